"""Benchmark building blocks: throughput, peak memory, tracing counts and the targets (issue 5).

``benchmarks/run.py`` is the command-line front end (JSON, Markdown and PNG output); book
chapter 7 loads the JSON it writes and plots it with the functions at the end of this module.

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

    All configurations of one (model, b) are timed in one process, **interleaved**: every
    repeat runs each configuration once, in a rotated order, so slow phases of a shared machine
    hit all of them alike. One warm-up run per configuration (tracing, XLA compilation, first
    allocations) is excluded. ``fit`` configurations are timed from ``on_epoch_begin`` to
    ``on_epoch_end`` (``fit``'s per-call set-up excluded), all share ``steps_per_execution``
    and ``jit_compile=False``; loops are timed over the whole call. The floors reduce every
    gradient with one ``reduce_sum`` (returned), so graph optimisers cannot prune the backward
    pass; that costs one read of the gradients, less than accumulating them.

Peak memory (bytes, ``tf.config.experimental.get_memory_info(device)["peak"]``)
    Each configuration runs in a fresh subprocess (``python -m accumcore.lab.benchmarking memory``):
    plain training at batch K * b against accumulation of K micro-batches of b, for the
    ``window_step`` split, the ``tf.function`` loop and ``AccumModel``'s ``train_step``. The
    stats are reset after one warm-up step (so weights, optimizer slots and accumulators are
    counted, tracing is not). On CPU the child sets ``TF_CPU_ALLOCATOR_USE_BFC=true``, without
    which TensorFlow keeps no allocator statistics for ``CPU:0``.

Tracing
    How often each compiled function is traced over 3 epochs of a dataset whose last batch is
    ragged: counted in Python, by the number of times the step's body (the loss, or
    ``train_step``) runs while a graph is being built.
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
from accumcore.lab import experiments
from accumcore.loops import AccumTrainer
from accumcore.model import AccumModel

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
#: Every accumcore configuration.
ACCUMCORE_CONFIGS = ("accum_fit", "loop_function", "loop_graph", "window", "window_xla", "eager")
#: Memory methods (plain training at K*b, and three ways to accumulate K micro-batches of b).
MEMORY_METHODS: dict[str, str] = {
    "plain": "plain train_on_batch at B = K*b",
    "accum_window": "accumcore window_step (split in the graph)",
    "accum_loop": "accumcore tf.function loop (train_micro_batch)",
    "accum_model": "accumcore AccumModel train_step (train_on_batch)",
}
#: The experiments of the suite (``run_suite(only=...)``, ``benchmarks/run.py --only``).
EXPERIMENTS = ("throughput", "breakdown", "memory", "tracing", "probe")
#: Target thresholds of the issue.
FIT_RATIO_TARGET = 1.0  # (4)/(3): AccumModel.fit at least as fast as Keras's own accumulation
FLOOR_RATIO_TARGET = 0.95  # best of (5)/(6) over the floor (8): overhead <= 5 %
MEMORY_RATIO_TARGET = 1.05  # accumulation peak <= 1.05 x (plain b peak + one copy of weights)
#: Most traces allowed per compiled function over 3 epochs (none after the first).
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
_MEMORY_TAG = "ACCUMCORE_MEMORY_RESULT "
_PROBE_TAG = "ACCUMCORE_PROBE_RESULT "


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
        warmup: untimed runs per configuration before the timed ones (tracing, compilation and
            TensorFlow's own warm-up: the first 2-3 calls of a function are often slower).
        configs: the throughput configurations to time (default: all of :data:`CONFIGS`).
        xla_models_on_cpu: models whose XLA configurations are timed on a CPU (see
            :data:`XLA_CPU_SKIP_REASON`); on a GPU every model's are.
        steps_per_execution: shared by every ``fit`` configuration.
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
        data: ``"mnist"`` (``accumcore.load_mnist``) or ``"synthetic"`` (seeded uniform
            noise of MNIST's shape: speed and memory do not depend on pixel values).
        device: ``"CPU:0"``, ``"GPU:0"``, or ``None`` to pick ``GPU:0`` when there is one.
    """

    quick: bool = False
    models: tuple[str, ...] = ("mlp", "conv")
    micro_batches: tuple[int, ...] = (16, 64)
    accum_steps: tuple[int, ...] = (4, 8)
    unit_samples: dict[str, int] = field(default_factory=lambda: {"mlp": 4096, "conv": 1024})
    repeats: int = 5
    warmup: int = 2
    configs: tuple[str, ...] = tuple(CONFIGS)
    xla_models_on_cpu: tuple[str, ...] = ("mlp",)
    steps_per_execution: int = 1
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
    data: str = "mnist"
    device: str | None = None

    @classmethod
    def full(cls, **overrides: Any) -> SuiteSettings:
        """The full suite (about 10 minutes on 2 quiet CPU cores)."""
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
            "probe": False,
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


# ---------------------------------------------------------------------------- data & models
INPUT_SHAPES: dict[str, tuple[int, ...]] = {"mlp": (784,), "conv": (28, 28, 1)}


def benchmark_data(kind: str, n: int, source: str = "mnist", seed: int = 0
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``n`` samples for model ``kind``: float32 inputs in [0, 1] and int32 labels 0..9.

    Args:
        kind: ``"mlp"`` (inputs ``(n, 784)``) or ``"conv"`` (``(n, 28, 28, 1)``).
        n: number of samples (at most 60 000 for MNIST).
        source: ``"mnist"`` (the training set, via :func:`accumcore.load_mnist`) or
            ``"synthetic"`` (seeded uniform noise and random labels; the benchmarks' speed and
            memory do not depend on the values).
    """
    shape = INPUT_SHAPES[_check_kind(kind)]
    if source == "mnist":
        if n > 60_000:
            raise ValueError(f"`n`={n} exceeds MNIST's 60 000 training samples.")
        data = accumcore.load_mnist(verbose=False)
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


def _dataset(x: np.ndarray, y: np.ndarray, batch: int) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).prefetch(2)


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
    from accumcore.core import as_loss_fn

    step = _floor_step(model, as_loss_fn(loss))

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
    learning_rate: float = 1e-3,
    configs: Iterable[str] = tuple(CONFIGS),
) -> list[Case]:
    """Every configuration of :data:`CONFIGS` for model ``kind``, micro-batch b and each K.

    Case names are the configuration names, suffixed ``@K{k}`` for the K-dependent ones.
    ``x``, ``y`` are the samples of one timed unit (a multiple of every B = K * b). Only the
    configurations in ``configs`` are built.
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
    ds_b = _dataset(x, y, b)

    def model(**kw: Any) -> keras.Model:
        return build_model(kind, filters=filters, **kw)

    def adam(**kw: Any) -> keras.optimizers.Optimizer:
        return keras.optimizers.Adam(learning_rate, **kw)

    def compiled(m: keras.Model, opt: keras.optimizers.Optimizer) -> keras.Model:
        m.compile(opt, LOSS, steps_per_execution=steps_per_execution, jit_compile=False)
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
        ds_big = _dataset(x, y, k * b)
        floor_k = floor_functions(model(), k)
        cases.append(_fit_case("fit_B" + tag, compiled(model(), adam()), ds_big, n))
        cases.append(_fit_case(
            "keras_ga" + tag, compiled(model(), adam(gradient_accumulation_steps=k)), ds_b, n))
        cases.append(_fit_case(
            "accum_fit" + tag, compiled(model(model_cls=AccumModel, accum_steps=k), adam()),
            ds_b, n))
        for mode in ("function", "graph", "eager"):
            trainer = AccumTrainer(model(), adam(), LOSS, accum_steps=k)
            name = "eager" if mode == "eager" else f"loop_{mode}"
            cases.append(Case(
                name + tag,
                (lambda t=trainer, md=mode: _timed(
                    lambda: t.fit(ds_b, epochs=1, mode=md, verbose=0))),
                n,
            ))
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
    "optimizer": "+ Adam once per window (a minimal accumulation)",
    "accumcore": "accumcore AccumTrainer.fit(mode='graph')",
    "adam_each": "reference: Adam after every micro-batch (no accumulation)",
}


def breakdown_cases(kind: str, b: int, k: int, x: np.ndarray, y: np.ndarray, *,
                    filters: Sequence[int] = (16, 32), learning_rate: float = 1e-3
                    ) -> list[Case]:
    """The :data:`BREAKDOWN` variants for model ``kind``, micro-batch b, K; one epoch each.

    ``"optimizer"`` is the leanest exact accumulation one can write: gradients of the summed
    loss added into accumulators, one Adam step on their mean per window, no checks, no
    counters. Its distance to ``"accumcore"`` is accumcore's own bookkeeping (micro-batch
    weights, finiteness checks, counters, end-of-window hooks, per-micro-batch loss records).
    """
    from accumcore.core import as_loss_fn

    loss_fn = as_loss_fn(LOSS)
    ds = _dataset(x, y, b)
    n = len(x)

    def grads_of(model, xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        return loss, tape.gradient(loss, model.trainable_variables)

    def built(**kw: Any) -> tuple[keras.Model, keras.optimizers.Optimizer]:
        model = build_model(kind, filters=filters)
        opt = keras.optimizers.Adam(learning_rate, **kw)
        opt.build(model.trainable_variables)
        return model, opt

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

    m_opt, opt = built()
    acc_opt = [tf.Variable(tf.zeros_like(v)) for v in m_opt.trainable_variables]
    count = tf.Variable(0, dtype=tf.int32)
    seen = tf.Variable(0.0)

    def lean(data):
        total = tf.constant(0.0)
        for xb, yb in iter(data):
            loss, grads = grads_of(m_opt, xb, yb)
            weight = tf.cast(tf.shape(xb)[0], tf.float32)
            for a, g in zip(acc_opt, grads):
                a.assign_add(g * weight)
            seen.assign_add(weight)
            count.assign_add(1)

            def apply() -> tf.Tensor:
                opt.apply([a / seen for a in acc_opt], m_opt.trainable_variables)
                for a in acc_opt:
                    a.assign(tf.zeros_like(a))
                seen.assign(0.0)
                count.assign(0)
                return tf.constant(True)

            tf.cond(count >= k, apply, lambda: tf.constant(False))
            total += loss
        return total

    m_each, opt_each = built()

    def each(data):
        total = tf.constant(0.0)
        for xb, yb in iter(data):
            loss, grads = grads_of(m_each, xb, yb)
            opt_each.apply(grads, m_each.trainable_variables)
            total += loss
        return total

    trainer = AccumTrainer(build_model(kind, filters=filters),
                           keras.optimizers.Adam(learning_rate), LOSS, accum_steps=k)

    def graph_fn(fn: Callable) -> Callable[[], float]:
        compiled = tf.function(fn)
        return lambda: _timed(lambda: float(compiled(ds)))

    return [
        Case("floor", graph_fn(floor), n),
        Case("accumulate", graph_fn(accumulate), n),
        Case("optimizer", graph_fn(lean), n),
        Case("accumcore", lambda: _timed(lambda: trainer.fit(ds, epochs=1, mode="graph",
                                                             verbose=0)), n),
        Case("adam_each", graph_fn(each), n),
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
                            "ms_per_micro_batch": ms, **rec})
        gc.collect()
        keras.backend.clear_session()
    return records


# ---------------------------------------------------------------------------- tracing
class TraceCountingLoss(keras.losses.SparseCategoricalCrossentropy):
    """Sparse cross-entropy that counts the calls made while a graph is being traced."""

    def __init__(self) -> None:
        super().__init__()
        self.traces = 0

    def call(self, y_true, y_pred):
        if not tf.executing_eagerly():
            self.traces += 1
        return super().call(y_true, y_pred)


class TraceCountingAccumModel(AccumModel):
    """``AccumModel`` counting how often ``train_step`` is traced (benchmark helper)."""

    traces = 0

    def train_step(self, data):
        if not tf.executing_eagerly():
            TraceCountingAccumModel.traces += 1
        return super().train_step(data)


def count_traces(samples: int = 200, b: int = 16, k: int = 4, epochs: int = 3,
                 data: str = "synthetic", xla: bool = True) -> list[dict[str, Any]]:
    """Traces of each compiled entry point per epoch, over ``epochs`` epochs (MLP).

    ``samples`` should not be a multiple of b nor of K * b, so that the last micro-batch and
    the last window are ragged. Returns one record per entry point with ``per_epoch`` (new
    traces in each epoch), ``total`` and ``ok`` (at most :data:`MAX_TRACES`, none after the
    first epoch).
    """
    x, y = benchmark_data("mlp", samples, data)
    ds_b = _dataset(x, y, b)
    ds_big = _dataset(x, y, k * b)
    records = []

    def record(entry: str, counts: list[int]) -> None:
        per_epoch = [counts[0]] + [counts[i] - counts[i - 1] for i in range(1, len(counts))]
        records.append({
            "entry": entry, "per_epoch": per_epoch, "total": counts[-1],
            "ok": counts[-1] <= MAX_TRACES and not any(per_epoch[1:]),
            "samples": samples, "micro_batch": b, "accum_steps": k,
        })

    # AccumModel.fit (numpy input, Keras's own batching: the last batch is ragged)
    TraceCountingAccumModel.traces = 0
    model = build_model("mlp", model_cls=TraceCountingAccumModel, accum_steps=k)
    model.compile(keras.optimizers.Adam(1e-3), LOSS)
    counts = []
    for _ in range(epochs):
        model.fit(x, y, batch_size=b, epochs=1, verbose=0, shuffle=False)
        counts.append(TraceCountingAccumModel.traces)
    record("AccumModel.fit", counts)
    # AccumTrainer loops
    for mode in ("function", "graph"):
        loss = TraceCountingLoss()
        trainer = AccumTrainer(build_model("mlp"), keras.optimizers.Adam(1e-3), loss,
                               accum_steps=k)
        counts = []
        for _ in range(epochs):
            trainer.fit(ds_b, epochs=1, mode=mode, verbose=0)
            counts.append(loss.traces)
        record(f"AccumTrainer.fit(mode='{mode}')", counts)
    for jit in (False, True) if xla else (False,):
        loss = TraceCountingLoss()
        trainer = AccumTrainer(build_model("mlp"), keras.optimizers.Adam(1e-3), loss,
                               accum_steps=k, jit_compile=jit)
        counts = []
        for _ in range(epochs):
            for xb, yb in ds_big:
                trainer.window_step(xb, yb)
            counts.append(loss.traces)
        record("AccumTrainer.window_step" + (" (XLA)" if jit else ""), counts)
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


def _child_env(device: str, extra: dict[str, str] | None = None) -> dict[str, str]:
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
    cmd = [sys.executable, "-m", "accumcore.lab.benchmarking", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=_child_env(device, extra_env))
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
                          "--filters", filters, "--device", device], device, _MEMORY_TAG,
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
                      "--filters", filters], device, _PROBE_TAG, timeout=900, extra_env=extra)
    rec.update({"device": device, "cpu_limit_mb": settings.probe_cpu_limit_mb if extra else None,
                "wall_seconds": time.perf_counter() - start})
    progress("  " + (f"max micro-batch {rec['max_micro_batch']}: K={rec['accum_steps']} x "
                     f"b={rec['micro_batch_size']}" if rec.get("error") is None
                     else rec["error"]))
    return rec


# ---------------------------------------------------------------------------- the suite
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
    results["machine"]["load_average_end"] = (list(os.getloadavg())
                                              if hasattr(os, "getloadavg") else None)
    results["duration_s"] = time.perf_counter() - start
    results["targets"] = evaluate_targets(results)
    return results


# ---------------------------------------------------------------------------- analysis
def _median(results: dict, model: str, b: int, k: int | None, config: str) -> float | None:
    for rec in results.get("throughput", []):
        if (rec["model"], rec["micro_batch"], rec["config"]) == (model, b, config) and (
            config in K_INDEPENDENT or rec["accum_steps"] == k
        ):
            return rec["median"]
    return None


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
    ``large_vs_small`` = (2)/(1); ``split_price`` = ``floor_window`` / ``floor_B``: K passes
    of b against one pass of B, both one ``tf.function`` call per update and no accumulation,
    i.e. what splitting the batch costs by itself.
    """
    rows = []
    for model, b, k in throughput_cells(results):
        def med(config: str, _m=model, _b=b, _k=k) -> float | None:
            return _median(results, _m, _b, _k, config)

        def ratio(num: float | None, den: float | None) -> float | None:
            return num / den if num and den else None

        per_floor = {c: ratio(med(c), med(f)) for c, f in FLOOR_OF.items()}
        compiled = {c: med(c) for c in FLOOR_OF if med(c)}
        best_compiled = max(compiled, key=compiled.get) if compiled else None
        accum = {c: med(c) for c in ACCUMCORE_CONFIGS if med(c)}
        best_accum = max(accum, key=accum.get) if accum else None
        rows.append({
            "model": model, "micro_batch": b, "accum_steps": k, "batch": b * k,
            "fit_vs_keras": ratio(med("accum_fit"), med("keras_ga")),
            "best_compiled": best_compiled,
            "vs_floor": per_floor.get(best_compiled) if best_compiled else None,
            "per_floor": per_floor,
            "best_accum": best_accum,
            "vs_large_batch": ratio(med(best_accum), med("fit_B")) if best_accum else None,
            "large_vs_small": ratio(med("fit_B"), med("fit_b")),
            "split_price": ratio(med("floor_window"), med("floor_B")),
        })
    return rows


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

    for row in throughput_ratios(results):
        cell = f"{row['model']} b={row['micro_batch']} K={row['accum_steps']}"
        v = row["fit_vs_keras"]
        add("(4)/(3) fit vs Keras accumulation", cell, v, FIT_RATIO_TARGET,
            None if v is None else v >= FIT_RATIO_TARGET)
        v = row["vs_floor"]
        add("best of (5)/(6) vs floor (8)", cell, v, FLOOR_RATIO_TARGET,
            None if v is None else v >= FLOOR_RATIO_TARGET,
            f"best: {row['best_compiled']}" if row["best_compiled"] else "")
        add("best accumcore / plain fit at B (2)", cell, row["vs_large_batch"], None, None,
            f"best: {row['best_accum']}" if row["best_accum"] else "")
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
            bool(rec["ok"]), f"per epoch {rec['per_epoch']}")
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


def plot_throughput(results: dict, model: str, ax=None):
    """Median samples/s of every configuration for ``model``, one bar series per (b, K)."""
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
    ax = plotting.bars(ax, groups, title=f"Training throughput, {model} "
                       f"({results['device']}; median of {results['settings']['repeats']})",
                       xlabel="configuration", ylabel="throughput (samples/s)", rotate=60)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return ax


def plot_ratios(results: dict, ax=None):
    """The target ratios per (model, b, K) cell, with the target lines."""
    from accumcore.lab import plotting

    groups = {}
    for row in throughput_ratios(results):
        name = f"{row['model']} {_cell_label(row['micro_batch'], row['accum_steps'])}"
        groups[name] = {
            "(4)/(3): AccumModel.fit / Keras accumulation": row["fit_vs_keras"] or np.nan,
            "best (5)/(6) / floor (8)": row["vs_floor"] or np.nan,
            "best accumcore / plain fit at B (2)": row["vs_large_batch"] or np.nan,
        }
    ax = plotting.bars(ax, groups, title="Throughput ratios (higher is better)",
                       xlabel="model and cell", ylabel="ratio of samples/s (1)",
                       reference_line=FLOOR_RATIO_TARGET, reference_label="0.95 (floor target)",
                       rotate=30)
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1, label="1.0 (fit target)")
    ax.legend(fontsize="small")
    return ax


def plot_memory(results: dict, ax=None):
    """Peak memory against K: plain batch K*b versus each accumulation method."""
    from accumcore.lab import plotting

    table = memory_table(results)
    if not table:
        raise ValueError("No memory results to plot.")
    ks = sorted({k for peaks in table.values() for k in peaks})
    series = {
        MEMORY_METHODS.get(m, m): [peaks.get(k, np.nan) / 2**20 for k in ks]
        for m, peaks in table.items()
    }
    budget = memory_budget(results)
    if budget is not None:
        series["target: 1.05 x (plain b + weights)"] = [budget / 2**20] * len(ks)
    b = results["memory"][0]["micro_batch"]
    ax = plotting.curves(ax, series, x=ks, logx=True,
                         title=f"Peak memory on {results['device']}, micro-batch b={b}",
                         xlabel="K (micro-batches per update; plain batch = K x b)",
                         ylabel="peak allocator memory (MiB)")
    ax.set_xticks(ks, [str(k) for k in ks])
    return ax


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
        print(_MEMORY_TAG + json.dumps(rec), flush=True)
    else:
        rec = probe_child(args.target, args.start, args.multiple_of, filters)
        print(_PROBE_TAG + json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through subprocesses
    sys.exit(_main())
