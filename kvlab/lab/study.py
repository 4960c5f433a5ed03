"""The study API: named recipe families, sweeps that return tidy tables, and a Markdown writer.

Tables are lists of dicts (one row per recipe × layer × side, or per recipe),
no pandas needed; :func:`markdown_table` renders them. Every row carries
``bits`` (storage bits per element, scales and zero points counted).

* :func:`quantize_capture` — one recipe on captured activations of one layer;
* :func:`tensor_sweep` — K/V relative MSE, SQNR, cosine per recipe × layer × side;
* :func:`attention_sweep` — attention-score and -output error per recipe × layer;
* :func:`end_to_end_sweep` — KL and perplexity per recipe (model in the loop);
* :func:`outlier_profile` — per-channel key magnitudes before/after the RHT;
* recipe families: :func:`zero_point_scale_recipes`, :func:`bit_width_recipes`,
  :func:`rotation_clipping_recipes`, :func:`candidate_recipes`.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..checks import check_int
from ..formats import FORMAT_NAMES
from ..reference.hadamard import rht
from .metrics import attention_errors, evaluate_recipe, tensor_errors
from .recipes import FORMAT_RECIPES, INT4_SPEC, QuantSpec, Recipe, format_recipe, roundtrip_side
from .rope import apply_rope, rope_cos_sin


def _progress(it, desc, enabled, total=None):
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, total=total, leave=False)


# ---- tables ------------------------------------------------------------------------------------
def _fmt(v, floatfmt):
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (float, np.floating)):
        if math.isnan(v):
            return "–"
        if math.isinf(v):
            return "inf"
        return format(float(v), floatfmt)
    return str(v)


def markdown_table(rows, columns=None, floatfmt: str = ".4g", headers=None) -> str:
    """A GitHub Markdown table of ``rows`` (list of dicts); ``columns`` picks and orders keys."""
    rows = list(rows)
    if not rows:
        return "_(no rows)_\n"
    columns = list(columns or rows[0].keys())
    headers = list(headers or columns)
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c, ""), floatfmt).replace("|", "\\|") for c in columns) + " |")
    return "\n".join(out) + "\n"


def group_mean(rows, by, values):
    """Mean of ``values`` columns over rows grouped by the ``by`` columns (first-seen order)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(tuple(r[b] for b in by), []).append(r)
    out = []
    for key, rs in groups.items():
        row = dict(zip(by, key))
        for v in values:
            row[v] = float(np.mean([r[v] for r in rs]))
        out.append(row)
    return out


# ---- argument checks -----------------------------------------------------------------------------
def _as_recipe(r, name: str) -> Recipe:
    """A Recipe, or the recipe of a kvlab format name; TypeError/ValueError naming ``name`` otherwise."""
    if isinstance(r, Recipe):
        return r
    if isinstance(r, str):
        if r not in FORMAT_NAMES:
            raise ValueError(f"{name}: expected a Recipe or one of {list(FORMAT_NAMES)}, got {r!r}")
        return format_recipe(r)
    raise TypeError(f"{name}: expected a Recipe or a format name, got {type(r).__name__}")


def _as_recipes(recipes) -> list:
    if isinstance(recipes, (str, Recipe)):
        raise TypeError(f"recipes: expected a list of recipes, got a single {type(recipes).__name__} "
                        f"(wrap it in a list)")
    try:
        items = list(recipes)
    except TypeError:
        raise TypeError(f"recipes: expected a list of recipes, got {type(recipes).__name__}") from None
    if not items:
        raise ValueError("recipes: expected at least one recipe, got an empty list")
    return [_as_recipe(r, f"recipes[{i}]") for i, r in enumerate(items)]


def _check_capture(capture) -> None:
    from .capture import KVCapture

    if not isinstance(capture, KVCapture):
        raise TypeError(f"capture: expected a KVCapture (kvlab.lab.capture.capture_kv), got {type(capture).__name__}")


def _layers(layers, capture) -> list:
    if layers is None:
        return list(range(capture.num_layers))
    out = [check_int(v, f"layers[{i}]", lo=0, hi=capture.num_layers - 1) for i, v in enumerate(layers)]
    if not out:
        raise ValueError("layers: expected at least one layer index (or None for all), got none")
    return out


# ---- recipes on captured activations ------------------------------------------------------------
def quantize_capture(capture, recipe, layer: int, calib=None, model=None):
    """Quantized ``(keys, values)`` of one layer, float32 ``(tokens, kv_heads, d)``, keys post-RoPE.

    Pre-RoPE recipes quantize ``capture.keys_pre_rope`` and re-apply RoPE
    (``model`` supplies the RoPE tables).
    """
    recipe = _as_recipe(recipe, "recipe")
    _check_capture(capture)
    layer = check_int(layer, "layer", lo=0, hi=capture.num_layers - 1)
    v = roundtrip_side(recipe, "v", capture.values[layer], layer, calib)
    if recipe.pre_rope:
        if model is None:
            raise ValueError("model: pre-RoPE recipes need the model for its RoPE tables")
        kq = roundtrip_side(recipe, "k", capture.keys_pre_rope[layer], layer, calib)
        cos, sin = rope_cos_sin(model, np.arange(kq.shape[0]))
        kq = apply_rope(kq.astype(np.float64), cos, sin).astype(np.float32)
    else:
        kq = roundtrip_side(recipe, "k", capture.keys[layer], layer, calib)
    return kq, v


def _quantized_layers(capture, recipes, layers, calib, model, progress: bool, what: str):
    """The loop of a sweep over captured activations: checks the arguments now (before any
    row is built), then returns an iterator of ``(recipe, layer, kq, vq)`` per recipe × layer
    (``quantize_capture``), with a progress bar labelled ``what``."""
    _check_capture(capture)
    recipes = _as_recipes(recipes)
    layers = _layers(layers, capture)

    def quantized():
        for r in _progress(recipes, what, progress):
            for layer in layers:
                kq, vq = quantize_capture(capture, r, layer, calib, model)
                yield r, layer, kq, vq

    return quantized()


def tensor_sweep(capture, recipes, layers=None, calib=None, model=None, progress: bool = True) -> list:
    """Rows ``{recipe, label, bits, layer, side, rel_mse, sqnr_db, cosine}`` per recipe × layer × side."""
    quantized = _quantized_layers(capture, recipes, layers, calib, model, progress, "tensor sweep")
    rows = []
    d = capture.head_dim
    for r, layer, kq, vq in quantized:
        for side, x, xq in (("k", capture.keys[layer], kq), ("v", capture.values[layer], vq)):
            rows.append({"recipe": r.name, "label": r.label(), "bits": r.side_bits(side, d), "layer": layer,
                         "side": side, **tensor_errors(x, xq)})
    return rows


def attention_sweep(capture, recipes, layers=None, calib=None, model=None, progress: bool = True) -> list:
    """Rows ``{recipe, bits, layer, k_rel_mse, v_rel_mse, score_rel_err, out_rel_err}`` per recipe × layer."""
    quantized = _quantized_layers(capture, recipes, layers, calib, model, progress, "attention sweep")
    rows = []
    d = capture.head_dim
    for r, layer, kq, vq in quantized:
        k, v = capture.keys[layer], capture.values[layer]
        att = attention_errors(capture.queries[layer], k, v, kq, vq, capture.scaling)
        rows.append({"recipe": r.name, "bits": r.bits_per_element(d), "layer": layer,
                     "k_rel_mse": tensor_errors(k, kq)["rel_mse"], "v_rel_mse": tensor_errors(v, vq)["rel_mse"],
                     **att})
    return rows


def end_to_end_sweep(lm, ref, recipes, calib=None, progress: bool = True, batch_size: int = 2) -> list:
    """Rows ``{recipe, label, bits, bytes_per_token_head, kl, kl_sem, ppl, ppl_ref, delta_nll, tokens}``."""
    from .metrics import Reference, _check_lm

    _check_lm(lm)
    if not isinstance(ref, Reference):
        raise TypeError(f"ref: expected a Reference (kvlab.lab.metrics.reference_logprobs), got {type(ref).__name__}")
    recipes = _as_recipes(recipes)
    batch_size = check_int(batch_size, "batch_size", lo=1)
    rows = []
    d = lm.head_dim
    for r in _progress(recipes, "end-to-end (KL, ppl)", progress):
        m = evaluate_recipe(lm, r, ref, calib=calib, batch_size=batch_size)
        rows.append({"recipe": r.name, "label": r.label(), "bits": r.bits_per_element(d),
                     "bytes_per_token_head": r.bytes_per_token_head(d), **m})
    return rows


# ---- outliers ------------------------------------------------------------------------------------
def kurtosis(x, axis=-1):
    """Excess-free kurtosis ``E[(x−μ)^4] / σ^4`` along ``axis`` (3 for a Gaussian)."""
    x = np.asarray(x, dtype=np.float64)
    c = x - x.mean(axis=axis, keepdims=True)
    return np.mean(c ** 4, axis=axis) / np.maximum(np.mean(c ** 2, axis=axis) ** 2, 1e-300)


def outlier_profile(keys, signs=None) -> dict:
    """Per-channel magnitudes of real keys ``(tokens, kv_heads, d)`` before and after the RHT.

    Returns ``{"absmax_before", "absmax_after"}`` float64 ``(kv_heads, d)`` (after: of
    ``H·(s⊙k)/√d``, the orthonormal RHT, so magnitudes compare), ``"kurtosis_before"``,
    ``"kurtosis_after"`` (mean over head vectors of the kurtosis of their coordinates),
    and ``"max_over_rms_before/after"`` (mean over vectors of max|x| / rms(x)).
    """
    k = np.asarray(keys, dtype=np.float64)
    if k.ndim != 3 or k.shape[0] < 1:
        raise ValueError(f"keys: expected one layer's keys (tokens, kv_heads, head_dim), got shape {k.shape}")
    d = k.shape[-1]
    y = rht(k, signs) / math.sqrt(d)

    def mor(a):
        return float(np.mean(np.abs(a).max(-1) / np.maximum(np.sqrt(np.mean(a * a, -1)), 1e-300)))

    return {"absmax_before": np.abs(k).max(axis=0), "absmax_after": np.abs(y).max(axis=0),
            "kurtosis_before": float(np.mean(kurtosis(k))), "kurtosis_after": float(np.mean(kurtosis(y))),
            "max_over_rms_before": mor(k), "max_over_rms_after": mor(y)}


# ---- recipe families -------------------------------------------------------------------------------
def zero_point_scale_recipes() -> list:
    """4-bit asymmetric (RHT) with every zero-point storage × scale dtype that is possible, and the
    group sizes with an fp16 scale + int8 zero point; plus symmetric references."""
    out = []
    for zp in ("scale_word", "int8", "float"):
        for sd in ("fp32", "fp16", "bf16", "e4m3", "e8m0"):
            try:
                spec = replace(INT4_SPEC, zero_point=zp, scale_dtype=sd)
            except ValueError:
                continue  # e.g. a zero point cannot hide in an E4M3 / E8M0 scale
            out.append(Recipe(f"zp={zp} scale={sd}", spec, spec))
    for g in (64, 32, 16):
        spec = replace(INT4_SPEC, zero_point="int8", scale_dtype="fp16", group_size=g)
        out.append(Recipe(f"g={g} fp16+int8zp", spec, spec))
    for sd in ("fp32", "e4m3"):
        spec = QuantSpec(bits=4, symmetric=True, scale_dtype=sd, rotation="rht")
        out.append(Recipe(f"symmetric scale={sd}", spec, spec))
    return out


def bit_width_recipes() -> list:
    """Asymmetric RHT whole-head recipes at 2, 3, 4, 8 bits (fp32 scale, hidden zero point)."""
    return [Recipe(f"int{b} rht", replace(INT4_SPEC, bits=b), replace(INT4_SPEC, bits=b)) for b in (2, 3, 4, 8)]


def rotation_clipping_recipes() -> list:
    """4-bit asymmetric with rotation none / vLLM signs / other signs, MSE clipping, rounding modes."""
    out = []
    for rot in ("none", "rht", "rht:1", "rht:2"):
        s = replace(INT4_SPEC, rotation=rot)
        out.append(Recipe(f"rotation={rot}", s, s))
    for clip in ("mse",):
        s = replace(INT4_SPEC, clipping=clip)
        out.append(Recipe("rht clip=mse", s, s))
    for rnd in ("half_even", "stochastic"):
        s = replace(INT4_SPEC, rounding=rnd)
        out.append(Recipe(f"rht round={rnd}", s, s))
    s = replace(INT4_SPEC, rotation="none", clipping="mse")
    out.append(Recipe("no rotation clip=mse", s, s))
    return out


#: per-channel keys, KIVI-style: 64-token groups, fp16 scale and fp16 offset (4.5 bits)
KIVI_KEYS = QuantSpec(bits=4, axis="channel", token_group=64, scale_dtype="fp16", zero_point="float")


def candidate_recipes() -> list:
    """The research question's candidates, all at ≤ d/2 + 4 bytes per (token, head) at d = 64."""
    mse = replace(INT4_SPEC, clipping="mse")
    lloyd = replace(INT4_SPEC, codebook="lloyd_max", clipping="mse")
    return [
        Recipe("int4 + MSE clip", mse, mse, description="per-vector search of the range shrink factor"),
        Recipe("Lloyd-Max 16 after RHT", lloyd, lloyd,
               description="Gaussian-optimal 16-level codebook, RMS scale (MSE-searched), fp32"),
        Recipe("int4 + smooth K", INT4_SPEC, INT4_SPEC, smooth_keys=0.5,
               description="SmoothAttention-style per-channel key scale folded into the query"),
        Recipe("int4 + pre-RoPE K", INT4_SPEC, INT4_SPEC, pre_rope=True),
        Recipe("int4 + center K", INT4_SPEC, INT4_SPEC, center_keys=True,
               description="calibrated per-channel key mean removed (free: softmax is shift-invariant)"),
        Recipe("int4 + center K,V", INT4_SPEC, INT4_SPEC, center_keys=True, center_values=True),
        Recipe("int4 + pre-RoPE + center K,V", INT4_SPEC, INT4_SPEC, pre_rope=True, center_keys=True,
               center_values=True),
        Recipe("int4 + center K,V + MSE clip", mse, mse, center_keys=True, center_values=True),
        Recipe("KIVI-style per-channel K (64 tok)", KIVI_KEYS, INT4_SPEC,
               description="keys: 64-token per-channel groups, fp16 scale+offset; values int4 RHT"),
        Recipe("KIVI-style K, pre-RoPE", KIVI_KEYS, INT4_SPEC, pre_rope=True),
    ]


def ordering_recipes() -> list:
    """INT8 per-token-head, INT4 per-token-head and a 2-bit recipe (for the ordering check)."""
    two = replace(INT4_SPEC, bits=2)
    return [format_recipe("int8_per_token_head"), format_recipe("int4_per_token_head"),
            Recipe("int2 rht", two, two)]


__all__ = [
    "markdown_table", "group_mean", "quantize_capture", "tensor_sweep", "attention_sweep", "end_to_end_sweep",
    "kurtosis", "outlier_profile", "zero_point_scale_recipes", "bit_width_recipes",
    "rotation_clipping_recipes", "candidate_recipes", "ordering_recipes", "FORMAT_RECIPES", "KIVI_KEYS",
]
