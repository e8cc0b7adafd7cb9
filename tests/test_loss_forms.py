"""Every loss Keras trains, exact or named (issue 39): ``add_loss`` in each form Keras sums,
losses that take their own mean, and compile objects that do not serialise.

The guard is one matrix: each case below is trained by every entry point (``accumulate``
after and before ``compile``, ``AccumModel``, ``AccumTrainer`` in each loop mode) on 24
samples in micro-batches of 4 with K = 4 (a full window of 16, then a partial one of 8) and,
for ``accumulate`` and ``AccumModel``, also with ``micro_batch_size=4`` at ``fit(batch_size=16)``
(the ``*_split`` entries: the same windows, each batch split in the step), and
compared with plain ``keras.Model.fit`` at B = 16 from the same initial weights, with the
same compile arguments. The tolerance is ``helpers.REL_TOL`` (1e-4; float32 round-off of the
re-associated sums is ~1e-7..1e-6 with SGD, see its justification); every bug these cases
guard against is 1e-2 or more (a per-sample ``add_loss`` divided by the window: 0.75 to 0.9).

Beside it: the forms :class:`~accumcore._impl.denominators.SampleGraph` reads (unit tests that
can tell each form apart), the warnings where one weight per micro-batch cannot be exact, and
a summed compiled loss with weight regularisers (counted once per update).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import REL_TOL, assert_matches_reference
from keras import ops

import accumcore as ac
from accumcore._impl.denominators import PROBE_BATCH, SampleGraph
from accumcore.lab.experiments import get_weights, relative_error

N, MICRO, K = 24, 4, 4  # windows of 16 and 8 samples: the last one partial
LR = 0.1


# ---------------------------------------------------------------------------- models
class SquaredErrorEndpoint(keras.layers.Layer):
    """An "endpoint layer" (as Keras's CTC examples write it): adds the per-sample squared
    error of its two inputs with ``add_loss``, in the ``form`` given, and returns the
    prediction."""

    def __init__(self, form: str = "per_sample", **kwargs) -> None:
        super().__init__(**kwargs)
        self.form = form

    def call(self, y_true, y_pred):
        error = ops.square(y_true - y_pred)  # (batch, 1): Keras sums every entry
        self.add_loss({"per_sample": error, "sum": ops.sum(error), "mean": ops.mean(error),
                       "max": ops.max(error)}[self.form])
        return y_pred


def endpoint_model(form: str = "per_sample", regularized: bool = False,
                   model_cls: Callable = keras.Model, **kwargs) -> keras.Model:
    """Inputs (features, target); the loss is the endpoint's ``add_loss`` only (compile
    without a loss); ``regularized`` adds kernel and bias regularisers."""
    keras.utils.set_random_seed(0)
    x = keras.Input((8,))
    target = keras.Input((1,))
    h = keras.layers.Dense(
        16, activation="tanh", kernel_regularizer="l2" if regularized else None,
        bias_regularizer=keras.regularizers.L2(0.05) if regularized else None)(x)
    prediction = keras.layers.Dense(1)(h)
    return model_cls([x, target], SquaredErrorEndpoint(form)(target, prediction), **kwargs)


def regression_mlp(model_cls: Callable = keras.Model, activity: bool = False,
                   **kwargs) -> keras.Model:
    """8 -> 16 (tanh) -> 1; ``activity``: an L2 activity regulariser on the hidden layer."""
    keras.utils.set_random_seed(0)
    x = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", activity_regularizer=(
        keras.regularizers.L2(0.1) if activity else None))(x)
    return model_cls(x, keras.layers.Dense(1)(h), **kwargs)


class _AddsLossInCall:
    """A subclassed model that adds a scalar loss of its hidden activations in ``call``: a
    mean or a sum over the micro-batch."""

    def __init__(self, form: str = "mean", **kwargs) -> None:
        super().__init__(**kwargs)
        self.form = form
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        h = self.hidden(x)
        penalty = ops.square(h)
        self.add_loss(0.01 * (ops.sum(penalty) if self.form == "sum" else ops.mean(penalty)))
        return self.out(h)


class AddsLossInCall(_AddsLossInCall, keras.Model):
    pass


class AccumAddsLossInCall(_AddsLossInCall, ac.AccumModel):
    pass


def adds_loss_in_call(form: str, model_cls: Callable = keras.Model, **kwargs) -> keras.Model:
    keras.utils.set_random_seed(0)
    cls = AccumAddsLossInCall if model_cls is ac.AccumModel else AddsLossInCall
    model = cls(form=form, **kwargs)
    model(np.zeros((1, 8), "float32"))
    return model


VOCAB, LENGTH = 10, 8


def tagger(model_cls: Callable = keras.Model, **kwargs) -> keras.Model:
    """Embedding -> Dense -> Dense(VOCAB) per token; its output carries no Keras mask."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Dense(16, activation="tanh")(keras.layers.Embedding(VOCAB, 8)(tokens))
    return model_cls(tokens, keras.layers.Dense(VOCAB)(h), **kwargs)


# ---------------------------------------------------------------------------- compile objects
class TokenMeanLoss(keras.losses.Loss):
    """Cross-entropy averaged over the tokens whose label is not 0, by its own count: one
    number per batch (``call`` returns a scalar), as token-tagging examples write it. Not
    registered for serialisation."""

    def call(self, y_true, y_pred):
        mask = ops.cast(y_true > 0, "float32")
        per_token = keras.losses.sparse_categorical_crossentropy(y_true, y_pred,
                                                                 from_logits=True)
        return ops.sum(per_token * mask) / ops.sum(mask)


def token_count(x, y, sample_weight):
    """What :class:`TokenMeanLoss` divides by: the labels that are not 0."""
    return tf.reduce_sum(tf.cast(y > 0, tf.float32))


class UnregisteredMSE(keras.losses.Loss):
    """A ``Loss`` subclass without ``register_keras_serializable``."""

    def call(self, y_true, y_pred):
        return ops.mean(ops.square(y_true - y_pred), axis=-1)


class WarmupWithoutConfig(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule without ``get_config``."""

    def __call__(self, step):
        return LR * ops.minimum(1.0, (ops.cast(step, "float32") + 1.0) / 2.0)


def scalar_mean_squared_error(y_true, y_pred):
    """A loss function that returns one number per batch, its mean over samples: Keras does
    not reduce it, accumcore reads it as a mean over samples."""
    return ops.mean(ops.square(y_true - y_pred))


def mean_absolute_error_metric(y_true, y_pred):
    """A plain function as a metric."""
    return ops.mean(ops.abs(y_true - y_pred))


# ---------------------------------------------------------------------------- data
def regression_data(n: int = N) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return (rng.normal(size=(n, 8)).astype("float32"),
            rng.normal(size=(n, 1)).astype("float32"))


def token_data() -> tuple[np.ndarray, np.ndarray]:
    """24 sequences of 8 tokens; the 6 micro-batches of 4 hold 4, 24, 8, 20, 12 and 28 tokens
    with a label (not 0): a token mean and a sample mean weigh them differently."""
    rng = np.random.default_rng(0)
    xs, ys = [], []
    for valid in (4, 24, 8, 20, 12, 28):
        labelled = np.zeros(MICRO * LENGTH, bool)
        labelled[rng.choice(MICRO * LENGTH, valid, replace=False)] = True
        y = np.zeros(MICRO * LENGTH, "int32")
        y[labelled] = rng.integers(1, VOCAB, size=valid)
        xs.append(rng.integers(1, VOCAB, size=(MICRO, LENGTH)).astype("int32"))
        ys.append(y.reshape(MICRO, LENGTH))
    return np.concatenate(xs), np.concatenate(ys)


# ---------------------------------------------------------------------------- the cases
def sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(LR)


class Case(NamedTuple):
    """One program: its model (``make(model_cls, **kwargs)``), its compile arguments (fresh
    objects per call), its data (``x``, ``y``: ``y`` None where the targets are an input)."""

    make: Callable[..., keras.Model]
    compile: Callable[[], dict]
    data: Callable[[], tuple]
    fit_only: bool = False  # metrics: AccumTrainer has none
    normalizer: Callable | None = None


def _endpoint_data() -> tuple:
    x, y = regression_data()
    return [x, y], None


def _endpoint_data_with_targets() -> tuple:
    """The endpoint's inputs, and the targets again for a compiled loss beside it."""
    x, y = regression_data()
    return [x, y], y


CASES = {
    "add_loss_per_sample": Case(lambda cls=keras.Model, **kw: endpoint_model(
        "per_sample", model_cls=cls, **kw), lambda: dict(optimizer=sgd()), _endpoint_data),
    "add_loss_per_sample_regularized": Case(lambda cls=keras.Model, **kw: endpoint_model(
        "per_sample", regularized=True, model_cls=cls, **kw), lambda: dict(optimizer=sgd()),
        _endpoint_data),
    # a per-sample add_loss (Keras sums it) beside a compiled mean loss: the sum enters the
    # window undivided (a second backward pass per micro-batch), also in the partial window
    "add_loss_per_sample_beside_mean": Case(lambda cls=keras.Model, **kw: endpoint_model(
        "per_sample", model_cls=cls, **kw), lambda: dict(optimizer=sgd(), loss="mse"),
        _endpoint_data_with_targets),
    "add_loss_per_sample_regularized_beside_mean": Case(
        lambda cls=keras.Model, **kw: endpoint_model(
            "per_sample", regularized=True, model_cls=cls, **kw),
        lambda: dict(optimizer=sgd(), loss="mse"), _endpoint_data_with_targets),
    "add_loss_scalar_sum": Case(lambda cls=keras.Model, **kw: endpoint_model(
        "sum", model_cls=cls, **kw), lambda: dict(optimizer=sgd()), _endpoint_data),
    "add_loss_scalar_mean_in_call": Case(
        lambda cls=keras.Model, **kw: adds_loss_in_call("mean", cls, **kw),
        lambda: dict(optimizer=sgd(), loss="mse"), regression_data),
    "add_loss_scalar_sum_in_call_beside_mean": Case(
        lambda cls=keras.Model, **kw: adds_loss_in_call("sum", cls, **kw),
        lambda: dict(optimizer=sgd(), loss="mse"), regression_data),
    "activity_regularizer": Case(
        lambda cls=keras.Model, **kw: regression_mlp(cls, activity=True, **kw),
        lambda: dict(optimizer=sgd(), loss="mse"), regression_data),
    "token_mean_loss_with_normalizer": Case(
        lambda cls=keras.Model, **kw: tagger(cls, **kw),
        lambda: dict(optimizer=sgd(), loss=TokenMeanLoss()), token_data,
        normalizer=token_count),
    "scalar_mean_function_loss": Case(
        lambda cls=keras.Model, **kw: regression_mlp(cls, **kw),
        lambda: dict(optimizer=sgd(), loss=scalar_mean_squared_error), regression_data),
    "unregistered_loss": Case(lambda cls=keras.Model, **kw: regression_mlp(cls, **kw),
                              lambda: dict(optimizer=sgd(), loss=UnregisteredMSE()),
                              regression_data),
    "schedule_without_get_config": Case(
        lambda cls=keras.Model, **kw: regression_mlp(cls, **kw),
        lambda: dict(optimizer=keras.optimizers.SGD(WarmupWithoutConfig()), loss="mse"),
        regression_data),
    "function_metric": Case(
        lambda cls=keras.Model, **kw: regression_mlp(cls, **kw),
        lambda: dict(optimizer=sgd(), loss="mse", metrics=[mean_absolute_error_metric]),
        regression_data, fit_only=True),
}


ENTRY_POINTS = ("accumulate", "accumulate_before_compile", "AccumModel", "trainer_eager",
                "trainer_function", "trainer_graph", "trainer_window_step",
                "accumulate_split", "accumulate_before_compile_split", "AccumModel_split")
#: ``*_split``: ``micro_batch_size=b`` and ``fit(batch_size=K * b)`` (the batch split in the
#: step); the others ``accum_steps=K`` and ``fit(batch_size=b)``.


def plain_fit(case: Case) -> tuple[list, list]:
    """Plain ``keras.Model.fit`` at B = K * b, in order: (initial weights, final weights)."""
    x, y = case.data()
    model = case.make()
    initial = get_weights(model)
    model.compile(**case.compile())
    model.fit(x, y, batch_size=K * MICRO, shuffle=False, verbose=0)
    return initial, get_weights(model)


def accumulated(case: Case, entry: str, normalizer: Callable | None = None) -> keras.Model:
    """The case trained by one entry point at micro-batch b (the model returned)."""
    x, y = case.data()
    settings = {} if normalizer is None else {"normalizer": normalizer}
    if entry.startswith("trainer_"):
        arguments = case.compile()
        model = case.make()
        trainer = ac.AccumTrainer(model, arguments["optimizer"], arguments.get("loss"),
                                  accum_steps=K, **settings)
        if entry == "trainer_window_step":  # each window's samples, split in the graph
            for start in range(0, N, K * MICRO):
                window = slice(start, start + K * MICRO)
                trainer.window_step(tf.nest.map_structure(lambda a, w=window: a[w], x),
                                    None if y is None else y[window])
            return model
        inputs = tuple(x) if isinstance(x, list) else x  # several inputs: one structure
        parts = (inputs,) if y is None else (inputs, y)
        trainer.fit(tf.data.Dataset.from_tensor_slices(parts).batch(MICRO),
                    mode=entry.removeprefix("trainer_"), verbose=0)
        return model
    split = entry.endswith("_split")
    settings.update(dict(micro_batch_size=MICRO) if split else dict(accum_steps=K))
    entry = entry.removesuffix("_split")
    if entry == "AccumModel":
        model = case.make(ac.AccumModel, **settings)
        model.compile(**case.compile())
    elif entry == "accumulate":
        model = case.make()
        model.compile(**case.compile())
        ac.accumulate(model, **settings)
    else:
        model = ac.accumulate(case.make(), **settings)
        model.compile(**case.compile())
    model.fit(x, y, batch_size=K * MICRO if split else MICRO, shuffle=False, verbose=0)
    return model


_REFERENCES: dict[str, tuple] = {}


def reference(name: str) -> tuple[list, list]:
    if name not in _REFERENCES:
        _REFERENCES[name] = plain_fit(CASES[name])
    return _REFERENCES[name]


def _matrix() -> list:
    return [pytest.param(name, entry, id=f"{name}-{entry}") for name in CASES
            for entry in ENTRY_POINTS]


@pytest.mark.parametrize(("name", "entry"), _matrix())
def test_every_entry_point_matches_plain_fit_at_the_large_batch(name, entry):
    case = CASES[name]
    if case.fit_only and entry.startswith("trainer_"):
        pytest.skip("AccumTrainer takes no metrics")
    initial, expected = reference(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # exact, so silent
        model = accumulated(case, entry, case.normalizer)
    assert_matches_reference(model, initial, expected)


@pytest.mark.parametrize("entry", ("accumulate", "AccumModel", "trainer_function",
                                   "trainer_eager", "accumulate_split", "AccumModel_split"))
def test_a_loss_that_averages_by_its_own_count_is_named_then_exact_with_normalizer(entry):
    """Item 2: without ``normalizer`` the token mean is weighed by samples (0.1 to 0.5 off
    here) with one warning naming ``normalizer=``; with it, the case above is exact."""
    name = "token_mean_loss_with_normalizer"
    initial, expected = reference(name)
    with pytest.warns(UserWarning, match=r"token_mean_loss.*normalizer=lambda x, y, "
                                         r"sample_weight: tf\.reduce_sum") as caught:
        model = accumulated(CASES[name], entry)
    assert sum("token_mean_loss" in str(w.message) for w in caught) == 1  # once per loss
    # the count's example names the label convention: 0 can be padding or a class
    text = next(str(w.message) for w in caught if "token_mean_loss" in str(w.message))
    assert "tf.not_equal(y, IGNORE)" in text and "-1 where -1 is ignored and 0 is a class" in text
    assert relative_error(get_weights(model), expected, initial) > 0.05


# ---------------------------------------------------------------- sums beside a mean loss
BESIDE_MEAN = "add_loss_per_sample_beside_mean"


def test_a_sum_beside_a_mean_loss_takes_undivided_accumulators_only_where_needed():
    """The per-sample ``add_loss`` beside ``mse`` gets a second set of accumulators (what makes
    it exact in the matrix above, partial window included); a model without one gets none:
    no extra memory, and its saved state keeps its format."""
    with_sum = accumulated(CASES[BESIDE_MEAN], "accumulate")
    without = accumulated(CASES["scalar_mean_function_loss"], "accumulate")
    state = with_sum.accumulation
    assert len(state.undivided_accumulators) == len(state.accumulators) > 0
    assert without.accumulation.undivided_accumulators == []
    assert len(without.accumulation.variables_for_saving()) == (
        len(state.variables_for_saving()) - len(state.accumulators))


@pytest.mark.parametrize("jit_compile", (False, True))
def test_a_sum_beside_a_mean_loss_is_exact_with_ragged_micro_batches(jit_compile):
    """``micro_batch_size=6`` at B = 16 (6 + 6 + 4, the last batch 6 + 2): micro-batches of
    unequal sizes, where weighing the sum by ``K c_i`` was 0.8 off."""
    case = CASES[BESIDE_MEAN]
    x, y = case.data()
    ref = case.make()
    initial = get_weights(ref)
    ref.compile(**case.compile())
    ref.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    model = ac.accumulate(case.make(), micro_batch_size=6)
    model.compile(**case.compile(), jit_compile=jit_compile)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert_matches_reference(model, initial, get_weights(ref))


def test_a_sum_beside_a_mean_loss_is_exact_under_loss_scaling():
    """``mixed_float16`` with a ``LossScaleOptimizer``: the mean part's gradients are weighed
    after the backward pass, the sum's are not; both are unscaled once per window. Against
    plain ``fit`` at B under the same policy, within ``tests/test_mixed_precision.py``'s
    float16 tolerance (2e-3: 16-bit rounding over other batch compositions)."""

    def make():
        keras.utils.set_random_seed(0)
        x = keras.Input((8,))
        target = keras.Input((1,))
        h = keras.layers.Dense(16, activation="tanh", dtype="mixed_float16")(x)
        prediction = keras.layers.Dense(1, dtype="float32")(h)
        return keras.Model([x, target], SquaredErrorEndpoint("per_sample")(target, prediction))

    x, y = _endpoint_data_with_targets()
    ref = make()
    initial = get_weights(ref)
    ref.compile(keras.optimizers.LossScaleOptimizer(sgd(), initial_scale=8.0), loss="mse")
    ref.fit(x, y, batch_size=K * MICRO, shuffle=False, verbose=0)
    model = make()
    model.compile(keras.optimizers.LossScaleOptimizer(sgd(), initial_scale=8.0), loss="mse")
    ac.accumulate(model, K)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert model.accumulation.undivided_accumulators
    assert_matches_reference(model, initial, get_weights(ref), tol=2e-3)


def test_a_window_with_a_sum_beside_a_mean_resumes_from_a_weights_file(tmp_path):
    """Saved mid-window (K = 4, 6 micro-batches of 4: 2 pending), loaded into a fresh model,
    both finish the epoch's data the same: the undivided sums are in the file."""
    case = CASES[BESIDE_MEAN]
    x, y = case.data()

    def make():
        model = ac.accumulate(case.make(), K, end_of_epoch="carry")
        model.compile(**case.compile())
        return model

    model = make()
    model.fit([a[:MICRO * 6] for a in x], y[:MICRO * 6], batch_size=MICRO, shuffle=False,
              verbose=0)
    assert int(model.accumulation.micro_step.numpy()) == 2
    assert model.accumulation.undivided_accumulators[0].numpy().any()
    path = str(tmp_path / "mid.weights.h5")
    model.save_weights(path)
    resumed = make()
    resumed.load_weights(path)
    for a, b in zip(resumed.accumulation.variables_for_saving(),
                    model.accumulation.variables_for_saving(), strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for m in (model, resumed):
        m.fit([a[:MICRO * 2] for a in x], y[:MICRO * 2], batch_size=MICRO, shuffle=False,
              verbose=0)
    for a, b in zip(get_weights(resumed), get_weights(model), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", ("eager", "function"))
def test_a_term_that_is_not_a_sum_or_mean_over_samples_is_named_once(mode):
    """``add_loss(ops.max(...))``: the large batch's maximum cannot be recovered from the
    micro-batches' maxima. One warning (per term and model, eager micro-batches included)
    names it, what it is, and what makes it exact."""
    x, y = regression_data()
    trainer = ac.AccumTrainer(endpoint_model("max"), sgd(), None, accum_steps=K)
    with pytest.warns(UserWarning, match=r"model\.losses\[0\].*neither a sum nor a mean over "
                                         r"samples \(here: computed by a Max op\)") as caught:
        trainer.fit(tf.data.Dataset.from_tensor_slices(((x, y),)).batch(MICRO), mode=mode,
                    verbose=0)
    assert sum("model.losses[0]" in str(w.message) for w in caught) == 1


def test_a_summed_compiled_loss_counts_weight_regularizers_once_per_update():
    """``reduction="sum"`` with kernel regularisers: the window is a sum, and the regulariser,
    the same in every micro-batch of a window, enters once (with the first micro-batch)."""
    x, y = regression_data()

    def make(model_cls=keras.Model, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        h = keras.layers.Dense(16, activation="tanh", kernel_regularizer="l2")(inputs)
        return model_cls(inputs, keras.layers.Dense(1, bias_regularizer="l1")(h), **kwargs)

    def loss():
        return keras.losses.MeanSquaredError(reduction="sum")

    ref = make()
    initial = get_weights(ref)
    ref.compile(keras.optimizers.SGD(0.01), loss=loss())
    ref.fit(x, y, batch_size=K * MICRO, shuffle=False, verbose=0)
    for mode in ("eager", "function"):
        model = make()
        trainer = ac.AccumTrainer(model, keras.optimizers.SGD(0.01), loss(), accum_steps=K)
        trainer.fit(x, y, batch_size=MICRO, shuffle=False, mode=mode, verbose=0)
        assert relative_error(get_weights(model), get_weights(ref), initial) <= REL_TOL, mode
    model = make(ac.AccumModel, accum_steps=K)
    model.compile(keras.optimizers.SGD(0.01), loss=loss())
    model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert relative_error(get_weights(model), get_weights(ref), initial) <= REL_TOL


def test_trainer_without_a_loss_needs_the_models_own_losses():
    with pytest.raises(ValueError, match=r"loss=None.*model\.losses"):
        ac.AccumTrainer(regression_mlp(), sgd(), None, accum_steps=K).train_micro_batch(
            *regression_data(MICRO))


# ---------------------------------------------------------------------------- reading forms
FORMS = {  # what add_loss is given, from the batch x (PROBE_BATCH, 3) and a weight w (3,)
    "per-sample vector": (lambda x, w: ops.square(x), "sum"),
    "sum": (lambda x, w: ops.sum(ops.square(x)), "sum"),
    "scaled sum minus a sum": (lambda x, w: 0.5 * ops.sum(x) - ops.sum(ops.abs(x)), "sum"),
    "mean": (lambda x, w: ops.mean(ops.square(x)), "mean"),
    "mean of per-sample sums": (lambda x, w: -0.5 * ops.mean(ops.sum(x * w, axis=1)), "mean"),
    "sum over the batch size": (
        lambda x, w: ops.divide_no_nan(ops.sum(ops.abs(x)), ops.cast(ops.shape(x)[0],
                                                                     "float32")), "mean"),
    "mean plus a weight penalty": (lambda x, w: ops.mean(x) + ops.sum(w ** 2), "mean"),
    "weight penalty": (lambda x, w: 0.01 * ops.sum(ops.square(w)), "once"),
    "token mean": (lambda x, w: ops.sum(x * ops.cast(x > 0, "float32"))
                   / ops.sum(ops.cast(x > 0, "float32")), "unknown"),
    "max": (lambda x, w: ops.max(x), "unknown"),
    "product of means": (lambda x, w: ops.mean(x) * ops.mean(ops.abs(x)), "unknown"),
    "sum plus a weight penalty": (lambda x, w: ops.sum(x) + ops.sum(w), "unknown"),
    "a batch statistic broadcast into rows": (lambda x, w: ops.sum(x - ops.mean(x)),
                                              "unknown"),
    "mean over the batch axis only": (lambda x, w: ops.sum(ops.mean(x, axis=0)), "unknown"),
}


@pytest.mark.parametrize("name", FORMS)
def test_sample_graph_reads_each_form(name):
    expression, expected = FORMS[name]
    w = tf.Variable(tf.ones((3,)))
    found = []

    def traced(x):
        found.append(SampleGraph((x,)).summed_form(expression(x, w)))
        return tf.constant(0.0)

    tf.function(traced).get_concrete_function(tf.TensorSpec((PROBE_BATCH, 3), tf.float32))
    assert found[0].kind == expected, found[0]
