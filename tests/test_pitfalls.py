"""accumcore.lab.pitfalls: each broken recipe really is broken, by the amount theory predicts
where it predicts one, and accumcore (and the hand-written correct loop) is exact on the
same problem.

Errors are ``experiments.relative_error`` against the independent large-batch reference
(``train_on_batch`` on each window's concatenated micro-batches, same initial weights).
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
from helpers import REL_TOL

from accumcore.lab import experiments, pitfalls

# REL_TOL (tests/helpers.py): float32 round-off of one correct accumulated run measures
# ~1e-7..3e-5 (Adam amplifies the round-off of near-zero gradient entries); every bug below
# is >= 1e-2.
K = 4


@pytest.fixture(scope="module")
def data():
    """Synthetic 10-class problem: 20 features, labels from a fixed random linear map."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 20)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(20, 10)), axis=1).astype("int64")
    return x, y


def problem(data, sizes, make_optimizer=None, **kwargs) -> pitfalls.Problem:
    x, y = data
    return pitfalls.make_problem(x, y, sizes, accum_steps=K, hidden=(16,),
                                 make_optimizer=make_optimizer, **kwargs)


@pytest.fixture(scope="module")
def two_windows(data):
    return problem(data, [16] * 8)


@pytest.fixture(scope="module")
def partial(data):
    return problem(data, [16] * 10)  # 2 full windows + 2 of K=4 micro-batches


@pytest.fixture(scope="module")
def ragged(data):
    return problem(data, [40, 8, 8, 8, 24, 16, 8, 8])


# ------------------------------------------------------------------------------- problems


def test_problem_windows_and_large_batches(partial):
    windows = partial.windows()
    assert [len(w) for w in windows] == [4, 4, 2]
    large = partial.large_batches()
    assert [len(b[0]) for b in large] == [64, 64, 32]
    np.testing.assert_array_equal(large[2][0], np.concatenate([partial.micro_batches[8][0],
                                                               partial.micro_batches[9][0]]))


def test_make_problem_rejects_too_few_samples(data):
    with pytest.raises(ValueError, match="samples"):
        problem(data, [400, 200])


def test_reference_is_cached_and_replace_drops_it(two_windows):
    ref = two_windows.reference()
    assert two_windows.reference() is ref
    assert two_windows.replace(name="x")._reference is None


def test_problem_takes_no_private_parameters():
    """The cache fields are no constructor parameters, so appendix B's signature of Problem
    shows only what a reader passes."""
    import inspect

    from accumcore.lab.pitfalls import Problem

    assert [n for n in inspect.signature(Problem).parameters if n.startswith("_")] == []


# ------------------------------------------------------------------------------- correct code


@pytest.mark.parametrize("name", ["two_windows", "partial", "ragged"])
def test_accumcore_and_correct_loop_are_exact(name, request):
    p = request.getfixturevalue(name)
    assert pitfalls.measure(p, pitfalls.accumcore_recipe) < REL_TOL
    assert pitfalls.measure(p, pitfalls.correct_loop) < REL_TOL


def test_token_problem_is_ragged_in_tokens_and_accumcore_is_exact():
    p = pitfalls.token_problem()
    tokens = [pitfalls.batch_weight(p, b) for b in p.micro_batches]
    assert max(tokens) > 2 * min(tokens)
    assert pitfalls.measure(p, pitfalls.accumcore_recipe) < REL_TOL
    assert pitfalls.measure(p, pitfalls.correct_loop) < REL_TOL
    assert pitfalls.measure(p, pitfalls.mean_of_means) > 0.05


# ------------------------------------------------------------------------------- broken recipes


def test_loss_not_rescaled_is_k_times_the_step(data):
    one_window = problem(data, [16] * K)
    # SGD: w = w0 - lr * K * g, so |w - w_ref| = (K - 1) |w_ref - w0| exactly (to round-off).
    assert pitfalls.measure(one_window, pitfalls.loss_not_rescaled) == pytest.approx(K - 1,
                                                                                    rel=1e-3)


def test_accumulators_before_variables_never_train(two_windows):
    model = pitfalls.accumulators_before_variables(two_windows)
    initial, _ = two_windows.reference()
    for w, w0 in zip(model.get_weights(), initial, strict=True):
        np.testing.assert_array_equal(w, w0)
    assert pitfalls.measure(two_windows, pitfalls.accumulators_before_variables) == pytest.approx(
        1.0, abs=1e-6)


@pytest.mark.parametrize("recipe", [pitfalls.never_reset, pitfalls.reset_every_micro_batch])
def test_reset_at_the_wrong_time(two_windows, recipe):
    assert pitfalls.measure(two_windows, recipe) > 0.05


def test_never_reset_is_harmless_for_a_single_window(data):
    # The bug appears only from the second window on: a control that the recipe is otherwise
    # right.
    assert pitfalls.measure(problem(data, [16] * K), pitfalls.never_reset) < REL_TOL


@pytest.mark.parametrize("recipe", [pitfalls.partial_window_dropped,
                                    pitfalls.partial_window_divided_by_k,
                                    pitfalls.tf_function_epoch_divide_by_k])
def test_partial_window_recipes_break_only_with_a_partial_window(two_windows, partial, recipe):
    assert pitfalls.measure(two_windows, recipe) < REL_TOL
    assert pitfalls.measure(partial, recipe) > 0.05


def test_mean_of_means_breaks_only_with_ragged_micro_batches(two_windows, ragged):
    assert pitfalls.measure(two_windows, pitfalls.mean_of_means) < REL_TOL
    assert pitfalls.measure(ragged, pitfalls.mean_of_means) > 0.05


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "schedule": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)),
    "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "weight_decay": lambda: keras.optimizers.SGD(0.1, weight_decay=0.1),
    "adam": lambda: keras.optimizers.Adam(1e-3),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_apply_every_micro_step_breaks_every_stateful_optimizer(two_windows, name):
    p = two_windows.replace(make_optimizer=OPTIMIZERS[name])
    rel = pitfalls.measure(p, pitfalls.apply_every_micro_step)
    if name == "sgd":
        assert rel < REL_TOL  # zero gradients move nothing: plain SGD hides the bug
    else:
        assert rel > 0.05
    assert pitfalls.measure(p, pitfalls.accumcore_recipe) < REL_TOL


@pytest.mark.parametrize("name", ["sgd", "schedule", "weight_decay"])
def test_keras_gradient_accumulation_steps(two_windows, ragged, partial, name):
    p = two_windows.replace(make_optimizer=OPTIMIZERS[name])
    rel = pitfalls.measure(p, pitfalls.keras_gradient_accumulation)
    if name == "schedule":
        assert rel > 0.05  # the schedule is evaluated at Keras's micro-step counter
    else:
        assert rel < REL_TOL
    if name == "sgd":
        assert pitfalls.measure(ragged, pitfalls.keras_gradient_accumulation) > 0.05  # 1/K
        # the partial window stays in Keras's accumulators: as if dropped
        assert pitfalls.measure(partial, pitfalls.keras_gradient_accumulation) == pytest.approx(
            pitfalls.measure(partial, pitfalls.partial_window_dropped), rel=1e-3)


def test_clip_per_micro_batch(two_windows):
    p = two_windows.replace(make_optimizer=lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.2))
    assert pitfalls.measure(p, pitfalls.clip_per_micro_batch) > 0.02
    assert pitfalls.measure(p, pitfalls.accumcore_recipe) < REL_TOL
    with pytest.raises(ValueError, match="global_clipnorm"):
        pitfalls.clip_per_micro_batch(two_windows)


def test_clip_before_unscale_vanishes_the_update(two_windows):
    p = two_windows.replace(make_optimizer=lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1, global_clipnorm=0.2)))
    # clipped at 0.2 in units scaled by 2**15, i.e. 6e-6 after unscaling: no update left.
    assert pitfalls.measure(p, pitfalls.clip_before_unscale) == pytest.approx(1.0, abs=1e-3)
    assert pitfalls.measure(p, pitfalls.accumcore_recipe) < REL_TOL


def test_sum_raw_gradients_train_step(data, two_windows):
    one_window = problem(data, [16] * K)
    assert pitfalls.measure(one_window, pitfalls.sum_raw_gradients_train_step) == pytest.approx(
        K - 1, rel=1e-3)
    assert pitfalls.measure(two_windows, pitfalls.sum_raw_gradients_train_step) > 1.0
    model = pitfalls.sum_raw_gradients_train_step(one_window)
    assert len(model.weights) == len(one_window.reference()[1])  # sums are not model weights


def test_popular_recipes_need_equal_micro_batches(ragged):
    with pytest.raises(ValueError, match="equal micro-batches"):
        pitfalls.sum_raw_gradients_train_step(ragged)
    with pytest.raises(ValueError, match="equal micro-batches"):
        pitfalls.tf_function_epoch_divide_by_k(ragged)


# ------------------------------------------------------------------------------- BN and dropout


def test_batchnorm_gap_is_real_and_moving_statistics_move_k_times(data):
    x, y = data
    images = np.tile(x[:, :16].reshape(-1, 4, 4, 1), (1, 2, 2, 1))  # (n, 8, 8, 1)
    build = functools.partial(experiments.conv_net, (8, 8, 1), filters=(4,), batch_norm=True)
    p = pitfalls.make_problem(images, y, [16] * K, accum_steps=K, build_model=build)
    gap = pitfalls.batchnorm_gap(p)
    assert gap["trainable"] > 1e-3  # micro-batch statistics differ from the batch's
    # Moving statistics get K updates of momentum 0.99 instead of one: ~K-1 times too far.
    assert gap["moving_statistics"] > 1.0
    no_bn = p.replace(build_model=functools.partial(experiments.conv_net, (8, 8, 1),
                                                    filters=(4,)))
    assert pitfalls.measure(no_bn, pitfalls.accumcore_recipe) < REL_TOL  # control: BN is the cause


def test_dropout_gap_is_of_the_order_of_a_different_dropout_seed(data):
    x, y = data
    build = functools.partial(pitfalls.dropout_mlp, 20, 16)
    p = pitfalls.make_problem(x, y, [16] * K, accum_steps=K, build_model=build)
    gap = pitfalls.dropout_gap(p)
    assert gap["accumcore_vs_large"] > 1e-3 and gap["large_vs_large_other_seed"] > 1e-3
    assert 0.1 < gap["accumcore_vs_large"] / gap["large_vs_large_other_seed"] < 10


def test_measure_rejects_bad_which(two_windows):
    with pytest.raises(ValueError, match="which"):
        pitfalls.measure(two_windows, pitfalls.correct_loop, which="moving")


# ------------------------------------------------------------------------------- display


CORRECT_CODE = (pitfalls.window_gradient, pitfalls.correct_loop)  # printed too, without a BUG


@pytest.mark.parametrize("obj", [*CORRECT_CODE, pitfalls.partial_window_dropped,
                                 pitfalls.partial_window_divided_by_k,
                                 pitfalls.clip_before_unscale, pitfalls.SumRawGradientsModel])
def test_recipe_source_drops_docstrings_keeps_bug_lines_narrow(obj):
    source = pitfalls.recipe_source(obj)
    assert '"""' not in source and ("# BUG" in source) == (obj not in CORRECT_CODE)
    assert max(len(line) for line in source.splitlines()) <= 88
    for line in source.splitlines():  # a BUG comment stands on a line of its own
        assert "# BUG" not in line or line.lstrip().startswith("# BUG")


def _run_listing(obj, folder):
    """The names defined by recipe_imports + recipe_source of ``obj``, as the book shows them,
    saved as a module of their own in ``folder`` and imported (autograph reads its source)."""
    import importlib.util

    path = folder / f"listing_{obj.__name__}.py"
    path.write_text(pitfalls.recipe_imports([obj]) + pitfalls.recipe_source(obj))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


def _listing_problem(obj, two_windows, partial):
    if obj is pitfalls.clip_per_micro_batch:
        return two_windows.replace(
            make_optimizer=lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.5))
    if obj is pitfalls.clip_before_unscale:
        return two_windows.replace(make_optimizer=lambda: keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1, global_clipnorm=0.5)))
    return partial  # a partial last window, so that the partial-window bugs act


@pytest.mark.parametrize("obj", pitfalls.RECIPES, ids=lambda obj: obj.__name__)
def test_recipe_listing_runs_as_shown(obj, two_windows, partial, tmp_path):
    """The book shows recipe_imports + recipe_source: run as text, each trains exactly as the
    library's own function (or, for the helpers, computes the same gradient / is defined)."""
    namespace = _run_listing(obj, tmp_path)
    shown = namespace[obj.__name__]
    assert shown is not obj  # defined by the listing, not imported
    if obj is pitfalls.SumRawGradientsModel:
        assert issubclass(shown, keras.Model)
        return
    if obj is pitfalls.window_gradient:
        model, loss_fn = partial.build_model(), experiments.keras_loss(partial.loss)
        window = partial.windows()[0]
        expected = pitfalls.window_gradient(partial, model, loss_fn, window)
        for a, b in zip(shown(partial, model, loss_fn, window), expected, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
        return
    p = _listing_problem(obj, two_windows, partial)
    for a, b in zip(shown(p).get_weights(), obj(p).get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_recipe_imports_name_every_free_name_once():
    text = pitfalls.recipe_imports(pitfalls.RECIPES)
    assert "import tensorflow as tf" in text and "from accumcore import AccumTrainer" in text
    assert "_impl" not in text and max(len(line) for line in text.splitlines()) <= 88
    imported = text.replace(",", " ").replace("(", " ").replace(")", " ").split()
    for name in ("Problem", "mean_loss_gradients", "zero_gradients", "batch_weight",
                 "keras_loss", "optimizer_like", "Any"):
        assert imported.count(name) == 1, name


# ------------------------------------------------------------------------------- embeddings


@pytest.mark.parametrize("name", ["sgd", "adam", "rmsprop"])
def test_embedding_keras_sparse_step_vs_dense_update(name):
    make = {"sgd": lambda: keras.optimizers.SGD(0.5),
            "adam": lambda: keras.optimizers.Adam(1e-2),
            "rmsprop": lambda: keras.optimizers.RMSprop(1e-2)}[name]
    p = pitfalls.embedding_problem(make_optimizer=make)
    tokens = np.concatenate([b[0] for b in p.large_batches()[0:1]])
    assert len(np.unique(tokens)) < tokens.size / 4  # many repeated token ids per batch
    gap = pitfalls.embedding_gap(p)
    assert gap["accumcore_vs_dense"] < REL_TOL  # accumcore's update is the dense one
    if name == "sgd":  # SGD is linear in the gradient: sparse rows sum to the dense row
        assert gap["keras_vs_dense"] < REL_TOL
    else:  # squared statistics of repeated rows: sum of squares, not square of the sum
        assert gap["keras_vs_dense"] > 1e-2


def test_zero_gradients_one_zero_tensor_per_trainable_variable():
    """The recipes' empty accumulators: the trainable variables' shapes, every entry zero."""
    model = experiments.mlp(20, (8,), 10, seed=0)
    zeros = pitfalls.zero_gradients(model)
    assert [tuple(z.shape) for z in zeros] == [tuple(v.shape) for v in model.trainable_variables]
    assert all(not np.any(np.asarray(z)) for z in zeros)
