"""The largest-micro-batch finder: search logic with injected predicates, OOM handling."""

from __future__ import annotations

import math

import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from accumcore import memory
from accumcore.memory import (
    accum_steps_for,
    gradient_step_probe,
    largest_fitting,
    oom_probe,
    plan_accumulation,
)


def threshold(capacity: int, calls: list[int] | None = None):
    """A device on which micro-batches of up to `capacity` samples fit."""

    def fits(b: int) -> bool:
        if calls is not None:
            calls.append(b)
        return b <= capacity

    return fits


@given(capacity=st.integers(1, 100_000), start=st.integers(1, 64))
@settings(max_examples=200, deadline=None)
def test_finds_exact_capacity_with_logarithmic_probes(capacity, start):
    if start > capacity:
        with pytest.raises(ValueError, match="does not fit"):
            largest_fitting(threshold(capacity), start=start)
        return
    calls: list[int] = []
    assert largest_fitting(threshold(capacity, calls), start=start) == capacity
    # doubling: log2(capacity/start) + 2 probes (the first and the failing one), bisection of
    # the last interval [good, 2 good): log2(good) < log2(capacity) + 1 probes.
    bound = math.ceil(math.log2(capacity / start)) + 2 + math.ceil(math.log2(capacity)) + 1
    assert len(calls) <= bound, (capacity, start, calls)
    assert len(set(calls)) == len(calls), "a size was probed twice"


@given(capacity=st.integers(1, 5000), limit=st.integers(1, 5000), m=st.sampled_from([1, 8, 32]))
@settings(max_examples=200, deadline=None)
def test_respects_limit_and_multiple_of(capacity, limit, m):
    calls: list[int] = []
    start = m
    if limit < m or capacity < start:
        with pytest.raises(ValueError):
            largest_fitting(threshold(capacity, calls), start=start, limit=limit, multiple_of=m)
        return
    best = largest_fitting(threshold(capacity, calls), start=start, limit=limit, multiple_of=m)
    # Largest multiple of m that is <= min(capacity, limit).
    assert best == (min(capacity, limit) // m) * m
    assert all(b % m == 0 and b <= limit for b in calls), calls


def test_probe_sequence_doubles_then_bisects():
    calls: list[int] = []
    assert largest_fitting(threshold(300, calls), start=16) == 300
    assert calls[:6] == [16, 32, 64, 128, 256, 512]  # doubling up to the first failure
    assert calls[6] == 384  # then bisection between 256 and 512
    assert all(256 < b < 512 for b in calls[6:])


def test_plan_reaches_target_with_fewest_even_micro_batches():
    plan = plan_accumulation(threshold(300), target_batch_size=1000)
    assert plan.max_micro_batch == 300
    assert (plan.accum_steps, plan.micro_batch_size, plan.effective_batch_size) == (4, 250, 1000)
    odd = plan_accumulation(threshold(320), target_batch_size=4096, start=32, multiple_of=32)
    assert (odd.max_micro_batch, odd.accum_steps, odd.micro_batch_size) == (320, 16, 256)
    loose = plan_accumulation(threshold(320), 4096, start=32, multiple_of=32, exact=False)
    assert (loose.accum_steps, loose.micro_batch_size, loose.effective_batch_size) == \
        (13, 316, 4108)
    assert plan.probes[0] == (1, True) and (512, False) in plan.probes
    # A device that holds the whole target batch needs no accumulation; nothing above B is probed.
    big = plan_accumulation(threshold(10_000), target_batch_size=256)
    assert (big.accum_steps, big.micro_batch_size, big.max_micro_batch) == (1, 256, 256)
    assert max(b for b, _ in big.probes) == 256


@pytest.mark.parametrize(
    ("target", "fits", "exact", "expected"),
    [(64, 16, True, (4, 16)), (1000, 300, True, (4, 250)), (100, 100, True, (1, 100)),
     (100, 500, True, (1, 100)), (4096, 320, True, (16, 256)), (4096, 320, False, (13, 316)),
     (7, 2, True, (7, 1)), (7, 2, False, (4, 2))],
)
def test_accum_steps_for(target, fits, exact, expected):
    k, b = accum_steps_for(target, fits, exact=exact)
    assert (k, b) == expected
    assert b <= fits and (k - 1) * b < target <= k * b
    if exact:
        assert k * b == target


@given(target=st.integers(1, 5000), fits=st.integers(1, 5000))
@settings(max_examples=200, deadline=None)
def test_exact_plan_uses_the_fewest_micro_batches_that_divide_b(target, fits):
    k, b = accum_steps_for(target, fits)
    assert k * b == target and b <= fits
    # no smaller K divides B with micro-batches that fit
    assert not any(target % j == 0 and target // j <= fits for j in range(1, k))


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="limit"):
        largest_fitting(threshold(10), start=8, limit=4)
    with pytest.raises(ValueError, match="multiple_of"):
        largest_fitting(threshold(10), multiple_of=0)
    with pytest.raises(TypeError, match="target_batch_size"):
        plan_accumulation(threshold(10), target_batch_size=2.5)
    with pytest.raises(ValueError, match="multiple_of"):  # not a ZeroDivisionError
        plan_accumulation(threshold(10), target_batch_size=100, multiple_of=0)


def test_oom_probe_maps_resource_exhausted_to_false_and_reraises_others(monkeypatch):
    cleaned: list[int] = []
    collected: list[int] = []
    # Count the garbage collections instead of running them (a full collection in a worker
    # that has built many models takes over a second, and the probe runs about ten).
    monkeypatch.setattr(memory.gc, "collect", lambda: collected.append(1))

    def step_at(b: int) -> None:
        if b > 48:
            raise tf.errors.ResourceExhaustedError(None, None, f"OOM at {b}")
        if b == 13:
            raise ValueError("a real bug")

    fits = oom_probe(step_at, cleanup=lambda: cleaned.append(1))
    assert fits(48) is True and fits(49) is False
    with pytest.raises(ValueError, match="real bug"):
        fits(13)
    assert len(cleaned) == len(collected) == 3  # after every probe, failed or not
    assert plan_accumulation(fits, target_batch_size=256, start=8, multiple_of=8).max_micro_batch \
        == 48


def test_gradient_step_probe_runs_a_real_step():
    import accumcore.lab.experiments as ex

    model = ex.mlp(8, (4,), 3)
    step_at = gradient_step_probe(model, "sparse_categorical_crossentropy", (8,), classes=3)
    assert math.isfinite(step_at(5))
    assert oom_probe(step_at)(7) is True
