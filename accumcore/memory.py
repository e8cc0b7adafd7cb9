"""Find the largest micro-batch that fits on the device, and the K that reaches a target batch.

The search assumes that "fits" is monotone in the micro-batch size b (if b fits, every smaller
b fits). It probes by doubling from ``start`` until a size does not fit (or ``limit`` is
reached), then bisects between the last size that fitted and the first that did not. With
``multiple_of=m`` only multiples of m are probed (e.g. 8 for tensor-core friendly shapes), which
also shortens the search. Each probe that runs out of memory costs real time on a GPU (TensorFlow's
allocator retries for a while before it raises), so the number of probes is kept logarithmic:
at most ``log2(b_max / start) + log2(b_max / multiple_of) + 3`` probes, b_max the result.

The search logic (:func:`largest_fitting`) takes any predicate ``fits(b) -> bool`` (your own
rule, or a real training step); :func:`oom_probe` turns a training step into such a
predicate by catching ``tf.errors.ResourceExhaustedError``, and :func:`plan_accumulation` puts the
two together; :func:`gradient_step_probe` makes the training step of a built model. The
optimizer's slots and the accumulators do not depend on b, so they are allocated (or their
room is) before probing::

    import keras
    import tensorflow as tf

    import accumcore
    from accumcore.memory import gradient_step_probe, oom_probe, plan_accumulation

    inputs = keras.Input((28, 28, 1))
    hidden = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
    outputs = keras.layers.Dense(10, activation="softmax")(keras.layers.Flatten()(hidden))
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(), "sparse_categorical_crossentropy")
    model.optimizer.build(model.trainable_variables)  # the optimizer's slots, allocated now
    room = [tf.zeros_like(v) for v in model.trainable_variables]  # the accumulators' size
    step_at = gradient_step_probe(model, "sparse_categorical_crossentropy", (28, 28, 1))
    plan = plan_accumulation(oom_probe(step_at), target_batch_size=4096)
    del room  # freed for the accumulators
    accumcore.accumulate(model, micro_batch_size=plan.max_micro_batch)
    model.fit(x, y, batch_size=4096)  # x: (n, 28, 28, 1), y: (n,) ints; one update per 4096

For data that already comes as micro-batches, take K and b from the plan instead:
``accumcore.accumulate(model, accum_steps=plan.accum_steps)`` and
``fit(x, y, batch_size=plan.micro_batch_size)``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accumcore._impl.search import largest_fitting
from accumcore._impl.settings import check_positive_int, split_batch


@dataclass
class MicroBatchPlan:
    """Result of :func:`plan_accumulation`.

    Attributes:
        target_batch_size: B, the samples per optimizer update that were asked for.
        max_micro_batch: the largest micro-batch size (samples) that fitted, at most B.
        accum_steps: K, the fewest micro-batches that reach B with micro-batches that fit: with
            ``exact=True`` (default) the smallest divisor of B that is >= B / max_micro_batch,
            else ceil(B / max_micro_batch).
        micro_batch_size: b <= max_micro_batch, the micro-batch for ``accum_steps=K``: B / K
            when exact, else ceil(B / K).
        effective_batch_size: K * b, samples per update with ``accum_steps=K`` and batches of
            b: B when exact, else up to K - 1 more (:func:`accum_steps_for`).
        probes: every probe in the order it ran, as ``(micro_batch_size, fitted)``.
    """

    target_batch_size: int
    max_micro_batch: int
    accum_steps: int
    micro_batch_size: int
    effective_batch_size: int
    probes: list[tuple[int, bool]]


def accum_steps_for(
    target_batch_size: int, max_micro_batch: int, *, exact: bool = True
) -> tuple[int, int]:
    """``(K, b)``: K micro-batches of at most ``max_micro_batch`` samples for an update of B
    (K * b == B with ``exact=True``; with ``exact=False`` K * b can exceed B by up to K - 1).

    Args:
        target_batch_size: B, samples per optimizer update.
        max_micro_batch: the largest micro-batch that fits (samples).
        exact: if True (default), b divides B exactly: K is the smallest divisor of B with
            B / K <= max_micro_batch, which can be more micro-batches than needed (16 of 256
            below, not 13); if False, K = ceil(B / max_micro_batch), the fewest micro-batches,
            and b = ceil(B / K), so K * b can exceed B (13 * 316 = 4108 below). The book's
            Reference page "Choosing b and K" says what an update then holds.

    Example:
        >>> accum_steps_for(4096, 320)
        (16, 256)
        >>> accum_steps_for(4096, 320, exact=False)
        (13, 316)
    """
    big = check_positive_int(target_batch_size, "target_batch_size")
    small = check_positive_int(max_micro_batch, "max_micro_batch")
    return split_batch(big, small, exact=exact)


def plan_accumulation(
    fits: Callable[[int], bool],
    target_batch_size: int,
    *,
    start: int = 1,
    multiple_of: int = 1,
    exact: bool = True,
) -> MicroBatchPlan:
    """Find the largest micro-batch (at most B) that fits and the K that reaches B with it.

    Args:
        fits: predicate ``fits(b) -> bool`` (see :func:`largest_fitting` and :func:`oom_probe`).
        target_batch_size: B, the samples per optimizer update you want.
        start: first micro-batch size probed (samples).
        multiple_of: probe only multiples of this (samples).
        exact: make K divide B (see :func:`accum_steps_for`).

    Returns:
        A :class:`MicroBatchPlan`.
    """
    big = check_positive_int(target_batch_size, "target_batch_size")
    step = check_positive_int(multiple_of, "multiple_of")
    first = -(-check_positive_int(start, "start") // step) * step  # as largest_fitting rounds it
    probes: list[tuple[int, bool]] = []
    best = largest_fitting(fits, start=first, limit=max(big, first), multiple_of=step,
                           probes=probes)
    k, b = accum_steps_for(big, min(best, big), exact=exact)
    return MicroBatchPlan(big, best, k, b, k * b, probes)


def oom_probe(
    step_at: Callable[[int], Any], *, cleanup: Callable[[], None] | None = None
) -> Callable[[int], bool]:
    """Turn ``step_at(b)`` (one training step at micro-batch b) into a ``fits(b)`` predicate.

    ``fits(b)`` runs ``step_at(b)`` and returns True, or False when it raises TensorFlow's
    out-of-memory error ``tf.errors.ResourceExhaustedError`` (also raised by XLA); any other
    error propagates. After each probe it runs ``gc.collect()`` and ``cleanup`` (if given) so
    the next probe starts from freed memory.

    Args:
        step_at: runs one complete step at micro-batch size b (samples), including whatever
            synchronisation makes the allocation happen (e.g. ``float(loss)``).
        cleanup: optional extra clean-up after each probe.
    """
    import tensorflow as tf

    def fits(b: int) -> bool:
        try:
            step_at(b)
        except tf.errors.ResourceExhaustedError:  # only OOM is swallowed
            return False
        finally:
            gc.collect()
            if cleanup is not None:
                cleanup()
        return True

    return fits


def gradient_step_probe(
    model: Any,
    loss: Any,
    input_shape: tuple[int, ...],
    *,
    classes: int = 10,
    jit_compile: bool = False,
) -> Callable[[int], float]:
    """``step_at(b)`` for :func:`oom_probe`: one forward + backward pass at micro-batch b.

    The step is what one accumcore micro-batch costs in memory: the activations of b samples and
    one set of gradients. It leaves out the accumulators and the optimizer's slots, which
    training allocates once, before the first step, whatever b is: about 1 + (the optimizer's
    slot copies, e.g. 2 for Adam) copies of the trainable weights. So the b it finds is the
    largest whose activations fit on top of the memory those already hold: allocate them (or
    leave room for them) before probing. Inputs are random, labels are integers in
    ``[0, classes)``; the step is a ``tf.function`` (retraced per size, since every probe uses
    a new shape).

    Args:
        model: a built Keras model.
        loss: a Keras loss (instance, name or callable) for sparse integer labels.
        input_shape: one sample's shape, e.g. ``(28, 28, 1)``.
        classes: number of label values.
        jit_compile: compile the step with XLA (as the training step will be).

    Returns:
        ``step_at(b) -> float`` (the loss; reading it forces the computation).
    """
    import tensorflow as tf

    from accumcore._impl.gradients import as_loss_fn

    loss_fn = as_loss_fn(loss)  # a reducing Keras loss: the mean over the micro-batch

    @tf.function(jit_compile=jit_compile)
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss_fn(y, model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        # Return a reduction of every gradient so that no part of the backward pass is pruned.
        return value, tf.add_n([tf.reduce_sum(g) for g in grads if g is not None])

    def step_at(b: int) -> float:
        x = tf.random.uniform((b, *input_shape))
        y = tf.random.uniform((b,), maxval=classes, dtype=tf.int32)
        value, _ = step(x, y)
        return float(value)

    return step_at
