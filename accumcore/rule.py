"""The window rule, as functions of an :class:`~accumcore.AccumulationState`: one micro-batch in,
one window closed.

* :func:`accumulate`: a micro-batch's gradient of its summed loss, its weight and its samples
  into the window, through the non-finite policy (one ``cond``; the rare branch skips or
  freezes).
* :func:`close_if_due` and :func:`close`: when the window holds K micro-batches (or any, for a
  flush), its mean gradient ``sum_i c_i grad(L_i) / sum_i c_i``, the skip decision, one
  :func:`apply_update` (the library's only ``optimizer.apply``) and :func:`end_window`. Under a
  ``tf.distribute`` strategy ``accumcore.distribute.StrategyReplicas.close`` is the close.

The state's methods of the same names (``state.accumulate``, ``state.step``, ...) call these.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from accumcore import loss_scaling
from accumcore.layout import variable_dtype
from accumcore.nonfinite import LOSS_SCALED


def accumulate(state, grads: Sequence, weight, samples, optimizer=None, *,
               advance: bool = False) -> tf.Tensor:
    """:meth:`AccumulationState.accumulate <accumcore.AccumulationState.accumulate>`: add
    one micro-batch; returns whether it was added (bool scalar)."""
    window, counters, guard = state.window, state.run_counters, state.guard
    window.has_gradient = [g is not None for g in grads]
    weight = tf.cast(weight, tf.float32)
    samples = tf.cast(samples, tf.int64)
    scaled = loss_scaling.is_loss_scale_optimizer(optimizer)
    policy = LOSS_SCALED if scaled else state.nonfinite_policy
    # Counted as seen inside `add` when refused micro-batches are not seen (a freeze) or
    # nothing is ever refused (loss scaling); else once, after the decision.
    inside = policy.freeze or scaled

    def add() -> None:
        window.add(grads, weight, samples)
        if inside:
            counters.samples_seen.assign_add(samples)
            if advance:
                state.advance()

    def skip() -> None:
        counters.skip(samples)
        if policy.skip_window:
            window.poisoned.assign(1)

    if scaled:  # no micro-batch is checked: the window is, when it closes
        add()
        return tf.constant(True)
    added = guard.admit(policy, grads, weight, add, skip, where=lambda: (
        window.micro_step.value(), counters.micro_batches_seen.value()))
    if not inside:
        counters.samples_seen.assign_add(samples)  # added or skipped: seen either way
        if advance:  # a skipped micro-batch still takes its place in the window
            state.advance()
    return added


def close_if_due(state, optimizer, variables: list, *, force: bool) -> tf.Tensor:
    """Close the window if it holds K micro-batches (any, with ``force``): bool scalar,
    whether an optimizer update was applied.

    Under a strategy this runs in cross-replica context, where the replicas' window counters
    agree (they advance in lockstep): the first one's decides.
    """
    replicas = state.replicas
    due = state.window.due(replicas.first(state.micro_step), state.accum_steps, force=force)
    if force and not replicas.distributed:
        # One replica: a frozen state keeps its window (the Python side raises). Under a
        # strategy the frozen flag is part of the window's status (distribute's close).
        due = tf.logical_and(due, tf.logical_not(state.frozen))
    if not replicas.distributed and state.nonfinite_policy.freeze and (
            not loss_scaling.is_loss_scale_optimizer(optimizer)):
        # Under a freezing policy a due window is always applied (`close`): the cond needs no
        # outputs, and whether it applied is whether it was due.
        tf.cond(due, lambda: _no_output(close(state, optimizer, variables)), _no_output)
        return due
    return tf.cond(due, lambda: close(state, optimizer, variables), lambda: tf.constant(False))


def _no_output(*_ignored) -> None:
    """A ``cond`` branch's result when the ``cond`` has no outputs."""
    return None  # a body besides the docstring: AutoGraph cannot convert an empty one


def close(state, optimizer, variables: list) -> tf.Tensor:
    """Close a due window: its mean gradient, the skip decision, one update, its end.

    A window is skipped when a micro-batch condemned it (``"skip_window"``) or none of its
    micro-batches was added; under ``"raise"`` neither can happen (a frozen state is never
    due), and a ``LossScaleOptimizer`` skips an overflowed window itself. Under a strategy
    ``accumcore.distribute.StrategyReplicas.close`` is the close, with the window's one
    status reduction.

    Returns:
        bool scalar: whether an optimizer update was applied.
    """
    if state.replicas.distributed:
        return state.replicas.close(state, optimizer, variables)
    window = state.window

    def mean() -> list:
        return window.mean(window.weight.value(), normalize=state.normalize)

    if state.nonfinite_policy.freeze or loss_scaling.is_loss_scale_optimizer(optimizer):
        grads = mean()  # applied, unless a LossScaleOptimizer skips the window itself
        return end_window(state, apply_update(optimizer, variables, grads), like=grads)
    skip = tf.logical_or(window.poisoned > 0, window.samples <= 0)
    applied = tf.cond(skip, lambda: tf.constant(False),
                      lambda: apply_update(optimizer, variables, mean()))
    return end_window(state, applied)


def apply_update(optimizer, variables: list, grads: list, *,
                 unscale: bool = False) -> tf.Tensor:
    """The window's optimizer update: the library's one ``apply`` call (under a strategy, in
    replica context: each replica applies its share, Keras all-reduces them).

    Args:
        grads: the window's gradient, one entry per variable (``None``: no gradient).
        unscale: apply the unscaled gradient with the inner optimizer of a
            ``LossScaleOptimizer`` (under a strategy: ``accumcore.loss_scaling``).

    Returns:
        bool scalar: whether the update was applied (a LossScaleOptimizer skips an
        overflowed window itself).
    """
    target = optimizer
    if unscale:
        target, grads = optimizer.inner_optimizer, loss_scaling.unscale(optimizer, grads)
    grads = [None if g is None else tf.cast(g, variable_dtype(v))
             for g, v in zip(grads, variables, strict=True)]
    target.apply(grads, variables)
    return loss_scaling.window_applied(target, grads)


def end_window(state, applied: tf.Tensor | bool, *, counted: bool = True,
               like: list | None = None) -> tf.Tensor:
    """Every window ends here, applied, skipped or dropped: counted, the window hooks run,
    then emptied (under a strategy: every local copy, from cross-replica context).

    Args:
        applied: a Python bool or a bool scalar tensor. Known statically, only that outcome
            is written; otherwise the hooks (which take a Python bool) run in one ``cond``, a
            branch per outcome.
        counted: count the window in ``windows_applied`` / ``windows_skipped`` (``False``: a
            dropped window, counted only in ``samples_dropped``).
        like: the window's mean gradient, if computed here (one device): what
            ``reset`` shapes its zeros like.

    Returns:
        bool scalar: ``applied``.
    """
    known = tf.get_static_value(applied)
    if known is None and state.window_hooks:
        return tf.cond(applied, lambda: end_window(state, True, counted=counted, like=like),
                       lambda: end_window(state, False, counted=counted, like=like))
    state.run_counters.end_window(applied, state.window.samples, counted=counted)
    for hook in state.window_hooks:
        hook(bool(known))
    state.window.reset(like)
    return applied if tf.is_tensor(applied) else tf.constant(applied)
