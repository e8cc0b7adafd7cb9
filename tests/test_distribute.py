"""MirroredStrategy over 2 logical CPU devices: equivalence, ragged shards, reduction count.

The cases run in ONE subprocess (``tests/distribute_cases.py``), because logical devices must
be configured before TensorFlow initialises its devices and this pytest process has already
done so; that also keeps the other tests on one device. Each test checks one case's numbers.
"""

from __future__ import annotations

import pytest
from helpers import REL_TOL, case_result, run_script

pytestmark = pytest.mark.slow  # a subprocess with its own TensorFlow (see pyproject)

# REL_TOL (tests/helpers.py) covers 2 replicas: measured 0.75e-6 .. 3.7e-6 here.
# mixed_float16 on both sides (see test_mixed_precision.TOL): measured 2e-4 .. 3e-4 here.
MIXED_TOL = 2e-3
# Generous: 6 small cases on a shared 2-core machine; CPU time is ~20 s.
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def results() -> dict:
    """Every case of distribute_cases.py, run once in one child with 2 logical CPUs."""
    return run_script("distribute_cases.py", timeout=TIMEOUT_S)


@pytest.mark.parametrize("mode", ["eager", "function", "graph"])
def test_loops_match_large_batch_with_ragged_shards(results: dict, mode: str) -> None:
    out = case_result(results, "loops_ragged")[mode]
    assert out["rel"] <= REL_TOL, out
    # 36 samples, micro-batches of 5 (3 + 2 per replica; the last: 1 + 0), K=2: 3 full
    # windows + 1 flushed.
    assert out["updates"] == [4]
    assert out["counters"]["samples_seen"] == 36  # SUM over replicas: every sample once
    assert out["counters"]["micro_batches_seen"] == 8
    assert out["counters"]["windows_applied"] == 4
    assert out["counters"]["micro_step"] == 0 and out["counters"]["window_samples"] == 0


@pytest.mark.parametrize("mode", ["eager", "function", "graph"])
def test_trainer_split_matches_large_batch_on_two_replicas(results: dict, mode: str) -> None:
    out = case_result(results, "trainer_split")[mode]
    assert out["rel"] <= REL_TOL, out
    assert out["updates"] == [4]  # batches of 10, 10, 10, 6: one update each
    # each replica cuts its share: 3 + 2 per batch of 10, 3 for the last of 6
    assert out["counters"]["micro_batches_seen"] == 2 * 3 + 1
    assert out["counters"]["samples_seen"] == 36


def test_fit_matches_large_batch(results: dict) -> None:
    out = case_result(results, "fit_ragged")
    assert out["rel"] <= REL_TOL, out
    assert out["counters"]["windows_applied"] == 4  # 39 samples, 6 per micro-batch, K=2
    assert out["counters"]["samples_seen"] == 39


def test_fit_split_matches_large_batch(results: dict) -> None:
    """``micro_batch_size``: each replica splits its share of every batch of 12."""
    out = case_result(results, "fit_ragged_split")
    assert out["rel"] <= REL_TOL, out
    assert out["iterations"] == out["counters"]["windows_applied"] == 4  # 12, 12, 12, 3
    assert out["counters"]["samples_seen"] == 39


@pytest.mark.parametrize("way", ["accum_steps", "micro_batch_size"])
def test_fit_refuses_an_uneven_first_batch_before_any_update(results: dict, way: str) -> None:
    out = case_result(results, "fit_uneven_first_batch")
    error = out[way]["error"]
    assert error is not None and error.startswith("InvalidArgumentError"), out
    assert "must have the same size and shape" in error and "AddN" in error
    assert out[way]["iterations"] == 0
    assert out["even"] == {"error": None, "iterations": 4}  # 13 samples: 4 + 4 + 4 + 1


@pytest.mark.parametrize("optimizer", ["global_clipnorm", "clipnorm", "adamw"])
def test_clipping_sees_the_global_window_gradient(results: dict, optimizer: str) -> None:
    rel = case_result(results, "clipping_and_decay")[optimizer]
    assert rel <= REL_TOL, f"{optimizer}: rel {rel:.3g}"


@pytest.mark.parametrize("name", ["k2", "k4"])
def test_one_gradient_reduction_per_window_independent_of_k(results: dict, name: str) -> None:
    """Counted by an instrumented CrossDeviceOps, eagerly (every reduction runs in Python)."""
    out = case_result(results, "reductions")
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
    out = case_result(results, "reductions")
    run, n_vars = out["k4_clip"], out["n_vars"]
    # Gradients + status in accumcore's batch (so that clipping sees the global gradient);
    # the optimizer's all-reduce then adds replica 0's gradient to exact zeros.
    assert run["batches"] == [n_vars + 1, n_vars] * 2


def test_nonfinite_shard_skips_the_window_on_every_replica(results: dict) -> None:
    out = case_result(results, "nonfinite_shard")["skip_window"]
    counters = out["counters"]
    assert counters["windows_skipped"] == 1 and counters["windows_applied"] == 2
    assert counters["samples_seen"] - counters["samples_dropped"] == 12  # windows 2 and 3
    assert counters["micro_batches_skipped"] == 0  # checked once per window, at its close
    assert out["rel"] <= REL_TOL, out  # = large batches of windows 2 and 3


def test_nonfinite_raise_under_a_strategy(results: dict) -> None:
    out = case_result(results, "nonfinite_shard")["raise"]
    assert out["raised"], "NonFiniteGradientError not raised"
    assert (out["window"], out["first_micro_step"], out["micro_batches"]) == (0, 0, 2)


@pytest.mark.parametrize("way", ["", "_fit_split"])
def test_mixed_float16_under_mirrored_strategy(results: dict, way: str) -> None:
    out = case_result(results, "mixed_precision")["clean" + way]
    assert out["rel"] <= MIXED_TOL, out
    assert out["counters"]["windows_skipped"] == 0
    assert out["scale"] == 2**15


@pytest.mark.parametrize("way", ["", "_fit_split"])
def test_overflow_on_one_replica_skips_the_window_everywhere(results: dict, way: str) -> None:
    out = case_result(results, "mixed_precision")["overflow" + way]
    counters = out["counters"]
    assert counters["windows_skipped"] == 1 and counters["windows_applied"] == 2
    assert counters["samples_dropped"] == 32 and counters["samples_seen"] == 96
    assert out["scale"] == 2**14
    assert out["rel"] <= MIXED_TOL, out


@pytest.mark.parametrize("mode", ["eager", "function", "graph", "fit", "fit_split"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam_clip"])
def test_masked_tokens_with_sparse_gradients_match_one_device(results: dict, optimizer: str,
                                                             mode: str) -> None:
    """An Embedding model (sparse gradients into replica-local accumulators) with a Keras
    mask: token counts differ per replica and per micro-batch and travel in the window's one
    status reduction; the result is one large batch's global token mean on one device."""
    out = case_result(results, "tokens")
    assert out["tokens_per_replica_differ"]
    run = out[f"{optimizer}_{mode}"]
    assert run["rel"] <= REL_TOL, run
    if not mode.startswith("fit"):
        assert run["epoch_weights"] == [out["valid_tokens"]]  # SUM over replicas


@pytest.mark.parametrize("model", ["mlp", "embedding", "causal_lm", "mlp_split",
                                   "embedding_split", "causal_lm_split"])
def test_accumulate_under_mirrored_strategy_matches_one_device(results: dict, model: str) -> None:
    """``_split``: ``micro_batch_size``, each replica splitting its share of the batch."""
    out = case_result(results, "accumulate_models")[model]
    assert "error" not in out, out
    assert out["rel"] <= REL_TOL, out
    if model.startswith("mlp"):  # 39 samples, windows of 12: 3 full windows + a partial one
        assert out["counters"]["windows_applied"] == 4
    if model.startswith("causal_lm"):
        assert out["iterations"] == 3


@pytest.mark.parametrize("way", ["", "_split", "_clip", "_split_clip"])
def test_a_sum_beside_a_mean_loss_is_exact_under_mirrored_strategy(results: dict,
                                                                   way: str) -> None:
    """A per-sample ``add_loss`` beside ``mse``: undivided accumulators on every replica."""
    out = case_result(results, "sum_beside_mean")["sum_beside_mean" + way]
    assert "error" not in out, out
    assert out["undivided"] > 0, out
    assert out["rel"] <= REL_TOL, out
