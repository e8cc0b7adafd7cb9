"""Small, consistent plots for the book: every figure gets a title, labelled axes and a legend.

Colours come from the Okabe-Ito palette (Okabe & Ito, 2008), which stays distinguishable for
the common forms of colour blindness; heatmaps use matplotlib's ``cividis`` colour map, which is
designed for the same purpose. Lines also differ by line style and marker, so overlapping curves
(the point of several figures) stay visible in grey-scale print.

Each function takes an existing ``matplotlib.axes.Axes`` or ``None`` (a new figure is created)
and returns the ``Axes`` it drew on. Requires matplotlib (``pip install accumcore[plot]``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.ticker import MaxNLocator

#: Okabe-Ito colours, ordered for contrast on white (blue, vermillion, bluish green, orange,
#: sky blue, reddish purple, black, yellow).
OKABE_ITO: tuple[str, ...] = (
    "#0072B2",
    "#D55E00",
    "#009E73",
    "#E69F00",
    "#56B4E9",
    "#CC79A7",
    "#000000",
    "#F0E442",
)

#: Colour map for heatmaps (perceptually uniform and colour-blind safe).
HEATMAP_CMAP = "cividis"

_LINESTYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def color(i: int) -> str:
    """The ``i``-th Okabe-Ito colour (cycling)."""
    return OKABE_ITO[i % len(OKABE_ITO)]


def _axes(ax: Axes | None, figsize: tuple[float, float] = (6.4, 4.0)) -> Axes:
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def _require_text(**texts: str) -> None:
    for name, text in texts.items():
        if not isinstance(text, str) or not text.strip():
            raise ValueError(
                f"`{name}` must be a non-empty string: every figure in the book has a title and "
                f"labelled axes (with units), got {text!r}."
            )


def _label(ax: Axes, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def curves(
    ax: Axes | None,
    series: Mapping[str, Any],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    x: Sequence[float] | np.ndarray | None = None,
    logx: bool = False,
    logy: bool = False,
    markers: bool = True,
    legend_loc: str = "best",
    style_start: int = 0,
) -> Axes:
    """Overlay several curves, one colour, line style and marker per series.

    Args:
        ax: the axes to draw on, or ``None`` for a new figure.
        series: ``{label: y}`` (``y`` shape ``(n,)``, plotted against ``x``) or
            ``{label: (x_i, y_i)}`` (each series with its own x values).
        title: the axes' title (required).
        xlabel: the x-axis label, with its unit (required).
        ylabel: the y-axis label, with its unit (required).
        x: the shared x values (shape ``(n,)``) for series given as ``y`` only; defaults to
            ``0 .. n-1``.
        logx: logarithmic x axis.
        logy: logarithmic y axis.
        markers: draw a marker at every point (off for long curves).
        legend_loc: passed to ``ax.legend``.
        style_start: the style (colour, line style, marker) of the first series; series ``i``
            takes style ``style_start + i``, so that a figure of differences to the first run
            of an earlier figure draws each difference in the style of the run it measures.

    Returns:
        The axes. Series are drawn in order, so a later dashed series stays visible on top of
        an earlier solid one that it coincides with.
    """
    _require_text(title=title, xlabel=xlabel, ylabel=ylabel)
    if not series:
        raise ValueError("`series` is empty: pass at least one {label: values} entry.")
    ax = _axes(ax)
    whole_x = True  # every x a whole number (epochs, steps): integer ticks only
    for i, (label, values) in enumerate(series.items(), start=style_start):
        xs, ys = _series_xy(label, values, x)
        whole_x = whole_x and bool(np.all(xs == np.round(xs)))
        ax.plot(
            xs, ys, label=str(label), color=color(i), linestyle=_LINESTYLES[i % 4],
            marker=_MARKERS[i % len(_MARKERS)] if markers else None, markersize=4,
            linewidth=1.8 if i == style_start else 1.4,
        )
    if logx:
        ax.set_xscale("log")
    elif whole_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if logy:
        ax.set_yscale("log")
    _label(ax, title, xlabel, ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(loc=legend_loc)
    return ax


def _series_xy(label: Any, values: Any, x: Sequence[float] | np.ndarray | None
               ) -> tuple[np.ndarray, np.ndarray]:
    """One series of :func:`curves` as float arrays ``(xs, ys)`` of the same shape ``(n,)``:
    ``values`` is ``(x_i, y_i)`` or ``y`` alone (then against ``x``, or ``0 .. n-1`` when ``x``
    is ``None``). Raises ``ValueError`` naming ``label`` when the shapes differ."""
    if isinstance(values, tuple) and len(values) == 2:
        xs, ys = np.asarray(values[0], float), np.asarray(values[1], float)
    else:
        ys = np.asarray(values, float)
        xs = np.arange(len(ys), dtype=float) if x is None else np.asarray(x, float)
    if xs.shape != ys.shape:
        raise ValueError(
            f"Series {label!r}: x has shape {xs.shape} but y has shape {ys.shape}; they must "
            "match (pass `x=` or give the series as (x, y))."
        )
    return xs, ys


def heatmap(
    ax: Axes | None,
    values: np.ndarray,
    *,
    row_labels: Sequence[Any],
    col_labels: Sequence[Any],
    title: str,
    xlabel: str,
    ylabel: str,
    colorbar_label: str,
    fmt: str = "{:.3f}",
    highlight: Sequence[tuple[int, int]] = (),
    highlight_label: str = "best per column",
    vmin: float | None = None,
    vmax: float | None = None,
) -> Axes:
    """A 2-D grid of numbers as colours, each cell annotated with its value.

    Args:
        ax: the axes to draw on, or ``None`` for a new figure.
        values: shape ``(len(row_labels), len(col_labels))``; NaN cells are drawn empty and
            annotated "n/a" (e.g. a diverged run).
        row_labels, col_labels: tick labels (rows run along y, columns along x).
        title, xlabel, ylabel: required texts; put units in the axis labels.
        colorbar_label: what the colour means, with units (the colour bar is the key).
        fmt: format of the cell annotations.
        highlight: ``(row, col)`` cells to outline (e.g. the best learning rate per batch size);
            they get a legend entry named ``highlight_label``.
        vmin, vmax: colour limits (default: data range); values outside are drawn in the
            end colours (so a scale that starts at the useful range separates the good cells).

    Returns:
        The axes.
    """
    _require_text(title=title, xlabel=xlabel, ylabel=ylabel, colorbar_label=colorbar_label)
    values = np.asarray(values, float)
    if values.shape != (len(row_labels), len(col_labels)):
        raise ValueError(
            f"`values` has shape {values.shape}, but row_labels x col_labels is "
            f"({len(row_labels)}, {len(col_labels)}): one value per cell."
        )
    ax = _axes(ax, figsize=(max(6.4, 2.5 + 0.9 * len(col_labels)),
                            max(4.4, 2.0 + 0.5 * len(row_labels))))
    image = ax.imshow(np.ma.masked_invalid(values), cmap=HEATMAP_CMAP, aspect="auto",
                      origin="lower", vmin=vmin, vmax=vmax)
    colorbar = ax.figure.colorbar(image, ax=ax)
    colorbar.set_label(colorbar_label)
    ax.set_xticks(range(len(col_labels)), [str(c) for c in col_labels])
    ax.set_yticks(range(len(row_labels)), [str(r) for r in row_labels])
    finite = values[np.isfinite(values)]
    low = vmin if vmin is not None else (float(np.min(finite)) if finite.size else 0.0)
    high = vmax if vmax is not None else (float(np.max(finite)) if finite.size else 0.0)
    middle = (low + high) / 2  # of the colour scale: values below vmin are drawn darkest
    for r in range(values.shape[0]):
        for c in range(values.shape[1]):
            v = values[r, c]
            text = "n/a" if not np.isfinite(v) else fmt.format(v)
            # cividis is dark at the low end: white text there, black text on the light end.
            ink = "black" if np.isfinite(v) and v > middle else "white"
            if not np.isfinite(v):
                ink = "black"
            ax.text(c, r, text, ha="center", va="center", color=ink, fontsize=8)
    for k, (r, c) in enumerate(highlight):
        ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor=color(1),
                                   linewidth=2.5, label=highlight_label if k == 0 else None))
    _label(ax, title, xlabel, ylabel)
    if highlight:  # below the x-axis label, outside the grid
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
        ax.figure.tight_layout()
    return ax


def bars(
    ax: Axes | None,
    groups: Mapping[str, Mapping[str, float]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logy: bool = False,
    reference_line: float | None = None,
    reference_label: str = "reference",
    rotate: int = 20,
    horizontal: bool = False,
) -> Axes:
    """Grouped bars: ``{group: {series: value}}``, one colour per series (hatched for contrast).

    Args:
        ax: the axes to draw on, or ``None`` for a new figure.
        groups: e.g. ``{"loss not rescaled": {"broken": 3.0, "accumcore": 2e-6}, ...}``; every
            group has the same series names (a missing one is drawn as no bar).
        title: the axes' title (required).
        xlabel: the x-axis label, with its unit (required); with ``horizontal=True`` the
            values run along x, so it names the values.
        ylabel: the y-axis label, with its unit (required).
        logy: logarithmic *value* axis (for errors spanning many decades); x when horizontal.
        reference_line: draw a dashed line at this value (e.g. a tolerance).
        reference_label: its legend entry. The legend sits outside the axes, to the right
            (inside it could cover a bar); a single series without a reference line gets
            none (the value axis's label names it).
        rotate: rotation of the group labels, degrees (vertical bars only).
        horizontal: horizontal bars, one row per group (for many or long group names).

    Returns:
        The axes.
    """
    _require_text(title=title, xlabel=xlabel, ylabel=ylabel)
    if not groups:
        raise ValueError("`groups` is empty: pass at least one {group: {series: value}} entry.")
    names = list(dict.fromkeys(s for g in groups.values() for s in g))
    if horizontal:
        ax = _axes(ax, figsize=(8.0, max(3.0, 0.32 * len(groups) * len(names) + 1.5)))
    else:
        ax = _axes(ax, figsize=(min(14.0, max(6.4, 0.55 * len(groups) + 2)), 4.5))
    width = 0.8 / len(names)
    positions = np.arange(len(groups))
    hatches = ("", "//", "..", "xx", "\\\\", "oo")
    for i, name in enumerate(names):
        heights = [groups[g].get(name, np.nan) for g in groups]
        offset = (i - (len(names) - 1) / 2) * width
        style = dict(label=name, color=color(i), hatch=hatches[i % len(hatches)],
                     edgecolor="white")
        if horizontal:
            ax.barh(positions + offset, heights, width, **style)
        else:
            ax.bar(positions + offset, heights, width, **style)
    line = dict(color="black", linestyle="--", linewidth=1, label=reference_label)
    if horizontal:
        if reference_line is not None:
            ax.axvline(reference_line, **line)
        ax.set_yticks(positions, list(groups))
        ax.invert_yaxis()  # first group on top
        if logy:
            ax.set_xscale("log")
        ax.grid(True, axis="x", alpha=0.3)
    else:
        if reference_line is not None:
            ax.axhline(reference_line, **line)
        ax.set_xticks(positions, list(groups), rotation=rotate,
                      ha="right" if rotate else "center")
        if logy:
            ax.set_yscale("log")
        ax.grid(True, axis="y", alpha=0.3)
    _label(ax, title, xlabel, ylabel)
    if len(names) > 1 or reference_line is not None:
        # Outside the axes, to the right: a legend inside can cover a bar.
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return ax


def gap_points(
    ax: Axes | None,
    gaps: Mapping[str, tuple[float, str]],
    *,
    title: str,
    xlabel: str,
    reference_line: float | None = None,
    reference_label: str = "reference",
) -> Axes:
    """Positive values on a log x axis as points, one row per entry (on a log axis a bar's
    length would mean nothing), each annotated with its value to two significant digits.

    Args:
        ax: the axes to draw on, or ``None`` for a new figure.
        gaps: ``{row label: (value, kind)}``, the first row on top; one marker and colour
            per kind, in the order kinds first appear, named in the legend (below the axes).
        title, xlabel: required texts; put the values' unit in ``xlabel``.
        reference_line: draw a dashed vertical line at this value (e.g. a tolerance).
        reference_label: its legend entry.

    Returns:
        The axes.

    Raises:
        ValueError: for empty ``gaps``, a value that is not positive, or a missing text.
    """
    _require_text(title=title, xlabel=xlabel)
    values = [float(value) for value, _ in gaps.values()]
    if not values or min(values) <= 0:
        raise ValueError(f"`gaps` needs at least one entry and positive values, got {values}.")
    ax = _axes(ax, figsize=(8.0, max(3.0, 0.25 * len(gaps) + 1.7)))
    rows = np.arange(len(gaps))
    kinds = list(dict.fromkeys(kind for _, kind in gaps.values()))
    markers = ("o", "s", "^", "D", "v")
    for i, kind in enumerate(kinds):
        mine = [r for r, (_, k) in zip(rows, gaps.values()) if k == kind]
        ax.scatter([values[r] for r in mine], mine, marker=markers[i % len(markers)],
                   color=color(i), label=kind, zorder=3)
    for r, value in zip(rows, values):
        ax.annotate(f"{value:.2g}", (value, r), xytext=(7, 0), textcoords="offset points",
                    va="center")
    if reference_line is not None:
        ax.axvline(reference_line, color="black", linestyle="--", linewidth=1,
                   label=reference_label)
    ax.set_xscale("log")
    low = min(values + ([reference_line] if reference_line is not None else []))
    ax.set_xlim(low / 3, 10 * max(values))
    ax.set_yticks(rows, list(gaps))
    ax.invert_yaxis()  # first row on top
    ax.grid(True, axis="x", alpha=0.3)
    ax.set(title=title, xlabel=xlabel)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize="small")
    return ax
