"""One micro-batch's contribution: the gradient of its summed loss and its weight.

Shared by the loops (``accumcore._impl.trainer``) and the Keras integration
(``accumcore._impl.accum_model``), so all three entry points compute exactly the same thing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from accumcore._impl.denominators import (
    loss_weights,
    read_forms,
    recording,
    regularization_count,
    resolve_loss,
)

#: The models whose micro-batches were differentiated eagerly at least once (``_persistent``).
_SEEN_EAGERLY: weakref.WeakSet = weakref.WeakSet()


def _persistent(model: keras.Model) -> bool:
    """Whether the micro-batch's tape must allow two backward passes (the second for the sums
    over samples beside a mean loss, ``LossWeights.undivided``). In a graph that costs nothing
    (the executor frees each tensor after its last use either way). Eagerly a persistent tape
    keeps the forward pass's tensors until both passes end, so it is used only for a model's
    first micro-batch and where its last call added losses (``model.losses`` beyond the weight
    regularisers)."""
    if not tf.executing_eagerly():
        return True
    try:
        if model not in _SEEN_EAGERLY:
            _SEEN_EAGERLY.add(model)
            return True
    except TypeError:  # a model that cannot be weakly referenced
        return True
    return len(model.losses) > regularization_count(model)


def first_leaf(x: Any) -> tf.Tensor:
    """The first non-``None`` tensor in a (possibly nested) input structure."""
    for leaf in tf.nest.flatten(x):
        if leaf is not None:
            return leaf
    raise ValueError("The micro-batch `x` has no tensors: the dataset must yield inputs.")


def batch_size_of(x: Any) -> tf.Tensor:
    """Number of samples in a micro-batch (int32 scalar; the leading dimension of ``x``)."""
    return tf.shape(first_leaf(x))[0]


def replica_loss_factor() -> float:
    """Number of replicas in sync when called inside a replica context, else 1.

    Keras losses divide their mean by the number of replicas under ``tf.distribute`` (so that
    summing gradients across replicas gives the global mean). accumcore normalises by the
    global window weight itself, so it multiplies that division back out.
    """
    if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context() is False:
        return float(tf.distribute.get_strategy().num_replicas_in_sync)
    return 1.0


def as_loss_fn(loss: Any) -> keras.losses.Loss:
    """A reducing Keras loss from a loss instance, a string name, or a callable, as
    ``model.compile`` makes it (``accumcore._impl.denominators.resolve_loss``)."""
    if isinstance(loss, str) and loss.lower() in ("crossentropy", "ce"):
        raise ValueError(
            f"`loss`={loss!r} is chosen from the data by `model.compile`; name the loss "
            "instead, e.g. 'sparse_categorical_crossentropy'."
        )
    return resolve_loss(loss)


class MicroBatchResult(NamedTuple):
    """One micro-batch's forward and backward pass (see :func:`summed_loss_gradients`)."""

    loss: tf.Tensor  # the micro-batch's loss as Keras computes it, float32 scalar (for logging)
    grads: list  # gradients of its weighed loss (times the loss scale), one per trainable variable
    weight: tf.Tensor  # c_i, float32 scalar
    samples: tf.Tensor  # number of samples, int32 scalar
    y_pred: Any  # the model's outputs, for metrics
    weighted_loss: tf.Tensor  # log_weight * loss, float32 scalar (the logged mean's numerator)
    log_weight: tf.Tensor  # what the logged mean weighs this micro-batch by (c_i for a mean)
    # gradients of the sums over samples beside a mean loss (times the loss scale), added to
    # the window undivided; None where there are none
    undivided: list | None = None


def _scaled_gradient(grad: Any, factor: tf.Tensor) -> Any:
    """``factor * grad`` for a dense gradient, ``tf.IndexedSlices`` or ``None``."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        values = grad.values * tf.cast(factor, grad.values.dtype)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def _loss_identity(model: keras.Model, loss_of: Callable) -> tuple:
    """What identifies ``loss_of`` across micro-batches (a ``functools.partial`` by its
    function and arguments, a bound method by its function and object), with the model's
    compiled loss."""
    func = getattr(loss_of, "func", None)
    if func is not None:  # a partial
        parts = (func, *map(id, getattr(loss_of, "args", ())))
    elif hasattr(loss_of, "__self__"):  # a bound method: its function and its object
        parts = (loss_of.__func__, id(loss_of.__self__))
    else:
        parts = (id(loss_of),)
    return (*parts, id(getattr(model, "loss", None)))


def _weighed_loss(loss: tf.Tensor, terms: list, weights: Any, weigh_after: bool) -> tf.Tensor:
    """What one micro-batch differentiates: its ``loss`` times ``weights.scale``, plus each
    ``model.losses`` entry (``terms``) times its extra weight; with ``weigh_after`` the loss
    as it is (``c_i`` multiplies the gradients after the backward pass)."""
    extra = [(tf.reduce_sum(tf.cast(terms[i], tf.float32)), e) for i, e in weights.extra]
    if weigh_after:
        return loss + sum(t * tf.math.divide_no_nan(e, weights.weight) for t, e in extra)
    return weights.scale * loss + sum(t * e for t, e in extra)


def _undivided_loss(terms: list, weights: Any, optimizer: Any) -> tf.Tensor | None:
    """The ``model.losses`` entries that enter the window undivided (``weights.undivided``:
    sums over samples beside a mean loss), summed and scaled as the loss is (mixed
    precision); ``None`` where there are none."""
    if not weights.undivided:
        return None
    return optimizer.scale_loss(
        sum(tf.reduce_sum(tf.cast(terms[i], tf.float32)) for i in weights.undivided))


def _weights(model: keras.Model, normalizer: str | Callable, denominators: list, forms: Any,
             batch: tuple, y_pred: Any, samples: tf.Tensor, state: Any,
             replicas: float, micro_batches: Any = None) -> Any:
    """``denominators.loss_weights`` for one micro-batch ``batch`` (``(x, y,
    sample_weight)``) going to ``state`` (``None``: K = 1, the window empty); constants to the
    tape (what could carry a gradient is stopped)."""
    x, y, sample_weight = batch
    if state is None:
        first_in_window, accum_steps = (lambda: tf.constant(True)), 1
    else:
        first_in_window = lambda: tf.equal(state.window_samples, 0)  # noqa: E731
        accum_steps = state.accum_steps if micro_batches is None else micro_batches
    return loss_weights(normalizer, denominators, forms, x, y, sample_weight, y_pred, samples,
                        first_in_window=first_in_window, accum_steps=accum_steps,
                        replicas=replicas, owner=model)


def summed_loss_gradients(
    model: keras.Model,
    loss_of: Callable[[Any, Any, Any, Any], tf.Tensor],
    x: Any,
    y: Any,
    sample_weight: Any,
    *,
    normalizer: str | Callable,
    optimizer: keras.optimizers.Optimizer,
    state: Any = None,
    adds_model_losses: bool = True,
    micro_batches: Any = None,
) -> MicroBatchResult:
    """Forward and backward pass of one micro-batch.

    Args:
        model: the Keras model (built).
        loss_of: ``loss_of(x, y, y_pred, sample_weight)``, the micro-batch's loss as Keras
            computes it (the compiled loss plus ``model.losses``; counted losses report).
        x, y, sample_weight: one micro-batch.
        normalizer: how to weigh it (``denominators.micro_batch_weight``).
        optimizer: for ``optimizer.scale_loss`` (mixed precision) only.
        state: the ``AccumulationState`` it goes to (read for K and an empty window);
            ``None``: K = 1, the window empty.
        adds_model_losses: whether ``loss_of`` adds ``model.losses`` as Keras does: each
            entry is then weighed by its form (``denominators.loss_weights``); ``False`` (an
            own ``compute_loss``): the loss is weighed as one.
        micro_batches: the window's micro-batches where not K (a batch split in the step).

    Returns:
        A :class:`MicroBatchResult`: the gradients of ``weight * loss`` (times the loss scale),
        each ``model.losses`` entry weighed to enter the window as at B; a sum over samples
        beside a mean loss in ``undivided`` (a second backward pass, same forward pass).
    """
    variables, samples = model.trainable_variables, batch_size_of(x)
    with tf.GradientTape(persistent=_persistent(model)) as tape:
        with recording() as denominators:
            y_pred = model(x, training=True)
            loss = tf.cast(loss_of(x, y, y_pred, sample_weight), tf.float32)
        terms = list(model.losses) if adds_model_losses else []
        with tape.stop_recording():
            forms = read_forms(model, loss_of, x, y, sample_weight, denominators, terms,
                               _loss_identity(model, loss_of))
        factor = replica_loss_factor()
        weights = _weights(model, normalizer, denominators, forms, (x, y, sample_weight),
                           y_pred, samples, state, factor, micro_batches)
        loss = loss * factor if factor != 1.0 else loss
        # Mixed precision: the *mean* loss scaled (as Keras does), so float16 sees gradients
        # of the usual size; c_i multiplies the float32 variable gradients afterwards.
        weigh_after = isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and (
            weights.weigh_after)
        summed = optimizer.scale_loss(_weighed_loss(loss, terms, weights, weigh_after))
        undivided_loss = _undivided_loss(terms, weights, optimizer)
    grads = tape.gradient(summed, variables)
    undivided = None if undivided_loss is None else tape.gradient(undivided_loss, variables)
    del tape
    if weigh_after:
        grads = [_scaled_gradient(g, weights.weight) for g in grads]
    return MicroBatchResult(loss, grads, weights.weight, samples, y_pred, loss * weights.log_weight,
                            weights.log_weight, undivided)
