"""A split batch's window summed in the loop's own values (issue 47): ``fit`` with
``micro_batch_size=16`` at B = 64 (and a ragged B = 40: 16, 16, 8, and a last batch of 20:
16, 4) adds each micro-batch's gradient into ``tf.while_loop`` values, not into the window's
accumulators, and applies a clean window directly; a window that is not clean (non-finite,
stopped, pending from before) goes through the accumulators as before.

References, independent of accumcore, from the same initial weights: plain Keras ``fit`` at B
(the MLP) and, for the Embedding model, plain ``fit`` at B of the same model whose
``train_step`` makes each gradient dense before ``optimizer.apply`` (Keras's optimizers update
repeated rows of a sparse gradient differently; the window's sums are dense). Non-finite
batches: plain ``train_on_batch`` on each applied window's good samples. Tolerance
``REL_TOL`` (tests/helpers.py).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import LOSS, assert_matches_reference, get_weights, make_data, small_mlp

import accumcore as ac

MICRO = 16
SIZES = {"B64": (64, 192), "B40_ragged": (40, 100)}  # (B, samples)


def sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.1)


def adam_schedule_ema_clipnorm() -> keras.optimizers.Optimizer:
    rate = keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=1, decay_rate=0.8)
    return keras.optimizers.Adam(rate, clipnorm=0.05, use_ema=True, ema_momentum=0.5,
                                 ema_overwrite_frequency=2)


OPTIMIZERS = {"sgd": sgd, "adam_schedule_ema_clipnorm": adam_schedule_ema_clipnorm}


class DenseGradientModel(keras.Model):
    """Plain Keras training with every gradient made dense before ``optimizer.apply``."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True), training=True)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply([tf.convert_to_tensor(g) for g in grads], self.trainable_variables)
        return {"loss": loss}


def embedding_model(seed: int = 0, model_cls=keras.Model) -> keras.Model:
    """6 tokens (vocabulary 10) -> Embedding(10, 4) -> mean over tokens -> Dense(3)."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(10, 4)(tokens))
    return model_cls(tokens, keras.layers.Dense(3, activation="softmax")(h))


def token_data(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    return (rng.integers(0, 10, size=(n, 6)).astype("int32"),
            rng.integers(0, 3, size=n).astype("int32"))


MODELS = {"mlp": (small_mlp, make_data), "embedding": (embedding_model, token_data)}


def fitted(make_model, make_opt, x, y, batch: int, how: dict | None, model_cls=keras.Model):
    """``(initial weights, model)`` after one epoch of ``fit(batch_size=batch)``, plain
    (``how=None``) or after ``accumulate(model, **how)``."""
    model = make_model(model_cls=model_cls)
    initial = get_weights(model)
    model.compile(make_opt(), LOSS)
    if how is not None:
        ac.accumulate(model, **how)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return initial, model


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("kind", MODELS)
def test_a_split_window_makes_plain_fits_update_at_b(kind, opt, size):
    make_model, make = MODELS[kind]
    batch, n = SIZES[size]
    x, y = make(n)
    initial, model = fitted(make_model, OPTIMIZERS[opt], x, y, batch,
                            dict(micro_batch_size=MICRO))
    reference = DenseGradientModel if kind == "embedding" else keras.Model
    _, plain = fitted(make_model, OPTIMIZERS[opt], x, y, batch, None, reference)
    windows = -(-n // batch)
    micro_batches = sum(-(-min(batch, n - s) // MICRO) for s in range(0, n, batch))
    counts = model.accumulation.counters()
    assert (counts["windows_applied"], counts["windows_skipped"]) == (windows, 0)
    assert counts["micro_batches_seen"] == micro_batches and counts["samples_seen"] == n
    assert counts["micro_step"] == 0 and counts["samples_dropped"] == 0
    assert int(model.optimizer.iterations.numpy()) == windows
    assert_matches_reference(model, initial, get_weights(plain))


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_the_accumulators_are_not_read_or_written_by_a_clean_split_window(opt):
    """The accumulators hold 7.0 while the window is empty (a sentinel): a clean split window
    neither reads them (the weights are plain fit's) nor writes them (still 7.0)."""
    x, y = make_data(192)
    _, plain = fitted(small_mlp, OPTIMIZERS[opt], x, y, 64, None)
    model = small_mlp()
    initial = get_weights(model)
    model.compile(OPTIMIZERS[opt](), LOSS)
    ac.accumulate(model, micro_batch_size=MICRO)
    model.train_on_batch(x[:64], y[:64])  # builds the state (one update)
    for accumulator in model.accumulation.accumulators:
        accumulator.assign(np.full(accumulator.shape, 7.0, "float32"))
    model.fit(x[64:], y[64:], batch_size=64, epochs=1, shuffle=False, verbose=0)
    for accumulator in model.accumulation.accumulators:
        np.testing.assert_array_equal(accumulator.numpy(), 7.0)
    assert model.accumulation.counters()["windows_applied"] == 3
    assert_matches_reference(model, initial, get_weights(plain))


def test_a_pending_window_is_completed_by_the_next_split_batch():
    """A micro-batch of 16 added by hand (a pending window) and the next batch of 64 split
    into 4 make one window of 80 samples: plain ``train_on_batch`` on those 80, then plain
    fit at 64 on the rest."""
    x, y = make_data(208)
    plain = small_mlp()
    initial = get_weights(plain)
    plain.compile(sgd(), LOSS)
    plain.train_on_batch(x[:80], y[:80])
    plain.fit(x[80:], y[80:], batch_size=64, epochs=1, shuffle=False, verbose=0)
    model = small_mlp()
    model.compile(sgd(), LOSS)
    ac.accumulate(model, micro_batch_size=MICRO)
    state = model.accumulation
    state.prepare(model)
    summed = keras.losses.SparseCategoricalCrossentropy(reduction="sum")
    with tf.GradientTape() as tape:
        loss = summed(y[:16], model(x[:16], training=True))
    state.accumulate(tape.gradient(loss, model.trainable_variables), 16.0, 16, model.optimizer)
    assert state.counters()["micro_step"] == 1
    model.fit(x[16:], y[16:], batch_size=64, epochs=1, shuffle=False, verbose=0)
    counts = state.counters()
    assert (counts["windows_applied"], counts["micro_batches_seen"]) == (3, 13)
    assert counts["samples_seen"] == 208 and counts["micro_step"] == 0
    assert all(not a.numpy().any() for a in state.accumulators)  # closed through the window
    assert_matches_reference(model, initial, get_weights(plain))


def _bad_data() -> tuple[np.ndarray, np.ndarray]:
    """192 samples; sample 90 (batch 1 of 64, its micro-batch 1 of 16) has a NaN input."""
    x, y = make_data(192)
    x = x.copy()
    x[90, 0] = np.nan
    return x, y


def _plain_on(x, y, windows: list) -> tuple[list, list]:
    """``(initial, final)`` weights of plain ``train_on_batch`` on each window's samples."""
    plain = small_mlp()
    initial = get_weights(plain)
    plain.compile(sgd(), LOSS)
    for samples in windows:
        plain.train_on_batch(x[samples], y[samples])
    return initial, get_weights(plain)


@pytest.mark.parametrize("policy", ["skip_window", "skip_micro_batch"])
def test_a_non_finite_split_batch_is_skipped_as_its_policy_says(policy):
    x, y = _bad_data()
    if policy == "skip_window":
        windows = [np.r_[0:64], np.r_[128:192]]
    else:
        windows = [np.r_[0:64], np.r_[64:80, 96:128], np.r_[128:192]]
    initial, plain = _plain_on(x, y, windows)
    _, model = fitted(small_mlp, sgd, x, y, 64,
                      dict(micro_batch_size=MICRO, nonfinite=policy))
    counts = model.accumulation.counters()
    skipped_window = policy == "skip_window"
    assert (counts["windows_applied"], counts["windows_skipped"]) == (
        3 - skipped_window, int(skipped_window))
    assert counts["samples_dropped"] == (64 if skipped_window else 16)
    assert counts["micro_batches_skipped"] == (not skipped_window)
    assert counts["micro_batches_seen"] == 12 and counts["samples_seen"] == 192
    assert int(model.optimizer.iterations.numpy()) == len(windows)
    assert_matches_reference(model, initial, plain)


def test_a_non_finite_split_batch_raises_and_leaves_the_windows_before_it():
    x, y = _bad_data()
    initial, plain = _plain_on(x, y, [np.r_[0:64]])
    model = small_mlp()
    model.compile(sgd(), LOSS)
    ac.accumulate(model, micro_batch_size=MICRO)
    with pytest.raises(ac.NonFiniteGradientError) as caught:
        model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert (caught.value.window, caught.value.first_micro_step) == (1, 4)
    assert caught.value.micro_batches == 4 and caught.value.unused_micro_batches == 4
    counts = model.accumulation.counters()
    assert (counts["windows_applied"], counts["windows_skipped"]) == (1, 2)
    assert counts["micro_batches_seen"] == 12 and counts["samples_dropped"] == 128
    assert all(not a.numpy().any() for a in model.accumulation.accumulators)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert_matches_reference(model, initial, plain)
