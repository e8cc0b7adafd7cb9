"""What accumulation costs where the recipe's batch is not split: plain ``fit`` at B against
``accumulate(model, micro_batch_size=B)`` and ``micro_batch_size="auto"`` (which keeps b = B
where B fits), each with and without ``compile(steps_per_execution=32)``.

Usage (repository root, the project's venv):

    python benchmarks/fast_path.py                                   # MLP and conv, 7 rounds
    python benchmarks/fast_path.py --rounds 9 --out benchmarks/results/cpu/fast_path.json
    python benchmarks/fast_path.py --quick                           # a smoke run

Every configuration makes the same updates from the same samples (B = 64 per update, SGD,
one epoch of ``--samples`` samples, in order): ``plain`` is plain ``fit(batch_size=64)``,
``fixed`` is ``accumcore.accumulate(model, micro_batch_size=64)`` with the same ``fit`` (one
micro-batch per window), ``auto`` is ``accumulate(model, micro_batch_size="auto")``, and
``unchecked`` is ``fixed`` traced without its non-finite check (``suite.UNCHECKED``: a
diagnostic of what the default ``nonfinite="raise"`` costs; never train so). Each
round times one epoch of every configuration (``accumcore.lab.benchmarking.paired_rounds``:
the order rotates every round); a figure is the median of the per-round throughput ratios
with its 95 % bootstrap interval (``paired_ratio``). The issue's targets: ``fixed/plain`` and
``auto/fixed`` at least 0.95 on the MLP; the conv net is reported beside them (its speed jumps
between two levels from one model instance to the next).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import accumcore  # noqa: E402
from accumcore.lab import benchmarking as bm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import suite  # noqa: E402

BATCH = 64
KINDS = ("plain", "fixed", "auto", "unchecked")
#: The ratios reported, ``(configuration, reference)``, and the issue's targets (MLP).
#: ``unchecked/plain`` is a diagnostic: what ``fixed`` costs without its non-finite check.
RATIOS = (("fixed", "plain"), ("auto", "plain"), ("auto", "fixed"), ("unchecked", "plain"),
          ("fixed", "unchecked"))
TARGETS = {"fixed/plain": 0.95, "auto/fixed": 0.95}


def compiled(model_kind: str, kind: str, spe: int) -> keras.Model:
    """The benchmark model ``model_kind`` compiled with SGD for configuration ``kind``."""
    if kind == "unchecked":  # the non-finite check traced out: a diagnostic, never train so
        model = bm.compiled_sgd(bm.build_model(model_kind), steps_per_execution=spe,
                                jit_compile=False)
        return accumcore.accumulate(model, micro_batch_size=BATCH, nonfinite=suite.UNCHECKED)
    micro = {"plain": None, "fixed": BATCH, "auto": "auto"}[kind]
    return bm.compiled_sgd(bm.build_model(model_kind), steps_per_execution=spe,
                           micro_batch_size=micro, jit_compile=False)


def measure(model_kind: str, rounds: int, samples: int, spes: tuple[int, ...] = (1, 32)
            ) -> dict[str, Any]:
    """``rounds`` interleaved rounds of one epoch of every configuration, at each
    ``steps_per_execution`` of ``spes``: wall seconds per epoch and the paired throughput
    ratios (``ratios``, what the targets judge), and the same in CPU seconds (``cpu_ratios``:
    on a shared machine they move much less with the other load; a diagnostic)."""
    x, y = bm.benchmark_data(model_kind, samples, "synthetic")
    out: dict[str, Any] = {}
    for spe in spes:
        runs = {kind: bm.fit_epoch(compiled(model_kind, kind, spe), x, y, BATCH)
                for kind in KINDS}
        seconds, cpu = bm.paired_rounds_with_cpu(runs, rounds, warmup=2)
        out[f"spe{spe}"] = {
            "seconds": seconds, "cpu_seconds": cpu,
            "ratios": {f"{a}/{b}": bm.paired_ratio(seconds[b], seconds[a]) for a, b in RATIOS},
            "cpu_ratios": {f"{a}/{b}": bm.paired_ratio(cpu[b], cpu[a]) for a, b in RATIOS},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = bm.benchmark_parser(__doc__.split("\n\n")[0], rounds=7, samples=16384,
                                 samples_help="samples per epoch (the conv net takes a quarter)")
    parser.add_argument("--models", nargs="+", default=["mlp", "conv"], choices=["mlp", "conv"])
    parser.add_argument("--quick", action="store_true", help="1 round of 256 samples")
    args = parser.parse_args(argv)
    rounds, samples = (1, 256) if args.quick else (args.rounds, args.samples)
    record: dict[str, Any] = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rounds": rounds,
                              "batch": BATCH, "load_average": [os.getloadavg()],
                              "keras": keras.__version__, "tensorflow": tf.__version__}
    for model_kind in args.models:
        n = samples if model_kind == "mlp" else max(BATCH, samples // 4)
        record[model_kind] = result = measure(model_kind, rounds, n)
        for spe, figures in result.items():
            for name, p in figures["ratios"].items():
                target = TARGETS.get(name) if model_kind == "mlp" else None
                print(f"{model_kind:4s} {spe:5s} {name:12s} {bm.ratio_text(p)}"
                      f"{bm.target_text(p, target)}; CPU time "
                      f"{bm.ratio_text(figures['cpu_ratios'][name])}", flush=True)
    record["load_average"].append(os.getloadavg())
    print(f"load average before {record['load_average'][0]}, after {record['load_average'][1]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
