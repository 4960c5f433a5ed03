"""GPU reshape_and_cache (kernels_cu/reshape_and_cache.cu) vs the NumPy reference, every format.

Fresh random bf16/fp16 inputs (never zeros), ragged sequences with padding tokens
(slot -1), partially filled last blocks, head sizes 64/128/256, 1–8 KV heads, block
sizes 16/32, and a cache poisoned with random bytes first so that untouched rows are
checked too. bf16 through torch CUDA tensors, fp16 through CuPy and torch.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvlab
from kvlab.reference import cache as ref_cache
from kvlab.reference.nibble import unpack_nibbles

from tests.gpu.device_arrays import NP_DTYPES, off_boundary, to_dev, to_host

pytestmark = pytest.mark.gpu


FORMATS = ("auto", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "nvfp4")


def random_kv(rng, shape, dtype_name):
    """Never zeros: normal rows, random per-(token, head) scale, an outlier channel per head."""
    x = rng.standard_normal(shape) * rng.uniform(0.05, 8.0, size=shape[:-1] + (1,))
    cols = rng.integers(0, shape[-1], size=shape[1])
    for h, c in enumerate(cols):
        x[:, h, c] *= 15.0
    return x.astype(NP_DTYPES[dtype_name])


def ragged_slots(rng, num_blocks, block_size):
    """vLLM-like slot mapping: a few sequences of ragged length, each in its own random blocks
    (last block partially filled), with ~15% padding tokens set to -1. Returns (slots, n)."""
    blocks = rng.permutation(num_blocks)
    slots, b = [], 0
    while b < num_blocks - 1:
        nblk = int(rng.integers(1, 4))
        seq_blocks = blocks[b:b + nblk]
        b += nblk
        L = int(rng.integers(1, len(seq_blocks) * block_size + 1))
        pos = np.arange(L)
        slots.append(seq_blocks[pos // block_size] * block_size + pos % block_size)
    slots = np.concatenate(slots).astype(np.int64)
    pad = rng.random(slots.size) < 0.15
    slots[pad] = -1
    return slots


def poisoned_cache(rng, fmt, num_blocks, block_size, H, d, dtype_name):
    shape = fmt.cache_shape(num_blocks, block_size, H, d)
    if fmt.name == "auto":
        return (rng.standard_normal(shape) * 100).astype(NP_DTYPES[dtype_name])
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def written_mask(slots, num_blocks, block_size):
    m = np.zeros((num_blocks, block_size), dtype=bool)
    s = slots[slots >= 0]
    m[s // block_size, s % block_size] = True
    return m


def compare_int4(got, want, mask, d, dtype_name):
    """Bit-exact except rounding-tie differences of the rotation, which are counted and bounded.

    Why there are any: the kernel sums the RHT in float32, the reference in float64; both round
    to the input dtype, so they differ only where the float32 sum lands on the other side of a
    bf16/fp16 rounding tie (for float32 input: at the last bit, often). A rotated element one
    dtype-ulp away can move its code by one at a code boundary, and moves the scale word when it
    is the vector's min or max. SPEC 2.1's bar: >= 99% of bytes equal, no code off by more than 1.
    """
    g = got.transpose(0, 2, 1, 3, 4)   # (nb, bs, 2, H, R)
    w = want.transpose(0, 2, 1, 3, 4)
    assert np.array_equal(g[~mask], w[~mask]), "rows of skipped / unused slots were modified"
    gr, wr = g[mask], w[mask]          # (n, 2, H, R)
    cg = unpack_nibbles(np.ascontiguousarray(gr[..., : d // 2])).astype(np.int32)
    cw = unpack_nibbles(np.ascontiguousarray(wr[..., : d // 2])).astype(np.int32)
    diff = np.abs(cg - cw)
    assert diff.max(initial=0) <= 1, f"a code is off by {diff.max()}"
    frac_codes = np.mean(diff != 0)
    assert frac_codes <= 0.005, f"{frac_codes:.4%} of codes differ (bound 0.5%)"
    wg = np.ascontiguousarray(gr[..., d // 2:]).view("<u4")[..., 0]
    ww = np.ascontiguousarray(wr[..., d // 2:]).view("<u4")[..., 0]
    zg, zw = (wg & 0xF).astype(np.int32), (ww & 0xF).astype(np.int32)
    sg = (wg & 0xFFFFFFF0).view(np.float32).astype(np.float64)
    sw = (ww & 0xFFFFFFF0).view(np.float32).astype(np.float64)
    assert np.abs(zg - zw).max(initial=0) <= 1, "a zero point is off by more than 1"
    # One dtype ulp in the min and in the max moves (max - min) by at most 2 · 2^-m · max|y|
    # <= 2 · 2^-m · (max - min) (a rotated vector has both signs); the stored scale drops its
    # 4 low mantissa bits, which adds < 2^-19 relative (bound 2^-18 for the float32 roundings
    # of the subtraction and the division on top).
    m = {"bfloat16": 7, "float16": 10, "float32": 23}[dtype_name]
    rel = np.abs(sg - sw) / sw
    assert rel.max(initial=0) <= 2 * 2.0 ** -m + 2.0 ** -18, f"scale off by {rel.max():.3g} relative"
    if dtype_name != "float32":
        frac_words = np.mean(wg != ww)
        assert frac_words <= 0.01, f"{frac_words:.3%} of scale words differ (bound 1%)"
        frac_bytes = np.mean(gr != wr)
        assert frac_bytes <= 0.01, f"{frac_bytes:.3%} of written bytes differ (SPEC: >= 99% equal)"


def run_case(rng, fmt, d, dtype_name, kind, H=None, block_size=None, k_scale=1.0, v_scale=1.0,
             slot_dtype=np.int64, strided=False, misaligned=False):
    H = int(rng.integers(1, 9)) if H is None else H
    block_size = int(rng.choice([16, 32])) if block_size is None else block_size
    num_blocks = int(rng.integers(6, 12))
    slots = ragged_slots(rng, num_blocks, block_size).astype(slot_dtype)
    T = slots.size
    if strided:  # K and V as views of a fused (T, 3H, d) QKV tensor: token stride 3·H·d
        qkv = random_kv(rng, (T, 3 * H, d), dtype_name)
        key, value = qkv[:, H:2 * H], qkv[:, 2 * H:]
    else:
        key = random_kv(rng, (T, H, d), dtype_name)
        value = random_kv(rng, (T, H, d), dtype_name)
    cache0 = poisoned_cache(rng, fmt, num_blocks, block_size, H, d, dtype_name)
    want = cache0.copy()
    ref_cache.reshape_and_cache(np.ascontiguousarray(key), np.ascontiguousarray(value), want,
                                slots, fmt, k_scale, v_scale)
    if strided:
        qkv_d = to_dev(qkv, kind)
        kd, vd = qkv_d[:, H:2 * H], qkv_d[:, 2 * H:]
    elif misaligned:   # contiguous, 2 bytes past a 16-byte boundary
        kd, vd = off_boundary(to_dev(key, kind)), off_boundary(to_dev(value, kind))
    else:
        kd, vd = to_dev(key, kind), to_dev(value, kind)
    cd = to_dev(cache0, kind)
    kvlab.reshape_and_cache(kd, vd, cd, to_dev(slots, kind), kv_cache_dtype=fmt,
                            k_scale=k_scale, v_scale=v_scale)
    got = to_host(cd)
    mask = written_mask(slots.astype(np.int64), num_blocks, block_size)
    return got, want, mask, d


def case_list():
    out = []
    for f in FORMATS:
        for d in (64, 128, 256):
            out.append((f, d, "bfloat16", "torch"))
            out.append((f, d, "float16", "cupy" if d != 128 else "torch"))
    return out


@pytest.mark.parametrize("fmt_name,d,dtype_name,kind", case_list())
def test_matches_reference(rng, fmt_name, d, dtype_name, kind):
    fmt = kvlab.get_format(fmt_name)
    got, want, mask, d = run_case(rng, fmt, d, dtype_name, kind)
    if fmt_name == "int4_per_token_head":
        compare_int4(got, want, mask, d, dtype_name)
    else:
        # auto (a copy), int8, fp8 and nvfp4 round every step exactly as the reference does:
        # the whole cache, written rows and untouched poison alike, must be bit-identical.
        bad = np.argwhere(got.view(np.uint8) != want.view(np.uint8)) if got.dtype == np.uint8 else None
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (
            f"{fmt_name}: cache differs at {bad[:5] if bad is not None else '...'}")


@pytest.mark.parametrize("d", (16, 32, 512))
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_other_head_sizes(rng, fmt_name, d):
    fmt = kvlab.get_format(fmt_name)
    got, want, mask, d = run_case(rng, fmt, d, "bfloat16", "torch", H=int(rng.integers(1, 5)),
                                  block_size=16)
    if fmt_name == "int4_per_token_head":
        compare_int4(got, want, mask, d, "bfloat16")
    else:
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_float32_input(rng, fmt_name):
    fmt = kvlab.get_format(fmt_name)
    got, want, mask, d = run_case(rng, fmt, 128, "float32", "cupy")
    if fmt_name == "int4_per_token_head":
        compare_int4(got, want, mask, d, "float32")
    else:
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("swizzle", [False, True])
def test_nvfp4_global_scales_and_swizzle(rng, swizzle):
    fmt = kvlab.get_format("nvfp4", swizzle_v_scales=swizzle)
    # global scales other than 1 and different for K and V (0.05 makes large V values saturate
    # the E4M3 block scale at 448, which must match too)
    got, want, mask, _ = run_case(rng, fmt, 128, "bfloat16", "torch", k_scale=0.2, v_scale=0.05)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_int32_slots_and_strided_qkv(rng, fmt_name):
    fmt = kvlab.get_format(fmt_name)
    got, want, mask, d = run_case(rng, fmt, 128, "bfloat16", "torch", slot_dtype=np.int32,
                                  strided=True)
    if fmt_name == "int4_per_token_head":
        compare_int4(got, want, mask, d, "bfloat16")
    else:
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("kind, dtype_name", [("torch", "bfloat16"), ("cupy", "float16")])
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_contiguous_inputs_off_a_16_byte_boundary(rng, fmt_name, kind, dtype_name):
    """key / value contiguous but starting 2 bytes past a 16-byte boundary: the write reads rows
    with 16-byte loads, so they are copied to a fresh allocation first (until session 47 the
    copy was .contiguous() / ascontiguousarray, which return a contiguous view unchanged, and
    the kernel got the misaligned address)."""
    fmt = kvlab.get_format(fmt_name)
    got, want, mask, d = run_case(rng, fmt, 128, dtype_name, kind, misaligned=True)
    if fmt_name == "int4_per_token_head":
        compare_int4(got, want, mask, d, dtype_name)
    else:
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_all_slots_skipped_leaves_cache_untouched(rng):
    import cupy

    fmt = kvlab.get_format("int4_per_token_head")
    cache0 = poisoned_cache(rng, fmt, 4, 16, 2, 128, "float16")
    cd = cupy.asarray(cache0)
    key = cupy.asarray(random_kv(rng, (10, 2, 128), "float16"))
    kvlab.reshape_and_cache(key, key, cd, cupy.full((10,), -1, dtype=cupy.int64),
                            kv_cache_dtype="int4_per_token_head")
    assert np.array_equal(cupy.asnumpy(cd), cache0)


def test_errors_before_launch(rng):
    import cupy

    from kvlab.cuda import cache as gpu

    fmt = kvlab.get_format("int8_per_token_head")
    cd = cupy.zeros(fmt.cache_shape(2, 16, 2, 64), dtype=cupy.uint8)
    key = cupy.asarray(random_kv(rng, (4, 2, 64), "float16"))
    with pytest.raises(ValueError, match="slot_mapping"):
        gpu.reshape_and_cache(key, key, cd, cupy.asarray([0, 1, 2, 32], dtype=cupy.int64),
                              "int8_per_token_head")   # 32 = num_blocks · block_size: out of range
    with pytest.raises(TypeError, match="slot_mapping"):
        gpu.reshape_and_cache(key, key, cd, cupy.zeros((4,), dtype=cupy.float32), "int8_per_token_head")
    with pytest.raises(ValueError, match="key"):
        gpu.reshape_and_cache(key[:, :1], key[:, :1], cd, cupy.zeros((4,), dtype=cupy.int64),
                              "int8_per_token_head")   # 1 head vs the cache's 2
    with pytest.raises(TypeError):
        gpu.reshape_and_cache(np.zeros((4, 2, 64), np.float16), key, cd,
                              cupy.zeros((4,), dtype=cupy.int64), "int8_per_token_head")
    assert not cd.any(), "a failed validation must not have launched anything"
