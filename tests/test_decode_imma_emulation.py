"""NumPy emulation of the decode kernels' integer Q·K (int4 by default, int8 with ``-DKVLAB_DECODE_IMMA_INT8``; no GPU needed).

``kernels_cu/attention_common.cuh`` (ImmaQK, imma_dim, imma_query_regs) and
``kernels_cu/paged_attention.cu`` (stage_query_column's integer branch, qk_scores_imma,
token_scores) compute S = Q·K^T of int4/int8 caches with ``mma.m16n8k32`` on 16-bit
fixed-point queries split into two signed bytes. This test rebuilds every thread's registers
from the kernel's own ``imma_dim`` expressions (read from the source), multiplies them with
the PTX ISA's m16n8k32 .s8/.u8 fragment layout, and checks

* that the result is exactly Σ_d q̂_d·code_d for every (column, token) — the dim maps of A and B
  agree, the limbs rebuild q̂, and thread (g, c) ends with tokens pv_token(c, 0..3);
* that the score the kernel forms from it is within the fixed-point bound of the float64
  dot product of the query with the dequantized key.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from kvlab.cuda import loader

Q_FIX = 32639


def _imma_dim_exprs():
    text = (loader.kernels_dir() / "attention_common.cuh").read_text()
    body = re.search(r"int imma_dim\(int c, int s, int h, int i\) \{(.*?)\n\}", text, re.S).group(1)
    int4 = re.search(r"if constexpr \(FMT == INT4\) return (.*?);", body).group(1)
    int8 = re.search(r"else return (.*?);", body).group(1)
    q_fix = float(re.search(r"constexpr float Q_FIX = ([0-9.]+)f;", text).group(1))
    assert q_fix == Q_FIX
    return {"int4": int4, "int8": int8}


def _dim(expr, c, s, h, i):
    return eval(expr, {}, {"c": c, "s": s, "h": h, "i": i})


def _limbs(x):
    """stage_query_column's integer branch for one column: q̂, hi, lo, δ."""
    amax = np.float32(np.max(np.abs(x)))
    inv = np.float32(1) / amax
    qi = np.rint((x * inv).astype(np.float32) * np.float32(Q_FIX)).astype(np.int64)
    hi = (qi + 128) >> 8
    lo = qi - (hi << 8)
    assert hi.min() >= -128 and hi.max() <= 127 and lo.min() >= -128 and lo.max() <= 127
    return qi, hi, lo, float(amax) / Q_FIX


def _s8(v):
    v = int(v) & 0xFF
    return v - 256 if v >= 128 else v


def _mma_m16n8k32(a_regs, b_regs, b_signed):
    """D = A·B from per-thread registers (lists over lane of 4 / 2 words), PTX fragment layout."""
    A = np.zeros((16, 32), np.int64)
    B = np.zeros((32, 8), np.int64)
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        for r, (row, k0) in enumerate([(g, 4 * c), (g + 8, 4 * c), (g, 16 + 4 * c), (g + 8, 16 + 4 * c)]):
            for i in range(4):
                A[row, k0 + i] = _s8(a_regs[lane][r] >> (8 * i))
        for r, k0 in enumerate([4 * c, 16 + 4 * c]):
            for i in range(4):
                byte = (b_regs[lane][r] >> (8 * i)) & 0xFF
                B[k0 + i, g] = _s8(byte) if b_signed else byte
    D = A @ B
    out = {}
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        out[lane] = [D[g, 2 * c], D[g, 2 * c + 1], D[g + 8, 2 * c], D[g + 8, 2 * c + 1]]
    return out


def _k_token(g):
    return (g >> 1) | ((g & 1) << 2)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_integer_qk_matches_exact_sums(fmt, d):
    rng = np.random.default_rng(7 + d)
    expr = _imma_dim_exprs()[fmt]
    # every dim is covered exactly once by (c, s, h, i)
    dims = sorted(_dim(expr, c, s, h, i) for c in range(4) for s in range(d // 32) for h in range(2) for i in range(4))
    assert dims == list(range(d))
    q = (rng.standard_normal((8, d)) * rng.uniform(0.1, 30, (8, 1))).astype(np.float32)
    q[3, 5] *= 40.0                                   # an outlier column
    limbs = [_limbs(q[n]) for n in range(8)]
    qhat = np.stack([l[0] for l in limbs])
    # a 16-token tile of codes: int4 0..15 (8 nibbles per word, dim 8w + j at bits 4j), int8 signed
    if fmt == "int4":
        codes = rng.integers(0, 16, (16, d))
        words = np.zeros((16, d // 8), np.int64)
        for j in range(8):
            words |= codes[:, j::8] << (4 * j)
    else:
        codes = rng.integers(-128, 128, (16, d))
        words = np.zeros((16, d // 4), np.int64)
        for j in range(4):
            words |= (codes[:, j::4] & 0xFF) << (8 * j)
    # thread c's row words (RowWords): row words c + 4w
    kw = d // 32 if fmt == "int4" else d // 16
    I = {lane: [0, 0, 0, 0] for lane in range(32)}
    for s in range(d // 32):
        a_regs, b_lo, b_hi = {}, {}, {}
        for lane in range(32):
            g, c = lane >> 2, lane & 3
            regs = []
            for h in range(2):
                hi = lo = 0
                for i in range(4):
                    dim = _dim(expr, c, s, h, i)
                    hi |= (int(limbs[g][1][dim]) & 0xFF) << (8 * i)
                    lo |= (int(limbs[g][2][dim]) & 0xFF) << (8 * i)
                regs += [hi, lo]
            a_regs[lane] = [regs[0], regs[1], regs[2], regs[3]]   # qa[2s][0], qa[2s][1], qa[2s+1][0..1]
            own = [words[:, c + 4 * w] for w in range(kw)]        # this thread's words, every token
            for tile, tok in (("lo", _k_token(g)), ("hi", _k_token(g) + 8)):
                if fmt == "int4":
                    w = int(own[s][tok])
                    b = [w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F]
                else:
                    b = [int(own[2 * s][tok]), int(own[2 * s + 1][tok])]
                (b_lo if tile == "lo" else b_hi)[lane] = b
        ca = _mma_m16n8k32(a_regs, b_lo, fmt == "int8")
        cb = _mma_m16n8k32(a_regs, b_hi, fmt == "int8")
        for lane in range(32):   # 256·hi + lo, accumulated over the k-steps
            I[lane] = [I[lane][0] + ca[lane][0] * 256 + ca[lane][2], I[lane][1] + ca[lane][1] * 256 + ca[lane][3],
                       I[lane][2] + cb[lane][0] * 256 + cb[lane][2], I[lane][3] + cb[lane][1] * 256 + cb[lane][3]]
    exact = qhat @ codes.T                                 # (8 columns, 16 tokens)
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        for i in range(4):
            assert I[lane][i] == exact[g, c + 4 * i], (fmt, d, lane, i)
            assert abs(I[lane][i]) < 2 ** 31


def test_int4_score_within_fixed_point_bound():
    """float32(I − z·Σq̂)·(scale·δ) against the float64 q·((c − z)·scale): |err| ≤ δ/2·Σ|c − z|·scale + fp32."""
    rng = np.random.default_rng(3)
    d = 128
    for _ in range(50):
        x = rng.standard_normal(d).astype(np.float32) * np.float32(rng.uniform(1e-3, 1e3))
        qi, hi, lo, delta = _limbs(x)
        codes = rng.integers(0, 16, d)
        z = int(rng.integers(0, 16))
        scale = float(rng.uniform(1e-3, 1.0))
        I = int(qi @ codes)
        got = float(np.float32(I - z * int(qi.sum()))) * (scale * delta)
        ref = float(x.astype(np.float64) @ ((codes - z) * scale))
        bound = delta / 2 * np.abs(codes - z).sum() * scale + abs(ref) * 2 ** -22 + 1e-30
        assert abs(got - ref) <= bound, (got, ref, bound)
