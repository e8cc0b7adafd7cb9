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

Like optax's ``MultiSteps``, all mutable accumulation state lives here and the whole window
life cycle is written once, in :class:`AccumulationState`: accumulate, advance, close (the
library's only ``optimizer.apply`` call, in ``AccumulationState._update``), drop and reset.
The skip decision for a bad micro-batch is injected (:class:`~accumcore.NonFinitePolicy`). Under a
``tf.distribute`` strategy, :mod:`accumcore.distribute` supplies only where each step of the
rule runs and how the window's status is reduced across replicas; loss scaling is the
``LossScaleOptimizer``'s own (:mod:`accumcore.loss_scaling`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import tensorflow as tf

from accumcore import distribute, loss_scaling
from accumcore.batchnorm import attach_window_layers
from accumcore.config import NONFINITE_POLICIES, check_accum_steps, check_choice
from accumcore.errors import NonFiniteGradientError

_ON_READ = tf.VariableSynchronization.ON_READ

logger = logging.getLogger("accumcore")

_SUM_UNDER_STRATEGY = (
    "A loss with reduction='sum' is not supported under a tf.distribute strategy (Keras "
    "scales such losses differently per replica): use reduction='sum_over_batch_size' (the "
    "default) or 'mean_with_sample_weight'."
)


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


def _finite(tensor) -> tf.Tensor:
    """bool scalar: every element of one (dense or IndexedSlices) tensor is finite."""
    values = tensor.values if isinstance(tensor, tf.IndexedSlices) else tensor
    return tf.reduce_all(tf.math.is_finite(values))


def _all_finite(tensors: Sequence) -> tf.Tensor:
    """bool scalar: every element of every (dense or IndexedSlices) tensor is finite."""
    flags = [_finite(t) for t in tensors if t is not None]
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


def has_nonfinite(grads: Sequence, weight: tf.Tensor) -> tf.Tensor:
    """The default ``should_skip``: bool scalar, any NaN or Inf in ``grads`` or ``weight``."""
    return tf.logical_not(_all_finite([*grads, weight]))


@dataclass(frozen=True)
class NonFinitePolicy:
    """What a bad micro-batch does to the window; the skip decision is injected, as optax's
    ``MultiSteps(should_skip_update_fn=...)``.

    Attributes:
        name: the policy's name (``get_config``, ``AccumulationState.nonfinite``).
        freeze: on a flagged micro-batch, keep the state as it was before it and let
            :meth:`AccumulationState.raise_if_nonfinite` raise from Python; otherwise skip the
            micro-batch (its samples counted in ``samples_dropped``).
        skip_window: a skipped micro-batch also discards its whole window when it closes.
        should_skip: ``f(grads, weight) -> bool scalar`` on every micro-batch's gradients (of
            its summed loss) and weight; by default :func:`~accumcore.state.has_nonfinite`.
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

#: Under a LossScaleOptimizer overflow is expected: the optimizer skips the window whole.
_LOSS_SCALED = NonFinitePolicy("loss_scaling", should_skip=lambda grads, weight: tf.constant(False))


def nonfinite_policy(nonfinite: str | NonFinitePolicy) -> NonFinitePolicy:
    """The policy for a ``nonfinite=`` argument: one of ``NONFINITE``'s names or a policy."""
    if isinstance(nonfinite, NonFinitePolicy):
        return nonfinite
    return NONFINITE[check_choice(nonfinite, "nonfinite", NONFINITE_POLICIES)]


class _Scalar(NamedTuple):
    """One scalar variable of the state (int64, or float32 for a float ``initial``)."""

    name: str
    initial: int | float
    summed: bool  # under a strategy: SUM over the replicas (else the first replica's value)
    window: bool  # part of the current window: emptied whenever the window ends
    reported: bool  # in counters()
    saved: bool  # in variables_for_saving()


#: Every scalar of the state, in the order of ``variables_for_saving`` (after the
#: accumulators; the order of ``.keras`` files' ``accumcore_<i>`` entries: never reorder).
_SCALARS = (
    _Scalar("window_weight", 0.0, summed=True, window=True, reported=True, saved=True),
    _Scalar("micro_step", 0, summed=False, window=True, reported=True, saved=True),
    _Scalar("window_samples", 0, summed=True, window=True, reported=True, saved=True),
    _Scalar("windows_applied", 0, summed=False, window=False, reported=True, saved=True),
    _Scalar("windows_skipped", 0, summed=False, window=False, reported=True, saved=True),
    _Scalar("micro_batches_seen", 0, summed=False, window=False, reported=True, saved=True),
    # Summed: under a strategy each replica skips its own shard of a micro-batch.
    _Scalar("micro_batches_skipped", 0, summed=True, window=False, reported=True, saved=True),
    _Scalar("samples_seen", 0, summed=True, window=False, reported=True, saved=True),
    _Scalar("samples_dropped", 0, summed=True, window=False, reported=True, saved=True),
    _Scalar("window_poisoned", 0, summed=False, window=True, reported=False, saved=True),
    # Where a non-finite gradient froze the state (-1: not frozen).
    _Scalar("nonfinite_micro_step", -1, summed=False, window=False, reported=False, saved=False),
    _Scalar(
        "nonfinite_window_position", -1, summed=False, window=False, reported=False, saved=False
    ),
    _Scalar("nonfinite_variable", -1, summed=False, window=False, reported=False, saved=False),
    # Micro-batches refused while frozen (seen after the bad one, not used).
    _Scalar("nonfinite_unused", 0, summed=False, window=False, reported=False, saved=False),
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
    * Flags (int64): ``window_poisoned`` and, where a non-finite gradient froze the state,
      ``nonfinite_micro_step``, ``nonfinite_window_position``, ``nonfinite_variable``.

    :attr:`window_variables` and :meth:`variables_for_saving` list them.
    """

    def __init__(
        self,
        accum_steps: int,
        *,
        nonfinite: str | NonFinitePolicy = "raise",
        name: str = "accumulation",
    ) -> None:
        super().__init__(name=name)
        self.accum_steps = check_accum_steps(accum_steps)
        self.nonfinite = nonfinite
        self.accumulators: list[tf.Variable] = []
        self._variable_names: list[str] = []
        self._has_gradient: list[bool] = []
        self._variables = _Untracked(())
        self._built = False
        #: Whether the window's gradient sum is divided by its weight ``sum_i c_i`` (the
        #: default, for mean losses); ``False`` applies it as it is, for losses that are
        #: already sums (``reduction="sum"``). Set by AccumTrainer / AccumModel from the loss.
        self.normalize = True
        # Where the rule's steps run and how the window is reduced (distribute.Replicas).
        self._replicas = distribute.replicas(None)
        #: Callables ``hook(applied: bool)`` run (in graph, where the update runs) whenever a
        #: window closes: ``True`` after an optimizer update, ``False`` when the window is
        #: skipped or dropped. Layers with per-window state (e.g. window-level BatchNorm
        #: statistics) register here.
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
        self._replicas = distribute.replicas(tf.distribute.get_strategy() if on_read else None)
        with tf.init_scope():
            # Extend the tracked list in place (not re-assign it) so that a checkpoint read
            # before the state was built restores the accumulators when they are created.
            self.accumulators.extend(self._new_accumulators(variables))
            for s in _SCALARS:
                dtype = tf.float32 if isinstance(s.initial, float) else tf.int64
                value = tf.Variable(
                    tf.constant(s.initial, dtype), trainable=False, name=s.name,
                    **self._placement(s.summed),
                )
                setattr(self, s.name, value)
        self._set_variables(variables)
        self._built = True
        return True

    def prepare(self, model, normalizer: str | Callable | None = None, *,
                distributed: bool = False) -> bool:
        """Everything an entry point does to ready the state for ``model``, in one place.

        Refuses a summed loss (``normalizer="sum"``) under a strategy, builds the accumulators
        for ``model.trainable_variables`` (or follows a changed set: :meth:`build`), sets
        :attr:`normalize` from ``normalizer`` (``None``: unchanged) and attaches ``model``'s
        window-level BatchNorm layers to this state. ``AccumTrainer`` and ``AccumModel`` call
        it; call it inside ``strategy.scope()`` under a strategy.

        Returns:
            Whether accumulators were created now (first build or a new trainable set).
        """
        if normalizer == "sum" and distributed:
            raise ValueError(_SUM_UNDER_STRATEGY)
        created = self.build(model.trainable_variables)
        if normalizer is not None:
            self.normalize = normalizer != "sum"
        attach_window_layers(model, self)  # window-level BN: one update per window
        return created

    def _placement(self, summed: bool) -> dict:
        """Under a strategy: one local copy per replica, read as their sum or the first."""
        if not self._replicas.distributed:
            return {}
        first = tf.VariableAggregation.ONLY_FIRST_REPLICA
        aggregation = tf.VariableAggregation.SUM if summed else first
        return dict(synchronization=_ON_READ, aggregation=aggregation)

    def _new_accumulators(self, variables: list) -> list[tf.Variable]:
        """Zero accumulators, one per variable (float32; float64 for float64 variables)."""
        with tf.init_scope():
            return [
                tf.Variable(
                    tf.zeros(v.shape, _accumulator_dtype(_as_dtype(v))),
                    trainable=False,
                    name=f"accum_{i}",
                    **self._placement(summed=True),
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
            return max(int(part.numpy()) for part in self._replicas.parts(self.micro_step))

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
        return self._replicas.strategy

    @property
    def frozen(self) -> tf.Tensor:
        """True once a non-finite gradient was seen under ``nonfinite="raise"``."""
        return self.nonfinite_micro_step >= 0

    @property
    def window_variables(self) -> list[tf.Variable]:
        """The current window's variables (emptied whenever it ends).

        The accumulators, ``window_weight``, ``micro_step``, ``window_samples`` and
        ``window_poisoned``."""
        self._check_built()
        return [*self.accumulators, *(getattr(self, s.name) for s in _SCALARS if s.window)]

    def variables_for_saving(self) -> list[tf.Variable]:
        """What a saved model holds to resume mid-window, in a fixed order: the accumulators,
        then ``window_weight``, ``micro_step``, ``window_samples``, the six run counters and
        ``window_poisoned`` (the order of the ``accumcore_<i>`` entries of ``.keras`` files).
        The non-finite flags are not saved: a frozen state is not saved frozen."""
        self._check_built()
        return [*self.accumulators, *(getattr(self, s.name) for s in _SCALARS if s.saved)]

    def counters(self) -> dict[str, int | float]:
        """The counters as Python numbers (reads the variables; call outside graphs): the
        run-long counts (ints) and the pending window's ``micro_step``, ``window_samples`` and
        ``window_weight`` (``sum_i c_i``, a float: samples, sample-weight sum or valid tokens,
        whatever the loss divides by)."""
        self._check_built()
        return {
            s.name: (float if isinstance(s.initial, float) else int)(getattr(self, s.name).numpy())
            for s in _SCALARS if s.reported
        }

    # ------------------------------------------------------------------ the window life cycle
    def accumulate(
        self, grads: Sequence, weight, samples, optimizer=None, *, advance: bool = False
    ) -> tf.Tensor:
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
            advance: also count the micro-batch into the window (what :meth:`advance` does),
                unless a frozen state refuses it (``nonfinite="raise"``: neither the bad
                micro-batch nor any later one is counted). :meth:`step` uses this.

        Returns:
            A bool scalar: whether the micro-batch was added (False if it was skipped or the
            state is frozen by a non-finite gradient).

        The work per micro-batch is the rule's: the weighted gradients added, the weight and
        the counters advanced, and one finiteness test (one ``is_finite`` reduction per
        gradient, stacked into one flag vector). Everything else (skipping, freezing, the first
        offending variable) is in the one rarely taken branch of one ``tf.cond``.
        """
        self._check_built()
        self._check_gradients(grads)
        self._has_gradient = [g is not None for g in grads]
        weight = tf.cast(weight, tf.float32)
        samples = tf.cast(samples, tf.int64)
        present = [(i, g) for i, g in enumerate(grads) if g is not None]
        scaled = loss_scaling.is_loss_scale_optimizer(optimizer)
        policy = _LOSS_SCALED if scaled else self.nonfinite_policy

        def add() -> tf.Tensor:
            for i, g in present:
                acc = self.accumulators[i]
                if isinstance(g, tf.IndexedSlices):
                    values = tf.cast(g.values, acc.dtype)
                    if self._replicas.distributed:
                        # A replica-local (ON_READ) variable has no scatter_add: add the rows
                        # as one dense tensor (repeated indices summed, as scatter_add does).
                        acc.assign_add(tf.math.unsorted_segment_sum(
                            values, g.indices, num_segments=acc.shape[0]))
                    else:
                        acc.scatter_add(tf.IndexedSlices(values, g.indices, g.dense_shape))
                else:
                    acc.assign_add(tf.cast(g, acc.dtype))
            self.window_weight.assign_add(weight)
            self.window_samples.assign_add(samples)
            if policy.freeze or policy is _LOSS_SCALED:  # else counted once, outside the cond
                self.samples_seen.assign_add(samples)
            if advance and policy.freeze:
                self.advance()
            return tf.constant(True)

        if policy is _LOSS_SCALED:  # no per-micro-batch check: the window is checked at close
            added = add()
            if advance:
                self.advance()
            return added

        flags = None  # per-gradient finiteness, reused by the freeze branch's diagnosis
        if policy.should_skip is has_nonfinite:
            flags = [_finite(g) for _, g in present]
            bad = tf.logical_not(tf.reduce_all(tf.stack([*flags, _finite(weight)])))
        else:
            bad = tf.convert_to_tensor(policy.should_skip(grads, weight))

        def skip() -> tf.Tensor:
            self.micro_batches_skipped.assign_add(1)
            # Its samples were seen (counted below) but reach no update: counted as dropped
            # too, so that samples_seen always sums to (dataset size x epochs).
            self.samples_dropped.assign_add(samples)
            if policy.skip_window:
                self.window_poisoned.assign(1)
            return tf.constant(False)

        def refuse() -> tf.Tensor:
            """A bad micro-batch freezes the state (recording where); a frozen state counts
            the micro-batches it refuses. No nested ``cond``: selects on scalars."""
            frozen = self.frozen
            fresh = tf.logical_not(frozen)
            self.nonfinite_unused.assign_add(tf.cast(frozen, tf.int64))
            checks = flags if flags is not None else [_finite(g) for _, g in present]
            index_map = tf.constant([i for i, _ in present] + [-1], tf.int64)
            # First offending variable (-1, the last entry: only the weight was non-finite).
            first = tf.argmin(tf.cast(tf.stack([*checks, tf.constant(False)]), tf.int32))
            record = (
                (self.nonfinite_variable, tf.gather(index_map, first)),
                (self.nonfinite_window_position, self.micro_step.read_value()),
                (self.nonfinite_micro_step, self.micro_batches_seen.read_value()),
            )
            for variable, value in record:
                variable.assign(tf.where(fresh, value, variable.read_value()))
            return tf.constant(False)

        if policy.freeze:
            ok = tf.logical_not(tf.logical_or(bad, self.frozen))
            return tf.cond(ok, add, refuse)
        added = tf.cond(bad, skip, add)
        self.samples_seen.assign_add(samples)  # added or skipped: seen either way
        if advance:  # a skipped micro-batch still takes its place in the window
            self.advance()
        return added

    def advance(self) -> None:
        """Count one micro-batch into the window (``micro_step``, ``micro_batches_seen``)."""
        self.micro_batches_seen.assign_add(1)
        self.micro_step.assign_add(1)

    def step(self, grads: Sequence, weight, samples, optimizer, variables: Sequence) -> tf.Tensor:
        """Accumulate one micro-batch and close the window when it holds K micro-batches.

        This is the whole per-micro-batch rule used by the eager loop, the compiled loop and
        ``AccumModel.train_step``. Graph-safe (no Python decision depends on tensor values).
        Under a strategy it runs in replica context (inside ``strategy.run``).

        Returns:
            bool scalar: whether an optimizer update was applied by this call.
        """
        self._check_built()
        self._check_variables(variables)
        self._replicas.require_replica_context()
        variables = list(variables)

        def close_if_full() -> tf.Tensor:
            return self._close_if_due(optimizer, variables, force=False)

        if self._replicas.distributed:
            # Every replica advances in lockstep (a frozen one too); whether the window is
            # full is decided in cross-replica context.
            self.accumulate(grads, weight, samples, optimizer)
            self.advance()
            return self._replicas.decide(close_if_full)
        # One replica: a frozen state does not advance, so its window never becomes due.
        self.accumulate(grads, weight, samples, optimizer, advance=True)
        return close_if_full()

    def apply_window(self, optimizer, variables: Sequence | None = None) -> tf.Tensor:
        """Close the current window: one ``optimizer.apply`` with the window's mean gradient.

        A window poisoned by a non-finite gradient (``nonfinite="skip_window"``) is discarded
        and counted in ``windows_skipped`` instead, and so is a window whose loss-scaled
        gradient is not finite under a ``LossScaleOptimizer`` (the loss scale is lowered). An
        empty window does nothing, and so does a frozen state. Graph-safe; under a strategy,
        callable in replica or cross-replica context.

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
        if variables is not None and not self._replicas.distributed and not optimizer.built:
            with tf.init_scope():
                optimizer.build(list(variables))
        # The window is applied to the variables it was accumulated for, even if `trainable`
        # changed since (e.g. a flush after unfreezing a layer).
        variables = list(self._variables.value)
        if not self.normalize and self._replicas.distributed:
            raise ValueError(_SUM_UNDER_STRATEGY)
        key = (id(optimizer), *map(id, variables))
        return self._replicas.decide(
            lambda: self._close_if_due(optimizer, variables, force=True), key
        )

    def drop_window(self) -> None:
        """Discard the current partial window (end-of-epoch policy ``"drop"``), counting it."""
        self._check_built()
        self._end_window(False, counted=False)

    def end_epoch(
        self, policy: str, optimizer, variables: Sequence | None = None, epoch: int | None = None
    ) -> str | None:
        """Apply an end-of-epoch policy (or a flush) to the pending partial window.

        The one place where AccumTrainer, ResumableLoop and AccumModel decide what happens to
        a window still open when an epoch ends (``flush()`` / ``flush_window()`` call it with
        ``"apply"``). From Python (eager), also under a strategy (cross-replica context).

        Args:
            policy: ``"apply"`` (one update with the window's true weight, see
                :meth:`apply_window`), ``"drop"`` (discard it, counted in ``samples_dropped``;
                logged as a warning) or ``"carry"`` (keep it for the next epoch; logged).
            optimizer: the Keras optimizer, for ``"apply"``.
            variables: the model's current trainable variables (see :meth:`apply_window`).
            epoch: the epoch that ended, for the log line.

        Returns:
            ``None`` if no window was pending (nothing done), else what was done:
            ``"applied"`` (an optimizer update), ``"skipped"`` (``"apply"``, but the window
            was skipped: non-finite, or frozen), ``"dropped"`` or ``"carried"``.
        """
        pending = self.pending_micro_batches()
        if pending == 0:
            return None
        if policy == "apply":
            return "applied" if bool(self.apply_window(optimizer, variables)) else "skipped"
        if policy == "drop":
            logger.warning(
                "end_of_epoch='drop': discarding a partial window of %d micro-batches "
                "(%d samples) at the end of epoch %s.",
                pending, int(self.window_samples.numpy()), epoch,
            )
            self.drop_window()
            return "dropped"
        logger.info("end_of_epoch='carry': %d micro-batches carried into the next epoch.", pending)
        return "carried"

    def reset(self) -> None:
        """Empty the current window (:attr:`window_variables`); counters are kept.

        In cross-replica context under a strategy: every local replica's part, reading nothing.
        """
        for variable in self.window_variables:
            for part in self._replicas.parts(variable):
                part.assign(tf.zeros(part.shape, part.dtype))

    def _close_if_due(self, optimizer, variables: list, *, force: bool) -> tf.Tensor:
        """Close the window if it holds K micro-batches (any, with ``force``): bool scalar.

        Under a strategy this runs in cross-replica context (``Replicas.decide``), where the
        replicas' window counters agree (they advance in lockstep): the first one's decides.
        """
        micro = self._replicas.first(self.micro_step)
        due = micro > 0 if force else micro >= self.accum_steps
        if force and not self._replicas.distributed:
            # One replica: a frozen state keeps its window (the Python side raises). It never
            # advances, so only a flush can find it frozen; under a strategy the frozen flag
            # is part of the window's status (see _close).
            due = tf.logical_and(due, tf.logical_not(self.frozen))
        return tf.cond(
            due, lambda: self._close(optimizer, variables), lambda: tf.constant(False)
        )

    def _mirrors_loss_scaling(self, optimizer) -> bool:
        """Under a strategy the loss-scale rule is accumcore's mirror (see loss_scaling)."""
        return self._replicas.distributed and loss_scaling.is_loss_scale_optimizer(optimizer)

    def _close(self, optimizer, variables: list) -> tf.Tensor:
        """Close a due window: one status reduction, at most one update, :meth:`_end_window`.

        The status holds only the entries the window's fate can depend on (``names``): the
        weight ``W``; ``frozen`` (a strategy only: a frozen replica keeps the window open; one
        replica is never due frozen); ``poisoned`` and ``samples`` (skipped: ``"skip_window"``,
        or every micro-batch skipped; one replica skips neither under ``"raise"`` nor with a
        ``LossScaleOptimizer``, which skips an overflowed window itself); ``overflow`` (a
        strategy with a ``LossScaleOptimizer``: the window's one finiteness check). With one
        replica they are read where they are; under a strategy ``Replicas.sum`` stacks them
        and reduces them in one batch, with the gradient sums when the optimizer clips.

        Returns:
            bool scalar: whether an optimizer update was applied.
        """
        replicas = self._replicas
        mirror = self._mirrors_loss_scaling(optimizer)
        prereduce = replicas.prereduces(optimizer)
        scaled = loss_scaling.is_loss_scale_optimizer(optimizer)
        can_skip = replicas.distributed or not (self.nonfinite_policy.freeze or scaled)
        names = [
            "weight",
            *(["frozen"] if replicas.distributed else []),
            *(["poisoned", "samples"] if can_skip else []),
            *(["overflow"] if mirror else []),
        ]
        present = [i for i, has in enumerate(self._has_gradient) if has]

        def local_status() -> list:
            """``[flags, *sums]`` here: the ``names`` entries and the gradient sums to
            pre-reduce."""
            needed = mirror or prereduce
            sums = [self.accumulators[i].read_value() for i in present] if needed else []
            flags = {
                "weight": self.window_weight.read_value,  # W = sum_i c_i, float32
                "frozen": lambda: self.frozen,
                "poisoned": self.window_poisoned.read_value,
                "samples": self.window_samples.read_value,
                "overflow": lambda: tf.logical_not(_all_finite(sums)),
            }
            return [[flags[name]() for name in names], *(sums if prereduce else [])]

        reduced = replicas.sum(local_status)  # THE reduction of the window (none: one replica)
        status = replicas.first(reduced[0])

        def flag(name: str) -> tf.Tensor:
            return status[names.index(name)]

        def update() -> tf.Tensor:
            return replicas.run(
                lambda local, *sums: self._update(optimizer, variables, local[0], sums), *reduced
            )

        def close() -> tf.Tensor:
            skips = [flag("poisoned") > 0, flag("samples") <= 0] if can_skip else []
            if mirror:  # no window is poisoned under loss scaling: skipped = overflowed
                skips.append(flag("overflow") > 0)
            if skips:
                skip = functools.reduce(tf.logical_or, skips)
                applied = tf.cond(skip, lambda: tf.constant(False), update)
            else:
                applied = update()  # True: statically, unless a LossScaleOptimizer skips it
            if mirror:
                loss_scaling.update_scale(optimizer, applied)
            return self._end_window(applied)

        if not replicas.distributed:
            return close()
        return tf.cond(flag("frozen") > 0, lambda: tf.constant(False), close)

    def _update(self, optimizer, variables: list, weight: tf.Tensor, sums: Sequence) -> tf.Tensor:
        """The window's optimizer update: the library's one ``apply`` call. Runs in replica
        context under a strategy (each replica applies its share; Keras all-reduces them).

        Args:
            weight: ``W = sum_i c_i`` over the whole window (all replicas), float32 scalar.
            sums: the window's gradient sums over all replicas when the replicas pre-reduce
                them (gradient clipping), else empty: each replica's accumulators hold its own.

        Returns:
            bool scalar: whether the update was applied (a LossScaleOptimizer skips an
            overflowed window itself).
        """
        totals = iter(sums)
        grads = []
        for acc, has in zip(self.accumulators, self._has_gradient, strict=True):
            if not has:
                grads.append(None)
                continue
            total = self._replicas.share(next(totals)) if sums else acc.read_value()
            if self.normalize:  # mean losses; a summed loss (reduction="sum") is applied as is
                total = tf.math.divide_no_nan(total, tf.cast(weight, total.dtype))
            grads.append(total)
        target = optimizer
        if self._mirrors_loss_scaling(optimizer):
            target, grads = optimizer.inner_optimizer, loss_scaling.unscale(optimizer, grads)
        grads = [
            None if g is None else tf.cast(g, _as_dtype(v))
            for g, v in zip(grads, variables, strict=True)
        ]
        target.apply(grads, variables)
        return loss_scaling.window_applied(target, grads)

    def _end_window(self, applied: tf.Tensor | bool, *, counted: bool = True) -> tf.Tensor:
        """Every window ends here, applied, skipped or dropped: counted, its unapplied samples
        added to ``samples_dropped``, the window hooks run, then :meth:`reset` (under a
        strategy: every local copy, from cross-replica context).

        Args:
            applied: a Python bool or a bool scalar tensor. Known statically (a bool, a
                constant, an eager tensor), only that outcome is written. Otherwise the hooks
                (which take a Python bool) run in one ``cond``, a branch per outcome; without
                hooks both outcomes are written as int64 arithmetic on ``applied``.
            counted: count the window in ``windows_applied`` / ``windows_skipped`` (``False``:
                a dropped window, counted only in ``samples_dropped``).

        Returns:
            bool scalar: ``applied``.
        """
        known = tf.get_static_value(applied)
        if known is None and self.window_hooks:
            return tf.cond(
                applied,
                lambda: self._end_window(True, counted=counted),
                lambda: self._end_window(False, counted=counted),
            )
        parts = self._replicas.parts
        if known is None:  # 0 or 1 window of each outcome
            applied_n = tf.cast(applied, tf.int64)
            skipped_n = 1 - applied_n
            outcomes = [(self.windows_applied, applied_n), (self.windows_skipped, skipped_n)]
        else:
            outcomes = [(self.windows_applied if known else self.windows_skipped, 1)]
        if counted:
            for counter, n in outcomes:
                for part in parts(counter):
                    part.assign_add(n)
        if not known:  # not applied (or not known): its samples reach no update
            for dropped, pending in zip(
                parts(self.samples_dropped), parts(self.window_samples), strict=True
            ):
                samples = pending.read_value()
                dropped.assign_add(samples if known is not None else skipped_n * samples)
        for hook in self.window_hooks:
            hook(bool(known))
        self.reset()
        return applied if known is None else tf.constant(bool(known))

    # ------------------------------------------------------------------ non-finite report
    def raise_if_nonfinite(self, epoch: int | None = None) -> None:
        """Raise :class:`NonFiniteGradientError` if a non-finite gradient froze the state.

        Call from Python, after a step or after many: a frozen state refuses every later
        micro-batch (counted), so checking once per epoch loses nothing but that epoch's
        remaining compute. ``AccumModel.fit`` and ``AccumTrainer.fit`` check at the end of each
        epoch (no host read per micro-batch); ``train_on_batch``, ``train_micro_batch`` and
        ``window_step`` after each call. The error names the epoch (when given), the
        micro-step, its position in the window, the first offending variable and how many
        later micro-batches were seen while frozen (not used). :meth:`clear_nonfinite`
        unfreezes the state (the bad micro-batch stays out).
        """
        if not self._built or not self.nonfinite_policy.freeze:
            return
        # Under a strategy: the first local replica that froze (each replica checks its shard).
        def local(variable: tf.Variable) -> list[int]:
            return [int(part.numpy()) for part in self._replicas.parts(variable)]

        steps = local(self.nonfinite_micro_step)
        replica = max(range(len(steps)), key=steps.__getitem__)
        step = steps[replica]
        if step < 0:
            return
        position = local(self.nonfinite_window_position)[replica]
        unused = local(self.nonfinite_unused)[replica]
        index = local(self.nonfinite_variable)[replica]
        variable = self._variable_names[index] if index >= 0 else "<micro-batch weight>"
        where = f"epoch {epoch}, " if epoch is not None else ""
        raise NonFiniteGradientError(
            f"Non-finite gradient (NaN or Inf) at {where}micro-step {step} (position {position} "
            f"in its window of {self.accum_steps}); first offending variable: {variable}. "
            "That micro-batch was not accumulated; the window before it is intact and kept. "
            f"{unused} later micro-batch(es) were seen while the state was frozen and not "
            f"used{' (the rest of that epoch)' if epoch is not None else ''}. "
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
            unused_micro_batches=unused,
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
            step = max(int(p.numpy()) for p in self._replicas.parts(self.nonfinite_micro_step))
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
        for variable in (self.nonfinite_micro_step, self.nonfinite_window_position,
                         self.nonfinite_variable):
            variable.assign(-1)
        self.nonfinite_unused.assign(0)
        return True

    def get_config(self) -> dict:
        return {"accum_steps": self.accum_steps, "nonfinite": self.nonfinite}
