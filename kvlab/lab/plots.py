"""Plots of the lab's tables (matplotlib). Each function takes tidy rows and returns a Figure.

Used by the report (saved as PNG) and by the notebooks (shown inline).
"""
from __future__ import annotations

import numpy as np


def _plt():
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline") \
            and "inline" not in matplotlib.get_backend().lower():
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bits_vs_quality(rows, bar_kl: float | None = None):
    """Two panels: storage bits per element vs mean KL (log scale) and vs perplexity.

    rows: end-to-end rows (``recipe``, ``bits``, ``kl``, ``kl_sem``, ``ppl``, ``ppl_ref``).
    bar_kl: draw the research question's KL bar (0.7 × INT4's KL) as a line.
    """
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    rows = [r for r in rows if r["kl"] > 0]
    formats = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "nvfp4")
    # many recipes share a bit count: label the formats and the lone points, not the crowd
    crowd = {b for b in {r["bits"] for r in rows} if sum(r["bits"] == b for r in rows) > 3}
    for ax, key in zip(axes, ("kl", "ppl")):
        for r in rows:
            fmt = r["recipe"] in formats
            ax.scatter(r["bits"], r[key], marker="s" if fmt else "o", s=50 if fmt else 22,
                       color="C3" if fmt else "C0", zorder=3 if fmt else 2, alpha=1.0 if fmt else 0.7)
            if fmt or r["bits"] not in crowd:
                ax.annotate(r["recipe"], (r["bits"], r[key]), fontsize=7, xytext=(5, 2),
                            textcoords="offset points")
        for b in crowd:
            ax.annotate(f"{sum(r['bits'] == b for r in rows)} recipes at {b:.3g} bits\n(see candidates_kl)",
                        (b, min(r[key] for r in rows if r["bits"] == b)), fontsize=7, xytext=(-10, -28),
                        textcoords="offset points", color="C0")
        ax.set_xlabel("storage bits per element (scales, zero points included)")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("mean KL(p_ref ‖ p_quant), nats/token")
    if bar_kl is not None:
        axes[0].axhline(bar_kl, color="C2", ls="--", lw=1, label="0.7 × KL(int4_per_token_head)")
        axes[0].legend(fontsize=8)
    if rows:
        axes[1].axhline(rows[0]["ppl_ref"], color="k", ls=":", lw=1, label="unquantized")
        axes[1].set_yscale("log")
        axes[1].legend(fontsize=8)
    axes[1].set_ylabel("perplexity of the continuation")
    fig.suptitle("Bits vs end-to-end quality (squares: kvlab formats, circles: lab recipes)")
    fig.tight_layout()
    return fig


def candidate_kl(rows, baseline: str = "int4_per_token_head"):
    """Horizontal bars of mean KL ± 2 SEM per recipe, with the 0.7 × baseline bar."""
    plt = _plt()
    base = next(r for r in rows if r["recipe"] == baseline)
    rows = sorted(rows, key=lambda r: r["kl"])
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
    y = np.arange(len(rows))
    colors = ["C3" if r["recipe"] == baseline else ("C2" if r["kl"] <= 0.7 * base["kl"] else "C0") for r in rows]
    ax.barh(y, [r["kl"] for r in rows], xerr=[2 * (r["kl_sem"] if np.isfinite(r["kl_sem"]) else 0) for r in rows],
            color=colors)
    ax.set_yticks(y, [f"{r['recipe']} ({r['bits']:.3g} b)" for r in rows], fontsize=8)
    ax.axvline(0.7 * base["kl"], color="C2", ls="--", lw=1, label="bar: 0.7 × KL(int4_per_token_head)")
    ax.set_xlabel("mean KL, nats/token (error bars: ±2 SEM over windows)")
    ax.set_xscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def zero_point_scale_errors(rows):
    """Grouped bars of mean K and V relative MSE per zero-point / scale recipe (bits in the labels).

    rows: :func:`kvlab.lab.study.tensor_sweep` rows (averaged here over layers).
    """
    from .study import group_mean

    plt = _plt()
    g = group_mean(rows, ["recipe", "side", "bits"], ["rel_mse"])
    names = list(dict.fromkeys(r["recipe"] for r in g))
    k = {r["recipe"]: r for r in g if r["side"] == "k"}
    v = {r["recipe"]: r for r in g if r["side"] == "v"}
    fig, ax = plt.subplots(figsize=(12, 4.8))
    x = np.arange(len(names))
    ax.bar(x - 0.2, [k[n]["rel_mse"] for n in names], 0.4, label="K")
    ax.bar(x + 0.2, [v[n]["rel_mse"] for n in names], 0.4, label="V")
    ax.set_xticks(x, [f"{n}\n{k[n]['bits']:.3g} b" for n in names], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("relative MSE (mean over layers)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("4-bit asymmetric after the RHT: zero-point storage, scale dtype, group size")
    fig.tight_layout()
    return fig


def per_layer_errors(rows, recipes=None):
    """Three panels per layer: K rel. MSE, V rel. MSE, attention-output rel. error (log scale).

    rows: :func:`kvlab.lab.study.attention_sweep` rows.
    """
    plt = _plt()
    names = recipes or list(dict.fromkeys(r["recipe"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharex=True)
    for n in names:
        rs = sorted((r for r in rows if r["recipe"] == n), key=lambda r: r["layer"])
        if not rs or all(r["k_rel_mse"] == 0 for r in rs):
            continue
        layers = [r["layer"] for r in rs]
        for ax, key in zip(axes, ("k_rel_mse", "v_rel_mse", "out_rel_err")):
            ax.plot(layers, [r[key] for r in rs], marker=".", label=n)
    for ax, t in zip(axes, ("K relative MSE", "V relative MSE", "attention output relative error")):
        ax.set_title(t)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def key_outliers(profile, layer: int, head: int, kurt_rows=None):
    """Per-channel |K| max of real keys before and after the RHT (one layer, one head);
    optionally a second panel with the per-layer coordinate kurtosis before/after.

    profile: :func:`kvlab.lab.study.outlier_profile` of that layer; kurt_rows: rows
    ``{layer, kurtosis_before, kurtosis_after}``.
    """
    plt = _plt()
    ncols = 2 if kurt_rows else 1
    fig, axes = plt.subplots(1, ncols, figsize=(7 * ncols, 4.2))
    axes = np.atleast_1d(axes)
    d = profile["absmax_before"].shape[-1]
    ax = axes[0]
    ax.bar(np.arange(d) - 0.2, profile["absmax_before"][head], 0.4, label="keys (post-RoPE)")
    ax.bar(np.arange(d) + 0.2, profile["absmax_after"][head], 0.4, label="after RHT (orthonormal)")
    ax.set_xlabel("channel")
    ax.set_ylabel("max |value| over tokens")
    ax.set_title(f"layer {layer}, KV head {head}: outlier channels before / after the RHT")
    ax.legend(fontsize=8)
    if kurt_rows:
        ax = axes[1]
        ax.plot([r["layer"] for r in kurt_rows], [r["kurtosis_before"] for r in kurt_rows], marker=".",
                label="keys")
        ax.plot([r["layer"] for r in kurt_rows], [r["kurtosis_after"] for r in kurt_rows], marker=".",
                label="after RHT")
        ax.axhline(3.0, color="k", ls=":", lw=1, label="Gaussian (3)")
        ax.set_xlabel("layer")
        ax.set_ylabel("kurtosis of head-vector coordinates")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def bars(rows, label_key: str, value_keys, title: str = "", log: bool = True):
    """Generic grouped bar chart of ``value_keys`` per ``label_key`` row."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4.2))
    x = np.arange(len(rows))
    w = 0.8 / len(value_keys)
    for i, k in enumerate(value_keys):
        ax.bar(x + (i - (len(value_keys) - 1) / 2) * w, [r[k] for r in rows], w, label=k)
    ax.set_xticks(x, [str(r[label_key]) for r in rows], rotation=45, ha="right", fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
