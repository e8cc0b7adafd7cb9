"""Non-finite gradients: "raise" (default), "skip_micro_batch" and "skip_window".

24 synthetic samples, micro-batches of 4, K = 3: two windows of three micro-batches each.
One sample of micro-batch 1 (window 0, position 1) is set to NaN or Inf, which makes that
micro-batch's gradients non-finite. Each test checks exactly what was kept against an
independent large-batch reference (plain ``train_on_batch`` on the samples that should count).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import LOSS, REL_TOL, built_state, reference_weights, small_mlp

import accumcore as ac
from accumcore import nonfinite
from accumcore.lab.experiments import get_weights, relative_error

MICRO, K, N = 4, 3, 24
BAD = 1  # index of the poisoned micro-batch (window 0, position 1)
WINDOW0 = np.arange(0, 12)
WINDOW1 = np.arange(12, 24)
WINDOW0_WITHOUT_BAD = np.setdiff1d(WINDOW0, np.arange(BAD * MICRO, (BAD + 1) * MICRO))


def make_opt() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(0.01)


@pytest.fixture
def clean() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return rng.normal(size=(N, 8)).astype("float32"), rng.integers(0, 3, N).astype("int32")


def poisoned(x: np.ndarray, kind: str) -> np.ndarray:
    x = x.copy()
    x[BAD * MICRO + 2, 0] = np.nan if kind == "nan" else np.inf
    return x


def train(entry: str, x, y, nonfinite: str, epochs: int = 1):
    """Train with one entry point; returns (model, state, optimizer, fit history or None)."""
    if entry == "fit":
        model = small_mlp(model_cls=ac.AccumModel, accum_steps=K, nonfinite=nonfinite)
        model.compile(make_opt(), LOSS)
        history = model.fit(x, y, batch_size=MICRO, epochs=epochs, shuffle=False, verbose=0)
        return model, model.accumulation, model.optimizer, history.history
    model = small_mlp()
    trainer = ac.AccumTrainer(model, make_opt(), LOSS, accum_steps=K, nonfinite=nonfinite)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)
    history = trainer.fit(ds, epochs=epochs, mode=entry, verbose=0)
    return model, trainer.state, trainer.optimizer, history


# ---------------------------------------------------------------------------- skip_micro_batch
@pytest.mark.parametrize(("entry", "kind"), [
    ("eager", "nan"), ("function", "inf"), ("graph", "nan"), ("fit", "inf"),
])
def test_skip_micro_batch_removes_only_that_contribution_and_weight(entry, kind, clean):
    """Catches: the bad micro-batch's gradient added anyway (NaN weights), its weight kept in
    the divisor (window 0 divided by 12 instead of 8), the whole window dropped, the next
    window affected, counters not reported."""
    x, y = clean
    model, state, opt, history = train(entry, poisoned(x, kind), y, "skip_micro_batch")
    initial, ref = reference_weights(make_opt, x, y, None, windows=[WINDOW0_WITHOUT_BAD, WINDOW1])
    rel = relative_error(get_weights(model), ref, initial)
    assert rel <= REL_TOL, f"rel error {rel:.3g} vs the reference without micro-batch {BAD}"
    c = state.counters()
    assert c["micro_batches_skipped"] == 1
    assert c["windows_applied"] == 2 and c["windows_skipped"] == 0
    assert int(opt.iterations.numpy()) == 2
    # Its 4 samples were seen but reached no update; none lost, none counted twice.
    assert c["samples_seen"] == N and c["samples_dropped"] == MICRO
    if entry == "fit":
        assert history["skipped_micro_batches"] == [1.0]
        assert history["skipped_windows"] == [0.0]
    else:
        assert history.counters["micro_batches_skipped"] == 1


def test_keeping_the_skipped_weight_would_fail_the_tolerance(clean):
    """Guard that the test above can fail: a recipe that zeroes the bad micro-batch's gradient
    but keeps its weight in the divisor (x 8/12 on window 0) misses the reference by far more
    than REL_TOL."""
    x, y = clean
    initial, ref = reference_weights(make_opt, x, y, None, windows=[WINDOW0_WITHOUT_BAD, WINDOW1])
    model = small_mlp()
    model.compile(make_opt(), LOSS)
    weights0 = np.ones(12, "float32")
    weights0[BAD * MICRO:(BAD + 1) * MICRO] = 0.0  # zero contribution, but divided by 12
    model.train_on_batch(x[WINDOW0], y[WINDOW0], sample_weight=weights0)
    model.train_on_batch(x[WINDOW1], y[WINDOW1])
    assert relative_error(get_weights(model), ref, initial) > 100 * REL_TOL


# ---------------------------------------------------------------------------- skip_window
@pytest.mark.parametrize(("entry", "kind"), [
    ("eager", "inf"), ("graph", "nan"), ("fit", "nan"),
])
def test_skip_window_discards_exactly_the_poisoned_window(entry, kind, clean):
    """Catches: a poisoned window applied (partially or with NaNs), the optimizer stepped for
    it (iterations, Adam's bias correction), the next window starting from stale sums."""
    x, y = clean
    model, state, opt, history = train(entry, poisoned(x, kind), y, "skip_window")
    initial, ref = reference_weights(make_opt, x, y, None, windows=[WINDOW1])
    rel = relative_error(get_weights(model), ref, initial)
    assert rel <= REL_TOL, f"rel error {rel:.3g} vs the reference of window 1 alone"
    c = state.counters()
    assert c["windows_skipped"] == 1 and c["windows_applied"] == 1
    assert c["micro_batches_skipped"] == 1
    assert int(opt.iterations.numpy()) == 1
    assert c["samples_seen"] == N and c["samples_dropped"] == 12  # the whole window 0
    if entry == "fit":
        assert history["skipped_windows"] == [1.0]


# ---------------------------------------------------------------------------- raise (default)
@pytest.mark.parametrize("entry", ["eager", "function", "graph", "fit"])
def test_raise_is_the_default_and_names_epoch_micro_step_and_variable(entry, clean):
    """One clean epoch, then an epoch whose micro-batch 1 is poisoned: micro-step 6 + 1 = 7
    of the run, epoch 1, position 1 in its window.

    Catches: NaNs silently applied by default, an error without the epoch / micro-step /
    variable, a state that already contains the bad micro-batch (a checkpoint taken after the
    error would be poisoned), the wrong first variable."""
    x, y = clean
    bad = poisoned(x, "nan")
    if entry == "fit":
        model = small_mlp(model_cls=ac.AccumModel, accum_steps=K)
        model.compile(make_opt(), LOSS)
        model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
        state = model.accumulation
        with pytest.raises(ac.NonFiniteGradientError) as info:
            model.fit(bad, y, batch_size=MICRO, initial_epoch=1, epochs=2, shuffle=False,
                      verbose=0)
    else:
        model = small_mlp()
        trainer = ac.AccumTrainer(model, make_opt(), LOSS, accum_steps=K)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)
        trainer.fit(ds, epochs=1, mode=entry, verbose=0)
        state = trainer.state
        bad_ds = tf.data.Dataset.from_tensor_slices((bad, y)).batch(MICRO)
        with pytest.raises(ac.NonFiniteGradientError) as info:
            trainer.fit(bad_ds, epochs=1, mode=entry, verbose=0)
    err = info.value
    first_variable = model.trainable_variables[0].path
    message = str(err)
    assert "epoch 1" in message and "micro-step 7" in message and first_variable in message
    assert (err.epoch, err.micro_step, err.window_position, err.variable) == (
        1, 7, 1, first_variable)
    # The state holds exactly the window before the bad micro-batch: one micro-batch of 4.
    assert int(state.micro_step.numpy()) == 1
    assert float(state.window_weight.numpy()) == MICRO
    assert state.counters()["windows_applied"] == 2
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def test_raise_keeps_the_pending_window_exactly(clean):
    """After the error, the accumulators equal 4 x grad(mean loss) of micro-batch 0 alone,
    computed independently with a GradientTape on a copy of the model.

    Catches: the bad micro-batch partly added (e.g. to variables before the NaN one)."""
    x, y = clean
    model = small_mlp()
    reference_model = small_mlp()  # same seed: same weights
    trainer = ac.AccumTrainer(model, keras.optimizers.SGD(0.1), LOSS, accum_steps=K)
    ds = tf.data.Dataset.from_tensor_slices((poisoned(x, "inf"), y)).batch(MICRO)
    with pytest.raises(ac.NonFiniteGradientError):
        trainer.fit(ds, epochs=1, mode="eager", verbose=0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    with tf.GradientTape() as tape:
        loss = loss_fn(y[:MICRO], reference_model(x[:MICRO], training=True))
    expected = tape.gradient(loss, reference_model.trainable_variables)
    for acc, g in zip(trainer.state.accumulators, expected, strict=True):
        np.testing.assert_allclose(acc.numpy(), MICRO * g.numpy(), rtol=1e-5, atol=1e-7)


def test_first_offending_variable_is_the_first_non_finite_one():
    """Unit test of the state: only the third of four gradients is Inf, then only the weight
    is NaN. Catches: always naming variable 0, or crashing when only the weight is bad."""
    model, state, opt = built_state(2)
    variables = model.trainable_variables
    grads = [tf.zeros_like(v) for v in variables]
    grads[2] = tf.fill(variables[2].shape, np.inf)
    state.step(grads, 4.0, 4, opt, variables)
    with pytest.raises(ac.NonFiniteGradientError) as info:
        state.raise_if_nonfinite(epoch=3)
    assert info.value.variable == variables[2].path
    assert "epoch 3" in str(info.value) and variables[2].path in str(info.value)
    assert int(state.micro_step.numpy()) == 0 and float(state.window_weight.numpy()) == 0.0

    state2 = ac.AccumulationState(2)
    state2.build(variables)
    state2.step([tf.zeros_like(v) for v in variables], float("nan"), 4, opt, variables)
    with pytest.raises(ac.NonFiniteGradientError, match="weight"):
        state2.raise_if_nonfinite()


def test_a_gradient_summing_beyond_the_float_range_is_flagged_and_16_bit_sums_in_float32():
    """What "non-finite" means for the one-pass check (`nonfinite.element_sum`): every element
    of the second gradient is finite (3e37) but its 16 sum to 4.8e38, beyond float32: flagged and
    named, like a NaN. A float16 gradient whose float16 sum would overflow (1000 x 100 =
    1e5 > 65504) is summed in float32 and passes. Catches a check that misses overflow, or
    one that sums 16-bit gradients in their own dtype (false alarms under pure float16)."""
    model, state, opt = built_state(2)
    variables = model.trainable_variables
    grads = [tf.zeros_like(v) for v in variables]
    assert grads[1].shape.num_elements() * 3e37 > 3.4e38 > 3e37
    grads[1] = tf.fill(variables[1].shape, 3e37)
    assert bool(tf.reduce_all(tf.math.is_finite(grads[1])))
    state.step(grads, 4.0, 4, opt, variables)
    with pytest.raises(ac.NonFiniteGradientError, match="beyond the float range") as info:
        state.raise_if_nonfinite()
    assert info.value.variable == variables[1].path
    assert int(state.micro_step.numpy()) == 0 and float(state.window_weight.numpy()) == 0.0

    half = tf.fill([1000], tf.constant(100.0, tf.float16))
    assert not np.isfinite(float(tf.reduce_sum(half)))  # float16's own sum overflows
    assert float(nonfinite.element_sum(half)) == 1e5
    assert not bool(nonfinite.has_nonfinite([half], tf.constant(4.0)))
    assert bool(nonfinite.has_nonfinite([half, tf.constant([np.nan])], tf.constant(4.0)))


# ---------------------------------------------------------------------------- no per-batch read
@pytest.mark.parametrize("entry", ["eager", "function", "graph", "fit"])
def test_raise_is_checked_once_per_epoch_and_counts_the_unused_rest(entry, clean, monkeypatch):
    """``fit`` reads the non-finite flag once per epoch, not per micro-batch: the state,
    frozen at micro-batch 1 of 6, refuses the 4 after it, and the error says so (and still
    names micro-step 1). Catches: a host read per micro-batch (``raise_if_nonfinite`` called
    about 6 times), later micro-batches accumulated or counted while frozen, a wrong count."""
    calls = []
    original = ac.AccumulationState.raise_if_nonfinite

    def counting(self, epoch=None):
        calls.append(epoch)
        return original(self, epoch)

    monkeypatch.setattr(ac.AccumulationState, "raise_if_nonfinite", counting)
    x, y = clean
    with pytest.raises(ac.NonFiniteGradientError) as info:
        train(entry, poisoned(x, "nan"), y, "raise")
    err = info.value
    assert (err.epoch, err.micro_step, err.window_position) == (0, BAD, BAD)
    assert err.unused_micro_batches == N // MICRO - BAD - 1 == 4
    assert "4 later micro-batch(es) were seen while the state was frozen" in str(err)
    assert len(calls) <= 2, f"raise_if_nonfinite called {len(calls)} times in one epoch"


def test_frozen_state_refuses_later_micro_batches_exactly():
    """Unit test: after a bad micro-batch, clean ones are refused (window, counters and
    accumulators unchanged) and counted; ``clear_nonfinite`` resets the count."""
    model, state, opt = built_state(3)
    variables = model.trainable_variables
    ones = [tf.ones_like(v) for v in variables]
    state.step(ones, 2.0, 2, opt, variables)
    bad = list(ones)
    bad[1] = tf.fill(variables[1].shape, np.nan)
    state.step(bad, 2.0, 2, opt, variables)
    for _ in range(3):  # would close the window (K = 3) if accepted
        state.step(ones, 2.0, 2, opt, variables)
    assert int(state.micro_step.numpy()) == 1 and float(state.window_weight.numpy()) == 2.0
    assert state.counters()["windows_applied"] == 0
    assert state.counters()["micro_batches_seen"] == 1
    np.testing.assert_array_equal(state.accumulators[0].numpy(), ones[0].numpy())
    with pytest.raises(ac.NonFiniteGradientError) as info:
        state.raise_if_nonfinite()
    assert (info.value.micro_step, info.value.unused_micro_batches) == (1, 3)
    assert info.value.variable == variables[1].path
    assert state.clear_nonfinite()
    state.raise_if_nonfinite()  # cleared: nothing to raise
    assert int(state.guard.refused.numpy()) == 0


# ---------------------------------------------------------------------------- all skipped
@pytest.mark.parametrize("entry", ["eager", "function", "graph", "fit"])
def test_window_of_only_skipped_micro_batches_is_skipped_not_applied(entry, clean):
    """``skip_micro_batch`` with every micro-batch of window 0 bad: the window is skipped
    (counted in windows_skipped), not applied with a zero gradient, which would still move
    Adam's moments and ``iterations``. Catches: the zero-gradient apply (iterations 2,
    weights off the reference of window 1 alone)."""
    x, y = clean
    bad = x.copy()
    bad[WINDOW0, 0] = np.nan
    model, state, opt, history = train(entry, bad, y, "skip_micro_batch")
    initial, ref = reference_weights(make_opt, x, y, None, windows=[WINDOW1])
    rel = relative_error(get_weights(model), ref, initial)
    assert rel <= REL_TOL, f"rel error {rel:.3g} vs the reference of window 1 alone"
    c = state.counters()
    assert c["windows_skipped"] == 1 and c["windows_applied"] == 1
    assert c["micro_batches_skipped"] == K
    assert int(opt.iterations.numpy()) == 1
    assert c["samples_seen"] == N and c["samples_dropped"] == 12
    if entry == "fit":
        assert history["skipped_windows"] == [1.0]
