"""Caches larger than 4 GiB: attention and the write path at byte offsets past 2^31 and 2^32.

An inference engine allocates one cache tensor per layer that fills what the GPU has left, so a
layer's cache of several GiB is the common case, and every byte offset into it must be 64-bit
(``block id × slab bytes`` overflows 32 bits past 4 GiB, a signed int past 2 GiB). The other GPU
tests use caches of a few MB; the decode benchmark reads caches up to 32 GiB but checks no output.

Each test builds a small ragged batch (decode, prefill and chunked prefill) with the NumPy writer
(``build_case``), then copies every block of its small cache to a block of a cache of ~4.3 GiB
filled with random bytes (bf16 NaNs included), half of them between 2^31 and 2^32 bytes and half
past 2^32 (the cache's last block among them), and renumbers the block table to match. The same
plan on the big cache must give **bit-identical** output to the small cache (the kernels see the
same bytes in the same order, only further away), for both decode kernels (per-head, paged in
both CTA forms) and both prefill kernels (mma, and wgmma on sm_90); the small cache's output is
also checked against the float64 reference (``check_close``), so two equal wrong answers fail
too. A kernel that wraps an offset reads random bytes: NaNs or a different result.

The write path (``kvlab.reshape_and_cache``, GPU) writes fresh K/V rows into slots of those far
blocks; the bytes must equal the same write into the small cache, and no other block of the big
cache may change (per-block checksums before and after).

Memory: one big cache (~4.3 GiB) at a time per test, plus < 100 MB.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvlab
from kvlab.formats import get_format

from .test_paged_attention_gpu import (FORMATS, _device_cc, _mixed_lengths, build_case, check_close, run_ref,
                                       to_device, to_host)

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

HKV, GROUP, D, BS = 2, 4, 128, 16
BIG_BYTES = (1 << 32) + (1 << 28)        # 4.25 GiB of cache


def _far_blocks(rng, nb_small, slab, nb_big):
    """``nb_small`` distinct block ids of the big cache: half with byte offsets in [2^31, 2^32),
    half at or past 2^32, the cache's last block first among the latter."""
    lo0, hi0 = -(-(1 << 31) // slab), -(-(1 << 32) // slab)
    n_lo = nb_small // 2
    lo = rng.choice(np.arange(lo0, hi0), n_lo, replace=False)
    hi = rng.choice(np.arange(hi0, nb_big - 1), nb_small - n_lo - 1, replace=False)
    ids = np.concatenate([lo, [nb_big - 1], hi]).astype(np.int64)
    assert ids.min() * slab >= 1 << 31 and (ids >= hi0).sum() == nb_small - n_lo
    return ids[rng.permutation(nb_small)]


def _big_cache(fmt_obj, small_dev, seed):
    """A cache of ~BIG_BYTES random bytes with the small cache's geometry: ``(cache, nb_big)``."""
    slab = small_dev[0].numel() * small_dev.element_size()
    nb_big = BIG_BYTES // slab
    g = torch.Generator(device="cuda").manual_seed(seed)
    raw = torch.randint(0, 256, (nb_big * slab,), dtype=torch.uint8, device="cuda", generator=g)
    shape = fmt_obj.cache_shape(nb_big, BS, HKV, D)
    big = raw.view(small_dev.dtype).view(shape)
    assert big.numel() * big.element_size() > 1 << 32
    return big, nb_big


def _block_sums(cache):
    """One int64 checksum per block (the block's bytes as int32 words, summed)."""
    nb = cache.shape[0]
    return cache.view(nb, -1).view(torch.int32).sum(dim=1)


def _run(case, q, cache, block_table, variant, prefill_variant):
    from kvlab.cuda.attention import plan_paged_attention

    seq_lens, qsl = to_device(case["seq_lens"]), to_device(case["query_start_loc"])
    plan = plan_paged_attention(q, cache, block_table, seq_lens, qsl, case["kv_cache_dtype"],
                                decode_variant=variant, prefill_variant=prefill_variant)
    assert plan.decode_variant == variant and plan.prefill_variant == prefill_variant
    out = torch.full_like(q, float("nan"))
    plan.run(q, cache, block_table, seq_lens, qsl, out=out)
    torch.cuda.synchronize()
    return to_host(out), plan


@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_reads_blocks_past_4gib_as_in_a_small_cache(rng, fmt, monkeypatch):
    fmt_obj = get_format(fmt)
    q_lens, kv_lens = _mixed_lengths(rng, 6, 700)
    case = build_case(rng, fmt, HKV, GROUP, D, BS, q_lens, kv_lens)
    ref = run_ref(case)
    small = to_device(case["kv_cache"])
    nb_small = small.shape[0]
    big, nb_big = _big_cache(fmt_obj, small, int(rng.integers(1 << 31)))
    slab = small[0].numel() * small.element_size()
    far = _far_blocks(rng, nb_small, slab, nb_big)
    big[torch.from_numpy(far).cuda()] = small
    bt_small = to_device(case["block_table"])
    bt_big = to_device(far[case["block_table"]].astype(np.int32))
    q = to_device(case["q"])
    prefills = ["mma"] + (["wgmma"] if _device_cc() == 90 else [])
    ran = 0
    for variant, dual in (("per_head", None), ("paged", "0"), ("paged", "1")):
        if dual is not None:
            monkeypatch.setenv("KVLAB_DECODE_PAGED_DUAL", dual)
        for pv in prefills:
            want, plan_s = _run(case, q, small, bt_small, variant, pv)
            got, plan_b = _run(case, q, big, bt_big, variant, pv)
            what = f"{fmt} decode={variant}/dual={dual} prefill={pv}"
            assert plan_b.n_items == plan_s.n_items and plan_b.paged_halves == plan_s.paged_halves, what
            check_close(want, ref, "bfloat16", what + " (small cache)")
            assert np.isfinite(got.astype(np.float64)).all(), what + ": NaN from the big cache (a wrapped offset?)"
            assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), \
                what + f": big-cache output differs from the small cache's " \
                       f"(max |diff| {np.abs(got.astype(np.float64) - want.astype(np.float64)).max():.3e})"
            ran += 1
    assert ran == 3 * len(prefills)
    # the comparison can fail: one block-table entry of the longest sequence moved to the next
    # block (random bytes) changes the output
    s = int(np.argmax(case["seq_lens"]))
    wrong = far[case["block_table"]].astype(np.int32)
    wrong[s, 0] = (wrong[s, 0] + 1) % nb_big
    right, _ = _run(case, q, big, bt_big, "per_head", "mma")
    got, _ = _run(case, q, big, to_device(wrong), "per_head", "mma")
    assert not np.array_equal(got.view(np.uint16), right.view(np.uint16)), \
        f"{fmt}: a block of random bytes in place of a real one did not change the output"


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_lands_in_blocks_past_4gib_and_nowhere_else(rng, fmt):
    fmt_obj = get_format(fmt)
    case = build_case(rng, fmt, HKV, GROUP, D, BS, [1, 1, 1], [300, 77, 513])
    small = to_device(case["kv_cache"])
    nb_small = small.shape[0]
    big, nb_big = _big_cache(fmt_obj, small, int(rng.integers(1 << 31)))
    slab = small[0].numel() * small.element_size()
    far = _far_blocks(rng, nb_small, slab, nb_big)
    far_dev = torch.from_numpy(far).cuda()
    big[far_dev] = small
    before = _block_sums(big)
    # fresh rows into random slots of the small cache's blocks (some skipped with -1), and the same
    # rows into the matching slots of the far blocks
    n = 400
    s_small = rng.choice(nb_small * BS, n, replace=False).astype(np.int64)
    s_small[rng.random(n) < 0.1] = -1
    s_big = np.where(s_small >= 0, far[s_small // BS] * BS + s_small % BS, -1).astype(np.int64)
    assert s_big.max() * (slab // BS) > 1 << 32
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(1 << 31)))
    mag = torch.exp(torch.randn((n, HKV, 1), device="cuda", generator=g) * 0.7)
    key = (torch.randn((n, HKV, D), device="cuda", generator=g) * mag).to(torch.bfloat16)
    value = (torch.randn((n, HKV, D), device="cuda", generator=g) * mag + 0.3).to(torch.bfloat16)
    kvlab.reshape_and_cache(key, value, small, torch.from_numpy(s_small).cuda(), kv_cache_dtype=fmt)
    kvlab.reshape_and_cache(key, value, big, torch.from_numpy(s_big).cuda(), kv_cache_dtype=fmt)
    torch.cuda.synchronize()
    # the write changed the small cache (the test is not vacuous) and the far blocks alike
    # (bytes compared: a bf16 cache's garbage holds NaNs, which never compare equal as values)
    assert not torch.equal(small.view(torch.uint8), to_device(case["kv_cache"]).view(torch.uint8))
    assert torch.equal(big[far_dev].view(torch.uint8), small.view(torch.uint8)), \
        f"{fmt}: the far blocks differ from the small cache after the same write"
    after = _block_sums(big)
    others = torch.ones(nb_big, dtype=torch.bool, device="cuda")
    others[far_dev] = False
    changed = torch.nonzero((before != after) & others).flatten()
    assert changed.numel() == 0, f"{fmt}: blocks outside the written ones changed: {changed[:8].tolist()}"
