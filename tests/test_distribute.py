"""MirroredStrategy over 2 logical CPU devices: equivalence, ragged shards, reduction count.

The cases run in ONE subprocess (``tests/distribute_cases.py``), because logical devices must
be configured before TensorFlow initialises its devices and this pytest process has already
done so; that also keeps the other tests on one device. Each test checks one case's numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a subprocess with its own TensorFlow (see pyproject)

HERE = Path(__file__).resolve().parent

# Float32 tolerance for "same weights as the large batch on one device" (see conftest.REL_TOL
# for the derivation: re-association round-off, measured ~1e-6..2e-5 with Adam). Splitting each
# micro-batch over 2 replicas only changes the order of the sums once more; measured here:
# 0.75e-6 .. 3.7e-6. 1e-4 is 3-4 orders of magnitude below a real bug (per-replica clipping
# measured ~1e-1, a missing 1/num_replicas ~1).
REL_TOL = 1e-4
# mixed_float16 on both sides (see test_mixed_precision.TOL): measured 2e-4 .. 3e-4 here.
MIXED_TOL = 2e-3
# Generous: 6 small cases on a shared 2-core machine; CPU time is ~20 s.
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("distribute") / "cases.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0",
               CUDA_VISIBLE_DEVICES="")  # 2 logical CPUs, also on a GPU machine
    proc = subprocess.run(
        [sys.executable, str(HERE / "distribute_cases.py"), str(out)],
        env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=HERE.parent,
    )
    if not out.exists():
        pytest.fail(f"distribute_cases.py wrote nothing (rc {proc.returncode}):\n"
                    f"{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def case(results: dict, name: str) -> dict:
    value = results.get(name)
    assert value is not None, f"case {name} did not run"
    assert "error" not in value, value.get("error")
    return value


@pytest.mark.parametrize("mode", ["eager", "function", "graph"])
def test_loops_match_large_batch_with_ragged_shards(results: dict, mode: str) -> None:
    out = case(results, "loops_ragged")[mode]
    assert out["rel"] <= REL_TOL, out
    # 36 samples, micro-batches of 5 (3 + 2 per replica; the last: 1 + 0), K=2: 3 full
    # windows + 1 flushed.
    assert out["updates"] == [4]
    assert out["counters"]["samples_seen"] == 36  # SUM over replicas: every sample once
    assert out["counters"]["micro_batches_seen"] == 8
    assert out["counters"]["windows_applied"] == 4
    assert out["counters"]["micro_step"] == 0 and out["counters"]["window_samples"] == 0


def test_fit_matches_large_batch(results: dict) -> None:
    out = case(results, "fit_ragged")
    assert out["rel"] <= REL_TOL, out
    assert out["counters"]["windows_applied"] == 4  # 39 samples, 6 per micro-batch, K=2
    assert out["counters"]["samples_seen"] == 39


@pytest.mark.parametrize("optimizer", ["global_clipnorm", "clipnorm", "adamw"])
def test_clipping_sees_the_global_window_gradient(results: dict, optimizer: str) -> None:
    rel = case(results, "clipping_and_decay")[optimizer]
    assert rel <= REL_TOL, f"{optimizer}: rel {rel:.3g}"


@pytest.mark.parametrize("name", ["k2", "k4"])
def test_one_gradient_reduction_per_window_independent_of_k(results: dict, name: str) -> None:
    """Counted by an instrumented CrossDeviceOps, eagerly (every reduction runs in Python)."""
    out = case(results, "reductions")
    n_vars = out["n_vars"]
    run = out[name]
    k = run["k"]
    assert run["windows_applied"] == 2
    assert run["singles"] == 0  # no stray reduction (e.g. reading a SUM variable)
    # No communication at all in the K-1 micro-steps that do not close a window ...
    for step, batches in enumerate(run["per_step"]):
        if (step + 1) % k:
            assert batches == [], f"micro-step {step} communicated: {batches}"
    # ... and per window: accumcore's status batch [weight, flags] (1 packed value), then the
    # optimizer's own all-reduce of the n_vars gradients: the gradients cross once per window.
    assert run["per_step"][k - 1] == [1, n_vars]
    assert run["per_step"][2 * k - 1] == [1, n_vars]
    assert run["batches"] == [1, n_vars] * 2


def test_clipping_optimizer_reduces_gradients_with_the_status(results: dict) -> None:
    out = case(results, "reductions")
    run, n_vars = out["k4_clip"], out["n_vars"]
    # Gradients + status in accumcore's batch (so that clipping sees the global gradient);
    # the optimizer's all-reduce then adds replica 0's gradient to exact zeros.
    assert run["batches"] == [n_vars + 1, n_vars] * 2


def test_nonfinite_shard_skips_the_window_on_every_replica(results: dict) -> None:
    out = case(results, "nonfinite_shard")["skip_window"]
    counters = out["counters"]
    assert counters["windows_skipped"] == 1 and counters["windows_applied"] == 2
    assert counters["samples_seen"] - counters["samples_dropped"] == 12  # windows 2 and 3
    assert counters["micro_batches_skipped"] == 1  # replica 0's shard only
    assert out["rel"] <= REL_TOL, out  # = large batches of windows 2 and 3


def test_nonfinite_raise_under_a_strategy(results: dict) -> None:
    out = case(results, "nonfinite_shard")["raise"]
    assert out["raised"], "NonFiniteGradientError not raised"
    assert out["micro_step"] == 1 and out["window_position"] == 1


def test_mixed_float16_under_mirrored_strategy(results: dict) -> None:
    out = case(results, "mixed_precision")
    assert out["clean"]["rel"] <= MIXED_TOL, out["clean"]
    assert out["clean"]["counters"]["windows_skipped"] == 0
    assert out["clean"]["scale"] == 2**15


def test_overflow_on_one_replica_skips_the_window_everywhere(results: dict) -> None:
    out = case(results, "mixed_precision")["overflow"]
    counters = out["counters"]
    assert counters["windows_skipped"] == 1 and counters["windows_applied"] == 2
    assert counters["samples_dropped"] == 32 and counters["samples_seen"] == 96
    assert out["scale"] == 2**14
    assert out["rel"] <= MIXED_TOL, out
