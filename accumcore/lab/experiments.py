"""Helpers shared by the tests, the book's notebooks and the benchmarks.

Model builders with fixed seeds (so two runs start from identical weights), the large-batch
reference update, and the relative error used everywhere in this project::

    rel = max |w - w_ref| / max |w_ref - w_init|

i.e. the largest weight difference measured in units of the largest reference update, with
its counterpart for BatchNormalization moving statistics (:func:`statistics_gap`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from accumcore.lab.book import progress as book_progress


class FunctionLoss(keras.losses.Loss):
    """A loss function ``fn(y_true, y_pred) -> per-sample losses`` as a Keras loss with the
    default reduction (the mean over the batch), as ``model.compile`` wraps a function."""

    def __init__(self, fn: Callable[[Any, Any], Any], name: str | None = None) -> None:
        super().__init__(name=name)
        self.fn = fn

    def call(self, y_true: Any, y_pred: Any) -> Any:
        return self.fn(y_true, y_pred)


def keras_loss(loss: Any) -> keras.losses.Loss:
    """The reducing Keras loss ``model.compile`` makes of ``loss`` (public Keras only): a
    ``keras.losses.Loss`` as it is, a name (``"sparse_categorical_crossentropy"``) or a
    function ``fn(y_true, y_pred)`` as a :class:`FunctionLoss` (the mean over the batch)."""
    if isinstance(loss, keras.losses.Loss):
        return loss
    fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    if isinstance(fn, keras.losses.Loss):
        return fn
    if not callable(fn):
        raise TypeError(f"`loss` must be a keras.losses.Loss, a loss name or a function "
                        f"(y_true, y_pred), got {loss!r}.")
    return FunctionLoss(fn, name=loss if isinstance(loss, str) else getattr(fn, "__name__", None))


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
    update. What float32 round-off alone gives is measured per page by reordering controls
    (:func:`large_batch_reference` with ``reorder``), not assumed. The three
    lists must hold the same number of arrays (e.g. ``get_weights`` of one architecture).
    """
    return _relative_gap(weights, reference, initial, "weight",
                         "`get_weights(...)` of models with the same architecture")


def batchnorm_layers(model: keras.layers.Layer) -> list[keras.layers.BatchNormalization]:
    """Every BatchNormalization layer of ``model`` (stock or window-level), in order.

    Walks the public ``layers`` attribute recursively (nested models included, and ``layer``
    of wrappers such as ``TimeDistributed``), depth first, each layer once: the order in
    which :func:`accumcore.convert_batchnorm` finds them.
    """
    found: list[keras.layers.BatchNormalization] = []
    seen: set[int] = set()
    stack = [model]
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        if isinstance(layer, keras.layers.BatchNormalization):
            found.append(layer)
        inner = getattr(layer, "layer", None)  # wrappers: TimeDistributed, Bidirectional, ...
        children = [*(getattr(layer, "layers", None) or []),
                    *([inner] if isinstance(inner, keras.layers.Layer) else [])]
        stack.extend(reversed(children))
    return found


def moving_statistics(model: keras.layers.Layer) -> list[np.ndarray]:
    """Moving statistics of every BatchNormalization layer (stock or window-level), in order.

    Returns:
        ``[mean_0, variance_0, mean_1, variance_1, ...]`` as float64 arrays of shape
        ``(channels,)``, in :func:`batchnorm_layers`'s order (layer names are not used, so two
        separately built models of the same architecture compare position by position); layers
        not built yet are left out.
    """
    stats = []
    for layer in batchnorm_layers(model):
        if layer.built:
            stats.append(np.asarray(layer.moving_mean.numpy(), np.float64))
            stats.append(np.asarray(layer.moving_variance.numpy(), np.float64))
    return stats


def statistics_gap(
    stats: list[np.ndarray], reference: list[np.ndarray], initial: list[np.ndarray]
) -> float:
    """``max|s - s_ref| / max|s_ref - s_init|`` over moving statistics (dimensionless).

    The statistics counterpart of :func:`relative_error` (the same computation): 0 means the
    moving statistics equal the reference's; 1 means an error as large as the reference's
    whole change since ``initial``. Arguments are lists from :func:`moving_statistics`.
    """
    return _relative_gap(stats, reference, initial, "statistics",
                         "`moving_statistics(...)` of models with the same BatchNormalization "
                         "layers")


def _relative_gap(values: Sequence[np.ndarray], reference: Sequence[np.ndarray],
                  initial: Sequence[np.ndarray], what: str, source: str) -> float:
    """``max|v - v_ref| / max|v_ref - v_init|`` in float64; ``what`` and ``source`` name the
    arrays and where matching lists come from, for the messages."""
    if not (len(values) == len(reference) == len(initial)) or not values:
        raise ValueError(
            f"Got {len(values)}, {len(reference)} and {len(initial)} {what} arrays: pass "
            f"{source}."
        )
    num = max(float(np.max(np.abs(np.asarray(v, np.float64) - np.asarray(r, np.float64))))
              for v, r in zip(values, reference, strict=True))
    den = max(float(np.max(np.abs(np.asarray(r, np.float64) - np.asarray(i, np.float64))))
              for r, i in zip(reference, initial, strict=True))
    if den == 0.0:
        raise ValueError(f"The reference {what} arrays did not move from `initial`: no update.")
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
    norm: str | None = None,
    model_cls: Callable[..., keras.Model] = keras.Model,
    **model_kwargs: Any,
) -> keras.Model:
    """A small MNIST conv net (conv-pool blocks, then dense), identical weights per seed.

    ``norm`` picks the normalisation after each convolution: ``None`` (none, or stock BN if
    ``batch_norm=True``), ``"batch"`` (``keras.layers.BatchNormalization``), ``"window_batch"``
    (:class:`accumcore.WindowBatchNormalization`), ``"group"`` (``GroupNormalization`` with
    up to 8 groups) or ``"layer"`` (``LayerNormalization``); the last two do not depend on the
    batch at all.
    """
    from accumcore import WindowBatchNormalization

    layers = {
        "batch": lambda f: keras.layers.BatchNormalization(),
        "window_batch": lambda f: WindowBatchNormalization(),
        "group": lambda f: keras.layers.GroupNormalization(groups=math.gcd(8, f)),
        "layer": lambda f: keras.layers.LayerNormalization(),
    }
    if norm is None and batch_norm:
        norm = "batch"
    if norm is not None and norm not in layers:
        raise ValueError(
            f"Unknown `norm`={norm!r}; expected None or one of {', '.join(map(repr, layers))}."
        )
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(input_shape)
    h = inputs
    for f in filters:
        h = keras.layers.Conv2D(f, 3, padding="same", use_bias=norm is None)(h)
        if norm is not None:
            h = layers[norm](f)(h)
        h = keras.layers.Activation("relu")(h)
        h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    outputs = keras.layers.Dense(classes, activation="softmax")(h)
    return model_cls(inputs, outputs, **model_kwargs)


#: The reordering controls (see :func:`reordered`), both used by Appendix A and chapter 8.
REORDERINGS = ("reversed", "shuffled")


#: A difference between two runs that compute the same updates counts as float round-off
#: (the book's round-off rule, :func:`roundoff_judgement`; in words :func:`roundoff_rule_words`)
#: when it is at most this many times the largest reordering control. Why a factor and not
#: "no larger than the controls": two or three controls sample the spread of round-off
#: thinly, and training amplifies it from update to update, so one more exact run can land a
#: few times beyond them; a wrong accumulation rule is off by far more (chapter 6 measures
#: the broken recipes).
#:
#: When the largest control is this factor squared (100) times the typical nonzero one or more
#: (:func:`controls_diverged`; typical: the smaller of two, the lower median of more,
#: :func:`typical_control`), the controls disagree on the size of round-off: within then needs
#: at most this many times the typical one, and a difference between that and this many times
#: the largest is undecided. The rule has a cliff at 100 times, on purpose: controls 1e-6 and
#: 0.99e-4 call a difference up to about 1e-3 within (10 times the larger), controls 1e-6 and
#: 1e-4 only up to 1e-5 (10 times the smaller; up to 1e-3 undecided). Two or three controls
#: cannot tell how much of a spread below 100 times is disagreement already; a smooth rule
#: would need that, so the book keeps the cliff and says which control it judged against
#: (:func:`roundoff_verdict`).
ROUNDOFF_FACTOR = 10


def _roundoff_inputs(difference: float, controls: Sequence[float]) -> tuple[float, list[float]]:
    """``difference`` and ``controls`` as floats, checked: distances (finite, >= 0), at least
    one control.

    Raises:
        ValueError: naming ``difference`` or ``controls``, for an empty ``controls`` or a
            negative, infinite or NaN value.
    """
    values = [float(c) for c in controls]
    if not values:
        raise ValueError("controls must hold at least one value (a reordering control's).")
    bad = [c for c in values if not math.isfinite(c) or c < 0]
    if bad:
        raise ValueError(f"`controls` must be non-negative finite numbers (distances from the "
                         f"reference), got {bad[0]!r} in {values!r}.")
    d = float(difference)
    if not math.isfinite(d) or d < 0:
        raise ValueError(f"`difference` must be a non-negative finite number (a distance from "
                         f"the reference), got {difference!r}.")
    return d, values


def _checked_controls(controls: Sequence[float]) -> list[float]:
    """``controls`` as floats, checked as :func:`_roundoff_inputs` checks them."""
    return _roundoff_inputs(0.0, controls)[1]


def roundoff_ratio(difference: float, controls: Sequence[float]) -> float:
    """``difference`` in units of the largest reordering control (same unit as both).

    Args:
        difference: how far a run ends from its reference (a ``relative_error``, a loss gap):
            finite, >= 0.
        controls: how far the reordering controls end from the same reference; at least one,
            each finite and >= 0.

    Returns:
        ``difference / max(controls)``; round-off by the book's rule needs at most
        :data:`ROUNDOFF_FACTOR` (and, when the controls disagree, at most that many times the
        typical nonzero control: :func:`roundoff_judgement`). If every control is 0: 0 for
        a zero difference, else inf.

    Raises:
        ValueError: for no controls, or a negative, infinite or NaN difference or control
            (the message names the argument).
    """
    d, values = _roundoff_inputs(difference, controls)
    largest = max(values)
    if largest == 0:  # the controls reproduced the reference bit for bit
        return 0.0 if d == 0 else math.inf
    return d / largest


def ratio_digits(ratio: float) -> str:
    """``ratio`` (a non-negative finite float) as the book prints ratios: two significant
    digits below 100, whole numbers with thousands separators from 100 ("1,234", never
    "1.2e+03").

    Raises:
        ValueError: for a negative, infinite or NaN ``ratio`` (no ratio of two distances).
    """
    if not math.isfinite(ratio) or ratio < 0:
        raise ValueError(f"`ratio` must be a non-negative finite number (a ratio of two "
                         f"distances), got {ratio!r}; compare the two values before wording them.")
    return f"{ratio:,.0f}" if ratio >= 99.5 else f"{ratio:.2g}"  # 99.6 would read "1e+02"


def times_words(ratio: float, whom: str) -> str:
    """``ratio`` (a non-negative finite float) as "<ratio> times <whom>", as
    :func:`roundoff_verdict` words it: two significant digits, whole numbers with thousands
    separators from 100 (never "1.5e+02 times"), "less than 0.0001 times" below 1e-4 (never
    "3.4e-05 times"), and "equal to <whom> to two significant digits" when the digits read 1
    (:func:`ratio_digits` raises for other ratios)."""
    digits = ratio_digits(ratio)
    if digits == "1":  # "1 times" would read as "equal"; say so, to what digits
        return f"equal to {whom} to two significant digits"
    if ratio < 1e-4:
        return f"less than 0.0001 times {whom}"
    return f"{digits} times {whom}"


def controls_diverged(controls: Sequence[float]) -> bool:
    """Whether the reordering controls disagree on the size of round-off: the largest is
    ``ROUNDOFF_FACTOR ** 2`` (100) times the typical nonzero control or more
    (:func:`typical_control`: the smaller of two, the lower median of more). Training can amplify
    one reordering's round-off far more than another's (chapter 3), or one control can end
    unusually close (a reordering that barely changes the sums); either way the largest is
    no yardstick for round-off on its own (:func:`roundoff_judgement`). A control of 0 (bit for
    bit) is left out, so it hides no disagreement of the others: ``[0, 1e-6, 1e-3]`` disagree,
    ``[0, 1e-3]`` do not. The median, not the smallest, of three or more: a control that ends
    near 0 by chance (a loss gap can) does not make the others disagree
    (``[1.8e-9, 2.5e-5, 2.5e-5]`` agree).

    At exactly 100 times the controls count as disagreeing: the rule has a cliff there (see
    :data:`ROUNDOFF_FACTOR`).

    Raises:
        ValueError: for no controls, or a negative, infinite or NaN control.
    """
    nonzero = [c for c in _checked_controls(controls) if c > 0]
    return len(nonzero) > 1 and max(nonzero) >= ROUNDOFF_FACTOR**2 * typical_control(nonzero)


def typical_control(controls: Sequence[float]) -> float:
    """The typical size of the nonzero reordering controls: the smaller of two, the lower
    median of more (``statistics.median_low``), 0 when all are 0.

    Raises:
        ValueError: for no controls, or a negative, infinite or NaN control.
    """
    nonzero = [c for c in _checked_controls(controls) if c > 0]
    return statistics.median_low(nonzero) if nonzero else 0.0


def roundoff_yardstick(controls: Sequence[float]) -> float:
    """The control the book's round-off rule judges a difference against: the largest, or the
    typical nonzero one (:func:`typical_control`) when the controls disagree
    (:func:`controls_diverged`). Within the rule (:func:`roundoff_within`) is
    ``difference <= ROUNDOFF_FACTOR * roundoff_yardstick``.

    Args:
        controls: how far the reordering controls end from the reference; at least one, each
            finite and >= 0.

    Returns:
        One of ``controls`` (0 when they are all 0).

    Raises:
        ValueError: for no controls, or a negative, infinite or NaN control.
    """
    values = _checked_controls(controls)
    return _yardstick(values, controls_diverged(values))


def _yardstick(values: list[float], diverged: bool) -> float:
    """:func:`roundoff_yardstick` of checked controls whose disagreement is already known."""
    return typical_control(values) if diverged else max(values)


def roundoff_judgement(difference: float, controls: Sequence[float]) -> str:
    """The book's round-off rule (:func:`roundoff_rule_words` states it) as one of three
    answers.

    Args:
        difference: how far a run ends from its reference (a ``relative_error``, a loss gap):
            finite, >= 0.
        controls: how far the reordering controls end from the same reference; at least one,
            each finite and >= 0.

    Returns:
        ``"within"`` when ``difference <= ROUNDOFF_FACTOR * roundoff_yardstick(controls)``
        (10 times the largest control, or 10 times the typical one when the largest is 100 or
        more times it); ``"undecided"`` when the controls disagree so (largest >= 100 times
        the typical) and ``difference`` is above 10 times the typical but at most 10 times the
        largest; ``"beyond"`` above 10 times the largest.

    Raises:
        ValueError: for no controls, or a negative, infinite or NaN difference or control
            (the message names the argument).
    """
    d, values = _roundoff_inputs(difference, controls)
    diverged = controls_diverged(values)  # once: it decides the yardstick and "undecided"
    if d <= ROUNDOFF_FACTOR * _yardstick(values, diverged):
        return "within"
    if diverged and d <= ROUNDOFF_FACTOR * max(values):
        return "undecided"
    return "beyond"


def roundoff_within(difference: float, controls: Sequence[float]) -> bool:
    """Whether :func:`roundoff_judgement` is ``"within"``.

    Returns:
        True when ``difference`` is at most 10 times the largest control and, if the largest
        is 100 or more times the typical nonzero control, at most 10 times the typical one;
        False otherwise (``"undecided"`` and ``"beyond"`` alike).

    Raises:
        ValueError: for no controls, or a negative, infinite or NaN difference or control
            (the message names the argument).
    """
    return roundoff_judgement(difference, controls) == "within"


def roundoff_rule_words() -> str:
    """The book's round-off rule (:func:`roundoff_judgement`) in a reader's words, controls that
    disagree included.

    Returns:
        "at most 10 times the largest reordering control; when that one is 100 or more times
        the typical nonzero one (the smaller of two, the lower median of more), the controls
        disagree on the size of round-off: at most 10 times the typical one is within, and
        between that and 10 times the largest the rule cannot decide" (10 is
        :data:`ROUNDOFF_FACTOR`, 100 its square; the typical one is :func:`typical_control`).
    """
    return (f"at most {ROUNDOFF_FACTOR} times the largest reordering control; when that one is "
            f"{ROUNDOFF_FACTOR**2} or more times the typical nonzero one (the smaller of two, the "
            "lower median of more), the controls disagree on the size of round-off: at most "
            f"{ROUNDOFF_FACTOR} times the typical one is within, and between that and "
            f"{ROUNDOFF_FACTOR} times the largest the rule cannot decide")


def roundoff_verdict(difference: float, controls: Sequence[float], beyond: str = "") -> str:
    """The book's round-off rule in words: ``difference`` against the reordering controls.

    Within the rule (:func:`roundoff_within`) means at most :data:`ROUNDOFF_FACTOR` times the
    largest control (:func:`roundoff_ratio`). When the largest is at least
    ``ROUNDOFF_FACTOR ** 2`` times the typical nonzero control (:func:`controls_diverged`), the
    controls disagree on the size of round-off: within needs at most ``ROUNDOFF_FACTOR`` times
    the typical one, and between that and that many times the largest the rule cannot decide
    (:func:`roundoff_judgement`).

    Args:
        difference: how far a run ends from its reference (a ``relative_error``, a loss gap):
            finite, >= 0.
        controls: how far the reordering controls end from the same reference; at least one,
            each finite and >= 0.
        beyond: what a difference beyond the rule means on the calling page, appended after
            a semicolon (nothing if empty).

    Returns:
        A phrase for a sentence, one per case below ("R" stands for "the book's round-off
        rule (at most 10 times)"; ratios to two significant digits, whole from 100).

        - One control: "3.2 times the reordering control: within R", or "20 times the
          reordering control: more than R allows; " followed by ``beyond``.
        - Two controls: "3.2 times the larger reordering control: within R" ("the largest"
          for more); below the larger, "below the larger reordering control and 1.7 times
          the smaller: within R"; "equal to the larger reordering control to two significant
          digits" when the ratio rounds to 1.
        - Controls that disagree (:func:`controls_diverged`): "the reordering controls are
          128 times apart, so they do not settle the size of round-off: 3 times the larger,
          385 times the smaller: R cannot decide; " followed by ``beyond``
          (:func:`roundoff_judgement` "undecided"), or "the reordering controls are 21,590
          times apart, so judged against the smaller too: 0.88 times it: within R"; for more
          than two, "the largest" and "the median".
        - A difference of 0: "equal to its reference bit for bit, closer than the reordering
          controls: within R".
        - All controls 0: "equal to its reference, as the reordering controls are: within R",
          or "not equal to its reference, though the reordering controls are: more than R
          allows; " followed by ``beyond``. A control of 0 beside nonzero ones is left out:
          the nonzero ones are the yardstick.

    Raises:
        ValueError: for no controls, or a negative, infinite or NaN difference or control
            (the message names the argument).
    """
    d, values = _roundoff_inputs(difference, controls)
    ratio = roundoff_ratio(d, values)
    rule = f"the book's round-off rule (at most {ROUNDOFF_FACTOR} times)"
    if ratio == 0 and max(values) == 0:
        return f"equal to its reference, as the reordering controls are: within {rule}"
    if d == 0:
        return ("equal to its reference bit for bit, closer than the reordering controls: "
                f"within {rule}")
    nonzero = [c for c in values if c > 0]
    largest = max(values)
    judgement = roundoff_judgement(d, values)
    within = judgement == "within"
    verdict = {"within": f"within {rule}", "undecided": f"{rule} cannot decide",
               "beyond": f"more than {rule} allows"}[judgement]
    if math.isinf(ratio):
        verdict = f"not equal to its reference, though the reordering controls are: {verdict}"
    elif controls_diverged(values):
        typical = typical_control(values)
        two = len(nonzero) == 2
        kind = ("nonzero reordering control" if len(nonzero) < len(values) else
                "reordering control")
        apart = (f"the {kind}s are {ratio_digits(largest / typical)} times apart" if two else
                 f"the largest {kind} is {ratio_digits(largest / typical)} times their median")
        big, small = ("the larger", "the smaller") if two else ("the largest", "the median")
        if len(nonzero) < len(values):  # a control of 0 is not the one judged against
            small = f"{small} nonzero one"
        if within:
            verdict = (f"{apart}, so judged against {small} too: "
                       f"{times_words(d / typical, 'it')}: {verdict}")
        else:
            settle = (", so they do not settle the size of round-off"
                      if judgement == "undecided" else "")
            verdict = (f"{apart}{settle}: {times_words(ratio, big)}, "
                       f"{times_words(d / typical, small)}: {verdict}")
    else:
        which = ("the reordering control" if len(values) == 1 else
                 "the larger reordering control" if len(values) == 2 else
                 "the largest reordering control")
        against = times_words(ratio, which)
        smallest = min(values)
        if ratio < 1 and len(values) > 1 and smallest > 0 and ratio_digits(ratio) != "1":
            least = "the smaller" if len(values) == 2 else "the smallest"
            against = f"below {which} and {times_words(d / smallest, least)}"
        verdict = f"{against}: {verdict}"
    return verdict if within or not beyond else f"{verdict}; {beyond}"


def reordered(batch: Sequence, how: str, seed: int = 0) -> tuple:
    """``batch`` (a tuple of arrays with one row per sample) with its samples in another order.

    The book's *reordering control*: the same training with every batch's samples in another
    order sums the same numbers in another order, so its distance from the original run is
    float32 round-off as that training amplifies it: the yardstick for a run that claims to
    be "the same training" (accumulated, on several replicas, ...), not zero.

    Args:
        batch: ``(x, y)`` or ``(x, y, sample_weight)``.
        how: ``"reversed"`` or ``"shuffled"`` (one of :data:`REORDERINGS`).
        seed: the shuffle's seed; the same seed gives every batch of one size the same
            permutation.

    Returns:
        The reordered arrays, as a tuple.
    """
    n = len(batch[0])
    if how == "reversed":
        order = np.arange(n)[::-1]
    elif how == "shuffled":
        order = np.random.default_rng(seed).permutation(n)
    else:
        raise ValueError(f"Unknown reordering {how!r}; expected one of {REORDERINGS}.")
    return tuple(np.asarray(a)[order] for a in batch)


def large_batch_reference(
    build_model: Callable[[], keras.Model],
    make_optimizer: Callable[[], keras.optimizers.Optimizer],
    loss: Any,
    batches: Sequence[tuple],
    reorder: str | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Independent reference: plain ``train_on_batch`` on each large batch, in order.

    Args:
        build_model: returns a fresh plain model with the same initial weights as the
            accumulated model it is compared with.
        make_optimizer: returns a fresh optimizer (same settings).
        loss: the loss for ``compile``.
        batches: large batches ``(x, y)`` or ``(x, y, sample_weight)``; each is one update.
        reorder: ``None``, or a reordering control (``"reversed"``, ``"shuffled"``): every
            batch's samples in that order (see :func:`reordered`).

    Returns:
        ``(initial_weights, final_weights)``.
    """
    model = build_model()
    initial = get_weights(model)
    model.compile(make_optimizer(), loss)
    for batch in batches:
        model.train_on_batch(*(batch if reorder is None else reordered(batch, reorder)))
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


def tie_threshold(accuracy: float, n: int) -> float:
    """The accuracy difference below which two runs scored on the same ``n`` samples are a tie.

    Twice the standard error of an accuracy ``p`` measured on ``n`` samples,
    ``2 * sqrt(p * (1 - p) / n)`` (a fraction, like ``accuracy``): what the finite evaluation
    set alone makes uncertain. Other seeds (initialisation, data order) add more, so a gap
    below this says nothing about which run is better; one above it is still one seed's
    measurement. Evaluate it for your own runs: ``tie_threshold(accuracy, n)``.
    """
    if n < 1 or not 0.0 <= accuracy <= 1.0:
        raise ValueError(f"Need n >= 1 and 0 <= accuracy <= 1; got n={n}, accuracy={accuracy}.")
    return 2.0 * math.sqrt(accuracy * (1.0 - accuracy) / n)


def compare(a: float, b: float, tie: float) -> int:
    """``1`` if ``a > b + tie``, ``-1`` if ``a < b - tie``, else ``0`` (a tie)."""
    return 0 if abs(a - b) <= tie else (1 if a > b else -1)


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
        samples: ``(n_points,)`` training samples seen at each evaluation point (0 = initial
            weights).
        train_loss: ``(n_points,)`` loss (nats) on a fixed subset of the training data, at each
            evaluation point's weights.
        test_loss: ``(n_points,)`` loss (nats) on the test data.
        test_accuracy: ``(n_points,)`` accuracy (fraction) on the test data.
        epoch_seconds: wall time of each epoch's ``fit`` (seconds), evaluation excluded.
        updates: optimizer updates applied in total.
        initial_weights: all model weights before training.
        final_weights: all model weights after training.
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
    progress: Callable[[str], None] | None = None,
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
        x_train: ``(n, ...)`` training inputs (preprocessed).
        y_train: ``(n,)`` integer training labels.
        x_test: held-out inputs for the test curves, shaped like ``x_train``.
        y_test: integer labels of ``x_test``.
        configs: ``{name: (micro_batch, accum_steps)}``, e.g.
            ``{"batch 64": (64, 1), "4 x 16": (16, 4), "batch 16": (16, 1)}``.
        make_optimizer: returns a fresh optimizer (same settings for every configuration).
        build_model: ``build_model(seed=..., [model_cls=AccumModel, accum_steps=K])``, e.g.
            :func:`mlp` or :func:`conv_net`, compiled here with sparse categorical
            cross-entropy.
        epochs: passes over the training data.
        eval_every: spacing of the evaluation points in training samples; must be a multiple
            of every configuration's ``b * K`` so that they fall on window boundaries.
        n_train_eval: size of the training subset used for the training-loss curve.
        seed: weights seed (via ``build_model``) and data-order seed.
        verbose: print one line per configuration and epoch.
        progress: called with that line too, also when ``verbose`` is false. Default
            ``None``: nothing is printed. Pass ``print`` or your own logger to follow a long
            run.

    Returns:
        ``{name: CompareRun}`` in the order of ``configs``.
    """
    from accumcore import AccumModel

    if not configs:
        raise ValueError("`configs` is empty: pass e.g. {'batch 64': (64, 1), '4 x 16': (16, 4)}.")
    for name, (b, k) in configs.items():
        if eval_every % (b * k):
            raise ValueError(
                f"`eval_every`={eval_every} must be a multiple of the effective batch b*K="
                f"{b * k} of configuration {name!r}, so that evaluation points fall on window "
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
            line = (f"{name}: epoch {epoch + 1}/{epochs}, {run.epoch_seconds[-1]:.1f} s, "
                    f"test accuracy {points[-1][3]:.4f}")
            if verbose:
                print(line)
            (progress or book_progress)(line)
        run.updates = int(model.optimizer.iterations.numpy())
        run.final_weights = get_weights(model)
        arr = np.asarray(points, np.float64)
        run.samples = arr[:, 0].astype(np.int64)
        run.train_loss, run.test_loss, run.test_accuracy = arr[:, 1], arr[:, 2], arr[:, 3]
        runs[name] = run
    return runs


class LinearWarmup(keras.optimizers.schedules.LearningRateSchedule):
    """Linear learning-rate warm-up (Goyal et al., 2017), then a constant rate.

    ``lr(step) = peak * min(1, (step + 1) / warmup_steps)`` where ``step`` counts optimizer
    updates (windows, with accumulation), starting at 0.

    Args:
        peak: the learning rate after warm-up (a float, or a scalar variable so that a sweep
            can change it without retracing).
        warmup_steps: number of updates over which the rate rises linearly (>= 1).
    """

    def __init__(self, peak: float, warmup_steps: int) -> None:
        if warmup_steps < 1:
            raise ValueError(f"`warmup_steps` must be >= 1 update, got {warmup_steps}.")
        self.peak = peak
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step):
        fraction = (keras.ops.cast(step, "float32") + 1.0) / float(self.warmup_steps)
        return self.peak * keras.ops.minimum(1.0, fraction)

    def get_config(self) -> dict:
        return {"peak": float(np.asarray(self.peak)), "warmup_steps": self.warmup_steps}


OPTIMIZERS = ("sgd", "adam")


def make_optimizer(name: str, learning_rate: Any) -> keras.optimizers.Optimizer:
    """``"sgd"`` (plain SGD, no momentum) or ``"adam"`` (Keras defaults) at ``learning_rate``."""
    if name == "sgd":
        return keras.optimizers.SGD(learning_rate)
    if name == "adam":
        return keras.optimizers.Adam(learning_rate)
    raise ValueError(f"Unknown optimizer {name!r}; expected one of {OPTIMIZERS}.")


def scaled_learning_rate(base_lr: float, base_batch: int, batch: int, rule: str) -> float:
    """The learning rate for batch ``batch`` from ``base_lr`` tuned at ``base_batch``.

    ``rule="linear"``: ``base_lr * batch / base_batch`` (Goyal et al., 2017);
    ``rule="sqrt"``: ``base_lr * sqrt(batch / base_batch)`` (Krizhevsky, 2014; Hoffer et al.,
    2017); ``rule="constant"``: ``base_lr``.
    """
    ratio = batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * float(np.sqrt(ratio))
    if rule == "constant":
        return base_lr
    raise ValueError(f"Unknown scaling `rule`={rule!r}; expected 'linear', 'sqrt' or 'constant'.")


def scaling_exponent(batch_sizes: Sequence[int], learning_rates: Sequence[float]) -> float:
    """Least-squares slope of ``log lr`` against ``log B`` (1 = linear rule, 0.5 = sqrt rule)."""
    b = np.log(np.asarray(batch_sizes, np.float64))
    lr = np.log(np.asarray(learning_rates, np.float64))
    if len(b) < 2 or np.ptp(b) == 0:
        raise ValueError("Need at least two different batch sizes to fit a scaling exponent.")
    return float(np.polyfit(b, lr, 1)[0])


@contextlib.contextmanager
def _quiet_accumcore_log():
    """Raise the ``accumcore`` logger to ERROR for the block (its warnings are not shown)."""
    log = logging.getLogger("accumcore")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


class _AccumRunner:
    """One model + :class:`accumcore.AccumTrainer` reused across learning rates (one trace).

    Between runs the weights are restored, every optimizer variable (iterations, slots) is
    zeroed and the accumulation window emptied, so each run starts exactly like a fresh one;
    only the learning rate changes (a variable: the traced epoch is reused).
    """

    def __init__(self, optimizer_name: str, micro_batch: int, accum_steps: int, *,
                 warmup_steps: int, build_model: Callable[..., keras.Model], seed: int,
                 mode: str = "graph") -> None:
        from accumcore import AccumTrainer

        self.model = build_model(seed=seed)
        self.initial = self.model.get_weights()
        self.peak = keras.Variable(1.0, trainable=False, dtype="float32", name="peak_lr")
        self.warmup_steps = warmup_steps
        lr = LinearWarmup(self.peak, warmup_steps) if warmup_steps else 1.0
        self.optimizer = make_optimizer(optimizer_name, lr)
        self.micro_batch = micro_batch
        self.mode = mode
        self.trainer = AccumTrainer(self.model, self.optimizer,
                                    "sparse_categorical_crossentropy", accum_steps=accum_steps)

    def run(self, learning_rate: float, datasets: Sequence, x_val: np.ndarray,
            y_val: np.ndarray) -> dict[str, Any]:
        from accumcore import NonFiniteGradientError

        state = self.trainer.state
        if state.built:
            state.drop_window()  # every run starts with an empty window
            with _quiet_accumcore_log():
                state.clear_nonfinite()
            for v in self.optimizer.variables:
                v.assign(keras.ops.zeros_like(v))
            before = int(state.windows_applied.numpy())
        else:
            before = 0
        self.model.set_weights(self.initial)
        if self.warmup_steps:
            self.peak.assign(learning_rate)
        else:  # a float learning rate is a variable owned by the optimizer
            self.optimizer.learning_rate = learning_rate
        diverged = False
        seconds = 0.0
        by_epoch: list[tuple[float, float]] = []  # (loss, accuracy) after each epoch
        for dataset in datasets:
            start = time.perf_counter()
            try:
                self.trainer.fit(dataset, epochs=1, mode=self.mode, verbose=0)
            except NonFiniteGradientError:
                diverged = True
            seconds += time.perf_counter() - start
            val_loss, val_acc = (float("nan"), float("nan")) if diverged else evaluate(
                self.model, x_val, y_val)
            if not np.isfinite(val_loss):
                diverged, val_loss, val_acc = True, float("nan"), float("nan")
            by_epoch.append((val_loss, val_acc))
            if diverged:
                break
        while len(by_epoch) < len(datasets):  # a diverged run stays diverged
            by_epoch.append((float("nan"), float("nan")))
        val_loss, val_acc = by_epoch[-1]
        return {"val_loss": val_loss, "val_accuracy": val_acc, "diverged": diverged,
                "val_loss_by_epoch": [v[0] for v in by_epoch],
                "val_accuracy_by_epoch": [v[1] for v in by_epoch],
                "updates": int(state.windows_applied.numpy()) - before, "seconds": seconds}


def epoch_datasets(x: np.ndarray, y: np.ndarray, micro_batch: int, epochs: int, seed: int = 0):
    """One ``tf.data.Dataset`` of micro-batches per epoch, in :func:`epoch_orders` order.

    The arrays are copied to a host (CPU) tensor once; each epoch's dataset gathers from it by
    index, so many runs can share the datasets (and so the exact data order) without copying
    the data.
    """
    import tensorflow as tf

    with tf.device("/cpu:0"):  # tf.data runs on the host; keep the data there on GPU machines
        xs, ys = tf.constant(x), tf.constant(y)
    return [
        tf.data.Dataset.from_tensor_slices(order).batch(micro_batch)
        .map(lambda i: (tf.gather(xs, i), tf.gather(ys, i)))
        for order in epoch_orders(len(x), epochs, seed)
    ]


def train_accumulated(
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_val: np.ndarray,
    y_val: np.ndarray,
    *,
    optimizer: str,
    learning_rate: float,
    micro_batch: int,
    accum_steps: int,
    epochs: int = 1,
    warmup_steps: int = 0,
    build_model: Callable[..., keras.Model] = mlp,
    seed: int = 0,
    mode: str = "graph",
) -> dict[str, Any]:
    """Train ``build_model(seed=seed)`` with :class:`accumcore.AccumTrainer`.

    Micro-batches of ``micro_batch`` samples, ``accum_steps`` per update (effective batch
    ``micro_batch * accum_steps``), data order from :func:`epoch_orders` (identical for every
    call with the same ``seed`` and data size). A non-finite gradient (divergence) stops the run.

    Args:
        optimizer: ``"sgd"`` or ``"adam"`` (see :func:`make_optimizer`).
        learning_rate: the (peak) learning rate.
        warmup_steps: linear warm-up over this many updates (0 = none), see
            :class:`LinearWarmup`.
        mode: the :meth:`accumcore.AccumTrainer.fit` mode: ``"graph"`` (the default) traces
            one epoch, ``"function"`` one micro-batch.

    Returns:
        A dict with these keys (loss and accuracy are NaN when the run diverged, from the
        epoch in which it diverged on).

        * ``"val_loss"``: the final validation loss, in nats;
        * ``"val_accuracy"``: the final validation accuracy, a fraction;
        * ``"diverged"``: bool, whether the run diverged;
        * ``"updates"``: int, the optimizer updates made;
        * ``"seconds"``: the wall time of training;
        * ``"val_loss_by_epoch"`` (nats) and ``"val_accuracy_by_epoch"`` (fractions): lists,
          one value per epoch.
    """
    runner = _AccumRunner(optimizer, micro_batch, accum_steps, warmup_steps=warmup_steps,
                          build_model=build_model, seed=seed, mode=mode)
    datasets = epoch_datasets(x_train, y_train, micro_batch, epochs, seed)
    return runner.run(learning_rate, datasets, x_val, y_val)


class SweepResult:
    """A learning-rate x effective-batch grid of validation results (see :func:`lr_sweep`).

    Attributes:
        optimizer: ``"sgd"`` or ``"adam"``.
        warmup_epochs: linear warm-up length in epochs (0 = none).
        learning_rates: ``(n_lr,)`` the grid's (peak) learning rates.
        batch_sizes: ``(n_b,)`` effective batch sizes B = K * b (samples per update).
        accuracy: ``(n_lr, n_b)`` validation accuracy (fraction) after the last epoch; NaN
            where the run diverged.
        loss: ``(n_lr, n_b)`` validation loss (nats) after the last epoch; NaN where diverged.
        accuracy_by_epoch: ``(epochs, n_lr, n_b)`` validation accuracy after each epoch (the
            same runs, evaluated on the way: shorter budgets at no extra training).
        loss_by_epoch: ``(epochs, n_lr, n_b)`` validation loss after each epoch (nats).
        micro_batches: ``(n_b,)`` the micro-batch size b used for each batch size (K = B / b).
        updates: ``(n_b,)`` optimizer updates per run for each batch size.
        seconds: wall time of the whole sweep (seconds).
    """

    def __init__(self, optimizer: str, warmup_epochs: float, learning_rates: Sequence[float],
                 batch_sizes: Sequence[int], epochs: int = 1,
                 micro_batches: Sequence[int] | None = None) -> None:
        self.optimizer = optimizer
        self.warmup_epochs = warmup_epochs
        self.learning_rates = np.asarray(learning_rates, np.float64)
        self.batch_sizes = np.asarray(batch_sizes, np.int64)
        self.micro_batches = np.asarray(
            batch_sizes if micro_batches is None else micro_batches, np.int64)
        shape = (len(self.learning_rates), len(self.batch_sizes))
        self.accuracy_by_epoch = np.full((epochs, *shape), np.nan)
        self.loss_by_epoch = np.full((epochs, *shape), np.nan)
        self.updates = np.zeros(len(self.batch_sizes), np.int64)
        self.seconds = 0.0

    @property
    def accuracy(self) -> np.ndarray:
        """``(n_lr, n_b)`` validation accuracy after the last epoch (NaN = diverged)."""
        return self.accuracy_by_epoch[-1]

    @property
    def loss(self) -> np.ndarray:
        """``(n_lr, n_b)`` validation loss after the last epoch (nats; NaN = diverged)."""
        return self.loss_by_epoch[-1]

    def best_lr_after(self, epochs: int) -> np.ndarray:
        """``(n_b,)`` the best learning rate per batch size after ``epochs`` epochs (1-based)."""
        acc = self.accuracy_by_epoch[epochs - 1]
        return self.learning_rates[np.argmax(np.where(np.isfinite(acc), acc, -np.inf), axis=0)]

    @property
    def largest_stable_lr(self) -> np.ndarray:
        """``(n_b,)`` the largest learning rate of the grid that trained (above 20 % accuracy:
        not diverged, not stuck at chance), per batch size; NaN if none did."""
        ok = np.where(np.isfinite(self.accuracy), self.accuracy, 0.0) > 0.2
        out = np.full(len(self.batch_sizes), np.nan)
        for j in range(len(self.batch_sizes)):
            rows = np.flatnonzero(ok[:, j])
            if rows.size:
                out[j] = self.learning_rates[rows.max()]
        return out

    @property
    def best_index(self) -> np.ndarray:
        """``(n_b,)`` row index of the best validation accuracy per batch size (NaN = worst)."""
        acc = np.where(np.isfinite(self.accuracy), self.accuracy, -np.inf)
        return np.argmax(acc, axis=0)

    @property
    def best_lr(self) -> np.ndarray:
        """``(n_b,)`` the learning rate with the best validation accuracy, per batch size."""
        return self.learning_rates[self.best_index]

    @property
    def best_accuracy(self) -> np.ndarray:
        """``(n_b,)`` the best validation accuracy per batch size (fraction)."""
        return self.accuracy[self.best_index, np.arange(len(self.batch_sizes))]

    def tied(self, tie: float, epochs: int | None = None) -> np.ndarray:
        """``(n_lr, n_b)`` True where a learning rate is within ``tie`` of its batch size's best.

        ``tie`` is an accuracy difference (a fraction, e.g. from :func:`tie_threshold`);
        ``epochs`` (1-based) picks the evaluation after that many epochs (default: the last).
        Diverged runs are never tied.
        """
        acc = self.accuracy if epochs is None else self.accuracy_by_epoch[epochs - 1]
        acc = np.where(np.isfinite(acc), acc, -np.inf)
        return acc >= acc.max(axis=0, keepdims=True) - tie

    def exponent_range(self, tie: float) -> tuple[float, float]:
        """The smallest and largest :func:`scaling_exponent` over every choice of one tied
        learning rate (see :meth:`tied`) per batch size: how far ties move the exponent."""
        choices = [self.learning_rates[np.flatnonzero(column)] for column in self.tied(tie).T]
        alphas = [scaling_exponent(self.batch_sizes, combo)
                  for combo in itertools.product(*choices)]
        return min(alphas), max(alphas)

    @property
    def diverged(self) -> np.ndarray:
        """``(n_lr, n_b)`` True where the run diverged (non-finite gradient or loss)."""
        return ~np.isfinite(self.accuracy)

    def __repr__(self) -> str:
        return (f"SweepResult({self.optimizer!r}, warmup_epochs={self.warmup_epochs}, "
                f"lrs={self.learning_rates.tolist()}, batches={self.batch_sizes.tolist()})")


def lr_sweep(
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_val: np.ndarray,
    y_val: np.ndarray,
    *,
    optimizer: str,
    learning_rates: Sequence[float],
    batch_sizes: Sequence[int],
    micro_batch: int | Sequence[int] = 16,
    epochs: int = 1,
    warmup_epochs: float = 0.0,
    build_model: Callable[..., keras.Model] = mlp,
    seed: int = 0,
    mode: str = "graph",
    verbose: bool = False,
    progress: Callable[[str], None] | None = None,
) -> SweepResult:
    """Validation accuracy over a learning-rate x effective-batch grid, by accumulation.

    Every effective batch B is reached with micro-batches of b samples and ``K = B / b``
    accumulation steps (so memory use is that of batch b for every B); b is ``micro_batch``,
    or ``micro_batch[j]`` for ``batch_sizes[j]`` when a sequence is given (one window is the
    large batch's update to float round-off, whatever b; over many updates that round-off can
    grow, as appendix A measures).
    All runs start from the same weights and see the same micro-batches in the same order, for
    the same number of epochs (so a larger B makes fewer updates). One model and one traced
    epoch per batch size are reused across the learning rates.

    Args:
        x_train: ``(n, ...)`` training inputs.
        y_train: ``(n,)`` integer training labels.
        x_val: validation inputs, shaped like ``x_train``.
        y_val: integer labels of ``x_val``.
        optimizer: ``"sgd"`` or ``"adam"``.
        learning_rates: the grid (peak learning rates when warming up).
        batch_sizes: effective batch sizes; each a multiple of its micro-batch size.
        micro_batch: b, samples per micro-batch: one int, or one per batch size.
        epochs: passes over the training data per run.
        warmup_epochs: linear warm-up length in epochs (0 = none); ``round(warmup_epochs * n /
            B)`` updates (at least 1) for batch size B.
        build_model: ``build_model(seed=...)``, e.g. :func:`mlp`.
        seed: weights and data-order seed.
        mode: the :meth:`accumcore.AccumTrainer.fit` mode (see :func:`train_accumulated`).
        verbose: print one line per run.
        progress: called with a one-line message after each run. Default ``None``: nothing
            is printed. Pass ``print`` or your own logger to follow a long run.

    Returns:
        A :class:`SweepResult`.
    """
    if isinstance(micro_batch, (int, np.integer)):
        micro_batches = [int(micro_batch)] * len(batch_sizes)
    else:
        micro_batches = [int(b) for b in micro_batch]
        if len(micro_batches) != len(batch_sizes):
            raise ValueError(
                f"`micro_batch` has {len(micro_batches)} entries but `batch_sizes` has "
                f"{len(batch_sizes)}: give one int, or one micro-batch size per batch size."
            )
    for batch, b in zip(batch_sizes, micro_batches):
        if batch % b:
            raise ValueError(
                f"Every batch size must be a multiple of its `micro_batch` (B = K * b): "
                f"got B = {batch} with b = {b}."
            )
    result = SweepResult(optimizer, warmup_epochs, learning_rates, batch_sizes, epochs,
                         micro_batches)
    datasets_by_b: dict[int, list] = {}
    start = time.perf_counter()
    total, done = len(batch_sizes) * len(learning_rates), 0
    for j, (batch, b) in enumerate(zip(batch_sizes, micro_batches)):
        if b not in datasets_by_b:
            datasets_by_b[b] = epoch_datasets(x_train, y_train, b, epochs, seed)
        warmup = max(1, round(warmup_epochs * len(x_train) / batch)) if warmup_epochs else 0
        runner = _AccumRunner(optimizer, b, batch // b, warmup_steps=warmup,
                              build_model=build_model, seed=seed, mode=mode)
        for i, lr in enumerate(learning_rates):
            out = runner.run(float(lr), datasets_by_b[b], x_val, y_val)
            result.accuracy_by_epoch[:, i, j] = out["val_accuracy_by_epoch"]
            result.loss_by_epoch[:, i, j] = out["val_loss_by_epoch"]
            result.updates[j] = max(result.updates[j], out["updates"])
            done += 1
            score = ("diverged" if out["diverged"]
                     else f"accuracy {100 * out['val_accuracy']:.2f}%")
            line = (f"{optimizer}{' + warm-up' if warmup_epochs else ''} B={batch} "
                    f"({batch // b} x {b}) lr={lr:g}: {score} ({out['seconds']:.1f} s) "
                    f"[run {done}/{total}]")
            if verbose:
                print(line)
            (progress or book_progress)(line)
    result.seconds = time.perf_counter() - start
    return result


# ----------------------------------------------------------------- several seeds, one decision


def seed_spread(values: Sequence[float]) -> float:
    """``max - min`` of one measurement repeated over seeds (same units; 0 for one seed)."""
    values = np.asarray(values, np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"Need a non-empty 1-D sequence of values; got shape {values.shape}.")
    return float(values.max() - values.min())


def count_by_tie(a: Sequence[float], b: Sequence[float], tie: float) -> tuple[int, int, int]:
    """Seed by seed, :func:`compare` of ``a[i]`` with ``b[i]``: how many times ``a`` is lower
    beyond ``tie``, tied (``|a - b| <= tie``) and higher beyond ``tie``, as
    ``(lower, tied, higher)`` (same units as ``a``, ``b`` and ``tie``)."""
    signs = [compare(float(x), float(y), tie) for x, y in zip(a, b, strict=True)]
    return signs.count(-1), signs.count(0), signs.count(1)


def tie_counts_sentence(window: Sequence[float], stock: Sequence[float], tie: float) -> str:
    """How often stock BN scored higher than window-level BN beyond ``tie``, tied, and lower,
    over the seeds (accuracies as fractions, the i-th of each from seed i; :func:`count_by_tie`):
    the counts clause of :func:`batchnorm_advice`. Where one layer was higher on every seed
    but not always beyond ``tie`` (:func:`higher_on_every_seed`), the clause says both in
    one measure each: "stock BN's accuracy was above window-level BN's on all 3 seeds, beyond
    the tie threshold on one only"."""
    return _tie_counts_words(count_by_tie(window, stock, tie),
                             higher_on_every_seed(window, stock))


def _tie_counts_words(counts: tuple[int, int, int], side: str = "") -> str:
    """:func:`tie_counts_sentence` from ``count_by_tie(window, stock, tie)`` and ``side``
    (:func:`higher_on_every_seed`): only the outcomes that occurred, e.g. "over the 3 seeds, by
    the tie threshold, stock BN scored higher on one, tied on one and scored lower on one" or
    "by the tie threshold, stock BN tied on both seeds" (never "on 0")."""
    seeds, beyond = sum(counts), counts[0] if side == "stock BN" else counts[2]
    if side and beyond < seeds:  # the same side higher on every seed, not always beyond
        other = "window-level BN" if side == "stock BN" else "stock BN"
        how = (f"beyond the tie threshold on {'one' if beyond == 1 else beyond} only" if beyond
               else f"{'' if seeds == 1 else 'each time '}within the tie threshold")
        return f"{side}'s accuracy was above {other}'s on {_seed_words(seeds, every=True)}, {how}"
    outcomes = [(n, what) for n, what in zip(counts, ("scored higher", "tied", "scored lower"),
                                             strict=True) if n]
    if len(outcomes) == 1:
        return (f"by the tie threshold, stock BN {outcomes[0][1]} on "
                f"{_seed_words(seeds, every=True)}")
    said = [f"{what} on {'one' if n == 1 else n}" for n, what in outcomes]
    return (f"over the {seeds} seeds, by the tie threshold, stock BN "
            f"{', '.join(said[:-1])} and {said[-1]}")


def _seed_words(seeds: int, every: bool = False) -> str:
    """A count of seeds in words: "one seed", "2 seeds"; with ``every`` "the one seed", "both
    seeds", "all 3 seeds"."""
    if seeds == 1:
        return "the one seed" if every else "one seed"
    if every:
        return "both seeds" if seeds == 2 else f"all {seeds} seeds"
    return f"{seeds} seeds"


#: The cases of :func:`batchnorm_advice`.
BATCHNORM_ADVICE_CASES = ("stock higher", "window higher", "same direction",
                          "no consistent difference", "normalisation")


def higher_on_every_seed(window: Sequence[float], stock: Sequence[float]) -> str:
    """Which BN layer scored higher on every seed, ties or not: ``"stock BN"``,
    ``"window-level BN"``, or ``""`` when the sign of ``window - stock`` varies or is 0 on a
    seed (accuracies as fractions, the i-th of each from seed i): the direction that
    :func:`batchnorm_advice` reports as its ``"same direction"`` case."""
    window, stock = _per_seed(window, stock)
    gap = window - stock
    return "stock BN" if np.all(gap < 0) else "window-level BN" if np.all(gap > 0) else ""


def _per_seed(*accuracies: Sequence[float]) -> tuple[np.ndarray, ...]:
    """``accuracies`` (window-level BN's, stock BN's[, the target's]) as float64 arrays after
    checking that each holds one finite accuracy per seed, the same seeds."""
    arrays = tuple(np.asarray(a, np.float64) for a in accuracies)
    if not arrays[0].size or any(a.shape != arrays[0].shape for a in arrays):
        raise ValueError("Need one accuracy per seed for window-level BN, stock BN (and the "
                         f"target): got {', '.join(str(a.size) for a in arrays)}; pass "
                         "sequences of equal length, one value per seed.")
    if not all(np.isfinite(a).all() for a in arrays):
        raise ValueError("The accuracies must be finite numbers (fractions of the test set).")
    return arrays


def batchnorm_advice(window: Sequence[float], stock: Sequence[float],
                     target: Sequence[float], tie: float) -> tuple[str, str]:
    """Which BatchNorm layer to use under accumulation, from per-seed test accuracies.

    ``window`` (:class:`accumcore.WindowBatchNormalization`) and ``stock``
    (``keras.layers.BatchNormalization``), both trained with accumulation, and ``target``
    (stock BN, plain batches of B): accuracies as fractions, the i-th of each from seed i (the
    same initial weights and data order). One tie rule throughout (e.g. :func:`tie_threshold`
    on the test set): window-level BN *reproduces* the target when on every seed
    ``|window - target| <= tie``; the statistics gap's cost is ``window - stock`` per seed,
    counted as stock higher beyond the tie, tied, or window higher beyond the tie
    (:func:`count_by_tie`); one side higher on every seed, not always beyond the tie, is
    ``"same direction"`` (:func:`higher_on_every_seed`). Returns ``(case, advice)``: ``case``
    one of ``BATCHNORM_ADVICE_CASES``, ``advice`` a sentence in percentage points.

    Raises:
        ValueError: if the sequences are empty, differ in length or hold a non-finite value.
    """
    window, stock, target = _per_seed(window, stock, target)
    if not np.isfinite(tie):
        raise ValueError(f"`tie` must be a finite number (a fraction), got {tie!r}.")
    seeds, worst = window.size, 100 * float(np.max(np.abs(window - target)))
    if worst > 100 * tie:
        return "normalisation", (
            f"window-level BN, whose moving statistics are close to the large batch's, was up to "
            f"{worst:.2f} points from the target on a seed, more than the tie threshold of "
            f"{100 * tie:.2f}: the normalisation gap (each micro-batch normalised with its "
            "own moments) shows; to reproduce large-batch training, use a batch-independent "
            "normalisation (GroupNormalization, LayerNormalization)")
    stock_higher, tied, window_higher = seed_counts = count_by_tie(window, stock, tie)
    side = higher_on_every_seed(window, stock)  # on every seed, not always beyond the tie
    counts = _tie_counts_words(seed_counts, side)
    reproduced = (f"window-level BN reproduced the large batch (within {worst:.2f} points of "
                  f"it on every seed, at most the tie threshold of {100 * tie:.2f}); {counts}")
    if stock_higher == seeds:
        return "stock higher", (
            f"{reproduced}: here reproducing the large batch cost accuracy. Use "
            "WindowBatchNormalization to reproduce or compare with a large-batch recipe; "
            "where only accuracy counts, measure stock BN against it on held-out "
            "data, as this page did")
    if window_higher == seeds:
        return "window higher", (
            f"{reproduced}: use WindowBatchNormalization (convert_batchnorm on an existing "
            "model)")
    low, high = (100 * float(extreme(window - stock)) for extreme in (np.min, np.max))
    spread = "Window-level minus stock BN " + (
        f"was {low:+.2f} points on {_seed_words(seeds, every=True)}"
        if f"{low:+.2f}" == f"{high:+.2f}" else
        f"ranged from {low:+.2f} to {high:+.2f} points over the {_seed_words(seeds)}")
    if side:
        return "same direction", (
            f"{reproduced}, so a {'cost' if side == 'stock BN' else 'gain'} of reproducing the "
            f"large batch is possible, and {_seed_words(seeds)} cannot size it. {spread}; "
            "before choosing for accuracy, compare both on more seeds of your own model")
    return "no consistent difference", (
        f"{reproduced}: no consistent cost or gain measured. {spread}: too few to tell "
        "whether the statistics gap costs or gains accuracy on this net; before choosing for "
        "accuracy, compare both on more seeds of your own model")
