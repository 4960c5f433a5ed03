"""Shared test setup.

* ``@pytest.mark.gpu`` tests run only where CuPy sees a CUDA device; elsewhere
  they are skipped with a reason (CI has no GPU).
* ``rng`` gives each test fresh random inputs from a seed printed on failure
  (set ``KVLAB_TEST_SEED`` to replay one).
* Crash-prone GPU modules (``tests/gpu/isolated.py: ISOLATED_MODULES``) run once, in a fresh
  subprocess started by ``tests/gpu/test_isolated_gpu.py``: when that runner is collected, their
  tests are deselected here (and run in the child, which sets ``KVLAB_ISOLATED_CHILD=1``). Named
  alone on the command line, such a module runs in-process as usual.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path

import numpy as np
import pytest


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


GPU = _gpu_available()


def _deselect_isolated(config, items):
    """Drop the tests of isolated modules when their subprocess runner is collected (not in the child)."""
    from tests.gpu.isolated import ISOLATED_MODULES, RUNNER, is_child

    if is_child():
        return
    root = Path(str(config.rootpath))

    def rel(item):
        try:
            return Path(str(item.path)).resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            return ""

    if not any(rel(i) == RUNNER for i in items):
        return
    keep, drop = [], []
    for item in items:
        (drop if rel(item) in ISOLATED_MODULES else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_modifyitems(config, items):
    _deselect_isolated(config, items)
    if GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible to CuPy)")
    for item in items:
        # the marker, not the keyword: every test under tests/gpu/ has the package name "gpu" among
        # its keywords, which skipped the NumPy-only emulation test there on machines without a GPU
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("KVLAB_TEST_SEED", secrets.randbits(32)))
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


def pytest_runtest_makereport(item, call):
    if call.excinfo is not None:
        for k, v in item.user_properties:
            if k == "seed":  # shown with the failure: replay with KVLAB_TEST_SEED=<v>
                item.add_report_section("call", "seed", f"KVLAB_TEST_SEED={v}")
