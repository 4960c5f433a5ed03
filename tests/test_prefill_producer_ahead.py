"""CPU emulation of the wgmma prefill producer's tile schedule (kernels_cu/paged_prefill_wgmma.cu):
the default since session 9 (producer ahead, ``KVLAB_WGMMA_PRODUCER_AHEAD``: two tiles of raw loads
in flight) and ``-DKVLAB_WGMMA_NO_PRODUCER_AHEAD`` (the old one-tile producer, the default until
session 9; docs/notes-prefill-wgmma.md, "Session 9 candidate").

Both loops are transliterated statement by statement into event traces (block-id fetch, raw
load into a register set, wait on empty[s] with a parity, store from a set, arrive on full[s]);
the checks: every tile is stored once, in order, from a set that holds exactly its raw bytes,
loaded with its own block id, which was fetched before that load; the stage / parity sequence is
the one-tile producer's (the consumers are the same in both builds); the ahead producer never
holds more than two tiles of raw loads and holds two whenever two remain; block ids are fetched
only for tiles that exist.
"""
from __future__ import annotations

import re

import pytest

from kvlab.cuda import loader

KT = 64


class Trace:
    def __init__(self, lo: int):
        self.lo = lo
        self.ev: list[tuple] = []

    def block_of(self, p0: int) -> str:
        self.ev.append(("fetch", (p0 - self.lo) // KT))
        return f"blk{p0}"

    def load_raw(self, regset: dict, p0: int, blk: str | None = None) -> None:
        if blk is None:  # Loader::load_raw(p0): the block id fetched right there
            blk = self.block_of(p0)
        tile = (p0 - self.lo) // KT
        self.ev.append(("load", tile, blk))
        regset["tile"], regset["blk"] = tile, blk

    def wait_empty(self, s: int, parity: int) -> None:
        self.ev.append(("wait", s, parity))

    def store(self, regset: dict, s: int) -> None:
        self.ev.append(("store", regset["tile"], regset["blk"], s))
        regset["tile"] = None  # registers free for the next load

    def arrive(self, s: int) -> None:
        self.ev.append(("arrive", s))


def producer_one_ahead(ntiles: int, lo: int, ns: int) -> list[tuple]:
    t, ld = Trace(lo), {"tile": None}
    blk = 0
    if ntiles > 0:
        t.load_raw(ld, lo)
        if ntiles > 1:
            blk = t.block_of(lo + KT)
    for it in range(ntiles):
        s = it % ns
        p0 = lo + it * KT
        t.wait_empty(s, ((it // ns) & 1) ^ 1)
        t.store(ld, s)
        t.arrive(s)
        if it + 1 < ntiles:
            t.load_raw(ld, p0 + KT, blk)
            if it + 2 < ntiles:
                blk = t.block_of(p0 + 2 * KT)
    return t.ev


def producer_ahead(ntiles: int, lo: int, ns: int) -> list[tuple]:
    t, ld, lb = Trace(lo), {"tile": None}, {"tile": None}
    blk = 0
    if ntiles > 0:
        b0 = t.block_of(lo)
        b1 = t.block_of(lo + KT) if ntiles > 1 else 0
        t.load_raw(ld, lo, b0)
        if ntiles > 1:
            t.load_raw(lb, lo + KT, b1)
        if ntiles > 2:
            blk = t.block_of(lo + 2 * KT)
    it = 0
    while it < ntiles:
        p0 = lo + it * KT
        s = it % ns
        t.wait_empty(s, ((it // ns) & 1) ^ 1)
        t.store(ld, s)
        t.arrive(s)
        if it + 2 < ntiles:
            t.load_raw(ld, p0 + 2 * KT, blk)
            blk = t.block_of(p0 + 3 * KT) if it + 3 < ntiles else 0
        if it + 1 < ntiles:
            s = (it + 1) % ns
            t.wait_empty(s, (((it + 1) // ns) & 1) ^ 1)
            t.store(lb, s)
            t.arrive(s)
            if it + 3 < ntiles:
                t.load_raw(lb, p0 + 3 * KT, blk)
                blk = t.block_of(p0 + 4 * KT) if it + 4 < ntiles else 0
        it += 2
    return t.ev


def _check(ev: list[tuple], ntiles: int, lo: int, depth: int) -> None:
    fetched: set[int] = set()
    loaded: list[int] = []
    stored: list[int] = []
    for e in ev:
        if e[0] == "fetch":
            assert 0 <= e[1] < ntiles, e  # only tiles that exist
            assert e[1] not in fetched, e  # once
            fetched.add(e[1])
        elif e[0] == "load":
            tile, blk = e[1], e[2]
            assert tile in fetched and blk == f"blk{lo + tile * KT}", e
            assert tile == len(loaded), e  # loads in tile order
            loaded.append(tile)
            in_flight = len(loaded) - len(stored)
            assert in_flight <= depth, (e, in_flight)
        elif e[0] == "store":
            tile, blk = e[1], e[2]
            assert tile == len(stored) and tile in loaded and blk == f"blk{lo + tile * KT}", e
            stored.append(tile)
            # right after a store, the producer holds `depth` tiles whenever that many remain
            # (checked at the next wait: the loads follow the arrive)
        elif e[0] == "wait":
            remaining = ntiles - len(stored)
            assert len(loaded) - len(stored) == min(depth, remaining), (e, loaded, stored)
    assert stored == list(range(ntiles)) and loaded == list(range(ntiles))
    assert fetched == set(range(ntiles))


@pytest.mark.parametrize("ns", [2, 3, 4])
@pytest.mark.parametrize("ntiles", list(range(0, 19)) + [64, 65])
def test_producer_schedules(ntiles, ns):
    lo = 3 * KT
    base = producer_one_ahead(ntiles, lo, ns)
    ahead = producer_ahead(ntiles, lo, ns)
    _check(base, ntiles, lo, 1)
    _check(ahead, ntiles, lo, 2)
    # the consumers see the same ring: the same waits (stage, parity) and arrives, in order
    sync = lambda ev: [e for e in ev if e[0] in ("wait", "arrive")]  # noqa: E731
    assert sync(base) == sync(ahead)
    assert [e[1:] for e in base if e[0] == "store"] == [e[1:] for e in ahead if e[0] == "store"]


def test_block_ids_one_tile_ahead():
    """Past the first two tiles a block id is fetched right after the previous tile's raw loads
    were issued: one store period before its own raw loads (as in the one-tile producer)."""
    ev = producer_ahead(10, 0, 4)
    for j in range(3, 10):
        f = ev.index(("fetch", j))
        assert ev[f - 1][0] == "load" and ev[f - 1][1] == j - 1, (j, ev[f - 2:f + 1])
        ld = next(i for i, e in enumerate(ev) if e[0] == "load" and e[1] == j)
        assert any(e[0] == "store" for e in ev[f:ld]), j


def test_producer_ahead_is_the_default():
    """The kernel defines KVLAB_WGMMA_PRODUCER_AHEAD unless -DKVLAB_WGMMA_NO_PRODUCER_AHEAD is
    given (#error if both), before any code reads it; the emulated loops are the two branches."""
    s = (loader.kernels_dir() / "paged_prefill_wgmma.cu").read_text()
    default = ("#if !defined(KVLAB_WGMMA_NO_PRODUCER_AHEAD) && !defined(KVLAB_WGMMA_PRODUCER_AHEAD)\n"
               "#define KVLAB_WGMMA_PRODUCER_AHEAD\n#endif\n")
    both = "#if defined(KVLAB_WGMMA_NO_PRODUCER_AHEAD) && defined(KVLAB_WGMMA_PRODUCER_AHEAD)\n#error"
    assert default in s and both in s
    first_use = min(m.start() for m in re.finditer(r"#if !?defined\(KVLAB_WGMMA_PRODUCER_AHEAD\)", s))
    assert s.index(default) < s.index(both) < first_use
    assert s.index(default) < s.index('#include "common.cuh"')
    assert "Loader lb = ld;" in s and "lb.load_raw(p0 + 3 * WG_KT, blk);" in s
