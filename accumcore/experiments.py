"""Helpers shared by the tests, the book's notebooks and the benchmarks.

Model builders with fixed seeds (so two runs start from identical weights), the large-batch
reference update, and the relative error used everywhere in this project::

    rel = max |w - w_ref| / max |w_ref - w_init|

i.e. the largest weight difference measured in units of the largest reference update.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np


def get_weights(model: keras.Model) -> list[np.ndarray]:
    """All model weights (trainable and not) as numpy copies."""
    return [np.array(w) for w in model.get_weights()]


def relative_error(
    weights: Sequence[np.ndarray],
    reference: Sequence[np.ndarray],
    initial: Sequence[np.ndarray],
) -> float:
    """``max|w - w_ref| / max|w_ref - w_init|`` over all tensors (dimensionless).

    0 means identical to the reference; 1 means an error as large as the whole reference
    update. Float32 round-off for one exact accumulated update is about 1e-6..1e-5.
    """
    num = max(float(np.max(np.abs(np.asarray(w, np.float64) - r))) for w, r in
              zip(weights, reference))
    den = max(float(np.max(np.abs(np.asarray(r, np.float64) - i))) for r, i in
              zip(reference, initial))
    if den == 0.0:
        raise ValueError("The reference did not move from the initial weights: no update.")
    return num / den


def mlp(
    input_dim: int = 784,
    hidden: Sequence[int] = (256, 256),
    classes: int = 10,
    *,
    seed: int = 0,
    model_cls: Callable[..., keras.Model] = keras.Model,
    dtype: str | None = None,
    **model_kwargs: Any,
) -> keras.Model:
    """The MNIST MLP (784-256-256-10 by default), softmax output, identical weights per seed.

    ``model_cls`` may be :class:`accumcore.AccumModel` (``model_kwargs`` go to it).
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((input_dim,), dtype=dtype)
    h = inputs
    for width in hidden:
        h = keras.layers.Dense(width, activation="relu", dtype=dtype)(h)
    outputs = keras.layers.Dense(classes, activation="softmax", dtype=dtype)(h)
    return model_cls(inputs, outputs, **model_kwargs)


def conv_net(
    input_shape: tuple[int, int, int] = (28, 28, 1),
    classes: int = 10,
    *,
    filters: Sequence[int] = (32, 64),
    seed: int = 0,
    batch_norm: bool = False,
    model_cls: Callable[..., keras.Model] = keras.Model,
    **model_kwargs: Any,
) -> keras.Model:
    """A small MNIST conv net (conv-pool blocks, then dense), identical weights per seed."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(input_shape)
    h = inputs
    for f in filters:
        h = keras.layers.Conv2D(f, 3, padding="same", use_bias=not batch_norm)(h)
        if batch_norm:
            h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Activation("relu")(h)
        h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    outputs = keras.layers.Dense(classes, activation="softmax")(h)
    return model_cls(inputs, outputs, **model_kwargs)


def large_batch_reference(
    build_model: Callable[[], keras.Model],
    make_optimizer: Callable[[], keras.optimizers.Optimizer],
    loss: Any,
    batches: Sequence[tuple],
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Independent reference: plain ``train_on_batch`` on each large batch, in order.

    Args:
        build_model: returns a fresh plain model (same seed as the model under test).
        make_optimizer: returns a fresh optimizer (same settings).
        loss: the loss for ``compile``.
        batches: large batches ``(x, y)`` or ``(x, y, sample_weight)``; each is one update.

    Returns:
        ``(initial_weights, final_weights)``.
    """
    model = build_model()
    initial = get_weights(model)
    model.compile(make_optimizer(), loss)
    for batch in batches:
        model.train_on_batch(*batch)
    return initial, get_weights(model)


# ---------------------------------------------------------------------------------------------
# Book experiments (chapters 4 and 5): training runs that differ only in how a window is formed.
# ---------------------------------------------------------------------------------------------


def evaluate(
    model: keras.Model, x: np.ndarray, y: np.ndarray, *, batch_size: int = 1000
) -> tuple[float, float]:
    """Mean sparse categorical cross-entropy (nats) and accuracy (fraction) of ``model`` on ``x``.

    Runs the model in inference mode (``training=False``) in chunks of ``batch_size`` samples,
    so that the result depends only on the weights (no metric state, no accumulation state).
    ``x``: ``(n, ...)`` inputs; ``y``: ``(n,)`` integer labels.
    """
    if len(x) == 0:
        raise ValueError("`x` is empty: evaluate needs at least one sample.")
    total_loss = 0.0
    correct = 0
    for start in range(0, len(x), batch_size):
        probs = np.asarray(model(x[start : start + batch_size], training=False), np.float64)
        labels = np.asarray(y[start : start + batch_size]).astype(np.int64).reshape(-1)
        picked = np.clip(probs[np.arange(len(labels)), labels], 1e-7, 1.0)  # Keras's epsilon
        total_loss += float(-np.log(picked).sum())
        correct += int((probs.argmax(axis=1) == labels).sum())
    return total_loss / len(x), correct / len(x)


def epoch_orders(n: int, epochs: int, seed: int = 0) -> list[np.ndarray]:
    """One permutation of ``range(n)`` per epoch, from ``seed``: the shared data order."""
    rng = np.random.default_rng(seed)
    return [rng.permutation(n) for _ in range(epochs)]


def max_curve_gap(a: Sequence[float], b: Sequence[float]) -> float:
    """``max_t |a_t - b_t|`` of two curves recorded at the same points (same units as them)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"Curves recorded at different points: shapes {a.shape} vs {b.shape}.")
    return float(np.max(np.abs(a - b)))


class CompareRun:
    """What :func:`train_compare` records for one configuration.

    Attributes:
        name: the configuration's label.
        micro_batch: samples per ``train_step`` (b).
        accum_steps: micro-batches per optimizer update (K; 1 = plain Keras, no accumulation).
        samples: ``(n_points,)`` training samples seen at each checkpoint (0 = initial weights).
        train_loss: ``(n_points,)`` loss (nats) on a fixed subset of the training data, at each
            checkpoint's weights.
        test_loss: ``(n_points,)`` loss (nats) on the test data.
        test_accuracy: ``(n_points,)`` accuracy (fraction) on the test data.
        epoch_seconds: wall time of each epoch's ``fit`` (seconds), evaluation excluded.
        updates: optimizer updates applied in total.
        initial_weights, final_weights: all model weights before and after training.
    """

    def __init__(self, name: str, micro_batch: int, accum_steps: int) -> None:
        self.name = name
        self.micro_batch = micro_batch
        self.accum_steps = accum_steps
        self.samples: np.ndarray = np.zeros(0)
        self.train_loss: np.ndarray = np.zeros(0)
        self.test_loss: np.ndarray = np.zeros(0)
        self.test_accuracy: np.ndarray = np.zeros(0)
        self.epoch_seconds: list[float] = []
        self.updates = 0
        self.initial_weights: list[np.ndarray] = []
        self.final_weights: list[np.ndarray] = []

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer update, K * b."""
        return self.micro_batch * self.accum_steps

    def __repr__(self) -> str:
        return (f"CompareRun({self.name!r}, b={self.micro_batch}, K={self.accum_steps}, "
                f"points={len(self.samples)}, updates={self.updates})")


class _Checkpoints(keras.callbacks.Callback):
    """Evaluates at fixed training-sample counts inside ``fit`` and times the evaluations."""

    def __init__(self, every_batches: int, record: Callable[[int], None], offset: int,
                 micro_batch: int) -> None:
        super().__init__()
        self.every_batches = every_batches
        self.record = record
        self.offset = offset
        self.micro_batch = micro_batch
        self.eval_seconds = 0.0

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if (batch + 1) % self.every_batches == 0:
            start = time.perf_counter()
            self.record(self.offset + (batch + 1) * self.micro_batch)
            self.eval_seconds += time.perf_counter() - start


def train_compare(
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    configs: dict[str, tuple[int, int]],
    *,
    make_optimizer: Callable[[], keras.optimizers.Optimizer],
    build_model: Callable[..., keras.Model] = mlp,
    epochs: int = 1,
    eval_every: int = 1024,
    n_train_eval: int = 2000,
    seed: int = 0,
    verbose: bool = False,
) -> dict[str, CompareRun]:
    """Train one model per configuration from identical weights, on the identical data order.

    Each configuration ``name: (b, K)`` trains with ``model.fit(batch_size=b)``; ``K == 1`` is a
    plain ``keras.Model`` (no accumcore involved), ``K > 1`` an :class:`accumcore.AccumModel`
    with ``accum_steps=K``. All start from ``build_model(seed=seed)``'s weights, use
    ``make_optimizer()`` and see the samples in the same order (one permutation per epoch from
    :func:`epoch_orders`). At every ``eval_every`` training samples (and at the start) the
    weights are evaluated with :func:`evaluate` on the test set and on the first
    ``n_train_eval`` training samples.

    Args:
        x_train, y_train: ``(n, ...)`` inputs and ``(n,)`` integer labels (preprocessed).
        x_test, y_test: held-out data for the test curves.
        configs: ``{name: (micro_batch, accum_steps)}``, e.g.
            ``{"batch 64": (64, 1), "4 x 16": (16, 4), "batch 16": (16, 1)}``.
        make_optimizer: returns a fresh optimizer (same settings for every configuration).
        build_model: ``build_model(seed=..., [model_cls=AccumModel, accum_steps=K])``, e.g.
            :func:`mlp` or :func:`conv_net`, compiled here with sparse categorical
            cross-entropy.
        epochs: passes over the training data.
        eval_every: checkpoint spacing in training samples; must be a multiple of every
            configuration's ``b * K`` so that checkpoints fall on window boundaries.
        n_train_eval: size of the training subset used for the training-loss curve.
        seed: weights seed (via ``build_model``) and data-order seed.
        verbose: print one line per configuration and epoch.

    Returns:
        ``{name: CompareRun}`` in the order of ``configs``.
    """
    from accumcore.model import AccumModel

    if not configs:
        raise ValueError("`configs` is empty: pass e.g. {'batch 64': (64, 1), '4 x 16': (16, 4)}.")
    for name, (b, k) in configs.items():
        if eval_every % (b * k):
            raise ValueError(
                f"`eval_every`={eval_every} must be a multiple of the effective batch b*K="
                f"{b * k} of configuration {name!r}, so that checkpoints fall on window "
                f"boundaries; choose e.g. eval_every={b * k * max(1, eval_every // (b * k))}."
            )
    orders = epoch_orders(len(x_train), epochs, seed)
    x_fixed, y_fixed = x_train[:n_train_eval], y_train[:n_train_eval]
    runs: dict[str, CompareRun] = {}
    for name, (b, k) in configs.items():
        run = CompareRun(name, b, k)
        if k == 1:
            model = build_model(seed=seed)
        else:
            model = build_model(seed=seed, model_cls=AccumModel, accum_steps=k)
        model.compile(make_optimizer(), "sparse_categorical_crossentropy")
        run.initial_weights = get_weights(model)
        points: list[tuple[int, float, float, float]] = []

        def record(samples: int, model: keras.Model = model, points: list = points) -> None:
            train_loss, _ = evaluate(model, x_fixed, y_fixed)
            test_loss, test_acc = evaluate(model, x_test, y_test)
            points.append((samples, train_loss, test_loss, test_acc))

        record(0)
        seen = 0
        for epoch, order in enumerate(orders):
            checkpoints = _Checkpoints(eval_every // b, record, seen, b)
            start = time.perf_counter()
            model.fit(x_train[order], y_train[order], batch_size=b, epochs=1, shuffle=False,
                      verbose=0, callbacks=[checkpoints])
            run.epoch_seconds.append(time.perf_counter() - start - checkpoints.eval_seconds)
            seen += len(order)
            if points[-1][0] != seen:  # the epoch did not end on a checkpoint
                record(seen)
            if verbose:
                print(f"{name}: epoch {epoch + 1}/{epochs}, {run.epoch_seconds[-1]:.1f} s, "
                      f"test accuracy {points[-1][3]:.4f}")
        run.updates = int(model.optimizer.iterations.numpy())
        run.final_weights = get_weights(model)
        arr = np.asarray(points, np.float64)
        run.samples = arr[:, 0].astype(np.int64)
        run.train_loss, run.test_loss, run.test_accuracy = arr[:, 1], arr[:, 2], arr[:, 3]
        runs[name] = run
    return runs
