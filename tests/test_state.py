"""AccumulationState: lazy building, None / IndexedSlices gradients, checkpoints mid-window."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import LOSS, OPTIMIZERS, REL_TOL, small_mlp

import accumcore as ac
from accumcore.lab.experiments import get_weights, relative_error


class LazyNet(keras.Model):
    """Subclassed model without an input shape: variables exist only after the first call.
    It also owns a layer that `call` never uses, so that layer's gradients are None."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.head = keras.layers.Dense(3, activation="softmax")
        self.unused = keras.layers.Dense(4)

    def build(self, input_shape):
        self.hidden.build(input_shape)
        self.head.build((None, 16))
        self.unused.build(input_shape)

    def call(self, x):
        return self.head(self.hidden(x))


def _lazy_net():
    keras.utils.set_random_seed(0)
    return LazyNet()


def test_state_is_built_lazily_from_a_subclassed_model_and_skips_none_gradients(data):
    x, y = data
    ref = _lazy_net()
    ref.build((None, 8))
    initial = get_weights(ref)
    ref.compile(keras.optimizers.SGD(0.1), LOSS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras warns about the unused layer's None gradients
        ref.train_on_batch(x, y)
    reference = get_weights(ref)

    model = _lazy_net()
    assert not model.built
    trainer = ac.AccumTrainer(model, keras.optimizers.SGD(0.1), LOSS, accum_steps=3)
    assert not trainer.state.built
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), mode="function",
                    verbose=0)
    assert trainer.state.built
    assert len(trainer.state.accumulators) == len(model.trainable_variables)
    assert relative_error(get_weights(model), reference, initial) <= REL_TOL
    # the unused layer did not move (None gradient is not turned into a zero update)
    for w, w0 in zip(model.unused.get_weights(), [initial[i] for i in range(4, 6)]):
        np.testing.assert_array_equal(w, w0)


def test_indexed_slices_are_accumulated_without_densifying():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,), dtype="int32")
    h = keras.layers.Flatten()(keras.layers.Embedding(50, 3)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(h))
    x = np.random.default_rng(0).integers(0, 50, size=(12, 4)).astype("int32")
    y = np.arange(12) % 2
    state = ac.AccumulationState(2)
    state.build(model.trainable_variables)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(y, model(x)))
    grads = tape.gradient(loss, model.trainable_variables)
    assert isinstance(grads[0], tf.IndexedSlices)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Converting sparse IndexedSlices to a dense Tensor"
        state.accumulate(grads, 12.0, 12)
    np.testing.assert_allclose(state.accumulators[0].numpy(), tf.convert_to_tensor(grads[0]),
                               rtol=1e-6, atol=1e-7)


def test_gradient_list_must_match_variables(data):
    model = small_mlp()
    state = ac.AccumulationState(2)
    state.build(model.trainable_variables)
    grads = [tf.zeros_like(v) for v in model.trainable_variables]
    with pytest.raises(ValueError, match="grads"):
        state.accumulate(grads[:-1], 1.0, 1)
    with pytest.raises(ValueError, match="grads"):
        state.accumulate(list(reversed(grads)), 1.0, 1)


def test_build_needs_variables():
    with pytest.raises(ValueError, match="not built|no trainable variables"):
        ac.AccumulationState(2).build([])


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_checkpoint_mid_window_restores_the_half_full_window(mode, data, tmp_path):
    """Save after 2 of 3 micro-batches, restore into fresh objects (state not yet built:
    deferred restoration), finish the window: identical to the uninterrupted run."""
    x, y = data
    batches = [(x[s:s + 8], y[s:s + 8]) for s in range(0, 40, 8)]  # 5 micro-batches

    def fresh():
        model = small_mlp()
        return ac.AccumTrainer(model, OPTIMIZERS["adam"](), LOSS, accum_steps=3)

    straight = fresh()
    for xb, yb in batches:
        straight.train_micro_batch(xb, yb, compiled=mode == "function")
    straight.flush()

    first = fresh()
    for xb, yb in batches[:2]:
        first.train_micro_batch(xb, yb, compiled=mode == "function")
    ckpt = tf.train.Checkpoint(model=first.model, optimizer=first.optimizer, state=first.state)
    path = ckpt.write(str(tmp_path / "mid"))
    assert int(first.state.micro_step.numpy()) == 2

    resumed = fresh()
    tf.train.Checkpoint(model=resumed.model, optimizer=resumed.optimizer,
                        state=resumed.state).read(path)
    resumed.build(batches[0][0])  # creating the accumulators now restores them (deferred)
    assert int(resumed.state.micro_step.numpy()) == 2
    np.testing.assert_array_equal(resumed.state.accumulators[0].numpy(),
                                  first.state.accumulators[0].numpy())
    for xb, yb in batches[2:]:
        resumed.train_micro_batch(xb, yb, compiled=mode == "function")
    resumed.flush()
    for a, b in zip(get_weights(resumed.model), get_weights(straight.model)):
        np.testing.assert_array_equal(a, b)
    assert int(resumed.optimizer.iterations.numpy()) == 2


def test_counters_account_for_every_sample(data):
    x, y = data
    trainer = ac.AccumTrainer(small_mlp(), OPTIMIZERS["sgd"](), LOSS, accum_steps=2)
    trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=3, verbose=0)
    c = trainer.state.counters()
    assert c["samples_seen"] == 3 * 40
    assert c["micro_batches_seen"] == 3 * 3
    assert c["windows_applied"] == 3 * 2  # [16, 16] and the flushed [8] per epoch
    assert int(trainer.optimizer.iterations.numpy()) == c["windows_applied"]


def test_a_dropped_window_is_logged_with_the_epoch_counted_from_1(caplog):
    """end_of_epoch='drop' names the epoch that ended as a reader counts it: epoch 0 of
    Keras's callbacks is "epoch 1". Catches the 0-based number in the warning."""
    import logging

    model = small_mlp()
    optimizer = keras.optimizers.SGD(0.1)
    state = ac.AccumulationState(4)
    state.build(model.trainable_variables)
    grads = [tf.ones_like(v) for v in model.trainable_variables]
    state.step(grads, 8.0, 8, optimizer, model.trainable_variables)  # 1 of 4: pending
    with caplog.at_level(logging.WARNING, logger="accumcore"):
        assert state.end_epoch("drop", optimizer, epoch=0) == "dropped"
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.endswith("(8 samples) at the end of epoch 1.")
