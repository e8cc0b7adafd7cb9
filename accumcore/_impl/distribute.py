"""Several replicas (``tf.distribute``): where each step of the window rule runs, and how the
window is reduced across replicas.

The rule itself (add, close, end) is written once, in ``accumcore._impl.rule``; it asks the state's
:class:`Replicas` (one replica) or :class:`StrategyReplicas` (a strategy) where each step runs
and how the window's status is reduced.

Under a strategy every micro-step runs in *replica context* (inside ``strategy.run``): each
replica adds the gradient of its shard's summed loss ``c_i * L_i`` to its own accumulators
(``ON_READ`` variables, never communicated by a micro-step) and advances its window counter.
It then calls ``merge_call`` **unconditionally**; whether the window is full is decided in
*cross-replica context*, so no ``merge_call`` ever sits inside a replica-context ``cond``
(TensorFlow refuses that: "merge_call called while defining a new graph").

When the window is full (a ``tf.cond`` in cross-replica context), ``accumcore._impl.rule.close``
closes it, asking :class:`StrategyReplicas` for two steps:

1. every replica reports its status ``[weight, poisoned, samples, non-finite]``, stacked
   as one float32 vector (:meth:`StrategyReplicas.reduce_window`);
2. **one** batched all-reduce (SUM) gives the global window weight ``W = sum_i c_i`` and flags
   (when the optimizer clips gradients, the window's gradient sums travel in the same batch);
3. unless the window is skipped, the optimizer update runs once, back in replica context
   (:meth:`StrategyReplicas.on_replicas`, not inside a replica-context ``cond``), on
   ``acc_r / W``. A Keras 3 TensorFlow optimizer all-reduces (SUM) its gradients itself there,
   so the replicas' ``acc_r / W`` add up to the large-batch gradient ``sum_r acc_r / W``: the
   window's gradients cross the replicas exactly once.

Why not apply in cross-replica context: Keras's TensorFlow optimizer routes its update through
``maybe_merge_call``, which calls ``get_replica_context().merge_call`` and fails there (the
replica context is ``None``) for every strategy that uses merge calls (all but XLA on GPUs).

Gradient clipping: Keras clips *before* its all-reduce, i.e. per replica. For an optimizer
with ``clipnorm``, ``clipvalue`` or ``global_clipnorm`` the window's gradient sums are therefore
reduced with the status (still one batch of accumcore's), replica 0 passes the global mean
gradient and the others zeros: Keras clips the true large-batch gradient and its all-reduce adds
exact zeros. That costs one more gradient-sized all-reduce per window
(the book's Reference page on multiple devices).

Mixed precision under a strategy: the window's finiteness is part of the status
reduction (the ``LossScaleOptimizer``'s own cross-replica check would read only the first
replica's share), the update applies the unscaled gradient with the inner optimizer and the
loss scale follows ``LossScaleOptimizer``'s rule (``accumcore._impl.loss_scaling``).

No decision in the compiled step is taken in Python on a tensor value (TPUStrategy would
require that, but accumcore has never been run on a TPU: not supported).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from accumcore._impl.loss_scaling import inner_optimizer

_SUM = tf.distribute.ReduceOp.SUM
_CLIP_ATTRIBUTES = ("clipnorm", "clipvalue", "global_clipnorm")


def optimizer_clips(optimizer: keras.optimizers.Optimizer) -> bool:
    """Whether the (inner) optimizer clips gradients (``clipnorm``/``clipvalue``/global)."""
    inner = inner_optimizer(optimizer)
    return any(getattr(inner, name, None) is not None for name in _CLIP_ATTRIBUTES)


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


# ---------------------------------------------------------------------------- the window
_ON_READ = tf.VariableSynchronization.ON_READ


class Replicas:
    """Where the window rule's steps run: one replica.

    Everything runs where it is called and nothing is communicated; the state closes its
    window itself. :class:`StrategyReplicas` is the same interface under a ``tf.distribute``
    strategy, with its own close.
    """

    strategy: tf.distribute.Strategy | None = None
    distributed = False

    def placement(self, summed: bool) -> dict:
        """``tf.Variable`` keywords for a state variable (none with one replica)."""
        return {}

    def require_replica_context(self) -> None:
        """Raise unless a micro-step may run here (always may, with one replica)."""
        return None  # a body besides the docstring: AutoGraph cannot convert an empty one

    def parts(self, variable: tf.Variable) -> tuple:
        """The copies of a state variable that an update here must write."""
        return (variable,)

    def first(self, value: Any) -> Any:
        """A reduced (or replicated) value as one tensor, in the decision context."""
        return value

    def decide(self, fn: Callable[[], tf.Tensor], key: Any = None) -> tf.Tensor:
        """Run ``fn`` (a window decision) where it may read every replica; ``key`` caches it."""
        return fn()

    def forget(self) -> None:
        """Drop compiled decisions (the state re-created its accumulators); none here."""
        return None  # a body besides the docstring, which AutoGraph can convert

    def reduce_window(self, window, accumulated: list, check: Callable, optimizer) -> tuple:
        """The window's status for its close: ``(weight, poisoned, samples, nonfinite,
        sums)``, with ``nonfinite = check(the values of the accumulators it reads,
        accumulated)`` and ``sums`` what :meth:`on_replicas` passes to the update (none: it
        reads the accumulators)."""
        nonfinite = check([a.value() for a in accumulated])
        return window.weight.value(), window.poisoned.value(), window.samples.value(), \
            nonfinite, []

    def on_replicas(self, update: Callable, sums: list) -> tf.Tensor:
        """Run ``update(*sums)`` (the window's one update) where the optimizer may apply."""
        return update(*sums)


class StrategyReplicas(Replicas):
    """:class:`Replicas` under a ``tf.distribute`` strategy (see the module docstring)."""

    distributed = True

    def __init__(self, strategy: tf.distribute.Strategy) -> None:
        self.strategy = strategy
        self._functions: dict = {}  # compiled cross-replica decisions (a flush from Python)

    def placement(self, summed: bool) -> dict:
        """One local copy per replica, read as their sum (``summed``) or the first one's."""
        first = tf.VariableAggregation.ONLY_FIRST_REPLICA
        aggregation = tf.VariableAggregation.SUM if summed else first
        return dict(synchronization=_ON_READ, aggregation=aggregation)

    def require_replica_context(self) -> None:
        if not in_replica_context():
            raise RuntimeError(
                "This AccumulationState was built under a tf.distribute strategy, so its "
                "micro-steps must run in replica context: call `state.step(...)` inside "
                "`strategy.run(fn, args=...)` (AccumTrainer and AccumModel.fit do this)."
            )

    def parts(self, variable: tf.Variable) -> tuple:
        """This replica's copy in replica context; every local copy in cross-replica context
        (written without reading the aggregate)."""
        return (variable,) if in_replica_context() else local_values(self.strategy, variable)

    def first(self, value: Any) -> Any:
        return local_values(self.strategy, value)[0]

    def decide(self, fn: Callable[[], tf.Tensor], key: Any = None) -> tf.Tensor:
        """Cross-replica context: an unconditional ``merge_call`` from replica context (never
        inside a replica-context ``cond``), or a compiled function from Python."""
        if in_replica_context():
            return tf.distribute.get_replica_context().merge_call(lambda _strategy: fn())
        if key not in self._functions:
            self._functions[key] = tf.function(fn)
        with self.strategy.scope():
            return self._functions[key]()

    def forget(self) -> None:
        self._functions.clear()

    def reduce_window(self, window, accumulated: list, check: Callable, optimizer) -> tuple:
        """The module docstring's steps 1-2: every replica's status, one batched all-reduce
        (``accumulated``: the accumulators the close reads, ``rule.window_sums``)."""
        prereduce = optimizer_clips(optimizer)  # gradient sums travel with the status

        def local_status() -> list:
            sums = [a.read_value() for a in accumulated]
            counts = [window.weight.read_value(), window.poisoned.read_value(),
                      window.samples.read_value()]
            status = tf.stack([*(tf.cast(c, tf.float32) for c in counts), check(sums)])
            return [status, *(sums if prereduce else [])]

        per_replica = self.strategy.run(local_status)
        reduced = self.strategy.extended.batch_reduce_to(_SUM, [(v, v) for v in per_replica])
        status = self.first(reduced[0])
        return status[0], status[1], status[2], status[3], reduced[1:]

    def on_replicas(self, update: Callable, sums: list) -> tf.Tensor:
        """Step 3: ``update`` back in replica context; with reduced ``sums`` (clipping),
        replica 0 passes the global sums and the others exact zeros."""
        def on_replica(*shares) -> tf.Tensor:
            first = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
            return update(*[tf.where(first, s, tf.zeros_like(s)) for s in shares])

        return self.first(self.strategy.run(on_replica, args=tuple(sums)))


_ONE_REPLICA = Replicas()


def replicas(strategy: tf.distribute.Strategy | None) -> Replicas:
    """The :class:`Replicas` for a state built under ``strategy`` (``None``: no strategy)."""
    return _ONE_REPLICA if strategy is None else StrategyReplicas(strategy)


# ---------------------------------------------------------------------------- loops
def run_micro_step(strategy: tf.distribute.Strategy, fn: Callable, x, y, sample_weight):
    """``strategy.run(fn, (x, y, sample_weight))`` and :func:`combine_local` of its outputs."""
    loss, weight, applied = strategy.run(fn, args=(x, y, sample_weight))
    return combine_local(strategy, loss, weight, applied)


def replicas_in_sync(strategy: tf.distribute.Strategy | None) -> int:
    """The replicas a global batch is shared by (1 without a strategy)."""
    return 1 if strategy is None else int(strategy.num_replicas_in_sync)


def smallest_everywhere(strategy: tf.distribute.Strategy | None, value: int) -> int:
    """The smallest ``value`` over every replica of every worker: one all-gather under a
    strategy (every worker must call it at the same point), ``value`` itself without one."""
    if strategy is None:
        return value
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda _: tf.constant([float(value)]))
    return int(tf.reduce_min(strategy.gather(per_replica, axis=0)).numpy())


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
