"""The window rule in one place: one ``apply`` call site, the state's variable lists, the
injected non-finite policy, and the loss-scale rule pinned against Keras's LossScaleOptimizer."""

from __future__ import annotations

import ast
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import LOSS, REL_TOL, built_state, small_mlp

import accumcore as ac
from accumcore._impl import loss_scaling
from accumcore._impl.nonfinite import POLICIES, NonFinitePolicy
from accumcore.lab.experiments import get_weights, relative_error

PACKAGE = Path(__file__).resolve().parents[1] / "accumcore"
LIBRARY = sorted(p for p in PACKAGE.rglob("*.py") if "lab" not in p.relative_to(PACKAGE).parts)


# ---------------------------------------------------------------------------- structure
def _calls_of(attribute: str) -> list[str]:
    sites = []
    for path in LIBRARY:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == attribute):
                sites.append(f"{path.name}:{node.lineno}")
    return sites


def test_optimizer_apply_has_one_call_site_in_the_rule() -> None:
    sites = _calls_of("apply")
    assert len(sites) == 1 and sites[0].startswith("rule.py:"), sites  # accumcore/_impl/


def test_the_rule_never_takes_the_state() -> None:
    """Calls go one way, entry point -> state -> rule: no function of the rule has a
    parameter named ``state`` (it takes the window, the counters and the plan)."""
    tree = ast.parse((PACKAGE / "_impl" / "rule.py").read_text())
    takes = [node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
             and any(a.arg == "state" for a in node.args.args + node.args.kwonlyargs)]
    assert not takes, takes


def _chain(entry: str, how: dict, batch_size: int) -> dict[str, list[str]]:
    """The library modules on the stack from the entry point's step to ``optimizer.apply``
    (``"apply"``) and to the accumulation of a gradient (``"add"``, where one is added), in
    call order (one entry per frame)."""
    import traceback

    from accumcore._impl import rule

    chains: dict[str, list[str]] = {}
    starts = ("train_step", "_micro_step", "_split_batch")

    def record(name: str) -> None:
        stack = traceback.extract_stack()[:-2]
        first = max(i for i, f in enumerate(stack) if f.name in starts)
        chains.setdefault(name, [Path(f.filename).name for f in stack[first:]
                                 if str(PACKAGE) in f.filename])

    x, y = np.zeros((8, 8), "float32"), np.zeros(8, "int32")
    optimizer = keras.optimizers.SGD(0.1)
    apply, add_gradient = optimizer.apply, rule.add_gradient
    optimizer.apply = lambda *a, **k: record("apply") or apply(*a, **k)
    rule.add_gradient = lambda *a, **k: record("add") or add_gradient(*a, **k)
    try:
        if entry == "fit":
            model = ac.accumulate(small_mlp(), **how)
            model.compile(optimizer, LOSS)
            model.fit(x, y, batch_size=batch_size, verbose=0)
        else:
            trainer = ac.AccumTrainer(small_mlp(), optimizer, LOSS, **how)
            trainer.train_micro_batch(x, y)  # eager: the Python stack is the library's
    finally:
        rule.add_gradient = add_gradient
    return chains


@pytest.mark.parametrize("entry", ["fit", "trainer"])
@pytest.mark.parametrize("how", [dict(micro_batch_size=4), dict(accum_steps=1)])
def test_no_module_is_entered_twice_on_the_way_to_the_update(entry, how) -> None:
    """Issue 47: the split path went rule -> state -> rule (12 frames, 4 modules, 7 module
    crossings from ``train_step`` to ``optimizer.apply``); now entry point -> state -> rule,
    with one replica (2 crossings), both to ``optimizer.apply`` and to a gradient's add. A
    clean window of one micro-batch (K = 1) adds no gradient, it goes to the optimizer
    directly: run eagerly (the trainer) no add is called; ``fit`` traces the add of the
    branch that a bad micro-batch takes."""
    chains = _chain(entry, how, batch_size=8)
    direct = entry == "trainer" and "accum_steps" in how
    assert sorted(chains) == (["apply"] if direct else ["add", "apply"])
    for modules in chains.values():
        runs = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
        assert len(runs) == len(set(runs)) == 3, modules
        assert runs[1:] == ["state.py", "rule.py"], modules


def test_no_library_function_is_over_60_lines() -> None:
    """A function that does not fit on a screen does more than one thing."""
    long = [f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
            for path in LIBRARY for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > 60]
    assert not long, long


def test_no_module_touches_another_objects_private_members() -> None:
    """``x._name`` only on ``self`` / ``cls`` / ``super()`` in the library (not the lab)."""
    found = []
    for path in LIBRARY:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
                continue
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


# ---------------------------------------------------------------------------- variables
def test_variables_for_saving_keep_the_order_of_saved_files() -> None:
    """The ``.keras`` entries ``accumcore_<i>`` follow this order: it must never change."""
    model, state, _ = built_state(3)
    expected = [*state.accumulators, state.window_weight, state.micro_step, state.window_samples,
                state.windows_applied, state.windows_skipped, state.micro_batches_seen,
                state.micro_batches_skipped, state.samples_seen, state.samples_dropped,
                state.window_poisoned]
    assert [id(v) for v in state.variables_for_saving()] == [id(v) for v in expected]
    assert len(state.accumulators) == len(model.trainable_variables)
    state.build_undivided()  # a sum over samples beside a mean loss: appended, last
    assert len(state.undivided_accumulators) == len(state.accumulators)
    assert [id(v) for v in state.variables_for_saving()] == [
        id(v) for v in [*expected, *state.undivided_accumulators]]


def test_drop_window_empties_exactly_the_window_variables() -> None:
    model, state, _ = built_state(3)
    x = np.random.default_rng(0).normal(size=(5, 8)).astype("float32")
    y = np.array([0, 1, 2, 0, 1])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(y, model(x)))
    grads = tape.gradient(loss, model.trainable_variables)
    state.accumulate(grads, 5.0, 5, undivided=grads)
    state.window_poisoned.assign(1)
    before = state.counters()
    assert before["micro_step"] == 1 and before["window_samples"] == 5
    assert all(np.any(a.numpy() != 0) for a in state.accumulators)
    assert all(np.any(a.numpy() != 0) for a in state.undivided_accumulators)
    state.drop_window()
    window = [*state.accumulators, state.window_weight, state.micro_step, state.window_samples,
              state.window_poisoned, *state.undivided_accumulators]
    assert all(np.all(v.numpy() == 0) for v in window)
    after = state.counters()
    assert before["window_weight"] == 5.0 and after["window_weight"] == 0.0
    assert after["samples_dropped"] == 5 and after["windows_skipped"] == 0  # dropped, counted
    untouched = ("windows_applied", "micro_batches_seen", "micro_batches_skipped", "samples_seen")
    assert {k: after[k] for k in untouched} == {k: before[k] for k in untouched}


def test_undivided_gradients_are_checked_like_grads() -> None:
    """``accumulate(..., undivided=)``: one per trainable variable, in order, or a
    ``ValueError`` naming ``undivided`` (nothing added, nothing created)."""
    model, state, _ = built_state(3)
    grads = [tf.ones_like(v) for v in model.trainable_variables]
    with pytest.raises(ValueError, match="`undivided` must match the trainable variables"):
        state.accumulate(grads, 1.0, 1, undivided=grads[:-1])
    with pytest.raises(ValueError, match="`undivided` must be in the order"):
        state.accumulate(grads, 1.0, 1, undivided=grads[::-1])
    assert state.undivided_accumulators == [] and state.counters()["micro_step"] == 0


def test_unbuilt_state_has_no_variable_lists() -> None:
    with pytest.raises(ValueError, match="not built"):
        ac.AccumulationState(2).variables_for_saving()


# ---------------------------------------------------------------------------- policy
def test_public_names_map_to_policies() -> None:
    assert ac.AccumulationState(2).nonfinite_policy is POLICIES["raise"]
    state = ac.AccumulationState(2, nonfinite="skip_window")
    assert (state.nonfinite, state.nonfinite_policy.skip_window) == ("skip_window", True)
    state.nonfinite = "skip_micro_batch"  # as AccumModel.set_accumulation assigns it
    assert state.nonfinite_policy is POLICIES["skip_micro_batch"]
    assert state.get_config() == {"accum_steps": 2, "nonfinite": "skip_micro_batch"}
    with pytest.raises(ValueError, match="nonfinite"):
        ac.AccumulationState(2, nonfinite="ignore")


def test_an_injected_predicate_decides_which_micro_batches_count(data) -> None:
    """A custom ``should_skip`` (here: drop micro-batches under 6 samples) is the whole skip
    decision: the result equals plain Keras on the samples the predicate kept."""
    x, y = data  # 40 samples in micro-batches of 6: six full ones and a last one of 4
    micro, k, epochs = 6, 7, 2  # one window per epoch, its last micro-batch dropped
    ref = small_mlp()
    initial = get_weights(ref)
    ref.compile(keras.optimizers.Adam(0.01), LOSS)
    for _ in range(epochs):
        ref.train_on_batch(x[:36], y[:36])
    reference = get_weights(ref)

    small = NonFinitePolicy("small", should_skip=lambda grads, weight: weight < micro)
    model = small_mlp()
    trainer = ac.AccumTrainer(model, keras.optimizers.Adam(0.01), LOSS, accum_steps=k,
                              nonfinite=small)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(micro)
    trainer.fit(dataset, epochs=epochs, mode="function", verbose=0)
    assert relative_error(get_weights(model), reference, initial) <= REL_TOL
    counters = trainer.state.counters()
    assert counters["micro_batches_skipped"] == 2 and counters["samples_dropped"] == 8
    assert counters["windows_applied"] == epochs


# ---------------------------------------------------------------------------- loss scaling
# Finite and non-finite windows, with dynamic_growth_steps=2: growth, halving, restarts.
SEQUENCE = ("finite", "finite", "finite", "inf", "finite", "nan", "finite", "finite", "finite")


def _scaled_optimizer() -> keras.optimizers.LossScaleOptimizer:
    inner = keras.optimizers.SGD(0.1, momentum=0.9)
    return keras.optimizers.LossScaleOptimizer(inner, initial_scale=16.0, dynamic_growth_steps=2)


@pytest.mark.parametrize("compiled", [False, True])
def test_loss_scale_mirror_follows_keras_loss_scale_optimizer(compiled: bool) -> None:
    """accumcore's mirror (used only under a strategy) against LossScaleOptimizer.apply itself:
    same scale, growth counter, iterations and weights after every window of the sequence."""
    keras_vars = [tf.Variable(np.ones((3, 2), "float32")), tf.Variable(np.zeros(2, "float32"))]
    mirror_vars = [tf.Variable(v.numpy()) for v in keras_vars]
    keras_opt, mirror_opt = _scaled_optimizer(), _scaled_optimizer()
    keras_opt.build(keras_vars)
    mirror_opt.build(mirror_vars)

    def mirrored(grads: list) -> tf.Tensor:
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])

        def update() -> tf.Tensor:
            mirror_opt.inner_optimizer.apply(loss_scaling.unscale(mirror_opt, grads), mirror_vars)
            return tf.constant(True)

        applied = tf.cond(finite, update, lambda: tf.constant(False))
        loss_scaling.update_scale(mirror_opt, applied)
        return applied

    step = tf.function(mirrored) if compiled else mirrored
    rng = np.random.default_rng(0)
    scales = []
    for kind in SEQUENCE:
        grads = [tf.constant(rng.normal(size=v.shape).astype("float32")) for v in keras_vars]
        if kind != "finite":
            bad = np.inf if kind == "inf" else np.nan
            grads[1] = tf.tensor_scatter_nd_update(grads[1], [[0]], [bad])
        before = [v.numpy() for v in keras_vars]
        keras_opt.apply(grads, keras_vars)
        moved = any(np.any(v.numpy() != b) for v, b in zip(keras_vars, before))
        assert bool(loss_scaling.window_applied(keras_opt, grads)) == moved == (kind == "finite")
        assert bool(step(grads)) == moved
        assert loss_scaling.loss_scale(mirror_opt) == loss_scaling.loss_scale(keras_opt), kind
        assert int(mirror_opt.step_counter.numpy()) == int(keras_opt.step_counter.numpy())
        assert int(mirror_opt.iterations.numpy()) == int(keras_opt.iterations.numpy())
        for a, b in zip(mirror_vars, keras_vars):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)
        scales.append(loss_scaling.loss_scale(keras_opt))
    # The sequence exercised growth and halving (else the comparison above proves little).
    assert scales[:4] == [16.0, 32.0, 32.0, 16.0] and min(scales) < max(scales)


def test_saved_micro_step_reads_the_pending_count_from_saved_values():
    from accumcore._impl.state import saved_micro_step

    state = ac.AccumulationState(3)
    state.build([tf.Variable(tf.zeros((2, 2))), tf.Variable(tf.zeros(2))])
    state.micro_step.assign(2)
    values = [v.numpy() for v in state.variables_for_saving()]
    assert saved_micro_step(values) == 2
    state.micro_step.assign(0)
    assert saved_micro_step([v.numpy() for v in state.variables_for_saving()]) == 0
