"""The accumulation state: one small trackable object that every entry point shares.

The update rule (the only rule that makes accumulation exact):

* every micro-batch ``i`` contributes the gradient of its **summed** loss, ``c_i * grad(L_i)``,
  where ``L_i`` is the micro-batch's mean loss and ``c_i`` its weight (what the loss divided
  by: samples, sum of sample weights or valid elements);
* when the window closes, the sum is divided **once** by ``sum_i c_i`` and the optimizer's
  ``apply`` is called exactly once.

So the optimizer sees ``sum_i c_i grad(L_i) / sum_i c_i``, which is the gradient of the mean
loss over the whole window: the large-batch gradient. Iterations, learning-rate schedules,
Adam's bias correction, clipping, weight decay and EMA all advance once per window.

Like optax's ``MultiSteps``, all mutable accumulation state lives in one object. Its pieces:

* :class:`~accumcore.window.Window`: the accumulators, the weight and the count (add, due,
  mean, reset);
* :class:`~accumcore.nonfinite.NonFiniteGuard` and the policy: what a bad micro-batch does;
* :class:`~accumcore.window.Counters`: the run-long counts;
* :class:`~accumcore.AccumulationState`: holds them (and their variables, under the names
  checkpoints know), runs one micro-step (:meth:`~accumcore.AccumulationState.step`) and
  closes a window in ``AccumulationState._close``, whose
  :meth:`~accumcore.AccumulationState.apply_update` is the library's only ``optimizer.apply``.

Under a ``tf.distribute`` strategy, :mod:`accumcore.distribute` supplies where each step runs
and its own close (one status reduction per window); loss scaling is the
``LossScaleOptimizer``'s own (:mod:`accumcore.loss_scaling`). What an entry point does around
the state (building it for a model, following the trainable set, the end-of-epoch policy) is
:mod:`accumcore.entry`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import tensorflow as tf

from accumcore import distribute, loss_scaling
from accumcore.config import check_accum_steps
from accumcore.nonfinite import LOSS_SCALED, NonFiniteGuard, NonFinitePolicy, nonfinite_policy
from accumcore.window import Counters, Window

#: The error for a summed loss under a strategy (``accumcore.entry`` raises it too).
SUM_UNDER_STRATEGY = (
    "A loss with reduction='sum' is not supported under a tf.distribute strategy (Keras "
    "scales such losses differently per replica): use reduction='sum_over_batch_size' (the "
    "default) or 'mean_with_sample_weight'."
)


def _accumulator_dtype(variable_dtype: tf.DType) -> tf.DType:
    """float32 for float16/bfloat16/float32 variables, float64 for float64 variables."""
    return tf.float64 if variable_dtype == tf.float64 else tf.float32


def _as_dtype(variable) -> tf.DType:
    return tf.as_dtype(getattr(variable, "dtype", tf.float32))


def variable_name(variable) -> str:
    """A variable's path (Keras 3) or name."""
    return getattr(variable, "path", None) or variable.name


class _Untracked:
    """Holds a Python value out of ``tf.Module`` tracking (so out of checkpoints)."""

    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value


def describe_change(old: list[str], new: list[str]) -> str:
    """``"+a/kernel, -b/bias"``: variables that became trainable (+) or frozen (-)."""
    added = [f"+{n}" for n in new if n not in old]
    removed = [f"-{n}" for n in old if n not in new]
    parts = added + removed
    return ", ".join(parts[:6] + (["..."] if len(parts) > 6 else [])) or "same names, new objects"


class _Scalar(NamedTuple):
    """One scalar variable of the state (int64, or float32 for a float ``initial``)."""

    name: str
    initial: int | float
    summed: bool  # under a strategy: SUM over the replicas (else the first replica's value)
    reported: bool  # in counters()
    saved: bool  # in variables_for_saving()


#: Every scalar of the state, in the order of ``variables_for_saving`` (after the
#: accumulators; the order of ``.keras`` files' ``accumcore_<i>`` entries: never reorder).
_SCALARS = (
    _Scalar("window_weight", 0.0, summed=True, reported=True, saved=True),
    _Scalar("micro_step", 0, summed=False, reported=True, saved=True),
    _Scalar("window_samples", 0, summed=True, reported=True, saved=True),
    _Scalar("windows_applied", 0, summed=False, reported=True, saved=True),
    _Scalar("windows_skipped", 0, summed=False, reported=True, saved=True),
    _Scalar("micro_batches_seen", 0, summed=False, reported=True, saved=True),
    # Summed: under a strategy each replica skips its own shard of a micro-batch.
    _Scalar("micro_batches_skipped", 0, summed=True, reported=True, saved=True),
    _Scalar("samples_seen", 0, summed=True, reported=True, saved=True),
    _Scalar("samples_dropped", 0, summed=True, reported=True, saved=True),
    _Scalar("window_poisoned", 0, summed=False, reported=False, saved=True),
    # Where a non-finite gradient froze the state (-1: not frozen).
    _Scalar("nonfinite_micro_step", -1, summed=False, reported=False, saved=False),
    _Scalar(
        "nonfinite_window_position", -1, summed=False, reported=False, saved=False
    ),
    _Scalar("nonfinite_variable", -1, summed=False, reported=False, saved=False),
    # Micro-batches refused while frozen (seen after the bad one, not used).
    _Scalar("nonfinite_unused", 0, summed=False, reported=False, saved=False),
)


def saved_micro_step(values: Sequence) -> int:
    """The pending window's micro-batch count in saved values (``variables_for_saving``).

    Readable without building a state (e.g. to refuse loading a partial window into a model
    that has nothing to apply it to): the saved scalars come last, in ``_SCALARS`` order.
    """
    saved = [s.name for s in _SCALARS if s.saved]
    index = len(values) - len(saved) + saved.index("micro_step")
    return int(values[index]) if 0 <= index < len(values) else 0


class AccumulationState(tf.Module):
    """Gradient accumulators and window counters (trackable; checkpoint it mid-window).

    Args:
        accum_steps: K, the number of micro-batches per optimizer update (int >= 1).
        nonfinite: what to do with a micro-batch whose gradient contains NaN or Inf:
            ``"raise"`` (default: freeze the state before that micro-batch and raise
            :class:`~accumcore.NonFiniteGradientError` from the Python side),
            ``"skip_micro_batch"`` (drop only that micro-batch's gradient and weight),
            ``"skip_window"`` (drop the whole window, apply nothing), or a
            :class:`~accumcore.NonFinitePolicy`.

    Variables (created by :meth:`build` from the model's trainable variables; attributes of
    the state, under these names in checkpoints):

    * ``accumulators``: one per trainable variable, same shape, float32 (float64 for float64
      variables), holding ``sum_i c_i * grad(L_i)`` of the current window.
    * ``window_weight`` (float32, ``sum_i c_i``), ``micro_step`` (micro-batches in the window,
      0..K-1), ``window_samples``, ``window_poisoned``: the rest of the
      :class:`~accumcore.window.Window`.
    * The :class:`~accumcore.window.Counters` (int64, over the whole run).
    * ``nonfinite_micro_step``, ``nonfinite_window_position``, ``nonfinite_variable``,
      ``nonfinite_unused``: the :class:`~accumcore.nonfinite.NonFiniteGuard`'s.

    :attr:`window_variables` and :meth:`variables_for_saving` list them.
    """

    def __init__(self, accum_steps: int, *, nonfinite: str | NonFinitePolicy = "raise",
                 name: str = "accumulation") -> None:
        super().__init__(name=name)
        self.accum_steps = check_accum_steps(accum_steps)
        self.nonfinite = nonfinite
        self.accumulators: list[tf.Variable] = []
        self._variables = _Untracked(())
        self._pieces = _Untracked(None)  # (Window, Counters, NonFiniteGuard) once built
        #: Whether the window's gradient sum is divided by its weight ``sum_i c_i`` (the
        #: default, for mean losses); ``False`` applies it as it is, for losses that are
        #: already sums (``reduction="sum"``). Set from the loss by :mod:`accumcore.entry`.
        self.normalize = True
        # Where the rule's steps run, and the close under a strategy (distribute.Replicas).
        self._replicas = distribute.replicas(None)
        #: Callables ``hook(applied: bool)`` run (in graph, where the update runs) whenever a
        #: window closes: ``True`` after an optimizer update, ``False`` when the window is
        #: skipped or dropped. Layers with per-window state (window-level BatchNorm) register.
        self.window_hooks: list = []

    @property
    def nonfinite(self) -> str:
        """The name of the non-finite policy (assign a name or a
        :class:`~accumcore.NonFinitePolicy`)."""
        return self.nonfinite_policy.name

    @nonfinite.setter
    def nonfinite(self, value: str | NonFinitePolicy) -> None:
        self.nonfinite_policy = nonfinite_policy(value)

    # ------------------------------------------------------------------ building
    @property
    def built(self) -> bool:
        return self._pieces.value is not None

    @property
    def window(self) -> Window:
        self._check_built()
        return self._pieces.value[0]

    @property
    def run_counters(self) -> Counters:
        self._check_built()
        return self._pieces.value[1]

    @property
    def guard(self) -> NonFiniteGuard:
        self._check_built()
        return self._pieces.value[2]

    def build(self, variables: Sequence) -> bool:
        """Create the accumulators for ``variables`` (the model's trainable variables).

        Safe inside a ``tf.function`` trace or a strategy scope (the variables are created
        eagerly, ``tf.init_scope``). With the same variables (same objects, same order) it is a
        no-op; with a different set (a layer frozen or unfrozen) the accumulators follow it
        when the window is empty (counters and flags are kept), and it raises otherwise: the
        pending gradients belong to the old set.

        Returns:
            Whether accumulators were created now (first build or a new trainable set).

        Raises:
            ValueError: if ``variables`` is empty (an unbuilt model has no variables yet), or
                if the set changed while a window is pending (flush it first).
        """
        variables = list(variables)
        if not variables:
            raise ValueError(
                "The model has no trainable variables yet, so there is nothing to accumulate. "
                "Build the model first: call it on one batch, call `model.build(input_shape)`, "
                "or start it with `keras.Input(shape=...)`."
            )
        if self.built:
            if self.same_variables(variables):
                return False
            self._follow(variables)
            return True
        strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
        self._replicas = distribute.replicas(strategy)
        with tf.init_scope():
            # Extend the tracked list in place (not re-assign it) so that a checkpoint read
            # before the state was built restores the accumulators when they are created.
            self.accumulators.extend(self._new_accumulators(variables))
            for s in _SCALARS:
                dtype = tf.float32 if isinstance(s.initial, float) else tf.int64
                setattr(self, s.name, tf.Variable(
                    tf.constant(s.initial, dtype), trainable=False, name=s.name,
                    **self._replicas.placement(s.summed)))
        self._set_variables(variables)
        return True

    def _new_accumulators(self, variables: list) -> list[tf.Variable]:
        """Zero accumulators, one per variable (float32; float64 for float64 variables)."""
        with tf.init_scope():
            return [
                tf.Variable(tf.zeros(v.shape, _accumulator_dtype(_as_dtype(v))),
                            trainable=False, name=f"accum_{i}",
                            **self._replicas.placement(summed=True))
                for i, v in enumerate(variables)
            ]

    def _set_variables(self, variables: list) -> None:
        """Hold ``variables`` (untracked: the model's variables are not the state's to save)
        and assemble the pieces over the state's variables."""
        self._variables = _Untracked(tuple(variables))
        parts = self._replicas.parts
        window = Window(self.accumulators, self.window_weight, self.micro_step,
                        self.window_samples, self.window_poisoned, parts,
                        self._replicas.distributed)
        counters = Counters({name: getattr(self, name) for name in Counters.NAMES}, parts)
        guard = NonFiniteGuard(self.nonfinite_micro_step, self.nonfinite_window_position,
                               self.nonfinite_variable, self.nonfinite_unused, parts)
        self._pieces = _Untracked((window, counters, guard))

    def _follow(self, variables: list) -> None:
        """Re-create the accumulators for a new trainable set (the window must be empty)."""
        old = [variable_name(v) for v in self._variables.value]
        new = [variable_name(v) for v in variables]
        pending = self.pending_micro_batches()
        if pending:
            raise ValueError(
                f"The trainable variables changed ({len(old)} -> {len(new)} variables: "
                f"{describe_change(old, new)}) while a window of {pending} micro-batches is "
                "pending. Its gradients belong to the old set: apply it first with "
                "`model.flush()` (AccumModel) or `trainer.flush()` (AccumTrainer), "
                "then change `trainable` (or train on: the next `fit` after `compile` follows "
                "the new set)."
            )
        if self._replicas.distributed and not tf.distribute.has_strategy():
            raise ValueError(
                "This AccumulationState was built under a tf.distribute strategy: re-build it "
                "for the new trainable set inside `strategy.scope()`."
            )
        with tf.init_scope():
            # A new list (not an in-place edit: tracked lists must only grow to stay saveable).
            self.accumulators = self._new_accumulators(variables)
        self._set_variables(variables)
        self._replicas.forget()  # compiled closes captured the old accumulators

    def same_variables(self, variables: Sequence) -> bool:
        """Whether ``variables`` are exactly the ones the accumulators were built for."""
        built = self._variables.value
        variables = tuple(variables)
        return len(variables) == len(built) and all(a is b for a, b in zip(variables, built))

    @property
    def variables_accumulated(self) -> tuple:
        """The trainable variables the accumulators belong to, in order (empty if unbuilt)."""
        return self._variables.value

    # ------------------------------------------------------------------ queries
    def pending_micro_batches(self) -> int:
        """Micro-batches in the current window (Python int; 0 when unbuilt). Call eagerly."""
        if not self.built:
            return 0
        with tf.init_scope():
            return max(int(part.numpy()) for part in self._replicas.parts(self.micro_step))

    def _check_built(self) -> None:
        if not self.built:
            raise ValueError(
                "AccumulationState is not built: call `state.build(model.trainable_variables)` "
                "once the model has variables."
            )

    def _check_gradients(self, grads: Sequence) -> None:
        if len(grads) != len(self.accumulators):
            raise ValueError(
                f"Got {len(grads)} gradients for {len(self.accumulators)} accumulators: "
                "`grads` must match the trainable variables the state was built from, one per "
                "variable and in the same order (use `tape.gradient(loss, "
                "model.trainable_variables)`)."
            )
        for g, acc in zip(grads, self.accumulators):
            if g is not None and g.shape.rank is not None and acc.shape.rank is not None:
                shape = g.dense_shape if isinstance(g, tf.IndexedSlices) else g.shape
                if isinstance(shape, tf.TensorShape) and not shape.is_compatible_with(acc.shape):
                    raise ValueError(
                        f"Gradient of shape {shape} does not match accumulator "
                        f"{acc.name} of shape {acc.shape}: `grads` must be in the order of the "
                        "trainable variables the state was built from."
                    )

    def _check_variables(self, variables: Sequence) -> None:
        if not self.same_variables(variables):
            names = [variable_name(v) for v in variables]
            built = [variable_name(v) for v in self._variables.value]
            raise ValueError(
                f"The trainable variables ({len(names)}) are not the ones the accumulators "
                f"were built for ({len(built)}; {describe_change(built, names)}): a layer was "
                "frozen or unfrozen. Call `state.build(model.trainable_variables)` with an "
                "empty window before the next step (AccumTrainer does this itself, "
                "`AccumModel.fit` after `compile`), and retrace compiled steps."
            )

    @property
    def strategy(self) -> tf.distribute.Strategy | None:
        """The ``tf.distribute`` strategy the state was built under (``None``: no strategy)."""
        return self._replicas.strategy

    @property
    def frozen(self) -> tf.Tensor:
        """True once a non-finite gradient was seen under ``nonfinite="raise"``."""
        return self.guard.frozen

    @property
    def window_variables(self) -> list[tf.Variable]:
        """The current window's variables (emptied whenever it ends).

        The accumulators, ``window_weight``, ``micro_step``, ``window_samples`` and
        ``window_poisoned``."""
        return self.window.variables

    def variables_for_saving(self) -> list[tf.Variable]:
        """What a saved model holds to resume mid-window, in a fixed order: the accumulators,
        then ``window_weight``, ``micro_step``, ``window_samples``, the six run counters and
        ``window_poisoned`` (the order of the entries of ``.keras`` files). The non-finite
        flags are not saved: a frozen state is not saved frozen."""
        self._check_built()
        return [*self.accumulators, *(getattr(self, s.name) for s in _SCALARS if s.saved)]

    def counters(self) -> dict[str, int | float]:
        """The counters as Python numbers (reads the variables; call outside graphs): the
        run-long counts (ints) and the pending window's ``micro_step``, ``window_samples`` and
        ``window_weight`` (``sum_i c_i``, a float: whatever the loss divides by)."""
        self._check_built()
        return {
            s.name: (float if isinstance(s.initial, float) else int)(getattr(self, s.name).numpy())
            for s in _SCALARS if s.reported
        }

    # ------------------------------------------------------------------ one micro-step
    def accumulate(self, grads: Sequence, weight, samples, optimizer=None, *,
                   advance: bool = False) -> tf.Tensor:
        """Add one micro-batch: ``grads`` are gradients of its **summed** loss ``c_i * L_i``.

        Args:
            grads: one gradient per trainable variable (dense tensor, ``tf.IndexedSlices`` or
                ``None`` for variables the loss does not depend on).
            weight: ``c_i``, float scalar (samples, sum of sample weights or item count).
            samples: number of samples in the micro-batch (int scalar), for the counters.
            optimizer: the optimizer the window will be applied with (optional). With a
                ``keras.optimizers.LossScaleOptimizer`` no micro-batch is checked: the window
                is checked once, when it closes (skipped whole, loss scale lowered).
            advance: also count the micro-batch into the window (:meth:`advance`), unless a
                frozen state refuses it (``nonfinite="raise"``). :meth:`step` uses this.

        Returns:
            A bool scalar: whether the micro-batch was added (False if it was skipped or the
            state is frozen by a non-finite gradient).

        Per micro-batch: the gradients added, the weight and the counts, and one finiteness
        test; skipping, freezing and the diagnosis are in the rarely taken branch of one
        ``tf.cond``.
        """
        self._check_built()
        self._check_gradients(grads)
        window, counters, guard = self._pieces.value
        window.has_gradient = [g is not None for g in grads]
        weight = tf.cast(weight, tf.float32)
        samples = tf.cast(samples, tf.int64)
        scaled = loss_scaling.is_loss_scale_optimizer(optimizer)
        policy = LOSS_SCALED if scaled else self.nonfinite_policy
        # Counted as seen inside `add` when refused micro-batches are not seen (a freeze) or
        # nothing is ever refused (loss scaling); else once, after the decision.
        inside = policy.freeze or scaled

        def add() -> tf.Tensor:
            window.add(grads, weight, samples)
            if inside:
                counters.samples_seen.assign_add(samples)
                if advance:
                    self.advance()
            return tf.constant(True)

        def skip() -> tf.Tensor:
            counters.skip(samples)
            if policy.skip_window:
                self.window_poisoned.assign(1)
            return tf.constant(False)

        if scaled:  # no micro-batch is checked: the window is, when it closes
            return add()
        added = guard.admit(policy, grads, weight, add, skip, where=lambda: (
            self.micro_step.value(), self.micro_batches_seen.value()))
        if not inside:
            counters.samples_seen.assign_add(samples)  # added or skipped: seen either way
            if advance:  # a skipped micro-batch still takes its place in the window
                self.advance()
        return added

    def advance(self) -> None:
        """Count one micro-batch into the window (``micro_step``, ``micro_batches_seen``)."""
        self.micro_batches_seen.assign_add(1)
        self.window.advance()

    def step(self, grads: Sequence, weight, samples, optimizer, variables: Sequence) -> tf.Tensor:
        """Accumulate one micro-batch and close the window when it holds K micro-batches.

        The whole per-micro-batch rule of the eager loop, the compiled loop and
        ``AccumModel.train_step``. Graph-safe; under a strategy it runs in replica context.

        Returns:
            bool scalar: whether an optimizer update was applied by this call.
        """
        self._check_built()
        self._check_variables(variables)
        self._replicas.require_replica_context()
        variables = list(variables)
        if self._replicas.distributed:
            # Every replica advances in lockstep (a frozen one too); whether the window is
            # full is decided in cross-replica context.
            self.accumulate(grads, weight, samples, optimizer)
            self.advance()
        else:  # a frozen state does not advance, so its window never becomes due
            self.accumulate(grads, weight, samples, optimizer, advance=True)
        return self._replicas.decide(lambda: self._close_if_due(optimizer, variables,
                                                                force=False))

    # ------------------------------------------------------------------ closing a window
    def apply_window(self, optimizer, variables: Sequence | None = None) -> tf.Tensor:
        """Close the current window now: one ``optimizer.apply`` with its mean gradient.

        A window poisoned by a non-finite gradient (``nonfinite="skip_window"``) or whose
        loss-scaled gradient is not finite (``LossScaleOptimizer``: the scale is lowered) is
        discarded and counted in ``windows_skipped``. An empty window does nothing, and so
        does a frozen state. Graph-safe; under a strategy, callable in replica or
        cross-replica context.

        Args:
            optimizer: the Keras optimizer (``apply`` is called once).
            variables: the model's current trainable variables. The window is applied to the
                variables its accumulators were built for (:attr:`variables_accumulated`),
                also when ``trainable`` changed since; an optimizer that is not built yet (a
                new one from ``compile``) is built for ``variables``, so that it can update
                the whole current set afterwards.

        Returns:
            bool scalar: whether an optimizer update was applied.
        """
        self._check_built()
        if variables is not None and not self._replicas.distributed and not optimizer.built:
            with tf.init_scope():
                optimizer.build(list(variables))
        variables = list(self._variables.value)
        if not self.normalize and self._replicas.distributed:
            raise ValueError(SUM_UNDER_STRATEGY)
        key = (id(optimizer), *map(id, variables))
        return self._replicas.decide(
            lambda: self._close_if_due(optimizer, variables, force=True), key)

    def drop_window(self) -> None:
        """Discard the current partial window (end-of-epoch policy ``"drop"``), counting it."""
        self._check_built()
        self.end_window(False, counted=False)

    def reset(self) -> None:
        """Empty the current window (:attr:`window_variables`); counters are kept."""
        self.window.reset()

    def _close_if_due(self, optimizer, variables: list, *, force: bool) -> tf.Tensor:
        """Close the window if it holds K micro-batches (any, with ``force``): bool scalar.

        Under a strategy this runs in cross-replica context, where the replicas' window
        counters agree (they advance in lockstep): the first one's decides.
        """
        due = self.window.due(self._replicas.first(self.micro_step), self.accum_steps,
                              force=force)
        if force and not self._replicas.distributed:
            # One replica: a frozen state keeps its window (the Python side raises). Under a
            # strategy the frozen flag is part of the window's status (distribute's close).
            due = tf.logical_and(due, tf.logical_not(self.frozen))
        return tf.cond(due, lambda: self._close(optimizer, variables), lambda: tf.constant(False))

    def _close(self, optimizer, variables: list) -> tf.Tensor:
        """Close a due window: its mean gradient, the skip decision, one update, its end.

        A window is skipped when a micro-batch condemned it (``"skip_window"``) or none of its
        micro-batches was added; under ``"raise"`` neither can happen (a frozen state is never
        due), and a ``LossScaleOptimizer`` skips an overflowed window itself. Under a strategy
        :meth:`accumcore.distribute.StrategyReplicas.close` is the close, with the window's one
        status reduction.

        Returns:
            bool scalar: whether an optimizer update was applied.
        """
        if self._replicas.distributed:
            return self._replicas.close(self, optimizer, variables)

        def update() -> tf.Tensor:
            grads = self.window.mean(self.window_weight.value(), normalize=self.normalize)
            return self.apply_update(optimizer, variables, grads)

        if self.nonfinite_policy.freeze or loss_scaling.is_loss_scale_optimizer(optimizer):
            applied = update()  # True, unless a LossScaleOptimizer skips the window itself
        else:
            skip = tf.logical_or(self.window_poisoned > 0, self.window_samples <= 0)
            applied = tf.cond(skip, lambda: tf.constant(False), update)
        return self.end_window(applied)

    def apply_update(self, optimizer, variables: list, grads: list, *,
               unscale: bool = False) -> tf.Tensor:
        """The window's optimizer update: the library's one ``apply`` call (under a strategy,
        in replica context: each replica applies its share, Keras all-reduces them).

        Args:
            grads: the window's gradient, one entry per variable (``None``: no gradient).
            unscale: apply the unscaled gradient with the inner optimizer of a
                ``LossScaleOptimizer`` (under a strategy: :mod:`accumcore.loss_scaling`).

        Returns:
            bool scalar: whether the update was applied (a LossScaleOptimizer skips an
            overflowed window itself).
        """
        target = optimizer
        if unscale:
            target, grads = optimizer.inner_optimizer, loss_scaling.unscale(optimizer, grads)
        grads = [None if g is None else tf.cast(g, _as_dtype(v))
                 for g, v in zip(grads, variables, strict=True)]
        target.apply(grads, variables)
        return loss_scaling.window_applied(target, grads)

    def end_window(self, applied: tf.Tensor | bool, *, counted: bool = True) -> tf.Tensor:
        """Every window ends here, applied, skipped or dropped: counted, the window hooks run,
        then emptied (under a strategy: every local copy, from cross-replica context).

        Args:
            applied: a Python bool or a bool scalar tensor. Known statically, only that
                outcome is written; otherwise the hooks (which take a Python bool) run in one
                ``cond``, a branch per outcome.
            counted: count the window in ``windows_applied`` / ``windows_skipped`` (``False``:
                a dropped window, counted only in ``samples_dropped``).

        Returns:
            bool scalar: ``applied``.
        """
        known = tf.get_static_value(applied)
        if known is None and self.window_hooks:
            return tf.cond(applied, lambda: self.end_window(True, counted=counted),
                           lambda: self.end_window(False, counted=counted))
        self.run_counters.end_window(applied, self.window_samples, counted=counted)
        for hook in self.window_hooks:
            hook(bool(known))
        self.window.reset()
        return applied if known is None else tf.constant(bool(known))

    # ------------------------------------------------------------------ non-finite report
    def raise_if_nonfinite(self, epoch: int | None = None) -> None:
        """Raise :class:`~accumcore.NonFiniteGradientError` if a non-finite gradient froze
        the state.

        Call from Python, after a step or after many: a frozen state refuses every later
        micro-batch (counted), so checking once per epoch loses nothing but that epoch's
        remaining compute. ``fit`` checks at the end of each epoch; ``train_on_batch``,
        ``train_micro_batch`` and ``window_step`` after each call. :meth:`clear_nonfinite`
        unfreezes the state (the bad micro-batch stays out).
        """
        if not self.built or not self.nonfinite_policy.freeze:
            return
        names = [variable_name(v) for v in self._variables.value]
        error = self.guard.error(names, self.accum_steps, epoch)
        if error is not None:
            raise error

    def clear_nonfinite(self) -> bool:
        """Unfreeze the state after a :class:`~accumcore.NonFiniteGradientError`.

        The window accumulated before the bad micro-batch is kept (valid gradients; nothing is
        dropped silently): training continues it. ``flush()`` applies it now,
        :meth:`drop_window` discards it (counted in ``samples_dropped``).

        Returns:
            Whether the state was frozen (and a log line said what was kept).
        """
        self._check_built()
        with tf.init_scope():
            pending = self.pending_micro_batches()
            samples = int(self.window_samples.numpy())  # under a strategy: the replicas' sum
        return self.guard.clear(pending, samples)

    def get_config(self) -> dict:
        return {"accum_steps": self.accum_steps, "nonfinite": self.nonfinite}
