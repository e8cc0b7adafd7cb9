"""MNIST read as sequences, and labels partly ignored: the data of chapter "Masks and tokens".

An MNIST image of 28 x 28 pixels is read as a sequence of 28 time steps of 28 pixels each (row
``t`` is step ``t``). :func:`mnist_as_sequences` keeps the first ``length`` rows of every image, a
random length per image, fills the remaining steps with :data:`PAD_VALUE` and repeats the digit's
label at every step, so that a model can be trained with a per-step loss ("which digit is it,
after reading this many rows?") whose mask comes from ``keras.layers.Masking``.

The padding value is -1, a value no pixel takes (pixels are scaled to [0, 1]): ``Masking`` masks a
step whose features *all* equal its ``mask_value``, and the top and bottom rows of most MNIST
digits are entirely blank, so padding with 0 would also mask those real, blank rows.

:func:`ignore_labels` replaces a fixed fraction of labels by an ignored class (for
``SparseCategoricalCrossentropy(ignore_class=-1)``), and :func:`per_micro_batch` counts the
valid items (steps, labels) of each micro-batch: the numbers Keras's loss divides by.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: What padded time steps are filled with (no pixel value in [0, 1] equals it).
PAD_VALUE = -1.0
#: The label that ``SparseCategoricalCrossentropy(ignore_class=IGNORED)`` leaves out.
IGNORED = -1


@dataclass(frozen=True)
class Sequences:
    """Padded sequences of image rows.

    Attributes:
        x: (n, steps, 28) float32: pixel rows in [0, 1], padded steps all :data:`PAD_VALUE`.
        y: (n, steps) int32: the image's label at every step (padded steps included, which a
            mask leaves out of the loss).
        lengths: (n,) int64: the number of valid (unpadded) steps of each sequence.
    """

    x: np.ndarray
    y: np.ndarray
    lengths: np.ndarray

    @property
    def mask(self) -> np.ndarray:
        """The valid steps, an (n, steps) bool array (what ``Masking`` computes from ``x``)."""
        return np.arange(self.x.shape[1])[None, :] < self.lengths[:, None]


def mnist_as_sequences(
    images: np.ndarray,
    labels: np.ndarray,
    *,
    seed: int = 0,
    min_length: int = 1,
    max_length: int | None = None,
    pad_value: float = PAD_VALUE,
) -> Sequences:
    """Images cut to random lengths (rows kept from the top) and padded to the full height.

    Args:
        images: (n, rows, cols) images, uint8 in 0..255 (MNIST) or floats in [0, 1].
        labels: (n,) integer labels.
        seed: seed of the lengths (``numpy.random.default_rng(seed)``).
        min_length: the shortest length drawn, in rows.
        max_length: the longest length drawn, in rows (default: the number of rows). Lengths
            are drawn uniformly from ``min_length..max_length``, both included.
        pad_value: what padded steps are filled with. It must lie outside the pixels' range,
            or ``Masking`` would also mask image rows that equal it.

    Returns:
        :class:`Sequences` with float32 ``x`` of the images' shape and int32 ``y`` of shape
        (n, rows).

    Raises:
        ValueError: for images that are not (n, rows, cols), labels of another length, lengths
            outside 1..rows, or a ``pad_value`` inside [0, 1].
    """
    images = np.asarray(images)
    labels = np.asarray(labels)
    if images.ndim != 3:
        raise ValueError(f"`images` must have shape (n, rows, cols), got {images.shape}.")
    n, rows, _ = images.shape
    if labels.shape != (n,):
        raise ValueError(f"`labels` must have shape ({n},), got {labels.shape}.")
    max_length = rows if max_length is None else max_length
    if not 1 <= min_length <= max_length <= rows:
        raise ValueError(
            f"Need 1 <= min_length <= max_length <= {rows} (the number of rows), got "
            f"min_length={min_length}, max_length={max_length}."
        )
    if 0.0 <= pad_value <= 1.0:
        raise ValueError(
            f"pad_value={pad_value} lies in the pixels' range [0, 1]: Masking would also mask "
            "image rows that equal it (blank rows are all 0). Use a value outside, e.g. -1."
        )
    pixels = images.astype("float32")
    if images.dtype == np.uint8:
        pixels /= 255.0
    lengths = np.random.default_rng(seed).integers(min_length, max_length + 1, size=n)
    valid = np.arange(rows)[None, :] < lengths[:, None]
    x = np.where(valid[..., None], pixels, np.float32(pad_value)).astype("float32")
    y = np.repeat(labels.astype("int32")[:, None], rows, axis=1)
    return Sequences(x, y, lengths)


def ignore_labels(labels: np.ndarray, fraction: float, *, seed: int = 0,
                  ignore_class: int = IGNORED) -> np.ndarray:
    """A copy of ``labels`` with ``round(fraction * n)`` of them, chosen at random, set to
    ``ignore_class`` (the loss's ``ignore_class`` then leaves them out).

    Raises:
        ValueError: for a fraction outside [0, 1], or labels that already hold
            ``ignore_class``.
    """
    labels = np.asarray(labels)
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"`fraction` must lie in [0, 1], got {fraction}.")
    if np.any(labels == ignore_class):
        raise ValueError(f"`labels` already contain ignore_class={ignore_class}.")
    out = labels.astype("int32")  # a copy
    chosen = np.random.default_rng(seed).permutation(len(out))[:round(fraction * len(out))]
    out[chosen] = ignore_class
    return out


def per_micro_batch(valid: np.ndarray, micro_batch: int) -> np.ndarray:
    """The number of valid items in each consecutive micro-batch of ``micro_batch`` samples.

    Args:
        valid: (n, ...) booleans (or 0/1): which items of each sample count (valid steps, or
            labels that are not ignored).
        micro_batch: samples per micro-batch; the last micro-batch may be smaller.

    Returns:
        (ceil(n / micro_batch),) int64 counts.
    """
    valid = np.asarray(valid)
    if micro_batch < 1:
        raise ValueError(f"`micro_batch` must be >= 1, got {micro_batch}.")
    per_sample = valid.reshape(len(valid), -1).sum(axis=1).astype("int64")
    starts = np.arange(0, len(per_sample), micro_batch)
    return np.add.reduceat(per_sample, starts) if len(starts) else np.zeros(0, "int64")
