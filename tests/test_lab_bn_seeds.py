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
    ([0.950, 0.960], [0.960, 0.970], "stock higher",
     "by the tie threshold, stock BN scored higher on both seeds"),
    ([0.950, 0.960], [0.940, 0.950], "window higher", "use WindowBatchNormalization"),
    ([0.950, 0.960], [0.953, 0.957], "no consistent difference",
     "by the tie threshold, stock BN tied on both seeds"),
    ([0.950, 0.960], [0.950, 0.970], "no consistent difference",
     "over the 2 seeds, by the tie threshold, stock BN scored higher on one and tied on one"),
    # stock higher on both seeds, but on one only beyond the tie: both measures, one clause
    ([0.950, 0.960], [0.951, 0.970], "same direction",
     "stock BN's accuracy was above window-level BN's on both seeds, beyond the tie threshold "
     "on one only, so a cost"),
    # window higher on both seeds, on one within the tie
    ([0.950, 0.960], [0.940, 0.957], "same direction",
     "window-level BN's accuracy was above stock BN's on both seeds, beyond the tie threshold "
     "on one only, so a gain"),
    # stock higher on both seeds, each within the tie
    ([0.950, 0.960], [0.953, 0.962], "same direction",
     "stock BN's accuracy was above window-level BN's on both seeds, each time within the tie "
     "threshold, so a cost"),
    ([0.930, 0.960], [0.960, 0.970], "normalisation", "GroupNormalization, LayerNormalization"),
])
def test_batchnorm_advice_cases(window, stock, case, words):
    """The target is 0.951 and 0.959 (window-level BN within 0.1 points but in the last case);
    the tie 0.5 points, the same rule for window vs target and window vs stock."""
    found, text = ex.batchnorm_advice(window, stock, [0.951, 0.959], tie=0.005)
    assert found == case and found in ex.BATCHNORM_ADVICE_CASES
    assert words in text
    if case != "normalisation":
        assert "within 0.10 points" in text
    if case in ("no consistent difference", "same direction"):  # tied on some seed
        same_sign = all(w < s for w, s in zip(window, stock)) or all(
            w > s for w, s in zip(window, stock))
        assert (case == "same direction") is same_sign, case
        assert ("no consistent cost or gain measured" in text) is not same_sign, text
        assert ("cannot size it" in text) is same_sign, text
        assert ("by the tie threshold" in text) is not same_sign, text  # one measure each


def test_batchnorm_advice_on_the_full_editions_seeds():
    """Window minus stock -1.57, -0.23, -0.17 points with a tie of 0.37: one seed beyond."""
    window, stock, target = [0.9533, 0.9725, 0.9663], [0.9690, 0.9748, 0.9680], [0.9537,
                                                                                  0.9726, 0.9665]
    case, text = ex.batchnorm_advice(window, stock, target, tie=0.0037)
    assert case == "same direction"
    assert ("; stock BN's accuracy was above window-level BN's on all 3 seeds, beyond the tie "
            "threshold on one only, so a cost") in text, text
    assert "ranged from -1.57 to -0.17 points over the 3 seeds" in text, text
    assert text.count("tie threshold") == 2, text  # the target's tie, then the counts, once
    assert "scored higher" not in text and "tied" not in text, text  # no second measure
    assert "a cost of reproducing the large batch is possible" in text, text
    assert "no consistent cost or gain" not in text, text
    assert "either layer does" not in text


def test_higher_on_every_seed_names_the_side_or_nothing():
    assert ex.higher_on_every_seed([0.95, 0.96], [0.951, 0.97]) == "stock BN"
    assert ex.higher_on_every_seed([0.95, 0.96], [0.94, 0.959]) == "window-level BN"
    assert ex.higher_on_every_seed([0.95, 0.96], [0.94, 0.97]) == ""
    assert ex.higher_on_every_seed([0.95, 0.96], [0.95, 0.97]) == ""  # a seed with no gap


def test_count_by_tie_counts_each_seed_once():
    assert ex.count_by_tie([0.90, 0.95, 0.99], [0.95, 0.951, 0.95], tie=0.005) == (1, 1, 1)
    assert ex.count_by_tie([0.90], [0.904], tie=0.005) == (0, 1, 0)
    with pytest.raises(ValueError):
        ex.count_by_tie([0.9, 0.9], [0.9], tie=0.005)


def test_tie_counts_sentence_is_the_advices_counts_clause():
    window, stock = [0.9533, 0.9725, 0.9663], [0.9690, 0.9748, 0.9610]
    sentence = ex.tie_counts_sentence(window, stock, tie=0.0037)
    assert sentence == ("over the 3 seeds, by the tie threshold, stock BN scored higher on one, "
                        "tied on one and scored lower on one")
    _, advice = ex.batchnorm_advice(window, stock, window, tie=0.0037)
    assert sentence in advice


def test_batchnorm_advice_needs_one_accuracy_per_seed_each():
    with pytest.raises(ValueError, match="one accuracy per seed"):
        ex.batchnorm_advice([0.95, 0.96], [0.95], [0.95, 0.96], tie=0.005)


def test_batchnorm_advice_refuses_a_nan_accuracy():
    """A NaN accuracy would compare as neither within nor beyond the tie: refused, not advised."""
    with pytest.raises(ValueError, match="finite"):
        ex.batchnorm_advice([0.95, float("nan")], [0.95, 0.96], [0.95, 0.96], tie=0.005)


def test_batchnorm_advice_counts_one_seed_in_words():
    """Stock BN higher within the tie on a single seed: no "all 1 seeds", no "1 seeds"."""
    case, text = ex.batchnorm_advice([0.950], [0.952], [0.951], tie=0.005)
    assert case == "same direction"
    assert ("stock BN's accuracy was above window-level BN's on the one seed, within the tie "
            "threshold, so a cost") in text, text
    assert "and one seed cannot size it" in text and "on the one seed;" in text, text
    assert "1 seeds" not in text, text


def test_the_spread_of_equal_gaps_is_one_value_not_a_range():
    """One seed, or seeds with the same gap: "was -0.20 points on ...", never "-0.20 to -0.20"."""
    _, one = ex.batchnorm_advice([0.950], [0.952], [0.951], tie=0.005)
    assert "was -0.20 points on the one seed" in one and " to -0.20" not in one, one
    _, both = ex.batchnorm_advice([0.95, 0.95], [0.952, 0.952], [0.95, 0.95], tie=0.005)
    assert "was -0.20 points on both seeds" in both, both
    _, ranged = ex.batchnorm_advice([0.95, 0.95], [0.952, 0.953], [0.95, 0.95], tie=0.005)
    assert "ranged from -0.30 to -0.20 points over the 2 seeds" in ranged, ranged


@pytest.mark.parametrize("window, stock", [([], []), ([0.9], [0.95, 0.96, 0.97]),
                                           ([0.9, float("nan")], [0.9, 0.9])])
def test_higher_on_every_seed_refuses_what_is_not_one_accuracy_per_seed(window, stock):
    """An empty list is no seed (not "stock BN" by an empty all()); one value is not broadcast
    against three."""
    with pytest.raises(ValueError, match="one accuracy per seed|finite"):
        ex.higher_on_every_seed(window, stock)
