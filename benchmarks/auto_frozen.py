"""``micro_batch_size="auto"`` against the same fixed b on a model with frozen weights, paired
and interleaved: what "auto"'s per-step copy costs when a model has a frozen part.

Usage (repository root, the project's venv):

    python benchmarks/auto_frozen.py --rounds 9 --samples 3200 --out /tmp/auto_frozen.json

The model: 784 -> Dense(4096, relu) -> Dense(4096, relu, ``trainable=False``: 64 MB of frozen
float32 weights) -> Dense(10), on MNIST, SGD, ``fit(batch_size=64)``, ``steps_per_execution``
32. ``auto`` is ``accumcore.accumulate(model, micro_batch_size="auto")`` (on a CPU nothing runs
out of memory: b = 64), ``fixed`` is ``micro_batch_size=64``. Each round times one epoch of both
in a rotating order (``accumcore.lab.benchmarking.paired_rounds``, after one untimed warm-up
epoch each); the figure is the median per-round throughput ratio ``auto / fixed`` with its 95 %
bootstrap interval (``paired_ratio``). The machine's load (``os.getloadavg``) is printed before
and after.
"""

from __future__ import annotations

import json
import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import accumcore  # noqa: E402
from accumcore.lab import benchmarking as bm  # noqa: E402

BATCH = 64
WIDTH = 4096  # the frozen Dense: WIDTH x WIDTH float32 = 64 MB
STEPS_PER_EXECUTION = 32


def _model(micro: int | str) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((784,))
    hidden = keras.layers.Dense(WIDTH, activation="relu")(inputs)
    hidden = keras.layers.Dense(WIDTH, activation="relu", trainable=False)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
    return bm.compiled_sgd(model, steps_per_execution=STEPS_PER_EXECUTION,
                           micro_batch_size=micro)


def main(argv: list[str] | None = None) -> dict:
    args = bm.benchmark_parser(__doc__.splitlines()[0], rounds=9, samples=3200).parse_args(argv)
    logging.getLogger("accumcore").setLevel(logging.ERROR)  # the "auto" report, once per model
    x, y = bm.benchmark_data("mlp", args.samples)
    runs = {name: bm.fit_epoch(_model(micro), x, y, BATCH)
            for name, micro in (("auto", "auto"), ("fixed", BATCH))}
    load_before = os.getloadavg()
    seconds = bm.paired_rounds(runs, args.rounds)
    load_after = os.getloadavg()
    ratio = bm.paired_ratio(seconds["fixed"], seconds["auto"])
    print(f"frozen {WIDTH}x{WIDTH} Dense, steps_per_execution={STEPS_PER_EXECUTION}: auto / "
          f"fixed b = {bm.ratio_text(ratio)} ({ratio['rounds']} rounds); accumcore from "
          f"{os.path.dirname(accumcore.__file__)}")
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}")
    record = {"seconds": seconds, "ratio": ratio, "load_before": load_before,
              "load_after": load_after}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
