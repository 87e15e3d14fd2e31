"""The generated pages match what they are made from: the tables of docs/benchmarks.md,
docs/algorithms.md and README.md match docs/results/ (docs/make_tables.py), and
docs/api.md matches the docstrings (docs/make_api.py).  Each check also fails on a page
that was changed by hand."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import pytest

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_{name}", os.path.join(DOCS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_tables_match_the_result_files():
    assert _script("make_tables").main(["--check"]) == 0, "run python3 docs/make_tables.py"


def test_table_check_notices_a_cell_changed_by_hand(tmp_path, monkeypatch):
    tables = _script("make_tables")
    page = tmp_path / "benchmarks.md"
    shutil.copy(os.path.join(DOCS, "benchmarks.md"), page)
    text = page.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 4 B |"))
    page.write_text(text.replace(row, row.replace("| 4 B |", "| 4 B | 1.00x |"), 1))
    monkeypatch.setattr(tables, "PAGES", (str(page),))
    assert tables.main(["--check"]) == 1


def test_api_reference_matches_the_docstrings():
    pytest.importorskip("torch")  # the page documents chorus.torch too
    assert _script("make_api").main(["--check"]) == 0, "run python3 docs/make_api.py"


def test_api_check_notices_a_page_changed_by_hand(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    api = _script("make_api")
    page = tmp_path / "api.md"
    page.write_text(open(os.path.join(DOCS, "api.md")).read().replace("Join the job", "Join a job", 1))
    monkeypatch.setattr(api, "PAGE", str(page))
    assert api.main(["--check"]) == 1
