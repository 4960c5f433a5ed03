"""``python -m kvlab report``: the lab's report on real KV activations of a real model.

Writes ``<out>/report.md`` (tables and the answer to the research question),
``<out>/results.json`` (every table) and PNG plots:

* ``bits_vs_quality.png`` — bits per element vs KL and perplexity of every format and recipe;
* ``candidates_kl.png`` — KL of the research question's candidates against the bar;
* ``zero_point_scale.png`` — K/V error vs zero-point storage, scale dtype and group size;
* ``per_layer_error.png`` — K, V and attention-output error per layer;
* ``key_outliers_rht.png`` — outlier channels of real keys before/after the RHT.

Sizes: the default run (8 windows of 512 tokens: 256 of context prefilled
into the quantized cache, 256 scored) takes a few minutes on 2 CPU cores;
``--quick`` shrinks everything for a 1–2 minute smoke run (numbers noisier).
"""
from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Sizes:
    """How much data a lab run uses."""

    eval_windows: int
    window_len: int
    context_len: int
    calib_windows: int
    calib_len: int
    capture_len: int
    #: every n-th layer in the attention sweep
    layer_stride: int
    batch_size: int = 2


FULL = Sizes(eval_windows=8, window_len=512, context_len=256, calib_windows=2, calib_len=512,
             capture_len=256, layer_stride=1)
QUICK = Sizes(eval_windows=2, window_len=192, context_len=96, calib_windows=1, calib_len=256,
              capture_len=128, layer_stride=3)


@dataclass
class Lab:
    """What a study needs, loaded once: model, evaluation windows and reference, calibration, a capture."""

    lm: object
    sizes: Sizes
    windows: np.ndarray
    ref: object
    calib: object
    capture: object


def small_mode() -> bool:
    """True when ``KVLAB_NOTEBOOK_SMALL=1`` (notebooks executed by the tests on CPU)."""
    return os.environ.get("KVLAB_NOTEBOOK_SMALL", "") not in ("", "0")


def prepare(model: str | None = None, sizes: Sizes | None = None, progress: bool = True) -> Lab:
    """Load the model and text, compute the unquantized reference, calibrate, capture one window.

    sizes: default :data:`QUICK` under ``KVLAB_NOTEBOOK_SMALL=1``, else :data:`FULL`.
    Calibration uses windows disjoint from the scored ones (``split="calib"``).
    """
    from .capture import capture_kv
    from .metrics import reference_logprobs
    from .model import load_model
    from .recipes import calibrate
    from .text import token_windows

    sizes = sizes or (QUICK if small_mode() else FULL)
    lm = load_model(model)
    tok = lm.tokenizer
    windows = token_windows(tok, sizes.eval_windows, sizes.window_len)
    ref = reference_logprobs(lm, windows, sizes.context_len, batch_size=sizes.batch_size)
    calib_w = token_windows(tok, sizes.calib_windows, sizes.calib_len, split="calib")
    calib = calibrate([capture_kv(lm, w) for w in calib_w])
    capture = capture_kv(lm, windows[0][: sizes.capture_len])
    return Lab(lm=lm, sizes=sizes, windows=windows, ref=ref, calib=calib, capture=capture)


def end_to_end_recipes() -> list:
    """Every recipe of the report's end-to-end table: the five formats, nvfp4 with a calibrated global
    scale, 2/3-bit and unrotated 4-bit references, and the research question's candidates."""
    from dataclasses import replace

    from .recipes import FORMAT_RECIPES, INT4_SPEC, Recipe
    from .study import candidate_recipes

    norot = replace(INT4_SPEC, rotation="none")
    i3, i2 = replace(INT4_SPEC, bits=3), replace(INT4_SPEC, bits=2)
    return [*FORMAT_RECIPES,
            Recipe("nvfp4 (calibrated global scale)", "nvfp4", "nvfp4", nvfp4_global_scale="calibrated"),
            Recipe("int4 no rotation", norot, norot),
            Recipe("int3 rht", i3, i3),
            Recipe("int2 rht", i2, i2),
            *candidate_recipes()]


def research_rows(e2e_rows, head_size: int, baseline: str = "int4_per_token_head") -> list:
    """The research question's table: every row of ``e2e_rows`` with its KL ratio to the baseline
    (paired bootstrap 95% interval over windows) and whether it meets the bar
    (bytes ≤ baseline's and KL ≤ 0.7 × baseline's)."""
    from .metrics import paired_ratio

    base = next(r for r in e2e_rows if r["recipe"] == baseline)
    budget = head_size / 2 + 4
    out = []
    for r in e2e_rows:
        pr = paired_ratio(r["kl_per_window"], base["kl_per_window"]) if r["kl"] > 0 else \
            {"ratio": 0.0, "lo": 0.0, "hi": 0.0}
        fits = r["bytes_per_token_head"] <= budget + 1e-9
        out.append({"recipe": r["recipe"], "bits": r["bits"], "bytes": r["bytes_per_token_head"],
                    "kl": r["kl"], "kl_sem": r["kl_sem"], "ppl": r["ppl"],
                    "kl_vs_int4": pr["ratio"], "ratio_lo": pr["lo"], "ratio_hi": pr["hi"],
                    "fits_bytes": fits, "meets_bar": bool(fits and pr["ratio"] <= 0.7 and r["recipe"] != baseline),
                    "robust": bool(fits and pr["hi"] <= 0.7 and r["recipe"] != baseline)})
    return out


def _zero_point_reading(zps) -> str:
    """One paragraph reading the zero-point / scale table (numbers taken from it)."""
    from .study import group_mean

    g = {r["recipe"]: r for r in group_mean(zps, ["recipe"], ["sqnr_db"])}

    def db(name):
        return g[name]["sqnr_db"] if name in g else float("nan")

    base = db("zp=int8 scale=fp32")

    def cost(name):
        c = base - db(name)
        return f"{abs(c):.3f}" if abs(c) < 0.0005 else f"{c:.3f}"

    parts = [f"Reading it (SQNR averaged over K and V; the reference is a separate int8 zero point with an fp32 "
             f"scale, {base:.2f} dB; costs in dB): hiding the zero point in the fp32 scale word costs "
             f"{cost('zp=scale_word scale=fp32')} and saves 8 bits per head; in an fp16 word "
             f"{cost('zp=scale_word scale=fp16')}; in a bf16 word {cost('zp=scale_word scale=bf16')}, because it "
             f"then rewrites 4 of bf16's 7 mantissa bits *after* the codes were computed. The scale's own "
             f"precision barely matters when the codes are computed with the stored scale (int8 zero point with "
             f"a bf16 scale costs {cost('zp=int8 scale=bf16')}, with E4M3 {cost('zp=int8 scale=e4m3')}), except "
             f"for power-of-two E8M0 scales ({cost('zp=int8 scale=e8m0')}: up to half the range wasted). A float "
             f"offset instead of an integer zero point gains {db('zp=float scale=fp16') - base:.2f}; smaller "
             f"groups gain more (g=32 {db('g=32 fp16+int8zp') - base:.2f}, g=16 {db('g=16 fp16+int8zp') - base:.2f}) "
             f"but cost bits."]
    return parts[0]


def _save(fig, path):
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)


def main(args) -> int:
    """Run the study and write the report folder ``args.out``; returns 0."""
    # Idle OpenMP workers sleep instead of spinning: on a shared 2-core machine a competing
    # process otherwise slows every forward pass by ~1.5x (measured: 5.0 s vs 3.4 s per
    # 2x512-token forward); no cost when the machine is idle (1.8 s either way). Only takes
    # effect if torch is not imported yet (the CLI case).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import matplotlib

    matplotlib.use("Agg")
    import torch

    from . import plots
    from .study import (attention_sweep, end_to_end_sweep, markdown_table, outlier_profile, tensor_sweep,
                        zero_point_scale_recipes, bit_width_recipes, rotation_clipping_recipes, group_mean)

    t0 = time.time()
    out = Path(getattr(args, "out", None) or "reports/latest")
    quick = bool(getattr(args, "quick", False))
    model = getattr(args, "model", None)
    sizes = QUICK if quick else FULL
    out.mkdir(parents=True, exist_ok=True)
    timings = {}

    t = time.time()
    lab = prepare(model, sizes)
    lm = lab.lm
    d = lm.head_dim
    timings["load + reference + calibration"] = time.time() - t
    print(f"kvlab report: {lm.name}, {sizes.eval_windows} windows × {sizes.window_len} tokens "
          f"({timings['load + reference + calibration']:.0f} s to prepare)", flush=True)

    t = time.time()
    e2e = end_to_end_sweep(lm, lab.ref, end_to_end_recipes(), calib=lab.calib, batch_size=sizes.batch_size)
    timings["end-to-end sweep"] = time.time() - t
    research = research_rows(e2e, d)

    t = time.time()
    cap = lab.capture
    zps = tensor_sweep(cap, zero_point_scale_recipes(), calib=lab.calib, model=lm.model)
    bw = tensor_sweep(cap, bit_width_recipes(), calib=lab.calib, model=lm.model)
    rc = tensor_sweep(cap, rotation_clipping_recipes(), calib=lab.calib, model=lm.model)
    best = min((r for r in research if r["meets_bar"]), key=lambda r: r["kl"], default=None)
    recipes_by_name = {r.name: r for r in end_to_end_recipes()}
    layer_recipes = [recipes_by_name[n] for n in ("int8_per_token_head", "fp8_per_token_head",
                                                  "int4_per_token_head", "nvfp4")]
    if best is not None:
        layer_recipes.append(recipes_by_name[best["recipe"]])
    att = attention_sweep(cap, layer_recipes, layers=range(0, cap.num_layers, sizes.layer_stride),
                          calib=lab.calib, model=lm.model)
    kurt = []
    for layer in range(cap.num_layers):
        p = outlier_profile(cap.keys[layer])
        kurt.append({"layer": layer, "kurtosis_before": p["kurtosis_before"], "kurtosis_after": p["kurtosis_after"],
                     "max_over_rms_before": p["max_over_rms_before"], "max_over_rms_after": p["max_over_rms_after"]})
    worst = max(kurt, key=lambda r: r["kurtosis_before"])["layer"]
    prof = outlier_profile(cap.keys[worst])
    head = int(np.argmax(prof["absmax_before"].max(axis=-1)))
    timings["tensor / attention sweeps"] = time.time() - t

    t = time.time()
    base_kl = next(r["kl"] for r in e2e if r["recipe"] == "int4_per_token_head")
    _save(plots.bits_vs_quality(e2e, bar_kl=0.7 * base_kl), out / "bits_vs_quality.png")
    cands = [r for r in e2e if r["bytes_per_token_head"] <= d / 2 + 4 + 1e-9]
    _save(plots.candidate_kl(cands), out / "candidates_kl.png")
    _save(plots.zero_point_scale_errors(zps), out / "zero_point_scale.png")
    _save(plots.per_layer_errors(att), out / "per_layer_error.png")
    _save(plots.key_outliers(prof, worst, head, kurt), out / "key_outliers_rht.png")
    timings["plots"] = time.time() - t
    timings["total"] = time.time() - t0

    # ---- the Markdown report ---------------------------------------------------------------------
    winners = [r for r in research if r["meets_bar"]]
    robust = [r for r in research if r["robust"]]
    bl = next(r for r in research if r["recipe"] == "int4_per_token_head")
    lines = [
        "# kvlab report: low-bit KV cache on real activations", "",
        f"- model: **{lm.name}** ({lm.num_layers} layers, {lm.num_q_heads} query / {lm.num_kv_heads} KV heads, "
        f"head size {d}), {str(lm.dtype).replace('torch.', '')} on {lm.device}",
        f"- text: CPython `pydoc_data.topics`, {sizes.eval_windows} deterministic windows of {sizes.window_len} "
        f"tokens; the first {sizes.context_len} are prefilled into the quantized cache, the remaining "
        f"{sizes.window_len - sizes.context_len} are scored ({lab.ref.targets.size} tokens); calibration "
        f"({sizes.calib_windows}×{sizes.calib_len} tokens) from a disjoint part of the text",
        f"- mode: {'--quick (smoke run: small sizes, noisy numbers)' if quick else 'default'}; "
        f"run time {timings['total']:.0f} s on {os.cpu_count()} CPU cores "
        f"(torch {torch.__version__}, {platform.python_implementation()} {platform.python_version()})",
        f"- unquantized perplexity of the scored tokens: **{lab.ref.ppl:.4f}**", "",
        "Every K and V row goes through the cache (the prefill too attends to the dequantized cache). "
        "KL is the mean over scored tokens of KL(p_unquantized ‖ p_quantized) in nats; ± is one standard "
        "error over windows. Bits per element count codes, scales and zero points; `auto` stores the "
        "model dtype and is counted as 16 bits.", "",
        "## The research question", "",
        f"Find a recipe at no more bytes per token-head than `int4_per_token_head` (d/2+4 = {d // 2 + 4} bytes, "
        f"{(d / 2 + 4) * 8 / d:.3g} bits/element at d={d}) whose KL is at least 30% lower than "
        f"`int4_per_token_head`'s (KL {bl['kl']:.4g} ± {bl['kl_sem']:.2g}; bar: KL ≤ {0.7 * bl['kl']:.4g}).", "",
    ]
    if winners:
        names = ", ".join(f"**{r['recipe']}** (KL ×{r['kl_vs_int4']:.2f} [{r['ratio_lo']:.2f}, "
                          f"{r['ratio_hi']:.2f}])" for r in sorted(winners, key=lambda r: r["kl"]))
        lines += [f"**Answer: {len(winners)} recipe(s) met the bar** (point estimate): {names}. "
                  f"{len(robust)} of them met it with the whole 95% paired-bootstrap interval of the KL ratio "
                  f"below 0.7" + (f" ({', '.join(r['recipe'] for r in robust)})." if robust else "."), ""]
    else:
        lines += ["**Answer: no recipe met the bar** on this run.", ""]
    lines += [
        "Columns: `kl_vs_int4` = KL ratio to `int4_per_token_head` on the same windows, with its 95% paired "
        "bootstrap interval [`ratio_lo`, `ratio_hi`]; `meets_bar` = fits the bytes and ratio ≤ 0.7; `robust` = "
        "the whole interval ≤ 0.7.", "",
        markdown_table(research, ["recipe", "bits", "bytes", "kl", "kl_sem", "ppl", "kl_vs_int4", "ratio_lo",
                                  "ratio_hi", "fits_bytes", "meets_bar", "robust"]),
        "Recipe details:", "",
        markdown_table([{"recipe": r["recipe"], "what": r["label"]} for r in e2e]),
        "Notes on the candidates: centering subtracts a per-layer, per-head, per-channel mean calibrated on "
        "disjoint text (exact to fold: keys shift every score of a query by the same constant, and values "
        "shift the output by the mean, which an output bias can add back); it costs no bytes per token. "
        "The KIVI-style per-channel keys re-quantize the last, partially filled 64-token group from its "
        "raw values as it grows, so a real cache must keep up to 63 raw keys per head in a residual "
        "buffer — not counted in its bits; the per-token recipes need no such buffer.", "",
        "![bits vs quality](bits_vs_quality.png)", "", "![candidates](candidates_kl.png)", "",
        "## Error vs zero-point and scale choices", "",
        "4-bit asymmetric after the RHT, mean over layers and heads of one captured window "
        f"({cap.keys.shape[1]} tokens). `scale_word` hides the integer zero point in the low mantissa bits "
        "of the scale (0 extra bits); `int8` stores it in a separate byte; `float` stores the group minimum "
        "in the scale dtype.", "",
        markdown_table(group_mean(zps, ["recipe", "side", "bits"], ["rel_mse", "sqnr_db", "cosine"])),
        _zero_point_reading(zps), "",
        "![zero point and scale](zero_point_scale.png)", "",
        "### Bit width", "",
        markdown_table(group_mean(bw, ["recipe", "side", "bits"], ["rel_mse", "sqnr_db", "cosine"])),
        "### Rotation, clipping, rounding", "",
        markdown_table(group_mean(rc, ["recipe", "side", "bits"], ["rel_mse", "sqnr_db", "cosine"])),
        "## Per-layer error", "",
        markdown_table(group_mean(att, ["recipe", "bits"], ["k_rel_mse", "v_rel_mse", "score_rel_err",
                                                            "out_rel_err"])),
        "![per layer](per_layer_error.png)", "",
        "## Outlier channels of real keys and the RHT", "",
        f"Layer {worst} has the heaviest-tailed keys (kurtosis of head-vector coordinates "
        f"{kurt[worst]['kurtosis_before']:.1f}; after the RHT {kurt[worst]['kurtosis_after']:.2f}; a Gaussian has 3). "
        f"Mean over layers: kurtosis {np.mean([r['kurtosis_before'] for r in kurt]):.2f} → "
        f"{np.mean([r['kurtosis_after'] for r in kurt]):.2f}, max/rms "
        f"{np.mean([r['max_over_rms_before'] for r in kurt]):.2f} → "
        f"{np.mean([r['max_over_rms_after'] for r in kurt]):.2f}.", "",
        "![key outliers](key_outliers_rht.png)", "",
        "## Timings", "",
        markdown_table([{"step": k, "seconds": v} for k, v in timings.items()], floatfmt=".1f"),
        f"Command: `python -m kvlab report{' --quick' if quick else ''}"
        f"{' --model ' + model if model else ''} --out {out}`", "",
    ]
    (out / "report.md").write_text("\n".join(lines))

    def clean(rows):
        return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
                for r in rows]

    (out / "results.json").write_text(json.dumps({
        "model": lm.name, "sizes": asdict(sizes), "ppl_ref": lab.ref.ppl, "timings_s": timings,
        "end_to_end": clean(e2e), "research_question": clean(research), "zero_point_scale": clean(zps),
        "bit_width": clean(bw), "rotation_clipping": clean(rc), "per_layer": clean(att), "key_kurtosis": kurt,
    }, indent=1))
    print(f"kvlab report: wrote {out}/report.md and plots in {timings['total']:.0f} s")
    for r in sorted(research, key=lambda r: r["kl"]):
        print(f"  {r['recipe']:36s} {r['bits']:6.3f} b  KL {r['kl']:.5f}  ppl {r['ppl']:.3f}"
              f"{'  MEETS BAR' if r['meets_bar'] else ''}")
    return 0
