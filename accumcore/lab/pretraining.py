"""A small GPT-2 pretrained here and saved as a KerasHub preset: the fine-tuning chapter's model
where the published preset cannot be downloaded (a machine without internet access).

:func:`pretrain_small_gpt2` builds a GPT-2 of two layers, 64 wide, over bytes (a byte-level
``GPT2Tokenizer``: the 256 bytes, one merge, the end token), trains it on
:func:`pretraining_corpus` (the docstrings of a few modules of Python's standard library: English
about programming, and not the Zen of Python the chapter fine-tunes on) and saves it with
KerasHub's own ``save_to_preset``, so that ``keras_hub.models.GPT2CausalLM.from_preset(folder)``
loads it exactly as it loads ``"gpt2_base_en"`` on Colab: backbone, preprocessor and tokenizer.
"""

from __future__ import annotations

import collections
import datetime
import decimal
import fractions
import functools
import heapq
import inspect
import itertools
import json
import pathlib
import re
import statistics
import string
import textwrap
from dataclasses import dataclass

import numpy as np

#: The modules whose docstrings are the pretraining text.
CORPUS_MODULES = (collections, datetime, decimal, fractions, functools, heapq, itertools, json,
                  pathlib, re, statistics, string, textwrap)
#: The end-of-text token (GPT-2's), the one token besides the bytes and the merge.
END_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class Pretrained:
    """What :func:`pretrain_small_gpt2` made.

    Attributes:
        folder: the preset's folder (``from_preset(folder)`` loads it).
        lines: the pretraining corpus's lines; characters: their total length.
        epochs: passes over the corpus; first_loss, last_loss: the training loss of the first
            and the last epoch (cross-entropy, nats per byte).
        parameters: the model's weights (count).
    """

    folder: str
    lines: int
    characters: int
    epochs: int
    first_loss: float
    last_loss: float
    parameters: int

    def describe(self) -> str:
        """One sentence for a reader: what was pretrained, on what, how far."""
        return (f"a GPT-2 of {self.parameters:,} weights over bytes, pretrained here for "
                f"{self.epochs} epochs on {self.lines:,} lines ({self.characters:,} characters) "
                f"of Python's standard-library docstrings (loss {self.first_loss:.2f} -> "
                f"{self.last_loss:.2f} nats per byte), saved as a KerasHub preset")


def pretraining_corpus(min_length: int = 20) -> list[str]:
    """The docstring lines (of at least ``min_length`` characters, stripped, each once, in a
    fixed order) of the public names of ``CORPUS_MODULES``."""
    lines: dict[str, None] = {}
    for module in CORPUS_MODULES:
        for name in sorted(vars(module)):
            doc = None if name.startswith("_") else inspect.getdoc(getattr(module, name))
            for line in (doc or "").splitlines():
                if len(line.strip()) >= min_length:
                    lines[line.strip()] = None
    return list(lines)


def byte_vocabulary() -> tuple[dict[str, int], list[str]]:
    """A GPT-2 byte-level vocabulary and merges: each byte as GPT-2's tokenizer spells it (ids
    0-255), ``END_TOKEN`` (256) and one merge, ``"Ġ t"`` (a space then "t", 257: KerasHub's
    tokenizer needs at least one)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = {}, 0
    for byte in range(256):  # GPT-2's byte-to-character table
        if byte in printable:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    vocabulary = {spelled[byte]: byte for byte in range(256)}
    vocabulary[END_TOKEN] = 256
    vocabulary[spelled[ord(" ")] + "t"] = 257
    return vocabulary, [f"{spelled[ord(' ')]} t"]


def small_gpt2(sequence_length: int, seed: int):
    """An untrained ``GPT2CausalLM``: two layers, 64 wide, four heads, over the bytes of
    :func:`byte_vocabulary`, with its ``GPT2CausalLMPreprocessor`` (``sequence_length`` tokens
    per example); no dropout."""
    import keras
    import keras_hub

    vocabulary, merges = byte_vocabulary()
    tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(
        tokenizer=tokenizer, sequence_length=sequence_length)
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=len(vocabulary), num_layers=2, num_heads=4, hidden_dim=64,
        intermediate_dim=128, max_sequence_length=2 * sequence_length, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)


def pretrain_small_gpt2(folder: str, *, epochs: int = 60, sequence_length: int = 48,
                        seed: int = 0) -> Pretrained:
    """Pretrain :func:`small_gpt2` on :func:`pretraining_corpus` with Adam (3e-3, batches of
    32 lines, in order) for ``epochs`` and save it to ``folder`` with KerasHub's
    ``save_to_preset``. Returns what was made.

    The default epochs make a model that spells common English words, which LoRA then adapts
    to new lines; chapter 3b prints its first and last loss (:meth:`Pretrained.describe`)."""
    import keras
    import keras_hub

    causal_lm = small_gpt2(sequence_length, seed)
    lines = pretraining_corpus()
    x, y, sample_weight = causal_lm.preprocessor(lines)
    trainer = keras_hub.models.GPT2CausalLM(backbone=causal_lm.backbone, preprocessor=None)
    trainer.compile(optimizer=keras.optimizers.Adam(3e-3))
    losses = trainer.fit({key: np.asarray(value) for key, value in x.items()}, np.asarray(y),
                         sample_weight=np.asarray(sample_weight, "float32"), batch_size=32,
                         epochs=epochs, shuffle=False, verbose=0).history["loss"]
    causal_lm.save_to_preset(folder)
    return Pretrained(folder=folder, lines=len(lines), characters=sum(map(len, lines)),
                      epochs=epochs, first_loss=float(losses[0]), last_loss=float(losses[-1]),
                      parameters=causal_lm.backbone.count_params())
