"""Every GPU kernel once, on small ragged shapes, for compute-sanitizer (scripts/sanitize.sh).

Shapes include partially filled last blocks, the largest head size (512 for the write path and
the Hadamard, 256 for attention), d = 128 with a three-tile prompt (the prefill kernels' ring),
GQA, sliding windows, decode + prefill. Memory pools are off
(PYTORCH_NO_CUDA_MEMORY_CACHING=1 set by the wrapper, CuPy's pool disabled here) so that every
tensor is its own allocation and an out-of-bounds access cannot hide inside a pool block.
"""
from __future__ import annotations

import os
import sys

import cupy
import numpy as np
import torch

import kvlab
from kvlab.cuda import hadamard, nibble
from kvlab.cuda.attention import plan_paged_attention

cupy.cuda.set_allocator(None)
cupy.cuda.set_pinned_memory_allocator(None)
rng = np.random.default_rng(7)
DEV = "cuda"
# the prefill kernels (kvlab.cuda.attention: "mma" everywhere, "wgmma" on compute capability 9.0)
PREFILL_VARIANTS = ("mma", "wgmma") if cupy.cuda.Device(0).compute_capability == "90" else ("mma",)


def t(a, dtype=None):
    x = torch.from_numpy(np.ascontiguousarray(a)).to(DEV)
    return x.to(dtype) if dtype is not None else x


def step(msg):
    print(f"[sanitize] {msg}", flush=True)


def main() -> int:
    step("nibble")
    codes = cupy.asarray(rng.integers(0, 16, (37, 66), dtype=np.uint8))
    nibble.unpack_nibbles(nibble.pack_nibbles(codes))
    step("hadamard")
    for d in (16, 64, 128, 512):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            x = t(rng.standard_normal((13, 3, d)), dt)
            hadamard.wht(x)
            hadamard.rht(hadamard.rht(x), inverse=True)
    for name in kvlab.FORMAT_NAMES:
        fmts = [kvlab.get_format(name)]
        if name == "nvfp4":
            fmts.append(kvlab.get_format("nvfp4", swizzle_v_scales=True))
        for fmt in fmts:
            for d, H, bs in ((64, 3, 16), (128, 2, 16), (256, 2, 32), (512, 1, 16)):
                step(f"write/read {fmt.name} swizzle={getattr(fmt, 'swizzle_v_scales', False)} d={d} H={H} bs={bs}")
                # last block partially filled; at d = 128 (the prefill kernels' main head size) a
                # prompt of three 64-token tiles, so the producer/consumer ring turns over
                T = (9 if d == 128 else 2) * bs + 5
                nb = T // bs + 2
                key = t(rng.standard_normal((T, H, d)), torch.bfloat16)
                val = t(rng.standard_normal((T, H, d)), torch.bfloat16)
                cache = kvlab.allocate_cache(fmt, nb, bs, H, d, like=key)
                slots = np.arange(T, dtype=np.int64)
                slots[3] = -1
                kvlab.reshape_and_cache(key, val, cache, t(slots), fmt)
                kvlab.reshape_and_cache(key[:7], val[:7], cache, t(slots[:7].astype(np.int32)), fmt)
                kvlab.dequantize_cache(cache, fmt)
                if d > 256:
                    continue
                step(f"attention {fmt.name} d={d}")
                seq_lens = np.array([T, 1, bs + 3], np.int32)
                qlens = np.array([T, 1, 4], np.int32)
                bt = np.zeros((3, nb), np.int32)
                bt[0, : -(-T // bs)] = np.arange(-(-T // bs))
                qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
                q = t(rng.standard_normal((int(qsl[-1]), H * 4, d)), torch.bfloat16)
                # both decode kernels, the paged one in both CTA forms (two per SM, dual ring)
                for variant, dual in (("per_head", "0"), ("paged", "0"), ("paged", "1")):
                    os.environ["KVLAB_DECODE_VARIANT"] = variant
                    os.environ["KVLAB_DECODE_PAGED_DUAL"] = dual
                    for pv in PREFILL_VARIANTS:                  # both prefill kernels (wgmma on sm_90)
                        os.environ["KVLAB_PREFILL_VARIANT"] = pv
                        for window in (None, 5):
                            kvlab.paged_attention(q, cache, t(bt), t(seq_lens), t(qsl), fmt, sliding_window=window)
                os.environ.pop("KVLAB_DECODE_VARIANT")
                os.environ.pop("KVLAB_DECODE_PAGED_DUAL")
                os.environ.pop("KVLAB_PREFILL_VARIANT")
                # decode batch with a long-ish context: the split-KV path and its reduction
                nb2 = 40
                cache2 = kvlab.allocate_cache(fmt, nb2, bs, H, d, like=key)
                L = nb2 * bs - 3
                kv = t(rng.standard_normal((L, H, d)), torch.bfloat16)
                kvlab.reshape_and_cache(kv, kv, cache2, t(np.arange(L, dtype=np.int64)), fmt)
                # G = 3 and G = 4 query heads per KV head: 3 or 4 of a column group's 8 columns have
                # a query row, so the merge's warps (or CTAs) of the others return before
                # griddepcontrol.wait; both merge forms (split: parts over 8 warps; one warp per
                # column: the form of large batches, forced here with KVLAB_DECODE_MERGE_SPLIT=0)
                index = (t(np.stack([np.arange(nb2)] * 2).astype(np.int32)), t(np.array([L, L - 100], np.int32)),
                         t(np.array([0, 1, 2], np.int32)))
                for G in (3, 4):
                    qd = t(rng.standard_normal((2, H * G, d)), torch.bfloat16)
                    for split in ("1", "0"):
                        os.environ["KVLAB_DECODE_MERGE_SPLIT"] = split
                        for variant, dual in (("per_head", "0"), ("paged", "0"), ("paged", "1")):
                            os.environ["KVLAB_DECODE_VARIANT"] = variant
                            os.environ["KVLAB_DECODE_PAGED_DUAL"] = dual
                            kvlab.paged_attention(qd, cache2, *index, fmt)
                        # the log shows which merge form ran (the plan of the last variant)
                        plan = plan_paged_attention(qd, cache2, *index, fmt)
                        step(f"  split-KV G={G}: {plan.n_red} merge items, "
                             f"{'split' if plan.red_split else 'warp-per-column'} form")
                os.environ.pop("KVLAB_DECODE_VARIANT")
                os.environ.pop("KVLAB_DECODE_PAGED_DUAL")
                os.environ.pop("KVLAB_DECODE_MERGE_SPLIT")
    torch.cuda.synchronize()
    step("ring probe (measurement tool)")
    from kvlab.cuda.ring_probe import THREADS, RingConfig, chunk_offsets, stream, tensor_rows
    for cfg in (RingConfig("t", chunk=1088, per_stage=3, nbuf=2, split=4, layout="paged"),
                RingConfig("w", mode="bulk_warp", chunk=1088, per_stage=2, nbuf=3, evict_first=True),
                RingConfig("l", mode="loads", chunk=1088, per_stage=3, layout="paged"),
                RingConfig("x", mode="tensor", layout="heads", chunk=16 * 272, per_stage=2, nbuf=2,
                           row_bytes=1056, col_step=264)):
        if cfg.mode != "loads" and cupy.cuda.Device(0).compute_capability < "90":
            continue
        offs = chunk_offsets(cfg, 4, 8)
        nbytes = tensor_rows(cfg, 4, 8) * cfg.row_bytes if cfg.mode == "tensor" else 4 * 8 * cfg.chunk
        stream(cfg, cupy.asarray(rng.integers(0, 256, nbytes, dtype=np.uint8)),
               cupy.asarray(offs), 4, 8, cupy.zeros(4 * THREADS, cupy.uint32))
    cupy.cuda.runtime.deviceSynchronize()
    step("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
