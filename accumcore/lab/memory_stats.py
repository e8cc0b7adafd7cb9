"""Peak memory and time of one training step, on a GPU or on the CPU: the practical guides' meter.

TensorFlow's allocator keeps statistics per device: ``tf.config.experimental.get_memory_info(
device)`` returns ``{"current": bytes, "peak": bytes}`` and
``tf.config.experimental.reset_memory_stats(device)`` restarts the peak. On a GPU they are always
available. On the CPU they are kept only when TensorFlow uses its BFC allocator there, which
the environment variable ``TF_CPU_ALLOCATOR_USE_BFC=true`` asks for; it is read when TensorFlow
creates the CPU device, so it must be set **before** ``import tensorflow`` (first thing in a
notebook or script; :data:`CPU_STATS_ENV`). The benchmark suite (``benchmarks/suite.py``) does
the same in its memory subprocesses.

:func:`memory_device` names the device to read (the first GPU if there is one, else the CPU),
:func:`memory_stats_available` says whether its statistics can be read, and
:func:`measure_step` runs a step once to warm it up (tracing, first allocations), then resets
the peak and times ``repeats`` more calls: it returns the peak over those calls, in bytes, and
their median time. The book's guides use it to compare ways of saving memory side by side.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import tensorflow as tf

#: The environment variable that makes TensorFlow keep allocator statistics for ``CPU:0``.
CPU_STATS_ENV = "TF_CPU_ALLOCATOR_USE_BFC"


def memory_device() -> str:
    """``"GPU:0"`` when TensorFlow sees a GPU, else ``"CPU:0"``."""
    return "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"


def memory_stats_available(device: str | None = None) -> bool:
    """Whether ``get_memory_info(device)`` works (``device`` defaults to :func:`memory_device`)."""
    try:
        tf.config.experimental.get_memory_info(device or memory_device())
    except ValueError:  # "Allocator stats not available" / "No matching devices"
        return False
    return True


class StepCost(NamedTuple):
    """What :func:`measure_step` measured."""

    #: Peak allocator memory over the timed calls, in bytes (weights and optimizer state that
    #: already exist count too: the peak is the allocator's, not the step's own).
    peak_bytes: int
    #: Median wall time of one call, in seconds.
    seconds: float
    #: The device whose allocator was read.
    device: str


def measure_step(step: Callable[[], Any], *, warmup: Callable[[], Any] | None = None,
                 repeats: int = 3, device: str | None = None) -> StepCost:
    """Peak memory and median time of ``step()``, after one untimed warm-up call.

    Args:
        step: the call to measure, e.g. ``lambda: train_step(x, y)``; its result is passed to
            ``np.asarray`` (so that asynchronous GPU work is finished before the clock stops).
        warmup: the untimed first call (default: ``step``), e.g. a tiny batch that traces
            the function without paying for a full step.
        repeats: timed calls (int >= 1); the peak covers all of them.
        device: the device whose allocator is read (default: :func:`memory_device`).

    Returns:
        A :class:`StepCost`.

    Raises:
        RuntimeError: if the device keeps no allocator statistics (on the CPU: set
            ``TF_CPU_ALLOCATOR_USE_BFC=true`` before importing TensorFlow).
    """
    import numpy as np

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"`repeats` must be an int >= 1, got {repeats!r}.")
    device = device or memory_device()
    if not memory_stats_available(device):
        raise RuntimeError(
            f"TensorFlow keeps no allocator statistics for {device!r}. On the CPU, set the "
            f"environment variable {CPU_STATS_ENV}=true before `import tensorflow` (restart "
            "the kernel or process first)."
        )

    def finish(result: Any) -> None:
        for leaf in tf.nest.flatten(result):
            if leaf is not None:
                np.asarray(leaf)

    finish((warmup or step)())
    tf.config.experimental.reset_memory_stats(device)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        finish(step())
        seconds.append(time.perf_counter() - start)
    peak = int(tf.config.experimental.get_memory_info(device)["peak"])
    return StepCost(peak, statistics.median(seconds), device)
