#!/usr/bin/env python3
"""A/B table of repeated `python -m kvlab bench` runs of two or more builds (scripts/gpu_ab.sh's
BENCH entries, one results.json per run).

    python scripts/ab_table.py --build A=/tmp/x/bench_def,/tmp/x/bench_def2 \
        --build B=/tmp/x/bench_cols,/tmp/x/bench_cols2 --md out.md --json out.json

The first build is the reference. Per (case, impl) row present in every run of every build: the
median over a build's runs of each run's median (ms), the difference of each other build to the
reference (µs), and each build's min–max over its runs. Rows whose impl starts with ``kvlab`` and
contains ``whole call`` time the host too (``kvlab/bench/targets.py``) and are listed last, apart.
The table is printed (markdown) and written to --md; --json holds every run's median per row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def load_rows(run_dir: Path) -> dict:
    """(case, impl) -> median_ms of one run (its results.json)."""
    path = run_dir / "results.json"
    if not path.is_file():
        raise SystemExit(f"{path}: no results.json (did that bench run finish?)")
    data = json.loads(path.read_text())
    rows = data["rows"] if isinstance(data, dict) else data
    return {(r["case"], r["impl"]): float(r["median_ms"]) for r in rows}


def parse_build(text: str) -> tuple[str, list[Path]]:
    name, sep, dirs = text.partition("=")
    if not sep or not name or not dirs:
        raise argparse.ArgumentTypeError(f"--build {text!r}: expected NAME=DIR[,DIR...]")
    return name, [Path(d) for d in dirs.split(",") if d]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", type=parse_build, action="append", required=True,
                    help="NAME=DIR[,DIR...]: one build's bench result folders (first = reference)")
    ap.add_argument("--md", type=Path, help="write the markdown table here")
    ap.add_argument("--json", type=Path, help="write every run's medians here")
    args = ap.parse_args(argv)
    if len(args.build) < 2:
        ap.error("give at least two --build")
    runs = {name: [load_rows(d) for d in dirs] for name, dirs in args.build}
    names = list(runs)
    keys = [k for k in runs[names[0]][0] if all(k in r for rs in runs.values() for r in rs)]
    keys = sorted(keys, key=lambda k: "whole call" in k[1])   # stable: the bench's order otherwise
    ref = names[0]
    head = (["case", "impl"] + [f"{n} ms" for n in names] + [f"{n} − {ref} µs" for n in names[1:]]
            + [f"{n} range" for n in names])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out = {"builds": {n: [str(d) for d in dirs] for n, dirs in args.build}, "rows": []}
    for case, impl in keys:
        vals = {n: [r[(case, impl)] for r in runs[n]] for n in names}
        med = {n: statistics.median(v) for n, v in vals.items()}
        cells = [case, impl] + [f"{med[n]:.4f}" for n in names]
        cells += [f"{1000 * (med[n] - med[ref]):+.2f}" for n in names[1:]]
        cells += [f"{min(vals[n]):.4f}–{max(vals[n]):.4f}" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
        out["rows"].append({"case": case, "impl": impl, "runs_ms": vals, "median_ms": med})
    table = "\n".join(lines) + "\n"
    sys.stdout.write(table)
    if args.md:
        args.md.write_text(table)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
