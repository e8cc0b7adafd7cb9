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

import inspect
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from accumcore import compat, entry
from accumcore.config import (
    check_optimizer,
    check_settings,
    warn_if_float16_without_loss_scaling,
)
from accumcore.core import (
    batch_size_of,
    replica_loss_factor,
    resolve_normalizer,
    summed_loss_gradients,
)
from accumcore.denominators import counted, uncounted
from accumcore.layout import saved_micro_step
from accumcore.loss_scaling import is_loss_scale_optimizer
from accumcore.nonfinite import NONFINITE, NonFinitePolicy
from accumcore.state import AccumulationState

_CONFIG_KEYS = ("accum_steps", "end_of_epoch", "nonfinite", "normalizer")
# Key under which get_compile_config() carries the accumulation settings (see there).
_COMPILE_KEY = "accumcore_accumulation"


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
        self.total.assign_add(value * weight)
        self.count.assign_add(weight)


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


# Keras's functional-model class comes from compat.functional_model_class() (found without
# building a model: no model is built at import).
_FUNCTIONAL_VARIANTS: dict[type, type] = {}


def _keras_keywords(functional: bool) -> tuple[str, ...]:
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


class _AccumulationStore(keras.layers.Layer):
    """Saves and loads an ``AccumModel``'s accumulation state under its own path in the file.

    Keras's weight files give every object a path; a model's own path holds only its own
    variables (none for a Functional model). Keeping the accumulation state under this child
    path (``_accumulation_store/vars``) instead of the model's own path means that
    ``load_weights`` into a plain ``keras.Model`` with the same layers (serving) finds exactly
    the variables it expects and ignores this entry, while an ``AccumModel`` restores its
    half-full window from it. It is not tracked as a layer (not in ``model.layers`` or
    ``model.weights``); ``tf.train.Checkpoint`` tracks ``model.accumulation`` directly.
    """

    def __init__(self, save: Callable[[], list], restore: Callable[[list], None]) -> None:
        """``save()`` returns the values to write; ``restore(values)`` loads them (bound
        methods of the model, held weakly)."""
        super().__init__(name="accumulation_store", trainable=False)
        # Weak references, untracked: Keras's saving walks this layer's attributes, and a
        # strong one would lead it back to the model (a cycle); no tracking either.
        object.__setattr__(self, "_save", weakref.WeakMethod(save))
        object.__setattr__(self, "_restore", weakref.WeakMethod(restore))
        self.built = True

    def save_own_variables(self, store) -> None:
        for i, value in enumerate(self._save()()):
            store[str(i)] = value

    def load_own_variables(self, store) -> None:
        keys = list(store.keys()) if store is not None else []
        if keys:
            # numpy arrays: Keras 3.10 hands over h5py datasets, 3.15 arrays
            self._restore()([np.asarray(store[str(i)]) for i in range(len(keys))])


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
        # Called functionally, Keras would rewrite this class's bases to include Functional,
        # permanently, which breaks later *subclassing* of AccumModel in the same process. Build
        # the functional form as a separate subclass (cls + Functional) instead.
        functional = compat.functional_model_class()
        if _is_functional_call(args, kwargs) and not issubclass(cls, functional):
            if cls not in _FUNCTIONAL_VARIANTS:
                variant = type(
                    cls.__name__, (cls, functional),
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
        accum_steps: int | None = None,
        end_of_epoch: str = "apply",
        nonfinite: str | NonFinitePolicy = "raise",
        normalizer: str | Callable = "auto",
        **kwargs: Any,
    ) -> None:
        functional = compat.functional_model_class()
        keras_keywords = _keras_keywords(isinstance(self, functional))
        unknown = [k for k in kwargs if k not in keras_keywords]
        if unknown:
            raise TypeError(
                f"AccumModel got unexpected keyword argument(s) {', '.join(unknown)}; valid "
                f"keywords: {', '.join((*_CONFIG_KEYS, *keras_keywords))}. (K, the number of "
                "micro-batches per optimizer update, is `accum_steps`.)"
            )
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
        object.__setattr__(self, "_accumulation_store", _AccumulationStore(
            self._accumulation_values_to_save, self._restore_accumulation
        ))

    # ------------------------------------------------------------------ config
    @property
    def accum_steps(self) -> int | None:
        """K, micro-batches per optimizer update (held by :attr:`accumulation`); ``None``
        until given."""
        return self.accumulation.accum_steps if self._accum_steps_given else None

    @property
    def nonfinite(self) -> str | NonFinitePolicy:
        """The non-finite policy (held by :attr:`accumulation`): its name, or the custom
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
        config = super().get_config()
        if callable(self.normalizer):
            raise ValueError(
                "An AccumModel with a callable `normalizer` cannot be serialised; pass "
                "normalizer='auto', 'samples' or 'sample_weight', or re-create the model in code."
            )
        if not isinstance(self.nonfinite, str):
            raise ValueError(
                f"An AccumModel with a custom NonFinitePolicy ({self.nonfinite.name!r}) cannot "
                "be serialised; pass nonfinite='raise', 'skip_micro_batch' or 'skip_window', "
                "or re-create the model in code."
            )
        config.update(self._settings())
        return config

    @classmethod
    def from_config(cls, config: dict, custom_objects: dict | None = None) -> AccumModel:
        config = dict(config)
        extra = {k: config.pop(k) for k in _CONFIG_KEYS if k in config}
        model = super().from_config(config, custom_objects=custom_objects)
        if extra:
            model.set_accumulation(**extra)
        return model

    def _settings(self) -> dict:
        return {k: getattr(self, k) for k in _CONFIG_KEYS}

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
        config = super().get_compile_config()
        if config is not None:
            config = {**config, _COMPILE_KEY: self._settings()}
        return config

    def compile_from_config(self, config: dict) -> None:
        """Keras's ``compile_from_config``, then the settings of :meth:`get_compile_config`."""
        config = dict(config)
        settings = config.pop(_COMPILE_KEY, None)
        # What keras.Model.compile_from_config does (Keras 3.10-3.15), which skips a
        # `compile` that a subclass overrides, as AccumModel does (to count the losses).
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)
        if settings:
            self.set_accumulation(**settings)

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
    def _needs_build(self) -> bool:
        """True while the model has no variables yet (an unbuilt subclass)."""
        return not self.built or not self.variables

    def _check_trainable(self) -> bool:
        """Whether there is anything to train; warns (as ``keras.Model.fit`` does) if not.

        Raises:
            ValueError: if a partial window is pending while the model has no trainable
                variables left (the pending gradients belong to variables now frozen).
        """
        if self.trainable_variables:
            return True
        if self.accumulation.pending_micro_batches():
            raise ValueError(
                "The model has no trainable variables now, but a partial window of "
                f"{self.accumulation.pending_micro_batches()} micro-batch(es) is pending from "
                "before they were frozen: call `model.flush()` before freezing "
                "(`model.trainable = False`), or unfreeze the model."
            )
        warnings.warn(
            f"AccumModel {self.name!r} has no trainable variables (`model.trainable = False`, "
            "or every layer frozen): there is nothing to train, so this `fit` only computes the "
            "loss and metrics, as keras.Model.fit does (\"The model does not have any "
            "trainable weights\"). To train, set `model.trainable = True` (or unfreeze some "
            "layers), then `compile` again.",
            UserWarning,
            stacklevel=3,
        )
        return False

    def build_accumulation(self) -> None:
        """Create the accumulators (called by ``fit`` once model and optimizer are built).

        Before a new ``train_function`` is traced (the first ``fit``, or the next one after
        ``compile``), the accumulators follow the trainable set (fine-tuning: freeze, ``fit``,
        unfreeze, ``compile``, ``fit``) and the normaliser follows the compiled loss's
        reduction. Without ``compile`` Keras keeps training the set it traced, and so does
        accumcore.
        """
        if self.accum_steps is None:
            raise ValueError(
                "AccumModel was created without `accum_steps` (K, the number of micro-batches "
                "per optimizer update), so it would silently train with K = 1. Pass it when "
                "creating the model (`AccumModel(inputs, outputs, accum_steps=4)`; "
                "`accum_steps=1` for no accumulation) or call "
                "`model.set_accumulation(accum_steps=K)`. (keras.models.clone_model of an "
                "*uncompiled* AccumModel cannot pass the settings on: set them on the clone.)"
            )
        if self._needs_build():
            raise ValueError(
                "The model is not built, so accumcore cannot create its accumulators. Give it "
                "an input shape (keras.Input, `model.build(input_shape)`) or call it once "
                "(`fit` and `train_on_batch` build it on the first batch)."
            )
        if not self.trainable_variables:
            raise ValueError(
                "The model has no trainable variables (`model.trainable = False`, or every "
                "layer frozen): there is nothing to accumulate. Set `model.trainable = True` "
                "(or unfreeze some layers) and `compile` again."
            )
        if self.optimizer is not None:
            check_optimizer(self.optimizer)
            warn_if_float16_without_loss_scaling(self, self.optimizer)
        state = self.accumulation
        retrace = getattr(self, "train_function", None) is None
        if state.built and not retrace:
            return  # the traced step keeps its trainable set and normaliser (as Keras)
        normalizer = resolve_normalizer(self.normalizer, getattr(self, "loss", None))
        if state.built and normalizer != self._accum_normalizer and (
                state.pending_micro_batches()):
            raise ValueError(
                "The compiled loss needs another normaliser than the pending window was "
                "accumulated with: call `model.flush()` before `compile`-ing a loss "
                "with another reduction."
            )
        strategy = self.distribute_strategy
        with strategy.scope():  # follows a changed trainable set
            entry.prepare(state, self, normalizer,
                          distributed=strategy.num_replicas_in_sync > 1)
        self._accum_normalizer = normalizer

    def _build_optimizer(self) -> None:
        if self.optimizer is not None and not self.optimizer.built:
            # Before tracing: a LossScaleOptimizer's `scale_loss` must read its loss-scale
            # variable in the traced step, not the constant initial scale of an unbuilt one.
            with self.distribute_strategy.scope():
                self.optimizer.build(self.trainable_variables)

    def make_train_function(self, force: bool = False):
        if self.accum_steps is None:
            self.build_accumulation()  # raises, naming `accum_steps`
        # An unbuilt subclass is built in the first traced step instead, from the first batch
        # (`_build_on_first_batch`), as keras.Model.fit builds a plain subclass.
        if not self._needs_build() and self._check_trainable():
            self.build_accumulation()
            self._build_optimizer()
        return super().make_train_function(force)

    def _build_on_first_batch(self, x) -> None:
        """Build model, accumulators and optimizer from the first batch's shapes, eagerly.

        Runs in the first trace of the train step for a model ``fit`` could not build before
        tracing (an unbuilt subclass): the model is called once on ``keras.KerasTensor`` s with
        the batch's shapes and dtypes (symbolic: no data, no state update), and every variable
        is created outside the graph (``tf.init_scope``).
        """
        def spec(t):
            return keras.KerasTensor(tuple(t.shape), dtype=tf.as_dtype(t.dtype).name)

        with tf.init_scope():
            self(tf.nest.map_structure(spec, x), training=False)
            if self._check_trainable():
                self.build_accumulation()
                self._build_optimizer()

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
        if self._needs_build():
            self._build_on_first_batch(x)
        if not self.trainable_variables:  # nothing to train: loss and metrics only, as Keras
            return self._forward_step(x, y, sample_weight, training=True)
        out = summed_loss_gradients(
            self, self._loss_of, x, y, sample_weight,
            normalizer=self._accum_normalizer, optimizer=self.optimizer,
        )
        self.accumulation.step(
            out.grads, out.weight, out.samples, self.optimizer, self.trainable_variables
        )
        self._accum_loss_tracker.update_state(out.loss, sample_weight=out.weight)
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

    # ------------------------------------------------------------------ saving
    def _accumulation_values_to_save(self) -> list:
        """The accumulation state's values, for ``_AccumulationStore`` (empty: nothing to save)."""
        if not self.accumulation.built:
            if self._needs_build() or not self.trainable_variables or self.accum_steps is None:
                return []
            self.build_accumulation()  # zeros: a file always restores a clean window
        return [v.numpy() for v in self.accumulation.variables_for_saving()]

    def _restore_accumulation(self, values: list) -> None:
        """Load saved accumulation-state values (from ``_AccumulationStore`` or an old file)."""
        if not self.trainable_variables:
            pending = saved_micro_step(values)
            if pending:
                raise ValueError(
                    f"The saved accumulation state holds a partial window of {pending} "
                    "micro-batch(es), but this model has no trainable variables to apply it "
                    "to: unfreeze the model before loading, or save after `flush()`."
                )
            return  # an empty window: nothing to restore into a frozen model
        if self.optimizer is not None:
            check_optimizer(self.optimizer)
        with self.distribute_strategy.scope():
            entry.prepare(self.accumulation, self)
        variables = self.accumulation.variables_for_saving()
        if len(values) != len(variables):
            raise ValueError(
                f"Saved accumulation state has {len(values)} entries, this model needs "
                f"{len(variables)}: the file was saved from a different architecture (or with "
                "a different set of trainable variables)."
            )
        for v, value in zip(variables, values, strict=True):
            v.assign(value)
