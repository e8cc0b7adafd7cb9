"""One worker of the MultiWorkerMirroredStrategy test (started by tests/test_multiworker.py).

Usage: ``python tests/multiworker_worker.py OUT.json`` with ``TF_CONFIG`` set in the
environment (two workers on 127.0.0.1). Every worker builds the same seeded model and data,
trains with accumulation under the strategy, and writes its final weights and counters.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import json  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import accumcore as ac  # noqa: E402
import accumcore.lab.experiments  # noqa: E402,F401

N, MICRO, K = 48, 8, 3  # global micro-batches of 8 (4 per worker), windows of 24 samples
LOSS = "sparse_categorical_crossentropy"


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    return (rng.normal(size=(N, 8)).astype("float32"),
            rng.integers(0, 3, size=N).astype("int32"))


def make_model(model_cls=None, **kwargs):
    import keras

    return ac.lab.experiments.mlp(8, (16,), 3, seed=0, model_cls=model_cls or keras.Model, **kwargs)


def make_optimizer():
    import keras

    return keras.optimizers.Adam(0.01, global_clipnorm=0.5)


def main(out_path: str) -> None:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options)
    with strategy.scope():
        model = make_model()
        trainer = ac.AccumTrainer(model, make_optimizer(), LOSS, accum_steps=K)
    history = trainer.fit(dataset, epochs=1, mode="function", verbose=0)
    result = {
        "replicas": strategy.num_replicas_in_sync,
        "weights": [w.tolist() for w in model.get_weights()],
        "counters": history.counters,
        "updates": history.updates,
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
