"""accumcore.lab.plotting: every figure has a title, axis labels, a legend and palette colours."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # headless; must precede pyplot

import matplotlib.colors as mcolors  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from accumcore.lab import plotting  # noqa: E402

PALETTE = {mcolors.to_hex(c) for c in plotting.OKABE_ITO}


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _legend_texts(ax) -> list[str]:
    legend = ax.get_legend()
    assert legend is not None, "no legend"
    return [t.get_text() for t in legend.get_texts()]


def test_palette_is_okabe_ito():
    assert len(plotting.OKABE_ITO) == 8
    assert PALETTE == {"#e69f00", "#56b4e9", "#009e73", "#f0e442", "#0072b2", "#d55e00",
                       "#cc79a7", "#000000"}
    assert plotting.color(0) == plotting.color(8)


def test_curves_sets_texts_legend_and_palette_colours():
    ax = plotting.curves(None, {"batch 64": [1.0, 0.5, 0.2], "4 x 16": [1.0, 0.5, 0.2],
                                "batch 16": [1.0, 0.3, 0.1]},
                         x=[0, 64, 128], title="Loss", xlabel="samples seen",
                         ylabel="loss (nats)")
    assert ax.get_title() == "Loss"
    assert ax.get_xlabel() == "samples seen"
    assert ax.get_ylabel() == "loss (nats)"
    assert _legend_texts(ax) == ["batch 64", "4 x 16", "batch 16"]
    lines = ax.get_lines()
    colours = [mcolors.to_hex(line.get_color()) for line in lines]
    assert set(colours) <= PALETTE
    assert len(set(colours)) == 3  # distinguishable
    assert len({line.get_linestyle() for line in lines}) == 3
    np.testing.assert_array_equal(lines[1].get_xdata(), [0, 64, 128])


def test_curves_accepts_per_series_x_and_log_axes():
    ax = plotting.curves(None, {"a": ([1, 2], [3, 4]), "b": ([1, 5, 9], [1, 1, 1])},
                         title="t", xlabel="x (s)", ylabel="y (1)", logx=True, logy=True)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert list(ax.get_lines()[1].get_xdata()) == [1, 5, 9]


@pytest.mark.parametrize("missing", ["title", "xlabel", "ylabel"])
def test_curves_requires_texts(missing):
    kwargs = dict(title="t", xlabel="x", ylabel="y")
    kwargs[missing] = ""
    with pytest.raises(ValueError, match=missing):
        plotting.curves(None, {"a": [1, 2]}, **kwargs)


def test_curves_rejects_mismatched_shapes_and_empty():
    with pytest.raises(ValueError, match="shape"):
        plotting.curves(None, {"a": [1, 2, 3]}, x=[0, 1], title="t", xlabel="x", ylabel="y")
    with pytest.raises(ValueError, match="empty"):
        plotting.curves(None, {}, title="t", xlabel="x", ylabel="y")


def test_curves_draws_on_given_axes():
    _, ax = plt.subplots()
    assert plotting.curves(ax, {"a": [1, 2]}, title="t", xlabel="x", ylabel="y") is ax


def test_heatmap_texts_colorbar_annotations_and_highlight():
    values = np.array([[0.1, 0.9], [np.nan, 0.5], [0.3, 0.2]])
    ax = plotting.heatmap(None, values, row_labels=["1e-3", "1e-2", "1e-1"],
                          col_labels=[16, 64], title="Accuracy", xlabel="batch (samples)",
                          ylabel="learning rate", colorbar_label="validation accuracy (fraction)",
                          highlight=[(2, 0), (0, 1)])
    assert ax.get_title() == "Accuracy"
    assert ax.get_xlabel() == "batch (samples)"
    assert ax.get_ylabel() == "learning rate"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["16", "64"]
    texts = sorted(t.get_text() for t in ax.texts)
    assert texts == sorted(["0.100", "0.900", "n/a", "0.500", "0.300", "0.200"])
    colorbar_axes = [a for a in ax.figure.axes if a is not ax]
    assert colorbar_axes and colorbar_axes[0].get_ylabel() == "validation accuracy (fraction)"
    assert ax.images[0].get_cmap().name == plotting.HEATMAP_CMAP
    assert _legend_texts(ax) == ["best per column"]
    outlines = [p for p in ax.patches if mcolors.to_hex(p.get_edgecolor()) in PALETTE]
    assert len(outlines) == 2


def test_heatmap_scale_from_vmin_separates_the_top_and_inks_by_that_scale():
    values = np.array([[10.0, 93.0], [96.0, 97.5]])  # one poor cell, three good ones
    ax = plotting.heatmap(None, values, row_labels=["a", "b"], col_labels=[1, 2], title="t",
                          xlabel="x", ylabel="y", colorbar_label="accuracy (%)", fmt="{:.1f}",
                          vmin=92.5, vmax=97.5)
    image = ax.images[0]
    assert image.get_clim() == (92.5, 97.5)
    colours = image.to_rgba(values)
    assert not np.allclose(colours[0, 1], colours[1, 0])  # 93 and 96 get different colours
    assert np.allclose(colours[0, 0], image.to_rgba(92.5))  # below vmin: the end colour
    ink = {t.get_text(): t.get_color() for t in ax.texts}
    # Middle of the colour scale (95), not of the data (53.75): 93 is on the dark side.
    assert ink["93.0"] == "white" and ink["96.0"] == "black" and ink["10.0"] == "white"


def test_heatmap_rejects_wrong_shape_and_missing_colorbar_label():
    with pytest.raises(ValueError, match="shape"):
        plotting.heatmap(None, np.zeros((2, 2)), row_labels=[1], col_labels=[1, 2], title="t",
                         xlabel="x", ylabel="y", colorbar_label="c")
    with pytest.raises(ValueError, match="colorbar_label"):
        plotting.heatmap(None, np.zeros((1, 1)), row_labels=[1], col_labels=[1], title="t",
                         xlabel="x", ylabel="y", colorbar_label=" ")


def test_bars_groups_series_colours_log_and_reference_line():
    ax = plotting.bars(None, {"not rescaled": {"broken": 3.0, "accumcore": 2e-6},
                              "ragged 1/K": {"broken": 0.1, "accumcore": 1e-6}},
                       title="Error", xlabel="pitfall", ylabel="relative error (1)", logy=True,
                       reference_line=1e-4, reference_label="tolerance")
    assert ax.get_title() == "Error" and ax.get_ylabel() == "relative error (1)"
    assert ax.get_xlabel() == "pitfall"
    assert ax.get_yscale() == "log"
    assert sorted(_legend_texts(ax)) == ["accumcore", "broken", "tolerance"]
    rects = ax.patches
    assert len(rects) == 4
    assert {mcolors.to_hex(r.get_facecolor()) for r in rects} == {
        mcolors.to_hex(plotting.OKABE_ITO[0]), mcolors.to_hex(plotting.OKABE_ITO[1])}
    heights = sorted(r.get_height() for r in rects)
    assert heights == pytest.approx([1e-6, 2e-6, 0.1, 3.0])


def test_horizontal_bars_put_values_on_x():
    groups = {"a long pitfall name": {"broken": 0.5, "accumcore": 1e-6},
              "another": {"broken": 2.0}}
    ax = plotting.bars(None, groups, title="Error", xlabel="relative error (log scale)",
                       ylabel="pitfall", logy=True, reference_line=1e-4,
                       reference_label="tolerance", horizontal=True)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "linear"
    assert [t.get_text() for t in ax.get_yticklabels()] == list(groups)
    assert sorted(_legend_texts(ax)) == ["accumcore", "broken", "tolerance"]
    widths = sorted(r.get_width() for r in ax.patches if np.isfinite(r.get_width()))
    assert widths == pytest.approx([1e-6, 0.5, 2.0])
    assert ax.get_xlabel() == "relative error (log scale)" and ax.get_ylabel() == "pitfall"


def test_bars_legend_outside_the_axes_and_none_for_a_single_series():
    ax = plotting.bars(None, {"a": {"s": 1.0, "t": 2.0}, "b": {"s": 3.0, "t": 4.0}},
                       title="t", xlabel="x", ylabel="y")
    ax.figure.canvas.draw()
    legend_box = ax.get_legend().get_window_extent()
    axes_box = ax.get_window_extent()
    assert legend_box.x0 >= axes_box.x1  # to the right of the plot: covers no bar
    single = plotting.bars(None, {"a": {"seconds": 1.0}, "b": {"seconds": 2.0}},
                           title="t", xlabel="run", ylabel="seconds per epoch")
    assert single.get_legend() is None


def test_curves_over_whole_numbers_get_whole_ticks():
    epochs = np.arange(1, 4)  # 3 epochs: matplotlib's default ticks would be 1.0, 1.25, ...
    ax = plotting.curves(None, {"loss": (epochs, [1.0, 0.5, 0.2])}, title="t", xlabel="epoch",
                         ylabel="y")
    ax.figure.canvas.draw()
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)
    ax = plotting.curves(None, {"loss": ([0.5, 1.5, 2.25], [1.0, 0.5, 0.2])}, title="t",
                         xlabel="x", ylabel="y")
    ax.figure.canvas.draw()
    assert not all(float(t).is_integer() for t in ax.get_xticks())


def test_curves_style_start_draws_each_series_in_a_later_series_style():
    """Chapter 4's distance figure: |64 - 4 x 16| in the accumulated run's style (the second
    of the earlier figures), |64 - 16| in batch 16's (the third)."""
    runs = plotting.curves(None, {"batch 64": [1, 2], "4 x 16": [1, 2], "batch 16": [2, 3]},
                           title="t", xlabel="x", ylabel="y")
    gaps = plotting.curves(None, {"|64 - 4 x 16|": [1e-6, 2e-6], "|64 - 16|": [0.1, 0.2]},
                           title="t", xlabel="x", ylabel="y", style_start=1)
    style = [(line.get_color(), line.get_linestyle(), line.get_marker())
             for line in runs.get_lines()]
    assert [(line.get_color(), line.get_linestyle(), line.get_marker())
            for line in gaps.get_lines()] == style[1:]
    assert style[0] != style[1]  # the default start is the first style


def test_gap_points_put_one_point_per_row_on_a_log_axis_with_a_marker_per_kind():
    gaps = {"BatchNorm": (0.3, "weights"), "moving mean": (2e-2, "statistics"),
            "Embedding": (1e-3, "weights")}
    ax = plotting.gap_points(None, gaps, title="Gaps", xlabel="gap (log scale)",
                             reference_line=1e-5, reference_label="tolerance")
    assert ax.get_xscale() == "log" and ax.get_title() == "Gaps"
    assert [t.get_text() for t in ax.get_yticklabels()] == list(gaps)
    assert sorted(_legend_texts(ax)) == ["statistics", "tolerance", "weights"]
    points = {tuple(p) for c in ax.collections for p in c.get_offsets()}
    assert points == {(0.3, 0), (2e-2, 1), (1e-3, 2)}  # each value on its own row
    colours = [mcolors.to_hex(c.get_facecolor()[0]) for c in ax.collections]
    assert colours == [mcolors.to_hex(plotting.OKABE_ITO[0]),
                       mcolors.to_hex(plotting.OKABE_ITO[1])]
    assert [t.get_text() for t in ax.texts] == ["0.3", "0.02", "0.001"]
    assert ax.get_xlim()[0] == pytest.approx(1e-5 / 3)  # the reference line is in view
    with pytest.raises(ValueError, match="positive"):
        plotting.gap_points(None, {"zero": (0.0, "weights")}, title="t", xlabel="x")
    with pytest.raises(ValueError, match="title"):
        plotting.gap_points(None, gaps, title="", xlabel="x")
