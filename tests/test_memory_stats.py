"""accumcore.lab.memory_stats: the peak-memory meter of the book's practical guides.

The pytest process imports TensorFlow without ``TF_CPU_ALLOCATOR_USE_BFC``, so the CPU keeps no
allocator statistics here (what a reader who forgot the variable gets); the measuring itself
runs in a child interpreter that sets it before importing TensorFlow, as the guides do.
"""

from __future__ import annotations

import os

import pytest
import tensorflow as tf
from helpers import run_script

from accumcore.lab import memory_stats

CHILD = """
import os
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
import tensorflow as tf
from helpers import emit
from accumcore.lab.memory_stats import measure_step, memory_stats_available

calls = {"warm": 0, "step": 0}

def allocate(mib):
    def step():
        calls["step"] += 1
        return tf.reduce_sum(tf.ones([mib * 2**18]))  # mib MiB of float32, then a scalar
    return step

small = measure_step(allocate(1), repeats=2, device="CPU:0")
steps_small = calls["step"]
def warm():
    calls["warm"] += 1
big = measure_step(allocate(64), warmup=warm, repeats=3, device="CPU:0")
emit({"available": memory_stats_available("CPU:0"), "small": list(small), "big": list(big),
      "steps_small": steps_small, "steps_big": calls["step"] - steps_small,
      "warm": calls["warm"]})
"""


def test_measure_step_reads_the_peak_of_the_timed_calls():
    r = run_script(CHILD, env={memory_stats.CPU_STATS_ENV: "true"}, timeout=300)
    assert r["available"]
    mib = 2**20
    small_peak, small_s, small_dev = r["small"]
    big_peak, big_s, big_dev = r["big"]
    assert small_dev == big_dev == "CPU:0"
    # A 64 MiB tensor is in the peak; a 1 MiB step peaks far lower (the peak was reset).
    assert big_peak >= 64 * mib
    assert small_peak < 16 * mib
    assert small_s > 0 and big_s > 0
    # The default warm-up is one extra call of the step; a given warm-up replaces it.
    assert r["steps_small"] == 1 + 2
    assert (r["warm"], r["steps_big"]) == (1, 3)


@pytest.mark.skipif(os.environ.get(memory_stats.CPU_STATS_ENV) == "true"
                    or bool(tf.config.list_physical_devices("GPU")),
                    reason="this process keeps allocator statistics")
def test_without_statistics_measure_step_says_how_to_get_them():
    assert not memory_stats.memory_stats_available("CPU:0")
    with pytest.raises(RuntimeError, match="TF_CPU_ALLOCATOR_USE_BFC=true before `import"):
        memory_stats.measure_step(lambda: None, device="CPU:0")
    assert not memory_stats.memory_stats_available("GPU:7")  # no such device: False, no raise


def test_memory_device_prefers_a_gpu(monkeypatch):
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: ["/physical_device:GPU:0"] if kind == "GPU" else [])
    assert memory_stats.memory_device() == "GPU:0"
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: [])
    assert memory_stats.memory_device() == "CPU:0"


@pytest.mark.parametrize("repeats", [0, -1, 1.5, True])
def test_measure_step_rejects_bad_repeats(repeats):
    with pytest.raises(ValueError, match="repeats"):
        memory_stats.measure_step(lambda: None, repeats=repeats, device="CPU:0")
