"""What :class:`~seqnorm.callbacks.HiddenStateStats` shows besides plain scalars: heatmap images of per-step
profiles, and the custom-scalars layout a run opens with in TensorBoard's "Custom Scalars" tab."""

from __future__ import annotations

import numpy as np
from torch import Tensor

__all__ = ["custom_scalars_layout", "render_profiles"]

LOG_SCALE_STATISTICS = frozenset({"h_norm"})  # gradient norms span decades through time: colour by log10


def render_profiles(title: str, panels: dict[str, dict[str, Tensor]]) -> np.ndarray:
    """One image with a heatmap per statistic: rows are cells (layer and direction), columns are time steps.

    Each panel has its cell names on the y axis, time steps on the x axis and a colour bar with its value range.
    Drawn with numpy and Pillow, not matplotlib figures: a figure costs seconds on a busy CPU, this costs
    milliseconds, which is what keeps the callback cheap.

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
    width, bar_width, row_height = 760, 70, 14
    map_width = width - label_width - bar_width - 10
    heights = [16 + row_height * len(rows) + 30 for rows in panels.values()]
    canvas = Image.new("RGB", (width, 22 + sum(heights)), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((6, 4), title, fill="black", font=font)
    top = 22
    for (name, rows), height in zip(panels.items(), heights, strict=True):
        steps = max(len(profile) for profile in rows.values())
        matrix = np.full((len(rows), steps), np.nan)
        for index, profile in enumerate(rows.values()):
            matrix[index, : len(profile)] = profile.double().cpu().numpy()
        label = name
        if name in LOG_SCALE_STATISTICS:
            with np.errstate(divide="ignore", invalid="ignore"):
                matrix = np.where(matrix > 0, np.log10(np.where(matrix > 0, matrix, 1.0)), np.nan)
            label = f"log10 {name}"
        finite = np.isfinite(matrix)
        low = float(matrix[finite].min()) if finite.any() else 0.0
        high = float(matrix[finite].max()) if finite.any() else 1.0
        scaled = (matrix - low) / (high - low) if high > low else np.full_like(matrix, 0.5)
        pixels = palette[(np.nan_to_num(scaled, nan=0.0).clip(0, 1) * 255).astype(int)]
        pixels[~finite] = 208  # grey: steps no sequence reached, statistics a cell does not have
        columns = np.minimum(np.arange(map_width) * steps // map_width, steps - 1)
        heatmap = pixels[:, columns].repeat(row_height, axis=0)
        draw.text((label_width, top), label, fill="black", font=font)
        map_top = top + 16
        canvas.paste(Image.fromarray(heatmap), (label_width, map_top))
        for index, cell in enumerate(rows):
            draw.text((6, map_top + index * row_height + 1), cell, fill="black", font=font)
        axis = map_top + len(rows) * row_height
        for tick in sorted({round(t) for t in np.linspace(0, steps - 1, min(steps, 8))}):
            x = label_width + int((tick + 0.5) * map_width / steps)
            draw.line([(x, axis), (x, axis + 3)], fill="black")
            draw.text((x - 3, axis + 3), str(tick), fill="black", font=font)
        draw.text((label_width + map_width - 50, axis + 15), "time step", fill="black", font=font)
        bar_left = label_width + map_width + 6
        gradient = palette[np.linspace(255, 0, len(rows) * row_height).astype(int)][:, None].repeat(10, axis=1)
        canvas.paste(Image.fromarray(np.ascontiguousarray(gradient)), (bar_left, map_top))
        draw.text((bar_left + 13, map_top - 2), f"{high:.3g}", fill="black", font=font)
        draw.text((bar_left + 13, axis - 11), f"{low:.3g}", fill="black", font=font)
        top += height
    return np.asarray(canvas)


def custom_scalars_layout(gate_names: list[str], batch_norm: bool) -> dict[str, dict[str, list]]:
    """The charts worth opening first, as ``{category: {chart: ["Multiline", [tag regexes]]}}``.

    Every chart shows all cells (layers and directions) at once; training and validation-batch values are separate
    charts because they come from different batches.
    """
    layout: dict[str, dict[str, list]] = {
        "seqnorm: hidden state": {
            "h std (train)": ["Multiline", [r"^hidden/.*/h_std$"]],
            "h std (fixed val batch)": ["Multiline", [r"^hidden/.*/val_h_std$"]],
            "h mean (train)": ["Multiline", [r"^hidden/.*/h_mean$"]],
            "near-zero h fraction (train)": ["Multiline", [r"^hidden/.*/h_zero_frac$"]],
            "c std (train)": ["Multiline", [r"^hidden/.*/c_std$"]],
        },
        "seqnorm: gates": {
            f"{gate} saturation (train)": ["Multiline", [rf"^gates/.*/{gate}_sat$"]] for gate in gate_names
        },
        "seqnorm: gradient through time": {
            "||dL/dh_t|| last / first step": ["Multiline", [r"^grad/.*/last_over_first$"]],
            "||dL/dh_t|| mean over steps": ["Multiline", [r"^grad/.*/h_norm$"]],
            "||dL/dh_t|| first and last step": ["Multiline", [r"^grad/.*/h_norm_(first|last)$"]],
        },
        "seqnorm: normalization": {
            "post-norm std (train)": ["Multiline", [r"^norm/.*/(ih|hh|c)_post_std$"]],
            "post-norm mean (train)": ["Multiline", [r"^norm/.*/(ih|hh|c)_post_mean$"]],
            "pre-norm std (train)": ["Multiline", [r"^norm/.*/(ih|hh)_pre_std$"]],
        },
        "seqnorm: task": {"loss": ["Multiline", [r"^(train|val)/loss$"]]},
    }
    if batch_norm:
        layout["seqnorm: normalization"].update(
            {
                "train/eval gap on the fixed val batch": ["Multiline", [r"^norm/.*/val_train_eval_gap$"]],
                "running variance (mean over steps)": ["Multiline", [r"^norm/.*_running_var$"]],
                "running mean (mean over steps)": ["Multiline", [r"^norm/.*_running_mean$"]],
                "fewest real rows at a step": ["Multiline", [r"^norm/.*/active_rows_min$"]],
            }
        )
    return layout
