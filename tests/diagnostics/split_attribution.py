"""Where the split step's CPU time goes beyond the minimal in-step split: an attribution by
ablation (a DIAGNOSTIC: the ablated variants skip bookkeeping, never train like this).

``accumcore.accumulate(model, micro_batch_size=16)`` with ``fit(batch_size=64)`` ("split")
against ``benchmarks/minimal.py``'s ``MinimalSplitModel`` ("minimal_split"), and split with
one piece of accumcore's step taken away (``-piece``) or all of them at once ("all"). The
pieces are removed by replacing private functions of ``accumcore._impl`` while each variant's
train function is TRACED (the replacements read :data:`ACTIVE`, which holds the variant's
pieces only during its trace and its op count; every later epoch runs the graph traced then):

* ``tracker``: the loss tracker's two ``assign_add`` per micro-batch (``fitting._micro_batch``);
* ``metrics``: ``model.compute_metrics`` per micro-batch (compiled metrics, results read);
* ``weights``: the loss weights ``c_i`` (``gradients._weights``: ``denominators.loss_weights``)
  replaced by the micro-batch's samples;
* ``loss``: ``weights``, and the compiled loss (``compute_loss``) replaced by Keras's sparse
  cross-entropy of the micro-batch, mean over its samples;
* ``counters``: the run-long counters of ``rule.add`` (``micro_batches_seen``,
  ``samples_seen``); the window's own weight, samples and micro-step stay;
* ``check``: the window's non-finite check (``nonfinite=suite.UNCHECKED``);
* ``take``: ``state.take`` replaced by the minimal model's slice (no cast, no ``tf.stack`` of
  a cast ``start``);
* ``close_cond``: ``apply_window`` calls ``rule.close`` directly (no ``plan.decide``, no
  "due" ``tf.cond``); where the library closes a split batch with ``_close_split`` (which
  does just that) this variant is the same graph as ``split``: a null control;
* ``bare_close``: ``apply_window`` is one ``optimizer.apply`` of ``sum / W`` and the window's
  variables zeroed (no skip ``tf.cond``, no ``end`` counters).

``per_micro_batch`` takes away every piece that runs once per micro-batch (``tracker`` to
``take``); ``all`` every piece but ``close_cond`` (within ``bare_close``).

``rule.check_variables`` and the policy's ``fit_logs`` (``{}`` for ``"raise"``) add no graph
op (they run at trace time), and with a static batch of 64 the whole-versus-split ``tf.cond``
is decided at trace time too: the op counts show it.

Usage (repository root, the project's venv):

    python tests/diagnostics/split_attribution.py --ops            # op counts only (no timing)
    python tests/diagnostics/split_attribution.py --variants=-check,all --rounds 21
    python tests/diagnostics/split_attribution.py --rounds 15 --samples 8192 \\
        --out benchmarks/results/cpu/split_attribution.json

Each round times one epoch of every variant in a rotating order (MLP 784-256-256-10,
synthetic data, Adam 1e-3, B = 64, b = 16), in wall seconds and in the process's CPU seconds;
a figure is the paired median ratio with its 95 % bootstrap interval
(``accumcore.lab.benchmarking.paired_ratio``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
import warnings
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import accumcore  # noqa: E402
from accumcore._impl import fitting, gradients, rule, state  # noqa: E402
from accumcore._impl.denominators import LossWeights  # noqa: E402
from accumcore.lab import benchmarking as bm  # noqa: E402

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)
import suite  # noqa: E402
from minimal import MinimalSplitModel  # noqa: E402
from split_gap import op_types, step_function  # noqa: E402

MICRO, BATCH = 16, 64
PIECES = ("tracker", "metrics", "weights", "loss", "counters", "check", "take", "close_cond",
          "bare_close")
#: Every variant: the pieces taken away from split (minimal_split is the floor).
VARIANTS: dict[str, tuple[str, ...]] = {
    "minimal_split": (), "split": (),
    **{f"-{p}": (p,) for p in PIECES if p != "loss"},
    "-loss": ("loss", "weights"),
    "per_micro_batch": ("tracker", "metrics", "weights", "loss", "counters", "take"),
    "all": tuple(p for p in PIECES if p != "close_cond"),
}
#: The pieces of the variant being traced (read by the replacements at trace time).
ACTIVE: set[str] = set()
ORIGINAL = {"micro_batch": fitting._micro_batch, "weights": gradients._weights,
            "loss": fitting._compiled_loss, "add": rule.add, "take": state.take,
            "apply_window": state.AccumulationState.apply_window,
            "close_split": getattr(state.AccumulationState, "_close_split", None)}


def micro_batch(model, x, y, sample_weight, *, micro_batches=None):
    """``fitting._micro_batch`` without the ``tracker`` and/or ``metrics`` pieces."""
    if not ACTIVE & {"tracker", "metrics"}:
        return ORIGINAL["micro_batch"](model, x, y, sample_weight, micro_batches=micro_batches)
    out = fitting._gradients(model, x, y, sample_weight, model.accumulation,
                             micro_batches=micro_batches)
    tracker = fitting.loss_tracker(model)
    if "tracker" not in ACTIVE and tracker is not None:
        tracker.total.assign_add(out.weighted_loss)
        tracker.count.assign_add(out.log_weight)
    if "metrics" not in ACTIVE:
        model.compute_metrics(x, y, out.y_pred, sample_weight=sample_weight)
    return out


def weights(model, normalizer, denominators, forms, batch, y_pred, samples, *args, **kwargs):
    """``gradients._weights``, or (``weights``) ``c_i`` = the micro-batch's samples."""
    if "weights" not in ACTIVE:
        return ORIGINAL["weights"](model, normalizer, denominators, forms, batch, y_pred,
                                   samples, *args, **kwargs)
    count = tf.cast(samples, tf.float32)
    return LossWeights(count, count, [], count, False)


def compiled_loss(model, x, y, y_pred, sample_weight):
    """``fitting._compiled_loss``, or (``loss``) the sparse cross-entropy's mean."""
    if "loss" not in ACTIVE:
        return ORIGINAL["loss"](model, x, y, y_pred, sample_weight)
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, y_pred))


def add(window, counters, plan, grads, weight, samples, undivided=None):
    """``rule.add``, or (``counters``) without the run-long counters."""
    if "counters" not in ACTIVE:
        return ORIGINAL["add"](window, counters, plan, grads, weight, samples, undivided)
    for accumulator, g in zip(window.accumulators, grads, strict=True):
        rule.add_gradient(accumulator, g, False)
    window.weight.assign_add(weight)
    window.samples.assign_add(samples)
    window.micro_step.assign_add(1)
    return tf.constant(True)


def take(batch, start, length):
    """``state.take``, or (``take``) the minimal model's slice."""
    if "take" not in ACTIVE:
        return ORIGINAL["take"](batch, start, length)

    def cut(t):
        if t is None:
            return None
        piece = tf.slice(t, tf.stack([start] + [0] * (t.shape.rank - 1)),
                         [length] + [-1] * (t.shape.rank - 1))
        piece.set_shape(tf.TensorShape([length]).concatenate(t.shape[1:]))
        return piece

    return tf.nest.map_structure(cut, batch)


def apply_window(self, optimizer, variables=None):
    """``apply_window``, or (``close_cond``) ``rule.close`` directly, or (``bare_close``) one
    ``optimizer.apply`` of ``sum / W`` and the window zeroed."""
    if not ACTIVE & {"close_cond", "bare_close"}:
        return ORIGINAL["apply_window"](self, optimizer, variables)
    window, counters, _ = self._pieces_checked()
    plan, present = self.plan(optimizer), list(self._present.value)
    accumulated = list(self._variables.value)
    if "close_cond" in ACTIVE:
        return rule.close(window, counters, plan, optimizer, accumulated, present)
    scale = 1.0 / window.weight
    optimizer.apply([window.accumulators[i].value() * scale for i in present],
                    [accumulated[i] for i in present])
    for variable in window.variables:
        variable.assign(tf.zeros(variable.shape, variable.dtype))
    return tf.constant(True)


def close_split(self, optimizer):
    """``_close_split`` (the split's close, where the library has one: ``rule.close`` without
    the count's ``tf.cond``), or (``bare_close``) :func:`apply_window`'s bare close."""
    if "bare_close" not in ACTIVE:
        return ORIGINAL["close_split"](self, optimizer)
    return apply_window(self, optimizer)


def install() -> None:
    """Put the replacements in place (each runs the original unless its piece is active)."""
    fitting._micro_batch, gradients._weights = micro_batch, weights
    fitting._compiled_loss, rule.add, state.take = compiled_loss, add, take
    state.AccumulationState.apply_window = apply_window
    if ORIGINAL["close_split"] is not None:
        state.AccumulationState._close_split = close_split


@contextlib.contextmanager
def active(pieces: tuple[str, ...]):
    """The pieces taken away while the block runs (a trace)."""
    ACTIVE.clear()
    ACTIVE.update(pieces)
    try:
        yield
    finally:
        ACTIVE.clear()


def epoch(model: keras.Model, data: tuple) -> float:
    """Wall seconds of one epoch of ``fit`` (batches of 64, in order)."""
    start = time.perf_counter()
    model.fit(*data, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return time.perf_counter() - start


def built(variant: str, samples: int) -> tuple[keras.Model, tuple, dict]:
    """``(model, data, op counts)`` of one variant, traced under its pieces."""
    model = bm.build_model("mlp")
    data = bm.benchmark_data("mlp", samples, "synthetic")
    if variant == "minimal_split":
        model = MinimalSplitModel(model, bm.LOSS, MICRO)
        model.compile(keras.optimizers.Adam(1e-3), jit_compile=False)
    else:
        model.compile(keras.optimizers.Adam(1e-3), bm.LOSS, jit_compile=False)
        unchecked = "check" in VARIANTS[variant]
        accumcore.accumulate(model, micro_batch_size=MICRO,
                             nonfinite=suite.UNCHECKED if unchecked else "raise")
    with active(VARIANTS[variant]):
        epoch(model, data)  # traced here, once
        counts = ops(step_function(model, *data))
    return model, data, counts


def ops(concrete: Any) -> dict[str, Any]:
    """Graph ops of the traced step: total, inside the while body, the rest; and by type."""
    types = op_types(concrete)
    sizes = {name: sum(c.values()) for name, c in types.items() if name != "all"}
    body = sum(n for name, n in sizes.items() if "while_body" in name)
    conds = sum(types["all"][t] for t in ("If", "StatelessIf"))
    return {"total": bm.graph_op_count(concrete), "while_body": body,
            "outside_body": bm.graph_op_count(concrete) - body, "conds": conds,
            "by_type": dict(types["all"].most_common())}


def ratios(times: dict[str, list[float]]) -> dict[str, dict]:
    """Paired throughput ratios: every variant over split, split and all over minimal."""
    out = {f"{v}/split": bm.paired_ratio(times["split"], times[v])
           for v in times if v != "split"}
    for v in ("split", "all"):
        out[f"{v}/minimal_split"] = bm.paired_ratio(times["minimal_split"], times[v])
    return out


def shares(cpu: dict[str, dict]) -> dict[str, float]:
    """Each variant's CPU gain over split as a share of split's gap to the minimal one."""
    gap = cpu["minimal_split/split"]["median"] - 1.0
    return {name.split("/")[0]: (r["median"] - 1.0) / gap for name, r in cpu.items()
            if name.endswith("/split") and gap > 0}


def main(argv: list[str] | None = None) -> int:
    parser = bm.benchmark_parser(__doc__.split("\n\n")[0], rounds=15, samples=8192)
    parser.add_argument("--ops", action="store_true", help="count the graph ops only")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated, e.g. --variants=-check,all (split and "
                        "minimal_split always run)")
    args = parser.parse_args(argv)
    args.variants = args.variants.split(",")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    variants = ["minimal_split", "split", *(v for v in args.variants
                                            if v not in ("minimal_split", "split"))]
    install()
    warnings.filterwarnings("ignore", message="micro_batch_size=")  # counters taken away
    tf.get_logger().setLevel("ERROR")  # step_function's extra trace
    record: dict[str, Any] = {"load_average": [os.getloadavg()], "rounds": args.rounds,
                              "samples": args.samples, "variants": {
                                  v: list(VARIANTS[v]) for v in variants}}
    made = {v: built(v, args.samples if not args.ops else 2 * BATCH) for v in variants}
    record["ops"] = {v: counts for v, (_, _, counts) in made.items()}
    for v, c in record["ops"].items():
        print(f"{v:14s} ops {c['total']:5d}  while body {c['while_body']:4d}  outside "
              f"{c['outside_body']:4d}  conds {c['conds']}", flush=True)
    if not args.ops:
        runs = {v: functools.partial(epoch, model, data) for v, (model, data, _) in made.items()}
        wall, cpu = bm.paired_rounds_with_cpu(runs, args.rounds, warmup=1)
        record["seconds"], record["cpu_seconds"] = wall, cpu
        record["wall_ratios"], record["cpu_ratios"] = ratios(wall), ratios(cpu)
        record["cpu_share_of_gap"] = shares(record["cpu_ratios"])
        for name, r in record["cpu_ratios"].items():
            print(f"{name:26s} CPU {bm.ratio_text(r)}   wall "
                  f"{bm.ratio_text(record['wall_ratios'][name])}", flush=True)
    record["load_average"].append(os.getloadavg())
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
