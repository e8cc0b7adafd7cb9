"""Mixed precision: loss scaling per micro-batch, one unscale and finiteness check per window.

The models set their dtype policy per layer, so no global Keras policy is changed (other tests
in this process are unaffected). Reference: plain ``train_on_batch`` on each window's samples
under the same policy and optimizer (a ``LossScaleOptimizer`` for ``mixed_float16``).
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import accumcore as ac  # noqa: E402
from accumcore._impl import loss_scaling  # noqa: E402
from accumcore.lab.experiments import get_weights, relative_error  # noqa: E402

LOSS = "sparse_categorical_crossentropy"
MICRO, K = 8, 4  # windows of 32 samples

# Tolerances against the large batch under the SAME policy. Both runs compute the forward and
# backward pass in 16-bit floats, but over different batch compositions (8-sample micro-batches
# vs one 32-sample batch), so every activation and per-sample gradient is rounded differently,
# each at the format's relative precision (float16: 2**-11 = 4.9e-4 per rounding; bfloat16:
# 2**-8 = 3.9e-3). With SGD (an update linear in the gradient) this was measured here, after 2-3
# updates, at rel = 4e-4 (float16) and 1.4e-2 (bfloat16); float32 accumulators add nothing
# visible. The bounds leave a 5x (float16) and 3.5x (bfloat16) margin and stay far below real
# bugs: a missing 1/K gives rel ~ 0.75, a missing unscale ~ 3e4, a skipped window ~ 1.
TOL = {"mixed_float16": 2e-3, "mixed_bfloat16": 5e-2}


def mixed_data(n: int, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 20)).astype("float32")
    y = rng.integers(0, 5, size=n).astype("int32")
    return x, y


def build_mixed_model(policy: str, seed: int = 0, model_cls=keras.Model, **kwargs):
    """20 -> 32 (relu) -> 5, hidden layers in ``policy``, softmax in float32 (as Keras advises)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((20,))
    h = keras.layers.Dense(32, activation="relu", dtype=policy)(inputs)
    h = keras.layers.Dense(5, dtype=policy)(h)
    outputs = keras.layers.Activation("softmax", dtype="float32")(h)
    return model_cls(inputs, outputs, **kwargs)


def mixed_optimizer(policy: str, initial_scale: float = 2.0**15):
    """SGD with momentum; wrapped in a LossScaleOptimizer for float16."""
    inner = keras.optimizers.SGD(0.1, momentum=0.9)
    if policy == "mixed_float16":
        return keras.optimizers.LossScaleOptimizer(inner, initial_scale=initial_scale)
    return inner


# Not helpers.reference_weights: the tests also compare this optimizer's loss scale, iterations.
def reference(policy: str, x, y, initial_scale: float = 2.0**15):
    model = build_mixed_model(policy)
    initial = get_weights(model)
    optimizer = mixed_optimizer(policy, initial_scale)
    model.compile(optimizer, LOSS)
    for start in range(0, len(x), MICRO * K):
        model.train_on_batch(x[start : start + MICRO * K], y[start : start + MICRO * K])
    return initial, get_weights(model), optimizer


def train(entry: str, policy: str, x, y, initial_scale: float = 2.0**15):
    """Returns (model, state, optimizer) after one epoch of micro-batches of MICRO samples."""
    optimizer = mixed_optimizer(policy, initial_scale)
    if entry in ("fit", "fit_split"):  # fit_split: batches of K * MICRO split in the step
        how = dict(accum_steps=K) if entry == "fit" else dict(micro_batch_size=MICRO)
        model = build_mixed_model(policy, model_cls=ac.AccumModel, **how)
        model.compile(optimizer, LOSS)
        model.fit(x, y, batch_size=MICRO if entry == "fit" else MICRO * K, epochs=1,
                  shuffle=False, verbose=0)
        return model, model.accumulation, optimizer
    model = build_mixed_model(policy)
    trainer = ac.AccumTrainer(model, optimizer, LOSS, accum_steps=K)
    trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO), mode=entry, verbose=0)
    return model, trainer.state, optimizer


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("entry", ["function", "fit", "fit_split"])
def test_equivalence_with_large_batch(entry: str, policy: str) -> None:
    x, y = mixed_data(64)
    initial, ref, ref_opt = reference(policy, x, y)
    model, state, optimizer = train(entry, policy, x, y)
    rel = relative_error(get_weights(model), ref, initial)
    assert rel <= TOL[policy], f"{entry}/{policy}: rel {rel:.3g} > {TOL[policy]}"
    assert all(a.dtype == tf.float32 for a in state.accumulators), "accumulators not float32"
    assert state.counters()["windows_applied"] == 2
    if policy == "mixed_float16":  # no overflow here: the scale is unchanged in both runs
        assert loss_scaling.loss_scale(optimizer) == loss_scaling.loss_scale(ref_opt) == 2**15


@pytest.mark.parametrize("entry", ["eager", "fit", "fit_split"])
def test_forced_overflow_skips_exactly_one_window(entry: str) -> None:
    """One sample of window 2 overflows float16: that window is skipped whole, the scale is
    halved, nothing is raised (nonfinite='raise' is the default) and window 3 is applied with
    all its samples, exactly like Keras's own LossScaleOptimizer on the large batches."""
    x, y = mixed_data(96)  # 3 windows of 32
    x[40] *= 1e6  # window 2 (samples 32..63): float16 overflow (> 65504) in the first layer
    initial, ref, ref_opt = reference("mixed_float16", x, y)
    model, state, optimizer = train(entry, "mixed_float16", x, y)
    counters = state.counters()
    assert counters["windows_skipped"] == 1
    assert counters["windows_applied"] == 2
    assert counters["samples_dropped"] == MICRO * K  # exactly window 2's samples
    assert counters["samples_seen"] == 96 and counters["micro_batches_seen"] == 12
    assert counters["micro_step"] == 0 and counters["window_samples"] == 0  # next window clean
    assert loss_scaling.loss_scale(optimizer) == loss_scaling.loss_scale(ref_opt) == 2**14
    assert int(optimizer.iterations.numpy()) == int(ref_opt.iterations.numpy()) == 2
    # Windows 1 and 3 applied as in the large-batch run (window 3 with the lowered scale).
    rel = relative_error(get_weights(model), ref, initial)
    assert rel <= TOL["mixed_float16"], f"rel {rel:.3g}"
    assert all(np.all(np.isfinite(w)) for w in get_weights(model))


@pytest.mark.parametrize("entry", ["fit", "fit_split"])
def test_fit_reports_skipped_windows(entry: str) -> None:
    x, y = mixed_data(64)
    x[3] *= 1e6  # window 1 overflows
    how = dict(accum_steps=K) if entry == "fit" else dict(micro_batch_size=MICRO)
    model = build_mixed_model("mixed_float16", model_cls=ac.AccumModel, **how)
    model.compile(mixed_optimizer("mixed_float16"), LOSS)
    history = model.fit(x, y, batch_size=MICRO if entry == "fit" else MICRO * K, epochs=1,
                        shuffle=False, verbose=0)
    assert history.history["skipped_windows"] == [1.0]


def test_overflow_is_not_a_nonfinite_error_but_nan_without_scaling_is() -> None:
    """Under loss scaling the per-micro-batch policy stands aside; without it, it raises."""
    x, y = mixed_data(32)
    x[5] *= 1e6
    model = build_mixed_model("mixed_float16")
    trainer = ac.AccumTrainer(model, mixed_optimizer("mixed_float16"), LOSS, accum_steps=K)
    trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO), verbose=0)
    assert trainer.state.counters()["windows_skipped"] == 1
    with warnings.catch_warnings():  # accumcore warns: float16 without loss scaling
        warnings.simplefilter("ignore")
        plain = ac.AccumTrainer(build_mixed_model("mixed_float16"), keras.optimizers.SGD(0.1),
                                LOSS, accum_steps=K)
    with pytest.raises(ac.NonFiniteGradientError):
        plain.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO), verbose=0)
