"""The tests' one helpers module: shared data, model, reference and subprocess harness.

Imported by the pytest modules (``from helpers import ...``; ``conftest.py`` keeps only the
fixtures) and by the scripts that run in a child interpreter (``python tests/x.py``: Python puts
``tests/`` first on ``sys.path``; ``python -c`` children get it on ``PYTHONPATH`` from
:func:`run_script`).

Subprocess protocol (the only one the tests use): the parent calls :func:`run_script` (one
child) or :func:`run_workers` (a pool started together, e.g. the workers of one cluster); the
child writes ONE JSON result with :func:`emit` (or :func:`run_cases`, which runs named cases and
records each one's result or traceback) to the file named by ``$ACCUMCORE_TEST_RESULT``; the
parent returns it parsed, numpy arrays included bit for bit, or raises :class:`ScriptError`
with the tail of the child's output when the child fails, times out or writes nothing.

Importing this module does not initialise TensorFlow's devices, so a child may still configure
logical devices after importing it.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import base64  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Iterable, Mapping, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import accumcore as ac  # noqa: E402
import accumcore.lab.experiments  # noqa: E402,F401
from accumcore.lab.experiments import get_weights, relative_error  # noqa: E402

TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent

# Tolerance for "same update as the large batch" in float32.
# Justification: accumulation computes sum_i c_i * grad(L_i) / sum_i c_i, the large batch computes
# grad(sum over all samples / B): the same real number, summed in a different order. In float32
# (eps = 1.2e-7) that re-association gives relative weight differences of ~1e-6 for SGD and up to
# ~2e-5 for Adam (whose update g / (sqrt(v) + eps) amplifies round-off in tiny gradients) after a
# few updates, measured on this machine. 1e-4 leaves a 5x margin yet is 3-4 orders of magnitude
# below every real bug (a 1/K mis-scaling gives rel ~ 0.2 - 3).
# The same bound holds across devices and processes: splitting each micro-batch over 2 replicas
# (MirroredStrategy) or 2 workers only changes the order of the sums once more (measured
# 0.75e-6 .. 3.7e-6), while per-replica clipping gives ~1e-1 and a missing 1/num_replicas ~1.
REL_TOL = 1e-4

LOSS = "sparse_categorical_crossentropy"


# ------------------------------------------------------------------------------ data and model
def make_data(n: int = 40, features: int = 8, classes: int = 3,
              seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic classification data: x float32 (n, features) ~ N(0, 1), y int32 (n,) in
    [0, classes). Equivalence does not depend on the data; the seed fixes it."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.integers(0, classes, size=n).astype("int32")
    return x, y


def small_mlp(seed: int = 0, model_cls: Callable = keras.Model, **kwargs) -> keras.Model:
    """8 -> 16 (tanh) -> 3 (softmax): tiny, so each test case takes well under a second.
    The same ``seed`` gives the same initial weights (``kwargs`` go to ``model_cls``)."""
    return ac.lab.experiments.mlp(8, (16,), 3, seed=seed, model_cls=model_cls, **kwargs)


OPTIMIZERS: dict[str, Callable[[], keras.optimizers.Optimizer]] = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
    "sgd_clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=0.01),
    "sgd_exponential_decay": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.5)
    ),
}


def windows_of(n: int, micro: int, k: int) -> list[slice]:
    """Sample ranges of consecutive windows of K micro-batches of size ``micro`` over n samples
    (the last micro-batch and the last window may be partial: end_of_epoch='apply')."""
    return [slice(s, min(s + micro * k, n)) for s in range(0, n, micro * k)]


def reference_weights(
    make_opt: Callable, x, y, sw, micro: int | None = None, k: int | None = None,
    epochs: int = 1, loss=LOSS, make_model: Callable[[], keras.Model] = small_mlp,
    windows: Sequence | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Independent large-batch reference: plain ``train_on_batch`` on each window's samples, on
    one device (no strategy scope). The windows are ``windows_of(len(x), micro, k)``, ``epochs``
    times over, or ``windows`` instead: the samples of each update in order (index arrays or
    slices), for tests that write the windows out themselves (a policy's, a skipped
    micro-batch's). Returns (initial weights, final weights)."""
    if windows is None:
        windows = [s for _ in range(epochs) for s in windows_of(len(x), micro, k)]
    elif micro is not None or k is not None or epochs != 1:
        raise TypeError("reference_weights: pass `micro`, `k` (and `epochs`) or `windows`")
    model = make_model()
    initial = get_weights(model)
    model.compile(make_opt(), loss)
    for s in windows:
        if sw is None:
            model.train_on_batch(x[s], y[s])
        else:
            model.train_on_batch(x[s], y[s], sample_weight=sw[s])
    return initial, get_weights(model)


def dataset(x, y, sw=None, micro: int = 8) -> tf.data.Dataset:
    """(x, y[, sw]) in micro-batches of ``micro`` samples, in order."""
    parts = (x, y) if sw is None else (x, y, sw)
    return tf.data.Dataset.from_tensor_slices(parts).batch(micro)


def built_state(k: int) -> tuple[keras.Model, ac.AccumulationState, keras.optimizers.Optimizer]:
    """For unit tests of the state without a loop: ``small_mlp()``, an ``AccumulationState(k)``
    built for its trainable variables and an ``SGD(0.1)`` built for them."""
    model = small_mlp()
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    state = ac.AccumulationState(k)
    state.build(model.trainable_variables)
    return model, state, optimizer


ENTRIES = ("eager", "function", "graph", "window_step", "fit")
#: ``fit`` with ``micro_batch_size=micro`` at ``batch_size=micro * k``: the same windows as
#: "fit", each batch split in the step (:func:`train_entry` takes it beside :data:`ENTRIES`).
FIT_SPLIT = "fit_split"


def train_entry(entry: str, make_opt: Callable, x, y, sw, micro: int, k: int,
                epochs: int = 1, loss=LOSS, **kwargs) -> keras.Model:
    """Train ``small_mlp()`` with one accumcore entry point (one of :data:`ENTRIES`, or
    :data:`FIT_SPLIT`); returns the trained model."""
    if entry in ("fit", FIT_SPLIT):
        how = dict(accum_steps=k) if entry == "fit" else dict(micro_batch_size=micro)
        model = small_mlp(model_cls=ac.AccumModel, **how, **kwargs)
        model.compile(make_opt(), loss)
        model.fit(x, y, sample_weight=sw, batch_size=micro if entry == "fit" else micro * k,
                  epochs=epochs, shuffle=False, verbose=0)
        return model
    model = small_mlp()
    trainer = ac.AccumTrainer(model, make_opt(), loss, accum_steps=k, **kwargs)
    if entry == "window_step":
        for _ in range(epochs):
            for s in windows_of(len(x), micro, k):
                trainer.window_step(x[s], y[s], None if sw is None else sw[s])
        return model
    trainer.fit(dataset(x, y, sw, micro), epochs=epochs, mode=entry, verbose=0)
    return model


def assert_matches_reference(model, initial, reference, tol: float = REL_TOL) -> float:
    """Asserts the model's weights are within ``tol`` (relative) of ``reference``; with
    ``$ACCUMCORE_REL_LOG`` set, appends the test's name and the error to that file (for the
    notes that list each case's measured error)."""
    rel = relative_error(get_weights(model), reference, initial)
    if os.environ.get("ACCUMCORE_REL_LOG"):
        with open(os.environ["ACCUMCORE_REL_LOG"], "a", encoding="utf-8") as log:
            log.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]} {rel:.2e}\n")
    assert rel <= tol, f"relative weight error {rel:.3g} > {tol:g}"
    return rel


def bitwise_equal(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> bool:
    """Same number of arrays, each with the same dtype, shape and bytes."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        for x, y in zip(a, b)
    )


# ------------------------------------------------------------------------------ subprocess harness
RESULT_ENV = "ACCUMCORE_TEST_RESULT"
TAIL_CHARS = 4000  # of the child's output, in a ScriptError


class ScriptError(RuntimeError):
    """A child interpreter failed, timed out or wrote no result; the message holds its output's
    tail."""


def _encode(obj: Any) -> Any:
    """JSON for numpy values: arrays exactly (dtype, shape, base64 of the bytes)."""
    if isinstance(obj, np.ndarray):
        data = np.ascontiguousarray(obj)
        return {"__ndarray__": base64.b64encode(data.tobytes()).decode("ascii"),
                "dtype": data.dtype.str, "shape": list(data.shape)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} as JSON")


def _decode(obj: dict) -> Any:
    if "__ndarray__" in obj:
        raw = base64.b64decode(obj["__ndarray__"])
        return np.frombuffer(raw, dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    return obj


def emit(result: Any) -> None:
    """Child side: write ``result`` (JSON-able; numpy arrays allowed) for the parent to read."""
    path = os.environ.get(RESULT_ENV)
    if not path:
        raise RuntimeError(f"${RESULT_ENV} is not set: run this script through "
                           "tests/helpers.py run_script (or set it to an output path)")
    tmp = f"{path}.partial"
    with open(tmp, "w") as f:
        json.dump(result, f, default=_encode)
    os.replace(tmp, path)  # the parent never reads a half-written result


def run_cases(cases: Mapping[str, Callable[[], Any]], names: Iterable[str] = ()) -> None:
    """Child side: run the named cases (all if none), emitting ``{name: result}`` after each one
    (a timeout keeps what finished); a case that raises is recorded as ``{"error": traceback}``
    for :func:`case_result` to report."""
    results: dict[str, Any] = {}
    for name in list(names) or list(cases):
        try:
            results[name] = cases[name]()
        except Exception:  # noqa: BLE001 - reported to the test that reads this case
            results[name] = {"error": traceback.format_exc()}
        emit(results)


def case_result(results: Mapping[str, Any], name: str) -> Any:
    """Parent side: one case of a :func:`run_cases` result; fails with the child's traceback if
    it raised, or if it did not run."""
    value = results.get(name)
    assert value is not None, f"case {name!r} did not run (cases run: {sorted(results)})"
    if isinstance(value, dict) and "error" in value:
        raise AssertionError(f"case {name!r} raised in the child:\n{value['error']}")
    return value


def child_env(env: Mapping[str, str] | None = None, cpu_only: bool = True) -> dict[str, str]:
    """The environment of a child: ours, TF quiet, ``tests/`` importable, no GPU by default
    (logical CPU devices and CPU workers, also on a GPU machine), plus ``env``."""
    path = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH")) if p)
    out = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0", PYTHONPATH=path)
    if cpu_only:
        out["CUDA_VISIBLE_DEVICES"] = ""
    out.update(env or {})
    return out


def _command(script: str | Path, args: Sequence[str]) -> list[str]:
    """``python FILE ARGS`` for a path (``str`` ending in .py or a Path), else ``python -c``."""
    if isinstance(script, Path) or (isinstance(script, str) and script.endswith(".py")
                                    and "\n" not in script):
        path = Path(script)
        path = path if path.is_absolute() else TESTS_DIR / path  # relative: to tests/
        return [sys.executable, str(path), *map(str, args)]
    return [sys.executable, "-c", str(script), *map(str, args)]


def _tail(text: str) -> str:
    return text[-TAIL_CHARS:]


def _read_result(path: Path, what: str, output: str) -> Any:
    if not path.exists():
        raise ScriptError(f"{what} exited 0 but wrote no result (helpers.emit):\n{_tail(output)}")
    return json.loads(path.read_text(), object_hook=_decode)


def run_script(script: str | Path, *args: Any, env: Mapping[str, str] | None = None,
               timeout: float = 600, cpu_only: bool = True) -> Any:
    """Run ``script`` (a ``tests/*.py`` path, or Python source for ``-c``) with ``args`` in a
    fresh interpreter, in the repository root; return the JSON result it :func:`emit`-ed.

    Raises :class:`ScriptError` with the tail of the child's stderr (and stdout) if it exits
    non-zero, runs longer than ``timeout`` seconds, or emits nothing.
    """
    cmd = _command(script, args)
    what = "child " + (Path(cmd[1]).name if cmd[1] != "-c" else "python -c script")
    with tempfile.TemporaryDirectory(prefix="accumcore-child-") as tmp:
        out = Path(tmp) / "result.json"
        try:
            proc = subprocess.run(cmd, env=child_env({**(env or {}), RESULT_ENV: str(out)},
                                                     cpu_only),
                                  capture_output=True, text=True, timeout=timeout, cwd=REPO_DIR)
        except subprocess.TimeoutExpired as err:
            stderr = err.stderr.decode() if isinstance(err.stderr, bytes) else err.stderr or ""
            raise ScriptError(f"{what} ran past its {timeout:g} s timeout:\n"
                              f"{_tail(stderr)}") from None
        output = f"{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        if proc.returncode != 0:
            raise ScriptError(f"{what} failed (rc {proc.returncode}):\n{_tail(output)}")
        return _read_result(out, what, output)


def run_workers(script: str | Path, envs: Sequence[Mapping[str, str]], *args: Any,
                timeout: float = 600, cpu_only: bool = True) -> list[Any]:
    """Start ``len(envs)`` copies of ``script`` at once (copy i with ``envs[i]`` added to its
    environment, e.g. its ``TF_CONFIG``), wait for all within ``timeout`` seconds together, and
    return their emitted results in order. Every child still running at the end is killed;
    raises :class:`ScriptError` with each child's output tail if any fails or times out."""
    cmd = _command(script, args)
    with tempfile.TemporaryDirectory(prefix="accumcore-workers-") as tmp:
        outs = [Path(tmp) / f"result{i}.json" for i in range(len(envs))]
        logs = [Path(tmp) / f"worker{i}.log" for i in range(len(envs))]
        procs: list[subprocess.Popen] = []

        def tails() -> str:
            return "\n".join(f"--- worker {i} ---\n{_tail(log.read_text())}"
                             for i, log in enumerate(logs) if log.exists())

        try:
            for i, extra in enumerate(envs):
                with open(logs[i], "w") as log:
                    procs.append(subprocess.Popen(
                        cmd, env=child_env({**extra, RESULT_ENV: str(outs[i])}, cpu_only),
                        stdout=log, stderr=subprocess.STDOUT, cwd=REPO_DIR,
                    ))
            deadline = time.monotonic() + timeout
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise ScriptError(f"workers did not finish within {timeout:g} s:\n{tails()}") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
        failed = [i for i, p in enumerate(procs) if p.returncode != 0]
        if failed:
            raise ScriptError(f"worker(s) {failed} failed "
                              f"(rc {[procs[i].returncode for i in failed]}):\n{tails()}")
        return [_read_result(out, f"worker {i}", logs[i].read_text())
                for i, out in enumerate(outs)]


# ------------------------------------------------------------------------------ masked sequences
VOCAB, SEQ_LEN = 20, 12  # token 0 is padding


def seq_data(n: int = 64, seed: int = 0, min_len: int = 1,
             max_len: int = SEQ_LEN) -> tuple[np.ndarray, np.ndarray]:
    """Padded token sequences: x int32 (n, SEQ_LEN), lengths uniform in [min_len, max_len],
    tokens in [1, VOCAB), 0 after the end; y int32 (n, SEQ_LEN) the next token (a per-token
    label everywhere, padding included: the mask decides what counts)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, size=n)
    x = np.zeros((n, SEQ_LEN), "int32")
    for i, length in enumerate(lengths):
        x[i, :length] = rng.integers(1, VOCAB, size=length)
    y = (np.roll(x, -1, axis=1) + 1) % VOCAB
    return x, y.astype("int32")


@keras.saving.register_keras_serializable(package="accumcore_tests")
class TokenMask(keras.layers.Layer):
    """One-hot tokens whose mask comes from this layer's own ``compute_mask`` (token != 0): a
    mask source that is neither ``Embedding`` nor ``Masking``."""

    def call(self, tokens):
        return keras.ops.one_hot(tokens, VOCAB)

    def compute_mask(self, tokens, mask=None):
        return keras.ops.not_equal(tokens, 0)


@keras.saving.register_keras_serializable(package="accumcore_tests")
class PaddedOneHot(keras.layers.Layer):
    """Token t -> one-hot row of t - 1 (VOCAB - 1 wide): padding (0) becomes all zeros, which
    ``Masking`` masks."""

    def call(self, tokens):
        return keras.ops.one_hot(tokens - 1, VOCAB - 1)


MASK_SOURCES = ("embedding", "masking", "compute_mask")


def seq_model(source: str = "embedding", seed: int = 0, model_cls: Callable = keras.Model,
              **kwargs) -> keras.Model:
    """Per-token logits (n, SEQ_LEN, VOCAB) whose Keras mask comes from ``source``:
    ``Embedding(mask_zero=True)``, ``Masking`` (over a one-hot of the tokens whose padding
    rows are all zeros) or a layer's own ``compute_mask`` (:class:`TokenMask`); then
    Dense(16, tanh) and Dense(VOCAB), which pass the mask on. ``"none"``: the same model
    without a mask."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((SEQ_LEN,), dtype="int32")
    if source in ("embedding", "none"):
        h = keras.layers.Embedding(VOCAB, 8, mask_zero=source == "embedding")(tokens)
    elif source == "masking":
        h = keras.layers.Masking(0.0)(PaddedOneHot()(tokens))
    elif source == "compute_mask":
        h = TokenMask()(tokens)
    else:
        raise ValueError(source)
    h = keras.layers.Dense(16, activation="tanh")(h)
    return model_cls(tokens, keras.layers.Dense(VOCAB)(h), **kwargs)


def token_loss(**kwargs) -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kwargs)


def dense_reference(make_model: Callable[[], keras.Model], make_opt: Callable, loss, x, y,
                    sw, micro: int, k: int, epochs: int = 1):
    """Independent large-batch reference with dense gradients: per window, one forward pass
    of the whole window, the plain Keras ``loss`` (which reads the output's mask itself), one
    ``tape.gradient`` and one ``optimizer.apply``. Embedding gradients are made dense first,
    because Keras's optimizers update a sparse ``IndexedSlices`` gradient with repeated
    indices differently from the same gradient dense (the book's chapter 6 measures it),
    while accumulated gradients are dense. Returns (initial weights, final weights)."""
    model = make_model()
    initial = get_weights(model)
    optimizer = make_opt()
    for _ in range(epochs):
        for s in windows_of(len(x), micro, k):
            with tf.GradientTape() as tape:
                value = loss(y[s], model(x[s], training=True),
                             None if sw is None else sw[s])
            grads = tape.gradient(value, model.trainable_variables)
            optimizer.apply([tf.convert_to_tensor(g) for g in grads], model.trainable_variables)
    return initial, get_weights(model)
