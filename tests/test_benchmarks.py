"""Benchmark machinery: timing, floors, trace counting, target checks and the report.

Never asserts a speed: these machines are shared and noisy. The whole pipeline is run by the
smoke test in scripts/test.sh (`benchmarks/run.py --quick`, then `--check`).
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    LOSS,
    OPTIMIZERS,
    REL_TOL,
    assert_matches_reference,
    reference_weights,
    small_mlp,
)

import accumcore as ac
import accumcore.lab.experiments  # noqa: F401
from accumcore.lab import benchmarking as bm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import minimal  # noqa: E402
import report  # noqa: E402
import split_fit  # noqa: E402
import suite  # noqa: E402


# ---------------------------------------------------------------------------- the minimal floor
def _concatenated(x, y, sizes) -> tf.data.Dataset:
    """Micro-batches of the given (unequal) sizes, in order, as one dataset."""
    ds, start = None, 0
    for size in sizes:
        part = tf.data.Dataset.from_tensors((x[start:start + size], y[start:start + size]))
        ds = part if ds is None else ds.concatenate(part)
        start += size
    return ds


@pytest.mark.parametrize("opt", ["adam", "adamw", "sgd_clipnorm"])
@pytest.mark.parametrize("variant", ["step", "epoch", "window"])
def test_minimal_accumulator_matches_the_large_batch(data, opt, variant):
    # The floor (9) is a floor only if it is correct: two windows of K=3 micro-batches of
    # unequal sizes (4+6+5, 7+3+5) must give the updates of two plain batches of 15 samples,
    # computed independently by train_on_batch (conftest.reference_weights).
    x, y = data
    x, y = x[:30], y[:30]
    initial, reference = reference_weights(OPTIMIZERS[opt], x, y, None, micro=5, k=3)
    model = small_mlp()
    acc = minimal.MinimalAccumulator(model, OPTIMIZERS[opt](), LOSS, accum_steps=3)
    sizes = [4, 6, 5, 7, 3, 5]
    if variant == "step":
        acc.fit_epoch(_concatenated(x, y, sizes))
    elif variant == "epoch":
        acc.epoch(_concatenated(x, y, sizes))
    else:  # one call per window of 15, split in the graph into 4 + 4 + 4 + 3 (K=4)
        acc = minimal.MinimalAccumulator(model, OPTIMIZERS[opt](), LOSS, accum_steps=4)
        for s in (slice(0, 15), slice(15, 30)):
            acc.window(x[s], y[s])
    assert int(acc.optimizer.iterations.numpy()) == 2
    assert float(acc.weight.numpy()) == 0.0 and int(acc.count.numpy()) == 0
    assert_matches_reference(model, initial, reference)


def test_minimal_accumulator_holds_a_partial_window(data):
    x, y = data
    acc = minimal.MinimalAccumulator(small_mlp(), keras.optimizers.SGD(0.1), LOSS, 3)
    before = [v.numpy().copy() for v in acc.variables]
    acc.fit_epoch(_concatenated(x, y, [5, 5]))  # 2 of 3 micro-batches: no update yet
    assert int(acc.optimizer.iterations.numpy()) == 0
    assert float(acc.weight.numpy()) == 10.0 and int(acc.count.numpy()) == 2
    assert all(np.array_equal(b, v.numpy()) for b, v in zip(before, acc.variables))


@pytest.mark.parametrize("accumulators", [False, True], ids=["loop_sums", "accumulators"])
@pytest.mark.parametrize("opt", ["adam", "sgd_clipnorm"])
def test_minimal_split_model_matches_plain_fit_at_the_batch(data, opt, accumulators):
    # The floor of split fit is a floor only if it is correct: 2 epochs of fit at B = 20 split
    # into 4 micro-batches of 5 must give plain fit's 4 updates at B = 20 from the same initial
    # weights, and its logged loss. Tolerance 2e-5 (the guide's for Adam in float32): the
    # split sums 4 partial sums where plain fit reduces 20 losses at once, and Adam's division
    # by sqrt(v) carries that round-off into the weights (measured: 7e-7 Adam, 1.2e-6 SGD).
    x, y = data
    reference = small_mlp()
    initial = [w.numpy().copy() for w in reference.weights]
    reference.compile(OPTIMIZERS[opt](), LOSS)
    expected = reference.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0)
    model = minimal.MinimalSplitModel(small_mlp(), LOSS, 5, accumulators=accumulators)
    model.compile(OPTIMIZERS[opt]())
    history = model.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4
    assert_matches_reference(model.network, initial,
                             [w.numpy() for w in reference.weights], tol=2e-5)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-6)


def test_minimal_split_model_refuses_a_batch_that_is_not_a_multiple_of_b(data):
    x, y = data
    model = minimal.MinimalSplitModel(small_mlp(), LOSS, 6)
    model.compile(keras.optimizers.SGD(0.1))
    with pytest.raises(tf.errors.InvalidArgumentError, match="multiple of b"):
        model.fit(x, y, batch_size=20, epochs=1, verbose=0)


# ---------------------------------------------------------------------------- graph operations
def test_graph_op_count_counts_both_cond_branches_and_loop_bodies():
    # Same function, but one cond branch has 4 more nodes (2 Const + 2 Mul): the count must
    # differ by exactly 4 although that branch is never taken.
    def make(extra: bool):
        @tf.function
        def f(x):
            def other():
                return x * 2.0 * 3.0 if extra else x

            return tf.cond(x > 1e9, other, lambda: x + 1.0)

        return f.get_concrete_function(tf.TensorSpec((), tf.float32))

    plain, extra = bm.graph_op_count(make(False)), bm.graph_op_count(make(True))
    assert extra - plain == 4
    own = len(make(True).graph.as_graph_def().node)
    assert extra > own  # the branches live in the function library, counted too

    def loop(n_ops: int):
        @tf.function
        def f(n):
            total = tf.constant(0.0)
            for i in tf.range(n):
                v = tf.cast(i, tf.float32)
                for _ in range(n_ops):
                    v = v + 1.0
                total += v
            return total

        return bm.graph_op_count(f.get_concrete_function(tf.TensorSpec((), tf.int32)))

    assert loop(3) - loop(1) == 4  # 2 more (Const, AddV2) pairs inside the while body


# ---------------------------------------------------------------------------- timing
def test_interleaved_medians_rotates_order_and_takes_medians():
    calls: list[str] = []
    seconds = {"a": iter([9.0, 1.0, 2.0, 3.0]), "b": iter([9.0, 4.0, 4.0, 8.0])}

    def case(name: str) -> suite.Case:
        return suite.Case(name, lambda: (calls.append(name), next(seconds[name]))[1], samples=8)

    out = suite.interleaved_medians([case("a"), case("b")], repeats=3, warmup=1)
    # warm-up (untimed: the 9 s runs), then rounds in rotated order: ab, ba, ab
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert out["a"]["seconds"] == [1.0, 2.0, 3.0]
    assert out["a"]["median"] == pytest.approx(4.0)  # samples/s: 8, 4, 8/3 -> median 4
    assert out["b"]["median"] == pytest.approx(2.0)  # 2, 2, 1
    assert out["b"]["spread"] == pytest.approx(0.5)


def test_interleaved_medians_records_a_failing_case_and_goes_on():
    def boom() -> float:
        raise RuntimeError("XLA said no\nmore lines")

    out = suite.interleaved_medians([suite.Case("bad", boom, 1), suite.Case("ok", lambda: 0.5, 1)],
                                 repeats=2)
    assert out["bad"]["error"] == "RuntimeError: XLA said no"
    assert out["bad"]["median"] is None and out["ok"]["median"] == pytest.approx(2.0)


def test_floor_window_does_the_same_passes_as_window_step():
    # The floor must run exactly window_step's K forward+backward passes: its result is the
    # sum over micro-batches of (mean loss + sum of all gradient entries), computed here
    # independently, micro-batch by micro-batch, for a ragged split (10 samples, K=3 -> 4,4,2).
    model = ac.lab.experiments.mlp(6, (5,), 3, seed=1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 6)).astype("float32")
    y = rng.integers(0, 3, 10).astype("int32")
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    expected = 0.0
    for s in (slice(0, 4), slice(4, 8), slice(8, 10)):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[s], model(x[s], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        expected += float(loss) + sum(float(tf.reduce_sum(g)) for g in grads)
    floors = suite.floor_functions(model, 3)
    assert float(floors["floor_window"](x, y)) == pytest.approx(expected, rel=1e-5)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)  # the same 4, 4, 2 split
    assert float(floors["floor_graph"](ds)) == pytest.approx(expected, rel=1e-5)
    # XLA needs static slice sizes (it clamps a ragged last slice), so the XLA floor is used
    # on whole windows only, as in the suite: 8 samples, K=2 -> 4 + 4.
    expected_even = expected - _pass_value(model, loss_fn, x[8:], y[8:])
    assert float(suite.floor_functions(model, 2)["floor_window_xla"](x[:8], y[:8])) == \
        pytest.approx(expected_even, rel=1e-5)


def _pass_value(model, loss_fn, x, y) -> float:
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    return float(loss) + sum(float(tf.reduce_sum(g)) for g in grads)


@pytest.mark.parametrize("jit", [False, True])
def test_window_step_is_exact_on_a_ragged_batch_with_and_without_xla(jit):
    # Benchmark configuration (6) with jit_compile=True once silently re-read samples: XLA
    # clamped the ragged last slice (10 samples, K=3: 4 + 4 + [6:10] instead of [8:10]),
    # rel ~0.5. Reference: one plain train_on_batch on the same 10 samples.
    from accumcore.lab.experiments import get_weights, relative_error

    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 6)).astype("float32")
    y = rng.integers(0, 3, 10).astype("int32")
    ref = ac.lab.experiments.mlp(6, (5,), 3, seed=1)
    initial = get_weights(ref)
    ref.compile(keras.optimizers.SGD(0.1), bm.LOSS)
    ref.train_on_batch(x, y)
    model = ac.lab.experiments.mlp(6, (5,), 3, seed=1)
    trainer = ac.AccumTrainer(model, keras.optimizers.SGD(0.1), bm.LOSS, accum_steps=3,
                              jit_compile=jit)
    trainer.window_step(x, y)
    # REL_TOL: float32 re-association of the same sum (see tests/helpers.py); the bug
    # gave 0.5.
    assert relative_error(get_weights(model), get_weights(ref), initial) < REL_TOL
    assert trainer.state.counters()["samples_seen"] == 10


def test_throughput_cases_cover_every_config():
    # Building is cheap (no tracing); running every configuration is the smoke test's job
    # (scripts/test.sh runs benchmarks/run.py --quick), so only two cheap ones run here.
    x, y = bm.benchmark_data("mlp", 64, "synthetic")
    cases = suite.throughput_cases("mlp", 8, (2, 4), x, y)
    names = {c.name for c in cases}
    assert names == set(bm.K_INDEPENDENT) | {
        f"{c}@K{k}" for c in bm.CONFIGS if c not in bm.K_INDEPENDENT for k in (2, 4)}
    assert all(c.samples == 64 for c in cases)
    subset = suite.throughput_cases("mlp", 8, (2,), x, y, configs=["window", "floor_window"])
    assert [c.name for c in subset] == ["window@K2", "floor_window@K2"]
    assert all(c.run() > 0 for c in subset)
    with pytest.raises(ValueError, match="multiple of B"):
        suite.throughput_cases("mlp", 8, (3,), x, y)
    with pytest.raises(ValueError, match="configs"):
        suite.throughput_cases("mlp", 8, (2,), x, y, configs=["nope"])


def test_breakdown_variants_all_run():
    x, y = bm.benchmark_data("mlp", 32, "synthetic")
    cases = suite.breakdown_cases("mlp", 8, 2, x, y)
    assert [c.name for c in cases] == list(suite.BREAKDOWN)
    assert all(c.run() > 0 for c in cases)


def test_count_step_traces_counts_traces_not_calls():
    x, y = bm.benchmark_data("mlp", 64, "synthetic")
    model = bm.build_model("mlp", model_cls=ac.AccumModel, accum_steps=2)
    model.compile(keras.optimizers.SGD(0.1), bm.LOSS)
    traced = bm.count_step_traces(model)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)  # 8 calls of the step
    assert len(traced) == 1
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # the same graph
    assert len(traced) == 1
    assert int(model.optimizer.iterations) == 6  # the counted step is the one that trained


def test_trainer_traces_reads_each_modes_compiled_function():
    x, y = bm.benchmark_data("mlp", 40, "synthetic")
    trainer = ac.AccumTrainer(bm.build_model("mlp"), keras.optimizers.SGD(0.1), bm.LOSS,
                              accum_steps=2)
    assert bm.trainer_traces(trainer, "function") == 0  # not made before the first micro-batch
    ds = bm.batched_dataset(x, y, 16)  # 16, 16 and a ragged 8
    for _ in range(2):
        trainer.fit(ds, epochs=1, mode="function", verbose=0)
    assert bm.trainer_traces(trainer, "function") == 1
    assert bm.trainer_traces(trainer, "window") == 0
    for _ in range(2):
        for start in (0, 16, 32):  # batches of 16, 16 and a ragged 8: two shapes
            trainer.window_step(x[start:start + 16], y[start:start + 16])
    assert bm.trainer_traces(trainer, "window") == 2
    with pytest.raises(ValueError, match="eager"):
        bm.trainer_traces(trainer, "eager")


def test_count_traces_reports_every_entry_traced_in_the_first_epoch_only():
    records = bm.count_traces(samples=40, b=8, k=2, epochs=2, xla=False)
    assert [r["entry"] for r in records] == [
        "AccumModel.fit", "AccumTrainer.fit(mode='function')",
        "AccumTrainer.fit(mode='graph')", "AccumTrainer.window_step"]
    for r in records:
        assert bm.traced_in_first_epoch_only(r) and r["per_epoch"][1] == 0, r
        assert 1 <= r["total"] <= bm.MAX_TRACES, r


# ---------------------------------------------------------------------------- analysis
def fake_results(**changes) -> dict:
    """A small, hand-made results dict (numbers chosen so every ratio is known exactly)."""
    rates = {"fit_b": 100.0, "fit_B": 400.0, "keras_ga": 80.0, "accum_fit": 90.0,
             "loop_function": 60.0, "loop_graph": 190.0, "window": 150.0, "window_xla": 120.0,
             "eager": 10.0, "floor_function": 70.0, "floor_graph": 200.0, "floor_window": 160.0,
             "floor_window_xla": 130.0, "floor_B": 320.0, "minimal_function": 75.0,
             "minimal_graph": 180.0, "minimal_window": 200.0, "keras_ga_spe": 100.0,
             "accum_fit_spe": 95.0, "accum_fit_xla": 45.0}
    rates.update(changes)
    throughput = []
    for cfg, rate in rates.items():
        k = None if cfg in bm.K_INDEPENDENT else 4
        throughput.append({
            "model": "mlp", "micro_batch": 16, "accum_steps": k,
            "batch": 64 if cfg == "fit_B" else 16, "config": cfg,
            "number": bm.CONFIGS[cfg][0], "label": bm.CONFIGS[cfg][1],
            "seconds": [1.0] * 5, "samples_per_s": [rate] * 5, "median": rate, "spread": 0.0,
            "error": None, "samples": 64,
        })
    mib = 2**20
    memory = [
        {"method": m, "micro_batch": 64, "accum_steps": k, "batch": 64 * k,
         "peak_bytes": peak * mib, "current_bytes": mib, "weights_bytes": mib, "error": None,
         "device": "CPU:0", "filters": [32, 64]}
        for m, peaks in {"plain": {1: 60, 2: 110, 4: 210},
                         "accum_window": {1: 61, 2: 62, 4: 63}}.items()
        for k, peak in peaks.items()
    ]
    tracing = [{"entry": "AccumModel.fit", "per_epoch": [1, 0, 0], "total": 1,
                "samples": 200, "micro_batch": 16, "accum_steps": 4},
               {"entry": "retracer", "per_epoch": [2, 1, 0], "total": 3,
                "samples": 200, "micro_batch": 16, "accum_steps": 4}]
    ops = [{"entry": entry, "model": "mlp", "ops": ops, "variant": variant,
            "minimal_ops": {"step": 400, "epoch": 440, "window": 450}[variant],
            "ratio": ops / {"step": 400, "epoch": 440, "window": 450}[variant],
            "target": target, "micro_batch": 16, "accum_steps": 4}
           for (entry, (variant, target)), ops in zip(bm.OP_ENTRIES.items(),
                                                      (580, 640, 620, 700, 350, 430))]
    settings = suite.SuiteSettings.quick_preset()
    return {
        "schema": bm.SCHEMA_VERSION, "created": "2025-01-01T00:00:00", "device": "CPU:0",
        "settings": {**suite.asdict(settings), "repeats": 5}, "machine": suite.machine_info(),
        "throughput": throughput, "memory": memory, "tracing": tracing, "probe": None,
        "ops": ops, "duration_s": 60.0,
    }


def test_throughput_ratios_follow_the_issue_definitions():
    (row,) = bm.throughput_ratios(fake_results())
    assert row["fit_vs_keras"] == pytest.approx(90 / 80)  # (4)/(3)
    assert row["best_compiled"] == "loop_graph"  # fastest of (5)/(6)
    assert row["vs_floor"] == pytest.approx(190 / 200)  # over the floor compiled the same way
    assert row["per_floor"]["window"] == pytest.approx(150 / 160)
    assert row["best_accum"] == "loop_graph"
    assert row["vs_large_batch"] == pytest.approx(190 / 400)
    assert row["large_vs_small"] == pytest.approx(4.0)
    assert row["split_price"] == pytest.approx(160 / 320)  # floor split / unsplit
    assert row["fit_vs_keras_spe"] == pytest.approx(95 / 100)  # (4)/(3) at large spe
    assert row["per_minimal"] == pytest.approx(
        {"loop_function": 60 / 75, "loop_graph": 190 / 180, "window": 150 / 200})
    assert row["best_vs_minimal"] == "loop_graph"  # the fastest path, against its own minimal
    assert row["vs_minimal"] == pytest.approx(190 / 180)
    assert row["fit_xla_vs_fit"] == pytest.approx(45 / 90)


def test_targets_are_judged_against_their_thresholds():
    targets = {(t["target"], t["cell"]): t for t in bm.evaluate_targets(fake_results())}
    fit = targets[("(4)/(3) fit vs Keras accumulation", "mlp b=16 K=4")]
    assert fit["met"] is True
    floor = targets[("best of (5)/(6) vs floor (8)", "mlp b=16 K=4")]
    assert floor["met"] is True and floor["value"] == pytest.approx(0.95)
    budget = bm.memory_budget(fake_results())
    assert budget == pytest.approx(1.05 * 61 * 2**20)  # 1.05 x (plain b + one weights copy)
    mem = targets[("accumulation peak <= 1.05 x (plain b + weights)", "accum_window")]
    assert mem["met"] is True and mem["value"] == pytest.approx(63 / 61)
    assert targets[("traces <= 2, none after epoch 1", "retracer")]["met"] is False
    spe = targets[("(4)/(3) fit vs Keras accumulation, large steps_per_execution",
                   "mlp b=16 K=4")]
    assert spe["met"] is False and spe["value"] == pytest.approx(0.95)
    mini = targets[("best compiled AccumTrainer vs minimal accumulator (9)", "mlp b=16 K=4")]
    assert mini["met"] is True and mini["value"] == pytest.approx(190 / 180)
    ops = {cell: t for (name, cell), t in targets.items() if name.startswith("graph ops")}
    assert ops["mlp AccumModel.fit train_step"]["met"] is True  # 580 / 400 = 1.45
    assert ops["mlp AccumTrainer.window_step"]["met"] is False  # 700 / 450 = 1.56
    assert ops["mlp AccumTrainer.fit(mode='graph') epoch"]["value"] == pytest.approx(620 / 440)
    keras_refs = [t for c, t in ops.items() if "keras" in c]
    assert len(keras_refs) == 2 and all(t["met"] is None for t in keras_refs)
    # Slower accumulation fails the targets.
    slow = {(t["target"], t["cell"]): t
            for t in bm.evaluate_targets(fake_results(accum_fit=70.0, loop_graph=100.0))}
    assert slow[("(4)/(3) fit vs Keras accumulation", "mlp b=16 K=4")]["met"] is False
    assert slow[("best of (5)/(6) vs floor (8)", "mlp b=16 K=4")]["met"] is False
    assert slow[("best compiled AccumTrainer vs minimal accumulator (9)",
                  "mlp b=16 K=4")]["met"] is False  # window 150 / 200 is now the best path


def test_lean_targets_decide_on_the_best_of_n_and_report_the_median():
    results = fake_results()
    for rec in results["throughput"]:  # repeats: one fast, the rest slowed by interference
        if rec["config"] in ("accum_fit", "keras_ga"):
            fast = {"accum_fit": 100.0, "keras_ga": 90.0}[rec["config"]]
            slow = {"accum_fit": 50.0, "keras_ga": 80.0}[rec["config"]]
            rec["samples_per_s"] = [fast, slow, slow, slow, slow]
            rec["median"] = slow
    results["code"] = {"largest_class": (320, "a.py:Big"), "longest_function": (40, "a.py:f"),
                       "code_lines": (2000, "3 files")}
    rows = {(r["target"], r["cell"]): r for r in bm.lean_targets(results)}
    fit = rows[("AccumModel.fit / Keras gradient_accumulation_steps", "mlp b=16 K=4")]
    assert fit["best"] == pytest.approx(100 / 90) and fit["median"] == pytest.approx(50 / 80)
    assert fit["met"] is True and fit["threshold"] == 1.0  # decided on the best of N
    spe = rows[("AccumModel.fit / Keras gradient_accumulation_steps, large steps_per_execution",
                "mlp b=16 K=4")]
    assert spe["best"] == pytest.approx(95 / 100) and spe["met"] is False
    loop = rows[("graph loop / minimal accumulator", "mlp b=16 K=4")]
    assert loop["best"] == pytest.approx(190 / 180) and loop["met"] is True
    ops = rows[("train_step graph operations <= Keras's accumulating one", "mlp: 580 vs 430")]
    assert ops["met"] is False  # 580 > 430
    assert rows[("largest class (lines)", "a.py:Big")]["met"] is False  # 320 > 299
    assert rows[("longest function (lines)", "a.py:f")]["met"] is True
    assert rows[("library code lines", "3 files")]["met"] is True


def test_pytest_summary_reads_counts_and_duration_of_the_last_summary_line():
    output = ("........ [100%]\n= slowest durations =\n1.02s call test_x.py::test_in 0.5s\n"
              "3 failed, 604 passed, 2 skipped, 64 warnings, 1 error in 213.80s (0:03:33)\n")
    assert bm.pytest_summary(output) == {"passed": 604, "failed": 3, "errors": 1,
                                         "skipped": 2, "seconds": 213.8}
    assert bm.pytest_summary("12 passed in 0.51s") == {
        "passed": 12, "failed": 0, "errors": 0, "skipped": 0, "seconds": 0.51}
    with pytest.raises(ValueError, match="no pytest summary"):
        bm.pytest_summary("Segmentation fault (core dumped)")


def test_run_unit_tests_records_pytests_counts_and_duration(tmp_path):
    tests = tmp_path / "test_two.py"
    tests.write_text("def test_passes():\n    pass\n\n\ndef test_fails():\n    assert 0\n")
    said = []
    record = suite.run_unit_tests(said.append, command=("-m", "pytest", str(tests), "-q",
                                                        "-p", "no:cacheprovider"))
    assert (record["passed"], record["failed"], record["returncode"]) == (1, 1, 1)
    assert 0 < record["seconds"] <= record["wall_s"] and "test_two.py" in record["command"]
    assert said[-1].startswith("  unit tests: 1 passed, 1 failed")
    crashed = suite.run_unit_tests(said.append, command=("-c", "print('no tests here')"))
    assert "no pytest summary" in crashed["error"] and crashed["returncode"] == 0


def test_unit_tests_target_needs_the_time_and_no_failure(tmp_path):
    def with_tests(**record) -> dict:
        return dict(fake_results(), unit_tests={"passed": 607, "failed": 0, "errors": 0,
                                                "skipped": 0, "seconds": 150.0, **record})

    def row(**record):
        rows = bm.lean_targets(with_tests(**record))
        (found,) = [r for r in rows if r["target"].startswith("fast unit")]
        return found

    assert row()["met"] is True and row()["cell"] == "607 passed"
    assert row(seconds=213.8)["met"] is False  # over 180 s
    assert row(failed=2)["met"] is False and row(failed=2)["cell"] == "607 passed, 2 failed"
    assert row(errors=1)["met"] is False  # a collection error is a failure too
    assert not [r for r in bm.lean_targets(fake_results()) if r["target"].startswith("fast")]
    results = with_tests(seconds=213.8)
    results["targets"] = bm.evaluate_targets(results)
    text = open(os.path.join(write_fake_run(tmp_path, results), "RESULTS.md"),
                encoding="utf-8").read()
    assert "| fast unit tests (seconds) | 607 passed | 213.8 | — | ≤ 180 | **no** |" in text
    assert "| mlp: 580 vs 430 | 1.349 | — | ≤ 1 | **no** |" in text  # ratios keep 3 decimals
    broken = dict(results, unit_tests={"error": "no pytest summary line", "returncode": -9})
    (tmp_path / "broken").mkdir()
    assert any("unit_tests: no pytest summary" in p
               for p in report.validate_outputs(write_fake_run(tmp_path / "broken", broken)))


def test_paired_rounds_warms_up_then_rotates_the_order_every_round():
    calls: list[str] = []
    seconds = {"a": iter([9.0, 1.0, 2.0, 3.0]), "b": iter([9.0, 4.0, 5.0, 6.0]),
               "c": iter([9.0, 7.0, 8.0, 9.5])}

    def run(name):
        return lambda: (calls.append(name), next(seconds[name]))[1]

    out = bm.paired_rounds({name: run(name) for name in "abc"}, rounds=3)
    # one untimed warm-up each (the 9 s calls), then abc, bca, cab
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")
    assert out == {"a": [1.0, 2.0, 3.0], "b": [4.0, 5.0, 6.0], "c": [7.0, 8.0, 9.5]}
    with pytest.raises(ValueError, match="`rounds` must be an int >= 1"):
        bm.paired_rounds({"a": lambda: 1.0}, rounds=0)
    with pytest.raises(ValueError, match="`runs` is empty"):
        bm.paired_rounds({}, rounds=2)


def test_paired_rounds_with_cpu_times_the_same_calls_and_leaves_out_the_warm_up(monkeypatch):
    """The CPU seconds are read around each call (a fake clock advanced by the calls), the
    warm-up calls' left out, in the same rotated order as :func:`bm.paired_rounds`."""
    clock = [0.0]
    monkeypatch.setattr(bm.time, "process_time", lambda: clock[0])
    costs = {"a": iter([50.0, 1.0, 2.0]), "b": iter([60.0, 3.0, 4.0])}

    def run(name):
        def once():
            used = next(costs[name])
            clock[0] += used
            return 10 * used

        return once

    seconds, cpu = bm.paired_rounds_with_cpu({name: run(name) for name in "ab"}, rounds=2)
    assert seconds == {"a": [10.0, 20.0], "b": [30.0, 40.0]}
    assert cpu == {"a": [1.0, 2.0], "b": [3.0, 4.0]}


def test_ratio_and_target_text_print_the_interval_and_judge_its_low_end():
    ratio = {"median": 1.23456, "low": 0.94949, "high": 1.5, "rounds": 3}
    assert bm.ratio_text(ratio) == "1.235 [0.949, 1.500]"
    assert bm.target_text(ratio, None) == ""
    assert bm.target_text(ratio, 0.95) == " (target >= 0.95: not met)"
    assert bm.target_text(ratio, 0.9) == " (target >= 0.9: met)"


def test_benchmark_parser_has_rounds_samples_and_out():
    args = bm.benchmark_parser("d", rounds=7, samples=64).parse_args(["--rounds", "2"])
    assert (args.rounds, args.samples, args.out) == (2, 64, None)
    args = bm.benchmark_parser("d", rounds=5).parse_args(["--out", "x.json"])
    assert (args.rounds, args.out, hasattr(args, "samples")) == (5, "x.json", False)


def test_paired_verdict_calls_a_tie_when_the_interval_contains_1():
    words = dict(faster="up", slower="down")
    assert bm.paired_verdict({"low": 1.01, "high": 1.2}, **words) == "up"
    assert bm.paired_verdict({"low": 0.7, "high": 0.99}, **words) == "down"
    assert bm.paired_verdict({"low": 0.9, "high": 1.1}, **words) == "a tie"
    assert bm.paired_verdict({"low": 1.0, "high": 1.3}, **words, tie="even") == "even"
    assert bm.paired_verdict({"low": 0.8, "high": 1.0}, **words, tie="even") == "even"
    # judged as printed, to 2 decimals by default: "[0.71, 1.00]" contains 1
    assert bm.paired_verdict({"low": 0.71, "high": 0.9996}, **words) == "a tie"
    assert bm.paired_verdict({"low": 0.71, "high": 0.9996}, **words, digits=None) == "down"
    assert bm.paired_verdict({"low": 1.004, "high": 1.2}, **words) == "a tie"


def test_fit_epoch_times_one_epoch_of_fit_and_trains_it():
    x = np.random.default_rng(0).random((40, 784), dtype=np.float32)
    y = np.arange(40, dtype="int32") % 10
    model = ac.lab.experiments.mlp(hidden=(8,))
    model.compile(keras.optimizers.SGD(0.1), LOSS)
    run = bm.fit_epoch(model, x, y, batch_size=16)
    seconds = [run(), run()]
    assert all(0 < s < 60 for s in seconds)
    assert int(model.optimizer.iterations) == 2 * 3  # 16 + 16 + 8 per epoch


def test_paired_ratio_cancels_a_slow_phase_that_hits_both_runs_of_a_round():
    keras_s = [1.0, 1.0, 3.0, 1.0, 1.0, 2.0, 1.0]  # two rounds slowed by the machine
    ours_s = [1.25 * t for t in keras_s]  # 0.8x Keras's throughput in every round
    paired = bm.paired_ratio(keras_s, ours_s)
    assert paired == {"median": pytest.approx(0.8), "low": pytest.approx(0.8),
                      "high": pytest.approx(0.8), "rounds": 7}
    assert min(keras_s) / min(ours_s) == pytest.approx(0.8)  # best-of-N agrees here ...
    ours_s[0] = 0.9  # ... until one lucky run: best-of-N says faster, the pairs do not
    assert min(keras_s) / min(ours_s) > 1 and bm.paired_ratio(keras_s, ours_s)["median"] == \
        pytest.approx(0.8)
    rng = np.random.default_rng(3)
    reference, timed = list(1 + rng.random(41)), list(1 + rng.random(41))
    noisy = bm.paired_ratio(reference, timed)
    assert noisy["low"] < noisy["median"] < noisy["high"] and noisy["rounds"] == 41
    assert noisy == bm.paired_ratio(reference, timed)  # seeded: the interval is reproducible
    with pytest.raises(ValueError, match="same, non-zero number of rounds"):
        bm.paired_ratio([1.0, 2.0], [1.0])


def test_report_shows_the_paired_nonfinite_cost_when_measured(tmp_path):
    results = fake_results()
    results["targets"] = bm.evaluate_targets(results)
    out = write_fake_run(tmp_path, results)
    assert "paired [95 % interval]" not in open(os.path.join(out, "RESULTS.md")).read()
    kinds = {kind: {"best": best, "samples_per_s": 2048.0, "seconds": [2.5, 2.0],
                    "paired": {"median": med, "low": med - 0.02, "high": med + 0.01,
                               "rounds": 41}}
             for kind, best, med in (("keras_ga", 1.0, 1.0), ("accumcore", 0.95, 0.912),
                                     ("accumcore_unchecked", 1.01, 0.987))}
    with open(os.path.join(out, report.NONFINITE_COST_FILE), "w") as f:
        json.dump({"created": "2026-12-03T22:40:00", "rounds": 41, "micro_batch": 16,
                   "accum_steps": 4, "by_spe": {"32": kinds}}, f)
    report.write_report([out], os.path.join(out, "RESULTS.md"))
    text = open(os.path.join(out, "RESULTS.md")).read()
    assert "nonfinite_cost.py --rounds 41` (2026-12-03T22:40:00" in text
    assert "K=4, 4,096 synthetic samples per epoch" in text  # 2,048 samples/s x 2.0 s
    assert "| 32 | 0.912 [0.892, 0.922] | 0.950 | 0.987 [0.967, 0.997] | 1.010 |" in text


def test_nonfinite_cost_reports_three_ratios():
    import nonfinite_cost  # benchmarks/ is on sys.path (see `suite` above)

    ratios = nonfinite_cost.measure(spe=1, rounds=1, samples=128)
    assert set(ratios) == set(nonfinite_cost.KINDS)
    assert ratios["keras_ga"]["best"] == pytest.approx(1.0)
    assert all(r["best"] > 0 and r["samples_per_s"] > 0 for r in ratios.values())
    assert ratios["keras_ga"]["paired"]["median"] == pytest.approx(1.0)
    assert all(r["paired"]["rounds"] == 1 and len(r["seconds"]) == 1 for r in ratios.values())


def test_check_cost_pairs_each_path_with_its_unchecked_twin():
    """``check_cost`` divides best-of-N rates of the right variants (a swapped pair, or a
    median instead of the best, gives other numbers)."""
    def rec(variant, rates):
        return {"model": "mlp", "micro_batch": 16, "accum_steps": 4, "variant": variant,
                "samples_per_s": rates}
    results = {"breakdown": [rec("optimizer", [100.0, 200.0]), rec("accumcore", [150.0, 50.0]),
                             rec("accumcore_unchecked", [180.0, 10.0]),
                             rec("fit_keras_ga", [40.0]), rec("fit_accumcore", [30.0])]}
    (row,) = bm.check_cost(results)
    assert row["cell"] == "mlp b=16 K=4"
    assert row["graph"] == pytest.approx(0.75) and row["graph_unchecked"] == pytest.approx(0.9)
    assert row["fit"] == pytest.approx(0.75) and row["fit_unchecked"] is None


@pytest.mark.parametrize("entry", ["trainer", "fit"])
def test_the_unchecked_policy_removes_only_the_window_check(entry):
    """``suite.UNCHECKED`` (a public ``NonFinitePolicy``) is ``"raise"`` without the window's
    check: on finite data it trains exactly as ``"raise"``; a NaN window that ``"raise"``
    refuses is applied (the weights become NaN), so the check really is gone."""
    x, y = bm.benchmark_data("mlp", 32, "synthetic")

    def train(nonfinite, x):
        keras.utils.set_random_seed(0)
        if entry == "trainer":
            model = bm.build_model("mlp")
            ac.AccumTrainer(model, keras.optimizers.SGD(0.1), bm.LOSS, accum_steps=2,
                            nonfinite=nonfinite).fit(x, y, batch_size=8, shuffle=False,
                                                     verbose=0)
        else:
            model = bm.build_model("mlp", model_cls=ac.AccumModel, accum_steps=2,
                                   nonfinite=nonfinite)
            model.compile(keras.optimizers.SGD(0.1), bm.LOSS)
            model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        return model.get_weights()

    for a, b in zip(train("raise", x), train(suite.UNCHECKED, x), strict=True):
        np.testing.assert_array_equal(a, b)
    bad = x.copy()
    bad[20] = np.nan
    with pytest.raises(ac.NonFiniteGradientError):
        train("raise", bad)
    assert not all(np.isfinite(w).all() for w in train(suite.UNCHECKED, bad))


def test_code_size_measures_spans_and_code_lines(tmp_path):
    package = tmp_path / "pkg"
    (package / "lab").mkdir(parents=True)
    (package / "mod.py").write_text(
        '"""Module doc."""\n\n# a comment\n\nclass A:\n    """Doc\n    two lines."""\n\n'
        '    def f(self):\n        x = 1\n        return x\n')
    (package / "lab" / "big.py").write_text("class Ignored:\n" + "    x = 1\n" * 500)
    size = bm.code_size(str(package))
    assert size["largest_class"] == (7, "pkg/mod.py:A")  # lab/ is not the library
    assert size["longest_function"] == (3, "pkg/mod.py:f")
    assert size["code_lines"] == (4, "1 files")  # class, def, x = 1, return
    assert size["files"] == {"pkg/mod.py": 4}


def test_ratio_summary_ranges_each_ratio_over_the_cells():
    results = fake_results()
    # A second cell (b=16, K=8) in which AccumModel.fit is slower than Keras's accumulation.
    for rec in list(results["throughput"]):
        if rec["accum_steps"] == 4:
            slower = {"accum_fit": 60.0}.get(rec["config"], rec["median"])
            results["throughput"].append(dict(rec, accum_steps=8, median=slower))
    summary = {row["key"]: row for row in bm.ratio_summary(results)}
    fit = summary["fit_vs_keras"]
    assert (fit["cells"], fit["met"], fit["target"]) == (2, 1, bm.FIT_RATIO_TARGET)
    assert fit["low"] == pytest.approx(60 / 80) and fit["high"] == pytest.approx(90 / 80)
    assert fit["median"] == pytest.approx((60 / 80 + 90 / 80) / 2)
    small = summary["small_vs_large"]  # (1)/(2), no target
    assert small["low"] == small["high"] == pytest.approx(100 / 400) and small["met"] is None
    assert list(summary) == [k for k, _, _ in bm.SUMMARY_RATIOS]  # every ratio, in order


@pytest.mark.parametrize("plot, values", [
    (bm.plot_split_cost, {100 / 400, 190 / 400}),  # (1)/(2) and best accumcore / (2)
    (bm.plot_vs_keras, {90 / 80, 95 / 100}),  # (4)/(3) at spe=1 and at the large spe
    (bm.plot_ratios, {90 / 80, 190 / 200, 190 / 400}),
])
def test_cell_ratio_plots_are_horizontal_labelled_with_the_legend_below(plot, values):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = plot(fake_results())
    try:
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel() == "model and cell"
        assert [t.get_text() for t in ax.get_yticklabels()] == ["mlp b=16, K=4 (B=64)"]
        widths = {round(p.get_width(), 6) for p in ax.patches}
        assert widths == {round(v, 6) for v in values}  # one bar per ratio, its length
        legend = ax.get_legend()
        assert legend is not None and legend.get_bbox_to_anchor().y1 < ax.bbox.y0  # below
    finally:
        plt.close(ax.figure)


def test_throughput_plot_has_one_row_per_configuration():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = bm.plot_throughput(fake_results(), "mlp")
    try:
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert labels == [f"({n}) {label}" for n, label in bm.CONFIGS.values()]
        assert ax.get_xlabel() == "throughput (samples/s)"
        assert max(p.get_width() for p in ax.patches) == 400.0  # fit_B, the fastest
    finally:
        plt.close(ax.figure)


def test_memory_target_fails_when_accumulation_grows_with_k():
    results = fake_results()
    for rec in results["memory"]:
        if rec["method"] == "accum_window" and rec["accum_steps"] == 4:
            rec["peak_bytes"] = 90 * 2**20
    checks = [t for t in bm.evaluate_targets(results) if t["cell"] == "accum_window"]
    assert [t["met"] for t in checks] == [False, False]  # over budget and not flat


# ---------------------------------------------------------------------------- report
def write_fake_run(tmp_path, results: dict) -> str:
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(results))
    report.write_report([str(out)], str(out / "RESULTS.md"))
    return str(out)


def test_report_is_well_formed_and_validates(tmp_path):
    out = write_fake_run(tmp_path, fake_results())
    text = open(os.path.join(out, "RESULTS.md"), encoding="utf-8").read()
    for fragment in ("### Summary", "| (4)/(3): AccumModel.fit / fit with Keras's accumulation, "
                     "steps_per_execution=1 | 1 | 1.12 | 1.12 | 1.12 | ≥ 1 | 1 of 1 |",
                     "| graph operations / minimal accumulator's (entry points) | 4 | 1.41 |",
                     "### Targets", "missed by", "No GPU results yet", "| (4) accumcore "
                     "AccumModel.fit | 90 (±0 %) |", "![memory](memory.png)", "retracer",
                     "### Graph operations", "| mlp | AccumTrainer.window_step | 700 | "
                     "one window per call (split in the graph) | 450 | 1.56 | **no** |",
                     "(4)/(3) at spe=32", "minimal accumulator: whole-epoch"):
        assert fragment in text, fragment
    assert sorted(n for n in os.listdir(out) if n.endswith(".png")) == [
        "memory.png", "ratios.png", "throughput_mlp.png"]
    # targets are recomputed from the numbers, so the fake run needs none stored
    assert report.validate_outputs(out) == ["results.json has no target checks"]


def test_validate_outputs_catches_broken_outputs(tmp_path):
    results = fake_results()
    results["targets"] = bm.evaluate_targets(results)
    bad = copy.deepcopy(results)
    bad["throughput"][0]["samples_per_s"] = [1.0, 2.0]  # fewer repeats than the settings say
    bad["throughput"][1]["error"] = "ValueError: boom"
    out = write_fake_run(tmp_path, bad)
    with open(os.path.join(out, "ratios.png"), "wb") as f:
        f.write(b"not a png")
    problems = report.validate_outputs(out)
    assert any("expected 5 positive rates" in p for p in problems)
    assert any("failed: ValueError: boom" in p for p in problems)
    assert any("ratios.png is not a real PNG" in p for p in problems)
    assert not any("boom" in p for p in report.validate_outputs(out, allow_errors=True))
    bad_ops = copy.deepcopy(results)
    bad_ops["ops"] = bad_ops["ops"][:1] + [dict(bad_ops["ops"][1], ops=0)]
    (tmp_path / "ops").mkdir()
    problems = report.validate_outputs(write_fake_run(tmp_path / "ops", bad_ops))
    assert any("no positive count" in p for p in problems)
    os.remove(os.path.join(out, "memory.png"))
    assert any("missing image memory.png" in p for p in report.validate_outputs(out))


def test_load_results_rejects_other_schemas(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"schema": 0}))
    with pytest.raises(ValueError, match="schema"):
        bm.load_results(str(path))


def test_settings_presets():
    quick = suite.SuiteSettings.quick_preset()
    full = suite.SuiteSettings.full()
    assert quick.quick and not full.quick
    assert full.repeats >= 5  # the issue: medians of >= 5 interleaved repeats
    assert set(full.configs) == set(bm.CONFIGS)
    assert full.memory_accum_steps == (1, 2, 4, 8, 16)
    with pytest.raises(ValueError, match="Unknown experiments"):
        suite.run_suite(quick, only=["speed"])


def test_merge_replaces_the_parts_run_and_takes_the_code_size_now():
    import run  # benchmarks/run.py (benchmarks/ is on sys.path, see `suite` above)

    old, new = fake_results(), fake_results()
    old["code"] = {"code_lines": [9999, "24 files"]}  # the source has changed since
    new["code"] = bm.code_size()
    new["ops"] = [dict(r, ops=r["ops"] + 1) for r in old["ops"]]
    merged = run.merge(old, new, ["ops"])
    assert merged["code"] == new["code"]
    assert merged["ops"] == new["ops"] and merged["throughput"] == old["throughput"]
    assert "ops" in merged["merged_parts"]
    # each part keeps the date of the run that measured it (the reader's page names it)
    old["created"], new["created"] = "2026-12-04T10:00:00", "2026-12-05T10:00:00"
    old["part_created"] = {"breakdown": "2026-12-04T10:00:00", "ops": "2026-12-04T10:00:00"}
    merged = run.merge(old, new, ["ops"])
    assert merged["part_created"]["breakdown"] == "2026-12-04T10:00:00"
    assert merged["part_created"]["ops"] == "2026-12-05T10:00:00"
    # a full run writes no part dates: its parts keep its own date, not the merging run's
    del old["part_created"]
    merged = run.merge(old, new, ["ops"])
    assert merged["part_created"]["ops"] == "2026-12-05T10:00:00"
    assert {date for part, date in merged["part_created"].items() if part != "ops"} == {
        "2026-12-04T10:00:00"}


def _op(start: float, duration: float, name: str, op_type: str):
    import profile_step  # benchmarks/ is on sys.path (see `suite` above)

    return profile_step.OpEvent(start, duration, name, op_type)


def test_profile_step_cuts_micro_steps_at_the_first_layer_and_splits_by_window_position():
    """Nine micro-steps whose span depends on the window position (K = 4): the summary gives
    each position its own median, and sums op time per micro-step by type."""
    import profile_step

    events, t = [], 0.0
    span_of = {0: 300.0, 1: 100.0, 2: 100.0, 3: 500.0}
    for i in range(9):
        events.append(_op(t, 40.0, "model/dense/Relu", "_FusedMatMul"))  # the first layer
        events.append(_op(t + 50, 10.0, "model/dense_1/Relu", "_FusedMatMul"))
        events.append(_op(t + 70, 5.0 if i % 4 else 20.0, "acc/AssignAdd", "AssignAddVariableOp"))
        t += span_of[i % 4]
    steps = profile_step.micro_steps(events)
    assert len(steps) == 8 and all(s[0].name == "model/dense/Relu" for s in steps)
    summary = profile_step.summarize(steps, spe=1)
    assert summary["span_by_position_us"] == {0: 300.0, 1: 100.0, 2: 100.0, 3: 500.0}
    assert summary["busy_by_position_us"] == {0: 70.0, 1: 55.0, 2: 55.0, 3: 55.0}
    assert summary["top_op_types_us"]["_FusedMatMul"] == pytest.approx(50.0)
    # steps_per_execution 4: the micro-step ending each call (position 3 here) is left out.
    assert 3 not in profile_step.summarize(steps, spe=4)["span_by_position_us"]
    with pytest.raises(ValueError, match="forward pass"):
        profile_step.micro_steps([_op(0.0, 1.0, "x", "AddV2")])


def test_profile_step_combines_rounds_by_the_median_of_each_position():
    import profile_step

    def summary(spans, matmul):
        return {"micro_steps": 8, "span_us": statistics.median(spans.values()),
                "span_by_position_us": spans, "busy_by_position_us": spans,
                "top_op_types_us": {"MatMul": matmul}}

    rounds = [summary({0: 100.0, 3: 400.0}, 10.0), summary({0: 300.0, 3: 200.0}, 20.0),
              summary({0: 200.0, 3: 900.0}, 60.0)]
    combined = profile_step.combine(rounds)
    assert combined["span_by_position_us"] == {0: 200.0, 3: 400.0}
    assert combined["micro_steps"] == 24 and combined["rounds"] == 3
    assert combined["top_op_types_us"] == {"MatMul": pytest.approx(30.0)}


@pytest.mark.slow
def test_profile_step_profiles_both_fits():
    import profile_step

    results = profile_step.profile(spe=4, samples=256, rounds=2)
    assert set(results) == set(profile_step.KINDS)
    for summary in results.values():
        assert summary["micro_steps"] > 0 and summary["rounds"] == 2
        assert set(summary["span_by_position_us"]) == set(range(profile_step.ACCUM_STEPS - 1))
        assert "MatMul" in summary["top_op_types_us"]


@pytest.mark.slow
def test_accumulate_lm_benchmark_measures_a_paired_ratio(tmp_path):
    """benchmarks/accumulate_lm.py on 2 rounds: both configurations timed per round and the
    paired ratio with its interval written (never a speed: a shared machine)."""
    pytest.importorskip("keras_hub")
    out = tmp_path / "accumulate_lm.json"
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "accumulate_lm.py")
    subprocess.run([sys.executable, script,
                    "--rounds", "2", "--out", str(out)], check=True, timeout=600)
    result = json.loads(out.read_text())
    assert [len(v) for v in result["seconds"].values()] == [2, 2]
    paired = result["throughput_ratio_paired"]
    assert paired["low"] <= paired["median"] <= paired["high"] and paired["rounds"] == 2


def test_accumulate_lm_section_renders_the_paired_ratio_and_its_verdict():
    record = {"config": {"layers": 2, "hidden": 64, "sequences": 512, "length": 64,
                         "micro_batch": 8, "accum_steps": 4, "keras": "3.15.1",
                         "keras_hub": "0.32.0", "rounds": 21},
              "throughput_ratio_paired": {"median": 0.977, "low": 0.956, "high": 1.4,
                                          "rounds": 21},
              "throughput_ratio_best_of_n": 0.993, "target": 0.97}
    lines = report.accumulate_lm_lines(record)
    assert lines[-1] == "| fit | 0.977 [0.956, 1.400] | 0.993 | ≥ 0.97 | met |"
    record["throughput_ratio_paired"]["median"] = 0.9
    assert report.accumulate_lm_lines(record)[-1].endswith("| **missed** |")
    assert report.accumulate_lm_lines(None) == []


def test_profile_step_section_puts_the_window_gap_by_position():
    """RESULTS.md's reason for a fit-ratio miss: the per-position spans of both fits as
    profile_step.py's JSON holds them (keys are strings after the round trip), their
    differences, and the window's total split into the closing micro-step and the others."""
    record = {"created": "2026-12-05T06:00:00+0000", "steps_per_execution": 32,
              "samples": 4096, "micro_batch": 16, "accum_steps": 4, "tensorflow": "2.21.0",
              "keras": "3.15.1",
              "kinds": {"keras_ga": {"span_by_position_us": {"0": 500.0, "1": 480.0,
                                                             "2": 490.0, "3": 900.0}},
                        "accumcore": {"span_by_position_us": {"0": 510.0, "1": 470.0,
                                                              "2": 500.0, "3": 1200.0}}}}
    lines = report.profile_step_lines(json.loads(json.dumps(record)))
    assert "| 3 (closes the window) | 900 | 1200 | +300 |" in lines
    assert "| 1 | 480 | 470 | -10 |" in lines
    assert lines[-1].startswith("Over one window AccumModel's micro-steps took +310 µs against "
                                "Keras's: +300 µs in the micro-step that closes the window and "
                                "+10 µs in the 3 that do not.")
    assert report.profile_step_lines(None) == []


@pytest.mark.slow
def test_split_fit_benchmark_measures_paired_ratios_and_memory(tmp_path):
    """benchmarks/split_fit.py on 2 rounds of the MLP: every configuration timed per round, the
    paired ratios with their intervals and the memory ratio written and rendered (never a
    speed: a shared machine)."""
    out = tmp_path / "split_fit.json"
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "split_fit.py")
    subprocess.run([sys.executable, script, "--models", "mlp", "--rounds", "2", "--out",
                    str(out)], check=True, timeout=900)
    record = json.loads(out.read_text())
    assert [len(v) for v in record["mlp"]["seconds"].values()] == [2] * len(
        split_fit.DEFAULT_KINDS)
    for p in record["mlp"]["ratios"].values():
        assert p["low"] <= p["median"] <= p["high"] and p["rounds"] == 2
    assert record["memory"]["split"]["peak_bytes"] > 0
    lines = report.split_fit_lines(record)
    assert sum(line.startswith("| mlp |") for line in lines) == len(split_fit.DEFAULT_KINDS) - 1
    assert "Peak memory" in lines[-1]


def test_split_fit_section_calls_a_target_met_only_when_the_interval_clears_it():
    p = {"median": 1.6, "low": 1.52, "high": 1.7, "rounds": 21}
    record = {"rounds": 21, "tensorflow": "2.21.0", "keras": "3.15.1",
              "load_average": [[1.0, 1, 1], [1.2, 1, 1]],
              "mlp": {"ratios": {"split/keras_ga": p}, "targets": {"keras_ga": 1.5}}}
    assert report.split_fit_lines(record)[-1].endswith("| ≥ 1.5 | met |")
    p["low"] = 1.4
    assert report.split_fit_lines(record)[-1].endswith("| not shown (interval spans it) |")
    p["high"] = 1.45
    assert report.split_fit_lines(record)[-1].endswith("| **missed** |")
    assert report.split_fit_lines(None) == []


def _split_record() -> dict:
    ratio = {"median": 1.6, "low": 1.52, "high": 1.7, "rounds": 21}
    return {"mlp": {"ratios": {"split/keras_ga": dict(ratio),
                               "split/plain_B": {**ratio, "median": 0.8, "low": 0.7,
                                                 "high": 0.9},
                               "split/micro_steps": dict(ratio)},
                    "targets": {"keras_ga": 1.5, "plain_B": 0.85}}}


def test_split_fit_rows_judge_each_target_by_the_interval():
    rows = {r["reference"]: r for r in bm.split_fit_rows(_split_record())}
    assert rows["keras_ga"]["verdict"] == "met"  # 1.52 >= 1.5
    assert rows["plain_B"]["verdict"] == "undecided"  # 0.7 < 0.85 <= 0.9
    assert rows["micro_steps"]["verdict"] is None and rows["micro_steps"]["target"] is None
    record = _split_record()
    record["mlp"]["ratios"]["split/plain_B"]["high"] = 0.84
    assert {r["reference"]: r for r in bm.split_fit_rows(record)}["plain_B"]["verdict"] == (
        "missed")


def test_split_fit_plot_has_a_bar_per_ratio_targets_and_labels():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = bm.plot_split_fit(_split_record())
    try:
        assert ax.get_title() and ax.get_xlabel()
        assert sorted(round(p.get_width(), 6) for p in ax.patches) == [0.8, 1.6, 1.6]
        assert len(ax.get_yticklabels()) == 3
        assert any(c.get_offsets().shape[0] == 2 for c in ax.collections)  # two targets
    finally:
        plt.close(ax.figure)


def test_fast_path_benchmark_pairs_plain_fit_with_b_equal_to_the_batch_and_auto():
    import fast_path  # benchmarks/ is on sys.path (see `suite` above)

    result = fast_path.measure("mlp", rounds=1, samples=128, spes=(1, 2))
    assert set(result) == {"spe1", "spe2"}
    for figures in result.values():
        assert set(figures["seconds"]) == set(figures["cpu_seconds"]) == set(fast_path.KINDS)
        assert all(len(s) == 1 and s[0] > 0 for s in figures["seconds"].values())
        assert all(len(s) == 1 for s in figures["cpu_seconds"].values())
        assert set(figures["ratios"]) == set(figures["cpu_ratios"]) == {
            f"{a}/{b}" for a, b in fast_path.RATIOS}
        plain, fixed = figures["seconds"]["plain"][0], figures["seconds"]["fixed"][0]
        assert figures["ratios"]["fixed/plain"]["median"] == pytest.approx(plain / fixed)
