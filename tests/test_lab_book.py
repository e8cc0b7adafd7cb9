"""accumcore.lab.book: the edition note, quoted numbers and progress lines of the book."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from accumcore.lab import book


@pytest.fixture
def glued(monkeypatch):
    """What myst-nb's glue hands to IPython's display: (bundle, metadata) per call."""
    myst_glue = pytest.importorskip("myst_nb.ext.glue")
    calls = []
    monkeypatch.setattr(myst_glue, "ipy_display",
                        lambda bundle, raw, metadata: calls.append((bundle, metadata)))
    return calls


def test_glue_records_silently_and_returns_none(glued, capsys):
    assert book.glue("test_ratio", np.float32(0.25), ".2f") is None
    assert capsys.readouterr() == ("", "")  # no `name = value` line, no stderr
    (bundle, metadata), = glued
    assert metadata["scrapbook"]["name"] == "test_ratio"
    # display=False: every mime key carries myst-nb's hidden prefix, so nothing renders
    assert bundle and all(key.startswith(metadata["scrapbook"]["mime_prefix"]) and
                          metadata["scrapbook"]["mime_prefix"] for key in bundle)
    assert next(v for k, v in bundle.items() if k.endswith("text/plain")) == "0.25"


def test_glue_converts_numpy_scalars(glued):
    book.glue("test_count", np.int64(7))
    (bundle, _), = glued
    assert next(v for k, v in bundle.items() if k.endswith("text/plain")) == "7"


def test_glue_rejects_a_format_that_does_not_fit(glued):
    with pytest.raises(ValueError, match="'.2f' does not apply to 'SGD'"):
        book.glue("test_rule", "SGD", ".2f")
    assert glued == []  # nothing recorded for the prose


@pytest.fixture
def recorded(monkeypatch):
    """What accumcore's own glue record hands to IPython's display, myst-nb hidden (a kernel
    without it, as Colab's stack runs the book in CI): (bundle, metadata) per call."""
    import IPython.display

    monkeypatch.setitem(sys.modules, "myst_nb", None)  # `from myst_nb import ...` fails
    calls = []
    monkeypatch.setattr(IPython.display, "display",
                        lambda bundle, raw, metadata: calls.append((bundle, metadata)))
    return calls


def test_glue_without_myst_nb_writes_myst_nbs_record_in_a_build(glued, recorded, monkeypatch):
    monkeypatch.setenv(book.BUILD_ENV, "1")
    value = np.float32(0.25)
    book.glue("test_ratio", value, ".2f")
    monkeypatch.delitem(sys.modules, "myst_nb")
    from myst_nb import glue as myst_glue

    myst_glue("test_ratio", value.item(), display=False)
    assert recorded and recorded == glued  # the same bundle and metadata, key for key


def test_glue_without_myst_nb_outside_a_build_records_nothing(recorded, monkeypatch):
    monkeypatch.delenv(book.BUILD_ENV, raising=False)
    assert book.glue("test_ratio", 0.25) is None
    assert recorded == []


def test_progress_appends_to_the_named_file_and_prints_nothing(tmp_path, monkeypatch, capsys):
    log = tmp_path / "progress.log"
    monkeypatch.setenv(book.PROGRESS_ENV, str(log))
    book.progress("chapter 5: run 1/3 done")
    book.progress("chapter 5: run 2/3 done")
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and lines[1].endswith("chapter 5: run 2/3 done")
    assert capsys.readouterr() == ("", "")


def test_progress_without_file_does_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(book.PROGRESS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    book.progress("hello")
    assert capsys.readouterr() == ("", "") and not list(tmp_path.iterdir())


def test_edition_note_only_in_quick_mode(capsys):
    assert book.edition_note(False) == ""
    assert capsys.readouterr().out == ""
    text = book.edition_note(True, what="2,048 samples")
    assert "Quick edition" in text and "(2,048 samples)" in text
