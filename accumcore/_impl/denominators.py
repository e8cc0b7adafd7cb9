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

Keras's training loss also adds every entry of ``model.losses`` (``add_loss`` terms,
regularisers), each as it is: a per-sample vector summed over the batch, a weight regulariser
once per batch. :func:`read_forms` reads each entry's :class:`Form` (a sum over samples, a
mean, no samples at all, or none of these) from one trace with a static batch
(:class:`SampleGraph`), and so the value of a loss that returns one number per batch;
:func:`loss_weights` weighs each part so that the window equals the large batch, and warns
where one weight per micro-batch cannot.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
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
    * ``form``: for an ``"unknown"`` denominator, how the loss's value depends on the
      micro-batch's samples (:class:`Form`), where the trace that reads forms saw it
      (:func:`read_forms`); ``None`` where not read.
    """

    value: tf.Tensor | None
    kind: str
    key: tuple
    name: str
    form: Form | None = None


_local = threading.local()


@contextlib.contextmanager
def recording(graph: SampleGraph | None = None) -> Iterator[list[Denominator]]:
    """Collect the :class:`Denominator` of every :class:`CountedLoss` called inside, in call
    order (this thread only; nested contexts collect separately). With ``graph`` (the trace
    of :func:`read_forms`), a loss whose value Keras does not reduce also records its
    :class:`Form`."""
    stack = _local.__dict__.setdefault("stack", [])
    records: list[Denominator] = []
    stack.append((records, graph))
    try:
        yield records
    finally:
        stack.pop()


def _report(record: Denominator, value: Any = None) -> None:
    """Record ``record``; an ``"unknown"`` one with the :class:`Form` of the loss's ``value``
    where the innermost :func:`recording` reads forms."""
    stack = getattr(_local, "stack", None)
    if stack:
        records, graph = stack[-1]
        if graph is not None and record.kind == "unknown" and value is not None:
            record = Denominator(record.value, record.kind, record.key, record.name,
                                 graph.form(tf.convert_to_tensor(value)))
        records.append(record)


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
            value = loss(y_true, y_pred, sample_weight)
            _report(Denominator(None, "unknown", ("unknown",), label), value)
            return value
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
        _report(Denominator(value_d, record.kind, record.key, record.name), value)
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
    sample_weight: Any, y_pred: Any, samples: tf.Tensor, owner: Any = None,
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
            A loss whose value Keras does not reduce (its ``call`` returns a scalar, or its
            ``__call__`` is its own) counts as a mean over samples where its :class:`Form`
            says it is one; otherwise, with ``normalizer="auto"``, it is weighed by its
            samples with a warning (once per loss and ``owner``) that names ``normalizer=``.
        x, y, sample_weight, y_pred: the micro-batch and the model's output for it.
        samples: the micro-batch's number of samples (int scalar).
        owner: the model, for warning once (``None``: every call warns).

    Raises:
        ValueError: where no single weight is exact: several outputs whose denominators are
            not proportional (different masks, one masked and one not, a sample-weight sum
            beside a count), or an explicit ``"samples"`` / ``"sample_weight"`` that the
            losses' denominators contradict.
    """
    return _weight_and_key(normalizer, records, x, y, sample_weight, y_pred, samples,
                           owner)[0]


def _weight_and_key(
    normalizer: str | Callable, records: Sequence[Denominator], x: Any, y: Any,
    sample_weight: Any, y_pred: Any, samples: tf.Tensor, owner: Any,
) -> tuple[tf.Tensor, tuple]:
    """:func:`micro_batch_weight` and what it is proportional to (a :attr:`Denominator.key`;
    ``("samples",)`` for a count of samples, ``("normalizer",)`` for a callable's count)."""
    samples_f = tf.cast(samples, tf.float32)
    if callable(normalizer):
        count = tf.stop_gradient(tf.cast(normalizer(x, y, sample_weight), tf.float32))
        return count, ("normalizer",)
    if normalizer == "sum":
        return samples_f, ("sum",)
    scalar_means = [r.kind == "unknown" and r.form is not None and r.form.kind == "mean"
                    for r in records]
    records = [Denominator(samples_f, "elements", ("samples",), r.name) if is_mean else r
               for r, is_mean in zip(records, scalar_means, strict=True)]
    unseen = [r for r in records if r.kind == "unknown"]
    if unseen and normalizer == "auto":
        for record in unseen:
            _warn_unseen_denominator(owner, record, y_pred)
    elif unseen or any(scalar_means) or not records:
        _warn_unseen_mask(
            y_pred, "the loss is not a Keras loss that reduces (a custom `compute_loss`, or a "
            "function returning a scalar)")
    known = [r for r in records if r.kind != "unknown"]
    if not known:
        if normalizer == "sample_weight" and sample_weight is not None:
            weights = tf.stop_gradient(tf.reduce_sum(tf.cast(sample_weight, tf.float32)))
            return weights, ("weights", id(sample_weight))
        return samples_f, ("samples",)
    record = _the_denominator(normalizer, known)
    if normalizer == "samples":
        return samples_f, ("samples",)
    return record.value, record.key


def _warn_unseen_denominator(owner: Any, record: Denominator, y_pred: Any) -> None:
    """Once per loss and model: a compiled loss returns one number per micro-batch that is not
    a mean over samples (or cannot be read), and ``normalizer`` is not given."""
    why = record.form.detail if record.form is not None and record.form.detail else (
        "it returns one number per micro-batch, and its graph could not be read")
    masked = any(compat.keras_mask(t) is not None for t in tf.nest.flatten(y_pred))
    _warn_once(owner, ("loss", record.name), (
        f"The loss {record.name!r} returns one number per micro-batch that accumcore cannot "
        f"read as a sum or a mean over samples (here: {why}), so it weighs each micro-batch by "
        "its number of samples: exact only if the loss is a mean over samples"
        + (" (the model's output carries a Keras mask)" if masked else "")
        + ". If the loss divides by its own count (tokens, a mask), pass that same count as "
        "`normalizer`, e.g. where it counts the labels not equal to IGNORE, your padding or "
        "ignored label (0 for token ids padded with 0; -1 where -1 is ignored and 0 is a "
        "class): `normalizer=lambda x, y, sample_weight: tf.reduce_sum(tf.cast("
        "tf.not_equal(y, IGNORE), tf.float32))`."
    ))


def _warn_once(owner: Any, key: tuple, message: str) -> None:
    """``warnings.warn(message)``, once per ``key`` and ``owner`` (every time without one)."""
    if owner is not None:
        try:
            seen = _WARNED.setdefault(owner, set())
        except TypeError:  # pragma: no cover - an owner that cannot be weakly referenced
            seen = set()
        if key in seen:
            return
        seen.add(key)
    warnings.warn(message, UserWarning, stacklevel=5)


_WARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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


# ---------------------------------------------------------------------- the normaliser
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


# ---------------------------------------------------------------------- the form of a loss value
class Form(NamedTuple):
    """How a loss value depends on the samples of its micro-batch, read from its graph
    (:class:`SampleGraph`).

    * ``kind``: ``"once"`` (no sample: weights and constants only, such as a kernel
      regulariser; Keras adds it once per batch), ``"sum"`` (a sum over samples, such as a
      per-sample vector given to ``add_loss``, which Keras sums), ``"mean"`` (a sum over
      samples divided by their number, or by a fixed number of elements per sample) or
      ``"unknown"`` (anything else: a ratio of two sums such as a token mean, a maximum, a
      product of two means).
    * ``detail``: for ``"unknown"``, what was seen, for messages.
    """

    kind: str
    detail: str = ""


ONCE, SUM, MEAN = Form("once"), Form("sum"), Form("mean")

#: The static batch size of the trace that :func:`read_forms` makes, so that TensorFlow's
#: shape inference gives every tensor whose first axis is the batch this first dimension; a
#: prime unlike a layer's width, so that no other axis is taken for the batch.
PROBE_BATCH = 1009

# Ops that pass a value on unchanged (up to its dtype or sign).
_TRANSPARENT = frozenset({"Identity", "IdentityN", "Cast", "Neg", "Snapshot", "EnsureShape",
                          "StopGradient", "PreventGradient"})
_SHAPE_ONLY = frozenset({"Reshape", "Squeeze", "ExpandDims"})
_ADDS = frozenset({"AddV2", "Add", "AddN", "Sub"})
_DIVIDES = frozenset({"RealDiv", "DivNoNan", "Div"})
_REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min", "Prod"})
# Elementwise ops: each output row comes from the same row of each (broadcast) input.
_ELEMENTWISE = frozenset({
    "Mul", "AddV2", "Add", "AddN", "Sub", "RealDiv", "DivNoNan", "Div", "Maximum", "Minimum",
    "SquaredDifference", "Square", "Abs", "Neg", "Exp", "Log", "Log1p", "Sqrt", "Rsqrt",
    "Pow", "Relu", "Sigmoid", "Tanh", "Softplus", "Sign", "Reciprocal", "Select", "SelectV2",
    "Cast", "Identity", "BiasAdd", "Less", "LessEqual", "Greater", "GreaterEqual", "Equal",
    "NotEqual", "LogicalAnd", "LogicalOr", "LogicalNot",
})
_MAX_DEPTH = 48


class SampleGraph:
    """The graph of one micro-batch's forward pass and loss, traced with a static batch of
    :data:`PROBE_BATCH` samples, read to tell how a loss value depends on the samples.

    A value that no op connects to the micro-batch's tensors (``data``) is ``"once"``. Above
    that, the reading follows the ops Keras and users write losses with: casts and signs;
    sums and differences of terms of one kind; scaling by a number that does not depend on
    the samples; division by the batch size (``ops.shape(x)[0]``, static here); and the
    reduction of a tensor whose first axis is the batch (``ops.sum``: ``"sum"``,
    ``ops.mean``: ``"mean"``, if its other axes are static) and whose rows belong to one
    sample each (no value that mixes samples is broadcast into them). Below such a reduction
    every row is taken to be one sample's, as a model's layers compute it (BatchNormalization
    in training couples samples, which the window-level layer handles).
    """

    def __init__(self, data: Any) -> None:
        leaves = [t for t in tf.nest.flatten(data, expand_composites=True) if t is not None]
        self._sources = {t.op for t in leaves if hasattr(t, "op")}
        self._memo: dict = {}

    # -------------------------------------------------------------- dependence on the samples
    def depends(self, tensor: tf.Tensor) -> bool:
        """Whether ``tensor`` is computed from the micro-batch (iterative: graphs are deep)."""
        root = tensor.op
        memo = self._memo
        stack = [(root, False)]
        while stack:
            op, expanded = stack.pop()
            if op in memo:
                continue
            if op in self._sources:
                memo[op] = True
            elif not expanded:
                stack.append((op, True))
                stack.extend((i.op, False) for i in op.inputs if i.op not in memo)
            else:
                memo[op] = any(memo.get(i.op, False) for i in op.inputs)
        return memo[root]

    def _batch_leading(self, tensor: tf.Tensor) -> bool:
        return tensor.shape.rank is not None and tensor.shape.rank >= 1 and (
            tensor.shape[0] == PROBE_BATCH)

    def _rows_per_sample(self, tensor: tf.Tensor, depth: int = 0) -> bool:
        """Whether each row (first axis) of ``tensor`` is one sample's: its first axis is the
        batch, and no value that depends on the samples but is not one row per sample is
        broadcast into it by the elementwise ops (or reductions over other axes) above it."""
        if not self.depends(tensor):
            return True
        if not self._batch_leading(tensor):
            return False
        op = tensor.op
        if depth > _MAX_DEPTH:
            return True
        if op.type in _ELEMENTWISE:
            return all(self._rows_per_sample(i, depth + 1) for i in op.inputs
                       if i.dtype != tf.resource)
        if op.type in _REDUCTIONS and 0 not in self._axes(op):
            return self._rows_per_sample(op.inputs[0], depth + 1)
        return True

    @staticmethod
    def _axes(op: tf.Operation) -> set[int]:
        """The axes a reduction op reduces (all of them where unknown)."""
        rank = op.inputs[0].shape.rank
        axes = tf.get_static_value(op.inputs[1])
        if rank is None or axes is None:
            return set(range(rank or 1))
        return {int(a) % max(rank, 1) for a in tf.nest.flatten(axes.tolist())}

    def _is_batch_size(self, tensor: tf.Tensor) -> bool:
        value = tf.get_static_value(tensor)
        return value is not None and getattr(value, "size", 1) == 1 and (
            float(value) == PROBE_BATCH)

    # -------------------------------------------------------------- forms
    def summed_form(self, tensor: Any) -> Form:
        """The :class:`Form` of ``ops.sum(tensor)``: how Keras adds an entry of
        ``model.losses`` (a scalar as it is, any other shape summed)."""
        tensor = tf.convert_to_tensor(tensor)
        if tensor.shape.rank == 0 or tensor.shape.num_elements() == 1:
            return self.form(tensor)
        if not self.depends(tensor):
            return ONCE
        if self._rows_per_sample(tensor):
            return SUM
        return Form("unknown", f"a tensor of shape {tensor.shape} whose first axis is not one "
                               "row per sample")

    def form(self, tensor: tf.Tensor, depth: int = 0) -> Form:
        """The :class:`Form` of a scalar (or one-element) ``tensor``."""
        if not self.depends(tensor):
            return ONCE
        op = tensor.op
        if depth > _MAX_DEPTH:
            return Form("unknown", "an expression too deep to read")
        if op.type in _TRANSPARENT or (op.type in _SHAPE_ONLY
                                       and op.inputs[0].shape.num_elements() == 1):
            return self.form(op.inputs[0], depth + 1)
        if op.type in _ADDS:
            return _combined([self.form(i, depth + 1) for i in op.inputs])
        if op.type == "Mul":
            a, b = op.inputs
            if not self.depends(a):
                return self.form(b, depth + 1)
            if not self.depends(b):
                return self.form(a, depth + 1)
            return Form("unknown", "a product of two values that depend on the samples")
        if op.type in _DIVIDES:
            numerator, denominator = op.inputs
            form = self.form(numerator, depth + 1)
            if self._is_batch_size(denominator):
                return MEAN if form.kind == "sum" else Form(
                    "unknown", f"a {form.kind} value divided by the batch size")
            if not self.depends(denominator):
                return form
            return Form("unknown", "divided by a count computed from the samples, such as "
                                   "its tokens or mask entries")
        if op.type in ("Sum", "Mean"):
            return self._reduced(op, depth)
        return Form("unknown", f"computed by a {op.type} op")

    def _reduced(self, op: tf.Operation, depth: int) -> Form:
        values = op.inputs[0]
        rank = values.shape.rank
        if rank == 0:
            return self.form(values, depth + 1)
        if rank is None or self._axes(op) != set(range(rank)):
            return Form("unknown", f"a {op.type.lower()} over some axes only")
        if not self._rows_per_sample(values):
            return Form("unknown", f"a {op.type.lower()} of values that are not one row per "
                                   "sample")
        if op.type == "Sum":
            return SUM
        if values.shape[1:].is_fully_defined():
            return MEAN
        return Form("unknown", "a mean over a number of elements per sample that varies")


def _combined(forms: Sequence[Form]) -> Form:
    """The form of a sum of terms: terms without samples add to a mean (the window weighs
    them to once), never to a sum (it would add them once per micro-batch)."""
    data = [f for f in forms if f.kind != "once"]
    if not data:
        return ONCE
    unknown = next((f for f in data if f.kind == "unknown"), None)
    if unknown is not None:
        return unknown
    kinds = {f.kind for f in data}
    if kinds == {"mean"}:
        return MEAN
    if kinds == {"sum"} and len(data) == len(forms):
        return SUM
    return Form("unknown", "a sum over samples added to a mean or to a term without samples")


class TermForm(NamedTuple):
    """The :class:`Form` of one entry of ``model.losses`` and a name for messages (its
    position and, where read, the op that computed it)."""

    form: Form
    name: str


class Forms(NamedTuple):
    """What :func:`read_forms` read: the forms of the unreduced losses' values (one per
    :class:`CountedLoss` record, in call order; ``None`` for a reduced loss) and of the
    entries of ``model.losses``."""

    records: list
    terms: list


def regularization_count(model: keras.Model) -> int:
    """How many entries of ``model.losses`` are weight regularisers: Keras appends one per
    trainable variable with a ``regularizer``, after the ``add_loss`` entries."""
    return sum(getattr(v, "regularizer", None) is not None for v in model.trainable_variables)


_FORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def read_forms(model: keras.Model, loss_of: Callable, x: Any, y: Any, sample_weight: Any,
               records: Sequence[Denominator], terms: Sequence[Any], cache_key: tuple) -> Forms:
    """The forms of one micro-batch's unreduced losses and ``model.losses`` entries.

    Where nothing needs reading (every loss reduced by Keras, every entry a weight
    regulariser) no trace is made. Otherwise the forward pass and ``loss_of`` are traced once
    more with a static batch of :data:`PROBE_BATCH` samples (a concrete function that never
    runs: no variable changes, no randomness is drawn) and read by a :class:`SampleGraph`;
    the result is kept per model and ``cache_key`` (the loss) and input signature. Call it
    after the micro-batch's own ``model.losses`` were read: the trace leaves its own values
    in the layers until the next call.

    Args:
        records: what the micro-batch's losses reported (:func:`recording`).
        terms: the micro-batch's ``model.losses`` entries (empty: not read).
        cache_key: identifies ``loss_of`` across calls (the model's compiled loss, or the
            trainer's loss).
    """
    unread = [r.kind == "unknown" for r in records]
    n_regularizers = regularization_count(model)
    if not any(unread) and len(terms) <= n_regularizers:
        return Forms([None] * len(records),
                     [TermForm(ONCE, f"model.losses[{i}] (a weight regulariser)")
                      for i in range(len(terms))])
    try:
        signature = tuple(
            None if t is None else (tuple(t.shape[1:]), tf.as_dtype(t.dtype).name)
            for t in tf.nest.flatten((x, y, sample_weight)))
        structure = tf.nest.map_structure(lambda _: 0, (x, y, sample_weight))
    except (TypeError, ValueError, AttributeError):
        signature = structure = None
    key = (cache_key, repr(structure), signature, len(records), len(terms))
    cached = _FORMS.setdefault(model, {}) if _weakrefable(model) else {}
    if key not in cached:
        cached[key] = _trace_forms(model, loss_of, x, y, sample_weight, len(terms))
    forms = cached[key]
    if forms is None or len(forms.records) != len(records) or len(forms.terms) != len(terms):
        why = Form("unknown", "the trace that reads loss forms failed or saw other losses")
        first_regularizer = len(terms) - n_regularizers  # Keras appends them last
        return Forms([why if u else None for u in unread], [
            TermForm(ONCE, f"model.losses[{i}] (a weight regulariser)") if i >= first_regularizer
            else TermForm(why, f"model.losses[{i}]") for i in range(len(terms))])
    return Forms([f if u else None for f, u in zip(forms.records, unread, strict=True)],
                 forms.terms)


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:  # pragma: no cover
        return False
    return True


def _trace_forms(model: keras.Model, loss_of: Callable, x: Any, y: Any, sample_weight: Any,
                 n_terms: int) -> Forms | None:
    """:func:`read_forms`'s trace (``None`` where the micro-batch cannot be traced with a
    static batch: composite tensors, a failing trace)."""
    def spec(t):
        if t is None:
            return None
        t = tf.convert_to_tensor(t)
        if t.shape.rank is None or t.shape.rank == 0:
            raise TypeError("no batch axis")
        return tf.TensorSpec((PROBE_BATCH, *t.shape[1:]), t.dtype)

    try:
        specs = tf.nest.map_structure(spec, (x, y, sample_weight))
    except (TypeError, ValueError):
        return None
    found = []  # (no annotation: autograph cannot make an annotated name nonlocal)

    def traced(x, y, sample_weight):
        graph = SampleGraph((x, y, sample_weight))
        with recording(graph) as probe_records:
            y_pred = model(x, training=True)
            loss_of(x, y, y_pred, sample_weight)
        terms = list(model.losses)
        names = [f"model.losses[{i}] ({getattr(t, 'name', '?')})" for i, t in enumerate(terms)]
        found.append(Forms([r.form for r in probe_records],
                           [TermForm(graph.summed_form(t), n) for t, n in zip(terms, names,
                                                                               strict=True)]))
        return tf.constant(0.0)

    try:
        tf.function(traced).get_concrete_function(*specs)
    except Exception:  # noqa: BLE001 - a model that cannot be traced this way: forms unread
        return None
    return found[0] if found and len(found[0].terms) == n_terms else None


# ---------------------------------------------------------------------- the micro-batch's weights
class LossWeights(NamedTuple):
    """How one micro-batch's loss enters the window (:func:`loss_weights`).

    * ``weight``: ``c_i``, what the window adds to its weight ``W`` (float32 scalar).
    * ``scale``: what the micro-batch's loss (the compiled loss plus ``model.losses``, as
      Keras sums them) is multiplied by: ``c_i``, or 1 where the window is a sum.
    * ``extra``: ``(i, e)`` pairs: ``e * sum(model.losses[i])`` is added too, so that entry
      ``i`` enters with ``scale + e`` (float32 scalars).
    * ``log_weight``: what the logged loss weighs this micro-batch by.
    * ``weigh_after``: whether the weight may multiply the gradients after the backward pass
      (mixed precision) instead of the loss: true where the loss is a mean.
    * ``undivided``: the indices of the ``model.losses`` entries that are sums over samples
      beside a mean: their ``extra`` cancels them in the weighed loss, and their gradient is
      added to the window undivided (the window applies ``sum / W + undivided sum``).
    """

    weight: tf.Tensor
    scale: tf.Tensor
    extra: list
    log_weight: tf.Tensor
    weigh_after: bool
    undivided: tuple = ()


def loss_weights(
    normalizer: str | Callable, records: Sequence[Denominator], forms: Forms, x: Any, y: Any,
    sample_weight: Any, y_pred: Any, samples: tf.Tensor, *, first_in_window: Callable,
    accum_steps: int | tf.Tensor, replicas: float = 1.0, owner: Any = None,
) -> LossWeights:
    """Each part of one micro-batch's loss weighed so that the window equals the large batch.

    The large batch's loss is the compiled loss (a mean over its denominator ``D``, or a sum)
    plus every entry of ``model.losses``, each added once (Keras sums a non-scalar entry).
    The window applies ``sum_i (gradient of the micro-batch's weighed loss) / W``:

    * compiled mean loss (or none, with every data-dependent entry a mean over samples):
      ``c_i = D_i`` (samples without a compiled loss), ``W = sum D_i``. An entry that is a
      mean over samples (with ``D`` a count of samples) or has no samples (a weight
      regulariser) enters with ``c_i``: after ``/ W`` it is weighed as at B, and counted once.
    * no compiled loss, and the entries are sums over samples (``add_loss`` of per-sample
      values, as Keras's endpoint layers do): the window is a sum. ``c_i`` is 1 for the first
      micro-batch of the window and 0 after (``first_in_window``; over the replicas of a
      strategy ``1 / replicas`` each), so ``W = 1``: every sum enters with 1, and an entry
      without samples with ``c_i``, once per window.
    * a compiled loss with ``reduction="sum"`` (``normalizer == "sum"``: the window is not
      divided): sums enter with 1, an entry without samples once per window.
    * an entry that is a sum over samples beside a mean (an ``add_loss`` of per-sample values
      beside a compiled mean loss): taken out of the weighed loss and differentiated on its
      own (``undivided``), it enters the window's update undivided, as a sum.

    What one weight per micro-batch cannot make exact is warned about, once per entry and
    model, and weighed as if every window held ``accum_steps`` micro-batches of equal weight:
    a mean beside a sum (``1 / K``), a mean over samples beside a loss that divides by another
    count, and an entry that is neither a sum nor a mean over samples (``Form``
    ``"unknown"``).

    ``normalizer``, ``records``, the micro-batch and ``owner`` are :func:`micro_batch_weight`'s;
    ``forms``: what :func:`read_forms` read for ``records`` and ``model.losses``;
    ``first_in_window() -> bool scalar``: no micro-batch is in the window yet; ``accum_steps``:
    K; ``replicas``: the replicas in sync (1 without a strategy).
    """
    records = [Denominator(r.value, r.kind, r.key, r.name, f) if f is not None else r
               for r, f in zip(records, forms.records, strict=True)]
    samples_f = tf.cast(samples, tf.float32)
    terms = list(enumerate(forms.terms))
    kinds = {t.form.kind for _, t in terms} - {"once"}

    def first() -> tf.Tensor:
        return tf.cast(first_in_window(), tf.float32) / replicas

    if normalizer == "sum":  # a compiled summed loss: the window is a sum, not divided
        extra = _sum_window_extra(terms, first(), tf.cast(accum_steps, tf.float32), owner,
                                  "a sum (the compiled loss has reduction='sum')")
        return LossWeights(samples_f, tf.constant(1.0), extra, samples_f, False)
    if normalizer == "auto" and not records and "sum" in kinds and "mean" not in kinds:
        weight = first()  # W = 1: the window's terms are sums
        extra = _sum_window_extra(terms, weight, tf.cast(accum_steps, tf.float32), owner,
                                  "a sum (the other entries of model.losses are sums)")
        return LossWeights(weight, tf.constant(1.0), extra, samples_f, False)
    weight, key = _weight_and_key(normalizer, records, x, y, sample_weight, y_pred, samples,
                                  owner)
    extra, undivided = _mean_window_extra(terms, weight, key, owner)
    return LossWeights(weight, weight, extra, weight, True, undivided)


def _sum_window_extra(terms: Sequence, first: tf.Tensor, k: tf.Tensor, owner: Any,
                      expected: str) -> list:
    """The ``extra`` weights of a window that is a sum (``W = 1`` or undivided): an entry
    without samples enters once per window (``first``: 1 for the window's first micro-batch,
    else 0), one that is neither a sum nor once is warned and weighed ``1 / K``."""
    extra = []
    for i, term in terms:
        if term.form.kind == "once":
            extra.append((i, first - 1.0))
        elif term.form.kind != "sum":
            _warn_term(owner, term, expected)
            extra.append((i, 1.0 / k - 1.0))
    return extra


def _mean_window_extra(terms: Sequence, weight: tf.Tensor, key: tuple,
                       owner: Any) -> tuple[list, tuple]:
    """The ``extra`` weights of a window that is a mean (divided by ``W``), and the entries
    added undivided: a sum over samples is cancelled in the weighed loss (``-c_i``) and
    listed as undivided; a mean over samples beside another denominator, or an entry of
    unknown form, is warned and keeps ``c_i``."""
    extra, undivided = [], []
    for i, term in terms:
        if term.form.kind == "sum":
            extra.append((i, -weight))
            undivided.append(i)
        elif term.form.kind == "mean" and key != ("samples",):
            _warn_term(owner, term, f"the loss, which divides by {_key_words(key)}")
        elif term.form.kind == "unknown":
            _warn_term(owner, term, "a mean over the loss's denominator")
    return extra, tuple(undivided)


def _key_words(key: tuple) -> str:
    return {"valid": "its valid elements (a Keras mask or ignore_class)",
            "weights": "its sample-weight sum", "normalizer": "the normalizer's count",
            "elements": "its number of elements"}.get(key[0], "another count")


def _warn_term(owner: Any, term: TermForm, weighed_as: str) -> None:
    """Once per entry and model: an entry of ``model.losses`` that one weight per micro-batch
    cannot make exact, how it is weighed instead, and what makes it exact."""
    what = {"sum": "a sum over the micro-batch's samples",
            "mean": "a mean over the micro-batch's samples",
            "unknown": f"neither a sum nor a mean over samples (here: {term.form.detail})"}
    _warn_once(owner, ("term", term.name, weighed_as), (
        f"{term.name} is {what[term.form.kind]}, but the model's loss is {weighed_as}, so one "
        "weight per micro-batch cannot make the window equal the large batch: accumcore "
        "weighs it as if every window held K micro-batches of equal weight (exact only then). "
        "To be exact, make every part of the loss the same kind: sums over samples (compile "
        "without a loss, or with reduction='sum', and `add_loss` per-sample values), or means "
        "over samples (`add_loss(ops.mean(...))` beside a loss without a mask); a term that "
        "is neither (a token mean, a maximum) becomes exact as a sum or mean over samples, "
        "or as a compiled loss with a Keras mask."
    ))
