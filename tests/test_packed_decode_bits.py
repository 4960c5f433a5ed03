"""Session 14's packed-decode bit tricks emulated bit for bit in NumPy (no GPU): ``e2m1x8_to_h2x4_scaled``
(both its byte-word forms: session 35's shared sign mask with two bit-selects, ``KVLAB_E2M1_SELECT``, the
default, and the mask-and-or form of ``-DKVLAB_NO_E2M1_SELECT``),
``pf_group_scale2``, int8 V in ``dec_unit`` and in ``v_operand`` (``KVLAB_DECODE_INT8_V_PRMT``), the int8 K
bias flip once per word; each against the path it replaces and exact reference values, exhaustively over
the nibbles / bytes involved. Shifts, masks and PRMT selectors are read from the kernel source and used by
the emulation (a rewrite the regexes miss fails loudly); the last test shows the comparisons can fail."""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from kvlab.cuda import loader

U32 = np.uint32
HEX = r"(0x[0-9A-Fa-f]+)u"
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float64)
BF16 = ml_dtypes.bfloat16
A, B = (g.ravel().astype(U32) for g in np.meshgrid(np.arange(256), np.arange(256), indexing="ij"))  # all pairs
S8 = np.arange(256).astype(np.uint8).view(np.int8)   # byte -> two's-complement value


def _src(name, start, end="\n}", sub=None):
    """Text of ``name`` from ``start`` to ``end``; with ``sub`` only the ``FMT == sub`` branch."""
    src = (loader.kernels_dir() / name).read_text()
    i = src.index(start)
    text = src[i: src.index(end, i)]
    return text[text.index(f"FMT == {sub}"): text.index("FMT == FP8")] if sub else text


def _grab(pattern, text):
    m = re.search(pattern, text)
    assert m, pattern
    return tuple(int(g, 0) for g in m.groups())


def rand_words(n, seed):
    return np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(U32)


def prmt(a, b, sel):
    """PTX prmt.b32, default mode (``attn::prmt``): byte n of the result is byte (sel nibble n) & 7 of
    the pool {a: bytes 0-3, b: bytes 4-7}; bit 3 of the nibble replicates that byte's sign bit."""
    a, b, sel = (np.asarray(x, U32) for x in (a, b, sel))
    pool = a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32))
    out = np.zeros(np.broadcast(a, b, sel).shape, U32)
    for n in range(4):
        s = (sel >> U32(4 * n)) & U32(0xF)
        byte = ((pool >> ((s & U32(7)).astype(np.uint64) * np.uint64(8))) & np.uint64(0xFF)).astype(U32)
        byte = np.where(s & U32(8), np.where(byte & U32(0x80), U32(0xFF), U32(0)), byte)
        out |= byte << U32(8 * n)
    return out


def put(base, vals, pos):  # base with byte pos replaced by vals
    return (np.asarray(base, U32) & ~U32(0xFF << 8 * pos)) | (np.asarray(vals, U32) << U32(8 * pos))


def f16(bits):
    return np.asarray(bits & 0xFFFF, np.uint16).view(np.float16).astype(np.float64)


def bf16(bits):
    return (np.asarray(bits, U32) << U32(16)).view(np.float32).astype(np.float64)


def bits16(x, typ):  # fp16 / bf16 bits of x, rounded to nearest (exact for every value used here)
    return np.asarray(np.asarray(x).astype(typ).view(np.uint16), U32)


def lo_hi(x):
    return np.asarray(x, U32) & U32(0xFFFF), np.asarray(x, U32) >> U32(16)


def sub2_exact(a, b, bf):
    """HSUB2 (fp16x2, or bf16x2 when ``bf``) of bit words, round to nearest; asserts that each
    difference is representable in the 16-bit type, i.e. that the hardware's rounding is exact."""
    dec, typ = (bf16, BF16) if bf else (f16, np.float16)
    out = []
    for x, y in zip(lo_hi(a), lo_hi(b)):
        x, y = dec(x), dec(y)
        d = x - y
        bb = d - x                                # TwoSum: the float64 rounding error of x - y is 0
        assert not ((x - (d - bb)) + (-y - bb)).any(), "x - y not exact in float64"
        np.testing.assert_array_equal(d.astype(typ).astype(np.float64), d)
        out.append(bits16(d, typ))
    return out[0] | (out[1] << U32(16))


# ---------------------------------------------------------------- 1. E2M1 x8 -> fp16x2 x4
def e2m1_consts():
    new = _src("attention_common.cuh", "void e2m1x8_to_h2x4_scaled(")
    old = _src("attention_common.cuh", "uint32_t e2m1x2_to_h2_scaled(uint32_t w)")
    assert new.count("#if defined(KVLAB_E2M1_SELECT)") == 1 and new.count("#else") == 1
    sel_src, mask_src = new.split("#else")
    e = _grab(rf"const uint32_t e = \(\(w << (\d+)\) & {HEX}\) \| \(\(w << (\d+)\) & {HEX}\);", mask_src)
    o = _grab(rf"const uint32_t o = \(\(w >> (\d+)\) & {HEX}\) \| \(w & {HEX}\);", mask_src)
    x = r"(0x[0-9A-Fa-f]+)"
    sel = dict(sgn=_grab(rf"and\.b32 s, %2, {x};", sel_src)[0], t=_grab(r"shl\.b32 t, %2, (\d+);", sel_src)[0],
               u=_grab(r"shl\.b32 u, s, (\d+);", sel_src)[0], v=_grab(r"shr\.b32 v, %2, (\d+);", sel_src)[0],
               e=_grab(rf"lop3\.b32 %0, t, u, {x}, {x};", sel_src), o=_grab(rf"lop3\.b32 %1, v, s, {x}, {x};", sel_src))
    assert sel_src.count("lop3.b32") == 2 and sel_src.count(".b32 ") == 7  # the 6 instructions + the .reg line
    h = sorted((int(k), v, int(s, 0)) for k, v, s in re.findall(rf"h\[(\d)\] = prmt\(([eo]), 0u, {HEX}\);", new))
    assert [k for k, _, _ in h] == [0, 1, 2, 3]
    ms = {n: (int(t), int(m, 0)) for n, t, m in re.findall(
        rf"const uint32_t (mag|sgn) = \(S <= (\d+) \? \(w << \(\2 - S\)\) : \(w >> \(S - \2\)\)\) & {HEX};", old)}
    assert set(ms) == {"mag", "sgn"} and "return mag | sgn;" in old
    return dict(e=e, o=o, sel=sel, h=[(v, s) for _, v, s in h], mag=ms["mag"], sgn=ms["sgn"])


def lop3(a, b, c, lut):
    """PTX lop3.b32: bit k of the result is bit (a_k·4 + b_k·2 + c_k) of ``lut`` (a = 0xF0, b = 0xCC, c = 0xAA)."""
    a, b, c = (np.asarray(x, U32) for x in (a, b, c))
    out = np.zeros(np.broadcast(a, b, c).shape, U32)
    for i in range(8):
        if (lut >> i) & 1:
            out |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
    return out


def e2m1_byte_words(w, c, select=True):
    """e2m1x8_to_h2x4_scaled's byte words {"e": E, "o": O}; ``select``: the default (KVLAB_E2M1_SELECT)
    form, else the -DKVLAB_NO_E2M1_SELECT one."""
    if select:
        q = c["sel"]
        sg = w & U32(q["sgn"])
        return dict(e=lop3(w << U32(q["t"]), sg << U32(q["u"]), U32(q["e"][0]), q["e"][1]),
                    o=lop3(w >> U32(q["v"]), sg, U32(q["o"][0]), q["o"][1]))
    (s1, m1, s2, m2), (s3, m3, m4) = c["e"], c["o"]
    return dict(e=((w << U32(s1)) & U32(m1)) | ((w << U32(s2)) & U32(m2)),
                o=((w >> U32(s3)) & U32(m3)) | (w & U32(m4)))


def e2m1x8_new(w, c, select=True):
    """e2m1x8_to_h2x4_scaled's four words (``select`` as in e2m1_byte_words)."""
    eo = e2m1_byte_words(w, c, select)
    return [prmt(eo[v], 0, sel) for v, sel in c["h"]]


def e2m1x2_old(w, S, c):
    def part(t, mask):
        return ((w << U32(t - S)) if S <= t else (w >> U32(S - t))) & U32(mask)
    return part(*c["mag"]) | part(*c["sgn"])


def nibble_words(n_rand=64):  # (words, pos, nibble): each nibble value at each position, others random
    pos, nib = (np.repeat(g.ravel(), n_rand) for g in np.meshgrid(np.arange(8), np.arange(16), indexing="ij"))
    w = (np.tile(rand_words(n_rand, 1), 128) & ~(U32(0xF) << (4 * pos).astype(U32))) | (nib << 4 * pos).astype(U32)
    return w, pos, nib


@pytest.mark.parametrize("select", [True, False], ids=["select", "no_select"])
@pytest.mark.parametrize("words", ["every_nibble", "random_100k"])
def test_e2m1x8_equals_e2m1x2(words, select):
    """h[i] of e2m1x8_to_h2x4_scaled (either byte-word form) equals e2m1x2_to_h2_scaled<4i> bitwise: for
    all 16 values of each of the 8 nibbles (others random), and on 100k random words. Fails on a wrong
    shift, mask, LOP3 table or PRMT selector of either function (a nibble in the wrong half or word, a
    bit lost or leaking in). Both forms equal to the same words: the switch cannot change an output."""
    c = e2m1_consts()
    w = nibble_words()[0] if words == "every_nibble" else rand_words(100_000, 14)
    for i, h in enumerate(e2m1x8_new(w, c, select)):
        np.testing.assert_array_equal(h, e2m1x2_old(w, 4 * i, c), err_msg=f"h[{i}]")


def test_e2m1_select_words_byte_parallel_over_all_bytes():
    """The select form's byte words depend on each byte of w alone: over all 65,536 pairs of
    neighbouring bytes (at byte positions 0-1, 1-2 and 2-3) E and O equal the mask-and-or form's, so no bit of a
    shifted neighbour leaks in (the s << 4 and w >> 3 cross byte borders)."""
    c = e2m1_consts()
    for pos in range(3):
        w = (A << U32(8 * pos)) | (B << U32(8 * pos + 8))
        new, old = e2m1_byte_words(w, c), e2m1_byte_words(w, c, select=False)
        for k in ("e", "o"):
            np.testing.assert_array_equal(new[k], old[k], err_msg=f"{k}, bytes {pos}-{pos + 1}")


def test_e2m1x8_decodes_to_the_e2m1_table_times_2_pow_minus_14():
    """Nibble p lands in word p % 4, half p // 4, as the fp16 of E2M1(code)·2^-14 exactly, sign
    included (code 8 -> -0). Fails if the fp16 placement (magnitude bits 9..11, sign bit 15) is
    wrong, e.g. 0.5 (code 1) not the fp16 subnormal 2^-15."""
    w, pos, nib = nibble_words()
    h = e2m1x8_new(w, e2m1_consts())
    for p in range(8):
        got, code = f16(lo_hi(h[p % 4][pos == p])[p // 4]) * 2.0**14, nib[pos == p]
        np.testing.assert_array_equal(got, np.where(code & 8, -1.0, 1.0) * E2M1[code & 7])
        np.testing.assert_array_equal(np.signbit(got), (code & 8) != 0)


# ---------------------------------------------------------------- 2. pf_group_scale2
def test_pf_group_scale2_packed_equals_per_byte_path():
    """For all 256 E4M3 bytes at each position i (other bytes random), the packed path (e4m3x2_to_h2
    of the half holding byte i, HMUL2 by the source's fp16 constant, PRMT 0x1010 / 0x3232) and the
    #else path (float32 of the byte · 128, fp16 RN, packed twice) give the same word, both halves
    fp16(e4m3·128) exactly; NaN codes give NaN. Fails on a wrong half shift, multiplier or selector."""
    packed, old = _src("prefill_common.cuh", "uint32_t pf_group_scale2(").split("#else")
    shift, mul = _grab(rf"hmul2_bits\(e4m3x2_to_h2\(i < 2 \? sb : sb >> (\d+)\), {HEX}\)", packed)
    sel_odd, sel_even = _grab(rf"prmt\(h, 0u, \(i & 1\) \? {HEX} : {HEX}\)", packed)
    (f32_mul,) = (float(x) for x in re.findall(r"e4m3_to_float\(\(sb >> \(8 \* i\)\) & 0xFFu\) \* ([\d.]+)f\)", old))
    assert "return pack2(hs, hs);" in old and f16(mul & 0xFFFF) == f16(mul >> 16) == f32_mul == 128.0
    e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    b, nan = np.arange(256, dtype=U32), np.isnan(e4m3)
    assert nan.sum() == 2
    for i in range(4):
        sb = put(rand_words(256, 2 + i), b, i)
        x = sb if i < 2 else sb >> U32(shift)
        h2 = [bits16(e4m3[(x >> U32(8 * k)) & U32(0xFF)], np.float16) for k in (0, 1)]       # cvt, exact
        h = [bits16(f16(hv) * f16(m), np.float16) for hv, m in zip(h2, lo_hi(U32(mul)))]  # HMUL2, RN
        new = prmt(h[0] | (h[1] << U32(16)), 0, sel_odd if i & 1 else sel_even)
        hs = bits16(e4m3[(sb >> U32(8 * i)) & U32(0xFF)].astype(np.float32) * np.float32(f32_mul), np.float16)
        old_w = hs | (hs << U32(16))
        for half_new, half_old in zip(lo_hi(new), lo_hi(old_w)):
            assert np.isnan(f16(half_new[nan])).all() and np.isnan(f16(half_old[nan])).all()
            np.testing.assert_array_equal(f16(half_new[~nan]), e4m3[~nan] * 128.0)   # exact
        np.testing.assert_array_equal(new[~nan], old_w[~nan], err_msg=f"i={i}")


# ---------------------------------------------------------------- 3. dec_unit int8 (prefill)
def dec_int8_consts():
    body = _src("prefill_common.cuh", "uint4 dec_unit(", sub="INT8")
    packed, old = body.split("#else")
    v_pool, keep, sign = _grab(rf"attn::prmt\(w, {HEX}, sel\);\s*return hsub2_bf\(x & {HEX}, x & {HEX}\);", packed)
    sels = _grab(rf"h\[0\] = v2\(w0, {HEX}\); h\[1\] = v2\(w0, {HEX}\);", packed)
    (flip,) = _grab(rf"const uint32_t x0 = w0 \^ {HEX}", packed)
    k_new = sorted((int(p, 0), int(s, 0)) for p, s in re.findall(rf"prmt\(x0, {HEX}, {HEX}\), OFF\)", packed))
    k_old = sorted(tuple(int(g, 0) for g in t) for t in re.findall(rf"prmt\(w0, {HEX}, {HEX}\) \^ {HEX}, OFF\)", old))
    offs = {int(x, 0) for x in re.findall(rf"constexpr uint32_t OFF = {HEX};", body)}
    (pool, xor), = {(p, x) for p, _, x in k_old}
    assert len(offs) == 1 and k_new == [(p, s) for p, s, _ in k_old] and {s for _, s in k_new} == set(sels)
    return dict(v_pool=v_pool, keep=keep, sign=sign, sels=sels, flip=flip, k_pool=pool, k_xor=xor, off=offs.pop())


def dec_v_new(w, sel, c):
    x = prmt(w, c["v_pool"], sel)
    return sub2_exact(x & U32(c["keep"]), x & U32(c["sign"]), bf=True)


def dec_v_old(w, sel, c):
    h = sub2_exact(prmt(w, c["k_pool"], sel) ^ U32(c["k_xor"]), U32(c["off"]), bf=False)
    return [bits16(f16(v).astype(np.float32), BF16) for v in lo_hi(h)]     # __half22float2, pack_f2


@pytest.mark.parametrize("which", [0, 1])
def test_dec_unit_int8_v_is_the_signed_byte_and_matches_the_old_path(which):
    """For all 256 x 256 byte pairs of the selector's two bytes (others random): the bf16 difference
    (x & keep) - (x & sign) is exactly the two's-complement byte (representable: RN is exact), low
    half byte `which`, high half byte `which` + 2, and equals bitwise the #else path (fp16
    (0x64 | b ^ 0x80) - 1152, then bf16). Fails on a wrong pool byte, mask or selector."""
    c = dec_int8_consts()
    w = put(put(rand_words(A.size, 3 + which), A, which), B, which + 2)
    lo, hi = lo_hi(dec_v_new(w, c["sels"][which], c))
    np.testing.assert_array_equal(bf16(lo), S8[A])
    np.testing.assert_array_equal(bf16(hi), S8[B])
    np.testing.assert_array_equal(np.array([lo, hi]), np.array(dec_v_old(w, c["sels"][which], c)))


@pytest.mark.parametrize("src", ["dec_unit", "k_operand"])
def test_int8_k_bias_flip_once_per_word(src):
    """prmt(w ^ flip, pool, sel) == prmt(w, pool, sel) ^ xor bitwise, exhaustively over the two
    bytes each selector takes (others random) and on 100k random words. Fails if the word flip
    misses a byte the selector uses, or the per-pair xor does not match it."""
    if src == "dec_unit":
        c = dec_int8_consts()
        flip, pool, xor, sels = c["flip"], c["k_pool"], c["k_xor"], c["sels"]
    else:
        new, old = _src("attention_common.cuh", "uint32_t k_operand(", sub="INT8").split("#else")
        flip, pool, s1, s0 = _grab(rf"return prmt\(w \^ {HEX}, {HEX}, p \? {HEX} : {HEX}\);", new)
        pool_old, t1, t0, xor = _grab(rf"return prmt\(w, {HEX}, p \? {HEX} : {HEX}\) \^ {HEX};", old)
        assert (pool_old, t1, t0) == (pool, s1, s0)
        sels = (s0, s1)
    for j, sel in enumerate(sels):
        for w in (put(put(rand_words(A.size, 5 + j), A, j), B, j + 2), rand_words(100_000, 6 + j)):
            np.testing.assert_array_equal(prmt(w ^ U32(flip), pool, sel), prmt(w, pool, sel) ^ U32(xor))


# ---------------------------------------------------------------- 4. v_operand int8 (decode)
def v_operand_int8_consts():
    new, old = _src("attention_common.cuh", "uint32_t v_operand(const uint32_t* wa", sub="INT8").split("#else")
    assert "defined(KVLAB_DECODE_INT8_V_PRMT)" in new
    (sel_e,) = re.findall(r"prmt\(wa\[m\], wb\[m\], static_cast<uint32_t>\((.+?)\)\);", new)
    masks = _grab(rf"return bsub2_bits\(\(z & {HEX}\) \| {HEX}, \(z & {HEX}\) \| {HEX}\);", new)
    assert "static_cast<signed char>((wa[m] >> (8 * i)) & 0xFFu)" in old and "__floats2bfloat162_rn(" in old
    return (lambda i: int(eval(sel_e, {"i": i}))), masks  # noqa: S307 - the source's own expression


def v_operand_new(wa, wb, i, sel_of, masks):
    km, kb, sm, sb = (U32(m) for m in masks)
    z = prmt(wa, wb, sel_of(i))
    return sub2_exact((z & km) | kb, (z & sm) | sb, bf=True)


@pytest.mark.parametrize("i", range(4))
def test_decode_v_operand_int8_prmt_equals_the_i2f_path(i):
    """For all 256 x 256 (byte i of wa, byte i of wb) pairs, other bytes random: low half is the
    signed byte of wa, high half that of wb, exactly (bf16 (128 + (b & 0x7F)) - (128 or 256)), and
    the word equals bitwise the #else path (sign extension, float, __floats2bfloat162_rn). Fails on
    a wrong selector nibble (another byte, or the selector's unused bytes leaking through a mask)."""
    sel_of, masks = v_operand_int8_consts()
    assert all((sel_of(j) >> 4 * n) & 8 == 0 for j in range(4) for n in range(4))  # no sign mode
    wa, wb = put(rand_words(A.size, 7 + i), A, i), put(rand_words(A.size, 11 + i), B, i)
    new = v_operand_new(wa, wb, i, sel_of, masks)
    np.testing.assert_array_equal(bf16(lo_hi(new)[0]), S8[A])
    np.testing.assert_array_equal(bf16(lo_hi(new)[1]), S8[B])
    old = [bits16(S8[v].astype(np.float32), BF16) for v in (A, B)]
    np.testing.assert_array_equal(new, old[0] | (old[1] << U32(16)))


# ---------------------------------------------------------------- the checks can fail
def test_prmt_model_and_mutated_constants_are_caught():
    """The PRMT model on hand-made words (identity, byte reversal, sign replication), and a mask or
    selector changed in the emulation is detected by the comparisons above (they can fail)."""
    a, b = U32(0x03020100), U32(0x87060504)
    assert prmt(a, b, 0x3210) == a and prmt(a, b, 0x7654) == b and prmt(a, b, 0x0123) == 0x00010203
    assert prmt(a, b, 0x7777) == 0x87878787 and prmt(a, b, 0xFFF7) == 0xFFFFFF87 and prmt(a, b, 0x333B) == 0x03030300
    w, c, d = rand_words(4096, 9), e2m1_consts(), dec_int8_consts()
    for bad in (dict(c, e=(c["e"][0], 0x0F0F0F0F) + c["e"][2:]), dict(c, h=[c["h"][k] for k in (0, 1, 3, 2)])):
        assert any(not np.array_equal(h, e2m1x2_old(w, 4 * i, c)) for i, h in enumerate(e2m1x8_new(w, bad, False)))
    q = c["sel"]
    assert lop3(U32(0xF0), U32(0xCC), U32(0xAA), 0xE4) == 0xE4 and lop3(U32(0xFF00), U32(0x0FF0), U32(0x0F0F), 0xE4) == 0x0FF0  # c ? a : b
    for bad_sel in (dict(q, e=(q["e"][0], 0xE2)), dict(q, sgn=0x80808080), dict(q, u=3), dict(q, o=(0x0F0F0F0F, q["o"][1]))):
        bad = dict(c, sel=bad_sel)
        assert any(not np.array_equal(h, e2m1x2_old(w, 4 * i, c)) for i, h in enumerate(e2m1x8_new(w, bad))), bad_sel
    with pytest.raises(AssertionError):   # a keep mask without the 0x43 bias: the difference is inexact
        dec_v_new(w, d["sels"][0], dict(d, keep=0x007F007F))
    sel_of, masks = v_operand_int8_consts()
    z = v_operand_new(w, w, 1, lambda i: i | ((4 + i) << 4), masks)  # wb's byte in the wrong slot
    assert not np.array_equal(bf16(z >> U32(16)), S8[w >> U32(8) & U32(0xFF)])
