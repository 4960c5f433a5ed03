"""``python -m kvlab bench [suites] --out DIR [--quick]``.

Suites are the modules ``kvlab/bench/suite_<name>.py``; each exposes ``NAME: str`` and
``run(quick: bool, progress) -> list[dict]``. ``progress(msg)`` advances the progress bar
by one step and shows ``msg``; ``progress.total(n)`` may announce the number of steps.
Each row has the keys of :data:`ROW_KEYS` (missing ones are filled with ``None``).

Writes ``results.json`` (rows + environment) and ``results.md`` (a Markdown table with the
date, GPU and library versions, ending with the issue's targets read off the rows:
:mod:`kvlab.bench.targets`) into ``--out``. Without a GPU it prints one line and exits 1.
``KVLAB_BENCH_L2=dirty|clean`` sets how the timer flushes L2 before each repeat
(:mod:`kvlab.bench.timing`); the header records it as ``l2_flush``.
"""
from __future__ import annotations

import datetime
import importlib
import json
import pkgutil
import platform
import sys
from pathlib import Path

from . import targets
from .timing import l2_flush_mode

ROW_KEYS = ("suite", "case", "impl", "median_ms", "bytes", "gbps", "frac_of_copy",
            "ratio_vs_baseline", "notes")


def discover() -> dict:
    """``{NAME: module}`` of every ``kvlab/bench/suite_*.py``."""
    import kvlab.bench as pkg

    suites = {}
    for m in pkgutil.iter_modules(pkg.__path__):
        if m.name.startswith("suite_"):
            try:
                mod = importlib.import_module(f"kvlab.bench.{m.name}")
            except Exception as e:  # one broken suite must not take the others down
                mod = _BrokenSuite(m.name[len("suite_"):], e)
            suites[getattr(mod, "NAME", m.name[len("suite_"):])] = mod
    return dict(sorted(suites.items()))


class _BrokenSuite:
    """Stands in for a suite module that failed to import; running it raises the import error."""

    def __init__(self, name, error):
        self.NAME, self.error = name, error

    def run(self, quick, progress):
        raise RuntimeError(f"suite {self.NAME!r} failed to import: {self.error!r}")


def gpu_or_none():
    """(name, device properties) of GPU 0, or None when CuPy sees no GPU."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        p = cupy.cuda.runtime.getDeviceProperties(0)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        return name, p
    except Exception:
        return None


def environment(gpu) -> dict:
    import cupy
    import numpy

    name, p = gpu
    rt = cupy.cuda.runtime.runtimeGetVersion()
    drv = cupy.cuda.runtime.driverGetVersion()
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": f"{name} (sm_{p.get('major')}{p.get('minor')}, {p.get('multiProcessorCount')} SMs, "
               f"{p.get('totalGlobalMem', 0) / 2**30:.0f} GiB, L2 {p.get('l2CacheSize', 0) / 2**20:.0f} MiB)",
        "cuda_runtime": f"{rt // 1000}.{(rt % 1000) // 10}",
        "cuda_driver": f"{drv // 1000}.{(drv % 1000) // 10}",
        "cupy": cupy.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "l2_flush": l2_flush_mode(),
    }
    try:
        import torch

        env["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
    except ImportError:
        env["torch"] = "not installed"
    try:
        from cupy.cuda import nvrtc

        env["nvrtc"] = "%d.%d" % nvrtc.getVersion()
    except Exception:
        pass
    return env


class Progress:
    """tqdm bar when tqdm is installed, else one printed line per step."""

    def __init__(self):
        try:
            from tqdm import tqdm

            self._bar = tqdm(desc="bench", unit="case", file=sys.stderr)
        except ImportError:
            self._bar = None
        self._n = 0

    def total(self, n: int) -> None:
        if self._bar is not None:
            self._bar.total = (self._bar.total or 0) + int(n)
            self._bar.refresh()

    def __call__(self, msg: str = "") -> None:
        self._n += 1
        if self._bar is not None:
            self._bar.set_postfix_str(msg[:60])
            self._bar.update(1)
        else:
            print(f"[bench {self._n}] {msg}", file=sys.stderr, flush=True)

    def close(self):
        if self._bar is not None:
            self._bar.close()


def _fmt(v, key):
    if v is None:
        return ""
    if key == "bytes":
        return f"{v / 1e6:.1f} MB"
    if key == "median_ms":
        return f"{v:.4f}"
    if key == "gbps":
        return f"{v:.0f}"
    if key in ("frac_of_copy", "ratio_vs_baseline"):
        return f"{v:.2f}"
    return str(v).replace("|", "/")


def markdown(rows, env) -> str:
    lines = ["# kvlab benchmark results", ""]
    for k, v in env.items():
        lines.append(f"- **{k}**: {v}")
    lines += ["", "Columns: median over repeats with a cold L2 (CUDA events); `bytes` = bytes read + "
              "written by the operation; `gbps` = bytes / median time; `frac_of_copy` = gbps / "
              "GB/s of a device-to-device copy moving the same bytes, measured in the same run; "
              "`ratio_vs_baseline` = median time / the suite's baseline time (see notes).", ""]
    cols = [k for k in ROW_KEYS if k != "suite"]
    by_suite = {}
    for r in rows:
        by_suite.setdefault(r["suite"], []).append(r)
    for suite, rs in by_suite.items():
        lines += [f"## {suite}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rs:
            lines.append("| " + " | ".join(_fmt(r.get(k), k) for k in cols) + " |")
        lines.append("")
    lines += targets.markdown_lines(rows)   # the goals, last (empty without their suites)
    return "\n".join(lines)


def main(args) -> int:
    # arguments first (they do not need a GPU), then the GPU
    suites = discover()
    wanted = list(dict.fromkeys(args.suites)) or list(suites)
    unknown = [s for s in wanted if s not in suites]
    if unknown:
        print(f"kvlab bench: error: suites: unknown suite(s) {unknown}; available: {list(suites)}",
              file=sys.stderr)
        return 2
    gpu = gpu_or_none()
    if gpu is None:
        print("kvlab bench: no CUDA GPU visible to CuPy; the benchmarks need one "
              "(kernels still compile here: python -m kvlab check)", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(gpu)
    rows = []
    progress = Progress()
    try:
        for name in wanted:
            for r in suites[name].run(bool(args.quick), progress):
                row = {k: r.get(k) for k in ROW_KEYS}
                row["suite"] = row["suite"] or name
                row.update({k: v for k, v in r.items() if k not in ROW_KEYS})
                rows.append(row)
            # write what we have after every suite: a later failure keeps earlier results
            (out / "results.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
            (out / "results.md").write_text(markdown(rows, env))
    finally:
        progress.close()
    print(markdown(rows, env))
    print(f"\nwrote {out / 'results.json'} and {out / 'results.md'}")
    return 0
