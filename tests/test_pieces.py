"""The state's pieces on their own: the window (add, due, mean, reset), the counters and the
non-finite guard, on hand-made variables (no model, no optimizer): each rule checked against
numbers computed here by hand."""

import numpy as np
import pytest
import tensorflow as tf

from accumcore.nonfinite import NonFiniteGuard
from accumcore.window import Counters, Window


def _scalar(value, dtype=tf.int64):
    return tf.Variable(tf.constant(value, dtype))


def _window(shapes=((2, 3), (4,))):
    accumulators = [tf.Variable(tf.zeros(s)) for s in shapes]
    return Window(accumulators, _scalar(0.0, tf.float32), _scalar(0), _scalar(0), _scalar(0),
                  parts=lambda v: (v,), distributed=False)


def test_window_adds_weighted_sums_and_divides_once():
    window = _window()
    rng = np.random.default_rng(0)
    grads = [[rng.normal(size=(2, 3)).astype("float32"), rng.normal(size=4).astype("float32")]
             for _ in range(3)]
    weights = [5.0, 2.0, 9.0]
    for g, w in zip(grads, weights):
        window.add([tf.constant(x) for x in g], tf.constant(w), tf.constant(4, tf.int64))
        window.advance()
    assert int(window.micro_step.numpy()) == 3 and int(window.samples.numpy()) == 12
    assert float(window.weight.numpy()) == sum(weights)
    mean = window.mean(window.weight.read_value())
    for i in range(2):
        expected = sum(g[i] for g in grads) / sum(weights)  # the sums were given pre-weighted
        np.testing.assert_allclose(mean[i].numpy(), expected, rtol=1e-6)
    summed = window.mean(window.weight.read_value(), normalize=False)
    np.testing.assert_allclose(summed[1].numpy(), sum(g[1] for g in grads), rtol=1e-6)


def test_window_sparse_rows_and_missing_gradients():
    window = _window(((5, 2), (3,)))
    rows = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
                            tf.constant([0, 3, 0]), tf.constant([5, 2]))
    window.add([rows, None], tf.constant(1.0), tf.constant(1, tf.int64))
    expected = np.zeros((5, 2), "float32")
    expected[0] = [6.0, 8.0]  # a repeated row is summed
    expected[3] = [3.0, 4.0]
    np.testing.assert_array_equal(window.accumulators[0].numpy(), expected)
    window.has_gradient = [True, False]
    mean = window.mean(tf.constant(2.0))
    assert mean[1] is None
    np.testing.assert_array_equal(mean[0].numpy(), expected / 2)


def test_window_due_and_reset():
    window = _window()
    assert not bool(window.due(tf.constant(3, tf.int64), 4, force=False))
    assert bool(window.due(tf.constant(4, tf.int64), 4, force=False))
    assert bool(window.due(tf.constant(1, tf.int64), 4, force=True))
    assert not bool(window.due(tf.constant(0, tf.int64), 4, force=True))
    window.add([tf.ones((2, 3)), tf.ones(4)], tf.constant(3.0), tf.constant(3, tf.int64))
    window.advance()
    window.poisoned.assign(1)
    window.reset()
    assert all(not np.any(v.numpy()) for v in window.variables)


@pytest.mark.parametrize("applied", [True, False, "tensor-true", "tensor-false"])
def test_counters_end_window(applied):
    variables = {name: _scalar(0) for name in Counters.NAMES}
    counters = Counters(variables, parts=lambda v: (v,))
    pending = _scalar(7)
    value = applied if isinstance(applied, bool) else None

    @tf.function
    def end(flag):  # the outcome is not known at trace time
        counters.end_window(flag, pending, counted=True)

    if value is None:
        value = applied == "tensor-true"
        end(tf.constant(value))
    else:
        counters.end_window(value, pending, counted=True)
    assert int(variables["windows_applied"].numpy()) == int(value)
    assert int(variables["windows_skipped"].numpy()) == int(not value)
    assert int(variables["samples_dropped"].numpy()) == (0 if value else 7)


def test_counters_dropped_window_is_not_counted_as_skipped():
    variables = {name: _scalar(0) for name in Counters.NAMES}
    Counters(variables, parts=lambda v: (v,)).end_window(False, _scalar(5), counted=False)
    assert int(variables["windows_skipped"].numpy()) == 0
    assert int(variables["samples_dropped"].numpy()) == 5


def test_guard_records_the_first_freeze_only_and_clears():
    guard = NonFiniteGuard(_scalar(0), tf.Variable(tf.constant([-1, -1, -1], tf.int64)),
                           lambda v: (v,))
    assert not bool(guard.frozen)
    assert guard.error(["a", "b", "c"], 4) is None
    # variables 0 and 2 have gradients; the one of variable 2 is not finite
    guard.refuse(tf.constant([True, False, True]), [0, 2], tf.constant(1, tf.int64),
                 tf.constant(9, tf.int64))
    guard.refuse(tf.constant([False, True, True]), [0, 2], tf.constant(2, tf.int64),
                 tf.constant(10, tf.int64))  # refused while frozen: counted, not recorded
    error = guard.error(["a", "b", "c"], 4, epoch=3)
    assert (error.micro_step, error.window_position, error.variable) == (9, 1, "c")
    assert error.unused_micro_batches == 1 and "epoch 3" in str(error)
    assert guard.clear(pending=1, samples=4)
    assert not bool(guard.frozen) and guard.error(["a", "b", "c"], 4) is None
    assert not guard.clear(pending=0, samples=0)
