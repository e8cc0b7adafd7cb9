"""The book's sources and rendered pages: what a reader must never see (scripts/book_checks.py).

The source checks run here on every ``book/*.ipynb`` and Markdown page; the page checks run on
the built HTML in ``scripts/browser_check.py``. Each check is also fed a bad sample, so that a
check that cannot fail fails here.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"


def _load_checks():
    path = ROOT / "scripts" / "book_checks.py"
    spec = importlib.util.spec_from_file_location("book_checks", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


checks = _load_checks()

SOURCES = sorted(p for p in [*BOOK.glob("*.ipynb"), *BOOK.rglob("*.md")]
                 if "_static" not in p.parts)
# Sources whose check is expected to fail for a stated reason (none at present).
PENDING: dict[str, str] = {}


def _params():
    for path in SOURCES:
        reason = PENDING.get(path.name)
        marks = [pytest.mark.xfail(reason=reason, strict=False)] if reason else []
        yield pytest.param(path, id=str(path.relative_to(BOOK)), marks=marks)


@pytest.mark.parametrize("path", list(_params()))
def test_book_source_is_clean(path):
    problems = checks.source_problems(path.name, path.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_there_are_sources_to_check():
    assert len([p for p in SOURCES if p.suffix == ".ipynb"]) >= 8


# ------------------------------------------------------------------ bad samples: each fires


def _notebook(*cells):
    """A notebook from (cell_type, source, tags) triples."""
    return {"cells": [{"cell_type": kind, "id": f"c{i}", "metadata": {"tags": list(tags)},
                       "source": source} for i, (kind, source, tags) in enumerate(cells)]}


def _problems(*cells):
    return checks.source_problems("sample.ipynb", json.dumps(_notebook(*cells)))


def test_a_clean_sample_passes():
    assert _problems(
        ("code", "import numpy as np\nx = np.ones(3)", ["hide-input"]),
        ("code", "from accumcore.lab.book import glue\nglue('n', 3)", ["remove-cell"]),
        ("markdown", "Three is {glue:text}`n`, $\\lceil x \\rceil$.", []),
        ("code", "def f(a, *, b=1):\n    return [a + b + k for k in range(3)]\n"
                 "y = f(x[0])\nprint(len(y), display)", []),
    ) == []


def test_a_cell_without_an_id_or_a_repeated_id_fires():
    notebook = _notebook(("code", "x = 1", ()), ("code", "y = x", ()))
    assert checks.notebook_problems(notebook) == []
    del notebook["cells"][0]["id"]
    assert checks.notebook_problems(notebook) == [
        "1 cells without an id, 0 repeated ids (nbformat 4.5 needs one each)"]
    notebook["cells"][0]["id"] = "c1"
    assert checks.notebook_problems(notebook) == [
        "0 cells without an id, 1 repeated ids (nbformat 4.5 needs one each)"]


def test_a_carriage_return_in_a_source_fires():
    # What a JSON "\rceil" becomes: a carriage return, then "ceil".
    found = _problems(("markdown", "$\\lceil 1875 / 8 \rceil = 235$", []))
    assert len(found) == 1 and "'\\r' before 'ceil = 235$'" in found[0]
    assert checks.source_problems("page.md", "tab\tok\nbell\x07") == [
        "page.md: control character at line 2: '\\x07' before ''"]


def test_a_name_defined_only_in_a_hidden_cell_fires():
    found = _problems(
        ("code", "from accumcore.lab.book import glue, progress", ["remove-input"]),
        ("code", "x = 1\nglue('x', x)", []),
        ("code", "y = undefined_name + 1", []),
    )
    assert any("`glue` (the book's page furniture) in a visible cell" in p for p in found)
    assert any("`undefined_name` is defined in no earlier visible cell" in p for p in found)
    found = _problems(("code", "helper = 3", ["remove-cell"]), ("code", "z = helper", []))
    assert len(found) == 1 and "`helper` is defined only in a hidden cell" in found[0]
    # defined later by a visible cell is still a failure for the cell that reads it first
    assert _problems(("code", "print(later)", []), ("code", "later = 1", []))


def test_furniture_imported_in_a_visible_cell_still_fires():
    found = _problems(("code", "from accumcore.lab.book import progress\n"
                               "progress('chapter 9: started')", ["hide-input"]))
    assert len(found) == 1 and "`progress`" in found[0]


def test_a_comment_rewrapped_mid_sentence_fires():
    found = _problems(("code", "# Same real number in float32: the\n# difference is\n"
                               "# a few eps relative to the largest entry.\nx = 1", []))
    assert len(found) == 1 and "'# difference is' / '# a few eps" in found[0]
    assert _problems(("code", "# A full sentence that ends.\n# Another one.\n"
                              "# Short last line\nx = 1", [])) == []


def test_a_syntax_error_fires():
    assert "does not parse" in _problems(("code", "def (:", []))[0]


_CLEAN_PAGE = {
    "prose": "One window of 4 x 16 matches the batch of 64 to 1e-6.",
    "text": "One window of 4 x 16 matches the batch of 64 to 1e-6. See tests/test_x.py and "
            "https://github.com/accumcore/accumcore/blob/main/accumcore/_impl/accum_model.py.",
    "outputs": [{"text": "rel = 1.2e-06\n", "stderr": False, "tags": []}],
}


def test_a_clean_page_passes():
    assert checks.page_problems(_CLEAN_PAGE, ["/build/repo", "/build/repo/.venv"]) == []


def test_an_unrendered_directive_or_role_fires():
    page = dict(_CLEAN_PAGE, text="1. Why?\n```{admonition} Answer\n:class: dropdown\nB.\n```",
                prose="the value {glue:text}`rel:.1e` here")
    found = checks.page_problems(page)
    assert "unrendered directive fence '```{admonition}'" in found
    assert "unrendered role '{glue:text}`'" in found


def test_an_absolute_path_of_the_build_machine_fires():
    line = ("/build/repo/accumcore/_impl/accum_model.py:440: UserWarning: Model 'functional' "
            "has 2 stock keras.layers.BatchNormalization layer(s)")
    page = dict(_CLEAN_PAGE, text=line, outputs=[{"text": line, "stderr": True, "tags": []}])
    found = checks.page_problems(page, ["/build/repo/"])
    assert "absolute path of the building machine '/build/repo' in the page" in found
    assert any("absolute path of a Python file '/build/repo/accumcore/_impl/accum_model.py'" in p
               for p in found)
    assert any(p.startswith("stderr output in a cell not tagged expect-warning") for p in found)
    # a path the check was not told about is still caught when it names a Python file
    assert checks.page_problems(dict(_CLEAN_PAGE, text=line))


def test_a_warning_in_an_output_fires_unless_the_cell_expects_it():
    warning = {"text": "x\n<stdin>:3: RuntimeWarning: overflow in exp\n", "stderr": False,
               "tags": []}
    found = checks.page_problems(dict(_CLEAN_PAGE, outputs=[warning]))
    assert found == ["a Python warning in a cell not tagged expect-warning: "
                     "'RuntimeWarning: overflow in exp'"]
    logged = {"text": "accumcore: cleared the stop\n", "stderr": True, "tags": []}
    assert len(checks.page_problems(dict(_CLEAN_PAGE, outputs=[logged]))) == 1
    expected = [dict(warning, tags=["expect-warning"]), dict(logged, tags=["expect-warning"])]
    assert checks.page_problems(dict(_CLEAN_PAGE, outputs=expected)) == []


# ---------------------------------------------------------------------------- the API page
def _load_api_docstrings():
    path = ROOT / "scripts" / "api_docstrings.py"
    spec = importlib.util.spec_from_file_location("api_docstrings", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _api_page_objects():
    """The objects book/api.md documents (its autodoc directives), each with its members'."""
    import inspect
    import re

    found = []
    for name in re.findall(r"\.\. auto\w+:: ([\w.]+)", (BOOK / "api.md").read_text()):
        module, _, attribute = name.rpartition(".")
        try:
            obj = importlib.import_module(name)  # a module (accumcore.memory)
        except ImportError:
            try:
                obj = getattr(importlib.import_module(module), attribute)
            except ImportError:  # a class's member (accumcore.AccumulationState.prepare)
                owner, _, cls = module.rpartition(".")
                members = vars(getattr(importlib.import_module(owner), cls))
                if attribute not in members:  # an instance attribute: a `#:` comment, no
                    continue  # docstring (autoattribute reads the comment from the source)
                obj = members[attribute]
                obj = obj.fget if isinstance(obj, property) else obj
        found.append((name, obj))
        members = vars(obj).items() if inspect.isclass(obj) or inspect.ismodule(obj) else ()
        for key, value in members:
            if not key.startswith("_"):
                found.append((f"{name}.{key}", value.fget if isinstance(value, property)
                              else value))
    return found


def test_the_api_page_shows_no_internal_module_names():
    """What autodoc puts on the API page, after scripts/api_docstrings.py, names no
    ``accumcore._impl`` module; the docstrings themselves do (at least one, or this test
    checks nothing)."""
    import inspect

    public_text = _load_api_docstrings().public_text
    raw = left = 0
    for name, obj in _api_page_objects():
        doc = inspect.getdoc(obj) or ""
        raw += "accumcore._impl" in doc
        if "_impl" in public_text(doc):
            left += 1
            print(name, [line for line in public_text(doc).splitlines() if "_impl" in line])
    assert raw >= 5 and left == 0


def test_the_api_docstring_filter_rewrites_each_form():
    public_text = _load_api_docstrings().public_text
    assert public_text("the rule (``accumcore._impl.rule.step``). Next") == "the rule. Next"
    assert public_text("does (``accumcore._impl.nonfinite``: what counts)") == \
        "does (what counts)"
    assert public_text("by (``accumcore._impl.fitting.x``; Keras's own)") == "by (Keras's own)"
    assert public_text("given; see ``accumcore._impl.d.a`` and\n ``accumcore._impl.d.b``.") \
        == "given."
    assert public_text("the scalars of ``accumcore._impl.state.SCALARS``:") == \
        "the scalars of ``SCALARS``:"
    assert public_text(":class:`~accumcore._impl.rule.Plan` for") == "``Plan`` for"
    assert public_text("``accumcore.flush`` stays") == "``accumcore.flush`` stays"


def test_appendix_b_signatures_and_type_hints_name_keras_classes_publicly():
    """Keras's classes live in ``keras.src``: a default value (``model_cls=keras.Model``) and a
    type hint would show ``keras.src.models.model.Model``; the extension writes the public name
    in both, as autodoc hands them over (a signature, the recorded hints)."""
    import types

    pytest.importorskip("sphinx")
    from sphinx.util.inspect import signature, stringify_signature
    from sphinx.util.typing import stringify_annotation

    from accumcore.lab import experiments

    module = _load_api_docstrings()
    raw = stringify_signature(signature(experiments.conv_net), show_annotation=False)
    assert "keras.src.models.model.Model" in raw  # what autodoc would show without it
    hint = stringify_annotation(signature(experiments.get_weights).parameters["model"]
                                .annotation, "fully-qualified")  # as autodoc records it
    assert hint == "keras.src.models.model.Model"
    hints = {"accumcore.lab.experiments.get_weights": {"model": hint}}
    app = types.SimpleNamespace(env=types.SimpleNamespace(temp_data={"annotations": hints}))
    sig, ret = module._process_signature(app, "function", "conv_net", experiments.conv_net,
                                         {}, raw, "keras.src.optimizers.optimizer.Optimizer")
    assert "keras.src" not in sig and "model_cls=keras.Model" in sig  # not <class '...'>
    assert ret == "keras.Optimizer"
    assert hints["accumcore.lab.experiments.get_weights"]["model"] == "keras.Model"
    assert module.public_keras_names("keras.src.not.a.Class") == "keras.src.not.a.Class"
    # internal accumcore objects in type hints: their public path where a public module
    # exports them; otherwise unchanged (a bare name would not resolve in the -n build)
    assert module.public_keras_names("accumcore._impl.state.AccumulationState | None") == \
        "accumcore.AccumulationState | None"
    assert module.public_keras_names("accumcore._impl.rule.NotExported") == \
        "accumcore._impl.rule.NotExported"
    # TensorFlow's classes: their tf. name (NonFinitePolicy's should_skip hint), where
    # TensorFlow exports one; other names unchanged
    assert module.public_keras_names(
        "Callable[[Sequence, tensorflow.python.framework.tensor.Tensor], "
        "tensorflow.python.framework.tensor.Tensor] | None") == \
        "Callable[[Sequence, tf.Tensor], tf.Tensor] | None"
    assert module.public_keras_names("tensorflow.python.not_a.Class") == \
        "tensorflow.python.not_a.Class"


def test_appendix_b_problem_signature_names_its_public_fields_only():
    """B.2 writes ``Problem``'s signature by hand, so that the dataclass's private cache fields
    (``_reference``, ``_errors``) stay off the page; it must name every public field, in
    order, with its default."""
    import dataclasses
    import re

    from accumcore.lab.pitfalls import Problem

    page = (BOOK / "appendix_b_pitfalls.md").read_text()
    signature = re.search(r"\.\. autoclass:: Problem\((.*)\)\n", page).group(1)
    public = [f for f in dataclasses.fields(Problem) if not f.name.startswith("_")]
    assert len(public) < len(dataclasses.fields(Problem))  # there are private ones to hide
    written = [part.strip() for part in signature.split(",")]
    assert [part.split("=")[0] for part in written] == [f.name for f in public], written
    for part, field in zip(written, public, strict=True):
        default = "" if field.default is dataclasses.MISSING else f"={field.default!r}"
        assert part == field.name + default, (part, field)
    assert "_" + "reference" not in signature


def test_dataclass_signatures_show_what_their_factories_make_and_docstring_types_are_public():
    """A dataclass field with a ``default_factory`` shows as ``micro_losses=<factory>`` in the
    signature autodoc builds (a reader found it on the API page): the extension writes the
    value the factory makes. The types napoleon copies from the annotations into a docstring
    (``Attributes:``) name TensorFlow's classes by their ``tf.`` name, as the hints do."""
    import dataclasses
    import types

    pytest.importorskip("sphinx")
    from sphinx.util.inspect import signature, stringify_signature

    import accumcore
    from accumcore.memory import MicroBatchPlan

    module = _load_api_docstrings()
    app = types.SimpleNamespace(env=types.SimpleNamespace(temp_data={}))
    # The public dataclasses show no factory default at all (a shared-looking ``=[]`` read as a
    # mutable default to a reader): their lists are not constructor arguments, or required.
    for cls in (accumcore.LoopHistory, MicroBatchPlan):
        raw = stringify_signature(signature(cls), show_annotation=False)
        sig, _ = module._process_signature(app, "class", cls.__name__, cls, {}, raw, None)
        assert "<factory>" not in sig and "[]" not in sig and "{}" not in sig, sig

    @dataclasses.dataclass
    class Toy:  # a dataclass that still has one: the extension writes what the factory makes
        micro_losses: list = dataclasses.field(default_factory=list)

    raw = stringify_signature(signature(Toy), show_annotation=False)
    assert "<factory>" in raw  # what autodoc would show without the extension
    sig, _ = module._process_signature(app, "class", "Toy", Toy, {}, raw, None)
    assert "<factory>" not in sig and "micro_losses=[]" in sig, sig
    assert module.dataclass_defaults(print, "(x=<factory>)") == "(x=<factory>)"  # not ours
    lines = [":vartype should_skip: Callable[[Sequence, "
             "tensorflow.python.framework.tensor.Tensor], tensorflow.python.framework.tensor."
             "Tensor] | None"]
    module._process(app, "class", "NonFinitePolicy", None, {}, lines)
    assert "tensorflow.python" not in lines[0] and "tf.Tensor]" in lines[0], lines[0]
