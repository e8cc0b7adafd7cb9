"""``AccumModel.fit`` with ``steps_per_execution`` and with ``jit_compile=True`` (XLA, on CPU).

Keras runs ``steps_per_execution`` train steps (micro-batches here) inside one compiled call, so
windows of K micro-batches span executions and the last execution of an epoch is ragged. The
state lives in variables, so the window rule must not care; these tests check it against an
independent large-batch reference: a plain ``keras.Model`` trained with one ``train_on_batch``
per window on exactly that window's samples (built here from the micro-batch stream and the
``end_of_epoch`` policy, not from accumcore).

38 samples, micro-batches of 4 (the tenth holds 2: a ragged last micro-batch), K = 3: per epoch
windows of 3, 3, 3 and 1 micro-batches; 2 epochs.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from helpers import LOSS, REL_TOL, assert_matches_reference, reference_weights, small_mlp

import accumcore as ac

N, MICRO, K, EPOCHS = 38, 4, 3, 2


def make_opt() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(0.01)


@pytest.fixture
def arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(N, 8)).astype("float32")
    y = rng.integers(0, 3, N).astype("int32")
    sw = rng.uniform(0.5, 2.0, N).astype("float32")
    return x, y, sw


def reference_windows(end_of_epoch: str) -> tuple[list[np.ndarray], int]:
    """The windows a large-batch run would apply, as sample indices, and the micro-batches
    left pending at the end (``"carry"``): written from the policy's definition."""
    micro = [np.arange(s, min(s + MICRO, N)) for s in range(0, N, MICRO)]
    windows, current = [], []
    for _ in range(EPOCHS):
        for batch in micro:
            current.append(batch)
            if len(current) == K:
                windows.append(np.concatenate(current))
                current = []
        if current and end_of_epoch == "apply":
            windows.append(np.concatenate(current))
        if end_of_epoch != "carry":
            current = []
    return windows, len(current)


def fit(x, y, sw, *, end_of_epoch="apply", steps_per_execution=1, jit_compile=False):
    model = small_mlp(model_cls=ac.AccumModel, accum_steps=K, end_of_epoch=end_of_epoch)
    model.compile(make_opt(), LOSS, steps_per_execution=steps_per_execution,
                  jit_compile=jit_compile)
    history = model.fit(x, y, sample_weight=sw, batch_size=MICRO, epochs=EPOCHS,
                        shuffle=False, verbose=0)
    return model, history


@pytest.mark.parametrize("end_of_epoch", ["apply", "carry", "drop"])
@pytest.mark.parametrize("steps_per_execution", [2, 4, 7, 32])
def test_steps_per_execution_is_exact(arrays, end_of_epoch, steps_per_execution):
    """Windows spanning executions (K = 3 vs 2, 4, 7 micro-batches per execution), a ragged
    last execution (10 = 7 + 3; 32 > 10: one short execution per epoch) and every end-of-epoch
    policy. Catches: a window closed at an execution boundary, a micro-batch lost or repeated
    in a ragged execution, the end-of-epoch policy applied per execution."""
    x, y, _ = arrays
    windows, pending = reference_windows(end_of_epoch)
    initial, ref = reference_weights(make_opt, x, y, None, windows=windows)
    model, _ = fit(x, y, None, end_of_epoch=end_of_epoch,
                   steps_per_execution=steps_per_execution)
    assert_matches_reference(model, initial, ref)
    assert int(model.optimizer.iterations.numpy()) == len(windows)
    counters = model.accumulation.counters()
    assert counters["windows_applied"] == len(windows)
    assert counters["micro_batches_seen"] == EPOCHS * 10
    assert model.accumulation.pending_micro_batches() == pending


def test_steps_per_execution_reference_can_fail(arrays):
    """Guard: windows cut at execution boundaries (every 4 micro-batches, a 'K' of 4) miss the
    K = 3 reference by far more than REL_TOL, so the test above can fail."""
    x, y, _ = arrays
    windows, _ = reference_windows("apply")
    initial, ref = reference_weights(make_opt, x, y, None, windows=windows)
    wrong = [np.arange(s, min(s + 4 * MICRO, N)) for s in range(0, N, 4 * MICRO)] * EPOCHS
    _, other = reference_weights(make_opt, x, y, None, windows=wrong)
    from accumcore.lab.experiments import relative_error

    assert relative_error(other, ref, initial) > 100 * REL_TOL


@pytest.mark.parametrize(("steps_per_execution", "weighted"), [(1, False), (4, True)])
def test_jit_compile_is_exact_on_cpu(arrays, steps_per_execution, weighted):
    """``compile(jit_compile=True)`` (Keras's default on GPUs): XLA-compiled train steps, the
    ragged last micro-batch of 2 samples included (a second compiled shape), with and without
    sample weights. Catches: XLA clamping or reusing the full-size shape for the ragged
    micro-batch, a weight computed from a static batch size, a cond XLA mis-compiles."""
    x, y, sw = arrays
    sw = sw if weighted else None
    windows, _ = reference_windows("apply")
    initial, ref = reference_weights(make_opt, x, y, sw, windows=windows)
    model, _ = fit(x, y, sw, steps_per_execution=steps_per_execution, jit_compile=True)
    assert model.jit_compile, "Keras turned jit_compile off: the test would not test XLA"
    assert_matches_reference(model, initial, ref)
    assert int(model.optimizer.iterations.numpy()) == len(windows)


@pytest.mark.parametrize(("steps_per_execution", "jit_compile"), [(4, False), (1, True)])
def test_nonfinite_raise_names_the_micro_step_under_execution_and_xla(
        arrays, steps_per_execution, jit_compile):
    """A NaN in micro-batch 5 (window 1, position 2, counted from 0): the error, raised at the
    epoch's end, names that window (``err.window`` 1, ``err.first_micro_step`` 3; its message
    counts from 1) and the 4 micro-batches after it that were discarded,
    whatever the execution grouping; the weights are those of window 0 alone."""
    x, y, _ = arrays
    bad = x.copy()
    bad[5 * MICRO + 1, 3] = np.nan
    model = small_mlp(model_cls=ac.AccumModel, accum_steps=K)
    model.compile(make_opt(), LOSS, steps_per_execution=steps_per_execution,
                  jit_compile=jit_compile)
    with pytest.raises(ac.NonFiniteGradientError) as info:
        model.fit(bad, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    err = info.value
    assert (err.epoch, err.window, err.first_micro_step, err.micro_batches) == (0, 1, 3, 3)
    assert err.unused_micro_batches == 4
    initial, ref = reference_weights(make_opt, x, y, None, windows=[np.arange(0, 3 * MICRO)])
    assert_matches_reference(model, initial, ref)
    assert model.accumulation.counters()["windows_applied"] == 1
