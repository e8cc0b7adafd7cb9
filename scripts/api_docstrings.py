"""Sphinx extension for the API page (``book/api.md``): internal module names stay off it.

The library's docstrings name the internal modules where a reader of the source goes next
(``accumcore._impl.rule.step``); a reader of the API page cannot import them and should not
need to. When autodoc reads a docstring, this extension removes a parenthesis that holds only
such a name, the name and its colon where a parenthesis goes on to explain
(``(``accumcore._impl.nonfinite``: what counts)`` -> ``(what counts)``), and writes any other
such name by its last part (``accumcore._impl.state.SCALARS`` -> ``SCALARS``). The docstrings
themselves are unchanged. Registered in ``_config.yml`` (``sphinx.local_extensions``);
``tests/test_book_sources.py`` checks every docstring of the page's objects comes out clean.
"""

from __future__ import annotations

import re

_NAME = r"accumcore\._impl(?:\.\w+)+"
_RULES = [
    # a parenthesis that only names an internal module or object: dropped
    (re.compile(r"\s*\((?:see\s+)?(?::\w+:`~?|``)" + _NAME + r"(?:``|`)\)"), ""),
    # a parenthesis that names one, then explains: the explanation stays
    (re.compile(r"\((?::\w+:`~?|``)" + _NAME + r"(?:``|`)[:;]\s*"), "("),
    # "see ``a`` and ``b``" that names only internal objects: dropped
    (re.compile(r";?\s*see\s+``" + _NAME + r"``(?:\s+and\s+``" + _NAME + r"``)?"), ""),
    # any other: the object's own name, as a literal
    (re.compile(r"(?::\w+:`~?|``)" + _NAME.replace(r"(?:\.\w+)+", r"(?:\.\w+)*\.(\w+)")
                + r"(?:``|`)"), r"``\1``"),
]


def public_text(text: str) -> str:
    """``text`` (a docstring) without internal module names, as the module docstring says."""
    for pattern, replacement in _RULES:
        text = pattern.sub(replacement, text)
    return text


def _process(app, what, name, obj, options, lines: list[str]) -> None:
    lines[:] = public_text("\n".join(lines)).split("\n")


def setup(app):
    app.connect("autodoc-process-docstring", _process)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
