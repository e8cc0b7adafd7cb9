"""The accumulation state: one small trackable object that every entry point shares.

The update rule (the only rule that makes accumulation exact):

* every micro-batch ``i`` contributes the gradient of its **summed** loss, ``c_i * grad(L_i)``,
  where ``L_i`` is the micro-batch's mean loss and ``c_i`` its weight (number of samples, sum of
  sample weights, or a caller-supplied item count such as valid tokens);
* when the window closes, the sum is divided **once** by ``sum_i c_i`` and the optimizer's
  ``apply`` is called exactly once.

So the optimizer sees ``sum_i c_i grad(L_i) / sum_i c_i``, which is the gradient of the mean
loss over the whole window: the large-batch gradient. Iterations, learning-rate schedules,
Adam's bias correction, clipping, weight decay and EMA all advance once per window.

Like optax's ``MultiSteps``, all mutable accumulation state lives here; the inner optimizer
is touched only when a window completes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import tensorflow as tf

from accumcore import distribute
from accumcore.config import NONFINITE_POLICIES, check_accum_steps, check_choice
from accumcore.errors import NonFiniteGradientError

_ON_READ = tf.VariableSynchronization.ON_READ

logger = logging.getLogger("accumcore")


def _accumulator_dtype(variable_dtype: tf.DType) -> tf.DType:
    """float32 for float16/bfloat16/float32 variables, float64 for float64 variables."""
    return tf.float64 if variable_dtype == tf.float64 else tf.float32


def _as_dtype(variable) -> tf.DType:
    return tf.as_dtype(getattr(variable, "dtype", tf.float32))


class _Untracked:
    """Holds a Python value out of ``tf.Module`` tracking (so out of checkpoints)."""

    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value


def _describe_change(old: list[str], new: list[str]) -> str:
    """``"+a/kernel, -b/bias"``: variables that became trainable (+) or frozen (-)."""
    added = [f"+{n}" for n in new if n not in old]
    removed = [f"-{n}" for n in old if n not in new]
    parts = added + removed
    return ", ".join(parts[:6] + (["..."] if len(parts) > 6 else [])) or "same names, new objects"


class AccumulationState(tf.Module):
    """Gradient accumulators and window counters (trackable; checkpoint it mid-window).

    Args:
        accum_steps: K, the number of micro-batches per optimizer update (int >= 1).
        nonfinite: what to do with a micro-batch whose gradient contains NaN or Inf:
            ``"raise"`` (default: freeze the state before that micro-batch and raise
            :class:`~accumcore.NonFiniteGradientError` from the Python side),
            ``"skip_micro_batch"`` (drop only that micro-batch's gradient and weight),
            ``"skip_window"`` (drop the whole window, apply nothing).

    Variables (created by :meth:`build`, lazily, from the model's trainable variables):

    * ``accumulators``: one per trainable variable, same shape, float32 (float64 for float64
      variables), holding ``sum_i c_i * grad(L_i)`` of the current window.
    * ``window_weight``: float32 scalar, ``sum_i c_i`` of the current window.
    * ``micro_step``: int64, number of micro-batches already in the current window (0..K-1).
    * ``window_samples``: int64, samples in the current window.
    * Counters (int64, over the whole run): ``windows_applied``, ``windows_skipped``,
      ``micro_batches_seen``, ``micro_batches_skipped``, ``samples_seen`` (samples counted
      into windows, applied or pending, plus skipped non-finite micro-batches),
      ``samples_dropped`` (by the ``"drop"`` end-of-epoch policy, a skipped window or a
      skipped micro-batch). Samples that reached an update: ``samples_seen - samples_dropped
      - window_samples``.
    """

    def __init__(
        self, accum_steps: int, *, nonfinite: str = "raise", name: str = "accumulation"
    ) -> None:
        super().__init__(name=name)
        self.accum_steps = check_accum_steps(accum_steps)
        self.nonfinite = check_choice(nonfinite, "nonfinite", NONFINITE_POLICIES)
        self.accumulators: list[tf.Variable] = []
        self._variable_names: list[str] = []
        self._has_gradient: list[bool] = []
        self._variables = _Untracked(())
        self._built = False
        #: Whether the window's gradient sum is divided by its weight ``sum_i c_i`` (the
        #: default, for mean losses); if not, it is applied as it is, for losses that are
        #: already sums (``reduction="sum"``). AccumTrainer / AccumModel set it from the loss.
        self.normalize = True
        self._strategy = None  # the tf.distribute strategy the variables were built under
        #: Callables ``hook(applied: bool)`` run (in graph, where the update runs) whenever a
        #: window closes: ``True`` after an optimizer update, ``False`` when the window is
        #: skipped or dropped. Layers with per-window state (e.g. window-level BatchNorm
        #: statistics) register here.
        self.window_hooks: list = []

    # ------------------------------------------------------------------ building
    @property
    def built(self) -> bool:
        return self._built

    def build(self, variables: Sequence) -> bool:
        """Create the accumulators for ``variables`` (the model's trainable variables).

        Safe to call inside a ``tf.function`` trace or a distribution strategy scope: the
        variables are created eagerly (``tf.init_scope``). Calling it again with the same
        variables (same objects, same order) is a no-op. Called with a *different* set (a layer
        was frozen or unfrozen, as in fine-tuning), the accumulators follow it: they are
        re-created for the new set when the window is empty (counters, flags and the
        ``nonfinite`` state are kept). With a pending window that would lose accumulated
        gradients, so it raises instead.

        Returns:
            Whether accumulators were created now (first build or a new trainable set).

        Raises:
            ValueError: if ``variables`` is empty (an unbuilt model has no variables yet), or if
                the set changed while a window is pending (flush it first:
                ``model.flush_window()`` / ``trainer.flush()``).
        """
        variables = list(variables)
        if not variables:
            raise ValueError(
                "The model has no trainable variables yet, so there is nothing to accumulate. "
                "Build the model first: call it on one batch, call `model.build(input_shape)`, "
                "or start it with `keras.Input(shape=...)`."
            )
        if self._built:
            if self.same_variables(variables):
                return False
            self._follow(variables)
            return True
        on_read = tf.distribute.has_strategy()
        self._strategy = tf.distribute.get_strategy() if on_read else None
        sync = dict(synchronization=_ON_READ) if on_read else {}
        sum_agg = dict(aggregation=tf.VariableAggregation.SUM) if on_read else {}
        first = dict(aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA) if on_read else {}
        with tf.init_scope():
            # Extend the tracked list in place (not re-assign it) so that a checkpoint read
            # before the state was built restores the accumulators when they are created.
            self.accumulators.extend(self._new_accumulators(variables))
            self.window_weight = tf.Variable(
                0.0, trainable=False, name="window_weight", **sync, **sum_agg
            )

            def counter(name: str, value: int = 0, agg: dict = first) -> tf.Variable:
                return tf.Variable(
                    tf.constant(value, tf.int64), trainable=False, name=name, **sync, **agg
                )

            self.micro_step = counter("micro_step")
            self.window_samples = counter("window_samples", agg=sum_agg)
            self.windows_applied = counter("windows_applied")
            self.windows_skipped = counter("windows_skipped")
            self.micro_batches_seen = counter("micro_batches_seen")
            # SUM: under a strategy each replica skips its own shard of a micro-batch.
            self.micro_batches_skipped = counter("micro_batches_skipped", agg=sum_agg)
            self.samples_seen = counter("samples_seen", agg=sum_agg)
            self.samples_dropped = counter("samples_dropped", agg=sum_agg)
            # Flags (int64 so that they checkpoint and cross devices like the counters).
            self.window_poisoned = counter("window_poisoned")
            self.nonfinite_micro_step = counter("nonfinite_micro_step", -1)
            self.nonfinite_window_position = counter("nonfinite_window_position", -1)
            self.nonfinite_variable = counter("nonfinite_variable", -1)
        self._set_variables(variables)
        self._built = True
        return True

    def _new_accumulators(self, variables: list) -> list[tf.Variable]:
        """Zero accumulators, one per variable (ON_READ, SUM under a strategy)."""
        on_read = tf.distribute.has_strategy()
        extra = (
            dict(synchronization=_ON_READ, aggregation=tf.VariableAggregation.SUM)
            if on_read else {}
        )
        with tf.init_scope():
            return [
                tf.Variable(
                    tf.zeros(v.shape, _accumulator_dtype(_as_dtype(v))),
                    trainable=False,
                    name=f"accum_{i}",
                    **extra,
                )
                for i, v in enumerate(variables)
            ]

    def _set_variables(self, variables: list) -> None:
        # Held outside tf.Module's tracking: the model's variables are not the state's to save.
        self._variables = _Untracked(tuple(variables))
        self._variable_names = [getattr(v, "path", None) or v.name for v in variables]
        self._has_gradient = [True] * len(variables)

    def _follow(self, variables: list) -> None:
        """Re-create the accumulators for a new trainable set (the window must be empty)."""
        old = list(self._variable_names)
        new = [getattr(v, "path", None) or v.name for v in variables]
        pending = self.pending_micro_batches()
        if pending:
            raise ValueError(
                f"The trainable variables changed ({len(old)} -> {len(new)} variables: "
                f"{_describe_change(old, new)}) while a window of {pending} micro-batches is "
                "pending. Its gradients belong to the old set: apply it first with "
                "`model.flush_window()` (AccumModel) or `trainer.flush()` (AccumTrainer), "
                "then change `trainable` (or train on: the next `fit` after `compile` follows "
                "the new set)."
            )
        if self._strategy is not None and not tf.distribute.has_strategy():
            raise ValueError(
                "This AccumulationState was built under a tf.distribute strategy: re-build it "
                "for the new trainable set inside `strategy.scope()`."
            )
        with tf.init_scope():
            # A new list (not an in-place edit: tracked lists must only grow to stay saveable).
            self.accumulators = self._new_accumulators(variables)
        self._set_variables(variables)
        distribute.forget_functions(self)

    def same_variables(self, variables: Sequence) -> bool:
        """Whether ``variables`` are exactly the ones the accumulators were built for."""
        built = self._variables.value if self._built else ()
        variables = tuple(variables)
        return len(variables) == len(built) and all(a is b for a, b in zip(variables, built))

    @property
    def variables_accumulated(self) -> tuple:
        """The trainable variables the accumulators belong to, in order (empty if unbuilt)."""
        return self._variables.value if self._built else ()

    def pending_micro_batches(self) -> int:
        """Micro-batches in the current window (Python int; 0 when unbuilt). Call eagerly."""
        if not self._built:
            return 0
        with tf.init_scope():
            return distribute.max_local(self, self.micro_step)[0]

    # ------------------------------------------------------------------ queries
    def _check_built(self) -> None:
        if not self._built:
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
            names = [getattr(v, "path", None) or v.name for v in variables]
            raise ValueError(
                f"The trainable variables ({len(names)}) are not the ones the accumulators "
                f"were built for ({len(self._variable_names)}; "
                f"{_describe_change(self._variable_names, names)}): a layer was frozen or "
                "unfrozen. Call `state.build(model.trainable_variables)` with an empty window "
                "before the next step (AccumTrainer does this itself, `AccumModel.fit` after "
                "`compile`), and retrace compiled steps."
            )

    @property
    def strategy(self) -> tf.distribute.Strategy | None:
        """The ``tf.distribute`` strategy the state was built under (``None``: no strategy)."""
        return self._strategy

    @property
    def frozen(self) -> tf.Tensor:
        """True once a non-finite gradient was seen under ``nonfinite="raise"``."""
        return self.nonfinite_micro_step >= 0

    def counters(self) -> dict[str, int]:
        """Run-long counters as Python ints (reads the variables; call outside graphs)."""
        self._check_built()
        names = (
            "micro_step",
            "window_samples",
            "windows_applied",
            "windows_skipped",
            "micro_batches_seen",
            "micro_batches_skipped",
            "samples_seen",
            "samples_dropped",
        )
        return {n: int(getattr(self, n).numpy()) for n in names}

    # ------------------------------------------------------------------ update rule
    def accumulate(self, grads: Sequence, weight, samples, optimizer=None) -> tf.Tensor:
        """Add one micro-batch: ``grads`` are gradients of its **summed** loss ``c_i * L_i``.

        Args:
            grads: one gradient per trainable variable (dense tensor, ``tf.IndexedSlices`` or
                ``None`` for variables the loss does not depend on).
            weight: ``c_i``, float scalar (samples, sum of sample weights or item count).
            samples: number of samples in the micro-batch (int scalar), for the counters.
            optimizer: the optimizer the window will be applied with (optional). With a
                ``keras.optimizers.LossScaleOptimizer`` the per-micro-batch ``nonfinite``
                policy is not applied: an overflowing micro-batch is added as it is and the
                window is checked once, when it closes (skipped whole, loss scale lowered).

        Returns:
            A bool scalar: whether the micro-batch was added (False if it was skipped or the
            state is frozen by a non-finite gradient).
        """
        self._check_built()
        self._check_gradients(grads)
        self._has_gradient = [g is not None for g in grads]
        weight = tf.cast(weight, tf.float32)
        samples = tf.cast(samples, tf.int64)
        present = [(i, g) for i, g in enumerate(grads) if g is not None]
        finite_flags = [
            tf.reduce_all(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g))
            for _, g in present
        ]
        finite_flags.append(tf.math.is_finite(weight))
        flags = tf.stack(finite_flags)
        finite = tf.reduce_all(flags)
        if distribute.is_loss_scale_optimizer(optimizer):
            finite = tf.constant(True)  # overflow is handled once per window (loss scaling)
        not_frozen = tf.logical_not(self.frozen)

        def add() -> tf.Tensor:
            for i, g in present:
                acc = self.accumulators[i]
                if isinstance(g, tf.IndexedSlices):
                    acc.scatter_add(
                        tf.IndexedSlices(tf.cast(g.values, acc.dtype), g.indices, g.dense_shape)
                    )
                else:
                    acc.assign_add(tf.cast(g, acc.dtype))
            self.window_weight.assign_add(weight)
            self.window_samples.assign_add(samples)
            self.samples_seen.assign_add(samples)
            return tf.constant(True)

        def skip() -> tf.Tensor:
            self.micro_batches_skipped.assign_add(1)
            # Its samples were seen but reach no update: count them as seen and dropped, so
            # that samples_seen always sums to (dataset size x epochs).
            self.samples_seen.assign_add(samples)
            self.samples_dropped.assign_add(samples)
            if self.nonfinite == "skip_window":
                self.window_poisoned.assign(1)
            return tf.constant(False)

        def freeze() -> tf.Tensor:
            # First offending variable: index among *present* gradients -> variable index.
            bad = tf.argmin(tf.cast(flags[:-1], tf.int32)) if present else 0
            index_map = tf.constant([i for i, _ in present] or [-1], tf.int64)
            var_index = tf.cond(
                tf.reduce_all(flags[:-1]) if present else tf.constant(True),
                lambda: tf.constant(-1, tf.int64),  # only the weight was non-finite
                lambda: tf.gather(index_map, bad),
            )
            self.nonfinite_variable.assign(var_index)
            self.nonfinite_window_position.assign(self.micro_step)
            self.nonfinite_micro_step.assign(self.micro_batches_seen)
            return tf.constant(False)

        def live() -> tf.Tensor:
            if self.nonfinite == "raise":
                added = tf.cond(finite, add, freeze)
            else:
                added = tf.cond(finite, add, skip)
            return added

        return tf.cond(not_frozen, live, lambda: tf.constant(False))

    def _window_gradients(self, variables: Sequence) -> list:
        """The window's mean gradients, ``sum_i c_i grad(L_i) / sum_i c_i``, per variable
        (the plain sum ``sum_i grad(L_i)`` when :attr:`normalize` is False)."""
        weight = self.window_weight
        grads = []
        for acc, var, has in zip(self.accumulators, variables, self._has_gradient):
            if not has:
                grads.append(None)
                continue
            g = acc.read_value()
            if self.normalize:
                g = tf.math.divide_no_nan(g, tf.cast(weight, acc.dtype))
            grads.append(tf.cast(g, _as_dtype(var)))
        return grads

    def reset(self) -> None:
        """Empty the current window (accumulators, weight, position); counters are kept."""
        self._check_built()
        if self._strategy is not None and not distribute.in_replica_context():
            distribute.reset_components(self)  # every replica, without reading the sums
            return
        for acc in self.accumulators:
            acc.assign(tf.zeros_like(acc))
        self.window_weight.assign(0.0)
        self.window_samples.assign(0)
        self.micro_step.assign(0)
        self.window_poisoned.assign(0)

    def apply_window(self, optimizer, variables: Sequence | None = None) -> tf.Tensor:
        """Close the current window: one ``optimizer.apply`` with the window's mean gradient.

        A window poisoned by a non-finite gradient (``nonfinite="skip_window"``) is discarded
        and counted in ``windows_skipped`` instead, and so is a window whose loss-scaled
        gradient is not finite under a ``LossScaleOptimizer`` (the loss scale is lowered). An
        empty window does nothing. Graph-safe. Under a ``tf.distribute`` strategy the window
        is closed by ``accumcore.distribute.close_window`` (replica or cross-replica context).

        Args:
            optimizer: the Keras optimizer (``apply`` is called once).
            variables: the model's current trainable variables. The window is applied to the
                variables its accumulators were built for (:attr:`variables_accumulated`), also
                when ``trainable`` changed since; an optimizer that is not built yet (a new one
                from ``compile``) is built for ``variables``, so that it can update the whole
                current set afterwards (a Keras optimizer cannot take new variables later).

        Returns:
            bool scalar: whether an optimizer update was applied.
        """
        self._check_built()
        if variables is not None and self._strategy is None and not optimizer.built:
            with tf.init_scope():
                optimizer.build(list(variables))
        # The window is applied to the variables it was accumulated for, even if `trainable`
        # changed since (e.g. a flush after unfreezing a layer).
        variables = list(self._variables.value)
        if not self.normalize and self._strategy is not None:
            raise ValueError(
                "A loss with reduction='sum' is not supported under a tf.distribute strategy "
                "(Keras scales such losses differently per replica): use "
                "reduction='sum_over_batch_size' (the default) or 'mean_with_sample_weight'."
            )
        if self._strategy is not None:
            return distribute.close_window(self, optimizer, variables)
        has_data = self.micro_step > 0
        poisoned = self.window_poisoned > 0
        live = tf.logical_and(has_data, tf.logical_not(self.frozen))

        def do_apply():
            if distribute.is_loss_scale_optimizer(optimizer):
                applied = distribute.apply_update(
                    optimizer, self._window_gradients(variables), variables
                )
                return tf.cond(applied, applied_window, do_skip)
            optimizer.apply(self._window_gradients(variables), variables)
            return applied_window()

        def applied_window():
            self.windows_applied.assign_add(1)
            self._run_hooks(True)
            self.reset()
            return tf.constant(True)

        def do_skip():
            self.windows_skipped.assign_add(1)
            self.samples_dropped.assign_add(self.window_samples)
            self._run_hooks(False)
            self.reset()
            return tf.constant(False)

        def maybe():
            return tf.cond(poisoned, do_skip, do_apply)

        return tf.cond(live, maybe, lambda: tf.constant(False))

    def drop_window(self) -> None:
        """Discard the current partial window (end-of-epoch policy ``"drop"``), counting it."""
        self._check_built()
        if self._strategy is not None and not distribute.in_replica_context():
            distribute.drop_window(self)
            return
        self.samples_dropped.assign_add(self.window_samples)
        self._run_hooks(False)
        self.reset()

    def _run_hooks(self, applied: bool) -> None:
        for hook in self.window_hooks:
            hook(applied)

    def step(self, grads: Sequence, weight, samples, optimizer, variables: Sequence) -> tf.Tensor:
        """Accumulate one micro-batch and close the window when it holds K micro-batches.

        This is the whole per-micro-batch rule used by the eager loop, the compiled loop and
        ``AccumModel.train_step``. Graph-safe (no Python decision depends on tensor values).

        Returns:
            bool scalar: whether an optimizer update was applied by this call.
        """
        self._check_built()
        self._check_variables(variables)
        if self._strategy is not None:  # replica context: the window decision is cross-replica
            self.accumulate(grads, weight, samples, optimizer)
            return distribute.replica_step(self, optimizer, variables)
        self.accumulate(grads, weight, samples, optimizer)

        def advance():
            self.micro_batches_seen.assign_add(1)
            self.micro_step.assign_add(1)
            return tf.cond(
                self.micro_step >= self.accum_steps,
                lambda: self.apply_window(optimizer, variables),
                lambda: tf.constant(False),
            )

        return tf.cond(self.frozen, lambda: tf.constant(False), advance)

    # ------------------------------------------------------------------ non-finite report
    def raise_if_nonfinite(self, epoch: int | None = None) -> None:
        """Raise :class:`NonFiniteGradientError` if a non-finite gradient froze the state.

        Call from Python after each step (the loops and ``AccumModel`` do). The error names the
        epoch (when given), the micro-step, its position in the window and the first offending
        variable. :meth:`clear_nonfinite` unfreezes the state (the bad micro-batch stays out).
        """
        if not self._built or self.nonfinite != "raise":
            return
        # Under a strategy: the first local replica that froze (each replica checks its shard).
        step, replica = distribute.max_local(self, self.nonfinite_micro_step)
        if step < 0:
            return
        position = distribute.component(self, self.nonfinite_window_position, replica)
        index = distribute.component(self, self.nonfinite_variable, replica)
        variable = self._variable_names[index] if index >= 0 else "<micro-batch weight>"
        where = f"epoch {epoch}, " if epoch is not None else ""
        raise NonFiniteGradientError(
            f"Non-finite gradient (NaN or Inf) at {where}micro-step {step} (position {position} "
            f"in its window of {self.accum_steps}); first offending variable: {variable}. "
            "That micro-batch was not accumulated; the window before it is intact and kept. "
            "Training is stopped until this is cleared: the next `fit` (AccumModel.fit or "
            "AccumTrainer.fit) clears it and continues that window with its data; in your "
            "own loop call `state.clear_nonfinite()` (`model.accumulation` / "
            "`trainer.state`) to continue, then `flush_window()` / `trainer.flush()` to apply "
            "the kept window now or `state.drop_window()` to discard it. "
            "Fix the data or the learning rate, or pass nonfinite='skip_micro_batch' or "
            "'skip_window' to skip such micro-batches.",
            micro_step=step,
            window_position=position,
            variable=variable,
            epoch=epoch,
        )

    def clear_nonfinite(self) -> bool:
        """Unfreeze the state after a :class:`NonFiniteGradientError` (to continue training).

        The window accumulated before the bad micro-batch is kept (it holds valid gradients; no
        accumulated gradient is dropped silently): training continues it. Call
        ``apply_window`` (``flush_window()`` / ``trainer.flush()``) first to apply it now, or
        :meth:`drop_window` to discard it (counted in ``samples_dropped``).

        Returns:
            Whether the state was frozen (and a log line said what was kept).
        """
        self._check_built()
        with tf.init_scope():
            step = distribute.max_local(self, self.nonfinite_micro_step)[0]
        if step < 0:
            return False
        pending = self.pending_micro_batches()
        with tf.init_scope():
            samples = int(self.window_samples.numpy())  # under a strategy: the replicas' sum
        logger.warning(
            "accumcore: cleared the non-finite gradient stop (micro-step %d); the window "
            "before it (%d micro-batches, %d samples) is kept and continues with the next "
            "micro-batches. Call flush_window() / trainer.flush() before training to apply it "
            "now, or state.drop_window() to discard it.", step, pending, samples,
        )
        self.nonfinite_micro_step.assign(-1)
        self.nonfinite_window_position.assign(-1)
        self.nonfinite_variable.assign(-1)
        return True

    def get_config(self) -> dict:
        return {"accum_steps": self.accum_steps, "nonfinite": self.nonfinite}
