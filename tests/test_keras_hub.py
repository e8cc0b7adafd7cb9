"""``accumulate`` on a KerasHub causal LM (a tiny GPT-2 built from its config, dropout 0).

The reference is independent: the same architecture from the same seed, trained with plain
Keras ``train_on_batch`` on each window's samples (the padding mask as ``sample_weight``, as
KerasHub's preprocessor gives it). Tolerance: ``REL_TOL`` (tests/helpers.py). CI installs
keras-hub (requirements.txt); elsewhere the module is skipped without it.
"""

from __future__ import annotations

import functools
import importlib
import os
import zipfile

import keras
import numpy as np
import pytest
from helpers import REL_TOL, assert_matches_reference, windows_of

import accumcore as ac
from accumcore.lab.experiments import get_weights, relative_error

keras_hub = (importlib.import_module("keras_hub") if os.environ.get("CI")
             else pytest.importorskip("keras_hub"))

VOCAB, LENGTH, N, MICRO, K = 40, 10, 24, 4, 2  # 24 sequences: windows of 8, 8, 8


def tiny_lm(seed: int = 0, lora: bool = False) -> keras.Model:
    """A GPT2CausalLM of one layer, 16 wide, no preprocessor (token ids in)."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=LENGTH, dropout=0.0)
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    if lora:
        backbone.enable_lora(rank=2)
    return lm


def lm_data(seed: int = 0, mask_dtype: str = "bool"):
    """Token ids with ragged lengths (3..LENGTH), the next-token labels and the padding mask
    as sample weights: (x dict, y, sample_weight)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, size=(N, LENGTH + 1)).astype("int32")
    lengths = rng.integers(3, LENGTH + 2, size=N)
    mask = np.arange(LENGTH + 1)[None, :] < lengths[:, None]
    ids = np.where(mask, ids, 0)
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1].astype(mask_dtype)}
    return x, ids[:, 1:], mask[:, 1:].astype("float32")


def _rows(x: dict, s: slice) -> dict:
    return {key: value[s] for key, value in x.items()}


def reference(make_opt, lora: bool, epochs: int = 1):
    """Plain Keras, one ``train_on_batch`` per window of K * MICRO sequences: the initial and
    the trained weights. Computed once per process and settings (the same seed, data and
    optimizer give the same weights; the arrays are read-only, so no test can change
    another's)."""
    return _reference(make_opt, bool(lora), int(epochs))


@functools.cache
def _reference(make_opt, lora: bool, epochs: int):
    x, y, sw = lm_data()
    lm = tiny_lm(lora=lora)
    initial = get_weights(lm)
    lm.compile(optimizer=make_opt())
    for _ in range(epochs):
        for s in windows_of(N, MICRO, K):
            lm.train_on_batch(_rows(x, s), y[s], sample_weight=sw[s])
    weights = get_weights(lm)
    for array in initial + weights:
        array.setflags(write=False)
    return initial, weights


#: ``accum_steps=K`` with fit batches of MICRO, or ``micro_batch_size`` with fit batches of
#: K * MICRO = 8 split inside the step as 3 + 3 + 2 (the same windows of 8 sequences).
WAYS = {"accum_steps": (dict(accum_steps=K), MICRO),
        "micro_batch_size": (dict(micro_batch_size=3), K * MICRO)}


def accumulated(make_opt, lora: bool, epochs: int = 1, way: str = "accum_steps", **settings):
    x, y, sw = lm_data()
    lm = tiny_lm(lora=lora)
    lm.compile(optimizer=make_opt())
    how, batch_size = WAYS[way]
    ac.accumulate(lm, **how, **settings)
    lm.fit(x, y, sample_weight=sw, batch_size=batch_size, epochs=epochs, shuffle=False,
           verbose=0)
    return lm


def schedule_adam():
    return keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=1, decay_rate=0.7))


@pytest.mark.parametrize("way", sorted(WAYS))
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_causal_lm_matches_the_large_batch(lora, way):
    initial, ref = reference(schedule_adam, lora, epochs=2)
    lm = accumulated(schedule_adam, lora, epochs=2, way=way)
    assert type(lm) is keras_hub.models.GPT2CausalLM
    assert_matches_reference(lm, initial, ref)
    assert int(lm.optimizer.iterations.numpy()) == 2 * len(windows_of(N, MICRO, K))
    if lora:  # only the LoRA weights (and the biases beside them) train and are accumulated
        assert len(lm.accumulation.accumulators) == len(lm.trainable_variables) == 6
        assert sum("lora_kernel" in v.path for v in lm.trainable_variables) == 4


def test_reference_can_fail():
    initial, ref = reference(schedule_adam, lora=False, epochs=2)
    x, y, sw = lm_data()
    lm = tiny_lm()
    lm.compile(optimizer=schedule_adam())
    lm.fit(x, y, sample_weight=sw, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    assert relative_error(get_weights(lm), ref, initial) > 100 * REL_TOL


def test_generate_and_saving_stay_the_models_own(tmp_path):
    lm = accumulated(lambda: keras.optimizers.Adam(1e-2), lora=False)
    lm.compile(optimizer=lm.optimizer, sampler="greedy")  # deterministic; keeps accumulating
    assert lm.accumulation.accum_steps == K
    prompt = {"token_ids": np.array([[5, 6, 7] + [0] * (LENGTH - 3)], "int32"),
              "padding_mask": np.array([[True] * 3 + [False] * (LENGTH - 3)])}
    out = lm.generate(prompt, max_length=LENGTH, stop_token_ids=None)
    assert out["token_ids"].shape == (1, LENGTH)
    path = tmp_path / "lm.keras"
    lm.save(path)
    with zipfile.ZipFile(path) as archive:
        assert "accumcore" not in archive.read("config.json").decode()
    loaded = keras.saving.load_model(path)
    assert type(loaded) is keras_hub.models.GPT2CausalLM
    np.testing.assert_array_equal(loaded.predict(prompt, verbose=0), lm.predict(prompt, verbose=0))
    loaded.compile(sampler="greedy")  # the sampler is compile's, not in the compile config
    np.testing.assert_array_equal(
        loaded.generate(prompt, max_length=LENGTH, stop_token_ids=None)["token_ids"],
        out["token_ids"])
