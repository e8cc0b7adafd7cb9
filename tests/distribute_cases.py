"""Distributed test cases, run in a *separate process* with 2 logical CPU devices.

Logical devices must be configured before TensorFlow initialises its devices, so these cases
cannot run inside the pytest process (other tests have initialised TF there already).
``tests/test_distribute.py`` runs this script once through ``helpers.run_script`` and checks
the result each case emits (``helpers.run_cases``)::

    python tests/distribute_cases.py [case ...]      # with $ACCUMCORE_TEST_RESULT set

Each case returns a dict of plain numbers; an exception is recorded as ``{"error": ...}`` so
the test that reads it fails with the traceback. All equivalence references are independent:
plain ``train_on_batch`` on the concatenated window, on ONE device, from the same initial
weights (``helpers.reference_weights``: the default strategy, outside any scope).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf
from helpers import (
    LOSS,
    dense_reference,
    make_data,
    reference_weights,
    run_cases,
    seq_data,
    seq_model,
    small_mlp,
    token_loss,
)

import accumcore as ac
from accumcore._impl import loss_scaling
from accumcore.lab.devices import CountingCrossDeviceOps, replica_devices
from accumcore.lab.experiments import get_weights, relative_error

# Two logical CPUs, before anything initialises TensorFlow's devices (importing accumcore and
# helpers does not). run_script sets CUDA_VISIBLE_DEVICES="": CPUs on a GPU machine too.
DEVICES = replica_devices(2)
CASES: dict[str, Callable[[], dict]] = {}


def case(fn: Callable[[], dict]) -> Callable[[], dict]:
    CASES[fn.__name__] = fn
    return fn


_SHARED: list[tf.distribute.MirroredStrategy] = []


def mirrored(cross_device_ops=None) -> tf.distribute.MirroredStrategy:
    """The process's one collective MirroredStrategy, or a new one with ``cross_device_ops``.

    Every MirroredStrategy of a process numbers its collective ops from the same keys, so two
    of them that both use collectives (the default on CPUs) collide ("Shape mismatch in the
    collective instance"): share one. ReductionToOneDevice uses no collectives.
    """
    if cross_device_ops is not None:
        return tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=cross_device_ops)
    if not _SHARED:
        _SHARED.append(tf.distribute.MirroredStrategy(DEVICES))
    return _SHARED[0]


def adam() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(0.01)


def train_trainer(strategy, make_opt, x, y, micro, k, mode, make_model=small_mlp, **kwargs):
    with strategy.scope():
        model = make_model()
        trainer = ac.AccumTrainer(model, make_opt(), LOSS, accum_steps=k, **kwargs)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(micro)
    history = trainer.fit(ds, epochs=1, mode=mode, verbose=0)
    return model, trainer, history


# ---------------------------------------------------------------------------- cases
@case
def loops_ragged() -> dict:
    """Eager, tf.function and graph loops; micro-batch 5 over 2 replicas = 3 + 2 samples; the
    last micro-batch (1 sample) leaves replica 1 EMPTY, and the last window is partial."""
    x, y = make_data(36)
    micro, k = 5, 2
    initial, ref = reference_weights(adam, x, y, None, micro, k)
    out = {}
    strategy = mirrored()
    for mode in ("eager", "function", "graph"):
        model, _, history = train_trainer(strategy, adam, x, y, micro, k, mode)
        out[mode] = {
            "rel": relative_error(get_weights(model), ref, initial),
            "counters": history.counters,
            "updates": history.updates,
        }
    return out


@case
def trainer_split() -> dict:
    """``AccumTrainer(micro_batch_size=3)``: batches of B = 10 over 2 replicas (5 + 5, each
    replica splitting its share 3 + 2), the last batch of 6 (3 + 3): one update per batch, in
    every mode."""
    x, y = make_data(36)
    initial, ref = reference_weights(adam, x, y, None, 10, 1)
    out = {}
    strategy = mirrored()
    for mode in ("eager", "function", "graph"):
        with strategy.scope():
            model = small_mlp()
            trainer = ac.AccumTrainer(model, adam(), LOSS, micro_batch_size=3)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(10)
        history = trainer.fit(ds, epochs=1, mode=mode, verbose=0)
        out[mode] = {"rel": relative_error(get_weights(model), ref, initial),
                     "counters": history.counters, "updates": history.updates}
    return out


@case
def fit_ragged() -> dict:
    """AccumModel.fit: micro-batch 6 (3 + 3); the last micro-batch of 3 is ragged (2 + 1)."""
    x, y = make_data(39)
    micro, k = 6, 2
    initial, ref = reference_weights(adam, x, y, None, micro, k)
    with mirrored().scope():
        model = small_mlp(model_cls=ac.AccumModel, accum_steps=k)
        model.compile(adam(), LOSS)
    history = model.fit(x, y, batch_size=micro, epochs=1, shuffle=False, verbose=0)
    return {
        "rel": relative_error(get_weights(model), ref, initial),
        "counters": model.accumulation.counters(),
        "loss": float(history.history["loss"][-1]),
    }


@case
def fit_ragged_split() -> dict:
    """AccumModel(micro_batch_size=3).fit at batch 12: each replica splits its 6 samples into
    3 + 3; the last batch of 3 is ragged (2 + 1 per replica)."""
    x, y = make_data(39)
    initial, ref = reference_weights(adam, x, y, None, 6, 2)  # windows of 12
    with mirrored().scope():
        model = small_mlp(model_cls=ac.AccumModel, micro_batch_size=3)
        model.compile(adam(), LOSS)
    model.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    return {"rel": relative_error(get_weights(model), ref, initial),
            "counters": model.accumulation.counters(),
            "iterations": int(model.optimizer.iterations.numpy())}


@case
def fit_uneven_first_batch() -> dict:
    """``fit`` whose FIRST batch splits unevenly (5 = 3 + 2): Keras builds the model from the
    mean of the replicas' shares and raises before any update (the devices page's Limits), with
    either setting; an even first batch (4 = 2 + 2) trains, its short last batch included."""
    x, y = make_data(13)
    out: dict = {}
    for way, (how, batch) in {"accum_steps": (dict(accum_steps=2), 5),
                              "micro_batch_size": (dict(micro_batch_size=2), 5),
                              "even": (dict(micro_batch_size=1), 4)}.items():
        with mirrored().scope():
            model = small_mlp(model_cls=ac.AccumModel, **how)
            model.compile(adam(), LOSS)
        try:
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
            out[way] = {"error": None}
        except Exception as error:  # noqa: BLE001 - the error is the result
            out[way] = {"error": f"{type(error).__name__}: {error}"}
        out[way]["iterations"] = int(model.optimizer.iterations.numpy())
    return out


@case
def clipping_and_decay() -> dict:
    """Clipping must see the global window gradient (Keras clips per replica otherwise)."""
    x, y = make_data(40)
    micro, k = 4, 5
    opts = {
        "global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
        "clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=0.01),
        "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    }
    strategy = mirrored()
    out = {}
    for name, make_opt in opts.items():
        initial, ref = reference_weights(make_opt, x, y, None, micro, k)
        model, _, _ = train_trainer(strategy, make_opt, x, y, micro, k, "function")
        out[name] = relative_error(get_weights(model), ref, initial)
    return out


@case
def reductions() -> dict:
    """Count the cross-replica reductions of whole windows, eagerly (every op runs in Python).

    For K in (2, 4): two windows of K micro-batches; also a clipping optimizer.
    """
    out = {}
    x, y = make_data(64)
    micro = 4
    n_vars = len(small_mlp().trainable_variables)
    for name, k, make_opt in (("k2", 2, adam), ("k4", 4, adam),
                              ("k4_clip", 4, lambda: keras.optimizers.Adam(0.01, clipnorm=1.0))):
        ops = CountingCrossDeviceOps()
        strategy = mirrored(ops)
        with strategy.scope():
            model = small_mlp()
            trainer = ac.AccumTrainer(model, make_opt(), LOSS, accum_steps=k)
        batches = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(micro)
        )
        per_step = []
        it = iter(batches)
        for _ in range(2 * k):
            before = len(ops.batches)
            xb, yb = next(it)
            trainer.train_micro_batch(xb, yb)
            per_step.append(ops.batches[before:])
        out[name] = {
            "k": k,
            "micro_steps": 2 * k,
            "batches": ops.batches,
            "singles": ops.singles,
            "per_step": per_step,
            "windows_applied": int(trainer.state.windows_applied.numpy()),
        }
    out["n_vars"] = n_vars
    return out


@case
def nonfinite_shard() -> dict:
    """A NaN in one replica's shard: 'skip_window' skips the window on every replica (the
    flag travels in the window's one reduction); 'raise' raises from the host."""
    x, y = make_data(20)
    x[5] = np.nan  # micro-batch 1 (samples 4..7): replica 0's shard 4, 5
    micro, k = 4, 2
    strategy = mirrored()
    # Reference: the large batches of windows 2 and 3 only (window 1 is skipped).
    initial, ref = reference_weights(adam, x[8:], y[8:], None, micro, k)
    model, _, history = train_trainer(strategy, adam, x, y, micro, k, "function",
                                      nonfinite="skip_window")
    out = {"skip_window": {"rel": relative_error(get_weights(model), ref, initial),
                           "counters": history.counters}}
    try:
        train_trainer(strategy, adam, x, y, micro, k, "function")
        out["raise"] = {"raised": False}
    except ac.NonFiniteGradientError as err:
        out["raise"] = {"raised": True, "window": err.window,
                        "first_micro_step": err.first_micro_step,
                        "micro_batches": err.micro_batches}
    return out


@case
def mixed_precision() -> dict:
    """mixed_float16 + LossScaleOptimizer under MirroredStrategy, and a forced overflow that
    lands on ONE replica only: the whole window must be skipped on every replica."""
    from test_mixed_precision import build_mixed_model, mixed_data, mixed_optimizer  # noqa: E402

    micro, k = 8, 4
    x, y = mixed_data(96)
    bad = 40  # window 2 (samples 32..63), micro-batch 40..47: replica 0 gets 40..43
    x_bad = x.copy()
    x_bad[bad] *= 1e6  # float16 activations overflow -> non-finite gradients
    out = {}
    for name, xs in (("clean", x), ("overflow", x_bad)):
        def make():
            return build_mixed_model("mixed_float16")
        initial, ref = reference_weights(lambda: mixed_optimizer("mixed_float16"), xs, y, None,
                                         micro, k, make_model=make)
        model, trainer, history = train_trainer(
            mirrored(), lambda: mixed_optimizer("mixed_float16"), xs, y, micro, k, "function",
            make_model=make,
        )
        out[name] = {
            "rel": relative_error(get_weights(model), ref, initial),
            "counters": history.counters,
            "scale": loss_scaling.loss_scale(trainer.optimizer),
        }
        with mirrored().scope():  # fit with micro_batch_size: batches of K * b, split
            model = build_mixed_model("mixed_float16", model_cls=ac.AccumModel,
                                      micro_batch_size=micro)
            model.compile(mixed_optimizer("mixed_float16"), LOSS)
        model.fit(xs, y, batch_size=micro * k, epochs=1, shuffle=False, verbose=0)
        out[f"{name}_fit_split"] = {
            "rel": relative_error(get_weights(model), ref, initial),
            "counters": model.accumulation.counters(),
            "scale": loss_scaling.loss_scale(model.optimizer),
        }
    return out


@case
def tokens() -> dict:
    """A masked Embedding model (sparse gradients, uneven tokens per replica and per
    micro-batch): micro-batches of 6 (3 + 3 per replica), K = 2, every entry point that runs
    under a strategy, against one large batch on ONE device. SGD against plain
    train_on_batch; Adam with global clipping (the replicas pre-reduce the window) against the
    dense-gradient reference (tests/helpers.py dense_reference)."""
    x, y = seq_data(42, seed=11)
    micro, k = 6, 2
    strategy = mirrored()
    out: dict = {"tokens_per_replica_differ": bool(
        (x[0:3] != 0).sum() != (x[3:6] != 0).sum())}
    optimizers = {
        "sgd": (lambda: keras.optimizers.SGD(0.5),
                lambda: reference_weights(lambda: keras.optimizers.SGD(0.5), x, y, None, micro,
                                          k, loss=token_loss(), make_model=seq_model)),
        "adam_clip": (lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5),
                      lambda: dense_reference(
                          seq_model, lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5),
                          token_loss(), x, y, None, micro, k)),
    }
    for name, (make_opt, reference) in optimizers.items():
        initial, ref = reference()
        for mode in ("eager", "function", "graph"):
            with strategy.scope():
                model = seq_model()
                trainer = ac.AccumTrainer(model, make_opt(), token_loss(), accum_steps=k)
            ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(micro)
            history = trainer.fit(ds, epochs=1, mode=mode, verbose=0)
            out[f"{name}_{mode}"] = {"rel": relative_error(get_weights(model), ref, initial),
                                     "epoch_weights": history.epoch_weights}
        with strategy.scope():
            model = seq_model(model_cls=ac.AccumModel, accum_steps=k)
            model.compile(make_opt(), token_loss())
        model.fit(x, y, batch_size=micro, epochs=1, shuffle=False, verbose=0)
        out[f"{name}_fit"] = {"rel": relative_error(get_weights(model), ref, initial)}
        with strategy.scope():  # batches of K * b = 12, each replica splitting its 6: 3 + 3
            model = seq_model(model_cls=ac.AccumModel, micro_batch_size=micro // 2)
            model.compile(make_opt(), token_loss())
        model.fit(x, y, batch_size=micro * k, epochs=1, shuffle=False, verbose=0)
        out[f"{name}_fit_split"] = {"rel": relative_error(get_weights(model), ref, initial)}
    out["valid_tokens"] = float((x != 0).sum())
    return out


@case
def accumulate_models() -> dict:
    """``accumulate`` on models built in the strategy's scope, graph mode: an MLP and a masked
    Embedding model (compiled, then accumulated) against one large batch on ONE device, and
    a tiny KerasHub causal LM (int32 padding mask: plain ``fit`` refuses a bool one under
    MirroredStrategy) against plain ``train_on_batch`` of each window on one device.

    Each model twice: ``accum_steps=K`` (``fit`` batches of b, K per update) and
    ``micro_batch_size`` (``fit`` batches of K * b, each replica splitting its share inside
    the step: 12 samples are 6 per replica, cut 4 + 2; the last 3 samples 2 + 1)."""
    out: dict = {}
    x, y = make_data(39)
    micro, k = 6, 2
    ways = {"": (dict(accum_steps=k), micro), "_split": (dict(micro_batch_size=4), micro * k)}
    initial, ref = reference_weights(adam, x, y, None, micro, k)
    for suffix, (how, batch) in ways.items():
        with mirrored().scope():
            model = small_mlp()
            model.compile(adam(), LOSS)
        ac.accumulate(model, **how)
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        out["mlp" + suffix] = {"rel": relative_error(get_weights(model), ref, initial),
                               "counters": model.accumulation.counters()}
    xs, ys = seq_data(42, seed=11)
    sgd = lambda: keras.optimizers.SGD(0.5)  # noqa: E731
    initial, ref = reference_weights(sgd, xs, ys, None, micro, k, loss=token_loss(),
                                     make_model=seq_model)
    for suffix, (how, batch) in ways.items():
        with mirrored().scope():
            model = ac.accumulate(seq_model(), **how)
            model.compile(sgd(), token_loss())
        model.fit(xs, ys, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        out["embedding" + suffix] = {"rel": relative_error(get_weights(model), ref, initial)}
    try:
        import test_keras_hub as hub
    except ImportError as err:  # keras-hub missing: the test that reads this fails
        out["causal_lm"] = out["causal_lm_split"] = {"error": str(err)}
        return out
    make_opt = hub.schedule_adam
    lx, ly, lsw = hub.lm_data(mask_dtype="int32")
    lm = hub.tiny_lm()
    initial = get_weights(lm)
    lm.compile(optimizer=make_opt())
    for s in hub.windows_of(hub.N, hub.MICRO, hub.K):
        lm.train_on_batch({key: value[s] for key, value in lx.items()}, ly[s],
                          sample_weight=lsw[s])
    ref = get_weights(lm)
    lm_ways = {"": (dict(accum_steps=hub.K), hub.MICRO),
               "_split": (dict(micro_batch_size=max(1, hub.MICRO // 2)), hub.MICRO * hub.K)}
    for suffix, (how, batch) in lm_ways.items():
        with mirrored().scope():
            lm = ac.accumulate(hub.tiny_lm(), **how)
            lm.compile(optimizer=make_opt())
        lm.fit(lx, ly, sample_weight=lsw, batch_size=batch, epochs=1, shuffle=False,
               verbose=0)
        out["causal_lm" + suffix] = {"rel": relative_error(get_weights(lm), ref, initial),
                                     "iterations": int(lm.optimizer.iterations.numpy())}
    return out


@case
def sum_beside_mean() -> dict:
    """A per-sample ``add_loss`` (Keras sums it) beside a compiled mean loss: the sum enters
    the update undivided from every replica (with clipping, its sums reduced with the
    window's status), against plain ``fit`` at B = 8 on ONE device (26 samples: the last
    window holds 2). ``accum_steps=2`` with batches of 4, and ``micro_batch_size=3`` with
    batches of 8 (each replica's 4 cut 3 + 1)."""
    import test_loss_forms as forms

    out: dict = {}
    x, y = forms.regression_data(26)
    optimizers = {"": lambda: keras.optimizers.SGD(forms.LR),
                  "_clip": lambda: keras.optimizers.SGD(forms.LR, clipnorm=0.5)}
    ways = {"": (dict(accum_steps=2), 4), "_split": (dict(micro_batch_size=3), 8)}
    for opt_suffix, make_opt in optimizers.items():
        model = forms.endpoint_model("per_sample")
        initial = get_weights(model)
        model.compile(make_opt(), loss="mse")
        model.fit([x, y], y, batch_size=8, shuffle=False, verbose=0)
        ref = get_weights(model)
        for suffix, (how, batch) in ways.items():
            with mirrored().scope():
                model = forms.endpoint_model("per_sample")
                model.compile(make_opt(), loss="mse")
            ac.accumulate(model, **how)
            model.fit([x, y], y, batch_size=batch, shuffle=False, verbose=0)
            out["sum_beside_mean" + suffix + opt_suffix] = {
                "rel": relative_error(get_weights(model), ref, initial),
                "undivided": len(model.accumulation.undivided_accumulators)}
    return out


if __name__ == "__main__":
    run_cases(CASES, sys.argv[1:])
