"""Dynamic loss scaling: what accumcore takes from Keras, and the one piece it must mirror.

With a :class:`keras.optimizers.LossScaleOptimizer` every micro-batch loss is scaled by the
optimizer's own ``scale_loss`` (``accumcore._impl.gradients.summed_loss_gradients``), the gradients
are accumulated in float32, and the window's mean (still scaled) gradient goes to the
optimizer's own ``apply``, which unscales it, checks it is finite, applies it with the inner
optimizer and grows the scale, or halves the scale and applies nothing. accumcore reads that
decision back with the optimizer's own ``check_finite`` (:func:`window_applied`).

The one exception is a window closed under a ``tf.distribute`` strategy. There each replica's
update runs in replica context on its own share of the window, and ``LossScaleOptimizer``'s
cross-replica logic would check only the first replica's share. accumcore checks the whole
window in its one cross-replica reduction instead (``accumcore._impl.distribute``), applies the
:func:`unscale` d gradients with the inner optimizer and then calls :func:`update_scale`, which
mirrors ``LossScaleOptimizer``'s growth and halving rule (``tests/test_window_rule.py`` pins it
against ``LossScaleOptimizer.apply`` on the same sequence of finite and non-finite windows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf


def is_loss_scale_optimizer(optimizer: Any) -> bool:
    """True for a :class:`keras.optimizers.LossScaleOptimizer` (dynamic loss scaling)."""
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def inner_optimizer(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """The optimizer that updates the variables (the inner one of a LossScaleOptimizer)."""
    return optimizer.inner_optimizer if is_loss_scale_optimizer(optimizer) else optimizer


def loss_scale(optimizer: keras.optimizers.Optimizer) -> float:
    """The current loss scale (1.0 without a LossScaleOptimizer); reads a variable."""
    if not is_loss_scale_optimizer(optimizer):
        return 1.0
    if not optimizer.built:
        return float(optimizer.initial_scale)
    return float(tf.convert_to_tensor(optimizer.dynamic_scale).numpy())


def window_applied(optimizer: keras.optimizers.Optimizer, grads: Sequence) -> tf.Tensor:
    """bool scalar: whether ``optimizer.apply(grads, ...)`` updated the variables.

    Always true, except for a ``LossScaleOptimizer`` given non-finite (overflowed) gradients,
    which it skips; its own ``check_finite`` says which.
    """
    if is_loss_scale_optimizer(optimizer):
        return tf.convert_to_tensor(optimizer.check_finite(list(grads)))
    return tf.constant(True)


# ---------------------------------------------------------------------------- the mirror
def unscale(optimizer: keras.optimizers.LossScaleOptimizer, grads: Sequence) -> list:
    """``grads / loss_scale``, as ``LossScaleOptimizer.apply`` unscales before its inner apply."""
    scale = tf.convert_to_tensor(optimizer.dynamic_scale)
    return [None if g is None else g / tf.cast(scale, g.dtype) for g in grads]


def update_scale(optimizer: keras.optimizers.LossScaleOptimizer, finite: tf.Tensor) -> None:
    """After a window: ``LossScaleOptimizer``'s rule for its scale and growth counter.

    A finite window counts one step and doubles the scale every ``dynamic_growth_steps`` finite
    windows (the counter restarts); a non-finite one halves the scale and restarts the counter.
    Graph-safe; ``finite`` is a bool scalar.
    """
    counter, scale = optimizer.step_counter, optimizer.dynamic_scale

    def restart(factor: float) -> None:
        counter.assign(tf.zeros_like(counter))
        scale.assign(scale * factor)

    def count() -> None:
        counter.assign_add(tf.ones_like(counter))

    def grow() -> None:
        current = tf.convert_to_tensor(counter)
        due = tf.equal(current, tf.cast(optimizer.dynamic_growth_steps - 1, current.dtype))
        tf.cond(due, lambda: restart(2.0), count)

    tf.cond(finite, grow, lambda: restart(0.5))
