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
from accumcore._impl import nonfinite
from accumcore.lab.experiments import get_weights, relative_error

MICRO, K, N = 4, 3, 24
BAD = 1  # index of the poisoned micro-batch (window 0, position 1)
WINDOW0 = np.arange(0, 12)
WINDOW1 = np.arange(12, 24)
WINDOW0_WITHOUT_BAD = np.setdiff1d(WINDOW0, np.arange(BAD * MICRO, (BAD + 1) * MICRO))


#: fit's two modes: the AccumModel's setting and fit's batch size (the same windows).
FITS = {"fit": (dict(accum_steps=K), MICRO),
        "fit_split": (dict(micro_batch_size=MICRO), MICRO * K)}


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
    """Train with one entry point; returns (model, state, optimizer, fit history or None).
    "fit_split": ``micro_batch_size=MICRO`` at ``fit(batch_size=K * MICRO)`` (the same windows,
    each batch split in the step)."""
    if entry in FITS:
        model = small_mlp(model_cls=ac.AccumModel, nonfinite=nonfinite, **FITS[entry][0])
        model.compile(make_opt(), LOSS)
        history = model.fit(x, y, batch_size=FITS[entry][1], epochs=epochs, shuffle=False,
                            verbose=0)
        return model, model.accumulation, model.optimizer, history.history
    model = small_mlp()
    trainer = ac.AccumTrainer(model, make_opt(), LOSS, accum_steps=K, nonfinite=nonfinite)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)
    history = trainer.fit(ds, epochs=epochs, mode=entry, verbose=0)
    return model, trainer.state, trainer.optimizer, history


# ---------------------------------------------------------------------------- skip_micro_batch
@pytest.mark.parametrize(("entry", "kind"), [
    ("eager", "nan"), ("function", "inf"), ("graph", "nan"), ("fit", "inf"),
    ("fit_split", "nan"),
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
    if entry in FITS:
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
    ("eager", "inf"), ("graph", "nan"), ("fit", "nan"), ("fit_split", "inf"),
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
    # Checked once per window, at its close: no micro-batch is singled out.
    assert c["micro_batches_skipped"] == 0
    assert int(opt.iterations.numpy()) == 1
    assert c["samples_seen"] == N and c["samples_dropped"] == 12  # the whole window 0
    if entry in FITS:
        assert history["skipped_windows"] == [1.0]


# ---------------------------------------------------------------------------- raise (default)
@pytest.mark.parametrize("entry", ["eager", "function", "graph", *FITS])
def test_raise_is_the_default_discards_the_bad_window_and_names_it(entry, clean):
    """One clean epoch (windows 0 and 1), then an epoch whose micro-batch 1 is poisoned: window
    2 of the run (its micro-batches 6 to 8; the message counts from 1: window 3, micro-batches
    7 to 9, epoch 2) is discarded whole and named, with the first non-finite variable; window 3,
    seen while stopped, is discarded too.

    Catches: NaNs silently applied by default, an error without the epoch / window /
    variable, the bad window partly applied (the weights must be exactly those after the
    clean epoch: earlier windows untouched, nothing after them applied), the wrong counts."""
    x, y = clean
    bad = poisoned(x, "nan")
    if entry in FITS:
        how, batch_size = FITS[entry]
        model = small_mlp(model_cls=ac.AccumModel, **how)
        model.compile(make_opt(), LOSS)
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        state = model.accumulation
        after_clean = get_weights(model)
        with pytest.raises(ac.NonFiniteGradientError) as info:
            model.fit(bad, y, batch_size=batch_size, initial_epoch=1, epochs=2, shuffle=False,
                      verbose=0)
    else:
        model = small_mlp()
        trainer = ac.AccumTrainer(model, make_opt(), LOSS, accum_steps=K)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)
        trainer.fit(ds, epochs=1, mode=entry, verbose=0)
        state = trainer.state
        after_clean = get_weights(model)
        bad_ds = tf.data.Dataset.from_tensor_slices((bad, y)).batch(MICRO)
        with pytest.raises(ac.NonFiniteGradientError) as info:
            trainer.fit(bad_ds, epochs=1, mode=entry, verbose=0)
    err = info.value
    first_variable = model.trainable_variables[0].path
    message = str(err)
    # err.epoch is 1 (counted from 0, as Keras does); the message counts from 1
    assert ("in epoch 2, window 3 of the run (its micro-batches 7 to 9 of the run; all counted "
            "from 1)") in message
    assert first_variable in message and "discarded whole" in message
    assert (err.epoch, err.window, err.first_micro_step, err.micro_batches, err.variable) == (
        1, 2, 2 * K, K, first_variable)
    assert err.unused_micro_batches == K
    for now, before in zip(get_weights(model), after_clean, strict=True):
        np.testing.assert_array_equal(now, before)
    c = state.counters()
    assert (c["windows_applied"], c["windows_skipped"], c["micro_step"]) == (2, 2, 0)
    assert c["samples_dropped"] == N and c["window_weight"] == 0.0
    assert all(np.all(np.isfinite(a.numpy())) for a in state.accumulators)


def test_raise_applies_nothing_of_a_bad_first_epoch(clean):
    """The eager loop on a poisoned first epoch: nothing is applied (the weights are the initial
    ones, bit for bit), the accumulators are empty, and both windows are counted skipped."""
    x, y = clean
    model = small_mlp()
    initial = get_weights(model)
    trainer = ac.AccumTrainer(model, keras.optimizers.SGD(0.1), LOSS, accum_steps=K)
    ds = tf.data.Dataset.from_tensor_slices((poisoned(x, "inf"), y)).batch(MICRO)
    with pytest.raises(ac.NonFiniteGradientError) as info:
        trainer.fit(ds, epochs=1, mode="eager", verbose=0)
    assert info.value.window == 0 and info.value.unused_micro_batches == K
    for now, before in zip(get_weights(model), initial, strict=True):
        np.testing.assert_array_equal(now, before)
    assert all(not np.any(a.numpy()) for a in trainer.state.accumulators)
    c = trainer.state.counters()
    assert (c["windows_applied"], c["windows_skipped"], c["samples_dropped"]) == (0, 2, N)


@pytest.mark.parametrize("entry", ["eager", *FITS])
def test_the_message_counts_epoch_window_and_micro_batches_from_1(entry):
    """Windows of two micro-batches of 4, two windows per epoch; epoch 1 is clean and the NaN
    sits in epoch 2's last micro-batch: the 4th window of the run, its 7th and 8th
    micro-batches. Catches: windows or micro-batches numbered from 0 next to epochs from 1."""
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(16, 8)).astype("float32"), rng.integers(0, 3, 16).astype("int32")
    bad = x.copy()
    bad[13, 0] = np.nan  # micro-batch 3 of the epoch (samples 12..15), counted from 0
    with pytest.raises(ac.NonFiniteGradientError) as info:
        if entry in FITS:
            how = dict(micro_batch_size=4) if entry == "fit_split" else dict(accum_steps=2)
            model = small_mlp(model_cls=ac.AccumModel, **how)
            model.compile(make_opt(), LOSS)
            batch_size = 8 if entry == "fit_split" else 4
            model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
            model.fit(bad, y, batch_size=batch_size, initial_epoch=1, epochs=2, shuffle=False,
                      verbose=0)
        else:
            trainer = ac.AccumTrainer(small_mlp(), make_opt(), LOSS, accum_steps=2)
            trainer.fit(x, y, batch_size=4, epochs=1, shuffle=False, mode=entry, verbose=0)
            trainer.fit(bad, y, batch_size=4, epochs=1, shuffle=False, mode=entry, verbose=0)
    assert ("in epoch 2, window 4 of the run (its micro-batches 7 to 8 of the run; all counted "
            "from 1)") in str(info.value)
    assert (info.value.epoch, info.value.window, info.value.first_micro_step) == (1, 3, 6)


def _close_one_window(state, opt, variables, grads, weight=4.0) -> None:
    """Two micro-batches (K = 2): ``grads`` and a clean one; the window closes."""
    state.step(grads, weight, 4, opt, variables)
    state.step([tf.zeros_like(v) for v in variables], 4.0, 4, opt, variables)


def test_first_offending_variable_is_the_first_non_finite_one():
    """Unit test of the state: only the third of four gradients is Inf, then only the weight
    is NaN. Catches: always naming variable 0, or crashing when only the weight is bad."""
    model, state, opt = built_state(2)
    variables = model.trainable_variables
    grads = [tf.zeros_like(v) for v in variables]
    grads[2] = tf.fill(variables[2].shape, np.inf)
    _close_one_window(state, opt, variables, grads)
    with pytest.raises(ac.NonFiniteGradientError) as info:
        state.raise_if_nonfinite(epoch=3)
    assert info.value.variable == variables[2].path
    assert "epoch 4," in str(info.value) and variables[2].path in str(info.value)
    assert int(state.micro_step.numpy()) == 0 and float(state.window_weight.numpy()) == 0.0

    state2 = ac.AccumulationState(2)
    state2.build(variables)
    _close_one_window(state2, opt, variables, [tf.zeros_like(v) for v in variables],
                      weight=float("nan"))
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
    _close_one_window(state, opt, variables, grads)
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
    """``fit`` reads the non-finite stop once per epoch, not per micro-batch: window 0 (with
    the bad micro-batch 1) stops training, window 1's 3 micro-batches are discarded, and the
    error says so. Catches: a host read per micro-batch (``raise_if_nonfinite`` called about 6
    times), later windows applied while stopped, a wrong count."""
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
    assert (err.epoch, err.window, err.first_micro_step, err.micro_batches) == (0, 0, 0, K)
    assert err.unused_micro_batches == N // MICRO - K == 3
    assert "3 later micro-batch(es) were seen while training was stopped" in str(err)
    assert len(calls) <= 2, f"raise_if_nonfinite called {len(calls)} times in one epoch"


def test_stopped_state_discards_later_windows_exactly():
    """Unit test: a bad window stops training; a clean window after it is discarded and
    counted; ``clear_nonfinite`` drops the micro-batches seen while stopped and training goes
    on."""
    model, state, opt = built_state(3)
    variables = model.trainable_variables
    ones = [tf.ones_like(v) for v in variables]
    bad = list(ones)
    bad[1] = tf.fill(variables[1].shape, np.nan)
    for grads in (ones, bad, ones, ones, ones, ones, ones):  # windows 0 (bad), 1, then 1 more
        state.step(grads, 2.0, 2, opt, variables)
    c = state.counters()
    assert (c["windows_applied"], c["windows_skipped"], c["micro_step"]) == (0, 2, 1)
    assert c["micro_batches_seen"] == 7 and c["samples_dropped"] == 12
    with pytest.raises(ac.NonFiniteGradientError) as info:
        state.raise_if_nonfinite()
    assert (info.value.window, info.value.unused_micro_batches) == (0, 4)
    assert info.value.variable == variables[1].path
    assert state.clear_nonfinite()
    state.raise_if_nonfinite()  # cleared: nothing to raise
    c = state.counters()
    assert c["micro_step"] == 0 and c["samples_dropped"] == 14  # the pending one, dropped
    before = [v.numpy() for v in variables]
    for _ in range(3):
        state.step(ones, 2.0, 2, opt, variables)
    assert state.counters()["windows_applied"] == 1
    assert any(np.any(v.numpy() != b) for v, b in zip(variables, before, strict=True))


# ---------------------------------------------------------------------------- all skipped
@pytest.mark.parametrize("entry", ["eager", "function", "graph", *FITS])
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
    if entry in FITS:
        assert history["skipped_windows"] == [1.0]
