"""What a reader of the book must never see, as checks that return problems (no browser needed).

Two groups, both used by ``tests/test_book_sources.py`` (on ``book/*.ipynb``, and on bad samples
so that every check is seen to fail) and the second by ``scripts/browser_check.py`` (on every
built page, after a negative control):

* **Sources** (:func:`source_problems`): control characters in notebook or Markdown sources (a
  JSON ``"\\rceil"`` is a carriage return followed by ``ceil``); visible cells that use a name
  defined only in a hidden cell (copied into a fresh notebook, they raise ``NameError``); the
  book's page furniture (``glue``, ``progress``, ``edition_note``) in a visible cell; comments
  re-wrapped in the middle of a sentence.
* **Rendered pages** (:func:`page_problems`, given what the browser extracted): directive fences
  or roles that were not rendered (a raw ```` ```{admonition} ```` block), absolute paths of the
  building machine, and Python warnings or other stderr output in cell outputs, unless the cell
  is tagged ``expect-warning`` (it shows the warning on purpose).
"""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Iterable

#: Cell tags that hide a cell's code from the rendered page (``hide-input`` only folds it).
HIDDEN_TAGS = frozenset({"remove-cell", "remove-input"})
#: The tag of a cell whose output shows a warning (or other stderr) on purpose.
EXPECT_WARNING_TAG = "expect-warning"
#: Page furniture from ``accumcore.lab.book``: only hidden cells may call it.
FURNITURE = frozenset({"glue", "progress", "edition_note"})
#: Names a notebook cell has without defining them (IPython's globals).
NOTEBOOK_GLOBALS = frozenset(dir(builtins)) | {"display", "get_ipython", "__file__"}

# C0 controls except tab and newline, and DEL. A carriage return is one of them: notebooks
# and Markdown here use "\n" line ends, so a "\r" is a "\\r" escape gone wrong.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_COMMENT = re.compile(r"^(\s*)#\s?(.*)$")


def control_characters(text: str) -> list[str]:
    """``"line N: '\\r' before 'ceil = 235$ ...'"`` for each control character in ``text``."""
    found = []
    for match in _CONTROL.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        after = text[match.end():match.end() + 24].split("\n")[0]
        found.append(f"line {line}: {match.group()!r} before {after!r}")
    return found


def rewrapped_comments(code: str) -> list[str]:
    """Comment lines broken in the middle of a sentence (a formatter re-wrapping them).

    The pattern: a full-line comment of at most three words followed, at the same indentation,
    by a comment line that continues the sentence (starts in lower case, with a digit or an
    opening parenthesis), e.g. ``# difference is`` / ``# a few eps relative ...``.
    """
    lines = code.split("\n")
    found = []
    for n, (line, following) in enumerate(zip(lines, lines[1:]), start=1):
        this, after = _COMMENT.match(line), _COMMENT.match(following)
        if not (this and after) or this.group(1) != after.group(1):
            continue
        words, rest = this.group(2).split(), after.group(2)
        if 0 < len(words) <= 3 and rest[:1] and (rest[0].islower() or rest[0].isdigit()
                                                  or rest[0] in "(~<>="):
            found.append(f"line {n}: {line.strip()!r} / {following.strip()!r}")
    return found


def _bound_and_used(tree: ast.AST) -> tuple[set[str], list[tuple[str, int]]]:
    """Every name a cell binds anywhere (assignments, defs, imports, arguments, loop and
    ``with`` targets, comprehension variables) and every name it reads, with its line."""
    bound: set[str] = set()
    used: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                used.append((node.id, node.lineno))
            else:
                bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bound.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound.update(node.names)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
    return bound, used


def cell_tags(cell: dict) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def is_hidden(cell: dict) -> bool:
    """Whether the rendered page hides the cell's code (``remove-cell``, ``remove-input``)."""
    return bool(cell_tags(cell) & HIDDEN_TAGS)


def notebook_problems(notebook: dict) -> list[str]:
    """Problems of one notebook (a parsed ``.ipynb``): see the module docstring."""
    problems = []
    ids = [cell.get("id") for cell in notebook.get("cells", [])]
    if None in ids or len(set(ids)) != len(ids):  # nbformat 4.5: nbval and nbclient warn
        problems.append(f"{ids.count(None)} cells without an id, "
                        f"{len(ids) - len(set(ids))} repeated ids (nbformat 4.5 needs one each)")
    defined: set[str] = set(NOTEBOOK_GLOBALS)  # by the visible cells so far
    hidden_only: set[str] = set()  # names bound by hidden cells and (yet) by no visible one
    for index, cell in enumerate(notebook.get("cells", [])):
        source = "".join(cell.get("source", []))
        where = f"cell {index} ({cell.get('cell_type')}, id {cell.get('id', '?')})"
        problems += [f"{where}: control character at {c}" for c in control_characters(source)]
        if cell.get("cell_type") != "code":
            continue
        try:
            tree = ast.parse(source)
        except SyntaxError as err:
            problems.append(f"{where}: does not parse as Python ({err.msg}, line {err.lineno})")
            continue
        bound, used = _bound_and_used(tree)
        if is_hidden(cell):
            hidden_only |= bound - defined
            continue
        problems += [f"{where}: comment re-wrapped mid-sentence at {c}"
                     for c in rewrapped_comments(source)]
        defined |= bound
        hidden_only -= bound
        reported = set()
        for name, line in used:
            if name in reported:
                continue
            if name in FURNITURE:
                problems.append(f"{where}, line {line}: `{name}` (the book's page furniture) "
                                "in a visible cell; call it in a cell tagged remove-cell")
                reported.add(name)
            elif name not in defined:
                origin = ("defined only in a hidden cell" if name in hidden_only
                          else "defined in no earlier visible cell")
                problems.append(f"{where}, line {line}: `{name}` is {origin}: the cell fails "
                                "when copied after the visible cells above it")
                reported.add(name)
    return problems


def source_problems(name: str, text: str) -> list[str]:
    """Problems of one source file: a notebook (``.ipynb``, parsed) or Markdown (``.md``)."""
    import json

    if name.endswith(".ipynb"):
        return [f"{name}: {p}" for p in notebook_problems(json.loads(text))]
    return [f"{name}: control character at {c}" for c in control_characters(text)]


# ------------------------------------------------------------------------- rendered pages

# A MyST directive fence or a role that reached the reader as text: the parser did not see
# it (a broken fence, an indentation error, a stray character before it).
_RAW_FENCE = re.compile(r"(```|~~~|:::)\s*\{[a-zA-Z][\w:-]*\}")
_RAW_ROLE = re.compile(r"\{(?:glue(?::\w+)?|ref|doc|numref|eq|math|term|py:\w+)\}`")
# Python's warning lines ("file.py:440: UserWarning: ...") and logging's "WARNING:" records.
_WARNING = re.compile(r"\b[A-Z]\w*Warning: |^WARNING:|^\s*warnings\.warn\(", re.M)
# A Python file path with a directory, as tracebacks and warnings print them.
_PY_PATH = re.compile(r"(?<![\w.:/])/(?:[\w.+-]+/)+[\w.+-]+\.py\b")


def page_problems(info: dict, machine_paths: Iterable[str] = ()) -> list[str]:
    """What a reader must not see on one rendered page.

    Args:
        info: what the browser extracted: ``prose`` (the page's text outside code blocks),
            ``text`` (all of its text) and ``outputs`` (one dict per cell output: ``text``,
            ``stderr`` (bool) and ``tags``, the cell's tags).
        machine_paths: absolute paths of the building machine (the repository, the Python
            environment, the home directory) that must not appear anywhere.

    Returns:
        One line per problem; empty if the page is clean.
    """
    problems = []
    text, prose = info.get("text", ""), info.get("prose", "")
    for match in _RAW_FENCE.finditer(text):
        problems.append(f"unrendered directive fence {match.group()!r}")
    for match in _RAW_ROLE.finditer(prose):
        problems.append(f"unrendered role {match.group()!r}")
    for path in sorted({p.rstrip("/") for p in machine_paths if p and p.rstrip("/")}):
        if path in text:
            problems.append(f"absolute path of the building machine {path!r} in the page")
    for match in _PY_PATH.finditer(text):
        problems.append(f"absolute path of a Python file {match.group()!r} in the page")
    for output in info.get("outputs", []):
        if EXPECT_WARNING_TAG in output.get("tags", ()):
            continue
        body = output.get("text", "")
        first = body.strip().split("\n")[0][:120]
        if output.get("stderr"):
            problems.append(f"stderr output in a cell not tagged {EXPECT_WARNING_TAG}: {first!r}")
        elif _WARNING.search(body):
            line = _WARNING.search(body)
            shown = body[line.start():].split("\n")[0][:120]
            problems.append(f"a Python warning in a cell not tagged {EXPECT_WARNING_TAG}: "
                            f"{shown!r}")
    return problems
