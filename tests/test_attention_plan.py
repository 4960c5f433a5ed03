"""AttentionPlan.check_run_args: a plan built once is reused for every layer, so ``run`` checks
that the arrays it is handed fit the plan (CPU: NumPy stand-ins for the GPU arrays, device None)."""
import numpy as np
import pytest

import kvlab
from kvlab.cuda.attention import AttentionPlan
from tests.gpu.device_arrays import off_boundary


def _plan(**kw):
    base = dict(fmt_code=3, head_size=128, q_dtype="float16", num_tokens=5, num_q_heads=8,
                num_kv_heads=2, block_size=16, hpc=4, tpc=2, ny=2, scale_log2=1.0, k_scale=1.0,
                v_scale=1.0, window=0, swizzle_v=0, items=None, red_items=None, n_items=0, n_red=0,
                n_parts=0, ws_o=None, ws_ml=None, device_id=None)
    base.update(kw)
    return AttentionPlan(**base)


def _args():
    rng = np.random.default_rng(7)
    q = rng.standard_normal((5, 8, 128)).astype(np.float16)
    cache = kvlab.allocate_cache("int4_per_token_head", 4, 16, 2, 128)
    return q, cache


def test_fitting_arrays_pass():
    q, cache = _args()
    _plan().check_run_args(q, cache, out=np.empty_like(q))


def test_q_and_out_off_a_16_byte_boundary_pass():
    """Every attention kernel reads q and writes out element-wise when their base is off a 16-byte
    boundary (the GPU tests test_decode_unaligned_q and test_queries_and_output_off_16_byte_boundaries
    run them), so only the cache, whose rows are bulk-copied, must be aligned."""
    q, cache = _args()
    qq, out = off_boundary(q, 2), off_boundary(np.empty_like(q), 8)
    _plan().check_run_args(qq, cache, out=out)
    with pytest.raises(ValueError, match=r"^kv_cache: its data must start on a 16-byte boundary"):
        _plan().check_run_args(qq, off_boundary(cache, 2), out=out)


@pytest.mark.parametrize("bad, match", [
    (lambda q, c: (q, off_boundary(c, 4), None), r"^kv_cache: its data must start on a 16-byte boundary .* 4 bytes"),
    (lambda q, c: (q[:4], c, None), r"^q: this plan was built for shape \(5, 8, 128\)"),
    (lambda q, c: (q.astype(np.float32), c, None), r"^q: this plan was built for dtype float16, got float32"),
    (lambda q, c: (np.asfortranarray(q), c, None), r"^q: must be contiguous"),
    (lambda q, c: (q, c, np.empty((5, 8, 64), np.float16)), r"^out: this plan was built for shape"),
    (lambda q, c: (q, c[:, :, :8], None), r"^kv_cache: this plan was built for \(num_blocks, 2, 16, 2, row\)"),
    (lambda q, c: (q, c[0], None), r"^kv_cache: this plan was built for"),
])
def test_misfits_name_the_argument(bad, match):
    q, cache = _args()
    qq, cc, out = bad(q, cache)
    with pytest.raises((TypeError, ValueError), match=match):
        _plan().check_run_args(qq, cc, out=out)


# ---- the paged decode kernel's stage count and the "auto" variant rule (host logic, CPU):
# the device queries are replaced by an H200's numbers (132 SMs, 228 KB shared memory per SM,
# 227 KB per block) or an A100's compute capability.
class _FakeDevice:
    def __init__(self, cc):
        self.compute_capability = cc


@pytest.fixture
def h200(monkeypatch):
    import cupy

    from kvlab.cuda import attention as A

    monkeypatch.setattr(A, "_device_props", lambda dev: (132, 228 * 1024))
    monkeypatch.setattr(A, "_smem_optin", lambda dev: 227 * 1024)
    monkeypatch.setattr(cupy.cuda, "Device", lambda dev=None: _FakeDevice("90"))
    monkeypatch.setattr(A, "_compute_capability", lambda dev: 90)   # cached on a real device
    return A


@pytest.mark.parametrize("code, d, h, expect, fit", [
    (3, 128, 8, 2, 3),   # int4: stages of 2·32·8·68 = 34,816 B; 3 fit in 110 KB (2 CTAs/SM), big: 2
    (4, 128, 8, 2, 3),   # nvfp4: 36,864 B stages (rows of 72 B)
    (1, 128, 8, 2, 3),   # int8: 16-token stages of 33,792 B
    (0, 128, 8, 2, 3),   # auto: 65,536 B stages only fit one CTA per SM (3 stages of 223 KB)
    (3, 64, 3, 4, 4),    # the shipped model's shape: small stages, the 4-stage cap
    (1, 128, 4, 4, 4),   # int8, 4 heads: 16,896 B stages, not big: as many as fit
    (0, 256, 8, 0, 0),   # auto d=256, 8 heads: a stage is 131 KB, two do not fit
])
def test_paged_stage_count(h200, monkeypatch, code, d, h, expect, fit):
    A = h200
    monkeypatch.delenv("KVLAB_DECODE_PAGED_NBUF", raising=False)
    if fit > 2:   # the big-stage cap is what makes the difference
        assert (A.paged_stage_bytes(code, d, h) >= A.PG_BIG_STAGE) == (expect == 2)
    monkeypatch.setenv("KVLAB_DECODE_PAGED_NBUF", "4")   # the session-9 rule: as many as fit
    assert A._paged_buffers(code, d, h, h, 0)[0] == fit
    monkeypatch.delenv("KVLAB_DECODE_PAGED_NBUF")
    nbuf, note = A._paged_buffers(code, d, h, h, 0)
    assert nbuf == expect, note
    if nbuf:   # fits one block's opt-in limit with room for the static part
        assert A.paged_smem_bytes(code, d, h, h, nbuf) <= 227 * 1024 - 4096
    else:
        assert "two stages" in note


@pytest.mark.parametrize("code, d, h, expect, fit", [
    (3, 128, 8, 2, 3),   # int4: two rings of 34,816 B stages; 3 per ring fit in 223 KB (one CTA per SM), big: 2
    (4, 128, 8, 2, 2),   # nvfp4: 36,864 B stages, 2 × 3 + the q staging do not fit (237,568 B)
    (1, 128, 8, 2, 3),   # int8: 33,792 B stages
    (2, 128, 8, 2, 3),   # fp8: the same stages, 2 per ring as int8 since session 20 (PG_DUAL_NBUF)
    (2, 64, 8, 2, 3),    # fp8 at d = 64: 34,816 B stages, 2 per ring
    (4, 64, 3, 4, 4),    # nvfp4, 9/3 heads: 7,680 B stages, not big: the 4-stage cap
    (3, 64, 3, 4, 4),    # the shipped model's shape: 6,912 B stages, the 4-stage cap
])
def test_paged_dual_stage_count(h200, monkeypatch, code, d, h, expect, fit):
    """The dual-ring CTA (nh = 2, one per SM): two rings of the usual stages, sized for the whole SM."""
    A = h200
    monkeypatch.delenv("KVLAB_DECODE_PAGED_NBUF", raising=False)
    nbuf, note = A._paged_buffers(code, d, h, h, 0, 2)
    assert nbuf == expect, note
    assert A.paged_smem_bytes(code, d, h, h, nbuf, 2) == max(2 * nbuf * A.paged_stage_bytes(code, d, h) + h * 8 * d * 2,
                                                               2 * h * 8 * d * 4)
    assert A.paged_smem_bytes(code, d, h, h, nbuf, 2) <= 227 * 1024 - 4096
    monkeypatch.setenv("KVLAB_DECODE_PAGED_NBUF", "4")
    assert A._paged_buffers(code, d, h, h, 0, 2)[0] == fit
    assert A.paged_smem_bytes(code, d, h, h, fit, 2) <= 227 * 1024 - 4096


def test_paged_halves_env(monkeypatch):
    """KVLAB_DECODE_PAGED_DUAL picks the dual-ring CTA where it is built (quantized formats, d <= 128)."""
    from kvlab.cuda import attention as A

    monkeypatch.delenv("KVLAB_DECODE_PAGED_DUAL", raising=False)
    for d in (64, 128, 256):
        assert [A._paged_halves(c, d) for c in range(5)] == [
            2 if ((c, d, 1) in A.PG_DUAL_DEFAULT or (c, d, 2) in A.PG_DUAL_DEFAULT)
            and c in A.PG_DUAL_CODES and d in A.PG_DUAL_HEAD_SIZES else 1 for c in range(5)]
    assert [A._paged_halves(c, 128) for c in range(5)] == [1, 2, 2, 2, 1]   # nvfp4: two CTAs per SM
    assert [A._paged_halves(c, 64) for c in range(5)] == [1, 2, 2, 2, 2]    # candidates; _dual_default decides
    monkeypatch.setenv("KVLAB_DECODE_PAGED_DUAL", "1")
    assert [A._paged_halves(c, 128) for c in (0, 1, 2, 3, 4)] == [1, 2, 2, 2, 2]
    assert A._paged_halves(3, 64) == 2 and A._paged_halves(3, 256) == 1
    monkeypatch.setenv("KVLAB_DECODE_PAGED_DUAL", "0")
    assert A._paged_halves(3, 128) == 1
    monkeypatch.setenv("KVLAB_DECODE_PAGED_DUAL", "yes")
    with pytest.raises(ValueError, match="KVLAB_DECODE_PAGED_DUAL"):
        A._paged_halves(3, 128)
    # every (format, head size) the plan can give nh = 2 has its instantiation
    names = {s.name_expression() for s in A.SPECS}
    for code in A.PG_DUAL_CODES:
        for d in A.PG_DUAL_HEAD_SIZES:
            for t in A.Q_DTYPES:
                assert A._paged_spec(code, d, t, 2).name_expression() in names


@pytest.mark.parametrize("code, seq_lens, dual", [
    # int8 (PG_DUAL_DEFAULT: gain 0.05, parts of >= 16 tiles; session 19 call 2's grid, dual-ring Δ)
    (1, [8192] * 32, True), (1, [131072], True), (1, [4096] * 64, True), (1, [32768] * 8, True),
    (1, [8192] * 8, True), (1, [1024] * 64, True), (1, [32768], True), (1, [1024] * 32, True),
    (1, [8192], False), (1, [1024] * 8, False),          # 8-tile parts: +2.4 / +2.6 %
    (1, [300] * 40 + [60000] * 4, False),               # short unsplit sequences idle SMs (+8.0 %)
    (1, list(range(2000, 32001, 2000)), True),          # a ragged batch that balances (−4.0 %)
    (1, [1000] * 20 + [50000] * 3, False), (1, [200] * 100 + [100000], False),   # the dual list is not one wave
    # int4 (gain 0.04, parts of >= 32 tiles)
    (3, [8192] * 32, True), (3, [4096] * 64, True), (3, [32768] * 32, True), (3, [131072] * 8, True),
    (3, [131072], True), (3, [8192] * 8, True),          # batch 1 × 128k −1.7 %, 8 × 8k −3.7 %
    (3, [32768], False), (3, [8192], False), (3, [1024] * 32, False),   # 17 / 8 / 16 tiles: +2.1 / +5.5 / −0.1 %
    (3, [300] * 40 + [60000] * 4, False),               # +10.4 %
    # fp8 (gain 0.05, parts of >= 17 tiles; session 20 call 3, interleaved rows: scripts/decode_fill_ab.py)
    (2, [8192] * 32, True), (2, [4096] * 64, True), (2, [131072], True), (2, [32768] * 8, True),   # −15.7 / −16.5 / −9.1 / −17.4 %
    (2, [8192] * 16, True), (2, [32768] * 32, True),    # −8.0 / −21.3 %
    (2, [8192] * 8, True), (2, [32768], True),          # 32 / 17 tiles: −0.7 / −3.6 %
    (2, [8192] * 4, False), (2, [1024] * 32, False),    # 16 tiles: +1.2 % (session 19: +1.9 %)
    (2, [300] * 40 + [60000] * 4, False),               # session 19: +9.4 %
])
def test_dual_pays_where_measured(code, seq_lens, dual):
    """The plan's default CTA form (``_dual_default`` on the two forms' default lists, H200: 132
    SMs, 264 / 132 slots, the (format, 128, 1) rule of ``PG_DUAL_DEFAULT``) against what sessions 19
    (int8, int4) and 20 (fp8, with its interleaved rows) measured for these batches
    (docs/perf-notes.md, with the split query staging)."""
    from kvlab.cuda import attention as A

    sl = np.asarray(seq_lens)
    qsl = np.arange(len(sl) + 1)
    two = A._paged_list(qsl, sl, 2, 0, 264, None, 1, 132)
    dl = A._paged_list(qsl, sl, 2, 0, 132, None, 2, 132)
    assert dl[3] == 1.0                      # the dual ring's list is never weighted
    rule = A.PG_DUAL_DEFAULT[code, 128, 1]
    assert rule.max_seqs is None
    assert A._dual_pays(two[0], dl[0], 132, A.PG_WAVE_WEIGHT, rule.gain, rule.min_tiles) == dual
    assert A._dual_default(code, 128, two[0], dl[0], 132, A.PG_WAVE_WEIGHT, 1, len(sl)) == dual
    assert not A._dual_default(4, 128, two[0], dl[0], 132, A.PG_WAVE_WEIGHT, 1, len(sl))   # nvfp4: no rule
    # the model's pieces: a dual CTA runs at its SM's whole rate, shared by per_sm of them
    t = A._list_time(dl[0], 132, 1.2, 2, 0.05)
    assert A._list_time(dl[0], 132, 1.2, 2, 0.05, per_sm=2) == pytest.approx(
        max(2 * t, A._row_tiles(dl[0]).sum() / 132 / 2.2 / 1.05))
    # never faster than all tiles spread evenly over the SMs at their whole rate
    assert A._list_time(dl[0], 132, 1.2, 2, 0.0) >= A._row_tiles(dl[0]).sum() / 132 / 2.2 - 1e-9


@pytest.mark.parametrize("code, hkv, seq_lens, dual", [
    # head size 64 (session 19, call 2: the grid and scripts/decode_fill_ab.py --shape 9/3/64, both
    # forms with the split query staging, on the H200; dual-ring Δ in the comments)
    (1, 3, [8192], True), (1, 3, [131072], True), (1, 3, [8192] * 32, True),          # −13.6 / −7.3 / −1.3 %
    (2, 3, [8192], True), (2, 3, [131072], True), (2, 3, [8192] * 32, True),          # −16.0 / −9.7 / −3.3 %
    (4, 3, [8192], True), (4, 3, [131072], True), (4, 3, [8192] * 32, True),          # −13.8 / −25.2 / −9.3 %
    (4, 3, [4096] * 64, True), (4, 3, [300] * 40 + [60000] * 4, True),                 # −8.2 / −11.7 %
    (3, 3, [8192], True), (3, 3, [32768], True), (3, 3, [131072], True),              # int4 batch 1: −14.8 / −11.6 / −8.1 %
    (3, 3, [8192] * 32, False), (3, 3, [4096] * 64, False),                           # +11.8 / +12.2 %
    (3, 3, [300] * 40 + [60000] * 4, False),                                          # +14.1 %
    # int4 at 9/3 by parts (call 6): the same parts in both lists −12.0 / −7.7 %, more +11 … +27 %
    (3, 3, [8192] * 2, True), (3, 3, [8192] * 4, True),
    (3, 3, [8192] * 8, False), (3, 3, [8192] * 16, False), (3, 3, [32768] * 2, False),
    (3, 3, [32768] * 4, False), (3, 3, [32768] * 8, False),
    (1, 3, [8192] * 4, True), (1, 3, [8192] * 8, True), (1, 3, [32768] * 2, True),   # −8.2 / −6.8 / −4.3 %
    (1, 8, [8192], False),                               # 32/8, 8-tile parts: int8 +6.1 % …
    (2, 8, [8192], True), (2, 8, [32768], True), (2, 8, [8192] * 8, True),   # … fp8 (session 20, interleaved): −4.4 / −1.0 / −4.3 %
    (1, 8, [131072], True), (1, 8, [8192] * 32, True),   # −2.9 / −1.4 %
    (2, 8, [131072], True), (2, 8, [8192] * 32, True),   # session 19: −3.3 / −2.7 %; session 20 B = 32: −3.0 %
    (2, 3, [8192] * 8, True), (2, 3, [8192] * 64, True),   # fp8 at 9/3 (session 20): +0.6 / +1.6 %, kept as int8's
    (4, 8, [131072], False), (4, 8, [8192] * 32, False),   # nvfp4 32/8: +7.4 / +2.9 % (no rule)
    (3, 8, [131072], False), (3, 8, [8192], False),        # int4 32/8: +2.5 / +2.9 % (no rule)
])
def test_dual_default_head_size_64(code, hkv, seq_lens, dual):
    """The plan's default CTA form at d = 64 (``_dual_default``): 9/3 heads put two (int4: three)
    dual-ring CTAs of 6 warps on an SM against four to seven two-per-SM CTAs of 3 warps, 32/8 one
    against two (H200: 132 SMs; the slot counts of call 2's plans)."""
    from kvlab.cuda import attention as A

    sl = np.asarray(seq_lens)
    qsl = np.arange(len(sl) + 1)
    slots = {1: (528, 264), 2: (528, 264), 3: (924, 396), 4: (792, 264)}[code] if hkv == 3 else (264, 132)
    two = A._paged_list(qsl, sl, 2, 0, slots[0], None, 1, 132)
    dl = A._paged_list(qsl, sl, 2, 0, slots[1], None, 2, 132)
    per_sm = slots[1] // 132
    assert A._dual_default(code, 64, two[0], dl[0], 132, A.PG_WAVE_WEIGHT, per_sm, len(sl)) == dual
    assert not A._dual_default(code, 256, two[0], dl[0], 132, A.PG_WAVE_WEIGHT, per_sm, len(sl))


def test_dual_default_builds_the_other_list_only_when_needed():
    """``_dual_default`` with the two-per-SM list given as a builder (the plan's way: building it
    costs ~0.1–0.3 ms of host time) decides as with the list itself, on random ragged batches for
    every rule of ``PG_DUAL_DEFAULT``; it skips the build for a uniform batch the dual ring wins
    (its list modelled no slower than any list of the same tiles), and both lists hold the same
    tiles in all (the bound's premise)."""
    from kvlab.cuda import attention as A

    rng = np.random.default_rng()
    slots = {(1, 128, 1): (264, 132), (2, 128, 1): (264, 132), (3, 128, 1): (264, 132),
             (1, 64, 1): (264, 132), (2, 64, 1): (264, 132),
             (1, 64, 2): (528, 264), (2, 64, 2): (528, 264), (4, 64, 2): (792, 264), (3, 64, 2): (924, 396)}
    assert set(slots) == set(A.PG_DUAL_DEFAULT)
    # uniform batches over the decode grid's range (many lie just above the bound, both ways:
    # a bound 5 % too loose fails here), then random ragged ones
    batches = [np.full(n, L) for n in (1, 2, 3, 5, 8, 13, 21, 32, 41, 47, 64)
               for L in (1024, 3000, 8192, 12000, 16384, 32768, 131072)]
    for _ in range(40):
        n = int(rng.integers(1, 80))
        if rng.integers(2):   # ragged
            batches.append(rng.integers(1, 70000, n))
        else:                 # short sequences and a few long ones
            batches.append(np.r_[rng.integers(1, 600, n), rng.integers(20000, 140000, int(rng.integers(1, 5)))])
    def oracle(rule, two, dual, per_sm, n_seqs):   # the rule's full comparison, both lists built
        if rule.max_seqs is not None and n_seqs > rule.max_seqs and not (rule.same_parts and len(two) <= len(dual)):
            return False
        if not len(dual) or A._row_tiles(dual).max() < rule.min_tiles:
            return False
        return rule.gain is None or (A._list_time(dual, 132, A.PG_WAVE_WEIGHT, 2, rule.gain, per_sm)
                                     <= A._list_time(two, 132, A.PG_WAVE_WEIGHT, 1))

    skipped = 0
    for sl in batches:
        qsl = np.arange(len(sl) + 1)
        window = int(rng.choice([0, 0, 4096]))
        for (code, d, per), (cap2, cap1) in slots.items():
            two = A._paged_list(qsl, sl, 2, window, cap2, None, 1, 132)
            dl = A._paged_list(qsl, sl, 2, window, cap1, None, 2, 132)
            assert A._row_tiles(two[0]).sum() == A._row_tiles(dl[0]).sum()
            calls = []

            def build():
                calls.append(1)
                return two[0]

            per_sm = cap1 // 132
            want = oracle(A.PG_DUAL_DEFAULT[code, d, per], two[0], dl[0], per_sm, len(sl))
            assert A._dual_default(code, d, two[0], dl[0], 132, A.PG_WAVE_WEIGHT, per_sm, len(sl)) == want
            got = A._dual_default(code, d, build, dl[0], 132, A.PG_WAVE_WEIGHT, per_sm, len(sl))
            assert got == want, (code, d, per, sl.tolist())
            skipped += not calls
    assert skipped > 0
    # B = 32 × 8k, int8 / fp8 / int4 at d = 128: decided without the other list
    sl = np.full(32, 8192)
    dl = A._paged_list(np.arange(33), sl, 2, 0, 132, None, 2, 132)
    for code in (1, 2, 3):
        assert A._dual_default(code, 128, lambda: pytest.fail("built"), dl[0], 132, A.PG_WAVE_WEIGHT, 1, 32)


def test_paged_stage_cap_env(h200, monkeypatch):
    A = h200
    monkeypatch.setenv("KVLAB_DECODE_PAGED_NBUF", "2")
    assert A._paged_buffers(3, 128, 8, 8, 0)[0] == 2      # int4: 3 fit, capped at 2
    assert A._paged_buffers(3, 64, 3, 3, 0)[0] == 2
    monkeypatch.setenv("KVLAB_DECODE_PAGED_NBUF", "4")
    assert A._paged_buffers(3, 128, 8, 8, 0)[0] == 3      # a cap above what fits: what fits
    monkeypatch.setenv("KVLAB_DECODE_PAGED_NBUF", "3")
    assert A._paged_buffers(0, 128, 8, 8, 0)[0] == 3      # the cap lifts the big-stage default
    for bad in ("1", "5", "two"):
        monkeypatch.setenv("KVLAB_DECODE_PAGED_NBUF", bad)
        with pytest.raises(ValueError, match="KVLAB_DECODE_PAGED_NBUF"):
            A._paged_buffers(3, 128, 8, 8, 0)


def test_paged_needs_sm90_and_at_most_8_column_groups(h200, monkeypatch):
    import cupy

    A = h200
    assert A._paged_buffers(3, 128, 16, 16, 0) == (0, "paged decode needs num_kv_heads * G / hpc <= 8 "
                                                      "column groups, got 16")
    monkeypatch.setattr(cupy.cuda, "Device", lambda dev=None: _FakeDevice("80"))
    monkeypatch.setattr(A, "_compute_capability", lambda dev: 80)
    nbuf, note = A._paged_buffers(3, 128, 8, 8, 0)
    assert nbuf == 0 and "sm_90" in note and "sm_80" in note


# ---- prefill_variant ("auto" | "mma" | "wgmma") and KVLAB_PREFILL_VARIANT (host logic, CPU)
def test_prefill_variant_default_env_and_argument(h200, monkeypatch):
    A = h200
    monkeypatch.delenv("KVLAB_PREFILL_VARIANT", raising=False)
    assert A.DEFAULT_PREFILL_VARIANT == "auto"
    assert A._resolve_prefill_variant(None, 0) == "wgmma"    # "auto" on sm_90
    assert A._resolve_prefill_variant("auto", 0) == "wgmma"
    monkeypatch.setenv("KVLAB_PREFILL_VARIANT", "wgmma")
    assert A._resolve_prefill_variant(None, 0) == "wgmma"
    assert A._resolve_prefill_variant("mma", 0) == "mma"   # the argument wins over the environment


@pytest.mark.parametrize("value, env", [("tma", False), ("", True), ("WGMMA", False)])
def test_prefill_variant_errors_name_the_source(h200, monkeypatch, value, env):
    A = h200
    if env:
        monkeypatch.setenv("KVLAB_PREFILL_VARIANT", "mma2")
        with pytest.raises(ValueError, match=r"^KVLAB_PREFILL_VARIANT: expected one of \['auto', 'mma', 'wgmma'\], got 'mma2'"):
            A._resolve_prefill_variant(None, 0)
    else:
        with pytest.raises(ValueError, match=rf"^prefill_variant: expected one of \['auto', 'mma', 'wgmma'\], got '{value}'"):
            A._resolve_prefill_variant(value, 0)


@pytest.mark.parametrize("cc", ["80", "89", "100"])
def test_wgmma_prefill_needs_sm90(h200, monkeypatch, cc):
    import cupy

    A = h200
    monkeypatch.setattr(cupy.cuda, "Device", lambda dev=None: _FakeDevice(cc))
    monkeypatch.setattr(A, "_compute_capability", lambda dev: int(cc))
    with pytest.raises(ValueError, match=rf"'wgmma' needs a GPU of compute capability 9.0.*sm_{cc}"):
        A._resolve_prefill_variant("wgmma", 0)
    assert A._resolve_prefill_variant("mma", 0) == "mma"
    assert A._resolve_prefill_variant("auto", 0) == "mma"    # the default falls back to v2 off sm_90
    monkeypatch.delenv("KVLAB_PREFILL_VARIANT", raising=False)
    assert A._resolve_prefill_variant(None, 0) == "mma"


def test_prefill_spec_and_smem_per_variant():
    from kvlab.cuda import attention as A
    from kvlab.cuda import loader

    assert A._prefill_spec(3, 128, "bfloat16").family == "paged_prefill"
    s = A._prefill_spec(3, 128, "bfloat16", "wgmma")
    assert s.family == "paged_prefill_wgmma" and s in loader.FAMILIES["paged_prefill_wgmma"]
    assert A.prefill_smem_bytes(128) == 768 * 128 + 7168
    assert A.prefill_smem_bytes(128, "wgmma") == 4 * (256 * 128 + 512) + 256 * 128 <= 227 * 1024
    assert _plan().prefill_variant == "mma"


def test_prefill_geometry_reads_the_ring_switch(monkeypatch):
    """The wgmma launch takes 384 threads (producer + 2 consumer warpgroups) and the shared memory of
    a ring of 4 stages, or of -DKVLAB_WGMMA_WS_STAGES in KVLAB_NVRTC_OPTIONS; the v2 ("mma") launch
    does not change; bad stage counts raise."""
    from kvlab.cuda import attention as A

    monkeypatch.delenv("KVLAB_NVRTC_OPTIONS", raising=False)
    assert A.prefill_geometry("wgmma") == A.PrefillGeometry(128, 384, 4)
    assert A.prefill_geometry("mma") == A.PrefillGeometry(128, 256, 0)
    assert A.prefill_smem_bytes(128, "wgmma") == 4 * (256 * 128 + 512) + 256 * 128
    for opts, stages in (("-lineinfo", 4), ("-DKVLAB_WGMMA_WS_STAGES=3", 3),
                         ("--define-macro=KVLAB_WGMMA_WS_STAGES=2", 2),
                         ("-DKVLAB_WGMMA_WS_STAGES=2 -DKVLAB_WGMMA_WS_NO_PINGPONG", 2),
                         ("-DKVLAB_WGMMA_WS_STAGESX=2", 4)):
        monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", opts)
        assert A.prefill_geometry("wgmma") == A.PrefillGeometry(128, 384, stages), opts
        assert A.prefill_geometry("mma") == A.PrefillGeometry(128, 256, 0)
        assert A.prefill_smem_bytes(128, "wgmma") == stages * (256 * 128 + 512) + 256 * 128 <= 227 * 1024
        assert A.prefill_smem_bytes(64, "wgmma") == stages * (256 * 64 + 512) + 256 * 64
        assert A.prefill_smem_bytes(128) == 768 * 128 + 7168
    for bad in (1, 5):
        monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", f"-DKVLAB_WGMMA_WS_STAGES={bad}")
        with pytest.raises(ValueError, match="2 .. 4 stages"):
            A.prefill_geometry("wgmma")


def test_reduce_split_choice(monkeypatch):
    """The plan spreads a column over a CTA only when the one-warp-per-column merge would leave
    SMs idle; KVLAB_DECODE_MERGE_SPLIT forces it either way, and rejects other values."""
    from kvlab.cuda.attention import reduce_split

    monkeypatch.delenv("KVLAB_DECODE_MERGE_SPLIT", raising=False)
    assert reduce_split(1, 8, 132) and reduce_split(16, 8, 132)
    assert not reduce_split(17, 8, 132) and not reduce_split(32, 8, 132) and not reduce_split(0, 8, 132)
    monkeypatch.setenv("KVLAB_DECODE_MERGE_SPLIT", "1")
    assert reduce_split(32, 8, 132) and not reduce_split(0, 8, 132)
    monkeypatch.setenv("KVLAB_DECODE_MERGE_SPLIT", "0")
    assert not reduce_split(1, 8, 132)
    monkeypatch.setenv("KVLAB_DECODE_MERGE_SPLIT", "yes")
    with pytest.raises(ValueError, match="KVLAB_DECODE_MERGE_SPLIT: expected 0 or 1"):
        reduce_split(1, 8, 132)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8])
def test_merge_columns_are_the_query_rows(group, monkeypatch):
    """The default build (since session 44) launches the merge columns that have a query row and no
    more: column n is query head n % hpc of token tok0 + n // hpc, so a decode batch (one token per
    sequence) needs hpc of the 8 and a longer query min(tpc, rows left) · hpc. Counted here by
    enumerating the columns on random items, as the kernels' validity test does (n < tpc·hpc and
    tok0 + n // hpc < Lq). The build -DKVLAB_DECODE_ALL_COLUMNS launches 8."""
    from kvlab.cuda.attention import NCOL, heads_per_column_group, merge_columns

    monkeypatch.delenv("KVLAB_NVRTC_OPTIONS", raising=False)
    hpc = heads_per_column_group(group)
    tpc = NCOL // hpc
    rng = np.random.default_rng(1000 + group)
    for trial in range(20):
        S = int(rng.integers(1, 12))
        qlen = rng.integers(1, 3 * tpc + 2, S) if trial % 2 else np.ones(S, np.int64)
        rows = [(s, t0, 0, 2) for s in range(S) for t0 in range(0, int(qlen[s]), tpc)]
        pick = rng.permutation(len(rows))[: int(rng.integers(1, len(rows) + 1))]
        red = np.array([rows[i] for i in sorted(pick)], np.int32)
        want = max(sum(1 for n in range(NCOL) if n < tpc * hpc and t0 + n // hpc < qlen[s])
                   for s, t0, _, _ in red)
        assert merge_columns(red, qlen, hpc, tpc) == want
        if trial % 2 == 0:
            assert want == hpc   # decode: one token, hpc query heads
    assert merge_columns(np.zeros((0, 4), np.int32), np.ones(3, np.int64), hpc, tpc) == NCOL
    monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", "-lineinfo -DKVLAB_DECODE_ALL_COLUMNS")
    assert merge_columns(np.array([[0, 0, 0, 2]], np.int32), np.ones(1, np.int64), hpc, tpc) == NCOL


def _check_same_work(before, after):
    """Every split group keeps its parts and its whole range, cut into contiguous pieces."""
    assert sorted(map(tuple, before[:, [0, 1, 4]])) == sorted(map(tuple, after[:, [0, 1, 4]]))
    for seq, tok0 in {(int(s), int(t)) for s, t in before[:, :2]}:
        b = before[(before[:, 0] == seq) & (before[:, 1] == tok0)]
        a = after[(after[:, 0] == seq) & (after[:, 1] == tok0)]
        a = a[np.argsort(a[:, 2])]
        assert a[0, 2] == b[:, 2].min() and a[-1, 3] == b[:, 3].max()
        assert np.all(a[1:, 2] == a[:-1, 3]) and np.all(a[:, 3] > a[:, 2]) and np.all(a[:, 2] % 16 == 0)


@pytest.mark.parametrize("seq_lens, weight", [([8192] * 32, 1.2), ([131072], 1.3), ([5000, 300, 9000] * 3, 1.15),
                                              ([700] * 40, 1.5),
                                              ([20000, 100, 3000, 64, 9000, 16, 40000, 30000, 50, 12000], 1.2)])
def test_wave_weighted_splits(seq_lens, weight):
    """The paged decode's first-wave parts (the first n_sm of the launch order) get ``weight``
    times the tiles of the others of their group, and every group keeps its range and its parts."""
    from kvlab.cuda.attention import PG_MIN_SPLIT_TOKENS, _wave_weighted, _work_list

    n_sm, cap = 132, 264
    sl = np.asarray(seq_lens)
    qsl = np.arange(len(sl) + 1)
    items, _, _ = _work_list(qsl, sl, 2, 0, 1, cap, None, PG_MIN_SPLIT_TOKENS)
    assert n_sm < len(items) <= cap
    out = _wave_weighted(items, n_sm, cap, weight)
    assert out.dtype == np.int32 and out.shape == items.shape
    _check_same_work(items, out)
    size = out[:, 3] - out[:, 2]
    multi = out[:, 4] >= 0
    assert np.all(multi[:n_sm])
    # within each group with parts in both waves, a first-wave part is ~weight x a later one
    ratios = []
    for seq, tok0 in {(int(s), int(t)) for s, t in out[multi][:, :2]}:
        g = (out[:, 0] == seq) & (out[:, 1] == tok0)
        first, later = size[:n_sm][g[:n_sm]], size[n_sm:][g[n_sm:] & multi[n_sm:]]
        if len(first) and len(later) > 1:
            ratios.append(np.median(first) / np.median(later[:-1] if len(later) > 2 else later))
    assert ratios and abs(np.median(ratios) - weight) < 0.1 * weight, ratios[:5]


def test_wave_weighting_applies_to_one_wave_only(monkeypatch):
    """Unchanged for weight 1, for grids of at most n_sm CTAs or more than one wave; the weight
    comes from KVLAB_DECODE_WAVE_WEIGHT (a number in [1, 2]) or the module default."""
    from kvlab.cuda import attention as A

    qsl, sl = np.arange(33), np.full(32, 8192)
    items, _, _ = A._work_list(qsl, sl, 2, 0, 1, 264, None, A.PG_MIN_SPLIT_TOKENS)
    assert A._wave_weighted(items, 132, 264, 1.0) is items
    assert A._wave_weighted(items, 132, 200, 1.3) is items            # more than one wave
    assert A._wave_weighted(items, 300, 600, 1.3) is items            # fewer CTAs than SMs
    assert A._wave_weighted(items, 132, 132, 1.3) is items            # one CTA per SM
    short = np.r_[np.full(150, 100), np.full(4, 8192)]                   # 150 unsplit, 20 parts
    it2, _, _ = A._work_list(np.arange(155), short, 2, 0, 1, 264, None, A.PG_MIN_SPLIT_TOKENS)
    assert 132 < len(it2) <= 264 and A._wave_weighted(it2, 132, 264, 1.3) is it2   # < n_sm parts
    monkeypatch.delenv("KVLAB_DECODE_WAVE_WEIGHT", raising=False)
    assert A._wave_weight() == A.PG_WAVE_WEIGHT
    monkeypatch.setenv("KVLAB_DECODE_WAVE_WEIGHT", "1.25")
    assert A._wave_weight() == 1.25
    for bad in ("0.9", "3", "heavy", "nan"):
        monkeypatch.setenv("KVLAB_DECODE_WAVE_WEIGHT", bad)
        with pytest.raises(ValueError, match="KVLAB_DECODE_WAVE_WEIGHT"):
            A._wave_weight()


def test_dependent_launch_layouts_and_switch(monkeypatch):
    """The ctypes mirrors of CUlaunchAttribute / CUlaunchConfig have cuda.h's layout (CUDA 13
    headers, checked with offsetof: 72 and 56 bytes; value at 8; hStream, attrs, numAttrs at 32,
    40, 48), and the plan's switch: KVLAB_DECODE_PDL=0 or a -DKVLAB_DECODE_NO_PDL build launch
    the merge normally (without the kernels' griddepcontrol.wait an early launch could read
    partials not yet written), a bad value is refused. Both answers come before any device query."""
    import ctypes

    from kvlab.cuda import attention as A
    from kvlab.cuda import launch as L

    assert ctypes.sizeof(L._LaunchAttribute) == 72 and L._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(L._LaunchConfig) == 56
    assert (L._LaunchConfig.hStream.offset, L._LaunchConfig.attrs.offset,
            L._LaunchConfig.numAttrs.offset) == (32, 40, 48)
    assert L.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == 6
    monkeypatch.setenv("KVLAB_DECODE_PDL", "0")
    assert A.pdl_merge(0) is False
    monkeypatch.setenv("KVLAB_DECODE_PDL", "1")
    monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", "-DKVLAB_DECODE_NO_PDL")
    assert A.pdl_merge(0) is False
    monkeypatch.setenv("KVLAB_DECODE_PDL", "yes")
    with pytest.raises(ValueError, match="KVLAB_DECODE_PDL"):
        A.pdl_merge(0)
    with pytest.raises(TypeError, match="typed NumPy scalars"):
        L.launch_dependent(None, (1,), (32,), (1,))


SLOT_CASES = [([8192] * 32, 1.2), ([131072], 1.2), ([4096] * 64, 1.3), ([5000, 300, 9000] * 3, 1.15),
              ([20000, 100, 3000, 64, 9000, 16, 40000, 30000, 50, 12000], 1.2), ([32768] * 8, 1.0),
              (list(range(2000, 32001, 2000)), 1.2), ([300] * 40 + [60000] * 4, 1.2), ([1000] * 20 + [50000] * 3, 1.3)]


@pytest.mark.parametrize("dual", [False, True], ids=["two-per-sm", "dual"])
@pytest.mark.parametrize("seq_lens, weight", SLOT_CASES)
def test_slot_filled_work_list(seq_lens, weight, dual):
    """``_slot_filled``: every split group still covers exactly its range in contiguous tile-aligned
    parts (2 … tiles / min_tiles of them), part ids are 0 … n_parts-1 (consecutive per group, as its
    merge row says), unsplit items are kept, the resident slots are filled, the first n_sm rows are
    the heavy parts, and no part takes longer (tiles / its slot's rate) than session 15's
    ``_wave_weighted`` list's longest part — nor more than 12 % over the ideal. ``dual``: the
    dual-ring CTA's grid, one slot per SM and no weight (session 18)."""
    from kvlab.cuda.attention import PG_MIN_SPLIT_TOKENS, _slot_filled, _wave_weighted, _work_list

    n_sm, cap, min_tiles = 132, 264, PG_MIN_SPLIT_TOKENS // 16
    if dual:
        cap, weight = n_sm, 1.0
    sl = np.asarray(seq_lens)
    qsl = np.arange(len(sl) + 1)
    items, red, n_parts = _work_list(qsl, sl, 2, 0, 1, cap, None, PG_MIN_SPLIT_TOKENS)
    r = _slot_filled(items, n_sm, cap, weight, min_tiles)
    if len(items) > cap:   # _work_list chose more than one wave (here: the dual grid of 20 × 1k + 3 × 50k)
        assert dual and r is None
        return
    assert r is not None
    out, red2, n2 = r
    assert out.dtype == np.int32 and red2.dtype == np.int32 and out.shape[1] == items.shape[1]
    multi_b, multi_a = items[:, 4] >= 0, out[:, 4] >= 0
    # the unsplit items of the input are kept, last
    n_un = int((~multi_b).sum())
    assert np.array_equal(out[len(out) - n_un:], items[~multi_b])
    # every split group keeps its range: whole in one unsplit row, or in contiguous parts
    for seq, tok0 in {(int(s), int(t)) for s, t in items[multi_b][:, :2]}:
        b = items[multi_b & (items[:, 0] == seq) & (items[:, 1] == tok0)]
        a = out[(out[:, 0] == seq) & (out[:, 1] == tok0)]
        a = a[np.argsort(a[:, 2])]
        tiles = -(-(b[:, 3].max() - b[:, 2].min()) // 16)
        assert a[0, 2] == b[:, 2].min() and a[-1, 3] == b[:, 3].max()
        assert np.all(a[1:, 2] == a[:-1, 3]) and np.all(a[:, 3] > a[:, 2]) and np.all(a[:, 2] % 16 == 0)
        assert 1 <= len(a) <= max(tiles // min_tiles, 1)
        row = red2[(red2[:, 0] == seq) & (red2[:, 1] == tok0)]
        if len(a) == 1:
            assert a[0, 4] == -1 and len(row) == 0
        else:
            assert len(row) == 1 and row[0, 3] == len(a) and np.array_equal(a[:, 4], row[0, 2] + np.arange(len(a)))
    assert sorted(out[multi_a][:, 4].tolist()) == list(range(n2)) and n2 == red2[:, 3].sum()
    assert len(out) == cap
    # balance: a part's time is its tiles over its slot's rate (weight for the first n_sm rows)
    def longest(it):
        t = (-(-(it[:, 3] - it[:, 2]) // 16)).astype(float)
        t[:n_sm] /= weight
        return t.max()
    total = int((-(-(sl - 0) // 16)).sum())
    ideal = total / (weight * n_sm + (len(out) - n_sm))
    assert longest(out) <= longest(_wave_weighted(items, n_sm, cap, weight)) + 1e-9
    if len(out) == cap and (~multi_a).sum() == 0:
        assert longest(out) <= 1.12 * ideal, (longest(out), ideal)


def test_slot_filled_declines_other_grids(monkeypatch):
    """None (the plan then keeps ``_wave_weighted``) for grids of more than one wave, for GPUs
    holding one CTA per SM with a first-wave weight (not the dual-ring CTA's unweighted grid), or
    with nothing split; a short list is filled (no part heavy if it
    stays at most n_sm CTAs); the switch reads KVLAB_DECODE_SLOT_FILL (0 or 1, default 1)."""
    from kvlab.cuda import attention as A

    qsl, sl = np.arange(33), np.full(32, 8192)
    items, _, _ = A._work_list(qsl, sl, 2, 0, 1, 264, None, A.PG_MIN_SPLIT_TOKENS)
    assert A._slot_filled(items, 132, 200, 1.2, 8) is None          # more than one wave
    assert A._slot_filled(items, 132, 132, 1.2, 8) is None          # one CTA per SM, weighted
    items1, _, _ = A._work_list(qsl, sl, 2, 0, 1, 132, None, A.PG_MIN_SPLIT_TOKENS)
    out1, _, n1 = A._slot_filled(items1, 132, 132, 1.0, 8)            # … unweighted: the dual-ring grid
    assert len(out1) == 132 == n1
    unsplit = np.full(150, 100)                                        # nothing split
    it1, _, _ = A._work_list(np.arange(151), unsplit, 2, 0, 1, 264, None, A.PG_MIN_SPLIT_TOKENS)
    assert np.all(it1[:, 4] == -1) and A._slot_filled(it1, 132, 264, 1.2, 8) is None
    # fewer CTAs than SMs: filled up to the slots (B = 32 × 8k on 300 SMs: 600 parts)
    out, red, n_parts = A._slot_filled(items, 300, 600, 1.2, 8)
    assert len(out) == 600 == n_parts and red[:, 3].sum() == 600
    # a list that stays short (4 × 256 tokens: at most 2 parts each): nothing heavy
    it3, _, _ = A._work_list(np.arange(5), np.full(4, 256), 2, 0, 1, 264, None, A.PG_MIN_SPLIT_TOKENS)
    out3, _, _ = A._slot_filled(it3, 132, 264, 1.5, 8)
    assert len(out3) == 8 and len(set((out3[:, 3] - out3[:, 2]).tolist())) == 1
    monkeypatch.delenv("KVLAB_DECODE_SLOT_FILL", raising=False)
    assert A._slot_fill() == "1"
    for v in ("0", "2"):
        monkeypatch.setenv("KVLAB_DECODE_SLOT_FILL", v)
        assert A._slot_fill() == v
    monkeypatch.setenv("KVLAB_DECODE_SLOT_FILL", "yes")
    with pytest.raises(ValueError, match="KVLAB_DECODE_SLOT_FILL"):
        A._slot_fill()
    monkeypatch.delenv("KVLAB_DECODE_FILL_SLACK", raising=False)
    assert A._fill_slack() == A.PG_FILL_SLACK == 1
    monkeypatch.setenv("KVLAB_DECODE_FILL_SLACK", "3")
    assert A._fill_slack() == 3
    monkeypatch.setenv("KVLAB_DECODE_FILL_SLACK", "-1")
    with pytest.raises(ValueError, match="KVLAB_DECODE_FILL_SLACK"):
        A._fill_slack()


@pytest.mark.parametrize("seq_lens, pays", [([8192] * 32, False), ([131072], False), ([4096] * 64, False),
                                            ([300] * 40 + [60000] * 4, True), (list(range(2000, 32001, 2000)), True),
                                            ([5000, 300, 9000] * 3, True)])
def test_fill_pays_only_for_a_large_modelled_gain(seq_lens, pays):
    """The plan takes the filled list only when the model's longest part shrinks to
    PG_FILL_MIN_GAIN of the weighted list's: not for the uniform benchmark batches (measured
    slower on the H200, session 16), yes for ragged ones (measured 29-83 % faster)."""
    from kvlab.cuda import attention as A

    sl = np.asarray(seq_lens)
    items, _, _ = A._work_list(np.arange(len(sl) + 1), sl, 2, 0, 1, 264, None, A.PG_MIN_SPLIT_TOKENS)
    filled = A._slot_filled(items, 132, 264, 1.2, 8)
    assert filled is not None
    weighted = A._wave_weighted(items, 132, 264, 1.2)
    assert A._fill_pays(filled[0], weighted, 132, 1.2) == pays
    # the cheap bound never says no where filling pays
    assert A._fill_may_pay(weighted, 132, 264, 1.2) or not pays
    # the model itself, on a hand case: 3 rows of 32, 16 and 48 tiles, the first one on a fast slot
    hand = np.array([[0, 0, 0, 512, 0], [0, 0, 512, 768, 1], [0, 0, 768, 1536, 2]], np.int32)
    assert A._longest_part(hand, 1, 1.6) == 48.0 and A._longest_part(hand, 3, 1.6) == 30.0


# ---- the device rows of the work list (_item_meta, session 17): the paged decode kernel takes its
# sequence's metadata and its first chunks' blocks from them instead of three dependent loads
def _kernel_kv_tiles(row, qsl, sl, tpc, hpc, window):
    """kv_tiles of paged_attention.cu for one item, column by column as the kernel does."""
    seq, tok0, kv_lo, kv_hi = (int(x) for x in row[:4])
    qs, L = int(qsl[seq]), int(sl[seq])
    Lq = int(qsl[seq + 1]) - qs
    qpos = []
    for n in range(8):
        tok = tok0 + n // hpc
        qpos.append(L - Lq + tok if (n < tpc * hpc and tok < Lq) else -1)
    valid = [p for p in qpos if p >= 0]
    pmax, pmin = (max(valid), min(valid)) if valid else (-1, 2**31 - 1)
    lo, hi = kv_lo, min(kv_hi, pmax + 1)
    if window > 0:
        lo = max(lo, pmin - window + 1)
    lo16 = lo & ~15
    return lo16, ((hi - lo16 + 15) >> 4 if hi > lo16 else 0), bool(valid)


@pytest.mark.parametrize("window", [0, 1, 37, 700])
@pytest.mark.parametrize("hpc", [1, 4, 8])
@pytest.mark.parametrize("bs", [16, 32, 64])
def test_item_meta_matches_the_kernel(window, hpc, bs):
    """Every device row carries its sequence's query offset / length and KV length, the chunk
    start the kernel computes (kv_tiles, transcribed column by column above) and the blocks of its
    first ITEM_PRE chunks (-1 past its chunks); the host columns are unchanged. Ragged decode,
    prefill and chunked-prefill rows, splits forced and not, random block tables."""
    from kvlab.cuda import attention as A

    rng = np.random.default_rng(17 + window + 7 * hpc + bs)
    tpc = 8 // hpc
    qlen = np.array([1, 1, 5, 40, 1, 3, 1], np.int64)
    sl = np.array([1, 17, 90, 3000, 16, 2048, 777], np.int64)
    qsl = np.concatenate([[0], np.cumsum(qlen)])
    nblk = -(-sl // bs)
    bt = rng.integers(0, 10_000, size=(len(sl), int(nblk.max()) + 2)).astype(np.int32)
    for ns in (None, 3, 50):
        items, _, _ = A._work_list(qsl, sl, tpc, window, 1, 264, ns, 16 * 8)
        rows = A._item_meta(items, qsl, sl, bt, tpc, window, bs)
        assert rows.shape == (len(items), A.ITEM) and rows.dtype == np.int32
        assert np.array_equal(rows[:, :A.ITEM_HOST], items)
        for row, r in zip(items, rows):
            seq = int(row[0])
            assert (r[5], r[6], r[7]) == (qsl[seq], qsl[seq + 1] - qsl[seq], sl[seq])
            lo16, nch, valid = _kernel_kv_tiles(row, qsl, sl, tpc, hpc, window)
            if not valid:
                assert r[8] == -1 and np.all(r[12:] == -1)
                continue
            assert r[8] == lo16
            for j in range(A.ITEM_PRE):
                want = bt[seq, (lo16 + 16 * j) // bs] if j < nch else -1
                assert r[12 + j] == want, (row, j, r)
        # the plan's lists start every item at a chunk boundary of its own range
        assert np.all(rows[rows[:, 8] >= 0, 8] == rows[rows[:, 8] >= 0, 2])
    assert A._item_meta(np.zeros((0, A.ITEM_HOST), np.int32), qsl, sl, bt, tpc, window, bs).shape == (0, A.ITEM)


def test_host_and_kernel_constants_agree():
    """The work-list row width and its prefetched blocks are written on both sides
    (kvlab/cuda/attention.py, kernels_cu/paged_attention.cu): a change on one side only would make
    the kernels read the rows at the wrong stride or take blocks from the wrong columns."""
    import re

    from kvlab.cuda import attention as A
    from kvlab.cuda.loader import read_source

    src = read_source("paged_attention")
    assert int(re.search(r"constexpr int ITEM = (\d+);", src).group(1)) == A.ITEM
    assert int(re.search(r"constexpr int ITEM_PRE = (\d+);", src).group(1)) == A.ITEM_PRE
    assert A.ITEM * 4 % 16 == 0 and A.ITEM >= 12 + A.ITEM_PRE   # 16-byte rows; blocks at 12 …


def test_dual_split_staging_smem(h200, monkeypatch):
    """The dual-ring CTA's one q staging sits after both rings (the split staging, the default since
    session 19), so its shared memory is two rings plus ny · 8 · d · 2 bytes, and the deepest rings
    that fit are sized with it (nvfp4 at d = 128: 2 stages per ring, not 3); the joint-staging
    builds (_DUAL_JOINT_STAGING_MACROS) keep session 18's size; two CTAs per SM are unchanged."""
    A = h200
    monkeypatch.delenv("KVLAB_DECODE_PAGED_NBUF", raising=False)
    monkeypatch.delenv("KVLAB_NVRTC_OPTIONS", raising=False)
    assert A._dual_split_staging()
    stage = A.paged_stage_bytes(1, 128, 8)
    assert A.paged_smem_bytes(1, 128, 8, 8, 2, 2) == 2 * 2 * stage + 8 * 8 * 128 * 2
    base1 = A.paged_smem_bytes(1, 128, 8, 8, 2)
    monkeypatch.setenv("KVLAB_DECODE_PAGED_NBUF", "3")
    nbuf, _ = A._paged_buffers(2, 128, 8, 8, 0, 2)   # 3 stages per ring of 33,792 B still fit with it
    assert nbuf == 3 and A.paged_smem_bytes(2, 128, 8, 8, 3, 2) <= 227 * 1024 - 4096
    monkeypatch.setenv("KVLAB_DECODE_PAGED_NBUF", "4")
    assert A._paged_buffers(4, 128, 8, 8, 0, 2)[0] == 2   # nvfp4: 2 × 3 × 36,864 B + 16 KB do not fit
    monkeypatch.delenv("KVLAB_DECODE_PAGED_NBUF")
    for macro in A._DUAL_JOINT_STAGING_MACROS:
        monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", f"-lineinfo -D{macro}")
        assert not A._dual_split_staging()
        assert A.paged_smem_bytes(1, 128, 8, 8, 2, 2) == max(2 * 2 * stage, 2 * 8 * 8 * 128 * 4)
        assert A.paged_smem_bytes(1, 128, 8, 8, 2) == base1
    monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", "--define-macro=KVLAB_DECODE_DUAL_JOINT_STAGING")
    assert not A._dual_split_staging()   # the long form names the same macro
    monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", "-DKVLAB_DECODE_DUAL_JOINT_STAGINGX")
    assert A._dual_split_staging()


def test_dual_joint_staging_macros_match_the_kernel():
    """The switches that turn the split staging off are the ones the kernel's #if names."""
    import re
    from pathlib import Path

    from kvlab.cuda import attention as A

    src = (Path(A.__file__).resolve().parents[2] / "kernels_cu" / "paged_attention.cu").read_text()
    cond = re.search(r"#if (!defined\(KVLAB_DECODE_DUAL_JOINT_STAGING\).*?)\n#define KVLAB_DECODE_DUAL_SPLIT_STAGING",
                     src, re.S).group(1)
    assert sorted(re.findall(r"!defined\((\w+)\)", cond)) == sorted(A._DUAL_JOINT_STAGING_MACROS)


#: Session 21's H200 decode grid (benchmarks/latest/decode/results.md, 2026-12-01 03:32 UTC):
#: (format, batch, context, KV heads, head size, per_head ms, paged ms), both kernels measured
#: side by side in one run, block size 16, every sequence decoding one token.
AUTO_GRID_SESSION21 = [
    ("int8_per_token_head", 1, 1024, 8, 128, 0.0138, 0.0191),
    ("fp8_per_token_head", 1, 1024, 8, 128, 0.0139, 0.0186),
    ("int4_per_token_head", 1, 1024, 8, 128, 0.0137, 0.0168),
    ("nvfp4", 1, 1024, 8, 128, 0.0132, 0.0176),
    ("int8_per_token_head", 1, 8192, 8, 128, 0.0204, 0.0208),
    ("fp8_per_token_head", 1, 8192, 8, 128, 0.0201, 0.0204),
    ("int4_per_token_head", 1, 8192, 8, 128, 0.0179, 0.0176),
    ("nvfp4", 1, 8192, 8, 128, 0.0181, 0.0188),
    ("int8_per_token_head", 1, 32768, 8, 128, 0.0401, 0.0392),
    ("fp8_per_token_head", 1, 32768, 8, 128, 0.0397, 0.0391),
    ("int4_per_token_head", 1, 32768, 8, 128, 0.0315, 0.0304),
    ("nvfp4", 1, 32768, 8, 128, 0.0313, 0.0330),
    ("int8_per_token_head", 1, 131072, 8, 128, 0.1070, 0.0866),
    ("fp8_per_token_head", 1, 131072, 8, 128, 0.1067, 0.0857),
    ("int4_per_token_head", 1, 131072, 8, 128, 0.0724, 0.0580),
    ("nvfp4", 1, 131072, 8, 128, 0.0700, 0.0679),
    ("int8_per_token_head", 8, 1024, 8, 128, 0.0200, 0.0214),
    ("fp8_per_token_head", 8, 1024, 8, 128, 0.0197, 0.0211),
    ("int4_per_token_head", 8, 1024, 8, 128, 0.0173, 0.0182),
    ("nvfp4", 8, 1024, 8, 128, 0.0171, 0.0194),
    ("int8_per_token_head", 8, 8192, 8, 128, 0.0625, 0.0552),
    ("fp8_per_token_head", 8, 8192, 8, 128, 0.0625, 0.0548),
    ("int4_per_token_head", 8, 8192, 8, 128, 0.0459, 0.0381),
    ("nvfp4", 8, 8192, 8, 128, 0.0445, 0.0441),
    ("int8_per_token_head", 8, 32768, 8, 128, 0.2012, 0.1472),
    ("fp8_per_token_head", 8, 32768, 8, 128, 0.2015, 0.1454),
    ("int4_per_token_head", 8, 32768, 8, 128, 0.1264, 0.0894),
    ("nvfp4", 8, 32768, 8, 128, 0.1234, 0.1142),
    ("int8_per_token_head", 8, 131072, 8, 128, 0.7903, 0.5100),
    ("fp8_per_token_head", 8, 131072, 8, 128, 0.8067, 0.5065),
    ("int4_per_token_head", 8, 131072, 8, 128, 0.4946, 0.2830),
    ("nvfp4", 8, 131072, 8, 128, 0.4571, 0.3863),
    ("int8_per_token_head", 32, 1024, 8, 128, 0.0468, 0.0385),
    ("fp8_per_token_head", 32, 1024, 8, 128, 0.0464, 0.0396),
    ("int4_per_token_head", 32, 1024, 8, 128, 0.0331, 0.0299),
    ("nvfp4", 32, 1024, 8, 128, 0.0383, 0.0323),
    ("int8_per_token_head", 32, 8192, 8, 128, 0.2073, 0.1495),
    ("fp8_per_token_head", 32, 8192, 8, 128, 0.2024, 0.1476),
    ("int4_per_token_head", 32, 8192, 8, 128, 0.1250, 0.0922),
    ("nvfp4", 32, 8192, 8, 128, 0.1323, 0.1161),
    ("int8_per_token_head", 32, 32768, 8, 128, 0.7964, 0.5108),
    ("fp8_per_token_head", 32, 32768, 8, 128, 0.7979, 0.5085),
    ("int4_per_token_head", 32, 32768, 8, 128, 0.4964, 0.2834),
    ("nvfp4", 32, 32768, 8, 128, 0.4979, 0.3876),
    ("int8_per_token_head", 64, 1024, 8, 128, 0.0795, 0.0558),
    ("fp8_per_token_head", 64, 1024, 8, 128, 0.0788, 0.0552),
    ("int4_per_token_head", 64, 1024, 8, 128, 0.0433, 0.0392),
    ("nvfp4", 64, 1024, 8, 128, 0.0637, 0.0448),
    ("int8_per_token_head", 64, 8192, 8, 128, 0.4255, 0.2709),
    ("fp8_per_token_head", 64, 8192, 8, 128, 0.4235, 0.2697),
    ("int4_per_token_head", 64, 8192, 8, 128, 0.2288, 0.1570),
    ("nvfp4", 64, 8192, 8, 128, 0.2802, 0.2088),
    ("int8_per_token_head", 64, 32768, 8, 128, 1.6555, 0.9931),
    ("fp8_per_token_head", 64, 32768, 8, 128, 1.6514, 0.9910),
    ("int4_per_token_head", 64, 32768, 8, 128, 1.0515, 0.5372),
    ("nvfp4", 64, 32768, 8, 128, 1.1169, 0.7476),
    ("int8_per_token_head", 64, 4096, 8, 128, 0.2249, 0.1491),
    ("fp8_per_token_head", 64, 4096, 8, 128, 0.2218, 0.1469),
    ("int4_per_token_head", 64, 4096, 8, 128, 0.1208, 0.0911),
    ("nvfp4", 64, 4096, 8, 128, 0.1570, 0.1156),
    # the 9 / 3-head cells: session 24's grid (call 2), where the paged lists first fitted the
    # GPU's resident CTAs (ctas_per_sm; the int4 cells had a second wave before)
    ("int8_per_token_head", 1, 8192, 3, 64, 0.0147, 0.0127),
    ("fp8_per_token_head", 1, 8192, 3, 64, 0.0142, 0.0137),
    ("int4_per_token_head", 1, 8192, 3, 64, 0.0136, 0.0135),
    ("nvfp4", 1, 8192, 3, 64, 0.0124, 0.0121),
    ("int8_per_token_head", 1, 131072, 3, 64, 0.0367, 0.0350),
    ("fp8_per_token_head", 1, 131072, 3, 64, 0.0371, 0.0340),
    ("int4_per_token_head", 1, 131072, 3, 64, 0.0298, 0.0278),
    ("nvfp4", 1, 131072, 3, 64, 0.0297, 0.0292),
    ("int8_per_token_head", 32, 8192, 3, 64, 0.0531, 0.0495),
    ("fp8_per_token_head", 32, 8192, 3, 64, 0.0680, 0.0488),
    ("int4_per_token_head", 32, 8192, 3, 64, 0.0501, 0.0368),
    ("nvfp4", 32, 8192, 3, 64, 0.0485, 0.0385),
    ("int8_per_token_head", 1, 8192, 8, 64, 0.0155, 0.0174),
    ("fp8_per_token_head", 1, 8192, 8, 64, 0.0153, 0.0169),
    ("int4_per_token_head", 1, 8192, 8, 64, 0.0150, 0.0161),
    ("nvfp4", 1, 8192, 8, 64, 0.0145, 0.0161),
    ("int8_per_token_head", 1, 131072, 8, 64, 0.0687, 0.0559),
    ("fp8_per_token_head", 1, 131072, 8, 64, 0.0700, 0.0554),
    ("int4_per_token_head", 1, 131072, 8, 64, 0.0506, 0.0424),
    ("nvfp4", 1, 131072, 8, 64, 0.0490, 0.0468),
    ("int8_per_token_head", 32, 8192, 8, 64, 0.1319, 0.0911),
    ("fp8_per_token_head", 32, 8192, 8, 64, 0.1219, 0.0893),
    ("int4_per_token_head", 32, 8192, 8, 64, 0.0860, 0.0649),
    ("nvfp4", 32, 8192, 8, 64, 0.0818, 0.0730),
]


def test_auto_variant_where_measured():
    """``decode_variant="auto"`` (``_auto_wants_paged``, 132 SMs) against every cell of session 21's
    grid (its 9/3-head cells from session 24's): it picks the faster kernel, or loses at most 16 %
    and 2 µs — the six misses are listed (the shipped model's 9/3 heads at batch 1 × 8k, four
    formats, where paged is 0.7–15.7 % faster on a 12–15 µs call, and two cells within 2 %).
    Before session 21 the rule (sequences × KV heads only) picked
    per_head at batch 1–8 over long contexts, 13–75 % slower (e.g. int4 at 8 × 128k: 0.4946 ms
    against 0.2830)."""
    from kvlab.cuda import attention as A

    misses = []
    for fmt, batch, ctx, hkv, d, t_ph, t_pg in AUTO_GRID_SESSION21:
        paged = A._auto_wants_paged(fmt, d, hkv, np.full(batch, ctx), 0, 132)
        t, best = (t_pg if paged else t_ph), min(t_ph, t_pg)
        if t > best:
            misses.append((fmt, batch, ctx, hkv, d))
            assert t / best - 1 <= 0.16 and (t - best) * 1e3 <= 2.05, (fmt, batch, ctx, hkv, d, paged)
    assert sorted(misses) == sorted([
        ("int4_per_token_head", 1, 8192, 8, 128),                                    # +1.7 %
        ("int8_per_token_head", 1, 8192, 3, 64), ("fp8_per_token_head", 1, 8192, 3, 64),
        ("int4_per_token_head", 1, 8192, 3, 64), ("nvfp4", 1, 8192, 3, 64),         # +0.7 … +15.7 %
        ("nvfp4", 1, 131072, 3, 64),                                                 # +1.7 %
    ])
    # the old rule's worst cells now go to the paged kernel
    assert A._auto_wants_paged("int4_per_token_head", 128, 8, np.full(8, 131072), 0, 132)
    assert A._auto_wants_paged("nvfp4", 128, 8, np.full(32, 8192), 0, 132)


def test_auto_variant_rule_edges():
    """The rows rule counts what a decode attends to: a sliding window caps each sequence's
    span; no decode sequence (prefill only) and formats without a paged rule stay per_head."""
    from kvlab.cuda import attention as A

    rows = A.AUTO_PAGED_MIN_ROWS["int8_per_token_head"]
    assert A._auto_wants_paged("int8_per_token_head", 128, 8, [rows // 8], 0, 132)
    assert not A._auto_wants_paged("int8_per_token_head", 128, 8, [rows // 8 - 1], 0, 132)
    assert not A._auto_wants_paged("int8_per_token_head", 128, 8, [rows], 4096, 132)   # 8 × 4096 rows
    assert A._auto_wants_paged("int8_per_token_head", 128, 8, [4096] * 4, 4096, 132)
    assert not A._auto_wants_paged("int8_per_token_head", 128, 8, np.zeros(0, np.int64), 0, 132)
    assert not A._auto_wants_paged("auto", 128, 8, [1 << 20] * 64, 0, 132)
    # the sequences rule alone: 17 sequences × 8 KV heads ≥ 132 SMs, whatever their length
    assert A._auto_wants_paged("nvfp4", 128, 8, [16] * 17, 0, 132)
    assert not A._auto_wants_paged("nvfp4", 128, 8, [16] * 16, 0, 132)
    # int4, d = 64, 3 KV heads, one long sequence: paged since session 24 (its list fits the GPU),
    # as with 8 KV heads
    assert A._auto_wants_paged("int4_per_token_head", 64, 3, [131072], 0, 132)
    assert A._auto_wants_paged("int4_per_token_head", 64, 8, [131072], 0, 132)


def test_paged_attention_plan_cache(monkeypatch):
    """``paged_attention``'s plan cache (``_cached_plan``), its device parts faked (the arrays are
    NumPy arrays posing as CuPy ones, the planner counts its calls): equal index contents and
    arguments reuse a plan — new array objects included —; a changed block-table entry, KV length,
    query shape, scale, stream or ``KVLAB_*`` variable plans again; a tensor-like scale is never
    cached; the cache keeps the ``PLAN_CACHE_SIZE`` most recently used plans.
    (tests/gpu/test_paged_attention_gpu.py, test_plan_cache_follows_the_index_arrays: the same on
    the GPU, outputs against float64.)"""
    from kvlab.cuda import attention as A

    made = []

    def fake_plan(q, kv, bt, sl, qsl, *args, host_index=None, **kw):
        assert host_index is not None and np.array_equal(host_index[2], bt)   # no second copy
        made.append(object())
        return made[-1]

    stream = [7]
    monkeypatch.setattr(A, "plan_paged_attention", fake_plan)
    monkeypatch.setattr(A.arrays, "kind", lambda x: "cupy")
    monkeypatch.setattr(A.arrays, "device_id", lambda x: 0)
    monkeypatch.setattr(A.arrays, "to_host_many", lambda *xs: [np.array(x) for x in xs])
    monkeypatch.setattr(A.L, "stream_ptr", lambda x: stream[0])
    monkeypatch.delenv("KVLAB_DECODE_PAGED_DUAL", raising=False)
    A.clear_plan_cache()
    rng = np.random.default_rng()
    q = np.zeros((3, 8, 64), np.float16)
    kv = np.zeros((40, 2, 16, 2, 64), np.float16)
    bt = rng.permutation(40).astype(np.int32)[:36].reshape(3, 12)
    sl = rng.integers(1, 190, 3).astype(np.int32)
    qsl = np.arange(4, dtype=np.int32)
    args = ("auto", None, 1.0, 1.0, None)
    kw = dict(decode_variant=None, prefill_variant=None)

    def plan(q=q, bt=bt, sl=sl, args=args):
        return A._cached_plan(q, kv, bt, sl, qsl, args, kw)

    p0 = plan()
    assert plan() is p0 and plan(bt=bt.copy(), sl=sl.copy()) is p0 and len(made) == 1
    bt2 = bt.copy()
    bt2[1, 0] = bt[2, 5]
    p1 = plan(bt=bt2)
    assert p1 is not p0
    sl2 = sl.copy()
    sl2[0] += 1
    p2 = plan(sl=sl2)
    assert p2 not in (p0, p1) and plan() is p0 and plan(bt=bt2) is p1 and len(made) == 3
    assert plan(q=np.zeros((3, 8, 64), np.float32)) not in (p0, p1, p2)          # dtype
    assert plan(args=("auto", None, 0.5, 1.0, None)) is made[-1] and len(made) == 5   # k_scale
    stream[0] = 8
    assert plan() is made[-1] and len(made) == 6
    stream[0] = 7
    monkeypatch.setenv("KVLAB_DECODE_PAGED_DUAL", "1")
    assert plan() is made[-1] and len(made) == 7
    monkeypatch.delenv("KVLAB_DECODE_PAGED_DUAL")
    assert plan() is p0 and len(made) == 7
    # a scale that is not a plain number (could change in place): planned every time, not kept
    n = len(A._PLAN_CACHE)
    odd = ("auto", None, np.ones(1), 1.0, None)
    assert plan(args=odd) is not plan(args=odd) and len(A._PLAN_CACHE) == n
    # bounded, least recently used out first: p0 (used last) and SIZE - 1 newer plans fit ...
    assert plan() is p0
    for k in range(A.PLAN_CACHE_SIZE - 1):
        plan(args=("auto", None, 1.0, 2.0 + k, None))
    assert plan() is p0 and len(A._PLAN_CACHE) == A.PLAN_CACHE_SIZE
    # ... SIZE newer ones push it out
    for k in range(A.PLAN_CACHE_SIZE):
        plan(args=("auto", None, 1.0, 20.0 + k, None))
    assert len(A._PLAN_CACHE) == A.PLAN_CACHE_SIZE and plan() is not p0
    A.clear_plan_cache()
    assert not A._PLAN_CACHE


def test_launch_ex_packs_arguments(monkeypatch):
    """``launch.launch_ex`` (the dependent merge launch and the ring probe's tensor mode) hands the
    driver one pointer per argument into a single buffer: 8-byte slots for scalars, a 64-byte
    aligned slot for a struct (a tensor map), the values intact; a dependent launch carries the
    programmatic-serialization attribute, a plain one none. Wrong arguments are refused before
    any driver call."""
    import ctypes
    from types import SimpleNamespace

    import cupy

    from kvlab.cuda import launch as L

    seen = {}

    def fake_launch(cfg, func, params, extra):
        c = cfg._obj
        seen["attrs"] = c.numAttrs
        seen["grid"] = (c.gridDimX, c.gridDimY, c.gridDimZ)
        seen["vals"] = [ctypes.string_at(params[i], n) for i, n in enumerate((8, 4, 4, 128))]
        seen["struct_align"] = (params[3] - params[0]) % 64
        return 0

    monkeypatch.setattr(L, "_cu_launch_kernel_ex", lambda: fake_launch)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: SimpleNamespace(ptr=0))
    rng = np.random.default_rng()
    tmap = rng.integers(0, 256, 128, dtype=np.uint8).tobytes()
    p, i, f = np.uint64(rng.integers(1, 2**63)), np.int32(rng.integers(-2**31, 2**31)), np.float32(rng.normal())
    kernel = SimpleNamespace(ptr=1)
    for dependent in (False, True):
        L.launch_ex(kernel, (3, 2), (64,), (p, i, f, tmap), dependent=dependent)
        assert seen["attrs"] == int(dependent) and seen["grid"] == (3, 2, 1)
        assert seen["vals"] == [p.tobytes(), i.tobytes(), f.tobytes(), tmap] and seen["struct_align"] == 0
    with pytest.raises(TypeError, match="at most 8 bytes"):
        L.launch_ex(kernel, (1,), (32,), (np.zeros(2),))
    with pytest.raises(TypeError, match="at most 8 bytes"):
        L.launch_ex(kernel, (1,), (32,), (5,))


def test_wave_weight_by_format(monkeypatch):
    """The first-wave weight (``_wave_weight``): nvfp4's own at d = 128 (``PG_WAVE_WEIGHT_FMT``)
    where its split parts average at least the rule's tiles (B = 32 × 8k, batch 1 × 128k), the
    common ``PG_WAVE_WEIGHT`` for short parts (batch 1 × 32k, measured slower with nvfp4's
    weight), for the other formats and for nvfp4 at d = 64 (not measured); ``KVLAB_DECODE_WAVE_WEIGHT`` wins over both. The plan's list carries
    the weight it was cut with, and its heavy parts are that many times as long."""
    from kvlab.cuda import attention as A

    monkeypatch.delenv("KVLAB_DECODE_WAVE_WEIGHT", raising=False)
    monkeypatch.delenv("KVLAB_DECODE_SLOT_FILL", raising=False)
    w4, tmin = A.PG_WAVE_WEIGHT_FMT[4, 128]
    assert w4 != A.PG_WAVE_WEIGHT

    def lst(B, L, code, d=128):
        return A._paged_list(np.arange(B + 1), np.full(B, L), 2, 0, 264, None, 1, 132, (code, d))

    for B, L, want in ((32, 8192, w4), (1, 131072, w4), (1, 32768, A.PG_WAVE_WEIGHT)):
        items = A._work_list(np.arange(B + 1), np.full(B, L), 2, 0, 1, 264, None, A.PG_MIN_SPLIT_TOKENS)[0]
        assert (A._row_tiles(items).mean() >= tmin) == (want == w4)
        got = lst(B, L, 4)
        assert got[3] == want
        t = A._row_tiles(got[0])
        assert t[:132].max() / t[132:].min() == pytest.approx(want, rel=0.1)   # heavy parts first
        assert lst(B, L, 3)[3] == lst(B, L, 4, 64)[3] == A.PG_WAVE_WEIGHT   # int4; nvfp4 at d = 64
        assert A._paged_list(np.arange(B + 1), np.full(B, L), 2, 0, 264, None, 1, 132)[3] == A.PG_WAVE_WEIGHT
    monkeypatch.setenv("KVLAB_DECODE_WAVE_WEIGHT", "1.3")
    assert lst(32, 8192, 4)[3] == lst(32, 8192, 3)[3] == 1.3


def test_wave_weight_keys_have_no_dual_rule():
    """A (format, head size) with its own first-wave weight has no dual-ring rule:
    ``_dual_default`` models the two-per-SM list at ``PG_WAVE_WEIGHT``, so the two must not meet."""
    from kvlab.cuda import attention as A

    assert not {k[:2] for k in A.PG_DUAL_DEFAULT} & set(A.PG_WAVE_WEIGHT_FMT)


# CTAs per SM (ctas_per_sm), hand-computed: warp registers = regs · 32 rounded up to 256; each of
# the 4 sub-partitions holds 16384 // warp_regs warps; CTAs = 4 · that // warps (then shared
# memory with 1 KB reserved per CTA, 2048 threads, 32 CTAs).
@pytest.mark.parametrize("regs, warps, smem, expect", [
    (106, 3, 30_000, 5),      # 3584-register warps: 4 per sub-partition, 16 // 3 = 5 (the SM's 65536 // 10752 = 6 is wrong)
    (93, 3, 0, 6),            # 3072: 5 per sub-partition, 20 // 3 = 6 (the SM's quotient says 7)
    (128, 8, 60_000, 2),      # 4096: 4 per sub-partition, 16 // 8 = 2
    (128, 16, 151_552, 1),    # the dual-ring CTA at d = 128
    (114, 6, 40_000, 2),      # 3840: 4 per sub-partition, 16 // 6 = 2
    (32, 4, 102_400, 2),      # shared memory: 233472 // (102400 + 1024) = 2
    (16, 32, 0, 2),           # threads: 2048 // 1024
    (16, 1, 0, 32),           # the CTA cap (registers would allow 128, threads 64)
    (255, 32, 0, 1),          # nothing fits by registers: still one CTA (a launch would fail, not the plan)
])
def test_ctas_per_sm(regs, warps, smem, expect):
    from kvlab.cuda.attention import ctas_per_sm

    assert ctas_per_sm(regs, warps, smem, 233_472) == expect


def test_ctas_per_sm_rejects_nonsense():
    from kvlab.cuda.attention import ctas_per_sm

    with pytest.raises(ValueError, match="warps_per_cta"):
        ctas_per_sm(100, 0, 0, 233_472)
    with pytest.raises(ValueError, match="regs_per_thread"):
        ctas_per_sm(0, 4, 0, 233_472)
