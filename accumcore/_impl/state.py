"""The accumulation state: one small trackable object that every entry point shares.

Every micro-batch ``i`` contributes the gradient of its **summed** loss ``c_i * grad(L_i)``
(``L_i`` its mean loss, ``c_i`` what that loss divided by: samples, sum of sample weights or
valid elements); when the window closes the sum is divided **once** by ``sum_i c_i`` and the
optimizer's ``apply`` runs once. So the optimizer sees the gradient of the mean loss over the
whole window, the large-batch gradient, and iterations, learning-rate schedules, Adam's bias
correction, clipping, weight decay and EMA all advance once per window.

Like optax's ``MultiSteps``, all mutable accumulation state lives in this one object; the
rule itself is ``accumcore._impl.rule`` (add, close, end), its special cases resolved once per
trace into a ``rule.Plan``. The variables are made by ``accumcore._impl.layout`` under the
names checkpoints know; ``accumcore._impl.distribute`` says where each step runs under a
``tf.distribute`` strategy.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from accumcore._impl import distribute, layout, rule
from accumcore._impl.config import check_accum_steps
from accumcore._impl.layout import variable_name
from accumcore._impl.nonfinite import NonFinitePolicy, nonfinite_policy

#: The error for a summed loss under a strategy (``accumcore._impl.entry`` raises it too).
SUM_UNDER_STRATEGY = (
    "A loss with reduction='sum' is not supported under a tf.distribute strategy (Keras "
    "scales such losses differently per replica): use reduction='sum_over_batch_size' (the "
    "default) or 'mean_with_sample_weight'."
)


class _Untracked:
    """Holds a Python value out of ``tf.Module`` tracking (so out of checkpoints)."""

    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value


class AccumulationState(tf.Module):
    """Gradient accumulators and window counters (trackable; checkpoint it mid-window).

    Args:
        accum_steps: K, the number of micro-batches per optimizer update (int >= 1).
        nonfinite: what a non-finite gradient does (``accumcore._impl.nonfinite``: what counts):
            ``"raise"`` (default: a window whose sum is not finite is discarded whole and
            :class:`~accumcore.NonFiniteGradientError` is raised from the Python side; checked
            once per window), ``"skip_window"`` (discard such a window and go on; checked once
            per window), ``"skip_micro_batch"`` (leave out only the bad micro-batches: every
            micro-batch is checked), or a :class:`~accumcore.NonFinitePolicy`.

    Variables, created by :meth:`build` for the model's trainable variables (attributes of
    the state, under these names in checkpoints): ``accumulators`` (one per trainable
    variable, ``sum_i c_i * grad(L_i)`` of the window, float32 or float64) and the scalars of
    ``accumcore._impl.layout.SCALARS``: the window's and the run's counters (the ``"raise"``
    policy's stop is in no checkpoint). :meth:`variables_for_saving` lists them.
    """

    def __init__(self, accum_steps: int, *, nonfinite: str | NonFinitePolicy = "raise",
                 name: str = "accumulation") -> None:
        super().__init__(name=name)
        self.accum_steps = check_accum_steps(accum_steps)
        self.nonfinite = nonfinite
        self.accumulators: list[tf.Variable] = []
        self._variables = _Untracked(())
        self._pieces = _Untracked(None)  # (Window, Counters, Stop) once built
        #: Whether the window's gradient sum is divided by its weight ``sum_i c_i`` (the
        #: default, for mean losses); ``False`` applies it as it is, for losses that are
        #: already sums (``reduction="sum"``). Set from the loss by ``accumcore._impl.entry``.
        self.normalize = True
        #: Where the rule's steps run (``Replicas``; see build).
        self.replicas = distribute.replicas(None)
        #: Callables ``hook(applied: bool)`` run (in graph, where the update runs) whenever a
        #: window closes: ``True`` after an optimizer update, ``False`` when the window is
        #: skipped or dropped. Layers with per-window state (window-level BatchNorm) register.
        self.window_hooks: list = []

    @property
    def nonfinite(self) -> str:
        """The non-finite policy's name (assign a name or a :class:`~accumcore.NonFinitePolicy`)."""
        return self.nonfinite_policy.name

    @nonfinite.setter
    def nonfinite(self, value: str | NonFinitePolicy) -> None:
        self.nonfinite_policy = nonfinite_policy(value)

    # ------------------------------------------------------------------ building
    @property
    def built(self) -> bool:
        return self._pieces.value is not None

    def _pieces_checked(self) -> tuple:
        """``(Window, Counters, Stop)`` of a built state."""
        self._check_built()
        return self._pieces.value

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
            raise ValueError(layout.NO_VARIABLES)
        if self.built:
            if self.same_variables(variables):
                return False
            layout.check_can_follow(self._variables.value, variables,
                                    self.pending_micro_batches(), self.replicas.distributed)
            with tf.init_scope():  # a new list: tracked lists must only grow to stay saveable
                self.accumulators = layout.new_accumulators(variables, self.replicas.placement)
            self.replicas.forget()  # compiled closes captured the old accumulators
        else:
            strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
            self.replicas = distribute.replicas(strategy)
            with tf.init_scope():
                # Extend the tracked list in place (not re-assign it) so that a checkpoint read
                # before the state was built restores the accumulators when they are created.
                self.accumulators.extend(
                    layout.new_accumulators(variables, self.replicas.placement))
                saved, unsaved = layout.new_scalars(self.replicas.placement)
            for name, variable in saved.items():
                setattr(self, name, variable)
            self._unsaved = _Untracked(unsaved)  # untracked: in no checkpoint
        self._variables = _Untracked(tuple(variables))  # the model's: not the state's to save
        self._pieces = _Untracked(layout.pieces(self, self._unsaved.value))
        return True

    def same_variables(self, variables: Sequence) -> bool:
        """Whether ``variables`` are exactly the ones the accumulators were built for."""
        return layout.same_variables(self._variables.value, variables)

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
            return max(int(part.numpy()) for part in self.replicas.parts(self.micro_step))

    def _check_built(self) -> None:
        if not self.built:
            raise ValueError(layout.NOT_BUILT)

    @property
    def strategy(self) -> tf.distribute.Strategy | None:
        """The ``tf.distribute`` strategy the state was built under, or ``None`` (no strategy)."""
        return self.replicas.strategy

    def variables_for_saving(self) -> list[tf.Variable]:
        """What a saved model holds to resume mid-window, in a fixed order: the accumulators,
        then ``window_weight``, ``micro_step``, ``window_samples``, the six run counters and
        ``window_poisoned`` (the order of the entries of ``.keras`` files). The ``"raise"``
        policy's stop is not saved: a stopped state is not saved stopped."""
        self._check_built()
        return [*self.accumulators, *(getattr(self, s.name) for s in layout.SCALARS if s.saved)]

    def counters(self) -> dict[str, int | float]:
        """The counters as Python numbers (reads the variables; call outside graphs): the
        run-long counts (ints) and the pending window's ``micro_step``, ``window_samples`` and
        ``window_weight`` (``sum_i c_i``, a float: whatever the loss divides by)."""
        self._check_built()
        return {
            s.name: (float if isinstance(s.initial, float) else int)(getattr(self, s.name).numpy())
            for s in layout.SCALARS if s.reported
        }

    # ------------------------------------------------------------------ the rule's steps
    def accumulate(self, grads: Sequence, weight, samples, optimizer=None) -> tf.Tensor:
        """Add one micro-batch and count it into the window; close nothing.

        Args:
            grads: gradients of the micro-batch's **summed** loss ``c_i * L_i``, one per
                trainable variable (dense tensor, ``tf.IndexedSlices`` or ``None`` for
                variables the loss does not depend on).
            weight: ``c_i``, float scalar (samples, sum of sample weights or item count).
            samples: number of samples in the micro-batch (int scalar), for the counters.
            optimizer: the optimizer the window will be applied with (a
                ``LossScaleOptimizer`` checks the window itself: no micro-batch is checked).

        Returns:
            bool scalar: whether the micro-batch was added (``False``: a per-micro-batch
            check left it out).
        """
        window, counters, _ = self._pieces_checked()
        layout.check_gradients(grads, self.accumulators)
        return rule.add(window, counters, self._plan(optimizer), grads,
                        tf.cast(weight, tf.float32), tf.cast(samples, tf.int64),
                        self.replicas.distributed)

    def step(self, grads: Sequence, weight, samples, optimizer, variables: Sequence) -> tf.Tensor:
        """:meth:`accumulate` one micro-batch, then close the window if it holds K: the whole
        per-micro-batch rule of every entry point. Graph-safe; under a strategy it runs in
        replica context.

        Returns:
            bool scalar: whether an optimizer update was applied by this call.
        """
        self._check_built()
        layout.check_variables(self._variables.value, variables)
        self.replicas.require_replica_context()
        self.accumulate(grads, weight, samples, optimizer)
        return self.replicas.decide(lambda: self._close_if_due(optimizer, force=False))

    def apply_window(self, optimizer, variables: Sequence | None = None) -> tf.Tensor:
        """Close the current window now, whatever it holds: one ``optimizer.apply`` with its
        mean gradient, unless it is empty, bad (``"skip_window"``, ``"raise"``; a
        ``LossScaleOptimizer`` lowers its scale) or training is stopped. Graph-safe; under a
        strategy, callable in replica or cross-replica context.

        Args:
            optimizer: the Keras optimizer (``apply`` is called once).
            variables: the model's current trainable variables: an optimizer not built yet (a
                new one from ``compile``) is built for them. The window is applied to
                :attr:`variables_accumulated`, also when ``trainable`` changed since.

        Returns:
            bool scalar: whether an optimizer update was applied.
        """
        self._check_built()
        if variables is not None and not self.replicas.distributed and not optimizer.built:
            with tf.init_scope():
                optimizer.build(list(variables))
        if not self.normalize and self.replicas.distributed:
            raise ValueError(SUM_UNDER_STRATEGY)
        key = (id(optimizer), *map(id, self._variables.value))
        return self.replicas.decide(lambda: self._close_if_due(optimizer, force=True), key)

    def drop_window(self) -> None:
        """Discard the current window unapplied (counted in ``samples_dropped`` only)."""
        window, counters, _ = self._pieces_checked()
        rule.end(window, counters, self.replicas, False, self.window_hooks, counted=False)

    def _plan(self, optimizer) -> rule.Plan:
        return rule.plan(self.nonfinite_policy, optimizer, self.replicas,
                         self._pieces_checked()[2])

    def _close_if_due(self, optimizer, *, force: bool) -> tf.Tensor:
        """Close the window if it holds K micro-batches (any, with ``force``); under a
        strategy in cross-replica context, where the replicas' counts agree (lockstep)."""
        window, counters, _ = self._pieces_checked()
        count = self.replicas.first(window.micro_step)
        due = count > 0 if force else count >= self.accum_steps
        variables = list(self._variables.value)
        return tf.cond(due, lambda: rule.close(
            window, counters, self._plan(optimizer), optimizer, variables, self.normalize,
            self.window_hooks), lambda: tf.constant(False))

    # ------------------------------------------------------------------ the "raise" stop
    def raise_if_nonfinite(self, epoch: int | None = None) -> None:
        """Raise :class:`~accumcore.NonFiniteGradientError` if a bad window stopped training
        (``nonfinite="raise"``). Call from Python, after a step or after many: a stopped state
        discards every later window, so ``fit`` checks once per epoch, ``train_on_batch`` and
        ``train_micro_batch`` after each call."""
        if not self.built or not self.nonfinite_policy.freeze:
            return
        names = [variable_name(v) for v in self._variables.value]
        with tf.init_scope():
            seen = int(self.micro_batches_seen.numpy())
        error = self._pieces_checked()[2].error(names, seen, epoch)
        if error is not None:
            raise error

    def clear_nonfinite(self) -> bool:
        """Clear the stop after a :class:`~accumcore.NonFiniteGradientError` so training can
        go on. The micro-batches seen while stopped (a partial window) are discarded, counted
        in ``samples_dropped``. Returns whether training was stopped."""
        if not self.built:
            return False
        with tf.init_scope():
            stopped = self._pieces_checked()[2].clear()
            if stopped and self.pending_micro_batches():
                self.drop_window()
        return stopped

    def get_config(self) -> dict:
        return {"accum_steps": self.accum_steps, "nonfinite": self.nonfinite}
