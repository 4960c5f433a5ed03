"""The GPU fuzz harness (tests/gpu/fuzz_case.py) itself, run with NumPy on both sides, so that a
harness bug shows up on machines without a GPU too."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fuzz_harness_runs_on_cpu():
    env = dict(os.environ, KVLAB_FUZZ_CPU="1")
    r = subprocess.run([sys.executable, "-m", "tests.gpu.fuzz_case", "1001", "1002", "1005"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("ok seed") == 3
