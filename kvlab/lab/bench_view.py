"""Read the committed kernel benchmark results (``benchmarks/``) for notebook 06.

The kernel engineers commit the latest H200 run as ``benchmarks/latest/<suite>/results.json``
(``{"environment": {...}, "rows": [...]}``, rows with ``suite, case, impl, median_ms,
bytes, gbps, frac_of_copy, ratio_vs_baseline, notes``) with a summary in
``benchmarks/RESULTS.md``; older runs live under ``benchmarks/history/``. Nothing here
needs a GPU.
"""
from __future__ import annotations

import json
from pathlib import Path


def _root(root):
    return Path(root) if root is not None else Path(__file__).resolve().parents[2] / "benchmarks"


def find_results(root=None) -> list:
    """The ``results.json`` files of the latest committed run (one per suite).

    Layout: ``benchmarks/latest/<suite>/results.json`` (newest run), older runs under
    ``benchmarks/history/``. Without a ``latest/`` folder, every ``results.json``
    outside ``history/`` (e.g. ``benchmarks/run2/``). Empty when nothing is committed.
    """
    root = _root(root)
    if not root.is_dir():
        return []
    latest = root / "latest"
    if latest.is_dir():
        found = sorted(latest.glob("**/results.json"))
        if found:
            return found
    return sorted(p for p in root.glob("**/results.json") if "history" not in p.relative_to(root).parts)


def results_markdown(root=None) -> str:
    """The committed ``benchmarks/RESULTS.md`` summary ('' when absent)."""
    p = _root(root) / "RESULTS.md"
    return p.read_text() if p.is_file() else ""


def latest_results(root=None) -> tuple[dict, list]:
    """``(environment, rows)`` of the latest run: rows of every suite's ``results.json`` together."""
    env, rows = {}, []
    for p in find_results(root):
        e, r = load_results(p)
        env = env or e
        rows.extend(r)
    return env, rows


def load_results(path) -> tuple[dict, list]:
    """``(environment, rows)`` of one ``results.json``."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "rows" not in data:
        raise ValueError(f"path: {path} is not a kvlab benchmark results.json (no 'rows')")
    return data.get("environment", {}), list(data["rows"])


def bandwidth_plot(rows, suite: str):
    """Bars of the fraction of the measured copy bandwidth per implementation and case of one suite."""
    import matplotlib.pyplot as plt
    import numpy as np

    rs = [r for r in rows if r.get("suite") == suite and r.get("frac_of_copy") is not None]
    cases = list(dict.fromkeys(r["case"] for r in rs))
    impls = list(dict.fromkeys(r["impl"] for r in rs))
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(cases) + 3), 4.2))
    w = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        vals = [next((r["frac_of_copy"] for r in rs if r["case"] == c and r["impl"] == impl), np.nan) for c in cases]
        ax.bar(np.arange(len(cases)) + (i - (len(impls) - 1) / 2) * w, vals, w, label=impl)
    ax.set_xticks(np.arange(len(cases)), cases, fontsize=8)
    ax.set_ylabel("fraction of device-to-device copy bandwidth")
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.set_title(f"suite {suite!r}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def targets_plot(rows):
    """Horizontal bars, one per issue-4 target measured in ``rows`` (:mod:`kvlab.bench.targets`):
    the default kernel's time over the most time the target allows (1 = on the line, left of it =
    met), with the paged read floor of the same bytes as a tick where the decode suite measured it
    (how close any reader of that cache could come). Returns the figure; None when ``rows`` hold
    no target."""
    import matplotlib.pyplot as plt

    from kvlab.bench import targets

    cs = [c for c in targets.check(rows) if c["limit_ms"]]
    if not cs:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(cs) + 1.4))
    y = list(range(len(cs)))[::-1]
    for yi, c in zip(y, cs):
        x = c["row"]["median_ms"] / c["limit_ms"]
        ax.barh(yi, x, color="tab:green" if c["status"] == "met" else "tab:red", alpha=0.75)
        ax.text(x, yi, f"  {c['row']['median_ms']:.4f} ms ({c['status']})", va="center", fontsize=7)
        if c["paged_floor_ms"]:
            fx = c["paged_floor_ms"] / c["limit_ms"]
            ax.plot([fx, fx], [yi - 0.4, yi + 0.4], color="k", lw=1.5)
    ax.axvline(1.0, color="k", lw=0.8, ls=":")
    ax.set_yticks(y, [c["target"].what for c in cs], fontsize=7)
    ax.set_xlabel("time / the time the target allows (black tick: the paged read floor of the same bytes)")
    ax.set_xlim(0, max(1.6, max(c["row"]["median_ms"] / c["limit_ms"] for c in cs) * 1.35))
    ax.set_title("issue-4 targets (default kernel per format)")
    fig.tight_layout()
    return fig


def cost_plot(rows):
    """Where each decode target's kernel spends its time beyond a pure reader: one panel per
    decode target whose kernel has a cost model (:func:`kvlab.bench.targets.cost_model`), its
    time minus the paged read floor of the same bytes (µs) in every fitted case against that floor
    (ms), the fitted ``(slope − 1) · floor + fixed`` as a line, and the most the target allows at
    its own case as a red cross (the target needs its case's point at or below the cross).
    Returns the figure; None when ``rows`` hold no decode target with a model."""
    import matplotlib.ticker
    import matplotlib.pyplot as plt

    from kvlab.bench import targets

    cs = [c for c in targets.check(rows) if c["model"] is not None and c["fixed_allowed_us"] is not None]
    if not cs:
        return None
    ncol = min(3, len(cs))
    nrow = -(-len(cs) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.2 * nrow), squeeze=False)
    for ax, c in zip(axes.flat, cs):
        m = c["model"]
        fl = [p[1] for p in m["cases"]]
        ax.scatter(fl, [1e3 * (p[2] - p[1]) for p in m["cases"]], s=14, color="tab:blue", label="cases")
        lo, hi = min(fl), max(fl)
        xs = [lo * (hi / lo) ** (i / 40) for i in range(41)]   # a straight line, drawn on a log axis
        ax.plot(xs, [1e3 * (m["slope"] - 1) * x + m["fixed_us"] for x in xs], color="tab:blue", lw=1,
                label=f"fit: {m['slope']:.3f}× floor + {m['fixed_us']:.1f} µs")
        floor = c["paged_floor_ms"]
        ax.plot([floor], [1e3 * (c["limit_ms"] - floor)], "x", color="tab:red", ms=9, mew=2,
                label=f"target's most: {1e3 * (c['limit_ms'] - floor):.1f} µs")
        ax.axhline(0, color="k", lw=0.6, ls=":")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(c["target"].what.split(":")[0] + ": " + m["impl"].split()[1], fontsize=8)
        ax.set_xlabel("paged read floor (ms)", fontsize=8)
        ax.set_ylabel("time − floor (µs)", fontsize=8)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(cs):]:
        ax.axis("off")
    fig.suptitle("decode: the time beyond a pure reader of the same cache", fontsize=10)
    fig.tight_layout()
    return fig
