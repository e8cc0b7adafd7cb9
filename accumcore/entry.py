"""What every entry point does around the state: ready it for a model, end an epoch, flush.

``AccumModel``, ``AccumTrainer`` and ``ResumableLoop`` call these and nothing else to manage
the state between micro-steps, so the three speak one vocabulary: :func:`prepare` before
training (build the accumulators or follow a changed trainable set, the loss's normaliser,
window-level BatchNorm), :func:`end_epoch` when an epoch ends with a partial window, and
:func:`flush` to apply one now. ``AccumModel`` readies itself through :func:`prepare_model`
(when ``fit`` traces, or on the first batch of an unbuilt subclass: :func:`build_on_first_batch`),
which checks what ``keras.Model.fit`` would (:func:`check_trainable`) and calls :func:`prepare`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence

import keras
import tensorflow as tf

from accumcore.batchnorm import attach_window_layers
from accumcore.config import check_optimizer, warn_if_float16_without_loss_scaling
from accumcore.core import resolve_normalizer
from accumcore.state import SUM_UNDER_STRATEGY, AccumulationState

logger = logging.getLogger("accumcore")


def prepare(state: AccumulationState, model, normalizer: str | Callable | None = None, *,
            distributed: bool = False) -> bool:
    """Ready ``state`` for training ``model`` (inside ``strategy.scope()`` under a strategy).

    Refuses a summed loss (``normalizer="sum"``) under a strategy, builds the accumulators for
    ``model.trainable_variables`` (or follows a changed set: ``AccumulationState.build``), sets
    ``state.normalize`` from ``normalizer`` (``None``: unchanged) and attaches ``model``'s
    window-level BatchNorm layers to the state.

    Returns:
        Whether accumulators were created now (first build or a new trainable set).
    """
    if normalizer == "sum" and distributed:
        raise ValueError(SUM_UNDER_STRATEGY)
    created = state.build(model.trainable_variables)
    if normalizer is not None:
        state.normalize = normalizer != "sum"
    attach_window_layers(model, state)  # window-level BN: one update per window
    return created


def end_epoch(state: AccumulationState, policy: str, optimizer,
              variables: Sequence | None = None, epoch: int | None = None) -> str | None:
    """Apply an end-of-epoch policy to the pending partial window (from Python; under a
    strategy in cross-replica context).

    Args:
        policy: ``"apply"`` (one update with the window's true weight:
            ``AccumulationState.apply_window``), ``"drop"`` (discard it, counted in
            ``samples_dropped``; logged as a warning) or ``"carry"`` (keep it; logged).
        optimizer: the Keras optimizer, for ``"apply"``.
        variables: the model's current trainable variables (see ``apply_window``).
        epoch: the epoch that ended, for the log line.

    Returns:
        ``None`` if no window was pending (nothing done), else what was done: ``"applied"``
        (an optimizer update), ``"skipped"`` (``"apply"``, but the window was skipped:
        non-finite, or frozen), ``"dropped"`` or ``"carried"``.
    """
    pending = state.pending_micro_batches()
    if pending == 0:
        return None
    if policy == "apply":
        return "applied" if bool(state.apply_window(optimizer, variables)) else "skipped"
    if policy == "drop":
        logger.warning(
            "end_of_epoch='drop': discarding a partial window of %d micro-batches "
            "(%d samples) at the end of epoch %s.",
            pending, int(state.window_samples.numpy()), epoch,
        )
        state.drop_window()
        return "dropped"
    logger.info("end_of_epoch='carry': %d micro-batches carried into the next epoch.", pending)
    return "carried"


def flush(state: AccumulationState, optimizer, variables: Sequence | None = None) -> bool:
    """Apply the pending partial window now, with its true weight (no-op when empty).

    Returns:
        Whether an optimizer update was applied.
    """
    return end_epoch(state, "apply", optimizer, variables) == "applied"


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


def prepare_model(model) -> None:
    """``AccumModel.build_accumulation``: check the model can accumulate, then :func:`prepare`
    its state, when a new ``train_function`` is traced (its trainable set and the compiled
    loss's normaliser); a traced one keeps both, as Keras keeps its trainable set."""
    if model.accum_steps is None:
        raise ValueError(
            "AccumModel was created without `accum_steps` (K, the number of micro-batches "
            "per optimizer update), so it would silently train with K = 1. Pass it when "
            "creating the model (`AccumModel(inputs, outputs, accum_steps=4)`; "
            "`accum_steps=1` for no accumulation) or call "
            "`model.set_accumulation(accum_steps=K)`. (keras.models.clone_model of an "
            "*uncompiled* AccumModel cannot pass the settings on: set them on the clone.)"
        )
    if model._needs_build():
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
        return  # the traced step keeps its trainable set and normaliser (as Keras)
    normalizer = resolve_normalizer(model.normalizer, getattr(model, "loss", None))
    if state.built and normalizer != model._accum_normalizer and state.pending_micro_batches():
        raise ValueError(
            "The compiled loss needs another normaliser than the pending window was "
            "accumulated with: call `model.flush()` before `compile`-ing a loss "
            "with another reduction."
        )
    strategy = model.distribute_strategy
    with strategy.scope():  # follows a changed trainable set
        prepare(state, model, normalizer, distributed=strategy.num_replicas_in_sync > 1)
    model._accum_normalizer = normalizer


def build_optimizer(model) -> None:
    """Build ``model.optimizer`` for the trainable variables, before tracing: a
    LossScaleOptimizer's ``scale_loss`` must read its loss-scale variable in the traced step,
    not the constant initial scale of an unbuilt one."""
    if model.optimizer is not None and not model.optimizer.built:
        with model.distribute_strategy.scope():
            model.optimizer.build(model.trainable_variables)


def build_on_first_batch(model, x) -> None:
    """Build an unbuilt ``AccumModel`` subclass, its accumulators and optimizer from the first
    batch ``x``'s shapes, eagerly.

    Runs in the first trace of the train step for a model ``fit`` could not build before
    tracing: the model is called once on ``keras.KerasTensor`` s with the batch's shapes and
    dtypes (symbolic: no data, no state update), and every variable is created outside the
    graph (``tf.init_scope``), as ``keras.Model.fit`` builds a plain subclass.
    """
    def spec(t):
        return keras.KerasTensor(tuple(t.shape), dtype=tf.as_dtype(t.dtype).name)

    with tf.init_scope():
        model(tf.nest.map_structure(spec, x), training=False)
        if check_trainable(model):
            prepare_model(model)
            build_optimizer(model)
