"""Shared fixtures and the large-batch reference harness for the core tests."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from collections.abc import Callable  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import accumcore as ac  # noqa: E402
import accumcore.lab.experiments  # noqa: E402,F401
from accumcore.lab.experiments import get_weights, relative_error  # noqa: E402

# Tolerance for "same update as the large batch" in float32.
# Justification: accumulation computes sum_i c_i * grad(L_i) / sum_i c_i, the large batch computes
# grad(sum over all samples / B): the same real number, summed in a different order. In float32
# (eps = 1.2e-7) that re-association gives relative weight differences of ~1e-6 for SGD and up to
# ~2e-5 for Adam (whose update g / (sqrt(v) + eps) amplifies round-off in tiny gradients) after a
# few updates, measured on this machine. 1e-4 leaves a 5x margin yet is 3-4 orders of magnitude
# below every real bug (a 1/K mis-scaling gives rel ~ 0.2 - 3).
REL_TOL = 1e-4

LOSS = "sparse_categorical_crossentropy"


def small_mlp(seed: int = 0, model_cls: Callable = keras.Model, **kwargs) -> keras.Model:
    """8 -> 16 (tanh) -> 3 (softmax): tiny, so each test case takes well under a second."""
    return ac.lab.experiments.mlp(8, (16,), 3, seed=seed, model_cls=model_cls, **kwargs)


OPTIMIZERS: dict[str, Callable[[], keras.optimizers.Optimizer]] = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
    "sgd_clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=0.01),
    "sgd_exponential_decay": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.5)
    ),
}


@pytest.fixture
def data() -> tuple[np.ndarray, np.ndarray]:
    """40 samples, 8 features, 3 classes (synthetic; equivalence does not depend on the data)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 8)).astype("float32")
    y = rng.integers(0, 3, size=40).astype("int32")
    return x, y


def windows_of(n: int, micro: int, k: int) -> list[slice]:
    """Sample ranges of consecutive windows of K micro-batches of size ``micro`` over n samples
    (the last micro-batch and the last window may be partial: end_of_epoch='apply')."""
    return [slice(s, min(s + micro * k, n)) for s in range(0, n, micro * k)]


def reference_weights(
    make_opt: Callable, x, y, sw, micro: int, k: int, epochs: int = 1, loss=LOSS
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Independent large-batch reference: plain train_on_batch on each window's samples."""
    model = small_mlp()
    initial = get_weights(model)
    model.compile(make_opt(), loss)
    for _ in range(epochs):
        for s in windows_of(len(x), micro, k):
            if sw is None:
                model.train_on_batch(x[s], y[s])
            else:
                model.train_on_batch(x[s], y[s], sample_weight=sw[s])
    return initial, get_weights(model)


def dataset(x, y, sw, micro: int) -> tf.data.Dataset:
    parts = (x, y) if sw is None else (x, y, sw)
    return tf.data.Dataset.from_tensor_slices(parts).batch(micro)


def train_entry(entry: str, make_opt: Callable, x, y, sw, micro: int, k: int,
                epochs: int = 1, loss=LOSS, **kwargs) -> keras.Model:
    """Train with one accumcore entry point; returns the trained model."""
    if entry == "fit":
        model = small_mlp(model_cls=ac.AccumModel, accum_steps=k, **kwargs)
        model.compile(make_opt(), loss)
        model.fit(x, y, sample_weight=sw, batch_size=micro, epochs=epochs, shuffle=False,
                  verbose=0)
        return model
    model = small_mlp()
    trainer = ac.AccumTrainer(model, make_opt(), loss, accum_steps=k, **kwargs)
    if entry == "window_step":
        for _ in range(epochs):
            for s in windows_of(len(x), micro, k):
                trainer.window_step(x[s], y[s], None if sw is None else sw[s])
        return model
    trainer.fit(dataset(x, y, sw, micro), epochs=epochs, mode=entry, verbose=0)
    return model


ENTRIES = ("eager", "function", "graph", "window_step", "fit")


def assert_matches_reference(model, initial, reference, tol: float = REL_TOL) -> float:
    rel = relative_error(get_weights(model), reference, initial)
    assert rel <= tol, f"relative weight error {rel:.3g} > {tol:g}"
    return rel
