"""Writes the saved-state fixtures of ``tests/test_saved_formats.py`` (run once, with the code
whose formats must stay readable: accumcore 0.1.0 as of 2026-12-02, commit 9e91682).

    python tests/saved_fixtures.py tests/data

An AccumModel (4 -> Dense(3), K = 4, SGD(0.1)) trains 6 micro-batches of 4 samples (one window
applied, 2 micro-batches pending, `end_of_epoch="carry"`), then is saved as a `.keras` file and a
`tf.train.Checkpoint`; it then trains the next 2 micro-batches (closing the window) and the
expected weights and counters are written to `v0_1_0_expected.npz`.
"""

import json
import sys
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import accumcore


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 4)).astype("float32"), rng.integers(0, 3, 32).astype("int32")


def model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    m = accumcore.AccumModel(inputs, keras.layers.Dense(3)(inputs), accum_steps=4,
                             end_of_epoch="carry")
    m.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    return m


if __name__ == "__main__":
    out = Path(sys.argv[1])
    x, y = data()
    m = model()
    m.fit(x[:24], y[:24], batch_size=4, epochs=1, shuffle=False, verbose=0)
    m.save(out / "v0_1_0_midwindow.keras")
    tf.train.Checkpoint(model=m).write(str(out / "v0_1_0_checkpoint" / "ckpt"))
    saved_counters = m.accumulation.counters()
    for i in (24, 28):
        m.train_on_batch(x[i:i + 4], y[i:i + 4])
    np.savez(out / "v0_1_0_expected.npz", *[w.numpy() for w in m.trainable_weights])
    (out / "v0_1_0_counters.json").write_text(json.dumps(
        {"saved": saved_counters, "after": m.accumulation.counters()}, indent=1) + "\n")
