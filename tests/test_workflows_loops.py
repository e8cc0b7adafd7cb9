"""Keras workflows around the accumulation state and the custom loops (issue 10, section 2).

Fine-tuning (the trainable set changes between ``fit`` calls), recovering from a
``NonFiniteGradientError`` (also in ``ResumableLoop``), ``steps_per_epoch`` and infinite
datasets, empty epochs in ``ResumableLoop``, arrays in ``AccumTrainer.fit``, optimizer names,
loss reductions and unbatched datasets. Every result is
compared with an independent large-batch reference (plain Keras) or a measured count.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    LOSS,
    REL_TOL,
    assert_matches_reference,
    dataset,
    reference_weights,
    small_mlp,
)

import accumcore as ac
from accumcore._impl.datasets import array_dataset
from accumcore.checkpointing import ResumableLoop
from accumcore.lab.experiments import get_weights, relative_error

MICRO, K = 8, 3
MODES = ("eager", "function", "graph")
#: ``fit``'s two ways to make up an update, with the same windows of K * b samples: the
#: AccumModel's settings and fit's ``batch_size``.
WAYS = {"accum_steps": (dict(accum_steps=K), MICRO),
        "micro_batch_size": (dict(micro_batch_size=MICRO), K * MICRO)}


def _accum_model(way: str, **kwargs) -> tuple[ac.AccumModel, int]:
    """``small_mlp`` as an AccumModel in ``way`` (:data:`WAYS`), and fit's batch size."""
    how, batch_size = WAYS[way]
    return small_mlp(model_cls=ac.AccumModel, **how, **kwargs), batch_size


def _adam() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(0.01)


def _freeze_first(model: keras.Model, frozen: bool = True) -> None:
    model.layers[1].trainable = not frozen  # the hidden Dense (layers[0] is the input)


# ---------------------------------------------------------------------------- fine-tuning
def _plain_frozen_epoch(x, y) -> tuple[keras.Model, list]:
    """Plain Keras at batch K*b: freeze the hidden layer, compile, fit one epoch, unfreeze (not
    recompiled). Returns the model and its initial weights."""
    model = small_mlp()
    initial = get_weights(model)
    _freeze_first(model)
    model.compile(_adam(), LOSS)
    model.fit(x, y, batch_size=K * MICRO, shuffle=False, verbose=0)
    _freeze_first(model, False)
    return model, initial


def _plain_fine_tuning(x, y) -> tuple[list, list]:
    """Independent reference: plain Keras at batch K*b: freeze, fit, unfreeze, compile, fit."""
    model, initial = _plain_frozen_epoch(x, y)
    model.compile(_adam(), LOSS)
    model.fit(x, y, batch_size=K * MICRO, shuffle=False, verbose=0)
    return initial, get_weights(model)


@pytest.mark.parametrize("way", list(WAYS))
def test_fine_tuning_with_accum_model_matches_plain_keras(data, way):
    x, y = data
    initial, reference = _plain_fine_tuning(x, y)
    model, batch_size = _accum_model(way)
    _freeze_first(model)
    model.compile(_adam(), LOSS)
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    assert len(model.accumulation.accumulators) == 2
    _freeze_first(model, False)
    model.compile(_adam(), LOSS)
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)  # was: "Got 4 gradients"
    assert len(model.accumulation.accumulators) == 4
    assert_matches_reference(model, initial, reference)
    # and the frozen phase really was frozen (so the test can tell the phases apart):
    frozen_only = small_mlp(model_cls=ac.AccumModel, accum_steps=K)
    frozen_only.compile(_adam(), LOSS)
    frozen_only.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    assert relative_error(get_weights(frozen_only), reference, initial) > 100 * REL_TOL


@pytest.mark.parametrize("mode", MODES)
def test_fine_tuning_with_accum_trainer_matches_plain_keras(mode, data):
    x, y = data
    initial, reference = _plain_fine_tuning(x, y)
    model = small_mlp()
    trainer = ac.AccumTrainer(model, _adam(), LOSS, accum_steps=K)
    _freeze_first(model)
    trainer.fit(dataset(x, y, micro=MICRO), mode=mode, verbose=0)
    _freeze_first(model, False)
    # A built Keras optimizer cannot take new variables: a clear error says what to do.
    with pytest.raises(ValueError, match=r"trainer\.optimizer = "):
        trainer.fit(dataset(x, y, micro=MICRO), mode=mode, verbose=0)
    trainer.optimizer = _adam()  # what `compile` does in the plain workflow
    trainer.fit(dataset(x, y, micro=MICRO), mode=mode, verbose=0)
    assert len(trainer.state.accumulators) == 4
    assert trainer.state.counters()["windows_applied"] == 4
    assert_matches_reference(model, initial, reference)


def test_pending_window_and_changed_trainable_set_raise_naming_flush(data):
    x, y = data  # 40 samples = 5 micro-batches: one window of 3 and 2 carried micro-batches
    model = small_mlp(model_cls=ac.AccumModel, accum_steps=K, end_of_epoch="carry")
    _freeze_first(model)
    model.compile(_adam(), LOSS)
    model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    _freeze_first(model, False)
    model.compile(_adam(), LOSS)
    with pytest.raises(ValueError, match=r"`accumcore\.flush\(model\)`"):
        model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert int(model.accumulation.micro_step.numpy()) == 2  # nothing was lost
    assert model.flush()  # applied to the two variables it was accumulated for
    model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert len(model.accumulation.accumulators) == 4

    plain = small_mlp()
    trainer = ac.AccumTrainer(plain, _adam(), LOSS, accum_steps=K, end_of_epoch="carry")
    _freeze_first(plain)
    trainer.fit(dataset(x, y, micro=MICRO), verbose=0)
    _freeze_first(plain, False)
    trainer.optimizer = _adam()
    with pytest.raises(ValueError, match=r"trainer\.flush\(\)"):
        trainer.fit(dataset(x, y, micro=MICRO), verbose=0)
    assert int(trainer.state.micro_step.numpy()) == 2


@pytest.mark.parametrize("way", list(WAYS))
def test_unfreezing_without_compile_keeps_the_traced_set_as_keras_does(data, way):
    # Plain Keras keeps training the variables its train function was traced with until
    # `compile` is called again; AccumModel does the same, and its end-of-epoch flush applies
    # each window to the variables it was accumulated for.
    x, y = data
    plain, initial = _plain_frozen_epoch(x, y)
    plain.fit(x, y, batch_size=K * MICRO, shuffle=False, verbose=0)
    assert np.array_equal(get_weights(plain)[0], initial[0])  # Keras: still frozen

    model, batch_size = _accum_model(way)
    _freeze_first(model)
    model.compile(_adam(), LOSS)
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    _freeze_first(model, False)
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    assert_matches_reference(model, initial, get_weights(plain))


# ---------------------------------------------------------------------------- non-finite
N_BAD, BAD_MB = 16, 2  # 4 micro-batches of 4, the third one poisoned; K = 4


def _clean_and_poisoned():
    rng = np.random.default_rng(5)
    xa = rng.normal(size=(N_BAD, 8)).astype("float32")
    xa[BAD_MB * 4 + 1, 3] = np.nan
    ya = rng.integers(0, 3, N_BAD).astype("int32")
    xb = rng.normal(size=(N_BAD, 8)).astype("float32")
    yb = rng.integers(0, 3, N_BAD).astype("int32")
    return xa, ya, xb, yb


def _recovery_reference(xb, yb):
    """The bad run's one window is discarded whole: the reference is the clean run alone."""
    model = small_mlp()
    initial = get_weights(model)
    model.compile(_adam(), LOSS)
    model.train_on_batch(xb, yb)
    return initial, get_weights(model)


@pytest.mark.parametrize("way", ("accum_steps", "micro_batch_size"))
@pytest.mark.parametrize("recompile", (False, True))
def test_fit_after_nonfinite_error_clears_the_stop_and_trains_on(recompile, way, caplog):
    xa, ya, xb, yb = _clean_and_poisoned()
    initial, reference = _recovery_reference(xb, yb)
    how, batch_size = (dict(accum_steps=4), 4) if way == "accum_steps" else (
        dict(micro_batch_size=4), N_BAD)
    model = small_mlp(model_cls=ac.AccumModel, **how)
    model.compile(_adam(), LOSS)
    with pytest.raises(ac.NonFiniteGradientError, match=r"next `fit`.*clear_nonfinite") as err:
        model.fit(xa, ya, batch_size=batch_size, shuffle=False, verbose=0)
    assert (err.value.window, err.value.micro_batches) == (0, 4)
    if recompile:
        model.compile(_adam(), LOSS)  # the old optimizer never stepped: same reference
    with caplog.at_level(logging.WARNING, logger="accumcore"):
        model.fit(xb, yb, batch_size=batch_size, shuffle=False, verbose=0)  # was: the same error
    assert "cleared the non-finite gradient stop" in caplog.text
    assert_matches_reference(model, initial, reference)


@pytest.mark.parametrize("mode", MODES)
def test_trainer_fit_after_nonfinite_error_clears_the_stop_and_trains_on(mode, caplog):
    xa, ya, xb, yb = _clean_and_poisoned()
    initial, reference = _recovery_reference(xb, yb)
    model = small_mlp()
    trainer = ac.AccumTrainer(model, _adam(), LOSS, accum_steps=4)
    with pytest.raises(ac.NonFiniteGradientError, match="clear_nonfinite"):
        trainer.fit(dataset(xa, ya, micro=4), mode=mode, verbose=0)
    with caplog.at_level(logging.WARNING, logger="accumcore"):
        trainer.fit(dataset(xb, yb, micro=4), mode=mode, verbose=0)
    assert "cleared the non-finite gradient stop" in caplog.text
    assert_matches_reference(model, initial, reference)


@pytest.mark.parametrize("mode", ("eager", "function"))
def test_resumable_loop_raises_at_the_bad_window_close(mode, tmp_path):
    # ResumableLoop checks after each micro-batch, before it reports it: the bad window
    # (micro-batches 0 to 3, the third poisoned) raises when it closes, unreported and
    # uncheckpointed; the checkpoints before it hold the window in progress.
    xa, ya, _, _ = _clean_and_poisoned()
    trainer = ac.AccumTrainer(small_mlp(), _adam(), LOSS, accum_steps=4)
    loop = ResumableLoop(trainer, tmp_path, save_every=1)
    reported: list[tuple[int, int]] = []
    with pytest.raises(ac.NonFiniteGradientError) as err:
        loop.fit(dataset(xa, ya, micro=4), 1, mode=mode,
                 on_micro_batch_end=lambda epoch, step: reported.append((epoch, step)))
    assert (err.value.window, err.value.first_micro_step, err.value.micro_batches) == (0, 0, 4)
    assert reported == [(0, step) for step in range(3)]
    assert int(loop.checkpoint.save_counter.numpy()) == 3  # one save per reported micro-batch
    assert trainer.state.counters()["windows_applied"] == 0


# ---------------------------------------------------------------------------- steps_per_epoch
def test_infinite_dataset_without_steps_per_epoch_raises_at_once(data):
    x, y = data
    trainer = ac.AccumTrainer(small_mlp(), _adam(), LOSS, accum_steps=K)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        trainer.fit(dataset(x, y, micro=MICRO).repeat(), epochs=1, verbose=0)
    assert not trainer.state.built  # nothing ran


@pytest.mark.parametrize("mode", MODES)
def test_steps_per_epoch_continues_the_iterator_across_epochs(mode, data):
    # 5 micro-batches per pass, 4 per epoch, K = 3: epoch 0 = [0 1 2] [3], epoch 1 = [4 0 1] [2]
    # (the iterator goes on across epochs, as in Keras; each epoch's partial window is applied).
    x, y = data
    model = ac.AccumTrainer(small_mlp(), _adam(), LOSS, accum_steps=K)
    history = model.fit(dataset(x, y, micro=MICRO).repeat(), epochs=2, steps_per_epoch=4,
                        mode=mode, verbose=0)
    assert history.updates == [2, 2]
    assert len(history.micro_losses) == 8

    ref = small_mlp()
    initial = get_weights(ref)
    ref.compile(_adam(), LOSS)
    mb = [np.arange(i * MICRO, (i + 1) * MICRO) for i in range(5)]
    for window in ([0, 1, 2], [3], [4, 0, 1], [2]):
        idx = np.concatenate([mb[i] for i in window])
        ref.train_on_batch(x[idx], y[idx])
    assert_matches_reference(model.model, initial, get_weights(ref))


@pytest.mark.parametrize("mode", MODES)
def test_steps_per_epoch_running_out_of_data_behaves_as_keras(mode, data):
    x, y = data  # 5 micro-batches, steps_per_epoch=3: Keras trains 3, 2 (+ warning), 3
    counts: list[int] = []

    class Count(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            counts.append(0)

        def on_train_batch_end(self, batch, logs=None):
            counts[-1] += 1

    plain = small_mlp()
    plain.compile(_adam(), LOSS)
    with pytest.warns(UserWarning, match="ran out of data"):
        plain.fit(dataset(x, y, micro=MICRO), epochs=3, steps_per_epoch=3, verbose=0,
                  callbacks=[Count()])

    trainer = ac.AccumTrainer(small_mlp(), _adam(), LOSS, accum_steps=K)
    seen: list[int] = []
    with pytest.warns(UserWarning, match="ran out of data after 2 of steps_per_epoch=3 "
                                         "micro-batches in epoch 2:"):  # counted from 1
        history = trainer.fit(dataset(x, y, micro=MICRO), epochs=3, steps_per_epoch=3,
                              mode=mode, verbose=0,
                              on_epoch_end=lambda e, h: seen.append(len(h.micro_losses)))
    per_epoch = np.diff([0, *seen]).tolist()
    assert per_epoch == counts == [3, 2, 3]
    assert history.updates == [1, 1, 1]  # [0 1 2], [3 4] flushed, [0 1 2] (a new pass)


# ---------------------------------------------------------------------------- ResumableLoop
def test_resumable_loop_empty_epoch_raises_naming_the_epoch(tmp_path, data):
    x, y = data
    ds = dataset(x, y, micro=MICRO)
    loop = ResumableLoop(ac.AccumTrainer(small_mlp(), _adam(), LOSS, accum_steps=K), tmp_path,
                         save_every=2)
    with pytest.raises(ValueError, match="yielded no micro-batches in epoch 2:"):
        loop.fit(lambda epoch: ds if epoch == 0 else ds.take(0), 2)
    assert loop.trainer.state.counters()["micro_batches_seen"] == 5  # epoch 0 ran


def test_resumable_loop_resumed_at_the_end_of_an_epoch_finishes_it_as_without_the_crash(
        tmp_path, data):
    # 5 micro-batches per epoch, K = 3, save_every=5: the checkpoint after the 5th micro-batch
    # holds an exhausted iterator and a pending window of 2; the resumed epoch 0 runs no
    # micro-batch (not an empty dataset) and flushes that window, then epoch 1 runs.
    x, y = data
    ds = dataset(x, y, micro=MICRO)
    reference = ac.AccumTrainer(small_mlp(), _adam(), LOSS, accum_steps=K)
    straight = ResumableLoop(reference, tmp_path / "straight", save_every=5).fit(ds, 2)

    def crash(epoch: int, step: int) -> None:
        if (epoch, step) == (0, 4):
            raise KeyboardInterrupt

    first = ResumableLoop(ac.AccumTrainer(small_mlp(), _adam(), LOSS, accum_steps=K),
                          tmp_path / "ckpt", save_every=5, save_at_epoch_end=False)
    with pytest.raises(KeyboardInterrupt):
        first.fit(ds, 2, on_micro_batch_end=crash)
    trainer = ac.AccumTrainer(small_mlp(seed=1), _adam(), LOSS, accum_steps=K)
    resumed = ResumableLoop(trainer, tmp_path / "ckpt", save_every=5)
    history = resumed.fit(ds, 2)
    assert resumed.resumed and int(trainer.state.micro_step.numpy()) == 0
    assert len(history.micro_losses) == 5  # epoch 1 only
    assert history.updates == straight.updates == [2, 2]
    assert history.epoch_losses == straight.epoch_losses  # epoch 0's sums were restored
    for got, want in zip(get_weights(trainer.model), get_weights(reference.model)):
        np.testing.assert_array_equal(got, want)  # same ops in the same order: bit-identical


# ---------------------------------------------------------------------------- arrays
@pytest.mark.parametrize("mode", MODES)
def test_fit_takes_arrays_like_model_fit(mode, data):
    x, y = data
    sw = np.random.default_rng(2).uniform(0, 2, size=len(x)).astype("float32")
    initial, reference = reference_weights(_adam, x, y, sw, micro=MICRO, k=K, epochs=2)
    model = small_mlp()
    trainer = ac.AccumTrainer(model, _adam(), LOSS, accum_steps=K)
    trainer.fit(x, y, batch_size=MICRO, epochs=2, sample_weight=sw, shuffle=False, mode=mode,
                verbose=0)  # was: TypeError
    assert_matches_reference(model, initial, reference)


def test_fit_arrays_default_batch_size_is_the_micro_batch_size(data):
    x, y = data
    with pytest.warns(FutureWarning, match="old form"):  # the old form keeps its meaning
        trainer = ac.AccumTrainer(small_mlp(), _adam(), LOSS, effective_batch_size=24,
                                  micro_batch_size=8)
    history = trainer.fit(x, y, verbose=0)
    assert history.micro_weights == [8.0] * 5
    with pytest.raises(ValueError, match="`batch_size`=16 contradicts"):
        trainer.fit(x, y, batch_size=16, verbose=0)


def test_array_shuffle_draws_a_new_permutation_every_epoch():
    ids = np.arange(20, dtype="int64")
    tf.random.set_seed(0)
    shuffled = array_dataset((ids,), 6, shuffle=True)
    epochs = [np.concatenate([b[0].numpy() for b in shuffled]) for _ in range(3)]
    for order in epochs:
        assert sorted(order.tolist()) == ids.tolist()  # every sample once per epoch
    assert not np.array_equal(epochs[0], ids) and not np.array_equal(epochs[0], epochs[1])
    kept = array_dataset((ids,), 6, shuffle=False)
    assert np.concatenate([b[0].numpy() for b in kept]).tolist() == ids.tolist()
    assert [len(b[0]) for b in kept] == [6, 6, 6, 2]


def test_fit_rejects_keras_arguments_that_do_not_apply(data):
    x, y = data
    trainer = ac.AccumTrainer(small_mlp(), _adam(), LOSS, accum_steps=K)
    with pytest.raises(ValueError, match="`batch_size` must not be given with a dataset"):
        trainer.fit(dataset(x, y, micro=MICRO), batch_size=8, verbose=0)
    with pytest.raises(ValueError, match="did you mean `epochs=`"):
        # Keras's positions: x, y, batch_size
        trainer.fit(dataset(x, y, micro=MICRO), None, 2, verbose=0)
    with pytest.raises(ValueError, match=r"`y` must not be given with a dataset \(did you mean "
                                         r"`epochs=`\?\)"):
        trainer.fit(dataset(x, y, micro=MICRO), 2, verbose=0)  # 2 is `y`, as in model.fit
    with pytest.raises(TypeError, match=r"from_tensor_slices"):
        trainer.fit((b for b in [(x, y)]), verbose=0)
    with pytest.raises(ValueError, match="same number of samples"):
        trainer.fit(x, y[:-1], verbose=0)


# ---------------------------------------------------------------------------- optimizer names
def test_optimizer_by_name_as_in_compile(data):
    x, y = data
    make = lambda: keras.optimizers.get("adam")  # noqa: E731 - Keras's defaults
    initial, reference = reference_weights(make, x, y, None, micro=MICRO, k=K)
    model = small_mlp()
    trainer = ac.AccumTrainer(model, "adam", LOSS, accum_steps=K)  # was: TypeError
    assert isinstance(trainer.optimizer, keras.optimizers.Adam)
    trainer.fit(dataset(x, y, micro=MICRO), verbose=0)
    assert_matches_reference(model, initial, reference)
    with pytest.raises(ValueError, match="Unknown `optimizer`='adamm'"):
        ac.AccumTrainer(small_mlp(), "adamm", LOSS, accum_steps=K)


# ---------------------------------------------------------------------------- reductions
SUM_LOSS = keras.losses.SparseCategoricalCrossentropy(reduction="sum")


def _sgd_small() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.005)  # a summed loss has gradients ~B times larger


@pytest.mark.parametrize("entry", ("eager", "function", "graph", "window_step", "fit",
                                   "fit_split"))
def test_sum_reduction_is_exact(entry, data):
    from helpers import train_entry

    x, y = data
    initial, reference = reference_weights(_sgd_small, x, y, None, micro=MICRO, k=K,
                                           epochs=2, loss=SUM_LOSS)
    if entry == "fit_split":  # batches of K * b, each split into micro-batches of b
        model, batch_size = _accum_model("micro_batch_size")
        model.compile(_sgd_small(), SUM_LOSS)
        model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    else:
        model = train_entry(entry, _sgd_small, x, y, None, micro=MICRO, k=K, epochs=2,
                            loss=SUM_LOSS)
    assert_matches_reference(model, initial, reference)  # was: rel 0.7-1.0, silently


def test_unsupported_reductions_raise_and_name_the_ones_that_work(data):
    x, y = data
    none_loss = keras.losses.SparseCategoricalCrossentropy(reduction="none")
    with pytest.raises(ValueError, match="sum_over_batch_size.*mean_with_sample_weight"):
        ac.AccumTrainer(small_mlp(), _adam(), none_loss, accum_steps=K)
    for way in WAYS:
        model, batch_size = _accum_model(way)
        model.compile(_adam(), none_loss)
        with pytest.raises(ValueError, match="sum_over_batch_size"):
            model.fit(x, y, batch_size=batch_size, verbose=0)
    with pytest.raises(ValueError, match="normalizer='sample_weight' does not match"):
        ac.AccumTrainer(small_mlp(), _adam(), keras.losses.SparseCategoricalCrossentropy(),
                        accum_steps=K, normalizer="sample_weight")


# ---------------------------------------------------------------------------- unbatched data
@pytest.mark.parametrize("mode", MODES)
def test_unbatched_dataset_names_batch(mode, data):
    x, y = data
    trainer = ac.AccumTrainer(small_mlp(), _adam(), LOSS, accum_steps=K)
    with pytest.raises(ValueError, match=r"dataset\.batch\(b\)"):
        trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)), mode=mode, verbose=0)


def test_unbuilt_model_that_fails_to_build_names_batch(data):
    x, y = data

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, inputs):
            return self.dense(tf.reshape(inputs, (-1, 8, 1)))[:, 0, :]

    trainer = ac.AccumTrainer(Net(), _adam(), LOSS, accum_steps=K)
    with pytest.raises(ValueError, match=r"dataset\.batch\(b\)"):
        trainer.fit(tf.data.Dataset.from_tensor_slices((x[:, :3], y)), verbose=0)
