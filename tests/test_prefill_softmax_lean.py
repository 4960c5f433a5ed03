"""NumPy float32 emulation of the prefill consumers' online softmax: the eager path (the v2
``mma`` kernel, and the wgmma kernel until session 7) and the lazy path (the wgmma kernel since
session 8; developed as ``-DKVLAB_WGMMA_SOFTMAX_LEAN``) (no GPU needed).

``kernels_cu/prefill_common.cuh``: ``pf_softmax_update`` (eager) moves each row's reference max
to the exact running max on every tile and rescales the O accumulator and the row sum whenever
a row max of the warp moved; ``pf_softmax_update_lazy`` (wgmma) moves them only when some
row of the warp would see an exponent above ``PF_LAZY_TAU`` (8, log2 units), so P = exp2(s·cs −
m·cs) may reach 2^8. ``pf_p_operand`` (both) forms P, adds it to the row sum and rounds
P' = P·(per-token V scale) to the P·V operand type.

The emulation reproduces the per-element float32 operations of both paths on 64-token tiles of
one warp (16 query rows): S = Q̂·K (Q̂ rounded to fp16, exact integer K codes, fp32 result),
the per-token K scale (FMUL), the causal mask, the row max, the FFMA exponent, ex2.approx (fp32
exp2 with a random relative error of a few ulp), the fp32 row sums, P' rounded to bf16 (or fp16)
and the fp32 P'·V accumulation, the rescale, and the final O / l. Both are compared with float64
softmax attention over the dequantized values (what tests/gpu/test_prefill_gpu.py's reference
computes): the lazy path's error must be of the same order as the default path's, and both far
inside the GPU tests' tolerance (relative L2 5e-3 for bf16 outputs).
"""
from __future__ import annotations

import numpy as np
import pytest

ml_dtypes = pytest.importorskip("ml_dtypes")

TAU = 8.0
REPS = 6
KT = 64          # tokens per tile
NEG_BIG = np.float32(-1.0e30)


def _f32(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32)


def _ex2(x, rng):
    """ex2.approx.ftz.f32: exp2 with a relative error of up to ~2 ulp (emulated at random)."""
    y = np.exp2(np.asarray(x, dtype=np.float64))
    y = y * (1.0 + rng.uniform(-2.0, 2.0, size=np.shape(y)) * 2.0 ** -23)
    y = _f32(y)
    return np.where(y < np.float32(2.0 ** -126), np.float32(0), y)  # ftz


def _to_op(x, op):
    if op == "bf16":
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    return x.astype(np.float16).astype(np.float32)


def emulate(q, kc, ks, vc, vs, qpos, cs, lazy, rng, op="bf16"):
    """One warp's rows through every tile; returns (out [rows, d], number of rescales, max P)."""
    rows, d = q.shape
    L = kc.shape[0]
    qh = q.astype(np.float16).astype(np.float64)          # fp16 Q operand
    m = np.full(rows, NEG_BIG, np.float32)
    nm = np.zeros(rows, np.float32)
    l = np.zeros(rows, np.float32)
    o = np.zeros((rows, d), np.float32)
    moves, pmax = 0, 0.0
    for p0 in range(0, L, KT):
        sl = slice(p0, min(p0 + KT, L))
        s = _f32(qh @ kc[sl].T.astype(np.float64))          # wgmma, fp32 accumulate
        t = _f32(s * ks[sl][None, :])                       # per-token K scale (FMUL)
        kp = np.arange(sl.start, sl.stop)
        t = np.where(kp[None, :] <= qpos[:, None], t, np.float32(-np.inf))
        mx = t.max(axis=1)
        if lazy:
            with np.errstate(invalid="ignore"):
                need = _f32(_f32(mx - m) * cs) > TAU
            move = bool(need.any())                         # __any_sync over the warp
        else:
            move = True
        if move:
            mn = np.maximum(m, mx)
            with np.errstate(invalid="ignore"):
                al = _ex2(_f32(_f32(m - mn) * cs), rng)
            m = mn
            nm = np.where(mn == NEG_BIG, np.float32(0), _f32(-mn * cs))
            l = _f32(l * al)
            if lazy or np.any(al != 1.0):                  # default: the warp vote on al != 1
                o = _f32(o * al[:, None])
                moves += 1
        with np.errstate(invalid="ignore"):
            x = _f32(t.astype(np.float64) * cs[:, None] + nm[:, None])   # FFMA
        p = _ex2(x, rng)
        pmax = max(pmax, float(p.max()))
        l = _f32(l + _f32(p.astype(np.float64).sum(axis=1)))
        pv = _to_op(_f32(p * vs[sl][None, :]), op)          # P' = P·vs, rounded to the operand type
        o = _f32(o + _f32(pv.astype(np.float64) @ vc[sl].astype(np.float64)))
    return o / l[:, None], moves, pmax


def reference(q, kc, ks, vc, vs, qpos, cs):
    k = kc.astype(np.float64) * ks[:, None]
    v = vc.astype(np.float64) * vs[:, None]
    z = (q.astype(np.float64) @ k.T) * cs[:, None].astype(np.float64)   # log2 units
    kp = np.arange(k.shape[0])
    z = np.where(kp[None, :] <= qpos[:, None], z, -np.inf)
    w = np.exp2(z - z.max(axis=1, keepdims=True))
    return (w @ v) / w.sum(axis=1, keepdims=True)


def _case(rng, kind, L=700, rows=16, d=128):
    kc = rng.integers(-15, 16, size=(L, d)).astype(np.float32)
    vc = rng.integers(-15, 16, size=(L, d)).astype(np.float32)
    ks = _f32(rng.uniform(0.02, 0.2, size=L))
    vs = _f32(rng.uniform(0.02, 0.2, size=L))
    q = rng.standard_normal((rows, d)).astype(np.float32)
    if kind == "sink":            # one early token with a very large score
        kc[3] = np.sign(q.sum(axis=0)) * 15
        ks[3] = 0.5
    if kind == "drift":           # scores growing along the sequence: the max keeps moving
        ks = _f32(np.linspace(0.01, 0.6, L))
    if kind == "sharp":           # large logits (log2 range ~ 100s)
        q *= 8.0
    cs = np.full(rows, (1.0 / np.sqrt(d)) * np.log2(np.e), np.float32)
    qpos = L - rows + np.arange(rows)                      # causal: the last rows of the prompt
    if kind == "diag":            # rows at different positions, many masked columns
        qpos = np.sort(rng.integers(0, L, size=rows))
    return q, kc, ks, vc, vs, qpos, cs


@pytest.mark.parametrize("kind", ["random", "sink", "drift", "sharp", "diag"])
@pytest.mark.parametrize("op", ["bf16", "fp16"])
def test_lazy_softmax_error_matches_default(kind, op):
    rng = np.random.default_rng(123)
    errs = {}
    info = {}
    for lazy in (False, True):
        rels, mxs = [], []
        for rep in range(REPS):
            case = _case(np.random.default_rng(1000 * rep + sum(map(ord, kind))), kind)
            ref = reference(*case)
            out, moves, pmax = emulate(*case, lazy=lazy, rng=rng, op=op)
            assert np.all(np.isfinite(out))
            err = out.astype(np.float64) - ref
            rels.append(np.linalg.norm(err) / np.linalg.norm(ref))
            mxs.append(np.abs(err).max() / np.abs(ref).max())
            info[(lazy, rep)] = (moves, pmax)
        errs[lazy] = (max(rels), max(mxs), float(np.mean(rels)), float(np.mean(mxs)))
    (rel0, mx0, mrel0, mmx0), (rel1, mx1, mrel1, mmx1) = errs[False], errs[True]
    # inside the GPU tolerance (relative L2 5e-3 for bf16 outputs, before the output rounding;
    # max |err| 2^-6·max|ref|): the bf16 rounding of P' dominates both paths
    assert rel0 < 4e-3 and rel1 < 4e-3, errs
    assert mx0 < 2.0 ** -7 and mx1 < 2.0 ** -7, errs
    # same order as the default path (means over REPS random cases: the rounding of P' differs
    # case by case, the lazy path changes magnitudes, not relative rounding)
    assert mrel1 <= 1.2 * mrel0 and mmx1 <= 1.3 * mmx0, errs
    for rep in range(REPS):
        moves0, pmax0 = info[(False, rep)]
        moves1, pmax1 = info[(True, rep)]
        assert pmax0 <= 1.0 + 1e-5
        assert pmax1 <= 2.0 ** TAU * (1 + 1e-5)
        assert moves1 <= moves0
        if kind in ("random", "sink", "diag"):
            assert moves1 <= 2, (kind, moves1)    # after the first tile(s), no rescale


def test_lazy_softmax_fully_masked_rows_and_exactness():
    """A row that is masked on its first tiles (m stays NEG_BIG, nm 0) and a warp whose max never
    moves by more than TAU: the lazy path rescales exactly once (the first tile) and matches."""
    rng = np.random.default_rng(7)
    q, kc, ks, vc, vs, qpos, cs = _case(np.random.default_rng(3), "random", L=300)
    qpos = qpos.copy()
    qpos[0] = 130                                          # row 0 sees tiles 0-2 only
    out1, moves1, _ = emulate(q, kc, ks, vc, vs, qpos, cs, lazy=True, rng=rng)
    out0, moves0, _ = emulate(q, kc, ks, vc, vs, qpos, cs, lazy=False, rng=rng)
    ref = reference(q, kc, ks, vc, vs, qpos, cs)
    assert moves1 == 1 and moves0 >= moves1
    rel1 = np.linalg.norm(out1 - ref) / np.linalg.norm(ref)
    rel0 = np.linalg.norm(out0 - ref) / np.linalg.norm(ref)
    assert rel1 < 4e-3 and rel1 <= 1.25 * rel0 + 1e-4, (rel0, rel1)


def test_kernel_source_has_the_lazy_threshold():
    """The emulated threshold is the kernel's."""
    from kvlab.cuda import loader

    text = (loader.kernels_dir() / "prefill_common.cuh").read_text()
    assert "#define PF_LAZY_TAU 8.0f" in text
    assert "pf_softmax_update_lazy" in (loader.kernels_dir() / "paged_prefill_wgmma.cu").read_text()


# ---------------------------------------------------------------- lean prologue / epilogue layout
# pf_stage_queries_quad / pf_epilogue_quad (prefill_common.cuh) run the int4 rotation with 4 lanes
# per row (rht_group<D/4, 4>) where pf_stage_queries / pf_epilogue use 32 (rht_group<D/32, 32>).


def _wht_group_model(x_lanes, lanes):
    """hadamard.cuh wht_group<EPT, LANES> on all lanes at once: x_lanes[lane, j] (float64)."""
    x = np.array(x_lanes, dtype=np.float64)
    ept = x.shape[1]
    h = 1
    while h < ept:                                   # wht_register_stages
        for i in range(ept):
            if i & h == 0:
                a, b = x[:, i].copy(), x[:, i + h].copy()
                x[:, i], x[:, i + h] = a + b, a - b
        h <<= 1
    m = 1
    while m < lanes:                                 # shuffle stages: lane ^ m
        p = x[np.arange(lanes) ^ m]
        upper = (np.arange(lanes) & m) != 0
        x = np.where(upper[:, None], p - x, x + p)   # wht_chunked: fmaf(x, upper ? -1 : 1, p), the same
        m <<= 1
    return x


@pytest.mark.parametrize("d", [64, 128])
def test_quad_lane_rotation_is_the_same_transform(d):
    """rht_group<d/4, 4> (lane qc holds dims qc·d/4 + j) and rht_group<d/32, 32> (lane l holds dims
    4l + j … ) both compute H·(s ⊙ x) over the dim index (lane·EPT + j): the reference rht."""
    from kvlab.reference import rht, rht_signs

    rng = np.random.default_rng(d)
    x = rng.standard_normal(d)
    want = rht(x[None, :])[0]                        # H · (s ⊙ x), unnormalized, vLLM's signs
    s = rht_signs(d).astype(np.float64)
    for ept, lanes in ((d // 32, 32), (d // 4, 4)):
        xs = (s * x).reshape(lanes, ept)             # apply_rht_signs(first = lane·EPT)
        y = _wht_group_model(xs, lanes).reshape(d)
        np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
        # inverse_rht_group: wht, / d, signs
        back = s * (_wht_group_model(y.reshape(lanes, ept), lanes).reshape(d) / d)
        np.testing.assert_allclose(back, x, rtol=1e-12, atol=1e-12)


def _unit_dim(fmt, p):
    if fmt in ("int4", "nvfp4"):
        return (p >> 1) + 4 * (p & 1)
    if fmt == "int8":
        return 4 * ((p >> 2) & 1) + ((p >> 1) & 1) + 2 * (p & 1)
    return p


def _unit_pos(fmt, o):
    if fmt in ("int4", "nvfp4"):
        return 2 * (o & 3) + (o >> 2)
    if fmt == "int8":
        return (o & 4) | ((o & 1) << 1) | ((o >> 1) & 1)
    return o


def _core_off(d, row, dim):
    return (row >> 3) * (16 * d) + (dim >> 3) * 128 + (row & 7) * 16 + (dim & 7) * 2


@pytest.mark.parametrize("fmt", ["int4", "nvfp4", "int8", "fp8", "auto"])
@pytest.mark.parametrize("d", [64, 128])
def test_quad_lane_query_stores_match_the_default_layout(fmt, d):
    """Every (row, dim) of the 128 query rows lands at the same shared-memory byte in
    pf_stage_queries_quad (16-byte unit stores in unit_dim order, lane (rr, qc), passes b) as in
    pf_stage_queries (one 16-bit store per dim at unit_pos), and every row is staged once."""
    rows, nwarps, qd = 128, 8, d // 4
    default, quad = {}, {}
    for r in range(rows):
        for dim in range(d):
            default[_core_off(d, r, (dim & ~7) + _unit_pos(fmt, dim & 7))] = (r, dim)
    for warp in range(nwarps):
        for b in range(0, rows // nwarps, 8):
            for lane in range(32):
                rr, qc = lane >> 2, lane & 3
                r = warp + (b + rr) * nwarps
                for u in range(qd // 8):
                    base = _core_off(d, r, qc * qd + 8 * u)
                    assert base % 16 == 0
                    for p in range(8):
                        key = base + 2 * p
                        assert key not in quad
                        quad[key] = (r, qc * qd + 8 * u + _unit_dim(fmt, p))
    assert quad == default


def test_kernel_source_uses_the_quad_lane_functions():
    from kvlab.cuda import loader

    src = (loader.kernels_dir() / "prefill_common.cuh").read_text()
    # rht_group<QD, 4> / inverse_rht_group<QD, 4> written with wht_chunked<QD, 4, QD> (one chunk of
    # QD elements per lane: dim index qc·QD + j, as wht_group<QD, 4>; the shuffle stages as
    # fmaf(x, ±1, p), which rounds exactly as wht_group's x + p / p − x)
    assert src.count("wht_chunked<QD, 4, QD>(x, qc)") == 2
    assert src.count("apply_rht_signs<QD>(x, qc * QD)") == 2
    assert "x[j] *= 1.0f / static_cast<float>(D)" in src
    assert "q_sm + LAYOUT::idx(r, qc * QD + 8 * u)" in src
    assert "x[8 * u + unit_dim<FMT>(7)] * pre" in src


def test_perm_scale_order_call_sites():
    """The per-token scale order ("PERM") is one pair of functions since session 13: the producers'
    stores (PfTileLoader::store_params<PERM = true>, PfRowGroupLoader::store_tile) place token lt at
    pf_par_pos(lt), the consumers' 16-byte loads (pf_softmax_update_lazy: K; pf_p_operand_perm: V)
    start at pf_par_off(c, i). tests/test_prefill_wgmma_layout.py evaluates both orders of those
    functions (default and -DKVLAB_WGMMA_NO_SCALES_CF, the order this test pinned until session
    13): every consumer lane reads exactly its fragment's tokens, in the order it multiplies them.
    Here: every call site goes through the two functions, none computes a position of its own."""
    from kvlab.cuda import loader

    src = (loader.kernels_dir() / "prefill_common.cuh").read_text()
    assert "const int pos = PERM ? pf_par_pos(lt) : lt;" in src
    assert "const int pos = pf_par_pos(16 * w + 8 * g + r);" in src
    assert "par + pf_par_off(c, i)" in src and "par + KT + pf_par_off(c, kc)" in src
    assert "16 * c + 4 * i" not in src.replace("return 16 * c + 4 * i;", "")
