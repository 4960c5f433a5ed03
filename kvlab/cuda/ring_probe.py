"""Ring probe (``kernels_cu/ring_probe.cu``): stream bytes from global memory the way the paged
decode's ring does (bulk copies into shared-memory stages), or with ordinary loads, and time it.
A measurement tool for ``scripts/ring_probe.py``; it computes nothing and has no reference.

:func:`stream` launches one configuration; :class:`RingConfig` names its parameters."""
from __future__ import annotations

from dataclasses import dataclass

from .loader import KernelSpec, get_kernel, register

MODES = {"bulk_thread": 0, "bulk_warp": 1, "loads": 2}
SPECS = register("ring_probe", [KernelSpec("ring_probe", "ring_stream", (m,)) for m in MODES.values()])
MAX_BUF = 8          # RP_MAXBUF in ring_probe.cu
THREADS = 256


@dataclass(frozen=True)
class RingConfig:
    """One probe configuration.

    mode: ``"bulk_thread"`` (thread 0 issues the bulk copies, as the paged decode),
    ``"bulk_warp"`` (the lanes of warp 0 issue them) or ``"loads"`` (16-byte loads by every
    thread, no shared memory); chunk: bytes per chunk (multiple of 16); per_stage: chunks per
    ring stage; nbuf: stages (2 … 8); split: bulk copies per chunk; ctas_per_sm: the grid is
    this × the SM count (shared memory must allow it to be resident); layout: ``"paged"``
    (pairs of chunks — a block's K and V — at shuffled places, as the decode benchmark's
    shuffled block table) or ``"contig"``; touch: every thread reads one 16-byte word per
    stage; evict_first: L2 evict-first hint on the bulk copies."""
    name: str
    mode: str = "bulk_thread"
    chunk: int = 8704
    per_stage: int = 4
    nbuf: int = 3
    split: int = 1
    ctas_per_sm: int = 2
    layout: str = "paged"
    touch: bool = True
    evict_first: bool = False
    grid: int | None = None   # overrides ctas_per_sm × SMs

    def smem_bytes(self) -> int:
        return 0 if self.mode == "loads" else self.nbuf * self.per_stage * self.chunk

    def check(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {sorted(MODES)}, got {self.mode!r}")
        if self.layout not in ("paged", "contig"):
            raise ValueError(f"layout: expected 'paged' or 'contig', got {self.layout!r}")
        if self.chunk % 16 or self.chunk <= 0:
            raise ValueError(f"chunk: a positive multiple of 16 bytes, got {self.chunk}")
        if self.mode != "loads":
            if not 2 <= self.nbuf <= MAX_BUF:
                raise ValueError(f"nbuf: 2 … {MAX_BUF}, got {self.nbuf}")
            if self.split < 1 or self.chunk % (16 * self.split):
                raise ValueError(f"split: pieces of chunk/split bytes must be multiples of 16 "
                                 f"(chunk {self.chunk}, split {self.split})")


def chunk_offsets(cfg: RingConfig, grid: int, chunks_per_cta: int, seed: int = 0):
    """int64 byte offsets, ``grid × chunks_per_cta`` of them, CTA-major: contiguous, or blocks of
    two adjacent chunks at a random permutation of block places (``chunks_per_cta`` even)."""
    import numpy as np

    n = grid * chunks_per_cta
    if cfg.layout == "contig":
        return np.arange(n, dtype=np.int64) * cfg.chunk
    if chunks_per_cta % 2:
        raise ValueError("paged layout: chunks_per_cta must be even (K and V chunks of a block)")
    perm = np.random.default_rng(seed).permutation(n // 2).astype(np.int64)
    return (perm[:, None] * 2 * cfg.chunk + np.arange(2, dtype=np.int64)[None, :] * cfg.chunk).ravel()


def stream(cfg: RingConfig, src, offsets_d, grid: int, chunks_per_cta: int, sink) -> None:
    """Launch the probe once on the current stream: ``src`` (cupy uint8), ``offsets_d`` (cupy
    int64, :func:`chunk_offsets`, ``grid × chunks_per_cta``), ``sink`` (cupy uint32,
    ``grid × THREADS``: each thread's XOR of the 32-bit words it loaded, :func:`expected_sink`)."""
    import cupy

    cfg.check()
    if offsets_d.size != grid * chunks_per_cta or sink.size < grid * THREADS:
        raise ValueError(f"offsets ({offsets_d.size}) must be grid × chunks_per_cta "
                         f"({grid} × {chunks_per_cta}); sink ({sink.size}) ≥ grid × {THREADS}")
    if cfg.mode != "loads" and cupy.cuda.Device().compute_capability < "90":
        raise RuntimeError(f"{cfg.mode}: bulk copies need sm_90 or newer")
    k = get_kernel(SPECS[MODES[cfg.mode]])
    smem = cfg.smem_bytes()
    if smem > 48 * 1024:
        k.max_dynamic_shared_size_bytes = smem
    k((grid,), (THREADS,),
      (src, offsets_d, cupy.int32(chunks_per_cta), cupy.int32(cfg.chunk), cupy.int32(cfg.per_stage),
       cupy.int32(cfg.nbuf), cupy.int32(cfg.split), cupy.int32(int(cfg.touch)),
       cupy.int32(int(cfg.evict_first)), sink), shared_mem=smem)


def expected_sink(cfg: RingConfig, src, offsets, grid: int, chunks_per_cta: int):
    """NumPy model of the probe's ``sink`` (uint32, ``grid × THREADS``): for ``"loads"`` each
    thread's XOR of the 16-byte vectors it reads (vector v of a stage goes to thread v mod 256);
    for the bulk modes with ``touch`` the XOR of the word at byte 16·tid of every stage (zero
    without ``touch``). ``src`` uint8 NumPy array, ``offsets`` :func:`chunk_offsets`."""
    import numpy as np

    words = np.frombuffer(np.ascontiguousarray(src).tobytes(), np.uint32)
    vec = cfg.chunk // 16
    out = np.zeros((grid, THREADS), np.uint32)
    for cta in range(grid):
        offs = offsets[cta * chunks_per_cta:(cta + 1) * chunks_per_cta]
        for i0 in range(0, chunks_per_cta, cfg.per_stage):
            st = offs[i0:i0 + cfg.per_stage]
            # the stage as a run of 16-byte vectors, 4 words each, XOR-folded per vector
            v4 = np.concatenate([words[o // 4:o // 4 + 4 * vec].reshape(vec, 4) for o in st])
            vx = np.bitwise_xor.reduce(v4, axis=1)
            if cfg.mode == "loads":
                n = len(vx)
                pad = np.zeros(-(-n // THREADS) * THREADS, np.uint32)
                pad[:n] = vx
                out[cta] ^= np.bitwise_xor.reduce(pad.reshape(-1, THREADS), axis=0)
            elif cfg.touch:
                n = min(len(vx), THREADS)
                out[cta, :n] ^= vx[:n]
    return out.ravel()
