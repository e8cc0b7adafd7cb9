"""Where a micro-step's time goes: TensorFlow's profiler on ``fit``, Keras's own accumulation
beside ``AccumModel``'s, split per micro-step and per position in the window.

Usage (repository root, the project's venv):

    python benchmarks/profile_step.py                 # steps_per_execution 32, 2048 samples
    python benchmarks/profile_step.py --spe 1 --samples 4096
    python benchmarks/profile_step.py --samples 4096 --rounds 9 \
        --out benchmarks/results/cpu/profile_step.json   # the file RESULTS.md reads

The benchmark MLP (784-256-256-10, Adam 1e-3, b=16, K=4, synthetic data) is compiled both ways,
warmed up, then one epoch of each runs under ``tf.profiler``. The op events of TensorFlow's
compute threads are cut into micro-steps at the first layer's forward matmul; for each kind it
prints the median span of a micro-step by its position in the window (0: the first after a
window closed) and the op types that take the most time per micro-step. The profiler records
the ops it deems expensive, not the cheap ones (reads, identities, control flow): what it misses
shows as the difference between a micro-step's span and its recorded busy time.

The XPlane protobuf is read with TensorFlow's own ``xplane_pb2`` (an internal module: this is a
diagnostic, not part of the library).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from accumcore.lab import benchmarking as bm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nonfinite_cost import (  # noqa: E402  (the same models, built one way)
    ACCUM_STEPS,
    MICRO_BATCH,
    compiled_model,
)

KINDS = ("keras_ga", "accumcore")


@dataclass(frozen=True)
class OpEvent:
    """One op execution on a compute thread: start and duration in microseconds, the op's
    graph name and its type."""

    start_us: float
    duration_us: float
    name: str
    op_type: str


def profiled_events(model: keras.Model, x, y, logdir: str) -> list[OpEvent]:
    """One epoch of ``model.fit`` under ``tf.profiler``; the op events of its compute threads,
    in time order."""
    tf.profiler.experimental.start(logdir)
    try:
        model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, verbose=0, shuffle=False)
    finally:
        tf.profiler.experimental.stop()
    return read_events(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))


def read_events(paths: list[str]) -> list[OpEvent]:
    """The op events (``name:type``) of the ``tf_Compute`` threads in XPlane files."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # internal: a diagnostic only

    events = []
    for path in paths:
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            for line in plane.lines:
                if not line.name.startswith("tf_Compute"):
                    continue
                for e in line.events:
                    name = plane.event_metadata[e.metadata_id].name
                    if ":" not in name or name.startswith(("Threadpool", "Executor")):
                        continue
                    start = (line.timestamp_ns * 1000 + e.offset_ps) / 1e6
                    op_name, op_type = name.rsplit(":", 1)
                    events.append(OpEvent(start, e.duration_ps / 1e6, op_name, op_type))
    return sorted(events, key=lambda e: e.start_us)


def micro_steps(events: list[OpEvent]) -> list[list[OpEvent]]:
    """``events`` cut at each run of the first layer's forward matmul (the alphabetically first
    fused matmul, ``_FusedMatMul`` or oneDNN's: the model's first Dense layer, with its bias and
    activation); the last, unfinished one is dropped."""
    fused = sorted({e.name for e in events if "FusedMatMul" in e.op_type})
    if not fused:
        raise ValueError("No fused matmul in the profile: the forward pass was not seen.")
    starts = [i for i, e in enumerate(events) if e.name == fused[0]]
    return [events[a:b] for a, b in zip(starts, starts[1:])]


def summarize(steps: list[list[OpEvent]], spe: int, top: int = 8) -> dict:
    """Per micro-step: the median span (first op's start to the next micro-step's) and the
    median recorded busy time, by window position, and the op types taking the most time (us per
    micro-step). Micro-steps ending a ``steps_per_execution`` call are left out (their span
    holds the host's work between calls)."""
    spans: dict[int, list[float]] = defaultdict(list)
    busy: dict[int, list[float]] = defaultdict(list)
    per_type: dict[str, float] = defaultdict(float)
    kept = 0
    for i, (step, following) in enumerate(zip(steps, steps[1:])):
        if spe > 1 and i % spe == spe - 1:
            continue
        spans[i % ACCUM_STEPS].append(following[0].start_us - step[0].start_us)
        busy[i % ACCUM_STEPS].append(sum(e.duration_us for e in step))
        for e in step:
            per_type[e.op_type] += e.duration_us
        kept += 1
    if not kept:
        raise ValueError("Too few micro-steps profiled: pass more --samples.")
    ranked = sorted(per_type.items(), key=lambda kv: -kv[1])[:top]
    return {
        "micro_steps": kept,
        "span_by_position_us": {p: statistics.median(v) for p, v in sorted(spans.items())},
        "span_us": statistics.median([s for v in spans.values() for s in v]),
        "busy_by_position_us": {p: statistics.median(v) for p, v in sorted(busy.items())},
        "top_op_types_us": {name: total / kept for name, total in ranked},
    }


def combine(summaries: list[dict]) -> dict:
    """One summary of several rounds: per position, the median of the rounds' medians; the op
    types' time per micro-step averaged over the rounds; the micro-steps summed."""
    def median_by_position(key: str) -> dict[int, float]:
        positions = sorted({p for s in summaries for p in s[key]})
        return {p: statistics.median(s[key][p] for s in summaries if p in s[key])
                for p in positions}

    types = {name for s in summaries for name in s["top_op_types_us"]}
    per_type = {name: sum(s["top_op_types_us"].get(name, 0.0) for s in summaries)
                / len(summaries) for name in types}
    return {
        "micro_steps": sum(s["micro_steps"] for s in summaries),
        "rounds": len(summaries),
        "span_by_position_us": median_by_position("span_by_position_us"),
        "span_us": statistics.median(s["span_us"] for s in summaries),
        "busy_by_position_us": median_by_position("busy_by_position_us"),
        "top_op_types_us": dict(sorted(per_type.items(), key=lambda kv: -kv[1])
                                [:len(summaries[0]["top_op_types_us"])]),
    }


def profile(spe: int = 32, samples: int = 2048, rounds: int = 1) -> dict[str, dict]:
    """``{kind: summary}`` for Keras's accumulation and AccumModel, profiled in turn in this
    process, ``rounds`` epochs each in alternating order (A B B A ...), combined by
    :func:`combine`."""
    x, y = bm.benchmark_data("mlp", samples, "synthetic")
    models = {kind: compiled_model(kind, spe, x, y) for kind in KINDS}
    per_round: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    for r in range(rounds):
        for kind in (KINDS if r % 2 == 0 else KINDS[::-1]):
            with tempfile.TemporaryDirectory() as logdir:
                events = profiled_events(models[kind], x, y, logdir)
            per_round[kind].append(summarize(micro_steps(events), spe))
    return {kind: combine(per_round[kind]) for kind in KINDS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spe", type=int, default=32, help="steps_per_execution")
    parser.add_argument("--samples", type=int, default=2048, help="samples in the epoch")
    parser.add_argument("--rounds", type=int, default=1,
                        help="epochs profiled per kind, in alternating order")
    parser.add_argument("--out", help="also write the summaries as JSON to this file")
    args = parser.parse_args(argv)
    summaries = profile(args.spe, args.samples, args.rounds)
    if args.out:
        record = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),  # as nonfinite_cost.py
                  "steps_per_execution": args.spe, "samples": args.samples,
                  "rounds": args.rounds,
                  "micro_batch": MICRO_BATCH, "accum_steps": ACCUM_STEPS,
                  "tensorflow": tf.__version__, "keras": keras.__version__,
                  "kinds": summaries}
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
    for kind, s in summaries.items():
        spans = ", ".join(f"{v:.0f}" for v in s["span_by_position_us"].values())
        busy = ", ".join(f"{v:.0f}" for v in s["busy_by_position_us"].values())
        print(f"{kind}: {s['micro_steps']} micro-steps, median span {s['span_us']:.0f} us; "
              f"by window position 0..{ACCUM_STEPS - 1}: span {spans} us, recorded busy "
              f"{busy} us")
        for name, us in s["top_op_types_us"].items():
            print(f"    {re.sub(r'^_', '', name):36s} {us:7.1f} us per micro-step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
