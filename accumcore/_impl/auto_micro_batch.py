"""``micro_batch_size="auto"``: the micro-batch found on the device by running the real step,
and the same batches rerun with a smaller one whenever a step runs out of memory.

At the first batch (of B samples) b is searched (``accumcore._impl.search.search_micro_batch``,
which ``AccumTrainer``'s "auto" uses too: ``largest_fitting`` with ``descending=True``, public
as ``accumcore.memory.largest_fitting``): one micro-batch's
forward and backward pass of the real model and loss on the batch's first b samples, first
b = B, halved while it runs out of memory
(``tf.errors.ResourceExhaustedError``, also raised by XLA), then bisected up between the
largest size that fitted and the smallest that did not; the probes change nothing (the model's
non-trainable variables are restored after each). The first probe that runs to its end also
records which of the model's non-trainable variables it changed, each compared with its copy
once: BatchNorm moving statistics and random-number states change, a frozen weight (of a layer
with ``trainable=False``, or a kernel frozen by ``enable_lora``) does not. Below b = 1 the error
is raised with every probe. Under a ``tf.distribute`` strategy there is no search: b starts at
each replica's share of the batch and only halves.

Then the batches run as a fixed b's do: ``steps_per_execution`` batches of Keras's iterator per
call of one compiled function, read in the graph in a ``tf.while_loop`` as Keras reads them,
each through the model's ``train_step`` compiled as Keras compiles it (``jit_compile``). Three
things are added to each step, in the graph: the batch is first written to variables of its own
and read back from them (:class:`_Held`: TensorFlow's assignment takes over the batch's buffer
where nothing else holds it, else copies it on its device), the small values a step changes
before its update are copied (:class:`_Kept`: the model's non-trainable variables but those the
first probe left unchanged, the metrics' variables, the accumulation state's counters and the
optimizer's ``iterations``; no frozen weight: a few scalars and the BatchNorm statistics) and,
once the step is done, a count of the call's completed steps goes up. The limit: a
non-trainable variable that a step changes only sometimes (or sets to the value it had) and
that the first probe left unchanged is not copied, so an aborted step's change to it would not
be undone; without a probe (under a ``tf.distribute`` strategy) every non-trainable variable is
copied. Nothing is read on the host but what Keras's own train function reads.

Whenever a step raises the out-of-memory error (the first batch, or a later batch of longer
sequences), the call's steps before it stay applied; the aborted step's values are restored
from the copy and its window emptied (window-level BatchNorm's pooled moments included; with
``micro_batch_size`` every window is one batch, so the window held only this step's
micro-batches; a window pending from before it is an error),
b is halved (rounded up), the step is traced anew, the held batch runs again, then the call's
remaining batches, still in the iterator: every update is applied once, exactly, no batch is
skipped or applied twice, and the logged metrics are those of the run without the error (to
float round-off: the loss is summed over other micro-batches). The
trainable variables and the optimizer change only in the window's one update, the step's last
part: a step that fails after its update began (``iterations`` moved) is not retried (its error
says so). The first batch the model trains on is read on the host (b is searched on it) and
run by the same compiled step before the loop.

A ``tf.distribute`` iterator, ``run_eagerly``, a dataset with parts other than dense tensors
(ragged, sparse, ``None``) and a Python iterable take another way: each batch is fetched on
the host and run by Keras's own train function, one batch per call (in a Python loop), after a
copy of the same values (and the accumulation state's variables) taken before every step
(on the device, ``tf.identity``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from accumcore._impl.gradients import first_leaf
from accumcore._impl.search import OUT_OF_MEMORY, nothing_fits, search_micro_batch

logger = logging.getLogger("accumcore")


def retrying_train_function(model: keras.Model, make: Callable[[], Callable],
                            probe: Callable[[Any, int], Any] | None = None) -> Callable:
    """The train function of a model with ``micro_batch_size="auto"``.

    Args:
        model: the model (its ``accumulation`` state holds the b found).
        make: makes Keras's train function anew for the state's current b (``model``'s own
            ``make_train_function(force=True)``, returning ``model.train_function``), for the
            batch-per-call way (a distributed iterator, ``run_eagerly``, a Python iterable).
        probe: ``probe(batch, b)``, one micro-batch's forward and backward pass on the first b
            samples of ``batch`` (raises the out-of-memory error if it does not fit); ``None``:
            no search, b starts at the batch's size.

    Returns:
        ``train_function(iterator)``, as Keras's: runs ``model.steps_per_execution`` batches
        of ``iterator`` and returns the last step's logs; ``StopIteration`` when it is empty.
    """
    runner = _Runner(model, make, probe)
    executions = _Executions(runner)

    def train_function(iterator: Any) -> Any:
        count = int(getattr(model, "steps_per_execution", 1) or 1)
        if (isinstance(iterator, tf.data.Iterator) and _dense(iterator.element_spec)
                and not model.run_eagerly and not model.accumulation.replicas.distributed):
            return executions.run(iterator, count)
        logs = None
        for data in _batches(iterator, count):
            logs = runner.run(data)
        if logs is None:
            raise StopIteration
        return logs

    train_function.kept = executions.kept  # what each step copies (read by the tests)
    return train_function


class _Runner:
    """Runs one batch with the state's b, shrinking b and rerunning while it runs out of
    memory; ``probes``: every ``(b, fitted)`` tried, in order; ``unchanged``: the ids of the
    model's non-trainable variables the first probe that fitted left unchanged (empty: no probe
    ran, or none)."""

    def __init__(self, model: keras.Model, make: Callable[[], Callable],
                 probe: Callable[[Any, int], Any] | None) -> None:
        self.model = model
        self.make = make
        self.probe = probe
        self.function: Callable | None = None
        self.probes: list[tuple[int, bool]] = []
        self.unchanged: set[int] = set()
        self.reported = False

    def run(self, data: Any) -> Any:
        """One batch, Keras's train function per call, a host copy before each try."""
        state = self.model.accumulation
        self.search_once(data)
        while True:
            if self.function is None:
                self.function = self.make()
            size = state.micro_batch_size
            before = _Snapshot(self.model, self.unchanged)
            try:
                logs = self.function(iter([data]))
            except OUT_OF_MEMORY as err:
                before.restore_or_raise(err)
                self.shrink(size, err)
                self.function = None
                continue
            self.report(data, size)
            return logs

    def search_once(self, data: Any) -> bool:
        """At the first batch, search b (returns whether it did)."""
        state = self.model.accumulation
        if state.micro_batch_size != "auto":
            return False
        state.micro_batch_size = self._search(data)
        return True

    def shrink(self, size: int, err: Exception) -> None:
        """b halved after a step with micro-batches of ``size`` ran out of memory (``err``);
        raises below one sample."""
        self.probes.append((size, False))
        if size <= 1:
            raise type(err)(err.node_def, err.op,
                            f"{nothing_fits(self.probes)} {err.message}") from err
        state = self.model.accumulation
        state.micro_batch_size = (size + 1) // 2
        logger.warning(
            "micro_batch_size='auto': a step with micro-batches of %d samples ran out "
            "of memory; the same batch runs again with micro-batches of %d (its update "
            "is applied once).", size, state.micro_batch_size)

    def _search(self, data: Any) -> int:
        """The largest b that fits one micro-batch of ``data`` (at most its size)."""
        samples = _samples(data)
        if self.probe is None or self.model.accumulation.replicas.distributed:
            return samples
        probes: list[tuple[int, bool]] = []

        def probe(size: int) -> None:  # changes nothing: every value restored
            before = _Snapshot(self.model)
            try:
                self.probe(data, size)
                if not any(fitted for _, fitted in probes):  # the first to run to its end
                    self.unchanged = before.unchanged()
            finally:
                before.restore()
                before.state.discard_window_layers()

        try:
            return search_micro_batch(probe, samples, probes)
        finally:
            self.probes.extend(probes)

    def report(self, data: Any, size: int) -> None:
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


class _Executions:
    """``steps_per_execution`` batches of a ``tf.data`` iterator per compiled call, read in the
    graph as a fixed b reads them; after an out-of-memory error the aborted batch (kept in
    :class:`_Held`) runs again with b halved, then the call's later batches."""

    def __init__(self, runner: _Runner) -> None:
        self.runner = runner
        self.model = runner.model
        self.kept = _Kept(runner)
        self.held: _Held | None = None
        self.functions: tuple[Callable, Callable] | None = None  # (one, loop) for the b

    def run(self, iterator: tf.data.Iterator, count: int) -> Any:
        """Up to ``count`` batches of ``iterator``; the last step's logs."""
        spec = iterator.element_spec
        if self.held is None or self.held.spec != spec:
            self.held, self.functions = _Held(spec), None
        pending, remaining, first = None, count, None
        if self.model.accumulation.micro_batch_size == "auto":  # search b on this batch
            optional = iterator.get_next_as_optional()
            if not optional.has_value():
                raise StopIteration
            pending = first = optional.get_value()
            remaining -= 1
            if self.runner.search_once(first):
                self.functions = None
        logs = self._run(iterator, pending, remaining)
        if logs is None:
            raise StopIteration
        if first is not None:
            self.runner.report(first, self.model.accumulation.micro_batch_size)
        return logs

    def _run(self, iterator: tf.data.Iterator, pending: Any, remaining: int) -> Any:
        """``pending`` (a batch, or ``None``), then up to ``remaining`` batches of
        ``iterator``, b halved and the aborted batch rerun while a step runs out of memory."""
        logs = None
        while True:
            if self.functions is None:
                self.functions = self._make()
            one, loop = self.functions
            size = self.model.accumulation.micro_batch_size
            try:
                if pending is not None:
                    logs, pending = one(pending), None
                if remaining:
                    out, ran = loop(iterator, _count(remaining))
                    logs, remaining = (out if int(ran) else logs), 0
                return logs
            except OUT_OF_MEMORY as err:
                if pending is None:  # a step of the loop: its batch is held
                    remaining -= int(self.held.completed.numpy()) + 1
                    pending = self.held.value()
                self.kept.restore_or_raise(err)
                self.runner.shrink(size, err)
                self.functions = None

    def _make(self) -> tuple[Callable, Callable]:
        """``one(batch)`` and ``loop(iterator, remaining)`` for the state's current b: each
        step is the model's ``train_step`` run by its strategy, compiled as Keras compiles it;
        ``loop`` reads each batch in the graph into :class:`_Held` first."""
        model, held, kept = self.model, self.held, self.kept

        def one_step(data: Any) -> Any:
            return model.distribute_strategy.run(model.train_step, args=(data,))

        step = tf.function(one_step, reduce_retracing=True, jit_compile=model.jit_compile)

        def counted_step(data: Any) -> Any:
            step.get_concrete_function(data)  # traced first: a first trace builds variables
            kept.save()
            logs = step(data)
            outputs = [t for t in tf.nest.flatten(logs) if tf.is_tensor(t)]
            with tf.control_dependencies(outputs):  # after the step's last op
                held.completed.assign_add(1)
            return logs

        def loop(iterator: tf.data.Iterator, remaining: tf.Tensor) -> tuple:
            logs = _zeros_like(step.get_concrete_function(held.spec).structured_outputs)
            kept.save()  # traced before the loop: the copies exist before its body uses them
            held.completed.assign(0)

            def body(ran: tf.Tensor, logs: Any) -> tuple:
                optional = iterator.get_next_as_optional()
                return tf.cond(optional.has_value(),
                               lambda: (ran + 1, counted_step(held.hold(optional.get_value()))),
                               lambda: (remaining, logs))

            # one iteration at a time: the next batch is held only once this step is done
            ran, logs = tf.while_loop(lambda ran, _: ran < remaining, body,
                                      (tf.constant(0, tf.int64), logs), parallel_iterations=1)
            return logs, held.completed.read_value()

        return tf.function(counted_step, reduce_retracing=True), tf.function(loop)


class _Held:
    """The batch the running step reads, kept in variables of its own (one per tensor of the
    dataset's element ``spec``, any shape): written as the loop reads it from the iterator,
    where an aborted step's batch stays for its rerun. ``completed``: the steps the current
    call completed (int64)."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        with tf.init_scope():
            self.variables = [tf.Variable(tf.zeros([0] * len(s.shape), s.dtype),
                                          shape=tf.TensorShape(None), trainable=False)
                              for s in tf.nest.flatten(spec)]
            self.completed = tf.Variable(0, dtype=tf.int64, trainable=False)

    def hold(self, batch: Any) -> Any:
        """Keep ``batch`` (the assignment takes over each tensor's buffer where nothing else
        holds it, else copies it); returns it read back, with its static shapes."""
        values = []
        for variable, tensor in zip(self.variables, tf.nest.flatten(batch), strict=True):
            variable.assign(tensor)
            value = variable.read_value()
            value.set_shape(tensor.shape)
            values.append(value)
        return tf.nest.pack_sequence_as(self.spec, values)

    def value(self) -> Any:
        """The batch held (eagerly: after a step was aborted)."""
        return tf.nest.pack_sequence_as(self.spec, [v.read_value() for v in self.variables])


@functools.lru_cache(maxsize=64)
def _count(steps: int) -> tf.Tensor:
    """``steps`` as an int64 scalar tensor, made once per value (not an eager op per call)."""
    with tf.init_scope():
        return tf.constant(steps, tf.int64)


def _zeros_like(outputs: Any) -> Any:
    """Zeros of the shapes and dtypes of a traced step's outputs (a loop's initial logs)."""
    return tf.nest.map_structure(lambda t: tf.zeros(t.shape, t.dtype), outputs)


def _dense(spec: Any) -> bool:
    """Whether a dataset's element spec is dense tensors only (no ``None`` part kept as an
    ``Optional``, no ragged or sparse tensor)."""
    return all(type(s) is tf.TensorSpec for s in tf.nest.flatten(spec))


def _stepped(model: keras.Model, unchanged: set[int]) -> list:
    """The model's non-trainable variables a step may change before its update: every one but
    those the first probe left unchanged (ids in ``unchanged``; one made later is kept)."""
    return [v for v in model.variables if not v.trainable and id(v) not in unchanged]


class _Kept:
    """The values a step may change before its update, copied in the graph at each step's
    start into variables of their own (:meth:`save`), restored after an aborted step;
    ``pairs``: each ``(variable, copy)``."""

    def __init__(self, runner: _Runner) -> None:
        self.runner = runner
        self.model = runner.model
        self.pairs: list[tuple[Any, tf.Variable]] = []
        self.known: set[int] = set()

    def _watched(self) -> list:
        model, state = self.model, self.model.accumulation
        window = {id(v) for v in (*state.accumulators, *state.undivided_accumulators)}
        watched = _stepped(model, self.runner.unchanged)
        watched += list(getattr(model, "metrics_variables", []))
        watched += [v for v in state.variables_for_saving() if id(v) not in window]
        return [*watched, model.optimizer.iterations]

    def save(self) -> None:
        """Copy every watched value (in a graph: at this point of its program order)."""
        for variable in self._watched():
            if id(variable) not in self.known:
                self.known.add(id(variable))
                with tf.init_scope():
                    copy = tf.Variable(tf.zeros_like(variable), trainable=False)
                self.pairs.append((variable, copy))
        for variable, copy in self.pairs:
            copy.assign(variable)

    def restore_or_raise(self, err: Exception) -> None:
        """Every value as at the aborted step's start and its window emptied, or raise if its
        update had begun or its window held an earlier micro-batch."""
        state = self.model.accumulation
        iterations = self.model.optimizer.iterations
        started = next((copy for variable, copy in self.pairs if variable is iterations), None)
        if started is None:  # out of memory before the step's first copy: nothing to rerun from
            raise err
        if int(iterations.numpy()) != int(started.numpy()):
            raise type(err)(err.node_def, err.op, (
                "The step ran out of memory after its optimizer update began, so it cannot "
                f"be rerun exactly: {err.message}")) from err
        for variable, copy in self.pairs:
            variable.assign(copy)
        if state.pending_micro_batches():
            raise type(err)(err.node_def, err.op, (
                "The step ran out of memory with a window pending from before it, so it "
                f"cannot be rerun exactly: {err.message}")) from err
        for accumulator in (*state.accumulators, *state.undivided_accumulators):
            accumulator.assign(tf.zeros(accumulator.shape, accumulator.dtype))
        state.discard_window_layers()


class _Snapshot:
    """The values a step may change before its update (the model's non-trainable variables
    but those whose ids are in ``unchanged``), copied on the device: restored before a rerun."""

    def __init__(self, model: keras.Model, unchanged: frozenset[int] | set[int] = frozenset()
                 ) -> None:
        self.state = state = model.accumulation
        self.stepped = [(v, tf.identity(v)) for v in _stepped(model, unchanged)]
        self.parts = [(part, tf.identity(part))
                      for v in state.variables_for_saving()
                      for part in state.replicas.parts(v)]
        self.parts += [(v, tf.identity(v)) for v in getattr(model, "metrics_variables", [])]
        self.parts += self.stepped
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
        self.state.discard_window_layers()

    def unchanged(self) -> set[int]:
        """The ids of the model's non-trainable variables equal to their copy (one host read
        per variable; a NaN counts as changed)."""
        return {id(v) for v, value in self.stepped
                if not bool(tf.reduce_any(tf.not_equal(v, value)).numpy())}

    def restore(self) -> None:
        """Every value as it was."""
        for variable, value in self.parts:
            variable.assign(value)


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
