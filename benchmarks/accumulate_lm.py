"""``accumcore.accumulate``'s ``fit`` on a tiny KerasHub causal LM, against Keras's own
``gradient_accumulation_steps`` on the same model, side by side in one process.

Usage (repository root, the project's venv):

    python benchmarks/accumulate_lm.py                     # 21 rounds, about 2 min on 2 CPUs
    python benchmarks/accumulate_lm.py --rounds 41 --out benchmarks/results/cpu/accumulate_lm.json

The model is ``tests/test_keras_hub.py``'s architecture at a size that trains in milliseconds
per micro-batch (GPT-2, 2 layers, 64 wide, vocabulary 512, sequences of 64 tokens, dropout 0),
Adam with an ``ExponentialDecay`` schedule, b=8, K=4, the padding mask as sample weights.
Each round times one epoch of each configuration, in alternating order (A B, then B A); the
figure is the median of the per-round throughput ratios accumcore / Keras with its 95 %
bootstrap interval (``accumcore.lab.benchmarking.paired_ratio``), best-of-N beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import accumcore  # noqa: E402
from accumcore.lab import benchmarking as bm  # noqa: E402

ACCUM_STEPS, MICRO_BATCH = 4, 8  # K, b
VOCAB, LENGTH, SEQUENCES = 512, 64, 512
KINDS = ("keras_ga", "accumulate")


def data(seed: int = 0):
    """Token ids with ragged lengths, next-token labels, the padding mask as sample weights."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, size=(SEQUENCES, LENGTH + 1)).astype("int32")
    lengths = rng.integers(LENGTH // 4, LENGTH + 2, size=SEQUENCES)
    mask = np.arange(LENGTH + 1)[None, :] < lengths[:, None]
    ids = np.where(mask, ids, 0)
    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    return x, ids[:, 1:], mask[:, 1:].astype("float32")


def schedule() -> keras.optimizers.schedules.LearningRateSchedule:
    return keras.optimizers.schedules.ExponentialDecay(1e-3, decay_steps=100, decay_rate=0.9)


def compiled(kind: str) -> keras.Model:
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=64, intermediate_dim=128,
        max_sequence_length=LENGTH, dropout=0.0)
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    if kind == "keras_ga":
        lm.compile(optimizer=keras.optimizers.Adam(schedule(),
                                                   gradient_accumulation_steps=ACCUM_STEPS))
    else:
        lm.compile(optimizer=keras.optimizers.Adam(schedule()))
        accumcore.accumulate(lm, accum_steps=ACCUM_STEPS)
    return lm


def epoch(model: keras.Model, x, y, sw) -> float:
    start = time.perf_counter()
    model.fit(x, y, sample_weight=sw, batch_size=MICRO_BATCH, epochs=1, shuffle=False,
              verbose=0)
    return time.perf_counter() - start


def measure(rounds: int) -> dict:
    x, y, sw = data()
    models = {kind: compiled(kind) for kind in KINDS}
    for model in models.values():  # trace and warm up
        epoch(model, x, y, sw)
    seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for r in range(rounds):
        for kind in (KINDS if r % 2 == 0 else KINDS[::-1]):
            seconds[kind].append(epoch(models[kind], x, y, sw))
    # Keras's seconds over accumcore's, per round: above 1, accumcore is faster.
    paired = bm.paired_ratio(seconds["keras_ga"], seconds["accumulate"])
    return {
        "config": {"accum_steps": ACCUM_STEPS, "micro_batch": MICRO_BATCH, "vocab": VOCAB,
                   "length": LENGTH, "sequences": SEQUENCES, "layers": 2, "hidden": 64,
                   "rounds": rounds, "keras": keras.__version__,
                   "keras_hub": keras_hub.__version__},
        "seconds": seconds,
        "throughput_ratio_paired": paired,
        "throughput_ratio_best_of_n": min(seconds["keras_ga"]) / min(seconds["accumulate"]),
        "target": 0.97,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = measure(args.rounds)
    p = result["throughput_ratio_paired"]
    print(f"accumulate fit / Keras gradient_accumulation_steps fit, throughput, "
          f"{p['rounds']} rounds: paired median {bm.ratio_text(p)}, best-of-N "
          f"{result['throughput_ratio_best_of_n']:.3f} (target >= {result['target']})")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
