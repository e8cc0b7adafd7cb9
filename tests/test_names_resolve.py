"""Every ``accumcore.*`` name that the docs and docstrings mention exists.

Reads the README, CONTRIBUTING, the book's Markdown pages and notebooks, and every docstring and
comment of the library, finds each dotted name that starts with ``accumcore.``
(``accumcore.flush``, ``accumcore.memory.accum_steps_for``, ``accumcore._impl.rule.close``) and
resolves it: modules are imported, the rest is looked up attribute by attribute. Catches a name
left behind by a rename (``accumcore.Trainer``, ``accumcore._impl.entry.prepare``).
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: A dotted name that starts with ``accumcore.`` and is not part of a web address
#: (``accumcore.github.io``) or a longer dotted name.
NAME = re.compile(r"(?<![\w./-])accumcore(?:\.[A-Za-z_]\w*)+")
WEB = ("accumcore.github",)


def _texts() -> dict[str, str]:
    texts = {}
    pages = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "book").rglob("*.md"))]
    for path in pages:
        texts[str(path.relative_to(REPO))] = path.read_text()
    for path in sorted((REPO / "book").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        texts[str(path.relative_to(REPO))] = "\n".join("".join(c["source"]) for c in cells)
    for path in sorted((REPO / "accumcore").rglob("*.py")):
        texts[str(path.relative_to(REPO))] = path.read_text()
    return texts


def _set_in_init(owner: object, attribute: str) -> bool:
    """Whether ``owner`` is a class whose ``__init__`` sets ``self.<attribute>`` (an instance
    attribute: autodoc documents it from its ``#:`` comment; the class itself lacks it)."""
    if not isinstance(owner, type):
        return False
    import inspect

    try:
        source = inspect.getsource(owner.__init__)
    except (OSError, TypeError):
        return False
    return re.search(rf"\bself\.{re.escape(attribute)}\s*(?::[^=]+)?=", source) is not None


def resolves(name: str) -> bool:
    """Whether ``name`` (``accumcore.a.b``) is a module or an attribute of one."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return _set_in_init(target, attribute)
            target = getattr(target, attribute)
        return True
    return False


def mentioned_names() -> dict[str, list[str]]:
    """Each ``accumcore.*`` name mentioned, with where (file names)."""
    found: dict[str, list[str]] = {}
    for where, text in _texts().items():
        for name in NAME.findall(text):
            name = name.rstrip(".")
            if not name.startswith(WEB):
                found.setdefault(name, []).append(where)
    return found


def test_an_instance_attribute_set_in_init_resolves_and_a_missing_one_does_not():
    assert resolves("accumcore.AccumulationState.flush_call")
    assert not resolves("accumcore.AccumulationState.no_such_attribute")
    assert not resolves("accumcore.flush.flush_call")  # a function: no __init__ to read


def test_every_accumcore_name_mentioned_resolves():
    names = mentioned_names()
    assert len(names) > 20  # the scan found the docs
    missing = {name: sorted(set(where)) for name, where in names.items() if not resolves(name)}
    assert not missing, missing


@pytest.mark.parametrize("name", ["accumcore.Trainer", "accumcore._impl.entry.prepare",
                                  "accumcore.memory.no_such_helper"])
def test_a_stale_name_does_not_resolve(name):
    assert not resolves(name)
    assert resolves("accumcore.flush") and resolves("accumcore.memory.accum_steps_for")
