"""The state's variables: what they are (in the order saved files know), how they are made,
and the checks that a step's inputs match them.

:class:`~accumcore.AccumulationState` holds one accumulator per trainable variable and the
scalars of :data:`SCALARS`; :meth:`~accumcore.AccumulationState.build` makes them with these
functions, and the checks name what does not match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import tensorflow as tf

from accumcore._impl.nonfinite import Stop
from accumcore._impl.rule import Counters, Window


def accumulator_dtype(variable_dtype: tf.DType) -> tf.DType:
    """float32 for float16/bfloat16/float32 variables, float64 for float64 variables."""
    return tf.float64 if variable_dtype == tf.float64 else tf.float32


def variable_dtype(variable) -> tf.DType:
    """A (Keras or TensorFlow) variable's dtype, as a ``tf.DType``."""
    return tf.as_dtype(getattr(variable, "dtype", tf.float32))


def variable_name(variable) -> str:
    """A variable's path (Keras 3) or name."""
    return getattr(variable, "path", None) or variable.name


def describe_change(old: list[str], new: list[str]) -> str:
    """``"+a/kernel, -b/bias"``: variables that became trainable (+) or frozen (-)."""
    added = [f"+{n}" for n in new if n not in old]
    removed = [f"-{n}" for n in old if n not in new]
    parts = added + removed
    return ", ".join(parts[:6] + (["..."] if len(parts) > 6 else [])) or "same names, new objects"


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


def new_accumulators(variables: Sequence, placement: Callable[..., dict]) -> list[tf.Variable]:
    """Zero accumulators, one per variable (float32; float64 for float64 variables).

    ``placement(summed)``: the ``tf.Variable`` keywords that place a variable on the replicas
    (``accumcore._impl.distribute.Replicas.placement``). Call in ``tf.init_scope``.
    """
    return [
        tf.Variable(tf.zeros(v.shape, accumulator_dtype(variable_dtype(v))),
                    trainable=False, name=f"accum_{i}", **placement(summed=True))
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
                    s.window_poisoned, [True] * len(s.accumulators))
    counters = Counters(*(getattr(s, name) for name in COUNTERS))
    return window, counters, Stop(unsaved["nonfinite_stop"], state.replicas.parts)


#: The run-long counters, in ``rule.Counters`` order.
COUNTERS = ("windows_applied", "windows_skipped", "micro_batches_seen",
            "micro_batches_skipped", "samples_seen", "samples_dropped")


def same_variables(built: Sequence, variables: Sequence) -> bool:
    """Whether ``variables`` are exactly ``built``: the same objects, in the same order."""
    variables = tuple(variables)
    return len(variables) == len(built) and all(a is b for a, b in zip(variables, built))


def check_can_follow(built: Sequence, variables: Sequence, pending: int,
                     distributed: bool) -> None:
    """Raise unless the accumulators may follow the trainable set from ``built`` to
    ``variables`` now: the window is empty (``pending`` micro-batches), and a state built
    under a strategy is re-built inside its scope."""
    if pending:
        old = [variable_name(v) for v in built]
        new = [variable_name(v) for v in variables]
        raise ValueError(
            f"The trainable variables changed ({len(old)} -> {len(new)} variables: "
            f"{describe_change(old, new)}) while a window of {pending} micro-batches is "
            "pending. Its gradients belong to the old set: apply it first with "
            "`model.flush()` (AccumModel) or `trainer.flush()` (AccumTrainer), "
            "then change `trainable` (or train on: the next `fit` after `compile` follows "
            "the new set)."
        )
    if distributed and not tf.distribute.has_strategy():
        raise ValueError(
            "This AccumulationState was built under a tf.distribute strategy: re-build it "
            "for the new trainable set inside `strategy.scope()`."
        )


def check_gradients(grads: Sequence, accumulators: Sequence[tf.Variable]) -> None:
    """Raise unless ``grads`` are one per accumulator, in order (compatible shapes)."""
    if len(grads) != len(accumulators):
        raise ValueError(
            f"Got {len(grads)} gradients for {len(accumulators)} accumulators: "
            "`grads` must match the trainable variables the state was built from, one per "
            "variable and in the same order (use `tape.gradient(loss, "
            "model.trainable_variables)`)."
        )
    for g, acc in zip(grads, accumulators):
        if g is not None and g.shape.rank is not None and acc.shape.rank is not None:
            shape = g.dense_shape if isinstance(g, tf.IndexedSlices) else g.shape
            if isinstance(shape, tf.TensorShape) and not shape.is_compatible_with(acc.shape):
                raise ValueError(
                    f"Gradient of shape {shape} does not match accumulator "
                    f"{acc.name} of shape {acc.shape}: `grads` must be in the order of the "
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
