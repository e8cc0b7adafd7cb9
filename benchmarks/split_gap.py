"""Where ``fit`` with ``micro_batch_size`` spends the time that the minimal in-step split does
not (issue 47): graph operations of both traced train steps, by op type, and paired timings of
variants that each take one piece of accumcore's split step away or add it to the minimal one.

Usage (repository root, the project's venv):

    python benchmarks/split_gap.py --ops                   # op counts only (no timing)
    python benchmarks/split_gap.py --rounds 21 --out FILE  # op counts and paired timings

The graphs are those ``fit`` runs: the ``tf.function`` ``multi_step_on_iterator`` that
``model.train_function`` calls (found through the closures of Keras's wrappers after one epoch;
with 4096 samples in batches of 64 Keras gives the batch a static shape ``(64, 784)``, so the
split step has no ``tf.cond`` for a last smaller micro-batch), counted with
:func:`accumcore.lab.benchmarking.graph_op_count` (nested functions, both branches of each
``tf.cond`` and each loop body included) and by op type. The timed variants, one epoch each
per round in a rotating order (MLP 784-256-256-10, b = 16, B = 64, Adam 1e-3, 4096 synthetic
samples):

* ``split``: ``accumcore.accumulate(model, micro_batch_size=16)``, ``fit(batch_size=64)``;
* ``split_unchecked``: the same with ``nonfinite=suite.UNCHECKED`` (no check of the window);
* ``minimal_split``: ``benchmarks/minimal.py``'s ``MinimalSplitModel`` (sums in the loop's
  variables), ``minimal_split_acc``: the same adding into one variable per weight;
* ``plus_tracker``, ``plus_counters``, ``plus_check``, ``plus_all``: :class:`PiecesSplitModel`,
  ``minimal_split_acc`` with accumcore's per-micro-batch bookkeeping added piece by piece: the
  loss tracker's total and count added per micro-batch and the metrics' results read per
  micro-batch (``tracker``); five scalar counters added per micro-batch and reset after the
  update (``counters``: the window's weight, samples and micro-step, the run's micro-batches
  and samples seen); the window's non-finite check with the update in a ``tf.cond``
  (``check``); all three (``all``).

Each epoch is timed in wall seconds and in the process's CPU seconds (every thread): on a
shared machine the CPU seconds move much less with the other load.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import accumcore  # noqa: E402
from accumcore.lab import benchmarking as bm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import suite  # noqa: E402
from minimal import MinimalSplitModel  # noqa: E402

MICRO, BATCH, SAMPLES = 16, 64, 4096
KINDS = ("split", "split_unchecked", "minimal_split", "minimal_split_acc", "plus_tracker",
         "plus_counters", "plus_check", "plus_all")
PIECES = {"plus_tracker": ("tracker",), "plus_counters": ("counters",), "plus_check": ("check",),
          "plus_all": ("tracker", "counters", "check")}


class PiecesSplitModel(MinimalSplitModel):
    """``MinimalSplitModel(accumulators=True)`` with some of accumcore's per-micro-batch
    bookkeeping added (``pieces``: ``"tracker"``, ``"counters"``, ``"check"``; see the module's
    docstring). Same updates as ``MinimalSplitModel``."""

    def __init__(self, model: keras.Model, loss: Any, micro_batch_size: int,
                 pieces: tuple[str, ...]) -> None:
        super().__init__(model, loss, micro_batch_size, accumulators=True)
        self.pieces = frozenset(pieces)
        self.counters = [tf.Variable(0.0, trainable=False)] + [
            tf.Variable(0, dtype=tf.int64, trainable=False) for _ in range(4)]

    def train_step(self, data: Any) -> dict:
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        b, variables = self.micro_batch_size, self.trainable_variables
        n = tf.shape(x)[0]

        def cut(t: tf.Tensor, i: tf.Tensor) -> tf.Tensor:
            begin = tf.stack([i * b] + [0] * (t.shape.rank - 1))
            piece = tf.slice(t, begin, [b] + [-1] * (t.shape.rank - 1))
            piece.set_shape(tf.TensorShape([b]).concatenate(t.shape[1:]))
            return piece

        def body(i, total):
            summed, grads = self._summed(cut(x, i), cut(y, i))
            for acc, g in zip(self.accumulators, grads, strict=True):
                acc.assign(acc + g)
            if "counters" in self.pieces:
                self.counters[0].assign_add(float(b))
                for counter in self.counters[1:]:
                    counter.assign_add(b)
            if "tracker" in self.pieces:
                self.loss_tracker.total.assign_add(summed)
                self.loss_tracker.count.assign_add(float(b))
                self.get_metrics_result()
            return i + 1, total + summed

        _, total = tf.while_loop(lambda i, *_: i < n // b, body,
                                 (tf.constant(0), tf.constant(0.0)), parallel_iterations=1)
        samples = tf.cast(n, tf.float32)

        def apply() -> tf.Tensor:
            self.optimizer.apply([acc.value() / samples for acc in self.accumulators],
                                 variables)
            return tf.constant(True)

        if "check" in self.pieces:
            finite = tf.math.is_finite(tf.add_n([tf.reduce_sum(a) for a in self.accumulators]))
            tf.cond(finite, apply, lambda: tf.constant(False))
        else:
            apply()
        for acc in self.accumulators:
            acc.assign(tf.zeros_like(acc))
        if "counters" in self.pieces:
            for counter in self.counters[:3]:
                counter.assign(tf.zeros_like(counter))
        if "tracker" not in self.pieces:
            self.loss_tracker.update_state(total / samples, sample_weight=samples)
        return self.get_metrics_result()


def compiled(kind: str, model_kind: str = "mlp") -> tuple[keras.Model, Any]:
    """``(model, (x, y))`` of one variant."""
    model = bm.build_model(model_kind)
    x, y = bm.benchmark_data(model_kind, SAMPLES, "synthetic")
    if kind in PIECES:
        model = PiecesSplitModel(model, bm.LOSS, MICRO, PIECES[kind])
        model.compile(keras.optimizers.Adam(1e-3), jit_compile=False)
        return model, (x, y)
    if kind.startswith("minimal_split"):
        model = MinimalSplitModel(model, bm.LOSS, MICRO, accumulators=kind.endswith("_acc"))
        model.compile(keras.optimizers.Adam(1e-3), jit_compile=False)
        return model, (x, y)
    model.compile(keras.optimizers.Adam(1e-3), bm.LOSS, jit_compile=False)
    nonfinite = suite.UNCHECKED if kind == "split_unchecked" else "raise"
    accumcore.accumulate(model, micro_batch_size=MICRO, nonfinite=nonfinite)
    return model, (x, y)


def epoch(model: keras.Model, data: Any) -> float:
    """Wall seconds of one epoch of ``fit``."""
    start = time.perf_counter()
    model.fit(*data, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return time.perf_counter() - start


def step_function(model: keras.Model, x: Any, y: Any) -> Any:
    """The concrete function of the ``tf.function`` ``multi_step_on_iterator`` that ``fit``
    ran (found through the closures of Keras's wrappers of ``model.train_function``), for an
    iterator over batches of ``(x, y)`` of ``BATCH`` samples, as ``fit`` traced it."""
    seen, todo = set(), [model.train_function]
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        if getattr(fn, "name", None) == "multi_step_on_iterator":
            batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH,
                                                                       drop_remainder=True)
            return fn.get_concrete_function(iter(batches))
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if callable(cell.cell_contents):
                    todo.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
    raise RuntimeError("multi_step_on_iterator not found in model.train_function")


def op_types(concrete: Any) -> dict[str, collections.Counter]:
    """Op types of a concrete function: ``"top"`` (its own graph), each nested function by
    name, and ``"all"`` (the sum; its total is :func:`bm.graph_op_count`)."""
    graph_def = concrete.graph.as_graph_def()
    out = {"top": collections.Counter(n.op for n in graph_def.node)}
    for f in graph_def.library.function:
        out[f.signature.name] = collections.Counter(n.op for n in f.node_def)
    out["all"] = sum(out.values(), collections.Counter())
    return out


def count(kind: str) -> dict[str, Any]:
    """The traced train step of ``kind`` after one short epoch: total ops, per function and
    by op type."""
    model, (x, y) = compiled(kind)
    x, y = x[:2 * BATCH], y[:2 * BATCH]
    epoch(model, (x, y))
    concrete = step_function(model, x, y)
    types = op_types(concrete)
    return {"ops": bm.graph_op_count(concrete),
            "functions": {name: sum(c.values()) for name, c in types.items()},
            "by_type": dict(types["all"].most_common())}


def ops_report(kinds: tuple[str, ...] = KINDS[:4]) -> dict:
    """:func:`count` of each of ``kinds``, printed with the op types that differ from
    ``minimal_split``'s."""
    counts = {kind: count(kind) for kind in kinds}
    base = counts["minimal_split"]["by_type"]
    for kind, c in counts.items():
        print(f"{kind:18s} ops {c['ops']:5d}; functions: " + ", ".join(
            f"{name[:40]} {n}" for name, n in sorted(c["functions"].items(),
                                                      key=lambda t: -t[1])), flush=True)
        if kind != "minimal_split":
            extra = {t: n - base.get(t, 0) for t, n in c["by_type"].items()}
            extra.update({t: -n for t, n in base.items() if t not in c["by_type"]})
            top = sorted(extra.items(), key=lambda t: -abs(t[1]))[:16]
            print("    over minimal_split: " + ", ".join(f"{t} {n:+d}" for t, n in top
                                                          if n), flush=True)
    return counts


def timings(rounds: int, kinds: tuple[str, ...] = KINDS) -> dict[str, Any]:
    """Paired rounds of ``kinds``: seconds per epoch and each one's throughput over
    ``minimal_split`` and over ``split``."""
    runs = {kind: functools.partial(epoch, *compiled(kind)) for kind in kinds}
    seconds, cpu = bm.paired_rounds_with_cpu(runs, rounds, warmup=2)
    ratios: dict[str, Any] = {}
    for clock, times in (("wall", seconds), ("cpu", cpu)):
        for reference in ("minimal_split", "split"):
            for kind in kinds:
                if kind != reference and reference in kinds:
                    ratios[f"{clock} {kind}/{reference}"] = p = bm.paired_ratio(
                        times[reference], times[kind])
                    print(f"{clock:4s} {kind + '/' + reference:32s} throughput "
                          f"{bm.ratio_text(p)}", flush=True)
    medians = {kind: 1000 * statistics.median(times) for kind, times in cpu.items()}
    print("CPU ms per epoch (median): " + ", ".join(f"{k} {v:.0f}" for k, v in medians.items()))
    return {"seconds": seconds, "cpu_seconds": cpu, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = bm.benchmark_parser(__doc__.split("\n\n")[0], rounds=21)
    parser.add_argument("--ops", action="store_true", help="count the graph ops only")
    parser.add_argument("--no-ops", action="store_true", help="time only")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    args = parser.parse_args(argv)
    record: dict[str, Any] = {"load_average": [os.getloadavg()]}
    if not args.no_ops:
        record["ops"] = ops_report()
    if not args.ops:
        record["timings"] = timings(args.rounds, tuple(args.kinds))
    record["load_average"].append(os.getloadavg())
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
