"""Soak: 20 epochs x ragged windows x every entry point on a small MNIST subset.

72 MNIST training images in micro-batches of 16 give 5 micro-batches per epoch (4 x 16 + 8),
and with K = 3 an epoch ends in a partial window of 2 micro-batches. Over 20 epochs each
entry point must apply exactly the expected number of optimizer updates (checked on the
optimizer's own ``iterations`` as well as accumcore's counters) and count every sample exactly
once: ``samples_seen`` (the library's counter of samples counted into windows) must be
72 x 20, and the samples that reached an update must be ``samples_seen - samples_dropped -
window_samples`` (pending). The expected numbers come from a plain Python simulation of the
window sequence (:func:`expected`), independent of the library.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import accumcore as ac
from accumcore.checkpointing import ResumableLoop
from accumcore.lab.data import load_mnist, preprocess
from accumcore.lab.experiments import mlp

N, MICRO, K, EPOCHS = 72, 16, 3, 20
SIZES = [min(MICRO, N - s) for s in range(0, N, MICRO)]  # [16, 16, 16, 16, 8] per epoch
LOSS = "sparse_categorical_crossentropy"

# ~20 s of CPU: deselected by `-m "not slow"`, always run by CI (`pytest tests`).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mnist() -> tuple[np.ndarray, np.ndarray]:
    data = load_mnist(verbose=False)
    return preprocess(data.x_train[:N]), data.y_train[:N].astype("int32")


def expected(policy: str, sizes: list[int] = SIZES) -> dict:
    """Simulate the windows: updates per epoch, samples dropped, samples pending at the end."""
    updates, dropped, window = [], 0, []
    for _ in range(EPOCHS):
        applied = 0
        for size in sizes:
            window.append(size)
            if len(window) == K:
                applied, window = applied + 1, []
        if window and policy == "apply":
            applied, window = applied + 1, []
        elif window and policy == "drop":
            dropped, window = dropped + sum(window), []
        updates.append(applied)
    return dict(per_epoch=updates, updates=sum(updates), dropped=dropped, pending=sum(window))


def check(state: ac.AccumulationState, optimizer, policy: str, micro_batches: int,
          want: dict | None = None) -> None:
    want = want or expected(policy)
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
    check(t.state, t.optimizer, policy, len(SIZES) * EPOCHS)
    assert history.updates == expected(policy)["per_epoch"]
    assert len(history.micro_losses) == len(SIZES) * EPOCHS
    assert sum(history.micro_weights) == N * EPOCHS


def test_soak_window_step(mnist):
    """window_step splits each large batch of 48 (and the last of 24) in the graph.
    Catches: a large batch split into overlapping or missing slices."""
    x, y = mnist
    t = trainer("apply")
    big = K * MICRO
    for _ in range(EPOCHS):
        for start in range(0, N, big):
            t.window_step(x[start:start + big], y[start:start + big])
    # 48 -> 3 x 16 and 24 -> 3 x 8 micro-batches: 2 windows (updates) per epoch
    check(t.state, t.optimizer, "apply", (3 + 3) * EPOCHS,
          dict(updates=2 * EPOCHS, dropped=0, pending=0))


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
    check(model.accumulation, model.optimizer, policy, len(SIZES) * EPOCHS)


def test_soak_resumable_loop(mnist, tmp_path):
    """The checkpointing loop, saving every 7 micro-batches (mid-epoch, mid-window) for 20
    epochs. Catches: saving or the epoch bookkeeping disturbing the training stream."""
    x, y = mnist
    t = trainer("apply")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=1).batch(MICRO)
    loop = ResumableLoop(t, tmp_path, save_every=7, max_to_keep=1, save_at_epoch_end=False)
    history = loop.fit(ds, EPOCHS, mode="function")
    check(t.state, t.optimizer, "apply", len(SIZES) * EPOCHS)
    assert history.updates == expected("apply")["per_epoch"]
    assert loop.manager.latest_checkpoint is not None
