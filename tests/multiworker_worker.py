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
from helpers import LOSS, emit, make_data, seq_data, seq_model, small_mlp, token_loss

import accumcore as ac

N, MICRO, K = 48, 8, 3  # global micro-batches of 8 (4 per worker), windows of 24 samples
SEED = 7  # of the data


def make_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(0.01, global_clipnorm=0.5)


def tokens_data():
    """Masked token sequences (the Embedding case): uneven tokens per worker."""
    return seq_data(N, seed=SEED)


def train(strategy, x, y, make_model, loss) -> dict:
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options)
    with strategy.scope():
        model = make_model()
        trainer = ac.AccumTrainer(model, make_optimizer(), loss, accum_steps=K)
    history = trainer.fit(dataset, epochs=1, mode="function", verbose=0)
    return {"weights": model.get_weights(), "counters": history.counters,
            "updates": history.updates, "epoch_weights": history.epoch_weights}


def main() -> None:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    emit({
        "replicas": strategy.num_replicas_in_sync,
        "mlp": train(strategy, *make_data(N, seed=SEED), small_mlp, LOSS),
        "tokens": train(strategy, *tokens_data(), seq_model, token_loss()),
    })


if __name__ == "__main__":
    main()
