"""What the per-micro-batch non-finite check costs ``AccumModel.fit``, against Keras's own
accumulation, side by side in one process.

Usage (repository root, the project's venv):

    python benchmarks/nonfinite_cost.py                      # steps_per_execution 1 and 32
    python benchmarks/nonfinite_cost.py --spe 32 --rounds 9
    python benchmarks/nonfinite_cost.py --rounds 41 --out benchmarks/results/cpu/nonfinite_cost.json
                                              # the committed figures (RESULTS.md shows them)

Four ``fit`` configurations on the benchmark MLP (784-256-256-10, Adam 1e-3, b=16, K=4,
synthetic data): Keras's ``gradient_accumulation_steps=K``, ``AccumModel`` as shipped (the
default ``nonfinite="raise"``: each window checked once, at its close), ``AccumModel`` traced
with that check removed (what a ``LossScaleOptimizer``'s close runs; never do this to train),
and ``AccumModel`` with ``nonfinite="skip_micro_batch"`` (every micro-batch checked). Each
round times one epoch of every configuration, in a rotating order; the best-of-N ratio to
Keras (interference only slows a run) is printed beside the ratio of the medians, and the
median of the per-round ratios with its 95 % bootstrap interval (the runs of one round share the
machine's state: the steadiest of the three on a shared machine).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import accumcore  # noqa: E402
from accumcore.lab import benchmarking as bm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import suite  # noqa: E402

KINDS = ("keras_ga", "accumcore", "accumcore_unchecked", "accumcore_skip_micro_batch")
ACCUM_STEPS = 4  # K, micro-batches per optimizer update
MICRO_BATCH = 16  # b, samples per micro-batch


def compiled_model(kind: str, spe: int, x, y) -> keras.Model:
    """The benchmark MLP of ``kind`` (Keras's ``gradient_accumulation_steps=ACCUM_STEPS``,
    AccumModel, or AccumModel with ``nonfinite=suite.UNCHECKED``: the check removed),
    compiled and warmed up (traced, then one more epoch at b=MICRO_BATCH).
    ``benchmarks/profile_step.py`` profiles the same models."""
    if kind == "keras_ga":
        model = bm.build_model("mlp")
        optimizer = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=ACCUM_STEPS)
    else:
        nonfinite = {"accumcore_skip_micro_batch": "skip_micro_batch",
                     "accumcore_unchecked": suite.UNCHECKED}.get(kind, "raise")
        model = bm.build_model("mlp", model_cls=accumcore.AccumModel, accum_steps=ACCUM_STEPS,
                               nonfinite=nonfinite)
        optimizer = keras.optimizers.Adam(1e-3)
    model.compile(optimizer, bm.LOSS, jit_compile=False, steps_per_execution=spe)
    for _ in range(2):  # trace, then TensorFlow's own warm-up
        model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, verbose=0, shuffle=False)
    return model


def _epoch_seconds(model: keras.Model, x: Any, y: Any) -> float:
    """Wall seconds of one epoch of ``fit`` at b = ``MICRO_BATCH``, in order."""
    start = time.perf_counter()
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, verbose=0, shuffle=False)
    return time.perf_counter() - start


def measure(spe: int, rounds: int, samples: int = 4096) -> dict[str, dict[str, Any]]:
    """``{kind: {"best": ratio, "median": ratio, "paired": {...}, "samples_per_s": best rate,
    "seconds": [...]}}``: each kind's throughput over Keras's, as the best-of-``rounds`` ratio,
    the ratio of the medians and the median of the per-round ratios with its 95 % interval
    (:func:`accumcore.lab.benchmarking.paired_ratio`: each round runs the four fits back to
    back, so a round's ratio compares runs that shared the machine's state)."""
    x, y = bm.benchmark_data("mlp", samples, "synthetic")
    models = {kind: compiled_model(kind, spe, x, y) for kind in KINDS}
    seconds = bm.paired_rounds({kind: functools.partial(_epoch_seconds, models[kind], x, y)
                                for kind in KINDS}, rounds, warmup=0)
    keras_best, keras_median = min(seconds["keras_ga"]), statistics.median(seconds["keras_ga"])
    return {kind: {"best": keras_best / min(t), "median": keras_median / statistics.median(t),
                   "paired": bm.paired_ratio(seconds["keras_ga"], t),
                   "samples_per_s": samples / min(t), "seconds": t}
            for kind, t in seconds.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spe", type=int, action="append",
                        help="steps_per_execution (repeatable; default 1 and 32)")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds")
    parser.add_argument("--out", help="also write the figures to this JSON file (e.g. "
                        "benchmarks/results/cpu/nonfinite_cost.json, which RESULTS.md shows)")
    args = parser.parse_args(argv)
    record: dict[str, Any] = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "rounds": args.rounds, "micro_batch": MICRO_BATCH,
                              "accum_steps": ACCUM_STEPS, "load_average": [os.getloadavg()],
                              "by_spe": {}}
    for spe in args.spe or [1, 32]:
        record["by_spe"][str(spe)] = ratios = measure(spe, args.rounds)
        for kind, r in ratios.items():
            p = r["paired"]
            print(f"steps_per_execution={spe:<3d} {kind:20s} paired {p['median']:.3f} x Keras "
                  f"[{p['low']:.3f}, {p['high']:.3f}], best-of-{args.rounds} {r['best']:.3f}, "
                  f"medians {r['median']:.3f} ({r['samples_per_s']:,.0f} samples/s at best)")
    record["load_average"].append(os.getloadavg())
    if args.out:
        suite.write_record(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
