"""Crash-prone GPU modules, each in its own ``python -m pytest`` process (tests/gpu/isolated.py).

A kernel fault in one of them fails that module's test here with the child's output tail, and
leaves the CUDA context of this process (and every later test) untouched.
"""
import re

import pytest

from tests.gpu.isolated import ISOLATED_MODULES, failure_message, run_isolated

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("module", ISOLATED_MODULES, ids=lambda m: m.rsplit("/", 1)[-1][:-3])
def test_module_passes_in_a_subprocess(module):
    r = run_isolated(module)
    print((r.stdout + r.stderr)[-2000:])
    # 0: all passed; anything else (failures, a crash, no tests collected = 5) fails here
    assert r.returncode == 0, failure_message(module, r)
    summary = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert re.search(r"\d+ passed", summary), failure_message(module, r)
    # skips in the child (e.g. CuPy could not see the GPU there) would hide the module: none allowed
    assert "skipped" not in summary, failure_message(module, r)
