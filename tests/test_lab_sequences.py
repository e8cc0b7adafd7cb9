"""The book's sequence data (accumcore.lab.sequences): MNIST rows as time steps, cut, padded."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from accumcore.lab.sequences import (
    IGNORED,
    PAD_VALUE,
    ignore_labels,
    mnist_as_sequences,
    per_micro_batch,
)


def images(n: int = 12, seed: int = 1) -> np.ndarray:
    """MNIST-like uint8 images whose top and bottom rows are blank (all 0), as in MNIST."""
    rng = np.random.default_rng(seed)
    out = rng.integers(0, 256, size=(n, 28, 28)).astype("uint8")
    out[:, :4] = 0
    out[:, -4:] = 0
    return out


def test_rows_are_kept_from_the_top_and_the_rest_is_padding():
    imgs, labels = images(), np.arange(12) % 10
    seq = mnist_as_sequences(imgs, labels, seed=3, min_length=2, max_length=20)
    assert seq.x.shape == (12, 28, 28) and seq.x.dtype == np.float32
    assert seq.y.shape == (12, 28) and seq.y.dtype == np.int32
    assert seq.lengths.min() >= 2 and seq.lengths.max() <= 20
    for i, length in enumerate(seq.lengths):
        np.testing.assert_array_equal(seq.x[i, :length], imgs[i, :length] / np.float32(255))
        assert np.all(seq.x[i, length:] == PAD_VALUE)
        assert np.all(seq.y[i] == labels[i])
    assert seq.mask.sum() == seq.lengths.sum()
    np.testing.assert_array_equal(seq.mask.sum(axis=1), seq.lengths)


def test_lengths_vary_and_depend_on_the_seed_only():
    imgs, labels = images(200), np.zeros(200, "int64")
    a = mnist_as_sequences(imgs, labels, seed=0)
    b = mnist_as_sequences(imgs, labels, seed=0)
    c = mnist_as_sequences(imgs, labels, seed=1)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    assert not np.array_equal(a.lengths, c.lengths)
    assert a.lengths.min() == 1 and a.lengths.max() == 28  # 200 draws from 1..28 reach both


def test_keras_masking_masks_exactly_the_padding_blank_rows_included():
    """The point of PAD_VALUE = -1: Masking(mask_value=-1) masks the padded steps and keeps the
    blank (all-zero) rows of the images, which Masking(mask_value=0) would mask too."""
    seq = mnist_as_sequences(images(), np.zeros(12, "int64"), seed=2, min_length=6)
    mask = keras.layers.Masking(mask_value=PAD_VALUE).compute_mask(seq.x)
    np.testing.assert_array_equal(np.asarray(mask), seq.mask)
    zero_mask = np.asarray(keras.layers.Masking(mask_value=0.0).compute_mask(seq.x))
    assert not np.array_equal(zero_mask, seq.mask)  # blank rows would be lost with 0


def test_float_images_are_used_as_they_are():
    imgs = images(3).astype("float32") / 255
    seq = mnist_as_sequences(imgs, np.array([1, 2, 3]), seed=0, min_length=28)
    np.testing.assert_array_equal(seq.x, imgs)


@pytest.mark.parametrize("kwargs, match", [
    ({"min_length": 0}, "min_length"),
    ({"min_length": 5, "max_length": 4}, "min_length"),
    ({"max_length": 29}, "max_length"),
    ({"pad_value": 0.0}, "pixels' range"),
])
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mnist_as_sequences(images(2), np.array([0, 1]), **kwargs)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="rows, cols"):
        mnist_as_sequences(np.zeros((2, 784)), np.array([0, 1]))
    with pytest.raises(ValueError, match="labels"):
        mnist_as_sequences(images(2), np.array([0, 1, 2]))


def test_ignore_labels_sets_the_fraction_and_keeps_the_rest():
    labels = np.arange(100) % 10
    out = ignore_labels(labels, 0.3, seed=4)
    assert (out == IGNORED).sum() == 30
    kept = out != IGNORED
    np.testing.assert_array_equal(out[kept], labels[kept])
    np.testing.assert_array_equal(labels, np.arange(100) % 10)  # the input is not changed
    assert not np.array_equal(out, ignore_labels(labels, 0.3, seed=5))
    assert (ignore_labels(labels, 0.0) == IGNORED).sum() == 0
    assert (ignore_labels(labels, 1.0) == IGNORED).all()


def test_ignore_labels_rejects_bad_input():
    with pytest.raises(ValueError, match="fraction"):
        ignore_labels(np.arange(4), 1.5)
    with pytest.raises(ValueError, match="already contain"):
        ignore_labels(np.array([0, -1, 2]), 0.5)


def test_per_micro_batch_counts_each_slice_the_last_one_partial():
    valid = np.zeros((10, 3), bool)
    valid[0, :2] = valid[3, :] = valid[9, 0] = True  # 2, 3 and 1 valid items
    np.testing.assert_array_equal(per_micro_batch(valid, 4), [5, 0, 1])
    np.testing.assert_array_equal(per_micro_batch(valid, 10), [6])
    flat = np.array([1, 0, 1, 1, 1])  # one item per sample (labels kept)
    np.testing.assert_array_equal(per_micro_batch(flat, 2), [1, 2, 1])
    with pytest.raises(ValueError, match="micro_batch"):
        per_micro_batch(valid, 0)
