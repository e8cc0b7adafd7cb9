"""The order in which Keras's own ``model.fit(x, y, shuffle=True)`` feeds arrays after
``keras.utils.set_random_seed``: what an exact resume of ``fit`` (``fit_resumable``,
``ExactBackupAndRestore``) relies on, pinned on the installed Keras.

Measured on Keras 3.13.2 (TensorFlow 2.20) and 3.15.1 (TensorFlow 2.21): after
``set_random_seed(s)`` every epoch gets the *same* permutation, a run started at
``initial_epoch=1`` (a restarted process) sees the batches the uninterrupted run saw from its
second epoch on, and so does a new interpreter. If a Keras upgrade reshuffles per epoch, these
tests fail, and the checkpointing docs and the resume guide must say so for that version.
Keras's own ``BackupAndRestore(save_freq=N)`` replays an interrupted epoch from its first batch
(both versions).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

N, BATCH, EPOCHS = 24, 4, 3  # 6 batches per epoch
BATCHES = N // BATCH


class _Recorder(keras.Model):
    """A model whose ``train_step`` records the sample ids (``x[:, 0]``) of every batch."""

    seen: list[list[int]] = []

    def train_step(self, data):
        _Recorder.seen.append([int(v) for v in np.asarray(data[0])[:, 0]])
        return super().train_step(data)


class _Crash(Exception):
    pass


class _CrashAfter(keras.callbacks.Callback):
    """Raises ``_Crash`` after batch ``at[1]`` of epoch ``at[0]`` (both from 0)."""

    def __init__(self, at: tuple[int, int]):
        super().__init__()
        self.at, self.epoch = at, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise _Crash


def fit_orders(seed: int, initial_epoch: int = 0, callbacks=()) -> list[list[int]]:
    """The sample ids of every batch ``fit(shuffle=True)`` trains on, in order, after
    ``keras.utils.set_random_seed(seed)``: epochs ``initial_epoch`` to ``EPOCHS - 1``, each
    ``BATCHES`` batches of ``BATCH`` ids (0 to ``N - 1``); up to the crash if a callback
    raises ``_Crash``."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((1,))
    model = _Recorder(inputs, keras.layers.Dense(1)(inputs))
    model.compile("sgd", "mse", run_eagerly=True)  # train_step in Python: it can record
    _Recorder.seen = []
    x = np.arange(N, dtype="float32")[:, None]
    try:
        model.fit(x, np.zeros((N, 1), "float32"), batch_size=BATCH, epochs=EPOCHS,
                  initial_epoch=initial_epoch, shuffle=True, verbose=0, callbacks=list(callbacks))
    except _Crash:
        pass
    return _Recorder.seen


def _epochs(batches: list[list[int]]) -> list[list[int]]:
    return [sum(batches[i:i + BATCHES], []) for i in range(0, len(batches), BATCHES)]


def test_fit_shuffle_repeats_one_permutation_every_epoch_after_set_random_seed():
    """Catches: Keras drawing a new order per epoch (a restarted process, which starts at
    ``initial_epoch``, would then see another order than the uninterrupted run)."""
    epochs = _epochs(fit_orders(seed=3))
    assert len(epochs) == EPOCHS
    for order in epochs:
        assert sorted(order) == list(range(N))  # every sample once per epoch
    assert epochs[0] != list(range(N)), "fit did not shuffle"
    assert epochs[1] == epochs[0] and epochs[2] == epochs[0]
    assert _epochs(fit_orders(seed=4))[0] != epochs[0], "the seed does not reach the order"


def test_fit_shuffle_from_initial_epoch_sees_the_uninterrupted_batches():
    """What ``fit_resumable`` does after a crash: the same seed, ``initial_epoch`` set.
    Catches: the epochs after a resume getting other batches than without the crash."""
    straight = fit_orders(seed=3)
    assert fit_orders(seed=3, initial_epoch=1) == straight[BATCHES:]


def test_keras_backup_and_restore_replays_the_interrupted_epoch_from_its_first_batch(tmp_path):
    """Keras's own ``BackupAndRestore(save_freq=2)`` after a crash after batch 4 of epoch 2
    (backup after batch 4): the run again trains epoch 2 from its first batch (measured on
    Keras 3.13.2 and 3.15.1), so batches 1 to 4 are trained twice. Catches: a Keras that skips
    the batches its backup holds (then the docs' warning about it must change)."""
    straight = fit_orders(seed=3)
    backup = str(tmp_path / "backup")
    crashed = fit_orders(seed=3, callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=2),
                                            _CrashAfter((1, 3))])
    assert len(crashed) == BATCHES + 4, "the crash did not come after batch 4 of epoch 2"
    again = fit_orders(seed=3, callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=2)])
    assert again == straight[BATCHES:]  # epoch 2 whole, then epoch 3


@pytest.mark.slow
def test_fit_shuffle_order_is_the_same_in_a_new_interpreter():
    """Catches: an order that depends on the process (not only on the seed)."""
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(here), str(here.parent), os.environ.get("PYTHONPATH", "")]),
        TF_CPP_MIN_LOG_LEVEL="2")
    code = "import json, test_keras_fit_order as t; print(json.dumps(t.fit_orders(3)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == fit_orders(seed=3)
