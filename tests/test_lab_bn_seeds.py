"""accumcore.lab.experiments: the spread of accuracies over seeds, and chapter 6b's BatchNorm
advice computed from them."""

from __future__ import annotations

import pytest

from accumcore.lab import experiments as ex


def test_seed_spread_is_max_minus_min():
    assert ex.seed_spread([0.95, 0.97, 0.96]) == pytest.approx(0.02)
    assert ex.seed_spread([0.9]) == 0.0
    with pytest.raises(ValueError, match="non-empty"):
        ex.seed_spread([])


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
