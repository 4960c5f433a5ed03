"""reshape_and_cache's index math at large indices (kernels_cu/reshape_and_cache.cu): the int4
d = 128 16-bit write (LEAN2's index math, the default since session 8) computes token/head with
udiv_small (launches up to 2^21 rows; a 64-bit division, div_s64_call, beyond) and block/slot with
udiv_wide (slots below 2^31; div_s64_call beyond, which no test can reach: the cache would hold
2^31 slots). These tests put rows on both sides of 2^21 (rows of one launch, and slots) and compare
the kernel with itself at small indices (same rows, small slots / split launches): the bytes must
be identical. With -DKVLAB_INT4_WRITE_DIV64 (session 7's C++ 64-bit divisions, for A/B) they check
that index math the same way.
Memory: ~0.6 GB (slots) and ~1.7 GB (rows) on the device.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvlab
from kvlab.formats import get_format

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

FMT = "int4_per_token_head"
D = 128
POISON = 0xA5


def _kv(T, H, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    scale = torch.rand((T, H, 1), generator=g, device="cuda") * 8 + 0.05
    k = (torch.randn((T, H, D), generator=g, device="cuda") * scale).to(dtype)
    v = (torch.randn((T, H, D), generator=g, device="cuda") * scale).to(dtype)
    return k, v


def _cache(num_blocks, bs, H):
    shape = get_format(FMT).cache_shape(num_blocks, bs, H, D)
    return torch.full(shape, POISON, dtype=torch.uint8, device="cuda")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("bs", [16, 17])
def test_int4_write_slots_beyond_2p21(dtype, bs):
    """Slots below and above 2^21 (2^21 itself, the cache's last slot, padding; block sizes a power
    of two and not) land where the same rows land in a small cache, byte for byte, and nothing
    else is written."""
    dt = getattr(torch, dtype)
    H, T = 2, 97
    nb = (1 << 21) // bs + 64
    total = nb * bs
    rng = np.random.default_rng(bs)
    lo = rng.choice(1 << 21, 30, replace=False)
    hi = (1 << 21) + 1 + rng.choice(total - (1 << 21) - 2, T - 30 - 2, replace=False)
    slots = np.concatenate([lo, hi, [1 << 21, total - 1]]).astype(np.int64)
    rng.shuffle(slots)
    slots[::9] = -1
    key, value = _kv(T, H, dt, 3 + bs)
    big = _cache(nb, bs, H)
    kvlab.reshape_and_cache(key, value, big, torch.from_numpy(slots).cuda(), kv_cache_dtype=FMT)
    small_slots = np.where(slots >= 0, np.arange(T), -1).astype(np.int64)
    small = _cache(-(-T // bs), bs, H)
    kvlab.reshape_and_cache(key, value, small, torch.from_numpy(small_slots).cuda(), kv_cache_dtype=FMT)
    w = np.nonzero(slots >= 0)[0]
    s = torch.from_numpy(slots[w]).cuda()
    i = torch.from_numpy(w).cuda()
    got = big[s // bs, :, s % bs]           # (n, 2, H, row)
    want = small[i // bs, :, i % bs]
    assert torch.equal(got, want)
    big[s // bs, :, s % bs] = POISON
    assert bool((big == POISON).all()), "a row outside slot_mapping was written"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_int4_write_launch_beyond_2p21_rows(dtype):
    """One launch of 2^21 + 296 rows (its last rows beyond udiv_small's range: div_s64_call) writes
    the same bytes as the same rows in two launches below it."""
    dt = getattr(torch, dtype)
    H, bs = 8, 16
    T = (1 << 18) + 37
    assert T * H > 1 << 21
    key, value = _kv(T, H, dt, 11)
    rng = np.random.default_rng(12)
    slots = rng.permutation(T).astype(np.int64)
    slots[rng.random(T) < 0.1] = -1
    sd = torch.from_numpy(slots).cuda()
    nb = -(-T // bs)
    one = _cache(nb, bs, H)
    kvlab.reshape_and_cache(key, value, one, sd, kv_cache_dtype=FMT)
    two = _cache(nb, bs, H)
    h = T // 2
    kvlab.reshape_and_cache(key[:h], value[:h], two, sd[:h], kv_cache_dtype=FMT)
    kvlab.reshape_and_cache(key[h:], value[h:], two, sd[h:], kv_cache_dtype=FMT)
    assert torch.equal(one, two)
