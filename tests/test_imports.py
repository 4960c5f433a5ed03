"""Every kvlab module imports on its own in a fresh interpreter (no import cycles, no GPU needed)."""
import pkgutil
import subprocess
import sys

import pytest

import kvlab

MODULES = sorted(m.name for m in pkgutil.walk_packages(kvlab.__path__, "kvlab.") if not m.name.endswith("__main__"))


def test_all_modules_import_standalone():
    failures = []
    for name in MODULES:
        r = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True)
        if r.returncode:
            failures.append(f"{name}: {r.stderr.strip().splitlines()[-1]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", ["kvlab.reference", "kvlab.formats", "kvlab.validate"])
def test_module_listed(name):
    assert name in MODULES
