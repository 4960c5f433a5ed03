"""The built wheel ships kernels_cu/ and the *installed* package finds and compiles them."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"pip wheel failed:\n{r.stdout}\n{r.stderr}")
    (whl,) = out.glob("kvlab-*.whl")
    return whl


def test_wheel_contains_every_kernel_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (ROOT / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh"))
    assert sources, "no kernel sources in the checkout"
    missing = [s for s in sources if f"kvlab/kernels_cu/{s}" not in names]
    assert not missing, f"wheel lacks {missing}"


def test_installed_wheel_finds_and_compiles_kernels(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True)
    code = (
        "import kvlab, kvlab.cuda.loader as L, pathlib;"
        "d = L.kernels_dir(); print(d);"
        f"assert pathlib.Path(kvlab.__file__).is_relative_to({str(target)!r}), kvlab.__file__;"
        f"assert d.is_relative_to({str(target)!r}), d;"
        "fams = L.all_families(); assert 'nibble' in fams, fams;"
        "r = L.compile_family_offline('nibble', 'sm_90'); assert len(r) == 2, r;"
        "print('ok', fams)"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok" in r.stdout
