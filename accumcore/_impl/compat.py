"""Every difference between the Keras 3 versions accumcore supports, in one place.

accumcore supports TensorFlow >= 2.20 with Keras >= 3.13 (CI runs the minimum, Colab's TF 2.20.0 +
Keras 3.13.2, and TF 2.21.0 + Keras 3.15.1; the book's "Supported
versions" page, ``book/reference/versions.md``). Where the Keras versions differ, the library
calls the helpers below instead of Keras directly. Each helper
names the versions it bridges and detects the feature (``inspect.signature``, ``getattr``)
rather than testing version numbers, so that a Keras release in between, or a user's override,
takes the right branch.

Nothing here runs at import: no model, layer or variable is built when accumcore is imported.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import keras


@functools.cache
def functional_model_class() -> type:
    """Keras's functional-model class: the type of ``keras.Model(inputs, outputs)``.

    Keras exports no name for it (it lives in the private ``keras.src``); ``keras.Model.__new__``
    is what picks it for the ``(inputs, outputs)`` call form, in every Keras 3. So ask
    ``keras.Model.__new__`` alone (not ``__init__``), once per process, when the first
    ``AccumModel`` is constructed (never at import), with a one-layer graph that has no weights
    and explicit names (it takes no automatic layer or model name from the user's models):

    - Keras >= 3.4: ``__new__`` only allocates the object; nothing is built.
    - Keras 3.0-3.3: ``__new__`` constructs the whole functional model (Keras then runs
      ``__init__`` a second time); here the throwaway weightless identity model.

    Version difference: accumcore <= 0.1.0 built ``keras.Model(x, x)``, an identity model whose
    output is its input, at import. Keras 3.3 and 3.14+ accept it; Keras 3.10-3.13 reject it
    ("`inputs` not connected to `outputs`"), so ``import accumcore`` failed on Keras 3.10-3.13.
    The probe's output is a new tensor (an ``Identity`` layer's), which every version accepts.

    Returns:
        The class (``keras.src.models.functional.Functional`` in Keras 3.3-3.15).
    """
    x = keras.Input((1,), name="accumcore_probe_input")
    y = keras.layers.Identity(name="accumcore_probe_identity")(x)
    cls = type(keras.Model.__new__(keras.Model, inputs=x, outputs=y, name="accumcore_probe"))
    if cls is keras.Model or not issubclass(cls, keras.Model):
        raise ImportError(  # pragma: no cover - a future Keras that changes Model.__new__
            f"accumcore cannot find Keras {keras.__version__}'s functional-model class: "
            f"keras.Model.__new__ returned {cls!r} for the (inputs, outputs) form. Use a Keras "
            "version the book's 'Supported versions' page lists (book/reference/versions.md)."
        )
    return cls


def compute_loss_accepts_training(model: keras.Model) -> bool:
    """Whether ``model.compute_loss`` takes a ``training`` argument (Keras's own rule).

    Version difference: ``keras.Model.compute_loss`` gained ``training=True`` in Keras 3.4
    (3.4.1 has it); Keras 3.0-3.3 have ``(x, y, y_pred, sample_weight, allow_empty)``. Keras
    3.4+ itself still accepts user overrides written without it: its ``train_step`` and
    ``test_step`` pass ``training`` only when ``"training" in
    inspect.signature(model.compute_loss).parameters`` (``Trainer._compute_loss`` in Keras
    3.10-3.15). accumcore applies the same test to the model's bound method, so an override
    without ``training`` works in ``AccumModel.fit`` exactly as in ``keras.Model.fit``.
    """
    try:
        return "training" in inspect.signature(model.compute_loss).parameters
    except (TypeError, ValueError):  # pragma: no cover - a C-level or odd callable
        return False


def compute_loss(
    model: keras.Model, *, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool
) -> Any:
    """``model.compute_loss(x=, y=, y_pred=, sample_weight=, training=)`` on any Keras 3.

    Args:
        model: the compiled model.
        x, y, y_pred, sample_weight: as for ``keras.Model.compute_loss`` (y_pred: the model's
            output for x; sample_weight: None or shape (b,) / broadcastable to the loss).
        training: passed on where ``compute_loss`` has a ``training`` parameter (Keras's own
            method since 3.4, and overrides that declare it); omitted otherwise, as Keras does.

    Returns:
        The scalar loss tensor, as ``compute_loss`` returns it (the compiled loss's mean over
        the batch plus the model's regularisation losses).
    """
    kwargs = {"x": x, "y": y, "y_pred": y_pred, "sample_weight": sample_weight}
    if compute_loss_accepts_training(model):
        kwargs["training"] = training
    return model.compute_loss(**kwargs)


def compile_arguments(model: keras.Model) -> dict | None:
    """The arguments ``model`` was last compiled with, as given: the live objects (losses,
    metrics, optimizer), not their configs; ``None`` where not found.

    Keras exports no accessor for them. ``Trainer.compile`` (Keras 3.0-3.15) keeps them in
    ``model._compile_config``, a ``SerializableDict`` whose ``config`` holds the arguments as
    passed (``optimizer`` as resolved, ``jit_compile`` as resolved) and which
    ``get_compile_config`` serialises; compiling again from that serialised form would fail
    for what plain ``fit`` never serialises (an unregistered ``Loss`` subclass, a schedule
    without ``get_config``, a plain function as a metric). Read by attribute, so a release
    without it takes the caller's fallback.
    """
    config = getattr(getattr(model, "_compile_config", None), "config", None)
    return dict(config) if isinstance(config, dict) else None


def batchnorm_renorm(layer: keras.layers.BatchNormalization) -> bool:
    """Whether a BatchNormalization layer uses batch renormalisation (``renorm=True``).

    Version difference: ``keras.layers.BatchNormalization`` gained ``renorm`` (and its
    ``renorm`` attribute) in Keras 3.14; in Keras 3.0-3.13 (Colab's 3.13.2, the minimum,
    among them) the layer has no such argument, so it never renormalises (Keras itself rejects
    ``renorm=`` there).
    """
    return bool(getattr(layer, "renorm", False))


def keras_mask(tensor: Any) -> Any:
    """The Keras mask a tensor carries (``None`` if none): what ``keras.losses.Loss`` reads.

    Layers that produce a mask (``Embedding(mask_zero=True)``, ``Masking``, any layer's
    ``compute_mask``) attach it to their output as the attribute ``_keras_mask``, the name the
    Keras masking guide documents ("Understanding masking & padding":
    ``masked_output._keras_mask``); a loss's ``call`` attaches one to its per-element values
    the same way (``SparseCategoricalCrossentropy(ignore_class=...)``).

    Version difference: Keras 3.10 reads and writes the attribute directly; Keras 3.15 goes
    through ``keras.src.backend.get_keras_mask`` (not exported), which reads the same attribute
    and falls back to a table for tensor types that cannot carry attributes (TensorFlow's can).
    """
    return getattr(tensor, "_keras_mask", None)
