"""The ``fit`` side: ``model.fit`` with exact accumulation, for any ``keras.Model``.

The train step, the build before tracing, ``compile`` with counted losses, the callback that
ends epochs, the settings and :func:`~accumcore.accumulate`. Two ways in share every function
here:

* :class:`~accumcore.AccumModel`, a ``keras.Model`` subclass whose methods call them;
* :func:`~accumcore.accumulate`, which gives one model that already exists (Functional,
  Sequential, a subclass, a pretrained KerasHub task) the same methods as instance attributes,
  in place:
  ``type(model)``, its own methods (``generate``, ``preprocessor``, ``save_to_preset``),
  ``predict``, ``evaluate`` and its saved format stay its own.

Each function takes the model and, where it wraps one, the model's own (class) method as
``base``: the train step (:func:`train_step`, one micro-batch), the build before tracing
(:func:`make_train_function`), ``fit`` with :class:`WindowFlushCallback` first (:func:`fit`),
``compile`` with every loss counted (:func:`compile_counted`: what the loss divides a
micro-batch by, ``accumcore._impl.denominators``) and a compile config without them
(:func:`plain_compile_config`), and ``train_on_batch`` (:func:`train_on_batch`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from accumcore._impl import compat, settings
from accumcore._impl.auto_micro_batch import retrying_train_function
from accumcore._impl.denominators import counted, resolve_normalizer, uncounted
from accumcore._impl.gradients import first_leaf, summed_loss_gradients
from accumcore._impl.loss_scaling import is_loss_scale_optimizer
from accumcore._impl.nonfinite import NonFinitePolicy
from accumcore._impl.search import OUT_OF_MEMORY, probe_total
from accumcore._impl.settings import AUTO, check_optimizer, warn_if_float16_without_loss_scaling
from accumcore._impl.state import AccumulationState, saved_micro_step, take

#: The call that applies a pending window of a model trained by ``fit`` (an ``AccumModel`` or
#: a model given ``accumulate``): the one every message of the fit side names.
FLUSH_CALL = "`accumcore.flush(model)`"

#: The methods :func:`~accumcore.accumulate` gives a model (each wraps the class's own).
METHODS = ("train_step", "make_train_function", "fit", "compile", "get_compile_config",
           "train_on_batch")


class WindowFlushCallback(keras.callbacks.Callback):
    """Applies the end-of-epoch policy and reports non-finite gradients, for ``fit``.

    At each epoch's end (and before validation inside ``fit``) the pending partial window gets
    the state's ``end_of_epoch`` policy (``"apply"`` for an :class:`~accumcore.AccumulationState`
    made by hand: one update with the window's true weight, as ``fit`` at the large batch
    makes); and if a non-finite window stopped training (``nonfinite="raise"``, the default) it
    raises :class:`~accumcore.NonFiniteGradientError` with the same message as ``fit`` after
    ``accumulate``, word for word where the variables' paths match (the message names the
    first non-finite variable by its path). The check reads the state once per epoch (before
    validation and before the end-of-epoch policy) and at the end of training,
    never per batch: a stopped state discards every later window, and the error says how many
    micro-batches it left unused. A previous run's stop is cleared when training begins
    (logged), as ``fit`` does.

    ``fit`` (of an ``AccumModel`` or a model given ``accumulate``) adds it first in the list,
    so that a partial window is flushed *before* validation and before other callbacks
    (checkpoints) see the epoch's end. A ``train_step`` of your own that calls
    ``state.step`` passes it first in ``callbacks`` itself:
    ``model.fit(x, y, batch_size=b, callbacks=[accumcore.WindowFlushCallback(state)])``.

    Args:
        state: the :class:`~accumcore.AccumulationState` your ``train_step`` steps; ``None``
            (default): the model's ``accumulation`` attribute (``AccumModel``, ``accumulate``).
            The model, its optimizer and trainable variables are the ones ``fit`` sets as
            ``self.model``: no global is needed.
    """

    #: Keras may run this callback's batch hook off the training thread (it only sets a flag):
    #: without this, a callback with ``on_train_batch_end`` makes Keras convert every batch's
    #: logs on the host before the next batch starts.
    async_safe = True

    def __init__(self, state: AccumulationState | None = None) -> None:
        super().__init__()
        if state is not None and not isinstance(state, AccumulationState):
            raise TypeError(f"`state` must be an accumcore.AccumulationState (the one your "
                            f"train_step steps) or None, got {type(state).__name__}.")
        self._state = state
        self._epoch = 0
        self._saw_batch: bool | None = None  # a training batch ran in the current epoch
        # (micro-batches seen, windows) before the first batch, while it is to be checked
        self._split_from: tuple[int, int] | None = None

    @property
    def state(self) -> AccumulationState:
        """The state given, else the model's ``accumulation`` (raises naming the fix)."""
        state = self._state if self._state is not None else getattr(
            self.model, "accumulation", None)
        if not isinstance(state, AccumulationState):
            raise ValueError(
                f"WindowFlushCallback() found no AccumulationState on the model (no "
                f"`accumulation` attribute on {type(self.model).__name__}): pass the state "
                "your train_step steps, `accumcore.WindowFlushCallback(state)`.")
        return state

    def on_train_begin(self, logs: dict | None = None) -> None:
        state = self.state
        # A NonFiniteGradientError stopped the previous fit: clear the stop (logged).
        if state.built:
            state.clear_nonfinite()
        self._split_from = None
        if isinstance(state.settings.micro_batch_size, int):  # checked after the first call
            self._split_from = _split_counts(state) if state.built else (0, 0)

    def _check_split(self) -> None:
        """Once per ``fit``, after its first call of the train function (one host read):
        warn if no batch was split (``settings.warn_if_nothing_split``)."""
        start, self._split_from = self._split_from, None
        seen, windows = _split_counts(self.state)
        settings.warn_if_nothing_split(
            self.state.settings.micro_batch_size, seen - start[0], windows - start[1],
            "`model.set_accumulation(accum_steps=K)`" if hasattr(self.model, "set_accumulation")
            else "`accumcore.accumulate(model, accum_steps=K)`")

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        self._saw_batch = False

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        # No non-finite check here (a host read): a stopped state discards every later window.
        self._saw_batch = True
        if self._split_from is not None and self.state.built:
            self._check_split()

    def _raise_if_nonfinite(self) -> None:
        self.state.raise_if_nonfinite(self._epoch)

    def on_test_begin(self, logs: dict | None = None) -> None:
        # Validation inside fit comes after the epoch's training batches: check them first.
        self._raise_if_nonfinite()
        # Validation inside fit: a large-batch fit would have applied the last batch already.
        if self.state.settings.end_of_epoch == "apply":
            self.state.flush(self.model.optimizer, self.model.trainable_variables)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._saw_batch is False:
            raise ValueError(
                f"The training data (`x`) yielded no batches in epoch {epoch + 1}: it is empty (or "
                "a dataset exhausted by `steps_per_epoch`). Pass non-empty data, or `.repeat()` "
                "the dataset when giving `steps_per_epoch`."
            )
        self._raise_if_nonfinite()
        self.state.end_epoch(self.state.settings.end_of_epoch, self.model.optimizer,
                             self.model.trainable_variables, epoch)

    def on_train_end(self, logs: dict | None = None) -> None:
        # Training stopped inside an epoch (e.g. `model.stop_training` set by a callback).
        self._raise_if_nonfinite()


def _split_counts(state: AccumulationState) -> tuple[int, int]:
    """``(micro-batches seen, windows closed)`` of a built state (a host read)."""
    with tf.init_scope():
        return (int(state.micro_batches_seen.numpy()),
                int(state.windows_applied.numpy()) + int(state.windows_skipped.numpy()))


# ---------------------------------------------------------------------- settings
def configure(model: keras.Model, given: dict) -> None:
    """Check the given settings (``accumcore._impl.settings.resolve``) and set them on
    ``model``'s state; ``accum_steps=None`` (an ``AccumModel`` created without it) leaves K
    unset, and ``fit`` raises naming it."""
    given = {name: value for name, value in given.items() if value is not None}
    state = model.accumulation
    state.settings = settings.resolve(state.settings, **given)


def attach(model: keras.Model, given: dict) -> None:
    """Give ``model`` its accumulation state, with the settings ``given`` (checked by
    :func:`configure`), and the weight-file entry that saves the state (``AccumModel.__init__``
    and :func:`~accumcore.accumulate`)."""
    state = AccumulationState(1)
    state.flush_call = FLUSH_CALL
    if given.get("accum_steps") is None:  # an AccumModel created without `accum_steps`
        state.settings = dataclasses.replace(state.settings, accum_steps=None)
    try:
        model.accumulation = state  # tracked: tf.train.Checkpoint(model=model) holds it
    except (AttributeError, ValueError):  # pragma: no cover - a class that forbids it
        object.__setattr__(model, "accumulation", state)
    configure(model, given)
    # Not tracked (not a layer of the model); Keras's saving finds it by attribute name.
    object.__setattr__(model, "_accumulation_store", AccumulationStore(model))


def set_accumulation(model: keras.Model, given: dict) -> None:
    """Change the settings between ``fit`` calls (the window must be empty); the next ``fit``
    traces a new step with them."""
    if model.accumulation.pending_micro_batches():
        raise ValueError(
            f"A partial window is pending; apply it ({FLUSH_CALL}) before changing the "
            "accumulation settings."
        )
    configure(model, given)
    model.train_function = None  # retrace with the new settings


def is_accumulating(model: Any) -> bool:
    """Whether ``model`` trains with accumcore already (an ``AccumModel``, or a model given to
    :func:`~accumcore.accumulate`)."""
    return isinstance(getattr(model, "accumulation", None), AccumulationState)


# ---------------------------------------------------------------------- saving
class AccumulationStore(keras.layers.Layer):
    """Saves and loads an ``AccumModel``'s accumulation state under its own path in the file.

    Keras's weight files give every object a path; a model's own path holds only its own
    variables (none for a Functional model). Keeping the accumulation state under this child
    path (``_accumulation_store/vars``) instead of the model's own path means that
    ``load_weights`` into a plain ``keras.Model`` with the same layers (serving) finds exactly
    the variables it expects and ignores this entry, while an ``AccumModel`` restores its
    half-full window from it. It is not tracked as a layer (not in ``model.layers`` or
    ``model.weights``); ``tf.train.Checkpoint`` tracks ``model.accumulation`` directly.
    """

    def __init__(self, model) -> None:
        super().__init__(name="accumulation_store", trainable=False)
        # A weak reference, untracked: Keras's saving walks this layer's attributes, and a
        # strong one would lead it back to the model (a cycle); no tracking either.
        object.__setattr__(self, "_model", weakref.ref(model))
        self.built = True

    def save_own_variables(self, store) -> None:
        for i, value in enumerate(values_to_save(self._model())):
            store[str(i)] = value

    def load_own_variables(self, store) -> None:
        keys = list(store.keys()) if store is not None else []
        if keys:
            # numpy arrays: Keras 3.10 hands over h5py datasets, 3.15 arrays
            restore(self._model(), [np.asarray(store[str(i)]) for i in range(len(keys))])


def values_to_save(model) -> list[Any]:
    """The accumulation state's values (numpy), in the file's order; empty: nothing to save."""
    if not model.accumulation.built:
        if (needs_build(model) or not model.trainable_variables
                or model.accumulation.accum_steps is None):
            return []
        prepare_model(model)  # zeros: a file always restores a clean window
    return [v.numpy() for v in model.accumulation.variables_for_saving()]


def restore(model, values: list) -> None:
    """Load saved accumulation-state ``values`` into ``model`` (building its state)."""
    if not model.trainable_variables:
        pending = saved_micro_step(values)
        if pending:
            raise ValueError(
                f"The saved accumulation state holds a partial window of {pending} "
                "micro-batch(es), but this model has no trainable variables to apply it "
                f"to: unfreeze the model before loading, or save after {FLUSH_CALL}."
            )
        return  # an empty window: nothing to restore into a frozen model
    if model.optimizer is not None:
        check_optimizer(model.optimizer)
    with model.distribute_strategy.scope():
        model.accumulation.prepare(model)
    variables = model.accumulation.variables_for_saving()
    if len(values) == len(variables) + len(model.accumulation.accumulators):
        model.accumulation.build_undivided()  # saved with a sum beside a mean loss
        variables = model.accumulation.variables_for_saving()
    if len(values) != len(variables):
        raise ValueError(
            f"Saved accumulation state has {len(values)} entries, this model needs "
            f"{len(variables)}: the file was saved from a different architecture (or with "
            "a different set of trainable variables)."
        )
    for v, value in zip(variables, values, strict=True):
        v.assign(value)


# ---------------------------------------------------------------------- compile
def _own(base: Callable, name: str) -> bool:
    """Whether ``base`` (a bound method) is ``keras.Model``'s own ``name``."""
    return getattr(base, "__func__", None) is getattr(keras.Model, name)


def compile_counted(model: keras.Model, base: Callable, *args: Any, **kwargs: Any) -> None:
    """``compile``, with every loss wrapped so that it reports what it divides by
    (``accumcore._impl.denominators.counted``; the values are Keras's own).

    Keras's own ``compile`` gets the counted losses directly. A class with a ``compile`` of its
    own (a KerasHub task resolving ``loss="auto"``) compiles first; its losses are then
    counted by compiling again with Keras's own ``compile`` (:func:`recount`: the same
    objects). ``model.loss`` is the loss as given either way.
    """
    if _own(base, "compile"):
        args = list(args)
        if len(args) > 1:
            args[1] = counted(args[1], getattr(model, "output_names", None))
        elif "loss" in kwargs:
            kwargs["loss"] = counted(kwargs["loss"], getattr(model, "output_names", None))
        base(*args, **kwargs)
    else:
        base(*args, **kwargs)
        recount(model)
    if getattr(model, "loss", None) is not None:
        model.loss = uncounted(model.loss)


def recount(model: keras.Model) -> None:
    """Compile ``model`` again, as it is compiled, with its losses counted (a no-op if it is
    not compiled, or has no loss).

    The arguments are the objects ``compile`` was given (``compat.compile_arguments``), the
    optimizer the model holds, never objects rebuilt from a serialised config: what plain
    ``fit`` trains with (an unregistered ``Loss`` subclass, a schedule without
    ``get_config``, a function as a metric) trains here too, and saving meets them as plain
    Keras does.
    """
    if not getattr(model, "compiled", False) or getattr(model, "loss", None) is None:
        return
    arguments = compat.compile_arguments(model)
    if arguments is None:  # pragma: no cover - a Keras without compile's own arguments
        config = keras.Model.get_compile_config(model)
        if not config:
            return
        arguments = keras.saving.deserialize_keras_object(plain_compile_config(config))
    arguments["optimizer"] = model.optimizer
    arguments["loss"] = counted(uncounted(model.loss), getattr(model, "output_names", None))
    keras.Model.compile(model, **arguments)


def plain_compile_config(config: Any) -> Any:
    """A serialised compile config with each counted loss replaced by the loss it wraps, so
    that a saved model loads without accumcore."""
    if isinstance(config, dict):
        if config.get("class_name") == "CountedLoss" and "config" in config:
            return plain_compile_config(config["config"]["loss"])
        return {key: plain_compile_config(value) for key, value in config.items()}
    if isinstance(config, (list, tuple)):
        return type(config)(plain_compile_config(value) for value in config)
    return config


# ---------------------------------------------------------------------- building
def check_trainable(model) -> bool:
    """Whether a model trained by ``fit`` has anything to train; warns (as ``keras.Model.fit`` does)
    if not.

    Raises:
        ValueError: if a partial window is pending while the model has no trainable
            variables left (the pending gradients belong to variables now frozen).
    """
    if model.trainable_variables:
        return True
    pending = model.accumulation.pending_micro_batches()
    if pending:
        raise ValueError(
            "The model has no trainable variables now, but a partial window of "
            f"{pending} micro-batch(es) is pending from before they were frozen: call "
            f"{FLUSH_CALL} before freezing (`model.trainable = False`), or unfreeze the model."
        )
    warnings.warn(
        f"{type(model).__name__} {model.name!r} has no trainable variables "
        "(`model.trainable = False`, "
        "or every layer frozen): there is nothing to train, so this `fit` only computes the "
        "loss and metrics, as keras.Model.fit does (\"The model does not have any "
        "trainable weights\"). To train, set `model.trainable = True` (or unfreeze some "
        "layers), then `compile` again.",
        UserWarning,
        stacklevel=3,
    )
    return False


def needs_build(model: keras.Model) -> bool:
    """True while ``model`` has no variables yet (an unbuilt subclass)."""
    return not model.built or not model.variables


def prepare_model(model) -> None:
    """Check that ``model`` can accumulate, then ``prepare`` its state when a new
    ``train_function`` is traced (its trainable set and the weighting resolved from the
    compiled loss); a traced one keeps both, as Keras keeps its trainable set."""
    state = model.accumulation
    if state.accum_steps is None:
        raise ValueError(
            "AccumModel was created without `micro_batch_size` or `accum_steps`, so it would "
            "silently train without accumulating. Pass one when creating the model: "
            "`AccumModel(inputs, outputs, micro_batch_size=b)` (then `fit(batch_size=B)` "
            "splits each batch of B into micro-batches of at most b) or `accum_steps=K` (each "
            "batch is one micro-batch, K per update; `accum_steps=1` for no accumulation); or "
            "call `model.set_accumulation(micro_batch_size=b)`. (keras.models.clone_model of "
            "an *uncompiled* AccumModel cannot pass the settings on: set them on the clone.)"
        )
    if needs_build(model):
        raise ValueError(
            "The model is not built, so accumcore cannot create its accumulators. Give it "
            "an input shape (keras.Input, `model.build(input_shape)`) or call it once "
            "(`fit` and `train_on_batch` build it on the first batch)."
        )
    if not model.trainable_variables:
        raise ValueError(
            "The model has no trainable variables (`model.trainable = False`, or every "
            "layer frozen): there is nothing to accumulate. Set `model.trainable = True` "
            "(or unfreeze some layers) and `compile` again."
        )
    if model.optimizer is not None:
        check_optimizer(model.optimizer)
        warn_if_float16_without_loss_scaling(model, model.optimizer)
    if state.built and getattr(model, "train_function", None) is not None:
        return  # the traced step keeps its trainable set (as Keras)
    weighting = resolve_normalizer(state.settings.normalizer, getattr(model, "loss", None))
    if state.built and weighting != state.weighting and state.pending_micro_batches():
        raise ValueError(
            "The compiled loss needs another normaliser than the pending window was "
            f"accumulated with: call {FLUSH_CALL} before `compile`-ing a loss "
            "with another reduction."
        )
    strategy = model.distribute_strategy
    with strategy.scope():  # follows a changed trainable set
        state.prepare(model, weighting, distributed=strategy.num_replicas_in_sync > 1)


def build_optimizer(model) -> None:
    """Build ``model.optimizer`` for the trainable variables, before tracing: a
    LossScaleOptimizer's ``scale_loss`` must read its loss-scale variable in the traced step,
    not the constant initial scale of an unbuilt one."""
    if model.optimizer is not None and not model.optimizer.built:
        with model.distribute_strategy.scope():
            model.optimizer.build(model.trainable_variables)


def build_on_first_batch(model, x) -> None:
    """Build an unbuilt ``AccumModel`` subclass, its accumulators and optimizer from the first
    batch ``x``'s shapes, eagerly.

    Runs in the first trace of the train step for a model ``fit`` could not build before
    tracing: the model is called once on ``keras.KerasTensor`` s with the batch's shapes and
    dtypes (symbolic: no data, no state update), and every variable is created outside the
    graph (``tf.init_scope``), as ``keras.Model.fit`` builds a plain subclass.

    """
    def spec(t):
        return keras.KerasTensor(tuple(t.shape), dtype=tf.as_dtype(t.dtype).name)

    with tf.init_scope():
        model(tf.nest.map_structure(spec, x), training=False)
        if not check_trainable(model):
            return
        prepare_model(model)
        build_optimizer(model)


# ---------------------------------------------------------------------- fit
def make_train_function(model: keras.Model, base: Callable, force: bool = False):
    """Build the accumulators (or follow a changed trainable set) and the optimizer, then
    Keras's ``make_train_function``. An unbuilt subclass is built in the first traced step
    instead, from the first batch (:func:`build_on_first_batch`), as
    ``keras.Model.fit`` builds a plain subclass."""
    if model.accumulation.accum_steps is None:
        prepare_model(model)  # raises, naming `accum_steps`
    if not needs_build(model) and check_trainable(model):
        prepare_model(model)
        build_optimizer(model)
    if model.accumulation.settings.micro_batch_size != AUTO:
        return base(force)
    if force or getattr(model, "train_function", None) is None:
        retrying = None

        def make() -> Callable:  # Keras's train function for the b found (the batch-per-call
            # way: a distributed iterator, run_eagerly), ours kept in place
            base(True)
            inner, model.train_function = model.train_function, retrying
            return inner

        model.train_function = retrying = retrying_train_function(model, make, probe_step(model))
    return model.train_function


def fit(model: keras.Model, base: Callable, *args: Any, **kwargs: Any):
    """``fit``, with :class:`WindowFlushCallback` added first."""
    if len(args) > 5:  # callbacks given positionally
        args = list(args)
        kwargs["callbacks"] = args.pop(5)
    callbacks = list(kwargs.pop("callbacks", None) or [])
    if not any(isinstance(c, WindowFlushCallback) for c in callbacks):
        callbacks.insert(0, WindowFlushCallback())
    try:
        return base(*args, callbacks=callbacks, **kwargs)
    except OUT_OF_MEMORY as err:
        size = model.accumulation.settings.micro_batch_size
        if not isinstance(size, int):
            raise
        raise type(err)(err.node_def, err.op, (
            f"A step with micro_batch_size={size} ran out of device memory. Pass a smaller "
            f"micro_batch_size (e.g. {max(1, size // 2)}), or micro_batch_size='auto' to find "
            "the largest that fits and shrink it when a batch runs out of memory (the same "
            f"batch rerun, nothing lost). {err.message}")) from err


def train_on_batch(model: keras.Model, base: Callable, *args: Any, **kwargs: Any):
    """``train_on_batch``: one ``train_step`` (one micro-batch with ``accum_steps``; the whole
    batch, split, with ``micro_batch_size``); a non-finite gradient raises
    ``NonFiniteGradientError`` here, as in ``fit``."""
    result = base(*args, **kwargs)
    model.accumulation.raise_if_nonfinite()
    return result


def _compiled_loss(model: keras.Model, x, y, y_pred, sample_weight):
    """The model's loss for one micro-batch, as ``keras.Model.fit`` computes it
    (``compute_loss``); bound to ``model``, the ``loss_of`` of ``summed_loss_gradients``."""
    if y is None and model.loss is not None:
        raise ValueError(
            "`fit` got no labels (`y` is None) but the compiled loss needs them: pass `y` "
            "with array inputs, or make the dataset yield `(x, y)` or `(x, y, "
            "sample_weight)` tuples."
        )
    return compat.compute_loss(model, x=x, y=y, y_pred=y_pred,
                               sample_weight=sample_weight, training=True)


def loss_tracker(model: keras.Model) -> keras.metrics.Mean | None:
    """Keras's own loss tracker (the ``keras.metrics.Mean`` named ``"loss"`` that a compiled
    model's ``metrics`` lists first)."""
    return next((m for m in model.metrics if m.name == "loss"), None)


def train_step(model: keras.Model, base: Callable, data: Any) -> dict:
    """One train step: with ``micro_batch_size`` the whole batch, split into micro-batches
    (``AccumulationState.one_window``: one update); else one micro-batch
    (``AccumulationState.step``), whose gradient ``c_i * grad(L_i)`` goes into the window,
    which closes (one ``optimizer.apply``) on every K-th call. The
    logged loss is the window-true mean (the tracker's total and count grow by ``c_i * L_i``
    and ``c_i`` per micro-batch)."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    if needs_build(model):
        build_on_first_batch(model, x)
    if not model.trainable_variables:  # nothing to train: loss and metrics only, as Keras
        return base(data)
    state = model.accumulation
    size = state.micro_batch_size
    if size is not None:
        n = tf.shape(first_leaf(x))[0]
        state.one_window(model.optimizer, model.trainable_variables, (x, y, sample_weight),
                         size, functools.partial(_micro_batch, model,
                                                 micro_batches=(n + size - 1) // size))
        logs = model.get_metrics_result()
    else:
        out = _micro_batch(model, x, y, sample_weight)
        state.step(out.grads, out.weight, out.samples, model.optimizer,
                   model.trainable_variables, out.undivided)
        logs = model.compute_metrics(x, y, out.y_pred, sample_weight=sample_weight)
    logs.update(state.nonfinite_policy.fit_logs(state))  # what the policy skipped
    if is_loss_scale_optimizer(model.optimizer):  # non-finite windows skipped (overflow)
        logs.setdefault("skipped_windows", state.windows_skipped)
    return logs


def _micro_batch(model: keras.Model, x: Any, y: Any, sample_weight: Any, *,
                 micro_batches: Any = None) -> Any:
    """One micro-batch's forward and backward pass (``summed_loss_gradients``), its loss into
    Keras's loss tracker; in a split batch also its metrics (updated from each micro-batch's
    outputs, as Keras updates them from the batch's: no layer sees more than b samples)."""
    out = _gradients(model, x, y, sample_weight, model.accumulation,
                     micro_batches=micro_batches)
    tracker = loss_tracker(model)
    if tracker is not None:
        tracker.total.assign_add(out.weighted_loss)
        tracker.count.assign_add(out.log_weight)
    if model.accumulation.micro_batch_size is not None:  # a split batch
        model.compute_metrics(x, y, out.y_pred, sample_weight=sample_weight)
    return out


def _gradients(model: keras.Model, x: Any, y: Any, sample_weight: Any, state: Any, *,
               micro_batches: Any = None) -> Any:
    """``summed_loss_gradients`` of one micro-batch with the model's compiled loss, as the
    train step computes it (``state``: the window it goes to, ``None`` for a probe)."""
    return summed_loss_gradients(
        model, functools.partial(_compiled_loss, model), x, y, sample_weight,
        normalizer=model.accumulation.weighting, optimizer=model.optimizer, state=state,
        adds_model_losses=type(model).compute_loss is keras.Model.compute_loss,
        micro_batches=micro_batches)


def probe_step(model: keras.Model) -> Callable[[Any, int], float]:
    """``probe(batch, b)`` for ``micro_batch_size="auto"``: one micro-batch's forward and
    backward pass (the model's compiled loss, as the train step computes it) on the first b
    samples of ``batch``, compiled as the train step is; nothing is applied. Returns the sum
    of the gradients (reading it makes the pass run)."""

    def grads_of(x, y, sample_weight):
        return probe_total(_gradients(model, x, y, sample_weight, None).grads)

    step = tf.function(grads_of, jit_compile=getattr(model, "jit_compile", False) is True)

    def probe(batch: Any, size: int) -> float:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        return float(step(*take((x, y, sample_weight), 0, size)))

    return probe


def flush(model: keras.Model) -> bool:
    """Apply ``model``'s pending partial window now, with its true weight (no-op when empty).
    Returns whether an optimizer update was applied."""
    return model.accumulation.flush(model.optimizer, model.trainable_variables)


def end_epoch(model: keras.Model, epoch: int | None = None) -> str | None:
    """Apply the ``end_of_epoch`` policy to a pending partial window; returns what was done
    (``AccumulationState.end_epoch``)."""
    state = model.accumulation
    return state.end_epoch(state.settings.end_of_epoch, model.optimizer,
                           model.trainable_variables, epoch)


# ---------------------------------------------------------------------- accumulate
_WARNED_OWN_LOSS: set[type] = set()  # classes warned about (once each)


def _refuse(model: Any) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if type(model).train_step is not keras.Model.train_step:
        raise ValueError(
            f"{type(model).__name__} overrides `train_step`, so accumcore cannot take over "
            "its training step without dropping yours. Call accumcore from your own "
            "`train_step`: `state = accumcore.AccumulationState(K)`, `state.build(model."
            "trainable_variables)` once, then per micro-batch `state.step(grads, weight, "
            "samples, optimizer, variables)` with the "
            "gradients of the micro-batch's summed loss (the API page documents "
            "AccumulationState), or train it with `accumcore.AccumTrainer`."
        )
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        check_optimizer(optimizer)


def _warn_own_compute_loss(model: keras.Model, normalizer: Any) -> None:
    if type(model).compute_loss is keras.Model.compute_loss or normalizer != "auto":
        return
    if type(model) in _WARNED_OWN_LOSS:
        return
    _WARNED_OWN_LOSS.add(type(model))
    warnings.warn(
        f"{type(model).__name__} computes its loss with a `compute_loss` of its own: accumcore "
        "counts what a compiled Keras loss divides by, and weighs a micro-batch by its "
        "number of samples where it cannot see one. That is exact for a mean over samples; "
        "for another mean (tokens, a weight sum) pass `normalizer=` (a callable returning "
        "the micro-batch's count).",
        UserWarning,
        stacklevel=3,
    )


def accumulate(model: keras.Model, accum_steps: int | None = None, *,
               micro_batch_size: int | str | None = None, end_of_epoch: str = "apply",
               nonfinite: str | NonFinitePolicy = "raise",
               normalizer: str | Callable = "auto") -> keras.Model:
    """Give ``model`` exact gradient accumulation in ``fit``, in place, and return it.

    With ``micro_batch_size=b``, ``fit(batch_size=B)`` makes one update per batch, from
    micro-batches of at most b samples inside the train step (B=100, b=32: 32+32+32+4), and
    everything Keras counts in steps counts updates; ``"auto"`` finds b on the device
    (``accumcore._impl.auto_micro_batch``). With ``accum_steps=K``, ``fit`` makes one update
    per K train steps of b (data that comes as micro-batches). Either way the update is the
    large batch's: each micro-batch weighted by what its loss divided it by, every optimizer,
    schedule and EMA advanced once per update. The model keeps its class and methods
    (``generate``, ``model.save`` loadable without accumcore; ``save_weights`` holds a
    pending window).

    Args:
        model: a ``keras.Model`` (Functional, Sequential, a subclass, a KerasHub task) whose
            class does not override ``train_step``; compiled or not (a later ``compile``
            keeps the accumulation).
        accum_steps: K, micro-batches (train steps) per optimizer update (int >= 1).
        micro_batch_size: b, samples per micro-batch inside each train step (int >= 1), or
            ``"auto"``; not with ``accum_steps``. Read as ``model.accumulation.micro_batch_size``.
        end_of_epoch: ``"apply"`` (default), ``"carry"`` or ``"drop"`` for a partial window
            (``accum_steps`` only: with ``micro_batch_size`` every window is one batch).
        nonfinite: ``"raise"`` (default), ``"skip_micro_batch"``, ``"skip_window"`` or a
            :class:`~accumcore.NonFinitePolicy`.
        normalizer: ``"auto"`` (default: what the compiled loss divided by), ``"samples"``,
            ``"sample_weight"`` or a callable ``(x, y, sample_weight) -> item count``.

    Returns:
        ``model`` itself. Called again, it changes the settings (the window must be empty).

    Raises:
        ValueError: for a class that overrides ``train_step`` (use
            :class:`~accumcore.AccumulationState` there), or an optimizer with Keras's own
            ``gradient_accumulation_steps``; for neither way of making up updates, or both.
        TypeError: for anything but a ``keras.Model``.
    """
    given = dict(accum_steps=accum_steps, micro_batch_size=micro_batch_size,
                 end_of_epoch=end_of_epoch, nonfinite=nonfinite, normalizer=normalizer)
    settings.require_a_way(accum_steps, micro_batch_size, "accumulate()")
    if is_accumulating(model):  # again, or an AccumModel
        set_accumulation(model, given)
        return model
    _refuse(model)
    settings.resolve(**{k: v for k, v in given.items() if v is not None})  # checked first
    _warn_own_compute_loss(model, normalizer)
    attach(model, given)
    wrappers = dict(train_step=train_step, make_train_function=make_train_function, fit=fit,
                    compile=compile_counted, train_on_batch=train_on_batch,
                    get_compile_config=_plain_get_compile_config)
    for name in METHODS:
        base = getattr(type(model), name).__get__(model, type(model))
        object.__setattr__(model, name, functools.partial(wrappers[name], model, base))
    if getattr(model, "compiled", False):
        recount(model)
        model.loss = uncounted(model.loss)
    model.train_function = None
    return model


def _plain_get_compile_config(model: keras.Model, base: Callable) -> dict | None:
    config = base()
    return None if config is None else plain_compile_config(config)
