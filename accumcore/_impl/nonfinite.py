"""Non-finite gradients: what counts, what each policy does, and the ``"raise"`` policy's stop.

A gradient is non-finite when an element is NaN or Inf, or when its elements sum beyond the
float range (``|sum| > 3.4e38`` in float32: overflow in all but name). One sum per gradient
decides (:func:`element_sum`): NaN and Inf propagate through a sum, so a finite sum proves every
element finite. They also propagate through the window's sums (and 0 * Inf is NaN), so
``"raise"`` and ``"skip_window"`` check each window once, at its close; ``"skip_micro_batch"``,
which must know which micro-batch to leave out, checks every micro-batch, as does a
:class:`NonFinitePolicy` with its own ``should_skip`` (an injected decision, as optax's
``MultiSteps(should_skip_update_fn=...)``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import tensorflow as tf

logger = logging.getLogger("accumcore")


class NonFiniteGradientError(FloatingPointError):
    """A window's gradient was not finite (NaN or Inf, or elements summing beyond the float
    range) under ``nonfinite="raise"``.

    That window was discarded whole, unapplied; the windows before it are applied and
    untouched, so a checkpoint taken now holds no NaN. Training stays stopped (later windows
    are discarded) until the stop is cleared: the next ``fit`` clears it (logged); in a custom
    loop call ``state.clear_nonfinite()``.

    The message counts epochs, windows and micro-batches from 1 (epoch 2, window 3 of the
    run, its micro-batches 7 to 9); the attributes count from 0, as Keras counts epochs.

    Attributes:
        window: 0-based index of the bad window since training started.
        first_micro_step: 0-based index (over the run) of its first micro-batch.
        micro_batches: how many micro-batches it held.
        variable: name of the first trainable variable whose window gradient was not finite.
        epoch: 0-based epoch, when the caller knows it (else ``None``).
        unused_micro_batches: micro-batches seen after the bad window while training was
            stopped, so not used (``fit`` checks once per epoch: the rest of that epoch).
    """

    def __init__(self, message: str, *, window: int, first_micro_step: int, micro_batches: int,
                 variable: str, epoch: int | None = None, unused_micro_batches: int = 0):
        # no ``-> None``: the API page documents an exception's __init__ hints with the
        # class, and a return type there would read as the exception's
        super().__init__(message)
        self.window = window
        self.first_micro_step = first_micro_step
        self.micro_batches = micro_batches
        self.variable = variable
        self.epoch = epoch
        self.unused_micro_batches = unused_micro_batches


def element_sum(tensor) -> tf.Tensor:
    """Float scalar: the sum of the elements of one (dense or IndexedSlices) tensor, in one
    pass; 16-bit floats are summed in float32. Finite exactly when every element is finite and
    their sum stays in the float range."""
    values = tensor.values if isinstance(tensor, tf.IndexedSlices) else tensor
    if values.dtype in (tf.float16, tf.bfloat16):
        values = tf.cast(values, tf.float32)
    return tf.reduce_sum(values)


def has_nonfinite(grads: Sequence, weight: tf.Tensor) -> tf.Tensor:
    """``"skip_micro_batch"``'s ``should_skip``: bool scalar, ``True`` when a gradient in
    ``grads`` (``None`` entries ignored) or ``weight`` is not finite (:func:`element_sum`)."""
    flags = [tf.math.is_finite(element_sum(g)) for g in grads if g is not None]
    flags.append(tf.math.is_finite(tf.cast(weight, tf.float32)))
    return tf.logical_not(tf.reduce_all(tf.stack(flags)))


@dataclass(frozen=True)
class NonFinitePolicy:
    """What a non-finite gradient does, as one object (pass it as ``nonfinite=``).

    The three built-in policies, ``nonfinite="raise"``, ``"skip_micro_batch"`` and
    ``"skip_window"``, are instances of this class, looked up by name. A policy of your own is
    one instance with its own name: ``should_skip`` decides which micro-batches are bad, and
    ``freeze`` / ``skip_window`` what a bad one does to its window and to training, e.g.
    ``NonFinitePolicy("large", skip_window=True, should_skip=f)``. Under a
    ``LossScaleOptimizer`` (mixed precision) the optimizer checks the window itself.

    Attributes:
        name: the policy's name (``get_config``, ``AccumulationState.nonfinite``).
        freeze: a bad window is discarded whole and stops training:
            :meth:`~accumcore.AccumulationState.raise_if_nonfinite` raises
            :class:`~accumcore.NonFiniteGradientError` from Python, and every window after it
            is discarded until the stop is cleared.
        skip_window: a bad window is discarded whole (counted in ``windows_skipped``).
        should_skip (~collections.abc.Callable | None): ``f(grads, weight) -> bool scalar``,
            checked on every micro-batch's gradients (of its summed loss) and weight: ``True``
            leaves that micro-batch out (counted in ``micro_batches_skipped``), or condemns its
            window under ``freeze`` or ``skip_window``. ``None``: no micro-batch is checked;
            the window is, at its close.
    """

    name: str
    freeze: bool = False
    skip_window: bool = False
    should_skip: Callable[[Sequence, tf.Tensor], tf.Tensor] | None = None

    @property
    def condemns_window(self) -> bool:
        """Whether a flagged micro-batch condemns its whole window (else only it is left out)."""
        return self.freeze or self.skip_window

    def admit(self, grads: Sequence, weight: tf.Tensor, accept: Callable[[], None],
              flag: Callable[[], None]) -> tf.Tensor:
        """Add one micro-batch, or flag it when ``should_skip`` says so.

        Args:
            grads: its gradients (of its summed loss), one per trainable variable.
            weight: its ``c_i``, what its loss divided it by, float32 scalar.
            accept: adds it to the window.
            flag: records it as left out (or its window as condemned).

        Returns:
            bool scalar: whether it was added.
        """
        if self.should_skip is None:
            accept()
            return tf.constant(True)
        added = tf.logical_not(self.should_skip(grads, weight))
        tf.cond(added, accept, flag)
        return added

    def judge_window(self, sums: Sequence[tf.Tensor]) -> tf.Tensor:
        """float32 scalar at the window's close: 1 if its gradient ``sums`` (the window's
        accumulators, one per trainable variable) are not finite, else 0; always 0 when each
        micro-batch was checked."""
        if self.should_skip is not None:
            return tf.constant(0.0)
        return window_nonfinite(sums)

    def stopped(self, stop: Stop) -> tf.Tensor:
        """bool scalar: training is stopped (``freeze``, after a bad window; ``stop``: the
        state's stop record)."""
        return stop.stopped if self.freeze else tf.constant(False)

    def on_skip(self, stop: Stop, bad: tf.Tensor, window, counters,
                present: Sequence[int]) -> None:
        """Run at the close of a skipped window (non-finite, condemned by a flagged
        micro-batch, empty, or any window while training is stopped); a ``freeze`` policy
        records the first bad one in ``stop``.

        Args:
            stop: the state's stop record (where ``"raise"`` keeps the bad window's position).
            bad: bool scalar: the window is bad (its gradient sums or weight are not
                finite, or a flagged micro-batch condemned it).
            window: the window's variables (its accumulators, weight and micro-batch count).
            counters: the state's run-long counters (windows and micro-batches seen).
            present: the indices of the accumulators that received a gradient.
        """
        if self.freeze:
            stop.record(bad, window, counters, present)

    def fit_logs(self, state) -> dict:
        """What ``fit`` logs of this policy's skips, read from ``state`` (the
        :class:`~accumcore.AccumulationState`): ``skipped_micro_batches`` and
        ``skipped_windows``; nothing for a ``freeze`` policy, which raises instead."""
        if self.freeze:
            return {}
        return {"skipped_micro_batches": state.micro_batches_skipped,
                "skipped_windows": state.windows_skipped}


def window_nonfinite(sums: Sequence[tf.Tensor]) -> tf.Tensor:
    """float32 scalar: 1 if an element of the window's ``sums`` is NaN or Inf, or their
    elements add up beyond the float range (:func:`element_sum`: NaN and Inf propagate through
    the sums, so one finite total proves every element finite), else 0."""
    if not sums:
        return tf.constant(0.0)
    totals = [element_sum(s) for s in sums]
    if len({t.dtype for t in totals}) > 1:
        totals = [tf.cast(t, tf.float64) for t in totals]
    return tf.cast(tf.logical_not(tf.math.is_finite(tf.add_n(totals))), tf.float32)


#: The one registry of ``nonfinite=`` names and the policies they stand for.
POLICIES = {
    policy.name: policy for policy in (
        NonFinitePolicy("raise", freeze=True),
        NonFinitePolicy("skip_micro_batch", should_skip=has_nonfinite),
        NonFinitePolicy("skip_window", skip_window=True),
    )
}


def nonfinite_policy(nonfinite: str | NonFinitePolicy) -> NonFinitePolicy:
    """The policy for a ``nonfinite=`` argument: a built-in policy's name (``"raise"``,
    ``"skip_micro_batch"``, ``"skip_window"``) or a policy.

    Raises:
        ValueError: for an unknown name, naming the accepted ones.
    """
    if isinstance(nonfinite, NonFinitePolicy):
        return nonfinite
    if not isinstance(nonfinite, str) or nonfinite not in POLICIES:
        raise ValueError(
            f"Unknown `nonfinite`={nonfinite!r}; expected one of "
            f"{', '.join(map(repr, POLICIES))}, or an accumcore.NonFinitePolicy."
        )
    return POLICIES[nonfinite]


class Stop:
    """The ``"raise"`` policy's stop: where training stopped, written in graph at a bad
    window's close, turned into a :class:`~accumcore.NonFiniteGradientError` or cleared from
    Python.

    Args:
        record: int64 variable of shape ``[4]``: the bad window's index, its first micro-batch
            (counted over the run), its micro-batches, and the index of its first non-finite
            trainable variable (-1: its weight, or a micro-batch flagged by a ``should_skip``);
            -1 each while training is not stopped.
        parts: ``variable -> tuple`` of the copies a write must reach (every local replica's
            in cross-replica context).
    """

    def __init__(self, record: tf.Variable, parts: Callable[[tf.Variable], tuple]) -> None:
        self.record_variable = record
        self._parts = parts

    @property
    def stopped(self) -> tf.Tensor:
        """Whether a bad window stopped training (a bool scalar tensor)."""
        return self.record_variable[0] >= 0

    def record(self, bad: tf.Tensor, window, counters, present: Sequence[int]) -> None:
        """At a skipped window's close: record it if it is ``bad`` and the first since the
        stop was cleared, with its first non-finite variable (one sum of each accumulator in
        ``present``: this runs only when a window is skipped)."""
        flags = [tf.logical_not(tf.math.is_finite(element_sum(window.accumulators[i].value())))
                 for i in present]
        first = tf.constant(-1, tf.int64)
        if present:
            index = tf.gather(tf.constant(present, tf.int64), tf.argmax(tf.cast(flags, tf.int32)))
            first = tf.where(tf.reduce_any(flags), index, first)
        micro_step = tf.cast(window.micro_step.value(), tf.int64)
        where = tf.stack([counters.windows_applied + counters.windows_skipped,
                          counters.micro_batches_seen - micro_step, micro_step, first])
        fresh = tf.logical_and(bad, tf.logical_not(self.stopped))
        for part in self._parts(self.record_variable):
            part.assign(tf.where(fresh, where, part.value()))

    def error(self, names: Sequence[str], micro_batches_seen: int,
              epoch: int | None = None) -> NonFiniteGradientError | None:
        """The error for a stopped run (``None`` if not stopped); read from Python.
        ``names``: the trainable variables' names; ``micro_batches_seen``: the run's count."""
        window, first, count, index = (int(v) for v in self._parts(self.record_variable)[0].numpy())
        if window < 0:
            return None
        unused = micro_batches_seen - first - count
        variable = names[index] if 0 <= index < len(names) else "<window weight or flagged>"
        # The message counts from 1 (the error's attributes from 0, as Keras counts epochs).
        where = f"epoch {epoch + 1}, " if epoch is not None else ""
        return NonFiniteGradientError(
            f"Non-finite gradient (NaN or Inf, or elements summing beyond the float range) in "
            f"{where}window {window + 1} of the run (its micro-batches {first + 1} to "
            f"{first + count} of the run; all counted from 1); "
            f"first non-finite variable: {variable}. That window was discarded whole, "
            "unapplied; the windows before it are applied and untouched. "
            f"{unused} later micro-batch(es) were seen while training was stopped and not "
            f"used{' (the rest of that epoch)' if epoch is not None else ''}. "
            "The next `fit` clears the stop and continues with its data; in your own loop "
            "call `state.clear_nonfinite()`. Fix the data or the learning rate, or pass "
            "nonfinite='skip_micro_batch' (leave out only the bad micro-batches) or "
            "'skip_window' (skip such windows and go on).",
            window=window, first_micro_step=first, micro_batches=count, variable=variable,
            epoch=epoch, unused_micro_batches=unused,
        )

    def clear(self) -> bool:
        """Clear the stop (from Python). Returns whether training was stopped."""
        stopped = int(self._parts(self.record_variable)[0].numpy()[0]) >= 0
        if stopped:
            logger.warning("accumcore: cleared the non-finite gradient stop; training goes on "
                           "with the next micro-batches.")
            for part in self._parts(self.record_variable):
                part.assign([-1, -1, -1, -1])
        return stopped
