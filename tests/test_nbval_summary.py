"""``scripts/nbval_summary.py``: nbval's JUnit XML (one test case per cell) read back as one
result per notebook, failing where any cell of any notebook failed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("nbval_summary", ROOT / "scripts/nbval_summary.py")
nbval_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nbval_summary)


def _junit(tmp_path: Path, cases: list[tuple[str, str, float, str]]) -> str:
    """A JUnit XML file as pytest writes it for nbval: (classname, cell, seconds, outcome)."""
    body = {"passed": "", "failed": "<failure message='boom'/>", "skipped": "<skipped/>"}
    xml = "".join(f'<testcase classname="{cls}" name="{name}" time="{sec}">{body[outcome]}'
                  "</testcase>" for cls, name, sec, outcome in cases)
    path = tmp_path / "nbval.xml"
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{xml}'
                    "</testsuite></testsuites>")
    return str(path)


def test_each_notebook_is_one_result_with_its_cells_and_time(tmp_path, capsys):
    path = _junit(tmp_path, [
        ("book.01_eager_loop.ipynb", "Cell 0", 1.5, "passed"),
        ("book.masks_tokens.ipynb", "Cell 0", 3.0, "passed"),
        ("book.01_eager_loop.ipynb", "Cell 1", 2.0, "skipped"),
        ("book.masks_tokens.ipynb", "Cell 1", 4.0, "passed"),
    ])
    assert nbval_summary.per_notebook(path) == {
        "book/01_eager_loop.ipynb": {"passed": 1, "failed": 0, "skipped": 1, "seconds": 3.5},
        "book/masks_tokens.ipynb": {"passed": 2, "failed": 0, "skipped": 0, "seconds": 7.0},
    }
    assert nbval_summary.main(path) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(": ")[1] == "book/masks_tokens.ipynb"  # the longest first
    assert lines[-1].strip() == "nbval: 2 notebooks, 0 failed, 10 s of cells"


def test_a_failed_cell_fails_its_notebook_and_the_run(tmp_path, capsys):
    path = _junit(tmp_path, [("book.06_pitfalls.ipynb", "Cell 0", 1.0, "passed"),
                             ("book.06_pitfalls.ipynb", "Cell 1", 1.0, "failed"),
                             ("book.07_memory_speed.ipynb", "Cell 0", 1.0, "passed")])
    assert nbval_summary.main(path) == 1
    out = capsys.readouterr().out
    assert "nbval FAILED: book/06_pitfalls.ipynb: 1 cells passed, 1 failed" in out
    assert "nbval passed: book/07_memory_speed.ipynb" in out


def test_no_cell_at_all_fails(tmp_path):
    assert nbval_summary.main(_junit(tmp_path, [])) == 1
