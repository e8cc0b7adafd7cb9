"""Building :class:`~accumcore.AccumTrainer` on a micro-batch, and following its trainable set.

:func:`build_model_and_optimizer` builds the model (by calling it on the micro-batch, if it is
unbuilt) and the optimizer, eagerly, before any accumulator is made
(:func:`accumcore.entry.prepare` makes them). When the trainable set has changed since the
accumulators were made (layers frozen or unfrozen), :func:`check_new_trainable_set` first
checks that it may be followed: no window is pending, and the optimizer can update every
variable (a built Keras optimizer cannot take new ones).
"""

from __future__ import annotations

from typing import Any

import keras

from accumcore.core import first_leaf
from accumcore.layout import variable_name
from accumcore.state import AccumulationState


def build_model_and_optimizer(model: keras.Model, state: AccumulationState,
                              optimizer: keras.optimizers.Optimizer, x: Any,
                              known: set[int] | None) -> set[int]:
    """Build ``model`` (called on the micro-batch ``x`` if unbuilt) and ``optimizer``, checking
    a trainable set that differs from the one ``state`` was built for.

    Args:
        known: ids of the variables ``optimizer`` can update (``None``: not known yet).

    Returns:
        ``known``, or on the first build the ids of the trainable variables.
    """
    if not model.built or not model.trainable_variables:
        try:
            model(x, training=False)
        except Exception as err:  # noqa: BLE001 - re-raised with context
            raise ValueError(
                "Could not build `model` by calling it on the first micro-batch "
                f"(input shape {getattr(first_leaf(x), 'shape', '?')}): {err}. Build it "
                "explicitly with `model.build(input_shape)` or start it with keras.Input. "
                "If the dataset yields single samples, batch it into micro-batches: "
                "`dataset.batch(b)`."
            ) from err
    variables = model.trainable_variables
    if state.built and not state.same_variables(variables):
        check_new_trainable_set(state, optimizer, variables, known)
    if not optimizer.built:
        optimizer.build(variables)
    return {id(v) for v in variables} if known is None else known


def check_new_trainable_set(state: AccumulationState, optimizer: keras.optimizers.Optimizer,
                            variables: list, known: set[int] | None) -> None:
    """Before following a new trainable set: the window is empty, the optimizer knows it
    (``known``: ids of the variables it can update, ``None``: not known)."""
    if state.pending_micro_batches():
        state.build(variables)  # raises: a pending window (names `trainer.flush()`)
    unknown = [v for v in variables if known is not None and id(v) not in known]
    if unknown and optimizer.built:
        names = ", ".join(variable_name(v) for v in unknown[:4])
        raise ValueError(
            f"The trainable variables changed: {len(unknown)} became trainable ({names}"
            f"{', ...' if len(unknown) > 4 else ''}), but `optimizer` was built for the old "
            "set and a Keras optimizer cannot take new variables. Give the trainer a new "
            "optimizer before training on, as `model.compile` does for fine-tuning: "
            "`trainer.optimizer = keras.optimizers.Adam(1e-5)`."
        )
