"""NumPy emulations of the write kernel's exact-rounding shortcuts (kernels_cu/reshape_and_cache.cu,
kernels_cu/quant_formats.cuh) against the reference codecs — the CPU half of their exactness
argument (the GPU tests compare the kernel itself: tests/gpu/test_write_rounding_gpu.py).

Each test re-implements one device sequence instruction by instruction (float32 roundings,
round-toward-zero / round-up where the kernel uses them, flush-to-zero as CuPy compiles, integer
bit manipulation) and checks it on every input class where it could go wrong.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from kvlab.reference.fp_codecs import e2m1_encode
from kvlab.reference.rounding import round_half_away

F32 = np.float32
M32 = 0xFFFFFFFF
BF16 = np.arange(0, 0x7F80, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
FP16 = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
E4M3_POS = np.arange(1, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def ftz(v):
    v = np.array(v, dtype=np.float32, copy=True)
    v[np.abs(v) < F32(2.0 ** -126)] = 0
    return v


def prmt(a, b, sel):
    """PTX prmt.b32 (default mode) on uint64 arrays holding 32-bit values."""
    by = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    r = np.zeros(np.broadcast(a, b).shape, np.uint64)
    for i in range(4):
        n = (sel >> (4 * i)) & 0xF
        v = np.asarray(by[n & 7], np.uint64)
        if n & 8:
            v = np.where(v & 0x80, 0xFF, 0).astype(np.uint64)
        r |= v << np.uint64(8 * i)
    return r


def test_int8_code_pair_matches_round_half_away(rng):
    """int8_code_pair: T = RZ(|v| + 6291712.5), packed 16-bit halves, sign fix (P ^ Q) + (Q & 2)."""
    ties = (np.arange(-127, 127) + F32(0.5)).astype(np.float32)
    special = np.float32([0.0, -0.0, 1e-30, -1e-30, 2.0 ** -130, -(2.0 ** -130)])
    v = np.concatenate([ties, np.nextafter(ties, F32(200)), np.nextafter(ties, F32(-200)),
                        np.arange(-127, 128).astype(np.float32), special,
                        rng.uniform(-127.49, 127.49, 1_000_000).astype(np.float32),
                        (rng.standard_normal(300_000) * 10.0 ** rng.uniform(-40, 0, 300_000)).astype(np.float32)])
    a = ftz(np.abs(v))
    f = np.floor(2 * a.astype(np.float64) + 1).astype(np.uint64)   # RZ onto the 0.5 grid
    h = (np.uint64(0x4AC00200) + f) & 0xFFFF                        # low half of bits(T)
    q = np.where(np.signbit(v), 0xFFFF, 0).astype(np.uint64)        # prmt sign replication
    s = (h ^ q) + (q & 2)
    assert np.all(s < 0x10000), "a carry would leave the 16-bit half"
    got = ((s >> 1) & 0xFF).astype(np.uint8)
    want = np.clip(round_half_away(v), -128, 127).astype(np.int8).view(np.uint8)
    np.testing.assert_array_equal(got, want)


def _e2m1_pack8(q, sat):
    """e2m1_pack8 without the signs: (S & 7 | S) + (S >> 22) shift-added, bias removed."""
    a = np.minimum(q, F32(6)) if sat else q
    eb = np.maximum(a, F32(1)).view(np.uint32) & np.uint32(0x7F800000)
    S = (a.astype(np.float64) + eb.view(np.float32).astype(np.float64) * 4194304.0)
    S = S.astype(np.float32).view(np.uint32).astype(np.uint64)     # one rounding: the FMA
    acc = np.full(q.shape[0], (-sum(298 << (4 * j) for j in range(8))) & M32, np.uint64)
    for j in range(8):
        s = S[:, j]
        acc = (acc + ((((s & 7) if j < 3 else s) + (s >> 22)) << np.uint64(4 * j))) & M32
    return acc


def test_e2m1_pack8_and_sign_gather(rng):
    t = np.float32([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6])
    for sat, hi in ((True, 9.0), (False, 6.999)):
        extra = [7.0, 100.0, np.inf] if sat else [np.nextafter(F32(7), F32(0))]
        q = np.concatenate([t, np.nextafter(t, F32(0)), np.nextafter(t, F32(1e9)), np.float32(extra),
                            rng.uniform(0, hi, 400_000).astype(np.float32)]).astype(np.float32)
        q = q[: (q.size // 8) * 8].reshape(-1, 8)
        neg = rng.integers(0, 2, q.shape).astype(bool)
        raw = np.where(neg, -1.0, 1.0).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint64)
        w = [raw[:, 2 * k] | (raw[:, 2 * k + 1] << np.uint64(16)) for k in range(4)]
        p01, p23 = prmt(w[0], w[1], 0xD9FB), prmt(w[2], w[3], 0xD9FB)
        sgn = (prmt(p01, p23, 0x5410) & 0xF0F0F0F0) | (prmt(p01, p23, 0x7632) & 0x0F0F0F0F)
        word = _e2m1_pack8(q, sat) | (sgn & 0x88888888)
        ref = e2m1_encode(np.where(neg, -q, q).astype(np.float32)).astype(np.uint64)
        want = sum(ref[:, j] << np.uint64(4 * j) for j in range(8)) & M32
        np.testing.assert_array_equal(word, want)


def test_nvfp4_division_e2m1_codes_exhaustive():
    """Global scale 1, every positive E4M3 divisor, every finite bf16/fp16 |x|:
    RU(|x|·RD(1/d)) (16-bit inputs) and FMA(|x|, r, RN(|x|·r_lo)) (float32 inputs) give the
    E2M1 code of the reference's RN(|x|/d); the latter is the correctly rounded quotient."""
    A0 = np.unique(np.concatenate([BF16, FP16]))
    A = ftz(A0)
    for d in E4M3_POS:
        with np.errstate(over="ignore"):
            ref_q = (A0 / d).astype(np.float32)
        ref = e2m1_encode(ref_q)
        r = F32(1) / d
        r_dn = r if float(r) <= 1.0 / float(d) else np.nextafter(r, F32(0))
        p = A.astype(np.float64) * float(r_dn)                      # exact
        with np.errstate(over="ignore"):
            q32 = p.astype(np.float32)
            q = ftz(np.where(q32.astype(np.float64) < p, np.nextafter(q32, F32(np.inf)), q32))
        np.testing.assert_array_equal(e2m1_encode(q), ref, err_msg=f"RU/RD, d={d}")
        e = 1.0 - float(d) * float(r)
        assert float(F32(e)) == e                                   # the FMA remainder is exact
        r_lo = F32(e * float(r))
        lo = ftz((A.astype(np.float64) * float(r_lo)).astype(np.float32))
        with np.errstate(over="ignore"):
            q2 = ftz((A.astype(np.float64) * float(r) + lo.astype(np.float64)).astype(np.float32))
        np.testing.assert_array_equal(e2m1_encode(q2), ref, err_msg=f"split reciprocal, d={d}")
        ok = (np.abs(ref_q) >= F32(2.0 ** -90)) & np.isfinite(ref_q)  # |x|·r_lo does not flush
        np.testing.assert_array_equal(q2[ok], ref_q[ok])


def test_markstein_division_by_15(rng):
    """int4_qparams: (mx - mn) / 15 as div_rn_by_recip with RN(1/15) = 0x3D888889."""
    r = F32(1) / F32(15)
    assert r.view(np.uint32) == 0x3D888889
    x = np.concatenate([rng.uniform(0, 1, 200_000), 10.0 ** rng.uniform(-30, 38, 200_000),
                        np.arange(1, 100_000)]).astype(np.float32)
    q0 = (x.astype(np.float64) * float(r)).astype(np.float32)
    rem = x.astype(np.float64) - 15.0 * q0.astype(np.float64)      # exact (FMA)
    q = (q0.astype(np.float64) + rem * float(r)).astype(np.float32)
    ref = (x / F32(15)).astype(np.float32)
    np.testing.assert_array_equal(q, ref)
