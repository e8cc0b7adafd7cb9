"""``micro_batch_size="auto"``: the micro-batch found on the device by running the real step,
and the same batch rerun with a smaller one whenever a step runs out of memory.

At the first batch (of B samples) b is searched (``accumcore._impl.search.largest_fitting``,
public as ``accumcore.memory.largest_fitting``, with ``descending=True``): one micro-batch's
forward and backward pass of the real model and loss on the batch's first b samples, first
b = B, halved while it runs out of memory
(``tf.errors.ResourceExhaustedError``, also raised by XLA), then bisected up between the
largest size that fitted and the smallest that did not; the probes change nothing (the model's
non-trainable variables are restored after each). Then the real step runs. Whenever a step
raises the out-of-memory error (the first, or a later batch of longer sequences) the state from
before the step is restored, b is halved (rounded up), the step is traced anew and the *same*
batch runs again: its update is applied once, exactly, and no batch is skipped or applied
twice. Below b = 1 the error is raised with every probe. Under a ``tf.distribute`` strategy
there is no search: b starts at each replica's share of the batch and only halves.

A compiled step aborted by an error keeps the assignments that ran before it, so the retry
starts from a copy taken before the step: the model's non-trainable variables (BatchNorm
statistics, random-number states), the metrics' variables and the accumulation state's. The
trainable variables and the optimizer change only in the window's one update, the step's last
part: a step that fails after its update began is not retried (its error says so).

Each batch is fetched on the host and run by Keras's own train function, one batch per call
(``steps_per_execution`` batches per fit step, in a Python loop).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from accumcore._impl.gradients import first_leaf
from accumcore._impl.search import largest_fitting

logger = logging.getLogger("accumcore")

#: Errors that mean "the step did not fit in device memory".
OUT_OF_MEMORY = (tf.errors.ResourceExhaustedError,)


def retrying_train_function(model: keras.Model, make: Callable[[], Callable],
                            probe: Callable[[Any, int], Any] | None = None) -> Callable:
    """The train function of a model with ``micro_batch_size="auto"``.

    Args:
        model: the model (its ``accumulation`` state holds the b found).
        make: makes Keras's train function anew for the state's current b (``model``'s own
            ``make_train_function(force=True)``, returning ``model.train_function``).
        probe: ``probe(batch, b)``, one micro-batch's forward and backward pass on the first b
            samples of ``batch`` (raises the out-of-memory error if it does not fit); ``None``:
            no search, b starts at the batch's size.

    Returns:
        ``train_function(iterator)``, as Keras's: runs ``model.steps_per_execution`` batches
        of ``iterator`` and returns the last step's logs; ``StopIteration`` when it is empty.
    """
    runner = _Runner(model, make, probe)

    def train_function(iterator: Any) -> Any:
        logs = None
        for data in _batches(iterator, int(getattr(model, "steps_per_execution", 1) or 1)):
            logs = runner.run(data)
        if logs is None:
            raise StopIteration
        return logs

    return train_function


class _Runner:
    """Runs one batch with the state's b, shrinking b and rerunning while it runs out of
    memory; ``probes``: every ``(b, fitted)`` tried, in order."""

    def __init__(self, model: keras.Model, make: Callable[[], Callable],
                 probe: Callable[[Any, int], Any] | None) -> None:
        self.model = model
        self.make = make
        self.probe = probe
        self.function: Callable | None = None
        self.probes: list[tuple[int, bool]] = []
        self.reported = False

    def run(self, data: Any) -> Any:
        state = self.model.accumulation
        if state.micro_batch_size == "auto":  # the first batch: search b
            state.micro_batch_size = self._search(data)
            self.function = None
        while True:
            if self.function is None:
                self.function = self.make()
            size = state.micro_batch_size
            before = _Snapshot(self.model)
            try:
                logs = self.function(iter([data]))
            except OUT_OF_MEMORY as err:
                before.restore_or_raise(err)
                self.probes.append((size, False))
                if size <= 1:
                    raise type(err)(err.node_def, err.op,
                                    f"{_nothing_fits(self.probes)} {err.message}") from err
                state.micro_batch_size = (size + 1) // 2
                logger.warning(
                    "micro_batch_size='auto': a step with micro-batches of %d samples ran out "
                    "of memory; the same batch runs again with micro-batches of %d (its update "
                    "is applied once).", size, state.micro_batch_size)
                self.function = None
                continue
            self._report(data, size)
            return logs

    def _search(self, data: Any) -> int:
        """The largest b that fits one micro-batch of ``data`` (at most its size)."""
        samples = _samples(data)
        if self.probe is None or self.model.accumulation.replicas.distributed:
            return samples
        def fits(size: int) -> bool:
            before = _Snapshot(self.model)
            try:
                self.probe(data, size)
            except OUT_OF_MEMORY:
                return False
            finally:
                before.restore()
            return True

        probes: list[tuple[int, bool]] = []
        try:
            return largest_fitting(fits, limit=samples, descending=True, probes=probes)
        except ValueError as err:
            raise ValueError(_nothing_fits(probes)) from err
        finally:
            self.probes.extend(probes)

    def _report(self, data: Any, size: int) -> None:
        """Once, after the first batch that fitted: b, K and the probes."""
        if self.reported:
            return
        self.reported = True
        if (size, True) not in self.probes:
            self.probes.append((size, True))
        samples = _samples(data)
        on_cpu = not tf.config.list_physical_devices("GPU")
        logger.warning(
            "micro_batch_size='auto': b = %d samples per micro-batch (K = %d per batch of %d; "
            "probes, b and whether it fitted: %s)%s. Read it as "
            "`model.accumulation.micro_batch_size`.", size, -(-samples // size), samples,
            self.probes,
            " -- no GPU, so nothing runs out of memory: each batch is one micro-batch, no "
            "split" if on_cpu and size >= samples else "")


class _Snapshot:
    """The values a step may change before its update: restored before a rerun."""

    def __init__(self, model: keras.Model) -> None:
        state = model.accumulation
        variables = [v for v in model.variables if not v.trainable]
        variables += list(getattr(model, "metrics_variables", []))
        self.parts = [(part, tf.identity(part))
                      for v in state.variables_for_saving()
                      for part in state.replicas.parts(v)]
        self.parts += [(v, tf.identity(v)) for v in variables]
        self.optimizer = model.optimizer
        # a copy on the device: no host read (a GPU would wait for the step before it)
        self.iterations = tf.identity(model.optimizer.iterations)

    def restore_or_raise(self, err: Exception) -> None:
        """Restore every value, or raise if the step's update had begun (then the trainable
        variables and the optimizer may be half-updated: nothing can rerun it exactly)."""
        if int(self.optimizer.iterations.numpy()) != int(self.iterations.numpy()):
            raise type(err)(err.node_def, err.op, (
                "The step ran out of memory after its optimizer update began, so it cannot "
                f"be rerun exactly: {err.message}")) from err
        self.restore()

    def restore(self) -> None:
        """Every value as it was."""
        for variable, value in self.parts:
            variable.assign(value)


def _nothing_fits(probes: list[tuple[int, bool]]) -> str:
    """The message when not even one sample fits, with every probe."""
    return ("micro_batch_size='auto': even micro-batches of 1 sample run out of memory "
            f"(probes, b and whether it fitted: {probes}). Make the model or its inputs "
            "smaller, or use a device with more memory.")


def _batches(iterator: Any, count: int) -> Iterator[Any]:
    """Up to ``count`` batches from a ``tf.data`` (or distributed) iterator or a Python
    iterable, fetched on the host."""
    if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
        for _ in range(count):
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                return
            yield optional.get_value()
        return
    for _, data in zip(range(count), iterator):
        yield data


def _samples(data: Any) -> int:
    """The samples in a batch ``(x, ...)`` (each replica's share for distributed values: b
    applies to each replica's share; the largest)."""
    x = keras.utils.unpack_x_y_sample_weight(data)[0]
    leaf = first_leaf(x)
    values = getattr(leaf, "values", None)  # a PerReplica value: one tensor per replica
    if values is not None:
        return max(int(tf.shape(v)[0]) for v in values)
    return int(tf.shape(leaf)[0])
