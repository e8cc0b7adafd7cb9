"""One micro-batch's contribution: the gradient of its summed loss and its weight.

Shared by the loops (:mod:`accumcore.loops`) and the Keras integration
(:mod:`accumcore.model`), so all three entry points compute exactly the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import tensorflow as tf


def first_leaf(x: Any) -> tf.Tensor:
    """The first non-``None`` tensor in a (possibly nested) input structure."""
    for leaf in tf.nest.flatten(x):
        if leaf is not None:
            return leaf
    raise ValueError("The micro-batch `x` has no tensors: the dataset must yield inputs.")


def batch_size_of(x: Any) -> tf.Tensor:
    """Number of samples in a micro-batch (int32 scalar; the leading dimension of ``x``)."""
    return tf.shape(first_leaf(x))[0]


def micro_batch_weight(
    normalizer: str | Callable, x: Any, y: Any, sample_weight: Any
) -> tf.Tensor:
    """The weight ``c_i`` of one micro-batch (float32 scalar).

    * ``"samples"``: the number of samples. Exact for Keras's default
      ``sum_over_batch_size`` reduction, which divides by the number of loss elements (with or
      without sample weights), as long as every sample has the same number of loss elements.
    * ``"sample_weight"``: the sum of the sample weights (the number of samples when there are
      none); exact for losses normalised by the weight sum
      (``reduction="mean_with_sample_weight"``).
    * a callable ``f(x, y, sample_weight) -> scalar``: e.g. the number of valid tokens, for a
      loss that is the mean over those tokens.
    * ``"sum"`` (resolved from a loss with ``reduction="sum"``, see :func:`resolve_normalizer`):
      the number of samples, recorded for logging only (summed losses are not divided).
    """
    if callable(normalizer):
        return tf.cast(normalizer(x, y, sample_weight), tf.float32)
    if normalizer == "sample_weight" and sample_weight is not None:
        return tf.reduce_sum(tf.cast(sample_weight, tf.float32))
    return tf.cast(batch_size_of(x), tf.float32)


#: Keras loss reductions and the normaliser that makes a window exact for each (see
#: :func:`resolve_normalizer`). "mean" is Keras's alias of "sum_over_batch_size".
REDUCTION_NORMALIZERS = {
    "sum_over_batch_size": "samples",
    "mean": "samples",
    "mean_with_sample_weight": "sample_weight",
    "sum": "sum",
}


def loss_reductions(loss: Any) -> list[str | None] | None:
    """The ``reduction`` of each Keras loss in ``loss`` (a loss, a name, a list or dict of them).

    Returns ``None`` when accumcore cannot know how the loss normalises (a plain callable, or
    accumcore's :class:`FunctionLoss` wrapper: the function decides), else one entry per loss
    (a name stands for a Keras loss with the default ``"sum_over_batch_size"``).
    """
    if loss is None:
        return None
    leaves = tf.nest.flatten(loss)
    reductions: list[str | None] = []
    for leaf in leaves:
        if leaf is None:
            continue
        if isinstance(leaf, str):  # `compile` and `as_loss_fn` wrap names with the default
            reductions.append("sum_over_batch_size")
            continue
        if isinstance(leaf, FunctionLoss) or not isinstance(leaf, keras.losses.Loss):
            return None  # a function: it returns its own (mean) value; trust the normaliser
        reductions.append(getattr(leaf, "reduction", "sum_over_batch_size"))
    return reductions or None


def resolve_normalizer(normalizer: str | Callable | None, loss: Any) -> str | Callable:
    """The normaliser that makes accumulation exact for ``loss``, checked against ``normalizer``.

    Args:
        normalizer: the user's choice: ``None`` or ``"samples"`` (the default: follow the
            loss), ``"sample_weight"``, or a callable item count (always kept).
        loss: the loss (see :func:`loss_reductions`).

    Returns:
        ``"samples"`` for ``sum_over_batch_size``/``mean`` losses, ``"sample_weight"`` for
        ``mean_with_sample_weight``, ``"sum"`` for ``reduction="sum"`` (no division: the loss
        is already a sum), or the callable.

    Raises:
        ValueError: for ``reduction=None``/``"none"`` (per-sample losses, not a scalar), for
            losses with different normalisers in one model, and for an explicit
            ``"sample_weight"`` that contradicts the loss's reduction.
    """
    if callable(normalizer):
        return normalizer
    reductions = loss_reductions(loss)
    if reductions is None:
        return normalizer or "samples"
    unsupported = [r for r in reductions if r not in REDUCTION_NORMALIZERS]
    if unsupported:
        raise ValueError(
            f"The loss has reduction={unsupported[0]!r}: it returns one value per sample, and "
            "accumcore needs a scalar. Use reduction='sum_over_batch_size' (the default), "
            "'mean_with_sample_weight' or 'sum', which are exact under accumulation."
        )
    matching = {REDUCTION_NORMALIZERS[r] for r in reductions}
    if len(matching) > 1:
        raise ValueError(
            f"The model's losses have reductions {sorted(set(reductions))}, which need "
            "different normalisers; accumulation can be exact for one only. Give every output "
            "the same reduction (e.g. the default 'sum_over_batch_size')."
        )
    (resolved,) = matching
    if normalizer == "sample_weight" and resolved != "sample_weight":
        raise ValueError(
            f"normalizer='sample_weight' does not match the loss's reduction "
            f"{reductions[0]!r}, which divides by the number of loss elements (or not at all "
            "for 'sum'): leave `normalizer` unset, or use "
            "reduction='mean_with_sample_weight' for a loss normalised by the weight sum."
        )
    return resolved


def replica_loss_factor() -> float:
    """Number of replicas in sync when called inside a replica context, else 1.

    Keras losses divide their mean by the number of replicas under ``tf.distribute`` (so that
    summing gradients across replicas gives the global mean). accumcore normalises by the
    global window weight itself, so it multiplies that division back out.
    """
    if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context() is False:
        return float(tf.distribute.get_strategy().num_replicas_in_sync)
    return 1.0


class FunctionLoss(keras.losses.Loss):
    """A Keras loss (mean reduction, sample weights) around ``fn(y_true, y_pred)``.

    ``fn`` returns per-sample losses (shape ``(batch,)`` or ``(batch, ...)``) or a scalar mean.
    """

    def __init__(self, fn: Callable, name: str | None = None) -> None:
        super().__init__(name=name or getattr(fn, "__name__", "loss"))
        self.fn = fn

    def call(self, y_true, y_pred):
        return self.fn(y_true, y_pred)


def as_loss_fn(loss: Any) -> keras.losses.Loss:
    """A reducing Keras loss from a loss instance, a string name, or a callable."""
    if isinstance(loss, keras.losses.Loss):
        return loss
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
        if isinstance(loss, keras.losses.Loss):
            return loss
    if callable(loss):
        return FunctionLoss(loss)
    raise TypeError(
        f"`loss` must be a keras.losses.Loss, a loss name such as "
        f"'sparse_categorical_crossentropy', or a callable(y_true, y_pred), got {loss!r}."
    )


class MicroBatchResult(NamedTuple):
    """One micro-batch's forward and backward pass (see :func:`summed_loss_gradients`)."""

    loss: tf.Tensor  # mean loss of the micro-batch, float32 scalar (for logging)
    grads: list  # gradients of weight * loss (times the loss scale), one per trainable variable
    weight: tf.Tensor  # c_i, float32 scalar
    samples: tf.Tensor  # number of samples, int32 scalar
    y_pred: Any  # the model's outputs, for metrics


def _scaled_gradient(grad: Any, factor: tf.Tensor) -> Any:
    """``factor * grad`` for a dense gradient, ``tf.IndexedSlices`` or ``None``."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        values = grad.values * tf.cast(factor, grad.values.dtype)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def summed_loss_gradients(
    model: keras.Model,
    loss_of: Callable[[Any, Any, Any, Any], tf.Tensor],
    x: Any,
    y: Any,
    sample_weight: Any,
    *,
    normalizer: str | Callable,
    optimizer: keras.optimizers.Optimizer,
) -> MicroBatchResult:
    """Forward and backward pass of one micro-batch.

    Args:
        model: the Keras model (built).
        loss_of: ``loss_of(x, y, y_pred, sample_weight)`` returning the micro-batch's *mean*
            loss (float scalar), e.g. ``model.compute_loss``.
        x, y, sample_weight: one micro-batch.
        normalizer: how to weigh the micro-batch (see :func:`micro_batch_weight`); ``"sum"``
            for a summed loss (its gradient is accumulated as it is).
        optimizer: used only for ``optimizer.scale_loss`` (mixed-precision loss scaling).

    Returns:
        A :class:`MicroBatchResult`: the gradients are those of ``weight * mean_loss`` (times
        the loss scale, if any) for ``model.trainable_variables``.
    """
    variables = model.trainable_variables
    weight = micro_batch_weight(normalizer, x, y, sample_weight)
    summed_loss = normalizer == "sum"  # reduction="sum": the loss is already c_i * L_i
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = tf.cast(loss_of(x, y, y_pred, sample_weight), tf.float32)
        loss = loss * replica_loss_factor()
        if summed_loss and model.losses:
            raise ValueError(
                "The loss has reduction='sum' and the model has regularisation losses "
                "(`model.losses`): a window cannot add the penalty exactly once per update. "
                "Use reduction='sum_over_batch_size' (the default), or drop the regularisers."
            )
        # Mixed precision: scale the micro-batch's *mean* loss (as Keras does), so that the
        # float16 backward pass sees per-sample gradients of the usual size; the weight c_i
        # multiplies the (float32) variable gradients afterwards.
        weigh_after = isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and not (
            summed_loss)
        summed = optimizer.scale_loss(loss if summed_loss or weigh_after else loss * weight)
    grads = tape.gradient(summed, variables)
    if weigh_after:
        grads = [_scaled_gradient(g, weight) for g in grads]
    return MicroBatchResult(loss, grads, weight, batch_size_of(x), y_pred)
