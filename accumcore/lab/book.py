"""Page furniture shared by the book's notebooks: the edition note, quoted numbers, progress.

* :func:`edition_note` says at the top of a page which edition (quick or full) it is.
* :func:`glue` records a number that the prose quotes (myst-nb's ``{glue:text}`` role). It
  prints and displays nothing: the reader sees the number in the sentence that quotes it and in
  the output of the visible cell that computed it, never a ``name = value`` line.
* :func:`progress` appends a progress line to the file named by the environment variable
  ``ACCUMCORE_PROGRESS`` (``scripts/build-book.sh`` follows that file, so the terminal shows
  which chapter runs and how far it is). It prints nothing into the page either, so it cannot
  interleave with Keras's own epoch log.

The notebooks call :func:`glue` and :func:`progress` only in cells tagged ``remove-cell``
(``tests/test_book_sources.py`` checks it): the code a reader sees, and copies, is plain Keras
and accumcore.
"""

from __future__ import annotations

import os
import time
from typing import Any

PROGRESS_ENV = "ACCUMCORE_PROGRESS"
# Set by the book's builds (scripts/check-book.sh, scripts/build-book.sh): the notebook runs
# inside a Jupyter Book build, whose kernel may lack myst-nb (a kernel on Colab's stack).
BUILD_ENV = "ACCUMCORE_BOOK_BUILD"
# myst-nb's (and papermill's) prefix of a glued value's hidden display keys.
GLUE_PREFIX = "application/papermill.record/"


def edition_note(quick: bool, *, what: str = "") -> str:
    """Display a one-paragraph note naming the edition (only in quick mode).

    Args:
        quick: whether the notebook runs in quick mode (``ACCUMCORE_QUICK=1``).
        what: optional words on what the quick edition shrinks (e.g. "2,048 training samples").

    Returns:
        The note's markdown text (empty in the full edition).
    """
    if not quick:
        return ""
    from IPython.display import Markdown, display

    detail = f" ({what})" if what else ""
    text = (
        f"> **Quick edition.** This page was executed in quick mode{detail}: the same code on "
        "less data, so what it computes are quick-mode numbers, and the sentences that quote "
        "them quote these. The full edition runs without `ACCUMCORE_QUICK`."
    )
    display(Markdown(text))
    return text


def glue(name: str, value: Any, fmt: str | None = None) -> None:
    """Record ``value`` under ``name`` for the prose, silently.

    Args:
        name: the key the markdown quotes with myst-nb's ``glue:text`` role (the role's
            target is ``name:fmt``, e.g. ``name:.3g``).
        value: a Python number or string (numpy scalars are converted to Python ones).
        fmt: the format spec the prose uses (e.g. ``".3g"``), if any. It is applied here once,
            so that a spec that does not fit the value (``".2f"`` on a string) fails in the
            notebook's cell, with a clear message, rather than later in the book build.

    Returns:
        None, so that a ``glue(...)`` call ending a cell shows no value either. Outside a
        Jupyter Book build (on Colab, where myst-nb is not installed) it does nothing; inside
        one whose kernel lacks myst-nb (``ACCUMCORE_BOOK_BUILD=1``) it writes myst-nb's
        record itself (:func:`_glue_record`).

    Raises:
        ValueError: if ``fmt`` cannot format ``value``.
    """
    if hasattr(value, "item"):
        value = value.item()
    if fmt is not None:
        try:
            format(value, fmt)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"glue({name!r}): the format {fmt!r} does not apply to {value!r} "
                f"({type(value).__name__}): {err}"
            ) from err
    try:
        from myst_nb import glue as record
    except ImportError:  # Colab: no myst-nb, nothing quotes the value (outside a build)
        if os.environ.get(BUILD_ENV) != "1":
            return None
        record = _glue_record
    record(name, value, display=False)  # hidden display keys only, never shown
    return None


def _glue_record(name: str, value: Any, display: bool = False) -> None:
    """Write what ``myst_nb.glue(name, value, display=False)`` writes, without myst-nb: the
    value's display bundle under hidden keys (:data:`GLUE_PREFIX`), named in the output's
    ``scrapbook`` metadata, which the build reads back (``tests/test_lab_book.py`` compares
    the two)."""
    from IPython.core.formatters import format_display_data
    from IPython.display import display as ipy_display

    bundle, metadata = format_display_data(value)
    prefix = "" if display else GLUE_PREFIX
    metadata["scrapbook"] = {"name": name, "mime_prefix": prefix}
    ipy_display({prefix + key: data for key, data in bundle.items()}, raw=True,
                metadata=metadata)


def progress(message: str) -> None:
    """Append ``message`` (with the time) to the ``ACCUMCORE_PROGRESS`` file, if one is named.

    Prints nothing on the page: the line goes to the file ``ACCUMCORE_PROGRESS`` names, for
    following a long run from a terminal.
    """
    path = os.environ.get(PROGRESS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"[{time.strftime('%H:%M:%S')}] {message}\n")
