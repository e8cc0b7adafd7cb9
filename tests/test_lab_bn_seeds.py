"""accumcore.lab.experiments: accuracies over seeds against a target, and chapter 6b's
BatchNorm decision rule built on them."""

from __future__ import annotations

import math

import pytest

from accumcore.lab import experiments as ex


def test_seed_spread_is_max_minus_min():
    assert ex.seed_spread([0.95, 0.97, 0.96]) == pytest.approx(0.02)
    assert ex.seed_spread([0.9]) == 0.0
    with pytest.raises(ValueError, match="non-empty"):
        ex.seed_spread([])


def test_noise_is_the_seed_spread_when_it_exceeds_the_tie_threshold():
    c = ex.compare_over_seeds([0.950, 0.970], [0.955, 0.957], n=10_000)
    tie = ex.tie_threshold(0.956, 10_000)  # ~0.0041
    assert c.mean == pytest.approx(0.96) and c.target_mean == pytest.approx(0.956)
    assert c.spread == pytest.approx(0.02)  # the candidate's spread, the larger one
    assert c.tie == pytest.approx(tie)
    assert c.noise == pytest.approx(0.02)
    assert c.verdict == 0 and c.within_noise
    assert c.delta == pytest.approx(0.004)
    assert "within the noise of the target (+0.40 points; noise 2.00 points)" in c.describe()


def test_noise_is_the_tie_threshold_when_the_seeds_agree():
    # identical seeds: the evaluation set's own error is the floor of the noise
    c = ex.compare_over_seeds([0.969, 0.969], [0.954, 0.954], n=10_000)
    assert c.spread == 0.0
    assert c.noise == pytest.approx(2 * math.sqrt(0.954 * 0.046 / 10_000))
    assert c.verdict == 1 and not c.within_noise
    assert c.describe("stock BN").startswith("is above stock BN by 1.50 points")
    below = ex.compare_over_seeds([0.954], [0.969, 0.969], n=10_000)
    assert below.verdict == -1 and "below the target by 1.50 points" in below.describe()


def test_the_target_spread_counts_too():
    c = ex.compare_over_seeds([0.960, 0.960], [0.940, 0.980], n=10_000)
    assert c.spread == pytest.approx(0.04) and c.verdict == 0


def test_paired_seeds_cancel_what_the_seed_does_to_both():
    # each seed moves both runs alike: unpaired the spread swamps the gap, paired it does not
    runs, target = [0.9533, 0.9725, 0.9663], [0.9537, 0.9726, 0.9665]
    unpaired = ex.compare_over_seeds(runs, target, n=10_000)
    paired = ex.compare_over_seeds(runs, target, n=10_000, paired=True)
    assert unpaired.spread == pytest.approx(0.0192) and not unpaired.paired
    assert paired.paired and paired.spread == pytest.approx(0.0003)
    assert paired.noise == pytest.approx(paired.tie)  # the floor
    assert paired.delta == pytest.approx(unpaired.delta)  # the same means
    shifted = ex.compare_over_seeds([0.9633, 0.9825, 0.9763], target, n=10_000, paired=True)
    assert shifted.verdict == 1  # +1 point on every seed: above the noise when paired ...
    assert ex.compare_over_seeds([0.9633, 0.9825, 0.9763], target, n=10_000).verdict == 0
    with pytest.raises(ValueError, match="one target per seed"):
        ex.compare_over_seeds(runs, target[:2], n=10_000, paired=True)


def _versus(delta, noise=0.005):
    return ex.SeedComparison(0.95 + delta, 0.95, noise, noise, noise,
                             ex.compare(0.95 + delta, 0.95, noise))


@pytest.mark.parametrize("stock_delta, window_delta, case, words", [
    (0.015, 0.0, "window", "stock BN lands above it"),
    (-0.015, 0.001, "window", "stock BN lands below it"),
    (0.002, -0.001, "either", "either layer does"),
    (0.015, -0.02, "normalisation", "lands below the target"),
    (0.0, 0.02, "normalisation", "offsets that gap"),
])
def test_batchnorm_rule_cases(stock_delta, window_delta, case, words):
    found, text = ex.batchnorm_rule(_versus(stock_delta), _versus(window_delta))
    assert found == case and found in ex.BATCHNORM_CASES
    assert words in text
    if case == "window":
        assert "use WindowBatchNormalization" in text
    if case == "normalisation":
        assert "GroupNormalization, LayerNormalization" in text


@pytest.mark.parametrize("window, stock, case, words", [
    ([0.950, 0.960], [0.960, 0.970], "stock higher", "stock BN scored higher on all 2 seeds"),
    ([0.950, 0.960], [0.940, 0.950], "window higher", "use WindowBatchNormalization"),
    ([0.950, 0.960], [0.955, 0.955], "mixed", "either layer does"),
    ([0.950, 0.960], [0.950, 0.970], "mixed", "changed sign across the seeds"),
    ([0.930, 0.960], [0.960, 0.970], "normalisation", "GroupNormalization, LayerNormalization"),
])
def test_batchnorm_advice_cases(window, stock, case, words):
    """The target is 0.951 and 0.959 (window-level BN within 0.1 points but in the last case);
    the tie 0.5 points."""
    found, text = ex.batchnorm_advice(window, stock, [0.951, 0.959], tie=0.005)
    assert found == case and found in ex.BATCHNORM_ADVICE_CASES
    assert words in text
    if case != "normalisation":
        assert "within 0.10 points" in text


def test_batchnorm_advice_needs_one_accuracy_per_seed_each():
    with pytest.raises(ValueError, match="one accuracy per seed"):
        ex.batchnorm_advice([0.95, 0.96], [0.95], [0.95, 0.96], tie=0.005)
