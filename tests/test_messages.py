"""Every message names a call that exists on the object the user holds.

Each error or warning below is raised through ``accumulate``, ``AccumModel`` and
``AccumTrainer`` (where it can arise there); every call it names in backticks
(``accumcore.flush(model)``, ``trainer.flush()``, ``model.set_accumulation(...)``) is then
resolved on the objects of that entry point. Catches: a message that tells an ``accumulate`` d
model's user to call ``model.flush()`` (which only ``AccumModel`` has), or a trainer's user a
model method.
"""

from __future__ import annotations

import re
import warnings

import keras
import pytest
from helpers import LOSS, make_data, small_mlp

import accumcore as ac

K, MICRO = 4, 4
ENTRIES = ("accumulate", "AccumModel", "AccumTrainer")
CALL = re.compile(r"`((?:accumcore|model|trainer|state)(?:\.\w+)+)\(")


def named_calls(message: str) -> list[str]:
    """The dotted calls a message names in backticks (``accumcore.flush`` of
    ``accumcore.flush(model)``)."""
    return CALL.findall(message)


def assert_calls_exist(message: str, held: dict) -> None:
    """Every call ``message`` names resolves on ``held`` (name -> object the user holds)."""
    calls = named_calls(message)
    assert calls, f"the message names no call: {message}"
    for call in calls:
        owner, *path = call.split(".")
        assert owner in held, f"{call!r} names an object the user does not hold: {message}"
        target = held[owner]
        for name in path:
            assert hasattr(target, name), f"{call!r} does not exist here: {message}"
            target = getattr(target, name)
        assert callable(target), call


def pending_window(entry: str):
    """A model with a partial window pending (1 micro-batch of K), by entry point; returns
    ``(held objects, the model, a function that trains one more micro-batch)``."""
    x, y = make_data(n=MICRO)
    if entry == "AccumTrainer":
        model = small_mlp()
        trainer = ac.AccumTrainer(model, keras.optimizers.SGD(0.1), LOSS, accum_steps=K)
        trainer.train_micro_batch(x, y)
        held = {"accumcore": ac, "model": model, "trainer": trainer, "state": trainer.state}
        return held, model, lambda: trainer.train_micro_batch(x, y)
    if entry == "AccumModel":
        model = small_mlp(model_cls=ac.AccumModel, accum_steps=K, end_of_epoch="carry")
    else:
        model = ac.accumulate(small_mlp(), K, end_of_epoch="carry")
    model.compile(keras.optimizers.SGD(0.1), LOSS)
    model.fit(x, y, batch_size=MICRO, epochs=1, verbose=0)
    held = {"accumcore": ac, "model": model, "state": model.accumulation}
    return held, model, lambda: model.fit(x, y, batch_size=MICRO, epochs=1, verbose=0)


@pytest.mark.parametrize("entry", ENTRIES)
def test_freezing_with_a_pending_window_names_a_call_that_exists(entry):
    held, model, train_more = pending_window(entry)
    assert held["state"].pending_micro_batches() == 1
    model.layers[-1].trainable = False
    if entry != "AccumTrainer":
        model.compile(keras.optimizers.SGD(0.1), LOSS)  # the next fit follows the new set
    with pytest.raises(ValueError, match="pending") as info:
        train_more()
    assert_calls_exist(str(info.value), held)
    expected = "trainer.flush" if entry == "AccumTrainer" else "accumcore.flush"
    assert expected in named_calls(str(info.value))


@pytest.mark.parametrize("entry", ENTRIES[:2])
def test_freezing_everything_with_a_pending_window_names_a_call_that_exists(entry):
    held, model, train_more = pending_window(entry)
    model.trainable = False
    model.compile(keras.optimizers.SGD(0.1), LOSS)
    with pytest.raises(ValueError, match="no trainable variables") as info:
        train_more()
    assert_calls_exist(str(info.value), held)


@pytest.mark.parametrize("entry", ENTRIES[:2])
def test_changing_settings_with_a_pending_window_names_a_call_that_exists(entry):
    held, model, _ = pending_window(entry)
    with pytest.raises(ValueError, match="pending") as info:
        ac.accumulate(model, 2)
    assert_calls_exist(str(info.value), held)
    if entry == "AccumModel":
        with pytest.raises(ValueError, match="pending") as info:
            model.set_accumulation(accum_steps=2)
        assert_calls_exist(str(info.value), held)
    ac.flush(model)  # the call named: it applies the window, and the change goes through
    ac.accumulate(model, 2)
    assert model.accumulation.accum_steps == 2


@pytest.mark.parametrize("entry", ENTRIES[:2])
def test_recompiling_another_reduction_with_a_pending_window_names_a_call_that_exists(entry):
    held, model, train_more = pending_window(entry)
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(reduction="sum"))
    with pytest.raises(ValueError, match="normaliser") as info:
        train_more()
    assert_calls_exist(str(info.value), held)


def test_window_step_on_a_pending_window_names_a_call_that_exists():
    held, _, _ = pending_window("AccumTrainer")
    x, y = make_data(n=16)
    with pytest.raises(ValueError, match="empty window") as info:
        held["trainer"].window_step(x, y)
    assert_calls_exist(str(info.value), held)


@pytest.mark.parametrize("entry", ENTRIES[:2])
def test_frozen_model_warning_names_the_model_class_it_is(entry):
    """The warning for a model with nothing to train names the user's class (a plain
    ``Functional`` for an ``accumulate`` d model), not "AccumModel"."""
    x, y = make_data(n=MICRO)
    model = (small_mlp(model_cls=ac.AccumModel, accum_steps=K) if entry == "AccumModel"
             else ac.accumulate(small_mlp(), K))
    model.trainable = False
    model.compile(keras.optimizers.SGD(0.1), LOSS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=MICRO, epochs=1, verbose=0)
    messages = [str(w.message) for w in caught if "no trainable variables" in str(w.message)]
    assert messages and messages[0].startswith(type(model).__name__)


def test_the_call_checker_can_fail():
    """The checker itself: a call the held object lacks is caught."""
    model = ac.accumulate(small_mlp(), K)
    with pytest.raises(AssertionError, match="does not exist"):
        assert_calls_exist("call `model.flush()` first", {"model": model})
    assert_calls_exist("call `accumcore.flush(model)` first", {"accumcore": ac})
