"""The non-finite guard: what a micro-batch with NaN or Inf in its gradient does to the window.

A micro-batch is flagged when an element of its gradient is NaN or Inf (or its weight is), or
when one variable's gradient sums beyond the float range (``|sum| > 3.4e38`` in float32, a
gradient that large is overflow in all but name): the check is one sum per gradient
(``element_sum``), with no per-element pass.
A :class:`~accumcore.NonFinitePolicy` says what happens (skip the micro-batch, skip its window,
or freeze the state and raise from Python); its skip decision is injected, as optax's
``MultiSteps(should_skip_update_fn=...)``. A :class:`NonFiniteGuard` holds the state a freeze
needs (where it froze, the first offending variable, how many micro-batches it refused since),
writes it in the one rarely taken branch of a micro-step, and turns it into a
:class:`~accumcore.NonFiniteGradientError` or clears it, from Python.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import tensorflow as tf

from accumcore.config import NONFINITE_POLICIES, check_choice
from accumcore.errors import NonFiniteGradientError

logger = logging.getLogger("accumcore")


def finite(tensor, axes: dict | None = None) -> tf.Tensor:
    """bool scalar: every element of one (dense or IndexedSlices) tensor is finite.

    ``axes``: a dict ``rank -> reduction axes`` shared by the calls of one graph, so that
    tensors of the same rank reduce over one constant (one graph operation, not one each).
    """
    values = tensor.values if isinstance(tensor, tf.IndexedSlices) else tensor
    flags = tf.math.is_finite(values)
    return tf.reduce_all(flags, axis=_axes(flags, axes)) if flags.shape.rank != 0 else flags


def element_sum(tensor, axes: dict | None = None) -> tf.Tensor:
    """Float scalar: the sum of the elements of one (dense or IndexedSlices) tensor, in one
    pass; 16-bit floats are summed in float32.

    NaN and Inf propagate through a sum, so a finite sum proves every element finite; a
    non-finite one means a NaN or Inf, or elements whose sum overflows the float range
    (``|sum| > 3.4e38`` in float32). :meth:`NonFiniteGuard.admit` flags both: a gradient
    that large is overflow in all but name. ``axes``: a dict ``rank -> reduction axes`` shared
    by the calls of one graph (one constant per rank).
    """
    values = tensor.values if isinstance(tensor, tf.IndexedSlices) else tensor
    if values.dtype in (tf.float16, tf.bfloat16):
        values = tf.cast(values, tf.float32)
    return tf.reduce_sum(values, axis=_axes(values, axes)) if values.shape.rank != 0 else values


def finite_each(scalars: Sequence[tf.Tensor]) -> tf.Tensor:
    """bool vector: which of the float ``scalars`` are finite (one ``IsFinite`` when they
    share a dtype, as float32 gradient sums and the weight do)."""
    if len({t.dtype for t in scalars}) == 1:
        return tf.math.is_finite(tf.stack(scalars))
    return tf.stack([tf.math.is_finite(t) for t in scalars])


def _axes(tensor: tf.Tensor, axes: dict | None):
    """All of ``tensor``'s axes as one constant shared per rank (``None``: every axis)."""
    rank = tensor.shape.rank
    if axes is None or rank is None:
        return None
    if rank not in axes:
        axes[rank] = tf.constant(list(range(rank)), tf.int32)
    return axes[rank]


def all_finite(tensors: Sequence) -> tf.Tensor:
    """bool scalar: every element of every (dense or IndexedSlices) tensor is finite."""
    flags = [finite(t) for t in tensors if t is not None]
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


def has_nonfinite(grads: Sequence, weight: tf.Tensor) -> tf.Tensor:
    """The default ``should_skip``: bool scalar, ``True`` for any NaN or Inf in ``grads`` or
    ``weight``, or a gradient whose elements sum beyond the float range
    (``element_sum``: one pass per gradient;
    :meth:`NonFiniteGuard.admit` computes the same, keeping the per-gradient flags for the
    diagnosis: ``gradients_finite``)."""
    return tf.logical_not(gradients_finite(grads, weight)[0])


def gradients_finite(grads: Sequence, weight: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``(all_ok, checks)``: ``checks`` is a bool vector, whether each gradient present (not
    ``None``) has a finite ``element_sum``, then whether ``weight``
    is finite (the freeze's diagnosis reads it); ``all_ok`` (bool scalar) reduces it."""
    axes: dict = {}  # one reduction-axes constant per rank, shared by the sums and the flags
    sums = [element_sum(g, axes) for g in grads if g is not None]
    checks = finite_each([*sums, tf.cast(weight, tf.float32)])
    return tf.reduce_all(checks, axis=_axes(checks, axes)), checks


@dataclass(frozen=True)
class NonFinitePolicy:
    """What a bad micro-batch does to the window.

    Attributes:
        name: the policy's name (``get_config``, ``AccumulationState.nonfinite``).
        freeze: on a flagged micro-batch, keep the state as it was before it and let
            :meth:`~accumcore.AccumulationState.raise_if_nonfinite` raise from Python;
            otherwise skip the micro-batch (its samples counted in ``samples_dropped``).
        skip_window: a skipped micro-batch also discards its whole window when it closes.
        should_skip: ``f(grads, weight) -> bool scalar`` on every micro-batch's gradients (of
            its summed loss) and weight; by default
            ``has_nonfinite``.
    """

    name: str
    freeze: bool = False
    skip_window: bool = False
    should_skip: Callable[[Sequence, tf.Tensor], tf.Tensor] = has_nonfinite


#: The public ``nonfinite=`` names and the policies they stand for.
NONFINITE = {
    "raise": NonFinitePolicy("raise", freeze=True),
    "skip_micro_batch": NonFinitePolicy("skip_micro_batch"),
    "skip_window": NonFinitePolicy("skip_window", skip_window=True),
}

#: The policy under a LossScaleOptimizer, where overflow is expected. No micro-batch is
#: checked; the window is checked once when it closes and skipped whole (the loss scale is
#: lowered).
LOSS_SCALED = NonFinitePolicy("loss_scaling", should_skip=lambda grads, weight: tf.constant(False))


def nonfinite_policy(nonfinite: str | NonFinitePolicy) -> NonFinitePolicy:
    """The policy for a ``nonfinite=`` argument: one of ``NONFINITE``'s names or a policy."""
    if isinstance(nonfinite, NonFinitePolicy):
        return nonfinite
    return NONFINITE[check_choice(nonfinite, "nonfinite", NONFINITE_POLICIES)]


class NonFiniteGuard:
    """Freeze, diagnosis and clear for ``nonfinite="raise"``.

    Args:
        refused: int64 scalar variable, the micro-batches refused since the state froze, the
            bad one included (0: not frozen).
        record: int64 variable of shape ``[3]``, where the state froze: the run's micro-batch
            index, its position in its window and the index of the first offending trainable
            variable (-1, or the number of variables: only the micro-batch weight was not
            finite); -1 each while not frozen.
        parts: ``variable -> tuple`` of the copies a write here must reach (one, or every
            local replica's: ``accumcore.distribute.Replicas.parts``).
    """

    def __init__(self, refused, record, parts: Callable[[tf.Variable], tuple]) -> None:
        self.refused = refused
        self.record = record
        self._parts = parts

    @property
    def frozen(self) -> tf.Tensor:
        """Whether a non-finite gradient froze the state (a bool scalar tensor)."""
        return self.refused > 0

    def admit(self, policy: NonFinitePolicy, grads: Sequence, weight: tf.Tensor,
              add: Callable[[], None], skip: Callable[[], None],
              where: Callable[[], tuple]) -> tf.Tensor:
        """One micro-batch through the policy: ``add()`` unless it is flagged (or the state is
        frozen, under a freezing policy), else ``skip()`` or :meth:`refuse`, in one ``cond``
        without outputs (its predicate says what happened).

        Args:
            policy: the non-finite policy.
            grads: the micro-batch's gradients (``None`` for variables without one).
            weight: its weight ``c_i`` (float32 scalar).
            add, skip: the window's two outcomes (they write variables, return nothing).
            where: ``() -> (window position, run micro-step)``, for a freeze's record.

        Returns:
            bool scalar: whether the micro-batch was added.
        """
        present = [(i, g) for i, g in enumerate(grads) if g is not None]
        checks = None  # per-gradient finiteness (the weight's last), reused by the diagnosis
        if policy.should_skip is has_nonfinite:
            ok, checks = gradients_finite(grads, weight)  # one pass per gradient
        else:
            ok = tf.logical_not(policy.should_skip(grads, weight))
        if not policy.freeze:
            tf.cond(ok, add, skip)
            return ok

        fresh = tf.equal(self.refused.value(), 0)  # not frozen: read once, predicate and record
        added = tf.logical_and(ok, fresh)

        def refuse() -> None:
            flags = checks if checks is not None else tf.stack(
                [*(finite(g) for _, g in present), finite(weight)])
            self.refuse(flags, [i for i, _ in present], *where(), fresh=fresh)

        tf.cond(added, add, refuse)
        return added

    def refuse(self, flags: tf.Tensor, indices: Sequence[int],
               window_position: tf.Tensor, micro_step: tf.Tensor, *,
               fresh: tf.Tensor | None = None) -> None:
        """The rare branch of a micro-step: a bad micro-batch freezes the state (recording
        where, and its first non-finite gradient); every refused micro-batch is counted.

        Args:
            flags: bool vector, the finiteness of each gradient present, then of the
                micro-batch weight (``len(indices) + 1`` entries).
            indices: the trainable-variable index of each of those gradients.
            window_position, micro_step: where this micro-batch is (int64 scalars).
            fresh: whether the state is not frozen yet, when the caller has read it
                (:meth:`admit`); read here otherwise.
        """
        if fresh is None:
            fresh = tf.equal(self.refused.value(), 0)
        self.refused.assign_add(1)
        # The first offending gradient: its position among `flags`, len(indices) for the weight
        # (a trainable-variable index once mapped through `indices`; -1 for the weight).
        first = tf.argmin(tf.cast(flags, tf.int32))
        if list(indices) != list(range(len(indices))):
            first = tf.gather(tf.constant([*indices, -1], tf.int64), first)
        where = tf.stack([tf.cast(t, tf.int64) for t in (micro_step, window_position, first)])
        self.record.assign(tf.where(fresh, where, self.record.value()))

    def _local(self, variable: tf.Variable) -> list[int]:
        return [int(part.numpy()) for part in self._parts(variable)]

    def error(self, names: Sequence[str], accum_steps: int,
              epoch: int | None = None) -> NonFiniteGradientError | None:
        """The error for a frozen state (``None`` if not frozen); read from Python.

        Under a strategy: the first local replica that froze (each checks its own shard).
        """
        records = [part.numpy().tolist() for part in self._parts(self.record)]
        replica = max(range(len(records)), key=lambda r: records[r][0])
        step, position, index = records[replica]
        if step < 0:
            return None
        unused = self._local(self.refused)[replica] - 1  # refused after the bad one
        # len(names) (every variable had a gradient) or -1: only the weight was not finite.
        variable = names[index] if 0 <= index < len(names) else "<micro-batch weight>"
        where = f"epoch {epoch}, " if epoch is not None else ""
        return NonFiniteGradientError(
            f"Non-finite gradient (NaN or Inf, or elements summing beyond the float range) at "
            f"{where}micro-step {step} (position {position} "
            f"in its window of {accum_steps}); first offending variable: {variable}. "
            "That micro-batch was not accumulated; the window before it is intact and kept. "
            f"{unused} later micro-batch(es) were seen while the state was frozen and not "
            f"used{' (the rest of that epoch)' if epoch is not None else ''}. "
            "Training is stopped until this is cleared: the next `fit` (AccumModel.fit or "
            "AccumTrainer.fit) clears it and continues that window with its data; in your "
            "own loop call `state.clear_nonfinite()` (`model.accumulation` / "
            "`trainer.state`) to continue, then `model.flush()` / `trainer.flush()` to apply "
            "the kept window now or `state.drop_window()` to discard it. "
            "Fix the data or the learning rate, or pass nonfinite='skip_micro_batch' or "
            "'skip_window' to skip such micro-batches.",
            micro_step=step,
            window_position=position,
            variable=variable,
            epoch=epoch,
            unused_micro_batches=unused,
        )

    def clear(self, pending: int, samples: int) -> bool:
        """Unfreeze (from Python); ``pending`` / ``samples``: the kept window, for the log.

        Returns:
            Whether the state was frozen.
        """
        with tf.init_scope():
            step = max(int(part.numpy()[0]) for part in self._parts(self.record))
        if step < 0:
            return False
        logger.warning(
            "accumcore: cleared the non-finite gradient stop (micro-step %d); the window "
            "before it (%d micro-batches, %d samples) is kept and continues with the next "
            "micro-batches. Call model.flush() / trainer.flush() before training to apply it "
            "now, or state.drop_window() to discard it.", step, pending, samples,
        )
        self.record.assign([-1, -1, -1])
        self.refused.assign(0)
        return True
