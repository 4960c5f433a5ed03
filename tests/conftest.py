"""Shared test setup.

* ``@pytest.mark.gpu`` tests run only where CuPy sees a CUDA device; elsewhere
  they are skipped with a reason (CI has no GPU).
* ``rng`` gives each test fresh random inputs from a seed printed on failure
  (set ``KVLAB_TEST_SEED`` to replay one).
"""
from __future__ import annotations

import os
import secrets

import numpy as np
import pytest


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


GPU = _gpu_available()


def pytest_collection_modifyitems(config, items):
    if GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible to CuPy)")
    for item in items:
        if "gpu" in item.keywords:
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
