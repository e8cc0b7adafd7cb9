"""The benchmark suite: throughput, overhead breakdown, peak memory, tracing, probe (issue 5).

``benchmarks/run.py`` is the command-line front end; this module does the measuring and is
also the child process of the memory and probe experiments (``python benchmarks/suite.py
memory ...``). The vocabulary (configuration names, targets), the models and data, and the
analysis of ``results.json`` live in :mod:`accumcore.lab.benchmarking`, which book chapter 7
imports; what is measured and how is described in that module's docstring.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import accumcore
from accumcore import AccumModel, AccumTrainer, NonFinitePolicy
from accumcore.lab.benchmarking import (
    CONFIGS,
    EXPERIMENTS,
    FLOOR_OF,
    INPUT_SHAPES,
    LOSS,
    MEMORY_METHODS,
    MEMORY_TAG,
    PROBE_TAG,
    SCHEMA_VERSION,
    XLA_CPU_SKIP_REASON,
    batched_dataset,
    benchmark_data,
    build_model,
    code_size,
    count_ops,
    count_traces,
    evaluate_targets,
    trainable_bytes,
)
from accumcore.lab.experiments import keras_loss

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from minimal import MinimalAccumulator  # noqa: E402


# ---------------------------------------------------------------------------- settings
@dataclass
class SuiteSettings:
    """What the suite measures; :meth:`full` and :meth:`quick_preset` are the two presets.

    Attributes:
        quick: the smoke-test preset (tiny sizes: checks the pipeline, not the speed).
        models: ``"mlp"`` and/or ``"conv"``.
        micro_batches: the micro-batch sizes b (samples).
        accum_steps: the K values.
        unit_samples: samples per timed unit, per model (raised to 2 windows of the largest B).
        repeats: timed repeats per configuration (the median is reported; >= 5 in full mode).
            Every repeat is one round over all configurations of a (model, b), interleaved.
        warmup: untimed runs per configuration before the timed ones (tracing, compilation and
            TensorFlow's own warm-up: the first 2-3 calls of a function are often slower).
        configs: the throughput configurations to time (default: all of :data:`CONFIGS`).
        xla_models_on_cpu: models whose XLA configurations are timed on a CPU (see
            :data:`XLA_CPU_SKIP_REASON`); on a GPU every model's are.
        steps_per_execution: shared by every ``fit`` configuration but the ``*_spe`` ones.
        large_steps_per_execution: ``steps_per_execution`` of ``keras_ga_spe`` and
            ``accum_fit_spe`` (how Keras users remove per-step overhead on small models).
        eager_fraction: the eager loop (7) is timed on this fraction of the timed unit
            (whole windows; at least 2): it is 5-15x slower than the rest and no target.
        ops_models: models whose graph operations are counted (:func:`count_ops`).
        conv_filters: filters of the throughput conv net.
        memory_micro_batch: b of the memory experiment (samples).
        memory_accum_steps: the K values of the memory experiment.
        memory_methods: keys of :data:`MEMORY_METHODS`.
        memory_filters: filters of the memory conv net (activations dominate its memory).
        memory_parallel: memory subprocesses run at once (CPU only; 1 on a GPU).
        tracing_samples: dataset size of the tracing experiment (ragged for b=16, B=64).
        tracing_xla: include ``window_step`` with ``jit_compile=True`` in the tracing count.
        probe: run the real largest-micro-batch probe (subprocess).
        probe_target: the target batch B of the probe (samples).
        probe_start: first micro-batch probed (samples).
        probe_multiple_of: probe only multiples of this (samples).
        probe_cpu_limit_mb: on CPU, the BFC allocator limit that plays the device's memory.
        unit_tests: time the fast unit tests (:func:`run_unit_tests`; minutes, full mode).
        data: ``"mnist"`` (``accumcore.lab.data.load_mnist``) or ``"synthetic"`` (seeded
            uniform noise of MNIST's shape: speed and memory do not depend on pixel values).
        device: ``"CPU:0"``, ``"GPU:0"``, or ``None`` to pick ``GPU:0`` when there is one.
    """

    quick: bool = False
    models: tuple[str, ...] = ("mlp", "conv")
    micro_batches: tuple[int, ...] = (16, 64)
    accum_steps: tuple[int, ...] = (4, 8)
    unit_samples: dict[str, int] = field(default_factory=lambda: {"mlp": 4096, "conv": 1024})
    repeats: int = 7
    warmup: int = 2
    configs: tuple[str, ...] = tuple(CONFIGS)
    xla_models_on_cpu: tuple[str, ...] = ("mlp",)
    steps_per_execution: int = 1
    large_steps_per_execution: int = 32
    eager_fraction: float = 0.25
    ops_models: tuple[str, ...] = ("mlp", "conv")
    conv_filters: tuple[int, ...] = (16, 32)
    memory_micro_batch: int = 64
    memory_accum_steps: tuple[int, ...] = (1, 2, 4, 8, 16)
    memory_methods: tuple[str, ...] = ("plain", "accum_window", "accum_loop", "accum_model")
    memory_filters: tuple[int, ...] = (32, 64)
    memory_parallel: int = 2
    tracing_samples: int = 200
    tracing_xla: bool = True
    probe: bool = True
    probe_target: int = 4096
    probe_start: int = 32
    probe_multiple_of: int = 32
    probe_cpu_limit_mb: int = 160
    unit_tests: bool = True
    data: str = "mnist"
    device: str | None = None

    @classmethod
    def full(cls, **overrides: Any) -> SuiteSettings:
        """The full suite (about 18 minutes on 2 quiet CPU cores, the unit tests' 3-4 included)."""
        return cls(**overrides)

    @classmethod
    def quick_preset(cls, **overrides: Any) -> SuiteSettings:
        """The smoke test: every experiment at toy size, XLA left out (it only compiles slowly)."""
        settings = {
            "quick": True,
            "models": ("mlp",),
            "micro_batches": (16,),
            "accum_steps": (4,),
            "unit_samples": {"mlp": 512, "conv": 256},
            "repeats": 3,
            "warmup": 1,
            "configs": tuple(c for c in CONFIGS if not c.endswith("_xla")),
            "memory_micro_batch": 16,
            "memory_accum_steps": (1, 2),
            "memory_methods": ("plain", "accum_window"),
            "memory_filters": (8, 16),
            "memory_parallel": 3,
            "tracing_samples": 72,
            "tracing_xla": False,
            "ops_models": ("mlp",),
            "probe": False,
            "unit_tests": False,
            "data": "synthetic",
        }
        settings.update(overrides)
        return cls(**settings)

    def resolved_device(self) -> str:
        if self.device:
            return self.device
        return "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"


# ---------------------------------------------------------------------------- machine
def machine_info() -> dict[str, Any]:
    """Describe the machine: CPU, cores, memory, GPUs, library versions, load average."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": np.__version__,
        "accumcore": accumcore.__version__,
        "cpu_count": os.cpu_count(),
    }
    try:
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        info["cpus_usable"] = os.cpu_count()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        info["cpu_model"] = names[0] if names else platform.processor()
    except OSError:  # pragma: no cover - not Linux
        info["cpu_model"] = platform.processor()
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            kb = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal"))
        info["memory_gib"] = round(kb / 2**20, 1)
    except (OSError, StopIteration):  # pragma: no cover - not Linux
        info["memory_gib"] = None
    gpus = []
    for gpu in tf.config.list_physical_devices("GPU"):
        try:
            details = tf.config.experimental.get_device_details(gpu)
        except Exception:  # noqa: BLE001 - details are optional
            details = {}
        gpus.append({"name": gpu.name, **{k: str(v) for k, v in details.items()}})
    info["gpus"] = gpus
    info["load_average"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return info


# ---------------------------------------------------------------------------- timing
@dataclass
class Case:
    """One timed configuration: ``run()`` processes ``samples`` samples, returns seconds."""

    name: str
    run: Callable[[], float]
    samples: int


class _EpochTimer(keras.callbacks.Callback):
    """Seconds from ``on_epoch_begin`` to ``on_epoch_end`` of the last epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = float("nan")
        self._start = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.seconds = time.perf_counter() - self._start


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved_medians(
    cases: Sequence[Case],
    repeats: int,
    *,
    warmup: int = 1,
    progress: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, dict[str, Any]]:
    """Time ``cases`` interleaved: ``warmup`` untimed runs each, then ``repeats`` rounds.

    Round r runs every case once, in the order rotated by r, so that a slow phase of a shared
    machine affects all cases alike. A case that raises is recorded with its error and
    skipped from then on.

    Returns:
        ``{name: {"seconds": [...], "samples_per_s": [...], "median": samples/s,
        "spread": (max - min) / median, "error": str | None}}``.
    """
    if repeats < 1:
        raise ValueError(f"`repeats` must be >= 1, got {repeats}.")
    out: dict[str, dict[str, Any]] = {
        c.name: {"seconds": [], "samples_per_s": [], "median": None, "spread": None,
                 "error": None, "samples": c.samples}
        for c in cases
    }
    say = progress or (lambda _msg: None)
    start = clock()

    def attempt(case: Case) -> float | None:
        if out[case.name]["error"] is not None:
            return None
        try:
            return case.run()
        except Exception as err:  # noqa: BLE001 - recorded, the suite goes on
            out[case.name]["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            say(f"    {case.name} failed: {out[case.name]['error']}")
            return None

    for w in range(warmup):
        took = {}
        for case in cases:
            t0 = clock()
            attempt(case)
            took[case.name] = clock() - t0
        slowest = sorted(took, key=took.get, reverse=True)[:3]
        say(f"  warm-up {w + 1}/{warmup} done ({clock() - start:.0f} s; slowest: "
            + ", ".join(f"{n} {took[n]:.1f} s" for n in slowest) + ")")
    for r in range(repeats):
        shift = r % len(cases)
        for case in list(cases[shift:]) + list(cases[:shift]):
            seconds = attempt(case)
            if seconds is not None:
                out[case.name]["seconds"].append(seconds)
                out[case.name]["samples_per_s"].append(case.samples / seconds)
        say(f"  round {r + 1}/{repeats} done ({clock() - start:.0f} s)")
    for rec in out.values():
        if rec["samples_per_s"]:
            rec["median"] = statistics.median(rec["samples_per_s"])
            rec["spread"] = (max(rec["samples_per_s"]) - min(rec["samples_per_s"])) / rec["median"]
    return out


def _fit_case(name: str, model: keras.Model, data: tf.data.Dataset, samples: int) -> Case:
    timer = _EpochTimer()

    def run() -> float:
        model.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[timer])
        return timer.seconds

    return Case(name, run, samples)


def _floor_step(model: keras.Model, loss_fn: keras.losses.Loss):
    """One forward + backward pass; returns (loss, sum of all gradient entries)."""

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        return loss, tf.add_n([tf.reduce_sum(g) for g in grads])

    return step


def floor_functions(model: keras.Model, k: int, *, loss: Any = LOSS
                    ) -> dict[str, Callable]:
    """The floor (8): K forward+backward passes, no accumulation, no optimizer.

    Returns ``tf.function`` s keyed like :data:`FLOOR_OF` 's values: ``"floor_function"`` (one
    micro-batch per call), ``"floor_graph"`` (a whole dataset per call), ``"floor_window"`` and
    ``"floor_window_xla"`` (one window of K micro-batches per call, split in the graph exactly
    like :meth:`~accumcore.AccumTrainer.window_step`).
    """
    step = _floor_step(model, keras_loss(loss))

    def epoch(dataset):
        total = tf.constant(0.0)
        for x, y in iter(dataset):  # a while loop over the iterator, like AccumTrainer._epoch
            value, consumed = step(x, y)
            total += value + consumed
        return total

    def window(x, y):
        n = tf.shape(x)[0]
        size = (n + k - 1) // k
        count = (n + size - 1) // size
        total = tf.constant(0.0)
        for i in tf.range(count):
            start = i * size
            value, consumed = step(x[start : start + size], y[start : start + size])
            total += value + consumed
        return total

    def micro(x, y):
        value, consumed = step(x, y)
        return value + consumed

    return {
        "floor_function": tf.function(micro, reduce_retracing=True),
        "floor_graph": tf.function(epoch),
        "floor_window": tf.function(window, reduce_retracing=True),
        "floor_window_xla": tf.function(window, reduce_retracing=True, jit_compile=True),
    }


def throughput_cases(
    kind: str,
    b: int,
    ks: Sequence[int],
    x: np.ndarray,
    y: np.ndarray,
    *,
    filters: Sequence[int] = (16, 32),
    steps_per_execution: int = 1,
    large_steps_per_execution: int = 32,
    eager_fraction: float = 1.0,
    learning_rate: float = 1e-3,
    configs: Iterable[str] = tuple(CONFIGS),
) -> list[Case]:
    """Every configuration of :data:`CONFIGS` for model ``kind``, micro-batch b and each K.

    Case names are the configuration names, suffixed ``@K{k}`` for the K-dependent ones.
    ``x``, ``y`` are the samples of one timed unit (a multiple of every B = K * b). Only the
    configurations in ``configs`` are built. The eager loop runs on the first
    ``eager_fraction`` of the samples (rounded to whole windows, at least 2); its rate is
    computed from the samples it ran.
    """
    wanted = set(configs)
    unknown = wanted - set(CONFIGS)
    if unknown:
        raise ValueError(f"Unknown throughput `configs` {sorted(unknown)}; expected names from "
                         f"{list(CONFIGS)}.")
    n = len(x)
    for k in ks:
        if n % (k * b):
            raise ValueError(f"{n} samples are not a multiple of B = {k} * {b}: use whole windows.")
    ds_b = batched_dataset(x, y, b)

    def model(**kw: Any) -> keras.Model:
        return build_model(kind, filters=filters, **kw)

    def adam(**kw: Any) -> keras.optimizers.Optimizer:
        return keras.optimizers.Adam(learning_rate, **kw)

    def compiled(m: keras.Model, opt: keras.optimizers.Optimizer, *, spe: int | None = None,
                 jit: bool = False) -> keras.Model:
        m.compile(opt, LOSS, steps_per_execution=spe or steps_per_execution, jit_compile=jit)
        return m

    cases = [_fit_case("fit_b", compiled(model(), adam()), ds_b, n)]
    floors = floor_functions(model(), max(ks))

    def loop(fn: Callable, data: tf.data.Dataset) -> Callable[[], float]:
        def run() -> float:
            def go() -> None:
                out = None
                for xb, yb in data:
                    out = fn(xb, yb)
                float(out)  # wait for the device

            return _timed(go)

        return run

    cases.append(Case("floor_function", loop(floors["floor_function"], ds_b), n))
    cases.append(Case("floor_graph",
                      lambda: _timed(lambda: float(floors["floor_graph"](ds_b))), n))
    for k in ks:
        tag = f"@K{k}"
        ds_big = batched_dataset(x, y, k * b)
        floor_k = floor_functions(model(), k)
        cases.append(_fit_case("fit_B" + tag, compiled(model(), adam()), ds_big, n))
        cases.append(_fit_case(
            "keras_ga" + tag, compiled(model(), adam(gradient_accumulation_steps=k)), ds_b, n))
        cases.append(_fit_case(
            "accum_fit" + tag, compiled(model(model_cls=AccumModel, accum_steps=k), adam()),
            ds_b, n))
        cases.append(_fit_case(
            "keras_ga_spe" + tag, compiled(model(), adam(gradient_accumulation_steps=k),
                                           spe=large_steps_per_execution), ds_b, n))
        cases.append(_fit_case(
            "accum_fit_spe" + tag, compiled(model(model_cls=AccumModel, accum_steps=k), adam(),
                                            spe=large_steps_per_execution), ds_b, n))
        if "accum_fit_xla" in wanted:  # XLA compiles at the first run: build only if timed
            cases.append(_fit_case(
                "accum_fit_xla" + tag, compiled(model(model_cls=AccumModel, accum_steps=k),
                                                adam(), jit=True), ds_b, n))
        n_eager = max(2, round(n * eager_fraction / (k * b))) * k * b
        n_eager = min(n, n_eager)
        ds_eager = batched_dataset(x[:n_eager], y[:n_eager], b)
        for mode in ("function", "graph", "eager"):
            trainer = AccumTrainer(model(), adam(), LOSS, accum_steps=k)
            name = "eager" if mode == "eager" else f"loop_{mode}"
            data = ds_eager if mode == "eager" else ds_b
            cases.append(Case(
                name + tag,
                (lambda t=trainer, md=mode, d=data: _timed(
                    lambda: t.fit(d, epochs=1, mode=md, verbose=0))),
                n_eager if mode == "eager" else n,
            ))
        # The minimal correct accumulator (9), compiled like (5) and (6): benchmarks/minimal.py.
        mini = MinimalAccumulator(model(), adam(), LOSS, k)
        cases.append(Case("minimal_function" + tag, lambda m=mini: _timed(
            lambda: m.fit_epoch(ds_b)), n))
        cases.append(Case("minimal_graph" + tag, lambda m=mini: _timed(
            lambda: float(m.epoch(ds_b))), n))
        mini_w = MinimalAccumulator(model(), adam(), LOSS, k)
        cases.append(Case("minimal_window" + tag, loop(mini_w.window, ds_big), n))
        for name, jit in (("window", False), ("window_xla", True)):
            trainer = AccumTrainer(model(), adam(), LOSS, accum_steps=k, jit_compile=jit)
            cases.append(Case(name + tag, loop(trainer.window_step, ds_big), n))
            floor = floor_k["floor_window_xla" if jit else "floor_window"]
            cases.append(Case(FLOOR_OF[name] + tag, loop(floor, ds_big), n))
        # The same passes unsplit: one pass of B per call (a fresh tf.function).
        floor_big = floor_functions(model(), k)["floor_function"]
        cases.append(Case("floor_B" + tag, loop(floor_big, ds_big), n))
    return [c for c in cases if c.name.partition("@")[0] in wanted]


def run_throughput(settings: SuiteSettings, progress: Callable[[str], None] = print
                   ) -> list[dict[str, Any]]:
    """Time every configuration for every (model, b, K) of ``settings``; one record each."""
    records: list[dict[str, Any]] = []
    on_cpu = settings.resolved_device().upper().startswith("CPU")
    for kind in settings.models:
        configs = list(settings.configs)
        skipped = []
        if on_cpu and kind not in settings.xla_models_on_cpu:
            skipped = [c for c in configs if c.endswith("_xla")]
            configs = [c for c in configs if c not in skipped]
        for b in settings.micro_batches:
            big = max(settings.accum_steps) * b
            n = max(settings.unit_samples[kind], 2 * big)
            n = -(-n // big) * big
            x, y = benchmark_data(kind, n, settings.data)
            progress(f"[throughput] {kind} b={b} K={list(settings.accum_steps)}: "
                     f"{n} samples per timed unit")
            cases = throughput_cases(kind, b, settings.accum_steps, x, y,
                                     filters=settings.conv_filters,
                                     steps_per_execution=settings.steps_per_execution,
                                     large_steps_per_execution=(
                                         settings.large_steps_per_execution),
                                     eager_fraction=settings.eager_fraction,
                                     configs=configs)
            timed = interleaved_medians(cases, settings.repeats, warmup=settings.warmup,
                                        progress=progress)
            for name, rec in timed.items():
                config, _, ktag = name.partition("@K")
                k = int(ktag) if ktag else None
                records.append({
                    "model": kind, "micro_batch": b, "accum_steps": k,
                    "batch": b * k if config == "fit_B" else b,
                    "config": config, "number": CONFIGS[config][0],
                    "label": CONFIGS[config][1], **rec,
                })
            for config in skipped:
                for k in settings.accum_steps:
                    records.append({
                        "model": kind, "micro_batch": b, "accum_steps": k, "batch": b,
                        "config": config, "number": CONFIGS[config][0],
                        "label": CONFIGS[config][1], "seconds": [], "samples_per_s": [],
                        "median": None, "spread": None, "error": None, "samples": n,
                        "skipped": XLA_CPU_SKIP_REASON,
                    })
            del cases
            gc.collect()
            keras.backend.clear_session()
    return records


# ---------------------------------------------------------------------------- breakdown
#: Variants of the overhead breakdown, each adding one ingredient of accumulation to the one
#: before (all a whole epoch in one tf.function over ``iter(dataset)``, like ``mode="graph"``).
BREAKDOWN: dict[str, str] = {
    "floor": "forward+backward only (the floor)",
    "accumulate": "+ assign_add of every gradient into an accumulator",
    "optimizer": "+ Adam once per window (the minimal accumulator)",
    "accumcore_unchecked": "accumcore AccumTrainer.fit(mode='graph'), NaN/Inf check removed",
    "accumcore": "accumcore AccumTrainer.fit(mode='graph')",
    "adam_each": "reference: Adam after every micro-batch (no accumulation)",
    "fit_keras_ga": "model.fit, Keras gradient_accumulation_steps=K",
    "fit_unchecked": "AccumModel.fit, NaN/Inf check removed",
    "fit_accumcore": "AccumModel.fit",
}
#: The breakdown variants that are diagnostics, not ingredients (no "added ms").
BREAKDOWN_REFERENCES = ("adam_each", "fit_keras_ga", "fit_unchecked", "fit_accumcore")


class UncheckedPolicy(NonFinitePolicy):
    """The ``"raise"`` policy with the window's non-finite check removed: every window is
    judged finite (what a ``LossScaleOptimizer``'s close runs on one device), so a model given
    ``nonfinite=UNCHECKED`` traces the shipped path without that check, and the paired timing
    measures what the check costs. A diagnostic only: never train like this (a NaN window is
    applied)."""

    def judge_window(self, sums) -> tf.Tensor:
        """float32 scalar 0: the window is never found non-finite."""
        return tf.constant(0.0)


#: The unchecked twin of ``nonfinite="raise"`` (a public :class:`accumcore.NonFinitePolicy`).
UNCHECKED = UncheckedPolicy("raise_unchecked", freeze=True)


def breakdown_cases(kind: str, b: int, k: int, x: np.ndarray, y: np.ndarray, *,
                    filters: Sequence[int] = (16, 32), learning_rate: float = 1e-3
                    ) -> list[Case]:
    """The :data:`BREAKDOWN` variants for model ``kind``, micro-batch b, K; one epoch each.

    ``"optimizer"`` is :class:`minimal.MinimalAccumulator` 's whole-epoch function (the
    ``"minimal_graph"`` floor of the throughput cases): gradients of the summed loss added
    into accumulators, one Adam step on their mean per window, no checks. Its distance to
    ``"accumcore"`` is accumcore's own bookkeeping (finiteness checks, further counters,
    end-of-window hooks, per-micro-batch loss records).
    """
    loss_fn = keras_loss(LOSS)
    ds = batched_dataset(x, y, b)
    n = len(x)

    def grads_of(model, xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)

    m_floor = build_model(kind, filters=filters)

    def floor(data):
        total = tf.constant(0.0)
        for xb, yb in iter(data):
            loss, grads = grads_of(m_floor, xb, yb)
            total += loss + tf.add_n([tf.reduce_sum(g) for g in grads])
        return total

    m_acc = build_model(kind, filters=filters)
    acc = [tf.Variable(tf.zeros_like(v)) for v in m_acc.trainable_variables]

    def accumulate(data):
        total = tf.constant(0.0)
        for xb, yb in iter(data):
            loss, grads = grads_of(m_acc, xb, yb)
            for a, g in zip(acc, grads):
                a.assign_add(g)
            total += loss
        return total

    minimal = MinimalAccumulator(build_model(kind, filters=filters),
                                 keras.optimizers.Adam(learning_rate), LOSS, k)

    m_each = build_model(kind, filters=filters)
    opt_each = keras.optimizers.Adam(learning_rate)
    opt_each.build(m_each.trainable_variables)

    def each(data):
        total = tf.constant(0.0)
        for xb, yb in iter(data):
            loss, grads = grads_of(m_each, xb, yb)
            opt_each.apply(grads, m_each.trainable_variables)
            total += loss
        return total

    def graph_fn(fn: Callable) -> Callable[[], float]:
        compiled = tf.function(fn)
        return lambda: _timed(lambda: float(compiled(ds)))

    def graph_loop(checked: bool) -> Callable[[], float]:
        trainer = AccumTrainer(build_model(kind, filters=filters),
                               keras.optimizers.Adam(learning_rate), LOSS, accum_steps=k,
                               nonfinite="raise" if checked else UNCHECKED)
        trainer.fit(ds, epochs=1, mode="graph", verbose=0)  # traced here, once
        return lambda: _timed(lambda: trainer.fit(ds, epochs=1, mode="graph", verbose=0))

    def fit(name: str, checked: bool = True) -> Case:
        if name == "fit_keras_ga":
            model = build_model(kind, filters=filters)
            optimizer = keras.optimizers.Adam(learning_rate, gradient_accumulation_steps=k)
        else:
            model = build_model(kind, filters=filters, model_cls=AccumModel, accum_steps=k,
                                nonfinite="raise" if checked else UNCHECKED)
            optimizer = keras.optimizers.Adam(learning_rate)
        model.compile(optimizer, LOSS, jit_compile=False)
        model.fit(ds, epochs=1, verbose=0)  # traced here, once
        return _fit_case(name, model, ds, n)

    return [
        Case("floor", graph_fn(floor), n),
        Case("accumulate", graph_fn(accumulate), n),
        Case("optimizer", lambda: _timed(lambda: float(minimal.epoch(ds))), n),
        Case("accumcore_unchecked", graph_loop(checked=False), n),
        Case("accumcore", graph_loop(checked=True), n),
        Case("adam_each", graph_fn(each), n),
        fit("fit_keras_ga"),
        fit("fit_unchecked", checked=False),
        fit("fit_accumcore"),
    ]


def run_breakdown(settings: SuiteSettings, progress: Callable[[str], None] = print
                  ) -> list[dict[str, Any]]:
    """Time :func:`breakdown_cases` for each model at the smallest b and K of ``settings``."""
    b, k = min(settings.micro_batches), min(settings.accum_steps)
    records = []
    for kind in settings.models:
        n = -(-settings.unit_samples[kind] // (b * k)) * b * k
        x, y = benchmark_data(kind, n, settings.data)
        progress(f"[breakdown] {kind} b={b} K={k}: what each ingredient of accumulation costs")
        timed = interleaved_medians(
            breakdown_cases(kind, b, k, x, y, filters=settings.conv_filters),
            settings.repeats, warmup=settings.warmup, progress=progress)
        for name, rec in timed.items():
            ms = (1e3 * b / rec["median"]) if rec["median"] else None
            records.append({"model": kind, "micro_batch": b, "accum_steps": k,
                            "variant": name, "label": BREAKDOWN[name],
                            "reference": name in BREAKDOWN_REFERENCES,
                            "ms_per_micro_batch": ms, **rec})
        gc.collect()
        keras.backend.clear_session()
    return records


# ---------------------------------------------------------------------------- memory
def memory_child(method: str, b: int, k: int, filters: Sequence[int], device: str,
                 steps: int = 2) -> dict[str, Any]:
    """Measure one memory configuration in *this* process (call it in a fresh one).

    Plain training runs one batch of K * b; accumulation runs one window of K micro-batches of
    b. After one warm-up step the allocator's peak is reset, ``steps`` more steps run, and the
    peak is read.
    """
    if method not in MEMORY_METHODS:
        raise ValueError(f"Unknown memory `method`={method!r}; expected one of "
                         f"{list(MEMORY_METHODS)}.")
    model = build_model("conv", filters=filters,
                        **({"model_cls": AccumModel, "accum_steps": k}
                           if method == "accum_model" else {}))
    x, y = benchmark_data("conv", k * b, "synthetic")
    micro = [(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]) for i in range(k)]
    opt = keras.optimizers.Adam(1e-3)
    if method == "plain":
        model.compile(opt, LOSS, jit_compile=False)

        def step() -> None:
            model.train_on_batch(x, y)
    elif method == "accum_model":
        model.compile(opt, LOSS, jit_compile=False)

        def step() -> None:
            for xi, yi in micro:
                model.train_on_batch(xi, yi)
    else:
        trainer = AccumTrainer(model, opt, LOSS, accum_steps=k)
        if method == "accum_window":
            def step() -> None:
                float(trainer.window_step(x, y))
        else:
            def step() -> None:
                for xi, yi in micro:
                    trainer.train_micro_batch(xi, yi, compiled=True)

    step()
    gc.collect()
    tf.config.experimental.reset_memory_stats(device)
    for _ in range(steps):
        step()
    info = tf.config.experimental.get_memory_info(device)
    return {
        "method": method, "micro_batch": b, "accum_steps": k, "batch": k * b,
        "filters": list(filters), "device": device, "peak_bytes": int(info["peak"]),
        "current_bytes": int(info["current"]), "weights_bytes": trainable_bytes(model),
        "error": None,
    }


def write_record(path: str, record: dict[str, Any]) -> None:
    """Write a benchmark script's ``record`` as indented JSON to ``path`` (its folder made if
    missing) and say so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print("wrote", path)


def child_env(device: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a measuring child process on ``device`` (allocator statistics on
    for a CPU)."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    if device.upper().startswith("CPU"):
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # allocator statistics for CPU:0
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "")
    else:
        env.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    env.update(extra or {})
    return env


def _run_child(args: list[str], device: str, tag: str, timeout: float,
               extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=child_env(device, extra_env))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(tag):
            return json.loads(line[len(tag):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit code {proc.returncode}: {' | '.join(tail)[:500]}"}


def run_memory(settings: SuiteSettings, progress: Callable[[str], None] = print
               ) -> list[dict[str, Any]]:
    """Peak memory of every (method, K) of ``settings``, each in a fresh subprocess."""
    device = settings.resolved_device()
    b = settings.memory_micro_batch
    jobs = [(m, k) for m in settings.memory_methods for k in settings.memory_accum_steps]
    filters = ",".join(str(f) for f in settings.memory_filters)
    parallel = settings.memory_parallel if device.upper().startswith("CPU") else 1
    progress(f"[memory] {len(jobs)} subprocesses on {device}, b={b}, "
             f"{parallel} at a time")
    done = [0]

    def one(job: tuple[str, int]) -> dict[str, Any]:
        method, k = job
        rec = _run_child(["memory", "--method", method, "--micro-batch", str(b), "--k", str(k),
                          "--filters", filters, "--device", device], device, MEMORY_TAG,
                         timeout=600)
        rec = {"method": method, "micro_batch": b, "accum_steps": k, "batch": k * b,
               "device": device, "filters": list(settings.memory_filters), **rec}
        done[0] += 1
        peak = rec.get("peak_bytes")
        progress(f"  {method} K={k}: " + (f"peak {peak / 2**20:.1f} MiB" if peak is not None
                                          else rec["error"]) + f" ({done[0]}/{len(jobs)})")
        return rec

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return list(pool.map(one, jobs))


def probe_child(target: int, start: int, multiple_of: int, filters: Sequence[int]
                ) -> dict[str, Any]:
    """The real largest-micro-batch probe on this process's device (conv net, Adam)."""
    from accumcore.memory import gradient_step_probe, oom_probe, plan_accumulation

    model = build_model("conv", filters=filters)
    step_at = gradient_step_probe(model, LOSS, INPUT_SHAPES["conv"])
    times: list[float] = []

    def fits(b_: int) -> bool:
        t0 = time.perf_counter()
        ok = oom_probe(step_at)(b_)
        times.append(time.perf_counter() - t0)
        print(f"probe b={b_}: {'fits' if ok else 'out of memory'} "
              f"({times[-1]:.1f} s)", flush=True)
        return ok

    plan = plan_accumulation(fits, target, start=start, multiple_of=multiple_of)
    return {**asdict(plan), "probe_seconds": times, "filters": list(filters), "error": None}


def run_probe(settings: SuiteSettings, progress: Callable[[str], None] = print
              ) -> dict[str, Any]:
    """Run :func:`probe_child` in a subprocess; on CPU under a BFC memory limit."""
    device = settings.resolved_device()
    extra = {}
    if device.upper().startswith("CPU"):
        extra["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(settings.probe_cpu_limit_mb)
    progress(f"[probe] largest micro-batch on {device} for B={settings.probe_target}"
             + (f" (CPU allocator limited to {settings.probe_cpu_limit_mb} MiB)" if extra
                else ""))
    filters = ",".join(str(f) for f in settings.memory_filters)
    start = time.perf_counter()
    rec = _run_child(["probe", "--target", str(settings.probe_target), "--start",
                      str(settings.probe_start), "--multiple-of", str(settings.probe_multiple_of),
                      "--filters", filters], device, PROBE_TAG, timeout=900, extra_env=extra)
    rec.update({"device": device, "cpu_limit_mb": settings.probe_cpu_limit_mb if extra else None,
                "wall_seconds": time.perf_counter() - start})
    progress("  " + (f"max micro-batch {rec['max_micro_batch']}: K={rec['accum_steps']} x "
                     f"b={rec['micro_batch_size']}" if rec.get("error") is None
                     else rec["error"]))
    return rec


# ---------------------------------------------------------------------------- the suite
#: The fast unit tests as the README runs them (scripts/test.sh), from the repository root.
UNIT_TESTS_COMMAND = ("-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                      "-n", "2")


def run_unit_tests(progress: Callable[[str], None] = print, timeout: float = 1800.0,
                   command: Sequence[str] = UNIT_TESTS_COMMAND) -> dict[str, Any]:
    """Time the fast unit tests in a subprocess (run alone: nothing else of the suite runs).

    ``command``: the interpreter's arguments, run from the repository root.

    Returns:
        :func:`accumcore.lab.benchmarking.pytest_summary`'s counts and ``seconds`` (pytest's
        own duration, collection included), plus ``wall_s`` (the whole subprocess, interpreter
        start-up included), ``returncode`` and ``command``; or ``{"error": ...}`` when pytest
        printed no summary (it crashed or timed out).
    """
    from accumcore.lab.benchmarking import pytest_summary

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [sys.executable, *command]
    progress("[unit_tests] " + " ".join(argv[1:]))
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=root, capture_output=True, text=True,
                              timeout=timeout, check=False)
        output, returncode = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        output, returncode = f"timed out after {timeout:.0f} s: {err}", None
    record: dict[str, Any] = {"command": " ".join(["python", *command]),
                              "wall_s": time.perf_counter() - start, "returncode": returncode}
    try:
        record.update(pytest_summary(output))
    except ValueError as err:
        record["error"] = str(err)[:600]
    progress(f"  unit tests: {record.get('passed')} passed, {record.get('failed')} failed in "
             f"{record.get('seconds')} s")
    return record


def run_suite(settings: SuiteSettings, *, only: Iterable[str] | None = None,
              progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the experiments named in ``only`` (default: all) and return the results dict."""
    parts = set(only or EXPERIMENTS)
    unknown = parts - set(EXPERIMENTS)
    if unknown:
        raise ValueError(f"Unknown experiments {sorted(unknown)} in `only`; expected "
                         f"{', '.join(EXPERIMENTS)}.")
    start = time.perf_counter()
    results: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": asdict(settings),
        "device": settings.resolved_device(),
        "machine": machine_info(),
        "throughput": [], "breakdown": [], "memory": [], "tracing": [], "probe": None,
        "ops": [], "unit_tests": None,
        "code": code_size(),  # the library's source sizes (issue 19), not a measurement
    }
    # Memory and the probe run in subprocesses and tracing counts do not depend on speed, so
    # the three overlap; the throughput timing then runs alone.
    with ThreadPoolExecutor(max_workers=2) as background:
        memory = (background.submit(run_memory, settings, progress)
                  if "memory" in parts else None)
        probe = (background.submit(run_probe, settings, progress)
                 if "probe" in parts and settings.probe else None)
        if "tracing" in parts:
            t0 = time.perf_counter()
            progress("[tracing] 3 epochs, ragged last batch")
            results["tracing"] = count_traces(settings.tracing_samples, data="synthetic",
                                              xla=settings.tracing_xla)
            for rec in results["tracing"]:
                progress(f"  {rec['entry']}: traces per epoch {rec['per_epoch']}")
            progress(f"  tracing done ({time.perf_counter() - t0:.0f} s)")
        if "ops" in parts:
            t0 = time.perf_counter()
            progress("[ops] graph operations per traced step vs the minimal accumulator")
            for kind in settings.ops_models:
                recs = count_ops(MinimalAccumulator, kind, filters=settings.conv_filters)
                results["ops"] += recs
                for rec in recs:
                    progress(f"  {kind} {rec['entry']}: {rec['ops']} ops, "
                             f"{rec['ratio']:.2f} x minimal {rec['variant']}")
                keras.backend.clear_session()
            progress(f"  ops done ({time.perf_counter() - t0:.0f} s)")
        if memory is not None:
            results["memory"] = memory.result()
        if probe is not None:
            results["probe"] = probe.result()
    if "throughput" in parts:
        t0 = time.perf_counter()
        results["throughput"] = run_throughput(settings, progress)
        progress(f"  ({time.perf_counter() - t0:.0f} s)")
    if "breakdown" in parts:
        t0 = time.perf_counter()
        results["breakdown"] = run_breakdown(settings, progress)
        progress(f"  ({time.perf_counter() - t0:.0f} s)")
    if "unit_tests" in parts and settings.unit_tests:
        results["unit_tests"] = run_unit_tests(progress)
    results["machine"]["load_average_end"] = (list(os.getloadavg())
                                              if hasattr(os, "getloadavg") else None)
    results["duration_s"] = time.perf_counter() - start
    results["targets"] = evaluate_targets(results)
    return results


# ---------------------------------------------------------------------------- child CLI
def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="accumcore benchmark subprocesses.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    mem = sub.add_parser("memory", help="peak memory of one configuration")
    mem.add_argument("--method", required=True, choices=list(MEMORY_METHODS))
    mem.add_argument("--micro-batch", type=int, required=True)
    mem.add_argument("--k", type=int, required=True)
    mem.add_argument("--filters", default="32,64")
    mem.add_argument("--device", default="CPU:0")
    probe = sub.add_parser("probe", help="largest micro-batch that fits")
    probe.add_argument("--target", type=int, required=True)
    probe.add_argument("--start", type=int, default=32)
    probe.add_argument("--multiple-of", type=int, default=32)
    probe.add_argument("--filters", default="32,64")
    args = parser.parse_args(argv)
    filters = tuple(int(f) for f in args.filters.split(","))
    if args.cmd == "memory":
        rec = memory_child(args.method, args.micro_batch, args.k, filters, args.device)
        print(MEMORY_TAG + json.dumps(rec), flush=True)
    else:
        rec = probe_child(args.target, args.start, args.multiple_of, filters)
        print(PROBE_TAG + json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through subprocesses
    sys.exit(_main())
