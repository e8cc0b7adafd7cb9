"""scripts/check_prose_numbers.py: a number in a notebook's prose must be shown on its page."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "check_prose_numbers", Path(__file__).resolve().parents[1] / "scripts" /
    "check_prose_numbers.py")
checker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checker)


def _page(markdown: str, output: str = "", code: str = "", tags: tuple = ()) -> dict:
    cell = {"cell_type": "code", "source": code, "metadata": {"tags": list(tags)},
            "outputs": [{"output_type": "stream", "text": output}]}
    return {"cells": [cell, {"cell_type": "markdown", "source": markdown, "metadata": {}}]}


def test_a_number_an_output_prints_passes():
    assert checker.unshown_numbers(_page("the gap is 0.25 here", "gap 0.25\n"), {}) == []


def test_a_number_no_output_shows_fails():
    assert checker.unshown_numbers(_page("the gap is 0.45 here", "gap 0.25\n"), {}) == ["0.45"]


def test_percentages_and_exponents_are_numbers_too():
    page = _page("it saved 45 % and 1e-6 of it", "nothing")
    assert checker.unshown_numbers(page, {}) == ["45", "1e-6"]


def test_code_math_glue_and_links_are_not_prose():
    page = _page("`lr=0.25`, $0.5 x$, {glue:text}`gap:.2f`, [a](https://x.org/1.5) and "
                 "{doc}`v0.3`", "nothing")
    assert checker.unshown_numbers(page, {}) == []


def test_a_constant_set_in_a_visible_code_cell_is_shown_a_hidden_one_is_not():
    assert checker.unshown_numbers(_page("decay 0.8", code="rate = 0.8"), {}) == []
    hidden = _page("decay 0.8", code="rate = 0.8", tags=("remove-cell",))
    assert checker.unshown_numbers(hidden, {}) == ["0.8"]


def test_rounding_as_python_formats_counts_as_shown():
    assert checker.unshown_numbers(_page("about 0.50", "ratio 0.5\n"), {}) == []


def test_an_exercise_answer_is_prose_and_the_allow_list_admits_definitions():
    page = _page("```{admonition} Answer\n:class: dropdown\nslope 0.25\n```", "x")
    assert checker.unshown_numbers(page, {}) == ["0.25"]
    assert checker.unshown_numbers(page, {"0.25": "worked arithmetic"}) == []


def test_main_fails_with_one_line_per_number(tmp_path, capsys):
    (tmp_path / "page.ipynb").write_text(json.dumps(_page("a 0.45 b", "0.25")))
    assert checker.main([str(tmp_path)]) == 1
    assert "page: '0.45' in the prose, shown by no output" in capsys.readouterr().out
    (tmp_path / "page.ipynb").write_text(json.dumps(_page("a 0.25 b", "0.25")))
    assert checker.main([str(tmp_path)]) == 0
