"""``model.fit`` with exact gradient accumulation: a ``keras.Model`` subclass.

``AccumModel`` overrides ``train_step`` so that ``fit`` keeps callbacks, metrics, the progress
bar and ``History``; each ``train_step`` is one micro-batch, and one optimizer update is
applied every ``accum_steps`` micro-batches. Use it functionally or by subclassing::

    inputs = keras.Input((784,))
    outputs = keras.layers.Dense(10, activation="softmax")(inputs)
    model = AccumModel(inputs, outputs, accum_steps=4)
    model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=16, epochs=3)   # updates of 64 samples

``train_on_batch`` runs one ``train_step`` per call: with ``accum_steps`` one micro-batch (the
optimizer steps on every K-th call, each micro-batch weighted by what Keras's loss divided it by,
the window divided once by the sum); with ``micro_batch_size`` the whole batch, split, one update.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import keras

from accumcore._impl import compat, fitting
from accumcore._impl.fitting import WindowFlushCallback
from accumcore._impl.nonfinite import NonFinitePolicy
from accumcore._impl.settings import Settings

__all__ = ["AccumModel", "WindowFlushCallback"]

#: The accumulation settings, as ``get_config`` and ``set_accumulation`` name them (every
#: field of ``Settings``).
CONFIG_KEYS = tuple(field.name for field in dataclasses.fields(Settings))
#: Key under which ``get_compile_config()`` carries the accumulation settings.
COMPILE_KEY = "accumcore_accumulation"

# The functional form of each AccumModel class (cls + Keras's Functional), made once.
_FUNCTIONAL_VARIANTS: dict[type, type] = {}


def is_functional_call(args: tuple, kwargs: dict) -> bool:
    """Same rule as Keras: ``(inputs, outputs)`` positionally or by keyword."""
    return len(args) == 2 or (len(args) == 1 and "outputs" in kwargs) or (
        "inputs" in kwargs and "outputs" in kwargs
    )


def model_class(cls: type, args: tuple, kwargs: dict) -> type:
    """The class ``AccumModel.__new__`` instantiates for these arguments.

    Called functionally, Keras would rewrite ``cls``'s bases to include Functional,
    permanently, which breaks later *subclassing* of ``cls`` in the same process. The
    functional form is a separate subclass (``cls`` + Functional) instead, registered for
    saving under ``cls``'s registered name.
    """
    functional = compat.functional_model_class()
    if not is_functional_call(args, kwargs) or issubclass(cls, functional):
        return cls
    if cls not in _FUNCTIONAL_VARIANTS:
        variant = type(cls.__name__, (cls, functional),
                       {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        registered = keras.saving.get_registered_name(cls)
        if ">" in registered:  # saved and loaded under the class's registered name
            package, name = registered.split(">", 1)
            keras.saving.register_keras_serializable(package, name)(variant)
        _FUNCTIONAL_VARIANTS[cls] = variant
    return _FUNCTIONAL_VARIANTS[cls]


def keras_keywords(functional: bool) -> tuple[str, ...]:
    """Keyword arguments ``keras.Model.__init__`` uses (read in Keras 3.10 and 3.15).

    Functional form: ``Functional.__init__(inputs, outputs, name=None, **kwargs)`` pops
    ``trainable`` and silently ignores every other keyword. Subclassed form: the keywords of
    ``keras.layers.Layer.__init__`` (read from its signature) plus ``input_shape`` /
    ``input_dim``, which it also pops (it rejects anything else itself, with a ValueError).
    """
    if functional:
        return ("inputs", "outputs", "name", "trainable")
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [p.name for p in inspect.signature(keras.layers.Layer.__init__).parameters.values()
             if p.kind in kinds and p.name != "self"]
    return tuple(dict.fromkeys([*names, "input_shape", "input_dim"]))


def check_keywords(kwargs: dict, functional: bool) -> None:
    """Raise ``TypeError`` for a keyword ``keras.Model`` would not use (a functional model
    silently ignores it, so ``accumulation_steps=4`` would train with K = 1 unnoticed)."""
    known = keras_keywords(functional)
    unknown = [k for k in kwargs if k not in known]
    if unknown:
        raise TypeError(
            f"AccumModel got unexpected keyword argument(s) {', '.join(unknown)}; valid "
            f"keywords: {', '.join((*CONFIG_KEYS, *known))}. (K, the number of "
            "micro-batches per optimizer update, is `accum_steps`.)"
        )


def settings_of(model) -> dict:
    """The model's accumulation settings, by :data:`CONFIG_KEYS` (the non-finite policy by
    name for a built-in one)."""
    settings = model.accumulation.settings
    given = {k: getattr(settings, k) for k in CONFIG_KEYS}
    return {**given, "nonfinite": settings.nonfinite_name}


def config_settings(model) -> dict:
    """The settings ``get_config`` adds; raises ``ValueError`` for one that cannot be
    serialised (a callable normaliser, a custom non-finite policy)."""
    if callable(model.normalizer):
        raise ValueError(
            "An AccumModel with a callable `normalizer` cannot be serialised; pass "
            "normalizer='auto', 'samples' or 'sample_weight', or re-create the model in code."
        )
    if not isinstance(model.nonfinite, str):
        raise ValueError(
            f"An AccumModel with a custom NonFinitePolicy ({model.nonfinite.name!r}) cannot "
            "be serialised; pass nonfinite='raise', 'skip_micro_batch' or 'skip_window', "
            "or re-create the model in code."
        )
    return settings_of(model)


def split_config(config: dict) -> tuple[dict, dict]:
    """``(Keras's config, the accumulation settings)`` of a ``get_config`` result."""
    config = dict(config)
    return config, {k: config.pop(k) for k in CONFIG_KEYS if k in config}


def with_settings(config: dict | None, model) -> dict | None:
    """Keras's compile config with the model's settings under :data:`COMPILE_KEY`."""
    return None if config is None else {**config, COMPILE_KEY: settings_of(model)}


def compile_from_config(model, config: dict) -> None:
    """``keras.Model.compile_from_config``, then the settings of :func:`with_settings`."""
    config = dict(config)
    given = config.pop(COMPILE_KEY, None)
    # What keras.Model.compile_from_config does (Keras 3.10-3.15), which skips a
    # `compile` that a subclass overrides, as AccumModel does (to count the losses).
    config = keras.saving.deserialize_keras_object(config)
    model.compile(**config)
    if getattr(model, "optimizer", None) is not None and model.built:
        model.optimizer.build(model.trainable_variables)
    if given:
        model.set_accumulation(**given)


@keras.saving.register_keras_serializable(package="accumcore")
class AccumModel(keras.Model):
    """A ``keras.Model`` whose ``fit`` accumulates gradients: each batch of B split into
    micro-batches of ``micro_batch_size``, or ``accum_steps`` batches per update.

    Args:
        *args: as for ``keras.Model`` (``inputs, outputs`` for the functional form).
        micro_batch_size (int | str | None): b: ``fit(batch_size=B)`` then makes one update
            per batch of B, split into micro-batches of at most b samples inside the train
            step; ``"auto"``: the largest b that fits (see :func:`~accumcore.accumulate`).
            Not with ``accum_steps``.
        accum_steps (int | None): K, micro-batches per update (``fit``'s ``batch_size`` is
            b; the effective batch K * b). Without this or ``micro_batch_size``, ``fit`` and
            ``train_on_batch`` raise ``ValueError`` (``accum_steps=1``: no accumulation);
            construction does not, as ``clone_model``, ``load_model`` and
            ``set_accumulation`` set them afterwards.
        end_of_epoch (str): ``"apply"`` (default), ``"carry"`` or ``"drop"`` for a partial window.
        nonfinite (str | ~accumcore.NonFinitePolicy): ``"raise"`` (default),
            ``"skip_micro_batch"``, ``"skip_window"`` or a policy object (a custom one cannot
            be serialised).
        normalizer (str | ~collections.abc.Callable): ``"auto"`` (default: what the compiled
            loss divided each micro-batch by: samples, sample-weight sum or valid elements
            under a Keras mask or ``ignore_class``), ``"samples"`` / ``"sample_weight"``
            (checked against it), or a callable ``(x, y, sample_weight) -> item count``, used
            as given.
        **kwargs: ``keras.Model``'s own keywords (e.g. ``name``); any other raises
            ``TypeError`` naming it and the valid ones.

    The loss logged by ``fit`` is the true mean over the epoch's samples (or tokens). The
    accumulation state (a half-full window included) is saved with ``model.save`` /
    ``save_weights`` and tracked by ``tf.train.Checkpoint(model=model)``; ``load_weights``
    into a plain ``keras.Model`` of the same layers works (serving).

    Unbuilt subclasses, frozen models, ``clone_model``, stock ``BatchNormalization`` and
    ``train_on_batch`` (with ``accum_steps`` one micro-batch per call; with
    ``micro_batch_size`` one split update per call) behave as the book's Reference page "Keras
    workflows" lists.
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        # The functional form is a subclass of its own (model_class).
        return super().__new__(model_class(cls, args, kwargs), *args, **kwargs)

    def __init__(
        self,
        *args: Any,
        accum_steps: int | None = None,
        end_of_epoch: str = "apply",
        nonfinite: str | NonFinitePolicy = "raise",
        normalizer: str | Callable = "auto",
        micro_batch_size: int | str | None = None,
        **kwargs: Any,
    ) -> None:
        functional = compat.functional_model_class()
        check_keywords(kwargs, isinstance(self, functional))
        if isinstance(self, functional):
            # What keras.Model.__init__ does for functional arguments, minus rewriting the class
            # hierarchy: the trainer's own state, then the functional graph.
            super(keras.Model, self).__init__()
            functional.__init__(self, *args, **kwargs)
        else:
            super().__init__(*args, **kwargs)
        # The state holds every setting (accumcore._impl.settings.Settings).
        fitting.attach(self, dict(accum_steps=accum_steps, end_of_epoch=end_of_epoch,
                                  nonfinite=nonfinite, normalizer=normalizer,
                                  micro_batch_size=micro_batch_size))

    # ------------------------------------------------------------------ config
    @property
    def accum_steps(self) -> int | None:
        """K, micro-batches per optimizer update (held by :attr:`accumulation`); ``None``
        until given."""
        return self.accumulation.accum_steps

    @property
    def micro_batch_size(self) -> int | str | None:
        """b, samples per micro-batch inside each train step (held by :attr:`accumulation`:
        for ``"auto"`` the size found); ``None``: ``accum_steps`` counts micro-batches."""
        return self.accumulation.micro_batch_size

    @property
    def nonfinite(self) -> str | NonFinitePolicy:
        """The non-finite policy (held by :attr:`accumulation`), as its name, or the custom
        :class:`~accumcore.NonFinitePolicy` given."""
        return self.accumulation.settings.nonfinite_name

    @property
    def end_of_epoch(self) -> str:
        """What ``fit`` does with a partial window at the end of an epoch."""
        return self.accumulation.settings.end_of_epoch

    @property
    def normalizer(self) -> str | Callable:
        """How each micro-batch is weighed (see the class docstring)."""
        return self.accumulation.settings.normalizer

    def get_config(self) -> dict:
        return {**super().get_config(), **config_settings(self)}

    @classmethod
    def from_config(cls, config: dict, custom_objects: dict | None = None) -> AccumModel:
        config, settings = split_config(config)
        model = super().from_config(config, custom_objects=custom_objects)
        if settings:
            model.set_accumulation(**settings)
        return model

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``keras.Model.compile``, with every loss wrapped so that it reports what it divides
        by (``accumcore._impl.fitting.compile_counted``; the values are Keras's own).

        ``model.loss`` is the loss as given, and so is the compile config (``model.save``,
        ``clone_model``).
        """
        fitting.compile_counted(self, super().compile, *args, **kwargs)

    def get_compile_config(self) -> dict | None:
        """Keras's compile config, plus the accumulation settings under one extra key.

        ``keras.models.clone_model`` builds the clone of a functional model with
        ``model.__class__(inputs, outputs, name=...)`` (it cannot pass ``accum_steps``), then
        calls ``clone.compile_from_config(model.get_compile_config())`` if ``model`` is
        compiled: carrying the settings here is how such a clone keeps K and the policies.
        """
        config = super().get_compile_config()
        return with_settings(fitting.plain_compile_config(config), self)

    def compile_from_config(self, config: dict) -> None:
        """Keras's ``compile_from_config``, then the settings of :meth:`get_compile_config`."""
        compile_from_config(self, config)

    def set_accumulation(
        self,
        accum_steps: int | None = None,
        end_of_epoch: str | None = None,
        nonfinite: str | NonFinitePolicy | None = None,
        normalizer: str | Callable | None = None,
        micro_batch_size: int | str | None = None,
    ) -> None:
        """Change accumulation settings between ``fit`` calls (the window must be empty);
        ``accum_steps`` and ``micro_batch_size`` replace each other."""
        fitting.set_accumulation(self, dict(accum_steps=accum_steps, end_of_epoch=end_of_epoch,
                                            nonfinite=nonfinite, normalizer=normalizer,
                                            micro_batch_size=micro_batch_size))

    # ------------------------------------------------------------------ training
    def build_accumulation(self) -> None:
        """Create the accumulators (called by ``fit`` once model and optimizer are built).

        Before a new ``train_function`` is traced (the first ``fit``, or the next one after
        ``compile``), the accumulators follow the trainable set (fine-tuning: freeze, ``fit``,
        unfreeze, ``compile``, ``fit``) and the normaliser follows the compiled loss's
        reduction. Without ``compile`` Keras keeps training the set it traced, and so does
        accumcore (``accumcore._impl.fitting.prepare_model``).
        """
        fitting.prepare_model(self)

    def make_train_function(self, force: bool = False):
        return fitting.make_train_function(self, super().make_train_function, force)

    def fit(self, *args: Any, **kwargs: Any):
        """``keras.Model.fit``, with :class:`WindowFlushCallback` added first.

        Args:
            *args: ``keras.Model.fit``'s positional arguments (``x``, ``y``, ``batch_size``,
                ``epochs``, ...), passed through unchanged. ``batch_size`` is the recipe's B
                with ``micro_batch_size`` (split inside each step), the micro-batch b with
                ``accum_steps``.
            **kwargs: ``keras.Model.fit``'s keyword arguments (``validation_data``,
                ``callbacks``, ``sample_weight``, ``class_weight``, ...), passed through
                unchanged; :class:`WindowFlushCallback` is put first in ``callbacks`` unless
                one is there.

        Returns:
            Keras's ``History``.
        """
        return fitting.fit(self, super().fit, *args, **kwargs)

    def train_step(self, data):
        """One step of ``fit``: with ``micro_batch_size`` the batch given is the recipe's B,
        split inside into micro-batches of at most b samples and applied as one update; with
        ``accum_steps`` the batch given is one micro-batch, added to the window, which is
        applied on every K-th step."""
        return fitting.train_step(self, super().train_step, data)

    def train_on_batch(self, *args: Any, **kwargs: Any):
        """``keras.Model.train_on_batch``: one ``train_step``.

        With ``micro_batch_size`` the batch given is the recipe's B: it is split inside the
        call into micro-batches of at most b samples and one update is made, as a plain
        model's ``train_on_batch`` of the whole batch would make.

        With ``accum_steps`` each call runs ONE micro-batch and the optimizer steps on every
        ``accum_steps``-th call. Each micro-batch's gradient is weighted by what Keras's loss
        divided it by (its samples, its sample-weight sum, or its valid elements under a
        mask), and the window is divided once by the sum of those weights, so K calls equal
        one ``train_on_batch`` of their samples together on a plain model. The calls in
        between only accumulate; the returned loss is this micro-batch's. A partial window is
        applied by ``model.flush()``.

        A non-finite gradient raises ``NonFiniteGradientError`` here, as in ``fit``.

        Args:
            *args: ``keras.Model.train_on_batch``'s positional arguments (``x``, ``y``,
                ``sample_weight``, ``class_weight``), passed through unchanged.
            **kwargs: its keyword arguments (the same names, and ``return_dict``), passed
                through unchanged.

        Returns:
            What ``keras.Model.train_on_batch`` returns: the loss and metric values (a dict
            with ``return_dict=True``).
        """
        return fitting.train_on_batch(self, super().train_on_batch, *args, **kwargs)

    # ------------------------------------------------------------------ windows
    def flush(self) -> bool:
        """Apply the pending partial window now, with its true weight (no-op when empty).
        Returns whether an optimizer update was applied."""
        return fitting.flush(self)

    def end_epoch(self, epoch: int | None = None) -> str | None:
        """Apply the ``end_of_epoch`` policy to a pending partial window; returns what was
        done (``AccumulationState.end_epoch``)."""
        return fitting.end_epoch(self, epoch)
