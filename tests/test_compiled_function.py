"""``AccumTrainer.compiled_function``: the ``tf.function`` each compiled entry point runs.

It must be the function the entry point really runs (its trace count moves when, and only
when, that entry point traces), for a Dense and an Embedding model, and refuse what does not
exist with an error naming the fix. The benchmarks count its graph operations
(``accumcore.lab.benchmarking.count_ops``).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import accumcore


def trainer_for(kind: str) -> tuple[accumcore.AccumTrainer, np.ndarray, np.ndarray]:
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if kind == "dense":
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        x = rng.normal(size=(32, 6)).astype("float32")
    else:
        inputs = keras.Input((5,), dtype="int32")
        hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4)(inputs))
        x = rng.integers(0, 20, (32, 5)).astype("int32")
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
    y = rng.integers(0, 3, 32).astype("int32")
    trainer = accumcore.AccumTrainer(model, keras.optimizers.SGD(0.1),
                                     "sparse_categorical_crossentropy", accum_steps=2)
    return trainer, x, y


def traces(trainer: accumcore.AccumTrainer, entry: str) -> int:
    return trainer.compiled_function(entry).experimental_get_tracing_count()


@pytest.mark.parametrize("kind", ["dense", "embedding"])
def test_each_entry_point_runs_its_compiled_function(kind):
    trainer, x, y = trainer_for(kind)
    with pytest.raises(ValueError, match=r"mode='function'\)` or `trainer.train_micro_batch"):
        trainer.compiled_function("micro_batch")
    assert traces(trainer, "epoch") == traces(trainer, "window") == 0

    trainer.fit(x, y, batch_size=8, mode="function", verbose=0, shuffle=False)
    assert traces(trainer, "micro_batch") == 1
    assert traces(trainer, "epoch") == traces(trainer, "window") == 0

    trainer.fit(x, y, batch_size=8, mode="graph", verbose=0, shuffle=False)
    assert traces(trainer, "epoch") == 1 and traces(trainer, "window") == 0

    trainer.window_step(x[:16], y[:16])
    assert traces(trainer, "window") == 1 and traces(trainer, "micro_batch") == 1
    spec = tf.TensorSpec((None, *x.shape[1:]), tf.as_dtype(x.dtype))
    graph = trainer.compiled_function("micro_batch").get_concrete_function(
        spec, tf.TensorSpec((None,), tf.int32), None).graph
    assert len(graph.as_graph_def().node) > 0


def test_an_unknown_entry_names_the_choices():
    trainer, _, _ = trainer_for("dense")
    with pytest.raises(ValueError, match="`entry`='step'.*'micro_batch', 'epoch', 'window'"):
        trainer.compiled_function("step")
