"""Benchmark suite ``decode``: paged decode attention (query length 1) for every format.

Grid: batch 1, 8, 32, 64 × context 1k, 8k, 32k, 128k for 32 query / 8 KV heads at head size 128
(the issue-4 target shape), plus 64 × 4k (vLLM's INT4 shape), and a smaller grid (batch 1, 32 ×
8k, 128k) for 9 / 3 heads at head size 64 (the lab's SmolLM2 model) and 32 / 8 at head size 64.
Block size 16, blocks of each sequence in random order. A case runs where the GPU's free memory
holds it (:func:`case_peak_bytes`, e.g. B = 64 × 128k at 32 / 8, d = 128 needs ~81 GiB: an H200,
not an H100); a case that does not fit, or runs out of memory anyway, leaves one row ``not run
(device memory)`` with the estimate and the free memory in its notes, and the grid goes on.

Bytes per call = the cache bytes read: ``2 · B · L · H_kv · row_bytes`` (K and V; q and the
output are < 0.1 % and not counted). Baselines in the same process:

* torch ``scaled_dot_product_attention`` on a contiguous bf16 cache ``(B, H_kv, L, d)``
  with ``enable_gqa=True`` — ``ratio_vs_baseline`` = time / this time;
* kvlab's own ``auto`` (bf16) paged kernel (a row of its own);
* a device-to-device copy moving the same bytes (``frac_of_copy`` = GB/s / copy GB/s);
* per distinct cache size of a case (``floors.py``): a **read floor** row (the fastest of a few
  pure streaming reads of that many contiguous bytes, the least time a call reading its cache
  once can take under this timer), a **paged read floor** row (the same bytes read as this
  case's cache lays them out: whole 16-token blocks at shuffled places, so what the layout costs
  any reader is the distance between the two floors) and, for the quantized formats, **torch
  SDPA at equal bytes** (SDPA on a bf16 cache of the same byte count: the context shortened by
  ``row_bytes / 2d``). Each kvlab row's notes give its time over both floors of its bytes.

Every kvlab format runs on both decode kernels, side by side (``impl`` = ``kvlab <format>
[<variant>]``): ``per_head`` (``paged_attention_decode``, one CTA per KV head gathering rows)
and ``paged`` (``paged_attention_decode_paged``, one CTA for all KV heads, sm_90, whole pages
copied into a ring of shared-memory stages by bulk copies; the whole-call row uses the
default ``decode_variant="auto"``). ``notes`` give the plan's CTAs, reductions and variant
(and the fallback reason if ``paged`` did not apply), and mark the row of the kernel that the
default ``decode_variant="auto"`` picks for that case.

kvlab rows time :meth:`kvlab.cuda.attention.AttentionPlan.run` — the kernels only (GPU time
between two events, the host's enqueue work hidden behind a GPU wait: ``timing.bench_ms``;
``notes`` give that host time per call, untimed); the plan
(validation, host work list) is built once per batch, as an inference engine builds the
attention metadata once per step for all layers. The target case also has a row for the
whole ``kvlab.paged_attention`` call. vLLM's Triton INT4 attention is quoted (issue 4):
1.09 ms for 64 × 4,096 tokens, 32/8 heads, d = 128 on an H200.
"""
from __future__ import annotations

import math

from . import floors
from .targets import DEFAULT_MARK
from .timing import bench_ms, copy_bandwidth_gbps, gbps

NAME = "decode"
VARIANTS = ("per_head", "paged")
FORMATS = ("auto", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "nvfp4")
BLOCK_SIZE = 16
VLLM_TRITON_INT4_MS = 1.09   # 64 × 4096, 32/8 heads, d=128, H200 (issue 4)
# device bytes kept free beyond a case's estimate: the CUDA context's own, the timer's two L2-sized
# flush buffers, torch's and CuPy's rounding and SDPA's workspace, the plans' partial buffers
MEM_MARGIN = 2 << 30
NOT_RUN = "not run (device memory)"


def _grid(quick):
    if quick:
        return [((32, 8, 128), [(32, 8192), (1, 131072), (64, 4096)])]
    full = [(b, c) for b in (1, 8, 32, 64) for c in (1024, 8192, 32768, 131072)]
    small = [(b, c) for b in (1, 32) for c in (8192, 131072)]
    return [((32, 8, 128), full + [(64, 4096)]), ((9, 3, 64), small), ((32, 8, 64), small)]


def _bf16_bytes(B, ctx, Hkv, d):
    """Bytes of a bf16 K/V cache of ``B`` sequences of ``ctx`` tokens (K and V)."""
    return 2 * B * ctx * Hkv * d * 2


def case_peak_bytes(B, ctx, Hkv, d):
    """Device bytes that :func:`run` holds at its peak for one grid case (an estimate, exact in
    the arrays it counts; :data:`MEM_MARGIN` covers the rest).

    ``run`` keeps the batch's bf16 K/V (``2 · B · ctx · Hkv · d`` elements, the source of every
    cache) for the whole case and, one at a time, holds beside it: the contiguous bf16 copy for
    SDPA with the largest SDPA-at-equal-bytes prefix (the SDPA phase, the peak), a floor's source
    or copy buffer of up to the bf16 bytes, and one format's cache of up to the bf16 bytes. The
    index arrays add 16 bytes a token (int64 slots, built per sequence and concatenated)."""
    tokens = int(B) * int(ctx)
    bf16 = _bf16_bytes(B, ctx, Hkv, d)
    eq = max((_bf16_bytes(B, floors.equal_bytes_context(ctx, rb, d), Hkv, d)
              for rb in _distinct_sizes(d) if rb != 2 * d), default=0)
    return 2 * bf16 + eq + 16 * tokens + 4 * B * (-(-ctx // BLOCK_SIZE))


def _free_pools(torch=None):
    """Give back what CuPy's and torch's allocators keep cached (the floors' buffers are CuPy's,
    the caches torch's), so the next phase of a case and the next case's free-memory check see
    the device's memory. No-op without a GPU."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            cupy.get_default_memory_pool().free_all_blocks()
    except Exception:  # noqa: BLE001 — no CuPy or no CUDA driver here: nothing is cached
        pass
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _device_free_bytes(torch):
    """Free device memory after :func:`_free_pools` (the driver's count)."""
    _free_pools(torch)
    return int(torch.cuda.mem_get_info()[0])


def _not_run_row(case, B, ctx, Hkv, d, need, free, why=""):
    bf16 = _bf16_bytes(B, ctx, Hkv, d)
    return dict(suite=NAME, case=case, impl=NOT_RUN, median_ms=None, bytes=None, gbps=None,
                frac_of_copy=None, ratio_vs_baseline=None,
                notes=(f"needs ~{need / 2**30:.1f} GiB of device memory at its peak (bf16 K/V "
                       f"{bf16 / 2**30:.1f} GiB twice, for the caches and for SDPA's contiguous copy, "
                       f"plus the largest SDPA-at-equal-bytes prefix and {MEM_MARGIN / 2**30:.0f} GiB "
                       f"of margin); {free / 2**30:.1f} GiB free on this GPU" + (f"; {why}" if why else "")))


def _row_bytes(name, d):
    import kvlab

    return 2 * d if name == "auto" else kvlab.get_format(name).row_bytes(d)


def _distinct_sizes(d):
    """Formats grouped by row bytes, in FORMATS order: ``{row_bytes: [format, ...]}``."""
    sizes = {}
    for name in FORMATS:
        sizes.setdefault(_row_bytes(name, d), []).append(name)
    return sizes


def _size_label(names):
    """``"int8/fp8"``: the formats sharing one cache size, as the floor rows' ``[… bytes]`` name them."""
    return "/".join(n.replace("_per_token_head", "") for n in names)


def floor_label(name, d):
    """The ``[… bytes]`` label of the floor rows that read format ``name``'s cache bytes at head
    size ``d`` (e.g. ``"int8/fp8"``; the formats of equal row bytes share their floor rows)."""
    return _size_label(_distinct_sizes(d)[_row_bytes(name, d)])


def _floor_rows(torch, case, B, ctx, Hkv, d, names, row_bytes, k_c, v_c, q_c, scale, base_ms, repeats):
    """The read floor, the paged read floor and (quantized formats, when ``k_c`` is given) the
    SDPA-at-equal-bytes rows of one cache size: ``((read floor ms, paged read floor ms), rows)``.

    Both floors are read before their copy-bandwidth rows, and the floors' source is handed back
    in between (:func:`_free_pools`), so this holds one buffer of the size's bytes at a time."""
    label = _size_label(names)
    nbytes = 2 * B * ctx * Hkv * row_bytes
    block = 2 * BLOCK_SIZE * Hkv * row_bytes
    rows, times = [], []
    measured = (
        (f"read floor [{label} bytes]", floors.read_floor(nbytes, repeats),
         "fastest pure streaming read of these bytes (ring probe, contiguous)"),
        (f"paged read floor [{label} bytes]", floors.paged_read_floor(nbytes, block, repeats),
         f"fastest pure streaming read of these bytes as whole {BLOCK_SIZE}-token blocks ({block} B, K and V) "
         f"at shuffled places, as this case's paged cache (ring probe)"),
    )
    floors.release()
    _free_pools()
    for impl, fl, what in measured:
        cp = copy_bandwidth_gbps(fl["bytes"], repeats)
        g = gbps(fl["bytes"], fl["median_ms"])
        others = "; ".join(f"{k}: {v:.4f} ms" if isinstance(v, float) else f"{k}: {v}"
                           for k, v in fl["per_config"].items() if k != fl["config"])
        rows.append(dict(suite=NAME, case=case, impl=impl, median_ms=fl["median_ms"], bytes=fl["bytes"], gbps=g,
                         frac_of_copy=g / cp, ratio_vs_baseline=fl["median_ms"] / base_ms,
                         notes=f"{what}: {fl['config']}; also {others}"))
        times.append(fl["median_ms"])
    if names != ["auto"] and k_c is not None:
        rows.append(_sdpa_equal_bytes_row(torch, case, B, ctx, Hkv, d, label, row_bytes, k_c, v_c, q_c, scale,
                                          base_ms, repeats))
    return tuple(times), rows


def _sdpa_equal_bytes_row(torch, case, B, ctx, Hkv, d, label, row_bytes, k_c, v_c, q_c, scale, base_ms, repeats):
    """SDPA on the prefix of the contiguous bf16 cache that holds as many bytes as the format's
    cache (a quantized row is smaller than a bf16 one, so the prefix is shorter than ``ctx``)."""
    ctx_eq = floors.equal_bytes_context(ctx, row_bytes, d)
    k_e, v_e = k_c[:, :, :ctx_eq].contiguous(), v_c[:, :, :ctx_eq].contiguous()
    r = bench_ms(lambda: _sdpa(torch, q_c, k_e, v_e, scale), repeats)
    del k_e, v_e
    eq_bytes = _bf16_bytes(B, ctx_eq, Hkv, d)
    g = gbps(eq_bytes, r["median_ms"])
    return dict(suite=NAME, case=case, impl=f"torch SDPA bf16 at {label} bytes (L={ctx_eq})",
                median_ms=r["median_ms"], bytes=eq_bytes, gbps=g,
                frac_of_copy=g / copy_bandwidth_gbps(eq_bytes, repeats),
                ratio_vs_baseline=r["median_ms"] / base_ms,
                notes="SDPA on a contiguous bf16 cache of the format's byte count: the time the "
                      "format's call would take at torch's efficiency per byte, fixed costs included")


def _sdpa(torch, q, k, v, scale):
    F = torch.nn.functional
    try:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    except TypeError:  # older torch: expand the KV heads
        g = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                              scale=scale)


def build_batch(torch, B, ctx, Hq, Hkv, d, seed=0, lens=None):
    """Random bf16 K/V, a decode query per sequence, a shuffled block table.

    ``B`` sequences of ``ctx`` tokens, or ragged: ``lens`` (tokens per sequence) instead of
    ``B``/``ctx`` (the block table is padded with block 0 past each sequence's blocks). A uniform
    ``lens`` gives the same arrays as ``B``/``ctx`` with the same seed."""
    lens = [int(ctx)] * int(B) if lens is None else [int(n) for n in lens]
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)
    key = torch.randn((T, Hkv, d), device="cuda", dtype=torch.bfloat16, generator=g)
    value = torch.randn((T, Hkv, d), device="cuda", dtype=torch.bfloat16, generator=g)
    nb_seq = [-(-n // BLOCK_SIZE) for n in lens]
    nb = sum(nb_seq)
    perm = torch.randperm(nb, device="cuda", generator=g).to(torch.int32)
    block_table = torch.zeros((len(lens), max(nb_seq)), device="cuda", dtype=torch.int32)
    slots, o = [], 0
    for i, (n, k) in enumerate(zip(lens, nb_seq)):
        block_table[i, :k] = perm[o:o + k]
        o += k
        pos = torch.arange(n, device="cuda")
        slots.append(block_table[i].long()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    q = torch.randn((len(lens), Hq, d), device="cuda", dtype=torch.bfloat16, generator=g)
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    qsl = torch.arange(len(lens) + 1, device="cuda", dtype=torch.int32)
    return dict(key=key, value=value, block_table=block_table, slots=torch.cat(slots), q=q, seq_lens=seq_lens,
                query_start_loc=qsl, num_blocks=nb)


def _case_steps(d):
    """Progress steps of one case: SDPA, one per cache size (floors), one per format and kernel."""
    return 1 + len(_distinct_sizes(d)) + len(FORMATS) * len(VARIANTS)


def run(quick: bool, progress) -> list[dict]:
    import cupy
    import torch

    repeats = 10 if quick else 30
    grid = _grid(quick)
    progress.total(sum(len(cases) * _case_steps(d) for (_, _, d), cases in grid))
    oom = (torch.cuda.OutOfMemoryError, cupy.cuda.memory.OutOfMemoryError)
    rows = []
    for (Hq, Hkv, d), cases in grid:
        for B, ctx in cases:
            case = f"B={B} L={ctx} {Hq}/{Hkv} d={d}"
            need = case_peak_bytes(B, ctx, Hkv, d) + MEM_MARGIN
            free = _device_free_bytes(torch)
            if need > free:
                rows.append(_not_run_row(case, B, ctx, Hkv, d, need, free))
                for _ in range(_case_steps(d)):
                    progress(f"{case} not run: memory")
                continue
            done = [0]

            def step(msg, done=done):
                done[0] += 1
                progress(msg)

            try:
                rows.extend(_run_case(torch, case, B, ctx, Hq, Hkv, d, repeats, step))
                why = None
            except oom as e:
                why = f"ran out of memory anyway: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            if why is not None:   # outside the handler: the failed case's frames and arrays are gone
                from kvlab.cuda.attention import clear_plan_cache

                clear_plan_cache()
                floors.release()
                rows.append(_not_run_row(case, B, ctx, Hkv, d, need, _device_free_bytes(torch), why))
                for _ in range(_case_steps(d) - done[0]):
                    progress(f"{case} not run: memory")
            _free_pools(torch)
    return rows


def _run_case(torch, case, B, ctx, Hq, Hkv, d, repeats, progress) -> list[dict]:
    """Every row of one grid case, in the order of the results table (SDPA baseline; per cache
    size the read floor, the paged read floor and SDPA at equal bytes; per format both kernels).

    Memory, in order (:func:`case_peak_bytes`): the bf16 K/V stay for the whole case; beside
    them the contiguous SDPA copy with one equal-bytes prefix at a time, then one floor buffer at
    a time, then one format's cache at a time (its copy-bandwidth buffers freed before it)."""
    import kvlab
    from kvlab.cuda.attention import clear_plan_cache, plan_paged_attention

    b = build_batch(torch, B, ctx, Hq, Hkv, d)
    scale = 1.0 / math.sqrt(d)
    sizes = _distinct_sizes(d)
    # SDPA on a contiguous bf16 cache, and on its prefixes of each quantized size's bytes
    k_c = b["key"].view(B, ctx, Hkv, d).transpose(1, 2).contiguous()
    v_c = b["value"].view(B, ctx, Hkv, d).transpose(1, 2).contiguous()
    q_c = b["q"].view(B, Hq, 1, d)
    base = bench_ms(lambda: _sdpa(torch, q_c, k_c, v_c, scale), repeats)
    eq_rows = {rb: _sdpa_equal_bytes_row(torch, case, B, ctx, Hkv, d, _size_label(names), rb, k_c, v_c, q_c,
                                         scale, base["median_ms"], repeats)
               for rb, names in sizes.items() if names != ["auto"]}
    del k_c, v_c
    _free_pools(torch)
    bytes_bf16 = _bf16_bytes(B, ctx, Hkv, d)
    cp_bf16 = copy_bandwidth_gbps(bytes_bf16, repeats)
    g_b = gbps(bytes_bf16, base["median_ms"])
    rows = [dict(suite=NAME, case=case, impl="torch SDPA bf16 (baseline)",
                 median_ms=base["median_ms"], bytes=bytes_bf16, gbps=g_b,
                 frac_of_copy=g_b / cp_bf16, ratio_vs_baseline=1.0,
                 notes=f"contiguous cache, enable_gqa; copy {cp_bf16:.0f} GB/s")]
    progress(f"{case} sdpa")
    floor_ms = {}
    for rb, names in sizes.items():
        floor_ms[rb], frows = _floor_rows(torch, case, B, ctx, Hkv, d, names, rb, None, None, q_c,
                                          scale, base["median_ms"], repeats)
        rows.extend(frows + ([eq_rows[rb]] if rb in eq_rows else []))
        progress(f"{case} floor {rb} B/row")
    floors.release()
    _free_pools(torch)
    for name in FORMATS:
        row_bytes = _row_bytes(name, d)
        nbytes = 2 * B * ctx * Hkv * row_bytes
        _free_pools(torch)   # the previous format's cache, before the copy's buffers
        cp = copy_bandwidth_gbps(nbytes, repeats)
        _free_pools(torch)   # the copy's buffers, before the cache of the same bytes
        cache = kvlab.allocate_cache(name, b["num_blocks"], BLOCK_SIZE, Hkv, d, like=b["key"])
        kvlab.reshape_and_cache(b["key"], b["value"], cache, b["slots"], kv_cache_dtype=name)
        args = (b["q"], cache, b["block_table"], b["seq_lens"], b["query_start_loc"])
        out = torch.empty_like(b["q"])
        # the kernel the default (decode_variant="auto") picks here: its row is marked
        chosen = plan_paged_attention(*args, name).decode_variant
        for variant in VARIANTS:
            plan = plan_paged_attention(*args, name, decode_variant=variant)
            r = bench_ms(lambda: plan.run(*args, out=out), repeats)
            g_k = gbps(nbytes, r["median_ms"])
            grid_s = (f"{plan.n_items} CTAs of {plan.ny * plan.paged_halves} warps"
                      + (f" (dual ring, {plan.paged_nbuf} stages each)" if plan.paged_halves == 2
                         else f" ({plan.paged_nbuf} stages)")
                      if plan.decode_variant == "paged" else f"{plan.n_items}x{plan.ny} CTAs")
            if plan.wave_weight != 1.0:
                grid_s += f" (first wave x{plan.wave_weight:g})"
            if plan.slot_fill:
                grid_s += " (slots filled)"
            notes = (f"{plan.decode_variant}: {grid_s}, {plan.n_red} reductions; "
                     f"byte floor {row_bytes / (2 * d):.3f}x bf16")
            if plan.decode_variant_note:
                notes += f"; {plan.decode_variant_note}"
            fl_c, fl_p = floor_ms[row_bytes]
            notes += (f"; {r['median_ms'] / fl_c:.2f}x read floor, "
                      f"{r['median_ms'] / fl_p:.2f}x paged read floor")
            notes += f"; host {r['host_ms']:.3f} ms/call (not timed)"
            if variant == chosen:
                notes += f"; {DEFAULT_MARK}"
            if (B, ctx, d) == (64, 4096, 128) and name == "int4_per_token_head":
                notes += f"; vLLM Triton INT4 {VLLM_TRITON_INT4_MS} ms (quoted) -> " \
                         f"{VLLM_TRITON_INT4_MS / r['median_ms']:.1f}x faster"
            rows.append(dict(suite=NAME, case=case, impl=f"kvlab {name} [{variant}]",
                             median_ms=r["median_ms"], bytes=nbytes, gbps=g_k, frac_of_copy=g_k / cp,
                             ratio_vs_baseline=r["median_ms"] / base["median_ms"], notes=notes,
                             p10_ms=r["p10_ms"], p90_ms=r["p90_ms"], host_ms=r["host_ms"]))
            progress(f"{case} {name} {variant}")
        if (B, ctx, Hq, d) == (32, 8192, 32, 128) and name == "int4_per_token_head":
            def afresh():
                clear_plan_cache()
                return kvlab.paged_attention(*args, kv_cache_dtype=name)

            for label, fn, what in (
                ("whole call, kept plan", lambda: kvlab.paged_attention(*args, kv_cache_dtype=name),
                 "index arrays copied and compared with the kept plan's (paged_attention's "
                 "plan cache: the same batch again, e.g. the next layer) + kernels"),
                ("whole call, planned afresh", afresh,
                 "validation + host work list + upload + kernels (a new batch)"),
            ):
                full = bench_ms(fn, repeats, hide_launch=False)
                rows.append(dict(suite=NAME, case=case, impl=f"kvlab {name} ({label})",
                                 median_ms=full["median_ms"], bytes=nbytes,
                                 gbps=gbps(nbytes, full["median_ms"]),
                                 frac_of_copy=gbps(nbytes, full["median_ms"]) / cp,
                                 ratio_vs_baseline=full["median_ms"] / base["median_ms"],
                                 notes=f"{what}; default variant"))
            clear_plan_cache()
        del cache, plan, out
    del b
    torch.cuda.empty_cache()
    return rows
