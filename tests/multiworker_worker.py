"""One worker of the MultiWorkerMirroredStrategy tests (started by tests/test_multiworker.py
through ``helpers.run_workers``).

Usage: ``python tests/multiworker_worker.py CASE`` with ``TF_CONFIG`` (two workers on
127.0.0.1) and ``$ACCUMCORE_TEST_RESULT`` set in the environment. Every worker builds the same
seeded model and data under the strategy and emits what ``CASE`` produces:

* ``trainer``: ``AccumTrainer.fit`` in each mode (eager, function, graph), with
  ``accum_steps=K`` (batches are micro-batches) and with ``micro_batch_size=b`` (each batch is
  the recipe's batch, split inside the step): final weights and counters per run.
* ``keras_fit``: Keras's own ``model.fit`` (a plain ``keras.Model``, an ``AccumModel`` and a
  model given to ``accumulate``), with arrays and with a dataset: the error each raises
  (message and traceback frames), or ``None`` if it trains.
* ``oom``: ``AccumTrainer`` with an out-of-memory error on worker 0 only: the error each
  worker raises.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import keras
import tensorflow as tf
from helpers import LOSS, emit, make_data, seq_data, seq_model, small_mlp, token_loss

import accumcore as ac

N, MICRO, K = 48, 8, 3  # accum_steps: global micro-batches of 8 (4 per worker), windows of 24
BATCH, SPLIT = 24, 5  # micro_batch_size: global batches of 24, each worker's 12 cut 5 + 5 + 2
SEED = 7  # of the data
MODES = ("eager", "function", "graph")
WAYS = {"accum_steps": (MICRO, {"accum_steps": K}),
        "micro_batch_size": (BATCH, {"micro_batch_size": SPLIT})}


def make_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(0.01, global_clipnorm=0.5)


def tokens_data():
    """Masked token sequences (the Embedding case): uneven tokens per worker."""
    return seq_data(N, seed=SEED)


def sharded(x, y, batch: int) -> tf.data.Dataset:
    """Global batches of ``batch``, each split across the workers' replicas (DATA sharding)."""
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)


def train(strategy, x, y, make_model, loss, way: str, mode: str) -> dict:
    batch, given = WAYS[way]
    with strategy.scope():
        model = make_model()
        trainer = ac.AccumTrainer(model, make_optimizer(), loss, **given)
    history = trainer.fit(sharded(x, y, batch), epochs=1, mode=mode, verbose=0)
    return {"weights": model.get_weights(), "counters": history.counters,
            "updates": history.updates, "epoch_weights": history.epoch_weights}


def trainer_case(strategy) -> dict:
    data = {"mlp": (*make_data(N, seed=SEED), small_mlp, LOSS),
            "tokens": (*tokens_data(), seq_model, token_loss())}
    return {f"{case}/{way}/{mode}": train(strategy, *args, way, mode)
            for case, args in data.items() for way in WAYS for mode in MODES}


def keras_fit_case(strategy) -> dict:
    """What Keras's own ``fit`` does here (keras-team/keras#20585): per model and data source,
    the error (its message and the traceback's function names), or None if it trained."""
    keras.config.disable_traceback_filtering()  # the frames name where it fails
    x, y = make_data(N, seed=SEED)
    models = {"keras.Model": lambda: small_mlp(),
              "AccumModel": lambda: small_mlp(model_cls=ac.AccumModel, accum_steps=K),
              "accumulate": lambda: ac.accumulate(small_mlp(), micro_batch_size=SPLIT)}
    out = {}
    for name, make_model in models.items():
        for source in ("arrays", "dataset"):
            with strategy.scope():
                model = make_model()
                model.compile(make_optimizer(), LOSS)
            try:
                if source == "arrays":
                    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
                else:
                    model.fit(sharded(x, y, MICRO), epochs=1, verbose=0)
                out[f"{name}/{source}"] = None
            except Exception as err:  # noqa: BLE001 - reported to the parent
                frames = [frame.name for frame in traceback.extract_tb(err.__traceback__)]
                out[f"{name}/{source}"] = {"error": f"{type(err).__name__}: {err}",
                                           "frames": frames}
    return out


class OutOfMemoryOnWorker0(keras.layers.Layer):
    """Identity that "runs out of memory" on worker 0 only: a ``MemoryError`` in a
    ``py_function`` for more than 3 samples, which reaches the caller as
    ``tf.errors.ResourceExhaustedError`` (as in tests/test_micro_batch_size.py)."""

    def call(self, x):
        limit = 3 if worker_index() == 0 else 10**9

        def check(t):
            if t.shape[0] > limit:
                raise MemoryError(f"injected: {t.shape[0]} samples")
            return t

        out = tf.py_function(check, [x], x.dtype)
        out.set_shape(x.shape)
        return out


def worker_index() -> int:
    """This worker's index in ``TF_CONFIG``."""
    return int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])


def oom_case(strategy) -> dict:
    """``AccumTrainer(micro_batch_size=5)``, function mode, with an out-of-memory error on
    worker 0 only (its micro-batches of 5 do not fit there): the error this worker raises."""
    x, y = make_data(N, seed=SEED)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        hidden = OutOfMemoryOnWorker0()(keras.layers.Dense(16, activation="tanh")(inputs))
        model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))
        trainer = ac.AccumTrainer(model, make_optimizer(), LOSS, micro_batch_size=SPLIT)
    try:
        trainer.fit(sharded(x, y, BATCH), epochs=1, mode="function", verbose=0)
    except Exception as err:  # noqa: BLE001 - reported to the parent
        return {"oom": {"error": f"{type(err).__name__}: {err}"}}
    return {"oom": {"error": None}}


def auto_case(strategy) -> dict:
    """``AccumTrainer(micro_batch_size="auto")``, function mode, each worker's share 12 of the
    global batches of 24; worker 0 "runs out of memory" above 3 samples, worker 1 never. Each
    searches its own device at the first batch; both must train with the smaller b. The model
    is ``small_mlp``'s layers (its initial weights) with the out-of-memory layer between."""
    x, y = make_data(N, seed=SEED)
    with strategy.scope():
        base = small_mlp()
        inputs = keras.Input((8,))
        hidden = OutOfMemoryOnWorker0()(base.layers[1](inputs))
        model = keras.Model(inputs, base.layers[2](hidden))
        trainer = ac.AccumTrainer(model, make_optimizer(), LOSS, micro_batch_size="auto")
    history = trainer.fit(sharded(x, y, BATCH), epochs=1, mode="function", verbose=0)
    return {"auto": {"weights": model.get_weights(), "b": trainer.micro_batch_size,
                     "updates": history.updates}}


def main() -> None:
    case = sys.argv[1] if len(sys.argv) > 1 else "trainer"
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    cases = {"trainer": trainer_case, "keras_fit": keras_fit_case, "oom": oom_case,
             "auto": auto_case}
    emit({"replicas": strategy.num_replicas_in_sync, **cases[case](strategy)})


if __name__ == "__main__":
    main()
