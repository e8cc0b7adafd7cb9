"""Helpers shared by the tests, the book's notebooks and the benchmarks.

Model builders with fixed seeds (so two runs start from identical weights), the large-batch
reference update, and the relative error used everywhere in this project::

    rel = max |w - w_ref| / max |w_ref - w_init|

i.e. the largest weight difference measured in units of the largest reference update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np


def get_weights(model: keras.Model) -> list[np.ndarray]:
    """All model weights (trainable and not) as numpy copies."""
    return [np.array(w) for w in model.get_weights()]


def relative_error(
    weights: Sequence[np.ndarray],
    reference: Sequence[np.ndarray],
    initial: Sequence[np.ndarray],
) -> float:
    """``max|w - w_ref| / max|w_ref - w_init|`` over all tensors (dimensionless).

    0 means identical to the reference; 1 means an error as large as the whole reference
    update. Float32 round-off for one exact accumulated update is about 1e-6..1e-5.
    """
    num = max(float(np.max(np.abs(np.asarray(w, np.float64) - r))) for w, r in
              zip(weights, reference))
    den = max(float(np.max(np.abs(np.asarray(r, np.float64) - i))) for r, i in
              zip(reference, initial))
    if den == 0.0:
        raise ValueError("The reference did not move from the initial weights: no update.")
    return num / den


def mlp(
    input_dim: int = 784,
    hidden: Sequence[int] = (256, 256),
    classes: int = 10,
    *,
    seed: int = 0,
    model_cls: Callable[..., keras.Model] = keras.Model,
    dtype: str | None = None,
    **model_kwargs: Any,
) -> keras.Model:
    """The MNIST MLP (784-256-256-10 by default), softmax output, identical weights per seed.

    ``model_cls`` may be :class:`accumcore.AccumModel` (``model_kwargs`` go to it).
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((input_dim,), dtype=dtype)
    h = inputs
    for width in hidden:
        h = keras.layers.Dense(width, activation="relu", dtype=dtype)(h)
    outputs = keras.layers.Dense(classes, activation="softmax", dtype=dtype)(h)
    return model_cls(inputs, outputs, **model_kwargs)


def conv_net(
    input_shape: tuple[int, int, int] = (28, 28, 1),
    classes: int = 10,
    *,
    filters: Sequence[int] = (32, 64),
    seed: int = 0,
    batch_norm: bool = False,
    model_cls: Callable[..., keras.Model] = keras.Model,
    **model_kwargs: Any,
) -> keras.Model:
    """A small MNIST conv net (conv-pool blocks, then dense), identical weights per seed."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(input_shape)
    h = inputs
    for f in filters:
        h = keras.layers.Conv2D(f, 3, padding="same", use_bias=not batch_norm)(h)
        if batch_norm:
            h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Activation("relu")(h)
        h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    outputs = keras.layers.Dense(classes, activation="softmax")(h)
    return model_cls(inputs, outputs, **model_kwargs)


def large_batch_reference(
    build_model: Callable[[], keras.Model],
    make_optimizer: Callable[[], keras.optimizers.Optimizer],
    loss: Any,
    batches: Sequence[tuple],
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Independent reference: plain ``train_on_batch`` on each large batch, in order.

    Args:
        build_model: returns a fresh plain model (same seed as the model under test).
        make_optimizer: returns a fresh optimizer (same settings).
        loss: the loss for ``compile``.
        batches: large batches ``(x, y)`` or ``(x, y, sample_weight)``; each is one update.

    Returns:
        ``(initial_weights, final_weights)``.
    """
    model = build_model()
    initial = get_weights(model)
    model.compile(make_optimizer(), loss)
    for batch in batches:
        model.train_on_batch(*batch)
    return initial, get_weights(model)
