"""The floor for "cost of accumulating": a minimal correct whole-window accumulator (issue 13).

Written plainly, with nothing but what the window rule needs, so that the benchmark can tell
the price of accumulating from the price of accumcore's own machinery. Per micro-batch of
``c_i`` samples:

1. the gradient of the micro-batch's *summed* loss ``c_i * L_i`` (one forward+backward pass);
2. ``assign_add`` of that (already weighted) gradient into one accumulator per variable, and
   of the weight ``c_i`` into one scalar;
3. a micro-batch counter advanced;
4. one ``tf.cond``: when the counter reaches K, divide the accumulators once by
   ``sum_i c_i``, call ``optimizer.apply`` once, and zero accumulators, weight and counter.

That is the same update as one large batch of ``sum_i c_i`` samples for a loss that is a mean
over samples, with any Keras optimizer (``tests/test_benchmarks.py`` checks it against a
large-batch reference). What it leaves out, on purpose: sample weights, regularization losses,
non-finite checks, loss scaling, distribution strategies, BatchNorm window hooks, partial
windows at the end of an epoch (a pending window is simply carried), per-micro-batch loss
records. The variants mirror accumcore's compiled entry points:

* :meth:`MinimalAccumulator.step` -- one ``tf.function`` call per micro-batch (as
  ``AccumTrainer.fit(mode="function")`` and ``AccumModel.fit``'s ``train_step``);
* :meth:`MinimalAccumulator.epoch` -- a whole dataset in one ``tf.function`` (as
  ``mode="graph"``);
* :meth:`MinimalAccumulator.window` -- one ``tf.function`` call per window, the batch split in
  the graph into ``ceil(n / K)``-sample micro-batches (as ``AccumTrainer.window_step``); it
  applies unconditionally at the end of the call, so it has no counter and no ``tf.cond``.

And :class:`MinimalSplitModel`, the floor of ``fit`` with ``micro_batch_size`` (issue 47): a
``keras.Model`` whose ``train_step`` cuts the batch of B into static slices of b in one
``tf.while_loop`` (``parallel_iterations=1``), carries the summed loss and the sums of the
micro-batches' gradients of their summed losses in the loop variables (or, with
``accumulators=True``, adds them into one variable per weight, as accumcore does), divides once
by B and calls ``optimizer.apply`` once; it updates the loss metric with the batch's mean loss.
It leaves out what :class:`MinimalAccumulator` leaves out, and a last micro-batch smaller than b
(B must be a multiple of b: checked, one op) and every compiled metric but the loss.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf


class MinimalAccumulator:
    """Whole-window gradient accumulation in its least code.

    Args:
        model: a built Keras model.
        optimizer: any Keras optimizer (built here on the model's trainable variables).
        loss: a Keras loss name or function returning one loss per sample, shape ``(b,)``.
        accum_steps: K, micro-batches per optimizer update.
        jit_compile: compile :meth:`window` with XLA (static shapes only: whole windows).
    """

    def __init__(self, model: keras.Model, optimizer: keras.optimizers.Optimizer,
                 loss: Any, accum_steps: int, *, jit_compile: bool = False) -> None:
        if accum_steps < 1:
            raise ValueError(f"`accum_steps` must be >= 1, got {accum_steps}.")
        self.model = model
        self.optimizer = optimizer
        self.per_sample_loss = keras.losses.get(loss) if isinstance(loss, str) else loss
        self.accum_steps = accum_steps
        self.variables = list(model.trainable_variables)
        optimizer.build(self.variables)  # before tracing: no variables created in a tf.cond
        self.accumulators = [tf.Variable(tf.zeros_like(v), trainable=False)
                             for v in self.variables]
        self.weight = tf.Variable(0.0, trainable=False)  # samples in the open window
        self.count = tf.Variable(0, dtype=tf.int32, trainable=False)  # its micro-batches
        self.step = tf.function(self._step, reduce_retracing=True)
        self.epoch = tf.function(self._epoch)
        self.window = tf.function(self._window, reduce_retracing=True, jit_compile=jit_compile)

    # ------------------------------------------------------------------ the rule
    def _accumulate(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        """Add one micro-batch; returns its summed loss (float32 scalar)."""
        with tf.GradientTape() as tape:
            summed = tf.reduce_sum(self.per_sample_loss(y, self.model(x, training=True)))
        grads = tape.gradient(summed, self.variables)
        for acc, grad in zip(self.accumulators, grads, strict=True):
            acc.assign_add(grad)
        self.weight.assign_add(tf.cast(tf.shape(x)[0], tf.float32))
        return summed

    def _apply(self) -> tf.Tensor:
        """Divide once by the window's samples, one optimizer update, zero the window."""
        self.optimizer.apply([acc / self.weight for acc in self.accumulators], self.variables)
        for acc in self.accumulators:
            acc.assign(tf.zeros_like(acc))
        self.weight.assign(0.0)
        self.count.assign(0)
        return tf.constant(True)

    def _step(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        """One micro-batch ``x`` (b, ...) , ``y`` (b,); applies when it completes a window.

        Returns the micro-batch's mean loss (float32 scalar).
        """
        summed = self._accumulate(x, y)
        self.count.assign_add(1)
        tf.cond(self.count >= self.accum_steps, self._apply, lambda: tf.constant(False))
        return summed / tf.cast(tf.shape(x)[0], tf.float32)

    def _epoch(self, dataset: tf.data.Dataset) -> tf.Tensor:
        """Every ``(x, y)`` micro-batch of ``dataset`` in one graph; returns the summed loss."""
        total = tf.constant(0.0)
        for x, y in iter(dataset):  # a tf.while_loop over the iterator, like mode="graph"
            total += self._step(x, y) * tf.cast(tf.shape(x)[0], tf.float32)
        return total

    def _window(self, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        """One window: ``x`` (n, ...) split into ``ceil(n / K)``-sample micro-batches.

        Must start on an empty window (use it alone, not after :meth:`step`). Returns the
        window's mean loss (float32 scalar).
        """
        n = tf.shape(x)[0]
        size = (n + self.accum_steps - 1) // self.accum_steps
        count = (n + size - 1) // size
        total = tf.constant(0.0)
        for i in tf.range(count):
            start = i * size
            total += self._accumulate(x[start:start + size], y[start:start + size])
        self._apply()
        return total / tf.cast(n, tf.float32)

    def fit_epoch(self, dataset: tf.data.Dataset) -> float:
        """One epoch with :meth:`step`, one call per micro-batch; returns the last loss."""
        loss = None
        for x, y in dataset:
            loss = self.step(x, y)
        return float(loss)


class MinimalSplitModel(keras.Model):
    """``fit`` with the batch split inside ``train_step``, in its least code (public Keras only).

    Args:
        model: the network (a built Keras model; its variables are this model's).
        loss: a Keras loss name or function returning one loss per sample, shape ``(b,)``.
        micro_batch_size: b, samples per micro-batch (a Python int: every slice has the static
            shape ``(b, ...)``); ``fit``'s ``batch_size`` B must be a multiple of it.
        accumulators: add each micro-batch's gradient into one ``tf.Variable`` per weight
            (``assign``) instead of carrying the sums in the loop's variables.

    Compile it with an optimizer only (``compile(optimizer)``): the loss is this model's.
    """

    def __init__(self, model: keras.Model, loss: Any, micro_batch_size: int, *,
                 accumulators: bool = False) -> None:
        super().__init__()
        self.network = model
        self.per_sample_loss = keras.losses.get(loss) if isinstance(loss, str) else loss
        self.micro_batch_size = micro_batch_size
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.accumulators = [tf.Variable(tf.zeros_like(v), trainable=False)
                             for v in model.trainable_variables] if accumulators else None

    def call(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        return self.network(x, training=training)

    @property
    def metrics(self) -> list:
        return [self.loss_tracker]

    def _summed(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, list]:
        """One micro-batch's summed loss (float32 scalar) and its gradients."""
        variables = self.trainable_variables
        with tf.GradientTape() as tape:
            summed = tf.reduce_sum(self.per_sample_loss(y, self(x, training=True)))
        return summed, tape.gradient(summed, variables)

    def train_step(self, data: Any) -> dict:
        """One update from a batch ``x`` (B, ...), ``y`` (B,): B / b micro-batches of b."""
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        b, variables = self.micro_batch_size, self.trainable_variables
        n = tf.shape(x)[0]
        tf.debugging.assert_equal(n % b, 0, message="B must be a multiple of b")

        def cut(t: tf.Tensor, i: tf.Tensor) -> tf.Tensor:
            begin = tf.stack([i * b] + [0] * (t.shape.rank - 1))
            piece = tf.slice(t, begin, [b] + [-1] * (t.shape.rank - 1))
            piece.set_shape(tf.TensorShape([b]).concatenate(t.shape[1:]))
            return piece

        def body(i, total, *sums):
            summed, grads = self._summed(cut(x, i), cut(y, i))
            if self.accumulators is not None:
                for acc, g in zip(self.accumulators, grads, strict=True):
                    acc.assign(acc + g)
                return (i + 1, total + summed)
            return (i + 1, total + summed, *[s + g for s, g in zip(sums, grads, strict=True)])

        sums = [] if self.accumulators is not None else [tf.zeros_like(v) for v in variables]
        _, total, *sums = tf.while_loop(lambda i, *_: i < n // b, body,
                                        (tf.constant(0), tf.constant(0.0), *sums),
                                        parallel_iterations=1)
        if self.accumulators is not None:
            sums = [acc.value() for acc in self.accumulators]
        samples = tf.cast(n, tf.float32)
        self.optimizer.apply([s / samples for s in sums], variables)
        if self.accumulators is not None:
            for acc in self.accumulators:
                acc.assign(tf.zeros_like(acc))
        self.loss_tracker.update_state(total / samples, sample_weight=samples)
        return {"loss": self.loss_tracker.result()}
