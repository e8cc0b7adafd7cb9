"""AccumTrainer: history, Progbar, tracing, effective batch size, window_step."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import LOSS, OPTIMIZERS, dataset, small_mlp

import accumcore as ac


@pytest.mark.parametrize("mode", ["eager", "function", "graph"])
def test_history_window_loss_is_the_large_batch_loss(mode, data):
    # With one window per epoch, the window loss is the loss of the large batch at the weights
    # the window started from: compare with the plain model's loss on all 40 samples.
    x, y = data
    plain = small_mlp()
    plain.compile(OPTIMIZERS["sgd"](), LOSS)
    expected = plain.evaluate(x, y, batch_size=40, verbose=0)
    trainer = ac.AccumTrainer(small_mlp(), OPTIMIZERS["sgd"](), LOSS, accum_steps=3)
    history = trainer.fit(dataset(x, y, micro=16), epochs=2, mode=mode, verbose=0)
    assert len(history.micro_losses) == 6 and history.micro_weights[:3] == [16.0, 16.0, 8.0]
    assert len(history.window_losses) == 2 and history.updates == [1, 1]
    assert history.window_losses[0] == pytest.approx(expected, rel=1e-5)
    assert history.epoch_losses[0] == pytest.approx(expected, rel=1e-5)
    assert history.window_losses[1] < history.window_losses[0]  # it learned something
    assert history.counters["windows_applied"] == 2


def test_function_mode_does_not_retrace_for_the_ragged_last_micro_batch(data):
    x, y = data
    trainer = ac.AccumTrainer(small_mlp(), OPTIMIZERS["adam"](), LOSS, accum_steps=2)
    # 16, 16, 8 samples per epoch
    trainer.fit(dataset(x, y, micro=16), epochs=3, mode="function", verbose=0)
    assert trainer._micro_fn.experimental_get_tracing_count() == 1


def test_graph_mode_traces_the_epoch_once(data):
    x, y = data
    trainer = ac.AccumTrainer(small_mlp(), OPTIMIZERS["adam"](), LOSS, accum_steps=2)
    trainer.fit(dataset(x, y, micro=16), epochs=3, mode="graph", verbose=0)
    assert trainer._epoch_fn.experimental_get_tracing_count() == 1


def test_window_step_does_not_retrace_for_a_ragged_last_batch(data):
    x, y = data
    trainer = ac.AccumTrainer(small_mlp(), OPTIMIZERS["sgd"](), LOSS, accum_steps=4)
    for _ in range(2):
        trainer.window_step(x[:32], y[:32])
        trainer.window_step(x[32:], y[32:])  # 8 samples: 4 micro-batches of 2
    assert trainer._window_fn.experimental_get_tracing_count() <= 2
    assert int(trainer.optimizer.iterations.numpy()) == 4
    assert trainer.state.counters()["micro_batches_seen"] == 16


def test_effective_batch_size_sets_k(data):
    with pytest.warns(FutureWarning, match="old form"):  # says the new calls
        trainer = ac.AccumTrainer(small_mlp(), OPTIMIZERS["sgd"](), LOSS,
                                  effective_batch_size=64, micro_batch_size=16)
    assert trainer.accum_steps == 4
    assert ac.resolve_accum_steps(effective_batch_size=100, micro_batch_size=16,
                                  exact=False) == 7


def test_progress_bar_is_shown(data, capsys):
    x, y = data
    trainer = ac.AccumTrainer(small_mlp(), OPTIMIZERS["sgd"](), LOSS, accum_steps=2)
    trainer.fit(dataset(x, y, micro=16), epochs=1, mode="eager", verbose=1)
    out = capsys.readouterr().out
    assert "3/3" in out and "loss" in out


def test_flush_applies_a_pending_window_with_its_true_weight(data):
    x, y = data
    trainer = ac.AccumTrainer(small_mlp(), OPTIMIZERS["sgd"](), LOSS, accum_steps=5)
    trainer.train_micro_batch(x[:8], y[:8])
    assert int(trainer.state.micro_step.numpy()) == 1
    assert trainer.flush() is True
    assert trainer.flush() is False  # nothing pending any more
    ref = small_mlp()
    ref.compile(OPTIMIZERS["sgd"](), LOSS)
    ref.train_on_batch(x[:8], y[:8])
    for a, b in zip(trainer.model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["eager", "function", "graph"])
def test_verbose_2_prints_each_epoch_once_with_its_mean_micro_batch_loss(mode, data, capsys):
    # The one end-of-epoch bar update (every mode with verbose=2; graph also with verbose=1).
    x, y = data
    trainer = ac.AccumTrainer(small_mlp(), OPTIMIZERS["sgd"](), LOSS, accum_steps=2)
    history = trainer.fit(dataset(x, y, micro=16), epochs=2, mode=mode, verbose=2)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2, lines
    for epoch, line in enumerate(lines):
        # The epoch's mean over its samples (micro-batches of 16, 16 and 8: not the plain
        # mean of the three micro-batch losses), as model.fit's bar ends.
        mean = history.epoch_losses[epoch]
        assert mean != pytest.approx(np.mean(history.micro_losses[3 * epoch : 3 * epoch + 3]))
        assert line.startswith("3/3 - ") and line.endswith(f"loss: {mean:.4f}"), line


@pytest.mark.parametrize("mode", ["eager", "function", "graph"])
def test_progress_bar_ends_each_epoch_on_the_epoch_mean_loss(mode, data, capsys):
    """verbose=1: the live bar shows the running mean, and its last line the epoch's mean
    (``LoopHistory.epoch_losses``), not the last micro-batch's loss."""
    x, y = data
    trainer = ac.AccumTrainer(small_mlp(), OPTIMIZERS["sgd"](), LOSS, accum_steps=2)
    history = trainer.fit(dataset(x, y, micro=16), epochs=1, mode=mode, verbose=1)
    out = capsys.readouterr().out
    last = out.replace("\b", "\r").replace("\n", "\r").split("\r")
    last = [line for line in last if line.strip()][-1]
    assert "3/3" in last and last.rstrip().endswith(f"loss: {history.epoch_losses[0]:.4f}"), last
    assert f"{history.micro_losses[-1]:.4f}" != f"{history.epoch_losses[0]:.4f}"
