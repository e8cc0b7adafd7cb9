"""The accumulation state: one small trackable object that every entry point shares.

Every micro-batch ``i`` contributes the gradient of its **summed** loss ``c_i * grad(L_i)``
(``L_i`` its mean loss, ``c_i`` what that loss divided by: samples, sum of sample weights or
valid elements); when the window closes the sum is divided **once** by ``sum_i c_i`` and the
optimizer's ``apply`` runs once. So the optimizer sees the gradient of the mean loss over the
whole window, the large-batch gradient, and iterations, learning-rate schedules, Adam's bias
correction, clipping, weight decay and EMA all advance once per window.

Like optax's ``MultiSteps``, all mutable accumulation state lives in this one object, with its
:class:`~accumcore._impl.settings.Settings`; the rule itself is ``accumcore._impl.rule`` (step,
add, close, end), its special cases resolved once per optimizer into a ``rule.Plan`` that the
state caches. The variables are made here, under the names checkpoints know (:data:`SCALARS`);
``accumcore._impl.distribute`` says where each step runs under a ``tf.distribute`` strategy.

Calls go one way: every entry point calls the state (:meth:`AccumulationState.step` for a
micro-batch, :meth:`AccumulationState.one_window` for a batch cut by :func:`micro_batches`, the
one cut of every entry point), which checks the inputs once and calls the rule with the window,
the counters and the plan.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from accumcore._impl import distribute, rule, settings
from accumcore._impl.batchnorm import attach_window_layers
from accumcore._impl.gradients import first_leaf
from accumcore._impl.nonfinite import NonFinitePolicy, Stop
from accumcore._impl.rule import Counters, Window, describe_change, same_variables, variable_name

logger = logging.getLogger("accumcore")

#: The error for a summed loss under a strategy (``prepare`` and ``apply_window`` raise it).
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
        nonfinite: what a non-finite gradient does: ``"raise"`` (default: a window whose
            sum is not finite is discarded whole and :class:`~accumcore.NonFiniteGradientError`
            raised from the Python side) or ``"skip_window"`` (discarded, training goes on),
            both checked once per window; ``"skip_micro_batch"`` (every micro-batch checked,
            only the bad ones left out); or a :class:`~accumcore.NonFinitePolicy`.

    Variables (made by :meth:`build`; under these names in checkpoints): ``accumulators``
    (per trainable variable, the window's ``sum_i c_i * grad(L_i)``, float32 or float64),
    the window's ``window_weight``, ``micro_step`` and ``window_samples``, the run's counters
    (:meth:`counters`), a condemned-window flag (the ``"raise"`` policy's stop is in no
    checkpoint), and ``undivided_accumulators`` once a micro-batch brings ``undivided``
    gradients.

    In a ``train_step`` of your own that calls :meth:`step`, give ``fit``
    ``callbacks=[accumcore.WindowFlushCallback(state)]``: at each epoch's end it applies the
    partial window (:meth:`end_epoch`) and raises the ``"raise"`` policy's stop
    (:meth:`raise_if_nonfinite`), as ``fit`` after ``accumulate`` does.
    """

    def __init__(self, accum_steps: int, *, nonfinite: str | NonFinitePolicy = "raise",
                 name: str = "accumulation") -> None:
        super().__init__(name=name)
        self._settings = _Untracked(settings.resolve(accum_steps=accum_steps,
                                                     nonfinite=nonfinite))
        self._found_micro_batch = _Untracked(None)  # the b that "auto" found
        self.accumulators: list[tf.Variable] = []
        self.undivided_accumulators: list[tf.Variable] = []  # see accumulate(undivided=)
        self._variables = _Untracked(())
        self._pieces = _Untracked(None)  # (Window, Counters, Stop) once built
        self._plans = _Untracked({})  # (optimizer, rule.Plan) by optimizer id, made once each
        self._weighting = _Untracked("auto")
        # The indices of the accumulated variables the loss has a gradient for, as the last
        # traced micro-batch found them (rule.present_of): a window is applied to these only,
        # as optimizer.apply skips a None gradient.
        self._present = _Untracked(())
        #: The call that applies a pending window, for the object the user holds (messages
        #: name it): ``accumcore.flush(model)`` for ``fit``, ``trainer.flush()`` for loops.
        self.flush_call = "`state.flush(optimizer)`"
        #: Where the rule's steps run (one device, or the replicas of the ``tf.distribute``
        #: strategy the state was built under, see :meth:`build`).
        self.replicas = distribute.replicas(None)
        #: Callables ``hook(applied: bool)`` run (in graph, where the update runs) whenever a
        #: window closes: ``True`` after an optimizer update, ``False`` when the window is
        #: skipped or dropped. Layers with per-window state (window-level BatchNorm) register.
        self.window_hooks: list = []

    # ------------------------------------------------------------------ settings
    @property
    def settings(self) -> settings.Settings:
        """The accumulation settings (K, the non-finite policy, the end-of-epoch policy, the
        normaliser as given); assign a new ``Settings`` (``settings.resolve``) between
        windows."""
        return self._settings.value

    @settings.setter
    def settings(self, value: settings.Settings) -> None:
        self._settings = _Untracked(value)
        self._plans.value.clear()  # the plans captured the old settings
        self._found_micro_batch = _Untracked(None)

    @property
    def micro_batch_size(self) -> int | str | None:
        """The samples per micro-batch (b) when ``fit`` splits each batch inside its step.

        The setting, or for ``"auto"`` the size found on the device once the first batch ran
        (``"auto"`` until then); ``None`` when ``fit`` does not split (``accum_steps`` counts
        micro-batches)."""
        found = self._found_micro_batch.value
        return self.settings.micro_batch_size if found is None else found

    @micro_batch_size.setter
    def micro_batch_size(self, value: int) -> None:
        """Record the size ``"auto"`` found (samples)."""
        self._found_micro_batch = _Untracked(settings.check_micro_batch_size(value))

    @property
    def accum_steps(self) -> int:
        """K, the micro-batches per optimizer update."""
        return self.settings.accum_steps

    @accum_steps.setter
    def accum_steps(self, value: int) -> None:
        self.settings = settings.resolve(self.settings, accum_steps=value)

    @property
    def nonfinite(self) -> str:
        """The non-finite policy's name (assign a name or a :class:`~accumcore.NonFinitePolicy`)."""
        return self.nonfinite_policy.name

    @nonfinite.setter
    def nonfinite(self, value: str | NonFinitePolicy) -> None:
        self.settings = settings.resolve(self.settings, nonfinite=value)

    @property
    def nonfinite_policy(self) -> NonFinitePolicy:
        """The :class:`~accumcore.NonFinitePolicy` in force."""
        return self.settings.nonfinite

    @property
    def weighting(self) -> str | Callable:
        """What each micro-batch is weighed by, resolved from the loss
        (``accumcore._impl.denominators.resolve_normalizer``): ``"auto"`` (what the loss divided
        by), ``"samples"``, ``"sample_weight"``, a callable, or ``"sum"`` (a summed loss: the
        window's sum is applied undivided)."""
        return self._weighting.value

    @property
    def normalize(self) -> bool:
        """Whether the window's gradient sum is divided by its weight ``sum_i c_i`` (``False``
        for a summed loss, ``reduction="sum"``)."""
        return self.weighting != "sum"

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
            raise ValueError(NO_VARIABLES)
        if self.built:
            if self.same_variables(variables):
                return False
            check_can_follow(self._variables.value, variables, self.pending_micro_batches(),
                             self.replicas.distributed, self.flush_call)
            with tf.init_scope():  # a new list: tracked lists must only grow to stay saveable
                self.accumulators = new_accumulators(variables, self.replicas.placement)
                if self.undivided_accumulators:
                    self.undivided_accumulators = new_accumulators(
                        variables, self.replicas.placement, "undivided")
            self.replicas.forget()  # compiled closes captured the old accumulators
            self._plans.value.clear()
        else:
            strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
            self.replicas = distribute.replicas(strategy)
            with tf.init_scope():
                # Extend the tracked list in place (not re-assign it) so that a checkpoint read
                # before the state was built restores the accumulators when they are created.
                self.accumulators.extend(
                    new_accumulators(variables, self.replicas.placement))
                saved, unsaved = new_scalars(self.replicas.placement)
            for name, variable in saved.items():
                setattr(self, name, variable)
            self._unsaved = _Untracked(unsaved)  # untracked: in no checkpoint
        self._variables = _Untracked(tuple(variables))  # the model's: not the state's to save
        self._pieces = _Untracked(pieces(self, self._unsaved.value))
        self._present = _Untracked(tuple(range(len(variables))))
        return True

    def build_undivided(self) -> None:
        """Create the ``undivided_accumulators`` (a no-op once they exist): the gradients of
        the sums over samples beside a mean loss, added to the window's update undivided.
        Safe inside a ``tf.function`` trace (created eagerly, ``tf.init_scope``)."""
        self._check_built()
        if self.undivided_accumulators:
            return
        with tf.init_scope():  # extended in place: a checkpoint read earlier restores them
            self.undivided_accumulators.extend(new_accumulators(
                self._variables.value, self.replicas.placement, "undivided"))
        self._pieces = _Untracked(pieces(self, self._unsaved.value))
        self.replicas.forget()  # compiled closes captured the window without them
        self._plans.value.clear()

    def same_variables(self, variables: Sequence) -> bool:
        """Whether ``variables`` are exactly the ones the accumulators were built for."""
        return same_variables(self._variables.value, variables)

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
            raise ValueError(NOT_BUILT)

    @property
    def strategy(self) -> tf.distribute.Strategy | None:
        """The ``tf.distribute`` strategy the state was built under, or ``None`` (no strategy)."""
        return self.replicas.strategy

    def variables_for_saving(self) -> list[tf.Variable]:
        """What a saved model holds to resume mid-window, in a fixed order: the accumulators,
        then ``window_weight``, ``micro_step``, ``window_samples``, the six run counters and
        the flag of a window condemned by a flagged micro-batch (the order of the entries of
        ``.keras`` files), then the undivided
        accumulators where they exist. The ``"raise"`` policy's stop is not saved: a stopped
        state is not saved stopped."""
        self._check_built()
        return [*self.accumulators, *(getattr(self, s.name) for s in SCALARS if s.saved),
                *self.undivided_accumulators]

    def counters(self) -> dict[str, int | float]:
        """The counters as Python numbers (reads the variables; call outside graphs): the
        run-long counts (ints) and the pending window's ``micro_step``, ``window_samples`` and
        ``window_weight`` (``sum_i c_i``, a float: whatever the loss divides by)."""
        self._check_built()
        return {
            s.name: (float if isinstance(s.initial, float) else int)(getattr(self, s.name).numpy())
            for s in SCALARS if s.reported
        }

    # ------------------------------------------------------------------ the rule's steps
    def accumulate(self, grads: Sequence, weight, samples, optimizer=None,
                   undivided: Sequence | None = None) -> tf.Tensor:
        """Add one micro-batch and count it into the window; close nothing.

        Args:
            grads: gradients of the micro-batch's **summed** loss ``c_i * L_i``, one per
                trainable variable (dense tensor, ``tf.IndexedSlices`` or ``None`` for
                variables the loss does not depend on).
            weight: ``c_i``, float scalar (samples, sum of sample weights or item count).
            samples: number of samples in the micro-batch (int scalar), for the counters.
            optimizer: the optimizer the window will be applied with (a
                ``LossScaleOptimizer`` checks the window itself: no micro-batch is checked).
            undivided: ``None``, or gradients (one per trainable variable) of sums beside a
                mean loss (an ``add_loss`` of per-sample values, which Keras sums): the window
                applies ``sum_i grads_i / W + sum_i undivided_i``, so they stay sums.

        Returns:
            bool scalar: whether the micro-batch was added (``False``: a per-micro-batch
            check left it out).
        """
        window, counters, plan = self._checked(grads, optimizer, undivided)
        return rule.add(window, counters, plan, grads, tf.cast(weight, tf.float32),
                        tf.cast(samples, tf.int64), undivided)

    def _checked(self, grads: Sequence, optimizer, undivided: Sequence | None) -> tuple:
        """One micro-batch's gradients checked (once; the ``undivided`` accumulators made
        when it brings them) and the variables they cover recorded: ``(window, counters,
        plan)``, what the rule's functions take."""
        self._check_built()
        if undivided is not None:
            rule.check_gradients(undivided, self.accumulators, "undivided")
            self.build_undivided()
        window, counters, _ = self._pieces_checked()
        rule.check_gradients(grads, self.accumulators)
        self._present = _Untracked(rule.present_of(grads))
        return window, counters, self.plan(optimizer)

    def step(self, grads: Sequence, weight, samples, optimizer, variables: Sequence,
             undivided: Sequence | None = None) -> tf.Tensor:
        """:meth:`accumulate` one micro-batch, then close the window if it holds K: the
        per-micro-batch rule of every entry point (``accumcore._impl.rule.step``).
        Graph-safe; under a strategy it runs in replica context.

        Args:
            grads, weight, samples, optimizer, undivided: as for :meth:`accumulate`.
            variables: the trainable variables ``grads`` belong to, in the same order.

        Returns:
            bool scalar: whether an optimizer update was applied by this call.
        """
        rule.check_variables(self._variables.value, variables)
        window, counters, plan = self._checked(grads, optimizer, undivided)
        plan.replicas.require_replica_context()
        if plan.accum_steps == 1 and self._direct(plan, undivided):  # K = 1: no accumulators
            self._build_optimizer(optimizer, variables)
            return rule.single_window(window, counters, plan, optimizer,
                                      list(self._variables.value), self._present.value,
                                      grads, weight, samples)
        return rule.step(window, counters, plan, optimizer, list(self._variables.value),
                         self._present.value, grads, weight, samples, undivided)

    def _direct(self, plan: rule.Plan, undivided: Sequence | None) -> bool:
        """Whether a window of one micro-batch goes to the optimizer without the accumulators
        (``rule.single_window``): the plan allows it, no window hook (window-level BatchNorm)
        and no ``undivided`` gradients."""
        return plan.direct and not plan.hooks and undivided is None

    def _build_optimizer(self, optimizer, variables: Sequence | None) -> None:
        """Build an optimizer not built yet (a new one from ``compile``) for ``variables``
        (one replica; eagerly, also inside a trace)."""
        if variables is not None and not self.replicas.distributed and not optimizer.built:
            with tf.init_scope():
                optimizer.build(list(variables))

    def one_window(self, optimizer, variables: Sequence, batch: tuple, size: int,
                   contribute: Callable) -> tuple:
        """One batch as one window, in one traced step: the batch cut into micro-batches of
        ``size`` samples (:func:`micro_batches`: the last may be smaller), each added
        (:meth:`accumulate`), then the window closed once (one optimizer update). A batch of
        at most ``size`` samples (known when traced, else decided by a ``tf.cond`` on its
        size) is one micro-batch: on one replica its window goes to the optimizer without
        the accumulators (``rule.single_window``), the same update and counts.

        Args:
            optimizer: the Keras optimizer the window is applied with.
            variables: the model's trainable variables now (must be those accumulated).
            batch: ``(x, y, sample_weight)`` of the whole batch (``y``, ``sample_weight`` may
                be ``None``); the leading dimension of every tensor is the batch's samples.
            size: b, samples per micro-batch (a Python int: every micro-batch but the last
                has this static shape, as XLA needs).
            contribute: ``contribute(x_i, y_i, sample_weight_i) -> MicroBatchResult``, one
                micro-batch's forward and backward pass (and whatever else it records).

        Returns:
            ``(loss, log_weight, applied)``: the batch's mean loss ``sum c_i L_i / sum c_i``
            (float32 scalar), ``sum c_i`` (float32 scalar) and whether an optimizer update
            was applied (bool scalar).
        """
        rule.check_variables(self._variables.value, variables)

        def add_one(micro_batch: tuple, totals: tuple) -> tuple:
            out = contribute(*micro_batch)
            self.accumulate(out.grads, out.weight, out.samples, optimizer, out.undivided)
            return totals[0] + out.weighted_loss, totals[1] + out.log_weight

        def split() -> tuple:
            totals = micro_batches(batch, size, add_one, (tf.constant(0.0), tf.constant(0.0)))
            applied = self._close_split(optimizer)
            return tf.math.divide_no_nan(*totals), totals[1], applied

        def whole() -> tuple:  # the batch is one micro-batch: its window skips accumulators
            out = contribute(*batch)
            loss = tf.math.divide_no_nan(out.weighted_loss, out.log_weight)
            window, counters, plan = self._checked(out.grads, optimizer, out.undivided)
            if not self._direct(plan, out.undivided):
                self.accumulate(out.grads, out.weight, out.samples, optimizer, out.undivided)
                return loss, out.log_weight, self.apply_window(optimizer)
            self._build_optimizer(optimizer, variables)
            return loss, out.log_weight, rule.single_window(
                window, counters, plan, optimizer, list(self._variables.value),
                self._present.value, out.grads, out.weight, out.samples)

        if self.replicas.distributed:
            return split()
        n_static = first_leaf(batch[0]).shape[0]
        if n_static is not None:
            return whole() if n_static <= size else split()
        return tf.cond(tf.shape(first_leaf(batch[0]))[0] <= size, whole, split)

    def _close_split(self, optimizer) -> tf.Tensor:
        """Close the window a split batch has just filled (:meth:`one_window`): on one
        replica the batch was larger than b, so :func:`micro_batches` added at least one
        micro-batch and the window is due: ``rule.close`` now, without
        :meth:`apply_window`'s ``tf.cond`` on the window's count (the branch it would take,
        the same update and counts). Under a strategy a replica's share of the batch may be
        empty: :meth:`apply_window`. Returns whether an optimizer update was applied."""
        if self.replicas.distributed:
            return self.apply_window(optimizer)
        window, counters, _ = self._pieces_checked()
        return rule.close(window, counters, self.plan(optimizer), optimizer,
                          list(self._variables.value), self._present.value)

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
        window, counters, _ = self._pieces_checked()
        self._build_optimizer(optimizer, variables)
        if not self.normalize and self.replicas.distributed:
            raise ValueError(SUM_UNDER_STRATEGY)
        plan, present = self.plan(optimizer), self._present.value
        key = (id(optimizer), present, *map(id, self._variables.value))
        return rule.close_window(window, counters, plan, optimizer, list(self._variables.value),
                                 present, force=True, key=key)

    def drop_window(self) -> None:
        """Discard the current window unapplied (counted in ``samples_dropped`` only)."""
        window, counters, _ = self._pieces_checked()
        rule.end(window, counters, self.replicas, False, self.window_hooks, counted=False)

    def discard_window_layers(self) -> None:
        """Empty what window-level layers (``WindowBatchNormalization``'s window moments,
        variables outside the model's) pooled in the open window; the accumulators and counts
        stay. For a step that is run again (a trial step of ``micro_batch_size="auto"``, a
        step aborted by an out-of-memory error): its rerun pools them again."""
        for hook in self.window_hooks:
            hook(False)

    def plan(self, optimizer) -> rule.Plan:
        """The rule's :class:`~accumcore._impl.rule.Plan` for ``optimizer``: made once per
        optimizer (and again after the settings, the weighting or the accumulators change)."""
        plans = self._plans.value  # id -> (optimizer, plan): an id is reused only once freed
        held, plan = plans.get(id(optimizer), (self, None))  # self: nothing held yet
        if held is not optimizer:
            plan = rule.plan(
                self.nonfinite_policy, optimizer, self.replicas, self._pieces_checked()[2],
                accum_steps=self.accum_steps, normalize=self.normalize,
                hooks=self.window_hooks)
            plans[id(optimizer)] = (optimizer, plan)
        return plan

    # ------------------------------------------------------------------ around the steps
    def prepare(self, model, weighting: str | Callable | None = None, *,
                distributed: bool = False) -> bool:
        """Ready the state for training ``model`` (inside ``strategy.scope()`` under a
        strategy): build the accumulators for ``model.trainable_variables`` (or follow a
        changed set: :meth:`build`), set ``weighting`` (``None``: unchanged) and attach
        ``model``'s window-level BatchNorm layers. Every entry point calls this before
        training.

        Returns:
            Whether accumulators were created now (first build or a new trainable set).

        Raises:
            ValueError: for a summed loss (``weighting="sum"``) under a strategy.
        """
        if weighting == "sum" and distributed:
            raise ValueError(SUM_UNDER_STRATEGY)
        created = self.build(model.trainable_variables)
        if weighting is not None and weighting != self.weighting:
            self._weighting = _Untracked(weighting)
            self._plans.value.clear()
        attach_window_layers(model, self)  # window-level BN: one update per window
        return created

    def end_epoch(self, policy: str, optimizer, variables: Sequence | None = None,
                  epoch: int | None = None) -> str | None:
        """Apply an end-of-epoch policy to the pending partial window (from Python; under a
        strategy in cross-replica context).

        Args:
            policy: ``"apply"`` (one update with the window's true weight:
                :meth:`apply_window`), ``"drop"`` (discard it, counted in ``samples_dropped``;
                logged as a warning) or ``"carry"`` (keep it; logged).
            optimizer: the Keras optimizer, for ``"apply"``.
            variables: the model's current trainable variables (see :meth:`apply_window`).
            epoch: the epoch that ended, for the log line.

        Returns:
            ``None`` if no window was pending (nothing done), else what was done:
            ``"applied"`` (an optimizer update), ``"skipped"`` (``"apply"``, but the window
            was skipped: non-finite, or training stopped), ``"dropped"`` or ``"carried"``.
        """
        pending = self.pending_micro_batches()
        if pending == 0:
            return None
        if policy == "apply":
            return "applied" if bool(self.apply_window(optimizer, variables)) else "skipped"
        where = f" at the end of epoch {epoch + 1}" if epoch is not None else ""
        if policy == "drop":
            logger.warning(
                "end_of_epoch='drop': discarding a partial window of %d micro-batch%s "
                "(%d samples)%s.", pending, "" if pending == 1 else "es",
                int(self.window_samples.numpy()), where)
            self.drop_window()
            return "dropped"
        logger.info("end_of_epoch='carry': %d micro-batch%s carried into the next epoch.",
                    pending, "" if pending == 1 else "es")
        return "carried"

    def flush(self, optimizer, variables: Sequence | None = None) -> bool:
        """Apply the pending partial window now, with its true weight (no-op when empty).

        Returns:
            Whether an optimizer update was applied.
        """
        return self.end_epoch("apply", optimizer, variables) == "applied"

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



# ---------------------------------------------------------------------------- the batch, cut
# The one cut of every entry point given a batch (``AccumulationState.one_window``: ``fit``
# with ``micro_batch_size``, ``AccumTrainer``'s split steps and ``window_step``): b, b, ...,
# the rest.
def micro_batches(batch: tuple, size: int, body: Callable, totals: tuple) -> tuple:
    """Run ``totals = body(micro_batch, totals)`` on every micro-batch of ``batch``, in order:
    ``n // size`` micro-batches of exactly ``size`` samples in a ``tf.while_loop`` (one at a
    time: ``parallel_iterations=1``, so only one micro-batch's activations are alive, and the
    graph does not grow with their number), then the ``n % size`` samples left, if any. Every
    slice has a static size where the batch's is static, so XLA never clamps a slice that runs
    past the batch's end (it would silently re-read samples). A batch known to fit in one
    micro-batch runs without the loop.
    """
    n_static = first_leaf(batch[0]).shape[0]
    if n_static is not None and n_static <= size:  # one micro-batch: no loop (XLA on a CPU
        return body(batch, totals)  # runs a convolution inside a loop far slower)
    n = tf.shape(first_leaf(batch[0]))[0]
    full = n // size

    def loop_body(i, *loop_totals):
        return (i + 1, *body(take(batch, i * size, size), loop_totals))

    _, *totals = tf.while_loop(lambda i, *_: i < full, loop_body, (tf.constant(0), *totals),
                               parallel_iterations=1)
    totals = tuple(totals)
    if n_static is not None:  # the rest's size known now
        rest = n_static % size
        return body(take(batch, n_static - rest, rest), totals) if rest else totals
    rest = n - full * size
    return tf.cond(rest > 0, lambda: body(take(batch, full * size, rest), totals),
                   lambda: totals)


def take(batch: Any, start, length) -> Any:
    """Samples ``[start, start + length)`` of every tensor in ``batch`` (``None`` stays).

    Every slice keeps the static shape of every non-batch dimension of its tensor (and a
    static batch dimension where ``length`` is a Python int): Keras decides things from static
    shapes at trace time (the squeeze of ``(N, 1)`` integer labels, ``Reshape``, a layer
    reading ``shape[-1]``), and ``tf.slice`` with a traced ``begin`` would forget them."""
    static_length = length if isinstance(length, int) else None

    def one(t):
        if t is None:
            return None
        if isinstance(t, tf.Tensor) and t.shape.rank is not None:
            rank = t.shape.rank
            begin = tf.stack([tf.cast(start, tf.int32)] + [0] * (rank - 1))
            sizes = [length] + [-1] * (rank - 1) if static_length is not None else (
                tf.stack([tf.cast(length, tf.int32)] + [-1] * (rank - 1)))
            piece = tf.slice(t, begin, sizes)
            piece.set_shape(tf.TensorShape([static_length]).concatenate(t.shape[1:]))
            return piece
        return t[start : start + length]

    return tf.nest.map_structure(one, batch)


# ---------------------------------------------------------------------------- the state's variables
def accumulator_dtype(variable_dtype: tf.DType) -> tf.DType:
    """float32 for float16/bfloat16/float32 variables, float64 for float64 variables."""
    return tf.float64 if variable_dtype == tf.float64 else tf.float32


def variable_dtype(variable) -> tf.DType:
    """A (Keras or TensorFlow) variable's dtype, as a ``tf.DType``."""
    return tf.as_dtype(getattr(variable, "dtype", tf.float32))


class Scalar(NamedTuple):
    """One scalar variable of the state (int64, or float32 for a float ``initial``; an int64
    vector for a tuple ``initial``: the stop's record)."""

    name: str
    initial: int | float | tuple
    summed: bool  # under a strategy: SUM over the replicas (else the first replica's value)
    reported: bool  # in counters()
    saved: bool  # in variables_for_saving()


#: Every scalar of the state, in the order of ``variables_for_saving`` (after the
#: accumulators; the order of the numbered entries ``AccumulationStore`` writes to ``.keras``
#: files: never reorder).
SCALARS = (
    Scalar("window_weight", 0.0, summed=True, reported=True, saved=True),
    Scalar("micro_step", 0, summed=False, reported=True, saved=True),
    Scalar("window_samples", 0, summed=True, reported=True, saved=True),
    Scalar("windows_applied", 0, summed=False, reported=True, saved=True),
    Scalar("windows_skipped", 0, summed=False, reported=True, saved=True),
    Scalar("micro_batches_seen", 0, summed=False, reported=True, saved=True),
    # Summed: under a strategy each replica skips its own shard of a micro-batch.
    Scalar("micro_batches_skipped", 0, summed=True, reported=True, saved=True),
    Scalar("samples_seen", 0, summed=True, reported=True, saved=True),
    Scalar("samples_dropped", 0, summed=True, reported=True, saved=True),
    Scalar("window_poisoned", 0, summed=False, reported=False, saved=True),
    # The "raise" policy's stop (accumcore._impl.nonfinite.Stop): the bad window, its first
    # micro-batch and size, its first non-finite variable; -1 each while not stopped.
    Scalar("nonfinite_stop", (-1, -1, -1, -1), summed=False, reported=False, saved=False),
)


def saved_micro_step(values: Sequence) -> int:
    """The pending window's micro-batch count in saved values (``variables_for_saving``).

    Readable without building a state (e.g. to refuse loading a partial window into a model
    that has nothing to apply it to): the saved scalars come last, in :data:`SCALARS` order.
    """
    saved = [s.name for s in SCALARS if s.saved]
    index = len(values) - len(saved) + saved.index("micro_step")
    return int(values[index]) if 0 <= index < len(values) else 0


#: The error for using a state before :meth:`~accumcore.AccumulationState.build`.
NOT_BUILT = ("AccumulationState is not built: call `state.build(model.trainable_variables)` "
             "once the model has variables.")

#: The error for building a state from no variables (an unbuilt model).
NO_VARIABLES = (
    "The model has no trainable variables yet, so there is nothing to accumulate. "
    "Build the model first: call it on one batch, call `model.build(input_shape)`, "
    "or start it with `keras.Input(shape=...)`."
)


def new_accumulators(variables: Sequence, placement: Callable[..., dict],
                     prefix: str = "accum") -> list[tf.Variable]:
    """Zero accumulators, one per variable (float32; float64 for float64 variables), named
    ``{prefix}_{i}``.

    ``placement(summed)``: the ``tf.Variable`` keywords that place a variable on the replicas
    (``accumcore._impl.distribute.Replicas.placement``). Call in ``tf.init_scope``.
    """
    return [
        tf.Variable(tf.zeros(v.shape, accumulator_dtype(variable_dtype(v))),
                    trainable=False, name=f"{prefix}_{i}", **placement(summed=True))
        for i, v in enumerate(variables)
    ]


def new_scalars(placement: Callable[..., dict]) -> tuple[dict, dict]:
    """Every scalar of :data:`SCALARS` at its initial value, by name: ``(saved, unsaved)``
    (``placement``: as for :func:`new_accumulators`). The state tracks the saved ones; the
    unsaved one (the non-finite stop) is in no checkpoint: a state is not saved stopped."""
    made = {
        s.name: tf.Variable(
            tf.constant(s.initial, tf.float32 if isinstance(s.initial, float) else tf.int64),
            trainable=False, name=s.name, **placement(s.summed))
        for s in SCALARS
    }
    saved = {s.name: made[s.name] for s in SCALARS if s.saved}
    return saved, {name: v for name, v in made.items() if name not in saved}


def pieces(state, unsaved: dict[str, tf.Variable]) -> tuple[Window, Counters, Stop]:
    """The ``Window``, ``Counters`` and ``Stop`` over a built state's variables (``unsaved``:
    the scalars not saved, by name, which the state keeps out of checkpoints)."""
    s = state
    window = Window(s.accumulators, s.window_weight, s.micro_step, s.window_samples,
                    s.window_poisoned, list(s.undivided_accumulators))
    counters = Counters(*(getattr(s, name) for name in COUNTERS))
    return window, counters, Stop(unsaved["nonfinite_stop"], state.replicas.parts)


#: The run-long counters, in ``rule.Counters`` order.
COUNTERS = ("windows_applied", "windows_skipped", "micro_batches_seen",
            "micro_batches_skipped", "samples_seen", "samples_dropped")


def check_can_follow(built: Sequence, variables: Sequence, pending: int,
                     distributed: bool, flush_call: str) -> None:
    """Raise unless the accumulators may follow the trainable set from ``built`` to
    ``variables`` now: the window is empty (``pending`` micro-batches; the error names
    ``flush_call``), and a state built under a strategy is re-built inside its scope."""
    if pending:
        old = [variable_name(v) for v in built]
        new = [variable_name(v) for v in variables]
        raise ValueError(
            f"The trainable variables changed ({len(old)} -> {len(new)} variables: "
            f"{describe_change(old, new)}) while a window of {pending} micro-batches is "
            f"pending. Its gradients belong to the old set: apply it first with {flush_call}, "
            "then change `trainable` (or train on: the next `fit` after `compile` follows "
            "the new set)."
        )
    if distributed and not tf.distribute.has_strategy():
        raise ValueError(
            "This AccumulationState was built under a tf.distribute strategy: re-build it "
            "for the new trainable set inside `strategy.scope()`."
        )
