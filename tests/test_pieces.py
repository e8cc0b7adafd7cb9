"""The rule's pieces on their own: ``rule.add``, ``rule.end`` and the ``"raise"`` stop, on
hand-made variables (no model, no optimizer); each checked against numbers computed here by
hand."""

import numpy as np
import pytest
import tensorflow as tf

from accumcore._impl import distribute, rule
from accumcore._impl.nonfinite import POLICIES, Stop

ONE_REPLICA = distribute.replicas(None)


def _scalar(value, dtype=tf.int64):
    return tf.Variable(tf.constant(value, dtype))


def _window(shapes=((2, 3), (4,))):
    accumulators = [tf.Variable(tf.zeros(s)) for s in shapes]
    return rule.Window(accumulators, _scalar(0.0, tf.float32), _scalar(0), _scalar(0),
                       _scalar(0))


def _counters():
    return rule.Counters(*(_scalar(0) for _ in range(6)))


def _stop():
    return Stop(tf.Variable(tf.constant([-1, -1, -1, -1], tf.int64)), lambda v: (v,))


def _plan(policy="skip_window"):
    return rule.plan(POLICIES[policy], None, ONE_REPLICA, _stop())


def test_add_sums_weighted_gradients_and_counts():
    window, counters = _window(), _counters()
    rng = np.random.default_rng(0)
    grads = [[rng.normal(size=(2, 3)).astype("float32"), rng.normal(size=4).astype("float32")]
             for _ in range(3)]
    weights = [5.0, 2.0, 9.0]
    for g, w in zip(grads, weights):
        rule.add(window, counters, _plan(), [tf.constant(x) for x in g], tf.constant(w),
                 tf.constant(4, tf.int64))
    assert int(window.micro_step.numpy()) == 3 and int(window.samples.numpy()) == 12
    assert float(window.weight.numpy()) == sum(weights)
    assert int(counters.micro_batches_seen.numpy()) == 3
    assert int(counters.samples_seen.numpy()) == 12
    for i in range(2):
        np.testing.assert_allclose(window.accumulators[i].numpy(), sum(g[i] for g in grads),
                                   rtol=1e-6)


def test_add_sparse_rows_and_missing_gradients():
    window = _window(((5, 2), (3,)))
    rows = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
                            tf.constant([0, 3, 0]), tf.constant([5, 2]))
    rule.add(window, _counters(), _plan(), [rows, None], tf.constant(1.0),
             tf.constant(1, tf.int64))
    expected = np.zeros((5, 2), "float32")
    expected[0] = [6.0, 8.0]  # a repeated row is summed
    expected[3] = [3.0, 4.0]
    np.testing.assert_array_equal(window.accumulators[0].numpy(), expected)
    assert rule.present_of([rows, None]) == (0,)
    assert not np.any(window.accumulators[1].numpy())


def test_skip_micro_batch_leaves_a_flagged_one_out_and_counts_it():
    window, counters = _window(), _counters()
    bad = [tf.fill((2, 3), np.nan), tf.ones(4)]
    added = rule.add(window, counters, _plan("skip_micro_batch"), bad, tf.constant(3.0),
                     tf.constant(3, tf.int64))
    assert not bool(added)
    assert float(window.weight.numpy()) == 0.0 and not np.any(window.accumulators[1].numpy())
    assert int(window.micro_step.numpy()) == 1  # it still takes its place in the window
    assert int(counters.micro_batches_skipped.numpy()) == 1
    assert int(counters.samples_dropped.numpy()) == 3 and int(window.poisoned.numpy()) == 0


@pytest.mark.parametrize("applied", [True, False, "tensor-true", "tensor-false"])
def test_end_counts_the_outcome_and_empties_the_window(applied):
    window, counters = _window(), _counters()
    rule.add(window, counters, _plan(), [tf.ones((2, 3)), tf.ones(4)], tf.constant(3.0),
             tf.constant(7, tf.int64))
    window.poisoned.assign(1)
    value = applied if isinstance(applied, bool) else applied == "tensor-true"
    if isinstance(applied, bool):
        rule.end(window, counters, ONE_REPLICA, value, [])
    else:  # the outcome is not known at trace time
        tf.function(lambda flag: rule.end(window, counters, ONE_REPLICA, flag, []))(
            tf.constant(value))
    assert int(counters.windows_applied.numpy()) == int(value)
    assert int(counters.windows_skipped.numpy()) == int(not value)
    assert int(counters.samples_dropped.numpy()) == (0 if value else 7)
    assert all(not np.any(v.numpy()) for v in window.variables)


def test_a_dropped_window_is_not_counted_as_skipped():
    window, counters = _window(), _counters()
    window.samples.assign(5)
    rule.end(window, counters, ONE_REPLICA, False, [], counted=False)
    assert int(counters.windows_skipped.numpy()) == 0
    assert int(counters.samples_dropped.numpy()) == 5


def test_stop_records_the_first_bad_window_only_and_clears():
    stop, window, counters = _stop(), _window(((2, 3), (4,), (5,))), _counters()
    assert not bool(stop.stopped) and stop.error(["a", "b", "c"], 4) is None
    window.micro_step.assign(2)
    counters.micro_batches_seen.assign(6)
    counters.windows_applied.assign(2)
    # variables 0 and 2 have gradients; the sum of variable 2 is not finite
    window.accumulators[2].assign([1.0, np.nan, 0.0, 0.0, 0.0])
    stop.record(tf.constant(True), window, counters, [0, 2])
    assert bool(stop.stopped)
    counters.micro_batches_seen.assign(9)
    counters.windows_skipped.assign(1)
    # a later bad window while stopped does not overwrite the record
    window.accumulators[0].assign(tf.fill((2, 3), np.inf))
    stop.record(tf.constant(True), window, counters, [0, 2])
    error = stop.error(["a", "b", "c"], 9, epoch=3)
    assert (error.window, error.first_micro_step, error.micro_batches) == (2, 4, 2)
    assert error.variable == "c" and error.unused_micro_batches == 3
    assert "epoch 4, window 3 of the run (its micro-batches 5 to 6 of the run" in str(error)
    assert stop.clear()
    assert not bool(stop.stopped) and stop.error(["a", "b", "c"], 9) is None
    assert not stop.clear()
    stop.record(tf.constant(False), window, counters, [0, 2])
    assert not bool(stop.stopped)  # a window skipped for another reason (empty) is not bad


def test_plan_skips_every_window_while_stopped():
    """``"raise"``: after a bad window, a clean full window is skipped too, and counted."""
    stop, window, counters = _stop(), _window(), _counters()
    stop.record_variable.assign([0, 0, 1, -1])
    plan = rule.plan(POLICIES["raise"], None, ONE_REPLICA, stop)
    rule.add(window, counters, plan, [tf.ones((2, 3)), tf.ones(4)], tf.constant(2.0),
             tf.constant(2, tf.int64))
    applied = rule.close(window, counters, plan, None, [], [])
    assert not bool(applied)
    assert int(counters.windows_skipped.numpy()) == 1
    assert int(counters.samples_dropped.numpy()) == 2
