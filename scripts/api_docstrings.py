"""Sphinx extension for the API page (``book/api.md``): internal module names stay off it.

The library's docstrings name the internal modules where a reader of the source goes next
(``accumcore._impl.rule.step``); a reader of the API page cannot import them and should not
need to. When autodoc reads a docstring, this extension removes a parenthesis that holds only
such a name, the name and its colon where a parenthesis goes on to explain
(``(``accumcore._impl.nonfinite``: what counts)`` -> ``(what counts)``), and writes any other
such name by its last part (``accumcore._impl.state.SCALARS`` -> ``SCALARS``). The docstrings
themselves are unchanged. Registered in ``_config.yml`` (``sphinx.local_extensions``);
``tests/test_book_sources.py`` checks every docstring of the page's objects comes out clean.

Keras's classes live in ``keras.src`` modules, so a signature's default value
(``model_cls=<class 'keras.src.models.model.Model'>``) and a type hint name them there; a
reader writes ``keras.Model``. Signatures and the recorded type hints are rewritten with the
class's public name (:func:`public_keras_names`), found in Keras's public namespaces.
TensorFlow's classes are defined in ``tensorflow.python`` modules
(``tensorflow.python.framework.tensor.Tensor``); a reader writes ``tf.Tensor``, and so does the
page.
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


#: Keras's public namespaces, in the order their names are preferred (``keras.Model`` before
#: ``keras.models.Model``).
KERAS_NAMESPACES = ("keras", "keras.layers", "keras.models", "keras.optimizers",
                    "keras.optimizers.schedules", "keras.losses", "keras.metrics",
                    "keras.callbacks", "keras.utils", "keras.initializers", "keras.regularizers",
                    "keras.mixed_precision", "keras.saving")
_KERAS_SRC = re.compile(r"keras\.src(?:\.\w+)+")
_public: dict[str, str] = {}


def _public_names() -> dict[str, str]:
    """``keras.src`` path of each class in :data:`KERAS_NAMESPACES` -> its public name."""
    if not _public:
        import importlib

        for namespace in KERAS_NAMESPACES:
            module = importlib.import_module(namespace)
            for attr in dir(module):
                obj = getattr(module, attr)
                if isinstance(obj, type) and obj.__module__.startswith("keras.src"):
                    _public.setdefault(f"{obj.__module__}.{obj.__qualname__}",
                                       f"{namespace}.{attr}")
    return _public


_CLASS_REPR = re.compile(r"<class '([\w.]+)'>")
_TF_PYTHON = re.compile(r"tensorflow\.python(?:\.\w+)*\.(\w+)")


def _public_tensorflow(match: re.Match) -> str:
    """``tf.Name`` for a ``tensorflow.python`` class that TensorFlow exports at its top level
    under that name (``tensorflow.python.framework.tensor.Tensor`` -> ``tf.Tensor``); other
    names unchanged."""
    import tensorflow as tf

    name = match.group(1)
    return f"tf.{name}" if isinstance(getattr(tf, name, None), type) else match.group(0)
_INTERNAL_OBJECT = re.compile(r"accumcore\._impl(?:\.\w+)*\.(\w+)")


def _public_accumcore(match: re.Match) -> str:
    """``accumcore.Name`` for an internal object that ``accumcore`` exports (``__all__``: the
    API page documents each, so the hint still resolves); other names unchanged."""
    import accumcore

    name = match.group(1)
    return f"accumcore.{name}" if name in accumcore.__all__ else match.group(0)


def public_keras_names(text: str) -> str:
    """``text`` (a signature or a type hint) with every ``keras.src`` class path that Keras
    exports written by its public name (``keras.src.models.model.Model`` -> ``keras.Model``),
    and every internal accumcore object that ``accumcore`` exports by its public name
    (``accumcore._impl.state.AccumulationState`` -> ``accumcore.AccumulationState``), and
    every ``tensorflow.python`` class by its ``tf.`` name (``tf.Tensor``); other text
    unchanged."""
    names = _public_names()
    text = _KERAS_SRC.sub(lambda match: names.get(match.group(0), match.group(0)), text)
    text = _TF_PYTHON.sub(_public_tensorflow, text)
    return _INTERNAL_OBJECT.sub(_public_accumcore, text)


def _process(app, what, name, obj, options, lines: list[str]) -> None:
    """The docstring without internal names; the types napoleon wrote into it from the
    annotations (``Attributes:``) by their public names too."""
    lines[:] = public_keras_names(public_text("\n".join(lines))).split("\n")


_FACTORY = re.compile(r"\b(\w+)=<factory>")


def dataclass_defaults(obj, signature: str) -> str:
    """``signature`` of a dataclass ``obj`` with each ``field=<factory>`` written as the
    value the factory makes (``micro_losses=[]``); other signatures unchanged."""
    import dataclasses

    if "<factory>" not in signature or not dataclasses.is_dataclass(obj):
        return signature
    made = {f.name: repr(f.default_factory()) for f in dataclasses.fields(obj)
            if f.default_factory is not dataclasses.MISSING}
    return _FACTORY.sub(lambda m: f"{m.group(1)}={made.get(m.group(1), '...')}", signature)


def _process_signature(app, what, name, obj, options, signature, return_annotation):
    """Public Keras names in the signature and in the type hints autodoc recorded for the
    description (``autodoc_typehints: description``; recorded just before, at priority 500)."""
    for hints in app.env.temp_data.get("annotations", {}).values():
        for key, hint in hints.items():
            hints[key] = public_keras_names(hint)
    if signature is not None:  # a class as a default value: its name, not its repr
        signature = dataclass_defaults(obj, _CLASS_REPR.sub(r"\1", public_keras_names(signature)))
    return (signature,
            None if return_annotation is None else public_keras_names(return_annotation))


def setup(app):
    app.connect("autodoc-process-docstring", _process)
    app.connect("autodoc-process-signature", _process_signature, priority=600)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
