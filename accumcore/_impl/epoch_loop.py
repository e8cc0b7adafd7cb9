"""One epoch of micro-batches, for :class:`~accumcore.AccumTrainer` and
:class:`~accumcore.checkpointing.ResumableLoop`.

* :func:`fit_epoch`: one epoch of :meth:`AccumTrainer.fit <accumcore.AccumTrainer.fit>` in any
  mode: its micro-batches, the progress bar, the book-keeping and the end-of-epoch policy.
* :func:`run_micro_batches`: the eager / function epoch, a Python loop (the body of
  :meth:`AccumTrainer.run_micro_batches <accumcore.AccumTrainer.run_micro_batches>`).
* :func:`epoch_in_graph`: the whole epoch inside one ``tf.function`` (``mode="graph"``; the
  trainer's ``_epoch_fn`` compiles it), and :func:`graph_records`, which runs it.
* :class:`HistoryBook` writes the :class:`~accumcore.LoopHistory` from the per-micro-batch
  records; :func:`close_epoch` and :func:`empty_epoch_error` end an epoch, the same way for
  ``fit`` and ``ResumableLoop.fit``.

The functions read the trainer's public attributes only; what it keeps to itself (its
micro-step, its compiled epoch) is passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import keras
import tensorflow as tf

from accumcore._impl import datasets


def _tick(bar: keras.utils.Progbar) -> Callable[[int, tuple], None]:
    """An ``after(step, record)`` for :meth:`AccumTrainer.run_micro_batches` that moves a live
    progress bar to ``step + 1`` with the epoch's running mean loss so far, ``sum c_i L_i /
    sum c_i`` (a host read per micro-batch); the epoch's last line is written by
    :func:`fit_epoch`."""
    sums = [0.0, 0.0]

    def tick(step: int, record: tuple) -> None:
        sums[0] += float(record[0]) * float(record[1])
        sums[1] += float(record[1])
        mean = sums[0] / sums[1] if sums[1] else float(record[0])
        bar.update(step + 1, values=[("loss", mean)], finalize=False)
    return tick


@dataclass
class LoopHistory:
    """What a loop recorded, one entry per micro-batch / window / epoch.

    Attributes:
        micro_losses: mean loss of each micro-batch (float, in loss units).
        micro_weights: weight ``c_i`` of each micro-batch (samples, weight sum or items).
        window_losses: mean loss over each closed window: ``sum c_i L_i / sum c_i``, exactly the
            loss a large batch made of that window would report.
        epoch_losses: mean loss over each epoch (per sample / item).
        epoch_weights: ``sum c_i`` over each epoch: what the epoch's loss is a mean over (its
            samples, its sample-weight sum, or its valid tokens under a mask). Under a
            ``MultiWorkerMirroredStrategy`` the records (losses and weights) are this worker's
            replicas'; the update itself uses every worker's.
        updates: number of optimizer updates applied in each epoch.
        counters: :meth:`AccumulationState.counters` after the last epoch.

    The loop creates it empty (``LoopHistory()``) and appends to it; the lists are not
    constructor arguments.
    """

    micro_losses: list[float] = field(default_factory=list, init=False)
    micro_weights: list[float] = field(default_factory=list, init=False)
    window_losses: list[float] = field(default_factory=list, init=False)
    epoch_losses: list[float] = field(default_factory=list, init=False)
    epoch_weights: list[float] = field(default_factory=list, init=False)
    updates: list[int] = field(default_factory=list, init=False)
    counters: dict[str, int] = field(default_factory=dict, init=False)


class HistoryBook:
    """Writes a :class:`~accumcore.LoopHistory` from micro-batch results: the one book-keeping of
    :meth:`~accumcore.AccumTrainer.fit` and :meth:`~accumcore.checkpointing.ResumableLoop.fit`.

    Keeps float64 running sums (Python floats) for the open window and the epoch:
    ``window_loss`` / ``epoch_loss`` (``sum c_i * L_i``, loss units times weight) and
    ``window_weight`` / ``epoch_weight`` (``sum c_i``). ``ResumableLoop`` checkpoints
    ``sums``, so that the losses reported after a resume are the same as without the
    interruption.
    """

    SUMS = ("window_loss", "window_weight", "epoch_loss", "epoch_weight")

    def __init__(self, sums: dict[str, float] | None = None) -> None:
        self.history = LoopHistory()
        self.sums = {name: float((sums or {}).get(name, 0.0)) for name in self.SUMS}

    def _reset(self, prefix: str) -> None:
        self.sums[f"{prefix}_loss"] = self.sums[f"{prefix}_weight"] = 0.0

    def _window_loss(self) -> None:
        self.history.window_losses.append(self.sums["window_loss"] / self.sums["window_weight"])

    def micro_batch(self, loss: float, weight: float, applied: bool) -> None:
        """Record one micro-batch: its mean loss, its weight ``c_i`` and whether it closed
        (applied) a window."""
        self.history.micro_losses.append(loss)
        self.history.micro_weights.append(weight)
        for prefix in ("window", "epoch"):
            self.sums[f"{prefix}_loss"] += loss * weight
            self.sums[f"{prefix}_weight"] += weight
        if applied:
            self._window_loss()
            self._reset("window")

    def end_epoch(self, policy: str, outcome: str | None, updates: int) -> None:
        """Record the end of an epoch.

        Args:
            policy: the ``end_of_epoch`` policy (``"carry"`` keeps the window's sums).
            outcome: what ``AccumulationState.end_epoch`` did (``None``:
                nothing pending).
            updates: optimizer updates applied in this epoch.
        """
        if outcome in ("applied", "skipped"):  # the partial window was closed
            self._window_loss()
        if policy != "carry":
            self._reset("window")
        weight = self.sums["epoch_weight"]
        self.history.epoch_losses.append(self.sums["epoch_loss"] / weight if weight else 0.0)
        self.history.epoch_weights.append(weight)
        self.history.updates.append(updates)
        self._reset("epoch")


# ---------------------------------------------------------------------------- eager / function
def run_micro_batches(trainer: Any, train: Callable, batches: Any, *, compiled: bool,
                      check_each: bool, after: Callable[[int, tuple], None] | None) -> list[tuple]:
    """The loop of :meth:`AccumTrainer.run_micro_batches
    <accumcore.AccumTrainer.run_micro_batches>` (same arguments and records), with ``train``
    the trainer's micro-batch without the non-finite check:
    ``train(x, y, sample_weight, compiled=compiled) -> (mean_loss, weight, applied)``."""
    records = []
    for step, batch in enumerate(batches):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        records.append(train(x, y, sample_weight, compiled=compiled))
        if check_each:
            trainer.state.raise_if_nonfinite(trainer.epoch)
        if after is not None:
            after(step, records[-1])
    return records


# ---------------------------------------------------------------------------- whole epoch in graph
def epoch_in_graph(step: Callable, batches: Any, steps: Any = None) -> tuple:
    """One epoch in graph (traced, not eager): ``step(x, y, sample_weight)`` (the trainer's
    micro-step, returning ``(loss, weight, applied)``) on every micro-batch of the dataset
    ``batches``; or, with ``steps`` (an int64 scalar tensor), on at most that many from the
    iterator ``batches`` (kept across epochs).

    Returns:
        The stacked records ``(losses, weights, applied)``, float32, float32 and bool tensors
        of shape ``[micro-batches]``.
    """
    records = tuple(tf.TensorArray(dtype, size=0, dynamic_size=True)
                    for dtype in (tf.float32, tf.float32, tf.bool))
    i = 0
    if steps is None:
        # iter(): autograph turns this into a tf.while_loop over the iterator. `for batch
        # in dataset` would become `dataset.reduce`, whose body (variable updates,
        # optimizer) runs about 10-30x slower (benchmarks/RESULTS.md).
        for batch in iter(batches):
            records = _record(step, records, i, batch)
            i += 1
    else:
        for _ in tf.range(steps):
            optional = batches.get_next_as_optional()
            if not optional.has_value():
                break  # the data ran out (the caller warns and starts a new iterator)
            records = _record(step, records, i, optional.get_value())
            i += 1
    return tuple(r.stack() for r in records)


def _record(step: Callable, records: tuple, i: Any, batch: Any) -> tuple:
    """Run one micro-batch; write its ``(loss, weight, applied)`` at index ``i``."""
    x, y, sw = keras.utils.unpack_x_y_sample_weight(batch)
    return tuple(r.write(i, out) for r, out in zip(records, step(x, y, sw)))


def graph_records(trainer: Any, epoch_fn: Callable,
                  source: datasets.EpochSource) -> list[tuple]:
    """Run the compiled :func:`epoch_in_graph` ``epoch_fn`` of ``trainer`` on the epoch of
    ``source``; raise for a non-finite gradient, else return its per-micro-batch records
    ``(loss, weight, applied)`` as Python floats and bools."""
    if source.steps_per_epoch is None:
        losses, weights, applied = epoch_fn(source.batches)
    else:
        losses, weights, applied = epoch_fn(
            source.iterator(), tf.constant(source.steps_per_epoch, tf.int64))
    trainer.state.raise_if_nonfinite(trainer.epoch)
    return list(zip(losses.numpy().tolist(), weights.numpy().tolist(),
                    applied.numpy().tolist()))


# ---------------------------------------------------------------------------- one epoch of fit
def fit_epoch(trainer: Any, dataset: tf.data.Dataset, source: datasets.EpochSource,
              book: HistoryBook,
              graph_epoch: Callable[[tf.data.Dataset, datasets.EpochSource], list[tuple]], *,
              mode: str, verbose: int) -> None:
    """One epoch of :meth:`AccumTrainer.fit <accumcore.AccumTrainer.fit>`: its micro-batches,
    the progress bar, the book-keeping in ``book`` and the end-of-epoch policy.

    ``mode="graph"`` runs ``graph_epoch(dataset, source)`` (the trainer's compiled epoch; its
    records as :func:`graph_records` returns them), the other modes
    :meth:`AccumTrainer.run_micro_batches <accumcore.AccumTrainer.run_micro_batches>`.
    Called by ``fit`` itself: the warning of ``source.count`` (the data ran out) points two
    frames up, at the caller of ``fit``.
    """
    steps = source.steps
    # "loss" is shown as given (stateful): the running mean, then the epoch's mean.
    bar = keras.utils.Progbar(steps, verbose=verbose, unit_name="micro-batch",
                              stateful_metrics=["loss"])
    # A live bar (eager / function, verbose=1) ticks per micro-batch (a host read each).
    ticked = mode != "graph" and verbose == 1
    before = int(trainer.state.windows_applied.numpy()) if trainer.state.built else 0
    if mode == "graph":
        records = graph_epoch(dataset, source)
    else:
        records = trainer.run_micro_batches(
            source.epoch(), compiled=(mode == "function"), check_each=False,
            after=_tick(bar) if ticked else None)
        trainer.state.raise_if_nonfinite(trainer.epoch)  # once per epoch, not per batch
        records = [(float(loss), float(weight), bool(did))
                   for loss, weight, did in records]
    source.count(len(records), trainer.epoch)
    if not records and (source.steps_per_epoch is None or not trainer.state.built):
        raise empty_epoch_error(trainer.epoch)
    for record in records:  # book-keeping in Python, from the per-micro-batch records
        book.micro_batch(*record)
    close_epoch(trainer, book, before)
    if verbose:  # the epoch's last line: its mean loss, as model.fit's bar ends
        bar.update(bar.target or len(records),
                   values=[("loss", book.history.epoch_losses[-1])], finalize=True)


# ---------------------------------------------------------------------------- end of an epoch
def close_epoch(trainer: Any, book: HistoryBook, windows_before: int) -> None:
    """End an epoch of ``trainer``: run its end-of-epoch policy and record it in ``book``; the
    one end-of-epoch step of :meth:`AccumTrainer.fit <accumcore.AccumTrainer.fit>` and
    :meth:`ResumableLoop.fit <accumcore.checkpointing.ResumableLoop.fit>`.

    Args:
        trainer: the trainer whose epoch ends.
        book: the :class:`HistoryBook` of the running ``fit``.
        windows_before: ``state.windows_applied`` at the start of the epoch, so that the
            epoch's updates are the windows applied since (the flush included).
    """
    outcome = trainer.end_epoch()
    book.end_epoch(
        trainer.end_of_epoch, outcome,
        int(trainer.state.windows_applied.numpy()) - windows_before,
    )


def empty_epoch_error(epoch: int) -> ValueError:
    """The error for an epoch (0-based ``epoch``) in which the data yielded no micro-batch."""
    return ValueError(
        f"`dataset` yielded no micro-batches in epoch {epoch + 1}: it is empty (or an exhausted "
        "iterator). Pass a dataset that can be iterated once per epoch."
    )
