"""Custom training loops over one :class:`~accumcore.AccumulationState`.

:class:`AccumTrainer` offers three ways to run the same update rule:

* ``fit(dataset, mode="eager")``: a plain Python loop, every op eager; the readable reference.
* ``fit(dataset, mode="function")``: the same Python loop calling a ``tf.function`` micro-step
  (traced once; a ragged last micro-batch does not retrace).
* ``fit(dataset, mode="graph")``: a whole epoch inside one ``tf.function`` (fastest).

and :meth:`~accumcore.AccumTrainer.window_step`, which takes one large batch and splits it into K
micro-batches *inside* the graph, so only one micro-batch's activations are alive at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from accumcore import distribute
from accumcore.batchnorm import attach_window_layers
from accumcore.config import (
    END_OF_EPOCH_POLICIES,
    check_choice,
    check_normalizer,
    check_optimizer,
    resolve_accum_steps,
    warn_if_float16_without_loss_scaling,
)
from accumcore.core import (
    as_loss_fn,
    first_leaf,
    replica_loss_factor,
    summed_loss_gradients,
)
from accumcore.state import AccumulationState

logger = logging.getLogger("accumcore")

MODES = ("eager", "function", "graph")


def _batch_relaxed_specs(structure: Any) -> Any:
    """``tf.TensorSpec`` s for a micro-batch with the batch (first) dimension unknown.

    Returns ``None`` if a leaf is neither a tensor nor a numpy array (then no spec is forced).
    """
    leaves = [t for t in tf.nest.flatten(structure) if t is not None]
    if not all(isinstance(t, (tf.Tensor, np.ndarray)) and len(t.shape) >= 1 for t in leaves):
        return None
    return tf.nest.map_structure(
        lambda t: None if t is None else tf.TensorSpec([None, *t.shape[1:]], tf.as_dtype(t.dtype)),
        structure,
    )


@dataclass
class LoopHistory:
    """What a loop recorded, one entry per micro-batch / window / epoch.

    Attributes:
        micro_losses: mean loss of each micro-batch (float, in loss units).
        micro_weights: weight ``c_i`` of each micro-batch (samples, weight sum or items).
        window_losses: mean loss over each closed window: ``sum c_i L_i / sum c_i``, exactly the
            loss a large batch made of that window would report.
        epoch_losses: mean loss over each epoch (per sample / item).
        updates: number of optimizer updates applied in each epoch.
        counters: :meth:`AccumulationState.counters` after the last epoch.
    """

    micro_losses: list[float] = field(default_factory=list)
    micro_weights: list[float] = field(default_factory=list)
    window_losses: list[float] = field(default_factory=list)
    epoch_losses: list[float] = field(default_factory=list)
    updates: list[int] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)


class AccumTrainer:
    """Train a Keras model with exact gradient accumulation in a custom loop.

    Args:
        model: a Keras model. It may be unbuilt (e.g. subclassed); it is built on the first
            micro-batch before any accumulator is created.
        optimizer: any Keras 3 optimizer (schedules, clipping, weight decay, EMA and
            ``LossScaleOptimizer`` included), without ``gradient_accumulation_steps``.
        loss: a ``keras.losses.Loss``, a loss name, or ``callable(y_true, y_pred)``. Must be a
            mean over samples (or items, see ``normalizer``). Regularisation losses
            (``model.losses``) are added, as in ``model.fit``.
        accum_steps: K, micro-batches per update. Or give ``effective_batch_size`` and
            ``micro_batch_size`` (K = B / b).
        end_of_epoch: ``"apply"`` (default: flush a partial window with its true weight),
            ``"carry"`` (keep it for the next epoch) or ``"drop"`` (discard it, logged and counted).
        nonfinite: ``"raise"`` (default), ``"skip_micro_batch"`` or ``"skip_window"``.
        normalizer: ``"samples"`` (default), ``"sample_weight"`` or a callable
            ``(x, y, sample_weight) -> item count``; see :func:`accumcore.core.micro_batch_weight`.
        jit_compile: compile the ``tf.function`` steps with XLA.

    Example:
        >>> trainer = AccumTrainer(model, keras.optimizers.Adam(1e-3),
        ...                        "sparse_categorical_crossentropy", accum_steps=4)
        >>> history = trainer.fit(train_ds.batch(16), epochs=2, mode="function")
    """

    def __init__(
        self,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer,
        loss: Any,
        accum_steps: int | None = None,
        *,
        effective_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        end_of_epoch: str = "apply",
        nonfinite: str = "raise",
        normalizer: str | Callable = "samples",
        jit_compile: bool = False,
    ) -> None:
        if not isinstance(model, keras.Model):
            raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
        check_optimizer(optimizer)
        k = resolve_accum_steps(
            accum_steps, effective_batch_size=effective_batch_size,
            micro_batch_size=micro_batch_size,
        )
        self.model = model
        self.optimizer = optimizer
        self.loss = as_loss_fn(loss)
        self.end_of_epoch = check_choice(end_of_epoch, "end_of_epoch", END_OF_EPOCH_POLICIES)
        self.normalizer = check_normalizer(normalizer)
        self.jit_compile = bool(jit_compile)
        self.state = AccumulationState(k, nonfinite=nonfinite)
        warn_if_float16_without_loss_scaling(model, optimizer)
        self._micro_fn = None
        self._epoch_fn = None
        self._window_fn = None
        self._window_ragged_fn = None  # window_step without XLA, for batches K does not divide
        self._flush_fn = None
        self.epoch = 0

    @property
    def accum_steps(self) -> int:
        return self.state.accum_steps

    # ------------------------------------------------------------------ building
    def build(self, x: Any) -> None:
        """Build model (by calling it on ``x``), optimizer and accumulators, eagerly.

        Under a ``tf.distribute`` strategy (model created in ``strategy.scope()``), ``x`` may
        be a distributed micro-batch; optimizer and accumulators are built in the scope.
        """
        self._strategy = distribute.model_strategy(self.model)
        if self._strategy is not None:
            with self._strategy.scope():
                return self._build(distribute.first_local(self._strategy, x))
        return self._build(x)

    def _build(self, x: Any) -> None:
        if not self.model.built or not self.model.trainable_variables:
            try:
                self.model(x, training=False)
            except Exception as err:  # noqa: BLE001 - re-raised with context
                raise ValueError(
                    "Could not build `model` by calling it on the first micro-batch "
                    f"(input shape {getattr(first_leaf(x), 'shape', '?')}): {err}. Build it "
                    "explicitly with `model.build(input_shape)` or start it with keras.Input."
                ) from err
        variables = self.model.trainable_variables
        if not self.optimizer.built:
            self.optimizer.build(variables)
        self.state.build(variables)
        attach_window_layers(self.model, self.state)  # window-level BN: one update per window

    def _loss_of(self, x, y, y_pred, sample_weight):
        if y is None:
            raise ValueError(
                "`dataset` yields no labels (y), but the loss needs them: make it yield "
                "`(x, y)` or `(x, y, sample_weight)` tuples."
            )
        loss = self.loss(y, y_pred, sample_weight)
        if self.model.losses:
            # Keras divides the loss (not model.losses) by the replicas in sync; so does this,
            # as summed_loss_gradients multiplies the sum back (replica_loss_factor).
            regularization = tf.add_n([tf.cast(v, loss.dtype) for v in self.model.losses])
            loss = loss + regularization / replica_loss_factor()
        return loss

    # ------------------------------------------------------------------ one micro-batch
    def _micro_step(self, x, y=None, sample_weight=None):
        loss, grads, weight, samples, _ = summed_loss_gradients(
            self.model, self._loss_of, x, y, sample_weight,
            normalizer=self.normalizer, optimizer=self.optimizer,
        )
        applied = self.state.step(
            grads, weight, samples, self.optimizer, self.model.trainable_variables
        )
        return loss, weight, applied

    def _run_micro_step(self, x, y=None, sample_weight=None):
        """:meth:`_micro_step`, on every replica under a strategy (outputs combined locally)."""
        if getattr(self, "_strategy", None) is None:
            return self._micro_step(x, y, sample_weight)
        return distribute.run_micro_step(self._strategy, self._micro_step, x, y, sample_weight)

    def train_micro_batch(self, x, y=None, sample_weight=None, *, compiled: bool = False):
        """Run one micro-batch; apply an update if it completes a window.

        Returns:
            ``(mean_loss, weight, applied)`` as tensors.
        """
        self.build(x)
        if compiled:
            if self._micro_fn is None:
                self._micro_fn = tf.function(
                    self._run_micro_step, reduce_retracing=True, jit_compile=self.jit_compile
                )
                # Trace once with the batch dimension unknown, so that a ragged (smaller) last
                # micro-batch reuses this trace instead of retracing.
                specs = _batch_relaxed_specs((x, y, sample_weight))
                if specs is not None:
                    self._micro_fn.get_concrete_function(*specs)
            out = self._micro_fn(x, y, sample_weight)
        else:
            out = self._run_micro_step(x, y, sample_weight)
        self.state.raise_if_nonfinite(self.epoch)
        return out

    # ------------------------------------------------------------------ one window, in graph
    def _window(self, x, y, sample_weight):
        k = self.accum_steps
        n = tf.shape(first_leaf(x))[0]
        size = (n + k - 1) // k  # ceil(n / K): the last micro-batch may be smaller

        def take(t, start):
            return None if t is None else tf.nest.map_structure(
                lambda a: a[start : start + size], t
            )

        count = (n + size - 1) // size  # number of non-empty micro-batches (<= K)
        total_loss = tf.constant(0.0)
        total_weight = tf.constant(0.0)
        for i in tf.range(count):  # autograph: a tf.while_loop; one micro-batch alive at a time
            start = i * size
            xi, yi, wi = take(x, start), take(y, start), take(sample_weight, start)
            loss, grads, weight, samples, _ = summed_loss_gradients(
                self.model, self._loss_of, xi, yi, wi,
                normalizer=self.normalizer, optimizer=self.optimizer,
            )
            self.state.accumulate(grads, weight, samples, self.optimizer)
            self.state.advance()
            total_loss += loss * weight
            total_weight += weight
        self.state.apply_window(self.optimizer, self.model.trainable_variables)
        return tf.math.divide_no_nan(total_loss, total_weight)

    def window_step(self, x, y=None, sample_weight=None):
        """One optimizer update from one large batch, split into K micro-batches in the graph.

        The batch of ``n`` samples is cut into micro-batches of ``ceil(n / K)`` samples (the
        last may be smaller); gradients are accumulated inside one ``tf.function`` and applied
        once. A batch of 64 with ``accum_steps=4`` runs as 4 x 16 without holding 64 samples'
        activations. Must start on an empty window (it closes the window it opens).

        Returns:
            The mean loss over the batch (float32 scalar tensor).
        """
        self.build(x)
        if self._strategy is not None:
            raise NotImplementedError(
                "`window_step` splits one batch on one device; under a tf.distribute strategy "
                "use `trainer.fit(dataset_of_micro_batches)` (or `train_micro_batch`), which "
                "splits every micro-batch across the replicas."
            )
        if self._window_fn is None:
            self._window_fn = tf.function(
                self._window, reduce_retracing=True, jit_compile=self.jit_compile
            )
        if int(self.state.micro_step.numpy()) != 0:
            raise ValueError(
                "`window_step` needs an empty window, but a partial window is pending from "
                "micro-batch training: call `trainer.flush()` first."
            )
        window_fn = self._window_fn
        n = first_leaf(x).shape[0]
        if self.jit_compile and (n is None or n % self.accum_steps):
            # XLA clamps an out-of-range slice to its static size, so a smaller last
            # micro-batch would silently re-read samples of the one before it: run such
            # ragged windows without XLA (issue 5 found this; tests/test_benchmarks.py).
            if self._window_ragged_fn is None:
                self._window_ragged_fn = tf.function(self._window, reduce_retracing=True)
            window_fn = self._window_ragged_fn
        loss = window_fn(x, y, sample_weight)
        self.state.raise_if_nonfinite(self.epoch)
        return loss

    # ------------------------------------------------------------------ end of epoch
    def flush(self) -> bool:
        """Apply the pending partial window now, with its true weight. Returns whether it did."""
        if not self.state.built or int(self.state.micro_step.numpy()) == 0:
            return False
        return bool(self.state.apply_window(self.optimizer, self.model.trainable_variables))

    def end_epoch(self) -> None:
        """Apply the end-of-epoch policy to a partial window."""
        pending = int(self.state.micro_step.numpy())
        if pending == 0:
            return
        if self.end_of_epoch == "apply":
            self.flush()
        elif self.end_of_epoch == "drop":
            samples = int(self.state.window_samples.numpy())
            logger.warning(
                "end_of_epoch='drop': discarding a partial window of %d micro-batches "
                "(%d samples) at the end of epoch %d.", pending, samples, self.epoch,
            )
            self.state.drop_window()
        else:
            logger.info(
                "end_of_epoch='carry': %d micro-batches carried into the next epoch.", pending
            )

    # ------------------------------------------------------------------ whole epoch in graph
    def _epoch(self, dataset):
        losses = tf.TensorArray(tf.float32, size=0, dynamic_size=True)
        weights = tf.TensorArray(tf.float32, size=0, dynamic_size=True)
        applied = tf.TensorArray(tf.bool, size=0, dynamic_size=True)
        i = 0
        # iter(): autograph turns this into a tf.while_loop over the iterator. `for batch in
        # dataset` would become `dataset.reduce`, whose body (variable updates, optimizer)
        # runs about 10-30x slower (benchmarks/RESULTS.md, issue 5).
        for batch in iter(dataset):
            x, y, sw = keras.utils.unpack_x_y_sample_weight(batch)
            loss, weight, did = self._run_micro_step(x, y, sw)
            losses = losses.write(i, loss)
            weights = weights.write(i, weight)
            applied = applied.write(i, did)
            i += 1
        return losses.stack(), weights.stack(), applied.stack()

    # ------------------------------------------------------------------ fit
    def fit(
        self,
        dataset: tf.data.Dataset,
        epochs: int = 1,
        *,
        mode: str = "function",
        verbose: int = 1,
        on_epoch_end: Callable[[int, LoopHistory], None] | None = None,
    ) -> LoopHistory:
        """Train for ``epochs`` passes over ``dataset`` (a dataset of **micro-batches**).

        Args:
            dataset: ``tf.data.Dataset`` yielding ``x``, ``(x, y)`` or ``(x, y, sample_weight)``
                micro-batches (batch it with the micro-batch size b).
            epochs: number of passes.
            mode: ``"eager"``, ``"function"`` (default) or ``"graph"``; see the module doc.
            verbose: 1 shows a ``keras.utils.Progbar`` per epoch (one tick per micro-batch),
                2 prints one line per epoch (as ``model.fit``), 0 is silent.
            on_epoch_end: optional ``f(epoch, history)`` called after each epoch.

        Returns:
            A :class:`LoopHistory`.
        """
        check_choice(mode, "mode", MODES)
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                f"`dataset` must be a tf.data.Dataset of micro-batches, got "
                f"{type(dataset).__name__}; use tf.data.Dataset.from_tensor_slices(...).batch(b)."
            )
        if int(dataset.cardinality()) == 0:
            raise ValueError(
                "`dataset` is empty (cardinality 0): nothing to train on. Check the data "
                "source and that `.batch(b, drop_remainder=True)` did not drop everything."
            )
        # Under a tf.distribute strategy each global micro-batch is split across the replicas.
        strategy = distribute.model_strategy(self.model)
        batches = dataset if strategy is None else distribute.distribute_dataset(strategy, dataset)
        history = LoopHistory()
        window_sum = 0.0
        window_weight = 0.0
        for _ in range(epochs):
            steps = int(dataset.cardinality()) if int(dataset.cardinality()) > 0 else None
            bar = keras.utils.Progbar(steps, verbose=verbose, unit_name="micro-batch")
            before = int(self.state.windows_applied.numpy()) if self.state.built else 0
            records: list[tuple[float, float, bool]] = []
            if mode == "graph":
                for batch in dataset.take(1):  # build eagerly before tracing
                    self.build(keras.utils.unpack_x_y_sample_weight(batch)[0])
                if self._epoch_fn is None:
                    self._epoch_fn = tf.function(self._epoch, jit_compile=False)
                losses, weights, applied = self._epoch_fn(batches)
                self.state.raise_if_nonfinite(self.epoch)
                records = list(zip(losses.numpy().tolist(), weights.numpy().tolist(),
                                   applied.numpy().tolist()))
                bar.update(len(records), values=[("loss", float(np.mean(losses)))] if records
                           else None, finalize=False)
            else:
                for step, batch in enumerate(batches):
                    x, y, sw = keras.utils.unpack_x_y_sample_weight(batch)
                    loss, weight, did = self.train_micro_batch(
                        x, y, sw, compiled=(mode == "function")
                    )
                    records.append((float(loss), float(weight), bool(did)))
                    bar.update(step + 1, values=[("loss", float(loss))])
            if not records:
                raise ValueError(
                    "`dataset` yielded no micro-batches in this epoch: it is empty (or an "
                    "exhausted iterator). Pass a dataset that can be iterated once per epoch."
                )
            # Book-keeping in Python: window losses from the per-micro-batch records.
            epoch_sum = sum(loss * w for loss, w, _ in records)
            epoch_weight = sum(w for _, w, _ in records)
            for loss, w, did in records:
                history.micro_losses.append(loss)
                history.micro_weights.append(w)
                window_sum += loss * w
                window_weight += w
                if did:
                    history.window_losses.append(window_sum / window_weight)
                    window_sum = window_weight = 0.0
            pending = int(self.state.micro_step.numpy())
            self.end_epoch()
            if pending and self.end_of_epoch == "apply":
                history.window_losses.append(window_sum / window_weight)
            if self.end_of_epoch != "carry":
                window_sum = window_weight = 0.0
            history.epoch_losses.append(epoch_sum / epoch_weight if epoch_weight else 0.0)
            history.updates.append(int(self.state.windows_applied.numpy()) - before)
            if verbose and (mode == "graph" or steps is None):  # else the last step finalized
                bar.update(bar.target or len(records), values=None, finalize=True)
            history.counters = self.state.counters()
            if on_epoch_end is not None:
                on_epoch_end(self.epoch, history)
            self.epoch += 1
        return history
