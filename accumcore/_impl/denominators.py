"""What a Keras loss divided a micro-batch's sum by, recorded while the loss runs.

Exact accumulation weighs micro-batch ``i`` by ``c_i``, the number its loss divided its summed
values by, and divides the window once by ``sum_i c_i``. For a Keras loss that number is not
always the sample count. ``Loss.__call__`` (``keras/src/losses/loss.py``, Keras 3.10 to 3.15)
merges the Keras mask of ``y_pred`` (``Embedding(mask_zero=True)``, ``Masking``, any layer's
``compute_mask``) with the mask its per-element losses carry (``ignore_class``) and the sample
weights, then reduces:

=========================== ==================================================================
reduction                   denominator ``D`` of one batch
=========================== ==================================================================
``sum_over_batch_size``     no mask: the number of loss elements (sample weights do not change
(``"mean"``)                it); with a mask: the number of *valid* elements
``mean_with_sample_weight`` the sum of the sample weights (times the mask); no weights and no
                            mask: the number of loss elements
``sum``                     none (1): the loss is already a sum
=========================== ==================================================================

:class:`CountedLoss` wraps a Keras loss (or a loss name or function, resolved as
``model.compile`` resolves it): it computes the per-element losses once with the loss's own
``call``, lets Keras's own ``Loss.__call__`` mask and reduce them (so the value is exactly
Keras's), and reports the denominator of that same reduction to the innermost
:func:`recording` context of the calling thread (each replica of a ``tf.distribute`` strategy
runs in its own thread). :func:`micro_batch_weight` turns the records of one micro-batch into
``c_i``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from accumcore._impl import compat

_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


class Denominator(NamedTuple):
    """The denominator of one loss on one micro-batch.

    * ``value``: ``D``, float32 scalar (``None`` where the loss did not reduce: a loss whose
      ``call`` returns a scalar, or whose ``__call__`` is its own).
    * ``kind``: ``"elements"`` (every loss element: no mask), ``"valid"`` (the valid elements
      of a mask), ``"weights"`` (a sample-weight sum), ``"sum"`` (``reduction="sum"``: no
      division) or ``"unknown"``.
    * ``key``: what ``D`` is proportional to, for comparing several outputs' denominators
      within one trace: equal keys mean ``D_a / D_b`` is the same constant for every
      micro-batch. ``("samples",)`` for an unmasked loss with a static number of elements per
      sample; otherwise the identities of the mask and weight tensors.
    * ``name``: the loss's (or its output's) name, for messages.
    """

    value: tf.Tensor | None
    kind: str
    key: tuple
    name: str


_local = threading.local()


@contextlib.contextmanager
def recording() -> Iterator[list[Denominator]]:
    """Collect the :class:`Denominator` of every :class:`CountedLoss` called inside, in call
    order (this thread only; nested contexts collect separately)."""
    stack = _local.__dict__.setdefault("stack", [])
    records: list[Denominator] = []
    stack.append(records)
    try:
        yield records
    finally:
        stack.pop()


def _report(record: Denominator) -> None:
    stack = getattr(_local, "stack", None)
    if stack:
        stack[-1].append(record)


def _same_rank(x1: tf.Tensor, x2: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Keras's ``squeeze_or_expand_to_same_rank`` (``keras/src/losses/loss.py``): squeeze or
    expand a last dimension of size 1 where the ranks differ by exactly one."""
    r1, r2 = len(x1.shape), len(x2.shape)
    if r1 == r2 + 1 and x1.shape[-1] == 1:
        if r2 == 1:
            x2 = tf.expand_dims(x2, -1)
        else:
            x1 = tf.squeeze(x1, -1)
    if r2 == r1 + 1 and x2.shape[-1] == 1:
        if r1 == 1:
            x1 = tf.expand_dims(x1, -1)
        else:
            x2 = tf.squeeze(x2, -1)
    return x1, x2


def _size(t: tf.Tensor) -> tf.Tensor:
    return tf.cast(tf.size(t), tf.float32)


def _per_sample_static(values: tf.Tensor) -> bool:
    """Whether every sample has the same, statically known number of loss elements."""
    return values.shape.rank is not None and all(d is not None for d in values.shape[1:])


def reduction_denominator(
    values: tf.Tensor, mask: tf.Tensor | None, sample_weight: Any, reduction: str,
    *, mask_ids: tuple = (), name: str = "loss",
) -> Denominator:
    """The denominator of Keras's ``reduce_weighted_values`` for these per-element losses.

    Args:
        values: the loss's per-element values (``Loss.call``'s output), any shape.
        mask: the merged Keras mask (``y_pred``'s and the values', combined with ``&``), or
            ``None``.
        sample_weight: ``None`` or the sample weights given to the loss.
        reduction: the loss's ``reduction``.
        mask_ids: identities of the tensors the mask came from (for :attr:`Denominator.key`).
        name: the loss's name.
    """
    if reduction == "sum":
        return Denominator(tf.constant(1.0), "sum", ("sum",), name)
    if values.shape.rank == 0 or tuple(values.shape) == (0,):  # Keras does not reduce these
        return Denominator(None, "unknown", ("unknown",), name)
    n_values = _size(values)
    weight_id = id(sample_weight) if sample_weight is not None else None
    if mask is None and (reduction in _MEAN_REDUCTIONS or sample_weight is None):
        key = ("samples",) if _per_sample_static(values) else ("elements", id(values))
        return Denominator(n_values, "elements", key, name)
    if reduction in _MEAN_REDUCTIONS:
        # apply_mask: valid entries weigh total / valid, then the mean over the values:
        # sum(l * w * mask) / valid * (size(values) / size(mask)).
        valid = tf.reduce_sum(tf.cast(mask, tf.float32))
        value = tf.math.divide_no_nan(valid * n_values, _size(mask))
        return Denominator(value, "valid", ("valid", *mask_ids), name)
    # mean_with_sample_weight: the sum of the weights, merged with the mask as Keras merges them.
    weights = None if sample_weight is None else tf.cast(sample_weight, tf.float32)
    if mask is not None:
        float_mask = tf.cast(mask, tf.float32)
        if weights is None:
            weights = float_mask
        else:
            float_mask, weights = _same_rank(float_mask, weights)
            weights = weights * float_mask
    return Denominator(
        tf.reduce_sum(weights), "weights", ("weights", *mask_ids, weight_id), name
    )


def _is_binary_or_sparse_categorical(y_true: Any, y_pred: Any) -> tuple[bool, bool]:
    """Keras's rule for the loss names ``"crossentropy"`` / ``"ce"`` (``compile_utils``)."""
    t_rank, p_rank = len(y_true.shape), len(y_pred.shape)
    t_last, p_last = y_true.shape[-1], y_pred.shape[-1]
    return p_last == 1, t_rank < p_rank or (t_last == 1 and p_last > 1)


def resolve_loss(identifier: Any, y_true: Any = None, y_pred: Any = None) -> keras.losses.Loss:
    """The Keras loss ``model.compile`` makes of ``identifier`` (``compile_utils.get_loss`` in
    Keras 3.10-3.15): a ``Loss`` as it is; a name or function through ``keras.losses.get``,
    a function wrapped with the default reduction; ``"crossentropy"`` / ``"ce"`` chosen from
    the shapes of ``y_true`` and ``y_pred``.
    """
    if isinstance(identifier, keras.losses.Loss):
        return identifier
    if isinstance(identifier, str) and identifier.lower() in ("crossentropy", "ce"):
        if y_true is None:
            raise ValueError("The loss 'crossentropy' is chosen from the data: call it first.")
        binary, sparse = _is_binary_or_sparse_categorical(y_true, y_pred)
        fn = (keras.losses.binary_crossentropy if binary else
              keras.losses.sparse_categorical_crossentropy if sparse else
              keras.losses.categorical_crossentropy)
        return FunctionLoss(fn, name=identifier)
    loss = keras.losses.get(identifier) if isinstance(identifier, str) else identifier
    if isinstance(loss, keras.losses.Loss):
        return loss
    if callable(loss):
        name = identifier if isinstance(identifier, str) else getattr(loss, "__name__", None)
        return FunctionLoss(loss, name=name)
    raise TypeError(
        f"`loss` must be a keras.losses.Loss, a loss name such as "
        f"'sparse_categorical_crossentropy', or a callable(y_true, y_pred), got {identifier!r}."
    )


@keras.saving.register_keras_serializable(package="accumcore")
class FunctionLoss(keras.losses.Loss):
    """A Keras loss around ``fn(y_true, y_pred)``, as ``model.compile`` wraps a function.

    Like Keras's own wrapper (``LossFunctionWrapper``, not exported), ``call`` first squeezes
    or expands a last dimension of size 1 so that ``y_true`` and ``y_pred`` have the same rank,
    then returns ``fn(y_true, y_pred)``: per-sample losses (shape ``(batch,)`` or
    ``(batch, ...)``), which the reduction (default ``"sum_over_batch_size"``) reduces, or a
    scalar, which Keras returns as it is (accumcore then cannot see its denominator).
    """

    def __init__(self, fn: Callable, reduction: str = "sum_over_batch_size",
                 name: str | None = None, dtype: Any = None) -> None:
        super().__init__(name=name or getattr(fn, "__name__", "loss"), reduction=reduction,
                         dtype=dtype)
        self.fn = fn

    def call(self, y_true, y_pred):
        if not tf.nest.is_nested(y_true) and not tf.nest.is_nested(y_pred):
            y_true, y_pred = _same_rank(y_true, y_pred)
        return self.fn(y_true, y_pred)

    def get_config(self) -> dict:
        return {**super().get_config(), "fn": keras.saving.serialize_keras_object(self.fn)}

    @classmethod
    def from_config(cls, config: dict) -> FunctionLoss:
        config = dict(config)
        config["fn"] = keras.saving.deserialize_keras_object(config["fn"])
        return cls(**config)


class _Reduced(keras.losses.Loss):
    """Keras's own ``Loss.__call__`` (mask, sample weights, reduction) over per-element losses
    computed beforehand: ``call`` returns them."""

    def __init__(self, values: tf.Tensor, loss: keras.losses.Loss) -> None:
        super().__init__(name=loss.name, reduction=loss.reduction, dtype=loss.dtype)
        self._values = values

    def call(self, y_true, y_pred):
        return self._values


def _reduces_itself(loss: keras.losses.Loss) -> bool:
    """Whether ``loss`` uses ``keras.losses.Loss.__call__`` (and so Keras's reduction)."""
    return type(loss).__call__ is keras.losses.Loss.__call__


@keras.saving.register_keras_serializable(package="accumcore")
class CountedLoss(keras.losses.Loss):
    """A Keras loss that also reports what its reduction divided by (see :func:`recording`).

    Args:
        loss: a ``keras.losses.Loss``, a loss name or a function, resolved as ``compile``
            resolves it (:func:`resolve_loss`; ``"crossentropy"`` on the first call).
        output: the model output this loss belongs to, for messages (optional).

    Its value is exactly the wrapped loss's: the per-element losses come from the loss's own
    ``call`` and are reduced by Keras's own ``Loss.__call__``. A loss that overrides
    ``__call__`` itself is called as it is and reports an ``"unknown"`` denominator.
    """

    def __init__(self, loss: Any, output: str | None = None, name: str | None = None,
                 reduction: str | None = None, dtype: Any = None) -> None:
        if isinstance(loss, CountedLoss):
            loss, output = loss.loss, output or loss.output
        self.loss = loss
        self.output = output
        self._resolved = None if _chosen_from_data(loss) else resolve_loss(loss)
        inner = self._resolved
        super().__init__(
            name=name or (inner.name if inner is not None else str(loss)),
            reduction=reduction or (inner.reduction if inner is not None
                                    else "sum_over_batch_size"),
            dtype=dtype if dtype is not None else (inner.dtype if inner is not None else None),
        )

    @property
    def resolved(self) -> keras.losses.Loss | None:
        """The Keras loss this wraps (``None`` for ``"crossentropy"`` before the first call)."""
        return self._resolved

    def __call__(self, y_true, y_pred, sample_weight=None):
        loss = self._resolved
        if loss is None:
            loss = self._resolved = resolve_loss(self.loss, y_true, y_pred)
        label = self.output or loss.name
        if not _reduces_itself(loss):
            _report(Denominator(None, "unknown", ("unknown",), label))
            return loss(y_true, y_pred, sample_weight)
        in_mask = compat.keras_mask(y_pred)
        with tf.name_scope(loss.name):
            y_pred_c = tf.nest.map_structure(
                lambda t: keras.ops.convert_to_tensor(t, dtype=loss.dtype), y_pred)
            y_true_c = tf.nest.map_structure(
                lambda t: keras.ops.convert_to_tensor(t, dtype=loss.dtype), y_true)
            values = loss.call(y_true_c, y_pred_c)
        value = _Reduced(values, loss)(y_true, y_pred, sample_weight)
        out_mask = compat.keras_mask(values)
        masks = [m for m in (in_mask, out_mask) if m is not None]
        mask = masks[0] if len(masks) == 1 else (
            tf.logical_and(tf.cast(in_mask, tf.bool), tf.cast(out_mask, tf.bool))
            if masks else None)
        with tf.name_scope("denominator"):
            record = reduction_denominator(
                tf.convert_to_tensor(values), mask, sample_weight, loss.reduction,
                mask_ids=tuple(id(m) for m in masks), name=label,
            )
        value_d = None if record.value is None else tf.stop_gradient(record.value)
        _report(Denominator(value_d, record.kind, record.key, record.name))
        return value

    def call(self, y_true, y_pred):  # pragma: no cover - __call__ does the work
        raise NotImplementedError

    def get_config(self) -> dict:
        return {"loss": keras.saving.serialize_keras_object(self.loss), "output": self.output,
                "name": self.name, "reduction": self.reduction}

    @classmethod
    def from_config(cls, config: dict) -> CountedLoss:
        config = dict(config)
        config["loss"] = keras.saving.deserialize_keras_object(config["loss"])
        return cls(**config)


def _chosen_from_data(identifier: Any) -> bool:
    return isinstance(identifier, str) and identifier.lower() in ("crossentropy", "ce")


def counted(loss: Any, outputs: Sequence[str] | None = None) -> Any:
    """``loss`` (a ``compile`` argument: a loss, a name, a function, or a list / dict of them,
    ``None`` entries kept) with every leaf a :class:`CountedLoss`.

    Args:
        outputs: the model's output names, to name the leaves of a list in messages.
    """
    if loss is None or isinstance(loss, CountedLoss):
        return loss
    if isinstance(loss, dict):
        return {key: counted_leaf(value, str(key)) for key, value in loss.items()}
    if isinstance(loss, (list, tuple)):
        names = list(outputs or [])
        return _sequence_like(loss, [
            counted_leaf(value, names[i] if i < len(names) else f"output {i}")
            for i, value in enumerate(loss)
        ])
    return CountedLoss(loss)


def counted_leaf(loss: Any, output: str | None) -> Any:
    """One leaf of :func:`counted`: ``None`` kept, nested structures recursed into."""
    if loss is None:
        return None
    if isinstance(loss, (dict, list, tuple)):
        return counted(loss)
    return CountedLoss(loss, output=output)


def uncounted(loss: Any) -> Any:
    """The inverse of :func:`counted`: the user's own loss structure."""
    if isinstance(loss, CountedLoss):
        return loss.loss
    if isinstance(loss, dict):
        return {key: uncounted(value) for key, value in loss.items()}
    if isinstance(loss, (list, tuple)):
        return _sequence_like(loss, [uncounted(value) for value in loss])
    return loss


def _sequence_like(original: Sequence, items: list) -> list | tuple:
    """A plain list or tuple (never a tracking wrapper of TensorFlow's) of ``items``."""
    return tuple(items) if isinstance(original, tuple) else items


# ---------------------------------------------------------------------- the micro-batch weight
def _proportional(records: Sequence[Denominator]) -> bool:
    return len({r.key for r in records}) == 1 and records[0].kind != "unknown"


def _describe(record: Denominator) -> str:
    what = {
        "elements": "every loss element",
        "valid": "its valid elements (a Keras mask or ignore_class)",
        "weights": "its sample-weight sum",
        "sum": "nothing (reduction='sum')",
        "unknown": "a number accumcore cannot see",
    }[record.kind]
    return f"{record.name!r} divides by {what}"


_warned_masks: set[int] = set()


def _warn_unseen_mask(y_pred: Any, why: str) -> None:
    """One warning per trace: a Keras mask is present, but the loss's denominator is unseen."""
    if not any(compat.keras_mask(t) is not None for t in tf.nest.flatten(y_pred)):
        return
    warnings.warn(
        f"The model's output carries a Keras mask, but {why}, so accumcore cannot see what "
        "the loss divides by and weighs each micro-batch by its number of samples: that is "
        "exact only if the loss is a mean over samples. If the loss is a mean over the mask's "
        "valid elements, pass `normalizer=lambda x, y, sample_weight: <valid count>`; "
        "compiled Keras losses (and AccumTrainer's) are counted exactly.",
        UserWarning,
        stacklevel=4,
    )


def micro_batch_weight(
    normalizer: str | Callable, records: Sequence[Denominator], x: Any, y: Any,
    sample_weight: Any, y_pred: Any, samples: tf.Tensor,
) -> tf.Tensor:
    """``c_i`` of one micro-batch (float32 scalar), from the denominators its losses reported.

    The weight is a constant to a gradient tape: a loss's denominator is recorded with its
    gradient stopped, a count of samples has none, and the other sources are stopped here.

    Args:
        normalizer: ``"auto"`` (the losses' own denominator), ``"samples"``,
            ``"sample_weight"`` (each checked against the losses' denominators), ``"sum"``
            (a summed loss: the sample count, for logging) or a callable
            ``f(x, y, sample_weight) -> count``, used as given.
        records: what the micro-batch's :class:`CountedLoss` es reported (:func:`recording`).
        x, y, sample_weight, y_pred: the micro-batch and the model's output for it.
        samples: the micro-batch's number of samples (int scalar).

    Raises:
        ValueError: where no single weight is exact: several outputs whose denominators are
            not proportional (different masks, one masked and one not, a sample-weight sum
            beside a count), or an explicit ``"samples"`` / ``"sample_weight"`` that the
            losses' denominators contradict.
    """
    if callable(normalizer):
        return tf.stop_gradient(tf.cast(normalizer(x, y, sample_weight), tf.float32))
    if normalizer == "sum":
        return tf.cast(samples, tf.float32)
    known = [r for r in records if r.kind != "unknown"]
    if len(known) < len(records) or not records:
        _warn_unseen_mask(
            y_pred, "the loss is not a Keras loss that reduces (a custom `compute_loss`, or a "
            "function returning a scalar)")
        if not known:
            if normalizer == "sample_weight" and sample_weight is not None:
                return tf.stop_gradient(tf.reduce_sum(tf.cast(sample_weight, tf.float32)))
            return tf.cast(samples, tf.float32)
    record = _the_denominator(normalizer, known)
    return tf.cast(samples, tf.float32) if normalizer == "samples" else record.value


def _the_denominator(normalizer: str, known: Sequence[Denominator]) -> Denominator:
    """The one denominator that weighs the micro-batch (the first of ``known``), checked: the
    losses' denominators must be proportional, and an explicit ``normalizer`` must agree."""
    if not _proportional(known):
        raise ValueError(
            "The model's losses divide by different numbers: "
            + "; ".join(_describe(r) for r in known)
            + ". One weight per micro-batch cannot make both exact under accumulation (the "
            "large batch divides each output by its own total). Give the outputs the same "
            "denominator (the same mask, or no mask, and the same reduction), train the "
            "masked output alone, or pass `normalizer=` a callable to choose the weighting "
            "yourself (exact only for the output it counts)."
        )
    record = known[0]
    if normalizer == "samples" and record.key != ("samples",):
        raise ValueError(
            f"normalizer='samples' weighs micro-batches by their number of samples, but "
            f"{_describe(record)}: the window would not equal the large batch (the mean of "
            "means is not the mean). Leave `normalizer` unset (default 'auto': accumcore uses "
            "the loss's own denominator), or pass a callable to weigh it yourself."
        )
    if normalizer == "sample_weight" and record.kind not in ("weights", "elements"):
        raise ValueError(
            f"normalizer='sample_weight' weighs micro-batches by their sample-weight sum, but "
            f"{_describe(record)}. Leave `normalizer` unset (default 'auto')."
        )
    return record
