"""A window of one micro-batch (issue 49): a batch that is not split (``micro_batch_size`` at
least the batch) or ``accum_steps=1`` makes the plain update directly, without the window's
accumulators, and gives what plain ``fit`` at B gives.

References: plain Keras ``fit`` at B from the same initial weights (the MLP, every optimizer;
the Embedding model with SGD), and for the Embedding model also today's window path, the same
batch split in two (``micro_batch_size=B // 2``: dense gradients, which tests/test_tokens.py and
tests/test_equivalence.py pin to the dense large-batch reference; Keras's optimizers update
repeated rows of a sparse gradient differently, so with Adam plain ``fit`` is no reference for
an Embedding). Tolerance ``REL_TOL`` (tests/helpers.py); mixed precision ``TOL`` of
tests/test_mixed_precision.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from helpers import LOSS, REL_TOL, assert_matches_reference, get_weights, make_data, small_mlp

import accumcore as ac
from accumcore.lab.experiments import relative_error

B = 8  # 40 samples: five batches of 8
MODES = {"micro_batch_size": dict(micro_batch_size=B), "accum_steps": dict(accum_steps=1)}


def sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.1)


def adam_schedule_ema_clipnorm() -> keras.optimizers.Optimizer:
    rate = keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=1, decay_rate=0.8)
    return keras.optimizers.Adam(rate, clipnorm=0.05, use_ema=True, ema_momentum=0.5,
                                 ema_overwrite_frequency=2)


OPTIMIZERS = {"sgd": sgd, "adam_schedule_ema_clipnorm": adam_schedule_ema_clipnorm}


def embedding_model(seed: int = 0) -> keras.Model:
    """6 tokens (vocabulary 10) -> Embedding(10, 4) -> mean over tokens -> Dense(3)."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(10, 4)(tokens))
    return keras.Model(tokens, keras.layers.Dense(3, activation="softmax")(h))


def token_data(n: int = 40) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    return (rng.integers(0, 10, size=(n, 6)).astype("int32"),
            rng.integers(0, 3, size=n).astype("int32"))


MODELS = {"mlp": (small_mlp, make_data), "embedding": (embedding_model, token_data)}


def fitted(make_model, make_opt, x, y, how: dict | None, *, batch: int = B, **compile_kwargs):
    """``(initial weights, model)`` after one epoch of ``fit(batch_size=batch)``, plain
    (``how=None``) or after ``accumulate(model, **how)``."""
    model = make_model()
    initial = get_weights(model)
    model.compile(make_opt(), LOSS, **compile_kwargs)
    if how is not None:
        ac.accumulate(model, **how)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return initial, model


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("kind", MODELS)
def test_one_micro_batch_window_makes_plain_fits_update(kind, opt, mode):
    make_model, make = MODELS[kind]
    x, y = make()
    initial, model = fitted(make_model, OPTIMIZERS[opt], x, y, MODES[mode])
    assert int(model.optimizer.iterations.numpy()) == 5
    assert model.accumulation.counters()["windows_applied"] == 5
    if kind == "mlp" or opt == "sgd":
        _, plain = fitted(make_model, OPTIMIZERS[opt], x, y, None)
        assert_matches_reference(model, initial, get_weights(plain))
    if kind == "embedding":  # today's window path: the batch split in two, dense gradients
        _, split = fitted(make_model, OPTIMIZERS[opt], x, y, dict(micro_batch_size=B // 2))
        assert_matches_reference(model, initial, get_weights(split))


@pytest.mark.parametrize("spe", [1, 3])
def test_the_window_is_not_read_or_written(spe):
    """The accumulators hold 7.0 (an empty window by its counters: a sentinel): through the
    window the first update would add them to its gradient and zero them; directly they are
    neither read nor written, and the weights are plain fit's. With ``steps_per_execution``
    and a batch of unknown size, the step picks the direct way at run time."""
    x, y = make_data()
    _, plain = fitted(small_mlp, sgd, x, y, None, steps_per_execution=spe)
    model = small_mlp()
    initial = get_weights(model)
    model.compile(sgd(), LOSS, steps_per_execution=spe)
    ac.accumulate(model, micro_batch_size=B)
    model.train_on_batch(x[:B], y[:B])  # builds the state (one update)
    for accumulator in model.accumulation.accumulators:
        accumulator.assign(np.full(accumulator.shape, 7.0, "float32"))
    model.fit(x[B:], y[B:], batch_size=B, epochs=1, shuffle=False, verbose=0)
    for accumulator in model.accumulation.accumulators:
        np.testing.assert_array_equal(accumulator.numpy(), 7.0)
    assert model.accumulation.counters()["windows_applied"] == 5
    assert_matches_reference(model, initial, get_weights(plain))


def test_a_batch_larger_than_b_still_goes_through_the_window():
    """The split (b < B) is untouched: the sentinel is read (added into the first window's sum,
    then zeroed) and the weights move away from plain fit's."""
    x, y = make_data()
    _, plain = fitted(small_mlp, sgd, x, y, None)
    model = small_mlp()
    initial = get_weights(model)
    model.compile(sgd(), LOSS)
    ac.accumulate(model, micro_batch_size=B // 2)
    model.train_on_batch(x[:B], y[:B])
    for accumulator in model.accumulation.accumulators:
        accumulator.assign(np.full(accumulator.shape, 7.0, "float32"))
    model.fit(x[B:], y[B:], batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert all(not a.numpy().any() for a in model.accumulation.accumulators)
    assert relative_error(get_weights(model), get_weights(plain), initial) > 100 * REL_TOL


def _bad_batch_data() -> tuple[np.ndarray, np.ndarray]:
    """40 samples; the second batch of 8 (samples 8-15) has a NaN input."""
    x, y = make_data()
    x = x.copy()
    x[10, 0] = np.nan
    return x, y


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["skip_window", "skip_micro_batch"])
def test_a_non_finite_batch_is_skipped_as_its_policy_says(policy, mode):
    """The bad batch's window is skipped (its samples dropped, counted), every other batch
    applied: the weights are plain fit's on the four good batches."""
    x, y = _bad_batch_data()
    good = np.r_[0:8, 16:40]
    _, plain = fitted(small_mlp, sgd, x[good], y[good], None)
    initial, model = fitted(small_mlp, sgd, x, y, dict(MODES[mode], nonfinite=policy))
    counts = model.accumulation.counters()
    assert (counts["windows_applied"], counts["windows_skipped"]) == (4, 1)
    assert counts["samples_dropped"] == B and counts["micro_batches_seen"] == 5
    assert counts["micro_batches_skipped"] == (policy == "skip_micro_batch")
    assert int(model.optimizer.iterations.numpy()) == 4
    assert_matches_reference(model, initial, get_weights(plain))


@pytest.mark.parametrize("mode", MODES)
def test_a_non_finite_batch_raises_and_leaves_the_windows_before_it(mode):
    x, y = _bad_batch_data()
    _, plain = fitted(small_mlp, sgd, x[:B], y[:B], None)
    model = small_mlp()
    initial = get_weights(model)
    model.compile(sgd(), LOSS)
    ac.accumulate(model, **MODES[mode])
    with pytest.raises(ac.NonFiniteGradientError) as caught:
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert (caught.value.window, caught.value.first_micro_step) == (1, 1)
    assert caught.value.micro_batches == 1 and caught.value.unused_micro_batches == 3
    assert model.accumulation.counters()["windows_applied"] == 1
    assert int(model.optimizer.iterations.numpy()) == 1
    assert_matches_reference(model, initial, get_weights(plain))


def mixed_model(seed: int = 0) -> keras.Model:
    """8 -> 16 (relu, float16) -> 3 (float16), softmax in float32."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu", dtype="mixed_float16")(inputs)
    h = keras.layers.Dense(3, dtype="mixed_float16")(h)
    return keras.Model(inputs, keras.layers.Activation("softmax", dtype="float32")(h))


def loss_scaled() -> keras.optimizers.Optimizer:
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                               initial_scale=2.0**15)


@pytest.mark.parametrize("mode", MODES)
def test_loss_scaling_matches_plain_fit_with_an_overflowing_batch(mode):
    """mixed_float16 with a ``LossScaleOptimizer``: the third batch overflows (inputs of 1e4
    in float16), so both runs skip it and halve the scale; every other update is plain
    fit's (tolerance: tests/test_mixed_precision.py's float16 bound)."""
    x, y = make_data()
    x = x.copy()
    x[16:24] *= 1e4
    initial, plain = fitted(mixed_model, loss_scaled, x, y, None)
    _, model = fitted(mixed_model, loss_scaled, x, y, MODES[mode])
    counts = model.accumulation.counters()
    assert (counts["windows_applied"], counts["windows_skipped"]) == (4, 1)
    assert float(model.optimizer.dynamic_scale.numpy()) == float(
        plain.optimizer.dynamic_scale.numpy()) == 2.0**14
    assert int(model.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy())
    assert relative_error(get_weights(model), get_weights(plain), initial) <= 2e-3
