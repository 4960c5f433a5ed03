"""Session 34's nvfp4 group-scale path of the decode kernels (``KVLAB_DECODE_SCALE_X2``, the default;
``tile_scales`` in kernels_cu/paged_attention.cu) emulated in NumPy, without a GPU, against the path it
replaces (``-DKVLAB_DECODE_NO_SCALE_X2``: one byte at a time, ``bits16<__half>(e4m3_to_float(b) * 128.f)``).

Two claims make the new path bit-identical to the old one:

1. the byte gather: for every head size (64, 128, 256) and every lane class ``c`` (0..3) the PRMT
   selectors (read from the kernel source) put into each scale register the same E4M3 bytes, in the
   same halves, that the old path picks (byte ``c·NGK + i`` of a K row; the low bytes of the V
   tokens' scale words);
2. the conversion: for all 256 E4M3 bytes, E4M3 -> fp16 (exact) times 128 in fp16 equals the
   float32 path, rounded to fp16, bit for bit (NaN stays NaN).

The GPU side of the same claim is tests/gpu/test_nvfp4_scale_x2_gpu.py (both builds, outputs compared
bit for bit). The last test shows that the comparison catches a wrong selector.
"""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from kvlab.cuda import loader
from tests.test_packed_decode_bits import prmt, rand_words

U32 = np.uint32


def _tile_scales_src() -> str:
    src = (loader.kernels_dir() / "paged_attention.cu").read_text()
    i = src.index("__device__ __forceinline__ void tile_scales(")
    body = src[i: src.index("\n}\n", i)]
    return body[body.index("#if defined(KVLAB_DECODE_SCALE_X2)"): body.index("#else")]


def selectors() -> dict:
    """The selector expressions of the new path, as Python functions of the lane class c."""
    body = _tile_scales_src()
    k = re.findall(r"const uint32_t sel = static_cast<uint32_t>\((.+?)\);", body)
    assert len(k) == 2, k                                  # NGK == 1 and NGK == 2
    v = re.findall(r"sfv\d\d\[i\] = e4m3x2_to_h2_x128\(prmt\(r\.sv\[(\d)\]\[i\], r\.sv\[(\d)\]\[i\], (0x[0-9A-Fa-f]+)u\)\);",
                   body)
    assert [(int(a), int(b)) for a, b, _ in v] == [(0, 1), (2, 3)], v
    for expr in k:
        assert re.fullmatch(r"[c0-9\s()|<*+]+", expr), expr   # only c, integers and | << * +
    return dict(k1=eval(f"lambda c: {k[0]}"), k2=eval(f"lambda c: {k[1]}"),
                v=[int(s, 0) for _, _, s in v])


def e4m3_h16_x128_new(b: np.ndarray) -> np.ndarray:
    """cvt e4m3 -> fp16 (exact), then the fp16 product by 128 (HMUL2, round to nearest)."""
    h = np.asarray(b, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16)
    return (h * np.float16(128)).view(np.uint16).astype(U32)


def e4m3_h16_x128_old(b: np.ndarray) -> np.ndarray:
    """float(e4m3) * 128.f in float32, rounded to fp16."""
    f = np.asarray(b, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(128)
    return f.astype(np.float16).view(np.uint16).astype(U32)


def ngk(d: int) -> int:
    """E4M3 group scales of one K row per thread (the kernel's TileRaw<NVFP4, D>::NGK)."""
    return d // 64 if d >= 128 else 1


def pair_new(word: np.ndarray) -> tuple:
    """e4m3x2_to_h2_x128: the two bytes of the low 16 bits -> (low half, high half) bits."""
    return e4m3_h16_x128_new(word & U32(0xFF)), e4m3_h16_x128_new((word >> U32(8)) & U32(0xFF))


def k_scales_new(words: list, c: int, d: int, sel: dict) -> list:
    """The NGK (sf·2^7 as fp16 bits) a thread of lane class c uses for one K row (words: its SW scale
    words), as the new tile_scales computes them (each broadcast half is the value itself)."""
    if ngk(d) == 1:
        lo, hi = pair_new(prmt(words[0], words[0], sel["k1"](c)))
        np.testing.assert_array_equal(lo, hi)               # (sf, sf): both halves the same byte
        return [lo]
    if ngk(d) == 2:
        lo, hi = pair_new(prmt(words[0], words[1], sel["k2"](c)))
        return [lo, hi]
    w = words[c]                                           # d = 256: pick_word(r.skg, c)
    return [*pair_new(w), *pair_new(w >> U32(16))]


def k_scales_old(words: list, c: int, d: int) -> list:
    out = []
    for i in range(ngk(d)):
        gi = c * ngk(d) + i
        out.append(e4m3_h16_x128_old((words[gi >> 2] >> U32(8 * (gi & 3))) & U32(0xFF)))
    return out


def test_e4m3_times_128_in_fp16_equals_the_float32_path_for_every_byte():
    b = np.arange(256)
    new, old = e4m3_h16_x128_new(b), e4m3_h16_x128_old(b)
    nan = np.isnan(np.asarray(b, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert nan.sum() == 2                                  # 0x7F and 0xFF
    np.testing.assert_array_equal(new[~nan], old[~nan])
    assert np.isnan(new[nan].astype(np.uint16).view(np.float16)).all()
    # exact: the fp16 value is the E4M3 value times 128 (max 448·128 = 57344 < 65504)
    v = np.asarray(b, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)[~nan] * 128
    np.testing.assert_array_equal(new[~nan].astype(np.uint16).view(np.float16).astype(np.float64), v)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("c", [0, 1, 2, 3])
def test_k_gather_picks_the_old_paths_bytes(d, c):
    sel = selectors()
    words = [rand_words(4096, 10 * d + c + j) for j in range(d // 64)]   # the SW scale words of a row
    new, old = k_scales_new(words, c, d, sel), k_scales_old(words, c, d)
    assert len(new) == len(old) == ngk(d)
    for a, b in zip(new, old):
        ok = ~np.isnan(b.astype(np.uint16).view(np.float16))
        assert ok.mean() > 0.95
        np.testing.assert_array_equal(a[ok], b[ok])


def test_v_gather_pairs_the_tokens_low_bytes():
    sel = selectors()
    rng = np.random.default_rng(7)
    sv = [rng.integers(0, 256, 4096).astype(U32) for _ in range(4)]   # one byte per token (LDS.U8)
    for (t0, t1), s in zip([(0, 1), (2, 3)], sel["v"]):
        lo, hi = pair_new(prmt(sv[t0], sv[t1], s))
        for got, t in ((lo, t0), (hi, t1)):
            want = e4m3_h16_x128_old(sv[t])
            ok = ~np.isnan(want.astype(np.uint16).view(np.float16))
            np.testing.assert_array_equal(got[ok], want[ok])


def test_a_wrong_selector_is_caught():
    sel = selectors()
    words = [rand_words(4096, 3), rand_words(4096, 4)]
    bad = dict(sel, k2=lambda c: (2 * c + 1) | ((2 * c) << 4))   # the two groups swapped
    new, old = k_scales_new(words, 1, 128, bad), k_scales_old(words, 1, 128)
    assert any((a != b).any() for a, b in zip(new, old))
