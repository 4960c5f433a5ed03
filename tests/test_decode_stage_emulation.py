"""CPU checks of the new index and arithmetic tricks of ``-DKVLAB_DECODE_STAGE`` (the paged decode
kernel's int4 stage-level body, kernels_cu/paged_attention.cu: stage_qk_int4, stage_scores_int4,
stage_pair_int4, fill_full; docs/perf-notes.md "Session 9 candidate"). No GPU needed.

* fill_full's per-lane pointers plus loop-invariant steps address the same shared-memory words
  as the kernel's general ``fill`` (head_offsets, kof, pk0) for every lane, head count and chunk;
* ``128 + zp`` built as float bits (0x43000000 + (zp << 16)) is exact;
* one accumulator chain per n-tile gives the same integers as the parity-split chains, and
  ``256·hi + lo + kz·(−Σq̂)`` is Σ q̂·(code − kz) without int32 overflow;
* the column max taken before the multiplication by cs ≥ 0 equals the max of the products
  (float32 rounding is monotonic), so the running max stays in the domain of head_tile_math.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from kvlab.cuda import loader


def _src():
    return (loader.kernels_dir() / "paged_attention.cu").read_text()


def test_switch_code_is_there():
    s = _src()
    assert "#ifdef KVLAB_DECODE_STAGE" in s
    assert re.search(r"vzp\[i\] = __uint_as_float\(0x43000000u \+ \(\(wv & 0xFu\) << 16\)\);", s)
    assert "x[i] = __int2float_rn(I[i] + kz * nq) * __uint_as_float(wk & ~0xFu);" in s
    assert "e[i] = ex2_approx(fmaf(x[i], sc, nm));" in s   # stage_softmax (shared with STAGE_NVFP4)
    assert "stage_softmax<8, D>(x, cs, m, l, z, acc, c, e);" in s


# --- the layout of the paged kernel (int4, d = 128 or 64), mirrored from head_offsets / fill
def k_token(g):
    return (g >> 1) | ((g & 1) << 2)


def pv_token(c, i):
    return c + 4 * i


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("H", [1, 2, 3, 5, 8])
def test_fill_full_offsets_match_fill(d, H):
    ROW = d // 2 + 4          # int4 row bytes
    TT = 32                   # tokens per stage (ROW <= 80)
    HR = H * ROW
    side_sm = TT * H * ROW
    stage_sm = 2 * side_sm
    KW = (d // 2) // 4 // 4   # K words per lane (KB = d/2/4 bytes)
    VW = (d // 2) // 8 // 4   # V words per lane (VB = d/2/8 bytes)
    for nbuf in (2, 3):
        for b in range(nbuf):
            for j in range(2):
                for kvh in range(H):
                    for lane in range(32):
                        g, c = lane >> 2, lane & 3
                        kt = k_token(g)
                        # the general fill (head_offsets, interleaved words; kof; pk0; fill's base)
                        kg = (kt * H + kvh) * ROW + 4 * c
                        v = [side_sm + (pv_token(c, i) * H + kvh) * ROW + 4 * g for i in range(4)]
                        pk0 = (pv_token(c, 0) * H + kvh) * ROW + d // 2
                        base = b * stage_sm + j * 16 * HR
                        ref_ka = [base + kg + 16 * i for i in range(KW)]
                        ref_kb = [base + 8 * HR + kg + 16 * i for i in range(KW)]
                        ref_v = [[base + v[t] + 32 * k for k in range(VW)] for t in range(4)]
                        ref_kp = [base + pk0 + 4 * i * HR for i in range(4)]
                        ref_vp = [base + pk0 + side_sm + 4 * i * HR for i in range(4)]
                        # fill_full: lk / lv / lp + o (o = boff + j·hr16) + steps (hr = H·ROW)
                        hr = H * ROW
                        hr4, hr8, hr16, sside = 4 * hr, 8 * hr, 16 * hr, TT * hr
                        o = b * stage_sm + j * hr16
                        lk, lv, lp = kg, v[0], pk0
                        assert [lk + o + 16 * i for i in range(KW)] == ref_ka
                        assert [lk + o + hr8 + 16 * i for i in range(KW)] == ref_kb
                        rows = [0, hr4, hr8, hr8 + hr4]
                        assert [[lv + o + rows[t] + 32 * k for k in range(VW)] for t in range(4)] == ref_v
                        assert [lp + o + rows[i] for i in range(4)] == ref_kp
                        assert [lp + o + sside + rows[i] for i in range(4)] == ref_vp


def test_boff_walk():
    """boff follows b·stage_sm through the ring (the loop's `boff += stage_sm; reset at nbuf`)."""
    for nbuf in (2, 3, 4):
        stage_sm = 1234
        b, boff = 0, 0
        for _ in range(20):
            assert boff == b * stage_sm
            boff += stage_sm
            if b + 1 == nbuf:
                boff = 0
            b = 0 if b + 1 == nbuf else b + 1


def test_v_zero_point_bits_exact():
    for zp in range(16):
        bits = np.uint32(0x43000000 + (zp << 16))
        assert bits.view(np.float32) == np.float32(128 + zp)


def test_single_chain_and_zero_point_integers():
    rng = np.random.default_rng(9)
    Q_FIX = 32639
    for d in (64, 128):
        for _ in range(200):
            q = rng.integers(-Q_FIX, Q_FIX + 1, size=d)
            if rng.random() < 0.2:
                q[:] = rng.choice([-Q_FIX, Q_FIX], size=d)   # extremes
            codes = rng.integers(0, 16, size=d)
            if rng.random() < 0.2:
                codes[:] = 15
            kz = int(rng.integers(0, 16))
            hi = (q + 128) >> 8
            lo = q - (hi << 8)
            assert np.all(hi <= 127) and np.all(hi >= -128) and np.all(lo >= -128) and np.all(lo <= 127)
            steps = d // 32
            # parity chains (qk_scores_imma) vs one chain (stage_qk_int4), per k-step of 32 dims
            part_hi = [int(np.dot(hi[32 * s:32 * s + 32], codes[32 * s:32 * s + 32])) for s in range(steps)]
            part_lo = [int(np.dot(lo[32 * s:32 * s + 32], codes[32 * s:32 * s + 32])) for s in range(steps)]
            two = (sum(part_hi[0::2]) + sum(part_hi[1::2])) * 256 + (sum(part_lo[0::2]) + sum(part_lo[1::2]))
            one = sum(part_hi) * 256 + sum(part_lo)
            nq = -int(q.sum())
            total = one + kz * nq
            assert two == one
            assert total == int(np.dot(q, codes - kz))
            for v in (sum(part_hi), sum(part_lo), one, kz * nq, total):
                assert -2**31 <= v < 2**31


def test_max_before_scale_is_exact():
    rng = np.random.default_rng(10)
    for _ in range(2000):
        n = 8
        x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 6)).astype(np.float32)
        cs = np.float32(abs(rng.standard_normal()) * 10.0 ** rng.integers(-8, 2))
        if rng.random() < 0.05:
            cs = np.float32(0.0)
        assert np.float32(x.max() * cs) == np.max((x * cs).astype(np.float32))
