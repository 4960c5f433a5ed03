"""One fuzz case per seed: random valid shapes and layouts, GPU kernels vs the NumPy reference.

Run as ``python -m tests.gpu.fuzz_case SEED [SEED ...]`` (tests/gpu/test_fuzz_gpu.py does, in a
subprocess, so that a crashing kernel cannot poison the CUDA context of the rest of the suite).
Prints one line per seed and exits 1 on the first mismatch, naming the seed and the case.
"""
from __future__ import annotations

import os
import sys

import numpy as np

import kvlab
from kvlab.arrays import NUMPY_BF16
from tests.helpers import random_block_table

#: int4: the GPU rotation's float32 sums may land on the other side of a bf16/fp16 rounding tie
#: (SPEC 2.1 "byte-compatible"): codes may differ by 1 on a small fraction; everything else exact.
INT4_MAX_BYTE_DIFF_FRACTION = 0.01
#: attention: bf16/fp16 output rounding (2^-9 / 2^-12 relative per element) plus float32
#: accumulation and, in prefill, bf16 probabilities fed to the tensor cores; an output uncorrelated
#: with the reference has relative L2 ≈ 1.4, so 1e-2 still fails loudly on any real bug.
ATTN_REL_L2 = {"bfloat16": 1e-2, "float16": 5e-3}


def draw_case(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    fmt = str(rng.choice(kvlab.FORMAT_NAMES))
    d = int(rng.choice([64, 128, 256]))
    case = dict(
        seed=seed, fmt=fmt, head_size=d, block_size=int(rng.choice([16, 32])),
        num_kv_heads=int(rng.choice([1, 2, 3, 4, 8])), gqa=int(rng.choice([1, 3, 4, 8])),
        dtype=str(rng.choice(["bfloat16", "float16"])),
        swizzle=bool(fmt == "nvfp4" and rng.random() < 0.3),
        window=None if rng.random() < 0.7 else int(rng.integers(1, 64)),
        magnitude=float(10 ** rng.uniform(-1, 1)),
    )
    n = int(rng.integers(1, 7))
    seq_lens = rng.integers(1, 300, n)
    qlens = np.where(rng.random(n) < 0.5, 1, [int(rng.integers(1, L + 1)) for L in seq_lens])
    case["seq_lens"] = [int(v) for v in seq_lens]
    case["query_lens"] = [int(v) for v in qlens]
    return case


#: KVLAB_FUZZ_CPU=1 runs the harness with NumPy arrays (the reference on both sides): a check of
#: the harness itself on machines without a GPU.
CPU_MODE = os.environ.get("KVLAB_FUZZ_CPU") == "1"


def dev(a: np.ndarray):
    """NumPy → torch CUDA tensor, or NumPy itself in CPU mode."""
    if CPU_MODE:
        return a.copy()
    from tests.gpu.device_arrays import to_dev

    return to_dev(a, "torch")


def host(t) -> np.ndarray:
    from tests.gpu.device_arrays import to_host

    return to_host(t)


def run_case(case: dict) -> str:
    rng = np.random.default_rng(case["seed"] + 1)
    fmt = kvlab.get_format(case["fmt"], swizzle_v_scales=True) if case["swizzle"] else kvlab.get_format(case["fmt"])
    d, bs, H, G = case["head_size"], case["block_size"], case["num_kv_heads"], case["gqa"]
    np_dt = NUMPY_BF16 if case["dtype"] == "bfloat16" else np.float16
    seq_lens = np.array(case["seq_lens"], np.int32)
    qlens = np.array(case["query_lens"], np.int32)
    num_blocks, block_table, slots = random_block_table(rng, seq_lens, bs, extra_blocks=2, fill=0)
    slot_mapping = np.concatenate(slots)
    T = len(slot_mapping)
    skip = rng.random(T) < 0.05            # a few skipped tokens: their slots keep the poison
    full_slots = slot_mapping.copy()
    slot_mapping[skip] = -1
    key = (rng.standard_normal((T, H, d)) * case["magnitude"]).astype(np_dt)
    value = (rng.standard_normal((T, H, d)) * case["magnitude"]).astype(np_dt)
    ks = vs = 1.0
    if fmt.name == "nvfp4" and rng.random() < 0.5:
        ks, vs = kvlab.calibrate_global_scale(key), kvlab.calibrate_global_scale(value)
    shape = fmt.cache_shape(num_blocks, bs, H, d)
    if fmt.stores_model_dtype:
        poison = (rng.standard_normal(shape) * 100).astype(np_dt)
    else:
        poison = rng.integers(0, 256, shape, dtype=np.uint8)
    ref_cache = poison.copy()
    kvlab.reshape_and_cache(key, value, ref_cache, slot_mapping, fmt, ks, vs)
    gpu_cache = dev(poison)
    kvlab.reshape_and_cache(dev(key), dev(value), gpu_cache, dev(slot_mapping), fmt, ks, vs)
    got = host(gpu_cache)
    # --- the write path (twice: with skipped tokens, then all tokens so attention reads no poison)
    for attempt in range(2):
        err = _compare_caches(fmt, got, ref_cache, slot_mapping, H, d)
        if err or attempt == 1:
            break
        kvlab.reshape_and_cache(key, value, ref_cache, full_slots, fmt, ks, vs)
        kvlab.reshape_and_cache(dev(key), dev(value), gpu_cache, dev(full_slots), fmt, ks, vs)
        got, slot_mapping = host(gpu_cache), full_slots
    if err:
        return err
    return _check_read_side(case, fmt, rng, gpu_cache, got, block_table, seq_lens, qlens, ks, vs, np_dt, H, G, d,
                            full_slots)


def _compare_caches(fmt, got, ref_cache, slot_mapping, H, d) -> str:
    if fmt.name == "int4_per_token_head":
        differ = np.count_nonzero(got != ref_cache) / max(1, np.count_nonzero(slot_mapping >= 0) * 2 * H * fmt.row_bytes(d))
        if differ > INT4_MAX_BYTE_DIFF_FRACTION:
            return f"write: {differ:.3%} of written int4 bytes differ"
        lo_g, lo_r = got[..., : d // 2] & 0xF, ref_cache[..., : d // 2] & 0xF
        hi_g, hi_r = got[..., : d // 2] >> 4, ref_cache[..., : d // 2] >> 4
        if max(np.abs(lo_g.astype(int) - lo_r).max(), np.abs(hi_g.astype(int) - hi_r).max()) > 1:
            return "write: an int4 code is off by more than 1"
    elif not np.array_equal(got.view(np.uint8), ref_cache.view(np.uint8)):
        return f"write: {np.count_nonzero(got.view(np.uint8) != ref_cache.view(np.uint8))} bytes differ"
    return ""


def _check_read_side(case, fmt, rng, gpu_cache, got, block_table, seq_lens, qlens, ks, vs, np_dt, H, G, d,
                     slots_all):
    # --- dequantize_cache on the GPU == the reference on the same bytes (exact)
    # compared on the written slots: elsewhere the cache holds poison bytes, whose garbage
    # scales may be float32 subnormals that the GPU flushes to zero (CuPy compiles with -ftz)
    gk, gv = kvlab.dequantize_cache(gpu_cache, fmt, ks, vs)
    rk, rv = kvlab.reference.dequantize_cache(got, fmt, ks, vs)
    bs = got.shape[2]
    blk, off = slots_all // bs, slots_all % bs
    for g, r, side in ((host(gk), rk, "K"), (host(gv), rv, "V")):
        if not np.array_equal(g[blk, off], r[blk, off], equal_nan=True):
            n = np.count_nonzero(~((g[blk, off] == r[blk, off]) | (np.isnan(g[blk, off]) & np.isnan(r[blk, off]))))
            return f"dequantize_cache: {side} differs from the reference on the same bytes ({n} values)"
    # --- attention over the GPU-written cache, against float64 over the same bytes
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    q = (rng.standard_normal((int(qsl[-1]), H * G, d))).astype(np_dt)
    out = kvlab.paged_attention(dev(q), gpu_cache, dev(block_table), dev(seq_lens), dev(qsl), fmt,
                                k_scale=ks, v_scale=vs, sliding_window=case["window"])
    out = host(out).astype(np.float64)
    ref = kvlab.reference.paged_attention(q, got, block_table, seq_lens, qsl, fmt, k_scale=ks, v_scale=vs,
                                          sliding_window=case["window"], out_dtype=np.float64)
    ok = np.isfinite(ref).all(axis=(1, 2))
    if not np.array_equal(np.isfinite(out).all(axis=(1, 2)), ok):
        return "attention: NaN pattern differs from the reference"
    num = np.linalg.norm(out[ok] - ref[ok])
    den = np.linalg.norm(ref[ok]) + 1e-30
    if num / den > ATTN_REL_L2[case["dtype"]]:
        return f"attention: relative L2 error {num / den:.2e} > {ATTN_REL_L2[case['dtype']]:.0e}"
    return ""


def main(argv) -> int:
    for s in argv:
        case = draw_case(int(s))
        print(f"seed {s}: {case}", flush=True)
        err = run_case(case)
        if err:
            print(f"FAIL seed {s}: {err}", flush=True)
            return 1
        print(f"ok seed {s}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
