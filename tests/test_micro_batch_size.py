"""``micro_batch_size``: the recipe's batch B in ``fit``, split into micro-batches of at most b
inside the one train step; ``"auto"`` finds b and reruns a batch that runs out of memory.

The exactness cases that ``accum_steps`` has are parametrised over both settings in
tests/test_accumulate.py and tests/test_keras_hub.py (``WAYS``), tests/test_distribute.py
(``_split``, ``fit_split``), tests/test_mixed_precision.py, tests/test_batchnorm.py,
tests/test_tokens.py and tests/test_equivalence.py (``fit_split``), tests/test_loss_forms.py
(``*_split``), tests/test_workflows_model.py, tests/test_workflows_loops.py, tests/test_model.py
and tests/test_bad_input.py (a mode parameter), tests/test_resume.py
(``fit_exact_backup_split``) and the keras.io-shaped programs of tests/test_programs.py; this
file holds what only this setting has. Every equivalence test compares against an independent
large-batch reference from the same initial weights (``helpers.reference_weights``: plain Keras
``train_on_batch`` on each batch of B). Tolerance ``REL_TOL`` (tests/helpers.py: float32
re-association with a 5x margin, 3-4 orders below a real bug's size).

Out of memory is injected on CPU: a layer whose ``tf.py_function`` raises ``MemoryError`` for a
micro-batch above a limit, which reaches the caller as ``tf.errors.ResourceExhaustedError``
(a ``py_function`` does not compile under XLA, so these run without ``jit_compile``).
"""

from __future__ import annotations

import logging
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import (
    LOSS,
    REL_TOL,
    assert_matches_reference,
    get_weights,
    make_data,
    reference_weights,
    relative_error,
    small_mlp,
)

import accumcore as ac

B, b = 16, 6  # 40 samples: batches of 16, 16, 8; cut 6 + 6 + 4 and 6 + 2


def adam() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(0.01)


def _split_model(make_opt=adam, *, micro=b, make_model=small_mlp, **compile_kwargs):
    model = make_model()
    model.compile(make_opt(), LOSS, **compile_kwargs)
    return ac.accumulate(model, micro_batch_size=micro)


def test_xla_with_ragged_micro_batches_matches_the_large_batch(data):
    """Uneven micro-batches under ``jit_compile=True``: a slice past the batch's end would be
    clamped by XLA and silently re-read samples (a 4.5x error in a quick stand-in)."""
    x, y = data
    initial, ref = reference_weights(adam, x, y, None, windows=_batches(len(x), B))
    model = _split_model(jit_compile=True)
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_matches_reference(model, initial, ref)
    assert int(model.optimizer.iterations.numpy()) == 3


def _batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


class _Counting(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None) -> None:
        self.batches += 1


def test_keras_counts_updates_batches_steps_per_epoch_and_steps_per_execution(data):
    """Callbacks see one batch per update, ``steps_per_epoch=N`` makes N updates, and
    ``steps_per_execution`` runs several whole batches per call, exactly."""
    x, y = data
    model = _split_model()
    counting = _Counting()
    model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[counting])
    assert counting.batches == int(model.optimizer.iterations.numpy()) == 6

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(B).repeat()
    model = _split_model()
    model.fit(ds, steps_per_epoch=2, epochs=3, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 6

    initial, ref = reference_weights(adam, x, y, None, windows=_batches(len(x), B))
    model = _split_model(steps_per_execution=2)
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_matches_reference(model, initial, ref)


def test_logged_loss_and_metrics_are_the_large_batch_ones(data):
    """Metrics are updated from every micro-batch's outputs: the epoch's loss and accuracy
    equal plain ``fit`` at B (which sees the same weights: SGD with a zero rate)."""
    x, y = data
    plain = small_mlp()
    plain.compile(keras.optimizers.SGD(0.0), LOSS, metrics=["accuracy"])
    expected = plain.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0).history
    model = small_mlp()
    model.compile(keras.optimizers.SGD(0.0), LOSS, metrics=["accuracy"])
    ac.accumulate(model, micro_batch_size=b)
    got = model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0).history
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["accuracy"], expected["accuracy"], rtol=1e-6)


def test_many_micro_batches_trace_once_per_batch_shape():
    """K = 64 micro-batches per batch in a loop, not unrolled: the step is traced once per
    distinct batch shape (here two: 128 and the last 64), and the update is exact."""
    x, y = make_data(192)
    initial, ref = reference_weights(adam, x, y, None, windows=_batches(len(x), 128))
    model = _split_model(micro=2)
    traces = []
    step = model.train_step
    model.train_step = lambda data: traces.append(1) or step(data)
    model.fit(x, y, batch_size=128, epochs=2, shuffle=False, verbose=0)
    assert len(traces) <= 2 * 2
    model2 = _split_model(micro=2)
    model2.fit(x, y, batch_size=128, epochs=1, shuffle=False, verbose=0)
    assert_matches_reference(model2, initial, ref)


def _graph_size(micro: int) -> int:
    """Nodes of the traced train step (its functions' bodies included) for batches of 256
    samples (a static size, which an unrolled loop could use) split into micro-batches of
    ``micro``."""
    model = _split_model(micro=micro)
    model.fit(*make_data(8), batch_size=8, epochs=1, verbose=0)  # build what fit builds
    step = tf.function(model.train_step).get_concrete_function(
        (tf.TensorSpec([256, 8]), tf.TensorSpec([256], tf.int64)))
    graph = step.graph.as_graph_def()
    return len(graph.node) + sum(len(f.node_def) for f in graph.library.function)


def test_the_graph_does_not_grow_with_the_number_of_micro_batches():
    """b = 1 (K = 256) traces the same graph as b = 64 (K = 4): one loop body. The count sees
    one more micro-batch's pass: b = 48 adds the rest's (5 x 48 + 16)."""
    assert _graph_size(1) == _graph_size(64) < _graph_size(48)


@pytest.mark.parametrize(("bad", "error"), [(0, ValueError), (-1, ValueError),
                                            (2.0, TypeError), (True, TypeError),
                                            ("big", ValueError), ("AUTO", ValueError)])
def test_bad_micro_batch_size_names_the_parameter_and_the_accepted_values(bad, error):
    with pytest.raises(error, match=r"`micro_batch_size` must be a positive int .*'auto'"):
        ac.accumulate(small_mlp(), micro_batch_size=bad)
    with pytest.raises(error, match="micro_batch_size"):
        ac.AccumModel(*_io(), micro_batch_size=bad)


def _io():
    inputs = keras.Input((8,))
    return inputs, keras.layers.Dense(3, activation="softmax")(inputs)


def test_both_or_neither_setting_is_refused_and_one_replaces_the_other(data):
    with pytest.raises(ValueError, match="`accum_steps` or `micro_batch_size`, not both"):
        ac.accumulate(small_mlp(), accum_steps=4, micro_batch_size=16)
    with pytest.raises(ValueError, match="micro_batch_size=b"):
        ac.accumulate(small_mlp())
    model = _split_model()
    assert model.accumulation.micro_batch_size == b and model.accumulation.accum_steps == 1
    ac.accumulate(model, accum_steps=3)
    assert model.accumulation.micro_batch_size is None and model.accumulation.accum_steps == 3


def test_accum_model_takes_it_and_its_config_round_trips(data):
    x, y = data
    initial, ref = reference_weights(adam, x, y, None, windows=_batches(len(x), B))
    model = small_mlp(model_cls=ac.AccumModel, micro_batch_size=b)
    model.compile(adam(), LOSS)
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert_matches_reference(model, initial, ref)
    assert model.micro_batch_size == b
    clone = ac.AccumModel.from_config(model.get_config())
    assert clone.micro_batch_size == b and clone.accum_steps == 1


# ---------------------------------------------------------------------- "auto", out of memory
class _Limit(keras.layers.Layer):
    """Identity that "runs out of memory" (``MemoryError`` in a ``py_function``) on more than
    ``LIMIT["samples"]`` samples at once, from its call number ``LIMIT["after"] + 1`` on (calls
    counted in ``CALLS``, as they run: one per micro-batch's forward pass, probes included)."""

    LIMIT = {"samples": 10**9, "after": 0}
    CALLS = [0]

    def call(self, x):
        def check(t):
            self.CALLS[0] += 1
            if self.CALLS[0] > self.LIMIT["after"] and t.shape[0] > self.LIMIT["samples"]:
                raise MemoryError(f"injected: {t.shape[0]} samples")
            return t

        out = tf.py_function(check, [x], x.dtype)
        out.set_shape(x.shape)
        return out


def _limited_mlp(seed: int = 0) -> keras.Model:
    """An MLP with the out-of-memory layer between its two Dense layers."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    hidden = _Limit()(keras.layers.Dense(16, activation="tanh")(inputs))
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))


@pytest.fixture
def limit():
    _Limit.CALLS[0] = 0
    yield _Limit.LIMIT
    _Limit.LIMIT.update(samples=10**9, after=0)


def test_auto_finds_the_largest_micro_batch_that_fits_and_reports_it(data, limit, caplog):
    x, y = data
    initial, ref = reference_weights(adam, x, y, None, windows=_batches(len(x), B),
                                     make_model=_limited_mlp)
    limit["samples"] = 5
    model = _limited_mlp()
    model.compile(adam(), LOSS)
    ac.accumulate(model, micro_batch_size="auto")
    with caplog.at_level(logging.WARNING, logger="accumcore"):
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert model.accumulation.micro_batch_size == 5
    assert_matches_reference(model, initial, ref)
    assert "b = 5 samples per micro-batch" in caplog.text and "(16, False)" in caplog.text


def test_auto_on_a_device_with_room_does_not_split(data, limit, caplog):
    x, y = data
    model = _split_model(micro="auto")
    with caplog.at_level(logging.WARNING, logger="accumcore"):
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert model.accumulation.micro_batch_size == B
    assert "no split" in caplog.text


class _Tighten(keras.callbacks.Callback):
    """From the second epoch on, only 3 samples fit (a batch of longer sequences)."""

    def on_epoch_begin(self, epoch, logs=None) -> None:
        if epoch == 1:
            _Limit.LIMIT["samples"] = 3


def test_out_of_memory_in_epoch_two_reruns_the_same_batch_exactly(data, limit):
    """Nothing lost or applied twice: the same updates, the same metrics, as the run without
    it (and as the large batch)."""
    x, y = data
    initial, ref = reference_weights(adam, x, y, None, windows=_batches(len(x), B) * 2,
                                     make_model=_limited_mlp)
    histories = []
    for callbacks in ([], [_Tighten()]):
        limit["samples"] = 10**9
        model = _limited_mlp()
        model.compile(adam(), LOSS, metrics=["accuracy"])
        ac.accumulate(model, micro_batch_size="auto")
        histories.append(model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0,
                                   callbacks=callbacks).history)
        assert int(model.optimizer.iterations.numpy()) == 6
        assert_matches_reference(model, initial, ref)
    assert model.accumulation.micro_batch_size == 2  # 16 -> 8 -> 4 -> 2
    np.testing.assert_allclose(histories[1]["loss"], histories[0]["loss"], rtol=1e-5)
    assert histories[1]["accuracy"] == histories[0]["accuracy"]


def _limited_embedding(seed: int = 0) -> keras.Model:
    """Tokens (5 of 7) through an ``Embedding`` and the out-of-memory layer."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((5,), dtype="int32")
    hidden = keras.layers.Dense(16, activation="tanh")(
        keras.layers.Flatten()(keras.layers.Embedding(7, 4)(tokens)))
    return keras.Model(tokens, keras.layers.Dense(3, activation="softmax")(_Limit()(hidden)))


def _tokens(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    return (rng.integers(0, 7, size=(n, 5)).astype("int32"),
            rng.integers(0, 3, size=n).astype("int32"))


#: Where the out-of-memory error comes (``LIMIT["after"]``: the layer's calls that pass
#: first): 40 batches of 16 per epoch, ``steps_per_execution`` 32 (calls of 32 and 8 batches);
#: call 1 is the search's probe at b = 16, then one call per batch until the first error.
OOM_AT = {"first_step": 1, "mid_execution": 1 + 10, "later_epoch": 1 + 40 + 36}


@pytest.mark.parametrize("where", list(OOM_AT))
@pytest.mark.parametrize("kind", ["mlp", "embedding"])
def test_out_of_memory_inside_an_execution_of_many_steps_reruns_exactly(kind, where, limit):
    """``steps_per_execution=32``: an error at the first step, at the 11th of a call, or in the
    second epoch's last call (its 5th step). The steps before it stay applied, the aborted
    batch and the call's later ones run again with b halved (16 -> 8 -> 4): the updates equal
    plain Keras at B from the same initial weights (``REL_TOL``), one per batch (80: none
    skipped or applied twice, every sample counted once), and the logged loss and accuracy
    equal the same run without the error (the aborted step's metric updates undone)."""
    n, epochs = 16 * 40, 2
    make_model, make_opt = ((_limited_mlp, adam) if kind == "mlp" else
                            (_limited_embedding, lambda: keras.optimizers.SGD(0.1)))
    x, y = make_data(n) if kind == "mlp" else _tokens(n)
    initial, ref = reference_weights(make_opt, x, y, None, windows=_batches(n, B) * epochs,
                                     make_model=make_model)
    histories = []
    for samples in (10**9, 5):
        _Limit.CALLS[0] = 0
        limit.update(samples=samples, after=OOM_AT[where])
        model = make_model()
        model.compile(make_opt(), LOSS, metrics=["accuracy"], steps_per_execution=32)
        ac.accumulate(model, micro_batch_size="auto")
        histories.append(model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False,
                                   verbose=0).history)
        assert int(model.optimizer.iterations.numpy()) == 40 * epochs
        counters = model.accumulation.counters()
        assert counters["windows_applied"] == 40 * epochs
        assert counters["samples_seen"] == n * epochs
        assert_matches_reference(model, initial, ref)
    assert model.accumulation.micro_batch_size == 4
    np.testing.assert_allclose(histories[1]["loss"], histories[0]["loss"], rtol=1e-5)
    np.testing.assert_allclose(histories[1]["accuracy"], histories[0]["accuracy"], rtol=1e-6)


def test_out_of_memory_in_epoch_two_with_several_steps_per_call(data, limit):
    """The epoch-two error at the first step of a call of 2 (40 samples: calls of batches
    16 + 16, then 8): the same updates as the large batch, 6 in all."""
    x, y = data
    initial, ref = reference_weights(adam, x, y, None, windows=_batches(len(x), B) * 2,
                                     make_model=_limited_mlp)
    model = _limited_mlp()
    model.compile(adam(), LOSS, steps_per_execution=2)
    ac.accumulate(model, micro_batch_size="auto")
    model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[_Tighten()])
    assert int(model.optimizer.iterations.numpy()) == 6
    assert model.accumulation.micro_batch_size == 2
    assert_matches_reference(model, initial, ref)


@pytest.mark.parametrize("entry", ["eager", "function", "graph", "window_step"])
def test_accum_trainer_auto_finds_b_at_the_first_batch(data, limit, caplog, entry):
    """``AccumTrainer(micro_batch_size="auto")``: b searched on the device at the first batch
    (5 of 16 fit here: 16, 8 fail, then 4 fits and bisection finds 5) and kept for the run;
    exact against the large batch, so the probes changed nothing."""
    x, y = data
    initial, ref = reference_weights(adam, x, y, None, windows=_batches(len(x), B),
                                     make_model=_limited_mlp)
    limit["samples"] = 5
    trainer = ac.AccumTrainer(_limited_mlp(), adam(), LOSS, micro_batch_size="auto")
    assert trainer.micro_batch_size == "auto"
    with caplog.at_level(logging.WARNING, logger="accumcore"):
        if entry == "window_step":
            for s in _batches(len(x), B):
                trainer.window_step(tf.constant(x[s]), tf.constant(y[s]))
        else:
            trainer.fit(x, y, batch_size=B, shuffle=False, mode=entry, verbose=0)
    assert trainer.micro_batch_size == 5
    assert int(trainer.optimizer.iterations.numpy()) == len(_batches(len(x), B))
    assert_matches_reference(trainer.model, initial, ref)
    assert "b = 5 samples per micro-batch" in caplog.text and "(16, False)" in caplog.text


@pytest.mark.parametrize("kind", ["mlp", "embedding"])
def test_fit_and_the_trainer_search_b_with_the_same_probes_in_the_same_order(data, limit,
                                                                            caplog, kind):
    """One search for both entry points of "auto": where 5 of 16 samples fit, b = 16 and 8 run
    out of memory, 4 fits, then the bisection probes 6 (out of memory) and 5 (fits), in that
    order, in ``fit`` (through ``accumulate``) and in ``AccumTrainer``; each logs its probes.
    An MLP, and tokens through an ``Embedding``."""
    x, y = data if kind == "mlp" else _tokens(B)
    make_model = _limited_mlp if kind == "mlp" else _limited_embedding
    probes = "[(16, False), (8, False), (4, True), (6, False), (5, True)]"
    limit["samples"] = 5
    model = make_model()
    model.compile(adam(), LOSS)
    ac.accumulate(model, micro_batch_size="auto")
    with caplog.at_level(logging.WARNING, logger="accumcore"):
        model.fit(x[:B], y[:B], batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert f"whether it fitted: {probes}" in caplog.text
    caplog.clear()
    trainer = ac.AccumTrainer(make_model(), adam(), LOSS, micro_batch_size="auto")
    with caplog.at_level(logging.WARNING, logger="accumcore"):
        trainer.window_step(tf.constant(x[:B]), tf.constant(y[:B]))
    assert f"whether it fitted: {probes}" in caplog.text
    assert model.accumulation.micro_batch_size == trainer.micro_batch_size == 5


def test_accum_trainer_auto_out_of_memory_later_raises(data, limit):
    """The trainer finds b once: a later batch that does not fit at that b raises TensorFlow's
    out-of-memory error (``fit`` through ``accumulate`` reruns it instead)."""
    x, y = data
    trainer = ac.AccumTrainer(_limited_mlp(), adam(), LOSS, micro_batch_size="auto")
    trainer.window_step(tf.constant(x[:B]), tf.constant(y[:B]))
    assert trainer.micro_batch_size == B
    limit["samples"] = 3
    with pytest.raises(tf.errors.ResourceExhaustedError, match="injected"):
        trainer.window_step(tf.constant(x[B:2 * B]), tf.constant(y[B:2 * B]))


@pytest.mark.parametrize("setting", [{"micro_batch_size": 8}, {"accum_steps": 2}])
@pytest.mark.parametrize("kind", ["mlp", "embedding"])
def test_accum_trainer_window_step_aborted_mid_window_drops_its_partial_window(kind, setting,
                                                                             limit):
    """``window_step`` at b = 8 of a batch of 16: the second micro-batch runs out of memory
    after the first was added. The error is raised and the partial window dropped (nothing
    pending, so the same batch can be given again), and given again it makes the update of
    plain Keras at B: one update per batch, no micro-batch added twice (kept, the retried
    window would hold the first 8 samples twice and a ``window_step`` after the error would
    refuse to start on a pending window)."""
    n = 2 * B
    x, y = make_data(n) if kind == "mlp" else _tokens(n)
    # SGD for the Embedding: Keras's Adam updates a sparse gradient's repeated rows unlike
    # the dense window (the keras-workflows reference page), so plain Keras is no reference.
    make_model, make_opt = ((_limited_mlp, adam) if kind == "mlp" else
                            (_limited_embedding, lambda: keras.optimizers.SGD(0.1)))
    initial, ref = reference_weights(make_opt, x, y, None, windows=_batches(n, B),
                                     make_model=make_model)
    trainer = ac.AccumTrainer(make_model(), make_opt(), LOSS, **setting)  # 8 + 8 either way
    trainer.window_step(tf.constant(x[:B]), tf.constant(y[:B]))
    limit.update(samples=7, after=_Limit.CALLS[0] + 1)
    with pytest.raises(tf.errors.ResourceExhaustedError, match="injected"):
        trainer.window_step(tf.constant(x[B:]), tf.constant(y[B:]))
    assert int(trainer.state.micro_step.numpy()) == 0
    assert int(trainer.optimizer.iterations.numpy()) == 1
    limit.update(samples=10**9, after=0)
    trainer.window_step(tf.constant(x[B:]), tf.constant(y[B:]))
    assert int(trainer.optimizer.iterations.numpy()) == 2
    assert_matches_reference(trainer.model, initial, ref)


def test_nothing_fits_raises_with_the_probes(data, limit):
    x, y = data
    limit["samples"] = 0
    model = _limited_mlp()
    model.compile(adam(), LOSS)
    ac.accumulate(model, micro_batch_size="auto")
    with pytest.raises(ValueError, match=r"even micro-batches of 1 sample.*\(1, False\)"):
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)


def test_a_fixed_micro_batch_that_runs_out_of_memory_names_auto(data, limit):
    x, y = data
    limit["samples"] = 4
    model = _split_model(micro=6, make_model=_limited_mlp)
    with pytest.raises(tf.errors.ResourceExhaustedError, match="micro_batch_size='auto'"):
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)


def _frozen_model(kind: str = "mlp", seed: int = 0, norm: str = "stock") -> keras.Model:
    """A frozen layer (``trainable=False``: a Dense, or an Embedding for ``kind="embedding"``),
    a LoRA Dense (``enable_lora``: its kernel frozen, the layer trainable), then a
    BatchNormalization and a Dropout on a side branch scaled by 0 (their state changes in every
    step, the weights do not depend on it, so plain Keras at B is the reference) before the
    out-of-memory layer, so an aborted step has already moved the BN statistics and the
    dropout's seed. ``norm="window"``: the BatchNormalization is window-level
    (``accumcore.WindowBatchNormalization``), whose pooled window moments are variables of the
    layer's own."""
    keras.utils.set_random_seed(seed)
    if kind == "mlp":
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="tanh", trainable=False, name="frozen")(inputs)
    else:
        inputs = keras.Input((5,), dtype="int32")
        hidden = keras.layers.Flatten()(
            keras.layers.Embedding(7, 4, trainable=False, name="frozen")(inputs))
    lora = keras.layers.Dense(16, activation="tanh", name="lora")
    hidden = lora(hidden)
    lora.enable_lora(2)
    batch_norm = (ac.WindowBatchNormalization if norm == "window"
                  else keras.layers.BatchNormalization)(name="bn")
    side = batch_norm(hidden) + keras.layers.Dropout(0.5)(hidden)
    hidden = _Limit()(hidden + 0.0 * side)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))


def _frozen_data(kind: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    return make_data(n) if kind == "mlp" else _tokens(n)


def _paths(variables) -> set[str]:
    return {getattr(v, "path", "") for v in variables}


def _seed_states(paths) -> list[str]:
    """The paths of random-number seed states (a Dropout's ``SeedGenerator``)."""
    return [p for p in paths if p.endswith("seed_generator_state")]


def _frozen_paths(model: keras.Model) -> set[str]:
    """The frozen weights: the frozen layer's and the LoRA-frozen kernel."""
    return {v.path for v in model.variables if v.path.startswith("frozen/")} | {"lora/kernel"}


#: The frozen model's run: 12 batches of 16, ``steps_per_execution=4``; only 10 samples fit
#: from the layer's call 7 on: the probe and batches 1-5 pass at b = 16, batch 6 (the second
#: step of the second call) runs out of memory and reruns at b = 8 with batches 7-12.
FROZEN_RUN = {"batches": 12, "passed": 6, "samples": 10}


def _frozen_auto_run(kind: str, limit, norm: str = "stock") -> keras.Model:
    x, y = _frozen_data(kind, B * FROZEN_RUN["batches"])
    _Limit.CALLS[0] = 0
    limit.update(samples=FROZEN_RUN["samples"], after=FROZEN_RUN["passed"])
    model = _frozen_model(kind, norm=norm)
    model.compile(adam(), LOSS, steps_per_execution=4)
    ac.accumulate(model, micro_batch_size="auto")
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    return model


def _frozen_run_without_the_error(kind: str, norm: str = "stock") -> keras.Model:
    """The same b schedule with fixed sizes and no error: batches 1-5 at b = 16, then b = 8."""
    x, y = _frozen_data(kind, B * FROZEN_RUN["batches"])
    cut = B * (FROZEN_RUN["passed"] - 1)
    model = _frozen_model(kind, norm=norm)
    model.compile(adam(), LOSS, steps_per_execution=4)
    ac.accumulate(model, micro_batch_size=B)
    model.fit(x[:cut], y[:cut], batch_size=B, epochs=1, shuffle=False, verbose=0)
    ac.accumulate(model, micro_batch_size=8)
    model.fit(x[cut:], y[cut:], batch_size=B, epochs=1, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize(("kind", "norm"), [("mlp", "stock"), ("embedding", "stock"),
                                          ("mlp", "window")])
def test_out_of_memory_with_frozen_weights_reruns_exactly_and_restores_bn_and_seed(kind, norm,
                                                                                  limit):
    """A frozen layer, a LoRA kernel, BatchNorm and Dropout, an error mid-call: the weights
    equal plain Keras at B (``REL_TOL``; the BN moving statistics excepted: stock BN updates
    them per micro-batch, so they depend on b), one update per batch, and the BN statistics
    and the dropout's seed state equal those of the run with the same b schedule and no error
    (a change of the aborted step left in place, a restore the narrowed copy dropped, would
    move them by one more update). Window-level BatchNorm goes through the same rerun (its
    pooled window moments are discarded with the aborted step; here the aborted step pooled
    the whole batch, which a double pooling would not change, so this case checks the rerun
    with that layer, not the discarding: see
    ``test_a_step_aborted_mid_window_discards_its_window_batchnorm_moments``)."""
    n = B * FROZEN_RUN["batches"]
    x, y = _frozen_data(kind, n)
    initial, ref = reference_weights(adam, x, y, None, windows=_batches(n, B),
                                     make_model=lambda: _frozen_model(kind, norm=norm))
    model = _frozen_auto_run(kind, limit, norm)
    assert model.accumulation.micro_batch_size == 8  # the error happened, b halved
    assert int(model.optimizer.iterations.numpy()) == FROZEN_RUN["batches"]
    assert model.accumulation.counters()["samples_seen"] == n
    weights = get_weights(model)
    compared = [i for i, w in enumerate(model.weights) if "moving_" not in w.path]
    rel = relative_error(*([ws[i] for i in compared] for ws in (weights, ref, initial)))
    assert rel <= REL_TOL, f"relative weight error {rel:.3g} > {REL_TOL:g}"
    limit.update(samples=10**9, after=0)
    without = [v for v in _frozen_run_without_the_error(kind, norm).variables
               if not v.trainable]
    state = [v for v in model.variables if not v.trainable]  # the same layers, in order
    assert {"bn/moving_mean", "bn/moving_variance"} | _frozen_paths(model) <= _paths(
        state) and len(_seed_states(_paths(state))) == 1 and len(state) == len(without)
    for variable, other in zip(state, without, strict=True):
        np.testing.assert_allclose(variable.numpy(), other.numpy(), rtol=1e-6, atol=1e-7,
                                   err_msg=variable.path)


@pytest.mark.parametrize("kind", ["mlp", "embedding"])
def test_the_per_step_copy_keeps_what_a_step_changes_and_no_frozen_weight(kind, limit):
    """The train function's ``kept.pairs`` (each ``(variable, copy)`` the step copies): the BN
    statistics, the dropout's seed state and the optimizer's ``iterations``, never a frozen
    weight (the ``trainable=False`` layer's, the LoRA-frozen kernel)."""
    x, y = _frozen_data(kind, 40)
    model = _frozen_model(kind)
    model.compile(adam(), LOSS, steps_per_execution=4)
    ac.accumulate(model, micro_batch_size="auto")
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    kept = [variable for variable, _ in model.train_function.kept.pairs]
    assert {"bn/moving_mean", "bn/moving_variance"} <= _paths(kept)
    assert len(_seed_states(_paths(kept))) == 1  # the dropout's
    assert any(v is model.optimizer.iterations for v in kept)
    frozen = _frozen_paths(model)
    assert len(frozen) >= 2 and not frozen & _paths(kept)


def _window_bn_model(kind: str, seed: int = 0) -> keras.Model:
    """An MLP (or an Embedding model) with ``accumcore.WindowBatchNormalization`` in its main
    path just after the out-of-memory layer: each micro-batch that passes that layer pools its
    moments into the BatchNorm's window variables (outside the model's variables), one that
    fails it pools nothing."""
    keras.utils.set_random_seed(seed)
    if kind == "mlp":
        inputs = hidden = keras.Input((8,))
    else:
        inputs = keras.Input((5,), dtype="int32")
        hidden = keras.layers.Flatten()(keras.layers.Embedding(7, 4)(inputs))
    hidden = keras.layers.Dense(16, activation="tanh")(hidden)
    hidden = ac.WindowBatchNormalization(name="bn")(_Limit()(hidden))
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(hidden))


class _AbortTheSecondMicroBatch(keras.callbacks.Callback):
    """Before batch 1 (at b = 8: micro-batches 8 + 8): its first micro-batch passes, its second
    runs out of memory (more than 7 samples fail from the layer's next call but one)."""

    def on_train_batch_begin(self, batch, logs=None) -> None:
        if batch == 1:
            _Limit.LIMIT.update(samples=7, after=_Limit.CALLS[0] + 1)


@pytest.mark.parametrize("kind", ["mlp", "embedding"])
def test_a_step_aborted_mid_window_discards_its_window_batchnorm_moments(kind, limit):
    """8 of 16 samples fit (b = 8); batch 1 runs out of memory at its second micro-batch, after
    its first pooled its moments in the window-level BatchNorm (the second pools nothing), and
    reruns at b = 4. The weights and the BatchNorm's moving statistics equal those of the run
    with the same b schedule (batch 0 at b = 8, the rest at b = 4) and no error: the aborted
    step's pooled moments were discarded (kept, the window would pool the batch's first 8
    samples twice, 24 samples, so the moving statistics would move by another mean and
    variance; were the whole batch pooled twice, they would not, so the second micro-batch
    must fail before the BatchNorm)."""
    n = 4 * B
    x, y = make_data(n) if kind == "mlp" else _tokens(n)
    limit.update(samples=8, after=0)
    model = _window_bn_model(kind)
    model.compile(adam(), LOSS)
    ac.accumulate(model, micro_batch_size="auto")
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[_AbortTheSecondMicroBatch()])
    assert model.accumulation.micro_batch_size == 4  # 8, then halved by the error
    assert int(model.optimizer.iterations.numpy()) == 4
    assert model.accumulation.counters()["samples_seen"] == n
    limit.update(samples=10**9, after=0)
    without = _window_bn_model(kind)
    without.compile(adam(), LOSS)
    for micro, part in ((8, slice(0, B)), (4, slice(B, n))):
        ac.accumulate(without, micro_batch_size=micro)
        without.fit(x[part], y[part], batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert {"bn/moving_mean", "bn/moving_variance"} <= _paths(model.weights)
    for variable, other in zip(model.weights, without.weights, strict=True):
        np.testing.assert_allclose(variable.numpy(), other.numpy(), rtol=1e-6, atol=1e-7,
                                   err_msg=variable.path)


@pytest.mark.parametrize("kind", ["mlp", "embedding"])
def test_accum_trainer_auto_probes_leave_window_batchnorm_unchanged(kind, limit):
    """``AccumTrainer(micro_batch_size="auto")`` on a model with window-level BatchNorm: the
    search's probes that fit (4 and 5 of 16 samples) pool their moments in the BatchNorm's
    window variables, outside the model's; the search discards them, so the weights and the
    moving statistics equal a trainer given b = 5 (kept, the first window would pool 9 more
    samples and its moving statistics move by another mean and variance)."""
    n = 4 * B
    x, y = make_data(n) if kind == "mlp" else _tokens(n)
    trained = []
    for micro, samples in (("auto", 5), (5, 10**9)):
        limit.update(samples=samples, after=0)
        trainer = ac.AccumTrainer(_window_bn_model(kind), adam(), LOSS, micro_batch_size=micro)
        trainer.fit(x, y, batch_size=B, shuffle=False, mode="function", verbose=0)
        assert trainer.micro_batch_size == 5
        trained.append(trainer.model)
    assert {"bn/moving_mean", "bn/moving_variance"} <= _paths(trained[0].weights)
    for variable, other in zip(trained[0].weights, trained[1].weights, strict=True):
        np.testing.assert_allclose(variable.numpy(), other.numpy(), rtol=1e-6, atol=1e-7,
                                   err_msg=variable.path)


class _OutOfMemoryAtTheFirstTrace(keras.metrics.Metric):
    """A mean of the predictions whose first update while a graph is traced raises the
    out-of-memory error: as an allocation made during the train step's first trace that does
    not fit, before the step has copied anything (the search's probes update no metric)."""

    def __init__(self, name: str = "oom_at_first_trace", **kwargs) -> None:
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.raised = False

    def update_state(self, y_true, y_pred, sample_weight=None):
        if tf.inside_function() and not self.raised:
            self.raised = True
            raise tf.errors.ResourceExhaustedError(None, None, "injected at the first trace")
        self.total.assign_add(tf.reduce_mean(tf.cast(y_pred, "float32")))

    def result(self):
        return self.total


@pytest.mark.parametrize("make_model", [_limited_mlp, _limited_embedding],
                         ids=["mlp", "embedding"])
def test_out_of_memory_before_the_steps_first_copy_raises(make_model, data, limit):
    """An out-of-memory error before the step's first copy (nothing saved to rerun from) is
    raised as TensorFlow raised it, with nothing applied; it does not end the epoch as if the
    data had run out (a ``StopIteration`` from the train function, which ``fit`` would then
    report as empty training data)."""
    x, y = data if make_model is _limited_mlp else _tokens(len(data[0]))
    model = make_model()
    model.compile(adam(), LOSS, metrics=[_OutOfMemoryAtTheFirstTrace()])
    ac.accumulate(model, micro_batch_size="auto")
    with pytest.raises(tf.errors.ResourceExhaustedError, match="injected at the first trace"):
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


# ---------------------------------------------------------------------- static shapes of the slices
@keras.saving.register_keras_serializable(package="accumcore_tests")
class _LastDimScale(keras.layers.Layer):
    """Multiplies by a ramp as long as the input's last dimension, read from the static shape
    in ``call`` (``None`` there fails: ``arange(None)``)."""

    def call(self, x):
        return x * keras.ops.arange(1, x.shape[-1] + 1, dtype=x.dtype) / x.shape[-1]


def _shape_model(seed: int = 0) -> keras.Model:
    """Dict input: ``image`` (4, 4, 1) through Conv2D, ``Reshape`` and :class:`_LastDimScale`,
    ``tokens`` (5,) through an ``Embedding`` (a matrix, dense gradients); 10 softmax classes,
    for integer labels of shape ``(N, 1)`` (Keras squeezes them from their static shape)."""
    keras.utils.set_random_seed(seed)
    image = keras.Input((4, 4, 1), name="image")
    tokens = keras.Input((5,), dtype="int32", name="tokens")
    h = keras.layers.Conv2D(3, 3)(image)  # (2, 2, 3)
    h = _LastDimScale()(keras.layers.Reshape((12,))(h))
    e = keras.layers.Flatten()(keras.layers.Embedding(7, 2)(tokens))
    h = keras.layers.Concatenate()([h, e])
    return keras.Model({"image": image, "tokens": tokens},
                       keras.layers.Dense(10, activation="softmax")(h))


def _shape_data(n: int = 40):
    rng = np.random.default_rng(3)
    x = {"image": rng.normal(size=(n, 4, 4, 1)).astype("float32"),
         "tokens": rng.integers(0, 7, size=(n, 5)).astype("int32")}
    y = rng.integers(0, 10, size=(n, 1)).astype("int32")
    sw = rng.uniform(0.5, 2.0, size=(n, 1)).astype("float32")
    return x, y, sw


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("way", ["micro_batch_size", "accum_steps"])
def test_every_slice_keeps_the_static_shape_of_every_non_batch_dimension(way, jit):
    """``(N, 1)`` integer labels with sparse categorical cross-entropy, ``Reshape``, a layer
    that reads ``shape[-1]``, dict inputs with an ``Embedding``, ``(N, 1)`` sample weights:
    each needs the inner dimensions static in every micro-batch (before: Keras raised "Argument
    `output` must have rank (ndim) `target.ndim - 1`" on the split's labels). The update
    equals plain Keras at B = 16 (batches 16, 16, 8) from the same initial weights, within
    ``REL_TOL`` (measured ~8e-7: float32 re-association). SGD: plain Keras's Adam updates the
    Embedding's sparse gradient (repeated rows) differently from the same gradient dense
    (rel 0.4 here; tests/helpers.py ``dense_reference``), SGD's scatter-add does not."""
    x, y, sw = _shape_data()
    initial, expected = _shape_reference(x, y, sw)
    model = _shape_model()
    model.compile(keras.optimizers.SGD(0.1), LOSS, jit_compile=jit)
    if way == "micro_batch_size":  # B = 16 split 6 + 6 + 4, the last batch 6 + 2
        ac.accumulate(model, micro_batch_size=b)
        model.fit(x, y, sample_weight=sw, batch_size=B, shuffle=False, verbose=0)
    else:  # K = 4 micro-batches of 4
        ac.accumulate(model, accum_steps=4)
        model.fit(x, y, sample_weight=sw, batch_size=4, shuffle=False, verbose=0)
    assert_matches_reference(model, initial, expected)
    assert int(model.optimizer.iterations.numpy()) == 3


# ---------------------------------------------------------------------- batches never larger than b
def _nothing_split(record) -> list[str]:
    return [str(w.message) for w in record if "nothing is split" in str(w.message)]


def test_batches_never_larger_than_b_warn_once_naming_batch_size_and_accum_steps(data):
    """The micro-step habit (``batch_size`` = b) trains updates of b with no accumulation: one
    warning per ``fit`` names ``batch_size=B`` and the ``accum_steps`` call of the object held.
    Not for batches larger than b whose last one is not (B = 16, b = 8: 16, 16, 8), nor for
    ``"auto"`` (which reports its b) or ``accum_steps``."""
    x, y = data

    def fit_record(model, *args, **kwargs):
        model.compile(adam(), LOSS)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            model.fit(*args, shuffle=False, verbose=0, **kwargs)
        return _nothing_split(record)

    found = fit_record(ac.accumulate(small_mlp(), micro_batch_size=16), x, y, batch_size=16,
                       epochs=2)
    assert len(found) == 1 and "batch_size=64" in found[0]
    assert "`accumcore.accumulate(model, accum_steps=K)`" in found[0]
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(b)  # batch dimension unknown
    found = fit_record(small_mlp(model_cls=ac.AccumModel, micro_batch_size=b), ds)
    assert len(found) == 1 and "`model.set_accumulation(accum_steps=K)`" in found[0]
    assert not fit_record(ac.accumulate(small_mlp(), micro_batch_size=8), x, y, batch_size=16)
    assert not fit_record(ac.accumulate(small_mlp(), micro_batch_size="auto"), x, y,
                          batch_size=16)
    assert not fit_record(ac.accumulate(small_mlp(), accum_steps=2), x, y, batch_size=8)


# ---------------------------------------------------------------------- one split everywhere
class _SizeRecorder(keras.layers.Layer):
    """Identity that records the samples of every batch it runs on (a ``tf.py_function``:
    eager, not under XLA)."""

    SIZES: list[int] = []

    def call(self, x):
        def record(t):
            self.SIZES.append(int(t.shape[0]))
            return t

        out = tf.py_function(record, [x], x.dtype)
        out.set_shape(x.shape)
        return out


def _recording_mlp(model_cls=keras.Model, **kwargs) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = _SizeRecorder()(keras.layers.Dense(16, activation="tanh")(inputs))
    return model_cls(inputs, keras.layers.Dense(3, activation="softmax")(hidden), **kwargs)


ENTRY_POINTS = ("accumulate", "AccumModel", "eager", "function", "graph", "window_step")


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_cuts_a_batch_of_100_at_b_32_the_same_way(entry):
    """``micro_batch_size=32`` and a batch of B = 100: 32 + 32 + 32 + 4 at every entry point
    (before: ``window_step`` cut 25 x 4 and ``AccumTrainer``'s b meant K = B / b), one update,
    equal to plain Keras on the 100 samples within ``REL_TOL``."""
    x, y = make_data(100)
    initial, ref = reference_weights(adam, x, y, None, windows=[slice(0, 100)],
                                     make_model=_recording_mlp)
    _SizeRecorder.SIZES = []
    optimizer = adam()
    if entry in ("accumulate", "AccumModel"):
        model = (ac.accumulate(_recording_mlp(), micro_batch_size=32) if entry == "accumulate"
                 else _recording_mlp(ac.AccumModel, micro_batch_size=32))
        model.compile(optimizer, LOSS)
        model.fit(x, y, batch_size=100, shuffle=False, verbose=0)
    else:
        model = _recording_mlp()
        trainer = ac.AccumTrainer(model, optimizer, LOSS, micro_batch_size=32)
        if entry == "window_step":
            trainer.window_step(x, y)
        else:
            trainer.fit(x, y, batch_size=100, shuffle=False, mode=entry, verbose=0)
    # (the rest's pass does not wait for the loop's in a graph: the order may differ)
    assert sorted(_SizeRecorder.SIZES) == [4, 32, 32, 32]
    assert int(optimizer.iterations.numpy()) == 1
    assert_matches_reference(model, initial, ref)


def _shape_reference(x: dict, y: np.ndarray, sw: np.ndarray) -> tuple[list, list]:
    """(initial, final) weights of plain Keras ``train_on_batch`` with SGD(0.1) on batches of
    B = 16 (16, 16, 8) of the static-shape data: the large-batch reference."""
    plain = _shape_model()
    initial = get_weights(plain)
    plain.compile(keras.optimizers.SGD(0.1), LOSS)
    for s in _batches(40, B):
        plain.train_on_batch({k: v[s] for k, v in x.items()}, y[s], sample_weight=sw[s])
    return initial, get_weights(plain)


def _trainer_equivalence(way: str, entry: str, jit: bool) -> None:
    x, y, sw = _shape_data()
    initial, expected = _shape_reference(x, y, sw)
    model = _shape_model()
    how = dict(micro_batch_size=b) if way == "micro_batch_size" else dict(accum_steps=4)
    trainer = ac.AccumTrainer(model, keras.optimizers.SGD(0.1), LOSS, jit_compile=jit, **how)
    if entry == "window_step":  # batches of 16, 16, 8: cut by b, or by ceil(n / K)
        for s in _batches(40, B):
            trainer.window_step({k: v[s] for k, v in x.items()}, y[s], sw[s])
    else:
        trainer.fit(x, y, sample_weight=sw, batch_size=B if way == "micro_batch_size" else 4,
                    shuffle=False, mode=entry, verbose=0)
    assert_matches_reference(model, initial, expected)
    assert int(trainer.optimizer.iterations.numpy()) == 3


@pytest.mark.parametrize("entry,jit", [("eager", False), ("function", True),
                                       ("graph", False), ("window_step", False),
                                       ("window_step", True)])
@pytest.mark.parametrize("way", ["micro_batch_size", "accum_steps"])
def test_accum_trainer_means_what_accumulate_means(way, entry, jit):
    """``AccumTrainer(micro_batch_size=b)``: each batch given is B, split (16: 6 + 6 + 4, the
    last 8: 6 + 2); ``accum_steps=K``: each batch a micro-batch. The static-shape model
    (``(N, 1)`` labels, ``Reshape``, ``shape[-1]``, an ``Embedding``, ``(N, 1)`` sample
    weights) equals plain Keras at B = 16 within ``REL_TOL`` (SGD: see the static-shape
    test); ``window_step`` under XLA on the ragged last batch included."""
    _trainer_equivalence(way, entry, jit)


def test_accum_trainer_checks_what_every_entry_point_checks(data):
    """The same checks as ``accumulate``: both ways refused (before: ``accum_steps=4,
    micro_batch_size=16`` trained), 0 refused (before: 0 became 32), the old form warns
    naming the new calls and keeps its meaning (K = B / b, batches of b)."""
    with pytest.raises(ValueError, match="`accum_steps` or `micro_batch_size`, not both"):
        ac.AccumTrainer(small_mlp(), adam(), LOSS, accum_steps=4, micro_batch_size=16)
    for bad, error in ((0, ValueError), (-1, ValueError), (2.0, TypeError)):
        with pytest.raises(error, match=r"`micro_batch_size` must be a positive int"):
            ac.AccumTrainer(small_mlp(), adam(), LOSS, micro_batch_size=bad)
    with pytest.raises(ValueError, match="micro_batch_size=b"):
        ac.AccumTrainer(small_mlp(), adam(), LOSS)
    with pytest.warns(FutureWarning, match=r"micro_batch_size=16\).*batch_size=64.*"
                                           r"accum_steps=4") as caught:
        old = ac.AccumTrainer(small_mlp(), adam(), LOSS, effective_batch_size=64,
                              micro_batch_size=16)
    # it says what dropping effective_batch_size alone does to fit's batch_size, and the call
    text = " ".join(str(w.message) for w in caught if w.category is FutureWarning)
    for said in ("`fit`'s `batch_size` is the micro-batch (16)",
                 "with `micro_batch_size=16` alone, `batch_size` is the recipe's batch B",
                 "change the call to `fit(x, y, batch_size=64)`",
                 "`AccumTrainer(..., accum_steps=4)` and keep batches of 16"):
        assert said in text, (said, text)
    assert (old.accum_steps, old.micro_batch_size) == (4, None)
    x, y = data
    assert old.fit(x, y, verbose=0).micro_weights == [16.0, 16.0, 8.0]


def test_accum_trainer_batches_never_larger_than_b_warn_once(data):
    x, y = data
    trainer = ac.AccumTrainer(small_mlp(), adam(), LOSS, micro_batch_size=16)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(x, y, batch_size=16, epochs=2, verbose=0)
        trainer.window_step(x[:16], y[:16])
        trainer.window_step(x[:16], y[:16])
    found = _nothing_split(record)
    assert len(found) == 2 and "`AccumTrainer(..., accum_steps=K)`" in found[0]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ac.AccumTrainer(small_mlp(), adam(), LOSS, micro_batch_size=8).fit(
            x, y, batch_size=16, verbose=0)  # 16, 16 and 8: the last is not split
    assert not _nothing_split(record)
