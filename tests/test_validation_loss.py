"""AccumModel's validation loss and evaluate() are real losses, equal to a plain model's."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from helpers import LOSS, small_mlp

import accumcore as ac


def test_val_loss_and_evaluate_match_a_plain_model_with_the_same_weights(data):
    x, y = data
    model = small_mlp(model_cls=ac.AccumModel, accum_steps=2)
    model.compile(keras.optimizers.SGD(0.1), LOSS, metrics=["accuracy"])
    history = model.fit(x, y, batch_size=8, epochs=1, validation_data=(x[:30], y[:30]),
                        shuffle=False, verbose=0)

    plain = small_mlp()  # independent: Keras's own test_step and loss tracker
    plain.compile(keras.optimizers.SGD(0.1), LOSS, metrics=["accuracy"])
    plain.set_weights(model.get_weights())
    # Ragged batches (16 + 14) so that a per-batch (unweighted) mean would differ.
    expected_loss, expected_acc = plain.evaluate(x[:30], y[:30], batch_size=16, verbose=0)
    assert expected_loss > 0.1  # a real cross-entropy, not an empty tracker

    assert history.history["val_loss"][0] == pytest.approx(expected_loss, rel=1e-6)
    assert history.history["val_accuracy"][0] == pytest.approx(expected_acc, rel=1e-6)
    loss, acc = model.evaluate(x[:30], y[:30], batch_size=16, verbose=0)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    assert np.isclose(acc, expected_acc)
