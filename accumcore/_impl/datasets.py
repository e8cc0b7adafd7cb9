"""What ``AccumTrainer.fit`` trains on: arrays or a dataset as micro-batches, checked, and the
epochs drawn from it (the whole dataset each epoch, or ``steps_per_epoch`` from one iterator).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from accumcore._impl import distribute
from accumcore._impl.settings import check_positive_int


def array_dataset(arrays: tuple, batch_size: int, shuffle: bool) -> tf.data.Dataset:
    """Micro-batches of ``batch_size`` samples from in-memory arrays, as ``model.fit`` makes.

    Args:
        arrays: ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``; each a numpy array, a tensor,
            or a list / dict of them (several inputs), all with the same number of samples n.
        batch_size: samples per micro-batch b (the last one has ``n mod b`` if not 0).
        shuffle: draw a new permutation every epoch (every pass over the dataset), seeded by
            TensorFlow's global seed; else keep the order.

    The arrays are held once (``from_tensors(...).repeat()``) and each micro-batch gathers its
    indices, so neither a shuffle buffer nor a graph constant copies the data.
    """
    tensors = tf.nest.map_structure(tf.convert_to_tensor, arrays)
    sizes = {int(t.shape[0]) for t in tf.nest.flatten(tensors)}
    if len(sizes) != 1:
        names = ("x", "y", "sample_weight")
        found = ", ".join(
            f"{names[i]}: {sorted({int(t.shape[0]) for t in tf.nest.flatten(a)})}"
            for i, a in enumerate(tensors)
        )
        raise ValueError(
            f"`x`, `y` and `sample_weight` must have the same number of samples, got {found}."
        )
    (n,) = sizes
    indices = tf.data.Dataset.range(n)
    if shuffle:
        indices = indices.shuffle(n, reshuffle_each_iteration=True)
    indices = indices.batch(batch_size)
    data = tf.data.Dataset.from_tensors(tensors).repeat()
    return tf.data.Dataset.zip((indices, data)).map(
        lambda i, d: tf.nest.map_structure(lambda a: tf.gather(a, i), d),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )


def as_dataset(x: Any, y: Any, sample_weight: Any, batch_size: int | None, shuffle: Any, *,
               fixed_batch_size: int | None = None) -> tf.data.Dataset:
    """``fit``'s input as a dataset of batches: a dataset as it is, arrays batched by
    ``batch_size`` (default 32, as ``model.fit``; ``fixed_batch_size``: the only size
    allowed, and the default: the trainer's old form, whose K was computed from it)."""
    if isinstance(x, tf.data.Dataset):
        for name, value in (("y", y), ("sample_weight", sample_weight),
                            ("batch_size", batch_size)):
            if value is not None:
                hint = " (did you mean `epochs=`?)" if name != "sample_weight" and (
                    isinstance(value, int)) else ""
                raise ValueError(
                    f"`{name}` must not be given with a dataset{hint}: the dataset yields "
                    "batches of `(x, y)` or `(x, y, sample_weight)`; batch it with "
                    "`dataset.batch(n)`, as for `model.fit` (n: the micro-batch b with "
                    "`accum_steps`, the recipe's batch B with `micro_batch_size`)."
                )
        return x
    leaves = [t for t in tf.nest.flatten(x) if t is not None]
    if not leaves or not all(isinstance(t, (np.ndarray, tf.Tensor)) for t in leaves):
        raise TypeError(
            f"`x` must be a tf.data.Dataset of micro-batches or numpy arrays / tensors "
            f"(with `y=` and `batch_size=`), got {type(x).__name__}. For other inputs "
            "make a dataset: `tf.data.Dataset.from_tensor_slices((x, y)).batch(b)` or "
            "`tf.data.Dataset.from_generator(...)`."
        )
    if y is None and sample_weight is not None:
        raise ValueError("`sample_weight` needs `y`: pass `fit(x, y, sample_weight=...)`.")
    if batch_size is None:
        batch_size = 32 if fixed_batch_size is None else fixed_batch_size  # Keras's default
    elif fixed_batch_size is not None and batch_size != fixed_batch_size:
        raise ValueError(
            f"`batch_size`={batch_size} contradicts the trainer's "
            f"`micro_batch_size`={fixed_batch_size} (K = effective_batch_size / "
            "micro_batch_size was computed from it): leave `batch_size` unset."
        )
    batch_size = check_positive_int(batch_size, "batch_size")
    if not isinstance(shuffle, bool):
        raise ValueError(
            f"`shuffle` must be True (default for arrays, as in model.fit: a new order "
            f"every epoch) or False, got {shuffle!r}."
        )
    return array_dataset(
        tuple(t for t in (x, y, sample_weight) if t is not None), batch_size, shuffle
    )


def check_batched(model: keras.Model, dataset: tf.data.Dataset) -> None:
    """Raise if ``dataset`` yields single samples where ``model`` takes batches."""
    try:
        inputs = list(model.inputs or [])
    except Exception:  # noqa: BLE001 - an unbuilt subclassed model has no inputs
        return
    element = dataset.element_spec
    if not isinstance(element, (tuple, list)):
        element = (element,)
    specs = [s for s in tf.nest.flatten(element[0]) if isinstance(s, tf.TensorSpec)]
    if not inputs or len(specs) != len(inputs):
        return
    for spec, tensor in zip(specs, inputs):
        expected = tf.TensorShape(tensor.shape)
        if (spec.shape.rank is not None and expected.rank is not None
                and spec.shape.rank == expected.rank - 1
                and expected[1:].is_compatible_with(spec.shape)):
            raise ValueError(
                f"`dataset` yields single samples (x of shape {spec.shape}), but the model "
                f"takes batches of shape {expected}: batch it into micro-batches of b "
                "samples with `dataset.batch(b)` (b = the micro-batch size)."
            )


def check_epochs(model: keras.Model, dataset: tf.data.Dataset,
                 steps_per_epoch: int | None) -> tuple[int, int | None]:
    """``(cardinality, steps_per_epoch)`` of a dataset ``fit`` can run epochs of (raises for
    an empty one, an infinite one without ``steps_per_epoch``, or unbatched samples)."""
    cardinality = int(dataset.cardinality())
    if cardinality == 0:
        raise ValueError(
            "`dataset` is empty (cardinality 0): nothing to train on. Check the data "
            "source and that `.batch(b, drop_remainder=True)` did not drop everything."
        )
    if steps_per_epoch is not None:
        steps_per_epoch = check_positive_int(steps_per_epoch, "steps_per_epoch")
    elif cardinality == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "`dataset` is infinite (e.g. `.repeat()` without a count), so an epoch would "
            "never end: pass `steps_per_epoch=` (micro-batches per epoch), as for "
            "`model.fit`."
        )
    check_batched(model, dataset)
    return cardinality, steps_per_epoch


def take(iterator: Iterator, steps: int) -> Iterator:
    """Up to ``steps`` items of ``iterator`` (fewer if it runs out), leaving the rest in it."""
    for _ in range(steps):
        try:
            yield next(iterator)
        except StopIteration:
            return


class EpochSource:
    """Where ``AccumTrainer.fit``'s epochs draw micro-batches: the whole dataset each epoch,
    or with ``steps_per_epoch`` that many from one iterator kept across epochs (as Keras)."""

    def __init__(self, model: keras.Model, dataset: tf.data.Dataset, cardinality: int,
                 steps_per_epoch: int | None) -> None:
        # Under a tf.distribute strategy each global micro-batch is split across the replicas.
        strategy = distribute.model_strategy(model)
        self.batches = dataset if strategy is None else distribute.distribute_dataset(
            strategy, dataset)
        self.cardinality = cardinality
        self.steps_per_epoch = steps_per_epoch
        #: micro-batches per epoch, if known (the progress bar's target)
        self.steps = steps_per_epoch if steps_per_epoch is not None else (
            cardinality if cardinality > 0 else None)
        self._iterator: Iterator | None = None
        self._seen = 0  # micro-batches drawn from the iterator

    def iterator(self) -> Iterator:
        if self._iterator is None:
            self._iterator, self._seen = iter(self.batches), 0
        return self._iterator

    def epoch(self):
        """The micro-batches of one epoch (eager and function modes)."""
        if self.steps_per_epoch is None:
            return self.batches
        return take(self.iterator(), self.steps_per_epoch)

    def count(self, drawn: int, epoch: int) -> bool:
        """Record an epoch of ``drawn`` micro-batches; returns whether the data ran out."""
        if self.steps_per_epoch is None:
            return False
        ran_out = drawn < self.steps_per_epoch
        self._seen += drawn
        if ran_out:
            warnings.warn(
                f"Your input ran out of data after {drawn} of "
                f"steps_per_epoch={self.steps_per_epoch} micro-batches in epoch "
                f"{epoch + 1}: this epoch ends early and the next starts a new "
                "pass over the data (as `model.fit`). Make sure the dataset can "
                "give `steps_per_epoch * epochs` micro-batches, e.g. with "
                "`.repeat()`.",
                UserWarning,
                stacklevel=4,  # count <- epochs.fit_epoch <- AccumTrainer.fit <- the caller
            )
        if ran_out or (self.cardinality > 0 and self._seen >= self.cardinality):
            self._iterator = None  # the next epoch starts a new pass (as Keras)
        return ran_out
