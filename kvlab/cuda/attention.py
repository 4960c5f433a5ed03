"""GPU paged attention. Reference: :mod:`kvlab.reference.attention`.

Kernels: ``kernels_cu/paged_attention.cu`` (decode, split-KV reduction; family
``paged_attention``) and ``kernels_cu/paged_prefill.cu`` (prefill; family ``paged_prefill``),
or, with ``prefill_variant="wgmma"``, ``kernels_cu/paged_prefill_wgmma.cu`` (prefill on Hopper
``wgmma``, sm_90a only; family ``paged_prefill_wgmma``).

SPEC 2.4 semantics for every format: ragged batches mixing decode and (chunked)
prefill, GQA, causal, optional sliding window. Two steps, as FlashInfer's
plan/run:

* :func:`plan_paged_attention` validates the arguments (host copies of the small
  index arrays) and builds the work list: *work items* of up to 8 query columns
  — (query token, query head) pairs of one sequence sharing a KV head — and a
  range of KV positions. Long ranges are split (flash-decoding) so that a batch
  of one long sequence still fills the GPU; the splits are merged by a second
  kernel. On the device each item is one 64-byte row that also carries its
  sequence's query offset, query length and KV length and the cache blocks of its
  first chunks (``_item_meta``), so the paged decode kernel starts its copies after
  one load.
* Decode work items run on one of two kernels (``decode_variant``; the default ``"auto"``
  takes ``"paged"`` for the quantized caches when decode sequences × KV heads ≥ the SM count
  or the decode reads ≥ 2^17 (token, KV head) rows, 2^19 for nvfp4 — where it measured faster
  on the H200, ``_auto_wants_paged`` — and ``"per_head"`` otherwise):

  - ``"per_head"`` — ``paged_attention_decode``: one CTA per (work item, column
    group), its warps gather their KV head's rows straight from global memory;
  - ``"paged"`` — ``paged_attention_decode_paged``: one CTA per work item covering every
    column group (one warp each, at most ``PG_MAXW``); one thread copies whole 16-token page
    chunks of K and V (all KV heads, contiguous) into a ring of ``nbuf`` shared-memory stages
    with Hopper bulk copies (TMA, mbarrier-completed), the warps decode from there with the
    per-head kernel's tile math (the first stages are copied before the query prologue; two
    stages when a stage is ≥ 32 KB, ``KVLAB_DECODE_PAGED_NBUF`` caps them; in a grid of one
    wave of two CTAs per SM the first-wave splits are longer, ``_wave_weighted``; a ragged batch's
    splits are re-drawn over every resident slot, ``_slot_filled``). Two CTA forms: two CTAs
    per SM, or the dual-ring CTA (``paged_halves`` 2: one CTA per SM whose two halves each run
    that pipeline, with a ring of their own, over half of the item's chunks), which the plan
    takes for the (format, head size) pairs of ``PG_DUAL_DEFAULT`` where its list is modelled no
    slower (``_dual_default``; ``KVLAB_DECODE_PAGED_DUAL=0|1`` forces one). It applies on
    sm_90+ when ``num_kv_heads · G / hpc ≤ 8`` and
    at least two stages fit the device's shared memory; otherwise the plan falls back to
    ``"per_head"`` and says why in ``AttentionPlan.decode_variant_note``.

  The environment variable ``KVLAB_DECODE_VARIANT`` overrides the default (an explicit
  ``decode_variant`` argument wins over it).
* Prefill work runs on one of two kernels of the same work list and semantics
  (``prefill_variant``): ``"mma"`` — ``paged_attention_prefill``, mma.sync + ldmatrix, any
  sm_80+ GPU; ``"wgmma"`` — ``paged_attention_prefill_wgmma``, Hopper warpgroup MMA,
  warp-specialised (a producer warpgroup decodes the cache into a shared-memory ring), compute
  capability 9.0 only (asking for it elsewhere raises ``ValueError`` when the plan is built);
  ``"auto"`` (default) — ``"wgmma"`` on compute capability 9.0, where it took 21–45 % less time
  than ``"mma"`` on the H200 (session 8's prefill grid), ``"mma"`` elsewhere. The environment variable
  ``KVLAB_PREFILL_VARIANT`` overrides the default (an explicit argument wins over it).
* :meth:`AttentionPlan.run` launches the kernels on the caller's stream. A model
  runs one plan for all its layers (the metadata is the same), which is why the
  benchmarks time ``run``.

:func:`paged_attention` does both, and keeps the plans of its last ``PLAN_CACHE_SIZE`` calls:
called again with index arrays of the same contents (the next layer of the same batch) and
otherwise equal arguments, it runs the kept plan after one copy and comparison of the index
arrays instead of planning again.
"""
from __future__ import annotations

import collections
import functools
import itertools
import math
import os
import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .. import arrays, checks, validate
from ..formats.base import CacheFormat
from . import launch as L
from .loader import KernelSpec, get_kernel, register

FAMILY = "paged_attention"
PREFILL_FAMILY = "paged_prefill"
PREFILL_WGMMA_FAMILY = "paged_prefill_wgmma"
#: format name -> FMT template code (attention_common.cuh ``enum Fmt``)
FORMAT_CODES = {
    "auto": 0,
    "int8_per_token_head": 1,
    "fp8_per_token_head": 2,
    "int4_per_token_head": 3,
    "nvfp4": 4,
}
HEAD_SIZES = (64, 128, 256)
Q_DTYPES = ("bfloat16", "float16")
NW = 4          # warps per attention CTA
NCOL = 8        # query columns per CTA
ITEM_HOST = 5   # ints per work item of the host lists: seq, tok0, kv_lo, kv_hi, part
ITEM = 16       # ints per work item on the device: ITEM_HOST, then the row's metadata (_item_meta)
ITEM_PRE = 4    # chunks whose cache block a device row carries (ITEM_PRE in paged_attention.cu)
MIN_SPLIT_TOKENS = 256  # a split gives each of the NW warps at least 4 tiles of 16 tokens

DECODE_VARIANTS = ("auto", "per_head", "paged")
DEFAULT_DECODE_VARIANT = "auto"
#: "auto" picks the paged kernel for these formats when (decode sequences × KV heads) reaches
#: this many SMs' worth of work (measured on the H200: docs/perf-notes.md, paged decode v2;
#: nvfp4 2.0 → 1.0 in session 21: at B = 32 × 1k / 8k it was 16–19 % faster than per_head) …
AUTO_PAGED_MIN_SM_FRACTION = {"int8_per_token_head": 1.0, "fp8_per_token_head": 1.0,
                              "int4_per_token_head": 1.0, "nvfp4": 1.0}
#: … or when the decode reads at least this many (token, KV head) rows (Σ over the decode
#: sequences of the context they attend to, times the KV heads): since the paged kernel splits a
#: sequence over the SMs it fills the GPU from one sequence up, and the per-sequence rule above
#: left it 13–75 % slower at batch 1–8 over long contexts (session 21: the H200 decode grid
#: measures both kernels in every cell; _auto_wants_paged, docs/perf-notes.md "Session 21").
AUTO_PAGED_MIN_ROWS = {"int8_per_token_head": 1 << 17, "fp8_per_token_head": 1 << 17,
                       "int4_per_token_head": 1 << 17, "nvfp4": 1 << 19}
PG_MAXW = 8                 # column groups (warps) per CTA of the paged decode kernel
PG_MAXBUF = 4               # its stage buffers at most (PG_MAXBUF in paged_attention.cu)
PG_BIG_STAGE = 32 * 1024    # stages this big (all formats at d = 128 with 8 KV heads) …
PG_BIG_STAGE_NBUF = 2       # … get this many buffers by default (_paged_buffers)
PG_MIN_SPLIT_TOKENS = 128   # each split walks at least 4 stages of 32 tokens (8 of 16)
PG_DUAL_CODES = (1, 2, 3, 4)        # formats with a dual-ring paged-decode CTA (auto: two rings do not fit at d = 128)
PG_DUAL_HEAD_SIZES = (64, 128)      # … and head sizes (NH = 2 needs 2·ny warps of ≤ 128 registers)
class DualRule(NamedTuple):
    """When the plan gives a paged decode the dual-ring CTA by default (``_dual_default``): its
    work list must be modelled no slower than the two-per-SM list with the dual ring's SM rate
    raised by ``gain`` (``_dual_pays``; None: no comparison), its longest part must have at least
    ``min_tiles`` 16-token tiles (the dual ring's prologue and its CTA barrier are longer than a
    two-per-SM CTA's), and the batch at most ``max_seqs`` decode sequences (None: any) — or, with
    ``same_parts``, any batch whose two-per-SM list has no more parts than the dual ring's."""
    gain: float | None
    min_tiles: int
    max_seqs: int | None = None
    same_parts: bool = False


# KVLAB_DECODE_PAGED_DUAL unset: the dual-ring CTA's default rule per (format code, head size,
# dual-ring CTAs per SM: 1, or 2 for two or more). Fitted on the H200's full decode grid measured
# in both CTA forms with the split query staging (session 19, call 2: docs/perf-notes.md "Session
# 19", benchmarks/latest/decode/variants_session19/call2_grid_dual_vs_two.md), dual-ring Δ:
#   d = 128, 32/8 heads (one dual-ring CTA of 16 warps per SM against two of 8)
#   int8: −3 … −12 % over parts of ≥ 16 tiles (B = 32 × 8k −5.5 %, batch 1 × 128k −5.6 %), 8-tile
#         parts +2.4 … +4.1 %; ragged 40 × 300 + 4 × 60k +8 % (short unsplit sequences idle an SM:
#         the model sees it);
#   fp8:  refitted in session 20 (call 3, benchmarks/latest/decode/variants_session20/
#         call3_fill_fp8_*.md) after its rows became interleaved words (no bank conflicts):
#         −0.7 … −21 % over parts of ≥ 17 tiles (B = 32 × 8k −15.7 %, batch 1 × 32k / 128k −3.6 /
#         −9.1 %, 8 × 8k −0.7 %), 16 tiles +1.2 % (4 × 8k; session 19, 32 × 1k: +1.9 %); a miss:
#         batch 1 × 8k, 8 tiles, −1.1 %. (Session 19's conflicted kernel: dual from 64 tiles.);
#   int4: −1.7 … −7 % over parts of ≥ 32 tiles (batch 1 × 128k −1.7 %, B = 32 × 8k −3.9 %),
#         16–17 tiles −0.1 / +2.1 %, 8 tiles +4.7 … +5.5 %;
#   nvfp4: +0.5 … +8.6 % but at B = 8 × 8k / 32k (−2.4 / −0.6 %): not a candidate.
#   d = 64, 32/8 heads: int8 −1.4 … −3.3 % over parts of ≥ 66 tiles, +6.1 % at 8 tiles (batch 1
#         × 8k); fp8 (session 20, interleaved) −1.0 … −4.4 % in every measured batch, 8-tile parts
#         included (batch 1 × 8k −4.4 %, 8 × 8k −4.3 %); int4 / nvfp4 +1 … +7 % but B = 32 × 8k
#         int4 −1.0 %: not candidates.
#   d = 64, 9/3 heads, the shipped model's (two or three dual-ring CTAs of 6 warps per SM against
#   four to seven of 3; scripts/decode_fill_ab.py --shape 9/3/64, call2_fill93.md): nvfp4
#         −4 … −25 % in every batch; fp8 −1.4 … −16 % (the ragged 40 × 300 + 4 × 60k +0.4 %;
#         session 20, interleaved: batch 1 × 8k / 128k −15.5 / −8.1 %, B = 8 / 32 / 64 × 8k +0.6 /
#         +0.7 / +1.6 %, kept as int8's);
#         int8 −5 … −14 % at batch 1 × 8k / 128k, −2 … −8 % at B = 4 … 16 × 8k and 2 / 8 × 32k
#         (call 6), 0 … +3.2 % at B = 2 × 8k, 4 × 32k, 32, 64, 1 × 32k and ragged;
#         int4 −4 … −15 % at batch 1, +11 … +14 % from B = 32 up. The model prices these rows
#         +3 … +9 % against the dual ring (it counts the small CTAs at the two-per-SM rate), hence
#         the gain of 0.15.
#         int4 at 9/3 (call 6, call6_fill93_batches.md) follows the parts: where both forms' lists
#         have the same parts the dual ring wins (B = 2 / 4 × 8k −12 / −7.7 %, batch 1 × 8k / 32k
#         −15 / −12 %), where the two-per-SM list has more it loses (+11 … +27 % at B = 8 / 16 × 8k,
#         2 … 8 × 32k and from B = 32 up) — but for batch 1 × 128k (923 parts against 396: −4 … −8 %,
#         its merge of 923 parts): batch 1 or the same parts.
PG_DUAL_DEFAULT = {
    (1, 128, 1): DualRule(0.05, 16), (2, 128, 1): DualRule(0.05, 17), (3, 128, 1): DualRule(0.04, 32),
    (1, 64, 1): DualRule(0.05, 16), (2, 64, 1): DualRule(0.05, 8),
    (1, 64, 2): DualRule(0.15, 0), (2, 64, 2): DualRule(0.15, 0), (4, 64, 2): DualRule(0.15, 0),
    (3, 64, 2): DualRule(None, 0, max_seqs=1, same_parts=True),
}
#: the dual ring's stages per ring where its stages are big (PG_BIG_STAGE; else PG_BIG_STAGE_NBUF),
#: by (format code, head size): none now. fp8 at d = 128 had 3 (session 18: −2.2 … −2.6 % against
#: 2 with the joint staging; session 19: +0.2 % at B = 32 × 8k, −2.1 % at batch 1 × 128k); with its
#: interleaved rows (session 20, call 3) 3 stages are +1.9 … +3.6 % from B = 8 × 32k up and at
#: batch 1 × 128k, −1.6 % at batch 1 × 32k, so fp8 keeps 2 as int8 / int4 (+1 … +4 % with 3)
PG_DUAL_NBUF: dict[tuple[int, int], int] = {}
#: first-wave weight of the paged decode's splits (_wave_weighted): with two CTAs per SM, the
#: CTA placed first on an SM runs faster than its partner (measured on the H200, docs/perf-notes.md
#: "Session 11"), so its splits get this many times the tokens; KVLAB_DECODE_WAVE_WEIGHT overrides
PG_WAVE_WEIGHT = 1.2
#: (weight, mean 16-token tiles per part) by (format code, head size): the first-wave weight where
#: the split list has parts at least that long on average (``_wave_weight``). nvfp4's first-placed CTA
#: outruns its partner more (session 21's timeline at 1.2, B = 32 × 8k: the first-placed CTAs'
#: loops take ~82 µs for 34–35 stages, their partners' ~95 for 29–30; docs/perf-notes.md
#: "Session 23"). Measured on the H200 (scripts/decode_fill_ab.py, weights 1.2 … 2.0, A B A B):
#: 1.6 against 1.2 −1.6 % at B = 32 × 8k, −1.8 % at 64 × 4k, −3.0 % at 4 × 32k, −0.6 % at batch
#: 1 × 128k, −3 … −5 % on the ragged batches, flat at 8 / 16 × 8k; 1.8 and 2.0 mostly slower
#: than 1.6; batch 1 × 32k (~9 tiles per part) +2.3 … +2.6 %, hence the tile minimum. Measured at
#: 32/8 heads, d = 128 only (d = 64 keeps 1.2). A key here must not have a PG_DUAL_DEFAULT rule as
#: well: _dual_default models the two-per-SM list at PG_WAVE_WEIGHT.
PG_WAVE_WEIGHT_FMT: dict[tuple[int, int], tuple[float, int]] = {(4, 128): (1.6, 16)}

PREFILL_HEAD_SIZES = (64, 128)   # head size 256 prefill runs on the decode kernel
PF_WARPS = 8                     # warps per prefill CTA (kernels_cu/paged_prefill.cu: NW)
PF_ROWS = 128                    # query rows per prefill CTA (PF_ROWS in paged_prefill.cu)
PREFILL_MIN_ROWS = 32            # a sequence with >= this many (token, head) rows per KV head uses it
PREFILL_VARIANTS = ("auto", "mma", "wgmma")
DEFAULT_PREFILL_VARIANT = "auto"  # "wgmma" on compute capability 9.0 (16-43 % less time on the H200), else "mma"

SPECS = register(FAMILY, [
    *[KernelSpec(FAMILY, "paged_attention_decode", (code, d, t))
      for code in FORMAT_CODES.values() for d in HEAD_SIZES for t in Q_DTYPES],
    *[KernelSpec(FAMILY, "paged_attention_decode_paged", (code, d, t))
      for code in FORMAT_CODES.values() for d in HEAD_SIZES for t in Q_DTYPES],
    # the dual-ring CTA (NH = 2, one per SM; _paged_halves): quantized formats, d <= 128
    *[KernelSpec(FAMILY, "paged_attention_decode_paged", (code, d, t, 2))
      for code in PG_DUAL_CODES for d in PG_DUAL_HEAD_SIZES for t in Q_DTYPES],
    *[KernelSpec(FAMILY, "paged_attention_reduce", (d, t, rot, split))
      for d in HEAD_SIZES for t in Q_DTYPES for rot in (False, True) for split in (False, True)],
])
# The prefill kernel has its own source file (kernels_cu/paged_prefill.cu) and family.
PREFILL_SPECS = register(PREFILL_FAMILY, [
    KernelSpec(PREFILL_FAMILY, "paged_attention_prefill", (code, d, t))
    for code in FORMAT_CODES.values() for d in PREFILL_HEAD_SIZES for t in Q_DTYPES
])
# The wgmma prefill kernel: same instantiations, built for sm_90a only (loader: fixed-arch family).
PREFILL_WGMMA_SPECS = register(PREFILL_WGMMA_FAMILY, [
    KernelSpec(PREFILL_WGMMA_FAMILY, "paged_attention_prefill_wgmma", (code, d, t))
    for code in FORMAT_CODES.values() for d in PREFILL_HEAD_SIZES for t in Q_DTYPES
], arch="sm_90a")


def _decode_spec(code, d, t):
    return KernelSpec(FAMILY, "paged_attention_decode", (code, d, t))


def _paged_spec(code, d, t, nh=1):
    """The paged decode kernel; ``nh = 2``: its dual-ring CTA (``NH`` in the .cu)."""
    return KernelSpec(FAMILY, "paged_attention_decode_paged", (code, d, t) if nh == 1 else (code, d, t, nh))


def paged_row_bytes(code: int, d: int) -> int:
    """Bytes per (token, KV head) row of a cache format (``Traits<FMT, D>::ROW``)."""
    return {0: 2 * d, 1: d + 4, 2: d + 4, 3: d // 2 + 4, 4: d // 2 + d // 16}[code]


def paged_stage_bytes(code: int, d: int, num_kv_heads: int) -> int:
    """Bytes of one stage of ``paged_attention_decode_paged`` (``PagedTile`` in the .cu):
    ``2 sides · TT tokens · H · row bytes``, TT = 32 for rows ≤ 80 bytes, 16 otherwise."""
    row = paged_row_bytes(code, d)
    return 2 * (32 if row <= 80 else 16) * num_kv_heads * row


#: -D switches that build the dual-ring CTA with session 18's joint query staging (each half stages
#: all 8 columns into its own ring) instead of the split staging after both rings (the default since
#: session 19); the same rule as the #if before ``paged_attention_decode_paged`` in paged_attention.cu
_DUAL_JOINT_STAGING_MACROS = ("KVLAB_DECODE_DUAL_JOINT_STAGING", "KVLAB_DECODE_SERIAL_QUERY_COLUMNS",
                              "KVLAB_DECODE_NO_EARLY_ISSUE", "KVLAB_DECODE_DUAL_CTA_BARRIER")


def _dual_split_staging() -> bool:
    """Whether the dual-ring CTA stages its queries once, after both rings (``paged_smem_bytes``):
    the default, unless ``KVLAB_NVRTC_OPTIONS`` defines one of ``_DUAL_JOINT_STAGING_MACROS``
    (``-DNAME`` or ``--define-macro=NAME``, read by ``_macros``)."""
    defined = _macros(os.environ.get("KVLAB_NVRTC_OPTIONS", ""))
    return not any(m in defined for m in _DUAL_JOINT_STAGING_MACROS)


def paged_smem_bytes(code: int, d: int, num_kv_heads: int, ny: int, nbuf: int, nh: int = 1) -> int:
    """Dynamic shared memory of ``paged_attention_decode_paged`` with ``nh`` rings (2: the
    dual-ring CTA) of ``nbuf`` stage buffers; each ring holds its half's q staging
    (``ny · 8 · d · 2``) at its end before the loop, and the output rows of all ``nh · ny``
    warps (``nh · ny · 8 · d · 4``) come after it, from the start. The dual-ring CTA (``nh`` 2)
    keeps one q staging after both rings instead (its split staging, ``_dual_split_staging``)."""
    rings = nh * nbuf * paged_stage_bytes(code, d, num_kv_heads)
    if nh == 2 and _dual_split_staging():
        rings += ny * NCOL * d * 2
    return max(rings, nh * ny * NCOL * d * 4)


def _paged_halves(code: int, d: int) -> int:
    """Halves of the paged decode kernel's CTA: 2 (the dual-ring CTA, one per SM, two halves of
    ``ny`` warps that each decode half of the item's chunks from a ring of their own, ``NH = 2``
    in paged_attention.cu) or 1 (two CTAs per SM). ``KVLAB_DECODE_PAGED_DUAL`` = ``1`` / ``0``
    picks for every format; unset, the (format, head size) pairs of ``PG_DUAL_DEFAULT`` are
    candidates, and the plan keeps the dual ring only where the pair's rule holds for the batch
    (``_dual_default``).
    Formats and head sizes without a dual-ring instantiation (auto, d = 256) always get 1. Read
    when a plan is built."""
    env = os.environ.get("KVLAB_DECODE_PAGED_DUAL", "").strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"KVLAB_DECODE_PAGED_DUAL: expected 0 or 1, got {env!r}")
    dual = any(k[:2] == (code, d) for k in PG_DUAL_DEFAULT) if env == "" else env == "1"
    return 2 if dual and code in PG_DUAL_CODES and d in PG_DUAL_HEAD_SIZES else 1


def _dual_forced() -> bool:
    """Whether ``KVLAB_DECODE_PAGED_DUAL`` picks the CTA form (set) or the plan does (unset: the
    dual ring for the (format, head size) pairs of ``PG_DUAL_DEFAULT`` where ``_dual_default``)."""
    return os.environ.get("KVLAB_DECODE_PAGED_DUAL", "").strip() != ""


def _list_time(items: np.ndarray, n_sm: int, weight: float, nh: int, gain: float = 0.0,
               per_sm: int = 1) -> float:
    """Modelled time of a paged-decode work list, in 16-token tiles at the rate of a second-placed
    CTA of two per SM: with two CTAs per SM (``nh`` 1) the longest part, the first ``n_sm`` rows
    ``weight`` times as fast (``_longest_part``); with the dual-ring CTA (``nh`` 2, ``per_sm`` of
    them per SM: 1 at d = 128) the longest part at its share of the SM's rate,
    ``(weight + 1) · (1 + gain) / per_sm``. Neither is shorter than all tiles spread evenly over
    the SMs (a list of more than one wave)."""
    t = _row_tiles(items).astype(np.float64)
    if not len(t):
        return 0.0
    even = float(t.sum()) / n_sm
    if nh == 1:
        return max(_longest_part(items, n_sm, weight), even / (weight + 1.0))
    return max(float(t.max()) * per_sm, even) / ((weight + 1.0) * (1.0 + gain))


def _dual_pays(two, dual: np.ndarray, n_sm: int, weight: float, gain: float | None,
               min_tiles: int, per_sm: int = 1) -> bool:
    """Whether the dual-ring CTA's list (``dual``, one slot per SM) is modelled no slower than the
    two-per-SM list (``two``) of the same batch (``_list_time``). Uniform batches: its parts are
    as long as an SM's pair of parts, so its measured gain decides (int8 B = 32 × 8k: 55.4 against
    59.0 tiles). A ragged batch whose short sequences run unsplit leaves an SM idle behind each
    (one slot per SM): there the two-per-SM list wins (40 × 300 + 4 × 60k tokens: 71 against
    ~55; measured on the H200: dual +6 %, session 18). Parts shorter than ``min_tiles``
    (``PG_DUAL_DEFAULT``) do not repay the dual ring's longer prologue. ``gain`` None: the tile
    minimum alone decides (no model comparison).

    ``two`` may be a function that builds the list (``_paged_list``, ~0.1–0.3 ms of host time):
    it is called only where the answer needs it. Both lists cut the same KV ranges at 16-token
    tiles from each range's start, so they hold the same tiles in all, and the two-per-SM list's
    modelled time is never below ``_list_time``'s even spread of them; a dual list modelled no
    slower than that bound pays without building the other (uniform batches)."""
    if not len(dual) or int(_row_tiles(dual).max()) < min_tiles:
        return False
    if gain is None:
        return True
    t_dual = _list_time(dual, n_sm, weight, 2, gain, per_sm)
    if t_dual <= float(_row_tiles(dual).sum()) / n_sm / (weight + 1.0):
        return True
    return t_dual <= _list_time(two() if callable(two) else two, n_sm, weight, 1)


def _dual_default(code: int, d: int, two, dual: np.ndarray, n_sm: int, weight: float,
                  per_sm: int, n_seqs: int) -> bool:
    """The plan's default CTA form where ``KVLAB_DECODE_PAGED_DUAL`` is unset: the dual ring (True)
    where ``PG_DUAL_DEFAULT`` has a rule for (format, head size, 1 or 2 for ``per_sm`` dual-ring
    CTAs resident per SM) and the batch (``n_seqs`` decode sequences, the two forms' lists ``two``
    and ``dual``) meets it: at most ``max_seqs`` sequences (or, with ``same_parts``, no more
    two-per-SM parts than dual-ring ones), and ``_dual_pays`` with its gain and tile minimum; two
    CTAs per SM (False) otherwise. ``two`` may be a function that builds the two-per-SM list: it
    is called only where the rule needs that list (not for a uniform batch the dual ring wins)."""
    rule = PG_DUAL_DEFAULT.get((code, d, min(per_sm, 2)))
    if rule is None:
        return False
    if rule.max_seqs is not None and n_seqs > rule.max_seqs:
        if not (rule.same_parts and len(two() if callable(two) else two) <= len(dual)):
            return False
    return _dual_pays(two, dual, n_sm, weight, rule.gain, rule.min_tiles, per_sm)


def _paged_buffers(code: int, d: int, num_kv_heads: int, ny: int, device_id, nh: int = 1) -> tuple[int, str]:
    """Stage buffers for the paged decode kernel on this device (0 and the reason if it cannot run).

    ``nh = 2`` (the dual-ring CTA) sizes two rings of them for one CTA per SM. Otherwise as many stages
    (≤ ``PG_MAXBUF``) as fit while two CTAs share an SM (one at d = 256, the
    kernel's launch bound), else one CTA per SM; at least two (one stage decoded while the
    next ones are copied). Stages of ``PG_BIG_STAGE`` bytes or more are capped at two: measured
    on the H200 (docs/perf-notes.md "Session 10"), a deeper ring of big stages moves the cache
    more slowly (int4 d = 128, 8 heads: 3 stages 0.1051 ms, 2 stages 0.1047–0.1052; auto:
    0.3352 → 0.2729 ms); the dual ring's big stages get ``PG_DUAL_NBUF``'s depth where it has one
    (none since session 20), and its rings step down a stage where its q staging does not fit
    beside them (nvfp4 at d = 128: 2). ``KVLAB_DECODE_PAGED_NBUF=n`` sets the cap to ``n`` (2 … 4)
    instead (``4``: as many as fit, the session-9 rule)."""
    cc = _compute_capability(device_id)
    if cc < 90:
        return 0, f"paged decode needs sm_90 (bulk copies), the device is sm_{cc}"
    if ny > PG_MAXW:
        return 0, f"paged decode needs num_kv_heads * G / hpc <= {PG_MAXW} column groups, got {ny}"
    _, smem_sm = _device_props(device_id)
    stage = paged_stage_bytes(code, d, num_kv_heads)
    cap = os.environ.get("KVLAB_DECODE_PAGED_NBUF", "").strip()
    if cap:
        if not cap.isdigit() or not 2 <= int(cap) <= PG_MAXBUF:
            raise ValueError(f"KVLAB_DECODE_PAGED_NBUF: 2 … {PG_MAXBUF}, got {cap!r}")
    if cap:
        cap = int(cap)
    elif nh == 2 and (code, d) in PG_DUAL_NBUF:   # the dual ring's stages per ring
        cap = PG_DUAL_NBUF[code, d] if stage >= PG_BIG_STAGE else PG_MAXBUF
    else:
        cap = PG_BIG_STAGE_NBUF if stage >= PG_BIG_STAGE else PG_MAXBUF
    for ctas in ((2, 1) if d <= 128 and nh == 1 else (1,)):
        per_cta = min(smem_sm // ctas, _smem_optin(device_id)) - 4 * 1024  # static + reserved
        nbuf = min(PG_MAXBUF, per_cta // (nh * stage), cap)
        while nbuf > 2 and paged_smem_bytes(code, d, num_kv_heads, ny, nbuf, nh) > per_cta:
            nbuf -= 1   # the dual ring's q staging after its rings takes a stage's room
        if nbuf >= 2 and paged_smem_bytes(code, d, num_kv_heads, ny, nbuf, nh) <= per_cta:
            return nbuf, ""
    return 0, (f"paged decode needs two stages of {stage} B of shared memory per CTA, "
               f"the device allows {per_cta}")


def _prefill_spec(code, d, t, variant="mma"):
    if variant == "wgmma":
        return KernelSpec(PREFILL_WGMMA_FAMILY, "paged_attention_prefill_wgmma", (code, d, t))
    return KernelSpec(PREFILL_FAMILY, "paged_attention_prefill", (code, d, t))


#: ring stages of the warp-specialised wgmma prefill kernel (paged_prefill_wgmma.cu: a producer
#: warpgroup decodes into a ring of stages, two consumer warpgroups of 64 rows each); the compile
#: switch ``-DKVLAB_WGMMA_WS_STAGES=N`` (2..4) in ``KVLAB_NVRTC_OPTIONS`` changes it
WGMMA_WS_STAGES_MACRO = "KVLAB_WGMMA_WS_STAGES"
WGMMA_WS_DEFAULT_STAGES = 4
WGMMA_THREADS = 384


@dataclass(frozen=True)
class PrefillGeometry:
    """Launch shape of a prefill kernel build: query rows per CTA, threads per CTA, and the
    warp-specialised build's ring stages (0: not warp-specialised)."""
    rows: int
    threads: int
    stages: int = 0


def _macros(env_options: str) -> dict:
    """``-DNAME[=VALUE]`` / ``--define-macro=NAME[=VALUE]`` of an NVRTC option string -> {NAME: VALUE or ""}."""
    out = {}
    for o in env_options.split():
        for pre in ("--define-macro=", "-D"):
            if o.startswith(pre) and len(o) > len(pre):
                name, _, value = o[len(pre):].partition("=")
                out[name] = value
                break
    return out


@functools.lru_cache(maxsize=8)
def _wgmma_geometry(env_options: str) -> PrefillGeometry:
    m = _macros(env_options)
    stages = int(m.get(WGMMA_WS_STAGES_MACRO) or WGMMA_WS_DEFAULT_STAGES)
    if not 2 <= stages <= 4:
        raise ValueError(f"KVLAB_NVRTC_OPTIONS: -D{WGMMA_WS_STAGES_MACRO}={stages}: 2 .. 4 stages")
    return PrefillGeometry(PF_ROWS, WGMMA_THREADS, stages)


def prefill_geometry(variant: str = "mma") -> PrefillGeometry:
    """Launch shape of the prefill kernel ``variant`` as built now: v2 (``"mma"``): 128 rows on 256
    threads; ``"wgmma"`` (warp-specialised): 128 rows on 384 threads (producer + 2 consumer
    warpgroups) with ``stages`` ring stages (4, or ``-DKVLAB_WGMMA_WS_STAGES`` read from
    ``KVLAB_NVRTC_OPTIONS``, cached per value; set it for the whole process, as a family is compiled
    once)."""
    if variant == "wgmma":
        return _wgmma_geometry(os.environ.get("KVLAB_NVRTC_OPTIONS", ""))
    return PrefillGeometry(PF_ROWS, PF_WARPS * 32)


def prefill_smem_bytes(d: int, variant: str = "mma") -> int:
    """Dynamic shared memory of a prefill launch (bytes). v2: two KV tile buffers + the query rows
    (``PfSmem<D>::BYTES`` in paged_prefill.cu: 16-byte padded rows for ldmatrix), 768·d + 7168;
    wgmma: ``stages`` ring stages of (K tile, V tile, 2·64 float scales) + the query rows as
    unpadded wgmma core matrices (``WsSmem<D>::BYTES``), stages·(256·d + 512) + 256·d."""
    if variant == "wgmma":
        stages = prefill_geometry(variant).stages
        return stages * (256 * d + 512) + 256 * d
    return 768 * d + 7168


def _auto_wants_paged(fmt_name: str, d: int, num_kv_heads: int, dec_lens, window: int, n_sm: int) -> bool:
    """Whether ``decode_variant="auto"`` takes the paged kernel (sm_90; the plan falls back to
    per_head with a note where it cannot) for a decode over sequences of KV lengths ``dec_lens``
    (int array, one per decode sequence): where decode sequences × KV heads reach
    ``AUTO_PAGED_MIN_SM_FRACTION`` SMs' worth, or the rows it reads (each sequence's attended
    context — ``window`` tokens at most when > 0 — times the KV heads) reach
    ``AUTO_PAGED_MIN_ROWS``. Fitted on session 21's H200 decode grid, its 9 / 3-head cells
    re-measured in session 24 once the paged lists fitted the GPU (``ctas_per_sm``); where it picks
    the slower kernel there (tests/test_attention_plan.py, test_auto_variant_where_measured) it
    loses ≤ 16 %, ≤ 2 µs. (Sessions 21–23 kept int4 at head size 64 with ≤ 4 KV heads and one
    sequence on per_head: the paged list had a second wave there, 0.0376 ms against per_head's
    0.0298 at 9 / 3 heads × 128k; without it paged takes 0.0278.)"""
    if fmt_name not in AUTO_PAGED_MIN_SM_FRACTION:
        return False
    lens = np.asarray(dec_lens, dtype=np.int64)
    n = int(lens.size)
    if n == 0:
        return False
    if n * num_kv_heads >= AUTO_PAGED_MIN_SM_FRACTION[fmt_name] * n_sm:
        return True
    span = np.minimum(lens, window) if window > 0 else lens
    return int(span.sum()) * num_kv_heads >= AUTO_PAGED_MIN_ROWS[fmt_name]


def _variant_choice(value, env: str, default: str, choices, arg: str) -> tuple[str, str]:
    """A kernel-variant knob: the explicit argument ``arg`` if given, else the environment
    variable ``env``, else ``default``; validated against ``choices``. Returns the value and the
    name that errors should blame (the argument or the variable)."""
    if value is None:
        value, what = os.environ.get(env, "") or default, env
    else:
        what = arg
    if value not in choices:
        raise ValueError(f"{what}: expected one of {list(choices)}, got {value!r}")
    return value, what


def _resolve_prefill_variant(prefill_variant, device_id) -> str:
    """``prefill_variant`` (None: ``KVLAB_PREFILL_VARIANT``, else the default ``"auto"``),
    validated and resolved to the kernel that runs: ``"auto"`` is ``"wgmma"`` on a device of compute
    capability 9.0 and ``"mma"`` elsewhere; an explicit ``"wgmma"`` needs compute capability 9.0
    (the kernel is built for sm_90a)."""
    prefill_variant, what = _variant_choice(prefill_variant, "KVLAB_PREFILL_VARIANT", DEFAULT_PREFILL_VARIANT,
                                            PREFILL_VARIANTS, "prefill_variant")
    if prefill_variant in ("auto", "wgmma"):
        cc = _compute_capability(device_id)
        if prefill_variant == "auto":
            return "wgmma" if cc == 90 else "mma"
        if cc != 90:
            raise ValueError(f"{what}: 'wgmma' needs a GPU of compute capability 9.0 (H100/H200; the kernel "
                             f"is built for sm_90a), device {device_id} is sm_{cc}; use 'mma'")
    return prefill_variant


def _reduce_spec(d, t, rot, split=False):
    return KernelSpec(FAMILY, "paged_attention_reduce", (d, t, rot, split))


def reduce_split(n_red: int, ny: int, sm_count: int) -> bool:
    """Whether the split merge spreads each column's parts over the 8 warps of a CTA (one CTA per
    column: ``n_red · ny · 8`` CTAs) instead of one warp per column (``n_red · ny`` CTAs): when the
    latter would leave SMs idle (batch 1: 8 CTAs on 132 SMs; CUPTI measured that merge at 8.9 µs
    at batch 1 × 128k on the H200, docs/perf-notes.md "Session 9"). The environment variable
    ``KVLAB_DECODE_MERGE_SPLIT`` = ``0`` / ``1`` forces the choice (A/B in one process)."""
    import os

    forced = os.environ.get("KVLAB_DECODE_MERGE_SPLIT", "")
    if forced in ("0", "1"):
        return n_red > 0 and forced == "1"
    if forced:
        raise ValueError(f"KVLAB_DECODE_MERGE_SPLIT: expected 0 or 1, got {forced!r}")
    return 0 < n_red * ny < sm_count


def merge_columns(red: np.ndarray, qlen: np.ndarray, hpc: int, tpc: int) -> int:
    """Output columns the split merge launches per (item, column group): the most that any of the
    reduction items ``red`` (int32 rows seq, tok0, part0, nparts) has with a query row. Column n is
    query head ``n % hpc`` of token ``tok0 + n // hpc``, so those are a prefix of the ``NCOL``:
    ``min(tpc, qlen[seq] - tok0) · hpc`` (``qlen``: each sequence's query length). A decode batch
    at 32 / 8 heads (hpc = 4, one token) merges 4 columns, not 8, and its decode kernels write no
    partials for the others (``query_columns`` in paged_attention.cu; docs/perf-notes.md
    "Session 44" for what that gained). The build ``-DKVLAB_DECODE_ALL_COLUMNS`` finishes and
    merges all ``NCOL`` (the default before session 44) and gets ``NCOL``."""
    from .loader import user_options

    if len(red) == 0 or "-DKVLAB_DECODE_ALL_COLUMNS" in user_options():
        return NCOL
    toks = np.minimum(tpc, np.asarray(qlen)[red[:, 0]] - red[:, 1])
    return int(min(NCOL, max(1, int(toks.max()) * hpc)))


def heads_per_column_group(group: int) -> int:
    """Query heads of one KV head placed side by side in the 8 columns: the largest divisor of G ≤ 8."""
    for h in range(min(group, NCOL), 0, -1):
        if group % h == 0:
            return h
    return 1


@functools.cache
def _device_props(device_id) -> tuple:
    """(SM count, shared memory per SM) — queried once per device (the query costs ~ms)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    return (int(props["multiProcessorCount"]),
            int(props.get("sharedMemPerMultiprocessor", 228 * 1024)))


@functools.cache
def _smem_optin(device_id) -> int:
    """Largest dynamic + static shared memory one CTA may opt into (227 KB on H100/H200)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    return int(props.get("sharedMemPerBlockOptin", 48 * 1024))


#: what one SM of sm_80 / sm_90 holds: 4 sub-partitions (SMSPs) of 16,384 registers each,
#: 2,048 threads, 32 CTAs; registers go to a warp in units of 256; 1 KB of shared memory is
#: reserved per CTA
SM_SUBPARTITIONS, SUBPARTITION_REGS, SM_THREADS, SM_CTAS, REG_UNIT, CTA_SMEM_RESERVED = 4, 16384, 2048, 32, 256, 1024


def ctas_per_sm(regs_per_thread: int, warps_per_cta: int, smem_per_cta: int, smem_per_sm: int) -> int:
    """CTAs of one kernel resident on one SM at once (at least 1), the rule of CUDA's occupancy
    calculator (``cuOccupancyMaxActiveBlocksPerMultiprocessor``; the GPU tests compare the two
    for every decode kernel the plans launch): the least of

    * registers: each of the SM's 4 sub-partitions holds ``16384 // warp_regs`` warps of
      ``warp_regs = regs_per_thread · 32`` rounded up to 256 registers, and a CTA's warps are
      spread over the sub-partitions, so ``4 · (16384 // warp_regs) // warps_per_cta`` CTAs fit.
      The whole SM's ``65536 // (warp_regs · warps_per_cta)`` overcounts where the warps of a CTA
      are not a multiple of 4 — 9 / 3 heads: 3 warps of 106 registers, 5 CTAs, not 6 (measured on
      the H200, docs/perf-notes.md "Session 24": 108 of 768 CTAs waited for a second wave);
    * shared memory: ``smem_per_sm // (smem_per_cta + 1 KB)`` (``smem_per_cta``: static + dynamic);
    * threads (2,048) and CTAs (32) per SM.
    """
    if regs_per_thread < 1 or warps_per_cta < 1 or smem_per_cta < 0:
        raise ValueError(f"ctas_per_sm: regs_per_thread and warps_per_cta must be >= 1 and smem_per_cta >= 0, "
                         f"got {regs_per_thread}, {warps_per_cta}, {smem_per_cta}")
    warp_regs = -(-regs_per_thread * 32 // REG_UNIT) * REG_UNIT
    by_regs = SM_SUBPARTITIONS * (SUBPARTITION_REGS // warp_regs) // warps_per_cta
    by_smem = smem_per_sm // (smem_per_cta + CTA_SMEM_RESERVED)
    return max(1, min(by_regs, by_smem, SM_THREADS // (warps_per_cta * 32), SM_CTAS))


@functools.cache
def _resident_paged_ctas(spec, device_id, ny: int, dyn_smem: int) -> int:
    """CTAs of the paged decode kernel (``ny`` warps, ``dyn_smem`` bytes) resident on the GPU."""
    kernel = get_kernel(spec, device_id)
    n_sm, smem_sm = _device_props(device_id)
    return n_sm * ctas_per_sm(int(kernel.num_regs), ny, int(kernel.shared_size_bytes) + dyn_smem, smem_sm)


_DYN_SET: dict = {}


def _raise_dynamic_smem(kernel, spec, device_id, nbytes: int):
    """Raise the kernel's dynamic shared-memory limit (needed above 48 KB), once per size."""
    key = (spec, device_id)
    # the default limit is 48 KB of static + dynamic shared memory
    if nbytes + int(kernel.shared_size_bytes) > 48 * 1024 and _DYN_SET.get(key, 0) < nbytes:
        kernel.max_dynamic_shared_size_bytes = int(nbytes)
        _DYN_SET[key] = nbytes


@functools.cache
def _resident_ctas(spec, device_id) -> int:
    """CTAs of one decode instantiation resident on the whole GPU at once (registers, shared memory)."""
    kernel = get_kernel(spec, device_id)
    n_sm, smem_sm = _device_props(device_id)
    return n_sm * ctas_per_sm(int(kernel.num_regs), NW, int(kernel.shared_size_bytes), smem_sm)


@dataclass
class AttentionPlan:
    """Work list and launch parameters of one paged-attention call (see module docstring)."""

    fmt_code: int
    head_size: int
    q_dtype: str
    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    block_size: int
    hpc: int
    tpc: int
    ny: int
    scale_log2: float
    k_scale: float
    v_scale: float
    window: int
    swizzle_v: int
    items: object        # device int32 (n_items, ITEM): the work list (_item_meta)
    red_items: object    # device int32 (n_red, 4) or None
    n_items: int
    n_red: int
    n_parts: int
    ws_o: object
    ws_ml: object
    device_id: int
    pf_items: object = None   # device int32 (n_pf, 2): seq, tok0 (prefill kernel)
    n_pf: int = 0
    red_split: bool = False                        # split merge: parts over 8 warps per column (reduce_split)
    red_cols: int = NCOL                           # merge columns launched (merge_columns)
    pdl_merge: bool = False                        # the merge is a programmatic dependent launch (pdl_merge)
    decode_variant: str = "per_head"               # the decode kernel this plan launches
    decode_variant_note: str = ""                  # why a requested "paged" fell back
    paged_smem: int = 0                            # dynamic shared memory of the paged kernel
    paged_nbuf: int = 0                            # its stage buffers
    paged_halves: int = 1                          # its CTA's halves (2: the dual-ring CTA, _paged_halves)
    wave_weight: float = 1.0                       # first-wave split weight applied (_wave_weighted; 1: none)
    slot_fill: bool = False                        # the work list re-drawn by _slot_filled (when it pays)
    prefill_variant: str = "mma"                   # the prefill kernel it launches: "mma" or "wgmma"

    def check_run_args(self, q, kv_cache, out=None):
        """Cheap checks that ``q``/``kv_cache``/``out`` fit this plan — shape, dtype, contiguity,
        the cache's data on a 16-byte boundary (``checks.check_aligned16``: its rows are bulk-copied;
        ``q`` and ``out`` need not be, every kernel has an element-wise path for a base off that
        boundary, ``tests/gpu``'s ``test_decode_unaligned_q``), device (a plan is built for one
        batch layout and format and reused for every layer: the index arrays are the caller's
        promise, their contents are not re-read). Raises ``TypeError``/``ValueError``."""
        want_q = (self.num_tokens, self.num_q_heads, self.head_size)
        for name, a in (("q", q), ("out", out)):
            if a is None:
                continue
            if arrays.shape(a) != want_q:
                raise ValueError(f"{name}: this plan was built for shape {want_q}, got {arrays.shape(a)}")
            if arrays.dtype_name(a) != self.q_dtype:
                raise TypeError(f"{name}: this plan was built for dtype {self.q_dtype}, got {arrays.dtype_name(a)}")
            if not arrays.is_contiguous(a):
                raise ValueError(f"{name}: must be contiguous")
            if arrays.device_id(a) != self.device_id:
                raise ValueError(f"{name}: this plan was built for device {self.device_id}, got {arrays.device_id(a)}")
        cs = arrays.shape(kv_cache)
        if len(cs) != 5 or cs[1:4] != (2, self.block_size, self.num_kv_heads):
            raise ValueError(f"kv_cache: this plan was built for (num_blocks, 2, {self.block_size}, "
                             f"{self.num_kv_heads}, row), got shape {cs}")
        checks.check_aligned16(kv_cache, "kv_cache")
        if arrays.device_id(kv_cache) != self.device_id:
            raise ValueError(f"kv_cache: this plan was built for device {self.device_id}, "
                             f"got {arrays.device_id(kv_cache)}")

    def run(self, q, kv_cache, block_table, seq_lens, query_start_loc, out=None):
        """Launch on the caller's stream; returns ``out`` ``(num_tokens, num_q_heads, head_size)``.

        Checks that ``q``, ``kv_cache`` and ``out`` fit the plan (:meth:`check_run_args`); the
        index arrays must be those the plan was built from (or equal to them) — ``block_table``
        included: the work-list rows carry the first cache blocks of each item (``_item_meta``)."""
        self.check_run_args(q, kv_cache, out)
        if out is None:
            out = L.empty(q, (self.num_tokens, self.num_q_heads, self.head_size), self.q_dtype)
        if self.n_items == 0 and self.n_pf == 0:
            return out
        d, t = self.head_size, self.q_dtype
        bt_stride = arrays.shape(block_table)[1]
        with L.stream_of(q):
            if self.n_pf:
                pf_spec = _prefill_spec(self.fmt_code, d, t, self.prefill_variant)
                kp = get_kernel(pf_spec, self.device_id)
                pf_smem = prefill_smem_bytes(d, self.prefill_variant)
                _raise_dynamic_smem(kp, pf_spec, self.device_id, pf_smem)
                L.launch(kp, (self.n_pf, self.num_kv_heads), (prefill_geometry(self.prefill_variant).threads,), (
                    L.ptr(q), L.ptr(out), L.ptr(kv_cache), L.ptr(block_table), L.i32(bt_stride),
                    L.ptr(seq_lens), L.ptr(query_start_loc), L.ptr(self.pf_items),
                    L.i32(self.num_kv_heads), L.i32(self.num_q_heads),
                    L.i32(int(math.log2(self.block_size))), L.f32(self.scale_log2),
                    L.f32(self.k_scale), L.f32(self.v_scale), L.i32(self.window),
                    L.i32(self.swizzle_v),
                ), shared_mem=pf_smem)
            if self.n_items == 0:
                return out
            if self.decode_variant == "paged":
                spec = _paged_spec(self.fmt_code, d, t, self.paged_halves)
                k = get_kernel(spec, self.device_id)
                _raise_dynamic_smem(k, spec, self.device_id, self.paged_smem)
                grid, block, smem = (self.n_items, 1), (self.paged_halves * self.ny * 32,), self.paged_smem
                extra = (L.i32(self.paged_nbuf),)
            else:
                k = get_kernel(_decode_spec(self.fmt_code, d, t), self.device_id)
                grid, block, smem, extra = (self.n_items, self.ny), (NW * 32,), 0, ()
            L.launch(k, grid, block, (
                L.ptr(q), L.ptr(out), L.ptr(kv_cache), L.ptr(block_table), L.i32(bt_stride),
                L.ptr(seq_lens), L.ptr(query_start_loc), L.ptr(self.items),
                L.i32(self.num_kv_heads), L.i32(self.num_q_heads), L.i32(self.hpc),
                L.i32(self.tpc), L.i32(int(math.log2(self.block_size))),
                L.f32(self.scale_log2), L.f32(self.k_scale), L.f32(self.v_scale),
                L.i32(self.window), L.i32(self.swizzle_v),
                L.ptr(self.ws_o), L.ptr(self.ws_ml), *extra,
            ), shared_mem=smem)
            if self.n_red:
                r = get_kernel(_reduce_spec(d, t, self.fmt_code == FORMAT_CODES["int4_per_token_head"],
                                            self.red_split), self.device_id)
                # the columns with a query row only (merge_columns; -DKVLAB_DECODE_ALL_COLUMNS: all
                # NCOL): a CTA per column of the split form, a warp per column of the other
                nc = self.red_cols
                grid = (self.n_red, self.ny, nc) if self.red_split else (self.n_red, self.ny)
                launch = L.launch_dependent if self.pdl_merge else L.launch
                launch(r, grid, ((NCOL if self.red_split else nc) * 32,), (
                    L.ptr(out), L.ptr(self.ws_o), L.ptr(self.ws_ml), L.ptr(self.red_items),
                    L.ptr(query_start_loc), L.i32(self.num_kv_heads), L.i32(self.num_q_heads),
                    L.i32(self.hpc), L.i32(self.tpc),
                ))
        return out


def pdl_merge(device_id) -> bool:
    """Whether the split merge is launched as a programmatic dependent of the decode kernel
    (``launch.launch_dependent``; the kernels' side is in paged_attention.cu, "programmatic
    dependent launch"): on sm_90+, unless the build has ``-DKVLAB_DECODE_NO_PDL`` (its merge has
    no ``griddepcontrol.wait``, so an early launch could read partials not yet written) or the
    environment variable ``KVLAB_DECODE_PDL`` is ``0`` (A/B in one process; ``1`` is the default).
    Read when a plan is built."""
    from .loader import user_options

    env = os.environ.get("KVLAB_DECODE_PDL", "")
    if env not in ("", "0", "1"):
        raise ValueError(f"KVLAB_DECODE_PDL: expected 0 or 1, got {env!r}")
    if env == "0" or "-DKVLAB_DECODE_NO_PDL" in user_options():
        return False
    return _compute_capability(device_id) >= 90


@functools.cache
def _compute_capability(device_id) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).compute_capability)


def _splits_for_waves(n_base: int, capacity: int, max_splits: int = 256) -> int:
    """Smallest split count whose CTAs fill the resident slots evenly (>= 95 % of the slots of every wave).

    ``n_base`` CTAs without splitting, ``capacity`` CTAs resident at once on the GPU. With
    fewer CTAs than slots the GPU is partly idle; with 1.3 waves the last wave is.
    """
    if n_base <= 0 or capacity <= 0:
        return 1
    best, best_eff = 1, 0.0
    for ns in range(1, max_splits + 1):
        n = n_base * ns
        waves = -(-n // capacity)
        eff = n / (waves * capacity)
        if eff >= 0.95:
            return ns
        if eff > best_eff + 1e-9:
            best, best_eff = ns, eff
        if n >= 4 * capacity:
            break
    return best


def _query_span(tok0, tpc, lq, L):
    """KV positions of the first and last query token of work items whose columns hold the query
    tokens ``tok0 … tok0 + tpc - 1`` (those below ``lq``) of sequences of query length ``lq`` and
    KV length ``L`` (arrays): ``(pmin, pmax)``, as ``kv_tiles`` in paged_attention.cu sees them.
    ``_work_list`` cuts the sequences' ranges with them, ``_item_meta`` each row's."""
    last = np.minimum(tok0 + tpc, lq) - 1
    return L - lq + tok0, L - lq + last


def _work_list(qsl, sl, tpc, window, ny, capacity, num_splits=None, min_split_tokens=MIN_SPLIT_TOKENS):
    """Host work list: items (seq, tok0, kv_lo, kv_hi, part) and reductions (seq, tok0, part0, nparts)."""
    qlen = np.diff(qsl)
    ntok_tiles = -(-qlen // tpc)
    S = len(sl)
    seq = np.repeat(np.arange(S), ntok_tiles)
    if seq.size == 0:
        return np.zeros((0, ITEM_HOST), np.int32), np.zeros((0, 4), np.int32), 0
    first = np.repeat(np.cumsum(ntok_tiles) - ntok_tiles, ntok_tiles)
    tok0 = (np.arange(seq.size) - first) * tpc
    pmin, pmax = _query_span(tok0, tpc, qlen[seq], sl[seq])
    hi = pmax + 1
    lo = np.maximum(pmin - window + 1, 0) if window else np.zeros_like(hi)
    lo16 = lo & ~15
    tiles = -(-(hi - lo16) // 16)
    n_base = seq.size * ny
    ns_target = _splits_for_waves(n_base, capacity)
    ns = np.clip(np.minimum(ns_target, -(-(hi - lo16) // min_split_tokens)), 1, None)
    if num_splits is not None:  # forced (tests), still at least 16 tokens per split
        ns = np.clip(np.minimum(int(num_splits), tiles), 1, None)
    per = -(-tiles // ns)                       # 16-token tiles per part
    ns = -(-tiles // per)                       # drop empty parts
    rows, reds, part = [], [], 0
    single = ns == 1
    if np.any(single):
        idx = np.nonzero(single)[0]
        rows.append(np.stack([seq[idx], tok0[idx], lo16[idx], hi[idx], -np.ones_like(idx)], 1))
    multi = np.nonzero(~single)[0]
    if multi.size:
        nsm = ns[multi]
        rep = np.repeat(multi, nsm)
        k = np.arange(rep.size) - np.repeat(np.cumsum(nsm) - nsm, nsm)
        kv_lo = lo16[rep] + k * per[rep] * 16
        kv_hi = np.minimum(kv_lo + per[rep] * 16, hi[rep])
        parts = np.arange(rep.size)
        rows.append(np.stack([seq[rep], tok0[rep], kv_lo, kv_hi, parts], 1))
        part0 = np.cumsum(nsm) - nsm
        reds.append(np.stack([seq[multi], tok0[multi], part0, nsm], 1))
        part = int(rep.size)
    items = np.ascontiguousarray(np.concatenate(rows).astype(np.int32))
    red = (np.ascontiguousarray(np.concatenate(reds).astype(np.int32)) if reds
           else np.zeros((0, 4), np.int32))
    return items, red, part


def _item_meta(items: np.ndarray, qsl: np.ndarray, sl: np.ndarray, bt: np.ndarray, tpc: int, window: int,
               block_size: int) -> np.ndarray:
    """The device rows ``(n, ITEM)`` int32 of a host work list ``(n, ITEM_HOST)``: the item, then
    its sequence's query offset, query length and KV length (``query_start_loc[seq]``,
    ``query_start_loc[seq + 1] - query_start_loc[seq]``, ``seq_lens[seq]``) at 5 … 7, the start of
    its first 16-token chunk at 8 (``kv_tiles`` in paged_attention.cu: the range cut to the
    columns' query positions and the window, rounded down to 16) and the cache blocks of its first
    ``ITEM_PRE`` chunks at 12 … (-1 past its chunks). The paged decode kernel then waits for one
    load of its row before it issues its first copies and query loads, instead of a chain of
    three (row, metadata, block table; docs/perf-notes.md "Session 17"). ``qsl``, ``sl``, ``bt``:
    the host copies the plan validated (a plan is run with the arrays it was built from)."""
    n = len(items)
    out = np.zeros((n, ITEM), np.int32)
    if n == 0:
        return out
    out[:, :ITEM_HOST] = items
    seq = items[:, 0].astype(np.int64)
    tok0, kv_lo, kv_hi = (items[:, k].astype(np.int64) for k in (1, 2, 3))
    qs = qsl[seq].astype(np.int64)
    lq = qsl[seq + 1].astype(np.int64) - qs
    L = sl[seq].astype(np.int64)
    out[:, 5], out[:, 6], out[:, 7] = qs, lq, L
    pmin, pmax = _query_span(tok0, tpc, lq, L)
    valid = pmax >= pmin                            # a row with no query token sees nothing
    pmax = np.where(valid, pmax, -1)
    lo = np.maximum(kv_lo, pmin - window + 1) if window > 0 else kv_lo
    hi = np.minimum(kv_hi, pmax + 1)
    lo16 = lo & ~15
    nch = np.where(valid & (hi > lo16), (hi - lo16 + 15) >> 4, 0)
    out[:, 8] = np.where(valid, lo16, -1)
    j = np.arange(ITEM_PRE)
    ok = j[None, :] < nch[:, None]                                  # (n, ITEM_PRE), one gather
    col = np.where(ok, (lo16[:, None] + 16 * j[None, :]) // block_size, 0)
    out[:, 12:12 + ITEM_PRE] = np.where(ok, bt[seq[:, None], col], -1)
    return out


def _wave_weight(key: tuple[int, int] | None = None, items: np.ndarray | None = None) -> float:
    """First-wave weight of the paged decode's splits: ``KVLAB_DECODE_WAVE_WEIGHT`` if set, else
    ``PG_WAVE_WEIGHT_FMT``'s weight for ``key`` (format code, head size) where the split list ``items``
    (``_work_list``'s, before weighting) has parts of at least its mean tile count, else
    ``PG_WAVE_WEIGHT``."""
    env = os.environ.get("KVLAB_DECODE_WAVE_WEIGHT", "").strip()
    if not env:
        rule = PG_WAVE_WEIGHT_FMT.get(key)
        if rule is not None and items is not None and len(items) and _row_tiles(items).mean() >= rule[1]:
            return rule[0]
        return PG_WAVE_WEIGHT
    try:
        w = float(env)
    except ValueError:
        w = float("nan")
    if not 1.0 <= w <= 2.0:
        raise ValueError(f"KVLAB_DECODE_WAVE_WEIGHT: a number in [1, 2], got {env!r}")
    return w


def _row_tiles(items: np.ndarray) -> np.ndarray:
    """16-token tiles of each work-list row's KV range [kv_lo, kv_hi) (int64)."""
    return -(-(items[:, 3].astype(np.int64) - items[:, 2]) // 16)


def _split_groups(m: np.ndarray):
    """Split groups of the multi-part rows ``m`` of a work list (``_work_list``): consecutive rows
    of one (seq, tok0) with consecutive part ids. Returns (starts, sizes, lo16, hi, tiles)."""
    starts = np.nonzero(np.r_[True, (m[1:, 0] != m[:-1, 0]) | (m[1:, 1] != m[:-1, 1])
                              | (m[1:, 4] != m[:-1, 4] + 1)])[0]
    sizes = np.diff(np.r_[starts, len(m)])
    lo16 = m[starts, 2].astype(np.int64)
    hi = m[starts + sizes - 1, 3].astype(np.int64)
    tiles = -(-(hi - lo16) // 16)
    return starts, sizes, lo16, hi, tiles


def _cut_groups(lo16, hi, tiles, sizes, heavy, weight):
    """Cut each group's range [lo16, hi) into ``sizes`` contiguous parts of whole 16-token tiles,
    its first ``heavy`` parts ``weight`` times as long as the others (every part ≥ 1 tile).
    Returns per row (groups in order, parts in order): group id, index in the group, kv_lo, kv_hi."""
    # every row at once (a Python loop over the groups cost ~0.6 ms of host time per plan)
    starts = np.cumsum(sizes) - sizes
    gid = np.repeat(np.arange(len(sizes)), sizes)
    k = np.arange(int(sizes.sum())) - np.repeat(starts, sizes)      # index within the group
    h = heavy[gid]                                                    # the group's heavy parts come first
    cw_in = weight * np.minimum(k + 1, h) + np.maximum(k + 1 - h, 0)  # weight up to this part's end
    wsum = weight * heavy + (sizes - heavy)
    # cumulative tiles at each part's end: strictly increasing within the group (>= 1 tile a
    # part), the last = the group's tiles; the running max per group via a group offset
    c = np.rint(cw_in / wsum[gid] * tiles[gid]).astype(np.int64) - k
    c = np.clip(c, 1, (tiles - sizes + 1)[gid])
    big = int(tiles.max()) + 1
    c = np.maximum.accumulate(c + gid * big) - gid * big
    cut = c + k
    prev = np.where(k == 0, 0, np.r_[0, cut[:-1]])
    return gid, k, lo16[gid] + 16 * prev, np.minimum(lo16[gid] + 16 * cut, hi[gid])


def _wave_weighted(items: np.ndarray, n_sm: int, capacity: int, weight: float) -> np.ndarray:
    """Re-split and re-order the paged decode's work list for a grid of one wave of two CTAs per SM.

    The block scheduler places CTAs 0 … n_sm-1 one per SM and the rest as each SM's second CTA;
    on the H200 the first runs faster than its partner (its warps are older, so the schedulers
    favour them) and finishes ~11 µs earlier, after which the SM streams with half its warps
    (docs/perf-notes.md "Session 11"). So: ``n_sm`` of the split parts, spread over the split
    groups in proportion to their part counts, get ``weight`` times the 16-token tiles of the
    others of their group and go first in launch order. Each group keeps its parts, its range
    [lo16, hi) and its part ids (the merge slots), only the cut points move; unsplit items (part
    -1) go last. Returns ``items`` unchanged when the grid is not one such wave, when there is
    nothing to weigh, or when ``weight`` is 1. (``_slot_filled`` re-draws the parts over the
    resident slots instead where a model says that pays — ragged batches; the plan picks.)
    """
    n = len(items)
    if weight == 1.0 or not (n_sm < n <= capacity and capacity >= 2 * n_sm):
        return items
    multi = items[:, 4] >= 0
    if multi.sum() < n_sm:
        return items
    m = items[multi]
    starts, sizes, lo16, hi, tiles = _split_groups(m)
    # heavy parts per group: largest remainders of sizes · n_sm / total (never above sizes)
    quota = sizes * (n_sm / sizes.sum())
    heavy = np.floor(quota).astype(np.int64)
    rest = n_sm - int(heavy.sum())
    if rest > 0:
        order = np.argsort(-(quota - heavy), kind="stable")
        heavy[order[:rest]] += 1
    gid, k, kv_lo, kv_hi = _cut_groups(lo16, hi, tiles, sizes, heavy, weight)
    is_heavy = k < heavy[gid]
    new = m.copy()
    new[:, 2], new[:, 3] = kv_lo, kv_hi
    out = np.concatenate([new[is_heavy], new[~is_heavy], items[~multi]])
    return np.ascontiguousarray(out.astype(np.int32))


def _greedy_units(score, low, high, guess, total):
    """Integer allocation ``u`` (``low <= u <= high``, ``sum(u) == min(total, sum(high))``) that a
    greedy loop would reach by giving one unit at a time to the entry of the largest
    ``score(i, u[i])`` (decreasing in the entry's units; called with index arrays and with
    scalars): starts from ``guess`` clipped to the bounds (units taken back from the lowest
    scores while that is over ``total``), then runs the greedy loop for the units still missing
    (a guess near the balance point leaves about one per entry). Used by
    ``_slot_filled``: D'Hondt apportionment of parts, then of heavy parts."""
    import heapq

    u = np.clip(guess, low, high)
    idx = np.arange(len(u))
    while u.sum() > total:   # over (the lower bounds pushed it up): take units back, one per
        # entry, from the entries that scored lowest with their last unit
        over = int(u.sum() - total)
        can = np.nonzero(u > low)[0]
        if len(can) == 0:
            break
        back = can[np.argsort(score(can, u[can].astype(np.float64)), kind="stable")[:over]]
        u[back] -= 1
    sc = score(idx, u.astype(np.float64)).tolist()
    heap = [(-sc[i], i) for i in range(len(u)) if u[i] < high[i]]
    heapq.heapify(heap)
    for _ in range(int(total - u.sum())):
        if not heap:
            break
        _, i = heapq.heappop(heap)
        u[i] += 1
        if u[i] < high[i]:
            heapq.heappush(heap, (-float(score(i, float(u[i]))), i))
    return u


def _slot_filled(items: np.ndarray, n_sm: int, capacity: int, weight: float, min_tiles: int, slack: int = 0):
    """The paged decode's one-wave work list with every resident slot filled and balanced.

    In a grid of (up to) one wave of two CTAs per SM the block scheduler places CTAs 0 … n_sm-1 first
    (one per SM, and they run faster than their partners: ``_wave_weighted``), the rest second.
    The split count of ``_work_list`` leaves slots empty (B = 32 × 8k: 256 CTAs for 264 slots,
    so 8 SMs stream with one CTA and finish early; batch 1 × 128k: 249) and is the same for
    every sequence long enough, so in a ragged batch a short sequence's parts are short and a
    long one's long. Here (docs/perf-notes.md "Session 16"):

    1. the split groups' part counts are drawn again for the slots the unsplit items leave: one
       each, then one at a time to the group with the most tiles per part (at most one part per
       ``min_tiles`` tiles), so a long sequence gets the parts ``_work_list``'s uniform split
       count gave short ones (a group left with one part runs unsplit: part -1, no merge);
    2. the ``n_sm`` heavy parts (``weight`` times the tiles of the group's others, first in
       launch order) go one at a time to the group with the most tiles per unit of weight;
    3. each group's range is re-cut (``_cut_groups``), part ids renumbered group by group.

    So every part of a group takes about the same time, and groups differ only by rounding.
    The unsplit items of ``items`` are kept as they are and go last. Returns ``(items, red, n_parts)``
    (``red`` rows: seq, tok0, part0, nparts, as ``_work_list``), or None when the work list is
    more than one wave, the GPU holds fewer than two CTAs per SM and ``weight`` is not 1, or
    nothing is split (then ``_wave_weighted`` applies). With ``weight`` 1 (the dual-ring CTA, one
    per SM: no first-placed partner to weigh) every slot is alike and any capacity is filled.
    ``slack`` slots are left empty (``KVLAB_DECODE_FILL_SLACK``).
    A list of at most ``n_sm`` CTAs is filled too (its SMs would
    otherwise stream with one CTA each); if it stays that short, no part is heavy.
    """
    n = len(items)
    if not (n <= capacity and (capacity >= 2 * n_sm or weight == 1.0)):
        return None
    multi = items[:, 4] >= 0
    m = items[multi]
    if len(m) == 0:
        return None
    starts, sizes, lo16, hi, tiles = _split_groups(m)
    # parts per group (D'Hondt): at least one each, then one at a time to the group with the
    # most tiles per part, until the slots the unsplit items leave are used (at most one part
    # per min_tiles tiles; a group left with one part runs unsplit, without a merge)
    n_slots = capacity - slack - int((~multi).sum())
    if n_slots < len(sizes):
        return None
    tiles_f = tiles.astype(np.float64)
    cap = np.maximum(tiles // max(int(min_tiles), 1), 1)
    parts = _greedy_units(lambda i, p: tiles_f[i] / p, np.ones(len(sizes), np.int64), cap,
                          np.floor(tiles_f * (n_slots / tiles_f.sum())).astype(np.int64), n_slots)
    n_heavy = n_sm if parts.sum() + int((~multi).sum()) > n_sm else 0   # else: one CTA per SM
    # heavy parts: to the group with the most tiles per unit of weight (start: the continuous
    # balance point x = tiles / (parts + (weight - 1) · heavy), rounded down)
    if weight > 1.0:
        wm1 = weight - 1.0
        x = tiles_f.sum() / (parts.sum() + wm1 * n_sm)
        heavy = _greedy_units(lambda i, h: tiles_f[i] / (parts[i] + wm1 * h), np.zeros_like(parts), parts,
                              np.floor((tiles_f / x - parts) / wm1).astype(np.int64), min(n_heavy, int(parts.sum())))
    else:   # weight 1: heavy and light parts are the same length
        heavy = np.zeros_like(parts)
    gid, k, kv_lo, kv_hi = _cut_groups(lo16, hi, tiles, parts, heavy, weight)
    split = parts > 1
    sparts = np.where(split, parts, 0)
    part0 = np.cumsum(sparts) - sparts
    part = np.where(split[gid], part0[gid] + k, -1)
    rows = np.stack([m[starts[gid], 0], m[starts[gid], 1], kv_lo, kv_hi, part], 1)
    is_heavy = k < heavy[gid]
    out = np.concatenate([rows[is_heavy], rows[~is_heavy], items[~multi]])
    red = np.stack([m[starts, 0], m[starts, 1], part0, parts], 1)[split]
    return (np.ascontiguousarray(out.astype(np.int32)), np.ascontiguousarray(red.astype(np.int32)),
            int(sparts.sum()))


def _slot_fill() -> str:
    """When the paged decode's plans use ``_slot_filled`` (``KVLAB_DECODE_SLOT_FILL``): ``"1"``
    (the default) when it pays (``_fill_pays``), ``"2"`` always, ``"0"`` never (session 15's
    ``_wave_weighted``); read when a plan is built, so A/B runs in one process."""
    env = os.environ.get("KVLAB_DECODE_SLOT_FILL", "").strip() or "1"
    if env not in ("0", "1", "2"):
        raise ValueError(f"KVLAB_DECODE_SLOT_FILL: expected 0, 1 or 2, got {env!r}")
    return env


#: slots the plan's ``_slot_filled`` leaves empty: measured on the H200 (docs/perf-notes.md
#: "Session 16"), a grid of exactly two CTAs per SM (264) is placed differently by the block
#: scheduler — 16 SMs get two CTAs of the first or of the second half of the launch order, so two
#: heavy parts share an SM — while 263 (and 256, 249) are placed CTA i with CTA i + n_sm.
PG_FILL_SLACK = 1


def _fill_slack() -> int:
    """Slots ``_slot_filled`` leaves empty: ``KVLAB_DECODE_FILL_SLACK`` or ``PG_FILL_SLACK``."""
    env = os.environ.get("KVLAB_DECODE_FILL_SLACK", "").strip() or str(PG_FILL_SLACK)
    if not env.isdigit():
        raise ValueError(f"KVLAB_DECODE_FILL_SLACK: a count of slots, got {env!r}")
    return int(env)


#: ``_slot_filled``'s list is used when its longest part (model: 16-token tiles over the slot's
#: rate, ``weight`` for the first n_sm) is at most this fraction of ``_wave_weighted``'s. Measured
#: on the H200 (docs/perf-notes.md "Session 16"): a uniform batch gains ≤ 3 % in the model, and a
#: grid of exactly two CTAs per SM is placed differently by the block scheduler (16 SMs get two
#: heavy or two light parts), so there the filled list lost 4–9 %; ragged batches (model 0.11–0.52)
#: gained 29–83 %.
PG_FILL_MIN_GAIN = 0.85


def _longest_part(items: np.ndarray, n_sm: int, weight: float) -> float:
    """The longest part of a paged-decode work list in the balance model of ``_slot_filled``:
    its 16-token tiles, divided by ``weight`` for the first ``n_sm`` rows (the faster CTAs)."""
    t = _row_tiles(items).astype(np.float64)
    t[:n_sm] /= weight
    return float(t.max()) if len(t) else 0.0


def _fill_may_pay(weighted: np.ndarray, n_sm: int, capacity: int, weight: float) -> bool:
    """Cheap bound before ``_slot_filled`` runs (~0.1–0.3 ms of host time): no list over
    ``capacity`` slots has a longest part below the mean load per slot (all tiles over
    ``weight · n_sm + capacity - n_sm``), so unless ``PG_FILL_MIN_GAIN`` × the weighted list's
    longest part reaches that mean, filling cannot pay (uniform batches: 50.2 < 56.4 tiles)."""
    tiles = float(_row_tiles(weighted).sum())
    mean = tiles / (weight * n_sm + max(capacity - n_sm, 0))
    return PG_FILL_MIN_GAIN * _longest_part(weighted, n_sm, weight) >= mean


def _fill_pays(filled: np.ndarray, weighted: np.ndarray, n_sm: int, weight: float) -> bool:
    """Whether the filled list's longest part is ≤ ``PG_FILL_MIN_GAIN`` × the weighted list's."""
    return _longest_part(filled, n_sm, weight) <= PG_FILL_MIN_GAIN * _longest_part(weighted, n_sm, weight)


def _paged_list(qsl_dec, sl, tpc, window, capacity, num_splits, nh, n_sm, key=None):
    """The paged decode's work list for ``capacity`` resident CTAs of ``nh`` halves:
    ``(items, red, n_parts, wave_weight, slot_fill)``. ``_work_list``'s split list, then (unless
    ``num_splits`` forces the splits) re-drawn over every slot (``_slot_filled``) where that pays,
    else weighted for the first-placed CTAs (``_wave_weighted``). The dual-ring CTA (``nh`` 2) has
    no partner on its SM: nothing to weigh, every slot alike, no slack (the placement quirk of
    ``PG_FILL_SLACK`` is the two-per-SM grid's at exactly 2·n_sm CTAs). ``key``: (format code,
    head size), for the first-wave weight (``_wave_weight``)."""
    items, red, n_parts = _work_list(qsl_dec, sl, tpc, window, 1, capacity, num_splits, PG_MIN_SPLIT_TOKENS)
    if num_splits is not None:
        return items, red, n_parts, 1.0, False
    w, mode = (_wave_weight(key, items) if nh == 1 else 1.0), _slot_fill()
    weighted = _wave_weighted(items, n_sm, capacity, w)
    try_fill = mode == "2" or (mode == "1" and _fill_may_pay(weighted, n_sm, capacity, w))
    filled = (_slot_filled(items, n_sm, capacity, w, PG_MIN_SPLIT_TOKENS // 16,
                           _fill_slack() if nh == 1 else 0) if try_fill else None)
    if filled is not None and (mode == "2" or _fill_pays(filled[0], weighted, n_sm, w)):
        return (*filled, w, True)
    if weighted is not items:
        return weighted, red, n_parts, w, False
    return items, red, n_parts, 1.0, False


def _prefill_list(qlen, seqs, tokens_per_cta):
    """Prefill CTAs (seq, tok0), the ones with the most keys (last query tokens) first."""
    if len(seqs) == 0:
        return np.zeros((0, 2), np.int32)
    n = -(-qlen[seqs] // tokens_per_cta)
    seq = np.repeat(seqs, n)
    first = np.repeat(np.cumsum(n) - n, n)
    tok0 = (np.arange(seq.size) - first) * tokens_per_cta
    order = np.argsort(-tok0, kind="stable")
    return np.ascontiguousarray(np.stack([seq[order], tok0[order]], 1).astype(np.int32))


def plan_paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, kv_cache_dtype="auto",
                         softmax_scale=None, k_scale=1.0, v_scale=1.0, sliding_window=None,
                         num_splits=None, prefill_kernel=None, decode_variant=None,
                         prefill_variant=None, host_index=None) -> AttentionPlan:
    """Validate and build the work list (see module docstring).

    ``num_splits`` forces the split count of the decode kernel; ``prefill_kernel`` (bool)
    forces sequences with long queries onto (True) or off (False) the prefill kernel;
    ``decode_variant`` picks the decode kernel (``"auto"``, ``"per_head"`` or ``"paged"``; None:
    the ``KVLAB_DECODE_VARIANT`` environment variable, else ``"auto"``). The plan's
    ``decode_variant`` is the kernel it launches, ``decode_variant_note`` why a requested
    ``"paged"`` fell back. ``prefill_variant`` picks the prefill kernel (``"auto"``, ``"mma"`` or ``"wgmma"``;
    None: the ``KVLAB_PREFILL_VARIANT`` environment variable, else ``"auto"``: ``"wgmma"`` on
    compute capability 9.0, ``"mma"`` elsewhere); the plan's ``prefill_variant`` is the kernel it
    launches. An explicit ``"wgmma"`` on a device that is not compute capability 9.0 raises
    ``ValueError``. ``host_index``: NumPy copies of ``(query_start_loc, seq_lens, block_table)``
    the caller has already read (they must equal the device arrays; :func:`paged_attention`'s
    plan cache passes them), else the plan copies them (one synchronizing copy).

    Range of the ``"wgmma"`` kernel with ``int4_per_token_head``: its producer scales K into fp16
    tiles (times 2^-4, ``kernels_cu/prefill_common.cuh``, ``KVLAB_WGMMA_KV_PRESCALE``), which hold
    dequantized keys up to about 10^6 in magnitude; a token whose K scale exceeds 2^16 makes the
    output rows that attend to it NaN (never a silently dropped key). The ``"mma"`` kernel and the
    decode kernels apply K scales in float32 and have no such limit.
    """
    decode_variant, _ = _variant_choice(decode_variant, "KVLAB_DECODE_VARIANT", DEFAULT_DECODE_VARIANT,
                                        DECODE_VARIANTS, "decode_variant")
    fmt, dims, backend, meta = validate.check_paged_attention(
        q, kv_cache, block_table, seq_lens, query_start_loc, kv_cache_dtype, softmax_scale,
        k_scale, v_scale, sliding_window, host_index=host_index,
    )
    if backend != "cuda":
        raise TypeError("q: kvlab.cuda.attention takes CuPy arrays or torch CUDA tensors, got NumPy arrays "
                        "(use kvlab.paged_attention or kvlab.reference.paged_attention)")
    qd = arrays.dtype_name(q)
    if qd not in Q_DTYPES:
        raise TypeError(f"q: the attention kernels take {list(Q_DTYPES)}, got {qd}")
    if not arrays.is_contiguous(q):
        raise ValueError("q: must be contiguous (num_tokens, num_q_heads, head_size)")
    for name, a in (("block_table", block_table), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        if not arrays.is_contiguous(a):
            raise ValueError(f"{name}: must be contiguous")
    d = dims.head_size
    if d not in HEAD_SIZES:
        raise ValueError(f"kv_cache: the attention kernels support head sizes {list(HEAD_SIZES)}, got {d}")
    bs = dims.block_size
    if bs < 16 or bs & (bs - 1):
        raise ValueError(f"kv_cache: the attention kernels need a power-of-two block_size >= 16, got {bs}")
    if fmt.stores_model_dtype and arrays.dtype_name(kv_cache) != qd:
        raise TypeError(f"kv_cache: an 'auto' cache must have q's dtype {qd}, got {arrays.dtype_name(kv_cache)}")
    devs = {arrays.device_id(x) for x in (q, kv_cache, block_table, seq_lens, query_start_loc)}
    if len(devs) != 1:
        raise ValueError(f"q, kv_cache, block_table, seq_lens, query_start_loc: must be on one device, got {sorted(devs)}")
    dev = devs.pop()
    pf_variant = _resolve_prefill_variant(prefill_variant, dev)
    code = FORMAT_CODES[fmt.name]
    T, Hq = meta["num_tokens"], meta["num_q_heads"]
    Hkv = dims.num_kv_heads
    G = Hq // Hkv
    hpc = heads_per_column_group(G)
    tpc = NCOL // hpc
    ny = Hkv * (G // hpc)
    window = int(meta["sliding_window"] or 0)
    import cupy

    qsl_h, sl_h = meta["query_start_loc"], meta["seq_lens"]
    qlen = np.diff(qsl_h)
    use_pf = (d in PREFILL_HEAD_SIZES and G <= PF_ROWS and prefill_kernel is not False)
    long_q = (qlen * G >= PREFILL_MIN_ROWS) if prefill_kernel is None else (qlen > 1)
    pf_seq = np.nonzero(long_q)[0] if use_pf else np.zeros(0, np.int64)
    qlen_dec = qlen.copy()
    qlen_dec[pf_seq] = 0  # those sequences' queries are all on the prefill kernel

    variant, note, paged_smem, nbuf, nh = "per_head", "", 0, 0, 1
    want_paged = decode_variant == "paged"
    if decode_variant == "auto":
        want_paged = _auto_wants_paged(fmt.name, d, Hkv, np.asarray(sl_h)[qlen_dec > 0], window,
                                       _device_props(dev)[0])
    if want_paged:
        nh = _paged_halves(code, d)
        nbuf, note = _paged_buffers(code, d, Hkv, ny, dev, nh)
        if not nbuf and nh == 2:   # two rings do not fit: two CTAs per SM
            nh = 1
            nbuf, note = _paged_buffers(code, d, Hkv, ny, dev)
        if nbuf:
            variant, paged_smem = "paged", paged_smem_bytes(code, d, Hkv, ny, nbuf, nh)
        else:
            note += "; using per_head"
    pf_items = _prefill_list(qlen, pf_seq, PF_ROWS // G)
    qsl_dec = np.concatenate([[0], np.cumsum(qlen_dec)])
    if variant == "paged":
        capacity = _resident_paged_ctas(_paged_spec(code, d, qd, nh), dev, ny * nh, paged_smem)
        lst = _paged_list(qsl_dec, sl_h, tpc, window, capacity, num_splits, nh, _device_props(dev)[0], (code, d))
        if nh == 2 and not _dual_forced() and num_splits is None:
            # the dual ring by default only where its list is modelled no slower (_dual_default);
            # the two-per-SM list is built only where that rule needs it
            nbuf1, note1 = _paged_buffers(code, d, Hkv, ny, dev)
            if nbuf1:
                smem1 = paged_smem_bytes(code, d, Hkv, ny, nbuf1)
                cap1 = _resident_paged_ctas(_paged_spec(code, d, qd), dev, ny, smem1)
                n_sm = _device_props(dev)[0]
                built = []

                def two_list():
                    if not built:
                        built.append(_paged_list(qsl_dec, sl_h, tpc, window, cap1, None, 1, n_sm, (code, d)))
                    return built[0][0]

                if not _dual_default(code, d, two_list, lst[0], n_sm, _wave_weight(),
                                     max(1, capacity // n_sm), int(np.count_nonzero(qlen_dec))):
                    two_list()
                    nh, nbuf, note, paged_smem, capacity, lst = 1, nbuf1, note1, smem1, cap1, built[0]
        items, red, n_parts, wave_weight, slot_fill = lst
    else:
        capacity = _resident_ctas(_decode_spec(code, d, qd), dev)
        items, red, n_parts = _work_list(qsl_dec, sl_h, tpc, window, ny, capacity, num_splits,
                                         MIN_SPLIT_TOKENS)
        wave_weight, slot_fill = 1.0, False
    scale_log2 = meta["softmax_scale"] * math.log2(math.e)
    if fmt.name == "int4_per_token_head":
        scale_log2 /= d  # q·k = q̃·k̃ / d in the rotated domain (SPEC 2.1)
    with cupy.cuda.Device(dev):
        with L.stream_of(q):
            # one host-to-device copy for the three work lists (views into one buffer)
            rows = _item_meta(items, qsl_h, sl_h, meta["block_table"], tpc, window, bs)
            parts = [np.ascontiguousarray(a, np.int32).ravel()
                     for a in (rows if len(rows) else np.zeros((1, ITEM), np.int32), red, pf_items)]
            buf = cupy.asarray(np.concatenate(parts))
            o1, o2 = parts[0].size, parts[0].size + parts[1].size
            items_d = buf[:o1].reshape(-1, ITEM)
            red_d = buf[o1:o2].reshape(-1, 4) if len(red) else None
            pf_d = buf[o2:].reshape(-1, 2) if len(pf_items) else None
            ws_o = cupy.empty((max(n_parts, 1) * ny * NCOL * d,), cupy.float32)
            ws_ml = cupy.empty((max(n_parts, 1) * ny * NCOL * 2,), cupy.float32)
    return AttentionPlan(
        fmt_code=code, head_size=d, q_dtype=qd, num_tokens=T, num_q_heads=Hq, num_kv_heads=Hkv,
        block_size=bs, hpc=hpc, tpc=tpc, ny=ny, scale_log2=scale_log2,
        k_scale=meta["k_scale"], v_scale=meta["v_scale"], window=window,
        swizzle_v=int(bool(getattr(fmt, "swizzle_v_scales", False))),
        items=items_d, red_items=red_d, n_items=len(items), n_red=len(red), n_parts=n_parts,
        ws_o=ws_o, ws_ml=ws_ml, device_id=dev, pf_items=pf_d, n_pf=len(pf_items),
        red_split=reduce_split(len(red), ny, _device_props(dev)[0]),
        red_cols=merge_columns(red, qlen_dec, hpc, tpc),
        pdl_merge=bool(len(red)) and pdl_merge(dev),
        decode_variant=variant, decode_variant_note=note, paged_smem=paged_smem, paged_nbuf=nbuf,
        paged_halves=nh if variant == "paged" else 1,
        wave_weight=wave_weight, slot_fill=slot_fill,
        prefill_variant=pf_variant,
    )


#: plans :func:`paged_attention` keeps, most recently used last (``_PLAN_CACHE``)
PLAN_CACHE_SIZE = 8
_PLAN_CACHE: collections.OrderedDict = collections.OrderedDict()
_PLAN_LOCK = threading.Lock()


def clear_plan_cache() -> None:
    """Drop the plans :func:`paged_attention` keeps (and the device buffers they hold)."""
    with _PLAN_LOCK:
        _PLAN_CACHE.clear()


def _plan_key(q, kv_cache, index, args):
    """The part of :func:`paged_attention`'s plan-cache key that is not the index arrays'
    contents: everything else a plan depends on (shapes, dtypes, contiguity and devices of the
    five arrays, the scalar arguments, the caller's stream — a plan's split workspace must not be
    shared by two streams —, and every ``KVLAB_*`` environment variable, which the plan and the
    kernels read). None when an argument is not a plain value (e.g. a tensor scale, which
    could change in place): then the call is planned afresh. (A format object is a frozen
    dataclass: equal by value.)"""
    for a in args:
        if not (a is None or isinstance(a, (str, int, float, np.number, CacheFormat))):
            return None
    desc = tuple(_array_desc(a) for a in (q, kv_cache, *index))
    return desc, tuple(args), L.stream_ptr(q), _kvlab_environment()


def _array_desc(a) -> tuple:
    """Kind, dtype, shape, contiguity and device of a CuPy array or torch CUDA tensor, hashable
    (the native dtype and shape objects: ~4× cheaper than the uniform ``arrays`` names, and this
    runs for five arrays on every :func:`paged_attention` call)."""
    if arrays.kind(a) == "torch":
        return ("torch", a.dtype, a.shape, a.is_contiguous(), a.device.index)
    return ("cupy", a.dtype, a.shape, a.flags.c_contiguous, arrays.device_id(a))


def _kvlab_environment() -> tuple:
    """Every ``KVLAB_*`` environment variable, sorted ``(name, value)`` pairs. Reads CPython's
    ``os.environ._data`` (the raw mapping; the public iteration decodes every variable, ~0.2 ms
    on the H200 machine's ~100 variables) where it exists, ``os.environ`` otherwise."""
    data = getattr(os.environ, "_data", None)
    if os.name == "posix" and isinstance(data, dict):   # bytes names and values there
        return tuple(sorted(kv for kv in data.items() if kv[0].startswith(b"KVLAB_")))
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("KVLAB_")))


def _cached_plan(q, kv_cache, block_table, seq_lens, query_start_loc, args, plan_kw):
    """:func:`plan_paged_attention` through the plan cache (see :func:`paged_attention`)."""
    index = (query_start_loc, seq_lens, block_table)
    if any(arrays.kind(a) not in ("cupy", "torch") for a in (q, kv_cache, *index)):
        return plan_paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, *args, **plan_kw)
    key = _plan_key(q, kv_cache, index, (*args, *plan_kw.values()))
    host = arrays.to_host_many(*index)      # one synchronizing copy; the plan would make it too
    if key is not None:
        with _PLAN_LOCK:
            hit = next((k for k, (h, _) in reversed(_PLAN_CACHE.items())
                        if k[0] == key and all(np.array_equal(x, y) for x, y in zip(h, host))), None)
            if hit is not None:
                _PLAN_CACHE.move_to_end(hit)
                return _PLAN_CACHE[hit][1]
    plan = plan_paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, *args,
                                host_index=host, **plan_kw)
    if key is not None:
        with _PLAN_LOCK:
            _PLAN_CACHE[(key, next(_PLAN_IDS))] = ([np.array(x, copy=True) for x in host], plan)
            while len(_PLAN_CACHE) > PLAN_CACHE_SIZE:
                _PLAN_CACHE.popitem(last=False)
    return plan


_PLAN_IDS = itertools.count()


def paged_attention(q, kv_cache, block_table, seq_lens, query_start_loc, kv_cache_dtype="auto",
                    softmax_scale=None, k_scale=1.0, v_scale=1.0, sliding_window=None,
                    decode_variant=None, prefill_variant=None):
    """Paged attention (SPEC 2.4) on the GPU → ``(num_tokens, num_q_heads, head_size)`` in q's dtype.

    q: bf16 (torch) or fp16 (CuPy or torch), contiguous. kv_cache: any kvlab format, on
    the same device. Same arguments as :func:`kvlab.reference.paged_attention`, plus
    ``decode_variant`` and ``prefill_variant`` (see :func:`plan_paged_attention`).

    The plans of the last ``PLAN_CACHE_SIZE`` calls are kept: a call whose index arrays
    (``query_start_loc``, ``seq_lens``, ``block_table``) hold the same values as one of them,
    with everything else a plan depends on equal (shapes, dtypes, devices, scalar arguments,
    the caller's stream, the ``KVLAB_*`` environment), runs that plan instead of building it
    again — a model calling this once per layer plans once per step. The index arrays are still
    copied to the host and compared on every call (one synchronizing copy); to skip that too,
    build the plan with :func:`plan_paged_attention` and call :meth:`AttentionPlan.run` per layer.
    :func:`clear_plan_cache` drops the kept plans and their device buffers.
    """
    plan = _cached_plan(q, kv_cache, block_table, seq_lens, query_start_loc,
                        (kv_cache_dtype, softmax_scale, k_scale, v_scale, sliding_window),
                        dict(decode_variant=decode_variant, prefill_variant=prefill_variant))
    return plan.run(q, kv_cache, block_table, seq_lens, query_start_loc)
