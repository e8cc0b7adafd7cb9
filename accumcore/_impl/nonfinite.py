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

from accumcore._impl.config import NONFINITE_POLICIES, check_choice
from accumcore._impl.errors import NonFiniteGradientError

logger = logging.getLogger("accumcore")


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
    """What a non-finite gradient does.

    Attributes:
        name: the policy's name (``get_config``, ``AccumulationState.nonfinite``).
        freeze: a bad window is discarded whole and stops training:
            :meth:`~accumcore.AccumulationState.raise_if_nonfinite` raises
            :class:`~accumcore.NonFiniteGradientError` from Python, and every window after it
            is discarded until the stop is cleared.
        skip_window: a bad window is discarded whole (counted in ``windows_skipped``).
        should_skip: ``f(grads, weight) -> bool scalar``, checked on every micro-batch's
            gradients (of its summed loss) and weight: ``True`` leaves that micro-batch out
            (counted in ``micro_batches_skipped``), or condemns its window under ``freeze`` or
            ``skip_window``. ``None``: no micro-batch is checked; the window is, at its close.
    """

    name: str
    freeze: bool = False
    skip_window: bool = False
    should_skip: Callable[[Sequence, tf.Tensor], tf.Tensor] | None = None


#: The public ``nonfinite=`` names and the policies they stand for.
NONFINITE = {
    "raise": NonFinitePolicy("raise", freeze=True),
    "skip_micro_batch": NonFinitePolicy("skip_micro_batch", should_skip=has_nonfinite),
    "skip_window": NonFinitePolicy("skip_window", skip_window=True),
}


def nonfinite_policy(nonfinite: str | NonFinitePolicy) -> NonFinitePolicy:
    """The policy for a ``nonfinite=`` argument: one of ``NONFINITE``'s names or a policy."""
    if isinstance(nonfinite, NonFinitePolicy):
        return nonfinite
    return NONFINITE[check_choice(nonfinite, "nonfinite", NONFINITE_POLICIES)]


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
            in cross-replica context: ``accumcore._impl.distribute.Replicas.parts``).
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
        where = f"epoch {epoch}, " if epoch is not None else ""
        return NonFiniteGradientError(
            f"Non-finite gradient (NaN or Inf, or elements summing beyond the float range) in "
            f"{where}window {window} (micro-batches {first} to {first + count - 1} of the run); "
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
