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

from ascend_vlm.quantization.quantize import DEFAULT_GROUP_SIZE, METHODS, quantize
from ascend_vlm.quantization.rtn import check_scheme

_SCHEME = re.compile(r"w(?P<bits>\d+)(?:g(?P<group>\d+))?(?:-(?P<method>[a-z]+))?")


def parse_scheme(text: str) -> dict[str, Any] | None:
    """``{"bits", "group_size", "method"}`` of a scheme (None for ``none``); raises
    ArgumentTypeError naming what is accepted."""
    if text == "none":
        return None
    match = _SCHEME.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected none or w<bits>[g<group size>][-<method>] (e.g. w8, w4g128-awq), got "
            f"{text!r}"
        )
    bits = int(match["bits"])
    group_size = int(match["group"]) if match["group"] else DEFAULT_GROUP_SIZE.get(bits, 0)
    method = match["method"] or "rtn"
    if method not in METHODS:
        raise argparse.ArgumentTypeError(f"method: expected one of {METHODS}, got {method!r}")
    try:
        check_scheme(bits, group_size)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return {"bits": bits, "group_size": group_size, "method": method}


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
    scheme = args.quantize
    if scheme is None:
        return {"summary": "not quantized", "scheme": None}
    report = quantize(model, **scheme, processor=processor, progress=False)
    group = f" g{report.group_size}" if report.group_size else " per channel"
    summary = (
        f"quantized: w{report.bits}{group} {report.method}, {len(report.modules)} layers, "
        f"{report.ratio_to_fp16:.3f}x their fp16 bytes"
    )
    return {
        "summary": summary,
        "scheme": scheme,
        "layers": len(report.modules),
        "fp16_bytes": report.fp16_bytes,
        "quantized_bytes": report.quantized_bytes,
    }
