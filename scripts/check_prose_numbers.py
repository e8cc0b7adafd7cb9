"""Every number a notebook's prose quotes must be shown by that page's executed cells.

The book's promise: each number in a sentence was printed (or glued: computed by a cell and
quoted with ``{glue:text}``) by the code above it, or is set in a visible code cell. This
check reads the executed notebooks of a book build (``_build/jupyter_execute/book/*.ipynb``)
and fails on a decimal number (``0.25``, ``1e-6``, ``97.5``) or a percentage (``45 %``) in a
markdown cell that nothing on the same page shows, unless ``ALLOWED`` lists it for that page
(definitions and constants: a grid step of sqrt(10), a worked exercise's arithmetic). Numbers
inside code spans, math, glue roles and link targets are not prose numbers.

Usage: python scripts/check_prose_numbers.py [EXECUTED_DIR]   (exit 1 with one line per number)
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

#: page (notebook stem) -> numbers its prose may quote without an output showing them, each
#: with why.
ALLOWED: dict[str, dict[str, str]] = {
    "06b_gaps": {"0.99": "keras.layers.BatchNormalization's default momentum (a constant)"},
    "05_lr_sweeps": {
        "0.5": "one grid step of sqrt(10) in log10 (exercise 3's worked answer)",
        "0.45": "exercise 3's worked arithmetic",
        "0.25": "exercise 3's worked arithmetic",
        "1.8": "exercise 3's worked arithmetic",
        "1.2": "log10 of 16 in exercise 3",
        "2.4": "log10 of 256 in exercise 3",
        "3.0": "log10 of 1024 in exercise 3",
        "2.1": "the mean of log10 B in exercise 3",
        "1.5": "a learning rate to add to the grid (exercise 2)",
        "3.2": "the grid's step, sqrt(10) (a definition)",
    },
}

_STRIP = [
    re.compile(r"\{glue:[a-z]+\}`[^`]*`"),  # glue roles (the value is computed)
    re.compile(r"\{[a-z]+\}`[^`]*`"),  # other roles ({doc}, {ref}, ...)
    re.compile(r"```.*?```", re.S),  # fenced blocks (code, admonitions are kept below)
    re.compile(r"`[^`]*`"),  # code spans
    re.compile(r"\$\$.*?\$\$", re.S),  # display math
    re.compile(r"\$[^$]*\$"),  # inline math
    re.compile(r"\]\([^)]*\)"),  # link targets
    re.compile(r"https?://\S+"),
]
_NUMBER = re.compile(r"(?<![\w.])(\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+|\d+(?= ?%))(?![\w])")


def prose(markdown: str) -> str:
    """The markdown without what is not prose (see the module docstring). Admonition bodies
    (exercise answers) are prose: their fences are unwrapped first."""
    text = re.sub(r"```\{admonition\}[^\n]*\n(?::class:[^\n]*\n)?(.*?)```", r"\1", markdown,
                  flags=re.S)
    for pattern in _STRIP:
        text = pattern.sub(" ", text)
    return text


#: Cell tags that keep a code cell's source off the page.
HIDDEN = {"remove-cell", "remove-input", "hide-input"}


def shown(notebook: dict) -> str:
    """Every text an executed notebook shows or glues: streams, plain-text results, errors,
    and the source of its visible code cells (a constant set there is on the page)."""
    parts = []
    for cell in notebook["cells"]:
        tags = set(cell.get("metadata", {}).get("tags", []))
        if cell["cell_type"] == "code" and not tags & HIDDEN:
            parts.append("".join(cell["source"]))
        for output in cell.get("outputs", []):
            parts.append("".join(output.get("text", "")))
            for mime, value in output.get("data", {}).items():
                if "text" in mime or "record" in mime:
                    parts.append("".join(value) if isinstance(value, list) else str(value))
    return "\n".join(parts)


def variants(number: str) -> set[str]:
    """How an output may show ``number``: as written, and for a decimal without trailing
    zeros or rounded as Python's formats round it."""
    forms = {number}
    try:
        value = float(number)
    except ValueError:
        return forms
    if "e" not in number and "." in number:
        digits = len(number.split(".")[1])
        forms.add(f"{value:.{digits}f}")
    forms.add(f"{value:g}")
    return forms


def unshown_numbers(notebook: dict, allowed: dict[str, str]) -> list[str]:
    """The prose numbers of ``notebook`` that none of its outputs shows."""
    outputs = shown(notebook)
    missing = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        for number in _NUMBER.findall(prose("".join(cell["source"]))):
            if number in allowed or any(form in outputs for form in variants(number)):
                continue
            missing.append(number)
    return missing


def main(argv: list[str]) -> int:
    folder = pathlib.Path(argv[0] if argv else "_build/jupyter_execute/book")
    notebooks = sorted(folder.glob("*.ipynb"))
    if not notebooks:
        print(f"check_prose_numbers: no executed notebooks in {folder}", file=sys.stderr)
        return 1
    failures = []
    for path in notebooks:
        notebook = json.loads(path.read_text(encoding="utf-8"))
        for number in unshown_numbers(notebook, ALLOWED.get(path.stem, {})):
            failures.append(f"{path.stem}: '{number}' in the prose, shown by no output")
    for line in failures:
        print(line)
    print(f"check_prose_numbers: {len(notebooks)} pages, {len(failures)} unshown numbers")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
