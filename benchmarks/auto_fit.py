"""``micro_batch_size="auto"`` against the same fixed b, paired and interleaved (issue 49).

Usage (repository root, the project's venv):

    python benchmarks/auto_fit.py --rounds 7 --samples 12800 --out /tmp/auto_fit.json

The benchmark MLP (784-256-256-10) on MNIST, SGD, ``fit(batch_size=64)``: ``auto`` is
``accumcore.accumulate(model, micro_batch_size="auto")`` (on a CPU nothing runs out of memory,
so b = 64 is found at the first batch), ``fixed`` is ``micro_batch_size=64``; each with
``compile(steps_per_execution=1)`` and ``=32``. Each round times one epoch of every
configuration in a rotating order (``accumcore.lab.benchmarking.paired_rounds``, after one
untimed warm-up epoch each); a figure is the median per-round throughput ratio ``auto /
fixed`` at the same ``steps_per_execution`` with its 95 % bootstrap interval
(``paired_ratio``). The machine's load (``os.getloadavg``) is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import accumcore  # noqa: E402
from accumcore.lab import benchmarking as bm  # noqa: E402

BATCH = 64
#: issue 49's target: "auto" at least this times the same fixed b's throughput.
TARGET = 0.95


def _model(micro: int | str, steps_per_execution: int) -> keras.Model:
    model = bm.build_model("mlp")
    model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy",
                  steps_per_execution=steps_per_execution)
    return accumcore.accumulate(model, micro_batch_size=micro)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--samples", type=int, default=12800)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.getLogger("accumcore").setLevel(logging.ERROR)  # the "auto" report, once per model
    x, y = bm.benchmark_data("mlp", args.samples)
    runs = {f"{name}_spe{spe}": bm.fit_epoch(_model(micro, spe), x, y, BATCH)
            for spe in (1, 32) for name, micro in (("auto", "auto"), ("fixed", BATCH))}
    load_before = os.getloadavg()
    seconds = bm.paired_rounds(runs, args.rounds)
    load_after = os.getloadavg()
    record = {"seconds": seconds, "load_before": load_before, "load_after": load_after,
              "ratios": {}}
    for spe in (1, 32):
        ratio = bm.paired_ratio(seconds[f"fixed_spe{spe}"], seconds[f"auto_spe{spe}"])
        record["ratios"][f"spe{spe}"] = ratio
        print(f"steps_per_execution={spe}: auto / fixed b = {ratio['median']:.3f} "
              f"[{ratio['low']:.3f}, {ratio['high']:.3f}] ({ratio['rounds']} rounds; target "
              f">= {TARGET})")
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
