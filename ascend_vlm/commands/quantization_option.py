"""The "quantize" feature option of ``python -m ascend_vlm eval``: ``--quantize SCHEME``
quantizes the language model's linear layers before the run
(:func:`ascend_vlm.quantization.quantize`).

``SCHEME`` is ``w<bits>[g<group size>][-<method>]``: ``w8`` (8 bits per channel, RTN),
``w8g128``, ``w4g128-awq``, ``w4-rtn``... Bits are 8 or 4; the group size defaults to 0 (per
channel) for 8 bits and 128 for 4 bits; the method is ``rtn`` (default) or ``awq`` (calibrated
on ShapesVQA training records encoded by the model's processor). ``none`` (the default) leaves
the model as loaded.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from ascend_vlm.quantization.config import QuantizationConfig
from ascend_vlm.quantization.quantize import quantize

_SCHEME = re.compile(r"w(?P<bits>\d+)(?:g(?P<group>\d+))?(?:-(?P<method>[a-z]+))?")


def parse_scheme(text: str) -> QuantizationConfig | None:
    """The :class:`QuantizationConfig` of a scheme (None for ``none``); raises
    ArgumentTypeError naming what is accepted."""
    if text == "none":
        return None
    match = _SCHEME.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected none or w<bits>[g<group size>][-<method>] (e.g. w8, w4g128-awq), got "
            f"{text!r}"
        )
    group_size = int(match["group"]) if match["group"] else None
    try:
        return QuantizationConfig(
            bits=int(match["bits"]), group_size=group_size, method=match["method"] or "rtn"
        )
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_quantization_arguments(group: Any) -> None:
    """Add ``--quantize SCHEME`` (default ``none``)."""
    group.add_argument(
        "--quantize",
        type=parse_scheme,
        default=None,
        metavar="SCHEME",
        help="weight-only quantize the language model's linear layers: w<bits>[g<group "
        "size>][-rtn|-awq], e.g. w8 (per channel), w4g128-awq; default none",
    )


def apply_quantization(model: Any, args: argparse.Namespace, processor: Any) -> dict[str, Any]:
    """Quantize ``model`` per ``args.quantize``; the dict records the scheme and the weight
    bytes of the quantized layers against fp16."""
    config = args.quantize
    if config is None:
        return {"summary": "not quantized", "scheme": None}
    report = quantize(model, config, processor=processor, progress=False)
    group = f" g{config.group_size}" if config.group_size else " per channel"
    summary = (
        f"quantized: w{config.bits}{group} {config.method}, {len(report.modules)} layers, "
        f"{report.ratio_to_fp16:.3f}x their fp16 bytes"
    )
    return {
        "summary": summary,
        "scheme": {"bits": config.bits, "group_size": config.group_size, "method": config.method},
        "layers": len(report.modules),
        "fp16_bytes": report.fp16_bytes,
        "quantized_bytes": report.quantized_bytes,
    }
