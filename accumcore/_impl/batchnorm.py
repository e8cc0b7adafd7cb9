"""Window-level BatchNormalization: moving statistics updated once per accumulation window.

Stock ``keras.layers.BatchNormalization`` updates its moving mean and variance on every call in
training mode. Under gradient accumulation that means K updates per optimizer step, each from
one micro-batch of b samples, instead of one update from the large batch of B = K * b samples:
the moving statistics drift from what large-batch training would give (momentum applied K
times, micro-batch variances noisier).

:class:`WindowBatchNormalization` is a drop-in replacement (same arguments, same weights, same
``get_config``) that, while it is attached to an :class:`~accumcore.AccumulationState`,

* normalises each micro-batch with that micro-batch's moments (exactly as stock BN does; the
  *training-mode* normalisation still sees b samples, not B: that gap is inherent to
  micro-batching and is measured in the tests and the pitfalls chapter);
* pools the micro-batch moments of the window exactly (count, mean and sum of squared
  deviations ``M2``, combined with Chan et al.'s parallel update in float32);
* updates ``moving_mean`` / ``moving_variance`` **once** when the window closes (the state's
  ``window_hooks``), with Keras's momentum and its biased (population) variance::

      moving_mean     <- moving_mean * momentum + mean_window * (1 - momentum)
      moving_variance <- moving_variance * momentum + var_window * (1 - momentum)

  where ``var_window = M2 / count``. Because the weights do not change inside a window, the
  window moments of a BN layer whose input does not pass through another batch-normalised layer
  are those of the large batch, so its moving statistics equal stock BN's after one large
  batch, to float round-off. Deeper BN layers see inputs normalised with micro-batch moments
  and inherit that (measured) gap.

When it is not attached (a plain ``keras.Model``, ``predict``/``evaluate``, ``training=False``)
it behaves exactly like stock BatchNormalization. ``AccumModel`` and ``AccumTrainer`` attach
every such layer of their model automatically (:func:`attach_window_layers`).

Under ``tf.distribute`` the window moments are replica-local (``ON_READ`` variables); at window
close they are pooled across replicas (an all-reduce in replica context, or a combination of
the per-replica components in cross-replica context), so every replica applies the same
update computed from all replicas' samples.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from accumcore._impl import compat

__all__ = [
    "WindowBatchNormalization",
    "attach_window_layers",
    "batchnorm_layers",
    "convert_batchnorm",
    "warn_stock_batchnorm",
    "window_layers",
]

# Keys under which the pending window's moments are saved next to the layer's 4 weights.
_STORE_KEYS = ("window_count", "window_mean", "window_m2")


def _chan_combine(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    """Exact pooled (count, mean, M2) of two sample sets (Chan, Golub & LeVeque 1979).

    Numerically safe in float32 (no sum of squares): ``M2 = M2_a + M2_b + d^2 n_a n_b / n``
    with ``d = mean_b - mean_a``. Counts are scalars; means and M2 have shape ``(channels,)``.
    """
    n = n_a + n_b
    frac_b = tf.math.divide_no_nan(n_b, n)
    delta = mean_b - mean_a
    mean = mean_a + delta * frac_b
    m2 = m2_a + m2_b + tf.square(delta) * n_a * frac_b
    return n, mean, m2


@keras.saving.register_keras_serializable(package="accumcore")
class WindowBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose moving statistics advance once per window.

    Takes exactly the arguments of ``keras.layers.BatchNormalization`` (``renorm=True`` is not
    supported: its renorm statistics would need the same treatment; use stock BN for it) and
    has exactly its weights (``gamma``, ``beta``, ``moving_mean``, ``moving_variance``), so
    ``set_weights`` / ``get_weights`` are interchangeable with stock BN.

    Extra state (not in ``weights``; saved by ``model.save`` and tracked by
    ``tf.train.Checkpoint``): the pending window's pooled moments, float32:

    * ``window_count``: scalar, number of values per channel pooled so far (samples times the
      spatial positions, e.g. ``b * H * W`` per micro-batch for NHWC input);
    * ``window_mean``: shape ``(channels,)``, their mean;
    * ``window_m2``: shape ``(channels,)``, their sum of squared deviations from that mean.

    Behaviour:
        * not attached, or ``training`` falsy, or ``trainable=False``: stock BatchNormalization;
        * attached and training: normalises with the micro-batch moments (as stock BN does),
          pools them into the window state and leaves the moving statistics alone until the
          window closes: the layer's window hook, registered with the state by
          :meth:`attach`, then folds the pooled moments into them once.

    A micro-batch whose moments are not finite (NaN/Inf activations) is left out of the window
    moments, so one bad micro-batch cannot poison the moving statistics.

    Args:
        *args: ``keras.layers.BatchNormalization``'s positional arguments (``axis``,
            ``momentum``, ``epsilon``, ...), passed through unchanged.
        **kwargs: its keyword arguments (``center``, ``scale``, the initializers, ``name``,
            ...), passed through unchanged; ``renorm=True`` raises ``ValueError``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if compat.batchnorm_renorm(self):
            raise ValueError(
                "WindowBatchNormalization does not support `renorm=True` (batch "
                "renormalisation keeps its own per-step statistics). Use "
                "keras.layers.BatchNormalization(renorm=True), or pass renorm=False."
            )
        self._attached_states = 0
        self._window_count = None
        self._window_mean = None
        self._window_m2 = None
        self._window_strategy = None
        self._window_axes: list[int] = []

    # ------------------------------------------------------------------ building
    def build(self, input_shape) -> None:
        """Create stock BN's weights, then the window moments (``ON_READ`` under a strategy)."""
        super().build(input_shape)
        rank = len(input_shape)
        axis = self.axis % rank
        self._window_axes = [i for i in range(rank) if i != axis]
        channels = int(input_shape[self.axis])
        distributed = tf.distribute.has_strategy()
        kwargs = (
            dict(
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
            if distributed
            else {}
        )
        self._window_strategy = tf.distribute.get_strategy() if distributed else None
        with tf.init_scope():  # named like their saved keys: window_count, window_mean, ...
            self._window_count, self._window_mean, self._window_m2 = (
                tf.Variable(tf.zeros(shape), trainable=False, name=f"{self.name}_{key}", **kwargs)
                for key, shape in zip(_STORE_KEYS, ((), (channels,), (channels,)), strict=True)
            )

    def _window_variables(self) -> tuple[tf.Variable, tf.Variable, tf.Variable]:
        """This replica's ``(count, mean, M2)`` variables, in the order of ``_STORE_KEYS``."""
        return self._window_count, self._window_mean, self._window_m2

    # ------------------------------------------------------------------ attaching
    @property
    def attached(self) -> bool:
        """Whether an accumulation state drives this layer's moving statistics."""
        return self._attached_states > 0

    def attach(self, state) -> None:
        """Register this layer's window hook (the method that folds the window's pooled moments
        into the moving statistics once per window) with ``state``, which runs it whenever a
        window closes (idempotent).

        Args:
            state: an :class:`~accumcore.AccumulationState`.
        """
        hooks = getattr(state, "window_hooks", None)
        if hooks is None:
            raise TypeError(
                f"`state` must be an accumcore.AccumulationState (with `window_hooks`), got "
                f"{type(state).__name__}."
            )
        if self.close_window not in hooks:
            hooks.append(self.close_window)
            self._attached_states += 1

    def detach(self, state) -> None:
        """Undo :meth:`attach` (the layer behaves like stock BN again once fully detached)."""
        hooks = getattr(state, "window_hooks", [])
        if self.close_window in hooks:
            hooks.remove(self.close_window)
            self._attached_states = max(0, self._attached_states - 1)

    # ------------------------------------------------------------------ moments
    def _micro_batch_moments(self, inputs, mask):
        """The moments stock BN normalises with (global ones if ``synchronized``), and this
        replica's ``(count, mean, variance)`` for the window pool (count: scalar, values per
        channel; the others of shape ``(channels,)``)."""
        if mask is not None:
            mean, variance = self._masked_moments(inputs, mask, keras.config.epsilon())
            count = tf.reduce_sum(tf.cast(mask, tf.float32))
            return mean, variance, (count, *self._masked_moments(inputs, mask, 0.0))
        mean, variance = keras.ops.moments(
            inputs, axes=self._window_axes, synchronized=self.synchronized
        )
        shape = tf.shape(inputs)
        count = tf.cast(tf.reduce_prod(tf.gather(shape, self._window_axes)), tf.float32)
        if self.synchronized:  # `mean`, `variance` are global; the pool needs local ones
            return mean, variance, (count, *tf.nn.moments(inputs, self._window_axes))
        return mean, variance, (count, mean, variance)

    def _masked_moments(self, inputs, mask, eps: float):
        """Mean and biased variance over unmasked positions (Keras's formula; ``eps`` guards
        an all-masked batch), each of shape ``(channels,)``."""
        m = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)), inputs.dtype)
        weight = tf.reduce_sum(m, self._window_axes)
        mean = tf.reduce_sum(inputs * m, self._window_axes) / (weight + eps)
        rank = len(inputs.shape)
        mean_shape = [-1 if i == self.axis % rank else 1 for i in range(rank)]
        diff = (inputs - tf.reshape(mean, mean_shape)) * m
        var = tf.reduce_sum(tf.square(diff), self._window_axes) / (weight + eps)
        return mean, var

    def _accumulate(self, count, mean, variance) -> None:
        """Pool one micro-batch's moments into the window (skipped if they are not finite)."""
        mean = tf.stop_gradient(tf.cast(mean, tf.float32))
        variance = tf.stop_gradient(tf.cast(variance, tf.float32))
        old = [v.read_value() for v in self._window_variables()]
        new = _chan_combine(*old, count, mean, variance * count)
        finite = tf.logical_and(
            tf.reduce_all(tf.math.is_finite(mean)), tf.reduce_all(tf.math.is_finite(variance))
        )
        for variable, new_value, old_value in zip(self._window_variables(), new, old, strict=True):
            variable.assign(tf.where(finite, new_value, old_value))

    # ------------------------------------------------------------------ call
    def call(self, inputs, training=None, mask=None):
        """Normalise ``inputs`` (any rank; channels on ``axis``) exactly as stock BN does.

        When attached and training, also pool this micro-batch's moments into the window
        instead of updating the moving statistics. Returns a tensor shaped like ``inputs``.
        """
        if not (training and self.trainable and self.attached):
            return super().call(inputs, training=training, mask=mask)
        if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
            raise ValueError(
                "The mask provided should be one dimension less than the inputs. Received: "
                f"mask.shape={mask.shape}, inputs.shape={inputs.shape}"
            )
        # As stock BN: statistics in (at least) float32, output in the compute dtype.
        compute_dtype = keras.backend.result_type(inputs.dtype, "float32")
        inputs = keras.ops.cast(inputs, compute_dtype)
        mean, variance, local = self._micro_batch_moments(inputs, mask)
        self._accumulate(*local)
        gamma = keras.ops.cast(self.gamma, inputs.dtype) if self.scale else None
        beta = keras.ops.cast(self.beta, inputs.dtype) if self.center else None
        outputs = keras.ops.batch_normalization(
            x=inputs, mean=mean, variance=variance, axis=self.axis, offset=beta, scale=gamma,
            epsilon=self.epsilon,
        )
        return keras.ops.cast(outputs, self.compute_dtype)

    # ------------------------------------------------------------------ window close
    def _components(self) -> list[tuple[tf.Variable, tf.Variable, tf.Variable]]:
        """Per-replica (count, mean, M2) variables (one triple without a strategy)."""
        if self._window_strategy is None:
            return [self._window_variables()]
        parts = [self._window_strategy.experimental_local_results(v)
                 for v in self._window_variables()]
        return list(zip(*parts, strict=True))

    def _in_replica_context(self) -> bool:
        """True without a strategy, or inside ``strategy.run`` (variables read locally)."""
        if self._window_strategy is None:
            return True
        return tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()

    @tf.autograph.experimental.do_not_convert  # plain TF ops: no AutoGraph needed
    def window_moments(self) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """The pending window's pooled ``(count, mean, M2)`` over all replicas.

        Two passes, exact and without a sum of squares: the count and the count-weighted mean
        are summed over replicas, then each replica's M2 about that global mean. In a replica
        context (inside ``strategy.run``, or no strategy) the sums are all-reduces; in a
        cross-replica context (where accumcore closes windows under a strategy) they are
        ``strategy.run`` + ``strategy.reduce``, so they span every worker's replicas.
        Shapes: ``()``, ``(C,)``, ``(C,)``.
        """
        if not self.built:
            raise ValueError(
                f"Layer {self.name!r} is not built yet: call the model on data (or build it "
                "with an input shape) before reading its window moments."
            )
        sum_op = tf.distribute.ReduceOp.SUM

        def local() -> tuple[tf.Tensor, tf.Tensor]:
            n = self._window_count.read_value()
            return n, n * self._window_mean.read_value()

        def spread(pooled: tf.Tensor) -> tuple[tf.Tensor]:
            n = self._window_count.read_value()
            deviation = self._window_mean.read_value() - pooled
            return (self._window_m2.read_value() + n * tf.square(deviation),)

        if self._in_replica_context():
            ctx = tf.distribute.get_replica_context()
            if ctx.num_replicas_in_sync == 1:
                return tuple(v.read_value() for v in self._window_variables())

            def summed(fn, *args) -> list[tf.Tensor]:
                return ctx.all_reduce(sum_op, list(fn(*args)))
        else:
            strategy = self._window_strategy

            def summed(fn, *args) -> list[tf.Tensor]:
                return [strategy.reduce(sum_op, v, axis=None) for v in strategy.run(fn, args)]

        total, weighted = summed(local)
        pooled = tf.math.divide_no_nan(weighted, total)
        (m2,) = summed(spread, pooled)
        return total, pooled, m2

    @tf.autograph.experimental.do_not_convert  # plain TF ops: no AutoGraph needed
    def close_window(self, applied: bool = True) -> None:
        """Window hook: fold the pooled window moments into the moving statistics, once.

        Args:
            applied: Python bool. ``True`` (an optimizer update was applied): update
                ``moving_mean`` / ``moving_variance`` with Keras's momentum rule from the
                window's mean and biased variance, if the window holds any values. ``False``
                (the window was skipped or dropped): discard the window's moments, as the
                update they belong to never happened.

        Graph-safe (runs inside the state's ``tf.cond`` branch); also callable eagerly.
        """
        if not self.built:
            return
        if applied:
            n, mean, m2 = self.window_moments()
            variance = tf.math.divide_no_nan(m2, n)  # biased, as Keras's
            for moving, value in ((self.moving_mean, mean), (self.moving_variance, variance)):
                old = tf.cast(moving, tf.float32)
                # The same expression as keras.layers.BatchNormalization.call.
                new = old * self.momentum + value * (1.0 - self.momentum)
                moving.assign(tf.cast(tf.where(n > 0, new, old), moving.dtype))
        self.reset_window()

    @tf.autograph.experimental.do_not_convert  # plain TF ops: no AutoGraph needed
    def reset_window(self) -> None:
        """Empty the pending window's moments (on every replica)."""
        if not self.built:
            return
        # In a replica context each replica empties its own part; otherwise every replica's.
        in_replica = self._in_replica_context()
        for variables in [self._window_variables()] if in_replica else self._components():
            for variable in variables:
                variable.assign(tf.zeros_like(variable))

    # ------------------------------------------------------------------ saving
    def save_own_variables(self, store) -> None:
        """Save the 4 weights, plus the pending window's moments pooled over replicas."""
        super().save_own_variables(store)
        if not self.built:
            return
        n, mean, m2 = self.window_moments()  # pooled over replicas: exact mid-window saves
        for key, value in zip(_STORE_KEYS, (n, mean, m2), strict=True):
            store[key] = value.numpy()

    def load_own_variables(self, store) -> None:
        """Load the weights and, if saved, the pending window's moments (onto replica 0)."""
        keys = [str(k) for k in store.keys()]
        super().load_own_variables({k: store[k] for k in keys if k not in _STORE_KEYS})
        if not all(k in keys for k in _STORE_KEYS):
            return  # saved from stock BatchNormalization, or before any window state
        self.reset_window()
        for variable, key in zip(self._components()[0], _STORE_KEYS, strict=True):
            variable.assign(store[key])


# ---------------------------------------------------------------------- model helpers
def _walk(layer: Any, seen: set[int]) -> Iterator[Any]:
    if id(layer) in seen:
        return
    seen.add(id(layer))
    yield layer
    for child in getattr(layer, "layers", None) or []:
        yield from _walk(child, seen)
    inner = getattr(layer, "layer", None)  # wrappers: TimeDistributed, Bidirectional, ...
    if isinstance(inner, keras.layers.Layer):
        yield from _walk(inner, seen)


def batchnorm_layers(model: keras.layers.Layer) -> list[keras.layers.BatchNormalization]:
    """Every BatchNormalization layer of ``model`` (stock or window-level), in order.

    Walks the public ``layers`` attribute recursively (nested models included, and ``layer`` of
    wrappers such as ``TimeDistributed``), depth first, each layer once.
    """
    return [
        layer for layer in _walk(model, set())
        if isinstance(layer, keras.layers.BatchNormalization)
    ]


def window_layers(model: keras.layers.Layer) -> list[WindowBatchNormalization]:
    """Every :class:`WindowBatchNormalization` in ``model``, in :func:`batchnorm_layers`'s order."""
    return [
        layer for layer in batchnorm_layers(model) if isinstance(layer, WindowBatchNormalization)
    ]


# Models already warned about their stock BatchNormalization layers (one warning per model).
_WARNED_STOCK_BN: weakref.WeakSet = weakref.WeakSet()


def warn_stock_batchnorm(model: keras.layers.Layer, accum_steps: int = 1, *,
                         micro_batch_size: int | str | None = None) -> bool:
    """Warn (``UserWarning``, once per model) if ``model`` has stock BatchNormalization layers
    and its updates are made of several micro-batches: ``accum_steps`` K > 1, or
    ``micro_batch_size`` b given (each batch of B split into ``ceil(B / b)`` micro-batches).

    Under accumulation a stock layer updates its moving mean and variance once per
    micro-batch, so several times per optimizer update, each from one micro-batch: they differ
    from what large-batch training gives (the tests measure a gap of the order of the update
    itself). Converting automatically would change the user's model (its class, its saved
    file) behind their back, so accumcore warns and names the fix,
    :func:`~accumcore.convert_batchnorm`. Frozen layers (``trainable=False``) are not counted:
    they run in inference mode and never update their moving statistics.

    Returns:
        Whether it warned (False for one micro-batch per update, no stock layer, or a model
        already warned about).
    """
    if micro_batch_size is None and accum_steps <= 1:
        return False
    try:
        if model in _WARNED_STOCK_BN:
            return False
    except TypeError:  # not weak-referenceable / hashable: warn every time rather than never
        pass
    layers = [
        layer for layer in batchnorm_layers(model)
        if not isinstance(layer, WindowBatchNormalization) and layer.trainable
    ]
    if not layers:
        return False
    names = ", ".join(repr(layer.name) for layer in layers)
    how = (f"accum_steps={accum_steps}) each updates its moving mean and variance "
           f"{accum_steps} times per optimizer update" if micro_batch_size is None else
           f"micro_batch_size={micro_batch_size!r}: each batch of B split into micro-batches) "
           "each updates its moving mean and variance once per micro-batch, ceil(B / b) times "
           "per optimizer update")
    warnings.warn(
        f"Model {model.name!r} has {len(layers)} stock keras.layers.BatchNormalization "
        f"layer(s) ({names}): under gradient accumulation ({how}, from micro-batches, so "
        "they differ from large-batch training. Convert the model with "
        "`model = accumcore.convert_batchnorm(model)` (weights and accumulation settings "
        "kept), or build it with accumcore.WindowBatchNormalization, to update them once "
        "per window.",
        UserWarning,
        stacklevel=4,
    )
    try:
        _WARNED_STOCK_BN.add(model)
    except TypeError:
        pass
    return True


def attach_window_layers(model: keras.layers.Layer, state) -> int:
    """Attach every :class:`WindowBatchNormalization` of ``model`` to ``state`` (idempotent).

    ``AccumulationState.prepare`` calls this (for ``AccumModel`` and
    ``AccumTrainer``); call it yourself only for a hand-written loop around
    :class:`~accumcore.AccumulationState`. It also warns,
    once per model, about stock ``BatchNormalization`` layers when an update is made of
    several micro-batches: ``accum_steps > 1`` or ``micro_batch_size`` set
    (:func:`warn_stock_batchnorm`).

    Returns:
        The number of window-level BN layers found.
    """
    given = getattr(state, "settings", None)
    warn_stock_batchnorm(model, int(getattr(given, "accum_steps", 1) or 1),
                         micro_batch_size=getattr(given, "micro_batch_size", None))
    layers = window_layers(model)
    for layer in layers:
        layer.attach(state)
    return len(layers)


def convert_batchnorm(model: keras.Model) -> keras.Model:
    """A clone of ``model`` with every ``keras.layers.BatchNormalization`` made window-level.

    Every layer whose type is exactly ``keras.layers.BatchNormalization`` becomes a
    :class:`WindowBatchNormalization` with the same config (nested Functional / Sequential
    models included); all weights are copied, so inference outputs are unchanged. An
    ``AccumModel`` stays an ``AccumModel`` and a model given to ``accumcore.accumulate`` is
    given to it again, with the same accumulation settings, all of them (the pending window of
    the original, if any, is not copied); a compiled model is re-compiled from its
    compile config (fresh optimizer state).

    Args:
        model: a built Functional or Sequential ``keras.Model`` (subclassed models cannot be
            cloned: use ``WindowBatchNormalization`` in their code instead).

    Returns:
        The new model; ``model`` itself is not modified.

    Raises:
        ValueError: for a subclassed model, or a BatchNormalization with ``renorm=True``.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")

    def clone(layer: keras.layers.Layer) -> keras.layers.Layer:
        if type(layer) is keras.layers.BatchNormalization:
            config = layer.get_config()
            if config.get("renorm"):
                raise ValueError(
                    f"BatchNormalization layer {layer.name!r} uses renorm=True, which "
                    "WindowBatchNormalization does not support; set renorm=False or keep "
                    "stock BN for that model."
                )
            return WindowBatchNormalization.from_config(config)
        return layer.__class__.from_config(layer.get_config())

    try:
        new = keras.models.clone_model(model, clone_function=clone, recursive=True)
    except ValueError as err:
        raise ValueError(
            f"convert_batchnorm could not clone {type(model).__name__} {model.name!r}: {err} "
            "It works on Functional and Sequential models; in a subclassed model, use "
            "accumcore.WindowBatchNormalization in place of keras.layers.BatchNormalization."
        ) from err
    new.set_weights(model.get_weights())
    copy_accumulation(model, new)
    return new


def copy_accumulation(model: keras.Model, new: keras.Model) -> None:
    """Give ``new`` (a rebuilt ``model``: a clone) ``model``'s accumulation settings, whole
    (every field of ``accumcore._impl.settings.Settings``): an ``AccumModel`` keeps them, a
    model given to ``accumcore.accumulate`` is given to it again. No-op for a model that
    does not accumulate."""
    from accumcore._impl import fitting  # fitting -> state -> batchnorm: imported late

    if not fitting.is_accumulating(model):
        return
    if not fitting.is_accumulating(new):
        fitting.accumulate(new, accum_steps=1)  # its settings replaced whole below
    new.accumulation.settings = model.accumulation.settings
    new.train_function = None
