"""What every entry point does around the state: ready it for a model, end an epoch, flush.

``AccumModel``, ``AccumTrainer`` and ``ResumableLoop`` call these and nothing else to manage
the state between micro-steps, so the three speak one vocabulary: :func:`prepare` before
training (build the accumulators or follow a changed trainable set, the loss's normaliser,
window-level BatchNorm), :func:`end_epoch` when an epoch ends with a partial window, and
:func:`flush` to apply one now. How each entry point builds for its model before it
calls :func:`prepare` is ``accumcore._impl.building``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from accumcore._impl.batchnorm import attach_window_layers
from accumcore._impl.state import SUM_UNDER_STRATEGY, AccumulationState

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
        non-finite, or training stopped), ``"dropped"`` or ``"carried"``.
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

