"""Several replicas (``tf.distribute``) and mixed precision for the accumulation state.

Under a strategy every micro-step runs in *replica context* (inside ``strategy.run``): each
replica adds the gradient of its shard's summed loss ``c_i * L_i`` to its own accumulators
(``ON_READ`` variables, never communicated by a micro-step) and advances its window counter.
It then calls ``merge_call`` **unconditionally**; whether the window is full is decided in
*cross-replica context*, so no ``merge_call`` ever sits inside a replica-context ``cond``
(TensorFlow refuses that: "merge_call called while defining a new graph").

When the window is full (a ``tf.cond`` in cross-replica context), :func:`close_window` runs:

1. every replica reports its status ``[window weight, poisoned, frozen(, non-finite)]``;
2. **one** batched all-reduce (SUM) gives the global window weight ``W = sum_i c_i`` and flags
   (when the optimizer clips gradients, the window's gradient sums travel in the same batch);
3. unless the window is skipped, the optimizer update runs once, back in replica context
   (``strategy.run``, not inside a replica-context ``cond``), on ``acc_r / W``. A Keras 3
   TensorFlow optimizer all-reduces (SUM) its gradients itself there, so the replicas'
   ``acc_r / W`` add up to the large-batch gradient ``sum_r acc_r / W``: the window's
   gradients cross the replicas exactly once.

Why not apply in cross-replica context: Keras's TensorFlow optimizer routes its update through
``maybe_merge_call``, which calls ``get_replica_context().merge_call`` and fails there (the
replica context is ``None``) for every strategy that uses merge calls (all but XLA on GPUs).

Gradient clipping: Keras clips *before* its all-reduce, i.e. per replica. For an optimizer
with ``clipnorm``, ``clipvalue`` or ``global_clipnorm`` the window's gradient sums are therefore
reduced with the status (still one batch of accumcore's), replica 0 passes the global mean
gradient and the others zeros: Keras clips the true large-batch gradient and its all-reduce adds
exact zeros. That costs one more gradient-sized all-reduce per window (see the README).

Mixed precision: with a :class:`keras.optimizers.LossScaleOptimizer` every micro-batch loss is
multiplied by the current loss scale (:func:`accumcore.core.summed_loss_gradients`), gradients
are accumulated in float32, and at window close :func:`apply_update` unscales once and checks
finiteness once. A non-finite window is skipped whole (counted in ``windows_skipped``, its
samples in ``samples_dropped``), the loss scale is halved and the next window starts from
zero. The per-micro-batch ``nonfinite`` policy is not applied under loss scaling: overflow is
what loss scaling expects and handles per window.

No decision in the compiled step is taken in Python on a tensor value, so the same graph is
valid for TPUStrategy (untested here: no TPU).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

_SUM = tf.distribute.ReduceOp.SUM
_CLIP_ATTRIBUTES = ("clipnorm", "clipvalue", "global_clipnorm")

#: Per-state cache of compiled cross-replica functions (flush), keyed by optimizer identity.
_FUNCTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ---------------------------------------------------------------------------- optimizers
def is_loss_scale_optimizer(optimizer: Any) -> bool:
    """True for a :class:`keras.optimizers.LossScaleOptimizer` (dynamic loss scaling)."""
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def inner_optimizer(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """The optimizer that updates the variables (the inner one of a LossScaleOptimizer)."""
    return optimizer.inner_optimizer if is_loss_scale_optimizer(optimizer) else optimizer


def optimizer_clips(optimizer: keras.optimizers.Optimizer) -> bool:
    """Whether the (inner) optimizer clips gradients (``clipnorm``/``clipvalue``/global)."""
    inner = inner_optimizer(optimizer)
    return any(getattr(inner, name, None) is not None for name in _CLIP_ATTRIBUTES)


def loss_scale(optimizer: keras.optimizers.Optimizer) -> float:
    """The current loss scale (1.0 without a LossScaleOptimizer); reads a variable."""
    if not is_loss_scale_optimizer(optimizer):
        return 1.0
    if not optimizer.built:
        return float(optimizer.initial_scale)
    return float(tf.convert_to_tensor(optimizer.dynamic_scale).numpy())


def _all_finite(tensors: Sequence) -> tf.Tensor:
    """bool scalar: every element of every (dense or IndexedSlices) tensor is finite."""
    flags = [
        tf.reduce_all(tf.math.is_finite(t.values if isinstance(t, tf.IndexedSlices) else t))
        for t in tensors
        if t is not None
    ]
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


def _lower_scale(optimizer: keras.optimizers.LossScaleOptimizer) -> tf.Tensor:
    """Halve the loss scale and restart the growth counter (as LossScaleOptimizer does)."""
    optimizer.step_counter.assign(tf.zeros_like(optimizer.step_counter))
    optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 0.5)
    return tf.constant(False)


def _grow_scale(optimizer: keras.optimizers.LossScaleOptimizer) -> None:
    """After a finite window: count it; double the scale every ``dynamic_growth_steps``."""
    counter = optimizer.step_counter

    def upscale() -> tf.Tensor:
        counter.assign(tf.zeros_like(counter))
        optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 2.0)
        return tf.constant(True)

    def increment() -> tf.Tensor:
        counter.assign_add(tf.ones_like(counter))
        return tf.constant(False)

    due = tf.equal(
        tf.convert_to_tensor(counter),
        tf.cast(optimizer.dynamic_growth_steps - 1, tf.convert_to_tensor(counter).dtype),
    )
    tf.cond(due, upscale, increment)


def _unscaled(optimizer: keras.optimizers.Optimizer, grads: Sequence) -> list:
    """``grads / loss_scale`` (the one unscale of a window); unchanged without loss scaling."""
    if not is_loss_scale_optimizer(optimizer):
        return list(grads)
    scale = tf.convert_to_tensor(optimizer.dynamic_scale)
    return [None if g is None else g / tf.cast(scale, g.dtype) for g in grads]


def apply_update(
    optimizer: keras.optimizers.Optimizer, grads: Sequence, variables: Sequence
) -> tf.Tensor:
    """One optimizer update from the window's mean gradients (single replica). Graph-safe.

    Args:
        optimizer: a Keras optimizer, possibly a ``LossScaleOptimizer``.
        grads: the window's mean gradients ``sum_i c_i grad(L_i) / sum_i c_i`` (times the loss
            scale under a LossScaleOptimizer), one per variable, ``None`` allowed.
        variables: the trainable variables.

    Returns:
        bool scalar: ``True`` if the update was applied, ``False`` if a loss-scaled window was
        not finite (then the loss scale was halved and nothing else changed).
    """
    if not is_loss_scale_optimizer(optimizer):
        optimizer.apply(grads, variables)
        return tf.constant(True)
    if not optimizer.built:
        optimizer.build(variables)

    def finite_window() -> tf.Tensor:
        optimizer.inner_optimizer.apply(_unscaled(optimizer, grads), variables)
        _grow_scale(optimizer)
        return tf.constant(True)

    return tf.cond(_all_finite(grads), finite_window, lambda: _lower_scale(optimizer))


# ---------------------------------------------------------------------------- contexts
def in_replica_context() -> bool:
    """True inside ``strategy.run`` of a (non-default) strategy."""
    return tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()


def model_strategy(model: keras.Model) -> tf.distribute.Strategy | None:
    """The strategy ``model`` was created under, or ``None`` for the default strategy."""
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is None:
        return None
    with strategy.scope():
        return strategy if tf.distribute.has_strategy() else None


def local_values(strategy: tf.distribute.Strategy, value: Any) -> tuple:
    """This worker's per-replica components of a distributed value or variable."""
    return strategy.experimental_local_results(value)


def combine_local(strategy: tf.distribute.Strategy, loss, weight, applied):
    """Combine one micro-step's per-replica outputs on this worker, without communication.

    Returns ``(loss, weight, applied)``: the weight-averaged mean loss and the total weight
    of this worker's shards (float32 scalars), and whether the window was applied (the same on
    every replica). Under MultiWorkerMirroredStrategy these cover this worker's replicas only.
    """
    losses = local_values(strategy, loss)
    weights = local_values(strategy, weight)
    total = tf.add_n([tf.cast(w, tf.float32) for w in weights])
    summed = tf.add_n([
        tf.reduce_sum(tf.cast(a, tf.float32)) * tf.cast(w, tf.float32)
        for a, w in zip(losses, weights, strict=True)
    ])
    return tf.math.divide_no_nan(summed, total), total, local_values(strategy, applied)[0]


def max_local(state, variable: tf.Variable) -> tuple[int, int]:
    """``(value, replica index)`` of the largest local component of an int counter."""
    strategy = state.strategy
    if strategy is None:
        return int(variable.numpy()), 0
    values = [int(v.numpy()) for v in local_values(strategy, variable)]
    best = max(range(len(values)), key=values.__getitem__)
    return values[best], best


def component(state, variable: tf.Variable, index: int) -> int:
    """The value of one local replica's component of an int variable (Python side)."""
    if state.strategy is None:
        return int(variable.numpy())
    return int(local_values(state.strategy, variable)[index].numpy())


def _require_replica_context(state) -> tf.distribute.ReplicaContext:
    if not in_replica_context():
        raise RuntimeError(
            "This AccumulationState was built under a tf.distribute strategy, so its "
            "micro-steps must run in replica context: call `state.step(...)` inside "
            "`strategy.run(fn, args=...)` (AccumTrainer and AccumModel.fit do this)."
        )
    return tf.distribute.get_replica_context()


# ---------------------------------------------------------------------------- the window
def _components(state, variable: tf.Variable) -> tuple:
    return local_values(state.strategy, variable)


def reset_components(state) -> None:
    """Empty the window on every local replica, in cross-replica context, reading nothing."""
    window = [*state.accumulators, state.window_weight, state.window_samples, state.micro_step,
              state.window_poisoned]
    for variable in window:
        for part in _components(state, variable):
            part.assign(tf.zeros(part.shape, part.dtype))


def _finish(state, applied: tf.Tensor) -> tf.Tensor:
    """Cross-replica book-keeping of a closed window: counters, hooks, reset."""

    def done() -> tf.Tensor:
        for part in _components(state, state.windows_applied):
            part.assign_add(tf.ones((), part.dtype))
        state._run_hooks(True)
        reset_components(state)
        return tf.constant(True)

    def skipped() -> tf.Tensor:
        for part in _components(state, state.windows_skipped):
            part.assign_add(tf.ones((), part.dtype))
        drop_window(state)  # count the samples as dropped, run the hooks, empty the window
        return tf.constant(False)

    return tf.cond(applied, done, skipped)


def _close(strategy, state, optimizer, variables: list) -> tf.Tensor:
    """Close a non-empty window (cross-replica context): one reduction, at most one update."""
    scaled = is_loss_scale_optimizer(optimizer)
    prereduce = optimizer_clips(optimizer)
    present = [i for i, has in enumerate(state._has_gradient) if has]

    def status() -> list:
        """Replica context: local status (and, when clipping, the local gradient sums)."""
        flags = [
            tf.cast(state.window_weight.read_value(), tf.float32),
            tf.cast(state.window_poisoned.read_value() > 0, tf.float32),
            tf.cast(state.frozen, tf.float32),
        ]
        if scaled:  # the one finiteness check of the window, on the local sums
            sums = [state.accumulators[i].read_value() for i in present]
            flags.append(tf.cast(tf.logical_not(_all_finite(sums)), tf.float32))
        local = [tf.stack(flags)]
        if prereduce:
            local += [state.accumulators[i].read_value() for i in present]
        return local

    per_replica = strategy.run(status)
    # THE reduction of the window: one batch, SUM over all replicas (all workers).
    reduced = strategy.extended.batch_reduce_to(_SUM, [(v, v) for v in per_replica])
    totals = local_values(strategy, reduced[0])[0]
    frozen = totals[2] > 0
    skip = totals[1] > 0
    if scaled:
        skip = tf.logical_or(skip, totals[3] > 0)
    target = inner_optimizer(optimizer)

    def replica_update(status_sum, *global_sums) -> tf.Tensor:
        """Replica context, outside any replica-context cond: the one optimizer update."""
        weight = status_sum[0]
        sums = iter(global_sums)
        first = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
        grads = []
        for i, acc in enumerate(state.accumulators):
            if i not in present:
                grads.append(None)
                continue
            if prereduce:  # replica 0 carries the global mean, the others exact zeros
                total = next(sums)
                total = tf.where(first, total, tf.zeros_like(total))
            else:  # this replica's share of the global mean: Keras's all-reduce adds them up
                total = acc.read_value()
            grads.append(tf.math.divide_no_nan(total, tf.cast(weight, total.dtype)))
        grads = _unscaled(optimizer, grads)
        grads = [
            None if g is None else tf.cast(g, tf.as_dtype(getattr(v, "dtype", g.dtype)))
            for g, v in zip(grads, variables, strict=True)
        ]
        target.apply(grads, variables)
        return tf.constant(True)

    def update() -> tf.Tensor:
        strategy.run(replica_update, args=tuple(reduced))
        if scaled:
            _grow_scale(optimizer)
        return tf.constant(True)

    def skip_window() -> tf.Tensor:
        if scaled:
            tf.cond(totals[3] > 0, lambda: _lower_scale(optimizer), lambda: tf.constant(False))
        return tf.constant(False)

    def closable() -> tf.Tensor:
        applied = tf.cond(skip, skip_window, update)
        return _finish(state, applied)

    # A replica frozen by nonfinite="raise" keeps the window open (the Python side raises).
    return tf.cond(frozen, lambda: tf.constant(False), closable)


def _close_if_due(strategy, *, state, optimizer, variables: list, force: bool) -> tf.Tensor:
    """Cross-replica decision (no merge_call inside a replica cond): close the window if due.

    ``force=False``: close when it holds K micro-batches (a micro-step); ``force=True``: close
    any non-empty window (a flush). Returns a bool scalar: whether an update was applied.
    """
    micro = local_values(strategy, state.micro_step)[0]
    due = micro > 0 if force else micro >= state.accum_steps
    return tf.cond(
        due, lambda: _close(strategy, state, optimizer, variables), lambda: tf.constant(False)
    )


def replica_step(state, optimizer, variables: Sequence) -> tf.Tensor:
    """The end of one micro-step under a strategy (after ``state.accumulate``).

    Advances the window counters on this replica (every replica advances in lockstep, also a
    replica whose shard was empty or skipped) and hands the window decision to cross-replica
    context with an unconditional ``merge_call``.
    """
    ctx = _require_replica_context(state)
    state.micro_batches_seen.assign_add(1)
    state.micro_step.assign_add(1)
    decide = functools.partial(
        _close_if_due, state=state, optimizer=optimizer, variables=list(variables), force=False
    )
    return ctx.merge_call(decide)


def close_window(state, optimizer, variables: Sequence) -> tf.Tensor:
    """Apply the pending window now (a flush), from replica or cross-replica context."""
    decide = functools.partial(
        _close_if_due, state=state, optimizer=optimizer, variables=list(variables), force=True
    )
    if in_replica_context():
        return tf.distribute.get_replica_context().merge_call(decide)
    strategy = state.strategy
    cache = _FUNCTIONS.setdefault(state, {})
    key = ("flush", id(optimizer), tuple(id(v) for v in variables))
    if key not in cache:
        cache[key] = tf.function(lambda: decide(strategy))
    with strategy.scope():
        return cache[key]()


def drop_window(state) -> None:
    """Discard the pending window on every local replica (cross-replica context)."""
    for dropped, pending in zip(
        _components(state, state.samples_dropped),
        _components(state, state.window_samples),
        strict=True,
    ):
        dropped.assign_add(pending.read_value())
    state._run_hooks(False)
    reset_components(state)


# ---------------------------------------------------------------------------- devices, counting
def replica_devices(count: int = 2) -> list[str]:
    """``count`` devices for a MirroredStrategy: real GPUs if there are enough, else logical CPUs.

    Splitting the CPU into ``count`` logical devices must happen before TensorFlow initialises
    its devices (before the first op): call this first thing after ``import tensorflow``.

    Raises:
        RuntimeError: if TensorFlow already initialised its devices with fewer logical CPUs.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= count:
        return [f"/gpu:{i}" for i in range(count)]
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * count
        )
    except RuntimeError as err:
        if len(tf.config.list_logical_devices("CPU")) < count:
            raise RuntimeError(
                f"TensorFlow already initialised its devices, so the CPU cannot be split into "
                f"{count} logical devices any more: call `replica_devices({count})` right after "
                "`import tensorflow`, before any TensorFlow op (restart the kernel/process)."
            ) from err
    return [f"/cpu:{i}" for i in range(count)]


class CountingCrossDeviceOps(tf.distribute.ReductionToOneDevice):
    """Cross-device ops that record every reduction a strategy performs (Python side).

    Pass it as ``tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)``. Run eagerly
    (inside ``tf.function`` the Python side runs once per trace, not once per call).

    Attributes:
        batches: number of values in each batched reduction, in order.
        singles: reductions issued outside a batch (``strategy.reduce``, reading a SUM
            variable in cross-replica context).
    """

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []
        self.singles = 0
        self._depth = 0

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        self.batches.append(len(value_destination_pairs))
        self._depth += 1
        try:
            return super().batch_reduce_implementation(
                reduce_op, value_destination_pairs, options
            )
        finally:
            self._depth -= 1

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        if not self._depth:
            self.singles += 1
        return super().reduce_implementation(reduce_op, per_replica_value, destinations, options)


# ---------------------------------------------------------------------------- loops
def run_micro_step(strategy: tf.distribute.Strategy, fn: Callable, x, y, sample_weight):
    """``strategy.run(fn, (x, y, sample_weight))`` and :func:`combine_local` of its outputs."""
    loss, weight, applied = strategy.run(fn, args=(x, y, sample_weight))
    return combine_local(strategy, loss, weight, applied)


def first_local(strategy: tf.distribute.Strategy | None, x: Any) -> Any:
    """The first local replica's part of a (possibly distributed) nested input."""
    if strategy is None:
        return x
    return tf.nest.map_structure(
        lambda v: local_values(strategy, v)[0] if v is not None else None, x
    )


def distribute_dataset(strategy: tf.distribute.Strategy, dataset: tf.data.Dataset):
    """Split each global micro-batch of ``dataset`` across the replicas (may be ragged)."""
    return strategy.experimental_distribute_dataset(dataset)


def forget_functions(state) -> None:
    """Drop the compiled cross-replica functions of ``state`` (its accumulators were re-created
    for a new trainable set; the old functions captured the old ones)."""
    _FUNCTIONS.pop(state, None)
