"""Files written by earlier code still load and resume their half-full window exactly: a
``.keras`` file and a ``tf.train.Checkpoint``.

The fixtures come from ``tests/saved_fixtures.py`` run with that code: ``tests/data`` with
accumcore 0.1.0 of 2026-12-02 (commit 9e91682, before the state was split into pieces),
``tests/data/before_settings`` with the code of 2026-12-05 (commit 7c791d4, before the settings
and the rule were resolved in one place and the modules regrouped). The expected weights are
that code's own continuation, so a change in what the saved variables mean (not only in their
names) fails here.
"""

import json
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from saved_fixtures import data, model

import accumcore

DATA = Path(__file__).parent / "data"
#: Each folder of fixtures, by the code that wrote it.
WRITERS = {"0.1.0 (9e91682)": DATA, "before the one-place settings (7c791d4)":
           DATA / "before_settings"}
# float32 round-off of two SGD steps on a 4 x 3 layer: the same arithmetic, so 1e-6 is loose.
TOL = 1e-6


def _continue_and_check(m: accumcore.AccumModel, folder: Path) -> None:
    counters = json.loads((folder / "v0_1_0_counters.json").read_text())
    assert m.accumulation.counters() == counters["saved"]
    x, y = data()
    for i in (24, 28):
        m.train_on_batch(x[i:i + 4], y[i:i + 4])
    expected = np.load(folder / "v0_1_0_expected.npz")
    for w, name in zip(m.trainable_weights, sorted(expected.files, key=lambda f: int(f[4:]))):
        np.testing.assert_allclose(w.numpy(), expected[name], rtol=0, atol=TOL)
    assert m.accumulation.counters() == counters["after"]


# Keras itself cannot read a .keras file written by a newer Keras (3.10 refuses 3.15's Dense
# config, `quantization_config`): that is Keras's format, not accumcore's state.
WRITTEN_WITH = (3, 15)


@pytest.mark.skipif(tuple(int(p) for p in keras.version().split(".")[:2]) < WRITTEN_WITH,
                    reason="a .keras file written by Keras 3.15 needs Keras >= 3.15 to load")
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_keras_file_resumes_its_window(writer):
    m = keras.models.load_model(WRITERS[writer] / "v0_1_0_midwindow.keras")
    assert isinstance(m, accumcore.AccumModel)
    assert m.accumulation.pending_micro_batches() == 2
    _continue_and_check(m, WRITERS[writer])


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_checkpoint_resumes_its_window(writer):
    m = model()
    x, y = data()
    m.train_on_batch(x[:4], y[:4])  # builds optimizer and state (then overwritten)
    tf.train.Checkpoint(model=m).read(str(WRITERS[writer] / "v0_1_0_checkpoint" / "ckpt")) \
        .assert_existing_objects_matched()
    assert m.accumulation.pending_micro_batches() == 2
    _continue_and_check(m, WRITERS[writer])
