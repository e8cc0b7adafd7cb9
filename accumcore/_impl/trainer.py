"""The custom-loop side: :class:`AccumTrainer`, custom training loops over one
:class:`~accumcore.AccumulationState`.

:class:`AccumTrainer` offers three ways to run the same update rule:

* ``fit(dataset, mode="eager")``: a plain Python loop, every op eager; the readable reference.
* ``fit(dataset, mode="function")``: the same Python loop calling a ``tf.function`` micro-step
  (traced once; a ragged last micro-batch does not retrace).
* ``fit(dataset, mode="graph")``: a whole epoch inside one ``tf.function`` (fastest).

and :meth:`~accumcore.AccumTrainer.window_step`, which takes one large batch and splits it
*inside* the graph, so only one micro-batch's activations are alive at a time.

``micro_batch_size=b``: each batch given (to ``fit``, ``window_step``, ``train_micro_batch``) is
the recipe's batch B, split inside the step into micro-batches of at most b
(``AccumulationState.one_window``, the cut every entry point makes: b, b, ..., the rest), one
update per batch. ``accum_steps=K``:
each batch given is a micro-batch, K per update (``window_step`` cuts its batch of n into
micro-batches of ``ceil(n / K)`` with the same function).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from accumcore._impl import datasets, distribute, epoch_loop, settings
from accumcore._impl.denominators import CountedLoss, resolve_normalizer
from accumcore._impl.epoch_loop import HistoryBook, LoopHistory, fit_epoch
from accumcore._impl.gradients import (
    as_loss_fn,
    first_leaf,
    replica_loss_factor,
    summed_loss_gradients,
)
from accumcore._impl.nonfinite import NonFinitePolicy
from accumcore._impl.rule import variable_name
from accumcore._impl.search import probe_total, search_micro_batch
from accumcore._impl.settings import (
    AUTO,
    check_choice,
    get_optimizer,
    resolve_accum_steps,
    warn_if_float16_without_loss_scaling,
)
from accumcore._impl.state import AccumulationState, take

logger = logging.getLogger("accumcore")

MODES = ("eager", "function", "graph")


class AccumTrainer:
    """Train a Keras model with exact gradient accumulation in a custom loop.

    Args:
        model: a Keras model. It may be unbuilt (e.g. subclassed); it is built on the first
            micro-batch before any accumulator is created.
        optimizer: any Keras 3 optimizer (schedules, clipping, weight decay, EMA and
            ``LossScaleOptimizer`` included) without ``gradient_accumulation_steps``, or a
            name such as ``"adam"``, as for ``model.compile``. Assign ``trainer.optimizer``
            between ``fit`` calls to replace it (fine-tuning).
        loss: as for ``model.compile`` (a ``keras.losses.Loss``, a name or
            ``callable(y_true, y_pred)``); ``None``: the model's own losses. ``model.losses``
            (``add_loss`` terms, regularisers) are added as in ``model.fit``, each weighed by
            its form (the Keras workflows page).
        accum_steps: K: each batch given is a micro-batch, K of them per update.
        micro_batch_size: b: each batch given is B, split inside the step into micro-batches
            of at most b samples, one update per batch (not with ``accum_steps``). ``"auto"``:
            the largest b that fits, searched at the first batch (see
            :func:`~accumcore.accumulate`); a later step that runs out of memory raises.
        end_of_epoch: ``"apply"`` (default: flush a partial window with its true weight),
            ``"carry"`` (keep it for the next epoch) or ``"drop"`` (discard it, logged and counted).
        nonfinite: ``"raise"`` (default; a window with a NaN or Inf is discarded whole and
            raises), ``"skip_window"`` (discarded, training goes on), ``"skip_micro_batch"``
            (only the bad micro-batches left out) or a :class:`~accumcore.NonFinitePolicy`.
        normalizer: as for :class:`~accumcore.AccumModel` (``"auto"`` reads each
            micro-batch's divisor as it runs; a ``"sum"`` loss is not divided).
        jit_compile: compile the ``tf.function`` steps with XLA.
        effective_batch_size: deprecated (warns); what it meant and what replaces it: the
            book's Reference page "Choosing b and K".

    Attributes:
        model: the model given.
        state: its :class:`~accumcore.AccumulationState` (pending window, counters), to
            checkpoint: ``tf.train.Checkpoint(model=..., optimizer=..., state=trainer.state)``.

    Freeze or unfreeze layers between calls (``flush()`` first; after unfreezing, assign a new
    optimizer: ``trainer.optimizer = keras.optimizers.Adam(1e-5)``); the next step retraces.

    Example:
        ``train_ds``: a ``tf.data.Dataset`` of unbatched ``(x, y)`` pairs; ``x``, ``y``:
        NumPy arrays of inputs and integer labels.

        >>> trainer = AccumTrainer(model, keras.optimizers.Adam(1e-3),
        ...                        "sparse_categorical_crossentropy", accum_steps=4)
        >>> history = trainer.fit(train_ds.batch(16), epochs=2, mode="function")
        >>> trainer = AccumTrainer(model, "adam", "sparse_categorical_crossentropy",
        ...                        micro_batch_size=16)
        >>> history = trainer.fit(x, y, batch_size=64)  # one update per 64, 4 x 16
    """

    def __init__(
        self,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer | str,
        loss: Any,
        accum_steps: int | None = None,
        *,
        effective_batch_size: int | None = None,
        micro_batch_size: int | str | None = None,
        end_of_epoch: str = "apply",
        nonfinite: str | NonFinitePolicy = "raise",
        normalizer: str | Callable = "auto",
        jit_compile: bool = False,
    ) -> None:
        if not isinstance(model, keras.Model):
            raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
        optimizer = get_optimizer(optimizer)
        given, self._legacy_batch_size = _ways(accum_steps, micro_batch_size,
                                               effective_batch_size)
        self.model = model
        self.loss = None if loss is None else as_loss_fn(loss)
        # reports what it divides by; None: the model's own losses are the loss
        self._counted_loss = None if self.loss is None else CountedLoss(self.loss)
        self.state = AccumulationState(1, nonfinite=nonfinite)
        self.state.settings = settings.resolve(self.state.settings, end_of_epoch=end_of_epoch,
                                               normalizer=normalizer, **given)
        self.state.flush_call = "`trainer.flush()`"
        # What the window rule weighs by: the normaliser matching the loss's reduction.
        self._weighting = resolve_normalizer(normalizer, loss)
        self.jit_compile = bool(jit_compile)
        self._warned_unsplit = False
        self._reset_functions()
        self.optimizer = optimizer
        self.epoch = 0

    def _reset_functions(self) -> None:
        """Forget the compiled steps (they captured the optimizer and the trainable set) and make
        them anew, untraced; ``_micro_fn`` is made on the first micro-batch, for its shape."""
        self._micro_fn = None
        self._epoch_fn = tf.function(
            functools.partial(epoch_loop.epoch_in_graph, self._run_step), jit_compile=False)
        # The cut's size is a Python int (an argument: one trace per size), so every
        # micro-batch but the rest has a static size and XLA stays on for ragged batches.
        self._window_fn = tf.function(self._window, reduce_retracing=True,
                                      jit_compile=self.jit_compile)

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
        """K, micro-batches per optimizer update (held by ``state``)."""
        return self.state.accum_steps

    @property
    def micro_batch_size(self) -> int | str | None:
        """The samples b of the micro-batches each batch given is split into (one update per
        batch; for ``"auto"`` the size found at the first batch, ``"auto"`` until then);
        ``None``: each batch is a micro-batch, ``accum_steps`` per update."""
        return self.state.micro_batch_size

    @property
    def end_of_epoch(self) -> str:
        """What a partial window does at the end of an epoch (held by ``state``)."""
        return self.state.settings.end_of_epoch

    @property
    def normalizer(self) -> str | Callable:
        """How each micro-batch is weighed, as given (held by ``state``)."""
        return self.state.settings.normalizer

    # ------------------------------------------------------------------ building
    def build(self, x: Any) -> None:
        """Build model (by calling it on ``x``), optimizer and accumulators, eagerly.

        Under a ``tf.distribute`` strategy (model created in ``strategy.scope()``), ``x`` may
        be a distributed micro-batch; optimizer and accumulators are built in the scope.
        """
        self._strategy = strategy = distribute.model_strategy(self.model)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            self._build_model_and_optimizer(distribute.first_local(strategy, x))
            # First build, or accumulators for a new trainable set: compiled steps are retraced.
            if self.state.prepare(self.model, self._weighting, distributed=strategy is not None):
                self._reset_functions()

    def _build_model_and_optimizer(self, x: Any) -> None:
        """Build the model (called on the micro-batch ``x`` if unbuilt) and the optimizer,
        checking a trainable set that differs from the one the state was built for."""
        model = self.model
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
        if self.state.built and not self.state.same_variables(variables):
            self._check_new_trainable_set(variables)
        if not self.optimizer.built:
            self.optimizer.build(variables)
        if self._optimizer_variables is None:
            self._optimizer_variables = {id(v) for v in variables}

    def _check_new_trainable_set(self, variables: list) -> None:
        """Before following a new trainable set: the window is empty, and the optimizer can
        update every variable (a built Keras optimizer cannot take new ones)."""
        if self.state.pending_micro_batches():
            self.state.build(variables)  # raises: a pending window (names `trainer.flush()`)
        known = self._optimizer_variables
        unknown = [v for v in variables if known is not None and id(v) not in known]
        if unknown and self.optimizer.built:
            names = ", ".join(variable_name(v) for v in unknown[:4])
            raise ValueError(
                f"The trainable variables changed: {len(unknown)} became trainable ({names}"
                f"{', ...' if len(unknown) > 4 else ''}), but `optimizer` was built for the "
                "old set and a Keras optimizer cannot take new variables. Give the trainer a "
                "new optimizer before training on, as `model.compile` does for fine-tuning: "
                "`trainer.optimizer = keras.optimizers.Adam(1e-5)`."
            )

    # ------------------------------------------------------------------ one micro-batch
    def _run_step(self, x, y=None, sample_weight=None):
        """One batch given: a micro-batch (:meth:`_micro_step`) or, with ``micro_batch_size``,
        a batch split into micro-batches, one window (:meth:`_split_batch`); on every replica
        under a strategy (outputs combined locally). Returns ``(loss, log weight, applied)``."""
        step = self._split_batch if self.state.settings.splits_batches else self._micro_step
        if getattr(self, "_strategy", None) is None:
            return step(x, y, sample_weight)
        return distribute.run_micro_step(self._strategy, step, x, y, sample_weight)

    def _loss_of(self, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> tf.Tensor:
        """The micro-batch's loss (scalar, loss units): the counted loss (which records what
        it divides by; none for ``loss=None``) plus ``model.losses``, each entry summed as
        Keras sums them; the ``loss_of`` of ``summed_loss_gradients``."""
        losses = self.model.losses
        if self._counted_loss is None:
            if not losses:
                raise ValueError(
                    "AccumTrainer was given `loss=None` but the model adds no losses of its "
                    "own (`model.losses` is empty): pass `loss`, or `add_loss` in the model.")
            return tf.add_n([tf.reduce_sum(tf.cast(v, tf.float32)) for v in losses]
                            ) / replica_loss_factor()
        if y is None:
            raise ValueError(
                "`dataset` yields no labels (y), but the loss needs them: make it yield "
                "`(x, y)` or `(x, y, sample_weight)` tuples."
            )
        loss = self._counted_loss(y, y_pred, sample_weight)
        if losses:
            # Keras divides the loss by the replicas in sync; so does this, as
            # summed_loss_gradients multiplies the sum back (replica_loss_factor). Each entry
            # is summed (Keras's `_aggregate_additional_loss`): a per-sample `add_loss` is a
            # vector.
            regularization = tf.add_n([tf.reduce_sum(tf.cast(v, loss.dtype)) for v in losses])
            loss = loss + regularization / replica_loss_factor()
        return loss

    def _micro_step(self, x: Any, y: Any = None, sample_weight: Any = None) -> tuple:
        """One micro-batch on one replica: its gradient into the window, the window applied if
        due. Returns ``(loss, log weight, applied)``, float32, float32 and bool scalars (the
        log weight is ``c_i`` for a mean loss: what the logged mean weighs it by)."""
        out = summed_loss_gradients(self.model, self._loss_of, x, y, sample_weight,
                                    normalizer=self._weighting, optimizer=self.optimizer,
                                    state=self.state)
        applied = self.state.step(out.grads, out.weight, out.samples, self.optimizer,
                                  self.model.trainable_variables, out.undivided)
        return out.loss, out.log_weight, applied

    def _split_batch(self, x: Any, y: Any = None, sample_weight: Any = None,
                     size: int | None = None) -> tuple:
        """One batch as one window (``AccumulationState.one_window``): cut into micro-batches
        of ``size`` samples (default: ``micro_batch_size``; a Python int), the last the rest, each
        accumulated as :meth:`_micro_step` does, then applied once. Returns ``(mean loss,
        log weight, applied)``, float32, float32 and bool scalars."""
        size = size or self.micro_batch_size
        micro_batches = (tf.shape(first_leaf(x))[0] + size - 1) // size

        def contribute(xi, yi, wi):
            return summed_loss_gradients(
                self.model, self._loss_of, xi, yi, wi, normalizer=self._weighting,
                optimizer=self.optimizer, state=self.state, micro_batches=micro_batches)

        return self.state.one_window(self.optimizer, self.model.trainable_variables,
                                     (x, y, sample_weight), size, contribute)

    def train_micro_batch(self, x, y=None, sample_weight=None, *, compiled: bool = False):
        """Run one micro-batch; apply an update if it completes a window. With
        ``micro_batch_size`` the batch given is the recipe's batch, split: one update.

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
        self._find_micro_batch(x, y, sample_weight)
        if not compiled:
            return self._run_step(x, y, sample_weight)
        if self._micro_fn is None:
            # Traced with the batch dimension unknown: a ragged last micro-batch reuses it.
            self._micro_fn = tf.function(self._run_step, reduce_retracing=True,
                                         jit_compile=self.jit_compile)
            specs = _batch_relaxed_specs((x, y, sample_weight))
            if specs is not None:
                self._micro_fn.get_concrete_function(*specs)
        return self._micro_fn(x, y, sample_weight)

    def _find_micro_batch(self, x: Any, y: Any, sample_weight: Any, *,
                          replicas: int = 1) -> None:
        """``micro_batch_size="auto"``, at the first batch: the largest b that fits one
        micro-batch's forward and backward pass on this device
        (``search.search_micro_batch``), the smallest over every replica and worker under a
        strategy; kept for the run (``replicas``: the replicas ``x`` is shared by, when it is
        not distributed)."""
        if self.state.micro_batch_size != AUTO:
            return
        strategy = self._strategy
        local = distribute.first_local(strategy, (x, y, sample_weight))
        samples = -(-int(first_leaf(local[0]).shape[0]) // replicas)  # one replica's share

        def grads_of(xi, yi, wi):
            return probe_total(summed_loss_gradients(
                self.model, self._loss_of, xi, yi, wi, normalizer=self._weighting,
                optimizer=self.optimizer).grads)

        step = tf.function(grads_of, jit_compile=self.jit_compile)
        restored = [v for v in self.model.variables if not v.trainable]  # BN, seeds

        def probe(size: int) -> float:  # reading the sum makes the pass run
            before = [tf.identity(v) for v in restored]
            try:
                piece = take(local, 0, size)
                out = step(*piece) if strategy is None else strategy.run(step, args=piece)
                return sum(float(v) for v in distribute.local_values(strategy, out)) \
                    if strategy is not None else float(out)
            finally:  # the probe changes nothing
                for variable, value in zip(restored, before, strict=True):
                    variable.assign(value)
                self.state.discard_window_layers()  # window-level moments it pooled

        probes: list[tuple[int, bool]] = []
        size = search_micro_batch(probe, samples, probes)
        logger.warning("micro_batch_size='auto': b = %d samples per micro-batch, found at the "
                       "first batch of %d (probes, b and whether it fitted: %s).",
                       size, samples, probes)
        self.state.micro_batch_size = distribute.smallest_everywhere(strategy, size)

    # ------------------------------------------------------------------ one window, in graph
    def window_step(self, x, y=None, sample_weight=None):
        """One optimizer update from one large batch, split in the graph.

        The batch of ``n`` samples is cut as at every entry point, into micro-batches of
        b = ``micro_batch_size`` (b, b, ..., the rest) or, with ``accum_steps`` K, of
        ``ceil(n / K)`` (at most K: 50 at K = 4 is 13 + 13 + 13 + 11), accumulated in one
        ``tf.function`` without holding the whole batch's activations, and applied once.
        Every slice but the rest has a static size, so ``jit_compile=True`` stays on for
        ragged batches. Starts on an empty window and closes it.

        An error partway (out of memory at a later micro-batch) drops what the window added
        (counted in ``samples_dropped``) and is raised: weights and optimizer are unchanged,
        so the same batch can be given again, applied once. What the forward passes changed
        (BatchNorm statistics, dropout seeds) stays changed, as after a failed Keras step.

        Returns:
            The mean loss over the batch (float32 scalar tensor).
        """
        self.build(x)
        self._check_window_step()
        self._find_micro_batch(x, y, sample_weight)
        n = int(first_leaf(x).shape[0])
        size = self.micro_batch_size or -(-n // self.accum_steps)  # ceil(n / K)
        if self._warns_unsplit() and n <= size and not self._warned_unsplit:
            self._warned_unsplit = settings.warn_if_nothing_split(
                size, 1, 1, "`AccumTrainer(..., accum_steps=K)`")
        try:
            loss = self._window_fn(x, y, sample_weight, size)
        except BaseException:  # an interrupt too: an eager body can stop partway
            if self.state.built:  # the window began empty: what it holds is this batch's
                self.state.drop_window()  # unapplied, so the batch can be given again
            raise
        self.state.raise_if_nonfinite(self.epoch)
        return loss

    def _window(self, x: Any, y: Any, sample_weight: Any, size: int) -> tf.Tensor:
        """The body of :meth:`window_step`, traced: :meth:`_split_batch` with micro-batches
        of ``size`` samples. Returns the batch's mean loss (float32 scalar)."""
        return self._split_batch(x, y, sample_weight, size)[0]

    def _check_window_step(self) -> None:
        """Refuse a ``window_step`` under a ``tf.distribute`` strategy or on a pending window (it
        must start on an empty window, as it closes the window it opens)."""
        if self._strategy is not None:
            raise NotImplementedError(
                "`window_step` splits one batch on one device; under a tf.distribute strategy "
                "use `trainer.fit(dataset_of_micro_batches)` (or `train_micro_batch`), which "
                "splits every micro-batch across the replicas."
            )
        if int(self.state.micro_step.numpy()) != 0:
            raise ValueError(
                "`window_step` needs an empty window, but a partial window is pending from "
                "micro-batch training: call `trainer.flush()` first."
            )


    # ------------------------------------------------------------------ end of epoch
    def flush(self) -> bool:
        """Apply the pending partial window now, with its true weight. Returns whether it did."""
        # To the variables the window was accumulated for (also after a `trainable` change).
        return self.state.flush(self.optimizer, self.model.trainable_variables)

    def end_epoch(self) -> str | None:
        """Apply the end-of-epoch policy to a partial window; returns what was done
        (``AccumulationState.end_epoch``)."""
        return self.state.end_epoch(self.end_of_epoch, self.optimizer,
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
        """Train for ``epochs`` epochs, like ``model.fit``: K micro-batches per update with
        ``accum_steps``, one update per batch with ``micro_batch_size`` (one record each).

        Args:
            x: a ``tf.data.Dataset`` yielding batches ``x``, ``(x, y)`` or ``(x, y,
                sample_weight)``, or arrays / tensors (a list or dict for several inputs).
            y: the targets (arrays), only with array ``x``.
            sample_weight: one weight per sample, as ``model.fit``'s, only with array ``y``.
            batch_size: arrays only (with a dataset it raises: batch the dataset): samples
                per batch, default 32 as in Keras; B with ``micro_batch_size``, b with
                ``accum_steps`` or the deprecated ``effective_batch_size``.
            epochs: number of epochs.
            shuffle: arrays only: ``True`` (default), a new order each epoch from
                TensorFlow's global seed (the same orders in every run after
                ``keras.utils.set_random_seed``); ``False`` keeps the order.
            steps_per_epoch: batches per epoch, as in ``model.fit`` (required for an infinite
                dataset): one iterator runs across the epochs; if the data runs out, a warning
                says so and the next epoch starts a new pass.
            mode: the same update in all three: ``"eager"``, a Python loop of eager ops;
                ``"function"`` (default), that loop calling a traced ``tf.function`` step;
                ``"graph"``, the whole epoch in one ``tf.function``.
            verbose: 1: a ``keras.utils.Progbar`` per epoch, 2: a line per epoch, 0: silent.
            on_epoch_end: optional ``f(epoch, history)`` called after each epoch.

        A :class:`NonFiniteGradientError` of a previous call is cleared at the start (logged).
        Returns a :class:`LoopHistory`."""
        check_choice(mode, "mode", MODES)
        dataset = datasets.as_dataset(x, y, sample_weight, batch_size, shuffle,
                                      fixed_batch_size=self._legacy_batch_size)
        cardinality, steps_per_epoch = datasets.check_epochs(self.model, dataset, steps_per_epoch)
        if self.state.built:
            self.state.clear_nonfinite()  # logged, if a previous call raised
        book = HistoryBook()
        source = datasets.EpochSource(self.model, dataset, cardinality, steps_per_epoch)
        for epoch in range(epochs):
            before = _split_counts(self.state)
            fit_epoch(self, dataset, source, book, self._graph_epoch, mode=mode, verbose=verbose)
            if epoch == 0:
                self._warn_if_nothing_split(before)
            book.history.counters = self.state.counters()
            if on_epoch_end is not None:
                on_epoch_end(self.epoch, book.history)
            self.epoch += 1
        return book.history

    def _warn_if_nothing_split(self, before: tuple[int, int]) -> None:
        """After ``fit``'s first epoch: warn if ``micro_batch_size`` is given but no batch
        was split (``before``: the counts at its start; ``settings.warn_if_nothing_split``)."""
        if not self._warns_unsplit():
            return
        after = _split_counts(self.state)
        settings.warn_if_nothing_split(self.micro_batch_size, after[0] - before[0],
                                       after[1] - before[1], "`AccumTrainer(..., accum_steps=K)`")

    def _warns_unsplit(self) -> bool:
        """Whether a batch of at most b is warned about: with an int ``micro_batch_size``
        (``"auto"`` that found b = B logs so itself)."""
        given = self.state.settings.micro_batch_size
        return given is not None and given != AUTO

    def _graph_epoch(self, dataset: tf.data.Dataset, source: datasets.EpochSource) -> list[tuple]:
        """One epoch as one compiled function (``mode="graph"``): its per-micro-batch records."""
        for batch in dataset.take(1):  # build eagerly before tracing
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            self.build(x)
            self._find_micro_batch(x, y, sample_weight,
                                   replicas=distribute.replicas_in_sync(self._strategy))
        return epoch_loop.graph_records(self, self._epoch_fn, source)

    def compiled_function(self, entry: str) -> Any:
        """The ``tf.function`` an entry point runs, to inspect (as Keras's
        ``model.train_function``): its graph and ops (``.get_concrete_function(...)``), its
        traces (``.experimental_get_tracing_count()``), its XLA IR. Calling it trains as the
        entry point does, without the entry point's checks (build, non-finite stop).

        Args:
            entry: ``"micro_batch"``: the micro-step of ``fit(mode="function")`` and
                ``train_micro_batch(compiled=True)``, called as ``f(x, y, sample_weight)``
                for one micro-batch, returning ``(mean_loss, weight, applied)``;
                ``"epoch"``: the whole epoch of ``fit(mode="graph")``, ``f(dataset)``;
                ``"window"``: that of :meth:`window_step`, ``f(x, y, sample_weight, size)`` for
                one batch split into micro-batches of ``size`` samples (a Python int),
                returning its mean loss.

        Raises:
            ValueError: for another ``entry``, or for ``"micro_batch"`` before the first
                compiled micro-batch (it is made for that micro-batch's structure).

        The functions are made anew when the optimizer is replaced (they capture it).
        """
        functions = {"micro_batch": self._micro_fn, "epoch": self._epoch_fn,
                     "window": self._window_fn}
        check_choice(entry, "entry", tuple(functions))
        if functions[entry] is None:
            raise ValueError(
                "The micro-batch function is made on the first compiled micro-batch: run "
                "`trainer.fit(..., mode='function')` or `trainer.train_micro_batch(x, y, "
                "compiled=True)` first.")
        return functions[entry]


def _split_counts(state: AccumulationState) -> tuple[int, int]:
    """``(micro-batches seen, windows closed)`` (a host read; zeros for an unbuilt state)."""
    if not state.built:
        return 0, 0
    counts = state.counters()
    return counts["micro_batches_seen"], counts["windows_applied"] + counts["windows_skipped"]


def _ways(accum_steps: Any, micro_batch_size: Any,
          effective_batch_size: Any) -> tuple[dict, int | None]:
    """The trainer's way of making up an update, checked as at every entry point
    (``settings.resolve`` checks the values and refuses both): ``(settings given, the old
    form's batch size b for arrays or None)``. The old form ``effective_batch_size=B,
    micro_batch_size=b`` (K = B / b, batches of b) warns, naming the new calls."""
    if effective_batch_size is not None:
        if accum_steps is not None:
            raise ValueError(
                f"Pass `accum_steps` or `effective_batch_size`, not both (got accum_steps="
                f"{accum_steps!r}, effective_batch_size={effective_batch_size!r}); better, "
                "pass `AccumTrainer(..., micro_batch_size=b)` and `fit(x, y, batch_size=B)` "
                "(each batch of B split into micro-batches of b), or `accum_steps=K` alone "
                "for data that comes as micro-batches.")
        # checks both values (positive ints, not bools); K = ceil(B / b), exact below
        k = resolve_accum_steps(effective_batch_size=effective_batch_size,
                                micro_batch_size=micro_batch_size, exact=False)
        big, small = int(effective_batch_size), int(micro_batch_size)
        if big < small:
            raise ValueError(
                f"`effective_batch_size`={big} is smaller than `micro_batch_size`={small}: a "
                f"batch of {big} needs no accumulation; pass `AccumTrainer(..., "
                f"accum_steps=1)` and `fit(x, y, batch_size={big})`.")
        settings.check_multiple(big, small, (
            f"pass `AccumTrainer(..., accum_steps={big // small + 1})` alone (no "
            f"`micro_batch_size`, no `effective_batch_size`) and `fit(x, y, batch_size={small})` "
            f"(B = {(big // small + 1) * small}), or `AccumTrainer(..., micro_batch_size={small})` "
            f"alone and `fit(x, y, batch_size={big})`: each batch of {big} is split into "
            f"micro-batches of at most {small}, one update per batch"))
        warnings.warn(
            f"AccumTrainer(effective_batch_size={big}, micro_batch_size={small}) is the old "
            f"form: it trains on batches of {small}, {k} per update, and `fit`'s `batch_size` "
            f"is the micro-batch ({small}). Dropping `effective_batch_size` alone changes "
            f"that: with `micro_batch_size={small}` alone, `batch_size` is the recipe's batch "
            f"B (default 32), split inside the step. Pass "
            f"`AccumTrainer(..., micro_batch_size={small})` and change the call to "
            f"`fit(x, y, batch_size={big})` (or a dataset batched by {big}, `window_step`), "
            f"or pass `AccumTrainer(..., accum_steps={k})` and keep batches of {small}.",
            FutureWarning,
            stacklevel=3,
        )
        return {"accum_steps": k}, small
    settings.require_a_way(accum_steps, micro_batch_size, "AccumTrainer")
    given = dict(accum_steps=accum_steps, micro_batch_size=micro_batch_size)
    return {name: value for name, value in given.items() if value is not None}, None


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
