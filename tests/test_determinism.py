"""Same seed => bit-identical weights, for every entry point.

Each entry point trains twice from ``keras.utils.set_random_seed(0)`` on 72 MNIST samples
(micro-batches of 16, K = 2, ragged last window, 2 epochs) with a Dropout layer and a seeded
``tf.data`` shuffle (``fit``: ``shuffle=True``), so that the seed drives initialisation,
dropout masks and data order. The runs happen in a fresh interpreter with
``tf.config.experimental.enable_op_determinism()`` (see ``reliability_scenarios.py``).
"""

from __future__ import annotations

import pytest
from helpers import bitwise_equal
from reliability_scenarios import ENTRY_POINTS, OTHER_SEED_ENTRIES, load, weights_of

# The scenario subprocess (shared with test_resume.py) takes ~45 s of CPU: deselected by
# `-m "not slow"`, always run by CI (`pytest tests`).
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_same_seed_gives_identical_weights(entry):
    """Catches: an unseeded random source (initialiser, dropout, shuffle), state leaking
    from one run into the next (a shared accumulator, optimizer or traced function), or a
    non-deterministic reduction in the accumulation."""
    r = load("determinism")
    a, b = weights_of(r, f"{entry}.a"), weights_of(r, f"{entry}.b")
    assert a, "no weights recorded"
    # Guard: the run trained (else a == b would be vacuous).
    assert not bitwise_equal(a, weights_of(r, f"{entry}.initial")), f"{entry} did not train"
    assert bitwise_equal(a, b), f"{entry}: two runs with seed 0 differ"


@pytest.mark.parametrize("entry", OTHER_SEED_ENTRIES)
def test_another_seed_gives_other_weights(entry):
    """Guard that the comparison above can fail: seed 1 must give different weights (else the
    seed would not reach the run)."""
    r = load("determinism")
    assert not bitwise_equal(weights_of(r, f"{entry}.a"), weights_of(r, f"{entry}.other_seed"))
