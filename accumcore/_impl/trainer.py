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

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from accumcore._impl import building, datasets, distribute, entry, epoch_loop, micro_steps
from accumcore._impl.config import (
    check_choice,
    check_settings,
    get_optimizer,
    resolve_accum_steps,
    warn_if_float16_without_loss_scaling,
)
from accumcore._impl.denominators import CountedLoss
from accumcore._impl.epoch_loop import HistoryBook, LoopHistory, fit_epoch
from accumcore._impl.gradients import as_loss_fn, resolve_normalizer
from accumcore._impl.nonfinite import NonFinitePolicy
from accumcore._impl.state import AccumulationState

MODES = ("eager", "function", "graph")


class AccumTrainer:
    """Train a Keras model with exact gradient accumulation in a custom loop.

    Args:
        model: a Keras model. It may be unbuilt (e.g. subclassed); it is built on the first
            micro-batch before any accumulator is created.
        optimizer: any Keras 3 optimizer (schedules, clipping, weight decay, EMA and
            ``LossScaleOptimizer`` included), without ``gradient_accumulation_steps``; or a
            name such as ``"adam"`` (``keras.optimizers.get``, as ``model.compile``). Replace
            it between ``fit`` calls by assigning ``trainer.optimizer`` (fine-tuning).
        loss: a ``keras.losses.Loss``, a loss name, or ``callable(y_true, y_pred)`` (wrapped
            as ``model.compile`` wraps it). Every micro-batch is weighted by what the loss
            divided it by: its samples, its sample-weight sum, or its valid elements under a
            Keras mask of the model's output or ``ignore_class``; a loss with
            ``reduction="sum"`` is accumulated without division. ``None``: the model's own
            losses are the loss, as after ``model.compile(loss=None)``. The model's losses
            (``model.losses``: ``add_loss`` terms, regularisers) are added, as in
            ``model.fit``, each weighed by its form (a sum over samples, a mean, or a weight
            regulariser counted once per update; Keras workflows page).
        accum_steps: K, micro-batches per update. Or give ``effective_batch_size`` and
            ``micro_batch_size`` (K = B / b).
        end_of_epoch: ``"apply"`` (default: flush a partial window with its true weight),
            ``"carry"`` (keep it for the next epoch) or ``"drop"`` (discard it, logged and counted).
        nonfinite: ``"raise"`` (default; a window with a NaN or Inf is discarded whole and
            raises), ``"skip_window"`` (discarded, training goes on), ``"skip_micro_batch"``
            (only the bad micro-batches left out) or a :class:`~accumcore.NonFinitePolicy`.
        normalizer: ``"auto"`` (default: the loss's own denominator, read as it runs:
            samples, sample-weight sum or valid elements; no division for ``"sum"``),
            ``"samples"`` or ``"sample_weight"`` (checked against that denominator: a masked
            loss refuses ``"samples"``), or a callable ``(x, y, sample_weight) -> item count``,
            used as given; see ``accumcore._impl.gradients.resolve_normalizer`` and
            ``accumcore._impl.denominators.micro_batch_weight``.
        jit_compile: compile the ``tf.function`` steps with XLA.

    The trainable set is followed: freeze or unfreeze layers between calls and the next
    micro-batch re-creates the accumulators (the window must be empty; ``flush()`` first)
    and retraces. A Keras optimizer cannot take new variables: after unfreezing, assign a
    fresh one (``trainer.optimizer = keras.optimizers.Adam(1e-5)``), as ``compile`` does.

    Example:
        >>> trainer = AccumTrainer(model, keras.optimizers.Adam(1e-3),
        ...                        "sparse_categorical_crossentropy", accum_steps=4)
        >>> history = trainer.fit(train_ds.batch(16), epochs=2, mode="function")
    """

    def __init__(
        self,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer | str,
        loss: Any,
        accum_steps: int | None = None,
        *,
        effective_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        end_of_epoch: str = "apply",
        nonfinite: str | NonFinitePolicy = "raise",
        normalizer: str | Callable = "auto",
        jit_compile: bool = False,
    ) -> None:
        if not isinstance(model, keras.Model):
            raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
        optimizer = get_optimizer(optimizer)
        k = resolve_accum_steps(
            accum_steps, effective_batch_size=effective_batch_size,
            micro_batch_size=micro_batch_size,
        )
        self.model = model
        self.loss = None if loss is None else as_loss_fn(loss)
        # The loss differentiated: a CountedLoss (reports what it divides by) + model.losses.
        self._loss_of = functools.partial(
            micro_steps.loss_of, None if self.loss is None else CountedLoss(self.loss), model)
        settings = check_settings(end_of_epoch=end_of_epoch, normalizer=normalizer)
        self.end_of_epoch, self.normalizer = settings["end_of_epoch"], settings["normalizer"]
        # What the window rule uses: the normaliser matching the loss's reduction.
        self._normalizer = resolve_normalizer(self.normalizer, loss)
        self.jit_compile = bool(jit_compile)
        self.micro_batch_size = micro_batch_size
        self.state = AccumulationState(k, nonfinite=nonfinite)
        self._reset_functions()
        self.optimizer = optimizer
        self.epoch = 0

    def _reset_functions(self) -> None:
        """Forget the compiled steps (they captured the optimizer and the trainable set) and make
        them anew, untraced; ``_micro_fn`` is made on the first micro-batch, for its shape."""
        self._micro_fn = None
        self._epoch_fn = tf.function(
            functools.partial(epoch_loop.epoch_in_graph, self._run_micro_step), jit_compile=False)
        split = functools.partial(micro_steps.split_window, self, self._loss_of, self._normalizer)
        self._window_fn = tf.function(split, reduce_retracing=True, jit_compile=self.jit_compile)
        # window_step without XLA, for batches K does not divide (micro_steps.ragged_under_xla)
        self._window_ragged_fn = tf.function(split, reduce_retracing=True)

    @property
    def optimizer(self) -> keras.optimizers.Optimizer:
        """The optimizer. Assign a new one (instance or name) to continue with it, e.g. after
        unfreezing layers: a built Keras optimizer cannot update variables it was not built
        for. Compiled steps are retraced; a pending window is applied by the new optimizer."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: keras.optimizers.Optimizer | str) -> None:
        self._optimizer = get_optimizer(optimizer)
        # ids of the variables the optimizer can update (None: not known yet)
        self._optimizer_variables: set[int] | None = None
        warn_if_float16_without_loss_scaling(self.model, self._optimizer)
        self._reset_functions()

    @property
    def accum_steps(self) -> int:
        return self.state.accum_steps

    # ------------------------------------------------------------------ building
    def build(self, x: Any) -> None:
        """Build model (by calling it on ``x``), optimizer and accumulators, eagerly.

        Under a ``tf.distribute`` strategy (model created in ``strategy.scope()``), ``x`` may
        be a distributed micro-batch; optimizer and accumulators are built in the scope.
        """
        self._strategy = strategy = distribute.model_strategy(self.model)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            self._optimizer_variables = building.build_model_and_optimizer(
                self.model, self.state, self.optimizer, distribute.first_local(strategy, x),
                self._optimizer_variables)
            # First build, or accumulators for a new trainable set: compiled steps are retraced.
            if entry.prepare(self.state, self.model, self._normalizer,
                             distributed=strategy is not None):
                self._reset_functions()

    # ------------------------------------------------------------------ one micro-batch
    def _run_micro_step(self, x, y=None, sample_weight=None):
        """``micro_step``, on every replica under a strategy (outputs
        combined locally)."""
        step = functools.partial(micro_steps.micro_step, self, self._loss_of, self._normalizer)
        if getattr(self, "_strategy", None) is None:
            return step(x, y, sample_weight)
        return distribute.run_micro_step(self._strategy, step, x, y, sample_weight)

    def train_micro_batch(self, x, y=None, sample_weight=None, *, compiled: bool = False):
        """Run one micro-batch; apply an update if it completes a window.

        Checks for a non-finite window after the call (one host read of the state's stop):
        under ``nonfinite="raise"`` the call that closes a bad window raises
        :class:`~accumcore.NonFiniteGradientError` here. (``fit`` checks once per epoch
        instead, with no host read per micro-batch.)

        Returns:
            ``(mean_loss, weight, applied)`` as tensors.
        """
        out = self._train_micro_batch(x, y, sample_weight, compiled=compiled)
        self.state.raise_if_nonfinite(self.epoch)
        return out

    def _train_micro_batch(self, x, y=None, sample_weight=None, *, compiled: bool = False):
        """:meth:`train_micro_batch` without the non-finite check (``fit`` checks per epoch:
        a stopped state discards every later window)."""
        self.build(x)
        if not compiled:
            return self._run_micro_step(x, y, sample_weight)
        if self._micro_fn is None:
            self._micro_fn = micro_steps.compile_micro_step(
                self._run_micro_step, (x, y, sample_weight), self.jit_compile)
        return self._micro_fn(x, y, sample_weight)

    # ------------------------------------------------------------------ one window, in graph
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
        micro_steps.check_window_step(self, distributed=self._strategy is not None)
        ragged = micro_steps.ragged_under_xla(self, x)
        window_fn = self._window_ragged_fn if ragged else self._window_fn
        loss = window_fn(x, y, sample_weight)
        self.state.raise_if_nonfinite(self.epoch)
        return loss

    # ------------------------------------------------------------------ end of epoch
    def flush(self) -> bool:
        """Apply the pending partial window now, with its true weight. Returns whether it did."""
        # To the variables the window was accumulated for (also after a `trainable` change).
        return entry.flush(self.state, self.optimizer, self.model.trainable_variables)

    def end_epoch(self) -> str | None:
        """Apply the end-of-epoch policy to a partial window; returns what was done
        (``accumcore._impl.entry.end_epoch``)."""
        return entry.end_epoch(self.state, self.end_of_epoch, self.optimizer,
                               self.model.trainable_variables, self.epoch)

    # ------------------------------------------------------------------ epoch, eager / function
    def run_micro_batches(
        self,
        batches: Any,
        *,
        compiled: bool = False,
        check_each: bool = True,
        after: Callable[[int, tuple], None] | None = None,
    ) -> list[tuple]:
        """Train on every micro-batch of ``batches`` in a Python loop: the eager / function
        epoch of :meth:`fit` and of :class:`~accumcore.checkpointing.ResumableLoop`.

        Args:
            batches: an iterable of micro-batches ``x``, ``(x, y)`` or ``(x, y, sample_weight)``
                (a dataset or an iterator over one).
            compiled: run the ``tf.function`` micro-step (``mode="function"``), else eagerly.
            check_each: raise :class:`~accumcore.NonFiniteGradientError` right after a bad
                micro-batch, before ``after`` sees it (one host read per micro-batch, as
                :meth:`train_micro_batch`). ``False`` leaves the check to the caller, with no
                host read here: :meth:`fit` calls ``state.raise_if_nonfinite(epoch)`` once
                per epoch (a stopped state discards every later window).
            after: optional ``after(step, record)`` called after each micro-batch, with its
                0-based index in ``batches`` and its record.

        Returns:
            The records, one per micro-batch: ``(mean_loss, weight, applied)`` as tensors
            (float32, float32 and bool scalars; convert them on the host when needed).
        """
        return epoch_loop.run_micro_batches(self, self._train_micro_batch, batches,
                                            compiled=compiled, check_each=check_each, after=after)

    # ------------------------------------------------------------------ fit
    def fit(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        epochs: int = 1,
        *,
        sample_weight: Any = None,
        shuffle: bool = True,
        steps_per_epoch: int | None = None,
        mode: str = "function",
        verbose: int = 1,
        on_epoch_end: Callable[[int, LoopHistory], None] | None = None,
    ) -> LoopHistory:
        """Train for ``epochs`` epochs of **micro-batches**, like ``model.fit``.

        Args:
            x: a ``tf.data.Dataset`` yielding ``x``, ``(x, y)`` or ``(x, y, sample_weight)``
                micro-batches (batch it with the micro-batch size b), or numpy arrays /
                tensors (a list or dict for several inputs) with ``y`` and ``batch_size``.
            y, sample_weight: arrays, only with array ``x``. As in ``model.fit``, the second
                position is ``y``: ``fit(dataset, 3)`` raises; pass ``epochs=3``.
            batch_size: the micro-batch size b for arrays (default: the trainer's
                ``micro_batch_size``, else 32 as in Keras). Not with a dataset.
            epochs: number of epochs.
            shuffle: arrays only (a dataset is used in its own order): ``True`` (default, as
                ``model.fit``) draws a new order every epoch, from TensorFlow's global seed
                (``keras.utils.set_random_seed``); ``False`` keeps the order.
            steps_per_epoch: micro-batches per epoch, as in ``model.fit``: required for an
                infinite dataset (``.repeat()``). One iterator runs across the epochs, so each
                epoch continues where the last stopped; if the data runs out, a warning says
                so, that epoch ends early and the next one starts a new pass. Windows and
                ``end_of_epoch`` work per epoch of that many micro-batches.
            mode: ``"eager"``, ``"function"`` (default) or ``"graph"``; see the module doc.
            verbose: 1 shows a ``keras.utils.Progbar`` per epoch (one tick per micro-batch),
                2 prints one line per epoch (as ``model.fit``), 0 is silent.
            on_epoch_end: optional ``f(epoch, history)`` called after each epoch.

        A :class:`NonFiniteGradientError` of a previous call is cleared at the start (logged).

        Returns:
            A :class:`LoopHistory`.
        """
        check_choice(mode, "mode", MODES)
        dataset = datasets.as_dataset(x, y, sample_weight, batch_size, shuffle,
                                    micro_batch_size=self.micro_batch_size)
        cardinality, steps_per_epoch = datasets.check_epochs(self.model, dataset, steps_per_epoch)
        if self.state.built:
            self.state.clear_nonfinite()  # logged, if a previous call raised
        book = HistoryBook()
        source = datasets.EpochSource(self.model, dataset, cardinality, steps_per_epoch)
        for _ in range(epochs):
            fit_epoch(self, dataset, source, book, self._graph_epoch, mode=mode, verbose=verbose)
            book.history.counters = self.state.counters()
            if on_epoch_end is not None:
                on_epoch_end(self.epoch, book.history)
            self.epoch += 1
        return book.history

    def _graph_epoch(self, dataset: tf.data.Dataset, source: datasets.EpochSource) -> list[tuple]:
        """One epoch as one compiled function (``mode="graph"``): its per-micro-batch records."""
        for batch in dataset.take(1):  # build eagerly before tracing
            self.build(keras.utils.unpack_x_y_sample_weight(batch)[0])
        return epoch_loop.graph_records(self, self._epoch_fn, source)
