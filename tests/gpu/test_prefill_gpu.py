"""Prefill kernel v2 (kernels_cu/paged_prefill.cu: 128 rows per CTA, 64-token tiles decoded once
into shared memory, mask-free tiles below the diagonal) against the float64 reference.

Aimed at what the v2 design can get wrong and the shared shape grid touches only lightly:
many tiles per CTA (double-buffer pipeline, the decode of tile i+1 interleaved with tile i),
several CTAs per sequence, the tile-level mask-free path next to diagonal tiles, sliding
windows whose edge falls on / next to a 64-token tile boundary, every GQA group the row
mapping supports (1: 128 tokens per CTA, 3: 126 rows, 4, 8: 16 tokens), chunked prefill
after a long cached prefix, fp16 queries, and head sizes 64/128 with blocks 16/32.
Tolerances and helpers: tests/gpu/test_paged_attention_gpu.py.

``test_prefill_emulation_matches_reference`` (no GPU) runs a NumPy emulation of the kernel's
arithmetic — the bit-level tile decode (zero points subtracted in fp16/bf16, exact), the dim
order inside 8-dim units, per-token K/V scales applied once per column, the nvfp4 global
scale folded into the softmax scale, 64-token tiles with the per-warp skip / mask-free rules,
the online softmax in log2 units with P' rounded to the P·V operand type — against
:func:`kvlab.reference.paged_attention`.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvlab import reference
from kvlab.arrays import NUMPY_BF16

from .test_paged_attention_gpu import (FORMATS, PREFILL_VARIANTS, build_case, check_close, run_gpu, run_ref,
                                       skip_unless_prefill_variant_runs)

CODES = {"auto": 0, "int8_per_token_head": 1, "fp8_per_token_head": 2, "int4_per_token_head": 3, "nvfp4": 4}


@pytest.fixture(params=PREFILL_VARIANTS, ids=lambda v: f"prefill_{v}", name="prefill_variant")
def _prefill_variant(request):
    """Prefill kernel variant (``"mma"``: paged_prefill.cu; ``"wgmma"``: paged_prefill_wgmma.cu,
    skipped on GPUs other than sm_90)."""
    skip_unless_prefill_variant_runs(request.param)
    return request.param


def _case(rng, fmt, hkv, g, d, bs, q_lens, kv_lens, q_dtype=NUMPY_BF16):
    return build_case(rng, fmt, hkv, g, d, bs, q_lens, kv_lens, q_dtype=q_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(2, 4, 128, 16), (1, 1, 128, 32), (3, 3, 64, 32), (1, 8, 64, 16)],
                         ids=lambda s: f"hkv{s[0]}-g{s[1]}-d{s[2]}-bs{s[3]}")
def test_long_prompt_and_chunk(rng, fmt, shape, prefill_variant):
    """A 700-token prompt (11 tiles, several CTAs) and a 150-token chunk after a 1,000-token prefix."""
    hkv, g, d, bs = shape
    q_lens = [700 + int(rng.integers(0, 40)), 150 + int(rng.integers(0, 20))]
    kv_lens = [q_lens[0], q_lens[1] + 1000 + int(rng.integers(0, 64))]
    case = _case(rng, fmt, hkv, g, d, bs, q_lens, kv_lens)
    out, plan = run_gpu(case, prefill_kernel=True, prefill_variant=prefill_variant)
    assert plan.n_pf > 0
    check_close(out, run_ref(case), "bfloat16", f"{fmt} {shape} {prefill_variant}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("window", [1, 63, 64, 65, 129, 300])
def test_window_edges(rng, fmt, window, prefill_variant):
    """Window edges on and next to tile boundaries (the mask-free test uses the window too)."""
    q_lens = [400 + int(rng.integers(0, 30)), 90]
    kv_lens = [q_lens[0], 90 + 640]
    case = _case(rng, fmt, 2, 4, 128, 16, q_lens, kv_lens)
    out, _ = run_gpu(case, prefill_kernel=True, sliding_window=window, prefill_variant=prefill_variant)
    check_close(out, run_ref(case, sliding_window=window), "bfloat16",
                f"{fmt} window={window} {prefill_variant}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_fp16_queries(rng, fmt, prefill_variant):
    q_lens = [333, 70]
    kv_lens = [333, 70 + 200]
    case = _case(rng, fmt, 2, 4, 128, 16, q_lens, kv_lens, q_dtype=np.float16)
    out, _ = run_gpu(case, prefill_kernel=True, prefill_variant=prefill_variant)
    check_close(out, run_ref(case), "float16", f"{fmt} fp16 {prefill_variant}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["auto", "int4_per_token_head", "nvfp4"])
def test_variants_agree_at_the_bench_shape(rng, fmt):
    """A 2,048-token causal prompt at the benchmark's heads (32 query / 8 KV heads, d = 128, block
    16): both prefill variants against the reference (many mask-free tiles, 64 CTAs per head)."""
    skip_unless_prefill_variant_runs("wgmma")
    T = 2048
    case = _case(rng, fmt, 8, 4, 128, 16, [T], [T])
    ref = run_ref(case)
    for pv in ("mma", "wgmma"):
        out, plan = run_gpu(case, prefill_kernel=True, prefill_variant=pv)
        assert plan.n_pf > 0 and plan.n_items == 0
        check_close(out, ref, "bfloat16", f"{fmt} T={T} {pv}")


def _int4_wgmma_prescaled():
    """Whether this process builds the wgmma prefill with int4's K and V scaled by the producer
    (KVLAB_WGMMA_KV_PRESCALE, the default since session 15; kernels_cu/prefill_common.cuh): not with
    -DKVLAB_WGMMA_NO_KV_PRESCALE, -DKVLAB_WGMMA_V_PRESCALE or -DKVLAB_WGMMA_NO_ROWGROUP in
    KVLAB_NVRTC_OPTIONS."""
    opts = os.environ.get("KVLAB_NVRTC_OPTIONS", "").split()
    return not any(o in opts for o in ("-DKVLAB_WGMMA_NO_KV_PRESCALE", "-DKVLAB_WGMMA_V_PRESCALE",
                                       "-DKVLAB_WGMMA_NO_ROWGROUP"))


@pytest.mark.gpu
def test_int4_keys_over_seven_decades(rng, prefill_variant):
    """int4 keys whose magnitudes span seven decades from token to token (multipliers 10^-4.2 …
    10^2.8, scales ~10^-4 … ~3.5·10^4): the wgmma kernel's prescaled K tile (fp16, times 2^-4) must
    keep the large ones finite and the small ones (fp16 subnormals after the factor) accurate. The
    queries are scaled down so that the large keys give logits of a few units: a softmax that
    neither ignores nor saturates on them. A scale above PF_K_PRESCALE_MAX_SCALE (65536) is NaN by
    design (test_int4_key_past_the_prescaled_range): the multipliers stay below it with a margin
    (scale / multiplier ≤ 56 over 3,600 drawn token-heads; session 19 found 10^3.5 reaching 70,178
    with some seeds), and the case asserts it before the run."""
    from kvlab.formats.int4_per_token_head import split_scale_word

    T = 300
    kmul = 10.0 ** rng.uniform(-4.2, 2.8, size=T)
    case = build_case(rng, "int4_per_token_head", 2, 4, 128, 16, [T], [T], key_mult=kmul, q_mult=1e-3)
    nb = -(-T // 16)
    rows = case["kv_cache"][case["block_table"][0, :nb], 0].reshape(nb * 16, 2, -1)[:T]
    k_scale, _ = split_scale_word(np.ascontiguousarray(rows[..., 64:68]).view(np.uint32)[..., 0])
    assert k_scale.max() < 65536 / 1.5, ("the case leaves the prescaled range", float(k_scale.max()))
    assert k_scale.max() / k_scale.min() > 1e6, "the keys must span the decades the test is about"
    out, plan = run_gpu(case, prefill_kernel=True, prefill_variant=prefill_variant)
    assert plan.n_pf > 0
    check_close(out, run_ref(case), "bfloat16", f"int4 key range {prefill_variant}")


@pytest.mark.gpu
def test_int4_key_past_the_prescaled_range(rng, prefill_variant):
    """One token's int4 key scale far above 2^16 (|k| ~ 10^6): the wgmma kernel's prescaled K tile cannot
    hold it (PF_K_PRESCALE_MAX_SCALE), so every row that sees that token must come out NaN — loud, not
    a silently dropped or clipped key — and every row before it exact as usual. The mma kernel and the
    -DKVLAB_WGMMA_NO_KV_PRESCALE build take such scales in float32 and must match the reference."""
    T, big = 200, 120
    kmul = np.ones(T)
    kmul[big] = 1e6
    case = build_case(rng, "int4_per_token_head", 2, 4, 128, 16, [T], [T], key_mult=kmul, q_mult=1e-6)
    out, plan = run_gpu(case, prefill_kernel=True, prefill_variant=prefill_variant)
    assert plan.n_pf > 0
    ref = run_ref(case)
    if prefill_variant == "wgmma" and _int4_wgmma_prescaled():
        assert np.isnan(out[big:]).all(), "rows that see the out-of-range key must be NaN"
        check_close(out[:big], ref[:big], "bfloat16", "int4 rows before the out-of-range key")
    else:
        check_close(out, ref, "bfloat16", f"int4 out-of-range key {prefill_variant}")


# ---------------------------------------------------------------- NumPy emulation (no GPU)
def _unit_dim(F, p):
    if F in (3, 4):
        return (p >> 1) + 4 * (p & 1)
    if F == 1:
        return 4 * ((p >> 2) & 1) + ((p >> 1) & 1) + 2 * (p & 1)
    return p


def _unit_pos(F, o):
    if F in (3, 4):
        return 2 * (o & 3) + (o >> 2)
    if F == 1:
        return (o & 4) | ((o & 1) << 1) | ((o >> 1) & 1)
    return o


def _decode_row(F, side, raw, prm, sfb, D, e4m3_decode, bf16):
    """One cache row -> the kernel's stored 16-bit values (float32, stored order), its scale."""
    h16 = lambda b: np.asarray(b, np.uint16).view(np.float16)  # noqa: E731
    b16 = lambda b: np.asarray(b, np.uint16).view(bf16)  # noqa: E731
    out = np.zeros(D, np.float32)
    for u in range(D // 8):
        for p in range(8):
            dd = 8 * u + _unit_dim(F, p)
            if F == 3:
                c = (int(raw[dd // 2]) >> (4 * (dd & 1))) & 0xF
                zp = prm & 0xF
                if side == 0:
                    v = h16(0x6400 | c) - h16(0x6400 | zp)
                else:
                    v = (b16(0x4300 | c).astype(np.float32) - b16(0x4300 | zp).astype(np.float32)).astype(bf16)
            elif F == 4:
                n = (int(raw[dd // 2]) >> (4 * (dd & 1))) & 0xF
                sf = np.float16(float(e4m3_decode(np.array([sfb[dd // 16]], np.uint8))[0]) * 128.0)
                v = h16(((n & 7) << 9) | ((n & 8) << 12)) * sf
            elif F == 1:
                b = int(raw[dd])
                v = h16(0x6400 | (b ^ 0x80)) - np.float16(1152.0)
                if side == 1:
                    v = np.float32(v).astype(bf16)
            elif F == 2:
                b = int(raw[dd])
                v = (np.float16(e4m3_decode(np.array([b], np.uint8))[0]) if side == 0
                     else b16(((b & 0x7F) << 4) | ((b & 0x80) << 8)))
            else:
                v = raw[dd]
            out[8 * u + p] = np.float32(v)
    sc = np.float32(1)
    if F == 3:
        sc = np.uint32(prm & ~0xF).view(np.float32)
    elif F in (1, 2):
        sc = np.uint32(prm).view(np.float32)
    if F == 2 and side == 1:
        sc = np.float32(sc * np.float32(2.0 ** 64))
    return out, np.float32(sc)


def emulate_prefill(case, window=0, KT=64, ROWS=128, kv_prescale=False):
    """NumPy emulation of paged_attention_prefill (every sequence on the prefill kernel).

    ``kv_prescale`` (int4): the wgmma kernel's KVLAB_WGMMA_KV_PRESCALE tiles instead (the default
    there since session 15; kernels_cu/prefill_common.cuh): K = fp16(c − zp)·fp16(s_k·2^-4) rounded to
    fp16, V = bf16(c − zp)·bf16(s_v) rounded to bf16, no per-token scale left for the softmax, the
    factor 2^4 in the rows' softmax scale."""
    import ml_dtypes

    from kvlab import get_format
    from kvlab.reference.fp_codecs import e4m3_decode
    from kvlab.reference.hadamard import inverse_rht, rht

    bf16 = ml_dtypes.bfloat16
    neg_big = np.float32(-1.0e30)
    fmt = case["kv_cache_dtype"].name
    F = CODES[fmt]
    q, cache, bt = case["q"], case["kv_cache"], case["block_table"]
    sl, qsl = case["seq_lens"], case["query_start_loc"]
    T, Hq, D = q.shape
    nb, BS, Hkv = cache.shape[0], cache.shape[2], cache.shape[3]
    G = Hq // Hkv
    flat = np.ascontiguousarray(cache).view(np.uint8).reshape(nb, -1)
    ROW = {0: 2 * D, 1: D + 4, 2: D + 4, 3: D // 2 + 4, 4: D // 2 + D // 16}[F]
    side_stride = BS * Hkv * ROW
    RB = D // 2 if F == 4 else ROW
    swz = int(bool(getattr(get_format(fmt), "swizzle_v_scales", False)))
    scale_log2 = np.float32(1 / np.sqrt(D) * np.log2(np.e) / (D if F == 3 else 1))
    ctq = np.float16 if F else (bf16 if q.dtype == NUMPY_BF16 else np.float16)
    ctv = {0: ctq, 4: np.float16}.get(F, bf16)
    memo = {}

    def row(seq, p, kvh, side):
        key = (seq, p, kvh, side)
        if key not in memo:
            fl = flat[bt[seq][p // BS]]
            tt = p % BS
            off = side * side_stride + (tt * Hkv + kvh) * RB
            prm, sfb = 0, None
            if F == 0:
                raw = np.ascontiguousarray(fl[off: off + 2 * D]).view(np.uint16)
                raw = (raw.view(bf16) if q.dtype == NUMPY_BF16 else raw.view(np.float16)).astype(np.float32)
            else:
                raw = fl[off: off + ROW]
                if F in (1, 2, 3):
                    po = off + (D // 2 if F == 3 else D)
                    prm = int(np.ascontiguousarray(fl[po: po + 4]).view(np.uint32)[0])
                if F == 4:
                    S, dp = D // 16, BS * Hkv * (D // 2)
                    sfb = []
                    for grp in range(S):
                        t2, gg = tt, grp
                        if side == 1 and swz:
                            t2, gg = (tt // 4) * 4 + grp // (S // 4), (grp % (S // 4)) * 4 + tt % 4
                        sfb.append(int(fl[side * side_stride + dp + (t2 * Hkv + kvh) * S + gg]))
            vals, sc = _decode_row(F, side, raw, prm, sfb, D, e4m3_decode, bf16)
            if F == 3 and kv_prescale:
                if side == 0:
                    skp = np.float16(sc * np.float32(2.0 ** -4)) if sc <= 65536.0 else np.float16(np.nan)
                    vals = (vals.astype(np.float16) * skp).astype(np.float32)
                else:
                    vals = (vals.astype(bf16) * bf16(sc)).astype(bf16).astype(np.float32)
                sc = np.float32(1)
            memo[key] = (vals, sc)
        return memo[key]

    out = np.zeros((T, Hq, D), np.float64)
    kfold = np.float32(128.0 * case["k_scale"]) if F == 4 else np.float32(16 if F == 3 and kv_prescale else 1)
    vfac = np.float32(128.0 * case["v_scale"]) if F == 4 else (np.float32(2.0 ** 56) if F == 2 else np.float32(1))
    for seq in range(len(sl)):
        qs, Lq, L = int(qsl[seq]), int(qsl[seq + 1] - qsl[seq]), int(sl[seq])
        tpc = ROWS // G
        for tok0 in range(0, Lq, tpc):
            for kvh in range(Hkv):
                nrow, pbase = min(tpc, Lq - tok0) * G, L - Lq + tok0
                qst = np.zeros((ROWS, D), np.float32)
                cs = np.zeros(ROWS, np.float32)
                qp = np.full(ROWS, -1)
                for r in range(ROWS):
                    x = np.zeros(D)
                    if r < nrow:
                        x = q[qs + tok0 + r // G, kvh * G + r % G].astype(np.float64)
                        qp[r] = pbase + r // G
                    if F == 3:
                        x = rht(x)
                    x = x.astype(np.float32)
                    pre = np.float32(1)
                    amax = np.abs(x).max()
                    if F != 0 and amax > 0:
                        ex = int((np.float32(amax).view(np.uint32) >> 23) & 0xFF) - 127
                        if ex > 14:
                            pre = np.float32(2.0 ** (-(ex - 14)))
                    for dd in range(D):
                        qst[r, (dd & ~7) + _unit_pos(F, dd & 7)] = np.float32(ctq(x[dd] * pre))
                    cs[r] = np.float32(np.float32(scale_log2 * kfold) / pre)
                hi = pbase + (nrow - 1) // G + 1
                lo = (max(0, pbase - window + 1) if window > 0 else 0) & ~(KT - 1)
                ntiles = (hi - lo + KT - 1) // KT if hi > lo else 0
                acc = np.zeros((ROWS, D), np.float32)
                m = np.full(ROWS, neg_big, np.float32)
                lsum = np.zeros(ROWS, np.float32)
                for it in range(ntiles):
                    p0 = lo + it * KT
                    Kt, Vt = np.zeros((KT, D), np.float32), np.zeros((KT, D), np.float32)
                    ksc, vsc = np.zeros(KT, np.float32), np.zeros(KT, np.float32)
                    for t in range(KT):
                        if p0 + t < L:
                            Kt[t], ksc[t] = row(seq, p0 + t, kvh, 0)
                            Vt[t], vsc[t] = row(seq, p0 + t, kvh, 1)
                    for w in range(ROWS // 16):
                        wr = 16 * w
                        if wr >= nrow:
                            continue
                        wmin, wmax = pbase + wr // G, pbase + min(wr + 15, nrow - 1) // G
                        if wmax < p0 or (window > 0 and p0 + KT - 1 <= wmin - window):
                            continue
                        full = (p0 + KT - 1 <= wmin) and (window <= 0 or p0 > wmax - window)
                        rs = slice(wr, wr + 16)
                        s = (qst[rs].astype(np.float64) @ Kt.T.astype(np.float64)).astype(np.float32)
                        if F in (1, 2, 3):
                            s = (s * ksc[None, :]).astype(np.float32)
                        if not full:
                            kp, qq = p0 + np.arange(KT)[None, :], qp[rs][:, None]
                            ok = (kp <= qq) & ((window <= 0) | (kp > qq - window))
                            s = np.where(ok, s, np.float32(-np.inf))
                        mn = np.maximum(m[rs], s.max(1))
                        al = np.exp2(((m[rs] - mn) * cs[rs]).astype(np.float32))
                        m[rs] = mn
                        nm = np.where(mn == neg_big, np.float32(0), (-mn * cs[rs]).astype(np.float32))
                        lsum[rs] *= al
                        acc[rs] *= al[:, None]
                        e = np.exp2((s.astype(np.float64) * cs[rs][:, None] + nm[:, None]).astype(np.float32))
                        lsum[rs] += e.sum(1, dtype=np.float32)
                        if F in (1, 2, 3):
                            e = (e * vsc[None, :]).astype(np.float32)
                        pp = e.astype(ctv).astype(np.float64)
                        acc[rs] += (pp @ Vt.astype(np.float64)).astype(np.float32)
                inv = np.where(lsum > 0, vfac / np.where(lsum > 0, lsum, 1), 0).astype(np.float32)
                o = acc * inv[:, None]
                ou = np.zeros_like(o)
                for p in range(D):
                    ou[:, (p & ~7) + _unit_dim(F, p & 7)] = o[:, p]
                for r in range(nrow):
                    x = ou[r].astype(np.float64)
                    out[qs + tok0 + r // G, kvh * G + r % G] = inverse_rht(x) if F == 3 else x
    return out


@pytest.mark.parametrize("fmt", FORMATS + ("int4_per_token_head+kv_prescale",))
def test_prefill_emulation_matches_reference(fmt):
    """The kernel's algebra (NumPy emulation, no GPU) against the float64 reference; for int4 also the
    wgmma kernel's prescaled tiles (``+kv_prescale``)."""
    fmt, _, extra = fmt.partition("+")
    pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(5)
    for (hkv, g, d, bs), win in (((1, 4, 128, 16), 0), ((1, 3, 64, 32), 50)):
        case = _case(rng, fmt, hkv, g, d, bs, [150, 45], [150, 45 + 200])
        ref = reference.paged_attention(case["q"], case["kv_cache"], case["block_table"], case["seq_lens"],
                                        case["query_start_loc"], case["kv_cache_dtype"], None, case["k_scale"],
                                        case["v_scale"], win or None, out_dtype=np.float64)
        emu = emulate_prefill(case, win, kv_prescale=extra == "kv_prescale")
        emu = emu.astype(np.float32).astype(NUMPY_BF16).astype(np.float64)
        check_close(emu, ref, "bfloat16", f"emulation {fmt} d={d} window={win}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["auto", "int4_per_token_head", "nvfp4"])
def test_queries_and_output_off_16_byte_boundaries(rng, fmt, prefill_variant):
    """q and out as views 2 bytes past a 16-byte boundary (element 1 of a larger buffer): kernels
    that move whole 16-byte chunks of q rows or output rows where the base allows it
    (the wgmma kernel's 4-lane prologue/epilogue since session 8) must take their element-wise path."""
    import torch

    from kvlab.cuda.attention import plan_paged_attention

    from .test_paged_attention_gpu import to_host, unaligned_run_args

    case = _case(rng, fmt, 2, 4, 128, 16, [300, 70], [300, 70 + 130])
    args, out, obuf = unaligned_run_args(case)
    n = out.numel()
    plan = plan_paged_attention(*args, case["kv_cache_dtype"], None, case["k_scale"], case["v_scale"],
                                prefill_kernel=True, prefill_variant=prefill_variant)
    assert plan.n_pf > 0
    plan.run(*args, out=out)
    assert torch.isnan(obuf[0]) and torch.isnan(obuf[1 + n:]).all(), "wrote outside the output view"
    check_close(to_host(out).astype(np.float64), run_ref(case), "bfloat16", f"{fmt} unaligned {prefill_variant}")
