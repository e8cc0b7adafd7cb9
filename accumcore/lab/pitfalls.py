"""Broken gradient-accumulation recipes, each reproducible beside the correct one.

Every recipe is a function ``recipe(problem) -> keras.Model`` that trains a fresh copy of
``problem``'s model on ``problem``'s micro-batches and returns it. :func:`measure` compares the
result with the independent large-batch reference (plain ``train_on_batch`` on each window's
concatenated micro-batches, :func:`accumcore.lab.experiments.large_batch_reference`) using
:func:`accumcore.lab.experiments.relative_error`::

    rel = max |w - w_ref| / max |w_ref - w_init|

so 0 is exact, 1 means an error as large as the whole reference update. Correct code
(:func:`accumcore_recipe`, :func:`correct_loop`) measures ~1e-6 in float32.

The broken recipes are written to be read (the book prints their source): each marks its bug
with ``# BUG``. Recipes A and B (:class:`SumRawGradientsModel`,
:func:`tf_function_epoch_divide_by_k`) are this project's own Keras 3 rewrites of two recipes
of the kind often posted; :func:`keras_gradient_accumulation` measures Keras's built-in
``gradient_accumulation_steps`` optimizer argument.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from accumcore import AccumTrainer
from accumcore.lab.experiments import (
    get_weights,
    keras_loss,
    large_batch_reference,
    mlp,
    relative_error,
)

Batch = tuple  # (x, y) or (x, y, sample_weight)


# ---------------------------------------------------------------------------------------------
# Problems: a model, an optimizer and a fixed sequence of micro-batches
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Problem:
    """A small, fixed training problem on which a recipe is run and measured.

    Attributes:
        build_model: ``build_model(model_cls=keras.Model, **kwargs)`` returns a fresh model with
            identical initial weights on every call (seeded), e.g. ``functools.partial(
            accumcore.lab.experiments.mlp, seed=0)``.
        make_optimizer: returns a fresh optimizer (same settings on every call).
        micro_batches: ``(x, y)`` or ``(x, y, sample_weight)`` tuples, in training order.
        accum_steps: K; consecutive groups of K micro-batches form a window (one update); the
            last window may hold fewer.
        loss: a Keras loss (name or instance) that is a mean over samples (or over items with
            ``normalizer="sample_weight"``).
        normalizer: accumcore's micro-batch weight: ``"samples"`` or ``"sample_weight"``.
        name: a label for tables.
    """

    build_model: Callable[..., keras.Model]
    make_optimizer: Callable[[], keras.optimizers.Optimizer]
    micro_batches: list[Batch]
    accum_steps: int
    loss: Any = "sparse_categorical_crossentropy"
    normalizer: str = "samples"
    name: str = ""
    _reference: tuple | None = dataclasses.field(default=None, init=False, repr=False,
                                                 compare=False)
    _errors: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                      compare=False)

    def windows(self) -> list[list[Batch]]:
        """The micro-batches in groups of ``accum_steps`` (the last group may be shorter)."""
        k = self.accum_steps
        return [self.micro_batches[i : i + k] for i in range(0, len(self.micro_batches), k)]

    def large_batches(self) -> list[Batch]:
        """Each window's micro-batches concatenated: what one large batch would contain."""
        return [tuple(np.concatenate(parts) for parts in zip(*w, strict=True))
                for w in self.windows()]

    @property
    def sizes(self) -> list[int]:
        """Samples per micro-batch."""
        return [len(b[0]) for b in self.micro_batches]

    def replace(self, **changes: Any) -> Problem:
        """A copy with some fields changed (the cached reference and errors are dropped)."""
        return dataclasses.replace(self, **changes)  # a new object: nothing cached

    def reference(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """``(initial, final)`` weights of large-batch training (computed once, then cached)."""
        if self._reference is None:
            self._reference = large_batch_reference(
                self.build_model, self.make_optimizer, self.loss, self.large_batches()
            )
        return self._reference

    def cached(self, key: Any, compute: Callable[[], float]) -> float:
        """``compute()``, computed once per ``key`` on this problem (:meth:`replace` drops
        it): :func:`measure`'s errors."""
        if key not in self._errors:
            self._errors[key] = compute()
        return self._errors[key]


def make_problem(
    x: np.ndarray,
    y: np.ndarray,
    sizes: Sequence[int],
    *,
    accum_steps: int = 4,
    make_optimizer: Callable[[], keras.optimizers.Optimizer] | None = None,
    build_model: Callable[..., keras.Model] | None = None,
    hidden: Sequence[int] = (32,),
    seed: int = 0,
    name: str = "",
) -> Problem:
    """A :class:`Problem` from consecutive slices of ``x``, ``y`` (``sizes[i]`` samples each).

    Args:
        x: ``(n, d)`` float inputs (or images for a conv ``build_model``).
        y: ``(n,)`` integer labels.
        sizes: samples per micro-batch, in order; ``sum(sizes) <= n``.
        accum_steps: micro-batches per update (K).
        make_optimizer: default plain SGD, learning rate 0.1.
        build_model: default :func:`accumcore.lab.experiments.mlp` with ``hidden`` and ``seed``.
        hidden: hidden widths of the default MLP.
        seed: weights seed of the default MLP.
        name: a label.
    """
    if sum(sizes) > len(x):
        raise ValueError(f"`sizes` need {sum(sizes)} samples but `x` has only {len(x)}.")
    bounds = np.cumsum([0, *sizes])
    batches = [(x[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    if build_model is None:
        build_model = functools.partial(mlp, input_dim=x.shape[1], hidden=tuple(hidden),
                                        seed=seed)
    return Problem(build_model, make_optimizer or (lambda: keras.optimizers.SGD(0.1)), batches,
                   accum_steps, name=name)


def token_model(
    vocab: int = 20, length: int = 12, width: int = 16, *, seed: int = 0,
    model_cls: Callable[..., keras.Model] = keras.Model, **model_kwargs: Any,
) -> keras.Model:
    """A tiny per-token classifier: ``(batch, length)`` int tokens -> ``(batch, length, vocab)``."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocab, width)(inputs)
    outputs = keras.layers.Dense(vocab, activation="softmax")(h)
    return model_cls(inputs, outputs, **model_kwargs)


def token_problem(
    *,
    micro_batches: int = 4,
    sequences_per_micro_batch: int = 4,
    accum_steps: int = 4,
    vocab: int = 20,
    length: int = 12,
    seed: int = 0,
    make_optimizer: Callable[[], keras.optimizers.Optimizer] | None = None,
) -> Problem:
    """Padded token sequences whose loss is the mean over *valid tokens* of the whole window.

    Synthetic data (the task: predict ``(token + 1) % vocab``): each sequence has a random
    number of valid tokens (1..length, marked by a 0/1 ``sample_weight`` mask of shape
    ``(batch, length)``), so micro-batches hold very different token counts. The loss is
    sparse categorical cross-entropy with ``reduction="mean_with_sample_weight"`` (divides by
    the number of valid tokens), and accumcore weighs micro-batches by their token count
    (``normalizer="sample_weight"``).
    """
    rng = np.random.default_rng(seed)
    n = micro_batches * sequences_per_micro_batch
    x = rng.integers(0, vocab, size=(n, length)).astype("int32")
    y = (x + 1) % vocab
    # Sort by length so that micro-batches differ strongly in token count (as with bucketing).
    lengths = np.sort(rng.integers(1, length + 1, size=n))
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype("float32")
    b = sequences_per_micro_batch
    batches = [(x[i : i + b], y[i : i + b], mask[i : i + b]) for i in range(0, n, b)]
    loss = keras.losses.SparseCategoricalCrossentropy(reduction="mean_with_sample_weight")
    return Problem(
        functools.partial(token_model, vocab, length, seed=seed),
        make_optimizer or (lambda: keras.optimizers.SGD(0.5)),
        batches, accum_steps, loss=loss, normalizer="sample_weight", name="tokens",
    )


def dropout_mlp(
    input_dim: int = 784, hidden: int = 64, classes: int = 10, *, rate: float = 0.3,
    dropout_seed: int = 1, seed: int = 0, model_cls: Callable[..., keras.Model] = keras.Model,
    **model_kwargs: Any,
) -> keras.Model:
    """MLP with one dropout layer; ``seed`` fixes the weights, ``dropout_seed`` the masks."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((input_dim,))
    h = keras.layers.Dense(hidden, activation="relu")(inputs)
    h = keras.layers.Dropout(rate, seed=dropout_seed)(h)
    outputs = keras.layers.Dense(classes, activation="softmax")(h)
    return model_cls(inputs, outputs, **model_kwargs)


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def recipe_source(obj: Any) -> str:
    """The source of a recipe (function or class) without its docstrings, for display.

    The book prints each recipe next to prose that says what it does; the code lines, with
    their ``# BUG`` comments on lines of their own, stay within 88 columns.
    """
    import ast
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(obj))
    lines = source.splitlines()
    drop: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and (
                ast.get_docstring(node) is not None):
            doc = node.body[0]
            drop.update(range(doc.lineno - 1, doc.end_lineno))
    return "\n".join(line for i, line in enumerate(lines) if i not in drop) + "\n"


def _free_names(source: str) -> set[str]:
    """Names ``source`` reads but never binds (parameters, assignments, defs), minus builtins."""
    import ast
    import builtins

    bound, loaded = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
    return loaded - bound - set(dir(builtins))


def recipe_imports(objs: Sequence[Any]) -> str:
    """The import lines after which each of ``objs``'s :func:`recipe_source` runs as shown.

    Every name a recipe reads without defining it is imported from where a reader would: a
    module by its own name (``import tensorflow as tf``), a public accumcore name from
    ``accumcore``, a typing name from ``typing``, anything else (the shared helpers such as
    :func:`mean_loss_gradients`, :class:`Problem`) from ``accumcore.lab.pitfalls``.
    """
    import inspect
    import textwrap

    import accumcore

    names = set().union(*(_free_names(recipe_source(obj)) for obj in objs))
    plain, named = [], {}
    for name in sorted(names):
        value = globals()[name]
        if inspect.ismodule(value):
            alias = "" if value.__name__ == name else f" as {name}"
            plain.append(f"import {value.__name__}{alias}")
        elif name in accumcore.__all__:
            named.setdefault("accumcore", []).append(name)
        elif getattr(value, "__module__", "") == "typing":
            named.setdefault("typing", []).append(name)
        else:
            named.setdefault(__name__, []).append(name)
    lines = [f"from typing import {', '.join(named.pop('typing'))}"] if "typing" in named else []
    lines += sorted(plain)
    for module in sorted(named):
        head = f"from {module} import "
        body = ", ".join(named[module])
        if len(head) + len(body) <= 88:
            lines.append(head + body)
        else:
            wrapped = textwrap.wrap(body, 84, initial_indent="    ", subsequent_indent="    ")
            lines += [head + "(", *wrapped[:-1], wrapped[-1] + ",", ")"]
    return "\n".join(lines) + "\n"


def _select(weights: Sequence[np.ndarray], model: keras.Model, which: str) -> list[np.ndarray]:
    if which == "all":
        return list(weights)
    if which not in ("trainable", "non_trainable"):
        raise ValueError(f"`which` must be 'all', 'trainable' or 'non_trainable', got {which!r}.")
    flags = [w.trainable for w in model.weights]
    keep = [f if which == "trainable" else not f for f in flags]
    return [w for w, k in zip(weights, keep, strict=True) if k]


def measure(problem: Problem, recipe: Callable[[Problem], keras.Model], *,
            which: str = "all") -> float:
    """Relative error (dimensionless) of ``recipe(problem)`` against large-batch training.

    Args:
        problem: the problem (its reference is computed once and cached).
        recipe: ``recipe(problem) -> trained keras.Model``; deterministic (seeded), so the
            error is cached on ``problem`` per ``(recipe, which)``.
        which: compare ``"all"`` weights, only ``"trainable"`` ones, or only
            ``"non_trainable"`` ones (e.g. BatchNorm moving statistics).
    """
    return problem.cached((recipe, which), lambda: _measure(problem, recipe, which))


def _measure(problem: Problem, recipe: Callable[[Problem], keras.Model], which: str) -> float:
    initial, final = problem.reference()
    model = recipe(problem)
    if len(model.weights) != len(final):
        raise ValueError(
            f"The recipe's model has {len(model.weights)} weights, the reference {len(final)}: "
            "they must be the same architecture."
        )
    return relative_error(_select(get_weights(model), model, which),
                          _select(final, model, which), _select(initial, model, which))


def compare(problem: Problem, broken: Callable[[Problem], keras.Model], *,
            which: str = "all") -> dict[str, float]:
    """``{"broken": rel, "accumcore": rel}`` for one broken recipe and accumcore on ``problem``."""
    return {"broken": measure(problem, broken, which=which),
            "accumcore": measure(problem, accumcore_recipe, which=which)}


# ---------------------------------------------------------------------------------------------
# Helpers shared by the recipes
# ---------------------------------------------------------------------------------------------


def mean_loss_gradients(model: keras.Model, loss_fn: keras.losses.Loss, batch: Batch,
                        optimizer: keras.optimizers.Optimizer | None = None):
    """``(mean_loss, gradients)`` of one micro-batch; dense gradients of the *mean* loss.

    With ``optimizer`` (a ``LossScaleOptimizer``) the gradients are of the scaled loss.
    """
    x, y, *rest = batch
    sample_weight = rest[0] if rest else None
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True), sample_weight)
        scaled = optimizer.scale_loss(loss) if optimizer is not None else loss
    grads = tape.gradient(scaled, model.trainable_variables)
    # Embedding gradients arrive as tf.IndexedSlices; densify them for simple arithmetic.
    return loss, [tf.convert_to_tensor(g) for g in grads]


def batch_weight(problem: Problem, batch: Batch) -> float:
    """The weight c_i of a micro-batch: its samples, or its sample-weight sum (tokens)."""
    if problem.normalizer == "sample_weight" and len(batch) > 2:
        return float(np.sum(batch[2]))
    return float(len(batch[0]))


def window_gradient(
    p: Problem, model: keras.Model, loss_fn: keras.losses.Loss, window: list[Batch],
    optimizer: keras.optimizers.Optimizer | None = None,
) -> list[tf.Tensor]:
    """The window's large-batch mean gradient, done right: ``sum c_i grad_i / sum c_i``.

    ``grad_i`` is micro-batch i's mean-loss gradient (so ``c_i grad_i`` is the gradient of its
    summed loss) and ``c_i`` its :func:`batch_weight`; a list of dense tensors shaped like
    ``model.trainable_variables``. With ``optimizer`` (a ``LossScaleOptimizer``) it is the
    gradient of the scaled loss.
    """
    acc, total = zero_gradients(model), 0.0
    for batch in window:
        _, grads = mean_loss_gradients(model, loss_fn, batch, optimizer)
        c = batch_weight(p, batch)  # samples (or valid tokens) in this micro-batch
        acc = [a + c * g for a, g in zip(acc, grads, strict=True)]
        total += c
    return [a / total for a in acc]


def optimizer_like(optimizer: keras.optimizers.Optimizer, **changes: Any):
    """A fresh optimizer of the same class and config, with some settings changed."""
    return type(optimizer).from_config({**optimizer.get_config(), **changes})


def zero_gradients(model: keras.Model) -> list[tf.Tensor]:
    """One zero tensor per trainable variable of `model` (same shapes): empty accumulators."""
    return [tf.zeros_like(v) for v in model.trainable_variables]


# ---------------------------------------------------------------------------------------------
# Correct versions
# ---------------------------------------------------------------------------------------------


def accumcore_recipe(p: Problem) -> keras.Model:
    """Correct: accumcore's eager loop (``AccumTrainer.train_micro_batch``), then ``flush``."""
    model = p.build_model()
    trainer = AccumTrainer(model, p.make_optimizer(), p.loss, accum_steps=p.accum_steps,
                           normalizer=p.normalizer)
    for batch in p.micro_batches:
        trainer.train_micro_batch(*batch)
    trainer.flush()  # a partial last window is applied with its true weight
    return model


def correct_loop(p: Problem) -> keras.Model:
    """Correct, by hand: one ``optimizer.apply`` per window, of :func:`window_gradient`."""
    model, opt, loss_fn = p.build_model(), p.make_optimizer(), keras_loss(p.loss)
    for window in p.windows():
        opt.apply(window_gradient(p, model, loss_fn, window), model.trainable_variables)
    return model


# ---------------------------------------------------------------------------------------------
# Broken recipes
# ---------------------------------------------------------------------------------------------


def loss_not_rescaled(p: Problem) -> keras.Model:
    """Sums the K micro-batches' mean-loss gradients and applies the sum: K times the step."""
    model, opt, loss_fn = p.build_model(), p.make_optimizer(), keras_loss(p.loss)
    for window in p.windows():
        acc = zero_gradients(model)
        for batch in window:
            _, grads = mean_loss_gradients(model, loss_fn, batch)
            # BUG: never divided by K
            acc = [a + g for a, g in zip(acc, grads, strict=True)]
        opt.apply(acc, model.trainable_variables)
    return model


def accumulators_before_variables(p: Problem) -> keras.Model:
    """Creates the accumulators from a lazily built model, before its variables exist.

    ``keras.Sequential`` without an ``Input`` (like a subclassed model) has no variables until
    its first call, so the list comprehension creates *no* accumulators; ``zip`` then silently
    truncates to nothing and ``optimizer.apply([])`` is a no-op: the model never trains.
    """
    reference = p.build_model()  # only to copy the architecture and the initial weights
    model = keras.Sequential([type(layer).from_config(layer.get_config())
                              for layer in reference.layers[1:]])
    opt, loss_fn = p.make_optimizer(), keras_loss(p.loss)
    # BUG: no variables yet, so `acc` is [] (and zip() below stops at once)
    acc = [tf.Variable(tf.zeros_like(v)) for v in model.trainable_variables]
    for window in p.windows():
        for batch in window:
            # The first call builds the model; start from the reference's weights.
            if not model.built:
                model(batch[0])
                model.set_weights(reference.get_weights())
            _, grads = mean_loss_gradients(model, loss_fn, batch)
            # BUG (the consequence): zip() stops at the shorter list, [], silently
            for a, g in zip(acc, grads):
                a.assign_add(g / len(window))
        opt.apply([a.value() for a in acc],
                  [v for v, _ in zip(model.trainable_variables, acc)])
        for a in acc:
            a.assign(tf.zeros_like(a))
    return model


def never_reset(p: Problem) -> keras.Model:
    """Creates the accumulators once and never zeroes them: every window re-applies the past."""
    model, opt, loss_fn = p.build_model(), p.make_optimizer(), keras_loss(p.loss)
    acc = zero_gradients(model)
    for window in p.windows():
        for batch in window:
            _, grads = mean_loss_gradients(model, loss_fn, batch)
            acc = [a + g / len(window) for a, g in zip(acc, grads, strict=True)]
        # BUG: `acc` is not reset after the update
        opt.apply(acc, model.trainable_variables)
    return model


def reset_every_micro_batch(p: Problem) -> keras.Model:
    """Zeroes the accumulators inside the micro-batch loop: only the last micro-batch counts."""
    model, opt, loss_fn = p.build_model(), p.make_optimizer(), keras_loss(p.loss)
    for window in p.windows():
        for batch in window:
            # BUG: reset at every micro-batch instead of every window
            acc = zero_gradients(model)
            _, grads = mean_loss_gradients(model, loss_fn, batch)
            acc = [a + g / len(window) for a, g in zip(acc, grads, strict=True)]
        opt.apply(acc, model.trainable_variables)
    return model


def partial_window_dropped(p: Problem) -> keras.Model:
    """Correct windows, but a last window with fewer than K micro-batches is thrown away."""
    model, opt, loss_fn = p.build_model(), p.make_optimizer(), keras_loss(p.loss)
    for window in p.windows():
        if len(window) < p.accum_steps:
            # BUG: the partial window's samples never reach the model
            break
        opt.apply(window_gradient(p, model, loss_fn, window), model.trainable_variables)
    return model


def partial_window_divided_by_k(p: Problem) -> keras.Model:
    """Divides every window by K, including a last window of r < K micro-batches (r/K step)."""
    model, opt, loss_fn = p.build_model(), p.make_optimizer(), keras_loss(p.loss)
    k = p.accum_steps
    for window in p.windows():
        acc = zero_gradients(model)
        for batch in window:
            _, grads = mean_loss_gradients(model, loss_fn, batch)
            # BUG: the last window holds r < K micro-batches: / K, not / r
            acc = [a + g / k for a, g in zip(acc, grads, strict=True)]
        opt.apply(acc, model.trainable_variables)
    return model


def mean_of_means(p: Problem) -> keras.Model:
    """Averages the micro-batches' mean gradients with weight 1/K each, whatever their size.

    Exact only when every micro-batch holds the same number of samples (or tokens); with ragged
    micro-batches (or per-token losses over padded sequences) small micro-batches count too much.
    """
    model, opt, loss_fn = p.build_model(), p.make_optimizer(), keras_loss(p.loss)
    for window in p.windows():
        acc = zero_gradients(model)
        for batch in window:
            _, grads = mean_loss_gradients(model, loss_fn, batch)
            # BUG: weight 1/K per micro-batch, not its share of the window's samples
            acc = [a + g / len(window) for a, g in zip(acc, grads, strict=True)]
        opt.apply(acc, model.trainable_variables)
    return model


def apply_every_micro_step(p: Problem) -> keras.Model:
    """Branch-free accumulation: ``optimizer.apply`` runs at *every* micro-batch, with a zero
    gradient except at the window's end.

    The gradient sum is right, but the optimizer's state advances K times per window: its
    iteration counter (learning-rate schedules), Adam's moment decay and bias correction,
    momentum, and decoupled weight decay. Plain SGD with a constant rate is unaffected.
    """
    model, opt, loss_fn = p.build_model(), p.make_optimizer(), keras_loss(p.loss)
    for window in p.windows():
        acc, total = zero_gradients(model), 0.0
        for i, batch in enumerate(window):
            _, grads = mean_loss_gradients(model, loss_fn, batch)
            c = batch_weight(p, batch)
            acc = [a + c * g for a, g in zip(acc, grads, strict=True)]
            total += c
            last = 1.0 if i == len(window) - 1 else 0.0
            # BUG: an optimizer step per micro-batch
            opt.apply([last * a / total for a in acc],
                      model.trainable_variables)
    return model


def clip_per_micro_batch(p: Problem) -> keras.Model:
    """Clips each micro-batch's gradient to the optimizer's ``global_clipnorm``, then averages.

    The large batch clips the *window's* mean gradient once; the mean of clipped gradients is
    a different vector (and is never longer than the clip norm, even when it should be clipped
    less). Needs ``p.make_optimizer()`` to set ``global_clipnorm``.
    """
    model, loss_fn = p.build_model(), keras_loss(p.loss)
    base = p.make_optimizer()
    clip = base.global_clipnorm
    if not clip:
        raise ValueError(
            "clip_per_micro_batch needs an optimizer with `global_clipnorm` set.")
    opt = optimizer_like(base, global_clipnorm=None)  # clipping is done by hand below
    for window in p.windows():
        acc, total = zero_gradients(model), 0.0
        for batch in window:
            _, grads = mean_loss_gradients(model, loss_fn, batch)
            # BUG: clip per micro-batch
            grads, _ = tf.clip_by_global_norm(grads, clip)
            c = batch_weight(p, batch)
            acc = [a + c * g for a, g in zip(acc, grads, strict=True)]
            total += c
        opt.apply([a / total for a in acc], model.trainable_variables)
    return model


def clip_before_unscale(p: Problem) -> keras.Model:
    """Mixed-precision order bug: clips the window gradient while it is still loss-scaled.

    ``p.make_optimizer()`` must be a ``keras.optimizers.LossScaleOptimizer`` whose inner
    optimizer sets ``global_clipnorm``. The correct order is: accumulate scaled gradients,
    divide by the window weight, **unscale**, then clip (Keras's ``LossScaleOptimizer`` unscales
    before its inner optimizer clips). Clipping first caps the norm at ``clip`` in scaled units,
    i.e. at ``clip / loss_scale`` after unscaling: the update nearly vanishes.
    """
    model, loss_fn = p.build_model(), keras_loss(p.loss)
    lso = p.make_optimizer()
    if not isinstance(lso, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "clip_before_unscale needs a keras.optimizers.LossScaleOptimizer.")
    clip = lso.inner_optimizer.global_clipnorm
    inner = optimizer_like(lso.inner_optimizer, global_clipnorm=None)
    lso.build(model.trainable_variables)
    for window in p.windows():
        # the window's mean gradient of the scaled loss
        grads = window_gradient(p, model, loss_fn, window, optimizer=lso)
        # BUG: clipped before unscaling
        grads, _ = tf.clip_by_global_norm(grads, clip)
        scale = lso.dynamic_scale
        inner.apply([g / scale for g in grads], model.trainable_variables)
    return model


def keras_gradient_accumulation(p: Problem) -> keras.Model:
    """Keras's own ``gradient_accumulation_steps=K`` optimizer argument, via ``train_on_batch``.

    Keras averages the K raw gradients with weight 1/K (ragged micro-batches: mean of means),
    applies them when its micro-step counter reaches a multiple of K, so a partial window of
    r micro-batches stays in its accumulators until K - r more arrive, which join it (here
    none follow: never applied), and evaluates learning-rate schedules at its micro-step
    counter.
    """
    model = p.build_model()
    opt = optimizer_like(p.make_optimizer(), gradient_accumulation_steps=p.accum_steps)
    model.compile(opt, p.loss)
    for batch in p.micro_batches:
        model.train_on_batch(*batch)
    return model


# ---------------------------------------------------------------------------------------------
# Two recipes of the kind often posted, rewritten for Keras 3
# ---------------------------------------------------------------------------------------------


class SumRawGradientsModel(keras.Model):
    """Recipe A of chapter 6, rewritten for Keras 3: a ``train_step`` that sums raw gradients.

    Each ``train_step`` adds the micro-batch's gradient to a running sum; every K steps the sum
    is applied and zeroed. The sum is never divided by K, so with SGD each update is K times
    the large-batch step. Adam divides by the gradient's own running magnitude, so the factor K
    cancels except against its epsilon: a smaller but not zero error (chapter 6, section 9,
    measures it). A partial window at the end of an epoch is carried into the next epoch's
    first window.

    Use it like ``keras.Model`` (functional form) with an extra ``accum_steps=K``.
    """

    def __init__(self, *args: Any, accum_steps: int = 4, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.accum_steps = accum_steps
        # tf.Variables (not keras.Variable) so that they stay out of `model.weights`.
        self.step_count = tf.Variable(0, trainable=False, name="step_count")
        self.gradient_sums = [
            tf.Variable(tf.zeros_like(v), trainable=False, name=f"sum_{i}")
            for i, v in enumerate(self.trainable_variables)
        ]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        for s, g in zip(self.gradient_sums, grads, strict=True):
            # BUG: raw sum of K mean-loss gradients, never divided by K
            s.assign_add(g)
        self.step_count.assign_add(1)
        tf.cond(self.step_count >= self.accum_steps, self._apply_sum,
                lambda: tf.constant(0))
        return {"loss": loss}

    def _apply_sum(self) -> tf.Tensor:
        self.optimizer.apply([s.value() for s in self.gradient_sums],
                             self.trainable_variables)
        for s in self.gradient_sums:
            s.assign(tf.zeros_like(s))
        self.step_count.assign(0)
        return tf.constant(0)


def sum_raw_gradients_train_step(p: Problem) -> keras.Model:
    """Runs :class:`SumRawGradientsModel` with ``model.fit`` over ``p``'s micro-batches.

    Needs micro-batches of equal size b (``fit(batch_size=b)`` re-slices the data).
    """
    sizes = set(p.sizes)
    if len(sizes) != 1:
        raise ValueError(
            f"sum_raw_gradients_train_step needs equal micro-batches, got {p.sizes}.")
    model = p.build_model(model_cls=SumRawGradientsModel, accum_steps=p.accum_steps)
    model.compile(p.make_optimizer(), p.loss)
    x = np.concatenate([b[0] for b in p.micro_batches])
    y = np.concatenate([b[1] for b in p.micro_batches])
    model.fit(x, y, batch_size=sizes.pop(), epochs=1, shuffle=False, verbose=0)
    return model


def tf_function_epoch_divide_by_k(p: Problem) -> keras.Model:
    """Recipe B of chapter 6, rewritten for Keras 3: a ``tf.function`` epoch loop over data.

    Every micro-batch adds ``grad / K``; the window is applied every K micro-batches and,
    after the loop, once more for a partial window: still divided by K instead of by its
    r micro-batches, so the epoch's last update is r/K of what it should be.
    """
    model, opt, loss_fn = p.build_model(), p.make_optimizer(), keras_loss(p.loss)
    k = p.accum_steps
    variables = model.trainable_variables
    opt.build(variables)
    acc = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]
    sizes = set(p.sizes)
    if len(sizes) != 1:
        raise ValueError(
            f"tf_function_epoch_divide_by_k needs equal micro-batches, got {p.sizes}.")
    x = np.concatenate([b[0] for b in p.micro_batches])
    y = np.concatenate([b[1] for b in p.micro_batches])
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(sizes.pop())

    def apply_and_reset():
        opt.apply([a.value() for a in acc], variables)
        for a in acc:
            a.assign(tf.zeros_like(a))

    @tf.function
    def train_epoch(dataset):
        step = tf.constant(0)
        for xb, yb in dataset:
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, variables)
            for a, g in zip(acc, grads, strict=True):
                a.assign_add(g / k)
            step += 1
            if step % k == 0:
                apply_and_reset()
        if step % k != 0:
            # BUG: the partial window was divided by K, not by step % K
            apply_and_reset()

    train_epoch(dataset)
    return model


# ---------------------------------------------------------------------------------------------
# Non-bugs with a measurable gap: BatchNorm and dropout
# ---------------------------------------------------------------------------------------------


def batchnorm_gap(p: Problem) -> dict[str, float]:
    """How far exact accumulation lands from the large batch when the model has BatchNorm.

    Stock ``BatchNormalization`` normalises each *micro-batch* with its own mean and variance
    and updates its moving statistics once per micro-batch, so K x b is not B even with exact
    gradient accumulation. Returns the relative errors of accumcore against the large batch for
    the trainable weights and for the moving statistics (non-trainable weights).
    """
    return {"trainable": measure(p, accumcore_recipe, which="trainable"),
            "moving_statistics": measure(p, accumcore_recipe, which="non_trainable")}


def dropout_gap(p: Problem, *, other_dropout_seed: int = 2) -> dict[str, float]:
    """Accumulation with dropout against the large batch, next to dropout's own noise.

    ``p.build_model`` must accept ``dropout_seed`` (e.g. :func:`dropout_mlp`). Returns
    ``{"accumcore_vs_large": rel, "large_vs_large_other_seed": rel}``: the second is the gap
    between two large-batch runs that differ only in their dropout masks, the natural scale
    against which the first is judged (micro-batches draw different masks than one large batch).
    """
    initial, final = p.reference()
    other = p.replace(build_model=functools.partial(p.build_model,
                                                    dropout_seed=other_dropout_seed))
    _, other_final = other.reference()
    if any(not np.array_equal(a, b) for a, b in zip(other.reference()[0], initial, strict=True)):
        raise ValueError("The two dropout seeds changed the initial weights; they must not.")
    return {"accumcore_vs_large": measure(p, accumcore_recipe),
            "large_vs_large_other_seed": relative_error(other_final, final, initial)}


# ---------------------------------------------------------------------------------------------
# Embeddings: Keras's sparse large-batch step against the dense update
# ---------------------------------------------------------------------------------------------


def embedding_model(
    vocab: int = 30, length: int = 10, width: int = 8, *, seed: int = 0,
    model_cls: Callable[..., keras.Model] = keras.Model, **model_kwargs: Any,
) -> keras.Model:
    """A tiny text classifier: ``(batch, length)`` int tokens -> Embedding -> mean -> 2 classes.

    The embedding's gradient is a ``tf.IndexedSlices`` with one row per token occurrence, so a
    token that occurs several times in a batch appears several times in its indices.
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocab, width)(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(2, activation="softmax")(h)
    return model_cls(inputs, outputs, **model_kwargs)


def embedding_problem(
    *,
    micro_batches: int = 4,
    sequences_per_micro_batch: int = 8,
    accum_steps: int = 4,
    vocab: int = 30,
    length: int = 10,
    seed: int = 0,
    make_optimizer: Callable[[], keras.optimizers.Optimizer] | None = None,
) -> Problem:
    """Synthetic token sequences with many repeated tokens (a Zipf-like draw), two classes.

    The label says whether the sequence holds more "low" tokens (ids below ``vocab // 2``)
    than "high" ones. Default optimizer: ``Adam(1e-2)``.
    """
    rng = np.random.default_rng(seed)
    n = micro_batches * sequences_per_micro_batch
    p = 1.0 / np.arange(1, vocab + 1)
    x = rng.choice(vocab, size=(n, length), p=p / p.sum()).astype("int32")
    y = ((x < vocab // 2).sum(axis=1) > length // 2).astype("int32")
    b = sequences_per_micro_batch
    batches = [(x[i : i + b], y[i : i + b]) for i in range(0, n, b)]
    return Problem(
        functools.partial(embedding_model, vocab, length, seed=seed),
        make_optimizer or (lambda: keras.optimizers.Adam(1e-2)),
        batches, accum_steps, name="embedding",
    )


def dense_large_batch_reference(p: Problem) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``(initial, final)`` weights of large-batch training with *dense* gradients.

    The same steps as ``train_on_batch`` on each window's concatenated micro-batches (mean
    loss over the large batch, one ``optimizer.apply`` per window), except that every
    gradient is converted to a dense tensor first: the mathematical update of the large
    batch, whatever the optimizer does with sparse (``tf.IndexedSlices``) gradients.
    """
    model = p.build_model()
    initial = get_weights(model)
    opt = p.make_optimizer()
    model.compile(opt, p.loss)  # compute_loss: the loss train_on_batch minimises
    for x, y, *rest in p.large_batches():
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True),
                                      sample_weight=rest[0] if rest else None)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply([tf.convert_to_tensor(g) for g in grads], model.trainable_variables)
    return initial, get_weights(model)


def embedding_gap(p: Problem) -> dict[str, float]:
    """Keras's sparse large-batch step and accumcore, each against the dense update.

    Returns ``{"keras_vs_dense": rel, "accumcore_vs_dense": rel}``: ``train_on_batch`` on
    the large batch (Keras applies the embedding's ``IndexedSlices`` gradient row by row,
    so with repeated tokens Adam's and RMSprop's squared-gradient statistics see the sum of
    the squares of the rows instead of the square of their sum), and accumcore's
    accumulated window (dense accumulators), both measured against
    :func:`dense_large_batch_reference`.
    """
    initial, dense = dense_large_batch_reference(p)
    _, keras_final = p.reference()
    accumulated = get_weights(accumcore_recipe(p))
    return {"keras_vs_dense": relative_error(keras_final, dense, initial),
            "accumcore_vs_dense": relative_error(accumulated, dense, initial)}


#: The recipes whose source the book shows (:func:`recipe_source`), correct ones first; with
#: :func:`recipe_imports` in front, each runs as shown.
RECIPES = (
    window_gradient, correct_loop, accumcore_recipe, loss_not_rescaled,
    accumulators_before_variables, never_reset, reset_every_micro_batch, partial_window_dropped,
    partial_window_divided_by_k, mean_of_means, apply_every_micro_step, clip_per_micro_batch,
    clip_before_unscale, SumRawGradientsModel, tf_function_epoch_divide_by_k,
)
