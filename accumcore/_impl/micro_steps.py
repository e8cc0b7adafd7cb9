"""The steps :class:`~accumcore.Trainer` runs, eagerly or inside its ``tf.function`` s.

* :func:`loss_of`: the loss the trainer differentiates, its counted loss plus the model's
  regularisation losses (``model.losses``).
* :func:`micro_step`: one micro-batch on one replica: the gradient of its summed loss
  (``accumcore._impl.gradients.summed_loss_gradients``) into the window, the window applied if due
  (``AccumulationState.step``). :func:`compile_micro_step` compiles it with the batch
  dimension unknown, so that a ragged last micro-batch does not retrace.
* :func:`split_window`: the body of :meth:`Trainer.window_step
  <accumcore.Trainer.window_step>`: one large batch cut into K micro-batches inside the
  graph (a ``tf.while_loop``, so only one micro-batch's activations are alive at a time),
  accumulated and applied once; :func:`check_window_step` and :func:`ragged_under_xla` decide
  whether and how it may run.

The trainer passes what it keeps to itself (its loss function, its resolved normaliser); the
rest is read from its public attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import keras
import numpy as np
import tensorflow as tf

from accumcore._impl.gradients import first_leaf, replica_loss_factor, summed_loss_gradients
from accumcore._impl.state import AccumulationState


class Trainer(Protocol):
    """What the steps and the epoch loop read of an :class:`~accumcore.AccumTrainer`."""

    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    state: AccumulationState
    accum_steps: int
    jit_compile: bool
    end_of_epoch: str
    epoch: int

    def end_epoch(self) -> str | None: ...

    def run_micro_batches(self, batches: Any, *, compiled: bool = False,
                          check_each: bool = True,
                          after: Callable[[int, tuple], None] | None = None) -> list[tuple]: ...


def _batch_relaxed_specs(structure: Any) -> Any:
    """``tf.TensorSpec`` s for a micro-batch with the batch (first) dimension unknown.

    Returns ``None`` if a leaf is neither a tensor nor a numpy array (then no spec is forced).
    """
    leaves = [t for t in tf.nest.flatten(structure) if t is not None]
    if not all(isinstance(t, (tf.Tensor, np.ndarray)) and len(t.shape) >= 1 for t in leaves):
        return None
    return tf.nest.map_structure(
        lambda t: None if t is None else tf.TensorSpec([None, *t.shape[1:]], tf.as_dtype(t.dtype)),
        structure,
    )


# ---------------------------------------------------------------------------- one micro-batch
def loss_of(counted_loss: Callable | None, model: keras.Model, x: Any, y: Any, y_pred: Any,
            sample_weight: Any) -> tf.Tensor:
    """The micro-batch's loss (scalar, loss units): ``counted_loss(y, y_pred,
    sample_weight)`` (a ``CountedLoss``, which records what it
    divides by; ``None``: no such loss) plus ``model.losses``, each summed as Keras sums them.
    ``x`` is unused; bound to its first two arguments, this is the ``loss_of`` of
    ``summed_loss_gradients``."""
    if counted_loss is None:
        if not model.losses:
            raise ValueError(
                "AccumTrainer was given `loss=None` but the model adds no losses of its own "
                "(`model.losses` is empty): pass `loss`, or `add_loss` in the model.")
        return tf.add_n([tf.reduce_sum(tf.cast(v, tf.float32)) for v in model.losses]
                        ) / replica_loss_factor()
    if y is None:
        raise ValueError(
            "`dataset` yields no labels (y), but the loss needs them: make it yield "
            "`(x, y)` or `(x, y, sample_weight)` tuples."
        )
    loss = counted_loss(y, y_pred, sample_weight)
    if model.losses:
        # Keras divides the loss by the replicas in sync; so does this, as
        # summed_loss_gradients multiplies the sum back (replica_loss_factor). Each entry is
        # summed (Keras's `_aggregate_additional_loss`): a per-sample `add_loss` is a vector.
        regularization = tf.add_n([tf.reduce_sum(tf.cast(v, loss.dtype)) for v in model.losses])
        loss = loss + regularization / replica_loss_factor()
    return loss


def micro_step(trainer: Trainer, loss: Callable, normalizer: Any, x: Any, y: Any = None,
               sample_weight: Any = None) -> tuple:
    """One micro-batch of ``trainer`` on one replica, with its ``loss`` (a bound
    :func:`loss_of`) and its resolved ``normalizer`` (``resolve_normalizer``).

    Returns:
        ``(mean_loss, weight, applied)``, float32, float32 and bool scalar tensors.
    """
    out = summed_loss_gradients(
        trainer.model, loss, x, y, sample_weight,
        normalizer=normalizer, optimizer=trainer.optimizer, state=trainer.state,
    )
    applied = trainer.state.step(
        out.grads, out.weight, out.samples, trainer.optimizer, trainer.model.trainable_variables
    )
    return out.loss, out.log_weight, applied


def compile_micro_step(step: Callable, example: tuple, jit_compile: bool) -> Callable:
    """``tf.function(step)``, traced once for micro-batches shaped like ``example``
    (``(x, y, sample_weight)``) with the batch dimension unknown, so that a ragged (smaller)
    last micro-batch reuses this trace instead of retracing."""
    compiled = tf.function(step, reduce_retracing=True, jit_compile=jit_compile)
    specs = _batch_relaxed_specs(example)
    if specs is not None:
        compiled.get_concrete_function(*specs)
    return compiled


# ---------------------------------------------------------------------------- one window, in graph
def split_window(trainer: Trainer, loss: Callable, normalizer: Any, x: Any, y: Any,
                 sample_weight: Any) -> tf.Tensor:
    """One window of ``trainer`` from the batch ``x`` (with its ``y`` and ``sample_weight``, or
    ``None``): cut into micro-batches of ``ceil(n / K)`` samples (the last may be smaller),
    each accumulated as :func:`micro_step` does, then applied once. Traced, not eager.

    Returns:
        The mean loss over the batch, ``sum c_i L_i / sum c_i`` (float32 scalar tensor).
    """
    k = trainer.accum_steps
    n = tf.shape(first_leaf(x))[0]
    size = (n + k - 1) // k  # ceil(n / K): the last micro-batch may be smaller

    def take(t, start):
        return None if t is None else tf.nest.map_structure(
            lambda a: a[start : start + size], t
        )

    count = (n + size - 1) // size  # number of non-empty micro-batches (<= K)
    total_loss = tf.constant(0.0)
    total_weight = tf.constant(0.0)
    for i in tf.range(count):  # autograph: a tf.while_loop; one micro-batch alive at a time
        start = i * size
        xi, yi, wi = take(x, start), take(y, start), take(sample_weight, start)
        out = summed_loss_gradients(
            trainer.model, loss, xi, yi, wi, normalizer=normalizer, optimizer=trainer.optimizer,
            state=trainer.state,
        )
        trainer.state.accumulate(out.grads, out.weight, out.samples, trainer.optimizer)
        total_loss += out.weighted_loss
        total_weight += out.log_weight
    trainer.state.apply_window(trainer.optimizer)
    return tf.math.divide_no_nan(total_loss, total_weight)


def check_window_step(trainer: Trainer, distributed: bool) -> None:
    """Refuse a ``window_step`` under a ``tf.distribute`` strategy (``distributed``) or on a
    pending window (it must start on an empty window, as it closes the window it opens)."""
    if distributed:
        raise NotImplementedError(
            "`window_step` splits one batch on one device; under a tf.distribute strategy "
            "use `trainer.fit(dataset_of_micro_batches)` (or `train_micro_batch`), which "
            "splits every micro-batch across the replicas."
        )
    if int(trainer.state.micro_step.numpy()) != 0:
        raise ValueError(
            "`window_step` needs an empty window, but a partial window is pending from "
            "micro-batch training: call `trainer.flush()` first."
        )


def ragged_under_xla(trainer: Trainer, x: Any) -> bool:
    """Whether the batch ``x`` must run without XLA: ``trainer`` compiles with XLA and K does
    not divide the batch size (or it is unknown). XLA clamps an out-of-range slice to its
    static size, so a smaller last micro-batch would silently re-read samples of the one before
    it (tests/test_benchmarks.py holds this)."""
    n = first_leaf(x).shape[0]
    return trainer.jit_compile and (n is None or n % trainer.accum_steps != 0)
