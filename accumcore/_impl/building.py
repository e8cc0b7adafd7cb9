"""How each entry point builds for its model before ``accumcore._impl.entry.prepare``.

``AccumModel`` (``prepare_model`` when ``fit`` traces,
``build_on_first_batch`` for an unbuilt subclass) checks what
``keras.Model.fit`` would (``check_trainable``) first.

``AccumTrainer``: ``build_model_and_optimizer`` builds the model (by
calling it on the micro-batch, if it is unbuilt) and the optimizer, eagerly, before any
accumulator is made (``accumcore._impl.entry.prepare`` makes them). When the trainable set has
changed since the accumulators were made (layers frozen or unfrozen),
``check_new_trainable_set`` first checks that it may be followed: no
window is pending, and the optimizer can update every variable (a built Keras optimizer cannot
take new ones).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from accumcore._impl import entry
from accumcore._impl.config import check_optimizer, warn_if_float16_without_loss_scaling
from accumcore._impl.gradients import first_leaf, resolve_normalizer
from accumcore._impl.layout import variable_name
from accumcore._impl.state import AccumulationState


@dataclass
class FitSettings:
    """The ``fit`` settings of one model, beside its :class:`~accumcore.AccumulationState`
    (which holds K and the non-finite policy): an ``AccumModel``'s, or an
    :func:`~accumcore.accumulate` d model's (held as ``model._accumcore``).

    * ``end_of_epoch``: the partial-window policy (``"apply"``, ``"carry"``, ``"drop"``).
    * ``normalizer``: as given (``"auto"``, ``"samples"``, ``"sample_weight"``, a callable).
    * ``traced_normalizer``: what the traced step weighs micro-batches by (resolved from the
      compiled loss when a step is traced).
    * ``accum_steps_given``: whether K was given (an ``AccumModel`` made without it cannot
      ``fit``).
    """

    end_of_epoch: str = "apply"
    normalizer: str | Callable = "auto"
    traced_normalizer: str | Callable = "auto"
    accum_steps_given: bool = False


#: The attribute that holds a model's :class:`FitSettings` (set by accumcore, never Keras).
SETTINGS_ATTRIBUTE = "_accumcore"


def settings_of(model) -> FitSettings:
    """``model``'s :class:`FitSettings`."""
    return getattr(model, SETTINGS_ATTRIBUTE)


def build_accumulation(model) -> None:
    """Create or follow ``model``'s accumulators (:func:`prepare_model`), keeping the
    normaliser it resolves."""
    settings = settings_of(model)
    settings.traced_normalizer = prepare_model(model, settings.traced_normalizer)


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


def check_trainable(model) -> bool:
    """Whether an ``AccumModel`` has anything to train; warns (as ``keras.Model.fit`` does)
    if not.

    Raises:
        ValueError: if a partial window is pending while the model has no trainable
            variables left (the pending gradients belong to variables now frozen).
    """
    if model.trainable_variables:
        return True
    pending = model.accumulation.pending_micro_batches()
    if pending:
        raise ValueError(
            "The model has no trainable variables now, but a partial window of "
            f"{pending} micro-batch(es) is pending from before they were frozen: call "
            "`model.flush()` before freezing (`model.trainable = False`), or unfreeze the model."
        )
    warnings.warn(
        f"AccumModel {model.name!r} has no trainable variables (`model.trainable = False`, "
        "or every layer frozen): there is nothing to train, so this `fit` only computes the "
        "loss and metrics, as keras.Model.fit does (\"The model does not have any "
        "trainable weights\"). To train, set `model.trainable = True` (or unfreeze some "
        "layers), then `compile` again.",
        UserWarning,
        stacklevel=3,
    )
    return False


def needs_build(model: keras.Model) -> bool:
    """True while ``model`` has no variables yet (an unbuilt subclass)."""
    return not model.built or not model.variables


def prepare_model(model, traced_normalizer: str | Callable) -> str | Callable:
    """``AccumModel.build_accumulation``: check the model can accumulate, then
    ``prepare`` its state when a new ``train_function`` is traced (its
    trainable set and the compiled loss's normaliser); a traced one keeps both, as Keras keeps
    its trainable set.

    Args:
        traced_normalizer: the normaliser the state accumulates with now.

    Returns:
        The normaliser to accumulate with from now on (resolved from the compiled loss).
    """
    settings = settings_of(model)
    if not settings.accum_steps_given:
        raise ValueError(
            "AccumModel was created without `accum_steps` (K, the number of micro-batches "
            "per optimizer update), so it would silently train with K = 1. Pass it when "
            "creating the model (`AccumModel(inputs, outputs, accum_steps=4)`; "
            "`accum_steps=1` for no accumulation) or call "
            "`model.set_accumulation(accum_steps=K)`. (keras.models.clone_model of an "
            "*uncompiled* AccumModel cannot pass the settings on: set them on the clone.)"
        )
    if needs_build(model):
        raise ValueError(
            "The model is not built, so accumcore cannot create its accumulators. Give it "
            "an input shape (keras.Input, `model.build(input_shape)`) or call it once "
            "(`fit` and `train_on_batch` build it on the first batch)."
        )
    if not model.trainable_variables:
        raise ValueError(
            "The model has no trainable variables (`model.trainable = False`, or every "
            "layer frozen): there is nothing to accumulate. Set `model.trainable = True` "
            "(or unfreeze some layers) and `compile` again."
        )
    if model.optimizer is not None:
        check_optimizer(model.optimizer)
        warn_if_float16_without_loss_scaling(model, model.optimizer)
    state = model.accumulation
    if state.built and getattr(model, "train_function", None) is not None:
        return traced_normalizer  # the traced step keeps its trainable set (as Keras)
    normalizer = resolve_normalizer(settings.normalizer, getattr(model, "loss", None))
    if state.built and normalizer != traced_normalizer and state.pending_micro_batches():
        raise ValueError(
            "The compiled loss needs another normaliser than the pending window was "
            "accumulated with: call `model.flush()` before `compile`-ing a loss "
            "with another reduction."
        )
    strategy = model.distribute_strategy
    with strategy.scope():  # follows a changed trainable set
        entry.prepare(state, model, normalizer, distributed=strategy.num_replicas_in_sync > 1)
    return normalizer


def build_optimizer(model) -> None:
    """Build ``model.optimizer`` for the trainable variables, before tracing: a
    LossScaleOptimizer's ``scale_loss`` must read its loss-scale variable in the traced step,
    not the constant initial scale of an unbuilt one."""
    if model.optimizer is not None and not model.optimizer.built:
        with model.distribute_strategy.scope():
            model.optimizer.build(model.trainable_variables)


def build_on_first_batch(model, x, traced_normalizer: str | Callable) -> str | Callable:
    """Build an unbuilt ``AccumModel`` subclass, its accumulators and optimizer from the first
    batch ``x``'s shapes, eagerly.

    Runs in the first trace of the train step for a model ``fit`` could not build before
    tracing: the model is called once on ``keras.KerasTensor`` s with the batch's shapes and
    dtypes (symbolic: no data, no state update), and every variable is created outside the
    graph (``tf.init_scope``), as ``keras.Model.fit`` builds a plain subclass.

    Returns:
        The normaliser to accumulate with (:func:`prepare_model`).
    """
    def spec(t):
        return keras.KerasTensor(tuple(t.shape), dtype=tf.as_dtype(t.dtype).name)

    with tf.init_scope():
        model(tf.nest.map_structure(spec, x), training=False)
        if not check_trainable(model):
            return traced_normalizer
        normalizer = prepare_model(model, traced_normalizer)
        build_optimizer(model)
    return normalizer
