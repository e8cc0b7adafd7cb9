"""The compiled micro-step (mode="function") is traced once, ragged last micro-batch included."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from helpers import small_mlp

import accumcore as ac


def _counting_loss(counter: list[int]):
    def loss(y_true, y_pred):
        counter[0] += 1  # Python side effect: runs once per trace (and per call in eager mode)
        return keras.losses.sparse_categorical_crossentropy(y_true, y_pred)

    return loss


def test_ragged_last_micro_batch_does_not_retrace(data):
    x, y = data  # 40 samples -> micro-batches 16, 16, 8 (ragged)
    traces = [0]
    trainer = ac.AccumTrainer(small_mlp(), keras.optimizers.SGD(0.1), _counting_loss(traces),
                              accum_steps=2)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    history = trainer.fit(ds, epochs=2, mode="function", verbose=0)
    assert history.micro_weights[:3] == [16.0, 16.0, 8.0]
    assert traces[0] == 1, f"the micro-step was traced {traces[0]} times, expected once"


def test_relaxed_trace_with_sample_weights_and_numpy_inputs(data):
    x, y = data
    sw = np.linspace(0.5, 1.5, len(x)).astype("float32")
    traces = [0]
    trainer = ac.AccumTrainer(small_mlp(), keras.optimizers.SGD(0.1), _counting_loss(traces),
                              accum_steps=2)
    for start, size in ((0, 16), (16, 16), (32, 8)):
        s = slice(start, start + size)
        trainer.train_micro_batch(x[s], y[s], sw[s], compiled=True)
    assert traces[0] == 1
    assert trainer.state.counters()["micro_batches_seen"] == 3


def _library_functions():
    """Every function and method defined in ``accumcore/`` (not ``lab/``): (where, AST node)."""
    import ast
    import pathlib

    root = pathlib.Path(ac.__file__).parent
    for path in sorted(root.rglob("*.py")):
        if "lab" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield f"{path.name}:{node.lineno} {node.name}", node


def test_library_code_is_convertible_by_autograph():
    """AutoGraph converts every function a ``tf.function`` calls; on what it cannot parse it
    prints "AutoGraph could not transform ... Please report this to the TensorFlow team" into
    the user's output (the book's browser check caught it). Two forms it cannot convert: a body
    that is only a docstring, and the walrus operator (``:=``)."""
    import ast

    docstring_only, walrus = [], []
    for where, node in _library_functions():
        if any("do_not_convert" in ast.unparse(d) for d in node.decorator_list):
            continue  # AutoGraph leaves it as it is, silently
        body = node.body
        if len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(
                body[0].value.value, str):
            docstring_only.append(where)
        if any(isinstance(n, ast.NamedExpr) for n in ast.walk(node)):
            walrus.append(where)
    assert docstring_only == [] and walrus == []
    assert len(list(_library_functions())) > 100  # the walk found the library


def test_hot_path_functions_convert():
    """The functions AutoGraph warned about, converted for real (``tf.autograph.to_graph``
    raises where it would have warned)."""
    from accumcore._impl import distribute, rule

    for function in (rule._nothing, rule._admit_all, rule._no_check, rule._never,
                     distribute.Replicas.forget, distribute.Replicas.require_replica_context):
        tf.autograph.to_graph(function)
