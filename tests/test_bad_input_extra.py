"""Rows of the book's "Errors and bad input" and "Keras workflows" pages (book/reference/) that
no other test held: a summed loss or ``window_step`` under a ``tf.distribute`` strategy, and a
weights file with a pending window loaded into a frozen model. Each test asserts the exception
type and that the message names the cause and the fix, as tests/test_bad_input.py does.

The strategy is a ``OneDeviceStrategy`` on the CPU: it is a strategy for every check that
accumcore makes (``tf.distribute.has_strategy()`` in its scope) and, unlike a
``MirroredStrategy``, it starts no collective ops in the test process.
"""

from __future__ import annotations

import keras
import pytest
import tensorflow as tf
from helpers import LOSS, small_mlp

import accumcore as ac

SUM_LOSS = keras.losses.SparseCategoricalCrossentropy(reduction="sum")
SUM_MESSAGE = r"reduction='sum' is not supported under a tf\.distribute strategy.*sum_over_batch"


def _one_device() -> tf.distribute.Strategy:
    return tf.distribute.OneDeviceStrategy("/cpu:0")


@pytest.mark.parametrize("entry", ["trainer", "fit", "fit_split"])
def test_sum_reduction_under_a_strategy_raises(entry, data):
    x, y = data
    strategy = _one_device()
    with strategy.scope():
        if entry == "trainer":
            trainer = ac.AccumTrainer(small_mlp(), keras.optimizers.SGD(0.01), SUM_LOSS,
                                      accum_steps=2)
        else:  # fit_split: micro_batch_size=b, fit(batch_size=K * b)
            how = dict(accum_steps=2) if entry == "fit" else dict(micro_batch_size=8)
            model = small_mlp(model_cls=ac.AccumModel, **how)
            model.compile(keras.optimizers.SGD(0.01), SUM_LOSS)
    with pytest.raises(ValueError, match=SUM_MESSAGE):
        if entry == "trainer":
            trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), verbose=0)
        else:
            model.fit(x, y, batch_size=8 if entry == "fit" else 16, verbose=0)
    # The same model and loss train without a strategy: the strategy is the cause.
    plain = ac.AccumTrainer(small_mlp(), keras.optimizers.SGD(0.01), SUM_LOSS, accum_steps=2)
    assert plain.fit(x, y, batch_size=8, verbose=0).updates == [3]


def test_window_step_under_a_strategy_raises(data):
    x, y = data
    with _one_device().scope():
        trainer = ac.AccumTrainer(small_mlp(), keras.optimizers.SGD(0.1), LOSS, accum_steps=2)
    with pytest.raises(NotImplementedError, match=r"`window_step` splits one batch on one "
                                                  r"device.*trainer\.fit"):
        trainer.window_step(x[:16], y[:16])


def test_pending_window_loaded_into_a_frozen_model_raises(data, tmp_path):
    x, y = data
    model = small_mlp(model_cls=ac.AccumModel, accum_steps=3, end_of_epoch="carry")
    model.compile(keras.optimizers.SGD(0.1), LOSS)
    model.fit(x[:16], y[:16], batch_size=8, shuffle=False, verbose=0)  # 2 of 3 pending
    assert int(model.accumulation.micro_step.numpy()) == 2
    path = str(tmp_path / "pending.weights.h5")
    model.save_weights(path)

    frozen = small_mlp(seed=1, model_cls=ac.AccumModel, accum_steps=3)
    frozen.trainable = False
    with pytest.raises(ValueError, match=r"partial window of 2 micro-batch.*no trainable "
                                         r"variables.*unfreeze the model before loading, or "
                                         r"save after `accumcore\.flush\(model\)`"):
        frozen.load_weights(path)
    # The documented way out: flush, save again, and the frozen model loads the weights.
    assert model.flush()
    model.save_weights(path)
    frozen.load_weights(path)
    for got, want in zip(frozen.get_weights(), model.get_weights(), strict=True):
        assert (got == want).all()
