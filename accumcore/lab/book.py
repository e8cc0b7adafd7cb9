"""Page furniture shared by the book's notebooks: the edition note, quoted numbers, progress.

* :func:`edition_note` says at the top of a page which edition (quick or full) it is.
* :func:`glue` records a number that the prose quotes (myst-nb's ``{glue:text}`` role) and
  prints it, so the executed cell shows the value the sentence states. On Colab, where myst-nb
  is not installed, it only prints.
* :func:`progress` prints a progress line in the cell and, when the environment variable
  ``ACCUMCORE_PROGRESS`` names a file, appends it there too (``scripts/build-book.sh`` follows
  that file, so the terminal shows which chapter runs and how far it is).
"""

from __future__ import annotations

import os
import time
from typing import Any

PROGRESS_ENV = "ACCUMCORE_PROGRESS"


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


def glue(name: str, value: Any, fmt: str | None = None) -> Any:
    """Record ``value`` under ``name`` for the prose and print it.

    Args:
        name: the key the markdown quotes with myst-nb's ``glue:text`` role (the role's
            target is ``name:fmt``, e.g. ``name:.3g``).
        value: a Python number or string (numpy scalars are converted).
        fmt: optional format spec used only for the printed line (e.g. ``".3g"``).

    Returns:
        ``value`` as a plain Python object.
    """
    if hasattr(value, "item"):
        value = value.item()
    try:
        from myst_nb import glue as _myst_glue
    except ImportError:  # Colab: no myst-nb; the printed line is what the reader sees
        _myst_glue = None
    if _myst_glue is not None:
        _myst_glue(name, value, display=False)
    shown = format(value, fmt) if fmt else value
    print(f"{name} = {shown}")
    return value


def progress(message: str) -> None:
    """Print ``message`` and append it (with the time) to the ``ACCUMCORE_PROGRESS`` file."""
    print(message, flush=True)
    path = os.environ.get(PROGRESS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"[{time.strftime('%H:%M:%S')}] {message}\n")
