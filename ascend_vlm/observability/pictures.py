"""PNG pictures of observability data: attention over an image, stage times as a heat map.

Drawing uses matplotlib's object API (``Figure`` + the Agg canvas), never pyplot, so it keeps no
global state and needs no display. matplotlib is optional: it is imported when a picture is
drawn, and its absence raises ImportError naming the ``ascend_vlm[plots]`` extra.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image

from ascend_vlm.observability.visual_grid import ImageCells, cell_pixel_map

# Fixed output sizes keep pictures comparable; tiny test images are upscaled without blur.
_OVERLAY_INCHES = (10.0, 5.0)
_DPI = 100
_OVERLAY_ALPHA = 0.55
# Beyond this many columns, cells are too narrow for their values.
_MAX_ANNOTATED_COLUMNS = 12
# At most this many tick labels per axis; more are thinned to every n-th.
_MAX_TICK_LABELS = 30


def save_attention_overlay(
    path: str | os.PathLike[str],
    image: PIL.Image.Image,
    cells: ImageCells,
    weights: Any,
    *,
    title: str = "",
) -> Path:
    """Two panels: the image as it is (left) and the image with the per-token weights drawn
    over it as a semi-transparent heat map (right; cell_pixel_map, NaN pixels transparent) with
    a colour bar and optional title; saved as PNG at path; returns the Path.

    Axes are in original-image pixel edges: pixel (x, y) spans [x, x + 1) x [y, y + 1), the
    convention of ImageCells boxes. The colour scale runs from the smallest
    to the largest weight.
    """
    if not isinstance(image, PIL.Image.Image):
        raise ValueError(f"image: expected a PIL.Image.Image, got {type(image).__name__}")
    if image.size != cells.image_size:
        raise ValueError(
            f"image: expected the {cells.image_size[0]} x {cells.image_size[1]} image of cells, "
            f"got {image.size[0]} x {image.size[1]}"
        )
    pixel_map = cell_pixel_map(cells, weights)
    mpl = matplotlib_package()

    width, height = image.size
    extent = (0, width, height, 0)
    figure = agg_figure(mpl, _OVERLAY_INCHES)
    # The heat covers what it points at: the plain image beside it shows what is there.
    plain, axes = figure.subplots(1, 2)
    pixels = np.asarray(image.convert("RGB"))
    plain.imshow(pixels, extent=extent, interpolation="nearest")
    plain.set_axis_off()
    plain.set_title("image")
    axes.imshow(pixels, extent=extent, interpolation="nearest")
    heat = axes.imshow(
        np.ma.masked_invalid(pixel_map),
        cmap=mpl.colormaps["inferno"].with_extremes(bad=(0, 0, 0, 0)),
        alpha=_OVERLAY_ALPHA,
        extent=extent,
        interpolation="nearest",
    )
    # The colour bar shows the scale opaque, as the colours would be without the image below.
    scale = mpl.cm.ScalarMappable(norm=heat.norm, cmap=heat.cmap)
    figure.colorbar(scale, ax=axes, label="weight")
    axes.set_xlim(0, width)
    axes.set_ylim(height, 0)
    axes.set_axis_off()
    if title:
        axes.set_title(title)
    return save_png(figure, path)


def save_stage_heatmap(
    path: str | os.PathLike[str],
    row_labels: Sequence[str],
    column_labels: Sequence[str],
    milliseconds: Any,
    *,
    title: str = "",
) -> Path:
    """A heat map of a [rows, columns] array of milliseconds (NaN = stage absent, drawn blank),
    rows = requests or batch rows, columns = stages then decode steps; each cell annotated with
    its value when there are at most ~12 columns; too many columns -> labels thinned. PNG.

    Returns the Path written. Values must be >= 0 or NaN.
    """
    values = _milliseconds_array(milliseconds, len(row_labels), len(column_labels))
    mpl = matplotlib_package()

    rows, columns = values.shape
    # Cells stay readable: about 0.6 x 0.4 inch each, within sane page limits.
    inches = (min(max(3.0 + 0.6 * columns, 6.0), 16.0), min(max(1.8 + 0.4 * rows, 3.0), 12.0))
    figure = agg_figure(mpl, inches)
    axes = figure.add_subplot()
    finite = values[np.isfinite(values)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    heat = axes.imshow(
        np.ma.masked_invalid(values),
        cmap=mpl.colormaps["viridis"].with_extremes(bad=(0, 0, 0, 0)),
        vmin=low,
        vmax=high if high > low else low + 1.0,
        aspect="auto",
        interpolation="nearest",
    )
    figure.colorbar(heat, ax=axes, label="ms")
    _set_ticks(axes.set_xticks, column_labels, rotation=45, ha="right", rotation_mode="anchor")
    _set_ticks(axes.set_yticks, row_labels)
    if columns <= _MAX_ANNOTATED_COLUMNS:
        middle = (low + high) / 2
        for (row, column), value in np.ndenumerate(values):
            if math.isfinite(value):
                # Light text on the dark low end of viridis, dark text on its light high end.
                colour = "white" if value < middle or high == low else "black"
                axes.text(
                    column,
                    row,
                    _format_ms(value),
                    ha="center",
                    va="center",
                    color=colour,
                    fontsize=8,
                )
    if title:
        axes.set_title(title)
    return save_png(figure, path)


def matplotlib_package():
    """The matplotlib package with the submodules used here, imported on first use."""
    try:
        import matplotlib
        import matplotlib.backends.backend_agg
        import matplotlib.cm
        import matplotlib.figure
        import matplotlib.patches
    except ImportError as error:
        raise ImportError(
            "drawing pictures needs matplotlib: install ascend_vlm[plots] (matplotlib)"
        ) from error
    return matplotlib


def agg_figure(mpl, inches: tuple[float, float]):
    """A figure drawn by the Agg canvas (no pyplot, no display), laid out to fit its labels."""
    figure = mpl.figure.Figure(figsize=inches, dpi=_DPI, layout="constrained")
    mpl.backends.backend_agg.FigureCanvasAgg(figure)
    return figure


def _milliseconds_array(milliseconds: Any, rows: int, columns: int) -> np.ndarray:
    if hasattr(milliseconds, "detach"):
        milliseconds = milliseconds.detach().to("cpu").double().numpy()
    values = np.asarray(milliseconds, dtype=np.float64)
    if values.shape != (rows, columns) or rows == 0 or columns == 0:
        raise ValueError(
            f"milliseconds: expected shape ({rows}, {columns}) (len(row_labels), "
            f"len(column_labels)), both > 0, got {values.shape}"
        )
    if np.isinf(values).any() or (values < 0).any():
        raise ValueError(
            "milliseconds: expected values >= 0 or NaN, got a negative or infinite value"
        )
    return values


def _set_ticks(set_ticks, labels: Sequence[str], **text: Any) -> None:
    """Label every n-th row or column so that at most _MAX_TICK_LABELS labels show."""
    step = max(1, math.ceil(len(labels) / _MAX_TICK_LABELS))
    positions = range(0, len(labels), step)
    set_ticks(list(positions), [str(labels[i]) for i in positions], **text)


def _format_ms(value: float) -> str:
    """About three significant figures, never scientific notation."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def save_png(figure, path: str | os.PathLike[str]) -> Path:
    """Write ``figure`` to ``path`` as PNG; returns the path."""
    path = Path(path)
    figure.savefig(path, format="png")
    return path
