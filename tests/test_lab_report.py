"""``python -m kvlab report --quick`` completes on CPU and writes its report, tables and plots."""
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

PNGS = ("bits_vs_quality.png", "candidates_kl.png", "zero_point_scale.png", "per_layer_error.png",
        "key_outliers_rht.png")


def test_report_quick_writes_its_files(tmp_path):
    from kvlab.lab.report import main

    out = tmp_path / "report"
    assert main(SimpleNamespace(out=str(out), quick=True, model=None)) == 0
    for name in PNGS:
        p = out / name
        assert p.is_file() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    md = (out / "report.md").read_text()
    assert "## The research question" in md and "**Answer:" in md
    assert "| int4_per_token_head | 4.5 | 36 |" in md
    res = json.loads((out / "results.json").read_text())
    rows = {r["recipe"]: r for r in res["research_question"]}
    assert set(rows) >= {"auto", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "nvfp4"}
    assert rows["auto"]["kl"] == 0.0
    assert rows["int4_per_token_head"]["kl_vs_int4"] == pytest.approx(1.0)
    for r in rows.values():  # the bar is applied as stated
        assert r["meets_bar"] == (r["bytes"] <= 36 and r["kl_vs_int4"] <= 0.7 and r["recipe"] != "int4_per_token_head")


def test_report_cli_turns_bad_model_into_one_line_error(capsys):
    from kvlab.__main__ import main

    assert main(["report", "--quick", "--model", "/nonexistent/model-folder", "--out", "/tmp/kvlab-x"]) != 0
