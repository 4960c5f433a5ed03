"""GPU fuzzing: random valid shapes/layouts, every kernel vs the reference (tests/gpu/fuzz_case.py).

A fixed seed list runs in CI-on-GPU; ``KVLAB_FUZZ_SEEDS=N`` runs N more random seeds on demand.
Each chunk of seeds runs in a subprocess: a kernel that faults cannot poison the CUDA context of
the rest of the suite, and the failing seed is named.
"""
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
FIXED_SEEDS = list(range(1000, 1036))
EXTRA = int(os.environ.get("KVLAB_FUZZ_SEEDS", "0"))
SEEDS = FIXED_SEEDS + [secrets.randbits(31) for _ in range(EXTRA)]
CHUNKS = [SEEDS[i: i + 6] for i in range(0, len(SEEDS), 6)]


@pytest.mark.parametrize("seeds", CHUNKS, ids=lambda c: f"seeds{c[0]}-{c[-1]}")
def test_fuzz(seeds):
    r = subprocess.run([sys.executable, "-m", "tests.gpu.fuzz_case", *map(str, seeds)], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, tail
