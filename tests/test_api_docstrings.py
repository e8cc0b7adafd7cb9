"""The API pages' docstrings as napoleon reads them: no attribute documentation that the book's
``-W -n`` build would turn into a type.

Napoleon reads the first line of an attribute's documentation (a ``#:`` doc comment, a property
docstring) as ``type: description`` when it holds a colon outside a role or literal, so
``#: Issue 19: ...`` renders a type "Issue 19" on the API page and fails the nitpicky build
(three times so far, found each time only by the book build in CI). This catches it in seconds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

napoleon = pytest.importorskip("sphinx.ext.napoleon")  # the book's toolchain (not the Colab leg)
from sphinx.ext.napoleon.docstring import GoogleDocstring  # noqa: E402

PACKAGE = Path(__file__).resolve().parent.parent / "accumcore"
#: The book's napoleon settings (_config.yml) that bear on attribute documentation.
CONFIG = napoleon.Config(napoleon_google_docstring=True, napoleon_numpy_docstring=False,
                         napoleon_use_rtype=False, napoleon_use_ivar=True)


def attribute_docs(source: str) -> list[tuple[int, list[str]]]:
    """``(line, lines)`` of every ``#:`` doc comment block and property docstring in
    ``source``: the documentation that napoleon parses as an attribute's."""
    found: list[tuple[int, list[str]]] = []
    lines = source.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("#:"):
            start, block = i, []
            while i < len(lines) and lines[i].lstrip().startswith("#:"):
                block.append(lines[i].lstrip()[2:].strip())
                i += 1
            found.append((start + 1, block))
        else:
            i += 1
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and any(
                getattr(d, "id", None) == "property" for d in node.decorator_list):
            doc = ast.get_docstring(node)
            if doc:
                found.append((node.lineno, doc.splitlines()))
    return found


def read_as_type(lines: list[str]) -> str | None:
    """The type napoleon finds in an attribute's documentation, or ``None``."""
    parsed = str(GoogleDocstring(lines, CONFIG, what="attribute", name="documented"))
    types = [ln for ln in parsed.splitlines() if ln.startswith(":type:")]
    return types[0][len(":type:"):].strip() if types else None


def test_no_attribute_documentation_reads_as_a_type():
    found = [(f"{path.relative_to(PACKAGE.parent)}:{line}", read_as_type(doc))
             for path in sorted(PACKAGE.rglob("*.py"))
             for line, doc in attribute_docs(path.read_text())]
    typed = [f"{where}: {kind!r}" for where, kind in found if kind is not None]
    assert not typed, "napoleon reads these as types (reword the first line):\n" + "\n".join(
        typed)


def test_the_check_finds_a_colon_in_a_doc_comment_and_a_property():
    source = ('#: Issue 19: the fast unit tests.\nLIMIT = 180\n\n\nclass A:\n'
              '    @property\n    def window(self):\n        """Window: its variables."""\n'
              '\n    @property\n    def fine(self):\n        """The ``a: b`` pair and '
              ':class:`x.Y`."""\n')
    docs = attribute_docs(source)
    assert [line for line, _ in docs] == [1, 7, 11]
    assert [read_as_type(doc) for _, doc in docs] == ["Issue 19", "Window", None]


def shared_defaults(members: list[tuple[str, object]]) -> list[str]:
    """``label(parameter=default)`` of every parameter of ``members`` (label, callable) whose
    default reads as shared mutable state on the API page: an unhashable value (``[]``, ``{}``,
    a set, a non-frozen dataclass instance: its type sets ``__hash__`` to None) or a dataclass
    ``default_factory``, which the signature shows as ``<factory>``. (``inspect`` marks a
    parameter without a default with ``Parameter.empty``, never ``dataclasses.MISSING``.)"""
    import inspect

    found = []
    for label, member in members:
        try:
            signature = inspect.signature(member)
        except (TypeError, ValueError):
            continue
        for parameter in signature.parameters.values():
            default = parameter.default
            if default is inspect.Parameter.empty:
                continue
            if type(default).__hash__ is None or "<factory>" in repr(default):
                found.append(f"{label}({parameter.name}={default!r})")
    return found


def test_no_public_signature_shows_a_mutable_or_factory_default():
    """The API page renders each signature: a default of ``[]``, ``{}`` or a dataclass
    ``<factory>`` reads as a shared mutable default (a reader flagged ``LoopHistory``'s)."""
    import inspect

    import accumcore
    import accumcore.checkpointing
    import accumcore.memory

    members = []
    for module in (accumcore, accumcore.memory, accumcore.checkpointing):
        for name in getattr(module, "__all__", [n for n in dir(module) if not n.startswith("_")]):
            obj = getattr(module, name)
            if getattr(obj, "__module__", "").split(".")[0] != "accumcore":
                continue
            members.append((name, obj))
            if inspect.isclass(obj):
                members += [(f"{name}.{k}", v) for k, v in vars(obj).items()
                            if callable(v) and not k.startswith("_")]
    assert shared_defaults(members) == []


def test_the_check_finds_each_kind_of_shared_default():
    """The check above can fail: each kind of default it exists for is found, and immutable
    defaults (None, a tuple, a frozen dataclass, a number, a string) pass."""
    import dataclasses

    @dataclasses.dataclass
    class Box:
        items: list = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        n: int = 1

    def bad(a, b, c, d):
        return a, b, c, d

    def good(a, b, c, d, e):
        return a, b, c, d, e

    bad.__defaults__ = ([], {}, set(), Box())  # as ``def bad(a=[], ...)`` would set them
    good.__defaults__ = (None, (), Frozen(), 1, "x")
    found = shared_defaults([("bad", bad), ("Box", Box)])
    assert [entry.split("=")[0] for entry in found] == ["bad(a", "bad(b", "bad(c", "bad(d",
                                                        "Box(items"]
    assert found[-1] == "Box(items=<factory>)"
    assert shared_defaults([("good", good)]) == []


def test_no_public_exception_documents_a_return_type():
    """``autoexception`` (unlike ``autoclass``) merges ``__init__``'s hints into the class's
    description under ``autodoc_typehints: description``, so ``-> None`` reads "Return type:
    None" on the exception's entry (round-15 reader, NonFiniteGradientError)."""
    import inspect

    import accumcore

    exceptions = [obj for name in accumcore.__all__
                  if inspect.isclass(obj := getattr(accumcore, name))
                  and issubclass(obj, BaseException)]
    assert exceptions
    for exc in exceptions:
        if "__init__" in vars(exc):
            assert "return" not in inspect.get_annotations(exc.__init__), exc.__name__


def test_no_docstring_puts_a_possessive_after_a_literal_with_a_space():
    """``\\`\\`fit()\\`\\` 's`` renders with a stray space and a curly opening quote."""
    bad = [(path.name, n) for path in sorted(PACKAGE.rglob("*.py"))
           for n, line in enumerate(path.read_text().splitlines(), 1)
           if "`` 's" in line or "` 's" in line]
    assert not bad, bad


def test_accum_model_says_what_train_on_batch_does_in_either_way():
    """Round-16 reader A2: "train_on_batch (one micro-batch per call)" is true with
    ``accum_steps`` only; with ``micro_batch_size`` one call is one split update."""
    import accumcore

    doc = " ".join(accumcore.AccumModel.__doc__.split())
    assert "(one micro-batch per call)" not in doc
    assert ("``train_on_batch`` (with ``accum_steps`` one micro-batch per call; with "
            "``micro_batch_size`` one split update per call)") in doc


def joint_arguments(source: str) -> list[str]:
    """``function: entry`` of every ``Args:`` entry in ``source`` that documents several
    parameters at once (``x_train, y_train: ...``): napoleon renders the joint text under each
    name, so ``y_train`` would read as "inputs"."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        doc = ast.get_docstring(node) or ""
        lines, in_args, indent = doc.splitlines(), False, None
        for line in lines:
            if line.strip() == "Args:":
                in_args, indent = True, None
                continue
            if in_args and line.strip() and not line.startswith(" "):
                in_args = False
            if not in_args or not line.strip():
                continue
            width = len(line) - len(line.lstrip())
            indent = width if indent is None else indent
            if width == indent and "," in line.split(":", 1)[0]:
                found.append(f"{node.name}: {line.strip()}")
    return found


#: The appendix B modules whose parameters readers found documented in pairs.
ONE_PARAMETER_PER_ENTRY = ["lab/experiments.py", "lab/sequences.py", "lab/data.py",
                           "lab/pitfalls.py", "memory.py"]


@pytest.mark.parametrize("module", ONE_PARAMETER_PER_ENTRY)
def test_each_parameter_has_its_own_description(module):
    assert not joint_arguments((PACKAGE / module).read_text()), module


def test_the_check_finds_a_joint_argument_entry():
    source = ('def f(a, b, c):\n    """Do.\n\n    Args:\n        a, b: two arrays.\n'
              '        c: one, with a comma: here.\n            continued, a: b.\n"""\n')
    assert joint_arguments(source) == ["f: a, b: two arrays."]
