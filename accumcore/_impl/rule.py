"""The window rule: a micro-batch in, a window out.

* :func:`add`: micro-batch ``i`` adds ``c_i grad(L_i)`` (the gradient of its summed loss) to the
  window's accumulators and ``c_i`` to its weight ``W``.
* :func:`close`: when the window holds K micro-batches (or any, for a flush), its mean gradient
  ``sum_i c_i grad(L_i) / W``, the skip decision, one ``optimizer.apply`` and :func:`end`.

Every special case (the non-finite policy, a ``LossScaleOptimizer``, the replicas) is resolved
once, into a :class:`Plan`, before the first step is traced: these functions branch on no flag.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import tensorflow as tf

from accumcore._impl import loss_scaling
from accumcore._impl.nonfinite import NonFinitePolicy, element_sum


@dataclass
class Window:
    """The open window's variables: ``accumulators`` (``sum_i c_i grad(L_i)``, float32, or
    float64 for float64 variables), ``weight`` (``W = sum_i c_i``, float32), ``micro_step`` (the
    micro-batches in it, int64), ``samples`` (int64) and ``poisoned`` (int64, 1 once a flagged
    micro-batch condemned it). ``with_gradient``: which accumulators received a gradient when
    :func:`add` was traced (``False``: the loss does not depend on that variable)."""

    accumulators: list
    weight: tf.Variable
    micro_step: tf.Variable
    samples: tf.Variable
    poisoned: tf.Variable
    with_gradient: list = field(default_factory=list)

    @property
    def variables(self) -> list:
        return [*self.accumulators, self.weight, self.micro_step, self.samples, self.poisoned]


@dataclass
class Counters:
    """The run-long counts (int64 variables). Samples that reached an update are
    ``samples_seen - samples_dropped - window.samples``."""

    windows_applied: tf.Variable
    windows_skipped: tf.Variable
    micro_batches_seen: tf.Variable
    micro_batches_skipped: tf.Variable
    samples_seen: tf.Variable
    samples_dropped: tf.Variable


@dataclass(frozen=True)
class Plan:
    """The rule's special cases, resolved once (:func:`plan`) into callables.

    Attributes:
        admit: ``admit(grads, weight, accept, flag) -> bool scalar``: runs ``accept()`` (add
            the micro-batch) or, if a per-micro-batch check flags it, ``flag()``.
        poison_window: whether ``flag`` condemns the window (else only the micro-batch goes).
        check: ``check(sums) -> float32 scalar``, 1 if the window's sums are not all finite
            at the close, else 0 (always 0: the window is not checked there).
        stopped: ``stopped() -> bool scalar``: training is stopped (``"raise"``, after a bad
            window: every window is skipped until the stop is cleared).
        on_skip: ``on_skip(bad, window, counters, present)``, run only when a window is
            skipped (``"raise"``: the first bad window is recorded there).
        update: ``update(optimizer, variables, grads) -> bool scalar``, the window's one
            optimizer update (whether it was applied).
        after_update: ``after_update(optimizer, applied)``, run after every closed window.
        replicas: where each step runs (``accumcore._impl.distribute``).
    """

    admit: Callable
    poison_window: bool
    check: Callable
    stopped: Callable
    on_skip: Callable
    update: Callable
    after_update: Callable
    replicas: object


def add(window: Window, counters: Counters, plan: Plan, grads: Sequence, weight: tf.Tensor,
        samples: tf.Tensor, distributed: bool) -> tf.Tensor:
    """Add one micro-batch (``grads`` of its summed loss, its weight ``c_i``, its samples) and
    count it into the window. Returns whether it was added (bool scalar)."""
    window.with_gradient = [g is not None for g in grads]

    def accept() -> None:
        for accumulator, g in zip(window.accumulators, grads, strict=True):
            add_gradient(accumulator, g, distributed)
        window.weight.assign_add(weight)
        window.samples.assign_add(samples)

    def flag() -> None:
        counters.micro_batches_skipped.assign_add(1)
        counters.samples_dropped.assign_add(samples)
        window.poisoned.assign_add(int(plan.poison_window))

    added = plan.admit(grads, weight, accept, flag)
    window.micro_step.assign_add(1)
    counters.micro_batches_seen.assign_add(1)
    counters.samples_seen.assign_add(samples)
    return added


def close(window: Window, counters: Counters, plan: Plan, optimizer, variables: list,
          normalize: bool, hooks: Sequence) -> tf.Tensor:
    """Close the window: its status reduced over the replicas (one reduction), the verdict,
    ``sum / W`` applied once unless the window is skipped, then :func:`end`. Returns whether
    an optimizer update was applied (bool scalar)."""
    present = [i for i, has in enumerate(window.with_gradient) if has]
    weight, poisoned, samples, nonfinite, sums = plan.replicas.reduce_window(
        window, present, plan.check, optimizer)
    bad = tf.logical_or(tf.logical_or(poisoned > 0, nonfinite > 0),
                        tf.logical_not(tf.math.is_finite(weight)))
    skip = tf.logical_or(tf.logical_or(bad, samples <= 0), plan.stopped())

    def skipped() -> tf.Tensor:
        plan.on_skip(bad, window, counters, present)
        return tf.constant(False)

    def apply_mean(*shares) -> tf.Tensor:
        totals = shares or [window.accumulators[i].value() for i in present]
        grads = [None] * len(window.accumulators)
        scale = tf.math.divide_no_nan(1.0, weight) if normalize else tf.constant(1.0)
        for i, total in zip(present, totals, strict=True):  # sum * (1 / W): one multiply
            grads[i] = total * tf.cast(scale, total.dtype) if normalize else total
        return plan.update(optimizer, variables, grads)

    applied = tf.cond(skip, skipped, lambda: plan.replicas.on_replicas(apply_mean, sums))
    plan.after_update(optimizer, applied)
    return end(window, counters, plan.replicas, applied, hooks)


def end(window: Window, counters: Counters, replicas, applied: tf.Tensor | bool,
        hooks: Sequence, *, counted: bool = True) -> tf.Tensor:
    """Every window ends here, applied, skipped or dropped (``counted=False``: counted only in
    ``samples_dropped``): counted, the window hooks run (``hook(applied: bool)``), emptied (every
    local copy under a strategy). Returns ``applied`` as a bool scalar."""
    known = tf.get_static_value(applied)
    if known is None and hooks:
        return tf.cond(applied, lambda: end(window, counters, replicas, True, hooks,
                                            counted=counted),
                       lambda: end(window, counters, replicas, False, hooks, counted=counted))
    applied_n = tf.cast(applied, tf.int64)
    # Under a strategy each replica's copy counts its own shard (summed when read).
    for dropped, pending in zip(replicas.parts(counters.samples_dropped),
                                replicas.parts(window.samples), strict=True):
        dropped.assign_add((1 - applied_n) * pending.value())
    outcomes = ((counters.windows_applied, applied_n), (counters.windows_skipped, 1 - applied_n))
    for counter, n in outcomes if counted else ():
        for part in replicas.parts(counter):
            part.assign_add(n)
    for hook in hooks:
        hook(bool(known))
    for variable in window.variables:
        for part in replicas.parts(variable):
            part.assign(tf.zeros(part.shape, part.dtype))
    return tf.convert_to_tensor(applied)


def add_gradient(accumulator: tf.Variable, g, distributed: bool) -> None:
    """``accumulator += g`` (dense, ``IndexedSlices`` rows, or ``None``: nothing)."""
    if g is None:
        return
    if not isinstance(g, tf.IndexedSlices):
        # A new buffer, not assign_add: after the window's reset the accumulator's buffer is a
        # shared zeros constant, which an in-place add would first copy.
        accumulator.assign(accumulator.value() + tf.cast(g, accumulator.dtype))
        return
    values = tf.cast(g.values, accumulator.dtype)
    if distributed:  # a replica-local (ON_READ) variable has no scatter_add
        accumulator.assign_add(tf.math.unsorted_segment_sum(
            values, g.indices, num_segments=accumulator.shape[0]))
    else:
        accumulator.scatter_add(tf.IndexedSlices(values, g.indices, g.dense_shape))


def apply_update(optimizer, variables: list, grads: list) -> tf.Tensor:
    """The library's one ``optimizer.apply``, in the variables' dtypes; bool scalar, whether it
    updated (a ``LossScaleOptimizer`` skips an overflowed window itself)."""
    grads = [None if g is None else tf.cast(g, tf.as_dtype(v.dtype))
             for g, v in zip(grads, variables, strict=True)]
    optimizer.apply(grads, variables)
    return loss_scaling.window_applied(optimizer, grads)


def _apply_unscaled(optimizer, variables: list, grads: list) -> tf.Tensor:
    return apply_update(optimizer.inner_optimizer, variables,
                        loss_scaling.unscale(optimizer, grads))


def _nothing(*_ignored) -> None:
    return None


def _admit_all(grads, weight, accept: Callable, flag: Callable) -> tf.Tensor:
    accept()
    return tf.constant(True)


def _admit_unless(should_skip: Callable) -> Callable:
    def admit(grads, weight, accept: Callable, flag: Callable) -> tf.Tensor:
        added = tf.logical_not(should_skip(grads, weight))
        tf.cond(added, accept, flag)
        return added
    return admit


def _no_check(sums: Sequence) -> tf.Tensor:
    return tf.constant(0.0)


def _never() -> tf.Tensor:
    return tf.constant(False)


def plan(policy: NonFinitePolicy, optimizer, replicas, stop) -> Plan:
    """The :class:`Plan` for a non-finite ``policy``, an ``optimizer`` and the ``replicas``;
    ``stop``: the ``"raise"`` policy's record (``accumcore._impl.nonfinite.Stop``).

    A ``LossScaleOptimizer`` expects overflow: no micro-batch is checked, and the window is
    checked by the optimizer's own ``apply`` (one replica) or, under a strategy, in the close's
    one reduction, with ``LossScaleOptimizer``'s scale rule mirrored
    (``accumcore._impl.loss_scaling``). Otherwise ``"raise"`` and ``"skip_window"`` check the window
    at its close and ``"skip_micro_batch"`` (or a policy's own ``should_skip``) each micro-batch.
    """
    if loss_scaling.is_loss_scale_optimizer(optimizer):
        if not replicas.distributed:
            return Plan(_admit_all, False, _no_check, _never, _nothing, apply_update, _nothing,
                        replicas)
        return Plan(_admit_all, False, window_nonfinite, _never, _nothing, _apply_unscaled,
                    loss_scaling.update_scale, replicas)
    admit = _admit_all if policy.should_skip is None else _admit_unless(policy.should_skip)
    return Plan(admit, policy.skip_window or policy.freeze,
                window_nonfinite if policy.should_skip is None else _no_check,
                (lambda: stop.stopped) if policy.freeze else _never,
                stop.record if policy.freeze else _nothing, apply_update, _nothing, replicas)


def window_nonfinite(sums: Sequence[tf.Tensor]) -> tf.Tensor:
    """float32 scalar: 1 if an element of the window's ``sums`` is NaN or Inf, or their
    elements add up beyond the float range (``element_sum``: NaN and Inf propagate through the
    sums, so one finite total proves every element finite), else 0."""
    if not sums:
        return tf.constant(0.0)
    totals = [element_sum(s) for s in sums]
    if len({t.dtype for t in totals}) > 1:
        totals = [tf.cast(t, tf.float64) for t in totals]
    return tf.cast(tf.logical_not(tf.math.is_finite(tf.add_n(totals))), tf.float32)
