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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from accumcore.batchnorm import attach_window_layers
from accumcore.config import (
    END_OF_EPOCH_POLICIES,
    NONFINITE_POLICIES,
    check_accum_steps,
    check_choice,
    check_normalizer,
    check_optimizer,
    warn_if_float16_without_loss_scaling,
)
from accumcore.core import (
    batch_size_of,
    replica_loss_factor,
    resolve_normalizer,
    summed_loss_gradients,
)
from accumcore.distribute import is_loss_scale_optimizer
from accumcore.state import AccumulationState

logger = logging.getLogger("accumcore")

_CONFIG_KEYS = ("accum_steps", "end_of_epoch", "nonfinite", "normalizer")


class WindowFlushCallback(keras.callbacks.Callback):
    """Applies ``AccumModel``'s end-of-epoch policy and reports non-finite gradients.

    ``AccumModel.fit`` adds it automatically, first in the list, so that a partial window is
    flushed *before* validation and before other callbacks (checkpoints) see the epoch's end.
    """

    def __init__(self) -> None:
        super().__init__()
        self._epoch = 0
        self._batches: int | None = None  # training batches seen in the current epoch

    def on_train_begin(self, logs: dict | None = None) -> None:
        # A NonFiniteGradientError stopped the previous fit: start clean. The window before the
        # bad micro-batch holds valid gradients and is kept (a log line says so).
        if self.model.accumulation.built:
            self.model.accumulation.clear_nonfinite()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        self._batches = 0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._batches = (self._batches or 0) + 1
        self.model.accumulation.raise_if_nonfinite(self._epoch)

    def on_test_begin(self, logs: dict | None = None) -> None:
        # Validation inside fit: a large-batch fit would have applied the last batch already.
        if self.model.end_of_epoch == "apply":
            self.model.flush_window()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._batches == 0:
            raise ValueError(
                f"The training data (`x`) yielded no batches in epoch {epoch}: it is empty (or "
                "a dataset exhausted by `steps_per_epoch`). Pass non-empty data, or `.repeat()` "
                "the dataset when giving `steps_per_epoch`."
            )
        self.model.end_window_of_epoch(epoch)


def _functional_model_class() -> type:
    """Keras's functional-model class, found through the public API."""
    x = keras.Input((1,))
    return type(keras.Model(x, x))


_FUNCTIONAL = _functional_model_class()
_FUNCTIONAL_VARIANTS: dict[type, type] = {}


def _is_functional_call(args: tuple, kwargs: dict) -> bool:
    """Same rule as Keras: ``(inputs, outputs)`` positionally or by keyword."""
    return len(args) == 2 or (len(args) == 1 and "outputs" in kwargs) or (
        "inputs" in kwargs and "outputs" in kwargs
    )


@keras.saving.register_keras_serializable(package="accumcore")
class AccumModel(keras.Model):
    """A ``keras.Model`` whose ``fit`` accumulates ``accum_steps`` micro-batches per update.

    Args:
        *args: as for ``keras.Model`` (``inputs, outputs`` for the functional form).
        **kwargs: as for ``keras.Model`` (e.g. ``name``).
        accum_steps: K, micro-batches per optimizer update (the ``batch_size`` given to ``fit``
            is the micro-batch size b; the effective batch is K * b).
        end_of_epoch: ``"apply"`` (default), ``"carry"`` or ``"drop"`` for a partial window.
        nonfinite: ``"raise"`` (default), ``"skip_micro_batch"`` or ``"skip_window"``.
        normalizer: ``"samples"`` (default), ``"sample_weight"`` or a callable
            ``(x, y, sample_weight) -> item count``.

    The loss logged by ``fit`` is the true per-sample mean over the epoch. The accumulation
    state (a half-full window included) is saved with ``model.save`` / ``save_weights`` and
    tracked by ``tf.train.Checkpoint(model=model)``.
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        # Called functionally, Keras would rewrite this class's bases to include Functional,
        # permanently, which breaks later *subclassing* of AccumModel in the same process. Build
        # the functional form as a separate subclass (cls + Functional) instead.
        if _is_functional_call(args, kwargs) and not issubclass(cls, _FUNCTIONAL):
            if cls not in _FUNCTIONAL_VARIANTS:
                variant = type(
                    cls.__name__, (cls, _FUNCTIONAL),
                    {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
                )
                registered = keras.saving.get_registered_name(cls)
                if ">" in registered:  # saved and loaded under the class's registered name
                    package, name = registered.split(">", 1)
                    keras.saving.register_keras_serializable(package, name)(variant)
                _FUNCTIONAL_VARIANTS[cls] = variant
            cls = _FUNCTIONAL_VARIANTS[cls]
        return super().__new__(cls, *args, **kwargs)

    def __init__(
        self,
        *args: Any,
        accum_steps: int = 1,
        end_of_epoch: str = "apply",
        nonfinite: str = "raise",
        normalizer: str | Callable = "samples",
        **kwargs: Any,
    ) -> None:
        if isinstance(self, _FUNCTIONAL):
            # What keras.Model.__init__ does for functional arguments, minus rewriting the class
            # hierarchy: the trainer's own state, then the functional graph.
            super(keras.Model, self).__init__()
            _FUNCTIONAL.__init__(self, *args, **kwargs)
        else:
            super().__init__(*args, **kwargs)
        self.accum_steps = check_accum_steps(accum_steps)
        self.end_of_epoch = check_choice(end_of_epoch, "end_of_epoch", END_OF_EPOCH_POLICIES)
        self.nonfinite = check_choice(nonfinite, "nonfinite", NONFINITE_POLICIES)
        self.normalizer = check_normalizer(normalizer)
        self.accumulation = AccumulationState(self.accum_steps, nonfinite=self.nonfinite)
        self._accum_normalizer = self.normalizer  # resolved from the loss by build_accumulation
        self._accum_loss_tracker = keras.metrics.Mean(name="loss")

    # ------------------------------------------------------------------ config
    def get_config(self) -> dict:
        config = super().get_config()
        if callable(self.normalizer):
            raise ValueError(
                "An AccumModel with a callable `normalizer` cannot be serialised; pass "
                "normalizer='samples' or 'sample_weight', or re-create the model in code."
            )
        config.update({k: getattr(self, k) for k in _CONFIG_KEYS})
        return config

    @classmethod
    def from_config(cls, config: dict, custom_objects: dict | None = None) -> AccumModel:
        config = dict(config)
        extra = {k: config.pop(k) for k in _CONFIG_KEYS if k in config}
        model = super().from_config(config, custom_objects=custom_objects)
        if extra:
            model.set_accumulation(**extra)
        return model

    def set_accumulation(
        self,
        accum_steps: int | None = None,
        end_of_epoch: str | None = None,
        nonfinite: str | None = None,
        normalizer: str | Callable | None = None,
    ) -> None:
        """Change accumulation settings between ``fit`` calls (the window must be empty)."""
        if self.accumulation.built and int(self.accumulation.micro_step.numpy()):
            raise ValueError(
                "A partial window is pending; call `model.flush_window()` before changing the "
                "accumulation settings."
            )
        if accum_steps is not None:
            self.accum_steps = check_accum_steps(accum_steps)
        if end_of_epoch is not None:
            self.end_of_epoch = check_choice(end_of_epoch, "end_of_epoch", END_OF_EPOCH_POLICIES)
        if nonfinite is not None:
            self.nonfinite = check_choice(nonfinite, "nonfinite", NONFINITE_POLICIES)
        if normalizer is not None:
            self.normalizer = check_normalizer(normalizer)
        self.accumulation.accum_steps = self.accum_steps
        self.accumulation.nonfinite = self.nonfinite
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
        accumcore.
        """
        if not self.built or not self.trainable_variables:
            raise ValueError(
                "The model is not built, so accumcore cannot create its accumulators. Give it "
                "an input shape (keras.Input, `model.build(input_shape)`) or call it once."
            )
        if self.optimizer is not None:
            check_optimizer(self.optimizer)
            warn_if_float16_without_loss_scaling(self, self.optimizer)
        state = self.accumulation
        retrace = getattr(self, "train_function", None) is None
        if state.built and not retrace:
            return  # the traced step keeps its trainable set and normaliser (as Keras)
        normalizer = resolve_normalizer(self.normalizer, getattr(self, "loss", None))
        if normalizer == "sum" and self.distribute_strategy.num_replicas_in_sync > 1:
            raise ValueError(
                "A loss with reduction='sum' is not supported under a tf.distribute strategy: "
                "use reduction='sum_over_batch_size' (the default) or 'mean_with_sample_weight'."
            )
        if state.built and normalizer != self._accum_normalizer and (
                state.pending_micro_batches()):
            raise ValueError(
                "The compiled loss needs another normaliser than the pending window was "
                "accumulated with: call `model.flush_window()` before `compile`-ing a loss "
                "with another reduction."
            )
        with self.distribute_strategy.scope():
            state.build(self.trainable_variables)  # follows a changed trainable set
        self._accum_normalizer = normalizer
        state.normalize = normalizer != "sum"
        attach_window_layers(self, self.accumulation)  # window-level BN: one update per window

    def make_train_function(self, force: bool = False):
        self.build_accumulation()
        if self.optimizer is not None and not self.optimizer.built:
            # Before tracing: a LossScaleOptimizer's `scale_loss` must read its loss-scale
            # variable in the traced step, not the constant initial scale of an unbuilt one.
            with self.distribute_strategy.scope():
                self.optimizer.build(self.trainable_variables)
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
        return self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                 training=True)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        out = summed_loss_gradients(
            self, self._loss_of, x, y, sample_weight,
            normalizer=self._accum_normalizer, optimizer=self.optimizer,
        )
        self.accumulation.step(
            out.grads, out.weight, out.samples, self.optimizer, self.trainable_variables
        )
        self._accum_loss_tracker.update_state(out.loss, sample_weight=out.weight)
        logs = self.compute_metrics(x, y, out.y_pred, sample_weight=sample_weight)
        if self.nonfinite != "raise":
            logs["skipped_micro_batches"] = self.accumulation.micro_batches_skipped
            logs["skipped_windows"] = self.accumulation.windows_skipped
        elif is_loss_scale_optimizer(self.optimizer):  # non-finite windows skipped (overflow)
            logs["skipped_windows"] = self.accumulation.windows_skipped
        return logs

    def test_step(self, data):
        # evaluate() and fit's validation. `metrics` replaces Keras's loss tracker by ours, so
        # ours must be fed here too (else val_loss is 0): mean loss weighted by batch size.
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                 training=False)
        self._accum_loss_tracker.update_state(
            loss * replica_loss_factor(), sample_weight=tf.cast(batch_size_of(x), tf.float32)
        )
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    # ------------------------------------------------------------------ windows
    def flush_window(self) -> bool:
        """Apply the pending partial window now, with its true weight (no-op when empty)."""
        if not self.accumulation.built or int(self.accumulation.micro_step.numpy()) == 0:
            return False
        state, optimizer, variables = self.accumulation, self.optimizer, self.trainable_variables
        strategy = self.distribute_strategy
        if strategy.num_replicas_in_sync > 1:
            result = strategy.run(tf.function(lambda: state.apply_window(optimizer, variables)))
            return bool(strategy.experimental_local_results(result)[0])
        return bool(state.apply_window(optimizer, variables))

    def end_window_of_epoch(self, epoch: int | None = None) -> None:
        """Apply the ``end_of_epoch`` policy to a pending partial window."""
        if not self.accumulation.built or int(self.accumulation.micro_step.numpy()) == 0:
            return
        if self.end_of_epoch == "apply":
            self.flush_window()
        elif self.end_of_epoch == "drop":
            samples = int(self.accumulation.window_samples.numpy())
            logger.warning(
                "end_of_epoch='drop': discarding a partial window of %d samples at the end of "
                "epoch %s.", samples, epoch,
            )
            self.accumulation.drop_window()

    # ------------------------------------------------------------------ saving
    def _accumulation_variables(self) -> list[tf.Variable]:
        s = self.accumulation
        return [
            *s.accumulators, s.window_weight, s.micro_step, s.window_samples, s.windows_applied,
            s.windows_skipped, s.micro_batches_seen, s.micro_batches_skipped, s.samples_seen,
            s.samples_dropped, s.window_poisoned,
        ]

    def save_own_variables(self, store) -> None:
        super().save_own_variables(store)
        if self.built and self.trainable_variables:
            self.build_accumulation()
            for i, v in enumerate(self._accumulation_variables()):
                store[f"accumcore_{i}"] = v.numpy()

    def load_own_variables(self, store) -> None:
        own = {k: store[k] for k in store.keys() if not str(k).startswith("accumcore_")}
        super().load_own_variables(own)
        keys = [k for k in store.keys() if str(k).startswith("accumcore_")]
        if not keys:
            return
        self.build_accumulation()
        variables = self._accumulation_variables()
        if len(keys) != len(variables):
            raise ValueError(
                f"Saved accumulation state has {len(keys)} entries, this model needs "
                f"{len(variables)}: the file was saved from a different architecture."
            )
        for i, v in enumerate(variables):
            v.assign(store[f"accumcore_{i}"])
