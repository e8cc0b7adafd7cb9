"""MultiWorkerMirroredStrategy: two worker processes on 127.0.0.1.

``AccumTrainer`` on both workers must end with the weights of single-process large-batch
training, with ``accum_steps`` (one ``train_on_batch`` per window of K global micro-batches) and
with ``micro_batch_size`` (one per global batch given, each worker splitting its share), in
every mode. Keras's own ``fit`` is checked to fail there before any train step
(keras-team/keras#20585), as the devices reference page says: if Keras fixes it, the test says
so. An out-of-memory error on one worker only stops both with an error. The workers run
through ``helpers.run_workers``: bounded by a timeout, always killed at the end.
"""

from __future__ import annotations

import json
import socket

import multiworker_worker as worker
import numpy as np
import pytest
from helpers import (
    REL_TOL,
    dense_reference,
    make_data,
    reference_weights,
    run_workers,
    seq_model,
    token_loss,
)

pytestmark = pytest.mark.slow  # a subprocess with its own TensorFlow (see pyproject)

# REL_TOL (tests/helpers.py) covers 2 workers x 1 replica: re-association round-off ~1e-6; a
# real bug, e.g. per-worker clipping, is >= 1e-2.
TIMEOUT_S = 900  # both workers together: 12 trainings each on a loaded 2-core machine


def free_ports(n: int) -> list[int]:
    """Ports the kernel reports free right now (bind to port 0, read it, release it)."""
    sockets, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


def two_workers(case: str, *args: str, timeout: float = TIMEOUT_S) -> list[dict]:
    """Each worker's result of ``multiworker_worker.py CASE ARGS`` on a fresh 2-worker
    cluster."""
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
    envs = [{"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})}
            for i in range(2)]
    return run_workers("multiworker_worker.py", envs, case, *args, timeout=timeout)


def references() -> dict:
    """The independent references per ``case/way``: one process, one device, one update per
    window (K global micro-batches) or per global batch (split): plain train_on_batch for the
    MLP; for the masked Embedding model (sparse gradients, uneven tokens per worker) one tape
    over the window with dense gradients (dense_reference)."""
    x, y = make_data(worker.N, seed=worker.SEED)
    xt, yt = worker.tokens_data()
    out = {}
    for way, (batch, given) in worker.WAYS.items():
        k = given.get("accum_steps", 1)
        out[f"mlp/{way}"] = reference_weights(worker.make_optimizer, x, y, None, batch, k)
        out[f"tokens/{way}"] = dense_reference(seq_model, worker.make_optimizer, token_loss(),
                                               xt, yt, None, batch, k)
    return out


def test_trainer_on_two_workers_matches_single_process_large_batch() -> None:
    from accumcore.lab.experiments import relative_error

    results = two_workers("trainer")
    valid_tokens = float((worker.tokens_data()[0] != 0).sum())
    for key, (initial, reference) in references().items():
        way = key.split("/")[1]
        batch, given = worker.WAYS[way]
        window = batch * given.get("accum_steps", 1)
        for mode in worker.MODES:
            run_key = f"{key}/{mode}"
            for i, result in enumerate(results):
                run = result[run_key]
                assert result["replicas"] == 2
                assert run["updates"] == [worker.N // window], run_key
                assert run["counters"]["samples_seen"] == worker.N  # SUM over both workers
                rel = relative_error(run["weights"], reference, initial)
                print(f"{run_key}, worker {i}: relative weight error vs one large batch "
                      f"{rel:.3g}")
                assert rel <= REL_TOL, f"{run_key}, worker {i}: rel {rel:.3g}"
            for a, b in zip(results[0][run_key]["weights"], results[1][run_key]["weights"],
                            strict=True):
                np.testing.assert_array_equal(a, b)  # replicas in sync
            if key.startswith("tokens"):
                # Each worker's LoopHistory counts its own replicas' tokens (the loop's records
                # are combined locally); together they are every valid token once.
                assert sum(r[run_key]["epoch_weights"][0] for r in results) == valid_tokens


def test_keras_fit_fails_on_two_workers_before_any_train_step() -> None:
    """keras-team/keras#20585 (open since 2024-12): Keras 3's ``fit`` builds the model from the
    first distributed batch in ``_maybe_symbolic_build`` and cannot convert its ``PerReplica``
    value, with arrays and with a dataset, for a plain model, an ``AccumModel`` and a model
    given to ``accumulate`` alike (both train through Keras's ``fit``). The
    devices page says so and sends multi-worker training to ``AccumTrainer``; when this test
    fails because ``fit`` trained, Keras has fixed it and the page must change."""
    results = two_workers("keras_fit", timeout=300)
    for i, result in enumerate(results):
        assert result["replicas"] == 2
        for run_key in (f"{model}/{source}" for model in ("keras.Model", "AccumModel",
                                                          "accumulate")
                        for source in ("arrays", "dataset")):
            outcome = result[run_key]
            assert outcome is not None, f"worker {i}: {run_key} trained: Keras fixed #20585"
            print(f"worker {i}, {run_key}: {outcome['error'][:60]} ... "
                  f"{outcome['error'][-100:]}")
            assert outcome["error"].startswith("ValueError: Attempt to convert a value (PerReplica")
            assert "with an unsupported type" in outcome["error"]
            assert "_maybe_symbolic_build" in outcome["frames"]


def test_out_of_memory_on_one_worker_stops_both_with_an_error() -> None:
    """An out-of-memory error on worker 0 only, inside a compiled step (``micro_batch_size=5``,
    each worker's share of 12 cut 5 + 5 + 2): worker 0 raises it; worker 1, waiting in the
    window's all-reduce, stops with TensorFlow's collective abort once worker 0's process has
    ended (its collectives then refuse to run until the program restarts, which is also why
    ``micro_batch_size="auto"`` cannot rerun a step on several workers). Neither trains on."""
    results = two_workers("oom", timeout=300)
    assert results[0]["oom"]["error"].startswith("ResourceExhaustedError")
    assert "injected: 5 samples" in results[0]["oom"]["error"]
    assert "Collective ops is aborted" in results[1]["oom"]["error"]


def test_auto_on_two_workers_agrees_on_the_smaller_micro_batch() -> None:
    """``micro_batch_size="auto"`` on two workers: worker 0 fits 3 samples, worker 1 all 12 of
    its share; the search runs on each worker's device at the first batch and both take the
    smallest b (one all-gather), so both train exactly as one process at the large batch."""
    from accumcore.lab.experiments import relative_error

    results = two_workers("auto")
    x, y = make_data(worker.N, seed=worker.SEED)
    initial, reference = reference_weights(worker.make_optimizer, x, y, None, worker.BATCH, 1)
    for i, result in enumerate(results):
        run = result["auto"]
        assert run["b"] == 3, f"worker {i} trained with b = {run['b']}"
        assert run["updates"] == [worker.N // worker.BATCH]
        rel = relative_error(run["weights"], reference, initial)
        print(f"auto, worker {i}: b = {run['b']}, relative weight error {rel:.3g}")
        assert rel <= REL_TOL, f"worker {i}: rel {rel:.3g}"
