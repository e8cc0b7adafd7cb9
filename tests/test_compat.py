"""accumcore._impl.compat (the Keras-version shim) and the import-time version check.

Each branch of the shim that can run on the stack under test runs here: the branch of
``compute_loss`` without ``training`` is driven on any stack by a ``compute_loss`` override
written without it (Keras 3.3's signature, which Keras 3.4+ still accepts). CI runs this file on
every stack of the README's "Supported versions" table.
"""

from __future__ import annotations

import inspect
import re
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    LOSS,
    REL_TOL,
    assert_matches_reference,
    reference_weights,
    run_script,
    small_mlp,
)

import accumcore as ac
from accumcore._impl import compat
from accumcore.lab.experiments import get_weights


def _keras_minor() -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", keras.__version__).groups()
    return int(major), int(minor)


# ------------------------------------------------------------------ no model at import
def test_import_builds_no_model_or_layer():
    """A fresh interpreter: `import accumcore` creates no Keras layer or model (a counter on
    Layer.__new__, which every layer and model goes through, stays at 0); the first functional
    AccumModel then works, and the counter is shown to count (it sees that model's layers)."""
    script = textwrap.dedent(
        """
        import keras
        created = []
        original = keras.layers.Layer.__new__

        def counting_new(cls, *args, **kwargs):
            created.append(cls.__name__)
            return original(cls, *args, **kwargs)

        keras.layers.Layer.__new__ = staticmethod(counting_new)
        import accumcore
        at_import = list(created)
        x = keras.Input((3,))
        model = accumcore.AccumModel(x, keras.layers.Dense(2)(x), accum_steps=2)
        after = list(created)

        from helpers import emit  # imported only now: the counts are taken

        emit({"at_import": at_import, "after": after,
              "model": [type(model).__mro__[1].__name__, model.accum_steps]})
        """
    )
    out = run_script(script, timeout=300)
    assert out["at_import"] == [], f"import accumcore created layers/models: {out}"
    assert "Dense" in out["after"] and "AccumModel" in out["after"], out  # the counter counts
    assert out["model"] == ["AccumModel", 2]


# ------------------------------------------------------------------ functional class
def test_functional_model_class_is_what_keras_model_returns():
    x = keras.Input((4,))
    plain = keras.Model(x, keras.layers.Dense(2)(x))
    cls = compat.functional_model_class()
    assert type(plain) is cls
    assert issubclass(cls, keras.Model) and cls is not keras.Model
    assert compat.functional_model_class() is cls  # cached: probed once per process


def test_functional_accum_model_is_functional_and_trains(data):
    """The functional form built through the probed class is a real functional model."""
    x, y = data
    model = small_mlp(model_cls=ac.AccumModel, accum_steps=2)
    assert isinstance(model, compat.functional_model_class())
    assert isinstance(model, ac.AccumModel)
    model.compile(keras.optimizers.SGD(0.1), LOSS)
    model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    assert int(model.accumulation.windows_applied.numpy()) == 4  # 40 samples / (2 * 5)


def _uid(name: str) -> int:
    match = re.fullmatch(r"functional(?:_(\d+))?", name)
    assert match, name
    return int(match.group(1) or 0)


def test_probe_takes_no_automatic_model_name():
    """Re-probing (cache cleared) between two unnamed models shifts Keras's automatic names no
    more than nothing does: the probe's names are explicit."""

    def unnamed() -> keras.Model:
        x = keras.Input((2,))
        return keras.Model(x, keras.layers.Dense(1)(x))

    a = unnamed()
    b = unnamed()
    compat.functional_model_class.cache_clear()
    try:
        cls = compat.functional_model_class()
    finally:
        assert compat.functional_model_class() is cls
    c = unnamed()
    assert _uid(c.name) - _uid(b.name) == _uid(b.name) - _uid(a.name), (a.name, b.name, c.name)


# ------------------------------------------------------------------ compute_loss(training=)
def test_keras_compute_loss_training_argument_matches_documented_versions():
    """Keras >= 3.4 has `compute_loss(..., training=True)`; 3.0-3.3 do not (compat's claim)."""
    has = "training" in inspect.signature(keras.Model.compute_loss).parameters
    assert has == (_keras_minor() >= (3, 4)), (keras.__version__, has)
    x = keras.Input((3,))
    assert compat.compute_loss_accepts_training(keras.Model(x, keras.layers.Dense(1)(x))) == has


class Recording:
    """Mixin: a compute_loss override (MSE) that records the keyword arguments it gets."""

    calls: list[dict]

    def _record(self, **kwargs) -> None:
        type(self).calls.append(kwargs)

    def _mse(self, y, y_pred, sample_weight):
        return keras.losses.MeanSquaredError()(y, y_pred, sample_weight=sample_weight)


class NoTraining(Recording):
    """compute_loss written without `training` (Keras 3.3's signature; valid in Keras 3.15)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        self._record()
        return self._mse(y, y_pred, sample_weight)


class WithTraining(Recording):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        self._record(training=training)
        return self._mse(y, y_pred, sample_weight)


class VarKeyword(Recording):
    """`**kwargs` but no `training` parameter: Keras passes no `training` (nor do we)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, **kwargs):
        self._record(**kwargs)
        return self._mse(y, y_pred, sample_weight)


OVERRIDES = {"no_training": NoTraining, "with_training": WithTraining, "var_keyword": VarKeyword}


def _model_with(mixin: type, base: type, **kwargs) -> keras.Model:
    cls = type(f"{mixin.__name__}{base.__name__}", (mixin, base), {"calls": []})
    x = keras.Input((3,))
    return cls(x, keras.layers.Dense(1)(x), **kwargs)


@pytest.mark.parametrize("name", sorted(OVERRIDES))
@pytest.mark.parametrize("training", [True, False])
def test_compute_loss_passes_training_only_where_declared(name, training):
    model = _model_with(OVERRIDES[name], keras.Model)
    accepts = name == "with_training"
    assert compat.compute_loss_accepts_training(model) is accepts
    x = np.ones((4, 3), "float32")
    y = np.zeros((4, 1), "float32")
    y_pred = model(x)
    loss = compat.compute_loss(model, x=x, y=y, y_pred=y_pred, sample_weight=None,
                               training=training)
    expected = float(np.mean(np.square(keras.ops.convert_to_numpy(y_pred))))
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert type(model).calls == [{"training": training} if accepts else {}]


@pytest.mark.parametrize("name", sorted(OVERRIDES))
def test_fit_and_evaluate_call_compute_loss_as_keras_does(name):
    """The same override under keras.Model and AccumModel: fit then evaluate hand it the same
    keyword arguments (Keras decides from the override's signature; so must we)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 3)).astype("float32"), rng.normal(size=(8, 1)).astype("float32")
    seen = {}
    for base, kwargs in ((keras.Model, {}), (ac.AccumModel, {"accum_steps": 2})):
        model = _model_with(OVERRIDES[name], base, **kwargs)
        model.compile(keras.optimizers.SGD(0.1))
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        model.evaluate(x, y, batch_size=8, verbose=0)
        # Traced once per function: the first call of each is what the function runs.
        seen[base.__name__] = (type(model).calls[0], type(model).calls[-1])
    assert seen["AccumModel"] == seen["Model"], seen
    if name == "with_training":
        assert seen["Model"] == ({"training": True}, {"training": False})


def test_compute_loss_equals_keras_compute_loss_with_regularisation():
    """On a plain compiled model compat.compute_loss is Keras's own (mean loss + penalties)."""
    x_in = keras.Input((3,))
    out = keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L2(0.1))(x_in)
    model = keras.Model(x_in, out)
    model.compile("sgd", "mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 3)).astype("float32"), rng.normal(size=(6, 2)).astype("float32")
    y_pred = model(x)
    got = float(compat.compute_loss(model, x=x, y=y, y_pred=y_pred, sample_weight=None,
                                    training=True))
    kernel = keras.ops.convert_to_numpy(model.layers[1].kernel)
    want = float(np.mean((keras.ops.convert_to_numpy(y_pred) - y) ** 2)) + 0.1 * float(
        np.sum(kernel**2))
    assert got == pytest.approx(want, rel=1e-5)


class AccumNoTraining(ac.AccumModel):
    """An AccumModel whose compute_loss is written without `training` (as for Keras 3.3)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        return super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)


def test_accum_model_exact_with_override_without_training_argument(data):
    """Such an override trains exactly (against the large batch) and evaluates; before the shim:
    TypeError: compute_loss() got an unexpected keyword argument 'training'."""
    x, y = data
    model = small_mlp(model_cls=AccumNoTraining, accum_steps=4)
    assert not compat.compute_loss_accepts_training(model)
    model.compile(keras.optimizers.Adam(0.01), LOSS)
    model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)
    initial, reference = reference_weights(lambda: keras.optimizers.Adam(0.01), x, y, None, 5, 4)
    assert_matches_reference(model, initial, reference, REL_TOL)
    plain = small_mlp()
    plain.set_weights(get_weights(model))
    plain.compile("sgd", LOSS)
    assert model.evaluate(x, y, batch_size=len(x), verbose=0) == pytest.approx(
        plain.evaluate(x, y, batch_size=len(x), verbose=0), rel=1e-5)


# ------------------------------------------------------------------ import-time check
def _check_with(monkeypatch, tf_version: str, keras_version: str, backend: str = "tensorflow"):
    monkeypatch.setattr(tf, "__version__", tf_version)
    monkeypatch.setattr(keras, "__version__", keras_version)
    monkeypatch.setattr(keras.backend, "backend", lambda: backend)
    ac._check_tensorflow()


@pytest.mark.parametrize(
    ("tf_version", "keras_version"),
    [("2.20.0", "3.13.0"), ("2.21.0", "3.15.1"), ("2.22.0rc1", "3.16.0.dev1")],
)
def test_check_accepts_supported_and_newer(monkeypatch, tf_version, keras_version):
    _check_with(monkeypatch, tf_version, keras_version)


@pytest.mark.parametrize(
    ("tf_version", "keras_version"),
    [("2.15.1", "2.15.0"), ("2.16.2", "3.3.3"), ("2.19.0", "3.10.0"), ("2.20.0", "3.12.1"),
     ("2.19.1", "3.13.2"), ("2.20.0", "3.0.0")],
)
def test_check_names_found_and_supported_versions(monkeypatch, tf_version, keras_version):
    with pytest.raises(ImportError) as err:
        _check_with(monkeypatch, tf_version, keras_version)
    message = str(err.value)
    assert f"found TensorFlow {tf_version} with Keras {keras_version}" in message
    assert "TensorFlow >= 2.20 with Keras >= 3.13" in message
    assert "TF 2.20.0 + Keras 3.13.2" in message  # the tested stacks are named
    assert "pip install" in message


def test_check_rejects_other_backends(monkeypatch):
    with pytest.raises(ImportError, match="KERAS_BACKEND=tensorflow") as err:
        _check_with(monkeypatch, "2.20.0", "3.13.2", backend="jax")
    assert "'jax' backend" in str(err.value)


# ------------------------------------------------------------------ BatchNormalization(renorm=)
def test_batchnorm_renorm_on_this_keras():
    """Keras >= 3.14 has `renorm`; older BatchNormalization has neither argument nor attribute
    (compat then reports False, and WindowBatchNormalization builds without looking for it)."""
    has = "renorm" in inspect.signature(keras.layers.BatchNormalization).parameters
    assert has == (_keras_minor() >= (3, 14)), (keras.__version__, has)
    assert compat.batchnorm_renorm(keras.layers.BatchNormalization()) is False
    assert ac.WindowBatchNormalization(momentum=0.9).momentum == pytest.approx(0.9)
    if has:
        assert compat.batchnorm_renorm(keras.layers.BatchNormalization(renorm=True)) is True
        with pytest.raises(ValueError, match="renorm=False"):
            ac.WindowBatchNormalization(renorm=True)
    else:
        with pytest.raises((TypeError, ValueError), match="renorm"):  # Keras's own refusal
            ac.WindowBatchNormalization(renorm=True)
