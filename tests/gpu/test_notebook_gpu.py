"""Notebook 06 on the GPU: its GPU branch runs a small benchmark (issue 5).

Executed like tests/test_notebooks.py (nbclient, one fresh kernel, ``KVLAB_NOTEBOOK_SMALL=1``:
the notebook then benchmarks only the ``write`` suite with ``--quick``). The notebook on disk is
not modified. Skips (does not fail) where nbformat/nbclient/ipykernel are not installed.
"""
import os
import re
from pathlib import Path

import pytest

from tests.helpers import run_notebook

pytestmark = pytest.mark.gpu
pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = next((ROOT / "notebooks").glob("06*.ipynb"))
TIMEOUT_S = 420


def test_notebook_06_runs_its_gpu_branch(monkeypatch):
    # the kernel and the benchmark subprocess it starts must import this checkout's kvlab
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    nb = run_notebook(NOTEBOOK, monkeypatch, TIMEOUT_S, env={"PYTHONPATH": path})
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                     if o.get("output_type") == "stream")
    assert "small mode" in text, "the notebook did not run in the small mode"
    assert "no GPU visible" not in text, "the notebook took its CPU branch on a GPU machine"
    m = re.search(r"ran the benchmark on the GPU: (\d+) rows \(write, --quick\)", text)
    assert m, f"the GPU branch's benchmark line is missing; stream output:\n{text[-3000:]}"
    assert int(m.group(1)) > 0
    print(m.group(0))
