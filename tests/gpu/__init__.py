"""GPU tests (``@pytest.mark.gpu``; skipped where CuPy sees no CUDA device).

Crash-prone modules (``tests/gpu/isolated.py: ISOLATED_MODULES``) run in a fresh ``python -m
pytest`` subprocess through ``tests/gpu/test_isolated_gpu.py``, so that a kernel fault cannot
poison the CUDA context of the rest of the suite; ``tests/conftest.py`` deselects their tests in
the parent process when the runner is collected (each runs once). ``test_fuzz_gpu.py`` runs its
seeds in subprocess chunks the same way (``tests/gpu/fuzz_case.py``).
"""
