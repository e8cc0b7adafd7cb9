"""``accumcore.accumulate(model, accum_steps=K)``: exact accumulation for a model that exists.

Every equivalence test compares against an independent large-batch reference from the same
initial weights: plain Keras ``train_on_batch`` on each window's samples
(``helpers.reference_weights``), or one forward / backward pass per window with the plain
Keras loss (``helpers.dense_reference``, for masked tokens). Tolerance: ``REL_TOL``
(tests/helpers.py: float32 re-association, 5x margin, 3-4 orders below a real bug).
"""

from __future__ import annotations

import json
import warnings
import zipfile

import keras
import numpy as np
import pytest
from helpers import (
    LOSS,
    REL_TOL,
    assert_matches_reference,
    dense_reference,
    make_data,
    reference_weights,
    seq_data,
    seq_model,
    small_mlp,
    token_loss,
    windows_of,
)

import accumcore as ac
from accumcore.lab.experiments import get_weights, relative_error

MICRO, K = 8, 2  # 40 samples: windows of 16, 16 and a partial 8 (end_of_epoch="apply")
#: The two ways to make up an update (``accumulate``'s ``accum_steps`` or ``micro_batch_size``):
#: the settings and fit's ``batch_size``. Both make the same windows of 16 samples: K = 2
#: micro-batches of 8, or batches of 16 split inside the step into 6 + 6 + 4 (ragged), the
#: last batch of 8 into 6 + 2.
SPLIT = 6
WAYS = {"accum_steps": (dict(accum_steps=K), MICRO),
        "micro_batch_size": (dict(micro_batch_size=SPLIT), MICRO * K)}


def _sequential(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(3, activation="softmax")])


class TinySubclass(keras.Model):
    """A subclass without a ``train_step`` of its own, built on the first batch."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.out = keras.layers.Dense(3, activation="softmax")

    def call(self, x):
        return self.out(self.hidden(x))


def _subclassed(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = TinySubclass()
    model(np.zeros((1, 8), "float32"))
    return model


def _subclassed_unbuilt(seed: int = 0) -> keras.Model:
    """Built by ``fit`` on the first batch (the same seeded initial weights as built)."""
    keras.utils.set_random_seed(seed)
    return TinySubclass()


MODELS = {"functional": small_mlp, "sequential": _sequential, "subclassed": _subclassed,
          "subclassed_unbuilt": _subclassed_unbuilt}


def _train(make_model, make_opt, x, y, *, order: str, epochs: int = 1, sw=None,
           loss=LOSS, way: str = "accum_steps", jit_compile: bool = False,
           **settings) -> keras.Model:
    how, batch_size = WAYS[way]
    model = make_model()
    if order == "before_compile":
        ac.accumulate(model, **how, **settings)
        model.compile(make_opt(), loss, jit_compile=jit_compile)
    else:
        model.compile(make_opt(), loss, jit_compile=jit_compile)
        ac.accumulate(model, **how, **settings)
    model.fit(x, y, sample_weight=sw, batch_size=batch_size, epochs=epochs, shuffle=False,
              verbose=0)
    return model


@pytest.mark.parametrize("way", sorted(WAYS))
@pytest.mark.parametrize("order", ["before_compile", "after_compile"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_every_model_kind_matches_the_large_batch(data, kind, order, way):
    x, y = data
    make_model = MODELS[kind]
    adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    initial, ref = reference_weights(adam, x, y, None, MICRO, K, make_model=_subclassed
                                     if kind == "subclassed_unbuilt" else make_model)
    model = _train(make_model, adam, x, y, order=order, way=way)
    assert type(model) is type(make_model())  # the class is kept
    assert_matches_reference(model, initial, ref)
    assert int(model.optimizer.iterations.numpy()) == 3  # 2 full windows + the partial one


def test_reference_can_fail(data):
    """The same comparison catches a wrong K (a real bug's size)."""
    x, y = data
    adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    initial, ref = reference_weights(adam, x, y, None, MICRO, K)
    model = small_mlp()
    model.compile(adam(), LOSS)
    ac.accumulate(model, accum_steps=K + 1)
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    assert relative_error(get_weights(model), ref, initial) > 100 * REL_TOL


SCHEDULED = {
    "adam_exponential_decay": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.5)),
    "adamw_ema": lambda: keras.optimizers.AdamW(0.02, weight_decay=0.1, use_ema=True,
                                                ema_momentum=0.5, ema_overwrite_frequency=2),
}


@pytest.mark.parametrize("way", sorted(WAYS))
@pytest.mark.parametrize("name", sorted(SCHEDULED))
def test_schedules_and_ema_advance_once_per_update(data, name, way):
    x, y = data
    make_opt = SCHEDULED[name]
    initial, ref = reference_weights(make_opt, x, y, None, MICRO, K, epochs=2)
    model = _train(small_mlp, make_opt, x, y, order="after_compile", epochs=2, way=way)
    assert int(model.optimizer.iterations.numpy()) == 6  # 3 updates per epoch
    assert_matches_reference(model, initial, ref)


def test_keras_own_accumulation_is_measurably_wrong_with_a_schedule(data):
    """What the book compares against: Keras's ``gradient_accumulation_steps`` on the same
    schedule reads the micro-step counter, so it is far from the large batch, while
    ``accumulate`` is not (the previous test). If Keras fixes it, this fails and the book's
    comparison must be rewritten."""
    x, y = data
    x, y = x[:32], y[:32]  # equal windows: Keras's accumulation has no partial-window rule
    make_opt = SCHEDULED["adam_exponential_decay"]
    initial, ref = reference_weights(make_opt, x, y, None, MICRO, K, epochs=2)
    model = small_mlp()
    keras_opt = keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.5),
        gradient_accumulation_steps=K)
    model.compile(keras_opt, LOSS)
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    assert relative_error(get_weights(model), ref, initial) > 100 * REL_TOL


@pytest.mark.parametrize("way", sorted(WAYS))
def test_masked_tokens_weigh_each_micro_batch_by_its_valid_tokens(way):
    x, y = seq_data(40, seed=3)
    adam = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    initial, ref = dense_reference(seq_model, adam, token_loss(), x, y, None, MICRO, K)
    model = _train(seq_model, adam, x, y, order="after_compile", loss=token_loss(), way=way)
    assert type(model) is keras.Model or isinstance(model, keras.Model)
    assert_matches_reference(model, initial, ref)


def test_logged_loss_is_the_epoch_mean_over_samples(data):
    x, y = data
    model = _train(small_mlp, lambda: keras.optimizers.SGD(0.0), x, y, order="before_compile")
    plain = small_mlp()
    plain.compile(keras.optimizers.SGD(0.0), LOSS)
    expected = plain.evaluate(x, y, batch_size=len(x), verbose=0)
    np.testing.assert_allclose(model.history.history["loss"][0], expected, rtol=1e-5)


def test_predict_and_evaluate_are_the_models_own(data):
    x, y = data
    model = small_mlp()
    model.compile(keras.optimizers.SGD(0.1), LOSS)
    before = model.predict(x, verbose=0)
    ac.accumulate(model, accum_steps=K)
    np.testing.assert_array_equal(model.predict(x, verbose=0), before)
    plain = small_mlp()
    plain.compile(keras.optimizers.SGD(0.1), LOSS)
    assert model.evaluate(x, y, verbose=0) == pytest.approx(plain.evaluate(x, y, verbose=0))


def test_train_on_batch_runs_one_micro_batch_and_flush_applies_the_rest(data):
    x, y = data
    sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    initial, ref = reference_weights(sgd, x[:24], y[:24], None, MICRO, K)
    model = small_mlp()
    model.compile(sgd(), LOSS)
    ac.accumulate(model, accum_steps=K)
    for s in range(0, 24, MICRO):
        model.train_on_batch(x[s:s + MICRO], y[s:s + MICRO])
    assert int(model.optimizer.iterations.numpy()) == 1
    assert ac.flush(model) is True
    assert_matches_reference(model, initial, ref)


def test_save_writes_the_models_own_class_without_accumcore(data, tmp_path):
    x, y = data
    model = _train(small_mlp, lambda: keras.optimizers.Adam(0.01), x, y, order="after_compile")
    path = tmp_path / "model.keras"
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        config = archive.read("config.json").decode()
    assert "accumcore" not in config and "CountedLoss" not in config
    loaded = keras.saving.load_model(path)
    assert type(loaded) is type(model)
    assert not hasattr(loaded, "accumulation")  # a plain model: re-apply the one line
    for a, b in zip(get_weights(loaded), get_weights(model), strict=True):
        np.testing.assert_array_equal(a, b)
    assert json.loads(config)["compile_config"]["loss"] == LOSS  # as given to compile


def test_weights_file_resumes_mid_window_exactly(data, tmp_path):
    x, y = data
    sgd = lambda: keras.optimizers.Adam(0.01)  # noqa: E731

    def fresh(seed: int) -> keras.Model:
        model = small_mlp(seed=seed)
        model.compile(sgd(), LOSS)
        return ac.accumulate(model, accum_steps=3)

    model = fresh(0)
    for s in range(0, 40, MICRO):
        model.train_on_batch(x[s:s + MICRO], y[s:s + MICRO])  # 5 micro-batches: 2 pending
    path = str(tmp_path / "mid.weights.h5")
    model.save_weights(path)
    resumed = fresh(7)  # other initial weights
    resumed.train_on_batch(x[:MICRO], y[:MICRO])  # built, with a window of its own
    ac.flush(resumed)
    resumed.load_weights(path)
    assert int(resumed.accumulation.micro_step.numpy()) == 2
    for m in (model, resumed):
        m.train_on_batch(x[:MICRO], y[:MICRO])  # closes the window
    for a, b in zip(get_weights(resumed), get_weights(model), strict=True):
        np.testing.assert_array_equal(a, b)


def _fresh_carry(seed: int = 0) -> keras.Model:
    model = small_mlp(seed=seed)
    model.compile(keras.optimizers.Adam(0.01), LOSS)
    return ac.accumulate(model, accum_steps=3, end_of_epoch="carry")


class _Interrupt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3 and self.epoch == 1:  # mid-epoch, mid-window
            raise RuntimeError("interrupted")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch


@pytest.mark.parametrize("backup", ["keras", "exact"])
def test_an_interrupted_fit_resumes_exactly(data, tmp_path, backup):
    """Keras's BackupAndRestore (epoch backups: the carried half-full window is in the file)
    and accumcore's ExactBackupAndRestore (every 2 batches, mid-window)."""
    from accumcore.checkpointing import fit_resumable

    x, y = data
    kw = dict(batch_size=MICRO, epochs=3, shuffle=False, verbose=0)
    straight = _fresh_carry()
    straight.fit(x, y, **kw)
    folder = str(tmp_path / "backup")

    def run(model, callbacks):
        if backup == "keras":
            return model.fit(x, y, callbacks=[keras.callbacks.BackupAndRestore(folder),
                                              *callbacks], **kw)
        return fit_resumable(model, x, y, backup_dir=folder, save_freq=2, callbacks=callbacks,
                             **kw)

    with pytest.raises(RuntimeError, match="interrupted"):
        run(_fresh_carry(), [_Interrupt()])
    resumed = _fresh_carry(seed=7)  # other initial weights: everything comes from the file
    run(resumed, [])
    assert resumed.accumulation.counters() == straight.accumulation.counters()
    for a, b in zip(get_weights(resumed), get_weights(straight), strict=True):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------- refusals
class _OwnTrainStep(keras.Model):
    def train_step(self, data):  # pragma: no cover - refused before it runs
        return {}


def test_a_model_with_its_own_train_step_is_refused():
    inputs = keras.Input((8,))
    model = _OwnTrainStep(inputs, keras.layers.Dense(3)(inputs))
    with pytest.raises(ValueError, match="overrides `train_step`.*AccumulationState"):
        ac.accumulate(model, accum_steps=2)


def test_an_optimizer_that_accumulates_itself_is_refused():
    model = small_mlp()
    model.compile(keras.optimizers.Adam(0.01, gradient_accumulation_steps=4), LOSS)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4"):
        ac.accumulate(model, accum_steps=2)
    later = ac.accumulate(small_mlp(), accum_steps=2)
    later.compile(keras.optimizers.Adam(0.01, gradient_accumulation_steps=4), LOSS)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4"):
        later.fit(*make_data(16), batch_size=8, verbose=0)


@pytest.mark.parametrize("bad", [0, -1, 2.0, None])
def test_bad_accum_steps_names_the_parameter(bad):
    with pytest.raises((TypeError, ValueError), match="accum_steps"):
        ac.accumulate(small_mlp(), accum_steps=bad)


def test_not_a_model_is_refused():
    with pytest.raises(TypeError, match="keras.Model"):
        ac.accumulate(keras.layers.Dense(3), accum_steps=2)


class _OwnLoss(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.mean((keras.ops.one_hot(y, 3) - y_pred) ** 2)


def test_an_own_compute_loss_warns_once_that_it_is_weighted_by_samples():
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(3, activation="softmax")(inputs)
    with pytest.warns(UserWarning, match="compute_loss.*normalizer="):
        ac.accumulate(_OwnLoss(inputs, outputs), accum_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ac.accumulate(_OwnLoss(inputs, outputs), accum_steps=2)  # once per class
        ac.accumulate(_OwnLoss(inputs, outputs), accum_steps=2, normalizer="samples")


def test_accumulate_again_changes_the_settings_only_with_an_empty_window(data):
    x, y = data
    model = small_mlp()
    model.compile(keras.optimizers.SGD(0.1), LOSS)
    ac.accumulate(model, accum_steps=2)
    model.train_on_batch(x[:MICRO], y[:MICRO])
    with pytest.raises(ValueError, match="partial window is pending"):
        ac.accumulate(model, accum_steps=4)
    ac.flush(model)
    assert ac.accumulate(model, accum_steps=4) is model
    assert model.accumulation.accum_steps == 4


def test_recompiling_keeps_the_accumulation(data):
    """Freeze, recompile, fit: the Keras fine-tuning habit."""
    x, y = data
    sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    model = small_mlp()
    model.compile(sgd(), LOSS)
    ac.accumulate(model, accum_steps=K)
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    model.layers[1].trainable = False
    model.compile(sgd(), LOSS)
    trained = get_weights(model)
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == len(windows_of(len(x), MICRO, K))
    np.testing.assert_array_equal(get_weights(model)[0], trained[0])  # frozen stays
