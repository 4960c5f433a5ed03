"""Run a GPU test module in a fresh ``python -m pytest`` subprocess.

One crashing kernel (an illegal address, a device-side assert) poisons the CUDA context for every
later test of the process (CONVENTIONS.md, "Pitfalls"). Modules that feed kernels hostile data
therefore run in their own process: ``tests/gpu/test_isolated_gpu.py`` runs each module of
:data:`ISOLATED_MODULES` with :func:`run_isolated` and fails with the child's output tail when the
child fails or dies.

Each module runs exactly once per session (``tests/conftest.py``):

* in the parent, when ``tests/gpu/test_isolated_gpu.py`` is collected too, the isolated modules'
  own tests are deselected (the runner runs them in the child);
* in the child, :data:`CHILD_ENV` is set and nothing is deselected;
* a module named alone (``pytest tests/gpu/test_degenerate_gpu.py``) runs in-process as usual.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: set in the child process; conftest then leaves the isolated modules in place
CHILD_ENV = "KVLAB_ISOLATED_CHILD"
#: repository-relative paths of the modules that run only in a subprocess
ISOLATED_MODULES = (
    "tests/gpu/test_degenerate_gpu.py",
    "tests/gpu/test_validation_gpu.py",
)
RUNNER = "tests/gpu/test_isolated_gpu.py"
TAIL_CHARS = 6000


def is_child() -> bool:
    return os.environ.get(CHILD_ENV) == "1"


def run_isolated(module: str, timeout_s: int = 600, extra_args=()) -> subprocess.CompletedProcess:
    """``python -m pytest -q <module>`` in a fresh process (repository root as cwd, ``CHILD_ENV=1``)."""
    env = dict(os.environ, **{CHILD_ENV: "1"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", module, *extra_args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


def failure_message(module: str, r: subprocess.CompletedProcess) -> str:
    """Why the child failed (exit code or signal) and the tail of its output."""
    how = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit code {r.returncode}"
    tail = (r.stdout + "\n" + r.stderr)[-TAIL_CHARS:]
    return f"{module} in a subprocess: {how}\n--- output tail ---\n{tail}"
