"""CPU checks of the index and arithmetic of ``-DKVLAB_DECODE_STAGE_NVFP4`` (the paged decode
kernel's stage-level body for nvfp4: kernels_cu/paged_attention.cu, stage_body_nvfp4,
stage_softmax and the nvfp4 branches of fill_full / fill_scales; docs/perf-notes.md "Session 9
candidate: -DKVLAB_DECODE_STAGE_NVFP4"; the nvfp4 part of session 8's
tests/test_decode_stage_all_emulation.py on experiment/decode-stage-int8-fp8-nvfp4). No GPU needed.

* fill_full's per-lane pointers plus loop-invariant steps address the same shared-memory words as
  the kernel's general ``fill`` (head_offsets) for every lane, head count, d, ring slot and chunk:
  the consecutive-byte K / V rows and the K scale rows (fill_scales), with aligned wide loads;
* the scale kc folded into the exp2's FFMA gives the scores of head_tile_math up to float32
  rounding, and the column max before the scale equals the max of the scaled scores.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvlab.cuda import loader


def _src():
    return (loader.kernels_dir() / "paged_attention.cu").read_text()


def test_switch_code_is_there():
    s = _src()
    assert "#ifdef KVLAB_DECODE_STAGE_NVFP4" in s
    assert "e[i] = ex2_approx(fmaf(x[i], sc, nm));" in s
    assert "stage_softmax<4 * NT, D>(x, kc, m, l, z, acc, c, e);" in s
    assert "smem_words<S, 4>(ls + os + hs8, r.skg8, true);" in s


def k_token(g):
    return (g >> 1) | ((g & 1) << 2)


def pv_token(c, i):
    return c + 4 * i


def layout(d):
    """nvfp4's (ROW, DROW, KB, VB, S) as Traits / the paged kernel define them."""
    return d // 2 + d // 16, d // 2, d // 8, d // 16, d // 16


def words(nbytes):
    """Byte offsets of the words smem_words<nbytes, align> returns (in order)."""
    return [4 * i for i in range(nbytes // 4)]


def width(nbytes, align=16):
    """Load width smem_words<nbytes, align> picks."""
    return 16 if align >= 16 and nbytes % 16 == 0 else 8 if align >= 8 and nbytes % 8 == 0 else 4


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("H", [1, 2, 3, 5, 8])
def test_fill_full_offsets_match_fill(d, H):
    ROW, DROW, KB, VB, S = layout(d)
    TT = 32 if ROW <= 80 else 16
    CPT = TT // 16
    assert CPT == (2 if d <= 128 else 1)   # stage_body_nvfp4<…, NT = CPT>
    HR = H * DROW
    side_sm = TT * H * ROW
    stage_sm = 2 * side_sm
    sc0 = TT * H * (d // 2)
    for kvh in range(H):
        for lane in range(32):
            g, c = lane >> 2, lane & 3
            kt = k_token(g)
            kg = (kt * H + kvh) * DROW + c * KB
            v = [side_sm + (pv_token(c, i) * H + kvh) * DROW + g * VB for i in range(4)]
            skg = sc0 + (kt * H + kvh) * S
            skg8 = sc0 + ((kt + 8) * H + kvh) * S
            for nbuf in (2, 3):
                for b in range(nbuf):
                    for j in range(CPT):
                        base = b * stage_sm + j * 16 * HR
                        # the general fill: base + of.kg, of.kg8 (= kg + 8·HR), of.v[t]
                        ref_ka = [base + kg + w for w in words(KB)]
                        ref_kb = [base + kg + 8 * HR + w for w in words(KB)]
                        ref_v = [[base + v[t] + w for w in words(VB)] for t in range(4)]
                        # fill_full: o = b·stage_sm + j·16·hr (hr16 steps), hr = H·DROW
                        hr = H * DROW
                        hr4, hr8, hr16 = 4 * hr, 8 * hr, 16 * hr
                        o = b * stage_sm + j * hr16
                        lk, lv = kg, v[0]
                        rows = [0, hr4, hr8, hr8 + hr4]
                        assert [lk + o + w for w in words(KB)] == ref_ka
                        assert [lk + o + hr8 + w for w in words(KB)] == ref_kb
                        assert [[lv + o + rows[t] + w for w in words(VB)] for t in range(4)] == ref_v
                        # fill_scales: os = b·stage_sm + j·16·H·S (hs16 steps); fill: sb + of.skg(8)
                        os_ = b * stage_sm + j * 16 * H * S
                        sb = b * stage_sm + j * 16 * H * S
                        hs8 = 8 * H * S
                        ls = skg
                        assert [ls + os_ + w for w in words(S)] == [sb + skg + w for w in words(S)]
                        assert [ls + os_ + hs8 + w for w in words(S)] == [sb + skg8 + w for w in words(S)]
                        # the wide loads (smem_words<KB / VB, 16>: 16, 8 or 4 bytes) stay aligned
                        wk, wv = width(KB), width(VB)
                        assert (lk + o) % wk == 0 and (lk + o + hr8) % wk == 0
                        assert all((lv + o + r) % wv == 0 for r in rows)
                        assert (ls + os_) % 4 == 0 and (ls + os_ + hs8) % 4 == 0


def test_scale_folded_into_exp2():
    """x' = s (the raw dot product), m = kc·max x', e = 2^(fma(x', kc, −m)) against
    head_tile_math's v = s·kc, e = 2^(v − max v): the same max, e within float32 rounding."""
    rng = np.random.default_rng(11)
    f32 = np.float32
    for _ in range(2000):
        s = (rng.standard_normal(8) * 100).astype(f32)
        kc = f32(abs(rng.standard_normal()) * 10.0 ** rng.integers(-4, 1))
        v = (s * kc).astype(f32)
        e_ref = np.exp2(v.astype(np.float64) - float(v.max()))
        m = f32(s.max() * kc)
        assert m == np.max(v)                          # max before the scale is exact
        arg = (s.astype(np.float64) * float(kc) - float(m)).astype(f32)   # one FFMA: one rounding
        e = np.exp2(arg.astype(np.float64))
        tol = 4 * 2.0 ** -23 * (np.abs(v.astype(np.float64)) + abs(float(m))) * np.log(2) + 1e-7
        assert np.all(np.abs(e - e_ref) <= tol * np.maximum(e, e_ref) + 1e-7)
