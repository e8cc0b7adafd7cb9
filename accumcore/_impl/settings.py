"""The accumulation settings: what each one accepts, checked in one place, and the object
that holds them.

Every entry point (``accumulate``, ``AccumModel``, ``AccumTrainer``, ``AccumulationState``,
``ResumableLoop``) builds its settings with :func:`resolve`; each check lives once, in
:data:`CHECKS`. Adding a setting is one :class:`Settings` field and its check. Every check
raises an error that names the offending parameter and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

from accumcore._impl.nonfinite import POLICIES, NonFinitePolicy, nonfinite_policy

#: What happens to a partially filled window when an epoch ends.
END_OF_EPOCH_POLICIES = ("apply", "carry", "drop")

#: How the summed loss of a window is normalised (see :class:`accumcore.AccumulationState`).
NORMALIZERS = ("auto", "samples", "sample_weight")

#: What ``micro_batch_size`` accepts besides a positive int, for a b found on the device by
#: running the real step (``accumcore._impl.auto_micro_batch``).
AUTO = "auto"


def check_positive_int(value: Any, name: str, *, meaning: str = "") -> int:
    """Return ``value`` as an ``int`` after checking it is a positive integer (a count or size).

    Args:
        value: the value passed for parameter ``name``.
        name: the parameter's name, for the messages.
        meaning: what the number is, added to the messages in parentheses (optional).

    Raises:
        TypeError: for ``bool``, ``float`` or any non-integer value.
        ValueError: for zero or negative values.
    """
    about = f" ({meaning})" if meaning else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{name}` must be a positive int{about}, got {value!r} of type "
            f"{type(value).__name__}."
        )
    if value < 1:
        raise ValueError(f"`{name}` must be >= 1{about}, got {value}.")
    return int(value)


def check_accum_steps(accum_steps: Any) -> int:
    """Return ``accum_steps`` (K) as an ``int`` after checking it is a positive integer; the
    messages explain K (other counts use :func:`check_positive_int`).

    Raises:
        TypeError: for ``bool``, ``float`` or any non-integer value.
        ValueError: for zero or negative values.
    """
    return check_positive_int(
        accum_steps, "accum_steps",
        meaning="the number K of micro-batches per optimizer update, e.g. `accum_steps=4` "
        "applies one update every 4 micro-batches; 1 means no accumulation",
    )


def resolve_accum_steps(
    accum_steps: int | None = None,
    *,
    effective_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    exact: bool = True,
) -> int:
    """Return K, from ``accum_steps`` or from ``effective_batch_size / micro_batch_size``.

    Args:
        accum_steps: K directly. Mutually exclusive with ``effective_batch_size``.
        effective_batch_size: the target batch B (samples per optimizer update).
        micro_batch_size: the micro-batch b that fits on the device (samples).
        exact: if True (default), B must be a multiple of b; if False, K = ceil(B / b)
            (the book's Reference page "Choosing b and K" says what an update then holds).

    Example:
        >>> resolve_accum_steps(effective_batch_size=64, micro_batch_size=16)
        4
    """
    if accum_steps is not None and effective_batch_size is not None:
        raise ValueError(
            "Pass either `accum_steps` or `effective_batch_size` (with `micro_batch_size`), "
            "not both."
        )
    if accum_steps is not None:
        return check_accum_steps(accum_steps)
    if effective_batch_size is None:
        raise ValueError(
            "Pass `accum_steps` (e.g. 4), or `effective_batch_size` together with "
            "`micro_batch_size`."
        )
    big = check_positive_int(effective_batch_size, "effective_batch_size")
    if micro_batch_size is None:
        raise ValueError(
            "`micro_batch_size` is required with `effective_batch_size`: K = "
            "effective_batch_size / micro_batch_size."
        )
    small = check_positive_int(micro_batch_size, "micro_batch_size")
    if exact:
        check_multiple(big, small, f"choose e.g. effective_batch_size="
                       f"{(big // small + 1) * small}, or pass `exact=False` to round K up")
    return split_batch(big, small, exact=exact)[0]


def check_multiple(big: int, small: int, way_out: str) -> None:
    """Raise unless ``effective_batch_size`` ``big`` is a multiple of ``micro_batch_size``
    ``small`` (both positive ints, in samples): one message, ``way_out`` naming the fixes
    the caller's signature has (a clause, no final period)."""
    if big % small:
        raise ValueError(f"`effective_batch_size`={big} is not a multiple of "
                         f"`micro_batch_size`={small}; {way_out}.")


def split_batch(batch_size: int, max_micro_batch: int, *, exact: bool = True) -> tuple[int, int]:
    """The one rule that turns a batch B into K micro-batches (``(K, b)``), for
    :func:`resolve_accum_steps` and ``accumcore.memory.accum_steps_for``.

    Args:
        batch_size: B, samples per optimizer update (a positive int, checked by the caller).
        max_micro_batch: the largest micro-batch b allowed (samples; a positive int, checked
            by the caller).
        exact: ``True``: K is the smallest divisor of B with B / K <= ``max_micro_batch`` and
            b = B / K, so every update sees exactly B samples; ``False``: K = ceil(B / b_max)
            and b = ceil(B / K) (K * b may exceed B by up to K - 1 samples).
    """
    big, small = batch_size, max_micro_batch
    k = math.ceil(big / small) if small < big else 1
    if exact:
        while big % k:
            k += 1  # terminates at k = B at the latest
        return k, big // k
    return k, math.ceil(big / k)


def check_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    """Check that ``value`` is one of ``choices`` (a policy string)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"Unknown `{name}`={value!r}; expected one of {', '.join(map(repr, choices))}."
        )
    return value


def check_normalizer(normalizer: Any) -> str | Callable:
    """Check the ``normalizer`` argument: ``"auto"``, ``"samples"``, ``"sample_weight"`` or a
    callable."""
    if callable(normalizer):
        return normalizer
    return check_choice(normalizer, "normalizer", NORMALIZERS)


def check_micro_batch_size(value: Any) -> int | str | None:
    """Check ``micro_batch_size`` (b, samples per micro-batch when ``fit`` splits each batch):
    a positive int, ``"auto"`` or ``None`` (no split: ``accum_steps`` counts micro-batches).

    Raises:
        TypeError: for a float, a bool or any other non-integer, non-string value (as
            ``accum_steps`` does), naming the accepted values.
        ValueError: for 0, a negative number or a string other than ``"auto"``, naming the
            accepted values.
    """
    if value is None or (isinstance(value, str) and value == AUTO):
        return value
    wrong_type = isinstance(value, bool) or not isinstance(value, numbers.Integral | str)
    if wrong_type or isinstance(value, str) or value < 1:
        error = TypeError if wrong_type else ValueError
        of_type = f" of type {type(value).__name__}" if wrong_type else ""
        raise error(
            f"`micro_batch_size` must be a positive int (the samples of one micro-batch, e.g. "
            f"16: `fit(batch_size=64)` then makes one update from 4 micro-batches of 16) or "
            f"'auto' (the largest that fits on the device), got {value!r}{of_type}."
        )
    return int(value)


@dataclasses.dataclass(frozen=True)
class Settings:
    """One model's or trainer's accumulation settings, validated (built by :func:`resolve`).

    Attributes:
        accum_steps: K, micro-batches per optimizer update (int >= 1); ``None`` only for an
            ``AccumModel`` created without it (its ``fit`` raises, naming it).
        end_of_epoch: what a partial window does at an epoch's end: ``"apply"``, ``"carry"``
            or ``"drop"``.
        nonfinite: the :class:`~accumcore.NonFinitePolicy` (given by name or as a policy).
        normalizer: how a micro-batch is weighed, as given: ``"auto"``, ``"samples"``,
            ``"sample_weight"`` or a callable ``(x, y, sample_weight) -> item count``.
        micro_batch_size: b, samples per micro-batch when ``fit`` splits each batch of B
            inside its train step (one update per batch; ``accum_steps`` is then 1), or
            ``"auto"`` (found on the device); ``None``: each batch is one micro-batch and
            ``accum_steps`` of them make an update.
    """

    accum_steps: int | None = 1
    end_of_epoch: str = "apply"
    nonfinite: NonFinitePolicy = dataclasses.field(
        default_factory=lambda: nonfinite_policy("raise"))
    normalizer: str | Callable = "auto"
    micro_batch_size: int | str | None = None

    @property
    def splits_batches(self) -> bool:
        """Whether ``fit`` splits each batch into micro-batches inside its train step."""
        return self.micro_batch_size is not None

    @property
    def nonfinite_name(self) -> str | NonFinitePolicy:
        """The policy as ``get_config`` names it (a built-in's name, else the policy object)."""
        built_in = POLICIES.get(self.nonfinite.name) == self.nonfinite
        return self.nonfinite.name if built_in else self.nonfinite


#: The one check of each setting, by name (``value -> the resolved value``; raises for a bad one).
CHECKS: dict[str, Callable[[Any], Any]] = {
    "accum_steps": check_accum_steps,
    "end_of_epoch": lambda value: check_choice(value, "end_of_epoch", END_OF_EPOCH_POLICIES),
    "nonfinite": nonfinite_policy,
    "normalizer": check_normalizer,
    "micro_batch_size": check_micro_batch_size,
}

#: The two ways to say how an update is made up (K batches per update, or each batch split
#: into micro-batches of b), given one at a time.
_EXCLUSIVE = ("accum_steps", "micro_batch_size")


def resolve(base: Settings | None = None, **given: Any) -> Settings:
    """``base`` (default: the defaults) with the ``given`` settings checked and set.

    Example:
        >>> resolve(accum_steps=4, end_of_epoch="carry").accum_steps
        4

    Raises:
        TypeError: for an unknown setting's name, naming the known ones; or a value of the
            wrong type (e.g. ``accum_steps=4.0``).
        ValueError: for a value out of range, naming the accepted ones.
    """
    unknown = [name for name in given if name not in CHECKS]
    if unknown:
        raise TypeError(f"Unknown accumulation setting(s) {', '.join(unknown)}; known: "
                        f"{', '.join(CHECKS)}.")
    if all(given.get(name) is not None for name in _EXCLUSIVE) and given["accum_steps"] != 1:
        raise ValueError(
            f"Pass `accum_steps` or `micro_batch_size`, not both (got accum_steps="
            f"{given['accum_steps']!r}, micro_batch_size={given['micro_batch_size']!r}). "
            "`micro_batch_size=b`: fit's `batch_size` is the recipe's batch B, split into "
            "micro-batches of b inside each step (one update per batch). `accum_steps=K`: "
            "fit's `batch_size` is the micro-batch, and K of them make an update (for data "
            "that comes as micro-batches)."
        )
    checked = {name: CHECKS[name](value) for name, value in given.items()}
    # The one given replaces the other (set_accumulation switches between them).
    if checked.get("micro_batch_size") is not None:
        checked["accum_steps"] = 1
    elif checked.get("accum_steps") is not None:
        checked["micro_batch_size"] = None
    return dataclasses.replace(base or Settings(), **checked)


def warn_if_nothing_split(micro_batch_size: Any, micro_batches: int, windows: int,
                          accum_call: str) -> bool:
    """Warn (``UserWarning``) when ``micro_batch_size`` b (an int) is given but the first
    ``windows`` updates were made of ``micro_batches`` micro-batches, one each: no batch was
    larger than b, so nothing is split and nothing accumulated (the micro-step habit of
    ``batch_size = b``). ``accum_call``: the call that sets ``accum_steps`` on the object
    the user holds. ``"auto"`` reports its own b. Returns whether it warned."""
    if not isinstance(micro_batch_size, int) or windows <= 0 or micro_batches > windows:
        return False
    import warnings

    warnings.warn(
        f"micro_batch_size={micro_batch_size} but no batch was larger than "
        f"{micro_batch_size} samples: nothing is split and nothing is accumulated, each "
        "batch makes an update of its own. With `micro_batch_size=b`, `batch_size` is the "
        "recipe's batch B (one update per batch of B, from micro-batches of at most b): pass "
        f"`batch_size=B`, e.g. `batch_size={4 * micro_batch_size}` for 4 micro-batches per "
        f"update. For data that comes as micro-batches, use {accum_call} (K batches per "
        "update).",
        UserWarning,
        stacklevel=2,
    )
    return True


def require_a_way(accum_steps: Any, micro_batch_size: Any, caller: str) -> None:
    """Raise ``ValueError`` naming both settings when neither is given to ``caller`` (the
    error an ``AccumModel`` created without either raises in ``fit``, and giving both raises)."""
    if accum_steps is None and micro_batch_size is None:
        raise ValueError(
            f"{caller} needs `micro_batch_size=b` (then `fit(batch_size=B)` makes one update "
            "per batch of B, from micro-batches of at most b samples; 'auto': the largest "
            "that fits) or `accum_steps=K` (then `fit(batch_size=b)` makes one update per K "
            "micro-batches of b)."
        )


def get_optimizer(optimizer: Any) -> Any:
    """An optimizer instance from an instance, a name (``"adam"``) or a config dict, as
    ``model.compile`` accepts (``keras.optimizers.get``); then :func:`check_optimizer`."""
    import keras

    if isinstance(optimizer, (str, dict)):
        try:
            optimizer = keras.optimizers.get(optimizer)
        except ValueError as err:
            raise ValueError(
                f"Unknown `optimizer`={optimizer!r}: pass a Keras optimizer name such as "
                f"'adam' or 'sgd', or an instance such as keras.optimizers.Adam(1e-3) ({err})."
            ) from err
    check_optimizer(optimizer)
    return optimizer


def check_optimizer(optimizer: Any) -> None:
    """Reject optimizers that would accumulate a second time, or are not Keras 3 optimizers."""
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"`optimizer` must be a Keras 3 optimizer (an instance such as "
            f"keras.optimizers.Adam(1e-3), or a name such as 'adam'), got "
            f"{type(optimizer).__name__}."
        )
    inner = getattr(optimizer, "inner_optimizer", None)
    for opt in (optimizer, inner):
        steps = getattr(opt, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                f"`optimizer` already accumulates gradients (gradient_accumulation_steps={steps}). "
                "accumcore does the accumulation: create the optimizer without "
                "`gradient_accumulation_steps` and pass `accum_steps` to accumcore instead."
            )


def warn_if_float16_without_loss_scaling(model: Any, optimizer: Any) -> bool:
    """Warn (``UserWarning``) if ``model`` computes in float16 without loss scaling.

    float16 flushes magnitudes below ~6e-8 to zero, so small gradients underflow unless the
    loss is scaled up first (``keras.optimizers.LossScaleOptimizer``; ``compile`` wraps the
    optimizer automatically only for the ``"mixed_float16"`` policy). bfloat16 has float32's
    range and needs no scaling.

    Returns:
        Whether it warned.
    """
    import warnings

    import keras

    if optimizer is None or isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return False
    policies = [getattr(model, "dtype_policy", None)]
    policies += [getattr(layer, "dtype_policy", None) for layer in getattr(model, "layers", [])]
    names = {getattr(p, "name", str(p)) for p in policies
             if getattr(p, "compute_dtype", None) == "float16"}
    if not names:
        return False
    warnings.warn(
        f"The model computes in float16 (dtype policy {', '.join(sorted(names))}) but "
        f"`optimizer` ({type(optimizer).__name__}) does not scale the loss: small gradients "
        "may underflow to zero in float16. Wrap it as "
        "`keras.optimizers.LossScaleOptimizer(optimizer)`, or use the 'mixed_bfloat16' policy.",
        UserWarning,
        stacklevel=3,
    )
    return True
