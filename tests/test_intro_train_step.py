"""The intro's own ``train_step`` (book/intro.md, "Your own train_step") is exact.

The code block that follows the ``(train-step-answer)=`` label of book/intro.md is run as the
reader would copy it, up to its usage lines (which name the reader's own ``inputs``, ``x``
and ``y``): a small model trained with it through ``fit(batch_size=16)`` must end at the
weights of a plain ``keras.Model`` trained with ``fit(batch_size=64)`` from the same initial
weights, the partial last window of each epoch included, with Adam (whose update depends on its
step count, so an optimizer stepped per micro-batch fails) and with SGD.

Tolerance: the two runs sum the same per-sample gradients in a different order, in float32
(eps = 1.2e-7); measured about 1e-6 of the largest weight change over 8 updates. ``1e-4``
leaves room for other CPUs and versions; the bugs this guards against (no division by the
window's weight, an update per micro-batch, the partial window lost) are off by 1e-1 or more
(the test checks that a broken copy fails).
"""

from __future__ import annotations

import re
from pathlib import Path

import keras
import numpy as np
import pytest

INTRO = Path(__file__).resolve().parents[1] / "book" / "intro.md"
TOLERANCE = 1e-4


def intro_block() -> str:
    """The intro's ``train_step`` block, without its usage lines (from ``model = ``)."""
    text = INTRO.read_text()
    after = text[text.index("(train-step-answer)="):]
    code = re.search(r"```python\n(.*?)```", after, re.S).group(1)
    assert "def train_step" in code and "accumulation.step(" in code
    return code[:code.index("\nmodel = ")]


def train(code: str, optimizer, n_samples: int, epochs: int = 2) -> dict:
    """For ``code``'s model at 4 x 16 against a plain model at 64: ``rel`` (largest weight
    difference / largest weight change of the reference), the optimizer's ``iterations`` and
    both runs' logged ``losses`` (per epoch)."""
    namespace: dict = {}
    exec(compile(code, str(INTRO), "exec"), namespace)

    def build(cls, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((20,))
        hidden = keras.layers.Dense(32, activation="relu")(inputs)
        return cls(inputs, keras.layers.Dense(5, activation="softmax")(hidden), **kwargs)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(n_samples, 20)).astype("float32")
    y = rng.integers(0, 5, n_samples).astype("int32")
    model = build(namespace["AccumulatingModel"], accum_steps=4)
    namespace["model"] = model  # the flush callback's lambda reads the global `model`
    reference = build(keras.Model)
    initial = model.get_weights()
    reference.set_weights(initial)
    model.compile(optimizer(), "sparse_categorical_crossentropy")
    reference.compile(optimizer(), "sparse_categorical_crossentropy")
    history = model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=[namespace["flush"]])
    plain = reference.fit(x, y, batch_size=64, epochs=epochs, shuffle=False, verbose=0)
    assert int(reference.optimizer.iterations) == epochs * -(-n_samples // 64)
    diff = max(np.abs(a - b).max() for a, b in zip(model.get_weights(),
                                                   reference.get_weights(), strict=True))
    change = max(np.abs(a - b).max() for a, b in zip(reference.get_weights(), initial,
                                                     strict=True))
    return {"rel": float(diff / change), "iterations": int(model.optimizer.iterations),
            "losses": (history.history["loss"], plain.history["loss"])}


@pytest.mark.parametrize("optimizer", [lambda: keras.optimizers.Adam(1e-2),
                                       lambda: keras.optimizers.SGD(0.1, momentum=0.9)],
                         ids=["adam", "sgd-momentum"])
@pytest.mark.parametrize("n_samples", [3 * 64, 3 * 64 + 40], ids=["full", "partial"])
def test_the_intro_train_step_matches_fit_at_64(optimizer, n_samples):
    run = train(intro_block(), optimizer, n_samples)
    assert run["iterations"] == 2 * -(-n_samples // 64)  # one per window, the partial included
    assert run["rel"] <= TOLERANCE
    # the logged loss is the mean over the epoch's samples, each at its window's weights, as
    # at 64: the same numbers to float32 round-off
    mine, plain = run["losses"]
    assert mine == pytest.approx(plain, rel=1e-5)


@pytest.mark.parametrize("broken", [
    ("summed_loss = c * loss", "summed_loss = loss"),  # micro-batch means summed: K x the step
    ("on_epoch_end=lambda epoch, logs: model.accumulation.flush(model.optimizer)",
     "on_epoch_end=lambda epoch, logs: None"),  # the partial window carried, not applied
])
def test_a_broken_copy_fails(broken):
    old, new = broken
    code = intro_block()
    assert old in code
    run = train(code.replace(old, new), lambda: keras.optimizers.SGD(0.1), 3 * 64 + 40)
    assert run["rel"] > 1e-2
