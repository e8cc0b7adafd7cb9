"""One worker of the MultiWorkerMirroredStrategy test (started by tests/test_multiworker.py
through ``helpers.run_workers``).

Usage: ``python tests/multiworker_worker.py`` with ``TF_CONFIG`` (two workers on 127.0.0.1) and
``$ACCUMCORE_TEST_RESULT`` set in the environment. Every worker builds the same seeded model
and data, trains with accumulation under the strategy, and emits its final weights and
counters.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from helpers import LOSS, emit, make_data, small_mlp

import accumcore as ac

N, MICRO, K = 48, 8, 3  # global micro-batches of 8 (4 per worker), windows of 24 samples
SEED = 7  # of the data


def make_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(0.01, global_clipnorm=0.5)


def main() -> None:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = make_data(N, seed=SEED)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options)
    with strategy.scope():
        model = small_mlp()
        trainer = ac.AccumTrainer(model, make_optimizer(), LOSS, accum_steps=K)
    history = trainer.fit(dataset, epochs=1, mode="function", verbose=0)
    emit({
        "replicas": strategy.num_replicas_in_sync,
        "weights": model.get_weights(),
        "counters": history.counters,
        "updates": history.updates,
    })


if __name__ == "__main__":
    main()
