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

``train_on_batch`` runs ONE micro-batch per call (one ``train_step``): the optimizer steps on
every K-th call, with the mean gradient of the last K batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from accumcore._impl import building, compat, fitting, model_protocol
from accumcore._impl.building import settings_of
from accumcore._impl.fitting import WindowFlushCallback
from accumcore._impl.nonfinite import NONFINITE, NonFinitePolicy

__all__ = ["AccumModel", "WindowFlushCallback"]


@keras.saving.register_keras_serializable(package="accumcore")
class AccumModel(keras.Model):
    """A ``keras.Model`` whose ``fit`` accumulates ``accum_steps`` micro-batches per update.

    Args:
        *args: as for ``keras.Model`` (``inputs, outputs`` for the functional form).
        **kwargs: as for ``keras.Model`` (e.g. ``name``).
        accum_steps: K, micro-batches per optimizer update (the ``batch_size`` given to ``fit``
            is the micro-batch size b; the effective batch is K * b). Required: without it,
            ``fit`` / ``train_on_batch`` raise ``ValueError`` (pass ``accum_steps=1`` for no
            accumulation). Construction itself does not raise, because Keras builds
            AccumModels without it and passes the settings afterwards
            (``keras.models.clone_model`` through the compile config, ``load_model`` through
            ``from_config``); ``set_accumulation(accum_steps=K)`` sets it too.
        end_of_epoch: ``"apply"`` (default), ``"carry"`` or ``"drop"`` for a partial window.
        nonfinite: ``"raise"`` (default), ``"skip_micro_batch"``, ``"skip_window"`` or a
            :class:`~accumcore.NonFinitePolicy` (a custom one cannot be serialised).
        normalizer: ``"auto"`` (default: each micro-batch weighted by what the compiled loss
            divided it by: its samples, its sample-weight sum, or its valid elements under a
            Keras mask or ``ignore_class``), ``"samples"`` / ``"sample_weight"`` (checked
            against that denominator), or a callable ``(x, y, sample_weight) -> item count``,
            used as given.

    Any other keyword raises ``TypeError`` naming it and the valid ones (a functional
    ``keras.Model`` silently ignores unknown keywords, so ``accumulation_steps=4`` would train
    with K = 1 unnoticed).

    ``compile`` wraps each loss in a ``CountedLoss`` (same value;
    it reports what the loss divided by); ``model.loss`` stays the loss given to ``compile``.
    The loss logged by ``fit`` is the true mean over the epoch's samples (or tokens: the
    loss's own denominator). The accumulation
    state (a half-full window included) is saved with ``model.save`` / ``save_weights`` and
    tracked by ``tf.train.Checkpoint(model=model)``; in a weights file it sits under its own
    path, so ``load_weights`` into a plain ``keras.Model`` of the same layers works (serving).

    Keras workflows (the book's Reference page "Keras workflows"): an unbuilt subclass is
    built on the first batch, as a plain ``keras.Model`` subclass is; a model without
    trainable variables (``model.trainable = False``) trains nothing, with a warning, as
    ``keras.Model.fit`` does;
    ``keras.models.clone_model`` of a compiled AccumModel keeps its settings; stock
    ``BatchNormalization`` layers draw one warning per model (use ``convert_batchnorm``);
    ``train_on_batch`` runs one micro-batch per call.
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        # The functional form is a subclass of its own (model_protocol.model_class).
        return super().__new__(model_protocol.model_class(cls, args, kwargs), *args, **kwargs)

    def __init__(
        self,
        *args: Any,
        accum_steps: int | None = None,
        end_of_epoch: str = "apply",
        nonfinite: str | NonFinitePolicy = "raise",
        normalizer: str | Callable = "auto",
        **kwargs: Any,
    ) -> None:
        functional = compat.functional_model_class()
        model_protocol.check_keywords(kwargs, isinstance(self, functional))
        if isinstance(self, functional):
            # What keras.Model.__init__ does for functional arguments, minus rewriting the class
            # hierarchy: the trainer's own state, then the functional graph.
            super(keras.Model, self).__init__()
            functional.__init__(self, *args, **kwargs)
        else:
            super().__init__(*args, **kwargs)
        # The state holds K and the non-finite policy, FitSettings the rest.
        fitting.attach(self, dict(accum_steps=accum_steps, end_of_epoch=end_of_epoch,
                                  nonfinite=nonfinite, normalizer=normalizer))

    # ------------------------------------------------------------------ config
    @property
    def accum_steps(self) -> int | None:
        """K, micro-batches per optimizer update (held by :attr:`accumulation`); ``None``
        until given."""
        return self.accumulation.accum_steps if settings_of(self).accum_steps_given else None

    @property
    def nonfinite(self) -> str | NonFinitePolicy:
        """The non-finite policy (held by :attr:`accumulation`), as its name, or the custom
        :class:`~accumcore.NonFinitePolicy` given."""
        policy = self.accumulation.nonfinite_policy
        return policy.name if NONFINITE.get(policy.name) == policy else policy

    @property
    def end_of_epoch(self) -> str:
        """What ``fit`` does with a partial window at the end of an epoch."""
        return settings_of(self).end_of_epoch

    @property
    def normalizer(self) -> str | Callable:
        """How each micro-batch is weighed (see the class docstring)."""
        return settings_of(self).normalizer

    def get_config(self) -> dict:
        return {**super().get_config(), **model_protocol.config_settings(self)}

    @classmethod
    def from_config(cls, config: dict, custom_objects: dict | None = None) -> AccumModel:
        config, settings = model_protocol.split_config(config)
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
        return model_protocol.with_settings(fitting.plain_compile_config(config), self)

    def compile_from_config(self, config: dict) -> None:
        """Keras's ``compile_from_config``, then the settings of :meth:`get_compile_config`."""
        model_protocol.compile_from_config(self, config)

    def set_accumulation(
        self,
        accum_steps: int | None = None,
        end_of_epoch: str | None = None,
        nonfinite: str | NonFinitePolicy | None = None,
        normalizer: str | Callable | None = None,
    ) -> None:
        """Change accumulation settings between ``fit`` calls (the window must be empty)."""
        fitting.set_accumulation(self, dict(accum_steps=accum_steps, end_of_epoch=end_of_epoch,
                                            nonfinite=nonfinite, normalizer=normalizer))

    # ------------------------------------------------------------------ training
    def build_accumulation(self) -> None:
        """Create the accumulators (called by ``fit`` once model and optimizer are built).

        Before a new ``train_function`` is traced (the first ``fit``, or the next one after
        ``compile``), the accumulators follow the trainable set (fine-tuning: freeze, ``fit``,
        unfreeze, ``compile``, ``fit``) and the normaliser follows the compiled loss's
        reduction. Without ``compile`` Keras keeps training the set it traced, and so does
        accumcore (``accumcore._impl.building.prepare_model``).
        """
        building.build_accumulation(self)

    def make_train_function(self, force: bool = False):
        return fitting.make_train_function(self, super().make_train_function, force)

    def fit(self, *args: Any, **kwargs: Any):
        """``keras.Model.fit``, with :class:`WindowFlushCallback` added first."""
        return fitting.fit(self, super().fit, *args, **kwargs)

    def train_step(self, data):
        """One micro-batch (``accumcore._impl.fitting.train_step``)."""
        return fitting.train_step(self, super().train_step, data)

    def train_on_batch(self, *args: Any, **kwargs: Any):
        """``keras.Model.train_on_batch``, which here runs ONE micro-batch (one ``train_step``).

        The optimizer steps on every ``accum_steps``-th call, with the mean gradient of the
        last K batches: K calls with b samples each equal one ``train_on_batch`` of the K * b
        samples on a plain model. The calls in between only accumulate; the returned loss is
        this micro-batch's. A partial window is applied by ``model.flush()``. A
        non-finite gradient raises ``NonFiniteGradientError`` here, as in ``fit``.
        """
        return fitting.train_on_batch(self, super().train_on_batch, *args, **kwargs)

    # ------------------------------------------------------------------ windows
    def flush(self) -> bool:
        """Apply the pending partial window now, with its true weight (no-op when empty).
        Returns whether an optimizer update was applied."""
        return fitting.flush(self)

    def end_epoch(self, epoch: int | None = None) -> str | None:
        """Apply the ``end_of_epoch`` policy to a pending partial window; returns what was
        done (``accumcore._impl.entry.end_epoch``)."""
        return fitting.end_epoch(self, epoch)
