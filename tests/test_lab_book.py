"""accumcore.lab.book: the edition note, quoted numbers and progress lines of the book."""

from __future__ import annotations

import numpy as np

from accumcore.lab import book


def test_glue_prints_and_returns_plain_value(capsys):
    value = book.glue("test_ratio", np.float32(0.25), ".2f")
    assert value == 0.25 and type(value) is float
    assert capsys.readouterr().out.strip() == "test_ratio = 0.25"


def test_progress_appends_to_the_named_file(tmp_path, monkeypatch, capsys):
    log = tmp_path / "progress.log"
    monkeypatch.setenv(book.PROGRESS_ENV, str(log))
    book.progress("chapter 5: run 1/3 done")
    book.progress("chapter 5: run 2/3 done")
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and lines[1].endswith("chapter 5: run 2/3 done")
    assert "run 1/3" in capsys.readouterr().out


def test_progress_without_file_only_prints(monkeypatch, capsys):
    monkeypatch.delenv(book.PROGRESS_ENV, raising=False)
    book.progress("hello")
    assert capsys.readouterr().out == "hello\n"


def test_edition_note_only_in_quick_mode(capsys):
    assert book.edition_note(False) == ""
    assert capsys.readouterr().out == ""
    text = book.edition_note(True, what="2,048 samples")
    assert "Quick edition" in text and "(2,048 samples)" in text
