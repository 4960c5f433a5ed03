"""The measurement scripts (``scripts/*.py``) run only on the GPU machine, where a syntax error costs a
device call: each must at least parse here (Python 3.11; the GPU host runs 3.12)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.py"))


def test_there_are_scripts():
    assert len(SCRIPTS) >= 20


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    assert ast.get_docstring(tree), f"{path.name}: no module docstring saying what it measures and how to run it"


def test_ab_table_medians_and_differences(tmp_path, capsys):
    """scripts/ab_table.py (the A/B tables of benchmarks/latest/*/variants_session*): the median of a
    build's run medians, the difference to the first build in µs, each build's range, and only the
    rows every run has. Random values, checked against numpy's median."""
    import importlib.util
    import json

    import numpy as np

    spec = importlib.util.spec_from_file_location("ab_table", SCRIPTS[0].parent / "ab_table.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    rng = np.random.default_rng(44)
    vals = {b: rng.uniform(0.1, 0.2, (3, 2)) for b in ("A", "B")}
    dirs = {}
    for b, v in vals.items():
        dirs[b] = []
        for i, run in enumerate(v):
            d = tmp_path / f"{b}{i}"
            d.mkdir()
            rows = [{"case": "c", "impl": f"kvlab x{j}", "median_ms": float(run[j])} for j in range(2)]
            if i == 1:
                rows.append({"case": "c", "impl": "only in one run", "median_ms": 1.0})
            (d / "results.json").write_text(json.dumps({"rows": rows}))
            dirs[b].append(str(d))
    out = tmp_path / "t.json"
    assert ab.main(["--build", "A=" + ",".join(dirs["A"]), "--build", "B=" + ",".join(dirs["B"]),
                    "--json", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 4 and "only in one run" not in "\n".join(table)
    for j in range(2):
        cells = [c.strip() for c in table[2 + j].strip("|").split("|")]
        ma, mb = np.median(vals["A"][:, j]), np.median(vals["B"][:, j])
        assert cells[1] == f"kvlab x{j}"
        assert cells[2:5] == [f"{ma:.4f}", f"{mb:.4f}", f"{1000 * (mb - ma):+.2f}"]
        assert cells[6] == f"{vals['B'][:, j].min():.4f}–{vals['B'][:, j].max():.4f}"
    assert json.loads(out.read_text())["rows"][1]["runs_ms"]["A"] == list(vals["A"][:, 1])
    with pytest.raises(SystemExit):
        ab.main(["--build", "A=" + dirs["A"][0], "--build", "B=" + str(tmp_path / "missing")])
