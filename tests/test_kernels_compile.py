"""Every kernel family compiles for sm_90 and sm_80 through NVRTC, no GPU needed (SPEC 4).

Memory-bound kernels that keep a head vector in registers must not spill: a spill would
add local-memory traffic to kernels whose whole budget is the bytes they move.

The wgmma prefill family (``paged_prefill_wgmma``) is registered for ``sm_90a`` only: it
compiles for that arch (``wgmma`` exists nowhere else), has no spills, and its SASS really
issues warpgroup MMAs (``HGMMA``) without ptxas serialising them (warning C7518/C7510).
"""
from __future__ import annotations

import re

import pytest

from kvlab.cli_check import TUNED_NVRTC  # the first NVRTC whose ptxas needs no spill allowance
from kvlab.cuda import loader
from kvlab.reference.hadamard import VLLM_SIGNS_512

pytest.importorskip("cupy")

#: families whose every instantiation must compile without spills
NO_SPILL_FAMILIES = ("hadamard", "reshape_and_cache", "dequantize_cache", "nibble")

#: The register bounds are tuned with NVRTC 13.5 (README's install resolves it when nothing pins
#: NVRTC), and under it nothing below spills. NVRTC 13.0 — the lent H200 host's, and what pip picks
#: beside torch's cu130 wheels, which pin it — spills in these, and only these (measured under
#: 13.0.88, docs/gpu-machine.md "Lessons of session 25"): (family, arch, name-expression prefix,
#: switch builds only) -> the most spill bytes (stores or loads) allowed. On the H200 / H100
#: (docs/perf-notes.md "Session 26") the int4 write built by 13.0 is 0.8 % slower than 13.5's
#: spill-free one and 2.2 % faster than a spill-free 13.0 build at 2 blocks per SM, so its bound
#: stays; nvfp4's dual-ring decode at d = 128 is not what the default plan launches (two CTAs per
#: SM); the wgmma rows are A/B switch builds (the default build does not spill under 13.0). Any
#: other spill, or a larger one, fails under every NVRTC.
OLDER_NVRTC_SPILLS = {
    ("reshape_and_cache", "sm_90", "reshape_and_cache<3, ", False): 44,   # int4 write, 80 registers
    ("paged_attention", "sm_90", "paged_attention_decode_paged<4, 128, ", False): 32,   # nvfp4 dual ring
    ("paged_prefill_wgmma", "sm_90a", "paged_attention_prefill_wgmma<", True): 56,
}


def spill_allowance(family: str, arch: str, name_expression: str, options: str,
                    nvrtc_version: tuple | None = None) -> int:
    """Spill bytes an instantiation may have: 0, or OLDER_NVRTC_SPILLS' bound under an NVRTC older
    than TUNED_NVRTC (``nvrtc_version`` defaults to the loaded NVRTC's)."""
    if nvrtc_version is None:
        from cupy.cuda import nvrtc

        nvrtc_version = tuple(nvrtc.getVersion())
    if tuple(nvrtc_version) >= TUNED_NVRTC:
        return 0
    for (fam, a, prefix, switch_only), most in OLDER_NVRTC_SPILLS.items():
        if (fam, a) == (family, arch) and name_expression.startswith(prefix) and (options.strip() or not switch_only):
            return most
    return 0


def spills_beyond_allowance(reports, family: str, arch: str, options: str = "") -> list:
    """(name, registers, spill stores, spill loads, stack) of every report that spills (or has a
    stack frame) more than :func:`spill_allowance` lets it."""
    return [(r.name_expression, r.registers, r.spill_stores, r.spill_loads, r.stack_frame) for r in reports
            if max(r.spill_stores, r.spill_loads, r.stack_frame)
            > spill_allowance(family, arch, r.name_expression, options)]


def test_spill_allowance_is_only_for_older_nvrtc():
    """The allowance needs NVRTC < 13.5, the named kernels, and (for the wgmma prefill) a switch
    build; everything else gets none."""
    int4_write = "reshape_and_cache<3, 128, __half, false>"
    assert spill_allowance("reshape_and_cache", "sm_90", int4_write, "", (13, 0)) == 44
    assert spill_allowance("reshape_and_cache", "sm_90", int4_write, "", (13, 5)) == 0
    assert spill_allowance("reshape_and_cache", "sm_90", int4_write, "", (14, 0)) == 0
    assert spill_allowance("reshape_and_cache", "sm_80", int4_write, "", (13, 0)) == 0
    assert spill_allowance("reshape_and_cache", "sm_90", "reshape_and_cache<2, 128, __half, false>", "", (13, 0)) == 0
    assert spill_allowance("paged_attention", "sm_90", "paged_attention_decode_paged<4, 128, __half, 2>", "", (13, 0)) == 32
    assert spill_allowance("paged_attention", "sm_90", "paged_attention_decode_paged<3, 128, __half, 2>", "", (13, 0)) == 0
    wg = "paged_attention_prefill_wgmma<3, 128, __half>"
    assert spill_allowance("paged_prefill_wgmma", "sm_90a", wg, "", (13, 0)) == 0   # the default build
    assert spill_allowance("paged_prefill_wgmma", "sm_90a", wg, "-DKVLAB_WGMMA_ROWGROUP", (13, 0)) == 56
    assert spill_allowance("paged_prefill_wgmma", "sm_90a", wg, "-DKVLAB_WGMMA_ROWGROUP", (13, 5)) == 0
    # and the filter: a report within its allowance passes, one byte more fails, a stack frame counts
    from cupy.cuda import nvrtc

    rep = loader.CompileReport("reshape_and_cache", "sm_90", int4_write, 80, 44, 40, 40, 0)
    if tuple(nvrtc.getVersion()) < TUNED_NVRTC:
        assert spills_beyond_allowance([rep], "reshape_and_cache", "sm_90") == []
        rep.spill_loads = 45
    assert spills_beyond_allowance([rep], "reshape_and_cache", "sm_90") != []
    # a stack frame without spills counts too, and no kernel outside the list gets any allowance
    stack_only = loader.CompileReport("reshape_and_cache", "sm_90", int4_write, 80, 0, 0, 48, 0)
    assert spills_beyond_allowance([stack_only], "reshape_and_cache", "sm_90") != []
    other = loader.CompileReport("hadamard", "sm_90", "rht<128>", 40, 4, 4, 4, 0)
    assert spills_beyond_allowance([other], "hadamard", "sm_90") != []


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("family", ["hadamard", "reshape_and_cache", "dequantize_cache"])
def test_family_compiles(family, arch):
    reports = loader.compile_family_offline(family, arch)
    specs = loader.FAMILIES[family]
    assert {r.name_expression for r in reports} == {s.name_expression() for s in specs}
    if family in NO_SPILL_FAMILIES:
        spills = spills_beyond_allowance(reports, family, arch)
        assert not spills, f"{family} spills on {arch}: {spills}"


@pytest.mark.parametrize("family", ["hadamard", "reshape_and_cache", "dequantize_cache"])
def test_write_path_families_are_registered(family):
    """The loader finds each write-path .cu file's family module and its instantiation list."""
    assert family in loader.all_families()
    assert loader._ensure_family(family)


def test_rht_sign_table_is_vllms():
    """The __constant__ sign bits in hadamard.cuh are exactly VLLM_SIGNS_512 (bit i = sign i is -1)."""
    text = (loader.kernels_dir() / "hadamard.cuh").read_text()
    bodies = re.findall(r"kRhtNegBits(?:Const)?\[16\]\s*=\s*\{([^}]*)\}", text)
    assert len(bodies) == 2, "both the __constant__ and the constexpr table"
    for body in bodies:
        words = [int(w.strip().rstrip("u"), 16) for w in body.split(",") if w.strip()]
        assert len(words) == 16
        signs = "".join("-" if (words[i // 32] >> (i % 32)) & 1 else "+" for i in range(512))
        assert signs == VLLM_SIGNS_512


def test_write_family_covers_every_format_and_head_size():
    from kvlab.cuda import cache

    exprs = {s.name_expression() for s in cache.WRITE_SPECS}
    for fid in cache.FORMAT_IDS.values():
        for d in cache.HEAD_SIZES:
            for ct in ("__nv_bfloat16", "__half", "float"):
                assert f"reshape_and_cache<{fid}, {d}, {ct}, false>" in exprs


def test_wgmma_prefill_family_is_sm90a_only():
    from kvlab.cuda import attention  # noqa: F401  (registers the families)

    assert loader.family_arch("paged_prefill_wgmma") == "sm_90a"
    assert loader.family_archs("paged_prefill_wgmma", ("sm_90", "sm_80")) == ("sm_90a",)
    assert loader.family_archs("paged_prefill", ("sm_90", "sm_80")) == ("sm_90", "sm_80")
    with pytest.raises(ValueError, match="sm_90a only"):
        loader.compile_family_offline("paged_prefill_wgmma", "sm_90")


def _family_sass(family, exprs, arch, extra=()):
    """(compile log, nvdisasm text or None) of the given instantiations of ``family``, built for ``arch``
    with the loader's options (``KVLAB_NVRTC_OPTIONS`` included) and ``extra``."""
    cubin, _, log = loader.offline_cubin(family, exprs, arch, extra)
    return log, loader.disassemble(cubin)


def _wgmma_sass(exprs):
    """(ptxas log, nvdisasm text or None) of the given wgmma prefill instantiations, built with the
    loader's options (``KVLAB_NVRTC_OPTIONS`` included)."""
    return _family_sass("paged_prefill_wgmma", exprs, "sm_90a", ("--ptxas-options=-v",))


@pytest.mark.parametrize("options", ["", "-DKVLAB_WGMMA_WS_STAGES=2", "-DKVLAB_WGMMA_WS_STAGES=3",
                                     "-DKVLAB_WGMMA_WS_NO_PINGPONG", "-DKVLAB_WGMMA_NO_PRODUCER_AHEAD",
                                     "-DKVLAB_WGMMA_NO_PRODUCER_AHEAD -DKVLAB_WGMMA_WS_STAGES=2",
                                     "-DKVLAB_WGMMA_PRODUCER_AHEAD", "-DKVLAB_WGMMA_ROWGROUP",
                                     "-DKVLAB_WGMMA_NO_ROWGROUP -DKVLAB_WGMMA_NO_SCALES_CF",
                                     "-DKVLAB_WGMMA_ROWGROUP -DKVLAB_WGMMA_NO_PRODUCER_AHEAD",
                                     "-DKVLAB_WGMMA_RAW_SETS=3",
                                     "-DKVLAB_WGMMA_S_FIRST -DKVLAB_PF_NO_PACKED_DECODE",
                                     "-DKVLAB_WGMMA_NO_KSC_EARLY", "-DKVLAB_WGMMA_VSC_EARLY",
                                     "-DKVLAB_WGMMA_TREE_REDUCE", "-DKVLAB_PF_NO_NVFP4_SCALE_WORDS",
                                     "-DKVLAB_WGMMA_KV_PRESCALE", "-DKVLAB_WGMMA_NO_KV_PRESCALE",
                                     "-DKVLAB_WGMMA_V_PRESCALE"])
def test_wgmma_prefill_compiles_without_spills(monkeypatch, options):
    """The warp-specialised wgmma prefill (kernels_cu/paged_prefill_wgmma.cu), default build (the
    producer two tiles ahead since session 9, row-group loads for int4 and auto and the conflict-free
    scale order since session 13) and its switches (-DKVLAB_WGMMA_NO_PRODUCER_AHEAD: the old one-tile
    producer; -DKVLAB_WGMMA_PRODUCER_AHEAD names the default; -DKVLAB_WGMMA_ROWGROUP /
    -DKVLAB_WGMMA_NO_ROWGROUP: row-group loads for every format / none; -DKVLAB_WGMMA_NO_SCALES_CF:
    the old scale order; session 14: -DKVLAB_WGMMA_S_FIRST, the old producer decode
    -DKVLAB_PF_NO_PACKED_DECODE, the K scales after the wait -DKVLAB_WGMMA_NO_KSC_EARLY, the V scales
    early -DKVLAB_WGMMA_VSC_EARLY, the softmax's tree reductions -DKVLAB_WGMMA_TREE_REDUCE, nvfp4's
    scale bytes one by one -DKVLAB_PF_NO_NVFP4_SCALE_WORDS; session 15: int4's K and V scaled in the
    producer, -DKVLAB_WGMMA_KV_PRESCALE, now the default, -DKVLAB_WGMMA_NO_KV_PRESCALE, and session 13's
    V half alone, -DKVLAB_WGMMA_V_PRESCALE): every instantiation
    compiles for sm_90a with no spills and no stack, at exactly the 168 registers
    __launch_bounds__(384, 1) gives (setmaxnreg moves registers inside that pool: the kernel's
    producer/consumer counts are computed from 168)."""
    from kvlab.cuda import attention  # noqa: F401

    monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", options)
    reports = loader.compile_family_offline("paged_prefill_wgmma")
    specs = loader.FAMILIES["paged_prefill_wgmma"]
    assert {r.name_expression for r in reports} == {s.name_expression() for s in specs}
    bad = spills_beyond_allowance(reports, "paged_prefill_wgmma", "sm_90a", options)
    bad += [(r.name_expression, r.registers) for r in reports if r.registers != 168]
    assert not bad, f"paged_prefill_wgmma {options}: {bad}"


def _wgmma_raw_sets(fmt: int, options: str) -> int:
    """Raw register sets of the producer (kernels_cu/paged_prefill_wgmma.cu: ws_raw_sets): 2;
    -DKVLAB_WGMMA_RAW_SETS=N for every raw-loading format (3: measured in session 13, not adopted)."""
    m = re.search(r"KVLAB_WGMMA_RAW_SETS=(\d)", options)
    return int(m.group(1)) if m and fmt != 0 else 2


def _wgmma_rowgroup(fmt: int, options: str) -> bool:
    """Row-group producer loads (ws_rowgroup): int4 and auto by default."""
    if "NO_ROWGROUP" in options:
        return False
    return "KVLAB_WGMMA_ROWGROUP" in options or fmt in (0, 3)


def _wgmma_producer_regs(fmt: int, d: int, ahead: bool, options: str = "") -> int:
    """setmaxnreg of the producer warpgroup (kernels_cu/paged_prefill_wgmma.cu: ws_producer_regs):
    auto 56 (cp.async, no raw registers); two raw sets 80, 104 for int8/fp8 at d = 128 (88 / 112 with
    row-group loads, the default for int4); three sets (-DKVLAB_WGMMA_RAW_SETS=3) 104, 136 for
    int8/fp8 at d = 128; -DKVLAB_WGMMA_NO_PRODUCER_AHEAD 56, 72 for int8/fp8 at d = 128."""
    wide = d == 128 and fmt in (1, 2)
    if not ahead:
        return 72 if wide else 56
    if fmt == 0:
        return 56
    if _wgmma_raw_sets(fmt, options) == 3:
        return 136 if wide else 104
    if _wgmma_rowgroup(fmt, options):
        return 112 if wide else 88
    return 104 if wide else 80


def _wgmma_sass_functions(monkeypatch, options, bad_log):
    """(fmt, d, SASS text) of every paged_prefill_wgmma instantiation built with
    ``KVLAB_NVRTC_OPTIONS=options``, after checking that ptxas printed none of ``bad_log`` (skips
    without nvdisasm)."""
    from kvlab.cuda import attention  # noqa: F401

    monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", options)
    exprs = [s.name_expression() for s in loader.FAMILIES["paged_prefill_wgmma"]]
    log, sass = _wgmma_sass(exprs)
    for bad in bad_log:
        assert bad not in log, log
    if sass is None:
        pytest.skip("nvdisasm not installed (pip nvidia-cuda-nvdisasm)")
    funcs = re.split(r"\n\s*\.text\.", sass)[1:]
    assert len(funcs) == len(exprs)
    out = []
    for f in funcs:
        m = re.match(r"_Z\d+paged_attention_prefill_wgmmaILi(\d)ELi(\d+)E", f)
        out.append((int(m.group(1)), int(m.group(2)), f))
    return out


def _assert_register_split(f, fmt, d, ahead, options=""):
    """The producer's setmaxnreg (_wgmma_producer_regs) and the consumers' share of the 3 · 168 pool."""
    prod = _wgmma_producer_regs(fmt, d, ahead, options)
    assert f"USETMAXREG.DEALLOC.CTAPOOL {hex(prod)}" in f, (fmt, d)
    assert f"USETMAXREG.TRY_ALLOC.CTAPOOL UP0, {hex(((3 * 168 - prod) // 2) & ~7)}" in f, (fmt, d)


@pytest.mark.parametrize("options", ["", "-DKVLAB_WGMMA_NO_PRODUCER_AHEAD", "-DKVLAB_WGMMA_ROWGROUP",
                                     "-DKVLAB_WGMMA_NO_ROWGROUP -DKVLAB_WGMMA_NO_SCALES_CF",
                                     "-DKVLAB_WGMMA_S_FIRST"])
def test_wgmma_prefill_sass(monkeypatch, options):
    """The default build, -DKVLAB_WGMMA_NO_PRODUCER_AHEAD, row-group loads for every format and the
    session-12 build (no row groups, old scale order) really issue warpgroup MMAs: no ptxas
    warning (wgmma serialised: C7518/C7510; setmaxnreg ignored), the register moves are in the
    SASS (_wgmma_producer_regs: default producer 80 or 104, 88 for int4's row-group loads, consumers
    208 or 200, auto 56 / 224; NO_PRODUCER_AHEAD: producer 56 or 72, consumers 224 or 216), every
    instantiation issues its HGMMAs (d = 128 per branch of the
    consumer loop: P·V + S, P·V only, S only), the mbarrier ring and the ping-pong handshakes are
    there, and the session-8 consumer loop (docs/notes-prefill-wgmma.md, "Session 8 candidate"):
    the lazy softmax's warp vote, and the wgmma descriptors built in uniform registers, i.e. no
    R2UR between the first wgmma fence and the last wgmma wait at d = 128 (session 7's loop moved
    80 descriptor words there per loop body)."""
    bad_log = ("C7518", "C7510", "serialized", "setmaxnreg", "arning")
    for fmt, d, f in _wgmma_sass_functions(monkeypatch, options, bad_log):
        _assert_register_split(f, fmt, d, ahead="NO_PRODUCER_AHEAD" not in options, options=options)
        hg = re.findall(r"HGMMA\.(64x\d+x16)\.F32[^;]*;", f)
        pv = [h for h in re.findall(r"HGMMA\.64x\d+x16\.F32[^;]*;", f) if ".tnspB" in h]
        # P·V (B = V transposed, n = d) + S (n = 64 tokens) in the P·V + S and the P·V-only
        # branch, S in the S-only branch: 2·4 P·V steps and 2·(d/16) S steps (-DKVLAB_WGMMA_S_FIRST:
        # the same steps, S first in the first branch)
        assert len(pv) == 2 * 4 and all(f"64x{d}x16" in h for h in pv), (fmt, d, pv)
        assert len(hg) - len(pv) == 2 * (d // 16) and hg.count("64x64x16") >= 2 * (d // 16), (fmt, d, hg)
        assert "SYNCS.PHASECHK.TRANS64.TRYWAIT" in f and "SYNCS.ARRIVE.TRANS64" in f
        assert "VOTE.ANY" in f and "BAR.ARV" in f  # the lazy max's vote, the ping-pong handshakes
        # the 4-lane query prologue / epilogue move whole 16-byte chunks when q / out allow it
        # (element-wise 16-bit accesses there cost ~0.1 ms at the benchmark shape, session 8)
        assert "LDG.E.128.CONSTANT" in f and "STG.E.128" in f, (fmt, d)
        region = f[f.index("WARPGROUP.ARRIVE"):f.rindex("WARPGROUP.DEPBAR")]
        r2ur = region.count("R2UR")
        assert r2ur == 0 if d == 128 else r2ur <= 24, (fmt, d, r2ur)


@pytest.mark.parametrize("options", ["", "-DKVLAB_WGMMA_PRODUCER_AHEAD", "-DKVLAB_WGMMA_NO_PRODUCER_AHEAD",
                                     "-DKVLAB_WGMMA_RAW_SETS=2", "-DKVLAB_WGMMA_RAW_SETS=3",
                                     "-DKVLAB_PF_NO_NVFP4_SCALE_WORDS"])
def test_wgmma_prefill_producer_ahead_sass(monkeypatch, options):
    """Producer ahead (the default since session 9, also named by -DKVLAB_WGMMA_PRODUCER_AHEAD;
    docs/notes-prefill-wgmma.md, "Session 9 candidate" and "Session 9: measured on the H200"): no
    ptxas warning (wgmma serialised, setmaxnreg ignored); the register split of _wgmma_producer_regs
    (producer 80 / 104 for int8/fp8 at d = 128, 88 for int4's row-group loads, auto 56); every
    raw-loading format's producer has two raw register sets in flight: its main loop waits on two
    empty barriers per pass (the loop unrolled by two) and issues the raw loads of two tiles before
    its first wait (tiles 0 and 1 leave together). -DKVLAB_WGMMA_RAW_SETS=3 (session 13, not
    adopted): three sets, the raw loads of three tiles before the first wait.
    -DKVLAB_WGMMA_NO_PRODUCER_AHEAD (the old producer, for A/B): 56 / 72 and the raw loads of one
    tile only before the first wait."""
    ahead = "NO_PRODUCER_AHEAD" not in options
    bad_log = ("C7518", "C7510", "C7515", "serialized", "setmaxnreg", "arning")
    for fmt, d, f in _wgmma_sass_functions(monkeypatch, options, bad_log):
        _assert_register_split(f, fmt, d, ahead, options)
        if fmt == 0:
            continue
        producer = f[f.index("USETMAXREG.DEALLOC"):]  # the producer's code follows the consumers'
        ldg_before = len(re.findall(r"LDG\.E[^;]*;", producer[:producer.index("SYNCS.PHASECHK")]))
        # raw loads of one set: int8 / fp8 2 * d/8 words + 2 parameter words, int4 2 * d/16 + 4
        # (LDG.32: rows are 4-byte aligned; row-group loads, the default for int4: two rows per lane,
        # two parameter words per side), nvfp4 2 * d/64 LDG.128 + 2 * d/32 scale bytes, or since
        # session 14 (KVLAB_PF_NVFP4_SCALE_WORDS) one scale word per side plus the d/32 byte loads of
        # the swizzled-V branch
        nv_scales = 2 + d // 32 if "NO_NVFP4_SCALE_WORDS" not in options else 2 * (d // 32)
        per_set = {1: 2 * (d // 8) + 2, 2: 2 * (d // 8) + 2, 3: 2 * (d // 16) + 4, 4: 2 * (d // 64) + nv_scales}[fmt]
        if ahead:
            sets = _wgmma_raw_sets(fmt, options)
            assert sets * per_set <= ldg_before < (sets + 1) * per_set, (fmt, d, sets, ldg_before)
            assert producer.count("SYNCS.PHASECHK") >= 2 and producer.count("SYNCS.ARRIVE.TRANS64") >= 2, (fmt, d)
        else:
            assert per_set <= ldg_before < 2 * per_set, (fmt, d, ldg_before)


def _consumer_loop_first_pass(f):
    """The consumers' tile loop of one instantiation's SASS, from the first full-barrier wait to the
    last wgmma wait of the first loop pass (P·V + S branch, then the two single branches)."""
    start = f.index("SYNCS.PHASECHK.TRANS64.TRYWAIT")
    return f[start:]


def test_wgmma_prefill_k_scales_before_the_issue(monkeypatch):
    """KVLAB_WGMMA_KSC_EARLY (the default since session 14, docs/perf-notes.md "Session 14"): for the
    formats whose consumers apply per-token scales (int8, fp8; int4 until session 15) the four
    16-byte K-scale loads of a tile sit between the consumer's full-barrier wait and its turn
    barrier, i.e. before the wgmma issue and the wait for the products; measured int4 -3.8 %. Fails
    if they move back after the wgmma wait (the -DKVLAB_WGMMA_NO_KSC_EARLY build is checked to be the
    counterexample). Since session 15 int4's producer scales K and V itself (KVLAB_WGMMA_KV_PRESCALE):
    its default consumers load no scales there, its -DKVLAB_WGMMA_NO_KV_PRESCALE build does."""
    def lds_before_issue(options, fmts):
        out = {}
        for fmt, d, f in _wgmma_sass_functions(monkeypatch, options, ("C7518", "C7510", "arning")):
            if fmt not in fmts:
                continue
            loop = _consumer_loop_first_pass(f)
            head = loop[:loop.index("WARPGROUP.ARRIVE")]
            out[(fmt, d)] = len(re.findall(r"LDS\.128", head))
        return out
    early = lds_before_issue("", (1, 2))
    assert early and all(n >= 4 for n in early.values()), early
    late = lds_before_issue("-DKVLAB_WGMMA_NO_KSC_EARLY", (1, 2))
    assert all(n == 0 for n in late.values()), late
    prescaled = lds_before_issue("", (3,))
    assert prescaled and all(n == 0 for n in prescaled.values()), prescaled
    int4_old = lds_before_issue("-DKVLAB_WGMMA_NO_KV_PRESCALE", (3,))
    assert int4_old and all(n >= 4 for n in int4_old.values()), int4_old


def test_wgmma_prefill_s_first_exponentials_between_the_waits(monkeypatch):
    """-DKVLAB_WGMMA_S_FIRST (measured in session 14, +5.6 % for int4, not adopted): S and P·V are two
    commit groups, and the 32 exponentials of a d = 128 tile sit between the wait for S
    (WARPGROUP.DEPBAR ... 0x1) and the wait for P·V (... 0x0), where the switch wants them (ptxas put
    them after the second wait until that wait moved into both arms of the rescale branch)."""
    for fmt, d, f in _wgmma_sass_functions(monkeypatch, "-DKVLAB_WGMMA_S_FIRST", ("C7518", "C7510", "arning")):
        if d != 128:
            continue
        i = f.index("WARPGROUP.DEPBAR.LE gsb0, 0x1")
        j = f.index("WARPGROUP.DEPBAR.LE gsb0, 0x0", i)
        assert f[i:j].count("MUFU.EX2") >= 32, (fmt, d, f[i:j].count("MUFU.EX2"))


@pytest.mark.parametrize("opts", ["-DKVLAB_WGMMA_KSC_EARLY -DKVLAB_WGMMA_NO_KSC_EARLY",
                                  "-DKVLAB_WGMMA_NO_KSC_EARLY -DKVLAB_WGMMA_VSC_EARLY",
                                  "-DKVLAB_PF_PACKED_DECODE -DKVLAB_PF_NO_PACKED_DECODE",
                                  "-DKVLAB_PF_NVFP4_SCALE_WORDS -DKVLAB_PF_NO_NVFP4_SCALE_WORDS",
                                  "-DKVLAB_WGMMA_KV_PRESCALE -DKVLAB_WGMMA_NO_KV_PRESCALE",
                                  "-DKVLAB_WGMMA_KV_PRESCALE -DKVLAB_WGMMA_V_PRESCALE",
                                  "-DKVLAB_WGMMA_KV_PRESCALE -DKVLAB_WGMMA_NO_ROWGROUP"])
def test_wgmma_prefill_session14_switches_refused(opts, monkeypatch):
    """Session 14's and 15's prefill switches that contradict each other (a default with its NO_ switch;
    the V scales early without the K scales early; int4's K and V prescaled together with the V half
    alone, or without the row-group loader that does it) are an #error, not a silently mislabelled
    A/B build."""
    _check_ptx_build(monkeypatch, "paged_prefill_wgmma", "paged_attention_prefill_wgmma<3, 128, __nv_bfloat16>",
                     opts, ok=False)


def test_wgmma_prefill_producer_ahead_switches_exclude_each_other(monkeypatch):
    """-DKVLAB_WGMMA_PRODUCER_AHEAD (the default) with -DKVLAB_WGMMA_NO_PRODUCER_AHEAD is an #error,
    as KVLAB_DECODE_STAGE / KVLAB_DECODE_NO_STAGE in paged_attention.cu."""
    from cupy.cuda import compiler

    from kvlab.cuda import attention  # noqa: F401

    monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", "-DKVLAB_WGMMA_PRODUCER_AHEAD -DKVLAB_WGMMA_NO_PRODUCER_AHEAD")
    with pytest.raises(compiler.CompileException, match="exclude each other"):
        loader.compile_family_offline("paged_prefill_wgmma")


def test_wgmma_prefill_rowgroup_switches_exclude_each_other(monkeypatch):
    """-DKVLAB_WGMMA_ROWGROUP (every format) with -DKVLAB_WGMMA_NO_ROWGROUP (none) is an #error."""
    from cupy.cuda import compiler

    from kvlab.cuda import attention  # noqa: F401

    monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", "-DKVLAB_WGMMA_ROWGROUP -DKVLAB_WGMMA_NO_ROWGROUP")
    with pytest.raises(compiler.CompileException, match="exclude each other"):
        loader.compile_family_offline("paged_prefill_wgmma")


def _check_ptx_build(monkeypatch, family, expr, opts, ok=True):
    """Compile one instantiation of ``family`` to PTX for sm_90 with ``KVLAB_NVRTC_OPTIONS=opts``:
    it must succeed (``ok``) or stop at an ``#error`` (a switch combination that is refused)."""
    import io

    from cupy.cuda import compiler

    monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", opts)
    prog = compiler._NVRTCProgram(loader.read_source(family), f"{family}.cu", name_expressions=[expr],
                                  method="ptx")
    build = lambda: prog.compile(loader.compile_options() + ("-arch=sm_90",), log_stream=io.StringIO())  # noqa: E731
    if ok:
        build()
    else:
        with pytest.raises(Exception, match="#error"):
            build()


def _switch_build_reports(family: str, arch: str, opts: str, switch_subset) -> list:
    """compile_family_offline's reports of ``family`` built with ``opts``: every instantiation for
    the default build (``opts`` empty), those ``switch_subset`` accepts for a switch build; checks
    that exactly those were reported."""
    where = switch_subset if opts else None
    reports = loader.compile_family_offline(family, arch, where=where)
    wanted = [s.name_expression() for s in loader.FAMILIES[family] if where is None or where(s.name_expression())]
    assert wanted and sorted(r.name_expression for r in reports) == sorted(wanted)
    return reports


@pytest.mark.parametrize("opts", ["", "-DKVLAB_INT4_WRITE_PLAIN_TAIL", "-DKVLAB_INT4_WRITE_DIV64"])
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_int4_write_lean_compiles_without_spills(arch, opts, monkeypatch):
    """The MMA8 int4 write (docs/notes-int4-write-mma.md) in its three builds: the default (the
    lean tail of session 7 with LEAN2's index math, the default since session 8), the previous
    tail (-DKVLAB_INT4_WRITE_PLAIN_TAIL) and the lean tail with session 7's index math
    (-DKVLAB_INT4_WRITE_DIV64, C++ 64-bit divisions): every reshape_and_cache instantiation
    compiles without spills, and the d = 128 16-bit int4 kernels keep sm_90's 80 registers
    (3 blocks/SM). The two switch builds change only the int4 write (``FMT == FMT_INT4`` behind
    ``int4_write_uses_mma8``), so they are checked in the int4 instantiations (18 of 102; the
    default build, whole, is the check's compile)."""
    monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", opts)
    reports = _switch_build_reports("reshape_and_cache", arch, opts, lambda e: e.startswith("reshape_and_cache<3, "))
    bad = spills_beyond_allowance(reports, "reshape_and_cache", arch, opts)
    assert not bad, f"spills with {opts!r} on {arch}: {bad}"
    if arch == "sm_90":
        regs = {r.name_expression: r.registers for r in reports}
        for t in ("__nv_bfloat16", "__half"):
            assert regs[f"reshape_and_cache<3, 128, {t}, false>"] <= 80


def test_int4_write_lean_rcp_has_no_slow_path(monkeypatch):
    """rcp_rn_scale is __frcp_rn's fast path only: the default (lean) d = 128 kernel's cubin names
    no reciprocal slow path, nor does -DKVLAB_INT4_WRITE_DIV64's (the same tail with session 7's
    index math, a different cubin); -DKVLAB_INT4_WRITE_PLAIN_TAIL's (__frcp_rn) does (the test's
    own control). -DKVLAB_INT4_WRITE_LEAN and -DKVLAB_INT4_WRITE_LEAN2, the A/B names of the lean
    tail (session 7) and of its index math (session 8), build the default."""
    import io

    from cupy.cuda import compiler

    def cubin(opts):
        monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", opts)
        prog = compiler._NVRTCProgram(loader.read_source("reshape_and_cache"), "reshape_and_cache.cu",
                                      name_expressions=["reshape_and_cache<3, 128, __nv_bfloat16, false>"],
                                      method="cubin")
        out, _ = prog.compile(loader.compile_options() + ("-arch=sm_90", "-ftz=true"), log_stream=io.StringIO())
        return bytes(out)

    assert b"rcp_rn" in cubin("-DKVLAB_INT4_WRITE_PLAIN_TAIL")
    default = cubin("")
    assert b"rcp_rn" not in default
    assert cubin("-DKVLAB_INT4_WRITE_LEAN") == default
    assert cubin("-DKVLAB_INT4_WRITE_LEAN2") == default
    div64 = cubin("-DKVLAB_INT4_WRITE_DIV64")
    assert b"rcp_rn" not in div64
    assert div64 != default


@pytest.mark.parametrize("opts, ok", [
    ("-DKVLAB_INT4_WRITE_DIV64", True),
    ("-DKVLAB_INT4_WRITE_DIV64 -DKVLAB_INT4_WRITE_LEAN", True),
    ("-DKVLAB_INT4_WRITE_LEAN2 -DKVLAB_INT4_WRITE_MMA8", True),
    ("-DKVLAB_INT4_WRITE_DIV64 -DKVLAB_INT4_WRITE_LEAN2", False),
    ("-DKVLAB_INT4_WRITE_DIV64 -DKVLAB_INT4_WRITE_PLAIN_TAIL", False),
    ("-DKVLAB_INT4_WRITE_LEAN2 -DKVLAB_INT4_WRITE_PLAIN_TAIL", False),
    ("-DKVLAB_INT4_WRITE_DIV64 -DKVLAB_INT4_WRITE_CUDA_CORES", False),
    ("-DKVLAB_INT4_WRITE_DIV64 -DKVLAB_INT4_WRITE_MMA", False),
])
def test_int4_write_index_math_switches(opts, ok, monkeypatch):
    """-DKVLAB_INT4_WRITE_DIV64 / _LEAN2 choose the lean MMA8 write's index math: accepted with it,
    an #error with each other (one index math at a time) and with the builds that have no lean
    MMA8 write (_PLAIN_TAIL, _CUDA_CORES, _MMA), so that an A/B build cannot be mislabelled."""
    _check_ptx_build(monkeypatch, "reshape_and_cache", "reshape_and_cache<3, 128, __nv_bfloat16, false>", opts, ok)


#: the decode's A/B switch builds (H200 measurement builds: compiled for sm_90 only, where the paged
#: kernel they mostly change exists; the default build for sm_90 and sm_80 — session 21 trimmed the
#: sm_80 builds of the switches to keep CI under its 30 minutes)
DECODE_SWITCH_BUILDS = ["-DKVLAB_DECODE_NO_STAGE", "-DKVLAB_DECODE_NO_STAGE_NVFP4",
                        "-DKVLAB_DECODE_NO_EARLY_ISSUE", "-DKVLAB_DECODE_SERIAL_QUERY_COLUMNS",
                        "-DKVLAB_DECODE_LATE_QUERY_LOADS", "-DKVLAB_DECODE_MERGE_RU=16",
                        "-DKVLAB_DECODE_NO_PDL -DKVLAB_DECODE_NO_ITEM_META -DKVLAB_DECODE_DUAL_CTA_BARRIER",
                        "-DKVLAB_DECODE_NO_PACKED_E2M1 -DKVLAB_DECODE_INT8_V_PRMT -DKVLAB_DECODE_NO_SCALE_X2",
                        "-DKVLAB_DECODE_DUAL_JOINT_STAGING", "-DKVLAB_DECODE_FP8_CONTIGUOUS -DKVLAB_NO_E2M1_SELECT",
                        "-DKVLAB_DECODE_KV_SPLIT -DKVLAB_DECODE_PARTIAL_SCALAR",
                        "-DKVLAB_DECODE_MERGE_TWOPASS -DKVLAB_DECODE_ALL_COLUMNS"]


@pytest.mark.parametrize("arch, opts", [("sm_90", ""), ("sm_80", "")] +
                         [("sm_90", o) for o in DECODE_SWITCH_BUILDS])
def test_decode_compiles_without_spills(arch, opts, monkeypatch):
    """Every paged_attention instantiation (per-head and paged decode, the split merge) compiles
    without stack or spills (sm_90 and sm_80; the switch builds for sm_90), in the default build (the paged kernel's int4 stage-level body since
    session 8, docs/perf-notes.md "Session 9 candidate: -DKVLAB_DECODE_STAGE", and the nvfp4 one
    since session 9), with -DKVLAB_DECODE_NO_STAGE (session 7's per-chunk body), with
    -DKVLAB_DECODE_NO_STAGE_NVFP4 (nvfp4 on the per-chunk body) and with
    -DKVLAB_DECODE_NO_EARLY_ISSUE (the paged ring's first copies after the prologue) and with
    -DKVLAB_DECODE_SERIAL_QUERY_COLUMNS (session 10's one-column-at-a-time query prologue) and with
    -DKVLAB_DECODE_LATE_QUERY_LOADS (the query rows loaded after the first copies) and with
    -DKVLAB_DECODE_MERGE_RU=16 (the split merge's o rows 16 parts at a time) and with session 14's
    -DKVLAB_DECODE_NO_PACKED_E2M1 (nvfp4 operands nibble pair by pair) together with
    -DKVLAB_DECODE_INT8_V_PRMT (int8 V without I2F; not adopted) and session 34's -DKVLAB_DECODE_NO_SCALE_X2
    (nvfp4 group scales one byte at a time through float32), and with session 17's
    -DKVLAB_DECODE_NO_ITEM_META (the metadata read from the arrays, not the work-list row, built
    together with -DKVLAB_DECODE_NO_PDL and session 18's -DKVLAB_DECODE_DUAL_CTA_BARRIER, the
    dual-ring CTA's prologue behind one CTA-wide barrier instead of one per half) and with session 20's
    -DKVLAB_DECODE_FP8_CONTIGUOUS (fp8 rows read as consecutive bytes, not interleaved words) together
    with session 35's -DKVLAB_NO_E2M1_SELECT (E2M1 byte words by mask-and-or, not bit-selects) and with
    -DKVLAB_DECODE_KV_SPLIT (session 20's staged layout: a stage's K side, then its V side; since
    session 21 a staged chunk keeps its K and V rows together, one bulk copy per block) together with
    -DKVLAB_DECODE_PARTIAL_SCALAR (the split partials stored and loaded as scalars, the default until
    session 47) and with
    -DKVLAB_DECODE_ALL_COLUMNS (every one of the 8 output columns finished and merged, the default
    until session 44; built together with -DKVLAB_DECODE_MERGE_TWOPASS, session 28's merge order); the int4 and nvfp4
    paged kernels stay within their 128-register budget (2 CTAs of 8 warps per SM), and so do the
    dual-ring CTAs of every quantized format (one CTA of 16 warps per SM, session 17).

    The default build is checked whole, on both archs. A switch build is checked in its bf16
    instantiations only (50 of 100): it exists for A/B runs of the decode benchmark, whose queries
    are bf16 (kvlab/bench/suite_decode.py), and its fp16 twins are the same template code. Each
    whole-family build costs ~85 s of NVRTC on a CI core; the bf16 half keeps CI well under its
    30 minutes (session 50)."""
    monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", opts)
    reports = _switch_build_reports("paged_attention", arch, opts, lambda e: "__half" not in e)
    bad = spills_beyond_allowance(reports, "paged_attention", arch, opts)
    assert not bad, f"paged_attention {opts!r} on {arch}: {bad}"
    if arch == "sm_90":
        regs = {r.name_expression: r.registers for r in reports}
        for t in ("__nv_bfloat16",) + (("__half",) if not opts else ()):
            for d in (64, 128):
                for fmt in (3, 4):
                    assert regs[f"paged_attention_decode_paged<{fmt}, {d}, {t}>"] <= 128
                for fmt in (1, 2, 3, 4):   # the dual-ring CTA: 16 warps, one CTA per SM
                    assert regs[f"paged_attention_decode_paged<{fmt}, {d}, {t}, 2>"] <= 128


@pytest.mark.parametrize("opts", ["-DKVLAB_DECODE_STAGE_NVFP4 -DKVLAB_DECODE_NO_STAGE",
                                  "-DKVLAB_DECODE_STAGE_NVFP4 -DKVLAB_DECODE_NO_STAGE_NVFP4",
                                  "-DKVLAB_DECODE_PACKED_E2M1 -DKVLAB_DECODE_NO_PACKED_E2M1",
                                  "-DKVLAB_DECODE_SCALE_X2 -DKVLAB_DECODE_NO_SCALE_X2",
                                  "-DKVLAB_E2M1_SELECT -DKVLAB_NO_E2M1_SELECT"])
def test_decode_stage_nvfp4_excludes_no_stage(opts, monkeypatch):
    """KVLAB_DECODE_STAGE_NVFP4 (the default since session 9) extends the default stage body: an
    #error when it is named together with -DKVLAB_DECODE_NO_STAGE or its own NO_ switch, so that
    an A/B build cannot be mislabelled; so are the default operand switches of sessions 14
    (PACKED_E2M1), 34 (SCALE_X2) and 35 (E2M1_SELECT) named together with their NO_ switch."""
    _check_ptx_build(monkeypatch, "paged_attention", "paged_attention_decode_paged<4, 128, __half>", opts, ok=False)


@pytest.mark.parametrize("opts, ok", [("-DKVLAB_DECODE_PROBE=1", True), ("-DKVLAB_DECODE_PROBE=2", True),
                                      ("-DKVLAB_DECODE_PROBE=3", False), ("-DKVLAB_DECODE_TIMELINE", True),
                                      ("-DKVLAB_DECODE_TIMELINE -DKVLAB_DECODE_SERIAL_QUERY_COLUMNS", True),
                                      ("-DKVLAB_DECODE_SERIAL_QUERY_COLUMNS -DKVLAB_DECODE_LATE_QUERY_LOADS", False)])
def test_decode_probe_builds(opts, ok, monkeypatch):
    """The paged decode's measurement-only builds (docs/perf-notes.md "Session 10": the probes =1
    data only, =2 math only, and the per-CTA timeline of scripts/decode_cta_timeline.py) compile,
    so a session can run them; any other probe value is an #error, and so is naming the two
    query-prologue switches of session 11 together (one would be ignored: a mislabelled A/B)."""
    _check_ptx_build(monkeypatch, "paged_attention", "paged_attention_decode_paged<3, 128, __nv_bfloat16>", opts, ok)


@pytest.mark.parametrize("opts", ["-DKVLAB_DECODE_MERGE_PROBE", "-DKVLAB_DECODE_MERGE_TWOPASS"])
@pytest.mark.parametrize("split", ["true", "false"])
def test_merge_switch_builds(opts, split, monkeypatch):
    """The split merge's session-28 builds compile (docs/perf-notes.md "Session 28"): the
    measurement-only probe (launched and released, then nothing read or written) and the two-pass
    order (the default before session 30: every run of parts loaded after the (m, l) pass), both
    merge forms. (-DKVLAB_DECODE_MERGE_LATE_INPUTS, the inputs' plain loads of sessions 30-41, is
    compiled, every instantiation, by test_merge_reads_its_inputs_before_the_wait_ptx.)"""
    _check_ptx_build(monkeypatch, "paged_attention", f"paged_attention_reduce<128, __nv_bfloat16, true, {split}>",
                     opts, True)


def _reduce_exprs():
    from kvlab.cuda import attention  # noqa: F401  (registers the family's instantiations)

    exprs = [s.name_expression() for s in loader.FAMILIES["paged_attention"]
             if s.name_expression().startswith("paged_attention_reduce<")]
    assert len(exprs) == 24   # 3 head sizes x 2 dtypes x rotation x split form
    return exprs


def _paged_attention_ptx(monkeypatch, opts, exprs):
    """PTX text (sm_90) of the paged_attention instantiations ``exprs`` built with
    ``KVLAB_NVRTC_OPTIONS=opts``, cut into one piece per kernel."""
    import io

    from cupy.cuda import compiler

    monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", opts)
    prog = compiler._NVRTCProgram(loader.read_source("paged_attention"), "paged_attention.cu",
                                  name_expressions=exprs, method="ptx")
    ptx, _ = prog.compile(loader.compile_options() + ("-arch=sm_90",), log_stream=io.StringIO())
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    funcs = re.split(r"\n\.(?:weak|visible) \.entry ", ptx)[1:]
    assert len(funcs) == len(exprs)
    return funcs


def _reduce_ptx(monkeypatch, opts):
    """PTX text of every split-merge instantiation (sm_90), one piece per kernel."""
    return _paged_attention_ptx(monkeypatch, opts, _reduce_exprs())


@pytest.mark.parametrize("opts, early", [("", True), ("-DKVLAB_DECODE_MERGE_LATE_INPUTS", False),
                                         ("-DKVLAB_DECODE_PARTIAL_SCALAR", True)])
def test_merge_reads_its_inputs_before_the_wait_ptx(monkeypatch, opts, early):
    """The split merge loads its work item (one 16-byte row) and its sequence's two query offsets
    with strong loads (ld.relaxed.gpu) before griddepcontrol.wait, in every instantiation (session 41:
    ptxas moves ld.global.nc loads — what the kernel's const __restrict__ pointers give — past the
    wait, so plain loads read the item and the offsets only after the decode grid's release, a
    dependent chain of DRAM round trips in front of the partials' loads; the default since session
    42). The -DKVLAB_DECODE_MERGE_LATE_INPUTS build (plain loads, as in sessions 30-41) has no strong
    load at all. Runs in CI (NVRTC only); the SASS order is checked by the test below where nvdisasm
    is installed."""
    for f in _reduce_ptx(monkeypatch, opts):
        wait = f.index("griddepcontrol.wait;")
        before = f[:wait]
        if early:
            assert before.count("ld.relaxed.gpu.global.v4.b32") == 1, f[:80]
            assert before.count("ld.relaxed.gpu.global.b32") == 2, f[:80]
        else:
            assert "ld.relaxed.gpu" not in f, f[:80]


@pytest.mark.parametrize("vec", [False, True])
def test_partials_as_vectors_ptx(monkeypatch, vec):
    """The split partials as vectors (the default since session 47; docs/perf-notes.md "Session
    47"): the split merge loads a part's row piece (E = D / 32 floats per lane) with one
    ld.global.nc.v4.f32 (d = 256: two) instead of E scalar loads, and the decode epilogue stores it
    with st.global.cg.v4.f32 (d = 64: the v2 forms). -DKVLAB_DECODE_PARTIAL_SCALAR keeps the scalar
    accesses of sessions 1-46. A build that lost the vectors — NVVM splits a plain float4 store
    through a cast pointer into four scalar stores, which is why the kernels use the intrinsics —
    fails here."""
    opts = "" if vec else "-DKVLAB_DECODE_PARTIAL_SCALAR"
    for f in _reduce_ptx(monkeypatch, opts):
        d = int(re.match(r"_Z\d+paged_attention_reduceILi(\d+)E", f).group(1))
        after = f[f.index("griddepcontrol.wait;"):]
        E, W = d // 32, (2 if d == 64 else 4)
        scalar = len(re.findall(r"ld\.global\.nc\.f32", after))
        vector = len(re.findall(rf"ld\.global\.nc\.v{W}\.f32", after))
        ml_pass = 8   # the (m, l) pass: PL = 8 float2 loads (v2, counted with d = 64's rows)
        # two load_run sites (the first run before the (m, l) pass, the loop), RU = 8 parts each:
        # 16 scalar loads of a part's m; the row pieces E scalars each, or E / W vectors each
        if vec:
            assert scalar == 16 and vector == 16 * E // W + (ml_pass if W == 2 else 0), (f[:70], scalar, vector)
        else:
            assert scalar == 16 * (1 + E) and vector == (ml_pass if W == 2 else 0), (f[:70], scalar, vector)
    for d, width in ((64, "v2"), (128, "v4")):
        ptx, = _paged_attention_ptx(monkeypatch, opts, [f"paged_attention_decode_paged<1, {d}, __nv_bfloat16, 2>"])
        stores = re.findall(r"st\.global(\.cg)?(\.v[24])?\.f32", ptx)
        if vec:
            assert (".cg", f".{width}") in stores and ("", "") not in stores, (d, stores)
        else:
            assert ("", "") in stores and (".cg", f".{width}") not in stores, (d, stores)


def test_merge_reads_its_inputs_before_the_wait_sass(monkeypatch):
    """The same in SASS (what the GPU runs), default build: in every split-merge instantiation the
    item row's LDG.E.128.STRONG.GPU and the two query offsets' LDG.E.STRONG.GPU come before ACQBULK
    (griddepcontrol.wait), and no load of a partial (LDG.E.CONSTANT) does. Skips without nvdisasm
    (pip nvidia-cuda-nvdisasm, the ``dev`` extra)."""
    monkeypatch.delenv("KVLAB_NVRTC_OPTIONS", raising=False)
    _, sass = _family_sass("paged_attention", _reduce_exprs(), "sm_90")
    if sass is None:
        pytest.skip("nvdisasm not installed (pip nvidia-cuda-nvdisasm)")
    funcs = re.split(r"\n\.text\.", sass)[1:]
    assert len(funcs) == 24
    for f in funcs:
        before = f[:f.index("ACQBULK")]
        assert before.count("LDG.E.128.STRONG.GPU") == 1, f[:80]
        assert before.count("LDG.E.STRONG.GPU") == 2, f[:80]
        assert "LDG.E.CONSTANT" not in before, f[:80]


def test_offline_compile_cache(tmp_path, monkeypatch):
    """compile_family_offline keeps a successful compile's reports on disk and answers the very same
    input from there (marked ``cached``, same numbers); any change NVRTC would see — options, a
    source edit — compiles afresh, ``use_cache=False`` / ``KVLAB_COMPILE_CACHE=0`` skip the read,
    a damaged entry is recompiled, and a failed compile leaves nothing behind."""
    import shutil

    from cupy.cuda import compiler

    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KVLAB_NVRTC_OPTIONS", raising=False)
    monkeypatch.delenv("KVLAB_COMPILE_CACHE", raising=False)
    first = loader.compile_family_offline("nibble", "sm_90")
    assert first and not any(r.cached for r in first)
    entries = sorted((tmp_path / "cache" / "kvlab_offline").glob("nibble-sm_90-*.json"))
    assert len(entries) == 1
    again = loader.compile_family_offline("nibble", "sm_90")
    assert all(r.cached for r in again)
    strip = lambda reps: sorted((r.name_expression, r.registers, r.spill_stores, r.spill_loads,  # noqa: E731
                                 r.stack_frame, r.shared_bytes) for r in reps)
    assert strip(again) == strip(first)
    assert not any(r.cached for r in loader.compile_family_offline("nibble", "sm_90", use_cache=False))
    monkeypatch.setenv("KVLAB_COMPILE_CACHE", "0")
    assert not any(r.cached for r in loader.compile_family_offline("nibble", "sm_90"))
    monkeypatch.delenv("KVLAB_COMPILE_CACHE")
    # another arch, another option: other inputs, compiled afresh (and kept beside the first)
    assert not any(r.cached for r in loader.compile_family_offline("nibble", "sm_80"))
    monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", "-DKVLAB_CACHE_TEST_UNUSED_MACRO=1")
    assert not any(r.cached for r in loader.compile_family_offline("nibble", "sm_90"))
    monkeypatch.delenv("KVLAB_NVRTC_OPTIONS")
    assert len(list((tmp_path / "cache" / "kvlab_offline").glob("nibble-*.json"))) == 3
    # a damaged entry: compiled again, and rewritten
    entries[0].write_text("{not json")
    assert not any(r.cached for r in loader.compile_family_offline("nibble", "sm_90"))
    assert all(r.cached for r in loader.compile_family_offline("nibble", "sm_90"))
    # a source edit (a copy of the sources with one more line): a miss; a broken one: an error, no entry
    src = loader.kernels_dir()
    copy = tmp_path / "kernels_cu"
    shutil.copytree(src, copy)
    monkeypatch.setattr(loader, "kernels_dir", lambda: copy)
    (copy / "nibble.cu").write_text((src / "nibble.cu").read_text() + "\n// an edit\n")
    assert not any(r.cached for r in loader.compile_family_offline("nibble", "sm_90"))
    n_before = len(list((tmp_path / "cache" / "kvlab_offline").glob("*.json")))
    (copy / "nibble.cu").write_text((src / "nibble.cu").read_text() + "\n__global__ void broken() { int x = ; }\n")
    with pytest.raises(compiler.CompileException):
        loader.compile_family_offline("nibble", "sm_90")
    assert len(list((tmp_path / "cache" / "kvlab_offline").glob("*.json"))) == n_before
    # a header edit changes the source's header hash: a miss too
    (copy / "nibble.cu").write_text((src / "nibble.cu").read_text())
    loader.compile_family_offline("nibble", "sm_90")
    assert all(r.cached for r in loader.compile_family_offline("nibble", "sm_90"))
    (copy / "common.cuh").write_text((src / "common.cuh").read_text() + "\n// a header edit\n")
    assert not any(r.cached for r in loader.compile_family_offline("nibble", "sm_90"))


def test_offline_cubin_reuses_the_check_compile(tmp_path, monkeypatch):
    """offline_cubin with the check's options (``--ptxas-options=-v``, the whole instantiation list)
    is answered from the cubin that compile_family_offline kept: no second NVRTC run, the same
    bytes, mapping and log. Other options compile afresh and are kept too; a damaged entry or
    ``KVLAB_COMPILE_CACHE=0`` compiles again. (The SASS tests lean on this: without it each
    wgmma build was compiled once for the spill test and again for every SASS test.)"""
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KVLAB_NVRTC_OPTIONS", raising=False)
    monkeypatch.delenv("KVLAB_COMPILE_CACHE", raising=False)
    exprs = [s.name_expression() for s in loader._ensure_family("nibble")]
    calls = []
    real = loader._nvrtc_compile
    monkeypatch.setattr(loader, "_nvrtc_compile", lambda *a: calls.append(a[2]) or real(*a))
    loader.compile_family_offline("nibble", "sm_90")
    assert len(calls) == 1
    cubin, mapping, log = loader.offline_cubin("nibble", exprs, "sm_90", ("--ptxas-options=-v",))
    assert len(calls) == 1, "offline_cubin compiled the check's build again"
    monkeypatch.setenv("KVLAB_COMPILE_CACHE", "0")
    again, amap, alog = loader.offline_cubin("nibble", exprs, "sm_90", ("--ptxas-options=-v",))
    assert len(calls) == 2
    timeless = lambda text: re.sub(r"Compile time = [0-9.]+ ms", "", text)  # noqa: E731
    assert (again, amap, timeless(alog)) == (cubin, mapping, timeless(log))
    assert cubin[:4] == b"\x7fELF" and set(mapping) == set(exprs) and "registers" in log
    monkeypatch.delenv("KVLAB_COMPILE_CACHE")
    # without -v: another build, compiled once, then answered from its own entry
    loader.offline_cubin("nibble", exprs, "sm_90")
    loader.offline_cubin("nibble", exprs, "sm_90")
    assert len(calls) == 3 and "--ptxas-options=-v" not in calls[-1]
    # a damaged entry is compiled again and rewritten
    entries = sorted((tmp_path / "cache" / "kvlab_offline").glob("nibble-sm_90-*.cubinz"))
    assert len(entries) == 2
    for e in entries:
        e.write_bytes(b"not zlib")
    loader.offline_cubin("nibble", exprs, "sm_90")
    assert len(calls) == 4
    loader.offline_cubin("nibble", exprs, "sm_90")
    assert len(calls) == 4
    # compile_family_offline(where=...): only the accepted instantiations, a build of its own
    one = loader.compile_family_offline("nibble", "sm_90", where=lambda e: e.startswith("pack_"))
    assert [r.name_expression for r in one] == [e for e in exprs if e.startswith("pack_")] and len(calls) == 5
    with pytest.raises(ValueError, match="no instantiation"):
        loader.compile_family_offline("nibble", "sm_90", where=lambda e: False)
