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
import tensorflow as tf

from accumcore import building, compat, entry, model_protocol
from accumcore.config import check_settings
from accumcore.core import batch_size_of, replica_loss_factor, summed_loss_gradients
from accumcore.denominators import counted, uncounted
from accumcore.loss_scaling import is_loss_scale_optimizer
from accumcore.nonfinite import NONFINITE, NonFinitePolicy
from accumcore.state import AccumulationState


class _ScalarMean(keras.metrics.Mean):
    """``keras.metrics.Mean`` of one scalar value per call, weighted by one scalar.

    ``total += value * weight``, ``count += weight`` (the variables ``Mean`` documents): the
    logged loss, whose weight is the micro-batch's. ``Mean.update_state`` broadcasts and
    reduces the weight like a per-sample array, a dozen graph operations per micro-step
    here.
    """

    def update_state(self, values, sample_weight=None) -> None:
        value = tf.cast(values, self.dtype)
        weight = tf.constant(1.0, self.dtype) if sample_weight is None else tf.cast(
            sample_weight, self.dtype)
        self.add_weighted(value * weight, weight)

    def add_weighted(self, weighted_value, weight) -> None:
        """``total += weighted_value``, ``count += weight``: a value already multiplied by its
        weight (the micro-batch's ``weight * loss``, computed once for its gradient)."""
        self.total.assign_add(tf.cast(weighted_value, self.dtype))
        self.count.assign_add(tf.cast(weight, self.dtype))


class WindowFlushCallback(keras.callbacks.Callback):
    """Applies ``AccumModel``'s end-of-epoch policy and reports non-finite gradients.

    The non-finite check reads the state once per epoch (before validation and before the
    end-of-epoch policy) and at the end of training, never per batch: a frozen state refuses
    every later micro-batch, and the error says how many it refused.

    ``AccumModel.fit`` adds it automatically, first in the list, so that a partial window is
    flushed *before* validation and before other callbacks (checkpoints) see the epoch's end.
    """

    def __init__(self) -> None:
        super().__init__()
        self._epoch = 0
        self._saw_batch: bool | None = None  # a training batch ran in the current epoch

    def on_train_begin(self, logs: dict | None = None) -> None:
        # A NonFiniteGradientError stopped the previous fit: start clean. The window before the
        # bad micro-batch holds valid gradients and is kept (a log line says so).
        if self.model.accumulation.built:
            self.model.accumulation.clear_nonfinite()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        self._saw_batch = False

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # No host read here: a state frozen by a non-finite gradient refuses (and counts) every
        # later micro-batch, so the check runs once, when the epoch's training ends.
        self._saw_batch = True

    def _raise_if_nonfinite(self) -> None:
        self.model.accumulation.raise_if_nonfinite(self._epoch)

    def on_test_begin(self, logs: dict | None = None) -> None:
        # Validation inside fit comes after the epoch's training batches: check them first.
        self._raise_if_nonfinite()
        # Validation inside fit: a large-batch fit would have applied the last batch already.
        if self.model.end_of_epoch == "apply":
            self.model.flush()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._saw_batch is False:
            raise ValueError(
                f"The training data (`x`) yielded no batches in epoch {epoch}: it is empty (or "
                "a dataset exhausted by `steps_per_epoch`). Pass non-empty data, or `.repeat()` "
                "the dataset when giving `steps_per_epoch`."
            )
        self._raise_if_nonfinite()
        self.model.end_epoch(epoch)

    def on_train_end(self, logs: dict | None = None) -> None:
        # Training stopped inside an epoch (e.g. `model.stop_training` set by a callback).
        self._raise_if_nonfinite()


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

    ``compile`` wraps each loss in a :class:`~accumcore.denominators.CountedLoss` (same value;
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
        # The state holds K and the non-finite policy (the properties below read them).
        self.accumulation = AccumulationState(1, nonfinite=nonfinite)
        self._accum_steps_given = False  # None = not given: fit raises (class docstring)
        self._configure(dict(accum_steps=accum_steps, end_of_epoch=end_of_epoch,
                             normalizer=normalizer))
        self._accum_normalizer = self.normalizer  # resolved from the loss by build_accumulation
        self._accum_loss_tracker = _ScalarMean(name="loss")
        # Not tracked (not a layer of the model); Keras's saving finds it by attribute name.
        object.__setattr__(self, "_accumulation_store", model_protocol.AccumulationStore(self))

    # ------------------------------------------------------------------ config
    @property
    def accum_steps(self) -> int | None:
        """K, micro-batches per optimizer update (held by :attr:`accumulation`); ``None``
        until given."""
        return self.accumulation.accum_steps if self._accum_steps_given else None

    @property
    def nonfinite(self) -> str | NonFinitePolicy:
        """The non-finite policy (held by :attr:`accumulation`), as its name, or the custom
        :class:`~accumcore.NonFinitePolicy` given."""
        policy = self.accumulation.nonfinite_policy
        return policy.name if NONFINITE.get(policy.name) == policy else policy

    def _configure(self, settings: dict) -> None:
        """Validate and set the given settings (``__init__`` and :meth:`set_accumulation`)."""
        nonfinite = settings.pop("nonfinite", None)
        if nonfinite is not None:
            self.accumulation.nonfinite = nonfinite  # a name or a NonFinitePolicy
        if settings.get("accum_steps", 0) is None:  # __init__ without `accum_steps`
            del settings["accum_steps"]
        for name, value in check_settings(**settings).items():
            if name == "accum_steps":
                self.accumulation.accum_steps = value
                self._accum_steps_given = True
            else:
                setattr(self, name, value)

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
        by (:func:`accumcore.denominators.counted`; the values are Keras's own).

        ``model.loss`` is the loss as given; the compile config (``model.save``,
        ``clone_model``) holds the wrapped losses, which load as themselves.
        """
        args = list(args)
        if len(args) > 1:
            args[1] = counted(args[1], getattr(self, "output_names", None))
        elif "loss" in kwargs:
            kwargs["loss"] = counted(kwargs["loss"], getattr(self, "output_names", None))
        super().compile(*args, **kwargs)
        if getattr(self, "loss", None) is not None:
            self.loss = uncounted(self.loss)

    def get_compile_config(self) -> dict | None:
        """Keras's compile config, plus the accumulation settings under one extra key.

        ``keras.models.clone_model`` builds the clone of a functional model with
        ``model.__class__(inputs, outputs, name=...)`` (it cannot pass ``accum_steps``), then
        calls ``clone.compile_from_config(model.get_compile_config())`` if ``model`` is
        compiled: carrying the settings here is how such a clone keeps K and the policies.
        """
        return model_protocol.with_settings(super().get_compile_config(), self)

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
        if self.accumulation.pending_micro_batches():
            raise ValueError(
                "A partial window is pending; call `model.flush()` before changing the "
                "accumulation settings."
            )
        given = dict(accum_steps=accum_steps, end_of_epoch=end_of_epoch, nonfinite=nonfinite,
                     normalizer=normalizer)
        self._configure({name: value for name, value in given.items() if value is not None})
        self.train_function = None  # retrace with the new settings

    # ------------------------------------------------------------------ metrics
    @property
    def metrics(self) -> list:
        # Our own "loss" tracker (weighted by micro-batch size) replaces Keras's, so the logged
        # loss is the per-sample mean over the epoch, whatever the micro-batch sizes.
        others = [m for m in super().metrics if m.name != "loss"]
        return [self._accum_loss_tracker, *others]

    # ------------------------------------------------------------------ building
    def build_accumulation(self) -> None:
        """Create the accumulators (called by ``fit`` once model and optimizer are built).

        Before a new ``train_function`` is traced (the first ``fit``, or the next one after
        ``compile``), the accumulators follow the trainable set (fine-tuning: freeze, ``fit``,
        unfreeze, ``compile``, ``fit``) and the normaliser follows the compiled loss's
        reduction. Without ``compile`` Keras keeps training the set it traced, and so does
        accumcore (:func:`accumcore.building.prepare_model`).
        """
        self._accum_normalizer = building.prepare_model(self, self._accum_normalizer)

    def make_train_function(self, force: bool = False):
        if self.accum_steps is None:
            self.build_accumulation()  # raises, naming `accum_steps`
        # An unbuilt subclass is built in the first traced step instead, from the first batch
        # (`building.build_on_first_batch`), as keras.Model.fit builds a plain subclass.
        if not building.needs_build(self) and building.check_trainable(self):
            self.build_accumulation()
            building.build_optimizer(self)
        return super().make_train_function(force)

    def fit(self, *args: Any, **kwargs: Any):
        """``keras.Model.fit``, with :class:`WindowFlushCallback` added first."""
        if len(args) > 5:  # callbacks given positionally
            args = list(args)
            kwargs["callbacks"] = args.pop(5)
        callbacks = list(kwargs.pop("callbacks", None) or [])
        if not any(isinstance(c, WindowFlushCallback) for c in callbacks):
            callbacks.insert(0, WindowFlushCallback())
        return super().fit(*args, callbacks=callbacks, **kwargs)

    # ------------------------------------------------------------------ training
    def _loss_of(self, x, y, y_pred, sample_weight):
        if y is None and self.loss is not None:
            raise ValueError(
                "`fit` got no labels (`y` is None) but the compiled loss needs them: pass `y` "
                "with array inputs, or make the dataset yield `(x, y)` or `(x, y, "
                "sample_weight)` tuples."
            )
        return compat.compute_loss(self, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                   training=True)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if building.needs_build(self):
            self._accum_normalizer = building.build_on_first_batch(
                self, x, self._accum_normalizer)
        if not self.trainable_variables:  # nothing to train: loss and metrics only, as Keras
            return self._forward_step(x, y, sample_weight, training=True)
        out = summed_loss_gradients(
            self, self._loss_of, x, y, sample_weight,
            normalizer=self._accum_normalizer, optimizer=self.optimizer,
        )
        self.accumulation.step(
            out.grads, out.weight, out.samples, self.optimizer, self.trainable_variables
        )
        self._accum_loss_tracker.add_weighted(out.weighted_loss, out.weight)
        logs = self.compute_metrics(x, y, out.y_pred, sample_weight=sample_weight)
        if not self.accumulation.nonfinite_policy.freeze:  # micro-batches may be skipped
            logs["skipped_micro_batches"] = self.accumulation.micro_batches_skipped
            logs["skipped_windows"] = self.accumulation.windows_skipped
        elif is_loss_scale_optimizer(self.optimizer):  # non-finite windows skipped (overflow)
            logs["skipped_windows"] = self.accumulation.windows_skipped
        return logs

    def _forward_step(self, x, y, sample_weight, *, training: bool):
        """Forward pass, loss and metrics; no gradient, no accumulation.

        ``evaluate`` and fit's validation (``training=False``), and a training step without
        trainable variables (``training=True``: what ``keras.Model.train_step`` does then).
        ``metrics`` replaces Keras's loss tracker by ours, so ours is fed here too (else the
        loss would log 0): the mean loss, weighted by the number of samples.
        """
        y_pred = self(x, training=training)
        if training:
            loss = self._loss_of(x, y, y_pred, sample_weight)
        else:
            loss = compat.compute_loss(self, x=x, y=y, y_pred=y_pred,
                                       sample_weight=sample_weight, training=False)
        self._accum_loss_tracker.update_state(
            loss * replica_loss_factor(), sample_weight=tf.cast(batch_size_of(x), tf.float32)
        )
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def train_on_batch(self, *args: Any, **kwargs: Any):
        """``keras.Model.train_on_batch``, which here runs ONE micro-batch (one ``train_step``).

        The optimizer steps on every ``accum_steps``-th call, with the mean gradient of the
        last K batches: K calls with b samples each equal one ``train_on_batch`` of the K * b
        samples on a plain model. The calls in between only accumulate; the returned loss is
        this micro-batch's. A partial window is applied by ``model.flush()``. A
        non-finite gradient raises ``NonFiniteGradientError`` here, as in ``fit``.
        """
        result = super().train_on_batch(*args, **kwargs)
        self.accumulation.raise_if_nonfinite()
        return result

    def test_step(self, data):
        """``evaluate`` and fit's validation: forward pass, loss (our tracker) and metrics."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        return self._forward_step(x, y, sample_weight, training=False)

    # ------------------------------------------------------------------ windows
    def flush(self) -> bool:
        """Apply the pending partial window now, with its true weight (no-op when empty).
        Returns whether an optimizer update was applied."""
        return entry.flush(self.accumulation, self.optimizer, self.trainable_variables)

    def end_epoch(self, epoch: int | None = None) -> str | None:
        """Apply the ``end_of_epoch`` policy to a pending partial window; returns what was
        done (:func:`accumcore.entry.end_epoch`)."""
        return entry.end_epoch(self.accumulation, self.end_of_epoch, self.optimizer,
                               self.trainable_variables, epoch)
