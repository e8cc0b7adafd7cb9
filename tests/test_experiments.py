"""The book's experiment drivers (chapters 4-5) in accumcore.lab.experiments, synthetic data."""

from __future__ import annotations

import functools
import itertools
import logging
import math

import keras
import numpy as np
import pytest
from helpers import REL_TOL

from accumcore.lab import experiments as ex

# 4 x 16 accumulated and batch 64 differ only by float32 round-off (~1e-7 relative per update);
# over a few updates the loss curves agree to ~1e-6 nats. 1e-4 leaves margin, and is still 100x
# below the gap to batch 16 (a different algorithm) measured below.
CURVE_TOL = 1e-4


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(320, 20)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(20, 10)), axis=1).astype("int64")
    return x[:256], y[:256], x[256:], y[256:]


BUILD = functools.partial(ex.mlp, 20, (16,))


def test_evaluate_matches_keras_loss_and_accuracy(data):
    x, y, _, _ = data
    model = BUILD(seed=0)
    model.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"])
    loss, acc = ex.evaluate(model, x, y, batch_size=100)
    keras_loss, keras_acc = model.evaluate(x, y, batch_size=256, verbose=0)
    assert loss == pytest.approx(keras_loss, rel=1e-5)
    assert acc == pytest.approx(keras_acc, abs=1e-6)
    with pytest.raises(ValueError, match="empty"):
        ex.evaluate(model, x[:0], y[:0])


def test_epoch_orders_are_seeded_permutations():
    a, b = ex.epoch_orders(10, 2, seed=3), ex.epoch_orders(10, 2, seed=3)
    assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
    assert sorted(a[0].tolist()) == list(range(10))
    assert not np.array_equal(a[0], a[1])


def test_max_curve_gap():
    assert ex.max_curve_gap([1.0, 2.0, 3.0], [1.0, 2.5, 2.0]) == 1.0
    with pytest.raises(ValueError, match="different points"):
        ex.max_curve_gap([1.0], [1.0, 2.0])


def test_train_compare_accumulation_tracks_the_large_batch_not_the_small_one(data):
    runs = ex.train_compare(
        *data, {"batch 64": (64, 1), "4 x 16": (16, 4), "batch 16": (16, 1)},
        make_optimizer=lambda: keras.optimizers.SGD(0.1), build_model=BUILD, epochs=2,
        eval_every=64, n_train_eval=128,
    )
    big, acc, small = runs["batch 64"], runs["4 x 16"], runs["batch 16"]
    np.testing.assert_array_equal(big.samples, np.arange(0, 513, 64))
    assert [r.updates for r in runs.values()] == [8, 8, 32]
    assert acc.effective_batch == 64 and len(acc.epoch_seconds) == 2
    for r in runs.values():  # identical initial weights
        for w, w0 in zip(r.initial_weights, big.initial_weights, strict=True):
            np.testing.assert_array_equal(w, w0)
    for curve in ("train_loss", "test_loss"):
        near = ex.max_curve_gap(getattr(big, curve), getattr(acc, curve))
        far = ex.max_curve_gap(getattr(big, curve), getattr(small, curve))
        assert near < CURVE_TOL
        assert far > 100 * CURVE_TOL
    assert ex.relative_error(acc.final_weights, big.final_weights, big.initial_weights) < REL_TOL


@pytest.mark.parametrize("gap", [ex.relative_error, ex.statistics_gap])
def test_relative_error_and_statistics_gap_definition_and_bad_input(gap):
    # float32 weights (get_weights) and float64 statistics (moving_statistics) alike.
    initial = [np.zeros((2, 2), np.float32), np.zeros(3, np.float32)]
    reference = [np.full((2, 2), 0.5, np.float32), np.array([1.0, -2.0, 0.25], np.float32)]
    values = [reference[0] + np.float32(0.125), reference[1].astype(np.float64)]
    # largest error 0.125 in units of the largest reference change |-2|
    assert gap(values, reference, initial) == 0.125 / 2.0
    assert gap(reference, reference, initial) == 0.0
    with pytest.raises(ValueError, match="Got 1, 2 and 2 .*arrays: pass"):
        gap(values[:1], reference, initial)  # not silently truncated to one array
    with pytest.raises(ValueError, match="Got 0, 0 and 0"):
        gap([], [], [])
    with pytest.raises(ValueError, match="did not move from `initial`"):
        gap(values, initial, initial)


def test_train_compare_rejects_checkpoints_inside_windows(data):
    with pytest.raises(ValueError, match="eval_every"):
        ex.train_compare(*data, {"4 x 16": (16, 4)}, make_optimizer=lambda: "sgd",
                         build_model=BUILD, eval_every=32)
    with pytest.raises(ValueError, match="empty"):
        ex.train_compare(*data, {}, make_optimizer=lambda: "sgd", build_model=BUILD)


def test_linear_warmup_schedule():
    schedule = ex.LinearWarmup(0.8, warmup_steps=4)
    values = [float(schedule(step)) for step in range(6)]
    assert values == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8])
    peak = keras.Variable(1.0)
    variable_schedule = ex.LinearWarmup(peak, 2)
    peak.assign(3.0)
    assert float(variable_schedule(0)) == pytest.approx(1.5)
    assert variable_schedule.get_config() == {"peak": 3.0, "warmup_steps": 2}
    with pytest.raises(ValueError, match="warmup_steps"):
        ex.LinearWarmup(1.0, 0)


def test_scaling_rules_and_exponent():
    assert ex.scaled_learning_rate(0.1, 16, 64, "linear") == pytest.approx(0.4)
    assert ex.scaled_learning_rate(0.1, 16, 64, "sqrt") == pytest.approx(0.2)
    assert ex.scaled_learning_rate(0.1, 16, 64, "constant") == 0.1
    with pytest.raises(ValueError, match="rule"):
        ex.scaled_learning_rate(0.1, 16, 64, "cubic")
    batches = [16, 64, 256]
    assert ex.scaling_exponent(batches, [0.1 * b / 16 for b in batches]) == pytest.approx(1.0)
    assert ex.scaling_exponent(batches, [0.1 * (b / 16) ** 0.5 for b in batches]) == (
        pytest.approx(0.5))
    with pytest.raises(ValueError, match="two different"):
        ex.scaling_exponent([16, 16], [0.1, 0.2])


def test_make_optimizer():
    assert isinstance(ex.make_optimizer("sgd", 0.1), keras.optimizers.SGD)
    assert isinstance(ex.make_optimizer("adam", 0.1), keras.optimizers.Adam)
    with pytest.raises(ValueError, match="optimizer"):
        ex.make_optimizer("rmsprop", 0.1)


def test_train_accumulated_equals_large_batch_and_sweep_reuse_is_a_fresh_start(data):
    x, y, xv, yv = data
    kwargs = dict(optimizer="adam", learning_rate=0.01, epochs=2, build_model=BUILD,
                  mode="function")
    accumulated = ex.train_accumulated(x, y, xv, yv, micro_batch=16, accum_steps=4, **kwargs)
    large = ex.train_accumulated(x, y, xv, yv, micro_batch=64, accum_steps=1, **kwargs)
    assert accumulated["updates"] == large["updates"] == 8
    assert accumulated["val_loss"] == pytest.approx(large["val_loss"], abs=CURVE_TOL)
    # The sweep reuses one model/trainer per batch size: a run after another learning rate
    # must give exactly what a fresh run gives.
    sweep = ex.lr_sweep(x, y, xv, yv, optimizer="adam", learning_rates=[0.1, 0.01],
                        batch_sizes=[64], epochs=2, build_model=BUILD, mode="function")
    assert sweep.loss[1, 0] == pytest.approx(accumulated["val_loss"], abs=CURVE_TOL)


def test_lr_sweep_grid_best_lr_and_divergence(data):
    x, y, xv, yv = data
    # mode="graph" (the default, used by the book's full runs): one traced epoch per batch size.
    sweep = ex.lr_sweep(x, y, xv, yv, optimizer="sgd", learning_rates=[0.01, 0.3, 1e6],
                        batch_sizes=[16, 64], epochs=1, build_model=BUILD)
    assert sweep.accuracy.shape == (3, 2)
    assert sweep.updates.tolist() == [16, 4]
    assert sweep.diverged[2].all() and not sweep.diverged[:2].any()  # lr 1e6 blows up
    assert np.all((sweep.accuracy[:2] >= 0) & (sweep.accuracy[:2] <= 1))
    best = np.nanargmax(sweep.accuracy, axis=0)
    np.testing.assert_array_equal(sweep.best_index, best)
    np.testing.assert_array_equal(sweep.best_lr, np.array([0.01, 0.3, 1e6])[best])
    np.testing.assert_array_equal(sweep.best_accuracy, np.nanmax(sweep.accuracy, axis=0))
    with pytest.raises(ValueError, match="multiple of its `micro_batch`"):
        ex.lr_sweep(x, y, xv, yv, optimizer="sgd", learning_rates=[0.1], batch_sizes=[24])
    trained = np.nan_to_num(sweep.accuracy) > 0.2
    expected = [max((lr for lr, ok in zip([0.01, 0.3, 1e6], trained[:, j]) if ok),
                    default=np.nan) for j in (0, 1)]
    np.testing.assert_array_equal(sweep.largest_stable_lr, expected)
    assert not np.any(sweep.largest_stable_lr == 1e6)  # the diverged rate never counts


def test_lr_sweep_after_a_diverged_run_logs_nothing_and_trains_the_next(data, caplog):
    # The runner clears the non-finite stop of a diverged run before the next learning rate;
    # its window is empty by then, so the library's note on what is kept must not reach the
    # page (chapter 5 printed "... (0 micro-batches, 0 samples) is kept").
    x, y, xv, yv = data
    kwargs = dict(optimizer="sgd", batch_sizes=[64], epochs=1, build_model=BUILD,
                  mode="function")
    with caplog.at_level(logging.INFO, logger="accumcore"):
        # lr 1e12: a non-finite gradient stops the run (1e6 here only ends in a NaN loss)
        sweep = ex.lr_sweep(x, y, xv, yv, learning_rates=[1e12, 0.3], **kwargs)
    assert sweep.diverged[:, 0].tolist() == [True, False]
    assert not [r for r in caplog.records if "non-finite" in r.getMessage()]
    fresh = ex.lr_sweep(x, y, xv, yv, learning_rates=[0.3], **kwargs)
    # the run after the divergence is a fresh run (same weights, state and window)
    assert sweep.loss[1, 0] == pytest.approx(fresh.loss[0, 0], abs=CURVE_TOL)


def test_lr_sweep_per_epoch_results_per_batch_micro_batches_and_progress(data):
    x, y, xv, yv = data
    lines = []
    kwargs = dict(optimizer="sgd", learning_rates=[0.05, 0.2], batch_sizes=[16, 64],
                  build_model=BUILD, mode="function")
    two = ex.lr_sweep(x, y, xv, yv, epochs=2, micro_batch=[16, 32], progress=lines.append,
                      **kwargs)
    one = ex.lr_sweep(x, y, xv, yv, epochs=1, micro_batch=16, **kwargs)
    assert two.accuracy_by_epoch.shape == (2, 2, 2) and two.micro_batches.tolist() == [16, 32]
    # Epoch 1 of the 2-epoch runs is the 1-epoch run (64 = 2 x 32 accumulated is 4 x 16).
    np.testing.assert_allclose(two.loss_by_epoch[0], one.loss, atol=CURVE_TOL)
    np.testing.assert_array_equal(two.loss, two.loss_by_epoch[1])
    assert np.all(two.loss_by_epoch[1] != two.loss_by_epoch[0])  # the 2nd epoch trained
    np.testing.assert_array_equal(two.best_lr_after(1), one.best_lr)
    assert len(lines) == 4 and "[run 4/4]" in lines[-1] and "B=64 (2 x 32)" in lines[-1]
    with pytest.raises(ValueError, match="one micro-batch size per batch size"):
        ex.lr_sweep(x, y, xv, yv, micro_batch=[16], **kwargs)


def test_lr_sweep_with_warmup_takes_smaller_first_steps(data):
    x, y, xv, yv = data
    kwargs = dict(optimizer="sgd", learning_rates=[0.5], batch_sizes=[64], epochs=1,
                  build_model=BUILD, mode="function")
    plain = ex.lr_sweep(x, y, xv, yv, **kwargs)
    warm = ex.lr_sweep(x, y, xv, yv, warmup_epochs=1.0, **kwargs)
    assert warm.warmup_epochs == 1.0
    assert abs(warm.loss[0, 0] - plain.loss[0, 0]) > 1e-3  # warm-up changed the run


def test_reordered_controls_and_the_reordered_reference(data):
    x, y, _, _ = data
    xr, yr = ex.reordered((x[:8], y[:8]), "reversed")
    np.testing.assert_array_equal(xr, x[:8][::-1])
    np.testing.assert_array_equal(yr, y[:8][::-1])
    xs, ys = ex.reordered((x[:8], y[:8]), "shuffled", seed=3)
    again, _ = ex.reordered((x[:8], y[:8]), "shuffled", seed=3)
    np.testing.assert_array_equal(xs, again)  # seeded: every batch of 8 gets the same order
    assert not np.array_equal(xs, x[:8]) and sorted(ys.tolist()) == sorted(y[:8].tolist())
    with pytest.raises(ValueError, match="Unknown reordering 'sorted'"):
        ex.reordered((x, y), "sorted")
    assert ex.REORDERINGS == ("reversed", "shuffled")
    # The same updates summed in another order: round-off away from the plain reference.
    batches = [(x[a:a + 64], y[a:a + 64]) for a in range(0, 256, 64)]
    args = (functools.partial(BUILD, seed=0), lambda: keras.optimizers.SGD(0.1),
            "sparse_categorical_crossentropy", batches)
    initial, plain = ex.large_batch_reference(*args)
    for how in ex.REORDERINGS:
        _, control = ex.large_batch_reference(*args, reorder=how)
        assert ex.relative_error(control, plain, initial) <= REL_TOL


def test_tie_threshold_and_compare():
    assert ex.tie_threshold(0.975, 10_000) == pytest.approx(0.00312, abs=1e-5)
    assert ex.tie_threshold(0.85, 500) == pytest.approx(0.0319, abs=1e-4)
    assert ex.tie_threshold(1.0, 100) == 0.0
    with pytest.raises(ValueError, match="Need n >= 1"):
        ex.tie_threshold(0.9, 0)
    assert [ex.compare(0.95, b, 0.01) for b in (0.9, 0.945, 0.955, 0.99)] == [1, 0, 0, -1]


def test_sweep_ties_and_the_exponent_range_they_allow():
    sweep = ex.SweepResult("sgd", 0.0, [0.1, 0.3, 1.0], [16, 64, 256], epochs=1)
    sweep.accuracy_by_epoch[0] = [[0.950, 0.90, 0.80],
                                  [0.948, 0.95, 0.90],
                                  [np.nan, 0.93, 0.95]]
    np.testing.assert_array_equal(sweep.tied(0.005), [[True, False, False],
                                                       [True, True, False],
                                                       [False, False, True]])
    np.testing.assert_array_equal(sweep.tied(0.0), [[True, False, False], [False, True, False],
                                                    [False, False, True]])
    low, high = sweep.exponent_range(0.005)
    # the only choice at B = 16 between 0.1 and 0.3 moves the slope; the best is one of them
    assert low == pytest.approx(ex.scaling_exponent([16, 64, 256], [0.3, 0.3, 1.0]))
    assert high == pytest.approx(ex.scaling_exponent([16, 64, 256], [0.1, 0.3, 1.0]))
    assert low <= ex.scaling_exponent(sweep.batch_sizes, sweep.best_lr) <= high
    assert sweep.exponent_range(0.0) == (pytest.approx(high), pytest.approx(high))


def test_roundoff_ratio_is_the_difference_in_units_of_the_largest_control():
    assert ex.roundoff_ratio(3e-4, [1e-4, 2e-4]) == pytest.approx(1.5)
    assert ex.roundoff_ratio(3e-3, [1e-4, 2e-4]) > ex.ROUNDOFF_FACTOR
    assert ex.roundoff_ratio(1e-3, [1e-4, 2e-4]) <= ex.ROUNDOFF_FACTOR
    with pytest.raises(ValueError, match="controls"):
        ex.roundoff_ratio(1e-3, [])
    assert ex.roundoff_ratio(0.0, [0.0, 0.0]) == 0.0  # bit-for-bit, like the controls
    assert ex.roundoff_ratio(1e-9, [0.0]) == float("inf")


def test_times_words_never_prints_exponents_or_one_times():
    assert ex.times_words(194.3, "float16's") == "194 times float16's"
    assert ex.times_words(0.43, "x") == "0.43 times x"
    assert ex.times_words(1.004, "x") == "equal to x to two significant digits"
    assert ex.times_words(3e-5, "x") == "less than 0.0001 times x"
    assert ex.times_words(2.5e5, "x") == "250,000 times x"


def test_roundoff_verdict_states_the_ratio_and_the_rule():
    rule = f"the book's round-off rule (at most {ex.ROUNDOFF_FACTOR} times)"
    assert ex.roundoff_verdict(3.2e-4, [1e-4, 2e-4]) == (
        f"1.6 times the larger reordering control: within {rule}")
    assert ex.roundoff_verdict(2.001e-4, [2e-4]) == (  # never "1 times": it reads as "equal"
        f"equal to the reordering control to two significant digits: within {rule}")
    assert ex.roundoff_verdict(1e-5, [1e-4, 2e-4, 3e-4]).startswith(
        "below the largest reordering control and 0.1 times the smallest: within")
    # one control far above the other (training amplified one reordering): the smaller one
    # says how the run compares with round-off that stayed small
    assert ex.roundoff_verdict(5.3e-7, [1.6e-2, 7.1e-7]) == (
        "the reordering controls are 22,535 times apart, so judged against the "
        f"smaller too: 0.75 times it: within {rule}")
    assert ex.roundoff_verdict(4.0e-7, [4.6e-7, 4.0e-7]) == (  # never "(1 times the smaller)"
        "below the larger reordering control and equal to the smaller to two significant digits: "
        f"within {rule}")
    assert ex.roundoff_verdict(2e-6, [1.6e-2, 1e-6]).endswith(
        f"judged against the smaller too: 2 times it: within {rule}")
    assert ex.roundoff_verdict(1e-5, [2e-4]).startswith("0.05 times the reordering control")
    at_rule = ex.roundoff_verdict(ex.ROUNDOFF_FACTOR * 1e-4, [1e-4])
    assert at_rule.endswith(f"within {rule}")
    beyond = ex.roundoff_verdict(3e-3, [1e-4, 2e-4], beyond="not the same update")
    assert beyond == (f"15 times the larger reordering control: more than {rule} allows; "
                      "not the same update")
    assert ex.roundoff_verdict(3e-2, [1e-4, 2e-4]).startswith("150 times the larger")
    assert ex.roundoff_verdict(2.5e-1, [1e-6]).startswith("250,000 times the reordering")
    assert "unused" not in ex.roundoff_verdict(1e-4, [2e-4], beyond="unused")
    # the smaller control is worded by the same rule as the larger: whole numbers from 100
    assert ex.roundoff_verdict(1.5e-4, [1e-3, 1e-5]) == (
        "the reordering controls are 100 times apart, so they do not settle the size of "
        f"round-off: 0.15 times the larger, 15 times the smaller: {rule} cannot decide")
    assert ex.roundoff_verdict(1.2e-1, [1e3, 1e-6]).startswith(
        "the reordering controls are 1,000,000,000 times apart, so they do not settle the size "
        "of round-off: 0.00012 times the larger, 120,000 times the smaller: ")
    assert ex.roundoff_verdict(1e-9, [1e-3]).startswith(
        "less than 0.0001 times the reordering control: within")  # never "1e-06 times"
    assert ex.roundoff_verdict(0.0, [1e-6, 2e-6]) == (
        f"equal to its reference bit for bit, closer than the reordering controls: within {rule}")
    # controls that reproduce the reference bit for bit
    assert ex.roundoff_verdict(0.0, [0.0, 0.0]) == (
        f"equal to its reference, as the reordering controls are: within {rule}")
    assert ex.roundoff_verdict(1e-9, [0.0]) == (
        "not equal to its reference, though the reordering controls are: more than "
        f"{rule} allows")
    with pytest.raises(ValueError, match="controls"):
        ex.roundoff_verdict(1e-3, [])


def test_roundoff_verdict_judges_against_the_smaller_control_when_one_diverged():
    rule = f"the book's round-off rule (at most {ex.ROUNDOFF_FACTOR} times)"
    # round 12: the weighted run's reversed control diverged to 1.8e-02, the other stayed near
    # 1e-6; 1e-3 is 0.056 times the larger but 1,000 times the round-off that stayed small
    diverged = ex.roundoff_verdict(1e-3, [1.8e-2, 1e-6], beyond="not round-off")
    assert diverged == (
        "the reordering controls are 18,000 times apart, so they do not settle the size of "
        "round-off: 0.056 times the larger, 1,000 times the smaller: "
        f"{rule} cannot decide; not round-off")
    assert ex.roundoff_judgement(1e-3, [1.8e-2, 1e-6]) == "undecided"
    assert ex.roundoff_judgement(0.5, [1.8e-2, 1e-6]) == "beyond"
    assert ex.roundoff_verdict(0.5, [1.8e-2, 1e-6]) == (
        "the reordering controls are 18,000 times apart: 28 times the larger, 500,000 times the "
        f"smaller: more than {rule} allows")
    assert ex.roundoff_verdict(8.8e-7, [1.8e-2, 1e-6]) == (
        "the reordering controls are 18,000 times apart, so judged against the smaller too: "
        f"0.88 times it: within {rule}")
    # at the factor squared the controls count as apart; just below it the larger is the rule
    assert "apart" in ex.roundoff_verdict(5e-5, [1e-4, 1e-6])
    assert ex.roundoff_verdict(5e-5, [1e-4, 1e-6]).endswith(f"{rule} cannot decide")
    assert ex.roundoff_verdict(5e-5, [0.99e-4, 1e-6]) == (
        f"below the larger reordering control and 50 times the smaller: within {rule}")
    # more than two controls: the largest against their median
    assert ex.roundoff_verdict(3e-6, [2e-2, 1e-6, 2e-6]) == (
        "the largest reordering control is 10,000 times their median, so judged against the "
        f"median too: 1.5 times it: within {rule}")
    # chapter 5's loss gaps: one control ends near 0 by chance; the other two agree, so none
    # diverged and the largest stays the yardstick (the smallest rule called this "diverged")
    assert not ex.controls_diverged([1.8e-9, 2.5e-5, 2.5e-5])
    assert ex.roundoff_within(2.5e-5, [1.8e-9, 2.5e-5, 2.5e-5])
    assert ex.typical_control([1.8e-9, 2.5e-5, 2.4e-5]) == 2.4e-5
    assert ex.typical_control([0.0, 3e-6, 1e-6]) == 1e-6 and ex.typical_control([0.0]) == 0.0
    # the rule at 10 times the smaller is within, just beyond it undecided
    assert ex.roundoff_verdict(10.0, [1e4, 1.0]).endswith(f"10 times it: within {rule}")
    assert ex.roundoff_verdict(12.0, [1e4, 1.0]).endswith(
        f"12 times the smaller: {rule} cannot decide")
    # a control of 0 reproduced the reference bit for bit: it diverged from nothing, so the
    # nonzero control stays the yardstick (as before)
    assert ex.roundoff_verdict(1e-3, [1e-3 / 2, 0.0]) == (
        f"2 times the larger reordering control: within {rule}")
    # the same rule as a bool, for pages that compute with it
    assert ex.controls_diverged([1.8e-2, 1e-6]) and ex.controls_diverged([1e-4, 1e-6])
    assert not ex.controls_diverged([0.99e-4, 1e-6])
    assert not ex.controls_diverged([1e-3, 0.0]) and not ex.controls_diverged([1e-3])
    assert not ex.roundoff_within(1e-3, [1.8e-2, 1e-6])  # within by the larger alone
    assert ex.roundoff_within(8.8e-7, [1.8e-2, 1e-6])
    assert ex.roundoff_within(5e-5, [0.99e-4, 1e-6]) and not ex.roundoff_within(2e-3, [1e-4])
    assert ex.roundoff_within(0.0, [0.0, 0.0]) and not ex.roundoff_within(1e-9, [0.0])


def test_ratio_digits_prints_no_scientific_notation():
    assert [ex.ratio_digits(r) for r in (0.0, 0.0123, 3.24, 99.4, 99.6, 150.2, 46_812.0)] == [
        "0", "0.012", "3.2", "99", "100", "150", "46,812"]
    assert ex.times_words(99.7, "the control") == "100 times the control"
    for bad in (-3.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="`ratio` must be a non-negative finite"):
            ex.times_words(bad, "the control")
    with pytest.raises(ValueError, match="`difference` must be a non-negative finite"):
        ex.roundoff_verdict(math.nan, [1e-6])
    assert not ex.roundoff_verdict(5e-324, [2.0]).startswith("equal")  # tiny is not zero


ROUNDOFF_HELPERS = ("roundoff_ratio", "roundoff_within", "roundoff_verdict")


@pytest.mark.parametrize("helper", ROUNDOFF_HELPERS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1e-6])
def test_roundoff_helpers_refuse_a_difference_that_is_no_distance(helper, bad):
    # roundoff_within(nan, ...) was True and a negative difference passed: no distance at all
    with pytest.raises(ValueError, match="`difference` must be a non-negative finite"):
        getattr(ex, helper)(bad, [1e-6, 2e-6])


@pytest.mark.parametrize("helper", (*ROUNDOFF_HELPERS, "controls_diverged",
                                    "roundoff_yardstick"))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -1e-6])
def test_roundoff_helpers_refuse_a_control_that_is_no_distance(helper, bad):
    # a NaN control passed roundoff_within (NaN compares False) and hid a divergence
    args = ([1e-6, bad],) if helper in ("controls_diverged", "roundoff_yardstick") else (
        1e-6, [1e-6, bad])
    with pytest.raises(ValueError, match="`controls` must be non-negative finite"):
        getattr(ex, helper)(*args)
    with pytest.raises(ValueError, match="controls must hold at least one"):
        getattr(ex, helper)(*(([],) if len(args) == 1 else (1e-6, [])))


def test_a_zero_control_hides_no_divergence_of_the_others():
    rule = f"the book's round-off rule (at most {ex.ROUNDOFF_FACTOR} times)"
    # 1e-3 and 1e-6 are 1,000 times apart: one diverged, whatever the bit-for-bit control says
    assert ex.controls_diverged([0.0, 1e-6, 1e-3])
    assert not ex.controls_diverged([0.0, 1e-3]) and not ex.controls_diverged([0.0, 0.0])
    assert not ex.controls_diverged([1e-6, 1e-3, 2e-3])  # the median is no outlier
    assert not ex.controls_diverged([0.0, 1e-6, 0.99e-4])
    assert ex.roundoff_yardstick([0.0, 1e-6, 1e-3]) == 1e-6
    assert ex.roundoff_yardstick([0.0, 1e-3]) == 1e-3 and ex.roundoff_yardstick([0.0]) == 0.0
    # 5e-4 is 0.5 times the larger control but 500 times the smaller nonzero one
    assert not ex.roundoff_within(5e-4, [0.0, 1e-6, 1e-3])
    assert ex.roundoff_within(5e-6, [0.0, 1e-6, 1e-3])
    assert ex.roundoff_verdict(5e-4, [0.0, 1e-6, 1e-3], beyond="not round-off") == (
        "the nonzero reordering controls are 1,000 times apart, so they do not settle the size "
        "of round-off: 0.5 times the larger, 500 times the smaller nonzero one: "
        f"{rule} cannot decide; not round-off")
    assert ex.roundoff_verdict(5e-6, [1e-3, 0.0, 1e-6, 2e-6]) == (
        "the largest nonzero reordering control is 500 times their median, so judged against "
        f"the median nonzero one too: 2.5 times it: within {rule}")


def test_the_rule_has_a_cliff_at_100_times_apart():
    # documented at ROUNDOFF_FACTOR: just below 100 times apart the larger control is the
    # yardstick, from 100 times apart the smaller (the larger diverged)
    assert ex.roundoff_within(0.99e-3, [1e-6, 0.99e-4])
    assert not ex.roundoff_within(0.99e-3, [1e-6, 1e-4])
    assert ex.roundoff_within(0.9e-5, [1e-6, 1e-4]) and not ex.roundoff_within(1.1e-5, [1e-6, 1e-4])


def test_roundoff_within_agrees_with_the_verdict_over_a_grid():
    rule = f"the book's round-off rule (at most {ex.ROUNDOFF_FACTOR} times)"
    levels = [0.0, 1e-7, 1e-6, 3e-6, 1e-5, 0.99e-4, 1e-4, 1e-3, 1.8e-2]
    control_sets = [[c] for c in levels]
    control_sets += [list(pair) for pair in itertools.combinations(levels, 2)]
    control_sets += [list(t) for t in itertools.combinations(levels, 3)]
    differences = [0.0, 5e-324, *levels, 2e-7, 5e-6, 5e-5, 2e-3, 0.5, 10.0]
    seen = {"diverged": 0, "within": 0, "beyond": 0}
    for controls in control_sets:
        diverged = ex.controls_diverged(controls)
        seen["diverged"] += diverged
        for d in differences:
            within = ex.roundoff_within(d, controls)
            words = ex.roundoff_verdict(d, controls)
            judgement = ex.roundoff_judgement(d, controls)
            ending = {"within": f"within {rule}", "undecided": f"{rule} cannot decide",
                      "beyond": f"more than {rule} allows"}[judgement]
            assert words.endswith(ending), (d, controls, words)
            assert within == (judgement == "within")
            # undecided only when the controls disagree and the largest alone would pass
            assert (judgement == "undecided") == (
                not within and diverged and d <= ex.ROUNDOFF_FACTOR * max(controls))
            said = "times apart" in words or "times their median" in words
            assert said == (diverged and d > 0), (d, controls, words)
            # the rule is one comparison with the control it judges against
            assert within == (d <= ex.ROUNDOFF_FACTOR * ex.roundoff_yardstick(controls))
            seen["within" if within else "beyond"] += 1
    assert all(seen.values()), seen  # the grid holds every case


def test_roundoff_rule_words_state_the_whole_rule():
    words = ex.roundoff_rule_words()
    assert words.startswith(f"at most {ex.ROUNDOFF_FACTOR} times the largest reordering control")
    assert f"{ex.ROUNDOFF_FACTOR ** 2} or more times the typical" in words
    assert "typical nonzero" in words and "median" in words and "cannot decide" in words


def test_roundoff_judgement_decides_whether_the_controls_disagree_once(monkeypatch):
    calls = []
    diverged = ex.controls_diverged

    def counted(controls):
        calls.append(list(controls))
        return diverged(controls)

    monkeypatch.setattr(ex, "controls_diverged", counted)
    cases = {"within": 5e-6, "undecided": 5e-4, "beyond": 5e-2}  # controls 1e-6 and 1e-3
    for expected, difference in cases.items():
        calls.clear()
        assert ex.roundoff_judgement(difference, [1e-6, 1e-3]) == expected
        assert len(calls) == 1, (expected, calls)


def test_docstrings_say_evaluation_point_and_give_no_unmeasured_speed_verdict():
    """Round-16 reader D9 and A3: train_compare saves nothing, so its points are evaluation
    points, not checkpoints; train_accumulated's ``mode`` says what each traces, not which is
    fastest."""
    for doc in (ex.train_compare.__doc__, ex.CompareRun.__doc__):
        assert "checkpoint" not in doc and "evaluation point" in doc
    assert "fastest" not in ex.train_accumulated.__doc__
