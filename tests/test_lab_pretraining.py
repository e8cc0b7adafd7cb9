"""accumcore.lab.pretraining: the small GPT-2 the fine-tuning chapter pretrains and saves as a
KerasHub preset where the published one cannot be downloaded. The preset must load through the
same ``GPT2CausalLM.from_preset`` call as a published one, with a tokenizer that spells any text
back exactly. CI installs keras-hub (and, on Colab's stack, tensorflow-text, as Colab has it);
elsewhere the module is skipped without them."""

from __future__ import annotations

import codecs
import contextlib
import importlib
import io
import os

import numpy as np
import pytest

from accumcore.lab import pretraining

keras_hub = (importlib.import_module("keras_hub") if os.environ.get("CI")
             else pytest.importorskip("keras_hub"))


def zen_lines() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13").splitlines()[2:]


def test_the_corpus_is_fixed_standard_library_text_without_the_fine_tuning_data():
    corpus = pretraining.pretraining_corpus()
    assert corpus == pretraining.pretraining_corpus()  # the same lines in the same order
    assert len(corpus) > 500 and len(set(corpus)) == len(corpus)
    assert all(len(line) >= 20 and line == line.strip() for line in corpus)
    assert not set(zen_lines()) & set(corpus)  # the chapter fine-tunes on what it never saw


def test_the_byte_tokenizer_spells_any_text_back_exactly():
    vocabulary, merges = pretraining.byte_vocabulary()
    assert len(vocabulary) == 258 and sorted(vocabulary.values()) == list(range(258))
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
    for text in ("Beautiful is better than ugly.", "naïve café, 3 × 4 = 12 tabs\tand more"):
        ids = np.asarray(tokenizer(text))
        assert len(ids) >= len(text.encode()) - text.count(" t")  # bytes, " t" merged
        assert tokenizer.detokenize(ids) == text


def test_the_saved_preset_loads_through_from_preset_as_it_was_trained(tmp_path):
    made = pretraining.pretrain_small_gpt2(str(tmp_path / "preset"), epochs=2,
                                           sequence_length=16)
    assert made.last_loss < made.first_loss  # it learned something from the corpus
    loaded = keras_hub.models.GPT2CausalLM.from_preset(str(tmp_path / "preset"))
    assert type(loaded.preprocessor).__name__ == "GPT2CausalLMPreprocessor"
    assert loaded.backbone.count_params() == made.parameters
    assert loaded.preprocessor.tokenizer.detokenize(
        loaded.preprocessor.tokenizer("Flat is better")) == "Flat is better"
    # the same architecture and seed, untrained, differ from the saved (trained) weights
    untrained = pretraining.small_gpt2(16, seed=0)
    assert any(not np.array_equal(a, b) for a, b in zip(untrained.backbone.get_weights(),
                                                        loaded.backbone.get_weights()))
    assert "pretrained here for 2 epochs" in made.describe()


@pytest.mark.slow
def test_the_default_pretraining_lets_lora_learn_a_new_line_quickly(tmp_path):
    """The chapter's fallback path, in the chapter's setting (LoRA of rank 8 on the same
    layers, Adam 1e-2, micro-batches of 4 in batches of 16): the default pretraining (60
    epochs) must reach a loss below 2 nats per byte (the former 10 epochs reached about 2.7)
    and leave a model that LoRA fine-tunes to a line of the Zen within 100 epochs. This slow
    test runs on the pinned stack; on Colab's (Keras 3.13.2), where the 10-epoch model never
    reached the line, the chapter itself runs under nbval."""
    import keras

    import accumcore

    made = pretraining.pretrain_small_gpt2(str(tmp_path / "preset"), sequence_length=48)
    assert made.last_loss < 2.0  # it spells common English words, not just bytes
    lm = keras_hub.models.GPT2CausalLM.from_preset(str(tmp_path / "preset"))
    preprocessor = lm.preprocessor
    lm.backbone.enable_lora(rank=8, target_layer_names=[
        "query", "key", "value", "attention_output", "feedforward_intermediate_dense",
        "feedforward_output_dense"])
    x, y, sample_weight = preprocessor(zen_lines() * 4)
    x = {key: np.asarray(value) for key, value in x.items()}
    trainer = keras_hub.models.GPT2CausalLM(backbone=lm.backbone, preprocessor=None)
    trainer.compile(optimizer=keras.optimizers.Adam(1e-2), sampler="greedy")
    accumcore.accumulate(trainer, micro_batch_size=4)
    prompt, target = "Beautiful is", zen_lines()[0]
    generated = ""
    for _ in range(4):
        trainer.fit(x, np.asarray(y), sample_weight=np.asarray(sample_weight, "float32"),
                    batch_size=16, epochs=25, shuffle=False, verbose=0)
        tokens = preprocessor.generate_preprocess([prompt], sequence_length=48)
        out = trainer.generate(tokens, max_length=48,
                               stop_token_ids=[preprocessor.tokenizer.end_token_id])
        generated = preprocessor.generate_postprocess(out)[0]
        if generated.startswith(target):
            break
    assert generated.startswith(target), generated
