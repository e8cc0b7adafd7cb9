"""Keras workflows around AccumModel (issue 10, section 2): each test compares with plain Keras.

Rows: a frozen model's ``fit``; ``save_weights`` -> ``load_weights`` into a plain model
(serving) and exact mid-window resume through weights files and ``tf.train.Checkpoint``;
``keras.models.clone_model``; unknown and missing keywords; an unbuilt subclass; stock
BatchNormalization; ``train_on_batch`` (one micro-batch per call). Each row runs in both
modes: ``accum_steps=K`` at ``fit(batch_size=b)`` and ``micro_batch_size=b`` at
``fit(batch_size=K * b)`` (``_split``: every window is one batch, so nothing is pending between
steps; its rows check the same workflow at a window's end).
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import LOSS, OPTIMIZERS, REL_TOL, small_mlp

import accumcore as ac
from accumcore.lab.experiments import get_weights, relative_error


def _accum(k: int = 3, seed: int = 0, **kwargs) -> ac.AccumModel:
    model = small_mlp(seed=seed, model_cls=ac.AccumModel, accum_steps=k, **kwargs)
    model.compile(OPTIMIZERS["adam"](), LOSS, metrics=["accuracy"])
    return model


def _split(micro: int = 8, seed: int = 0, **kwargs) -> ac.AccumModel:
    """``micro_batch_size`` mode: ``fit(batch_size=B)`` splits each batch into ``micro``."""
    model = small_mlp(seed=seed, model_cls=ac.AccumModel, micro_batch_size=micro, **kwargs)
    model.compile(OPTIMIZERS["adam"](), LOSS, metrics=["accuracy"])
    return model


#: The two modes: (model builder, fit's batch size): windows of 24 samples either way.
MODES = {"accum_steps": (lambda **kw: _accum(k=3, **kw), 8),
         "micro_batch_size": (lambda **kw: _split(micro=8, **kw), 24)}


def _fit(model, x, y, batch_size: int = 8, **kwargs):
    return model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0, **kwargs)


def _messages(record) -> list[str]:
    return [str(w.message) for w in record]


def _identical(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(u, v)


# ---------------------------------------------------------------- model.trainable = False
@pytest.mark.parametrize("mode", list(MODES))
def test_frozen_model_fit_warns_and_trains_nothing_as_keras_does(data, mode):
    # keras.Model.fit on a model without trainable weights warns and runs: loss and metrics
    # are computed, nothing is updated. AccumModel does the same, with a message that says what
    # is wrong and how to fix it (it used to claim "The model is not built").
    x, y = data
    plain = small_mlp()
    plain.trainable = False
    plain.compile(OPTIMIZERS["adam"](), LOSS, metrics=["accuracy"])
    make, batch_size = MODES[mode]
    model = make()
    model.trainable = False
    model.compile(OPTIMIZERS["adam"](), LOSS, metrics=["accuracy"])
    initial = get_weights(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        history = _fit(model, x, y, batch_size, epochs=2)
        expected = _fit(plain, x, y, batch_size, epochs=2)
    ours = [m for m in _messages(record) if "AccumModel" in m]
    assert len(ours) == 1, _messages(record)
    assert "no trainable variables" in ours[0] and "model.trainable = True" in ours[0]
    _identical(get_weights(model), initial)
    assert int(model.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy()) == 0
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history.history[key], expected.history[key], rtol=1e-6)

    # Unfrozen and recompiled, it trains (and accumulates) again.
    model.trainable = True
    model.compile(OPTIMIZERS["adam"](), LOSS)
    _fit(model, x, y, batch_size=24, epochs=1)  # 40 samples: 24 + 16
    assert int(model.optimizer.iterations.numpy()) == (1 if mode == "accum_steps" else 2)


def test_freezing_with_a_pending_window_names_flush(data):
    x, y = data
    model = _accum(k=3, end_of_epoch="carry")
    _fit(model, x[:16], y[:16])  # 2 of 3 micro-batches pending
    model.trainable = False
    model.compile(OPTIMIZERS["adam"](), LOSS)
    with pytest.raises(ValueError, match=r"no trainable variables.*`accumcore\.flush\(model\)`"):
        _fit(model, x, y)


# ---------------------------------------------------------------- saving and serving
def _mid_window_model(x, y) -> ac.AccumModel:
    """K = 3, carry: 16 samples in micro-batches of 8 leave 2 micro-batches pending."""
    model = _accum(k=3, end_of_epoch="carry")
    _fit(model, x[:16], y[:16])
    assert int(model.accumulation.micro_step.numpy()) == 2
    return model


def test_save_weights_loads_into_a_plain_model_for_serving(data, tmp_path):
    x, y = data
    model = _mid_window_model(x, y)
    _fit(model, x, y)  # some applied updates, and again a pending window
    path = str(tmp_path / "accum.weights.h5")
    model.save_weights(path)

    serving = small_mlp(seed=7)  # plain keras.Model, same layers, other initial weights
    serving.load_weights(path)
    _identical(get_weights(serving), get_weights(model))
    np.testing.assert_array_equal(serving.predict(x, verbose=0), model.predict(x, verbose=0))
    # ...and a compiled plain model (which has its own optimizer) loads it too.
    compiled = small_mlp(seed=7)
    compiled.compile(OPTIMIZERS["adam"](), LOSS)
    compiled.load_weights(path)
    _identical(get_weights(compiled), get_weights(model))

    # The other way: weights saved by a plain model load into an AccumModel.
    plain_path = str(tmp_path / "plain.weights.h5")
    serving.save_weights(plain_path)
    fresh = _accum(k=3, seed=9)
    fresh.load_weights(plain_path)
    _identical(get_weights(fresh), get_weights(model))


def test_weights_file_resumes_mid_window_exactly(data, tmp_path):
    x, y = data
    model = _mid_window_model(x, y)
    path = str(tmp_path / "mid.weights.h5")
    model.save_weights(path)
    resumed = _accum(k=3, seed=5, end_of_epoch="carry")  # other initial weights
    resumed.load_weights(path)
    assert resumed.accumulation.counters() == model.accumulation.counters()
    assert model.accumulation.accumulators[0].numpy().any()  # a real, non-empty window
    for a, b in zip(resumed.accumulation.accumulators, model.accumulation.accumulators,
                    strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for m in (model, resumed):
        _fit(m, x[16:], y[16:])
    assert int(resumed.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy())
    _identical(get_weights(resumed), get_weights(model))


def test_tf_train_checkpoint_resumes_mid_window_exactly(data, tmp_path):
    x, y = data
    model = _mid_window_model(x, y)
    prefix = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "ckpt"))
    resumed = _accum(k=3, seed=5, end_of_epoch="carry")
    resumed.optimizer.build(resumed.trainable_variables)
    status = tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(prefix)
    resumed.build_accumulation()  # (fit would build it) the pending window is restored into it
    status.assert_consumed()
    assert int(resumed.accumulation.micro_step.numpy()) == 2
    for m in (model, resumed):
        _fit(m, x[16:], y[16:])
    _identical(get_weights(resumed), get_weights(model))


def test_split_mode_weights_load_into_a_plain_model_and_resume_exactly(data, tmp_path):
    """``micro_batch_size``: saved between batches (every window closed), the weights serve
    in a plain model, and a ``tf.train.Checkpoint`` with the optimizer resumes exactly."""
    x, y = data
    model = _split(micro=6)
    _fit(model, x[:16], y[:16], batch_size=16)
    path = str(tmp_path / "split.weights.h5")
    model.save_weights(path)
    serving = small_mlp(seed=7)
    serving.load_weights(path)
    _identical(get_weights(serving), get_weights(model))
    np.testing.assert_array_equal(serving.predict(x, verbose=0), model.predict(x, verbose=0))

    prefix = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "ckpt"))
    resumed = _split(micro=6, seed=5)
    resumed.optimizer.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(
        prefix).assert_existing_objects_matched()
    for m in (model, resumed):
        _fit(m, x[16:], y[16:], batch_size=16)
    assert int(resumed.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy())
    _identical(get_weights(resumed), get_weights(model))


# ---------------------------------------------------------------- clone_model
def test_clone_model_keeps_settings_and_trains_like_the_original(data):
    x, y = data
    model = _accum(k=3, end_of_epoch="drop", nonfinite="skip_window")
    clone = keras.models.clone_model(model)
    assert isinstance(clone, ac.AccumModel)
    assert (clone.accum_steps, clone.end_of_epoch, clone.nonfinite, clone.normalizer) == (
        3, "drop", "skip_window", "auto")
    clone.set_weights(model.get_weights())
    for m in (model, clone):
        _fit(m, x, y, epochs=2)
    # 5 micro-batches per epoch, K = 3: one update per epoch, the rest dropped.
    assert int(clone.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) == 2
    for a, b in zip(get_weights(clone), get_weights(model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_clone_model_keeps_micro_batch_size_and_trains_like_the_original(data):
    x, y = data
    model = _split(micro=6, nonfinite="skip_window")
    clone = keras.models.clone_model(model)
    assert isinstance(clone, ac.AccumModel)
    assert (clone.micro_batch_size, clone.nonfinite) == (6, "skip_window")
    clone.set_weights(model.get_weights())
    for m in (model, clone):
        _fit(m, x, y, batch_size=16, epochs=2)
    assert int(clone.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) == 6
    for a, b in zip(get_weights(clone), get_weights(model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_clone_of_an_uncompiled_model_says_to_set_the_settings(data):
    # clone_model cannot pass accum_steps to the constructor, and an uncompiled model has no
    # compile config to carry it: the clone's fit raises instead of training with K = 1.
    x, y = data
    model = small_mlp(model_cls=ac.AccumModel, accum_steps=4)
    clone = keras.models.clone_model(model)
    clone.compile(OPTIMIZERS["sgd"](), LOSS)
    with pytest.raises(ValueError, match=r"without `micro_batch_size` or `accum_steps`."
                       r"*set_accumulation"):
        _fit(clone, x, y)
    clone.set_accumulation(accum_steps=4)
    _fit(clone, x, y, batch_size=10)
    assert int(clone.optimizer.iterations.numpy()) == 1


# ---------------------------------------------------------------- keywords
def test_unknown_keyword_raises_type_error_naming_it_and_the_valid_ones():
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(3)(inputs)
    with pytest.raises(TypeError, match=r"accumulation_steps.*accum_steps.*end_of_epoch"):
        ac.AccumModel(inputs, outputs, accumulation_steps=4)

    class Net(ac.AccumModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    with pytest.raises(TypeError, match=r"accum_step\b.*accum_steps"):
        Net(accum_step=4)
    assert Net(accum_steps=2, name="net", trainable=True).accum_steps == 2  # Keras's own kept
    assert ac.AccumModel(inputs, outputs, accum_steps=2, name="m").name == "m"


def test_missing_accum_steps_raises_at_fit(data):
    x, y = data
    model = small_mlp(model_cls=ac.AccumModel)
    assert model.accum_steps is None
    model.compile(OPTIMIZERS["sgd"](), LOSS)
    with pytest.raises(ValueError, match=r"without `micro_batch_size` or `accum_steps`."
                       r"*accum_steps=1"):
        _fit(model, x, y)
    with pytest.raises(ValueError, match=r"without `micro_batch_size` or `accum_steps`"):
        model.train_on_batch(x[:8], y[:8])
    model.set_accumulation(accum_steps=2)
    _fit(model, x, y, batch_size=10)
    assert int(model.optimizer.iterations.numpy()) == 2


# ---------------------------------------------------------------- unbuilt subclass
def _dense(units: int, seed: int, **kwargs) -> keras.layers.Dense:
    # Seeded initialisers: the same weights whenever (and in whatever order) they are built.
    return keras.layers.Dense(units, kernel_initializer=keras.initializers.GlorotUniform(seed),
                              **kwargs)


class _TwoDense:
    """8 -> 16 (tanh) -> 3 (softmax), seeded, built on the first call; mixed into a model class."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = _dense(16, 1, activation="tanh")
        self.head = _dense(3, 2, activation="softmax")

    def call(self, x):
        return self.head(self.hidden(x))


class PlainNet(_TwoDense, keras.Model):
    pass


class AccumNet(_TwoDense, ac.AccumModel):
    pass


@pytest.mark.parametrize("how", ["fit", "train_on_batch", "fit_split", "train_on_batch_split"])
def test_unbuilt_subclass_is_built_on_the_first_batch_and_exact(how, data):
    x, y = data
    reference = PlainNet()
    reference(x[:1])
    initial = get_weights(reference)
    reference.compile(OPTIMIZERS["adam"](), LOSS)
    for s in (slice(0, 20), slice(20, 40)):  # two windows of 2 micro-batches of 10
        reference.train_on_batch(x[s], y[s])

    split = how.endswith("_split")
    model = AccumNet(micro_batch_size=7) if split else AccumNet(accum_steps=2)
    assert not model.built
    model.compile(OPTIMIZERS["adam"](), LOSS)
    if how == "fit_split":  # batches of 20, each split 7 + 7 + 6
        _fit(model, x, y, batch_size=20)
    elif how == "train_on_batch_split":
        for start in (0, 20):
            model.train_on_batch(x[start:start + 20], y[start:start + 20])
    elif how == "fit":
        _fit(model, x, y, batch_size=10)
    else:
        for start in range(0, 40, 10):
            model.train_on_batch(x[start:start + 10], y[start:start + 10])
    assert model.built and int(model.optimizer.iterations.numpy()) == 2
    assert relative_error(get_weights(model), get_weights(reference), initial) <= REL_TOL


# ---------------------------------------------------------------- stock BatchNormalization
def _bn_model(model_cls=keras.Model, **kwargs) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(6)(inputs)
    h = keras.layers.BatchNormalization(name="stock_bn")(h)
    outputs = keras.layers.Dense(3, activation="softmax")(h)
    return model_cls(inputs, outputs, **kwargs)


def _bn_warnings(record) -> list[str]:
    return [m for m in _messages(record) if "convert_batchnorm" in m]


@pytest.mark.parametrize("mode", ["accum_steps", "micro_batch_size"])
def test_stock_batchnorm_warns_once_per_accum_model(data, mode):
    x, y = data
    how, batch_size = (dict(accum_steps=2), 8) if mode == "accum_steps" else (
        dict(micro_batch_size=8), 16)
    model = _bn_model(ac.AccumModel, **how, name="bn_accum_model")
    model.compile(OPTIMIZERS["sgd"](), LOSS)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _fit(model, x, y, batch_size, epochs=2)
        _fit(model, x, y, batch_size, epochs=1)
        model.train_on_batch(x[:batch_size], y[:batch_size])
    found = _bn_warnings(record)
    assert len(found) == 1, _messages(record)
    assert "stock_bn" in found[0] and "bn_accum_model" in found[0]

    converted = ac.convert_batchnorm(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _fit(converted, x, y, batch_size)
        k1 = _bn_model(ac.AccumModel, accum_steps=1)  # K = 1: stock BN is exact
        k1.compile(OPTIMIZERS["sgd"](), LOSS)
        _fit(k1, x, y)
    assert not _bn_warnings(record)


def test_stock_batchnorm_warns_once_per_trainer_model(data):
    x, y = data
    model = _bn_model(name="bn_trainer_model")
    trainer = ac.AccumTrainer(model, OPTIMIZERS["sgd"](), LOSS, accum_steps=2)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(ds, epochs=2, verbose=0)
        trainer.fit(ds, epochs=1, verbose=0, mode="eager")
    found = _bn_warnings(record)
    assert len(found) == 1 and "bn_trainer_model" in found[0], _messages(record)

    frozen = _bn_model()
    frozen.get_layer("stock_bn").trainable = False  # inference mode: statistics never move
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ac.AccumTrainer(frozen, OPTIMIZERS["sgd"](), LOSS, accum_steps=2).fit(ds, verbose=0)
    assert not _bn_warnings(record)


# ---------------------------------------------------------------- train_on_batch
def test_train_on_batch_runs_one_micro_batch_per_call(data):
    # Documented behaviour: each call is one micro-batch; the optimizer steps on every K-th
    # call, and K calls equal one plain train_on_batch on their concatenation.
    x, y = data
    reference = small_mlp()
    initial = get_weights(reference)
    reference.compile(OPTIMIZERS["adam"](), LOSS)
    reference.train_on_batch(x[:24], y[:24])

    model = _accum(k=3)
    for i, start in enumerate((0, 8, 16)):
        loss = model.train_on_batch(x[start:start + 8], y[start:start + 8])
        assert np.isfinite(loss[0] if isinstance(loss, list) else loss)
        if i < 2:
            assert int(model.optimizer.iterations.numpy()) == 0
            _identical(get_weights(model), initial)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert relative_error(get_weights(model), get_weights(reference), initial) <= REL_TOL


def test_train_on_batch_raises_on_a_non_finite_gradient(data):
    x, y = data
    model = _accum(k=2)
    bad = x[:8].copy()
    bad[0, 0] = np.nan
    model.train_on_batch(bad, y[:8])  # the window (K = 2) is checked when it closes
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ac.NonFiniteGradientError, match="window 1 of the run"):
        model.train_on_batch(x[8:16], y[8:16])
    for now, then in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(now, then)


def test_split_mode_train_on_batch_is_one_update_of_the_whole_batch(data):
    """``micro_batch_size``: each ``train_on_batch`` call is one whole batch, split in the step
    (24 = 8 + 8 + 8) and applied once: equal to plain ``train_on_batch`` of the same batch."""
    x, y = data
    reference = small_mlp()
    initial = get_weights(reference)
    reference.compile(OPTIMIZERS["adam"](), LOSS)
    model = _split(micro=8)
    for s in (slice(0, 24), slice(24, 40)):
        reference.train_on_batch(x[s], y[s])
        model.train_on_batch(x[s], y[s])
    assert int(model.optimizer.iterations.numpy()) == 2
    assert relative_error(get_weights(model), get_weights(reference), initial) <= REL_TOL


def test_split_mode_train_on_batch_raises_on_a_non_finite_gradient(data):
    x, y = data
    model = _split(micro=8)
    bad = x[:16].copy()
    bad[9, 0] = np.nan  # in the batch's second micro-batch
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ac.NonFiniteGradientError, match="window 1 of the run"):
        model.train_on_batch(bad, y[:16])
    for now, then in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(now, then)
