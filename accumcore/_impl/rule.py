"""The window rule, whole: a micro-batch in, a window out.

* :func:`step`: one micro-batch of any entry point: :func:`add`, then :func:`close_window`.
* :func:`single_window`: a window of exactly one micro-batch (a batch not split, K = 1): a
  clean one applied directly (:func:`apply_direct`, the accumulators untouched), any other
  through :func:`add` and :func:`close`.
* :func:`add`: micro-batch ``i`` adds ``c_i grad(L_i)`` (the gradient of its summed loss) to the
  window's accumulators and ``c_i`` to its weight ``W`` (and the gradient of its sums over
  samples beside a mean loss, ``U_i``, to the undivided accumulators).
* :func:`close_window`: :func:`close_if_due` where every replica can be read; it closes
  (:func:`close`) if the window holds K micro-batches (any, for a flush).
* :func:`close`: the window's mean gradient ``sum_i c_i grad(L_i) / W + sum_i U_i``, the skip
  decision, one ``optimizer.apply`` (:func:`apply_update`, the library's only one) and
  :func:`end`.
* :func:`end`: every window ends there, applied, skipped or dropped.

Calls go one way: the entry points call the state (``accumcore._impl.state``), which checks a
micro-batch's inputs once and calls these functions with the window, the counters and the
plan, never the state. Every special case (the non-finite policy, a ``LossScaleOptimizer``, the
replicas, a summed loss) is resolved once per (state, optimizer) into a :class:`Plan`
(:func:`plan`, cached by the state): these functions branch on no flag.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf

from accumcore._impl import loss_scaling
from accumcore._impl.nonfinite import NonFinitePolicy, Stop, window_nonfinite


@dataclass
class Window:
    """The open window's variables: ``accumulators`` (``sum_i c_i grad(L_i)``, float32, or
    float64 for float64 variables), ``weight`` (``W = sum_i c_i``, float32), ``micro_step`` (the
    micro-batches in it, int64), ``samples`` (int64), ``poisoned`` (int64, 1 once a flagged
    micro-batch condemned it) and ``undivided`` (``sum_i U_i``, the sums over samples beside
    a mean loss, applied undivided; empty where the loss has none)."""

    accumulators: list
    weight: tf.Variable
    micro_step: tf.Variable
    samples: tf.Variable
    poisoned: tf.Variable
    undivided: list = field(default_factory=list)

    @property
    def variables(self) -> list:
        return [*self.accumulators, self.weight, self.micro_step, self.samples, self.poisoned,
                *self.undivided]


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
    """The rule's special cases for one (state, optimizer), resolved once (:func:`plan`).

    Attributes:
        admit: ``admit(grads, weight, accept, flag) -> bool scalar``: runs ``accept()`` (add
            the micro-batch) or, if a per-micro-batch check flags it, ``flag()``.
        condemns_window: whether ``flag`` condemns the window (else only the micro-batch goes).
        judge: ``judge(sums) -> float32 scalar``, 1 if the window's sums are not all finite
            at the close, else 0 (always 0: the window is not checked there).
        stopped: ``stopped() -> bool scalar``: training is stopped (``"raise"``, after a bad
            window: every window is skipped until the stop is cleared).
        on_skip: ``on_skip(bad, window, counters, present)``, run only when a window is
            skipped (``"raise"``: the first bad window is recorded there).
        update: ``update(optimizer, variables, grads) -> bool scalar``, the window's one
            optimizer update (whether it was applied).
        after_update: ``after_update(optimizer, applied)``, run after every closed window.
        replicas: where each step runs (``accumcore._impl.distribute``).
        decide: ``decide(fn, key=None)``: ``fn()`` where every replica can be read (one
            replica: called now).
        on_replicas: ``on_replicas(update, sums)``: the update run on the replicas (one
            replica: ``update(*sums)``).
        accum_steps: K, the micro-batches that make a window due.
        normalize: whether the window's sum is divided by ``W`` (``False``: a summed loss).
        hooks: the state's window hooks, ``hook(applied: bool)`` (window-level BatchNorm).
        flags: the per-micro-batch check, ``flags(grads, weight) -> bool scalar`` (``True``:
            the micro-batch is left out or condemns its window), or ``None`` (none).
        direct: whether a window of one micro-batch may be applied without the accumulators
            (:func:`single_window`): one replica, and the policy's own ``admit``.
    """

    admit: Callable
    condemns_window: bool
    judge: Callable
    stopped: Callable
    on_skip: Callable
    update: Callable
    after_update: Callable
    replicas: Any
    decide: Callable
    on_replicas: Callable
    accum_steps: int
    normalize: bool
    hooks: Sequence
    flags: Callable | None = None
    direct: bool = False


def plan(policy: NonFinitePolicy, optimizer, replicas, stop: Stop, *, accum_steps: int = 1,
         normalize: bool = True, hooks: Sequence = ()) -> Plan:
    """The :class:`Plan` for a non-finite ``policy``, an ``optimizer`` and the ``replicas``;
    ``stop``: the ``"raise"`` policy's record; ``accum_steps``, ``normalize``, ``hooks``: the
    state's.

    A ``LossScaleOptimizer`` expects overflow: no micro-batch is checked, and the window is
    checked by the optimizer's own ``apply`` (one replica) or, under a strategy, in the close's
    one reduction, with ``LossScaleOptimizer``'s scale rule mirrored
    (``accumcore._impl.loss_scaling``). Otherwise the policy decides (its ``admit``,
    ``judge_window``, ``stopped`` and ``on_skip``).
    """
    distributed = replicas.distributed
    common = dict(replicas=replicas, accum_steps=accum_steps, normalize=normalize, hooks=hooks,
                  decide=replicas.decide if distributed else _now,
                  on_replicas=replicas.on_replicas if distributed else _on_one_replica)
    if loss_scaling.is_loss_scale_optimizer(optimizer):
        if not replicas.distributed:
            return Plan(_admit_all, False, _no_check, _never, _nothing, apply_update, _nothing,
                        direct=True, **common)
        return Plan(_admit_all, False, window_nonfinite, _never, _nothing, _apply_unscaled,
                    loss_scaling.update_scale, **common)

    def stopped() -> tf.Tensor:
        return policy.stopped(stop)

    def on_skip(bad, window, counters, present) -> None:
        policy.on_skip(stop, bad, window, counters, present)

    # A policy that checks no micro-batch adds every one: the same as its own `admit`.
    checks_none = policy.should_skip is None and type(policy).admit is NonFinitePolicy.admit
    return Plan(_admit_all if checks_none else policy.admit, policy.condemns_window,
                policy.judge_window, stopped, on_skip, apply_update, _nothing,
                flags=policy.should_skip,
                direct=not distributed and type(policy).admit is NonFinitePolicy.admit,
                **common)


def present_of(grads: Sequence) -> tuple[int, ...]:
    """The indices of the variables that have a gradient in ``grads`` (``None``: the loss does
    not depend on that variable, so the window leaves it to the optimizer untouched)."""
    return tuple(i for i, g in enumerate(grads) if g is not None)


def step(window: Window, counters: Counters, plan: Plan, optimizer, variables: list,
         present: Sequence[int], grads: Sequence, weight, samples,
         undivided: Sequence | None = None) -> tf.Tensor:
    """One micro-batch of any entry point, its inputs checked by the state: :func:`add`, then
    :func:`close_if_due` where every replica can be read (the window closes if it holds K
    micro-batches).

    Args:
        optimizer: the Keras optimizer the window is applied with.
        variables: the variables the window is accumulated for (``present``: the indices of
            those with a gradient).
        grads: gradients of the micro-batch's summed loss, one per variable (or ``None``).
        weight: ``c_i``, float scalar; samples: the micro-batch's samples, int scalar.
        undivided: gradients of its sums over samples beside a mean loss (``None``: none).

    Returns:
        bool scalar: whether an optimizer update was applied.
    """
    add(window, counters, plan, grads, tf.cast(weight, tf.float32), tf.cast(samples, tf.int64),
        undivided)
    return plan.decide(functools.partial(close_if_due, window, counters, plan, optimizer,
                                         variables, present, force=False))


def single_window(window: Window, counters: Counters, plan: Plan, optimizer, variables: list,
                  present: Sequence[int], grads: Sequence, weight, samples) -> tf.Tensor:
    """A window of exactly one micro-batch, opened and closed by this call (a batch that is
    not split, or K = 1), on one replica (``plan.direct``): where the window is empty, the
    micro-batch is clean (no check flags it, its gradient sums and weight are finite, it has
    samples) and training is not stopped, its mean gradient ``grads / c_i`` goes to the
    optimizer directly (:func:`apply_direct`), the accumulators untouched; otherwise
    :func:`add` and :func:`close`, as a window of one micro-batch always closes. Either way
    the same update and counts.

    Args: as :func:`step` (``undivided``: none).

    Returns:
        bool scalar: whether an optimizer update was applied.
    """
    weight, samples = tf.cast(weight, tf.float32), tf.cast(samples, tf.int64)
    bad = tf.logical_or(plan.judge([grads[i] for i in present]) > 0,
                        tf.logical_not(tf.math.is_finite(weight)))
    if plan.flags is not None:
        bad = tf.logical_or(bad, plan.flags(grads, weight))
    clean = tf.logical_and(tf.logical_and(tf.logical_not(bad), samples > 0),
                           tf.logical_and(tf.logical_not(plan.stopped()),
                                          tf.equal(window.micro_step, 0)))

    def through_window() -> tf.Tensor:
        add(window, counters, plan, grads, weight, samples)
        return close(window, counters, plan, optimizer, variables, present)

    return tf.cond(clean, functools.partial(apply_direct, window, counters, plan, optimizer,
                                            variables, present, grads, weight, samples),
                   through_window)


def apply_direct(window: Window, counters: Counters, plan: Plan, optimizer, variables: list,
                 present: Sequence[int], grads: Sequence, weight: tf.Tensor,
                 samples: tf.Tensor) -> tf.Tensor:
    """A clean window of one micro-batch applied without its accumulators: what :func:`add`
    and :func:`close` compute (each gradient dense, in its accumulator's dtype, times
    ``1 / c_i``: an ``IndexedSlices`` made dense as the window's sum is, because Keras's
    optimizers update repeated rows of a sparse gradient differently) and count
    (``windows_applied``, or for a ``LossScaleOptimizer`` that skips an overflow
    ``windows_skipped`` and ``samples_dropped``). Returns whether an update was applied."""
    scale = tf.math.divide_no_nan(1.0, weight)
    means = [None] * len(window.accumulators)
    for i in present:
        g = dense(grads[i], window.accumulators[i].dtype)
        means[i] = g * tf.cast(scale, g.dtype) if plan.normalize else g
    applied = plan.update(optimizer, variables, means)
    plan.after_update(optimizer, applied)
    counters.micro_batches_seen.assign_add(1)
    counters.samples_seen.assign_add(samples)
    if tf.get_static_value(applied) is not None and bool(tf.get_static_value(applied)):
        counters.windows_applied.assign_add(1)
        return tf.convert_to_tensor(applied)
    applied_n = tf.cast(applied, tf.int64)
    counters.windows_applied.assign_add(applied_n)
    counters.windows_skipped.assign_add(1 - applied_n)
    counters.samples_dropped.assign_add((1 - applied_n) * samples)
    return tf.convert_to_tensor(applied)


def close_window(window: Window, counters: Counters, plan: Plan, optimizer, variables: list,
                 present: Sequence[int], *, force: bool, key: Any = None) -> tf.Tensor:
    """:func:`close_if_due`, where every replica can be read (``plan.decide``; ``key``: the
    cache key of a cross-replica close). Returns whether an update was applied."""
    return plan.decide(functools.partial(close_if_due, window, counters, plan, optimizer,
                                         variables, present, force=force), key)


def add(window: Window, counters: Counters, plan: Plan, grads: Sequence, weight: tf.Tensor,
        samples: tf.Tensor, undivided: Sequence | None = None) -> tf.Tensor:
    """Add one micro-batch (``grads`` of its summed loss, its weight ``c_i``, its samples, and
    ``undivided``: the gradients of its sums over samples beside a mean loss, or ``None``)
    and count it into the window. Returns whether it was added (bool scalar)."""
    distributed = plan.replicas.distributed
    pairs = list(zip(window.accumulators, grads, strict=True))
    if undivided is not None:
        pairs += zip(window.undivided, undivided, strict=True)
        grads = [*grads, *undivided]  # checked together

    def accept() -> None:
        for accumulator, g in pairs:
            add_gradient(accumulator, g, distributed)
        window.weight.assign_add(weight)
        window.samples.assign_add(samples)

    def flag() -> None:
        counters.micro_batches_skipped.assign_add(1)
        counters.samples_dropped.assign_add(samples)
        window.poisoned.assign_add(int(plan.condemns_window))

    added = plan.admit(grads, weight, accept, flag)
    window.micro_step.assign_add(1)
    counters.micro_batches_seen.assign_add(1)
    counters.samples_seen.assign_add(samples)
    return added


def close_if_due(window: Window, counters: Counters, plan: Plan, optimizer, variables: list,
                 present: Sequence[int], *, force: bool) -> tf.Tensor:
    """Close the window if it holds K micro-batches (any, with ``force``: a flush); under a
    strategy in cross-replica context, where the replicas' counts agree (lockstep). Returns
    whether an optimizer update was applied (bool scalar)."""
    count = plan.replicas.first(window.micro_step)
    due = count > 0 if force else count >= plan.accum_steps
    return tf.cond(due, functools.partial(close, window, counters, plan, optimizer, variables,
                                          present), lambda: tf.constant(False))


def close(window: Window, counters: Counters, plan: Plan, optimizer, variables: list,
          present: Sequence[int]) -> tf.Tensor:
    """Close the window: its status reduced over the replicas (one reduction), the verdict,
    ``sum / W`` (plus the undivided sum) applied once to the variables in ``present`` unless
    the window is skipped, then :func:`end`. Returns whether an optimizer update was applied
    (bool scalar)."""
    present = list(present)
    weight, poisoned, samples, nonfinite, sums = plan.replicas.reduce_window(
        window, window_sums(window, present), plan.judge, optimizer)
    bad = tf.logical_or(tf.logical_or(poisoned > 0, nonfinite > 0),
                        tf.logical_not(tf.math.is_finite(weight)))
    skip = tf.logical_or(tf.logical_or(bad, samples <= 0), plan.stopped())

    def skipped() -> tf.Tensor:
        plan.on_skip(bad, window, counters, present)
        return tf.constant(False)

    def apply_mean(*shares) -> tf.Tensor:
        totals = list(shares) or [a.value() for a in window_sums(window, present)]
        grads = [None] * len(window.accumulators)
        scale = tf.math.divide_no_nan(1.0, weight)
        for k, i in enumerate(present):  # sum * (1 / W): one multiply
            total = totals[k]
            grads[i] = total * tf.cast(scale, total.dtype) if plan.normalize else total
            if window.undivided:
                grads[i] += totals[len(present) + k]
        return plan.update(optimizer, variables, grads)

    applied = tf.cond(skip, skipped, functools.partial(plan.on_replicas, apply_mean, sums))
    plan.after_update(optimizer, applied)
    return end(window, counters, plan.replicas, applied, plan.hooks)


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


def window_sums(window: Window, present: Sequence[int]) -> list:
    """The accumulators the window's close reads, in the order it reads them: those in
    ``present``, then the undivided ones in ``present`` (where they exist)."""
    return [window.accumulators[i] for i in present] + (
        [window.undivided[i] for i in present] if window.undivided else [])


def dense(g, dtype: tf.DType) -> tf.Tensor:
    """A gradient (dense or ``IndexedSlices``: its rows summed) as a dense tensor of
    ``dtype``, as its accumulator would hold it."""
    if isinstance(g, tf.IndexedSlices):
        g = tf.IndexedSlices(tf.cast(g.values, dtype), g.indices, g.dense_shape)
    return tf.cast(tf.convert_to_tensor(g), dtype)


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


def _now(fn: Callable[[], tf.Tensor], key: Any = None) -> tf.Tensor:
    return fn()


def _on_one_replica(update: Callable, sums: list) -> tf.Tensor:
    return update(*sums)


def _admit_all(grads, weight, accept: Callable, flag: Callable) -> tf.Tensor:
    accept()
    return tf.constant(True)


def _no_check(sums: Sequence) -> tf.Tensor:
    return tf.constant(0.0)


def _never() -> tf.Tensor:
    return tf.constant(False)


# ---------------------------------------------------------------------------- the step's inputs
def variable_name(variable) -> str:
    """A variable's path (Keras 3) or name."""
    return getattr(variable, "path", None) or variable.name


def describe_change(old: list[str], new: list[str]) -> str:
    """``"+a/kernel, -b/bias"``: variables that became trainable (+) or frozen (-)."""
    added = [f"+{n}" for n in new if n not in old]
    removed = [f"-{n}" for n in old if n not in new]
    parts = added + removed
    return ", ".join(parts[:6] + (["..."] if len(parts) > 6 else [])) or "same names, new objects"


def same_variables(built: Sequence, variables: Sequence) -> bool:
    """Whether ``variables`` are exactly ``built``: the same objects, in the same order."""
    variables = tuple(variables)
    return len(variables) == len(built) and all(a is b for a, b in zip(variables, built))


def check_gradients(grads: Sequence, accumulators: Sequence[tf.Variable],
                    name: str = "grads") -> None:
    """Raise unless ``grads`` (the parameter ``name``) are one per accumulator, in order
    (compatible shapes)."""
    if len(grads) != len(accumulators):
        raise ValueError(
            f"Got {len(grads)} gradients for {len(accumulators)} accumulators: "
            f"`{name}` must match the trainable variables the state was built from, one per "
            "variable and in the same order (use `tape.gradient(loss, "
            "model.trainable_variables)`)."
        )
    for g, acc in zip(grads, accumulators):
        if g is not None and g.shape.rank is not None and acc.shape.rank is not None:
            shape = g.dense_shape if isinstance(g, tf.IndexedSlices) else g.shape
            if isinstance(shape, tf.TensorShape) and not shape.is_compatible_with(acc.shape):
                raise ValueError(
                    f"Gradient of shape {shape} does not match accumulator "
                    f"{acc.name} of shape {acc.shape}: `{name}` must be in the order of the "
                    "trainable variables the state was built from."
                )


def check_variables(built: Sequence, variables: Sequence) -> None:
    """Raise unless ``variables`` are the ones the accumulators were built for (``built``)."""
    if not same_variables(built, variables):
        names = [variable_name(v) for v in variables]
        built_names = [variable_name(v) for v in built]
        raise ValueError(
            f"The trainable variables ({len(names)}) are not the ones the accumulators "
            f"were built for ({len(built_names)}; {describe_change(built_names, names)}): a "
            "layer was frozen or unfrozen. Call `state.build(model.trainable_variables)` "
            "with an empty window before the next step (AccumTrainer does this itself, "
            "`AccumModel.fit` after `compile`), and retrace compiled steps."
        )
