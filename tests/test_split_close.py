"""A split batch's window is closed without ``apply_window``'s ``tf.cond`` on its count
(``AccumulationState._close_split``, one replica): the same weights and counters, bit for bit,
as through ``apply_window``, and the large-batch result.

Both modes and both models of every test matrix: the small MLP and an ``Embedding`` model,
``micro_batch_size`` (the split batch: compared bitwise with the ``apply_window`` close and with
the plain-Keras reference) and ``accum_steps`` (not split: compared with the reference, which
the split's result must equal too). A window with a NaN input under ``nonfinite="skip_window"``
takes the close's skip branch.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from helpers import LOSS, assert_matches_reference, bitwise_equal, get_weights, small_mlp

import accumcore as ac
from accumcore._impl.state import AccumulationState

B, b = 16, 6  # 40 samples: batches of 16, 16, 8; cut 6 + 6 + 4 and 6 + 2


def embedding_model(seed: int = 0) -> keras.Model:
    """Five tokens of 7 through an ``Embedding(7, 4)``, flattened, a softmax over 3."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((5,), dtype="int32")
    hidden = keras.layers.Flatten()(keras.layers.Embedding(7, 4)(tokens))
    return keras.Model(tokens, keras.layers.Dense(3, activation="softmax")(hidden))


MODELS = {"mlp": small_mlp, "embedding": embedding_model}


def inputs(kind: str, n: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)``: 8 float features or 5 tokens, labels in 0..2 (seeded)."""
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(n, 8)).astype("float32") if kind == "mlp"
         else rng.integers(0, 7, size=(n, 5)).astype("int32"))
    return x, rng.integers(0, 3, size=n).astype("int32")


def trained(kind: str, x, y, *, via_apply_window: bool = False, nonfinite: str = "raise",
            **how) -> keras.Model:
    """``MODELS[kind]()`` after ``fit`` with accumcore (``how``: the mode); with
    ``via_apply_window`` the split's window is closed through ``apply_window`` instead."""
    model = MODELS[kind]()
    model.compile(keras.optimizers.SGD(0.1), LOSS)
    ac.accumulate(model, nonfinite=nonfinite, **how)
    batch = B if "micro_batch_size" in how else B // how["accum_steps"]
    close, calls = AccumulationState._close_split, []

    def counted(self, optimizer):  # traced once per step function: counts the traces
        calls.append(optimizer)
        return close(self, optimizer)

    AccumulationState._close_split = (
        (lambda self, optimizer: self.apply_window(optimizer)) if via_apply_window else counted)
    try:
        model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    finally:
        AccumulationState._close_split = close
    # the split's own close is what ran (without it both paths would be one graph)
    assert bool(calls) is ("micro_batch_size" in how and not via_apply_window)
    return model


def reference(kind: str, x, y, windows: list) -> tuple[list, list]:
    """Plain Keras ``train_on_batch`` on each window's samples: (initial, final) weights."""
    model = MODELS[kind]()
    initial = get_weights(model)
    model.compile(keras.optimizers.SGD(0.1), LOSS)
    for s in windows:
        model.train_on_batch(x[s], y[s])
    return initial, get_weights(model)


WINDOWS = [slice(s, min(s + B, 40)) for s in range(0, 40, B)] * 2  # two epochs


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_split_close_is_bitwise_the_apply_window_close(kind):
    x, y = inputs(kind)
    fast = trained(kind, x, y, micro_batch_size=b)
    slow = trained(kind, x, y, micro_batch_size=b, via_apply_window=True)
    assert bitwise_equal(get_weights(fast), get_weights(slow))
    assert fast.accumulation.counters() == slow.accumulation.counters()
    assert fast.accumulation.counters()["windows_applied"] == len(WINDOWS)
    assert_matches_reference(fast, *reference(kind, x, y, WINDOWS))


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("how", [{"micro_batch_size": b}, {"accum_steps": 4}],
                         ids=["micro_batch_size", "accum_steps"])
def test_both_modes_match_the_large_batch(kind, how):
    """accum_steps=4 at batch 4 and micro_batch_size=6 at batch 16: windows of 16 samples."""
    x, y = inputs(kind)
    model = trained(kind, x, y, **how)
    assert_matches_reference(model, *reference(kind, x, y, WINDOWS))


def test_split_close_skips_a_nonfinite_window_as_apply_window_does():
    x, y = inputs("mlp")
    x[20] = np.nan  # the second batch of each epoch
    fast = trained("mlp", x, y, micro_batch_size=b, nonfinite="skip_window")
    slow = trained("mlp", x, y, micro_batch_size=b, nonfinite="skip_window",
                   via_apply_window=True)
    assert bitwise_equal(get_weights(fast), get_weights(slow))
    counts = fast.accumulation.counters()
    assert counts == slow.accumulation.counters()
    assert (counts["windows_applied"], counts["windows_skipped"]) == (4, 2)
    assert_matches_reference(fast, *reference("mlp", x, y, [WINDOWS[i] for i in (0, 2, 3, 5)]))
