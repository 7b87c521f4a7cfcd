"""The error-vs-depth picture of a `VerifyReport`: each capture's relative L2 against the
reference in execution order (log scale, one colour per op kind), the noise floor beneath it,
the flag line k * floor + slack, and the first flagged module marked."""

from __future__ import annotations

import os
from pathlib import Path

from ascend_vlm.observability.pictures import agg_figure, matplotlib_package, save_png
from ascend_vlm.verification.capture_points import OP_KINDS
from ascend_vlm.verification.report import VerifyReport

_INCHES = (11.0, 4.5)
# Plotted in place of a zero error, which a log axis cannot show.
_LOG_FLOOR = 1e-9


def save_error_plot(report: VerifyReport, path: str | os.PathLike[str]) -> Path:
    """Draw ``report`` as described in the module docstring into the PNG ``path``; returns it.
    ValueError when the report has no capture; ImportError naming the ``ascend_vlm[plots]``
    extra without matplotlib."""
    if not report.modules:
        raise ValueError("report: expected at least one capture to plot, got none")
    mpl = matplotlib_package()
    figure = agg_figure(mpl, _INCHES)
    axes = figure.add_subplot()
    depth = [m.depth for m in report.modules]
    axes.plot(
        depth,
        [max(m.floor_relative_l2, _LOG_FLOOR) for m in report.modules],
        color="black",
        linewidth=1,
        label=f"noise floor (stock, {report.dtype}, CPU)",
    )
    axes.plot(
        depth,
        [max(m.threshold, _LOG_FLOOR) for m in report.modules],
        color="firebrick",
        linestyle="--",
        linewidth=1,
        label=f"flag line: {report.k:g} x floor + {report.slack:g}",
    )
    colours = mpl.colormaps["tab20"]
    for index, kind in enumerate(OP_KINDS):
        points = [m for m in report.modules if m.kind == kind]
        if points:
            axes.scatter(
                [m.depth for m in points],
                [max(m.relative_l2, _LOG_FLOOR) for m in points],
                s=14,
                color=colours(2 * index % 20),
                label=kind,
            )
    first = report.first_flagged
    if first is not None:
        axes.annotate(
            f"first flagged: {first.label}",
            (first.depth, max(first.relative_l2, _LOG_FLOOR)),
            xytext=(10, 10),
            textcoords="offset points",
            arrowprops={"arrowstyle": "->"},
        )
    axes.set_yscale("log")
    axes.set_xlabel("capture, in execution order (vision tower, projector, decoder)")
    axes.set_ylabel("relative L2 vs the reference")
    state = "patched" if report.patched else "stock"
    axes.set_title(
        f"{report.model_type}: {state} {report.dtype} on {report.device} "
        f"({report.backend} kernels) vs the {report.reference_dtype} reference"
    )
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_png(figure, path)
