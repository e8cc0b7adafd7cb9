"""The compiled micro-step (mode="function") is traced once, ragged last micro-batch included."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from helpers import small_mlp

import accumcore as ac


def _counting_loss(counter: list[int]):
    def loss(y_true, y_pred):
        counter[0] += 1  # Python side effect: runs once per trace (and per call in eager mode)
        return keras.losses.sparse_categorical_crossentropy(y_true, y_pred)

    return loss


def test_ragged_last_micro_batch_does_not_retrace(data):
    x, y = data  # 40 samples -> micro-batches 16, 16, 8 (ragged)
    traces = [0]
    trainer = ac.AccumTrainer(small_mlp(), keras.optimizers.SGD(0.1), _counting_loss(traces),
                              accum_steps=2)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    history = trainer.fit(ds, epochs=2, mode="function", verbose=0)
    assert history.micro_weights[:3] == [16.0, 16.0, 8.0]
    assert traces[0] == 1, f"the micro-step was traced {traces[0]} times, expected once"


def test_relaxed_trace_with_sample_weights_and_numpy_inputs(data):
    x, y = data
    sw = np.linspace(0.5, 1.5, len(x)).astype("float32")
    traces = [0]
    trainer = ac.AccumTrainer(small_mlp(), keras.optimizers.SGD(0.1), _counting_loss(traces),
                              accum_steps=2)
    for start, size in ((0, 16), (16, 16), (32, 8)):
        s = slice(start, start + size)
        trainer.train_micro_batch(x[s], y[s], sw[s], compiled=True)
    assert traces[0] == 1
    assert trainer.state.counters()["micro_batches_seen"] == 3
