"""Bad input: one test per case; each asserts the exception type and that the message names
the parameter (and, where there is one, the fix). The README's "Errors and bad input" table
lists the same cases.
"""

from __future__ import annotations

import inspect
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import LOSS, built_state, small_mlp

import accumcore as ac
from accumcore._impl.settings import check_positive_int
from accumcore.checkpointing import ExactBackupAndRestore, ResumableLoop, SkipTrainedBatches
from accumcore.memory import accum_steps_for, largest_fitting


@pytest.fixture
def xy() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(16, 8)).astype("float32"), rng.integers(0, 3, 16).astype("int32")


def sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.1)


# Every constructor that takes `accum_steps`, called with the bad value.
CONSTRUCTORS = {
    "AccumTrainer": lambda k: ac.AccumTrainer(small_mlp(), sgd(), LOSS, accum_steps=k),
    "AccumModel": lambda k: small_mlp(model_cls=ac.AccumModel, accum_steps=k),
    "AccumulationState": lambda k: ac.AccumulationState(k),
    "resolve_accum_steps": lambda k: ac.resolve_accum_steps(k),
}


# ---------------------------------------------------------------------------- accum_steps
# Each bad value, the exception and the message it must raise.
BAD_ACCUM_STEPS = {
    "zero": (0, ValueError, "`accum_steps` must be >= 1.*1 means no accumulation"),
    "negative": (-3, ValueError, "`accum_steps` must be >= 1.*got -3"),
    # 4.0 is rejected, not rounded: a float K usually comes from B / b that did not divide.
    "float": (4.0, TypeError, "`accum_steps` must be a positive int.*float"),
    # bool is an int subclass in Python; True would silently mean K = 1.
    "bool": (True, TypeError, "`accum_steps` must be a positive int.*bool"),
}


@pytest.mark.parametrize("where", sorted(CONSTRUCTORS))
@pytest.mark.parametrize("bad", list(BAD_ACCUM_STEPS))
def test_accum_steps_bad_value(bad, where):
    value, error, message = BAD_ACCUM_STEPS[bad]
    with pytest.raises(error, match=message):
        CONSTRUCTORS[where](value)


# Every constructor that takes `micro_batch_size` (fit's split mode), called with the bad value.
SPLIT_CONSTRUCTORS = {
    "AccumModel": lambda b: small_mlp(model_cls=ac.AccumModel, micro_batch_size=b),
    "accumulate": lambda b: ac.accumulate(small_mlp(), micro_batch_size=b),
}
SPLIT_MESSAGE = (r"`micro_batch_size` must be a positive int \(the samples of one "
                 r"micro-batch.*'auto'")


@pytest.mark.parametrize("where", sorted(SPLIT_CONSTRUCTORS))
@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-3, ValueError),
                                               (4.0, TypeError), (True, TypeError),
                                               ("big", ValueError)], ids=repr)
def test_micro_batch_size_bad_value(value, error, where):
    """4.0 is refused, not rounded; True would silently mean b = 1; a string other than
    'auto' names the one accepted. A value of the wrong type is a TypeError, as for
    `accum_steps`; a wrong int or string a ValueError."""
    with pytest.raises(error, match=SPLIT_MESSAGE):
        SPLIT_CONSTRUCTORS[where](value)


@pytest.mark.parametrize("where", ["AccumModel", "accumulate"])
def test_accum_steps_and_micro_batch_size_together(where):
    with pytest.raises(ValueError, match=r"`accum_steps` or `micro_batch_size`, not both "
                                         r"\(got accum_steps=2, micro_batch_size=4\)"):
        if where == "AccumModel":
            small_mlp(model_cls=ac.AccumModel, accum_steps=2, micro_batch_size=4)
        else:
            ac.accumulate(small_mlp(), 2, micro_batch_size=4)


#: fit's two modes for the rows below: the AccumModel's setting and fit's batch size.
FIT_MODES = {"accum_steps": (dict(accum_steps=2), 4),
             "micro_batch_size": (dict(micro_batch_size=4), 8)}


def _fit_model(mode: str) -> tuple[keras.Model, int]:
    how, batch_size = FIT_MODES[mode]
    return small_mlp(model_cls=ac.AccumModel, **how), batch_size


# Other counts and sizes share the positive-int check, with a message that names them and does
# not explain K (issue 12: "1 means no accumulation" misled for `epochs`, `start`, ...).
OTHER_COUNTS = {
    "effective_batch_size": lambda v: ac.resolve_accum_steps(effective_batch_size=v,
                                                             micro_batch_size=4),
    "micro_batch_size": lambda v: ac.resolve_accum_steps(effective_batch_size=8,
                                                         micro_batch_size=v),
    "start": lambda v: largest_fitting(lambda b: True, start=v, limit=8),
    "target_batch_size": lambda v: accum_steps_for(v, 4),
    # datasets.py / checkpointing.py call check_positive_int(value, "<their name>")
    "epochs": lambda v: check_positive_int(v, "epochs"),
}


@pytest.mark.parametrize("name", sorted(OTHER_COUNTS))
@pytest.mark.parametrize(("value", "error", "message"), [
    (0, ValueError, "must be >= 1, got 0"), (2.0, TypeError, "must be a positive int, got 2.0"),
    (True, TypeError, "must be a positive int, got True of type bool")])
def test_other_counts_bad_value(name, value, error, message):
    with pytest.raises(error, match=f"`{name}` {message}") as info:
        OTHER_COUNTS[name](value)
    assert "micro-batches per optimizer update" not in str(info.value)


def test_target_batch_not_a_multiple_of_the_micro_batch():
    with pytest.raises(ValueError, match="`effective_batch_size`=100 is not a multiple of "
                                         "`micro_batch_size`=16.*accum_steps=7.*B = 112"):
        ac.AccumTrainer(small_mlp(), sgd(), LOSS, effective_batch_size=100,
                        micro_batch_size=16)
    # resolve_accum_steps names its own way out, exact=False, which rounds K up
    with pytest.raises(ValueError, match="`exact=False`"):
        ac.resolve_accum_steps(effective_batch_size=100, micro_batch_size=16)
    assert ac.resolve_accum_steps(effective_batch_size=100, micro_batch_size=16,
                                  exact=False) == 7


def test_accum_steps_and_effective_batch_size_together():
    with pytest.raises(ValueError, match="either `accum_steps` or `effective_batch_size`"):
        ac.resolve_accum_steps(4, effective_batch_size=64, micro_batch_size=16)


# ---------------------------------------------------------------------------- data
def test_empty_dataset_custom_loop(xy):
    x, y = xy
    trainer = ac.AccumTrainer(small_mlp(), sgd(), LOSS, accum_steps=2)
    empty = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).take(0)
    with pytest.raises(ValueError, match="`dataset` is empty"):
        trainer.fit(empty, verbose=0)


def test_empty_dataset_of_unknown_length_custom_loop(xy):
    x, y = xy
    trainer = ac.AccumTrainer(small_mlp(), sgd(), LOSS, accum_steps=2)
    empty = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: b > 5).batch(4)
    with pytest.raises(ValueError, match="`dataset` yielded no micro-batches"):
        trainer.fit(empty, mode="eager", verbose=0)


@pytest.mark.parametrize("mode", sorted(FIT_MODES))
def test_empty_arrays_model_fit(xy, mode):
    # Plain Keras trains nothing and returns an empty History here; accumcore refuses.
    x, y = xy
    model, batch_size = _fit_model(mode)
    model.compile(sgd(), LOSS)
    with pytest.raises(ValueError, match=r"training data \(`x`\) yielded no batches"):
        model.fit(x[:0], y[:0], batch_size=batch_size, verbose=0)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_dataset_without_labels_custom_loop(mode, xy):
    x, _ = xy
    trainer = ac.AccumTrainer(small_mlp(), sgd(), LOSS, accum_steps=2)
    with pytest.raises(ValueError, match="`dataset` yields no labels"):
        trainer.fit(tf.data.Dataset.from_tensor_slices(x).batch(4), mode=mode, verbose=0)


@pytest.mark.parametrize("mode", sorted(FIT_MODES))
def test_data_without_labels_model_fit(xy, mode):
    # Keras alone fails with "None values not supported."
    x, _ = xy
    model, batch_size = _fit_model(mode)
    model.compile(sgd(), LOSS)
    with pytest.raises(ValueError, match=r"no labels \(`y` is None\)"):
        model.fit(x, batch_size=batch_size, verbose=0)


# ---------------------------------------------------------------------------- models
class Unbuilt(keras.Model):
    """A subclassed model without an input shape: no variables until it is called."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = keras.layers.Dense(3, activation="softmax")

    def call(self, x):
        return self.dense(x)


def test_unbuilt_model_without_input_shape_state():
    model = Unbuilt()
    with pytest.raises(ValueError, match=r"no trainable variables yet.*model\.build"):
        ac.AccumulationState(2).build(model.trainable_variables)


def test_unbuilt_subclassed_accum_model_fit(xy):
    class UnbuiltAccum(ac.AccumModel):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(3, activation="softmax")

        def call(self, x):
            return self.dense(x)

    # Not an error for fit any more: it builds the model on the first batch, as keras.Model.fit
    # builds a plain subclass (exactness: tests/test_workflows_model.py). Asking for the
    # accumulators before any data still raises, naming the fix.
    x, y = xy
    small_mlp(model_cls=ac.AccumModel, accum_steps=2)  # functional use first must not matter
    model = UnbuiltAccum(accum_steps=2)
    with pytest.raises(ValueError, match=r"model is not built.*input shape.*model\.build"):
        model.build_accumulation()
    model.compile(sgd(), LOSS)
    model.fit(x, y, batch_size=4, verbose=0)
    assert model.built and int(model.optimizer.iterations.numpy()) == 2


def test_unbuilt_model_is_built_by_the_custom_loop(xy):
    # Not an error for AccumTrainer: it builds the model on the first micro-batch.
    x, y = xy
    model = Unbuilt()
    trainer = ac.AccumTrainer(model, sgd(), LOSS, accum_steps=2)
    trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), mode="eager", verbose=0)
    assert trainer.state.counters()["windows_applied"] == 2


def test_model_that_cannot_be_built_on_the_data(xy):
    class WrongShape(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(tf.reshape(x, (-1, 7)))  # 8 features cannot be reshaped to 7

    x, y = xy
    trainer = ac.AccumTrainer(WrongShape(), sgd(), LOSS, accum_steps=2)
    with pytest.raises(ValueError, match=r"Could not build `model`.*input shape \(4, 8\)"):
        trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), verbose=0)


def test_model_not_a_keras_model():
    with pytest.raises(TypeError, match="`model` must be a keras.Model"):
        ac.AccumTrainer(lambda x: x, sgd(), LOSS, accum_steps=2)


# ---------------------------------------------------------------------------- gradients
def test_gradient_list_shorter_than_variables():
    model, state, _ = built_state(2)
    grads = [tf.zeros_like(v) for v in model.trainable_variables][:-1]
    with pytest.raises(ValueError, match="Got 3 gradients for 4 accumulators: `grads` must"):
        state.accumulate(grads, 4.0, 4)


def test_gradients_in_the_wrong_order():
    model, state, _ = built_state(2)
    grads = [tf.zeros_like(v) for v in model.trainable_variables][::-1]
    with pytest.raises(ValueError, match="does not match accumulator.*`grads` must be in the "
                                         "order"):
        state.accumulate(grads, 4.0, 4)


# ---------------------------------------------------------------------------- optimizers
def test_optimizer_already_accumulating_custom_loop():
    opt = keras.optimizers.SGD(0.1, gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match=r"`optimizer` already accumulates gradients "
                                         r"\(gradient_accumulation_steps=4\)"):
        ac.AccumTrainer(small_mlp(), opt, LOSS, accum_steps=2)


@pytest.mark.parametrize("mode", sorted(FIT_MODES))
def test_optimizer_already_accumulating_model_fit(xy, mode):
    x, y = xy
    model, batch_size = _fit_model(mode)
    model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), LOSS)
    with pytest.raises(ValueError, match="`optimizer` already accumulates gradients"):
        model.fit(x, y, batch_size=batch_size, verbose=0)


def test_optimizer_not_a_keras_optimizer():
    with pytest.raises(TypeError, match="`optimizer` must be a Keras 3 optimizer"):
        ac.AccumTrainer(small_mlp(), tf.optimizers.schedules.ExponentialDecay(1.0, 1, 0.5),
                        LOSS, accum_steps=2)


def test_loss_that_is_not_a_loss():
    with pytest.raises(TypeError, match="`loss` must be a keras.losses.Loss"):
        ac.AccumTrainer(small_mlp(), sgd(), 3, accum_steps=2)


# ---------------------------------------------------------------------------- policy strings
POLICIES = {
    "nonfinite": [
        lambda v: ac.AccumTrainer(small_mlp(), sgd(), LOSS, accum_steps=2, nonfinite=v),
        lambda v: small_mlp(model_cls=ac.AccumModel, accum_steps=2, nonfinite=v),
        lambda v: small_mlp(model_cls=ac.AccumModel, micro_batch_size=4, nonfinite=v),
        lambda v: ac.accumulate(small_mlp(), micro_batch_size=4, nonfinite=v),
        lambda v: ac.AccumulationState(2, nonfinite=v),
    ],
    "end_of_epoch": [
        lambda v: ac.AccumTrainer(small_mlp(), sgd(), LOSS, accum_steps=2, end_of_epoch=v),
        lambda v: small_mlp(model_cls=ac.AccumModel, accum_steps=2, end_of_epoch=v),
    ],
    "normalizer": [
        lambda v: ac.AccumTrainer(small_mlp(), sgd(), LOSS, accum_steps=2, normalizer=v),
        lambda v: small_mlp(model_cls=ac.AccumModel, accum_steps=2, normalizer=v),
        lambda v: small_mlp(model_cls=ac.AccumModel, micro_batch_size=4, normalizer=v),
        lambda v: ac.accumulate(small_mlp(), micro_batch_size=4, normalizer=v),
    ],
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_unknown_policy_string(name):
    for make in POLICIES[name]:
        with pytest.raises(ValueError, match=rf"Unknown `{name}`='ignore'; expected one of"):
            make("ignore")


def test_unknown_mode(xy):
    x, y = xy
    trainer = ac.AccumTrainer(small_mlp(), sgd(), LOSS, accum_steps=2)
    with pytest.raises(ValueError, match="Unknown `mode`='xla'"):
        trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), mode="xla")


# ---------------------------------------------------------------------------- float16
@pytest.fixture
def float16_policy():
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("float16")
    yield
    keras.mixed_precision.set_global_policy(previous)


def test_float16_without_loss_scaling_warns_about_underflow(float16_policy):
    with pytest.warns(UserWarning, match=r"float16.*`optimizer` \(SGD\).*gradients may "
                                         r"underflow.*LossScaleOptimizer"):
        ac.AccumTrainer(small_mlp(), sgd(), LOSS, accum_steps=2)


@pytest.mark.parametrize("mode", sorted(FIT_MODES))
def test_float16_model_fit_without_loss_scaling_warns(float16_policy, xy, mode):
    x, y = xy
    model, batch_size = _fit_model(mode)
    model.compile(sgd(), LOSS)  # compile wraps only for "mixed_float16", not "float16"
    with pytest.warns(UserWarning, match="gradients may underflow"):
        model.fit(x, y, batch_size=batch_size, verbose=0)


def test_float16_with_loss_scaling_does_not_warn(float16_policy):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        ac.AccumTrainer(small_mlp(), keras.optimizers.LossScaleOptimizer(sgd()), LOSS,
                        accum_steps=2)


def test_float32_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        ac.AccumTrainer(small_mlp(), sgd(), LOSS, accum_steps=2)


# ---------------------------------------------------------------------------- windows
def test_window_step_with_a_pending_partial_window(xy):
    x, y = xy
    trainer = ac.AccumTrainer(small_mlp(), sgd(), LOSS, accum_steps=3)
    trainer.train_micro_batch(x[:4], y[:4])
    with pytest.raises(ValueError, match=r"`window_step` needs an empty window.*flush\(\)"):
        trainer.window_step(x, y)


def test_changing_accum_steps_with_a_pending_window(xy):
    x, y = xy
    model = small_mlp(model_cls=ac.AccumModel, accum_steps=3)
    model.compile(sgd(), LOSS)
    model.fit(x[:8], y[:8], batch_size=4, verbose=0, epochs=1)  # 2 of 3: flushed at epoch end
    model.set_accumulation(end_of_epoch="carry")
    model.fit(x[:8], y[:8], batch_size=4, verbose=0, epochs=1)  # 2 of 3: carried
    with pytest.raises(ValueError, match=r"partial window is pending.*`accumcore\.flush\(model\)`"):
        model.set_accumulation(accum_steps=2)


# ---------------------------------------------------------------------------- checkpointing
def test_resumable_loop_rejects_graph_mode_and_bad_save_every(tmp_path, xy):
    x, y = xy
    trainer = ac.AccumTrainer(small_mlp(), sgd(), LOSS, accum_steps=2)
    with pytest.raises(ValueError, match="`save_every` must be >= 1"):
        ResumableLoop(trainer, tmp_path, save_every=0)
    loop = ResumableLoop(trainer, tmp_path, save_every=2)
    with pytest.raises(ValueError, match="Unknown `mode`='graph'"):
        loop.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), 1, mode="graph")


def test_exact_backup_rejects_bad_save_freq_and_a_wrong_initial_epoch(tmp_path, xy):
    with pytest.raises(ValueError, match="`save_freq` must be 'epoch' or an int >= 1"):
        ExactBackupAndRestore(tmp_path / "b", save_freq=0)
    with pytest.raises(ValueError, match="`batches` must be an int >= 0"):
        SkipTrainedBatches(-1)
    x, y = xy
    model = small_mlp(model_cls=ac.AccumModel, accum_steps=2)
    model.compile(sgd(), LOSS)
    backup = ExactBackupAndRestore(tmp_path / "b", save_freq=2, delete_checkpoint=False)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[backup])
    assert backup.initial_epoch == 1 and backup.batches_done == 4
    with pytest.raises(ValueError, match="resumes epoch 2, but `fit` started at "
                                         "epoch 1: pass `initial_epoch="):
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0,
                  callbacks=[ExactBackupAndRestore(tmp_path / "b", save_freq=2)])


def test_the_trainers_message_names_only_calls_the_trainer_has():
    """AccumTrainer has no ``exact``: its message names its own parameters and ``fit``'s."""
    with pytest.raises(ValueError, match="not a multiple") as info:
        ac.AccumTrainer(small_mlp(), sgd(), LOSS, effective_batch_size=100,
                        micro_batch_size=16)
    message = str(info.value)
    named = set(re.findall(r"(\w+)=", message))
    assert named == {"accum_steps", "micro_batch_size", "batch_size"}, message
    own = (set(inspect.signature(ac.AccumTrainer).parameters)
           | set(inspect.signature(ac.AccumTrainer.fit).parameters))
    assert named <= own and "exact" not in message, message
    assert "micro_batch_size=16)` alone and `fit(x, y, batch_size=100)`" in message, message
    # the deprecated parameter is never the way out
    assert "effective_batch_size=" not in message.split(";", 1)[1], message
    with pytest.raises(ValueError, match="smaller than `micro_batch_size`=16.*accum_steps=1"):
        ac.AccumTrainer(small_mlp(), sgd(), LOSS, effective_batch_size=8, micro_batch_size=16)


@pytest.mark.parametrize("big, small, error, match", [
    (True, 16, TypeError, "`effective_batch_size` must be a positive int.*bool"),
    (100, False, TypeError, "`micro_batch_size` must be a positive int.*bool"),
    (100.0, 16, TypeError, "`effective_batch_size` must be a positive int.*float"),
    (np.int64(100), 16, ValueError, "not a multiple.*accum_steps=7.*alone"),
    (100, np.int32(16), ValueError, "not a multiple.*accum_steps=7.*alone"),
    (np.int64(8), 16, ValueError, "smaller than `micro_batch_size`=16.*accum_steps=1"),
])
def test_the_trainers_old_form_checks_every_integer_type_once(big, small, error, match):
    """numpy ints get the trainer's own messages as Python ints do; bools and floats are
    refused by the one positive-int check, naming the parameter."""
    with pytest.raises(error, match=match):
        ac.AccumTrainer(small_mlp(), sgd(), LOSS, effective_batch_size=big,
                        micro_batch_size=small)


def test_the_trainer_refuses_accum_steps_beside_the_old_form_before_other_checks():
    """``accum_steps`` with ``effective_batch_size`` is refused as "not both", whatever B / b."""
    for big in (100, 64, 8):
        with pytest.raises(ValueError, match="not both") as info:
            ac.AccumTrainer(small_mlp(), sgd(), LOSS, accum_steps=4, effective_batch_size=big,
                            micro_batch_size=16)
        # the way out is the front door, never the deprecated parameter
        assert "effective_batch_size=" not in str(info.value).split(";", 1)[1], info.value
        assert "micro_batch_size=b)` and `fit(x, y, batch_size=B)`" in str(info.value)


def test_the_trainers_old_form_with_numpy_ints_trains_on_batches_of_b():
    """A valid old form given numpy ints warns and resolves K = B / b as Python ints."""
    with pytest.warns(FutureWarning, match="old form"):
        trainer = ac.AccumTrainer(small_mlp(), sgd(), LOSS, effective_batch_size=np.int64(64),
                                  micro_batch_size=np.int64(16))
    assert trainer.accum_steps == 4 and type(trainer.accum_steps) is int
    history = trainer.fit(np.zeros((128, 8), "float32"), np.zeros((128,), "int32"), epochs=1,
                          verbose=0)  # arrays: batches of b = 16, 4 per update
    assert trainer.optimizer.iterations.numpy() == 128 // 64, history
