"""keras.io-shaped programs (tests/programs.py), each trained by accumcore in both modes against
plain ``keras.Model.fit`` at the recipe's batch B, from the same initial weights, in order.

* ``micro_batch_size``: ``accumcore.accumulate(model, micro_batch_size=b)``, ``fit(batch_size=B)``;
* ``accum_steps``: ``accumcore.accumulate(model, accum_steps=K)``, ``fit(batch_size=b)``;

with B = K * b = 32 over N = 100 samples, so the epoch ends in a partial window of 4 samples
(one batch of 4 split into one micro-batch / one micro-batch closing a partial window with
``end_of_epoch="apply"``).

Tolerances (relative weight error ``max|w - w_ref| / max|w_ref - w_0|``): the update is the same
real number summed in another order, so float32 re-association is all that differs. Measured on
this machine (TF 2.21, Keras 3.15, one epoch = 4 updates, the same in both modes): SGD programs
7e-8 to 3.2e-7 (``TOL_SGD`` = 1e-5, a margin of 30), Adam programs 7.5e-7 to 1.5e-6
(``TOL_ADAM`` = 2e-5, a margin of 13: Adam's ``g / (sqrt(v) + eps)`` step amplifies round-off in
small gradient entries, the bound tests/helpers.py ``REL_TOL`` gives for Adam). A wrong
weighting of one micro-batch (a 1/K mis-scaling, a partial window weighed as a full one) gives
1e-2 to 1, and stock BatchNorm under accumulation 1.9 here.

A program with stock ``BatchNormalization`` cannot match (its moving statistics and its
training-mode normalisation depend on how the batch is cut): the documented warning naming
``convert_batchnorm`` (book/reference/batchnorm.md) is checked instead, and so is the
converted model's documented exact part (the moving statistics equal plain fit's at B when the
weights do not move: learning rate 0).

Before issue 47's fixes, split mode failed five of these: (N, 1) integer labels, dict inputs
with a CategoryEncoding, a layer reading ``shape[-1]`` and raw strings (the split's slices lost
their static inner shapes), and stock BatchNorm (no warning).
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
from helpers import assert_matches_reference
from programs import MICRO, PROGRAMS, B, K, Program

import accumcore as ac
from accumcore.lab.experiments import get_weights

MODES = {"micro_batch_size": (dict(micro_batch_size=MICRO), B),
         "accum_steps": (dict(accum_steps=K), MICRO)}

def _cases() -> list:
    return [pytest.param(name, mode, id=f"{name}-{mode}") for name in PROGRAMS for mode in MODES]


_INITIAL: dict[str, list[np.ndarray]] = {}
_REFERENCES: dict[str, list[np.ndarray]] = {}


def initial_weights(name: str) -> list[np.ndarray]:
    """The program's model built once; every run starts from a copy of these weights."""
    if name not in _INITIAL:
        _INITIAL[name] = get_weights(PROGRAMS[name].make())
    return _INITIAL[name]


def fresh(program: Program, initial: list[np.ndarray]) -> keras.Model:
    model = program.make()
    model.set_weights(initial)
    return model


def plain_fit(name: str) -> list[np.ndarray]:
    """Plain ``keras.Model.fit`` at B (in order, one epoch): the final weights."""
    if name not in _REFERENCES:
        program = PROGRAMS[name]
        x, y, fit_kwargs = program.data()
        model = fresh(program, initial_weights(name))
        model.compile(**program.compile())
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0, **fit_kwargs)
        _REFERENCES[name] = get_weights(model)
    return _REFERENCES[name]


def accumulated(program: Program, mode: str, model: keras.Model) -> keras.Model:
    """``model`` compiled, given accumulation in ``mode`` and trained one epoch."""
    settings, batch_size = MODES[mode]
    x, y, fit_kwargs = program.data()
    model.compile(**program.compile())
    ac.accumulate(model, **settings)
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0, **fit_kwargs)
    return model


def _accumcore_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "accumcore" in str(w.message)
            or "convert_batchnorm" in str(w.message) or "normalizer" in str(w.message)]


EXACT = [p for p in _cases() if not PROGRAMS[p.values[0]].stock_batchnorm]
STOCK_BN = [p for p in _cases() if PROGRAMS[p.values[0]].stock_batchnorm]


@pytest.mark.parametrize(("name", "mode"), EXACT)
def test_program_matches_plain_fit_at_the_large_batch(name, mode):
    program = PROGRAMS[name]
    reference = plain_fit(name)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model = accumulated(program, mode, fresh(program, initial_weights(name)))
    assert not _accumcore_warnings(record), _accumcore_warnings(record)  # exact, so silent
    assert_matches_reference(model, initial_weights(name), reference, program.tol)


@pytest.mark.parametrize(("name", "mode"), STOCK_BN)
def test_stock_batchnorm_program_warns_naming_convert_batchnorm(name, mode):
    program = PROGRAMS[name]
    with pytest.warns(UserWarning, match="convert_batchnorm") as record:
        accumulated(program, mode, fresh(program, initial_weights(name)))
    assert sum("convert_batchnorm" in str(w.message) for w in record) == 1  # once per model


@pytest.mark.parametrize("mode", list(MODES))
def test_converted_batchnorm_program_keeps_plain_fits_moving_statistics(mode):
    """The documented exact part of ``convert_batchnorm``: with the weights held still
    (learning rate 0), the moving mean and variance after an epoch of windows equal plain
    fit's at B (one momentum step per update, from the window's pooled moments); no warning."""
    program = PROGRAMS["timeseries_batchnorm"]
    initial = initial_weights("timeseries_batchnorm")
    x, y, _ = program.data()
    plain = fresh(program, initial)
    plain.compile(keras.optimizers.SGD(0.0), "mse")
    plain.fit(x, y, batch_size=B, shuffle=False, verbose=0)

    model = ac.convert_batchnorm(fresh(program, initial))
    assert sum(isinstance(layer, ac.WindowBatchNormalization) for layer in model.layers) == 1
    settings, batch_size = MODES[mode]
    model.compile(keras.optimizers.SGD(0.0), "mse")
    ac.accumulate(model, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    moving = {"moving_mean", "moving_variance"}
    got = [w.numpy() for w in model.weights if w.name in moving]
    want = [w.numpy() for w in plain.weights if w.name in moving]
    start = [w.numpy() for w in fresh(program, initial).weights if w.name in moving]
    assert len(got) == len(want) == 2
    gap = max(np.max(np.abs(g - w)) for g, w in zip(got, want))
    moved = max(np.max(np.abs(w - s)) for w, s in zip(want, start))
    assert moved > 1e-2  # the statistics did move: the comparison can fail
    assert gap / moved < 1e-5, f"moving statistics {gap / moved:.3g} of their change off"


def test_stock_batchnorm_is_measurably_not_the_large_batch():
    """Why the BatchNorm program is checked for its warning: trained with stock BN under
    accumulation its weights are far from plain fit's at B (this tolerance would catch it)."""
    program = PROGRAMS["timeseries_batchnorm"]
    reference = plain_fit("timeseries_batchnorm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = accumulated(program, "accum_steps",
                            fresh(program, initial_weights("timeseries_batchnorm")))
    with pytest.raises(AssertionError, match="relative weight error"):
        assert_matches_reference(model, initial_weights("timeseries_batchnorm"), reference,
                                 program.tol)
