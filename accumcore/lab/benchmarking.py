"""Benchmark vocabulary and analysis, and the paired timings that book chapter 7 runs live.

The suite that measures (timing, floors, the overhead breakdown, peak-memory subprocesses, the
micro-batch probe) lives in ``benchmarks/suite.py`` and its front end ``benchmarks/run.py``;
it writes ``results.json``. This module holds what both sides share and what the book needs:
the configuration names and targets, the benchmark models and data, the trace counter and the
paired, interleaved timings (:func:`paired_rounds`, :func:`fit_epoch`, :func:`paired_ratio`,
:func:`paired_verdict`; run live in chapter 7), what the paired benchmark scripts share
(:func:`benchmark_parser`, :func:`compiled_sgd`, :func:`paired_rounds_with_cpu`,
:func:`ratio_text`, :func:`target_text`), and the analysis of ``results.json`` (ratios,
targets, tables, plots).

``benchmarks/run.py`` is the command-line front end (JSON, Markdown and PNG output) and the
book's benchmark reference page shows its tables; chapter 7 reads no committed file.

Throughput (samples per second; every configuration processes the same in-memory data)
    For a model (``"mlp"``: 784-256-256-10, ``"conv"``: a small conv net), a micro-batch b and
    K micro-batches per update (B = K * b), the configurations of :data:`CONFIGS`:

    ``fit_b`` (1) plain ``keras.Model.fit`` at batch b; ``fit_B`` (2) plain ``fit`` at
    B = K * b; ``keras_ga`` (3) plain ``fit`` at b with the Keras optimizer's
    ``gradient_accumulation_steps=K``; ``accum_fit`` (4) :class:`~accumcore.AccumModel`
    ``fit`` at b; ``loop_function`` (5) ``AccumTrainer.fit(mode="function")`` (a tf.function
    per micro-batch) and ``loop_graph`` (5) ``mode="graph"`` (the whole epoch in one
    tf.function); ``window`` (6) ``AccumTrainer.window_step`` (one call per window) and
    ``window_xla`` (6) the same with ``jit_compile=True``; ``eager`` (7)
    ``AccumTrainer.fit(mode="eager")``; the floors (8), the same forward+backward passes with
    no accumulation and no optimizer, compiled like their counterpart (:data:`FLOOR_OF`):
    ``floor_function`` (a tf.function per micro-batch), ``floor_graph`` (the whole epoch),
    ``floor_window`` (one tf.function per window, split in the graph exactly like
    ``window_step``) and ``floor_window_xla``; and ``floor_B``, the same passes *unsplit*
    (one pass of B per call), so that ``floor_window / floor_B`` is what splitting costs.
    The minimal correct accumulator (9) of ``benchmarks/minimal.py`` (gradient of the summed
    loss, ``assign_add`` of it and of the weight, a counter, one ``tf.cond`` that applies),
    compiled like its counterpart (:data:`MINIMAL_OF`): ``minimal_function``,
    ``minimal_graph`` and ``minimal_window``: the floor for "cost of accumulating". And the
    ``fit`` variants ``keras_ga_spe`` / ``accum_fit_spe`` (3)/(4) at a large
    ``steps_per_execution`` (32) and ``accum_fit_xla`` (4) with ``jit_compile=True``.

    All configurations of one (model, b) are timed in one process, **interleaved**: every
    repeat runs each configuration once, in a rotated order, so slow phases of a shared machine
    hit all of them alike. One warm-up run per configuration (tracing, XLA compilation, first
    allocations) is excluded. ``fit`` configurations are timed from ``on_epoch_begin`` to
    ``on_epoch_end`` (``fit``'s per-call set-up excluded), all share ``steps_per_execution``
    and ``jit_compile=False``; loops are timed over the whole call. The floors reduce every
    gradient with one ``reduce_sum`` (returned), so graph optimisers cannot prune the backward
    pass; that costs one read of the gradients, less than accumulating them.

Peak memory (bytes, ``tf.config.experimental.get_memory_info(device)["peak"]``)
    Each configuration runs in a fresh subprocess (``python benchmarks/suite.py memory ...``):
    plain training at batch K * b against accumulation of K micro-batches of b, for the
    ``window_step`` split, the ``tf.function`` loop and ``AccumModel``'s ``train_step``. The
    stats are reset after one warm-up step (so weights, optimizer slots and accumulators are
    counted, tracing is not). On CPU the child sets ``TF_CPU_ALLOCATOR_USE_BFC=true``, without
    which TensorFlow keeps no allocator statistics for ``CPU:0``.

Graph operations (a count, independent of machine noise)
    :func:`count_ops`: the operations of each entry point's traced function (nested functions
    and both ``tf.cond`` branches included, see :func:`graph_op_count`) against the minimal
    accumulator's, traced the same way.

Tracing
    How often each compiled function is traced over 3 epochs of a dataset whose last batch is
    ragged: counted in Python, by the number of times the step's body (the loss, or
    ``train_step``) runs while a graph is being built.

Unit tests (seconds; full mode only)
    The fast unit tests as the README runs them (``pytest tests -m "not slow" -n 2``), in a
    subprocess, after everything else: pytest's own duration and counts
    (:func:`pytest_summary`), against :data:`UNIT_TESTS_SECONDS_TARGET`.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import pathlib
import re
import time
import tokenize
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import accumcore
from accumcore import AccumModel, AccumTrainer
from accumcore.lab import experiments
from accumcore.lab.data import load_mnist

#: Every throughput configuration, as name -> (number in the issue, description).
CONFIGS: dict[str, tuple[str, str]] = {
    "fit_b": ("1", "plain fit at b"),
    "fit_B": ("2", "plain fit at B = K*b"),
    "keras_ga": ("3", "fit, Keras gradient_accumulation_steps=K"),
    "accum_fit": ("4", "accumcore AccumModel.fit"),
    "loop_function": ("5", "accumcore tf.function loop"),
    "loop_graph": ("5", "accumcore whole-epoch tf.function"),
    "window": ("6", "accumcore window_step"),
    "window_xla": ("6", "accumcore window_step, XLA"),
    "eager": ("7", "accumcore eager loop"),
    "floor_function": ("8", "floor: tf.function per micro-batch"),
    "floor_graph": ("8", "floor: whole-epoch tf.function"),
    "floor_window": ("8", "floor: tf.function per window"),
    "floor_window_xla": ("8", "floor: per window, XLA"),
    "floor_B": ("8", "floor: one pass at B per call"),
    "minimal_function": ("9", "minimal accumulator: tf.function per micro-batch"),
    "minimal_graph": ("9", "minimal accumulator: whole-epoch tf.function"),
    "minimal_window": ("9", "minimal accumulator: tf.function per window"),
    "keras_ga_spe": ("3", "fit, Keras gradient_accumulation_steps=K, large steps_per_execution"),
    "accum_fit_spe": ("4", "accumcore AccumModel.fit, large steps_per_execution"),
    "accum_fit_xla": ("4", "accumcore AccumModel.fit, jit_compile=True"),
}
#: Configurations that depend only on (model, b), not on K.
K_INDEPENDENT = ("fit_b", "floor_function", "floor_graph")
#: Each compiled accumcore configuration and the floor compiled the same way.
FLOOR_OF: dict[str, str] = {
    "loop_function": "floor_function",
    "loop_graph": "floor_graph",
    "window": "floor_window",
    "window_xla": "floor_window_xla",
}
#: Each compiled AccumTrainer configuration and the minimal accumulator (9) compiled the same
#: way (``benchmarks/minimal.py``): the floor for "cost of accumulating".
MINIMAL_OF: dict[str, str] = {
    "loop_function": "minimal_function",
    "loop_graph": "minimal_graph",
    "window": "minimal_window",
}
#: Every accumcore configuration.
ACCUMCORE_CONFIGS = ("accum_fit", "accum_fit_spe", "accum_fit_xla", "loop_function",
                     "loop_graph", "window", "window_xla", "eager")
#: Memory methods (plain training at K*b, and three ways to accumulate K micro-batches of b).
MEMORY_METHODS: dict[str, str] = {
    "plain": "plain train_on_batch at B = K*b",
    "accum_window": "accumcore window_step (split in the graph)",
    "accum_loop": "accumcore tf.function loop (train_micro_batch)",
    "accum_model": "accumcore AccumModel train_step (train_on_batch)",
}
#: The experiments of the suite (``run_suite(only=...)``, ``benchmarks/run.py --only``).
EXPERIMENTS = ("throughput", "breakdown", "memory", "tracing", "probe", "ops", "unit_tests")
#: Target thresholds of the issue.
FIT_RATIO_TARGET = 1.0  # (4)/(3): AccumModel.fit at least as fast as Keras's own accumulation
FLOOR_RATIO_TARGET = 0.95  # best of (5)/(6) over the floor (8): overhead <= 5 %
MINIMAL_RATIO_TARGET = 0.95  # best compiled AccumTrainer path over the minimal accumulator (9)
OPS_RATIO_TARGET = 1.5  # graph ops per traced micro-step <= 1.5 x the minimal accumulator's
MEMORY_RATIO_TARGET = 1.05  # accumulation peak <= 1.05 x (plain b peak + one copy of weights)
#: Traces a compiled function needs over 3 epochs with a ragged last window, one per input
#: shape it sees (a full and a ragged window for ``window_step``), none after the first epoch.
MAX_TRACES = 2

LOSS = "sparse_categorical_crossentropy"
#: Why XLA configurations of convolutional models are not timed on a CPU.
XLA_CPU_SKIP_REASON = (
    "not timed on CPU: XLA:CPU runs these convolution gradients 20-80x slower than "
    "TensorFlow's own CPU kernels (measured while sizing the suite: 12-50 samples/s against "
    "about 1700), which would take most of the suite's time; XLA is timed for the MLP here "
    "and for every model on a GPU"
)
SCHEMA_VERSION = 1
#: The prefix of the JSON line a memory subprocess prints (``benchmarks/suite.py``).
MEMORY_TAG = "ACCUMCORE_MEMORY_RESULT "
#: The prefix of the JSON line a probe subprocess prints (``benchmarks/suite.py``).
PROBE_TAG = "ACCUMCORE_PROBE_RESULT "


# ---------------------------------------------------------------------------- data & models
INPUT_SHAPES: dict[str, tuple[int, ...]] = {"mlp": (784,), "conv": (28, 28, 1)}


def benchmark_data(kind: str, n: int, source: str = "mnist", seed: int = 0
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``n`` samples for model ``kind``: float32 inputs in [0, 1] and int32 labels 0..9.

    Args:
        kind: ``"mlp"`` (inputs ``(n, 784)``) or ``"conv"`` (``(n, 28, 28, 1)``).
        n: number of samples (at most 60 000 for MNIST).
        source: ``"mnist"`` (the training set, via :func:`accumcore.lab.data.load_mnist`) or
            ``"synthetic"`` (seeded uniform noise and random labels; the benchmarks' speed and
            memory do not depend on the values).
    """
    shape = INPUT_SHAPES[_check_kind(kind)]
    if source == "mnist":
        if n > 60_000:
            raise ValueError(f"`n`={n} exceeds MNIST's 60 000 training samples.")
        data = load_mnist(verbose=False)
        x = (data.x_train[:n].astype("float32") / 255.0).reshape((n, *shape))
        y = data.y_train[:n].astype("int32")
        return x, y
    if source == "synthetic":
        rng = np.random.default_rng(seed)
        x = rng.random((n, *shape), dtype=np.float32)
        y = rng.integers(0, 10, size=n).astype("int32")
        return x, y
    raise ValueError(f"Unknown data `source`={source!r}; expected 'mnist' or 'synthetic'.")


def _check_kind(kind: str) -> str:
    if kind not in INPUT_SHAPES:
        raise ValueError(f"Unknown model `kind`={kind!r}; expected one of {list(INPUT_SHAPES)}.")
    return kind


def build_model(kind: str, *, filters: Sequence[int] = (16, 32),
                model_cls: Callable[..., keras.Model] = keras.Model, **kwargs: Any
                ) -> keras.Model:
    """The benchmark model ``kind`` (seed 0): the MNIST MLP 784-256-256-10 or the conv net."""
    if _check_kind(kind) == "mlp":
        return experiments.mlp(model_cls=model_cls, **kwargs)
    return experiments.conv_net(filters=tuple(filters), model_cls=model_cls, **kwargs)


def trainable_bytes(model: keras.Model) -> int:
    """Bytes of one copy of the model's trainable weights."""
    return int(sum(np.prod(v.shape) * np.dtype(v.dtype).itemsize
                   for v in model.trainable_variables))


def batched_dataset(x: np.ndarray, y: np.ndarray, batch: int) -> tf.data.Dataset:
    """``(x, y)`` in batches of ``batch`` samples, in order (the last may be smaller),
    prefetched: the datasets the benchmarks train on."""
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).prefetch(2)


# ---------------------------------------------------------------------------- tracing
#: For each compiled mode (``fit(mode=...)``'s "function" and "graph", and "window" for
#: ``window_step``), the ``AccumTrainer.compiled_function`` entry it runs. ``mode="eager"``
#: compiles nothing.
COMPILED_ENTRY: dict[str, str] = {"function": "micro_batch", "graph": "epoch", "window": "window"}


def trainer_traces(trainer: AccumTrainer, mode: str) -> int:
    """Traces so far of the ``tf.function`` ``trainer`` runs for ``mode`` (a key of
    :data:`COMPILED_ENTRY`); 0 before that function is made (the micro-step is made on the
    first compiled micro-batch).

    Raises:
        ValueError: for a ``mode`` that compiles nothing or does not exist.
    """
    if mode not in COMPILED_ENTRY:
        raise ValueError(f"mode={mode!r} runs no compiled function; use one of "
                         f"{sorted(COMPILED_ENTRY)}.")
    try:
        function = trainer.compiled_function(COMPILED_ENTRY[mode])
    except ValueError:  # the mode is checked above: its function is not made yet
        return 0
    return function.experimental_get_tracing_count()


def traced_in_first_epoch_only(record: dict[str, Any]) -> bool:
    """Whether a :func:`count_traces` record's function was traced in the first epoch only and
    at most twice (once for the full and once for the ragged batch shape): then no later epoch
    pays to build it again, and a ragged last batch costs at most one extra trace."""
    return record["total"] <= MAX_TRACES and not any(record["per_epoch"][1:])


def count_traces(samples: int = 200, b: int = 16, k: int = 4, epochs: int = 3,
                 data: str = "synthetic", xla: bool = True) -> list[dict[str, Any]]:
    """Traces of each compiled entry point per epoch, over ``epochs`` epochs (MLP): of
    ``AccumModel``'s train step, and of the ``tf.function`` each ``AccumTrainer`` loop runs
    (``compiled_function``).

    ``samples`` should not be a multiple of b nor of K * b, so that the last micro-batch and
    the last window are ragged. Returns one record per entry point: ``entry`` (its name),
    ``per_epoch`` (the new traces in each epoch: a trace after the first epoch means the
    function was built again, which costs time in every epoch that does it) and ``total``.
    """
    x, y = benchmark_data("mlp", samples, data)
    ds_b = batched_dataset(x, y, b)
    ds_big = batched_dataset(x, y, k * b)
    records = []

    def record(entry: str, counts: list[int]) -> None:
        per_epoch = [counts[0]] + [counts[i] - counts[i - 1] for i in range(1, len(counts))]
        records.append({
            "entry": entry, "per_epoch": per_epoch, "total": counts[-1],
            "samples": samples, "micro_batch": b, "accum_steps": k,
        })

    # AccumModel.fit (numpy input, Keras's own batching: the last batch is ragged)
    model = build_model("mlp", model_cls=AccumModel, accum_steps=k)
    model.compile(keras.optimizers.Adam(1e-3), LOSS)
    traced = count_step_traces(model)
    counts = []
    for _ in range(epochs):
        model.fit(x, y, batch_size=b, epochs=1, verbose=0, shuffle=False)
        counts.append(len(traced))
    record("AccumModel.fit", counts)
    # AccumTrainer loops: the traces of the tf.function each runs (`compiled_function`)
    for mode in ("function", "graph"):
        trainer = AccumTrainer(build_model("mlp"), keras.optimizers.Adam(1e-3), LOSS,
                               accum_steps=k)
        counts = []
        for _ in range(epochs):
            trainer.fit(ds_b, epochs=1, mode=mode, verbose=0)
            counts.append(trainer_traces(trainer, mode))
        record(f"AccumTrainer.fit(mode='{mode}')", counts)
    for jit in (False, True) if xla else (False,):
        trainer = AccumTrainer(build_model("mlp"), keras.optimizers.Adam(1e-3), LOSS,
                               accum_steps=k, jit_compile=jit)
        counts = []
        for _ in range(epochs):
            for xb, yb in ds_big:
                trainer.window_step(xb, yb)
            counts.append(trainer_traces(trainer, "window"))
        record("AccumTrainer.window_step" + (" (XLA)" if jit else ""), counts)
    return records


def count_step_traces(model: keras.Model) -> list[int]:
    """Count the traces of ``model``'s train step (its class's, or the one
    ``accumcore.accumulate`` gave it): returns a list that gets one item per trace, from
    ``fit`` or ``train_on_batch`` (the step's Python runs only while a graph is traced).
    Call it after ``accumulate`` and before the first ``fit``."""
    step = model.train_step
    traced: list[int] = []

    def counted_step(data):
        if not tf.executing_eagerly():
            traced.append(1)
        return step(data)

    object.__setattr__(model, "train_step", counted_step)  # on the instance, as accumulate
    return traced


# ---------------------------------------------------------------------------- graph operations
#: The entry points whose traced graphs are counted. Each name maps to the minimal variant it
#: is compared with and whether the 1.5x target applies (Keras's own steps are references,
#: reported only).
OP_ENTRIES: dict[str, tuple[str, bool]] = {
    "AccumModel.fit train_step": ("step", True),
    "AccumTrainer.fit(mode='function') micro-step": ("step", True),
    "AccumTrainer.fit(mode='graph') epoch": ("epoch", True),
    "AccumTrainer.window_step": ("window", True),
    "keras.Model.fit train_step (no accumulation)": ("step", False),
    "keras.Model.fit train_step, gradient_accumulation_steps=K": ("step", False),
}
#: What each minimal variant is (``benchmarks/minimal.py``).
MINIMAL_VARIANTS: dict[str, str] = {
    "step": "one micro-batch per call",
    "epoch": "a whole dataset per call (while loop over the iterator)",
    "window": "one window per call (split in the graph)",
}


def graph_op_types(concrete: Any) -> dict[str, int]:
    """``{op type: count}`` over the same nodes as :func:`graph_op_count` (most frequent first)."""
    graph_def = concrete.graph.as_graph_def()
    types: dict[str, int] = {}
    nodes = [*graph_def.node, *(n for f in graph_def.library.function for n in f.node_def)]
    for node in nodes:
        types[node.op] = types.get(node.op, 0) + 1
    return dict(sorted(types.items(), key=lambda kv: (-kv[1], kv[0])))


def graph_op_count(concrete: Any) -> int:
    """Graph operations of a traced ``tf.function`` (a ``ConcreteFunction``), nested included.

    The count is ``len(graph_def.node)`` of the function's own graph plus ``len(node_def)`` of
    every function in that GraphDef's library: the branches of each ``tf.cond`` (both are
    counted, whichever runs), the condition and body of each ``tf.while_loop``, and any nested
    ``tf.function``. Nodes are counted as traced, before Grappler's graph optimisations (which
    prune and fold some of them at run time); the count depends on the model's layers and the
    optimizer, not on the batch size.
    """
    graph_def = concrete.graph.as_graph_def()
    return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)


def count_ops(minimal_cls: Callable[..., Any], kind: str = "mlp", b: int = 16, k: int = 4,
              filters: Sequence[int] = (16, 32)) -> list[dict[str, Any]]:
    """Graph operations of every entry point in :data:`OP_ENTRIES` and of the minimal one.

    Each entry point is run once on synthetic data (so every variable exists), then its traced
    function is counted with :func:`graph_op_count`: ``AccumModel.fit``'s ``train_step`` and
    Keras's (traced in a ``tf.function`` of their own, for one batch ``(x, y)`` with the batch
    dimension unknown), the ``tf.function`` micro-step that ``AccumTrainer.fit(mode="function")``
    calls, the whole-epoch function of ``mode="graph"`` (one traced micro-step inside a while
    loop) and the function of ``window_step`` for one window of K * b samples (one traced micro-step
    inside a loop over the K slices, plus one update). Each is compared with the minimal
    accumulator ``minimal_cls`` (``benchmarks/minimal.MinimalAccumulator``) traced the same way.
    Adam(1e-3) throughout.

    Returns:
        One record per entry point: ``entry``, ``model``, ``ops``, ``variant`` (the minimal
        variant compared with), ``minimal_ops``, ``ratio`` = ops / minimal_ops and ``target``
        (whether the ``OPS_RATIO_TARGET`` applies), ``extra_op_types`` = ``{op type:
        count over the minimal's}`` (negative: fewer), largest first.
    """
    x, y = benchmark_data(kind, b * k, "synthetic")
    x_spec = tf.TensorSpec((None, *INPUT_SHAPES[_check_kind(kind)]), tf.float32)
    y_spec = tf.TensorSpec((None,), tf.int32)
    ds = batched_dataset(x, y, b)
    xw, yw = tf.constant(x), tf.constant(y)

    def model(**kw: Any) -> keras.Model:
        return build_model(kind, filters=filters, **kw)

    mini = minimal_cls(model(), keras.optimizers.Adam(1e-3), LOSS, k)
    minimal_fns = {
        "step": mini.step.get_concrete_function(x_spec, y_spec),
        "epoch": mini.epoch.get_concrete_function(ds),
        "window": mini.window.get_concrete_function(xw, yw),
    }
    minimal = {v: graph_op_count(fn) for v, fn in minimal_fns.items()}
    minimal_types = {v: graph_op_types(fn) for v, fn in minimal_fns.items()}
    counts: dict[str, Any] = {}  # entry -> ConcreteFunction

    def train_step_ops(m: keras.Model, optimizer: keras.optimizers.Optimizer) -> int:
        m.compile(optimizer, LOSS, jit_compile=False)
        m.fit(x, y, batch_size=b, epochs=1, verbose=0, shuffle=False)  # builds every variable
        return tf.function(m.train_step).get_concrete_function((x_spec, y_spec))

    names = list(OP_ENTRIES)
    counts[names[0]] = train_step_ops(model(model_cls=AccumModel, accum_steps=k),
                                      keras.optimizers.Adam(1e-3))
    trainer = AccumTrainer(model(), keras.optimizers.Adam(1e-3), LOSS, accum_steps=k)
    trainer.fit(ds, epochs=1, mode="function", verbose=0)
    counts[names[1]] = trainer.compiled_function("micro_batch").get_concrete_function(
        x_spec, y_spec, None)
    trainer = AccumTrainer(model(), keras.optimizers.Adam(1e-3), LOSS, accum_steps=k)
    trainer.fit(ds, epochs=1, mode="graph", verbose=0)
    counts[names[2]] = trainer.compiled_function("epoch").get_concrete_function(ds)
    trainer = AccumTrainer(model(), keras.optimizers.Adam(1e-3), LOSS, accum_steps=k)
    trainer.window_step(xw, yw)
    counts[names[3]] = trainer.compiled_function("window").get_concrete_function(
        xw, yw, None, b)  # window_step's size: ceil(K * b / K) = b
    counts[names[4]] = train_step_ops(model(), keras.optimizers.Adam(1e-3))
    counts[names[5]] = train_step_ops(
        model(), keras.optimizers.Adam(1e-3, gradient_accumulation_steps=k))
    records = []
    for entry, concrete in counts.items():
        variant, target = OP_ENTRIES[entry]
        ops = graph_op_count(concrete)
        types = graph_op_types(concrete)
        extra = {t: n - minimal_types[variant].get(t, 0) for t, n in types.items()}
        extra.update({t: -n for t, n in minimal_types[variant].items() if t not in types})
        records.append({"entry": entry, "model": kind, "ops": ops, "variant": variant,
                        "minimal_ops": minimal[variant], "ratio": ops / minimal[variant],
                        "target": target, "micro_batch": b, "accum_steps": k,
                        "extra_op_types": dict(sorted(
                            ((t, n) for t, n in extra.items() if n), key=lambda kv: -kv[1]))})
    return records


# ---------------------------------------------------------------------------- analysis
def _throughput_record(results: dict, model: str, b: int, k: int | None,
                       config: str) -> dict | None:
    """The throughput record of ``config`` in the cell (model, b, K), if measured."""
    for rec in results.get("throughput", []):
        if (rec["model"], rec["micro_batch"], rec["config"]) == (model, b, config) and (
            config in K_INDEPENDENT or rec["accum_steps"] == k
        ):
            return rec
    return None


def _median(results: dict, model: str, b: int, k: int | None, config: str) -> float | None:
    rec = _throughput_record(results, model, b, k, config)
    return None if rec is None else rec["median"]


def _best(results: dict, model: str, b: int, k: int | None, config: str) -> float | None:
    """The fastest repeat of a configuration (samples/s): interference only slows a run."""
    rec = _throughput_record(results, model, b, k, config)
    return max(rec["samples_per_s"]) if rec and rec.get("samples_per_s") else None


#: The speed targets of issue 19, one tuple each (name, numerator configuration, denominator
#: configuration, models, the threshold in the headline cell mlp b=16 K=4, the threshold in
#: every other cell of those models).
LEAN_SPEED_TARGETS = (
    ("AccumModel.fit / Keras gradient_accumulation_steps", "accum_fit", "keras_ga",
     ("mlp", "conv"), 1.0, 0.95),
    ("AccumModel.fit / Keras gradient_accumulation_steps, large steps_per_execution",
     "accum_fit_spe", "keras_ga_spe", ("mlp", "conv"), 1.0, 0.95),
    ("graph loop / minimal accumulator", "loop_graph", "minimal_graph", ("mlp",), 0.95, 0.95),
)
#: The cell where issue 19's headline thresholds apply.
LEAN_HEADLINE_CELL = ("mlp", 16, 4)


def lean_targets(results: dict) -> list[dict[str, Any]]:
    """Issue 19's targets against ``results``: one record per check.

    Speed: for each ratio of :data:`LEAN_SPEED_TARGETS` and each cell, the best-of-N ratio
    (fastest repeat over fastest repeat; the repeats are interleaved, and interference only
    ever slows a run) beside the ratio of the medians; decided on the best-of-N ratio.
    Graph operations: ``AccumModel.fit``'s ``train_step`` against Keras's accumulating one.
    Code size: :func:`code_size` as recorded in ``results["code"]``.
    Keys: ``target``, ``cell``, ``best``, ``median``, ``threshold``, ``met``, and
    ``at_most`` (``True``: the value must not exceed the threshold; absent: reach it) and
    ``digits`` (decimals to show a float value with; absent: 3).
    """
    rows: list[dict[str, Any]] = []
    for name, num, den, models, headline, other in LEAN_SPEED_TARGETS:
        for model, b, k in throughput_cells(results):
            if model not in models:
                continue
            best_n, best_d = _best(results, model, b, k, num), _best(results, model, b, k, den)
            med_n, med_d = _median(results, model, b, k, num), _median(results, model, b, k, den)
            if not (best_n and best_d):
                continue
            threshold = headline if (model, b, k) == LEAN_HEADLINE_CELL else other
            ratio = best_n / best_d
            rows.append({"target": name, "cell": f"{model} b={b} K={k}", "best": ratio,
                         "median": med_n / med_d if med_n and med_d else None,
                         "threshold": threshold, "met": ratio >= threshold})
    ops = {(r["model"], r["entry"]): r["ops"] for r in results.get("ops") or []}
    for model in sorted({m for m, _ in ops}):
        mine = ops.get((model, "AccumModel.fit train_step"))
        keras_ga = ops.get((model, "keras.Model.fit train_step, gradient_accumulation_steps=K"))
        if mine and keras_ga:
            rows.append({"target": "train_step graph operations <= Keras's accumulating one",
                         "cell": f"{model}: {mine} vs {keras_ga}", "best": mine / keras_ga,
                         "median": None, "threshold": 1.0, "at_most": True,
                         "met": mine <= keras_ga})
    tests = results.get("unit_tests")
    if tests and tests.get("seconds"):
        rows.append({"target": "fast unit tests (seconds)", "cell": unit_tests_cell(tests),
                     "best": tests["seconds"], "median": None,
                     "threshold": UNIT_TESTS_SECONDS_TARGET, "at_most": True, "digits": 1,
                     "met": tests["seconds"] <= UNIT_TESTS_SECONDS_TARGET
                     and not (tests["failed"] or tests["errors"]) and tests["passed"] > 0})
    code = results.get("code")
    if code:
        for key, label, limit in (("largest_class", "largest class (lines)", 299),
                                  ("longest_function", "longest function (lines)", 60),
                                  ("code_lines", "library code lines", 2651)):
            value, where = code[key]
            rows.append({"target": label, "cell": where, "best": value, "median": None,
                         "threshold": limit, "at_most": True, "met": value <= limit})
    return rows


#: The most seconds the fast unit tests (``pytest -m "not slow" -n 2``, as the README runs
#: them) may take on the project's 2-core machine, issue 19's target.
UNIT_TESTS_SECONDS_TARGET = 180.0


def pytest_summary(output: str) -> dict[str, Any]:
    """pytest's counts and its own duration from the summary line at the end of ``output``
    (``"607 passed, 64 warnings in 213.80s (0:03:33)"``).

    Returns:
        ``{"passed", "failed", "errors", "skipped": int, "seconds": float}`` (counts pytest
        did not print are 0).

    Raises:
        ValueError: if ``output`` holds no summary line (pytest crashed or was killed).
    """
    lines = [ln for ln in output.splitlines() if re.search(r"\bin [0-9.]+s\b", ln)]
    if not lines:
        raise ValueError("no pytest summary line ('... passed ... in N.NNs') in the output: "
                         + output[-500:])
    line = lines[-1]
    counts = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
    for number, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", line):
        counts["errors" if word.startswith("error") else word] = int(number)
    counts["seconds"] = float(re.search(r"\bin ([0-9.]+)s\b", line).group(1))
    return counts


def paired_ratio(reference: Sequence[float], seconds: Sequence[float], *,
                 resamples: int = 2000, seed: int = 0) -> dict[str, float]:
    """Throughput of one configuration over a reference timed in the same rounds.

    Each round times both back to back, so the per-round ratios ``reference[i] / seconds[i]``
    cancel a slow phase of a shared machine.

    Args:
        reference: seconds of the reference, one per round, in round order.
        seconds: the configuration's seconds in the same rounds (as many as ``reference``).
        resamples: bootstrap resamplings of the rounds for the interval.
        seed: the resampling's seed (the interval is reproducible).

    Returns:
        A dict of four keys (a ratio above 1 means faster than the reference).

        * ``"median"``: the median of the per-round ratios;
        * ``"low"``, ``"high"``: its 95 % bootstrap interval (percentile method);
        * ``"rounds"``: the number of rounds.
    """
    if len(reference) != len(seconds) or not len(seconds):
        raise ValueError(f"paired_ratio needs the same, non-zero number of rounds: "
                         f"{len(reference)} reference and {len(seconds)} timed")
    ratios = np.asarray(reference, dtype=float) / np.asarray(seconds, dtype=float)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(ratios), size=(resamples, len(ratios)))
    medians = np.median(ratios[picks], axis=1)
    return {"median": float(np.median(ratios)), "low": float(np.percentile(medians, 2.5)),
            "high": float(np.percentile(medians, 97.5)), "rounds": len(ratios)}


def paired_rounds(runs: Mapping[str, Callable[[], float]], rounds: int, *, warmup: int = 1
                  ) -> dict[str, list[float]]:
    """Time several configurations in interleaved rounds (A B C, B C A, C A B, ...).

    Every round calls each run once, in an order rotated by one from the round before;
    :func:`paired_ratio` then compares them round by round.

    Args:
        runs: ``{name: run}``; ``run()`` does the work once (e.g. one epoch) and returns its
            seconds (float > 0), timed as it sees fit (:func:`fit_epoch` times an epoch).
        rounds: timed rounds (int >= 1).
        warmup: untimed calls of each run before the first round (tracing, first allocations).

    Returns:
        ``{name: [seconds of round 1, round 2, ...]}``, in the order of ``runs``.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"`rounds` must be an int >= 1, got {rounds!r}.")
    if not runs:
        raise ValueError("`runs` is empty: pass at least one {name: run} entry.")
    names = list(runs)
    for name in names:
        for _ in range(warmup):
            runs[name]()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            seconds[name].append(float(runs[name]()))
    return seconds


def fit_epoch(model: keras.Model, x: Any, y: Any, batch_size: int) -> Callable[[], float]:
    """A run for :func:`paired_rounds`: one epoch of ``model.fit(x, y, batch_size=...)``, in
    order, silent; it returns the seconds from ``on_epoch_begin`` to ``on_epoch_end`` (the
    epoch's steps, without ``fit``'s per-call set-up)."""
    stamps: dict[str, float] = {}

    class EpochClock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            stamps["begin"] = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            stamps["end"] = time.perf_counter()

    clock = EpochClock()

    def run() -> float:
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0,
                  callbacks=[clock])
        return stamps["end"] - stamps["begin"]

    return run


def paired_verdict(ratio: dict[str, float], *, faster: str, slower: str,
                   tie: str = "a tie", digits: int | None = 2) -> str:
    """The words for a :func:`paired_ratio`: ``faster`` when its whole 95 % interval lies
    above 1, ``slower`` when it lies below 1, ``tie`` when it contains 1 (the difference is
    within what the rounds can resolve). The interval is rounded to ``digits`` decimals first
    (``None``: unrounded), so the words match the interval you print with that many digits:
    "[0.71, 1.00]" is a tie."""
    low, high = ratio["low"], ratio["high"]
    if digits is not None:
        low, high = round(low, digits), round(high, digits)
    if low > 1:
        return faster
    if high < 1:
        return slower
    return tie


def ratio_text(ratio: Mapping[str, float]) -> str:
    """A :func:`paired_ratio` as the benchmark scripts print it: ``"median [low, high]"``,
    three decimals each."""
    return f"{ratio['median']:.3f} [{ratio['low']:.3f}, {ratio['high']:.3f}]"


def target_text(ratio: Mapping[str, float], target: float | None) -> str:
    """The verdict printed after a :func:`ratio_text`: ``" (target >= T: met)"`` when the
    ratio's whole 95 % interval reaches ``target`` (a throughput ratio), ``" (target >= T: not
    met)"`` otherwise, ``""`` when ``target`` is ``None`` (no target)."""
    if target is None:
        return ""
    return f" (target >= {target}: {'met' if ratio['low'] >= target else 'not met'})"


def paired_rounds_with_cpu(runs: Mapping[str, Callable[[], float]], rounds: int, *,
                           warmup: int = 1
                           ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """:func:`paired_rounds`, also measuring the CPU seconds of every timed call.

    Args:
        runs, rounds, warmup: as :func:`paired_rounds`.

    Returns:
        ``(seconds, cpu_seconds)``: ``seconds`` as :func:`paired_rounds` returns it;
        ``cpu_seconds``, ``{name: [seconds per round]}``, the CPU time the process used during
        each timed call (``time.process_time``: every thread; the warm-up calls left out). On a
        shared machine it moves much less with the other load than the wall seconds do.
    """
    cpu: dict[str, list[float]] = {name: [] for name in runs}

    def with_cpu(name: str, run: Callable[[], float]) -> Callable[[], float]:
        def timed() -> float:
            start = time.process_time()
            wall = run()
            cpu[name].append(time.process_time() - start)
            return wall

        return timed

    seconds = paired_rounds({name: with_cpu(name, run) for name, run in runs.items()}, rounds,
                            warmup=warmup)
    return seconds, {name: times[warmup:] for name, times in cpu.items()}


def compiled_sgd(model: keras.Model, *, steps_per_execution: int,
                 micro_batch_size: int | str | None = None,
                 jit_compile: bool | str = "auto") -> keras.Model:
    """``model`` compiled as the ``fit`` benchmarks compile it: ``SGD(0.01)``, :data:`LOSS`,
    ``steps_per_execution``, ``jit_compile``; then, unless ``micro_batch_size`` is ``None``
    (plain Keras), ``accumcore.accumulate(model, micro_batch_size=micro_batch_size)`` (an int
    b or ``"auto"``). Returns ``model``."""
    model.compile(keras.optimizers.SGD(0.01), LOSS, steps_per_execution=steps_per_execution,
                  jit_compile=jit_compile)
    if micro_batch_size is not None:
        accumcore.accumulate(model, micro_batch_size=micro_batch_size)
    return model


def benchmark_parser(description: str, *, rounds: int, samples: int | None = None,
                     samples_help: str | None = None,
                     out_help: str = "write the figures as JSON here"
                     ) -> argparse.ArgumentParser:
    """The command line the paired benchmark scripts share: ``--rounds`` (int, default
    ``rounds``: timed interleaved rounds), ``--samples`` (int, default ``samples``; only when
    ``samples`` is given) and ``--out`` (a JSON file to write; default none). A script adds its
    own options to the parser returned."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=rounds)
    if samples is not None:
        parser.add_argument("--samples", type=int, default=samples, help=samples_help)
    parser.add_argument("--out", help=out_help)
    return parser


def unit_tests_cell(record: dict) -> str:
    """How a unit-test timing is shown in a target row: its counts."""
    failed = record["failed"] + record["errors"]
    return f"{record['passed']} passed" + (f", {failed} failed" if failed else "")


def check_cost(results: dict) -> list[dict[str, Any]]:
    """What the per-micro-batch NaN/Inf check costs, from the breakdown (one process, the
    variants interleaved): per breakdown cell, best-of-N throughput ratios with and without
    the check (``nonfinite=UNCHECKED``, ``benchmarks/suite.py``).

    Keys: ``cell``; ``graph`` and ``graph_unchecked`` (``AccumTrainer.fit(mode="graph")``
    over the minimal accumulator's whole-epoch function); ``fit`` and ``fit_unchecked``
    (``AccumModel.fit`` over Keras's ``gradient_accumulation_steps``); ``None`` where a
    variant was not measured.
    """
    by_cell: dict[tuple, dict[str, float]] = {}
    for rec in results.get("breakdown") or []:
        if rec.get("samples_per_s"):
            cell = (rec["model"], rec["micro_batch"], rec["accum_steps"])
            by_cell.setdefault(cell, {})[rec["variant"]] = max(rec["samples_per_s"])
    pairs = {"graph": ("accumcore", "optimizer"),
             "graph_unchecked": ("accumcore_unchecked", "optimizer"),
             "fit": ("fit_accumcore", "fit_keras_ga"),
             "fit_unchecked": ("fit_unchecked", "fit_keras_ga")}
    return [{"cell": f"{model} b={b} K={k}",
             **{key: best[num] / best[den] if num in best and den in best else None
                for key, (num, den) in pairs.items()}}
            for (model, b, k), best in by_cell.items()]


def code_size(package_dir: str | None = None) -> dict[str, Any]:
    """Sizes of the library's source (``accumcore/`` without ``lab/``): issue 19's targets.

    Returns ``{"largest_class": (lines, "file:Class"), "longest_function": (lines,
    "file:function"), "code_lines": (n, "N files"), "files": {"file": code lines}}``: classes
    and functions by their line span (docstrings included); code lines without docstrings,
    comments and blank lines (``files``: per module, largest first).
    """
    root = pathlib.Path(package_dir or pathlib.Path(accumcore.__file__).parent)
    files = sorted(p for p in root.rglob("*.py") if "lab" not in p.relative_to(root).parts)
    classes, functions, per_file = [(0, "")], [(0, "")], {}
    for path in files:
        source = path.read_text()
        docstrings: set[int] = set()
        for node in ast.walk(ast.parse(source)):
            body = getattr(node, "body", None)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)) and body and isinstance(
                    body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
                    body[0].value.value, str):
                docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
            span = (getattr(node, "end_lineno", 0) or 0) - getattr(node, "lineno", 0) + 1
            where = f"{path.relative_to(root.parent)}:{getattr(node, 'name', '')}"
            if isinstance(node, ast.ClassDef):
                classes.append((span, where))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((span, where))
        code: set[int] = set()
        skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                tokenize.DEDENT, tokenize.ENDMARKER)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type not in skip:
                code.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docstrings)
        per_file[str(path.relative_to(root.parent))] = len(code)
    return {"largest_class": max(classes), "longest_function": max(functions),
            "code_lines": (sum(per_file.values()), f"{len(files)} files"),
            "files": dict(sorted(per_file.items(), key=lambda item: -item[1]))}


def throughput_cells(results: dict) -> list[tuple[str, int, int]]:
    """The (model, b, K) cells present in ``results``, in run order."""
    cells = []
    for rec in results.get("throughput", []):
        if rec["accum_steps"] is not None:
            cell = (rec["model"], rec["micro_batch"], rec["accum_steps"])
            if cell not in cells:
                cells.append(cell)
    return cells


def throughput_ratios(results: dict) -> list[dict[str, Any]]:
    """The issue's throughput ratios for every (model, b, K) cell.

    Keys per cell: ``fit_vs_keras`` = (4)/(3); ``best_compiled`` = the fastest of (5)/(6),
    ``vs_floor`` = its throughput over the floor compiled the same way (8); ``per_floor`` =
    that ratio for each compiled configuration; ``best_accum`` = fastest accumcore
    configuration and ``vs_large_batch`` = its throughput over plain fit at B (2);
    ``large_vs_small`` = (2)/(1) and ``small_vs_large`` = (1)/(2); ``split_price`` =
    ``floor_window`` / ``floor_B``: K passes of b against one pass of B, both one
    ``tf.function`` call per update and no accumulation, i.e. what splitting the batch costs
    by itself.
    """
    rows = []
    for model, b, k in throughput_cells(results):
        def med(config: str, _m=model, _b=b, _k=k) -> float | None:
            return _median(results, _m, _b, _k, config)

        def ratio(num: float | None, den: float | None) -> float | None:
            return num / den if num and den else None

        per_floor = {c: ratio(med(c), med(f)) for c, f in FLOOR_OF.items()}
        per_minimal = {c: ratio(med(c), med(f)) for c, f in MINIMAL_OF.items()}
        fast = {c: med(c) for c in MINIMAL_OF if med(c) and med(MINIMAL_OF[c])}
        best_vs_minimal = max(fast, key=fast.get) if fast else None
        compiled = {c: med(c) for c in FLOOR_OF if med(c)}
        best_compiled = max(compiled, key=compiled.get) if compiled else None
        accum = {c: med(c) for c in ACCUMCORE_CONFIGS if med(c)}
        best_accum = max(accum, key=accum.get) if accum else None
        rows.append({
            "model": model, "micro_batch": b, "accum_steps": k, "batch": b * k,
            "fit_vs_keras": ratio(med("accum_fit"), med("keras_ga")),
            "fit_vs_keras_spe": ratio(med("accum_fit_spe"), med("keras_ga_spe")),
            "fit_xla_vs_fit": ratio(med("accum_fit_xla"), med("accum_fit")),
            "best_vs_minimal": best_vs_minimal,
            "vs_minimal": per_minimal.get(best_vs_minimal) if best_vs_minimal else None,
            "per_minimal": per_minimal,
            "best_compiled": best_compiled,
            "vs_floor": per_floor.get(best_compiled) if best_compiled else None,
            "per_floor": per_floor,
            "best_accum": best_accum,
            "vs_large_batch": ratio(med(best_accum), med("fit_B")) if best_accum else None,
            "large_vs_small": ratio(med("fit_B"), med("fit_b")),
            "small_vs_large": ratio(med("fit_b"), med("fit_B")),
            "split_price": ratio(med("floor_window"), med("floor_B")),
        })
    return rows


#: The per-cell ratios that :func:`ratio_summary` ranges over, one tuple each (key in a
#: :func:`throughput_ratios` row, description, target or None).
SUMMARY_RATIOS: tuple[tuple[str, str, float | None], ...] = (
    ("fit_vs_keras", "(4)/(3): AccumModel.fit / fit with Keras's accumulation, "
                     "steps_per_execution=1", FIT_RATIO_TARGET),
    ("fit_vs_keras_spe", "(4)/(3) at the large steps_per_execution", FIT_RATIO_TARGET),
    ("vs_minimal", "fastest compiled AccumTrainer path / minimal accumulator (9) compiled "
                   "the same way",
     MINIMAL_RATIO_TARGET),
    ("vs_floor", "fastest of (5)/(6) / its floor (8) compiled the same way",
     FLOOR_RATIO_TARGET),
    ("vs_large_batch", "fastest accumcore path / plain fit at B (2)", None),
    ("small_vs_large", "plain fit at b (1) / plain fit at B (2)", None),
    ("split_price", "floor split into K micro-batches / the same passes unsplit", None),
    ("fit_xla_vs_fit", "AccumModel.fit with jit_compile=True / without", None),
)


def ratio_summary(results: dict) -> list[dict[str, Any]]:
    """One row per ratio of :data:`SUMMARY_RATIOS`: its range over the suite's cells.

    Keys: ``key``, ``label``, ``cells`` (how many cells have the ratio), ``low``, ``median``,
    ``high``, ``target`` and ``met`` (cells at or above the target; None without a target).
    Ratios that no cell has are left out.
    """
    rows = throughput_ratios(results)
    summary = []
    for key, label, target in SUMMARY_RATIOS:
        values = sorted(r[key] for r in rows if r.get(key) is not None)
        if not values:
            continue
        summary.append({
            "key": key, "label": label, "cells": len(values), "low": values[0],
            "median": float(np.median(values)), "high": values[-1], "target": target,
            "met": None if target is None else sum(v >= target for v in values),
        })
    return summary


def memory_table(results: dict) -> dict[str, dict[int, int]]:
    """``{method: {K: peak_bytes}}`` from the memory records (failed runs left out)."""
    table: dict[str, dict[int, int]] = {}
    for rec in results.get("memory", []):
        if rec.get("peak_bytes") is not None:
            table.setdefault(rec["method"], {})[rec["accum_steps"]] = rec["peak_bytes"]
    return table


def memory_budget(results: dict) -> float | None:
    """The memory target in bytes: 1.05 x (plain b's peak + one copy of the weights)."""
    plain = memory_table(results).get("plain", {})
    weights = next((r["weights_bytes"] for r in results.get("memory", [])
                    if r.get("weights_bytes")), None)
    if 1 not in plain or weights is None:
        return None
    return MEMORY_RATIO_TARGET * (plain[1] + weights)


def evaluate_targets(results: dict) -> list[dict[str, Any]]:
    """Check every target of the issue against ``results``.

    Returns one record per check: ``{"target", "cell", "value", "threshold", "met", "note"}``
    (``met`` is None for figures that are reported without a threshold).
    """
    checks: list[dict[str, Any]] = []

    def add(target: str, cell: str, value: float | None, threshold: float | None,
            met: bool | None, note: str = "") -> None:
        checks.append({"target": target, "cell": cell, "value": value,
                       "threshold": threshold, "met": met, "note": note})

    spe = (results.get("settings") or {}).get("large_steps_per_execution")
    for row in throughput_ratios(results):
        cell = f"{row['model']} b={row['micro_batch']} K={row['accum_steps']}"
        v = row["fit_vs_keras"]
        add("(4)/(3) fit vs Keras accumulation", cell, v, FIT_RATIO_TARGET,
            None if v is None else v >= FIT_RATIO_TARGET, "steps_per_execution=1")
        v = row["fit_vs_keras_spe"]
        if v is not None:
            add("(4)/(3) fit vs Keras accumulation, large steps_per_execution", cell, v,
                FIT_RATIO_TARGET, v >= FIT_RATIO_TARGET, f"steps_per_execution={spe}")
        v = row["vs_minimal"]
        if v is not None:
            add("best compiled AccumTrainer vs minimal accumulator (9)", cell, v,
                MINIMAL_RATIO_TARGET, v >= MINIMAL_RATIO_TARGET,
                f"best: {row['best_vs_minimal']} vs {MINIMAL_OF[row['best_vs_minimal']]}")
        v = row["vs_floor"]
        add("best of (5)/(6) vs floor (8)", cell, v, FLOOR_RATIO_TARGET,
            None if v is None else v >= FLOOR_RATIO_TARGET,
            f"best: {row['best_compiled']}" if row["best_compiled"] else "")
        add("best accumcore / plain fit at B (2)", cell, row["vs_large_batch"], None, None,
            f"best: {row['best_accum']}" if row["best_accum"] else "")
        if row["fit_xla_vs_fit"] is not None:
            add("AccumModel.fit jit_compile=True / without", cell, row["fit_xla_vs_fit"], None,
                None)
    for rec in results.get("ops") or []:
        cell = f"{rec['model']} {rec['entry']}"
        note = f"{rec['ops']} vs {rec['minimal_ops']} ops (minimal {rec['variant']})"
        add("graph ops <= 1.5 x minimal accumulator's" if rec["target"]
            else "graph ops / minimal accumulator's (Keras, reference)", cell, rec["ratio"],
            OPS_RATIO_TARGET if rec["target"] else None,
            rec["ratio"] <= OPS_RATIO_TARGET if rec["target"] else None, note)
    table = memory_table(results)
    budget = memory_budget(results)
    for method, peaks in table.items():
        if method == "plain":
            ks = sorted(peaks)
            if len(ks) > 1:
                add("plain B peak grows with K", f"plain K={ks[0]}..{ks[-1]}",
                    peaks[ks[-1]] / peaks[ks[0]], None, None,
                    f"K x {ks[-1] // ks[0]}")
            continue
        if budget is not None:
            worst = max(peaks.values())
            add("accumulation peak <= 1.05 x (plain b + weights)", method,
                worst / (budget / MEMORY_RATIO_TARGET),
                MEMORY_RATIO_TARGET, worst <= budget, "value: worst K, in units of plain b + "
                "weights")
        if len(peaks) > 1:
            flat = max(peaks.values()) / min(peaks.values())
            add("accumulation peak flat in K (max/min)", method, flat, MEMORY_RATIO_TARGET,
                flat <= MEMORY_RATIO_TARGET)
    for rec in results.get("tracing", []):
        add("traces <= 2, none after epoch 1", rec["entry"], rec["total"], MAX_TRACES,
            traced_in_first_epoch_only(rec), f"per epoch {rec['per_epoch']}")
    return checks


def throughput_table(results: dict, model: str) -> tuple[list[str], list[list[str]]]:
    """``(headers, rows)``: median samples/s of every configuration (rows) per (b, K) cell.

    Each entry reads ``"12,345 (±6 %)"``: the median and half the range of the repeats in %
    of the median; ``"failed"`` for a configuration that raised, ``"skipped"`` for one left out
    on purpose (see its record's ``skipped``), ``"—"`` when not measured.
    """
    cells = [c for c in throughput_cells(results) if c[0] == model]
    by_key = {(r["model"], r["micro_batch"], r["accum_steps"], r["config"]): r
              for r in results.get("throughput", [])}
    headers = ["configuration", *(f"b={b}, K={k}" for _, b, k in cells)]
    rows = []
    for cfg, (num, label) in CONFIGS.items():
        row = [f"({num}) {label}"]
        for _, b, k in cells:
            rec = by_key.get((model, b, None if cfg in K_INDEPENDENT else k, cfg))
            if rec is None:
                row.append("—")
            elif rec.get("skipped"):
                row.append("skipped")
            elif rec.get("error") or not rec.get("median"):
                row.append("failed")
            else:
                row.append(f"{rec['median']:,.0f} (±{50 * rec['spread']:.0f} %)")
        if any(v != "—" for v in row[1:]):
            rows.append(row)
    return headers, rows


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|---" * len(headers) + "|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with aligned columns (for notebooks and terminals)."""
    table = [list(map(str, headers)), *[list(map(str, r)) for r in rows]]
    widths = [max(len(r[i]) for r in table) for i in range(len(headers))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*table[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*r) for r in table[1:]]
    return "\n".join(line.rstrip() for line in lines)


def load_results(path: str) -> dict[str, Any]:
    """Read a ``results.json`` written by ``benchmarks/run.py`` (checks the schema)."""
    with open(path, encoding="utf-8") as f:
        results = json.load(f)
    if results.get("schema") != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema {results.get('schema')!r}, expected "
                         f"{SCHEMA_VERSION}; re-run benchmarks/run.py.")
    for key in ("machine", "settings", "throughput", "memory", "tracing"):
        if key not in results:
            raise ValueError(f"{path}: missing {key!r}; re-run benchmarks/run.py.")
    return results


# ---------------------------------------------------------------------------- plots
def _cell_label(b: int, k: int) -> str:
    return f"b={b}, K={k} (B={b * k})"


def _cell_name(row: dict) -> str:
    return f"{row['model']} {_cell_label(row['micro_batch'], row['accum_steps'])}"


def plot_throughput(results: dict, model: str, ax=None):
    """Median samples/s of every configuration for ``model``: one row per configuration, one
    bar per (b, K) cell (horizontal, so that the configuration names stay readable)."""
    from accumcore.lab import plotting

    groups: dict[str, dict[str, float]] = {}
    for cfg, (num, label) in CONFIGS.items():
        series = {}
        for m, b, k in throughput_cells(results):
            if m == model:
                value = _median(results, m, b, k, cfg)
                if value:
                    series[_cell_label(b, k)] = value
        if series:
            groups[f"({num}) {label}"] = series
    if not groups:
        raise ValueError(f"No throughput results for model {model!r}.")
    return plotting.bars(ax, groups, title=f"Training throughput, {model} "
                         f"({results['device']}; median of {results['settings']['repeats']})",
                         xlabel="throughput (samples/s)", ylabel="configuration",
                         horizontal=True)


def _plot_cell_ratios(results: dict, ax, series: dict[str, str], *, title: str, xlabel: str,
                      reference: float, reference_label: str):
    from accumcore.lab import plotting

    groups = {_cell_name(row): {name: row[key] or np.nan for name, key in series.items()}
              for row in throughput_ratios(results)}
    if not groups:
        raise ValueError("No throughput results to plot.")
    ax = plotting.bars(ax, groups, title=title, xlabel=xlabel, ylabel="model and cell",
                       reference_line=reference, reference_label=reference_label,
                       horizontal=True)
    values = [v for g in groups.values() for v in g.values() if v == v]
    ax.set_xlim(0, 1.08 * max([reference, *values]))  # the reference line inside, not on the edge
    # Below the axes, under the x label: a figure the width of a book page keeps its width
    # for the bars (beside them, the legend would squeeze them; inside, it would cover one).
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.1),
              ncol=min(len(labels), 2), frameon=False)
    return ax


def plot_ratios(results: dict, ax=None):
    """The summary's throughput ratios per (model, b, K) cell (one row each), with 1 (as
    fast) marked. The maintainers' targets are in their report's tables, not in the figure."""
    return _plot_cell_ratios(
        results, ax,
        {"(4)/(3): AccumModel.fit / Keras accumulation": "fit_vs_keras",
         "best (5)/(6) / floor (8)": "vs_floor",
         "best accumcore / plain fit at B (2)": "vs_large_batch"},
        title=f"Throughput ratios on {results['device']} (higher is better)",
        xlabel="ratio of samples/s (1 = as fast)", reference=1.0,
        reference_label="1 = as fast")


def plot_split_cost(results: dict, ax=None):
    """What splitting B into K micro-batches costs: plain fit at b, and the fastest accumcore
    path, each over plain fit at B (one row per cell; 1 = as fast as one batch of B)."""
    return _plot_cell_ratios(
        results, ax,
        {"plain fit at b (1) / plain fit at B (2)": "small_vs_large",
         "fastest accumcore path / plain fit at B (2)": "vs_large_batch"},
        title=f"The price of splitting B into micro-batches ({results['device']})",
        xlabel="throughput relative to plain fit at B (1 = as fast)", reference=1.0,
        reference_label="1 = as fast as one batch of B")


def plot_vs_keras(results: dict, ax=None):
    """``AccumModel.fit`` over ``fit`` with Keras's own ``gradient_accumulation_steps``, at one
    and at many steps per execution (one row per cell; 1 = as fast as Keras)."""
    spe = (results.get("settings") or {}).get("large_steps_per_execution")
    return _plot_cell_ratios(
        results, ax,
        {"steps_per_execution=1": "fit_vs_keras",
         f"steps_per_execution={spe}": "fit_vs_keras_spe"},
        title=f"AccumModel.fit against Keras's own accumulation ({results['device']})",
        xlabel="throughput ratio (4)/(3) (1 = as fast as Keras)", reference=1.0,
        reference_label="1 = as fast as Keras")


def plot_memory(results: dict, ax=None):
    """Peak memory against K: plain batch K*b versus each accumulation method (the measured
    peaks only; the maintainers' budget is in their report's table)."""
    from accumcore.lab import plotting

    table = memory_table(results)
    if not table:
        raise ValueError("No memory results to plot.")
    ks = sorted({k for peaks in table.values() for k in peaks})
    series = {
        MEMORY_METHODS.get(m, m): [peaks.get(k, np.nan) / 2**20 for k in ks]
        for m, peaks in table.items()
    }
    b, filters = results["memory"][0]["micro_batch"], results["memory"][0].get("filters")
    model = f"conv net {tuple(filters)}, " if filters else ""
    ax = plotting.curves(ax, series, x=ks, logx=True,
                         title=f"Peak memory on {results['device']}, {model}micro-batch b={b}",
                         xlabel="K (micro-batches per update; plain batch = K x b)",
                         ylabel="peak allocator memory (MiB)")
    ax.set_xticks(ks, [str(k) for k in ks])
    return ax


# ---------------------------------------------------------------------------- split fit
#: What each reference of ``benchmarks/split_fit.py`` is, by its name in the record's ratios.
SPLIT_FIT_REFERENCES = {
    "keras_ga": "Keras's gradient_accumulation_steps (fit batches of b)",
    "micro_steps": "accumulate(accum_steps=K) (fit batches of b)",
    "plain_B": "plain fit at B (no accumulation)",
    "minimal_split": "a minimal hand-written split train_step (fit batches of B)",
}


def split_fit_rows(record: dict) -> list[dict[str, Any]]:
    """One row per (model, reference) of a ``benchmarks/split_fit.py`` record: the paired
    throughput ratio of split fit over the reference (``median``, ``low``, ``high``: its 95 %
    interval), the ``target`` (``None`` where there is none) and the ``verdict``: ``"met"``
    when the interval's lower end reaches the target, ``"missed"`` when its upper end stays
    below it, ``"undecided"`` when the interval spans it (``None`` without a target)."""
    rows = []
    for model in ("mlp", "conv", "lm", "mlp_jit", "conv_jit"):
        if model not in record:
            continue
        for name, p in record[model]["ratios"].items():
            reference = name.split("/")[1]
            target = record[model]["targets"].get(reference)
            verdict = None if target is None else (
                "met" if p["low"] >= target else "missed" if p["high"] < target
                else "undecided")
            rows.append({"model": model, "reference": reference, "median": p["median"],
                         "low": p["low"], "high": p["high"], "target": target,
                         "verdict": verdict})
    return rows


def plot_split_fit(record: dict, ax=None):
    """Split fit's throughput over each reference, per model: the paired median with its
    95 % interval, 1 (as fast) and each target marked."""
    import matplotlib.pyplot as plt

    rows = split_fit_rows(record)
    if not rows:
        raise ValueError("No split-fit results to plot.")
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    labels = [f"{r['model']}: over {SPLIT_FIT_REFERENCES[r['reference']]}" for r in rows]
    y = np.arange(len(rows))[::-1]
    medians = np.array([r["median"] for r in rows])
    errors = np.array([[r["median"] - r["low"] for r in rows],
                       [r["high"] - r["median"] for r in rows]])
    ax.barh(y, medians, xerr=errors, color="#4c72b0", capsize=3,
            label="paired median, 95 % interval")
    targets = [(yi, r["target"]) for yi, r in zip(y, rows, strict=True) if r["target"]]
    if targets:
        ax.scatter([t for _, t in targets], [yi for yi, _ in targets], marker="|", s=400,
                   color="#c44e52", zorder=3, label="target")
    ax.axvline(1.0, color="gray", linestyle="--", linewidth=1, label="1 = as fast")
    ax.set_yticks(y, labels)
    ax.set_xlabel("throughput ratio, split fit / reference (samples/s over samples/s)")
    ax.set_title("fit with micro_batch_size against its references (higher is faster)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, frameon=False)
    return ax
