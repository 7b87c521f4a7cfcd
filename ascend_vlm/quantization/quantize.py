"""`quantize(model, config)`: swap a VLM's linear layers for weight-only quantized `QuantLinear`s.

Selection (:class:`~ascend_vlm.quantization.config.QuantizationConfig`): ``include`` names model
parts (:data:`ascend_vlm.models.parts.PARTS`: the language model, the vision tower, the
projector, the output head) or ``fnmatch`` patterns of module names; ``exclude`` patterns win
over them. By default only the language model's linears are quantized: never the output head or
the embeddings unless asked (embeddings are not linear layers and are never quantized).

Methods: ``"rtn"`` rounds each weight to the nearest point of its grid
(:func:`~ascend_vlm.quantization.rtn.quantize_rtn`); ``"awq"`` first rescales the weights'
input channels by activation-aware scales searched on calibration batches and folded into the
ops that feed them (:func:`~ascend_vlm.quantization.awq.apply_awq_scales`), then rounds.

The swaps and the recorded ``config.quantization_config`` go through the edit ledger
(:mod:`~ascend_vlm.quantization.feature`), so ``model.save_pretrained`` writes a checkpoint that
``from_pretrained`` reads back, and :func:`~ascend_vlm.quantization.feature.unquantize` undoes
them when the float weights were kept.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ascend_vlm._base_model import base_model
from ascend_vlm.models.parts import PARTS, model_part
from ascend_vlm.quantization.config import QuantizationConfig
from ascend_vlm.quantization.feature import install_quantization
from ascend_vlm.quantization.quant_linear import QuantLinear
from ascend_vlm.quantization.quantized_weight import QuantizedWeight
from ascend_vlm.quantization.report import LayerBytes, QuantizationReport
from ascend_vlm.quantization.rtn import quantize_rtn


def selected_linears(model: nn.Module, config: QuantizationConfig) -> list[tuple[str, nn.Linear]]:
    """The plain ``nn.Linear`` modules of ``model`` (a PEFT wrapper unwrapped) that
    ``config`` selects (its ``modules``, else ``include`` minus ``exclude``), as
    ``(name, module)``."""
    found = []
    for name, module in base_model(model).named_modules():
        if type(module) is not nn.Linear:
            continue
        if config.modules is not None:
            chosen = name in config.modules
        else:
            chosen = any(
                model_part(name) == entry if entry in PARTS else fnmatch.fnmatchcase(name, entry)
                for entry in config.include
            ) and not any(fnmatch.fnmatchcase(name, pattern) for pattern in config.exclude)
        if chosen:
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
    """Tied: the same parameter, or (on the empty model transformers builds before loading,
    which ties after) listed in transformers' ``all_tied_weights_keys``."""
    root = base_model(model)
    head = root.get_output_embeddings() if hasattr(root, "get_output_embeddings") else None
    embeddings = root.get_input_embeddings() if hasattr(root, "get_input_embeddings") else None
    if head is None or embeddings is None:
        return
    tied_keys = getattr(root, "all_tied_weights_keys", None) or {}
    for name, module in targets:
        if module is head and (head.weight is embeddings.weight or f"{name}.weight" in tied_keys):
            raise ValueError(
                "include: the output head shares its weight with the input embeddings "
                "(tie_word_embeddings), which stay in float: quantizing it would keep both "
                "copies; leave lm_head out"
            )


def quantization_targets(
    model: nn.Module, config: QuantizationConfig
) -> list[tuple[str, nn.Linear]]:
    """:func:`selected_linears`, checked: ValueError for a model already quantized or carrying
    PEFT adapters, a selection matching no linear layer (or missing a listed module), and a
    selected output head tied to the input embeddings."""
    _refuse_prepared(model)
    targets = selected_linears(model, config)
    if config.modules is not None and len(targets) != len(config.modules):
        found = {name for name, _ in targets}
        absent = next(name for name in config.modules if name not in found)
        raise ValueError(
            f"modules: {absent!r} is not an nn.Linear of {type(base_model(model)).__name__}"
        )
    if not targets:
        raise ValueError(
            f"include: {list(config.include)} (exclude {list(config.exclude)}) selects no "
            f"nn.Linear of {type(base_model(model)).__name__}"
        )
    _refuse_tied_head(model, targets)
    return targets


def quantize_linear(config: QuantizationConfig, weight: torch.Tensor) -> QuantizedWeight:
    """``weight`` (a linear layer's, in its dtype) rounded to ``config``'s grid, the scales in
    the weight's dtype: the one rounding ``quantize`` and quantizing while loading share."""
    return quantize_rtn(
        weight.detach(), config.bits, config.group_size, config.symmetric, dtype=weight.dtype
    )


def quantize(
    model: nn.Module,
    config: QuantizationConfig,
    *,
    calibration: Iterable[Mapping[str, torch.Tensor]] | None = None,
    processor: Any = None,
    progress: bool = True,
) -> QuantizationReport:
    """Quantize ``model``'s linear layers that ``config`` selects, in place (see the module
    docstring); returns what was replaced (``print(report)`` shows a table).

    AWQ measures activations on ``calibration`` (model-input dicts), by default on
    :func:`~ascend_vlm.quantization.calibration.shapes_calibration` batches of ``processor``.
    ``progress``: tqdm bars. Raises TypeError naming ``config`` unless it is a
    :class:`QuantizationConfig` (which validated the scheme), and ValueError for what
    :func:`quantization_targets` refuses and AWQ without calibration data or processor.
    """
    if not isinstance(config, QuantizationConfig):
        raise TypeError(f"config: expected a QuantizationConfig, got {type(config).__name__}")
    targets = quantization_targets(model, config)
    awq_report = None
    if config.method == "awq":
        awq_report = _apply_awq(model, config, targets, calibration, processor, progress)
    from tqdm.auto import tqdm

    weights, layers = {}, []
    for name, linear in tqdm(targets, desc="quantize", unit="layer", disable=not progress):
        weights[name] = quantized = quantize_linear(config, linear.weight)
        layers.append(
            LayerBytes(
                name=name,
                float_bytes=linear.weight.numel() * linear.weight.element_size(),
                fp16_bytes=linear.weight.numel() * 2,
                quantized_bytes=sum(
                    t.numel() * t.element_size()
                    for t in (quantized.qweight, quantized.scale, quantized.offset)
                    if t is not None
                ),
            )
        )
    recorded = config.recorded(weights)
    install_quantization(model, recorded, weights, config.keep_float_weights)
    return QuantizationReport(config=recorded, layers=tuple(layers), awq=awq_report)


def _apply_awq(model, config, targets, calibration, processor, progress):
    from ascend_vlm.quantization.awq import apply_awq_scales

    if calibration is None:
        if processor is None:
            raise ValueError(
                "calibration: AWQ needs calibration batches, or a processor to encode the "
                "default ShapesVQA ones (processor=...)"
            )
        from ascend_vlm.quantization.calibration import shapes_calibration

        calibration = shapes_calibration(processor)
    return apply_awq_scales(
        model,
        calibration,
        config.bits,
        config.group_size,
        symmetric=config.symmetric,
        layers=[name for name, _ in targets],
        progress=progress,
    )
