"""Property test: random K, ragged micro-batch sizes and optimizers, against the large batch."""

from __future__ import annotations

import numpy as np
from helpers import LOSS, OPTIMIZERS, REL_TOL, small_mlp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import accumcore as ac
from accumcore.lab.experiments import get_weights, relative_error


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    opt_name=st.sampled_from(sorted(OPTIMIZERS)),
    seed=st.integers(0, 2**16),
)
def test_one_window_of_any_micro_batch_sizes_equals_one_large_batch(sizes, opt_name, seed):
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = rng.integers(0, 3, size=n).astype("int32")

    ref = small_mlp()
    initial = get_weights(ref)
    ref.compile(OPTIMIZERS[opt_name](), LOSS)
    ref.train_on_batch(x, y)

    model = small_mlp()
    trainer = ac.AccumTrainer(model, OPTIMIZERS[opt_name](), LOSS, accum_steps=len(sizes))
    start = 0
    applied = []
    for size in sizes:  # eager: no retracing cost per example
        _, _, did = trainer.train_micro_batch(x[start:start + size], y[start:start + size])
        applied.append(bool(did))
        start += size
    assert applied == [False] * (len(sizes) - 1) + [True]
    assert int(trainer.optimizer.iterations.numpy()) == 1
    assert relative_error(get_weights(model), get_weights(ref), initial) <= REL_TOL
