"""The intro's own ``train_step`` (book/intro.md, "Your own train_step") is exact and safe.

The code block that follows the ``(train-step-answer)=`` label of book/intro.md is run as the
reader would copy it: its class as written, and its ``fit`` call's ``callbacks=[...]`` as
written (evaluated with the test's ``model``; the usage lines name the reader's own ``inputs``,
``x`` and ``y``). A small model trained with it through ``fit(batch_size=16)`` must end at the
weights of a plain ``keras.Model`` trained with ``fit(batch_size=64)`` from the same initial
weights, the partial last window of each epoch included, with Adam (whose update depends on its
step count, so an optimizer stepped per micro-batch fails) and with SGD, without and with sample
or class weights (Keras's mean loss divides by the samples either way); and at the weights of
``fit`` after ``accumcore.accumulate(model, accum_steps=4)``.

A NaN in the data must stop it with the error ``fit`` after ``accumulate`` raises (same type,
same message: the same window, micro-batches and variable), in both modes: the intro's
``accum_steps`` form (each batch a micro-batch) against ``accumulate(accum_steps=4)`` at b = 16,
and a ``train_step`` that splits each batch of B = 64 by hand into micro-batches of 16 against
``accumulate(micro_batch_size=16)`` at B = 64; for a Dense and an Embedding model.

Tolerance: the two runs sum the same per-sample gradients in a different order, in float32
(eps = 1.2e-7); measured about 1e-6 of the largest weight change over 8 updates. ``1e-4``
leaves room for other CPUs and versions; the bugs this guards against (no division by the
window's weight, an update per micro-batch, the partial window lost) are off by 1e-1 or more
(the test checks that a broken copy fails).
"""

from __future__ import annotations

import re
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import accumcore

INTRO = Path(__file__).resolve().parents[1] / "book" / "intro.md"
TOLERANCE = 1e-4


def intro_code() -> str:
    """The intro's whole ``train_step`` block."""
    text = INTRO.read_text()
    after = text[text.index("(train-step-answer)="):]
    code = re.search(r"```python\n(.*?)```", after, re.S).group(1)
    assert "def train_step" in code and "accumulation.step(" in code
    return code


def intro_block() -> str:
    """The intro's ``train_step`` block, without its usage lines (from ``model = ``)."""
    code = intro_code()
    return code[:code.index("\nmodel = ")]


def intro_callbacks() -> str:
    """The ``callbacks=[...]`` list of the intro's ``fit`` call, as source."""
    usage = intro_code()[len(intro_block()):]
    return re.search(r"callbacks=(\[.*?\])\)", usage, re.S).group(1)


def build(cls, kind: str = "dense", loss_kind: str = "classes", **kwargs) -> keras.Model:
    """A seeded functional model of ``cls``: ``"dense"`` (20 floats in) or ``"embedding"``
    (6 tokens of 50 in); 5 softmax outputs (``"classes"``) or 1 linear (``"regression"``).
    Layers are named, so two models' variables have the same paths (error messages)."""
    keras.utils.set_random_seed(0)
    if kind == "dense":
        inputs = keras.Input((20,))
        hidden = keras.layers.Dense(32, activation="relu", name="hidden")(inputs)
    else:
        inputs = keras.Input((6,), dtype="int32")
        tokens = keras.layers.Embedding(50, 8, name="embed")(inputs)
        hidden = keras.layers.GlobalAveragePooling1D(name="pool")(tokens)
    head = (keras.layers.Dense(5, activation="softmax", name="out") if loss_kind == "classes"
            else keras.layers.Dense(1, name="out"))
    return cls(inputs, head(hidden), **kwargs)


def data(kind: str, n_samples: int, loss_kind: str = "classes") -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(n_samples, 20)).astype("float32") if kind == "dense"
         else rng.integers(0, 50, (n_samples, 6)).astype("int32"))
    y = (rng.integers(0, 5, n_samples).astype("int32") if loss_kind == "classes"
         else rng.normal(size=(n_samples, 1)).astype("float32"))
    return x, y


def gap(weights: list, reference: list, initial: list) -> float:
    """max|w - w_ref| / max|w_ref - w_0| (dimensionless)."""
    diff = max(np.abs(a - b).max() for a, b in zip(weights, reference, strict=True))
    change = max(np.abs(a - b).max() for a, b in zip(reference, initial, strict=True))
    return float(diff / change)


def train(code: str, callbacks: str, optimizer, n_samples: int, epochs: int = 2,
          kind: str = "dense", **fit_kwargs) -> dict:
    """For ``code``'s model at 4 x 16 (``callbacks``: the ``fit`` call's list, as source)
    against a plain model at 64, both ``fit`` calls given ``fit_kwargs`` (e.g.
    ``sample_weight``): ``rel`` (largest weight difference / largest weight change of the
    reference), the optimizer's ``iterations``, both runs' logged ``losses`` (per epoch) and
    the final ``weights``."""
    namespace: dict = {}
    exec(compile(code, str(INTRO), "exec"), namespace)
    x, y = data(kind, n_samples)
    model = build(namespace["AccumulatingModel"], kind, accum_steps=4)
    reference = build(keras.Model, kind)
    initial = model.get_weights()
    reference.set_weights(initial)
    model.compile(optimizer(), "sparse_categorical_crossentropy")
    reference.compile(optimizer(), "sparse_categorical_crossentropy")
    history = model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=eval(callbacks, {**namespace, "model": model}), **fit_kwargs)
    plain = reference.fit(x, y, batch_size=64, epochs=epochs, shuffle=False, verbose=0,
                          **fit_kwargs)
    assert int(reference.optimizer.iterations) == epochs * -(-n_samples // 64)
    return {"rel": gap(model.get_weights(), reference.get_weights(), initial),
            "iterations": int(model.optimizer.iterations),
            "losses": (history.history["loss"], plain.history["loss"]),
            "weights": model.get_weights(), "initial": initial}


ADAM = lambda: keras.optimizers.Adam(1e-2)  # noqa: E731
SGD_MOMENTUM = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731


# Not Embedding + Adam against plain fit: for Embedding gradients (IndexedSlices) Keras's own
# large-batch Adam step is not the dense update (tests/test_equivalence.py,
# test_sparse_embedding_gradients_get_the_dense_update); the flush test below compares that
# case with fit after accumulate instead.
@pytest.mark.parametrize("kind, optimizer", [("dense", ADAM), ("dense", SGD_MOMENTUM),
                                             ("embedding", SGD_MOMENTUM)],
                         ids=["dense-adam", "dense-sgd-momentum", "embedding-sgd-momentum"])
@pytest.mark.parametrize("n_samples", [3 * 64, 3 * 64 + 40], ids=["full", "partial"])
def test_the_intro_train_step_matches_fit_at_64(optimizer, n_samples, kind):
    run = train(intro_block(), intro_callbacks(), optimizer, n_samples, kind=kind)
    assert run["iterations"] == 2 * -(-n_samples // 64)  # one per window, the partial included
    assert run["rel"] <= TOLERANCE
    # the logged loss is the mean over the epoch's samples, each at its window's weights, as
    # at 64: the same numbers to float32 round-off
    mine, plain = run["losses"]
    assert mine == pytest.approx(plain, rel=1e-5)


@pytest.mark.parametrize("kind", ["dense", "embedding"])
@pytest.mark.parametrize("weights", ["sample_weight", "class_weight"])
def test_the_intro_train_step_matches_fit_at_64_with_weights(weights, kind):
    """Keras's default mean loss divides the weighted sum by the batch's samples, not by the
    weights' sum: c_i = samples stays exact with sample or class weights, the partial window
    included; the weights change the result (the runs are not the unweighted ones)."""
    n_samples = 3 * 64 + 40
    given = ({"sample_weight": np.random.default_rng(1).uniform(0.2, 3.0, n_samples)}
             if weights == "sample_weight" else {"class_weight": {0: 0.2, 1: 3.0, 2: 1.0,
                                                                  3: 0.5, 4: 2.0}})
    run = train(intro_block(), intro_callbacks(), SGD_MOMENTUM, n_samples, kind=kind, **given)
    unweighted = train(intro_block(), intro_callbacks(), SGD_MOMENTUM, n_samples, kind=kind)
    assert run["iterations"] == 2 * 4
    assert run["rel"] <= TOLERANCE
    assert gap(run["weights"], unweighted["weights"], run["initial"]) > 1e-2
    mine, plain = run["losses"]
    assert mine == pytest.approx(plain, rel=1e-5)


@pytest.mark.parametrize("kind", ["dense", "embedding"])
def test_the_intro_callback_flushes_as_fit_after_accumulate_does(kind):
    """Each epoch's partial window (40 samples: 3 micro-batches) is applied at the epoch's end,
    with its true weight, exactly as ``fit`` after ``accumulate(accum_steps=4)`` applies it."""
    n_samples = 3 * 64 + 40
    run = train(intro_block(), intro_callbacks(), lambda: keras.optimizers.Adam(1e-2),
                n_samples, kind=kind)
    x, y = data(kind, n_samples)
    model = build(keras.Model, kind)
    model.set_weights(run["initial"])
    accumcore.accumulate(model, accum_steps=4)
    model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == run["iterations"] == 2 * 4
    assert model.accumulation.pending_micro_batches() == 0
    assert gap(run["weights"], model.get_weights(), run["initial"]) <= TOLERANCE


@pytest.mark.parametrize("broken", [
    ("summed_loss = c * loss", "summed_loss = loss"),  # micro-batch means summed: K x the step
    ("callbacks", "[]"),  # no callback: the partial window carried, not applied
])
def test_a_broken_copy_fails(broken):
    old, new = broken
    code, callbacks = intro_block(), intro_callbacks()
    if old == "callbacks":
        callbacks = new
    else:
        assert old in code
        code = code.replace(old, new)
    run = train(code, callbacks, lambda: keras.optimizers.SGD(0.1), 3 * 64 + 40)
    assert run["rel"] > 1e-2


class SplittingModel(keras.Model):
    """A hand-written ``train_step`` in the ``micro_batch_size`` form: ``fit(batch_size=B)``,
    each batch split by hand into micro-batches of ``micro_batch_size`` samples (the last may
    be smaller), accumulated into an :class:`accumcore.AccumulationState` and applied once."""

    def __init__(self, *args, micro_batch_size=16, **kwargs):
        super().__init__(*args, **kwargs)
        self.micro_batch_size = micro_batch_size
        self.accumulation = accumcore.AccumulationState(4)

    def train_step(self, data):
        x, y = data
        self.accumulation.build(self.trainable_variables)
        b = self.micro_batch_size

        def micro_batch(start):
            xi, yi = x[start:start + b], y[start:start + b]
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=xi, y=yi, y_pred=self(xi, training=True))
                c = tf.cast(tf.shape(xi)[0], tf.float32)
                summed_loss = c * loss
            grads = tape.gradient(summed_loss, self.trainable_variables)
            self.accumulation.accumulate(grads, c, tf.shape(xi)[0], self.optimizer)
            return start + b

        tf.while_loop(lambda start: start < tf.shape(x)[0], micro_batch, [tf.constant(0)])
        self.accumulation.apply_window(self.optimizer, self.trainable_variables)
        return {"samples": tf.shape(x)[0]}


def nan_run(model: keras.Model, x, y, batch_size: int, callbacks=()) -> BaseException:
    """The error ``fit`` raises for the data (which holds a NaN), at epoch 1 of 2."""
    model.compile(keras.optimizers.SGD(0.1), "mse")
    with pytest.raises(accumcore.NonFiniteGradientError) as caught:
        model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0,
                  callbacks=list(callbacks))
    return caught.value


@pytest.mark.parametrize("kind", ["dense", "embedding"])
@pytest.mark.parametrize("mode", ["accum_steps", "micro_batch_size"])
def test_a_nan_in_the_data_stops_the_hand_written_train_step_as_fit(mode, kind):
    """Sample 70 is NaN (window 1 of the first epoch: micro-batch 4 of the run); without the
    callback the hand-written step trains on silently, frozen."""
    x, y = data(kind, 3 * 64 + 40, "regression")
    y[70] = np.nan
    if mode == "accum_steps":
        namespace: dict = {}
        exec(compile(intro_block(), str(INTRO), "exec"), namespace)
        make = lambda: build(namespace["AccumulatingModel"], kind, "regression",  # noqa: E731
                             accum_steps=4)
        batch_size, given = 16, {"accum_steps": 4}
    else:
        make = lambda: build(SplittingModel, kind, "regression")  # noqa: E731
        batch_size, given = 64, {"micro_batch_size": 16}

    model = make()
    callbacks = eval(intro_callbacks(), {"accumcore": accumcore, "model": model})
    mine = nan_run(model, x, y, batch_size, callbacks)
    reference = accumcore.accumulate(build(keras.Model, kind, "regression"), **given)
    expected = nan_run(reference, x, y, batch_size)
    assert type(mine) is type(expected)
    assert str(mine) == str(expected)
    assert (mine.window, mine.first_micro_step, mine.epoch) == (1, 4, 0)
    assert all(np.isfinite(w).all() for w in model.get_weights())

    silent = make()  # the same step without the callback: no error, no update after window 1
    silent.compile(keras.optimizers.SGD(0.1), "mse")
    silent.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    assert int(silent.accumulation.windows_applied.numpy()) == 1


def test_the_callback_without_a_state_names_the_fix():
    x, y = data("dense", 32)
    model = build(keras.Model)
    model.compile("sgd", "sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match=r"accumcore.WindowFlushCallback\(state\)"):
        model.fit(x, y, batch_size=16, verbose=0, callbacks=[accumcore.WindowFlushCallback()])
    with pytest.raises(TypeError, match="`state` must be an accumcore.AccumulationState"):
        accumcore.WindowFlushCallback(model)


def test_chapter_3_runs_the_intro_code_as_printed():
    """Chapter 3's section "The introduction's own train_step, run" executes the intro's block
    as printed (the same text, usage lines included), so the page's numbers are this code's."""
    import json

    notebook = INTRO.parent / "03_model_fit.ipynb"
    cells = json.loads(notebook.read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    assert intro_code().rstrip("\n") in sources
