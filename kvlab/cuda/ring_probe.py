"""Ring probe (``kernels_cu/ring_probe.cu``): stream bytes from global memory the way the paged
decode's ring does (bulk copies into shared-memory stages), or with ordinary loads, and time it.
A measurement tool for ``scripts/ring_probe.py``; it computes nothing and has no reference.

:func:`stream` launches one configuration; :class:`RingConfig` names its parameters."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .loader import KernelSpec, get_kernel, register

MODES = {"bulk_thread": 0, "bulk_warp": 1, "loads": 2, "tensor": 3}
SPECS = register("ring_probe", [KernelSpec("ring_probe", "ring_stream", (m,)) for m in (0, 1, 2)]
                 + [KernelSpec("ring_probe", "ring_stream_tensor")])
MAX_BUF = 8          # RP_MAXBUF in ring_probe.cu
THREADS = 256


@dataclass(frozen=True)
class RingConfig:
    """One probe configuration.

    mode: ``"bulk_thread"`` (thread 0 issues the bulk copies, as the paged decode),
    ``"bulk_warp"`` (the lanes of warp 0 issue them), ``"loads"`` (16-byte loads by every
    thread, no shared memory) or ``"tensor"`` (thread 0 issues 2-D tensor copies: each chunk is
    a box of ``box_rows`` rows of a tensor whose rows are ``row_bytes`` apart, the boxes of one
    CTA all at the same column — ``layout="heads"``, :func:`chunk_offsets`); chunk: bytes per
    chunk (multiple of 16; tensor: the box, ``box_rows`` × its row, a multiple of 128); per_stage: chunks per
    ring stage; nbuf: stages (2 … 8); split: bulk copies per chunk; ctas_per_sm: the grid is
    this × the SM count (shared memory must allow it to be resident); layout: ``"paged"``
    (pairs of chunks — a block's K and V — at shuffled places, as the decode benchmark's
    shuffled block table), ``"blocks"`` (every chunk at its own shuffled place: a chunk is a
    whole block, its K and V sides together, as the paged decode copies a block of 16 tokens) or
    ``"contig"`` (tensor mode: ``"heads"``); touch: every thread reads
    one 16-byte word per stage; evict_first: L2 evict-first hint on the bulk copies. Tensor mode
    only: row_bytes (a token's row of every KV head, a multiple of 16), box_rows (tokens per box),
    col_step (bytes from one column group's first byte to the next: the KV heads one CTA stages;
    its boxes start there rounded down to 16 bytes, :func:`group_starts`)."""
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
    row_bytes: int = 0
    box_rows: int = 16
    col_step: int = 0

    def smem_bytes(self) -> int:
        return 0 if self.mode == "loads" else self.nbuf * self.per_stage * self.chunk

    def box_bytes(self) -> int:
        """Tensor mode: bytes of one box row (the chunk over ``box_rows``)."""
        return self.chunk // self.box_rows

    def elem_bytes(self) -> int:
        """Tensor mode: the tensor map's element size, the largest of 4, 2, 1 dividing the row and
        the box row (a box row holds at most 256 elements; boxes start at 16-byte columns)."""
        return next(e for e in (4, 2, 1) if not (self.row_bytes % e or self.box_bytes() % e))

    def check(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {sorted(MODES)}, got {self.mode!r}")
        if (self.mode == "tensor") != (self.layout == "heads"):
            raise ValueError(f"layout: 'heads' goes with mode 'tensor' (and only with it), got mode "
                             f"{self.mode!r} with layout {self.layout!r}")
        if self.layout not in ("paged", "blocks", "contig", "heads"):
            raise ValueError(f"layout: expected 'paged', 'blocks', 'contig' or 'heads', got {self.layout!r}")
        if self.mode == "tensor":
            if self.chunk % self.box_rows or self.chunk % 128 or self.box_bytes() % 16:
                raise ValueError(f"chunk: a box of {self.box_rows} rows whose row is a multiple of 16 "
                                 f"bytes and whose size is a multiple of 128, got {self.chunk}")
            if self.row_bytes <= 0 or self.row_bytes % 16 or not 0 < self.col_step < self.row_bytes:
                raise ValueError(f"row_bytes: a positive multiple of 16 above col_step > 0, got "
                                 f"row_bytes {self.row_bytes}, col_step {self.col_step}")
            if self.split != 1 or self.evict_first:
                raise ValueError("split / evict_first: tensor copies take one box per chunk, no hint")
            starts = group_starts(self)
            ends = [min((g + 1) * self.col_step, self.row_bytes) for g in range(len(starts))]
            if any(c + self.box_bytes() < e for c, e in zip(starts, ends)):
                raise ValueError(f"col_step: a box of {self.box_bytes()} B from each group's 16-byte aligned "
                                 f"start must cover the group's {self.col_step} B")
            if self.box_bytes() // self.elem_bytes() > 256 or not 1 <= self.box_rows <= 256:
                raise ValueError(f"box: at most 256 elements a side, got {self.box_bytes() // self.elem_bytes()} "
                                 f"x {self.box_rows}")
        if self.chunk % 16 or self.chunk <= 0:
            raise ValueError(f"chunk: a positive multiple of 16 bytes, got {self.chunk}")
        if self.mode != "loads":
            if not 2 <= self.nbuf <= MAX_BUF:
                raise ValueError(f"nbuf: 2 … {MAX_BUF}, got {self.nbuf}")
            if self.split < 1 or self.chunk % (16 * self.split):
                raise ValueError(f"split: pieces of chunk/split bytes must be multiples of 16 "
                                 f"(chunk {self.chunk}, split {self.split})")


def head_groups(cfg: RingConfig) -> int:
    """Tensor mode: column groups of a row (the last box may run past the row's end: its
    remainder is zero-filled, not read)."""
    return -(-cfg.row_bytes // cfg.col_step)


def group_starts(cfg: RingConfig) -> list[int]:
    """Tensor mode: the byte column where each column group's boxes start — the group's first
    byte ``g · col_step`` rounded down to 16 bytes, because a tensor copy's box must start at a
    16-byte aligned address (measured on the H200, ``scripts/tensor_copy_check.py``: boxes at
    264-byte steps raised an illegal instruction). The box then holds the group's bytes at
    offset ``g · col_step`` minus that start (< 16)."""
    return [(g * cfg.col_step) & ~15 for g in range(head_groups(cfg))]


def tensor_rows(cfg: RingConfig, grid: int, chunks_per_cta: int) -> int:
    """Tensor mode: rows of the source tensor that :func:`chunk_offsets` addresses."""
    seqs = -(-grid // head_groups(cfg))
    return seqs * (chunks_per_cta // 2) * 2 * cfg.box_rows


def chunk_offsets(cfg: RingConfig, grid: int, chunks_per_cta: int, seed: int = 0):
    """int64 byte offsets, ``grid × chunks_per_cta`` of them, CTA-major: contiguous, blocks of
    two adjacent chunks at a random permutation of block places (``"paged"``, ``chunks_per_cta``
    even), or every chunk at a random permutation of chunk places (``"blocks"``).

    Tensor mode (``layout="heads"``), a paged cache split by KV heads: the tensor's rows are
    blocks of 2 · ``box_rows`` rows (a block's K tokens, then its V tokens) at shuffled places;
    CTA c stages column group ``c % head_groups`` of sequence ``c // head_groups``'s blocks, a K
    box and a V box per block, from the group's 16-byte aligned start (:func:`group_starts`).
    Each entry packs (row << 20) | (column in tensor-map elements)."""
    import numpy as np

    n = grid * chunks_per_cta
    if cfg.layout == "heads":
        if chunks_per_cta % 2:
            raise ValueError("heads layout: chunks_per_cta must be even (K and V boxes of a block)")
        groups, bpc = head_groups(cfg), chunks_per_cta // 2
        perm = np.random.default_rng(seed).permutation(tensor_rows(cfg, grid, chunks_per_cta) // (2 * cfg.box_rows))
        cta = np.arange(grid)
        blocks = perm.reshape(-1, bpc)[cta // groups].astype(np.int64)              # (grid, bpc)
        rows = (blocks[:, :, None] * 2 + np.arange(2)[None, None, :]) * cfg.box_rows  # (grid, bpc, 2)
        cols = np.asarray(group_starts(cfg), np.int64)[cta % groups] // cfg.elem_bytes()
        return (rows.reshape(grid, -1) << 20 | cols[:, None]).ravel().astype(np.int64)
    if cfg.layout == "contig":
        return np.arange(n, dtype=np.int64) * cfg.chunk
    if cfg.layout == "blocks":
        return np.random.default_rng(seed).permutation(n).astype(np.int64) * cfg.chunk
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
    if cfg.mode == "tensor":
        from . import launch as L

        e, rows = cfg.elem_bytes(), tensor_rows(cfg, grid, chunks_per_cta)
        if src.nbytes < rows * cfg.row_bytes:
            raise ValueError(f"src: the tensor needs {rows} rows of {cfg.row_bytes} bytes, got {src.nbytes} bytes")
        tmap = _tensor_map(int(src.data.ptr), e, cfg.row_bytes // e, rows, cfg.row_bytes,
                           cfg.box_bytes() // e, cfg.box_rows)
        L.launch_ex(k, (grid,), (THREADS,), (
            L.ptr(offsets_d), L.i32(chunks_per_cta), L.i32(cfg.chunk), L.i32(cfg.per_stage),
            L.i32(cfg.nbuf), L.i32(int(cfg.touch)), L.ptr(sink), tmap), shared_mem=smem)
        return
    k((grid,), (THREADS,),
      (src, offsets_d, cupy.int32(chunks_per_cta), cupy.int32(cfg.chunk), cupy.int32(cfg.per_stage),
       cupy.int32(cfg.nbuf), cupy.int32(cfg.split), cupy.int32(int(cfg.touch)),
       cupy.int32(int(cfg.evict_first)), sink), shared_mem=smem)


@functools.lru_cache(maxsize=16)
def _tensor_map(*args) -> bytes:
    """:func:`launch.encode_tensor_map_2d`, kept per (address, geometry): the benchmark launches the
    same map many times."""
    from .launch import encode_tensor_map_2d

    return encode_tensor_map_2d(*args)


def _stage_vectors(cfg: RingConfig, src, offs):
    """The 16-byte vectors (4 words each, (n, 4) uint32) of one stage as it lies in shared
    memory: its chunks in order; a tensor-mode chunk is its box, rows of ``box_bytes`` taken
    ``row_bytes`` apart from (row, column), zero past the end of a row or of the tensor."""
    import numpy as np

    if cfg.mode != "tensor":
        return np.concatenate([np.frombuffer(src[o:o + cfg.chunk].tobytes(), np.uint32).reshape(-1, 4)
                               for o in offs])
    e, bb, rb = cfg.elem_bytes(), cfg.box_bytes(), cfg.row_bytes
    rows_total = len(src) // rb
    boxes = []
    for c in offs:
        row0, col = int(c) >> 20, (int(c) & 0xFFFFF) * e
        box = np.zeros((cfg.box_rows, bb), np.uint8)
        for r in range(cfg.box_rows):
            if row0 + r < rows_total:
                n = max(0, min(bb, rb - col))
                box[r, :n] = src[(row0 + r) * rb + col:(row0 + r) * rb + col + n]
        boxes.append(np.frombuffer(box.tobytes(), np.uint32).reshape(-1, 4))
    return np.concatenate(boxes)


def expected_sink(cfg: RingConfig, src, offsets, grid: int, chunks_per_cta: int):
    """NumPy model of the probe's ``sink`` (uint32, ``grid × THREADS``): for ``"loads"`` each
    thread's XOR of the 16-byte vectors it reads (vector v of a stage goes to thread v mod 256);
    for the bulk modes with ``touch`` the XOR of the word at byte 16·tid of every stage (zero
    without ``touch``). ``src`` uint8 NumPy array, ``offsets`` :func:`chunk_offsets`."""
    import numpy as np

    src = np.ascontiguousarray(src).view(np.uint8).ravel()
    out = np.zeros((grid, THREADS), np.uint32)
    for cta in range(grid):
        offs = offsets[cta * chunks_per_cta:(cta + 1) * chunks_per_cta]
        for i0 in range(0, chunks_per_cta, cfg.per_stage):
            # the stage as a run of 16-byte vectors, 4 words each, XOR-folded per vector
            vx = np.bitwise_xor.reduce(_stage_vectors(cfg, src, offs[i0:i0 + cfg.per_stage]), axis=1)
            if cfg.mode == "loads":
                n = len(vx)
                pad = np.zeros(-(-n // THREADS) * THREADS, np.uint32)
                pad[:n] = vx
                out[cta] ^= np.bitwise_xor.reduce(pad.reshape(-1, THREADS), axis=0)
            elif cfg.touch:
                n = min(len(vx), THREADS)
                out[cta, :n] ^= vx[:n]
    return out.ravel()
