"""What :class:`~seqnorm.callbacks.HiddenStateStats` shows besides plain scalars: images of per-step profiles (line
plots for one layer, heatmaps for several), and the custom-scalars layout a run opens with in TensorBoard's "Custom
Scalars" tab.

The images are drawn with numpy and Pillow, not matplotlib figures: those took about a second each, these take
milliseconds, which keeps the callback cheap (docs/performance.md).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
from torch import Tensor

__all__ = ["MAX_CHART_CELLS", "custom_scalars_layout", "layer_of", "render_lines", "render_profiles"]

LOG_SCALE_STATISTICS = frozenset({"h_norm"})  # gradient norms span decades through time: drawn as log10
WIDTH = 760
TEXT_HEIGHT = 12  # Pillow's default font: a line of text with its descenders
BAR_LABEL_GAP = 6  # at least this between a colour bar's top and bottom labels


def layer_of(cell: str) -> str:
    """The layer a cell name belongs to: its two directions (``l0``, ``l0_reverse``) share one."""
    return cell.removesuffix("_reverse")


def _matrix(rows: dict[str, Tensor], name: str) -> tuple[np.ndarray, str]:
    """``(cells, T)`` values (shorter profiles padded with NaN) and the panel's label; log10 where the statistic is
    drawn on a log scale (non-positive values become NaN)."""
    steps = max(len(profile) for profile in rows.values())
    matrix = np.full((len(rows), steps), np.nan)
    for index, profile in enumerate(rows.values()):
        matrix[index, : len(profile)] = profile.double().cpu().numpy()
    if name not in LOG_SCALE_STATISTICS:
        return matrix, name
    with np.errstate(divide="ignore", invalid="ignore"):
        matrix = np.where(matrix > 0, np.log10(np.where(matrix > 0, matrix, 1.0)), np.nan)
    return matrix, f"log10 {name}"


def _range(matrix: np.ndarray) -> tuple[float, float]:
    finite = np.isfinite(matrix)
    if not finite.any():
        return 0.0, 1.0
    return float(matrix[finite].min()), float(matrix[finite].max())


def _time_axis(draw: Any, font: Any, left: int, width: int, axis: int, steps: int) -> None:
    """Ticks at up to 8 time steps under ``axis`` (step ``t`` centred in its ``width / steps`` column)."""
    for tick in sorted({round(t) for t in np.linspace(0, steps - 1, min(steps, 8))}):
        x = left + int((tick + 0.5) * width / steps)
        draw.line([(x, axis), (x, axis + 3)], fill="black")
        draw.text((x - 3, axis + 3), str(tick), fill="black", font=font)
    draw.text((left + width - 50, axis + 15), "time step", fill="black", font=font)


def render_profiles(title: str, panels: dict[str, dict[str, Tensor]]) -> np.ndarray:
    """One image with a heatmap per statistic: rows are cells (layer and direction), columns are time steps.

    Each panel has its cell names on the y axis, time steps on the x axis and a colour bar with its value range. Rows
    are stretched so that the colour bar is tall enough for its two labels (one row, 14 pixels, had them overlap).

    Args:
        title: the image title.
        panels: ``statistic -> {cell name -> (T,) profile}``; cells without the statistic are simply absent and
            profiles may differ in length (shorter ones are padded with NaN, drawn grey).

    Returns:
        An ``(H, W, 3)`` uint8 RGB image.
    """
    from matplotlib import colormaps
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    palette = (colormaps["viridis"](np.linspace(0.0, 1.0, 256))[:, :3] * 255).astype(np.uint8)
    label_width = 12 + max(int(font.getlength(name)) for rows in panels.values() for name in rows)
    bar_width, least_row_height = 70, 14
    map_width = WIDTH - label_width - bar_width - 10
    least_map_height = 2 * TEXT_HEIGHT + BAR_LABEL_GAP
    row_heights = [max(least_row_height, math.ceil(least_map_height / len(rows))) for rows in panels.values()]
    heights = [16 + row_height * len(rows) + 30 for rows, row_height in zip(panels.values(), row_heights, strict=True)]
    canvas = Image.new("RGB", (WIDTH, 22 + sum(heights)), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((6, 4), title, fill="black", font=font)
    top = 22
    for (name, rows), height, row_height in zip(panels.items(), heights, row_heights, strict=True):
        matrix, label = _matrix(rows, name)
        steps = matrix.shape[1]
        low, high = _range(matrix)
        finite = np.isfinite(matrix)
        scaled = (matrix - low) / (high - low) if high > low else np.full_like(matrix, 0.5)
        pixels = palette[(np.nan_to_num(scaled, nan=0.0).clip(0, 1) * 255).astype(int)]
        pixels[~finite] = 208  # grey: steps no sequence reached, statistics a cell does not have
        columns = np.minimum(np.arange(map_width) * steps // map_width, steps - 1)
        heatmap = pixels[:, columns].repeat(row_height, axis=0)
        draw.text((label_width, top), label, fill="black", font=font)
        map_top = top + 16
        canvas.paste(Image.fromarray(heatmap), (label_width, map_top))
        for index, cell in enumerate(rows):
            draw.text((6, map_top + (index + 0.5) * row_height - TEXT_HEIGHT / 2), cell, fill="black", font=font)
        axis = map_top + len(rows) * row_height
        _time_axis(draw, font, label_width, map_width, axis, steps)
        bar_left = label_width + map_width + 6
        gradient = palette[np.linspace(255, 0, axis - map_top).astype(int)][:, None].repeat(10, axis=1)
        canvas.paste(Image.fromarray(np.ascontiguousarray(gradient)), (bar_left, map_top))
        draw.text((bar_left + 13, map_top - 2), f"{high:.3g}", fill="black", font=font)
        draw.text((bar_left + 13, axis - TEXT_HEIGHT), f"{low:.3g}", fill="black", font=font)
        top += height
    return np.asarray(canvas)


def render_lines(title: str, panels: dict[str, dict[str, Tensor]]) -> np.ndarray:
    """One image with a line plot per statistic: value against time step, a line per cell (a layer's directions).

    What a one-layer model's profiles read best as: a heatmap of one or two rows shows the values only as colours.
    Each panel has the value range on its y axis (log10 for gradient norms), the time steps on its x axis and a
    legend of its cells; a step that no sequence reached (NaN) breaks the line.

    Args and returns as :func:`render_profiles`.
    """
    from matplotlib import colormaps
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    colours = [tuple(int(255 * c) for c in colour[:3]) for colour in colormaps["tab10"].colors]
    axis_width, plot_height, panel_height = 56, 70, 16 + 70 + 32
    plot_width = WIDTH - axis_width - 16
    canvas = Image.new("RGB", (WIDTH, 22 + panel_height * len(panels)), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((6, 4), title, fill="black", font=font)
    top = 22
    for name, rows in panels.items():
        matrix, label = _matrix(rows, name)
        steps = matrix.shape[1]
        low, high = _range(matrix)
        if high <= low:  # a flat profile: drawn across the middle
            low, high = low - 0.5, high + 0.5
        draw.text((axis_width, top), label, fill="black", font=font)
        legend = WIDTH - 10
        for index, cell in reversed(list(enumerate(rows))):
            legend -= int(font.getlength(cell)) + 22
            draw.line([(legend, top + 7), (legend + 14, top + 7)], fill=colours[index % len(colours)], width=2)
            draw.text((legend + 17, top), cell, fill="black", font=font)
        plot_top = top + 16
        axis = plot_top + plot_height
        for fraction, value in ((0.0, high), (0.5, (low + high) / 2), (1.0, low)):
            y = plot_top + round(fraction * plot_height)
            draw.line([(axis_width, y), (axis_width + plot_width, y)], fill=(225, 225, 225))
            text = f"{value:.3g}"
            draw.text((axis_width - 4 - font.getlength(text), y - TEXT_HEIGHT / 2), text, fill="black", font=font)
        draw.line([(axis_width, plot_top), (axis_width, axis), (axis_width + plot_width, axis)], fill="black")
        xs = axis_width + (np.arange(steps) + 0.5) * plot_width / steps
        for index, values in enumerate(matrix):
            ys = plot_top + (high - values) / (high - low) * plot_height
            colour = colours[index % len(colours)]
            for t in range(steps):
                if not np.isfinite(ys[t]):
                    continue
                if t + 1 < steps and np.isfinite(ys[t + 1]):
                    draw.line([(xs[t], ys[t]), (xs[t + 1], ys[t + 1])], fill=colour, width=2)
                if steps <= 60 or not (t > 0 and np.isfinite(ys[t - 1])):  # dots where steps are few, or alone
                    draw.ellipse([(xs[t] - 2, ys[t] - 2), (xs[t] + 2, ys[t] + 2)], fill=colour)
        _time_axis(draw, font, axis_width, plot_width, axis, steps)
        top += panel_height
    return np.asarray(canvas)


MAX_CHART_CELLS = 4
"""Cells (layers and directions) one custom-scalars chart overlays, for one statistic: a chart holds at most this many
lines per run, so two runs side by side (LN against BN) still read at 8 lines."""

SOURCES = ("ih", "hh", "gates", "c")
CHARTS: dict[str, list[tuple[str, str]]] = {
    # category -> [(chart title, statistic)]: one statistic per chart, the lines are cells
    "seqnorm: hidden state": [
        ("h std (train)", "h_std"),
        ("h std (fixed val batch)", "val_h_std"),
        ("h mean (train)", "h_mean"),
        ("near-zero h fraction (train)", "h_zero_frac"),
        ("c std (train)", "c_std"),
    ],
    "seqnorm: gates": [(f"{gate} saturation (train)", f"{gate}_sat") for gate in ("i", "f", "g", "o", "r", "z", "n")],
    "seqnorm: gradient through time": [
        ("||dL/dh_t|| last / first step", "last_over_first"),
        ("||dL/dh_t|| mean over steps", "h_norm"),
        ("||dL/dh_t|| first step", "h_norm_first"),
        ("||dL/dh_t|| last step", "h_norm_last"),
    ],
    "seqnorm: normalization": [
        *[(f"{source} post-norm std (train)", f"{source}_post_std") for source in SOURCES],
        *[(f"{source} post-norm mean (train)", f"{source}_post_mean") for source in SOURCES],
        *[(f"{source} pre-norm std (train)", f"{source}_pre_std") for source in ("ih", "hh")],
        ("train/eval gap on the fixed val batch", "val_train_eval_gap"),
        *[(f"{source} running variance (mean over steps)", f"{source}_running_var") for source in SOURCES],
        *[(f"{source} running mean (mean over steps)", f"{source}_running_mean") for source in SOURCES],
        ("fewest real rows at a step", "active_rows_min"),
    ],
}


def _chunks(names: list[str]) -> list[list[str]]:
    """``names`` cut into runs of at most :data:`MAX_CHART_CELLS`, a layer's two directions never apart."""
    layers: dict[str, list[str]] = {}
    for name in names:
        layers.setdefault(layer_of(name), []).append(name)
    chunks: list[list[str]] = []
    for directions in layers.values():
        if chunks and len(chunks[-1]) + len(directions) <= MAX_CHART_CELLS:
            chunks[-1].extend(directions)
        else:
            chunks.append(list(directions))
    return chunks


def custom_scalars_layout(cells: dict[str, set[tuple[str, str]]]) -> dict[str, dict[str, list]]:
    """The charts worth opening first, as ``{category: {chart: ["Multiline", [tag regexes]]}}``.

    Args:
        cells: cell name (``l0``, ``l0_reverse``, ``encoder.rnn/l1``) -> the ``(group, statistic)`` it logs
            (:func:`~seqnorm.callbacks.observe.logged_statistics`), layer-major.

    Each chart is one statistic, its lines the cells that log it, at most :data:`MAX_CHART_CELLS` of them: with
    more, the layers are split over charts titled with their first and last layer (``h std (train): l0-l1``; a layer's
    two directions stay in one chart).
    TensorBoard draws every selected run's matching tags in a chart, so a chart of ``k`` cells has ``k`` lines per
    run; the Time Series tab shows the same tags one per chart, a line per run. A chart no cell logs is left out.
    Training and validation-batch values are separate charts because they come from different batches.
    """
    layout: dict[str, dict[str, list]] = {}
    for category, charts in CHARTS.items():
        for title, statistic in charts:
            logging = [name for name, logged in cells.items() if any(stat == statistic for _, stat in logged)]
            chunks = _chunks(logging)
            for chunk in chunks:
                group = next(group for group, stat in cells[chunk[0]] if stat == statistic)
                names = "|".join(re.escape(name) for name in chunk)
                first, last = layer_of(chunk[0]), layer_of(chunk[-1])
                chart = title if len(chunks) == 1 else f"{title}: {first}" + (f"-{last}" if last != first else "")
                layout.setdefault(category, {})[chart] = ["Multiline", [rf"^{group}/({names})/{statistic}$"]]
    layout["seqnorm: task"] = {"loss": ["Multiline", [r"^(train|val)/loss$"]]}
    return layout
