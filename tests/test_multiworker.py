"""MultiWorkerMirroredStrategy: two worker processes on 127.0.0.1 train with accumulation.

Both workers must end with the weights of single-process large-batch training (one
``train_on_batch`` per window of K global micro-batches). The workers run through
``helpers.run_workers``: bounded by a timeout, always killed at the end.
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
TIMEOUT_S = 300  # both workers together; ~30 s of CPU each on a loaded 2-core machine


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


def test_two_workers_match_single_process_large_batch() -> None:
    from accumcore.lab.experiments import relative_error

    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
    envs = [{"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})}
            for i in range(2)]
    results = run_workers("multiworker_worker.py", envs, timeout=TIMEOUT_S)

    # The independent references: one process, one device, one update per window: plain
    # train_on_batch for the MLP; for the masked Embedding model (sparse gradients, uneven
    # tokens per worker) one tape over the window with dense gradients (dense_reference).
    x, y = make_data(worker.N, seed=worker.SEED)
    references = {"mlp": reference_weights(worker.make_optimizer, x, y, None, worker.MICRO,
                                           worker.K)}
    xt, yt = worker.tokens_data()
    references["tokens"] = dense_reference(seq_model, worker.make_optimizer, token_loss(), xt,
                                           yt, None, worker.MICRO, worker.K)
    window = worker.MICRO * worker.K
    for case, (initial, reference) in references.items():
        for i, result in enumerate(results):
            run = result[case]
            assert result["replicas"] == 2
            assert run["updates"] == [worker.N // window]
            assert run["counters"]["samples_seen"] == worker.N  # SUM over both workers
            rel = relative_error(run["weights"], reference, initial)
            print(f"{case}, worker {i}: relative weight error vs one large batch {rel:.3g}")
            assert rel <= REL_TOL, f"{case}, worker {i}: rel {rel:.3g}"
        for a, b in zip(results[0][case]["weights"], results[1][case]["weights"], strict=True):
            np.testing.assert_array_equal(a, b)  # replicas in sync
    # Each worker's LoopHistory counts its own replicas' tokens (the loop's records are
    # combined locally); together they are every valid token once.
    assert sum(r["tokens"]["epoch_weights"][0] for r in results) == float((xt != 0).sum())
