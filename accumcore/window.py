"""The open window: the gradient sums, their weight, and how many micro-batches it holds.

A :class:`Window` adds one micro-batch (``sum_i c_i grad(L_i)`` per variable, ``W = sum_i c_i``,
its samples), says when it is due, gives its mean gradient ``sum / W`` and empties itself. It
writes only its own variables; what a bad micro-batch does is the non-finite guard's
(``accumcore.nonfinite``) and what is counted over the run is :class:`Counters`'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf


class Window:
    """The current window's variables and the four things done to them.

    Args:
        accumulators: one variable per trainable variable, float32 (float64 for float64
            variables): ``sum_i c_i grad(L_i)`` of the window.
        weight: float32 scalar variable, ``W = sum_i c_i``.
        micro_step: int64 scalar variable, the micro-batches in the window (0..K).
        samples: int64 scalar variable, the samples in the window.
        poisoned: int64 scalar variable, 1 once a skipped micro-batch condemned the window
            (``nonfinite="skip_window"``).
        parts: ``variable -> tuple`` of the copies a write must reach (one, or every local
            replica's in cross-replica context: ``accumcore.distribute.Replicas.parts``).
        distributed: the accumulators are replica-local (``ON_READ``): sparse rows are added
            densely (those variables have no ``scatter_add``).
    """

    def __init__(self, accumulators: Sequence[tf.Variable], weight, micro_step, samples,
                 poisoned, parts: Callable[[tf.Variable], tuple], distributed: bool) -> None:
        self.accumulators = accumulators
        self.weight = weight
        self.micro_step = micro_step
        self.samples = samples
        self.poisoned = poisoned
        self._parts = parts
        self._distributed = distributed
        #: Which accumulators received a gradient (a ``None`` gradient means that the loss
        #: does not depend on that variable); set by :meth:`add`, read by :meth:`mean`.
        self.has_gradient = [True] * len(accumulators)

    @property
    def variables(self) -> list[tf.Variable]:
        """Everything :meth:`reset` empties (accumulators, weight, count, samples, flag)."""
        return [*self.accumulators, self.weight, self.micro_step, self.samples, self.poisoned]

    def add(self, grads: Sequence, weight: tf.Tensor, samples: tf.Tensor) -> None:
        """Add one micro-batch: ``grads`` (of its summed loss; dense, ``IndexedSlices`` or
        ``None``), its weight ``c_i`` (float32) and its samples (int64). Not counted into
        the window (:meth:`advance`)."""
        for acc, g in zip(self.accumulators, grads, strict=True):
            if g is None:
                continue
            if not isinstance(g, tf.IndexedSlices):
                acc.assign_add(tf.cast(g, acc.dtype))
                continue
            values = tf.cast(g.values, acc.dtype)
            if self._distributed:
                # A replica-local (ON_READ) variable has no scatter_add: add the rows as one
                # dense tensor (repeated indices summed, as scatter_add does).
                acc.assign_add(tf.math.unsorted_segment_sum(
                    values, g.indices, num_segments=acc.shape[0]))
            else:
                acc.scatter_add(tf.IndexedSlices(values, g.indices, g.dense_shape))
        self.weight.assign_add(weight)
        self.samples.assign_add(samples)

    def advance(self, one: tf.Tensor | int = 1) -> tf.Tensor | int:
        """Count one micro-batch into the window (``one``: the caller's int64 constant 1);
        returns ``one``, for the caller's other counts."""
        self.micro_step.assign_add(one)
        return one

    def due(self, count: tf.Tensor, accum_steps: int, *, force: bool) -> tf.Tensor:
        """bool scalar: ``count`` (the window's micro-batches) makes it due: K of them, or any
        with ``force`` (a flush)."""
        return count > 0 if force else count >= accum_steps

    def mean(self, weight: tf.Tensor, sums: Sequence | None = None, *,
             normalize: bool = True) -> list:
        """The window's gradient, one entry per accumulator (``None`` where none was added).

        Args:
            weight: ``W``, the window's total weight (all replicas), float32 scalar.
            sums: the gradient sums to use instead of the accumulators (one per accumulator
                with a gradient: under a strategy, this replica's share of the reduced sums).
            normalize: divide by ``W`` (mean losses); ``False``: a summed loss, as it is.
        """
        given = iter(sums or ())
        grads = []
        for acc, has in zip(self.accumulators, self.has_gradient, strict=True):
            if not has:
                grads.append(None)
                continue
            total = next(given) if sums else acc.value()
            if normalize:
                total = tf.math.divide_no_nan(total, tf.cast(weight, total.dtype))
            grads.append(total)
        return grads

    def reset(self, like: Sequence | None = None) -> None:
        """Empty the window (every local copy under a strategy, reading nothing).

        ``like``: the window's mean gradient just computed in this graph (:meth:`mean`, one
        entry per accumulator, ``None`` where none): an accumulator with an entry is zeroed as
        ``ZerosLike`` of it, one graph operation instead of a constant and a fill of its shape.
        """
        zeros: dict = {}  # dtype -> its scalar 0, shared by the window's variables
        shaped = [*(like or ()), *[None] * (len(self.variables) - len(like or ()))]
        for variable, mean in zip(self.variables, shaped, strict=True):
            if mean is not None:
                variable.assign(tf.raw_ops.ZerosLike(x=mean))
                continue
            for part in self._parts(variable):
                if part.dtype not in zeros:
                    zeros[part.dtype] = tf.zeros((), part.dtype)
                part.assign(_zeros_like(part, zeros[part.dtype]))


def _zeros_like(variable: tf.Variable, zero: tf.Tensor) -> tf.Tensor:
    """Zeros of ``variable``'s shape: ``zero`` itself for a scalar, a constant when small (as
    ``tf.zeros`` makes), else ``zero`` filled (``tf.zeros`` would add a constant of its own)."""
    size = variable.shape.num_elements()
    if variable.shape.rank == 0:
        return zero
    if size is not None and size < 1000:
        return tf.zeros(variable.shape, variable.dtype)
    return tf.fill(variable.shape if size is not None else tf.shape(variable), zero)


class Counters:
    """The run-long counts (int64 variables), written when a micro-batch is seen or skipped and
    when a window ends.

    ``windows_applied``, ``windows_skipped``, ``micro_batches_seen``, ``micro_batches_skipped``,
    ``samples_seen`` (counted into windows, applied or pending, plus skipped micro-batches) and
    ``samples_dropped`` (a dropped or skipped window, a skipped micro-batch). Samples that
    reached an update: ``samples_seen - samples_dropped - window_samples``.
    """

    NAMES = ("windows_applied", "windows_skipped", "micro_batches_seen",
             "micro_batches_skipped", "samples_seen", "samples_dropped")

    def __init__(self, variables: dict[str, tf.Variable],
                 parts: Callable[[tf.Variable], tuple]) -> None:
        for name in self.NAMES:
            setattr(self, name, variables[name])
        self._parts = parts

    def skip(self, samples: tf.Tensor) -> None:
        """A skipped micro-batch: seen elsewhere, its samples reach no update."""
        self.micro_batches_skipped.assign_add(1)
        self.samples_dropped.assign_add(samples)

    def end_window(self, applied: tf.Tensor | bool, window_samples: tf.Variable, *,
                   counted: bool) -> None:
        """Count a window that ends (``applied`` statically known or a bool scalar); its
        samples count as dropped unless it was applied. ``counted=False``: a dropped window,
        counted only in ``samples_dropped``."""
        known = tf.get_static_value(applied)
        if known is None:  # 0 or 1 window of each outcome
            applied_n = tf.cast(applied, tf.int64)
            outcomes = [(self.windows_applied, applied_n), (self.windows_skipped, 1 - applied_n)]
        else:
            outcomes = [(self.windows_applied if known else self.windows_skipped, 1)]
        if counted:
            for counter, n in outcomes:
                for part in self._parts(counter):
                    part.assign_add(n)
        if known:
            return
        for dropped, pending in zip(self._parts(self.samples_dropped),
                                    self._parts(window_samples), strict=True):
            samples = pending.value()
            dropped.assign_add(samples if known is not None else (1 - applied_n) * samples)
