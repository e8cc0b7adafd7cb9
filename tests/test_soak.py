"""Soak: 20 epochs x ragged windows x every entry point on a small MNIST subset.

100 MNIST training images in micro-batches of 16 give 7 micro-batches per epoch (6 x 16 +
4), and with K = 3 the last window of an epoch holds one micro-batch. Over 20 epochs each
entry point must apply exactly the expected number of optimizer updates (checked on the
optimizer's own ``iterations`` as well as accumcore's counters) and count every sample exactly
once: ``samples_seen`` (the library's counter of samples counted into windows) must be
100 x 20, and the samples that reached an update must be ``samples_seen - samples_dropped -
window_samples`` (pending). The expected numbers are computed here from the sizes alone.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import accumcore as ac
from accumcore.checkpointing import ResumableLoop
from accumcore.data import load_mnist, preprocess
from accumcore.experiments import mlp

N, MICRO, K, EPOCHS = 100, 16, 3, 20
MICRO_PER_EPOCH = math.ceil(N / MICRO)  # 7
LOSS = "sparse_categorical_crossentropy"


@pytest.fixture(scope="module")
def mnist() -> tuple[np.ndarray, np.ndarray]:
    data = load_mnist(verbose=False)
    return preprocess(data.x_train[:N]), data.y_train[:N].astype("int32")


def expected(policy: str) -> dict[str, int]:
    """Updates and sample counts for 20 epochs, from the sizes alone."""
    total_micro = MICRO_PER_EPOCH * EPOCHS
    last = N - MICRO * (MICRO_PER_EPOCH - 1)  # 4 samples in the ragged last micro-batch
    if policy == "apply":  # ceil(7 / 3) = 3 updates per epoch, the last of 1 micro-batch
        return dict(updates=math.ceil(MICRO_PER_EPOCH / K) * EPOCHS, dropped=0, pending=0)
    if policy == "drop":  # 2 full windows per epoch; the 7th micro-batch (4 samples) dropped
        return dict(updates=(MICRO_PER_EPOCH // K) * EPOCHS, dropped=last * EPOCHS, pending=0)
    # carry: one stream of 140 micro-batches -> 46 windows, 2 micro-batches pending at the end
    # (the last epoch's 6th and 7th: 16 + 4 samples)
    assert total_micro % K == 2
    return dict(updates=total_micro // K, dropped=0, pending=MICRO + last)


def check(state: ac.AccumulationState, optimizer, policy: str, micro_batches: int) -> None:
    want = expected(policy)
    c = state.counters()
    assert int(optimizer.iterations.numpy()) == want["updates"]
    assert c["windows_applied"] == want["updates"] and c["windows_skipped"] == 0
    assert c["micro_batches_seen"] == micro_batches
    assert c["samples_seen"] == N * EPOCHS, "samples lost or counted twice"
    assert c["samples_dropped"] == want["dropped"]
    assert c["window_samples"] == want["pending"]
    applied = c["samples_seen"] - c["samples_dropped"] - c["window_samples"]
    assert applied == N * EPOCHS - want["dropped"] - want["pending"]


def trainer(policy: str) -> ac.AccumTrainer:
    model = mlp(784, (16,), 10, seed=0)
    return ac.AccumTrainer(model, keras.optimizers.Adam(1e-3), LOSS, accum_steps=K,
                           end_of_epoch=policy)


@pytest.mark.parametrize(("mode", "policy"), [
    ("eager", "apply"), ("function", "carry"), ("graph", "drop"),
])
def test_soak_custom_loop(mode, policy, mnist):
    """Catches: a window lost or doubled at epoch ends, a ragged micro-batch miscounted, a
    carried window reset between epochs, a dropped window applied, counters drifting."""
    x, y = mnist
    t = trainer(policy)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)
    history = t.fit(ds, epochs=EPOCHS, mode=mode, verbose=0)
    check(t.state, t.optimizer, policy, MICRO_PER_EPOCH * EPOCHS)
    assert sum(history.updates) == expected(policy)["updates"]
    assert len(history.micro_losses) == MICRO_PER_EPOCH * EPOCHS
    assert sum(history.micro_weights) == N * EPOCHS
    if policy == "apply":
        assert history.updates == [3] * EPOCHS
        assert len(history.window_losses) == 3 * EPOCHS


def test_soak_window_step(mnist):
    """window_step splits each large batch of 48 (and the last of 4) in the graph.
    Catches: a large batch split into overlapping or missing slices."""
    x, y = mnist
    t = trainer("apply")
    big = K * MICRO
    for _ in range(EPOCHS):
        for start in range(0, N, big):
            t.window_step(x[start:start + big], y[start:start + big])
    # 48 -> 3 x 16, 48 -> 3 x 16, 4 -> 2 x 2 micro-batches per epoch
    check(t.state, t.optimizer, "apply", (3 + 3 + 2) * EPOCHS)


@pytest.mark.parametrize("policy", ["apply", "carry"])
def test_soak_model_fit(policy, mnist):
    """Catches: WindowFlushCallback flushing twice or never, a carried window lost between
    epochs of fit, Keras' last ragged batch miscounted."""
    x, y = mnist
    model = mlp(784, (16,), 10, seed=0, model_cls=ac.AccumModel, accum_steps=K,
                end_of_epoch=policy)
    model.compile(keras.optimizers.Adam(1e-3), LOSS)
    history = model.fit(x, y, batch_size=MICRO, epochs=EPOCHS, shuffle=True, verbose=0)
    assert len(history.history["loss"]) == EPOCHS
    check(model.accumulation, model.optimizer, policy, MICRO_PER_EPOCH * EPOCHS)


def test_soak_resumable_loop(mnist, tmp_path):
    """The checkpointing loop, saving every 5 micro-batches for 20 epochs.
    Catches: saving or the epoch bookkeeping disturbing the training stream."""
    x, y = mnist
    t = trainer("apply")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=1).batch(MICRO)
    history = ResumableLoop(t, tmp_path, save_every=5, max_to_keep=1).fit(
        ds, EPOCHS, mode="function")
    check(t.state, t.optimizer, "apply", MICRO_PER_EPOCH * EPOCHS)
    assert history.updates == [3] * EPOCHS
