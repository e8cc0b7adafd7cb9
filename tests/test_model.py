"""AccumModel: fit keeps callbacks/metrics/History, true mean loss, policies, saving; in both
modes (``accum_steps`` and ``micro_batch_size``) where the row applies to both."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import LOSS, OPTIMIZERS, REL_TOL, reference_weights, small_mlp

import accumcore as ac
from accumcore.lab.experiments import get_weights, relative_error


def _fit_model(k=3, **kwargs):
    model = small_mlp(model_cls=ac.AccumModel, accum_steps=k, **kwargs)
    model.compile(OPTIMIZERS["sgd"](), LOSS, metrics=["accuracy"])
    return model


def _split_model(micro: int, **kwargs):
    """``micro_batch_size`` mode: ``fit(batch_size=B)`` splits each batch into ``micro``."""
    model = small_mlp(model_cls=ac.AccumModel, micro_batch_size=micro, **kwargs)
    model.compile(OPTIMIZERS["sgd"](), LOSS, metrics=["accuracy"])
    return model


def _mode(mode: str, k: int, micro: int, **kwargs):
    """(model, fit's batch size) in ``mode``, making the same windows: K micro-batches of
    ``micro``, or one batch of K * ``micro`` split into micro-batches of ``micro``."""
    if mode == "accum_steps":
        return _fit_model(k=k, **kwargs), micro
    return _split_model(micro, **kwargs), k * micro


MODES = ("accum_steps", "micro_batch_size")


@pytest.mark.parametrize("mode", MODES)
def test_logged_loss_and_metrics_are_true_means_over_ragged_micro_batches(data, mode):
    # One window covers the whole epoch (16 + 16 + 8), so every micro-batch sees the initial
    # weights: the logged loss must equal the plain model's mean loss over all 40 samples.
    x, y = data
    plain = small_mlp()
    plain.compile(OPTIMIZERS["sgd"](), LOSS, metrics=["accuracy"])
    expected_loss, expected_acc = plain.evaluate(x, y, batch_size=40, verbose=0)

    model, batch_size = _mode(mode, 3, 16)  # 40 samples: 16 + 16 + 8 in one window
    history = model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    assert history.history["loss"][0] == pytest.approx(expected_loss, rel=1e-6)
    assert history.history["accuracy"][0] == pytest.approx(expected_acc, rel=1e-6)
    assert int(model.optimizer.iterations.numpy()) == 1


@pytest.mark.parametrize("mode", MODES)
def test_fit_keeps_callbacks_history_and_validation(data, mode):
    x, y = data
    seen = []

    class CountUpdates(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append((int(self.model.optimizer.iterations.numpy()), sorted(logs)))

    model, batch_size = _mode(mode, 2, 8)
    history = model.fit(x, y, batch_size=batch_size, epochs=2, validation_data=(x, y),
                        shuffle=False, verbose=0, callbacks=[CountUpdates()])
    # 5 micro-batches per epoch, K=2: updates after 2, 4 and the flushed 5th -> 3 per epoch
    assert [n for n, _ in seen] == [3, 6]
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(seen[0][1])
    assert len(history.history["val_loss"]) == 2


@pytest.mark.parametrize("mode", MODES)
def test_partial_window_is_flushed_before_validation(data, mode):
    # Validation must see the weights after the epoch's last (partial) window, like a
    # large-batch fit: val_loss equals evaluate() on the final weights.
    x, y = data
    model, batch_size = _mode(mode, 2, 16)
    history = model.fit(x, y, batch_size=batch_size, epochs=1, validation_data=(x, y),
                        shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2
    final_val = model.evaluate(x, y, batch_size=40, verbose=0)[0]
    assert history.history["val_loss"][0] == pytest.approx(final_val, rel=1e-6)


@pytest.mark.parametrize("entry", ["fit", "function"])
def test_end_of_epoch_carry_spans_epochs(entry, data):
    # 40 samples, micro 16, K=2. Epoch 1 applies [0:32] and carries [32:40] (pending, not lost);
    # epoch 2 applies [32:40] + [0:16], then [16:32] + [32:40]: 3 updates over 80 samples.
    x, y = data
    x2, y2 = np.concatenate([x, x]), np.concatenate([y, y])
    initial, reference = reference_weights(
        OPTIMIZERS["sgd"], x2, y2, None, windows=[slice(0, 32), slice(32, 56), slice(56, 80)])
    if entry == "fit":
        model = _fit_model(k=2, end_of_epoch="carry")
        state, optimizer = model.accumulation, model.optimizer

        def epoch():
            model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    else:
        model = small_mlp()
        trainer = ac.AccumTrainer(model, OPTIMIZERS["sgd"](), LOSS, accum_steps=2,
                                  end_of_epoch="carry")
        state, optimizer = trainer.state, trainer.optimizer

        def epoch():
            trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1,
                        verbose=0, mode=entry)
    epoch()
    assert (int(state.micro_step.numpy()), int(state.window_samples.numpy())) == (1, 8)
    assert int(optimizer.iterations.numpy()) == 1
    epoch()  # a second fit call continues the carried window
    assert int(state.micro_step.numpy()) == 0
    assert int(optimizer.iterations.numpy()) == 3
    assert relative_error(get_weights(model), reference, initial) <= REL_TOL


@pytest.mark.parametrize("entry", ["fit", "eager"])
def test_end_of_epoch_drop_discards_and_counts(entry, data):
    x, y = data
    initial, reference = reference_weights(OPTIMIZERS["sgd"], x, y, None,
                                           windows=[slice(0, 32), slice(0, 32)])
    if entry == "fit":
        model = _fit_model(k=2, end_of_epoch="drop")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        state = model.accumulation
    else:
        model = small_mlp()
        trainer = ac.AccumTrainer(model, OPTIMIZERS["sgd"](), LOSS, accum_steps=2,
                                  end_of_epoch="drop")
        trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=2, verbose=0,
                    mode=entry)
        state = trainer.state
    assert relative_error(get_weights(model), reference, initial) <= REL_TOL
    counters = state.counters()
    assert counters["samples_dropped"] == 2 * 8
    assert counters["samples_seen"] == 2 * 40
    assert counters["micro_step"] == 0


class SubclassedAccum(ac.AccumModel):
    def __init__(self, **kwargs):
        super().__init__(accum_steps=3, **kwargs)
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.head = keras.layers.Dense(3, activation="softmax")

    def call(self, x):
        return self.head(self.hidden(x))


@pytest.mark.parametrize("mode", MODES)
def test_subclassed_accum_model_matches_large_batch(data, mode):
    x, y = data
    keras.utils.set_random_seed(0)
    model = SubclassedAccum()
    model(x[:1])  # builds the layers
    initial = get_weights(model)
    keras.utils.set_random_seed(0)
    ref = SubclassedAccum()  # same seed -> same initial weights; trained as a plain model
    ref(x[:1])
    ref.set_accumulation(accum_steps=1)
    ref.compile(OPTIMIZERS["adam"](), LOSS)
    ref.train_on_batch(x, y)
    if mode == "micro_batch_size":  # one batch of 40 split 16 + 16 + 8
        model.set_accumulation(micro_batch_size=16)
    model.compile(OPTIMIZERS["adam"](), LOSS)
    model.fit(x, y, batch_size=16 if mode == "accum_steps" else 40, epochs=1, shuffle=False,
              verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert relative_error(get_weights(model), get_weights(ref), initial) <= REL_TOL


def test_config_and_keras_file_round_trip_mid_window(data, tmp_path):
    x, y = data
    model = _fit_model(k=3, end_of_epoch="carry", nonfinite="skip_window")
    model.fit(x[:32], y[:32], batch_size=16, epochs=1, shuffle=False, verbose=0)  # 2 of 3 pending
    assert int(model.accumulation.micro_step.numpy()) == 2
    config = model.get_config()
    assert (config["accum_steps"], config["end_of_epoch"], config["nonfinite"]) == (
        3, "carry", "skip_window")
    clone = ac.AccumModel.from_config(config)
    assert (clone.accum_steps, clone.end_of_epoch, clone.nonfinite) == (3, "carry", "skip_window")

    path = str(tmp_path / "mid_window.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, ac.AccumModel)
    assert loaded.accum_steps == 3 and loaded.end_of_epoch == "carry"
    assert int(loaded.accumulation.micro_step.numpy()) == 2
    for a, b in zip(loaded.accumulation.accumulators, model.accumulation.accumulators):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # finishing the window gives the same weights in both
    for m in (model, loaded):
        m.fit(x[32:], y[32:], batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) == 1
    for a, b in zip(get_weights(loaded), get_weights(model)):
        np.testing.assert_allclose(a, b, rtol=0, atol=0)


def test_config_and_keras_file_round_trip_in_split_mode(data, tmp_path):
    """``micro_batch_size`` travels in the config and the ``.keras`` file; the loaded model
    trains on exactly as the original (every window closed at each batch's end)."""
    x, y = data
    model = _split_model(6, nonfinite="skip_window")
    model.fit(x[:32], y[:32], batch_size=16, epochs=1, shuffle=False, verbose=0)
    config = model.get_config()
    assert (config["micro_batch_size"], config["nonfinite"]) == (6, "skip_window")
    clone = ac.AccumModel.from_config(config)
    assert (clone.micro_batch_size, clone.nonfinite) == (6, "skip_window")
    path = str(tmp_path / "split.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, ac.AccumModel) and loaded.micro_batch_size == 6
    for m in (model, loaded):
        m.fit(x[32:], y[32:], batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) == 3
    for a, b in zip(get_weights(loaded), get_weights(model)):
        np.testing.assert_allclose(a, b, rtol=0, atol=0)


def test_functional_construction_rejects_bad_settings():
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(3)(inputs)
    with pytest.raises(ValueError, match="accum_steps"):
        ac.AccumModel(inputs, outputs, accum_steps=0)
    with pytest.raises(ValueError, match="end_of_epoch"):
        ac.AccumModel(inputs, outputs, accum_steps=2, end_of_epoch="flush")
    with pytest.raises(ValueError, match="micro_batch_size"):
        ac.AccumModel(inputs, outputs, micro_batch_size=0)


def test_custom_nonfinite_policy_is_accepted_by_both_entry_points(data):
    # A NonFinitePolicy (the injected skip decision) works in AccumModel as in AccumTrainer:
    # this one skips the ragged last micro-batch (8 < 10 samples), so the one update of the
    # epoch (16 + 16 + skipped 8, flushed) equals a large batch of the first 32 samples.
    x, y = data

    def small(grads, weight):
        return weight < 10.0

    policy = ac.NonFinitePolicy("skip_small", should_skip=small)
    plain = small_mlp()
    initial = get_weights(plain)
    plain.compile(OPTIMIZERS["sgd"](), LOSS)
    plain.train_on_batch(x[:32], y[:32])
    models = [_fit_model(k=3, nonfinite=policy), _split_model(16, nonfinite=policy)]
    models[0].fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    models[1].fit(x, y, batch_size=40, epochs=1, shuffle=False, verbose=0)  # 16 + 16 + 8
    trainer = ac.AccumTrainer(small_mlp(), OPTIMIZERS["sgd"](), LOSS, accum_steps=3,
                              nonfinite=policy)
    trainer.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    models.append(trainer.model)
    for state in (models[0].accumulation, models[1].accumulation, trainer.state):
        assert state.counters()["micro_batches_skipped"] == 1
        assert state.counters()["windows_applied"] == 1
    for model in models:
        assert relative_error(get_weights(model), get_weights(plain), initial) < REL_TOL
    assert models[0].nonfinite is policy
    with pytest.raises(ValueError, match="custom NonFinitePolicy.*cannot be serialised"):
        models[0].get_config()
    models[0].set_accumulation(nonfinite="skip_window")
    assert models[0].nonfinite == "skip_window" == models[0].get_config()["nonfinite"]
