"""Same-run floors of the decode suite: how fast can *any* call that reads a cache of N bytes be,
under the suite's own timer?

The issue-4 targets compare a kvlab decode call with torch SDPA on the bf16 cache; the "byte
floor" there (``row_bytes / 2d``, 0.266× for int4 at d = 128) assumes that time scales with
bytes. It does not quite: a call also has a fixed part (launch, ramp-up, tail, the timer's cold
L2 with its dirty lines). Two rows per distinct cache size make that visible, measured in the
same process as the kernels (docs/perf-notes.md, "Session 16"):

* **read floor** (:func:`read_floor`): the ring probe (``kernels_cu/ring_probe.cu``, a kernel
  that only streams bytes and XORs them into a sink) reading the same number of bytes,
  contiguous, in each of :data:`READ_FLOOR_CONFIGS`; the row keeps the fastest. It does no
  math, writes ~0.1 % of what it reads and launches one kernel: a decode call that reads its
  cache once cannot beat it by more than the timer's noise.
* **paged read floor** (:func:`paged_read_floor`): the same probe reading the same bytes as the
  paged cache lays them out for the decode — whole blocks (a block's K and V sides together, one
  bulk copy each, as the paged decode copies a block of 16 tokens) at shuffled places, as the
  suite's block table scatters them — in each of :func:`paged_floor_configs`; the fastest is
  kept. The distance from the read floor is what the layout costs any reader; the distance of a
  kvlab row from this floor is what the kernel costs beyond reading its cache.
* **SDPA at equal bytes** (:func:`equal_bytes_context`): torch SDPA on a bf16 cache of the
  same byte count — the same batch and heads with the context shortened by ``row_bytes / 2d``
  — i.e. what the format's call would take if kvlab read bytes as efficiently as torch's own
  attention kernel does, fixed costs included.

Both are timed with :func:`kvlab.bench.timing.bench_ms` like every other row.
"""
from __future__ import annotations

from ..cuda.ring_probe import THREADS, RingConfig, chunk_offsets

#: streaming reads tried for the read floor (contiguous bytes; the fastest is kept). The first
#: is the fastest of the session-10 probe sweep at 285 MB (0.90 of copy), the other two the
#: fastest with small copies and with ordinary loads (benchmarks/latest/decode/variants_session10).
READ_FLOOR_CONFIGS = (
    RingConfig("bulk copies, 32 KB chunks, 2/stage, 3 stages, 1 CTA/SM", chunk=32768, per_stage=2,
               nbuf=3, ctas_per_sm=1, layout="contig"),
    RingConfig("bulk copies, 8.5 KB chunks, 4/stage, 2 stages, 3 CTAs/SM", chunk=8704, per_stage=4,
               nbuf=2, ctas_per_sm=3, layout="contig"),
    RingConfig("16-byte loads, 4 CTAs/SM", mode="loads", chunk=8704, per_stage=4, ctas_per_sm=4,
               layout="contig"),
)


#: the paged read floor's ring forms: (stage bytes aimed at, stages, CTAs per SM). A stage holds
#: ``max(1, round(aim / block))`` whole blocks. The first is one CTA per SM with as many bytes in
#: flight as the paged decode's dual-ring CTA (two rings of 2 stages of 2 int4 blocks at d = 128),
#: the third two CTAs per SM as its two-per-SM form; the other two bracket them.
PAGED_FLOOR_FORMS = ((65536, 2, 1), (32768, 3, 1), (32768, 2, 2), (17408, 3, 2))
#: shared memory of one SM (H100 / H200: 228 KB, 1 KB of it reserved per resident CTA) and the
#: most one CTA may opt in to (227 KB): a form that does not fit its CTAs per SM is left out
SMEM_PER_SM = 228 * 1024
SMEM_PER_CTA_MAX = 227 * 1024


def paged_floor_configs(block: int) -> tuple[RingConfig, ...]:
    """Ring-probe configurations that read whole blocks of ``block`` bytes at shuffled places
    (``layout="blocks"``): one per :data:`PAGED_FLOOR_FORMS` entry whose ``ctas_per_sm`` CTAs fit
    an SM's shared memory, and 16-byte loads at 4 CTAs per SM (~34 KB per step). Names are unique.

    ``block``: bytes of one cache block, K and V sides (``2 · block_size · num_kv_heads · row
    bytes``), a positive multiple of 16."""
    if block <= 0 or block % 16:
        raise ValueError(f"block: a positive multiple of 16 bytes, got {block}")
    kb = f"{block / 1024:.1f} KB"
    out, seen = [], set()
    for aim, nbuf, k in PAGED_FLOOR_FORMS:
        ps = max(1, round(aim / block))
        smem = nbuf * ps * block
        if (ps, nbuf, k) in seen or smem > SMEM_PER_CTA_MAX or k * (smem + 1024) > SMEM_PER_SM:
            continue
        seen.add((ps, nbuf, k))
        out.append(RingConfig(f"bulk copies of whole blocks ({kb}), {ps}/stage, {nbuf} stages, {k} CTA"
                              f"{'s' if k > 1 else ''}/SM", chunk=block, per_stage=ps, nbuf=nbuf, ctas_per_sm=k,
                              layout="blocks"))
    out.append(RingConfig(f"16-byte loads of whole blocks ({kb}), 4 CTAs/SM", mode="loads", chunk=block,
                          per_stage=max(1, round(34816 / block)), ctas_per_sm=4, layout="blocks"))
    return tuple(out)


def probe_shape(nbytes: int, cfg: RingConfig, n_sm: int) -> tuple[int, int, int]:
    """``(grid, chunks_per_cta, bytes read)`` of a probe launch that reads ~``nbytes``.

    The grid is ``cfg.ctas_per_sm × n_sm`` CTAs of an equal number of chunks, the count rounded
    to the nearest (so the bytes read differ from ``nbytes`` by less than half a chunk per CTA);
    a cache smaller than one chunk per CTA gets one CTA per chunk."""
    if nbytes <= 0 or n_sm <= 0:
        raise ValueError(f"nbytes and n_sm must be positive, got {nbytes}, {n_sm}")
    chunks = max(1, round(nbytes / cfg.chunk))
    grid = cfg.ctas_per_sm * n_sm
    if chunks < grid:
        return chunks, 1, chunks * cfg.chunk
    per_cta = max(1, round(chunks / grid))
    return grid, per_cta, grid * per_cta * cfg.chunk


def equal_bytes_context(ctx: int, row_bytes: int, d: int) -> int:
    """Context of a bf16 cache (``2d`` bytes per row) with the bytes of ``ctx`` rows of
    ``row_bytes`` (nearest, at least 1): 2,176 for int4 at d = 128 and 8,192 tokens."""
    if ctx <= 0 or row_bytes <= 0 or d <= 0:
        raise ValueError(f"ctx, row_bytes and d must be positive, got {ctx}, {row_bytes}, {d}")
    return max(1, round(ctx * row_bytes / (2 * d)))


class _Source:
    """One zero-filled device buffer, grown on demand, that every floor measurement reads."""

    def __init__(self):
        self.buf = None

    def get(self, nbytes: int):
        import cupy

        if self.buf is None or self.buf.size < nbytes:
            self.buf = None
            self.buf = cupy.zeros(nbytes, dtype=cupy.uint8)
        return self.buf

    def release(self):
        self.buf = None


_SOURCE = _Source()


def read_floor(nbytes: int, repeats: int = 30, configs=READ_FLOOR_CONFIGS) -> dict:
    """Fastest streaming read of ~``nbytes`` bytes among ``configs`` (ring probe; contiguous for
    the default configurations, as each configuration's layout says otherwise).

    Returns ``dict(median_ms, bytes, config, per_config)``: the fastest configuration's median
    time, the bytes it read (:func:`probe_shape`), its name, and ``{name: median_ms}`` of every
    configuration that ran (a configuration that does not fit the device is left out with its
    error in ``per_config`` as a string). Needs sm_90 for the bulk-copy configurations."""
    import cupy

    from ..cuda.ring_probe import stream
    from .timing import bench_ms

    n_sm = cupy.cuda.Device().attributes["MultiProcessorCount"]
    shapes = {c.name: probe_shape(nbytes, c, n_sm) for c in configs}
    src = _SOURCE.get(max(b for _, _, b in shapes.values()))
    best, per_config = None, {}
    for c in configs:
        grid, per_cta, nread = shapes[c.name]
        offs = cupy.asarray(chunk_offsets(c, grid, per_cta))
        sink = cupy.empty(grid * THREADS, cupy.uint32)
        try:
            stream(c, src, offs, grid, per_cta, sink)
            cupy.cuda.runtime.deviceSynchronize()
            r = bench_ms(lambda: stream(c, src, offs, grid, per_cta, sink), repeats=repeats)
        except Exception as e:  # noqa: BLE001 — a configuration that cannot launch here is skipped
            per_config[c.name] = f"{type(e).__name__}: {e}"
            continue
        per_config[c.name] = r["median_ms"]
        if best is None or r["median_ms"] < best["median_ms"]:
            best = dict(median_ms=r["median_ms"], bytes=nread, config=c.name)
    if best is None:
        raise RuntimeError(f"no read-floor configuration ran: {per_config}")
    best["per_config"] = per_config
    return best


def paged_read_floor(nbytes: int, block: int, repeats: int = 30) -> dict:
    """:func:`read_floor` of ~``nbytes`` bytes read as whole blocks of ``block`` bytes at shuffled
    places (:func:`paged_floor_configs`): the fastest pure read of a paged cache of that size."""
    return read_floor(nbytes, repeats, paged_floor_configs(block))


def release() -> None:
    """Free the floor's source buffer (the suite calls it between cases)."""
    _SOURCE.release()
