"""Shared-memory layout and wgmma descriptors of the wgmma prefill kernel, checked without a GPU.

``kernels_cu/paged_prefill_wgmma.cu`` stores Q, K and V tiles as wgmma core matrices
(``wg::core_off`` in ``kernels_cu/wgmma.cuh``) and hands the tensor cores matrix descriptors
(start address, LBO, SBO). Here a NumPy model of shared memory is filled the way the kernel's
stores fill it (query prologue element stores, the decode's 16-byte unit stores, the auto
path's cp.async units), and every operand that a wgmma of a tile reads is rebuilt from the
descriptor the kernel builds, with the PTX ISA's canonical no-swizzle layout:

* K-major (imm-trans 0): element (mn, k) at start + (mn/8)·SBO + (k/8)·LBO + (mn%8)·16 + (k%8)·2
* MN-major (imm-trans 1): element (mn, k) at start + (mn/8)·SBO + (k/8)·LBO + (k%8)·16 + (mn%8)·2

(LBO steps between core matrices adjacent in K, SBO between those adjacent in M/N). A wrong
LBO/SBO, k-step, warpgroup offset or buffer offset reads the wrong elements and fails here; the
swapped LBO/SBO reading of the V operand must fail (the check can fail). The descriptor
constants are read from the kernel source, so editing them there is what gets checked.

Since session 13 also: the per-token scale order (``pf_par_pos`` / ``pf_par_off``) serves every
consumer lane and costs one wavefront per 16-byte load phase (the old order two), and the
row-group producer (``PfRowGroupLoader``) covers every unit of a tile once with conflict-free
16-byte stores and 8-row load instructions; the formulas are read from
``kernels_cu/prefill_common.cuh``.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from kvlab.cuda import loader

ROWS, KT = 128, 64


def core_off(row, col, cols):
    """wg::core_off<COLS>(row, col) (kernels_cu/wgmma.cuh), bytes."""
    return (row >> 3) * (16 * cols) + (col >> 3) * 128 + (row & 7) * 16 + (col & 7) * 2


def desc_noswizzle(addr, lbo, sbo):
    """wg::desc_noswizzle: start >> 4 in bits 0-13, LBO >> 4 in 16-29, SBO >> 4 in 32-45."""
    return ((addr & 0x3FFFF) >> 4) | (((lbo >> 4) & 0x3FFF) << 16) | (((sbo >> 4) & 0x3FFF) << 32)


def desc_fields(desc):
    """(start, LBO, SBO, base offset, swizzle mode) in bytes, as the PTX ISA defines the fields."""
    return ((desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4,
            (desc >> 49) & 0x7, (desc >> 62) & 0x3)


def read_operand(smem, desc, mn, k, mn_major):
    """The mn x k matrix of 16-bit elements a wgmma reads through ``desc`` (canonical, no swizzle)."""
    start, lbo, sbo, base, swz = desc_fields(desc)
    assert base == 0 and swz == 0
    out = np.empty((mn, k), np.uint16)
    for i in range(mn):
        for j in range(k):
            if mn_major:
                a = start + (i // 8) * sbo + (j // 8) * lbo + (j % 8) * 16 + (i % 8) * 2
            else:
                a = start + (i // 8) * sbo + (j // 8) * lbo + (i % 8) * 16 + (j % 8) * 2
            out[i, j] = smem[a // 2]
    return out


def kernel_constants():
    """Descriptor constants and the shared-memory map as written in paged_prefill_wgmma.cu."""
    src = (loader.kernels_dir() / "paged_prefill_wgmma.cu").read_text()
    body = src[src.index("struct WgDesc"):]
    body = body[: body.index("};")]
    default = body.split("#ifndef KVLAB_WGMMA_V_SWAP_LBO_SBO")[1].split("#else")[0]

    def val(text, name, d):
        m = re.search(rf"{name} = ([^,;]+)[,;]", text)
        assert m, name
        return int(eval(m.group(1), {"D": d}))  # noqa: S307 - constant expressions of the source

    return lambda d: dict(
        QK_LBO=val(body, "QK_LBO", d), QK_SBO=val(body, "QK_SBO", d), V_LBO=val(default, "V_LBO", d),
        V_SBO=val(default, "V_SBO", d), QK_KSTEP=val(body, "QK_KSTEP", d), V_KSTEP=val(body, "V_KSTEP", d),
        UNIT=int(re.search(r"UNIT = (\d+);\s*// halves between", src).group(1)))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("parts", [4, 2])
def test_unit_stores_land_on_core_matrix_rows(d, parts):
    """The decode's 16-byte stores (unit u of part `part` of token lt at idx(lt, part·D/PARTS) +
    UNIT·u halves; quarters for the 256-thread kernel, half rows for the warp-specialised build's
    128 producer threads) and the query prologue's element stores follow core_off exactly, and
    the parts of all tokens cover the tile once."""
    unit = kernel_constants()(d)["UNIT"]
    seen = set()
    for lt in range(KT):
        for part in range(parts):
            base = core_off(lt, part * d // parts, d) // 2
            for u in range(d // (8 * parts)):
                assert base + unit * u == core_off(lt, part * d // parts + 8 * u, d) // 2
                seen.update(base + unit * u + i for i in range(8))
    assert seen == set(range(KT * d))
    # 8 consecutive tokens of one unit = one 128-byte core matrix: a conflict-free quarter-warp store
    offs = sorted(core_off(t, 8, d) for t in range(8))
    assert offs == list(range(offs[0], offs[0] + 128, 16))


def check_descriptors(d, buf, m):
    """Fill buffer/stage ``buf`` of the map ``m`` (TILE, BUF = bytes per buffer or stage, Q_OFF,
    BYTES) as the kernel's stores do and read every wgmma operand back through its descriptor."""
    c = kernel_constants()(d)
    rng = np.random.default_rng(d + buf)
    smem_base = 0x400  # the dynamic window starts after the static cs_sm floats (any 128-byte multiple)
    smem = np.zeros((smem_base + m["BYTES"]) // 2, np.uint16)
    Q = rng.integers(1, 60000, (ROWS, d), dtype=np.uint16)
    K = rng.integers(1, 60000, (KT, d), dtype=np.uint16)
    V = rng.integers(1, 60000, (KT, d), dtype=np.uint16)
    kt0 = smem_base + buf * m["BUF"]
    vt0 = kt0 + m["TILE"]
    for r in range(ROWS):
        for x in range(d):
            smem[(smem_base + m["Q_OFF"] + core_off(r, x, d)) // 2] = Q[r, x]
    for t in range(KT):
        for x in range(d):
            smem[(kt0 + core_off(t, x, d)) // 2] = K[t, x]
            smem[(vt0 + core_off(t, x, d)) // 2] = V[t, x]
    # descriptors as the kernel builds them: qdesc per warpgroup, kdesc0 / vdesc0 of buffer 0 plus
    # (b·BUF_BYTES) >> 4, plus k-steps of (KSTEP >> 4)
    bofs = (buf * m["BUF"]) >> 4
    kdesc0 = desc_noswizzle(smem_base, c["QK_LBO"], c["QK_SBO"])
    vdesc0 = desc_noswizzle(smem_base + m["TILE"], c["V_LBO"], c["V_SBO"])
    for wgi in range(2):
        qdesc = desc_noswizzle(smem_base + m["Q_OFF"] + wgi * 8 * (16 * d), c["QK_LBO"], c["QK_SBO"])
        for k in range(d // 16):
            a = read_operand(smem, qdesc + k * (c["QK_KSTEP"] >> 4), 64, 16, mn_major=False)
            np.testing.assert_array_equal(a, Q[64 * wgi: 64 * wgi + 64, 16 * k: 16 * k + 16])
    for k in range(d // 16):   # S = Q·K^T: B[n = token][k = dim], K-major
        b = read_operand(smem, kdesc0 + bofs + k * (c["QK_KSTEP"] >> 4), KT, 16, mn_major=False)
        np.testing.assert_array_equal(b, K[:, 16 * k: 16 * k + 16])
    for kc in range(KT // 16):  # O = P·V: B[n = dim][k = token], MN-major (imm-trans-b = 1)
        desc = vdesc0 + bofs + kc * (c["V_KSTEP"] >> 4)
        b = read_operand(smem, desc, d, 16, mn_major=True)
        np.testing.assert_array_equal(b, V[16 * kc: 16 * kc + 16, :].T)
        # the other reading of LBO/SBO for the MN-major operand reads other elements
        swapped = desc_noswizzle(desc_fields(desc)[0], c["V_SBO"], c["V_LBO"])
        assert not np.array_equal(read_operand(smem, swapped, d, 16, mn_major=True), V[16 * kc: 16 * kc + 16, :].T)


def test_descriptor_fields_and_no_carry():
    """Field positions, and the kernel's descriptor arithmetic (adding (bytes >> 4) to the 64-bit
    word) never carries out of the 14-bit start-address field for any start in 227 KB."""
    dsc = desc_noswizzle(0x12340, 128, 2048)
    assert desc_fields(dsc) == (0x12340, 128, 2048, 0, 0)
    for d in (64, 128):
        c, m = kernel_constants()(d), ws_smem_map(d, 4)
        top = 0x400 + m["BYTES"]
        assert top <= 227 * 1024
        worst = 0x400 + m["Q_OFF"] + 8 * 16 * d + (d // 16 - 1) * c["QK_KSTEP"]
        assert (worst >> 4) < (1 << 14)
        base = desc_noswizzle(0x400, c["V_LBO"], c["V_SBO"])
        for extra in range(0, m["BYTES"], 16):
            assert desc_fields(base + (extra >> 4))[1:] == (c["V_LBO"], c["V_SBO"], 0, 0)


# ---------------------------------------------------------------- the ring of stages (WsSmem)
def ws_smem_map(d, stages):
    """WsSmem<D> (kernels_cu/paged_prefill_wgmma.cu): ``stages`` x (K tile, V tile, 128 floats),
    then Q."""
    tile = KT * d * 2
    stage = 2 * tile + 2 * KT * 4
    return dict(TILE=tile, BUF=stage, Q_OFF=stages * stage, BYTES=stages * stage + ROWS * d * 2)


def test_ws_smem_formula_is_the_kernels():
    src = (loader.kernels_dir() / "paged_prefill_wgmma.cu").read_text()
    assert "STAGE = 2 * TILE + 2 * WG_KT * 4;" in src and "Q_OFF = WS_NS * STAGE;" in src
    assert "BYTES = Q_OFF + WG_ROWS * D * 2;" in src
    assert "BYTES == WS_NS * (256 * D + 512) + 256 * D" in src


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_ws_smem_budget_matches_the_launch(monkeypatch, d, stages):
    from kvlab.cuda.attention import prefill_geometry, prefill_smem_bytes

    if stages == 4:
        monkeypatch.delenv("KVLAB_NVRTC_OPTIONS", raising=False)   # the default ring
    else:
        monkeypatch.setenv("KVLAB_NVRTC_OPTIONS", f"-DKVLAB_WGMMA_WS_STAGES={stages}")
    m = ws_smem_map(d, stages)
    assert prefill_geometry("wgmma").threads == 384 and prefill_geometry("wgmma").stages == stages
    assert m["BYTES"] == prefill_smem_bytes(d, "wgmma") == stages * (256 * d + 512) + 256 * d
    assert m["BYTES"] + 640 <= 227 * 1024                # + the static cs_sm floats and mbarriers
    assert ROWS * (d + 4) * 4 <= m["BYTES"]              # epilogue output rows reuse the window
    assert m["TILE"] % 128 == 0 and m["BUF"] % 16 == 0 and m["Q_OFF"] % 16 == 0
    # descriptor start field (14 bits of addr >> 4): every operand start below 256 KB, no carry
    assert ((0x400 + m["Q_OFF"] + 8 * 16 * d + d * 2) >> 4) < (1 << 14)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ws_descriptors_read_q_k_and_v(d, stage):
    """The consumers' descriptors of stage s (kdesc0/vdesc0 + (s·STAGE) >> 4, Q after the ring)."""
    check_descriptors(d, stage, ws_smem_map(d, 4))


# ---------------------------------------------------------------- session 13: scale order, row groups
def _source_expr(pattern, text):
    """A C++ integer expression of the kernel source (``pattern`` has one group), as Python: the
    operators it uses (+ * >> & ?:) mean the same on non-negative ints once ?: is rewritten."""
    m = re.search(pattern, text, re.S)
    assert m, pattern
    e = m.group(1).strip()
    tern = re.fullmatch(r"FMT == NVFP4 \? (.+) : (.+)", e)
    if tern:
        return f"(({tern.group(1)}) if nvfp4 else ({tern.group(2)}))"
    return e


def _scale_order_exprs():
    """(pos, off) expressions of pf_par_pos / pf_par_off for the default and the
    -DKVLAB_WGMMA_NO_SCALES_CF order, from kernels_cu/prefill_common.cuh."""
    src = (loader.kernels_dir() / "prefill_common.cuh").read_text()
    pos = re.search(r"constexpr int pf_par_pos\(int lt\) \{\n#if !defined\(KVLAB_WGMMA_NO_SCALES_CF\)\n"
                    r"\s+return (.+?);\n#else\n\s+return (.+?);\n#endif", src)
    off = re.search(r"constexpr int pf_par_off\(int c, int i\) \{\n#if !defined\(KVLAB_WGMMA_NO_SCALES_CF\)\n"
                    r"\s+return (.+?);\n#else\n\s+return (.+?);\n#endif", src)
    assert pos and off
    return {"default": (pos.group(1), off.group(1)), "old": (pos.group(2), off.group(2))}


def _phase_wavefronts(byte_addrs, width):
    """Shared-memory wavefronts of one access phase: distinct ``width``-byte chunks are served
    together unless two of them use the same bank (4-byte banks, 32 of them)."""
    chunks = sorted(set(byte_addrs))
    per_bank = {}
    for a in chunks:
        for b in range(a // 4, (a + width) // 4):
            per_bank.setdefault(b % 32, set()).add(a)
    return max(len(v) for v in per_bank.values())


@pytest.mark.parametrize("order", ["default", "old"])
def test_scale_order_serves_every_consumer_lane_and_the_default_is_conflict_free(order):
    """pf_par_pos is a permutation of the 64 tokens of a tile; the consumer lane with column pair
    c = lane % 4 finds, in its float4 i at pf_par_off(c, i), the scales of tokens 8nt + 2c + e for
    (nt, e) = (2i, 0), (2i, 1), (2i+1, 0), (2i+1, 1) (the order pf_softmax_update_lazy and
    pf_p_operand_perm multiply them in). The default order's 16-byte loads take one wavefront per
    8-lane phase; the pre-session-13 order takes two (c = 0 and 2 on the same banks), which is
    what the default removed (and shows that the bank check can fail). The row-group producer's
    scale stores (8 lanes, tokens 16w + 8g + r) take one wavefront."""
    pos_e, off_e = _scale_order_exprs()[order]
    pos = [eval(pos_e, {"lt": lt}) for lt in range(KT)]  # noqa: S307 (the kernel's own expression)
    assert sorted(pos) == list(range(KT))
    for c in range(4):
        for i in range(4):
            base = eval(off_e, {"c": c, "i": i})  # noqa: S307
            toks = [8 * nt + 2 * c + e for nt in (2 * i, 2 * i + 1) for e in (0, 1)]
            assert [pos[t] for t in toks] == [base + j for j in range(4)], (order, c, i)
    waves = {_phase_wavefronts([4 * eval(off_e, {"c": lane & 3, "i": i}) for lane in range(8)], 16)  # noqa: S307
             for i in range(4)}
    assert waves == ({1} if order == "default" else {2}), (order, waves)
    if order == "default":
        for w in range(4):
            for g in range(2):
                stores = [4 * pos[16 * w + 8 * g + r] for r in range(8)]
                assert _phase_wavefronts(stores, 4) == 1, (w, g)


def _rowgroup_model():
    """Lane roles and unit choice of PfRowGroupLoader (kernels_cu/prefill_common.cuh), read from
    the source: init (w, r, q from the thread index), unit(k) and the row of row group g."""
    src = (loader.kernels_dir() / "prefill_common.cuh").read_text()
    body = src[src.index("struct PfRowGroupLoader"):]
    body = body[:body.index("\n};")]
    init = re.search(r"void init\(int tid\) \{ w = (.+?); r = (.+?); q = (.+?); \}", body)
    assert init
    unit = _source_expr(r"int unit\(int k\) const \{ return (.+?); \}", body)
    row = _source_expr(r"const int row = (16 \* w \+ 8 \* g \+ r);", body)
    return init.groups(), unit, row


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("fmt", ["int4", "int8", "nvfp4", "auto"])
def test_rowgroup_loader_covers_each_unit_once_with_conflict_free_stores(d, fmt):
    """The 128 producer threads of PfRowGroupLoader cover every (token, 8-dim unit) of a 64-token
    tile exactly once; each 16-byte store phase (8 lanes) writes one unit of 8 consecutive tokens,
    i.e. one 128-byte core matrix of the wgmma layout (one wavefront); and each load instruction
    reads 8 rows (4 lanes per row reading consecutive units: 16 bytes per row for int4, 32 for
    int8 as two 4-byte loads, 64 for nvfp4 at d = 128, 64 for auto's 16-byte copies)."""
    (w_e, r_e, q_e), unit_e, row_e = _rowgroup_model()
    U = d // 8
    UL = U // 4
    nvfp4 = fmt == "nvfp4"
    seen = {}
    store_phases = {}
    load_rows = {}
    for tid in range(128):
        w, r, q = (eval(e, {"tid": tid}) for e in (w_e, r_e, q_e))  # noqa: S307
        for g in range(2):
            row = eval(row_e, {"w": w, "g": g, "r": r})  # noqa: S307
            for k in range(UL):
                # auto copies units q + 4k (PfRowGroupLoader::copy), the others unit(k)
                u = q + 4 * k if fmt == "auto" else eval(unit_e, {"q": q, "k": k, "UL": UL, "nvfp4": nvfp4})  # noqa: S307
                assert 0 <= row < KT and 0 <= u < U
                seen[(row, u)] = seen.get((row, u), 0) + 1
                lane = tid & 31
                store_phases.setdefault((w, g, k, lane // 8), []).append(core_off(row, 8 * u, d))
                load_rows.setdefault((w, g, k), set()).add(row)
    assert set(seen) == {(t, u) for t in range(KT) for u in range(U)} and set(seen.values()) == {1}
    for key, addrs in store_phases.items():
        assert len(addrs) == 8 and sorted(addrs) == list(range(min(addrs), min(addrs) + 128, 16)), key
        assert min(addrs) % 128 == 0 and _phase_wavefronts(addrs, 16) == 1, key
    assert {len(rows) for rows in load_rows.values()} == {8}
