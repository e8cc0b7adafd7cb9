"""Exact resumption of interrupted training, for custom loops and for ``model.fit``.

A run interrupted in the middle of an accumulation window and resumed from its checkpoint
ends with the same weights, bit for bit, as a run that was never interrupted, provided the
checkpoint holds *everything* the update depends on:

* the model's weights and the optimizer's variables (iterations, moments, learning rate);
* the accumulation state (the half-full window's gradient sums, its weight, the position in
  the window and the run-long counters): :class:`accumcore.AccumulationState` is trackable;
* the data position: which micro-batches of the current epoch were already consumed.

Custom loops (:class:`ResumableLoop`) keep all of it in one ``tf.train.Checkpoint`` managed
by a ``tf.train.CheckpointManager``; the ``tf.data`` iterator itself is checkpointed, so the
epoch continues with the next unseen micro-batch. That a checkpointed iterator carries its
shuffle buffer is TensorFlow's documented design
(https://www.tensorflow.org/guide/data#iterator_checkpointing).

``model.fit`` cannot checkpoint its data iterator, and ``keras.callbacks.BackupAndRestore``
restores the weights but restarts the interrupted epoch from its first batch. With
``save_freq="epoch"`` that is exact (the checkpoint is taken at an epoch boundary;
:class:`accumcore.AccumModel` saves a carried partial window with the weights).
With an integer ``save_freq`` the batches trained between the epoch start and the checkpoint
are trained a second time, so the result differs from an uninterrupted run.
:class:`ExactBackupAndRestore` fixes that: it records how many batches of the epoch the
checkpoint already contains and turns exactly those batches into no-ops when ``fit`` replays
them (the data are still read, so the order of later batches is unchanged).
:class:`SkipTrainedBatches` does the same after reloading a mid-epoch ``ModelCheckpoint``.
Both replace ``model.train_function`` (the function ``fit`` builds and calls once per
``steps_per_execution`` batches) with a wrapper that reads the batches and returns
``model.get_metrics_result()`` while skipping, and put it back when ``fit`` ends; the rest
of :class:`ExactBackupAndRestore` is Keras's callback hooks, ``optimizer.build``,
``save_weights`` and ``load_weights``. ``train_function`` is a
``keras.Model`` attribute, not a documented extension point: a Keras release that changes how
``fit`` calls it can break the skipping. The resume guide runs it on the Keras version it
prints; on another version, interrupt and resume one short run before relying on it.

Exactness also needs the data order to be reproducible. For :class:`ResumableLoop` it is, by
TensorFlow's design: the checkpointed ``tf.data`` iterator carries its shuffle buffer and the
state of a ``shuffle(..., seed=s)`` seed generator, so the epochs after the
resumed one get the same orders as without the interruption, provided the same dataset
object is passed for every epoch and the same global seed (``keras.utils.set_random_seed``)
is set at the start of the restarted process. A
callable ``epoch -> dataset`` (e.g. ``samples.shuffle(n, seed=base + epoch)``, as the resume
guide runs it: a fresh dataset each epoch, so ``reshuffle_each_iteration`` does not matter)
makes the order of each epoch explicit. ``model.fit`` has
no iterator to checkpoint: the order of every epoch must follow from the epoch alone. That
holds for ``shuffle=False``, for a ``tf.data`` dataset with a fixed order, and for
``fit(x, y, shuffle=True)`` with arrays after ``keras.utils.set_random_seed``: Keras then
uses the *same* permutation in every epoch, which changes the training itself (no epoch gets a
new order), not only the resume. That is what the resume guide shows on the Keras version it
prints, not a documented Keras promise: check it on yours the same way.
Without a global seed the permutation differs between processes and no resume is exact.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from accumcore._impl.epoch_loop import HistoryBook, LoopHistory, close_epoch, empty_epoch_error
from accumcore._impl.settings import check_choice, check_positive_int
from accumcore._impl.state import AccumulationState
from accumcore._impl.trainer import AccumTrainer

#: Modes of :meth:`ResumableLoop.fit` (``"graph"`` runs a whole epoch in one call, so it cannot
#: stop or checkpoint between micro-batches).
RESUMABLE_MODES = ("eager", "function")

DatasetOrFactory = tf.data.Dataset | Callable[[int], tf.data.Dataset]


def training_checkpoint(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer,
    accumulation: AccumulationState,
    iterator: Any = None,
    **trackables: Any,
) -> tf.train.Checkpoint:
    """A ``tf.train.Checkpoint`` of everything an accumulated update depends on.

    Args:
        model: the Keras model (its variables are saved).
        optimizer: the Keras optimizer (iterations, slots, learning rate).
        accumulation: the :class:`~accumcore.AccumulationState` (build it first, e.g. with
            ``trainer.build(x)``, so that a restore fills the accumulators immediately).
        iterator: an iterator over a ``tf.data.Dataset`` (``iter(dataset)``), whose position
            and shuffle buffer are saved; ``None`` to leave the data position out.
        **trackables: anything else trackable to save (e.g. an epoch ``tf.Variable``).

    Returns:
        The checkpoint; wrap it in ``tf.train.CheckpointManager`` to save and restore.

    Example:
        ``trainer``: an :class:`~accumcore.AccumTrainer`; ``train_ds``: the batched
        ``tf.data.Dataset`` it trains on.

        >>> it = iter(train_ds)
        >>> ckpt = training_checkpoint(trainer.model, trainer.optimizer, trainer.state, it)
        >>> manager = tf.train.CheckpointManager(ckpt, "ckpts", max_to_keep=2)
        >>> ckpt.restore(manager.latest_checkpoint)   # no-op on a fresh start
    """
    objects = dict(model=model, optimizer=optimizer, accumulation=accumulation, **trackables)
    if iterator is not None:
        objects["iterator"] = iterator
    return tf.train.Checkpoint(**objects)


def _as_factory(dataset: DatasetOrFactory) -> Callable[[int], tf.data.Dataset]:
    if isinstance(dataset, tf.data.Dataset):
        return lambda epoch: dataset
    if callable(dataset):
        return dataset
    raise TypeError(
        "`dataset` must be a tf.data.Dataset of micro-batches or a callable "
        f"`epoch -> tf.data.Dataset`, got {type(dataset).__name__}."
    )


class ResumableLoop:
    """:class:`~accumcore.AccumTrainer` epochs that checkpoint and resume mid-window, exactly.

    Every ``save_every`` micro-batches (and at each epoch end) it saves one
    ``tf.train.Checkpoint`` holding the model, the optimizer, the accumulation state, the
    ``tf.data`` iterator of the current epoch and the loop's progress (epoch, loss sums for
    the history). :meth:`fit` first restores the latest checkpoint in ``directory``, if any,
    and continues with the next unseen micro-batch.

    Args:
        trainer: the :class:`~accumcore.AccumTrainer` to drive (its settings, e.g.
            ``end_of_epoch`` and ``nonfinite``, apply unchanged).
        directory: where the ``tf.train.CheckpointManager`` keeps its checkpoints.
        save_every: save after every ``save_every`` micro-batches (counted over the whole run,
            so the cadence survives restarts); int >= 1. With ``micro_batch_size`` a batch
            runs several micro-batches at once: the save follows the batch that reaches or
            passes the next multiple of ``save_every``.
        max_to_keep: checkpoints kept on disk.
        save_at_epoch_end: also save after each epoch's end-of-epoch policy ran.

    Example:
        ``trainer``: an :class:`~accumcore.AccumTrainer`; ``make_dataset``: your own function
        returning the epoch's batched ``tf.data.Dataset``, shuffled with ``seed``.

        >>> loop = ResumableLoop(trainer, "ckpts", save_every=50)
        >>> history = loop.fit(lambda epoch: make_dataset(seed=epoch), epochs=10)
        >>> # after a crash, the same two lines continue where the last checkpoint left off
    """

    def __init__(
        self,
        trainer: AccumTrainer,
        directory: str | os.PathLike,
        *,
        save_every: int,
        max_to_keep: int = 2,
        save_at_epoch_end: bool = True,
    ) -> None:
        if not isinstance(trainer, AccumTrainer):
            raise TypeError(
                f"`trainer` must be an accumcore.AccumTrainer, got {type(trainer).__name__}."
            )
        #: What this loop drives, the :class:`~accumcore.AccumTrainer` given:
        #: ``loop.trainer.model`` is the model it trains, ``loop.trainer.state`` its
        #: accumulation state.
        self.trainer = trainer
        self.save_every = check_positive_int(save_every, "save_every")
        self.save_at_epoch_end = bool(save_at_epoch_end)
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        # float64 loss sums for the history (sum of c_i * L_i and of c_i), so that the window
        # and epoch losses reported after a resume are the same as without the interruption.
        self._sums = {
            name: tf.Variable(0.0, dtype=tf.float64, trainable=False, name=name)
            for name in HistoryBook.SUMS
        }
        self._book = HistoryBook()  # the running sums of the current fit (saved in _sums)
        self.epoch_start_windows = tf.Variable(0, dtype=tf.int64, trainable=False)
        #: The ``tf.train.Checkpoint`` saved and restored (model, optimizer, accumulation
        #: state, the epoch's data iterator and the loop's progress).
        self.checkpoint = training_checkpoint(
            trainer.model, trainer.optimizer, trainer.state, epoch=self.epoch,
            epoch_start_windows=self.epoch_start_windows, **self._sums,
        )
        #: The ``tf.train.CheckpointManager`` over ``directory``. Its ``latest_checkpoint`` is
        #: the path of the checkpoint the next :meth:`fit` restores (``None`` before the first
        #: save), readable with ``tf.train.load_variable``; its ``checkpoints`` lists those kept.
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, os.fspath(directory), max_to_keep=max_to_keep
        )
        #: Whether the last :meth:`fit` started from a checkpoint.
        self.resumed = False
        self._saved_multiple = 0  # the last multiple of save_every saved at (fit sets it)

    # ------------------------------------------------------------------ helpers
    def _build(self, make: Callable[[int], tf.data.Dataset], epoch: int) -> None:
        if self.trainer.state.built:
            return
        for batch in make(epoch).take(1):
            self.trainer.build(keras.utils.unpack_x_y_sample_weight(batch)[0])
            return
        raise ValueError(
            f"`dataset({epoch})`, for epoch {epoch + 1}, is empty: nothing to train on (and "
            "nothing to build the model from)."
        )

    def _keep_sums(self) -> None:
        """Copy the history's running sums into the checkpointed variables."""
        for name, value in self._book.sums.items():
            self._sums[name].assign(value)

    def save(self) -> str:
        """Save a checkpoint now; returns its path."""
        self._keep_sums()
        return self.manager.save()

    # ------------------------------------------------------------------ fit
    def fit(
        self,
        dataset: DatasetOrFactory,
        epochs: int,
        *,
        mode: str = "function",
        on_micro_batch_end: Callable[[int, int], None] | None = None,
    ) -> LoopHistory:
        """Train until ``epochs`` epochs are done, resuming from the latest checkpoint.

        Args:
            dataset: a ``tf.data.Dataset`` of micro-batches (the same object for every epoch),
                or a callable ``epoch -> dataset``; see the module doc about shuffling.
            epochs: total number of epochs of the run (not "more epochs").
            mode: ``"eager"`` (every op eager) or ``"function"`` (each micro-step a
                ``tf.function``, traced once), as in
                :meth:`AccumTrainer.fit() <accumcore.AccumTrainer.fit>`.
            on_micro_batch_end: optional ``f(epoch, step)`` called after each micro-batch
                (``step`` is its 0-based index in the epoch), after any checkpoint it caused.

        Returns:
            A :class:`~accumcore.LoopHistory` of the micro-batches run by *this* call; its
            ``window_losses``, ``epoch_losses`` and ``updates`` include the part of a window
            or epoch that ran before the checkpoint.
        """
        mode = check_choice(mode, "mode", RESUMABLE_MODES)
        epochs = check_positive_int(epochs, "epochs")
        make = _as_factory(dataset)
        trainer, state = self.trainer, self.trainer.state
        start, iterator = self._restore_or_start(make)
        # The history's running sums continue from the checkpoint (or the last fit).
        self._book = book = HistoryBook({k: float(v.numpy()) for k, v in self._sums.items()})

        self._saved_multiple = int(state.micro_batches_seen.numpy()) // self.save_every

        def after(step: int, record: tuple) -> None:
            # Host reads per micro-batch (per batch when it is split; after the non-finite
            # check, so that a stopped state is never saved): the running sums are
            # checkpointed with the state.
            loss, weight, applied = record
            book.micro_batch(float(loss), float(weight), bool(applied))
            self._save_if_due()
            if on_micro_batch_end is not None:
                on_micro_batch_end(trainer.epoch, step)

        try:
            for epoch in range(start, epochs):
                trainer.epoch = epoch
                records = trainer.run_micro_batches(
                    iterator, compiled=(mode == "function"), after=after
                )
                if not records and not (self.resumed and epoch == start):
                    raise empty_epoch_error(epoch)
                close_epoch(trainer, book, int(self.epoch_start_windows.numpy()))
                iterator = self._next_epoch(epoch, epochs, make, iterator)
        finally:
            self._keep_sums()  # what the next fit on this loop continues from
        history = book.history
        history.counters = state.counters()
        return history

    def _save_if_due(self) -> None:
        """Save when the micro-batches run reached or passed the next multiple of
        ``save_every`` (a split batch runs several at once)."""
        multiple = int(self.trainer.state.micro_batches_seen.numpy()) // self.save_every
        if multiple > self._saved_multiple:
            self._saved_multiple = multiple
            self.save()

    def _restore_or_start(self, make: Callable[[int], tf.data.Dataset]) -> tuple[int, Any]:
        """The epoch to start at and its dataset iterator: restored from the latest checkpoint
        (the iterator's position included), or the trainer's epoch from its start."""
        latest = self.manager.latest_checkpoint
        start = int(tf.train.load_variable(latest, "epoch/.ATTRIBUTES/VARIABLE_VALUE")) \
            if latest else self.trainer.epoch
        self.resumed = latest is not None
        self._build(make, start)
        iterator = iter(make(start))
        self.checkpoint.iterator = iterator
        if latest:
            # Partial by design: a checkpoint written before 2026-12-02 also holds the
            # non-finite guard's old flags, which are no longer saved (never needed to resume).
            self.checkpoint.restore(latest).assert_existing_objects_matched().expect_partial()
        else:
            self.epoch.assign(start)
            self.epoch_start_windows.assign(self.trainer.state.windows_applied)
        return start, iterator

    def _next_epoch(self, epoch: int, epochs: int, make: Callable[[int], tf.data.Dataset],
                    iterator: Any) -> Any:
        """Move the checkpointed progress to the start of the epoch after ``epoch`` (its
        iterator, if there is one, is returned and checkpointed), saving if asked."""
        self.epoch.assign(epoch + 1)
        self.epoch_start_windows.assign(self.trainer.state.windows_applied)
        self.trainer.epoch = epoch + 1
        if epoch + 1 < epochs:
            iterator = iter(make(epoch + 1))
            self.checkpoint.iterator = iterator
        if self.save_at_epoch_end:
            self.save()
        return iterator


# ---------------------------------------------------------------------------- model.fit
_SKIP_MARK = "_accumcore_skip_wrapper_of"


def _unwrap_train_function(model: keras.Model) -> None:
    """Remove a skipping wrapper left on ``model.train_function`` by an interrupted ``fit``."""
    fn = getattr(model, "train_function", None)
    while fn is not None and hasattr(fn, _SKIP_MARK):
        fn = getattr(fn, _SKIP_MARK)
    model.train_function = fn


class SkipTrainedBatches(keras.callbacks.Callback):
    """Skip (make no-ops of) the first n training batches of ``fit``'s first epoch (n: ``batches``).

    Use it to resume exactly from a checkpoint taken in the middle of an epoch: reload the
    weights (``keras.models.load_model`` of a ``ModelCheckpoint(save_freq=N)`` file, say),
    then ``fit(..., initial_epoch=e, callbacks=[SkipTrainedBatches(n)])`` where the checkpoint
    holds the first ``n`` batches of epoch ``e``. The skipped batches are still read from the
    data (so the later ones come in the same order), but not trained on, measured or counted.

    It wraps ``model.train_function`` (built by ``fit`` before ``on_train_begin``) and removes
    the wrapper when ``fit`` ends.

    Args:
        batches: number of batches to skip (int >= 0); a multiple of the model's
            ``steps_per_execution``.
    """

    def __init__(self, batches: int) -> None:
        super().__init__()
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
            raise ValueError(f"`batches` must be an int >= 0, got {batches!r}.")
        self.batches = batches
        self._remaining_calls = 0
        self._last_call_skipped = False
        #: Number of batches this callback has turned into no-ops so far.
        self.skipped = 0

    def _calls(self, batches: int) -> int:
        per_call = int(getattr(self.model, "steps_per_execution", 1) or 1)
        if batches % per_call:
            raise ValueError(
                f"`batches`={batches} is not a multiple of the model's steps_per_execution="
                f"{per_call}: a checkpoint can only be taken between executions."
            )
        return batches // per_call

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._install(self.batches)

    def _install(self, batches: int) -> None:
        model = self.model
        _unwrap_train_function(model)
        self._last_call_skipped = False
        self._remaining_calls = self._calls(batches)
        if not self._remaining_calls:
            return
        original = model.train_function
        per_call = int(getattr(model, "steps_per_execution", 1) or 1)

        def train_function(iterator):
            self._last_call_skipped = self._remaining_calls > 0
            if self._last_call_skipped:
                self._remaining_calls -= 1
                self.skipped += per_call
                if hasattr(iterator, "get_next"):
                    # TensorFlow backend: the train function reads its batches itself from
                    # the (distributed) iterator; read them here so that they are consumed.
                    for _ in range(per_call):
                        iterator.get_next()
                return model.get_metrics_result()
            return original(iterator)

        setattr(train_function, _SKIP_MARK, original)
        model.train_function = train_function

    @property
    def skipping(self) -> bool:
        """True while batches are being skipped (the next batch will be skipped, too)."""
        return self._remaining_calls > 0

    def on_train_end(self, logs: dict | None = None) -> None:
        _unwrap_train_function(self.model)


class ExactBackupAndRestore(SkipTrainedBatches):
    """Back up mid-epoch and resume ``fit`` exactly, without re-training seen batches.

    An alternative to ``keras.callbacks.BackupAndRestore`` for an integer ``save_freq``
    which, unlike it, needs the saved epoch passed to ``fit``:
    ``initial_epoch=callback.initial_epoch`` (or use :func:`fit_resumable`). It saves a Keras
    weights file (``model.save_weights``: in Keras 3 the model's weights, the optimizer's
    variables and, for :class:`~accumcore.AccumModel`, the accumulation state with a half-full
    window) plus a small JSON file with the epoch and the number of its batches already
    trained. On the next ``fit`` it restores all of it (the optimizer built first) and skips
    exactly those batches of that epoch (see :class:`SkipTrainedBatches`).

    Args:
        backup_dir: a directory used only by this callback.
        save_freq: ``"epoch"`` or an int: save every ``save_freq`` batches.
        delete_checkpoint: delete ``backup_dir`` when ``fit`` completes.

    The order of every epoch must follow from the epoch alone, the same in every process:
    ``shuffle=False``, a ``tf.data`` dataset in a fixed order, or arrays with ``shuffle=True``
    after ``keras.utils.set_random_seed`` (the module doc says why).
    """

    METADATA = "accumcore_backup.json"

    def __init__(
        self,
        backup_dir: str | os.PathLike,
        save_freq: int | str = "epoch",
        delete_checkpoint: bool = True,
    ) -> None:
        super().__init__(0)
        if not backup_dir:
            raise ValueError("`backup_dir` must be a non-empty directory path.")
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            raise ValueError(
                f"`save_freq` must be 'epoch' or an int >= 1 (batches), got {save_freq!r}."
            )
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = bool(delete_checkpoint)
        self._epoch = 0
        self._first_epoch: int | None = None
        self._since_save = 0
        self._saves = 0

    # ------------------------------------------------------------------ metadata
    @property
    def _metadata_path(self) -> str:
        return os.path.join(self.backup_dir, self.METADATA)

    def _metadata(self) -> dict | None:
        if not os.path.exists(self._metadata_path):
            return None
        with open(self._metadata_path) as f:
            return json.load(f)

    @property
    def initial_epoch(self) -> int:
        """The epoch to pass as ``fit(initial_epoch=...)``, the saved epoch or 0."""
        meta = self._metadata()
        return int(meta["epoch"]) if meta else 0

    @property
    def batches_done(self) -> int:
        """How many batches of :attr:`initial_epoch` the backup already holds."""
        meta = self._metadata()
        return int(meta["batches_done"]) if meta else 0

    def _save(self, epoch: int, batches_done: int) -> None:
        os.makedirs(self.backup_dir, exist_ok=True)
        self._saves += 1
        name = f"backup-{self._saves % 2}.weights.h5"  # alternate: never overwrite the live one
        self.model.save_weights(os.path.join(self.backup_dir, name), overwrite=True)
        tmp = self._metadata_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"weights": name, "epoch": epoch, "batches_done": batches_done}, f)
        os.replace(tmp, self._metadata_path)  # atomic: the metadata names a complete file

    # ------------------------------------------------------------------ callback hooks
    def on_train_begin(self, logs: dict | None = None) -> None:
        meta = self._metadata()
        self._first_epoch = None
        if meta is None:
            self._install(0)
            return
        model = self.model
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        model.load_weights(os.path.join(self.backup_dir, meta["weights"]))
        self._install(int(meta["batches_done"]))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        if self._first_epoch is None:
            self._first_epoch = epoch
            expected = self.initial_epoch
            if epoch != expected:
                raise ValueError(
                    f"The backup in {self.backup_dir!r} resumes epoch {expected + 1}, but `fit` "
                    f"started at epoch {epoch + 1}: pass `initial_epoch=callback.initial_epoch` "
                    "to fit (or use accumcore.checkpointing.fit_resumable)."
                )
        elif self.skipping:
            raise RuntimeError(
                "The epoch ended before the batches already in the backup were skipped: the "
                "dataset is shorter than when the backup was written."
            )

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._last_call_skipped or self.save_freq == "epoch":
            return
        per_call = int(getattr(self.model, "steps_per_execution", 1) or 1)
        self._since_save += per_call
        if self._since_save >= self.save_freq:
            self._since_save = 0
            self._save(self._epoch, batch + 1)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch + 1, 0)

    def on_train_end(self, logs: dict | None = None) -> None:
        super().on_train_end(logs)
        if self.delete_checkpoint and os.path.isdir(self.backup_dir):
            shutil.rmtree(self.backup_dir)


def fit_resumable(
    model: keras.Model,
    *args: Any,
    backup_dir: str | os.PathLike,
    save_freq: int | str = "epoch",
    callbacks: list | None = None,
    **kwargs: Any,
):
    """``model.fit(*args, **kwargs)`` that resumes exactly from ``backup_dir`` if it holds one.

    Adds an :class:`ExactBackupAndRestore` (last in the callback list, so that it saves after
    ``AccumModel``'s end-of-epoch flush) and passes ``initial_epoch`` from the backup. Call it
    again with the same arguments after an interruption.

    Args:
        model: the model to train (an ``AccumModel`` or a model given ``accumulate``).
        *args: ``model.fit``'s positional arguments (``x``, ``y``, ``batch_size``, ``epochs``,
            ...), passed through unchanged.
        backup_dir: a directory used only by the backup (:class:`ExactBackupAndRestore`).
        save_freq: ``"epoch"`` or an int: save every ``save_freq`` batches.
        callbacks: your callbacks; the backup callback is added after them.
        **kwargs: ``model.fit``'s other keyword arguments, passed through unchanged (not
            ``initial_epoch``, which comes from the backup: passing it raises ``ValueError``).

    Returns:
        The ``History`` of this call.
    """
    if "initial_epoch" in kwargs:
        raise ValueError(
            "`initial_epoch` is set by fit_resumable from the backup; do not pass it."
        )
    backup = ExactBackupAndRestore(backup_dir, save_freq=save_freq)
    callbacks = [*(callbacks or []), backup]
    return model.fit(*args, callbacks=callbacks, initial_epoch=backup.initial_epoch, **kwargs)
