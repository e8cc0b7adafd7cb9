"""MultiWorkerMirroredStrategy: two worker processes on 127.0.0.1 train with accumulation.

Both workers must end with the weights of single-process large-batch training (one
``train_on_batch`` per window of K global micro-batches). The workers are bounded by a timeout
and always killed in ``finally``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # a subprocess with its own TensorFlow (see pyproject)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import multiworker_worker as worker  # noqa: E402

# Float32, 2 workers x 1 replica: same bound and reasoning as test_distribute.REL_TOL
# (re-association round-off ~1e-6; a real bug, e.g. per-worker clipping, is >= 1e-2).
REL_TOL = 1e-4
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


def test_two_workers_match_single_process_large_batch(tmp_path: Path) -> None:
    from accumcore.lab.experiments import get_weights, relative_error

    ports = free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs: list[subprocess.Popen] = []
    outs = [tmp_path / f"worker{i}.json" for i in range(2)]
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
    try:
        for i in range(2):
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0",
                       TF_CONFIG=json.dumps({"cluster": cluster,
                                             "task": {"type": "worker", "index": i}}))
            env["CUDA_VISIBLE_DEVICES"] = ""  # CPU workers, also on a GPU machine
            with open(logs[i], "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(HERE / "multiworker_worker.py"), str(outs[i])],
                    env=env, stdout=log, stderr=subprocess.STDOUT, cwd=HERE.parent,
                ))
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        tails = "\n".join(log.read_text()[-2000:] for log in logs)
        pytest.fail(f"workers did not finish within {TIMEOUT_S} s:\n{tails}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"worker {i} failed:\n{logs[i].read_text()[-4000:]}"

    # The independent reference: one process, one device, one train_on_batch per window.
    x, y = worker.data()
    model = worker.make_model()
    initial = get_weights(model)
    model.compile(worker.make_optimizer(), worker.LOSS)
    window = worker.MICRO * worker.K
    for start in range(0, worker.N, window):
        model.train_on_batch(x[start : start + window], y[start : start + window])
    reference = get_weights(model)

    results = [json.loads(out.read_text()) for out in outs]
    for i, result in enumerate(results):
        assert result["replicas"] == 2
        assert result["updates"] == [worker.N // window]
        assert result["counters"]["samples_seen"] == worker.N  # SUM over both workers
        weights = [np.asarray(w, np.float32) for w in result["weights"]]
        rel = relative_error(weights, reference, initial)
        print(f"worker {i}: relative weight error vs single-process large batch {rel:.3g}")
        assert rel <= REL_TOL, f"worker {i}: rel {rel:.3g}"
    for a, b in zip(results[0]["weights"], results[1]["weights"], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # replicas in sync
