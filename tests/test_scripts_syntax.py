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
