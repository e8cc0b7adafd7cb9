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
from helpers import REL_TOL, make_data, reference_weights, run_workers

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

    # The independent reference: one process, one device, one train_on_batch per window.
    x, y = make_data(worker.N, seed=worker.SEED)
    initial, reference = reference_weights(worker.make_optimizer, x, y, None, worker.MICRO,
                                           worker.K)
    window = worker.MICRO * worker.K
    for i, result in enumerate(results):
        assert result["replicas"] == 2
        assert result["updates"] == [worker.N // window]
        assert result["counters"]["samples_seen"] == worker.N  # SUM over both workers
        rel = relative_error(result["weights"], reference, initial)
        print(f"worker {i}: relative weight error vs single-process large batch {rel:.3g}")
        assert rel <= REL_TOL, f"worker {i}: rel {rel:.3g}"
    for a, b in zip(results[0]["weights"], results[1]["weights"], strict=True):
        np.testing.assert_array_equal(a, b)  # replicas in sync
