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

* ``Window``: the accumulators, the weight and the count (add, due,
  mean, reset);
* ``NonFiniteGuard`` and the policy: what a bad micro-batch does;
* ``Counters``: the run-long counts;
* :class:`~accumcore.AccumulationState`: holds them and their variables (made by
  ``accumcore.layout``, under the names checkpoints know), and runs one micro-step
  (:meth:`~accumcore.AccumulationState.step`) with the rule's functions in
  ``accumcore.rule``: ``accumulate``, ``close_if_due``, ``close`` (the one-device close,
  on one screen) and ``apply_update``, the library's only ``optimizer.apply``.

Under a ``tf.distribute`` strategy, ``accumcore.distribute`` supplies where each step runs
and its own close (one status reduction per window); loss scaling is the
``LossScaleOptimizer``'s own (``accumcore.loss_scaling``). What an entry point does around
the state (building it for a model, following the trainable set, the end-of-epoch policy) is
``accumcore.entry``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from accumcore import distribute, layout, rule
from accumcore.config import check_accum_steps
from accumcore.layout import variable_name
from accumcore.nonfinite import NonFiniteGuard, NonFinitePolicy, nonfinite_policy
from accumcore.window import Counters, Window

#: The error for a summed loss under a strategy (``accumcore.entry`` raises it too).
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
        nonfinite: what a non-finite gradient does (``accumcore.nonfinite``: what counts):
            ``"raise"`` (default: freeze the state before that micro-batch and raise
            :class:`~accumcore.NonFiniteGradientError` from the Python side),
            ``"skip_micro_batch"`` (drop only that micro-batch's gradient and weight),
            ``"skip_window"`` (drop the whole window, apply nothing), or a
            :class:`~accumcore.NonFinitePolicy`.

    Variables, created by :meth:`build` for the model's trainable variables (attributes of
    the state, under these names in checkpoints): ``accumulators`` (one per trainable
    variable, ``sum_i c_i * grad(L_i)`` of the window, float32 or float64) and the scalars of
    ``accumcore.layout.SCALARS``: the ``Window``'s and the
    ``Counters`` (the ``guard``'s are in no checkpoint).
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
        #: already sums (``reduction="sum"``). Set from the loss by ``accumcore.entry``.
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

    @property
    def frozen(self) -> tf.Tensor:
        """True once a non-finite gradient was seen under ``nonfinite="raise"``."""
        return self.guard.frozen

    @property
    def window_variables(self) -> list[tf.Variable]:
        """The current window's variables (emptied whenever it ends); the accumulators,
        ``window_weight``, ``micro_step``, ``window_samples`` and ``window_poisoned``."""
        return self.window.variables

    def variables_for_saving(self) -> list[tf.Variable]:
        """What a saved model holds to resume mid-window, in a fixed order: the accumulators,
        then ``window_weight``, ``micro_step``, ``window_samples``, the six run counters and
        ``window_poisoned`` (the order of the entries of ``.keras`` files). The guard's flags
        are not saved: a frozen state is not saved frozen."""
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
        """
        self._check_built()
        layout.check_gradients(grads, self.accumulators)
        return rule.accumulate(self, grads, weight, samples, optimizer, advance=advance)

    def advance(self) -> None:
        """Count one micro-batch into the window (``micro_step``, ``micro_batches_seen``)."""
        # One constant for both counts (AutoGraph cannot convert `:=`).
        self.micro_batches_seen.assign_add(self.window.advance(tf.constant(1, tf.int64)))

    def step(self, grads: Sequence, weight, samples, optimizer, variables: Sequence) -> tf.Tensor:
        """Accumulate one micro-batch and close the window when it holds K micro-batches.

        The whole per-micro-batch rule of the eager loop, the compiled loop and
        ``AccumModel.train_step``. Graph-safe; under a strategy it runs in replica context.

        Returns:
            bool scalar: whether an optimizer update was applied by this call.
        """
        self._check_built()
        layout.check_variables(self._variables.value, variables)
        self.replicas.require_replica_context()
        variables = list(variables)
        if self.replicas.distributed:
            # Every replica advances in lockstep (a frozen one too); whether the window is
            # full is decided in cross-replica context.
            self.accumulate(grads, weight, samples, optimizer)
            self.advance()
        else:  # a frozen state does not advance, so its window never becomes due
            self.accumulate(grads, weight, samples, optimizer, advance=True)
        return self.replicas.decide(
            lambda: rule.close_if_due(self, optimizer, variables, force=False))

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
        variables = list(self._variables.value)
        if not self.normalize and self.replicas.distributed:
            raise ValueError(SUM_UNDER_STRATEGY)
        key = (id(optimizer), *map(id, variables))
        return self.replicas.decide(
            lambda: rule.close_if_due(self, optimizer, variables, force=True), key)

    def drop_window(self) -> None:
        """Discard the current partial window (end-of-epoch policy ``"drop"``), counting it."""
        self._check_built()
        self.end_window(False, counted=False)

    def reset(self) -> None:
        """Empty the current window (:attr:`window_variables`); counters are kept."""
        self.window.reset()

    def apply_update(self, optimizer, variables: list, grads: list, *,
                     unscale: bool = False) -> tf.Tensor:
        """The window's optimizer update, the library's one ``apply`` call
        (``accumcore.rule.apply_update``); bool scalar: whether it was applied."""
        return rule.apply_update(optimizer, variables, grads, unscale=unscale)

    def end_window(self, applied: tf.Tensor | bool, *, counted: bool = True) -> tf.Tensor:
        """End the window, ``applied`` (a bool or bool scalar) or not: counted, the window
        hooks run, then emptied (``accumcore.rule.end_window``). Returns ``applied``."""
        return rule.end_window(self, applied, counted=counted)

    # ------------------------------------------------------------------ non-finite report
    def raise_if_nonfinite(self, epoch: int | None = None) -> None:
        """Raise :class:`~accumcore.NonFiniteGradientError` if a non-finite gradient froze
        the state.

        Call from Python, after a step or after many: a frozen state refuses (and counts)
        every later micro-batch, so ``fit`` checks once per epoch; ``train_on_batch``,
        ``train_micro_batch`` and ``window_step`` after each call.
        """
        if not self.built or not self.nonfinite_policy.freeze:
            return
        names = [variable_name(v) for v in self._variables.value]
        error = self.guard.error(names, self.accum_steps, epoch)
        if error is not None:
            raise error

    def clear_nonfinite(self) -> bool:
        """Unfreeze the state after a :class:`~accumcore.NonFiniteGradientError`.

        The window before the bad micro-batch is kept (nothing is dropped silently) and
        training continues it; ``flush()`` applies it now, :meth:`drop_window` discards it.
        Returns whether the state was frozen (a log line says what was kept).
        """
        self._check_built()
        with tf.init_scope():
            pending = self.pending_micro_batches()
            samples = int(self.window_samples.numpy())  # under a strategy: the replicas' sum
        return self.guard.clear(pending, samples)

    def get_config(self) -> dict:
        return {"accum_steps": self.accum_steps, "nonfinite": self.nonfinite}
