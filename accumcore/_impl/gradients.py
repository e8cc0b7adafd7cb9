"""One micro-batch's contribution: the gradient of its summed loss and its weight.

Shared by the loops (``accumcore._impl.trainer``) and the Keras integration
(``accumcore._impl.accum_model``), so all three entry points compute exactly the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from accumcore._impl.denominators import (
    FunctionLoss,
    loss_weights,
    read_forms,
    recording,
    resolve_loss,
    uncounted,
)


def first_leaf(x: Any) -> tf.Tensor:
    """The first non-``None`` tensor in a (possibly nested) input structure."""
    for leaf in tf.nest.flatten(x):
        if leaf is not None:
            return leaf
    raise ValueError("The micro-batch `x` has no tensors: the dataset must yield inputs.")


def batch_size_of(x: Any) -> tf.Tensor:
    """Number of samples in a micro-batch (int32 scalar; the leading dimension of ``x``)."""
    return tf.shape(first_leaf(x))[0]


#: Keras loss reductions and the normaliser that makes a window exact for each (see
#: :func:`resolve_normalizer`): every mean is weighted by what it divided by ("auto", read
#: from the loss as it runs: ``accumcore._impl.denominators``); a summed loss is not divided.
#: "mean" is Keras's alias of "sum_over_batch_size".
REDUCTION_NORMALIZERS = {
    "sum_over_batch_size": "auto",
    "mean": "auto",
    "mean_with_sample_weight": "auto",
    "sum": "sum",
}


def loss_reductions(loss: Any) -> list[str | None] | None:
    """The ``reduction`` of each Keras loss in ``loss`` (a loss, a name, a list or dict of them).

    Returns ``None`` when accumcore cannot know how the loss normalises (a plain callable, or
    accumcore's ``FunctionLoss`` wrapper: the function decides),
    else one entry per loss (a name stands for a Keras loss with the default
    ``"sum_over_batch_size"``).
    """
    if loss is None:
        return None
    reductions: list[str | None] = []
    for leaf in tf.nest.flatten(uncounted(loss)):
        if leaf is None:
            continue
        if isinstance(leaf, str):  # `compile` and `as_loss_fn` wrap names with the default
            reductions.append("sum_over_batch_size")
            continue
        if isinstance(leaf, FunctionLoss) or not isinstance(leaf, keras.losses.Loss):
            return None  # a function: it returns its own (mean) value
        reductions.append(getattr(leaf, "reduction", "sum_over_batch_size"))
    return reductions or None


def resolve_normalizer(normalizer: str | Callable | None, loss: Any) -> str | Callable:
    """The normaliser that makes accumulation exact for ``loss``, checked against ``normalizer``.

    Args:
        normalizer: the user's choice: ``None`` or ``"auto"`` (the default: weigh every
            micro-batch by what its loss divided by, read as the loss runs), ``"samples"``,
            ``"sample_weight"`` (both checked against the loss's own denominator as it runs:
            ``accumcore._impl.denominators.micro_batch_weight``), or a callable item count (always
            kept, used as given).
        loss: the loss (see :func:`loss_reductions`).

    Returns:
        ``"sum"`` for losses with ``reduction="sum"`` (no division: the loss is already a
        sum), else ``normalizer`` (``"auto"`` for ``None``) or the callable.

    Raises:
        ValueError: for ``reduction=None``/``"none"`` (per-sample losses, not a scalar), for
            summed and mean losses in one model, and for an explicit ``"sample_weight"``
            with a loss that does not divide by the weight sum.
    """
    if callable(normalizer):
        return normalizer
    normalizer = normalizer or "auto"
    reductions = loss_reductions(loss)
    if reductions is None:
        return normalizer
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
            f"The model's losses have reductions {sorted(set(reductions))}: a summed loss "
            "(reduction='sum') is not divided and a mean is, so one window cannot be exact for "
            "both. Give every output a mean reduction (e.g. the default 'sum_over_batch_size')."
        )
    if matching == {"sum"}:
        return "sum"
    if normalizer == "sample_weight" and "mean_with_sample_weight" not in reductions:
        raise ValueError(
            f"normalizer='sample_weight' does not match the loss's reduction "
            f"{reductions[0]!r}, which divides by the number of loss elements (or not at all "
            "for 'sum'): leave `normalizer` unset, or use "
            "reduction='mean_with_sample_weight' for a loss normalised by the weight sum."
        )
    return normalizer


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
    function and arguments), with the model's compiled loss."""
    func = getattr(loss_of, "func", None)
    parts = (func, *map(id, getattr(loss_of, "args", ()))) if func is not None else (
        id(loss_of),)
    return (*parts, id(getattr(model, "loss", None)))


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
) -> MicroBatchResult:
    """Forward and backward pass of one micro-batch.

    Args:
        model: the Keras model (built).
        loss_of: ``loss_of(x, y, y_pred, sample_weight)`` returning the micro-batch's loss as
            Keras computes it (float scalar: the compiled loss, a mean or a sum, plus every
            entry of ``model.losses``), e.g. ``model.compute_loss``. Its
            ``CountedLoss`` es report what they divided by.
        x, y, sample_weight: one micro-batch.
        normalizer: how to weigh the micro-batch (see
            ``accumcore._impl.denominators.micro_batch_weight``): ``"auto"`` (what the loss divided
            by), ``"samples"``, ``"sample_weight"``, a callable, or ``"sum"`` for a summed loss
            (its gradient is accumulated as it is).
        optimizer: used only for ``optimizer.scale_loss`` (mixed-precision loss scaling).
        state: the ``AccumulationState`` the micro-batch goes to (read for K and whether the
            window is empty); ``None``: K = 1, the window empty.
        adds_model_losses: whether ``loss_of`` adds ``model.losses`` as Keras does (each
            entry summed, once): then each entry is weighed by its own form
            (``accumcore._impl.denominators.loss_weights``). ``False`` (a ``compute_loss`` of
            the model's own): the loss is weighed as one.

    Returns:
        A :class:`MicroBatchResult`: the gradients are those of ``weight * loss`` (times the
        loss scale, if any) for ``model.trainable_variables``, with each ``model.losses``
        entry that is a sum over samples, or has no samples, weighed to enter the window as
        it enters the large batch.
    """
    variables = model.trainable_variables
    samples = batch_size_of(x)
    with tf.GradientTape() as tape:
        with recording() as denominators:
            y_pred = model(x, training=True)
            loss = tf.cast(loss_of(x, y, y_pred, sample_weight), tf.float32)
        terms = list(model.losses) if adds_model_losses else []
        with tape.stop_recording():
            forms = read_forms(model, loss_of, x, y, sample_weight, denominators, terms,
                               _loss_identity(model, loss_of))
        factor = replica_loss_factor()
        # Constants to the tape (micro_batch_weight stops what could carry a gradient).
        weights = loss_weights(
            normalizer, denominators, forms, x, y, sample_weight, y_pred, samples,
            first_in_window=(lambda: tf.equal(state.window_samples, 0)) if state is not None
            else (lambda: tf.constant(True)),
            accum_steps=state.accum_steps if state is not None else 1, replicas=factor,
            owner=model)
        weight = weights.weight
        if factor != 1.0:
            loss = loss * factor
        extra = [(tf.reduce_sum(tf.cast(terms[i], tf.float32)), e) for i, e in weights.extra]
        # Mixed precision: scale the micro-batch's *mean* loss (as Keras does), so that the
        # float16 backward pass sees per-sample gradients of the usual size; the weight c_i
        # multiplies the (float32) variable gradients afterwards.
        weigh_after = isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and (
            weights.weigh_after)
        if weigh_after:
            total = loss + sum(t * tf.math.divide_no_nan(e, weight) for t, e in extra)
        else:
            total = weights.scale * loss + sum(t * e for t, e in extra)
        summed = optimizer.scale_loss(total)
    grads = tape.gradient(summed, variables)
    if weigh_after:
        grads = [_scaled_gradient(g, weight) for g in grads]
    return MicroBatchResult(loss, grads, weight, samples, y_pred, loss * weights.log_weight,
                            weights.log_weight)
