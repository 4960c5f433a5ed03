"""NumPy emulation of the int4 decode P·V with fp16 V operands (``-DKVLAB_DECODE_V_FP16``; no GPU needed).

``kernels_cu/attention_common.cuh`` (vf16_word / vf16_sel / vf16_shift / vf16_bias / vf16_off,
v_operand_int4_f16) and ``kernels_cu/paged_attention.cu`` (token_scores' V offset,
store_acc_columns_vf16, the epilogues' z_odd = z_even − 960·w, online_softmax_vf16) decode int4
V nibbles into fp16 with two offset classes (1024 + c at bits 0..3 of a half, 64 + c at bits
4..7) and run O^T += V^T·P'^T as m16n8k16 fp16 mma. This test

* rebuilds every thread's A registers from the kernel's own expressions (read from the source),
  decodes them as fp16, multiplies them with the PTX m16n8k16 fragment layout against P' of the
  kernel's token order, subtracts the zero-point terms the way the epilogue does, and checks the
  result against Σ_t P'_t·(code_t − zp_t) for every (column, dim) — so a wrong shift, bias,
  class, word, byte selector, offset or class-to-accumulator mapping fails;
* replays the running V-scale exponent of online_softmax_vf16 over tiles whose V scales span
  2^-30 … 2^30 and checks that P' stays below 2 (fp16-safe) and that o / l matches float64.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from kvlab.cuda import loader


def _src(name):
    return (loader.kernels_dir() / name).read_text()


def _body(text, fn):
    m = re.search(r"__device__ __forceinline__ \w+ " + fn + r"\(int l\) \{ return (.*?); \}", text)
    assert m, fn
    return re.sub(r"(0x[0-9a-fA-F]+|\d+(?:\.\d*)?)[uf]\b", r"\1", m.group(1))


def _exprs():
    common = _src("attention_common.cuh")
    ex = {fn: _body(common, fn) for fn in ("vf16_word", "vf16_sel", "vf16_shift", "vf16_bias", "vf16_off")}
    op = re.search(r"uint32_t v_operand_int4_f16\(.*?\n\}", common, re.S).group(0)
    assert "prmt(wa[vf16_word(l)], wb[vf16_word(l)], vf16_sel(l)) >> vf16_shift(l)" in op
    assert "(x & ((l & 1) ? mhi : mlo)) | vf16_bias(l)" in op
    pv = re.search(r"if constexpr \(FMT == INT4\) return (8 \* \(g \+ 8 \* \(l >> 3\)\) \+ \(l & 7\));", common)
    ex["pv_dim"] = pv.group(1)
    kern = _src("paged_attention.cu")
    masks = re.findall(r"pinned_u32<(0x[0-9A-Fa-f]+)u>\(\), mhi = pinned_u32<(0x[0-9A-Fa-f]+)u>\(\)", kern)
    assert masks and all(mm == masks[0] for mm in masks)
    ex["mlo"], ex["mhi"] = (int(v, 16) for v in masks[0])
    # V zero-point offset of token_scores in the VF16 build, and the odd-class correction
    ex["voff"] = float(re.search(r"vzp\[i\] = \(DecodeVF16<FMT>::value && PAR_LOADED \? ([0-9.]+)f : 128\.f\)", kern).group(1))
    corr = set(re.findall(r"z0 - ([0-9.]+)f \* w0, z1 - \1f \* w1", kern))
    assert len(corr) == 1
    ex["corr"] = float(corr.pop())
    st = re.search(r"void store_acc_columns_vf16\(.*?\n\}", kern, re.S).group(0)
    ex["store"] = re.findall(r"make_float2\(acc\[j\]\[(\d)\] - (z\w+), acc\[j\]\[(\d)\] - (z\w+)\)", st)
    assert len(ex["store"]) == 2
    return ex


def _ev(expr, l=0, g=0):
    return eval(expr, {}, {"l": l, "g": g})


def _prmt(a, b, sel):
    by = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(by[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def _operand(ex, wa, wb, l):
    """v_operand_int4_f16 of the two tokens' word lists wa, wb (thread-local), local dim l."""
    w = _ev(ex["vf16_word"], l)
    x = _prmt(wa[w], wb[w], _ev(ex["vf16_sel"], l)) >> _ev(ex["vf16_shift"], l)
    return (x & (ex["mhi"] if l & 1 else ex["mlo"])) | _ev(ex["vf16_bias"], l)


def _h2(reg):
    return np.array([reg & 0xFFFF, reg >> 16], np.uint16).view(np.float16).astype(np.float64)


def test_vf16_operand_values_are_offset_plus_code():
    """Each fp16 half of an operand is exactly vf16_off(l) + the nibble of dim pv_dim(g, l)."""
    ex = _exprs()
    rng = np.random.default_rng(1)
    for d in (64, 128, 256):
        vw = d // 64
        for _ in range(20):
            codes = rng.integers(0, 16, (2, d))
            words = [[sum(int(codes[t, 8 * w + j]) << (4 * j) for j in range(8)) for w in range(d // 8)] for t in (0, 1)]
            g = int(rng.integers(0, 8))
            own = [[words[t][g + 8 * w] for w in range(vw)] for t in (0, 1)]
            for l in range(d // 8):
                lo, hi = _h2(_operand(ex, own[0], own[1], l))
                dim = _ev(ex["pv_dim"], l, g)
                off = _ev(ex["vf16_off"], l)
                assert lo - off == codes[0, dim] and hi - off == codes[1, dim], (d, g, l)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_vf16_pv_mma_matches_exact_sums(d):
    ex = _exprs()
    assert ex["voff"] == _ev(ex["vf16_off"], 0) and ex["voff"] - ex["corr"] == _ev(ex["vf16_off"], 1)
    rng = np.random.default_rng(11 + d)
    codes = rng.integers(0, 16, (16, d))
    zp = rng.integers(0, 16, 16)
    words = np.zeros((16, d // 8), np.int64)
    for j in range(8):
        words |= codes[:, j::8] << (4 * j)
    # P' (8 columns x 16 tokens) as the kernel rounds it: fp16 in [0, 2), some tiny
    p = (rng.uniform(0, 2, (8, 16)) * 2.0 ** rng.integers(-20, 1, (8, 16))).astype(np.float16).astype(np.float64)
    vw = d // 64
    tok = lambda c, i: c + 4 * i                                  # noqa: E731  pv_token
    out = np.zeros((8, d))
    for j in range(d // 16):
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        slot_tok = {}
        for lane in range(32):
            g, c = lane >> 2, lane & 3
            own = [[int(words[tok(c, i), g + 8 * w]) for w in range(vw)] for i in range(4)]
            a = [_operand(ex, own[0], own[1], 2 * j), _operand(ex, own[0], own[1], 2 * j + 1),
                 _operand(ex, own[2], own[3], 2 * j), _operand(ex, own[2], own[3], 2 * j + 1)]
            for r, (row, k0) in enumerate([(g, 2 * c), (g + 8, 2 * c), (g, 2 * c + 8), (g + 8, 2 * c + 8)]):
                A[row, k0:k0 + 2] = _h2(a[r])
            # B = P'^T: b0 = tokens pv_token(c, 0..1), b1 = pv_token(c, 2..3) of column g
            B[2 * c, g], B[2 * c + 1, g] = p[g, tok(c, 0)], p[g, tok(c, 1)]
            B[2 * c + 8, g], B[2 * c + 9, g] = p[g, tok(c, 2)], p[g, tok(c, 3)]
            for i, k in enumerate((2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9)):
                assert slot_tok.setdefault(k, tok(c, i)) == tok(c, i)   # A and B agree on the token of a k-slot
        Dm = A @ B
        z_even = (p * (ex["voff"] + zp)[None, :]).sum(1)            # per column
        w = p.sum(1)
        zs = {"ze": z_even, "zo": z_even - ex["corr"] * w}
        for lane in range(32):
            g, c = lane >> 2, lane & 3
            dacc = [Dm[g, 2 * c], Dm[g, 2 * c + 1], Dm[g + 8, 2 * c], Dm[g + 8, 2 * c + 1]]
            dim = _ev(ex["pv_dim"], 2 * j, g)
            for col, (ia, za, ib, zb) in zip((2 * c, 2 * c + 1), ex["store"]):
                out[col, dim] = dacc[int(ia)] - zs[za[:2]][col]
                out[col, dim + 1] = dacc[int(ib)] - zs[zb[:2]][col]
    exact = p @ (codes - zp[:, None])
    np.testing.assert_allclose(out, exact, rtol=0, atol=1e-9 * np.abs(p).sum(1).max() * 2000)


def test_vf16_running_exponent_keeps_p_in_fp16_and_the_result():
    """online_softmax_vf16's reference m = ms + EV: P' = 2^(x − m)·s_v < 2, o / l unchanged."""
    rng = np.random.default_rng(5)
    ntile = 64
    x = rng.normal(0, 3, (ntile, 16))                            # log2 scores of one column
    x[rng.random((ntile, 16)) < 0.05] = -np.inf                   # masked tokens
    sv = 2.0 ** rng.uniform(-30, 30, (ntile, 16))                 # V scales over 60 octaves
    sv[3, 2] = 0.0
    v = rng.normal(0, 1, (ntile, 16)) * sv                        # V values of one dim
    ms, vt, m, l, o = -1e30, 0.0, -1e30, 0.0, 0.0
    pmax = 0.0
    for t in range(ntile):
        mx, vm = np.max(x[t]), np.max(sv[t])
        if mx > ms or vm >= vt:
            ms_n = max(ms, mx)
            p2 = 2.0 ** np.floor(np.log2(vm)) if vm > 0 else 0.0
            p2 = min(max(p2, 0.5 * vt, 2.0 ** -60), 2.0 ** 64)
            mn = ms_n + np.log2(p2)
            al = 2.0 ** (m - mn)
            ms, vt, m = ms_n, 2 * p2, mn
            l, o = l * al, o * al
        e = 2.0 ** (x[t] - m)
        pp = (e * sv[t]).astype(np.float16).astype(np.float64)    # P' as the mma sees it
        assert np.all(np.isfinite(pp)) and pp.max() < 2.0
        pmax = max(pmax, pp.max())
        l += e.sum()
        o += (pp * v[t] / np.where(sv[t] > 0, sv[t], 1.0)).sum()
    w = 2.0 ** (x - x[np.isfinite(x)].max())
    ref = (w * v).sum() / w.sum()
    assert pmax > 0.5
    assert abs(o / l - ref) <= 2e-3 * np.abs(v).max()
