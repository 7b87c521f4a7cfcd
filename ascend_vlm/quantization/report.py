"""`QuantizationReport`: what `quantize` replaced and the bytes it saved, printable as a table."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ascend_vlm.models.parts import model_part
from ascend_vlm.quantization.config import QuantizationConfig

_LAYER_INDEX = re.compile(r"^.*\.\d+\.")


@dataclass(frozen=True)
class LayerBytes:
    """One replaced layer's weight bytes: as floats in the model (``float_bytes``), as fp16
    (``fp16_bytes``) and quantized (``quantized_bytes``: packed integers, scales, offsets)."""

    name: str
    float_bytes: int
    fp16_bytes: int
    quantized_bytes: int


@dataclass(frozen=True)
class QuantizationReport:
    """What :func:`~ascend_vlm.quantization.quantize.quantize` did: the ``config`` it recorded
    on the model (its ``modules`` are the replaced layers), each replaced layer's bytes
    (``layers``, in model order) and, for AWQ, the scale search's report (``awq``, None for
    RTN). ``print(report)`` shows a table per model part and layer kind."""

    config: QuantizationConfig
    layers: tuple[LayerBytes, ...]
    awq: Any = None

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)

    @property
    def float_bytes(self) -> int:
        return sum(layer.float_bytes for layer in self.layers)

    @property
    def fp16_bytes(self) -> int:
        return sum(layer.fp16_bytes for layer in self.layers)

    @property
    def quantized_bytes(self) -> int:
        return sum(layer.quantized_bytes for layer in self.layers)

    @property
    def ratio_to_fp16(self) -> float:
        """``quantized_bytes / fp16_bytes``."""
        return self.quantized_bytes / self.fp16_bytes

    def scheme(self) -> str:
        """The scheme in one phrase, e.g. ``"w4 g128 asymmetric, awq"``."""
        config = self.config
        group = f"g{config.group_size}" if config.group_size else "per channel"
        kind = "symmetric" if config.symmetric else "asymmetric"
        return f"w{config.bits} {group} {kind}, {config.method}"

    def __str__(self) -> str:
        groups: dict[tuple[str, str], list[LayerBytes]] = {}
        for layer in self.layers:
            kind = _LAYER_INDEX.sub("", layer.name)
            groups.setdefault((model_part(layer.name), kind), []).append(layer)
        rows = [("part", "layer", "count", "fp16 MB", "quantized MB", "ratio")]
        for (part, kind), members in groups.items():
            rows.append(_row(part, kind, members))
        rows.append(_row("total", "", list(self.layers)))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [f"ascend_vlm.quantize report: {self.scheme()}, {len(self.layers)} layers"]
        for index, row in enumerate(rows):
            if index == len(rows) - 1:
                lines.append("  ".join("-" * width for width in widths))
            lines.append(
                "  ".join(
                    cell.ljust(width) for cell, width in zip(row, widths, strict=True)
                ).rstrip()
            )
            if index == 0:
                lines.append("  ".join("-" * width for width in widths))
        if self.awq is not None:
            lines.append(
                f"awq: {len(self.awq.groups)} scaling groups searched ({len(self.awq.skipped)} "
                f"skipped), calibration loss {self.awq.rtn_loss:.4g} (rtn) -> "
                f"{self.awq.awq_loss:.4g}"
            )
        return "\n".join(lines)


def _row(part: str, kind: str, layers: list[LayerBytes]) -> tuple[str, ...]:
    fp16 = sum(layer.fp16_bytes for layer in layers)
    quantized = sum(layer.quantized_bytes for layer in layers)
    return (
        part,
        kind,
        str(len(layers)),
        f"{fp16 / 1e6:.3f}",
        f"{quantized / 1e6:.3f}",
        f"{quantized / fp16:.3f}x",
    )
