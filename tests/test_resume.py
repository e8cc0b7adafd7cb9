"""Resume exactly: an interrupted run, resumed from its checkpoint, ends bit-identical.

Each scenario runs in a fresh interpreter with ``enable_op_determinism()`` (see
``reliability_scenarios.py``). Data: 60 samples in micro-batches of 8 (7 x 8 + 4) with K = 3,
so an epoch's windows hold 3, 3 and 2 micro-batches; Adam, whose moments and step counter
must be restored too. Every interruption is an exception raised from a callback, and every
resumed run uses *new* model, optimizer and trainer objects built from another seed, so only
what the checkpoint holds can make it match.

What each test would catch is said in its docstring.
"""

from __future__ import annotations

import pytest
from helpers import bitwise_equal
from reliability_scenarios import load, weights_of

# The scenario subprocess (shared with test_determinism.py) takes ~45 s of CPU: deselected by
# `-k "not slow"`, always run by CI (`pytest tests`).
pytestmark = pytest.mark.slow


def _check_interrupted(info: dict) -> None:
    flags = info["interrupted"]
    flags = flags if isinstance(flags, list) else [flags]
    assert flags and all(flags), f"the simulated crash did not happen: {flags}"


def test_custom_loop_resumes_mid_window_bitwise():
    """ResumableLoop (mode="function", CheckpointManager with model, optimizer, accumulation
    state and tf.data iterator), crash in epoch 1 after its 5th micro-batch; the last
    checkpoint holds 12 micro-batches, one of them in a pending window.

    Catches: accumulators or window weight not checkpointed (pending micro-batch lost),
    iterator position not restored (micro-batches replayed or skipped), optimizer moments or
    iterations not restored, epoch counter or history sums wrong after the resume."""
    r = load("loop_function_apply")
    info = r["info"]
    _check_interrupted(info)
    assert info["resumed_flag"]
    assert info["restored_seen"] == 12, "checkpoint should hold 12 micro-batches"
    assert info["restored_micro_step"] == 1, "the checkpoint must be taken mid-window"
    straight, resumed = weights_of(r, "straight"), weights_of(r, "resumed")
    assert not bitwise_equal(weights_of(r, "resumed_initial"), straight)  # restore did the work
    assert bitwise_equal(resumed, straight)
    # ...and the checkpointing loop itself equals the library's plain AccumTrainer.fit.
    assert bitwise_equal(weights_of(r, "plain"), straight)
    assert info["resumed_iterations"] == info["plain_iterations"] == 9
    assert info["counters"] == info["straight_counters"]
    assert info["resumed_micro_batches_run"] == 24 - 12  # nothing replayed, nothing skipped
    # The history of the resumed epochs (1 and 2) matches the uninterrupted one exactly.
    assert info["resumed_updates"] == info["straight_updates"][1:]
    assert info["resumed_epoch_losses"] == info["straight_epoch_losses"][1:]
    n = len(info["resumed_window_losses"])
    assert info["resumed_window_losses"] == info["straight_window_losses"][-n:]


def test_custom_loop_in_split_mode_resumes_bitwise():
    """ResumableLoop over an ``AccumTrainer(micro_batch_size=8)`` fed batches of 24: crash after
    epoch 1's second batch; the last checkpoint (every 5 micro-batches: after the batch that
    passed 10) holds epoch 1's first batch.

    Catches: a split batch's micro-batches counted as one (the cadence), a batch replayed or
    skipped on resume, any of the state that the accum_steps loop restores missing here."""
    r = load("loop_function_split")
    info = r["info"]
    _check_interrupted(info)
    assert info["resumed_flag"]
    assert info["restored_seen"] == 11, "the checkpoint should hold 3 + 3 + 2 + 3 micro-batches"
    assert info["restored_micro_step"] == 0  # a split batch is a whole window
    straight = weights_of(r, "straight")
    assert not bitwise_equal(weights_of(r, "resumed_initial"), straight)
    assert bitwise_equal(weights_of(r, "resumed"), straight)
    assert bitwise_equal(weights_of(r, "plain"), straight)
    assert info["resumed_iterations"] == info["plain_iterations"] == 9  # 3 batches x 3 epochs
    assert info["counters"] == info["straight_counters"]
    assert info["straight_micro_batches_run"] == 9  # one record per batch
    assert info["resumed_micro_batches_run"] == 9 - 4  # epoch 0 and epoch 1's first batch
    assert info["resumed_updates"] == info["straight_updates"][1:]
    assert info["resumed_epoch_losses"] == info["straight_epoch_losses"][1:]


def test_custom_loop_eager_carry_with_per_epoch_shuffle_survives_two_crashes():
    """Eager mode, end_of_epoch="carry" (windows span epochs), a dataset reshuffled per
    epoch by a callable ``epoch -> dataset``; crashes in epoch 0 and in epoch 2, each resumed.

    Catches: a carried half-window lost at a resume, a shuffle buffer or per-epoch order not
    restored, the epoch counter not restored (wrong epoch's order)."""
    r = load("loop_eager_carry_shuffled")
    info = r["info"]
    _check_interrupted(info)
    assert info["resumed_flag"]
    assert bitwise_equal(weights_of(r, "resumed"), weights_of(r, "straight"))
    assert info["counters"] == info["straight_counters"]
    assert info["counters"]["samples_seen"] == 60 * 3
    assert info["resumed_epoch_losses"] == info["straight_epoch_losses"][-1:]


def test_reshuffled_dataset_resumes_exactly_with_a_checkpointed_iterator():
    """One dataset object with ``shuffle(N, seed=5)`` (reshuffled every epoch), rebuilt in the
    "restarted process", crash in epoch 1. The iterator checkpoint restores the shuffle's
    seed-generator state too, so epoch 2 gets the same order as without the crash.

    Catches: the loop iterating a fresh dataset per epoch, or a TensorFlow change that stops
    checkpointing the reshuffle state (then the docs in accumcore.checkpointing are wrong)."""
    r = load("loop_reshuffle_each_iteration")
    _check_interrupted(r["info"])
    assert r["info"]["restored_epoch"] == 1
    assert bitwise_equal(weights_of(r, "resumed"), weights_of(r, "straight"))
    assert r["info"]["counters"]["samples_seen"] == 60 * 3
    assert r["info"]["counters"]["windows_applied"] == 9


def test_fit_keras_backup_and_restore_at_epoch_end_resumes_a_carried_window_exactly():
    """AccumModel.fit + keras.callbacks.BackupAndRestore(save_freq="epoch") with
    end_of_epoch="carry", crash mid-epoch and mid-window in epoch 1. The backup of epoch 0's
    end holds a half-full window (2 micro-batches) in the weights file.

    Catches: AccumModel.save_weights not saving the accumulators/counters, a pending window
    flushed or dropped at the backup, Keras not restarting at the right epoch."""
    r = load("fit_keras_backup_epoch_carry")
    info = r["info"]
    _check_interrupted(info)
    assert info["restored"]["first_epoch"] == 1
    assert info["restored"]["micro_batches_seen"] == 8
    assert info["restored"]["micro_step"] == 2, "the backup must hold a half-full window"
    assert info["resumed_epochs_run"] == 2
    assert bitwise_equal(weights_of(r, "resumed"), weights_of(r, "straight"))
    assert info["counters"] == info["straight_counters"]


def test_fit_exact_backup_and_restore_mid_epoch_two_crashes():
    """AccumModel.fit through accumcore's fit_resumable / ExactBackupAndRestore(save_freq=2):
    crash in epoch 1 (backup: 4 of its batches, one pending micro-batch), resume, crash again
    in epoch 2 (backup: 2 batches, two pending), resume to the end.

    Catches: batches already in the backup trained again (Keras' own behaviour, see the next
    test), skipped batches not read from the data (the later ones shift), the epoch or batch
    position recorded wrongly after a resume, the backup not deleted at the end."""
    r = load("fit_exact_backup")
    info = r["info"]
    _check_interrupted(info)
    start1, meta1, start2, meta2, start3 = info["restored"]
    assert start1["micro_batches_seen"] == 0 and start1["first_epoch"] == 0
    assert (meta1["epoch"], meta1["batches_done"]) == (1, 4)
    assert start2["first_epoch"] == 1 and start2["micro_batches_seen"] == 12
    assert start2["micro_step"] == 1, "first backup must be mid-window"
    assert (meta2["epoch"], meta2["batches_done"]) == (2, 2)
    assert start3["first_epoch"] == 2 and start3["micro_batches_seen"] == 18
    assert start3["micro_step"] == 2, "second backup must be mid-window"
    assert bitwise_equal(weights_of(r, "resumed"), weights_of(r, "straight"))
    assert info["counters"] == info["straight_counters"]
    assert info["counters"]["samples_seen"] == 60 * 3
    assert info["resumed_iterations"] == info["straight_iterations"] == 9
    assert info["backup_deleted"]


def test_fit_exact_backup_and_restore_in_split_mode_two_crashes():
    """``fit_exact_backup`` with ``micro_batch_size``: every window is one batch of 24 (the last
    of an epoch 12), so each backup falls between windows; the resumed run ends bit-identical.

    Catches: a batch in the backup trained again or skipped, the optimizer state or step
    count not restored, the split setting lost by the resume."""
    r = load("fit_exact_backup_split")
    info = r["info"]
    _check_interrupted(info)
    start1, meta1, start2, meta2, start3 = info["restored"]
    assert start1["micro_batches_seen"] == 0 and start1["first_epoch"] == 0
    # The interrupting callback runs before the backup's: the backup holds batch 0 of epoch 1.
    assert (meta1["epoch"], meta1["batches_done"]) == (1, 1)
    assert start2["first_epoch"] == 1 and start2["samples_seen"] == 60 + 24
    # The second crash comes at epoch 2's first batch: the backup holds all of epoch 1.
    assert (meta2["epoch"], meta2["batches_done"]) == (1, 3)
    assert start3["first_epoch"] == 1 and start3["samples_seen"] == 60 + 60
    assert start2["micro_step"] == start3["micro_step"] == 0  # no window spans two steps
    assert not bitwise_equal(weights_of(r, "resumed_initial"), weights_of(r, "straight"))
    assert bitwise_equal(weights_of(r, "resumed"), weights_of(r, "straight"))
    assert info["counters"] == info["straight_counters"]
    assert info["resumed_iterations"] == info["straight_iterations"] == 9
    assert info["backup_deleted"]


def test_keras_backup_and_restore_with_integer_save_freq_retrains_seen_batches():
    """What Keras's BackupAndRestore(save_freq=2) (3.13, 3.15) does: the mid-epoch backup (epoch 1,
    4 batches) is restored, then epoch 1 is replayed from its first batch, so 4 micro-batches
    (32 samples) are trained twice and the weights differ from the uninterrupted run. This
    is why accumcore ships ExactBackupAndRestore.

    Catches: the README's statement about Keras becoming wrong (e.g. a Keras upgrade that
    skips seen batches: then the README table and checkpointing docs must be updated)."""
    r = load("fit_keras_backup_int_replays")
    info = r["info"]
    _check_interrupted(info)
    assert info["counters"]["micro_batches_seen"] == 24 + 4
    assert info["counters"]["samples_seen"] == 180 + 32
    assert not bitwise_equal(weights_of(r, "resumed"), weights_of(r, "straight"))


def test_model_checkpoint_keras_file_reload_resumes_exactly():
    """ModelCheckpoint writes ``.keras`` files at epoch ends and every 3 batches
    (end_of_epoch="carry"); crash in epoch 2. Reload with keras.models.load_model and
    continue: from the epoch-end file with ``initial_epoch=2``, and from the newest mid-epoch
    file with ``initial_epoch`` + ``SkipTrainedBatches(batches in the file)``.

    Catches: the .keras format losing the accumulation state, the optimizer state or the
    accumcore settings; SkipTrainedBatches skipping the wrong number of batches."""
    r = load("fit_model_checkpoint_keras")
    info = r["info"]
    _check_interrupted(info)
    assert info["restored_epoch"]["micro_batches_seen"] == 16
    assert info["restored_epoch"]["micro_step"] == 1, "epoch-end file must hold a carried window"
    assert info["skipped"] > 0
    assert info["restored_mid"]["micro_batches_seen"] == 16 + info["skipped"]
    straight = weights_of(r, "straight")
    assert bitwise_equal(weights_of(r, "from_epoch"), straight)
    assert bitwise_equal(weights_of(r, "from_mid"), straight)
    assert info["from_epoch_counters"] == info["straight_counters"]
    assert info["from_mid_counters"] == info["straight_counters"]
