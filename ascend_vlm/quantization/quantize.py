"""`quantize(model, ...)`: swap a VLM's linear layers for weight-only quantized `QuantLinear`s.

Selection: ``include`` names model parts (:data:`ascend_vlm.models.parts.PARTS`: the language
model, the vision tower, the projector, the output head) or ``fnmatch`` patterns of module
names; ``exclude`` patterns win over them. By default only the language model's linears are
quantized: never the output head or the embeddings unless asked (embeddings are not linear
layers and are never quantized).

Methods: ``"rtn"`` rounds each weight to the nearest point of its grid
(:func:`~ascend_vlm.quantization.rtn.quantize_rtn`); ``"awq"`` first rescales the weights'
input channels by activation-aware scales searched on calibration batches and folded into the
ops that feed them (:func:`~ascend_vlm.quantization.awq.apply_awq_scales`), then rounds.

The model's config records the scheme under ``quantization_config`` (``quant_method``
"ascend_vlm"), so ``model.save_pretrained`` writes a checkpoint that
:func:`~ascend_vlm.quantization.quantized_checkpoint.load_quantized` reads back.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ascend_vlm._base_model import base_model
from ascend_vlm.models.parts import PARTS, model_part
from ascend_vlm.quantization.quant_linear import QuantLinear
from ascend_vlm.quantization.rtn import check_scheme, quantize_rtn, resolve_symmetric

METHODS = ("rtn", "awq")
QUANT_METHOD = "ascend_vlm"
# The group size a bit width gets when none is named (CLI schemes, the fine-tune script):
# 8 bits per channel (the int8 kernels' fast case), 4 bits in groups of 128.
DEFAULT_GROUP_SIZE = {8: 0, 4: 128}


@dataclass(frozen=True)
class QuantizationReport:
    """What :func:`quantize` did: the scheme, the replaced modules, and bytes of their weights
    as floats in the model (``float_bytes``), as fp16 (``fp16_bytes``) and quantized
    (``quantized_bytes``: packed integers, scales and offsets); ``awq`` is the scale search's
    report (None for RTN)."""

    method: str
    bits: int
    group_size: int
    symmetric: bool
    modules: tuple[str, ...]
    float_bytes: int
    fp16_bytes: int
    quantized_bytes: int
    awq: Any = None

    @property
    def ratio_to_fp16(self) -> float:
        """``quantized_bytes / fp16_bytes``."""
        return self.quantized_bytes / self.fp16_bytes


def _check_names(argument: str, entries: object, parts_allowed: bool) -> tuple[str, ...]:
    if isinstance(entries, str) or not isinstance(entries, Iterable):
        raise TypeError(f"{argument}: expected a sequence of strings, got {entries!r}")
    entries = tuple(entries)
    for entry in entries:
        if not isinstance(entry, str) or not entry:
            raise TypeError(f"{argument}: expected non-empty strings, got {entry!r}")
        if parts_allowed and entry not in PARTS and not any(c in entry for c in "*?[."):
            raise ValueError(
                f"{argument}: expected model parts {PARTS} or module-name patterns (with '.', "
                f"'*', '?' or '['), got {entry!r}"
            )
    return entries


def selected_linears(
    model: nn.Module, include: Sequence[str], exclude: Sequence[str]
) -> list[tuple[str, nn.Linear]]:
    """The plain ``nn.Linear`` modules of ``model`` (a PEFT wrapper unwrapped) that ``include``
    selects and ``exclude`` does not, as ``(name, module)``."""
    found = []
    for name, module in base_model(model).named_modules():
        if type(module) is not nn.Linear:
            continue
        chosen = any(
            model_part(name) == entry if entry in PARTS else fnmatch.fnmatchcase(name, entry)
            for entry in include
        )
        if chosen and not any(fnmatch.fnmatchcase(name, pattern) for pattern in exclude):
            found.append((name, module))
    return found


def _refuse_prepared(model: nn.Module) -> None:
    base = base_model(model)
    for name, module in base.named_modules():
        if isinstance(module, QuantLinear):
            raise ValueError(f"model: already quantized ({name} is a QuantLinear)")
        if hasattr(module, "base_layer") and hasattr(module, "active_adapters"):
            raise ValueError(
                f"model: {name} carries PEFT adapters; quantize the base model first, then add "
                "adapters (QLoRA-style)"
            )


def _refuse_tied_head(model: nn.Module, targets: list[tuple[str, nn.Linear]]) -> None:
    root = base_model(model)
    head = root.get_output_embeddings() if hasattr(root, "get_output_embeddings") else None
    embeddings = root.get_input_embeddings() if hasattr(root, "get_input_embeddings") else None
    if head is None or embeddings is None or head.weight is not embeddings.weight:
        return
    if any(module is head for _, module in targets):
        raise ValueError(
            "include: the output head shares its weight with the input embeddings "
            "(tie_word_embeddings), which stay in float: quantizing it would keep both copies; "
            "leave lm_head out"
        )


def replace_module(root: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at the dotted ``name`` under ``root``."""
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


def quantize(
    model: nn.Module,
    bits: int = 8,
    group_size: int = 128,
    method: str = "rtn",
    calibration: Iterable[Mapping[str, torch.Tensor]] | None = None,
    *,
    processor: Any = None,
    include: Sequence[str] = ("language",),
    exclude: Sequence[str] = (),
    symmetric: bool | None = None,
    progress: bool = True,
) -> QuantizationReport:
    """Quantize ``model``'s selected linear layers in place (see the module docstring).

    ``bits``: 8 or 4. ``group_size``: 0 (per output channel) or a multiple of 32 from 32 to
    256. ``symmetric``: no offsets (default: True for 8 bits, False for 4). AWQ measures
    activations on ``calibration`` (model-input dicts), by default on
    :func:`~ascend_vlm.quantization.calibration.shapes_calibration` batches of ``processor``.
    Raises TypeError / ValueError naming the argument for a bad scheme, method or selection, a
    selection matching no linear layer, AWQ without calibration data or processor, and a model
    already quantized or carrying PEFT adapters.
    """
    check_scheme(bits, group_size)
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    include = _check_names("include", include, parts_allowed=True)
    exclude = _check_names("exclude", exclude, parts_allowed=False)
    symmetric = resolve_symmetric(bits, symmetric)
    _refuse_prepared(model)
    targets = selected_linears(model, include, exclude)
    if not targets:
        raise ValueError(
            f"include: {list(include)} (exclude {list(exclude)}) selects no nn.Linear of "
            f"{type(base_model(model)).__name__}"
        )
    _refuse_tied_head(model, targets)
    awq_report = None
    if method == "awq":
        from ascend_vlm.quantization.awq import apply_awq_scales

        if calibration is None:
            if processor is None:
                raise ValueError(
                    "calibration: AWQ needs calibration batches, or a processor to encode the "
                    "default ShapesVQA ones (processor=...)"
                )
            from ascend_vlm.quantization.calibration import shapes_calibration

            calibration = shapes_calibration(processor)
        awq_report = apply_awq_scales(
            model,
            calibration,
            bits,
            group_size,
            symmetric=symmetric,
            layers=[name for name, _ in targets],
            progress=progress,
        )
    from tqdm.auto import tqdm

    root = base_model(model)
    float_bytes = fp16_bytes = quantized_bytes = 0
    for name, linear in tqdm(targets, desc="quantize", unit="layer", disable=not progress):
        weight = linear.weight.detach()
        quantized = quantize_rtn(weight, bits, group_size, symmetric=symmetric, dtype=weight.dtype)
        replace_module(root, name, QuantLinear.from_quantized(quantized, linear.bias))
        float_bytes += weight.numel() * weight.element_size()
        fp16_bytes += weight.numel() * 2
        quantized_bytes += sum(
            t.numel() * t.element_size()
            for t in (quantized.qweight, quantized.scale, quantized.offset)
            if t is not None
        )
    modules = tuple(name for name, _ in targets)
    root.config.quantization_config = {
        "quant_method": QUANT_METHOD,
        "method": method,
        "bits": bits,
        "group_size": group_size,
        "symmetric": symmetric,
        "modules": list(modules),
    }
    return QuantizationReport(
        method=method,
        bits=bits,
        group_size=group_size,
        symmetric=symmetric,
        modules=modules,
        float_bytes=float_bytes,
        fp16_bytes=fp16_bytes,
        quantized_bytes=quantized_bytes,
        awq=awq_report,
    )
