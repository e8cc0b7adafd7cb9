"""Training scenarios for the resume and determinism tests, run in a fresh interpreter.

``tf.config.experimental.enable_op_determinism()`` cannot be switched off again, and with it
every random op needs a seed and some ops raise; enabling it inside the shared pytest process
would change the other test modules. So :func:`results` runs this file once per pytest
session through ``helpers.run_script``: the child enables op determinism, runs every scenario
and emits ``{name: {"runs": {run: [weights]}, "info": {...}}}`` (``helpers.run_cases``: a
scenario that raises is recorded with its traceback). The tests in ``test_resume.py`` and
``test_determinism.py`` only compare the saved results.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from helpers import LOSS, case_result, make_data, run_cases, run_script, small_mlp

HERE = Path(__file__).resolve().parent

# Resume data: 60 samples in micro-batches of 8 -> 8 micro-batches per epoch (7 x 8 + 4), with
# K = 3 the windows of one epoch hold 3, 3 and 2 (ragged) micro-batches.
N, MICRO, K, EPOCHS = 60, 8, 3, 3
TIMEOUT_S = 900  # every scenario in one child: ~45 s of CPU, a shared 2-core machine


class Interrupt(Exception):
    """Raised by a callback to simulate a crash in the middle of training."""


# ------------------------------------------------------------------------------ in-process side
@functools.lru_cache(maxsize=1)
def results() -> dict:
    """Run every scenario once (in a child interpreter) and return their results by name."""
    return run_script(Path(__file__).resolve(), timeout=TIMEOUT_S)


def load(name: str) -> dict:
    """The result of one scenario: ``{"runs": {run: [arrays]}, "info": {...}}`` (raises with
    its traceback if it failed in the child)."""
    return case_result(results(), name)


def weights_of(result: dict, run: str) -> list[np.ndarray]:
    """The weight arrays of one run of a scenario."""
    return result["runs"][run]


# ------------------------------------------------------------------------------ subprocess side
def _data():
    return make_data(N)


def _weights(model) -> list[np.ndarray]:
    return [np.array(w) for w in model.get_weights()]


def _script_seed() -> None:
    """The global seed a training script sets at start, the same in every (re)started run.

    ``seed`` in the builders below only changes the *initial weights* (so that a resumed run
    provably gets its weights from the checkpoint); a seeded ``tf.data`` shuffle also depends
    on the global seed, so it is reset here as a restarted script would set it.
    """
    import keras

    keras.utils.set_random_seed(0)


def _trainer(seed: int = 0, **kwargs):
    import keras

    import accumcore as ac

    model = small_mlp(seed)
    _script_seed()
    how = {} if "micro_batch_size" in kwargs else dict(accum_steps=K)
    return ac.AccumTrainer(model, keras.optimizers.Adam(0.01), LOSS, **how, **kwargs)


def _accum_model(seed: int = 0, run_eagerly: bool = True, **kwargs):
    """A compiled AccumModel. ``run_eagerly=True`` (default here) saves a ~1 s CPU trace per
    model; the resume logic does not depend on it, and ``fit_exact_backup`` (which wraps the
    compiled train function) and the determinism runs use compiled models."""
    import keras

    import accumcore as ac

    how = {} if "micro_batch_size" in kwargs else dict(accum_steps=K)
    model = small_mlp(seed, model_cls=ac.AccumModel, **how, **kwargs)
    _script_seed()
    model.compile(keras.optimizers.Adam(0.01), LOSS, run_eagerly=run_eagerly)
    return model


def _interrupt_at(epoch: int, batch: int):
    """A Keras callback that raises :class:`Interrupt` after batch ``batch`` of ``epoch``."""
    import keras

    class InterruptAt(keras.callbacks.Callback):
        def on_epoch_begin(self, e, logs=None):
            self.epoch = e

        def on_train_batch_end(self, b, logs=None):
            if (self.epoch, b) == (epoch, batch):
                raise Interrupt(f"interrupted after epoch {epoch}, batch {batch}")

    return InterruptAt()


def _state_probe(record: dict):
    """A Keras callback recording the accumulation state when the first epoch of ``fit`` starts
    (that is, after a backup was restored)."""
    import keras

    class Probe(keras.callbacks.Callback):
        # on_epoch_begin: after every callback's on_train_begin (where backups are restored).
        def on_epoch_begin(self, epoch, logs=None):
            if not record:
                record.update(self.model.accumulation.counters(), first_epoch=epoch)

    return Probe()


def _run_interrupted(fn: Callable[[], object]) -> bool:
    try:
        fn()
    except Interrupt:
        return True
    return False


def scenario_loop_function_apply(tmp: Path) -> dict:
    """ResumableLoop, mode="function": crash mid-epoch, mid-window (the 13th micro-batch; the
    last checkpoint holds 12); resume in new objects."""
    return _loop_crash_and_resume(tmp, MICRO, crash_at=(1, 4), save_every=2)


def scenario_loop_function_split(tmp: Path) -> dict:
    """The same with ``micro_batch_size=b``: batches of K * b (24, 24, 12), each one window
    of 3, 3 and 2 micro-batches (seen after each: 3, 6, 8 | 11, 14, 16 | ...); saved every
    5 micro-batches, so after the batches that pass 5, 10, 15, ...: crash after epoch 1's
    second batch (14 seen), whose checkpoint holds 11."""
    return _loop_crash_and_resume(tmp, MICRO * K, crash_at=(1, 1), save_every=5,
                                  micro_batch_size=MICRO)


def _loop_crash_and_resume(tmp: Path, batch_size: int, crash_at: tuple[int, int],
                           save_every: int, **how) -> dict:
    """Plain ``AccumTrainer.fit``, an uninterrupted ``ResumableLoop``, and one crashed at
    ``crash_at`` (epoch, step) then resumed in new objects (other initial weights)."""
    import tensorflow as tf

    from accumcore.checkpointing import ResumableLoop

    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    plain = _trainer(**how)
    plain.fit(ds, epochs=EPOCHS, mode="function", verbose=0)

    loop = ResumableLoop(_trainer(**how), tmp / "straight", save_every=save_every)
    straight = loop.fit(ds, EPOCHS, mode="function")

    def crash(epoch, step):
        if (epoch, step) == crash_at:
            raise Interrupt

    first = ResumableLoop(_trainer(**how), tmp / "ckpt", save_every=save_every)
    interrupted = _run_interrupted(lambda: first.fit(ds, EPOCHS, mode="function",
                                                     on_micro_batch_end=crash))
    latest = first.manager.latest_checkpoint
    restored_micro_step = int(tf.train.load_variable(
        latest, "accumulation/micro_step/.ATTRIBUTES/VARIABLE_VALUE"))
    restored_seen = int(tf.train.load_variable(
        latest, "accumulation/micro_batches_seen/.ATTRIBUTES/VARIABLE_VALUE"))
    # New model (other initial weights), optimizer, trainer and loop: only the files carry over.
    resumed_trainer = _trainer(seed=7, **how)
    initial_resumed = _weights(resumed_trainer.model)
    second = ResumableLoop(resumed_trainer, tmp / "ckpt", save_every=save_every)
    resumed = second.fit(ds, EPOCHS, mode="function")
    return {
        "runs": {"plain": _weights(plain.model), "straight": _weights(loop.trainer.model),
                 "resumed": _weights(resumed_trainer.model),
                 "resumed_initial": initial_resumed},
        "info": {
            "interrupted": interrupted, "resumed_flag": second.resumed,
            "restored_micro_step": restored_micro_step, "restored_seen": restored_seen,
            "straight_epoch_losses": straight.epoch_losses,
            "resumed_epoch_losses": resumed.epoch_losses,
            "straight_updates": straight.updates, "resumed_updates": resumed.updates,
            "straight_window_losses": straight.window_losses,
            "resumed_window_losses": resumed.window_losses,
            "straight_micro_batches_run": len(straight.micro_losses),
            "resumed_micro_batches_run": len(resumed.micro_losses),
            "counters": resumed.counters, "straight_counters": straight.counters,
            "plain_iterations": int(plain.optimizer.iterations.numpy()),
            "resumed_iterations": int(resumed_trainer.optimizer.iterations.numpy()),
        },
    }


def _shuffled_factory(x, y):
    import tensorflow as tf

    def make(epoch: int) -> tf.data.Dataset:
        # The order of epoch e is a function of e alone: exact across restarts.
        return (tf.data.Dataset.from_tensor_slices((x, y))
                .shuffle(N, seed=100 + epoch, reshuffle_each_iteration=False).batch(MICRO))

    return make


def scenario_loop_eager_carry_shuffled(tmp: Path) -> dict:
    """ResumableLoop, eager, end_of_epoch="carry", per-epoch shuffling; two crashes."""
    from accumcore.checkpointing import ResumableLoop

    x, y = _data()
    make = _shuffled_factory(x, y)
    straight_loop = ResumableLoop(_trainer(end_of_epoch="carry"), tmp / "straight",
                                  save_every=3)
    straight = straight_loop.fit(make, EPOCHS, mode="eager")
    crashes = [(0, 5), (2, 1)]
    interrupted = []
    restored = []
    for seed, at in zip((0, 4), crashes):  # the first run starts like `straight`
        loop = ResumableLoop(_trainer(seed=seed, end_of_epoch="carry"), tmp / "ckpt",
                             save_every=3)

        def crash(epoch, step, at=at):
            if (epoch, step) == at:
                raise Interrupt

        interrupted.append(_run_interrupted(lambda loop=loop, crash=crash: loop.fit(
            make, EPOCHS, mode="eager", on_micro_batch_end=crash)))
        restored.append(loop.trainer.state.counters()["micro_step"])
    final = ResumableLoop(_trainer(seed=9, end_of_epoch="carry"), tmp / "ckpt", save_every=3)
    resumed = final.fit(make, EPOCHS, mode="eager")
    return {
        "runs": {"straight": _weights(straight_loop.trainer.model),
                 "resumed": _weights(final.trainer.model)},
        "info": {"interrupted": interrupted, "resumed_flag": final.resumed,
                 "straight_epoch_losses": straight.epoch_losses,
                 "resumed_epoch_losses": resumed.epoch_losses,
                 "straight_counters": straight.counters, "counters": resumed.counters},
    }


def scenario_loop_reshuffle_each_iteration(tmp: Path) -> dict:
    """One dataset reshuffled every epoch (seeded), rebuilt as a restarted process would;
    crash in epoch 1, so epoch 2's order must come from the restored iterator state."""
    import tensorflow as tf

    from accumcore.checkpointing import ResumableLoop

    x, y = _data()

    def dataset():  # a new object, as a restarted process would build it
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(N, seed=5).batch(MICRO)

    straight_loop = ResumableLoop(_trainer(), tmp / "straight", save_every=2)
    straight_loop.fit(dataset(), EPOCHS, mode="eager")

    def crash(epoch, step):
        if (epoch, step) == (1, 4):
            raise Interrupt

    first = ResumableLoop(_trainer(), tmp / "ckpt", save_every=2)
    interrupted = _run_interrupted(
        lambda: first.fit(dataset(), EPOCHS, mode="eager", on_micro_batch_end=crash))
    restored_epoch = int(tf.train.load_variable(first.manager.latest_checkpoint,
                                                "epoch/.ATTRIBUTES/VARIABLE_VALUE"))
    second = ResumableLoop(_trainer(seed=7), tmp / "ckpt", save_every=2)
    second.fit(dataset(), EPOCHS, mode="eager")
    return {
        "runs": {"straight": _weights(straight_loop.trainer.model),
                 "resumed": _weights(second.trainer.model)},
        "info": {"interrupted": interrupted, "restored_epoch": restored_epoch,
                 "counters": second.trainer.state.counters()},
    }


def scenario_fit_keras_backup_epoch_carry(tmp: Path) -> dict:
    """AccumModel.fit + keras.callbacks.BackupAndRestore(save_freq="epoch"), carry policy:
    crash mid-epoch and mid-window; the epoch-end backup holds a half-full window."""
    import keras

    x, y = _data()
    kw = dict(batch_size=MICRO, epochs=EPOCHS, shuffle=False, verbose=0)
    straight = _accum_model(end_of_epoch="carry")
    straight.fit(x, y, **kw)
    first = _accum_model(end_of_epoch="carry")
    interrupted = _run_interrupted(lambda: first.fit(x, y, callbacks=[
        keras.callbacks.BackupAndRestore(str(tmp / "backup")), _interrupt_at(1, 4)], **kw))
    restored: dict = {}
    resumed = _accum_model(seed=7, end_of_epoch="carry")
    history = resumed.fit(x, y, callbacks=[
        keras.callbacks.BackupAndRestore(str(tmp / "backup")), _state_probe(restored)], **kw)
    return {
        "runs": {"straight": _weights(straight), "resumed": _weights(resumed)},
        "info": {"interrupted": interrupted, "restored": restored,
                 "resumed_epochs_run": len(history.history["loss"]),
                 "straight_counters": straight.accumulation.counters(),
                 "counters": resumed.accumulation.counters()},
    }


def _two_crashes_then_resume(tmp: Path, batch_size: int, crashes: tuple, save_freq: int,
                             **settings) -> tuple:
    """The fit_exact_backup scenarios' runs: ``straight``, one ``AccumModel`` (``settings``)
    trained without a crash; then ``fit_resumable(save_freq=...)`` runs from other seeds, each
    crashed at its ``(epoch, batch)`` of ``crashes`` (the first starts like ``straight``), and
    one resumed to the end. Returns ``(straight, resumed, info)``."""
    from accumcore.checkpointing import fit_resumable

    x, y = _data()
    kw = dict(batch_size=batch_size, epochs=EPOCHS, shuffle=False, verbose=0)
    straight = _accum_model(run_eagerly=False, **settings)
    straight.fit(x, y, **kw)
    backup = str(tmp / "backup")
    interrupted, restored = [], []
    for seed, at in zip((0, 4), crashes, strict=True):
        model = _accum_model(seed=seed, run_eagerly=False, **settings)
        record: dict = {}
        interrupted.append(_run_interrupted(lambda model=model, at=at, record=record: (
            fit_resumable(model, x, y, backup_dir=backup, save_freq=save_freq,
                          callbacks=[_interrupt_at(*at), _state_probe(record)], **kw))))
        restored.append(record)
        with open(os.path.join(backup, "accumcore_backup.json")) as f:
            restored.append(json.load(f))
    record = {}
    resumed = _accum_model(seed=5, run_eagerly=False, **settings)
    fit_resumable(resumed, x, y, backup_dir=backup, save_freq=save_freq,
                  callbacks=[_state_probe(record)], **kw)
    restored.append(record)
    info = {"interrupted": interrupted, "restored": restored,
            "backup_deleted": not os.path.exists(backup),
            "straight_counters": straight.accumulation.counters(),
            "counters": resumed.accumulation.counters(),
            "straight_iterations": int(straight.optimizer.iterations.numpy()),
            "resumed_iterations": int(resumed.optimizer.iterations.numpy())}
    return straight, resumed, info


def scenario_fit_exact_backup(tmp: Path) -> dict:
    """AccumModel.fit + accumcore's ExactBackupAndRestore(save_freq=2): two mid-window crashes,
    the second one in the epoch resumed by the first."""
    straight, resumed, info = _two_crashes_then_resume(tmp, MICRO, ((1, 4), (2, 2)), 2)
    return {"runs": {"straight": _weights(straight), "resumed": _weights(resumed)},
            "info": info}


def scenario_fit_exact_backup_split(tmp: Path) -> dict:
    """The same with ``micro_batch_size=b`` at ``fit(batch_size=K * b)``: batches of 24, 24, 12
    (the windows of the ``accum_steps`` runs), ExactBackupAndRestore(save_freq=1); crash in
    epoch 1 after its batch 1 (the backup holds batch 0: the crash comes before its save),
    resume, crash at epoch 2's first batch (the backup holds epoch 1), resume to the end."""
    straight, resumed, info = _two_crashes_then_resume(
        tmp, MICRO * K, ((1, 1), (2, 0)), 1, micro_batch_size=MICRO)
    return {"runs": {"straight": _weights(straight), "resumed": _weights(resumed),
                     "resumed_initial": _weights(_accum_model(seed=5, micro_batch_size=MICRO))},
            "info": info}


def scenario_fit_keras_backup_int_replays(tmp: Path) -> dict:
    """What Keras's own BackupAndRestore(save_freq=2) (3.13, 3.15) does after a mid-epoch crash: it
    restores the mid-epoch weights and replays the epoch from its first batch."""
    import keras

    x, y = _data()
    kw = dict(batch_size=MICRO, epochs=EPOCHS, shuffle=False, verbose=0)
    straight = _accum_model()
    straight.fit(x, y, **kw)
    first = _accum_model()
    interrupted = _run_interrupted(lambda: first.fit(x, y, callbacks=[
        keras.callbacks.BackupAndRestore(str(tmp / "backup"), save_freq=2),
        _interrupt_at(1, 4)], **kw))
    resumed = _accum_model(seed=7)
    resumed.fit(x, y, callbacks=[
        keras.callbacks.BackupAndRestore(str(tmp / "backup"), save_freq=2)], **kw)
    return {
        "runs": {"straight": _weights(straight), "resumed": _weights(resumed)},
        "info": {"interrupted": interrupted,
                 "straight_counters": straight.accumulation.counters(),
                 "counters": resumed.accumulation.counters()},
    }


def scenario_fit_model_checkpoint_keras(tmp: Path) -> dict:
    """ModelCheckpoint writes .keras files (epoch-end and every 3 batches); reload with
    keras.models.load_model and continue: from the epoch-end file with initial_epoch, and from
    a mid-epoch file with initial_epoch + SkipTrainedBatches."""
    import re

    import keras

    from accumcore.checkpointing import SkipTrainedBatches

    x, y = _data()
    kw = dict(batch_size=MICRO, epochs=EPOCHS, shuffle=False, verbose=0)
    straight = _accum_model(end_of_epoch="carry")
    straight.fit(x, y, **kw)
    first = _accum_model(end_of_epoch="carry")
    epoch_file = str(tmp / "epoch.keras")
    interrupted = _run_interrupted(lambda: first.fit(x, y, callbacks=[
        keras.callbacks.ModelCheckpoint(epoch_file, save_freq="epoch"),
        keras.callbacks.ModelCheckpoint(str(tmp / "mid-{epoch:02d}-{batch:03d}.keras"),
                                        save_freq=3),
        _interrupt_at(2, 4)], **kw))
    # From the epoch-end file: epochs 0 and 1 are done.
    from_epoch = keras.models.load_model(epoch_file)
    restored_epoch = from_epoch.accumulation.counters()
    from_epoch.fit(x, y, initial_epoch=2, **kw)
    # From the newest mid-epoch file: the name holds epoch + 1 and the batches done.
    found = sorted(
        (int(m.group(1)), int(m.group(2)), p) for p in tmp.glob("mid-*.keras")
        if (m := re.fullmatch(r"mid-(\d+)-(\d+)\.keras", p.name))
    )
    epoch_1based, batches_done, path = found[-1]
    from_mid = keras.models.load_model(str(path))
    restored_mid = from_mid.accumulation.counters()
    skip = SkipTrainedBatches(batches_done)
    from_mid.fit(x, y, initial_epoch=epoch_1based - 1, callbacks=[skip], **kw)
    return {
        "runs": {"straight": _weights(straight), "from_epoch": _weights(from_epoch),
                 "from_mid": _weights(from_mid)},
        "info": {"interrupted": interrupted, "restored_epoch": restored_epoch,
                 "restored_mid": restored_mid, "mid_file": path.name,
                 "skipped": skip.skipped,
                 "straight_counters": straight.accumulation.counters(),
                 "from_epoch_counters": from_epoch.accumulation.counters(),
                 "from_mid_counters": from_mid.accumulation.counters()},
    }


# ------------------------------------------------------------------------------ determinism
DET_N, DET_MICRO, DET_K, DET_EPOCHS = 72, 16, 2, 2  # 4 x 16 + 8: windows of 2, 2, 1
ENTRY_POINTS = ("eager", "function", "graph", "window_step", "fit", "resumable")


def _mnist_subset():
    from accumcore.lab.data import load_mnist, preprocess

    data = load_mnist(verbose=False)
    return preprocess(data.x_train[:DET_N]), data.y_train[:DET_N].astype("int32")


def _dropout_mlp(seed: int, model_cls=None, **kwargs):
    """784-32-dropout-10: dropout makes training depend on the seed, not only the init."""
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((784,))
    h = keras.layers.Dense(32, activation="relu")(inputs)
    h = keras.layers.Dropout(0.3)(h)
    outputs = keras.layers.Dense(10, activation="softmax")(h)
    return (model_cls or keras.Model)(inputs, outputs, **kwargs)


def train_entry_point(entry: str, seed: int, x, y, tmp: Path | None = None,
                      initial: list | None = None) -> list[np.ndarray]:
    """Train with ``entry`` from ``set_random_seed(seed)``: init, dropout, shuffling all seeded.

    Returns the final weights; appends the initial ones to ``initial`` if given."""
    import keras
    import tensorflow as tf

    import accumcore as ac
    from accumcore.checkpointing import ResumableLoop

    if entry == "fit":
        model = _dropout_mlp(seed, ac.AccumModel, accum_steps=DET_K)
        if initial is not None:
            initial.extend(_weights(model))
        model.compile(keras.optimizers.Adam(1e-3), LOSS)
        model.fit(x, y, batch_size=DET_MICRO, epochs=DET_EPOCHS, shuffle=True, verbose=0)
        return _weights(model)
    model = _dropout_mlp(seed)
    if initial is not None:
        initial.extend(_weights(model))
    trainer = ac.AccumTrainer(model, keras.optimizers.Adam(1e-3), LOSS, accum_steps=DET_K)
    shuffled = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(DET_N, seed=seed)
    ds = shuffled.batch(DET_MICRO)
    if entry == "window_step":  # one large batch of K micro-batches per call
        for _ in range(DET_EPOCHS):
            for xb, yb in shuffled.batch(DET_MICRO * DET_K):
                trainer.window_step(xb, yb)
    elif entry == "resumable":
        loop = ResumableLoop(trainer, tmp, save_every=3)
        loop.fit(ds, DET_EPOCHS, mode="function")
    else:
        trainer.fit(ds, epochs=DET_EPOCHS, mode=entry, verbose=0)
    return _weights(model)


#: Entry points also trained from another seed (a guard that the seed reaches the run; one
#: per family keeps the runner's CPU time down: each run costs a trace of ~1-3 s).
OTHER_SEED_ENTRIES = ("function", "fit")


def scenario_determinism(tmp: Path) -> dict:
    """Every entry point twice with seed 0 (and its initial weights); some once with seed 1."""
    x, y = _mnist_subset()
    runs = {}
    for entry in ENTRY_POINTS:
        initial: list = []
        runs[f"{entry}.a"] = train_entry_point(entry, 0, x, y, tmp / f"{entry}a", initial)
        runs[f"{entry}.initial"] = initial
        runs[f"{entry}.b"] = train_entry_point(entry, 0, x, y, tmp / f"{entry}b")
        if entry in OTHER_SEED_ENTRIES:
            runs[f"{entry}.other_seed"] = train_entry_point(entry, 1, x, y, tmp / f"{entry}o")
    return {"runs": runs, "info": {"entries": list(ENTRY_POINTS)}}


SCENARIOS: dict[str, Callable[[Path], dict]] = {
    name[len("scenario_"):]: fn for name, fn in list(globals().items())
    if name.startswith("scenario_") and callable(fn)
}


def _in_temp_dir(fn: Callable[[Path], dict]) -> Callable[[], dict]:
    """The scenario ``fn`` run in a fresh temporary directory (removed after), its CPU seconds
    added to its info."""

    def run() -> dict:
        tmp = Path(tempfile.mkdtemp(prefix=f"{fn.__name__}-"))
        start = time.process_time()
        try:
            result = fn(tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        result["info"]["cpu_seconds"] = round(time.process_time() - start, 2)
        return result

    return run


def main(names: list[str]) -> None:
    """Enable op determinism, run the named scenarios (all if none), emit their results."""
    shared_mnist = HERE.parent.parent / "shared" / "data" / "mnist.npz"  # as scripts/setup.sh
    if "ACCUMCORE_MNIST_PATH" not in os.environ and shared_mnist.is_file():
        os.environ["ACCUMCORE_MNIST_PATH"] = str(shared_mnist)
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()
    run_cases({name: _in_temp_dir(fn) for name, fn in SCENARIOS.items()}, names)


if __name__ == "__main__":
    main(sys.argv[1:])
