"""The micro-batch size search: the largest size for which a predicate holds, and
``micro_batch_size="auto"``'s search on the device (:func:`search_micro_batch`).

:func:`largest_fitting` is public as :func:`accumcore.memory.largest_fitting`; it lives here,
below the public module, so that ``accumcore._impl.auto_micro_batch`` (``micro_batch_size=
"auto"``) uses it without importing a public module (imports point down: public modules ->
``accumcore._impl``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from accumcore._impl.settings import check_positive_int

#: Errors that mean "the step did not fit in device memory".
OUT_OF_MEMORY = (tf.errors.ResourceExhaustedError,)


def largest_fitting(
    fits: Callable[[int], bool],
    *,
    start: int = 1,
    limit: int | None = None,
    multiple_of: int = 1,
    probes: list[tuple[int, bool]] | None = None,
    descending: bool = False,
) -> int:
    """The largest micro-batch size b in ``[start, limit]`` with ``fits(b)`` true.

    Doubles from ``start`` while ``fits`` holds, then bisects between the last size that fitted
    and the first that did not; with ``descending=True`` (and a ``limit``) it halves from
    ``limit`` while ``fits`` fails, then bisects up (one probe when ``limit`` fits). Only
    multiples of ``multiple_of`` are probed (``start`` rounded up, ``limit`` down).

    Args:
        fits: predicate ``fits(b) -> bool``, True when a training step with micro-batch b
            (samples) fits in device memory. Assumed monotone (fits(b) implies fits(b') for
            b' < b); called at most ``log2(result / start) + log2(result / multiple_of) + 3``
            times (doubling, then bisection of the last doubling interval).
        start: the first size probed (samples, >= 1).
        limit: the largest size worth probing (samples), e.g. the target batch B; ``None`` for
            no limit (doubling then stops only at the first failure).
        multiple_of: probe only multiples of this many samples (>= 1).
        probes: optional list that receives every ``(b, fitted)`` pair, in order.
        descending: search down from ``limit`` (see above).

    Returns:
        The largest b that fitted.

    Raises:
        ValueError: bad arguments, or even ``start`` does not fit (then no micro-batch size in
            the range fits: make the model or the inputs smaller, or use a device with more
            memory).
    """
    step = check_positive_int(multiple_of, "multiple_of")
    start, limit = _rounded_range(start, limit, step)
    seen = probes if probes is not None else []

    def probe(b: int) -> bool:
        ok = bool(fits(b))
        seen.append((b, ok))
        return ok

    if descending and limit is not None:
        return _descend(probe, start, limit, step)
    if not probe(start):
        raise ValueError(
            f"Even the smallest micro-batch probed (start={start} samples) does not fit in device "
            "memory: reduce the model or input size, or use a device with more memory."
        )
    good = start  # largest size known to fit
    # 1. doubling
    while limit is None or good < limit:
        nxt = good * 2 if limit is None else min(good * 2, limit)
        if not probe(nxt):
            return _bisect(probe, good, nxt, step)
        good = nxt
    return good  # reached the limit


def _descend(probe: Callable[[int], bool], start: int, limit: int, step: int) -> int:
    """``largest_fitting`` from the top: ``limit``, then halves (multiples of ``step``, not
    below ``start``) until one fits, then bisection between it and the last that did not."""
    bad = None
    size = limit
    while not probe(size):
        if size <= start:
            raise ValueError(
                f"Even the smallest micro-batch probed (start={start} samples) does not fit in "
                "device memory: reduce the model or input size, or use a device with more "
                "memory.")
        bad = size
        size = max(start, (size // 2 // step) * step)
    return size if bad is None else _bisect(probe, size, bad, step)


def _rounded_range(start: int, limit: int | None, step: int) -> tuple[int, int | None]:
    """``start`` rounded up and ``limit`` down to multiples of ``step``, checked."""
    start = check_positive_int(start, "start")
    start = -(-start // step) * step
    if limit is not None:
        limit = check_positive_int(limit, "limit")
        limit = (limit // step) * step
        if limit < start:
            raise ValueError(
                f"`limit` ({limit} after rounding down to a multiple of {step}) is below "
                f"`start` ({start}): pass limit >= start."
            )
    return start, limit


def _bisect(probe: Callable[[int], bool], good: int, bad: int, step: int) -> int:
    """The largest fitting multiple of ``step`` in ``[good, bad)``: ``good`` fits, ``bad``
    does not; bisects on the multiples strictly between them."""
    while bad - good > step:
        mid = ((good + bad) // 2 // step) * step
        if mid <= good:
            mid = good + step
        if probe(mid):
            good = mid
        else:
            bad = mid
    return good


def search_micro_batch(probe: Callable[[int], Any], samples: int,
                       probes: list[tuple[int, bool]] | None = None) -> int:
    """The micro-batch search of ``micro_batch_size="auto"`` (every entry point): the largest
    b <= ``samples`` for which ``probe(b)`` does not raise an :data:`OUT_OF_MEMORY` error.

    :func:`largest_fitting` from the top (``descending=True``): b = ``samples`` first, halved
    while it runs out of memory, then bisected up between the largest size that fitted and the
    smallest that did not (16 of which 5 fit: 16, 8 fail, 4 fits, then 6 fails, 5 fits).

    Args:
        probe: ``probe(b)``, one micro-batch's forward and backward pass on b samples (its
            result is ignored); it raises ``tf.errors.ResourceExhaustedError`` when b does not
            fit (any other error propagates) and sets back whatever it changed, so that the
            search changes nothing.
        samples: the batch's samples, the largest b probed (>= 1).
        probes: optional list that receives every ``(b, fitted)``, in order (also when the
            search raises).

    Returns:
        The largest b that fitted (samples).

    Raises:
        ValueError: when not even one sample fits (:func:`nothing_fits`, with every probe).
    """
    seen = probes if probes is not None else []

    def fits(size: int) -> bool:
        try:
            probe(size)
        except OUT_OF_MEMORY:
            return False
        return True

    try:
        return largest_fitting(fits, limit=samples, descending=True, probes=seen)
    except ValueError as err:
        raise ValueError(nothing_fits(seen)) from err


def nothing_fits(probes: list[tuple[int, bool]]) -> str:
    """The message when not even one sample fits, with every probe ``(b, fitted)``."""
    return ("micro_batch_size='auto': even micro-batches of 1 sample run out of memory "
            f"(probes, b and whether it fitted: {probes}). Make the model or its inputs "
            "smaller, or use a device with more memory.")


def probe_total(grads: Sequence[Any]) -> tf.Tensor:
    """What a probe returns: the sum of every element of one micro-batch's gradients
    (``None`` skipped, an ``IndexedSlices``' values), a float32 scalar; reading it makes the
    forward and backward pass run."""
    return tf.add_n([tf.reduce_sum(tf.cast(getattr(g, "values", g), tf.float32))
                     for g in grads if g is not None])
