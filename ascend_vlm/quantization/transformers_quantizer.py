"""transformers' side of this library's checkpoints: with :mod:`ascend_vlm.quantization`
imported, ``from_pretrained`` on a folder ``save_pretrained`` wrote after
:func:`~ascend_vlm.quantization.quantize.quantize` builds the listed layers as `QuantLinear`s
before the weights load, so they load into them.

Registered under transformers' custom-quantization hooks (``register_quantization_config`` /
``register_quantizer``, quant_method ``"ascend_vlm"``). Without the registration transformers
would skip the unknown method and load the quantized layers as float layers of random weights.
Pre-quantized checkpoints only: ``quantize`` is how a model gets quantized.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers.quantizers.auto import (
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ascend_vlm.quantization.quant_linear import QuantLinear
from ascend_vlm.quantization.quantize import QUANT_METHOD, replace_module


class AscendVLMQuantizationConfig(QuantizationConfigMixin):
    """The ``quantization_config`` :func:`~ascend_vlm.quantization.quantize.quantize` records:
    ``method`` ("rtn" / "awq"), ``bits``, ``group_size``, ``symmetric`` and the quantized
    ``modules`` (their names in the model)."""

    def __init__(
        self,
        bits: int,
        group_size: int,
        symmetric: bool,
        modules: list[str],
        method: str = "rtn",
        **kwargs: Any,
    ) -> None:
        self.quant_method = QUANT_METHOD
        self.method = method
        self.bits = bits
        self.group_size = group_size
        self.symmetric = symmetric
        self.modules = list(modules)


class AscendVLMQuantizer(HfQuantizer):
    """Builds the checkpoint's quantized layers as `QuantLinear` skeletons before loading."""

    requires_calibration = True  # pre-quantized checkpoints only

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> None:
        config = self.quantization_config
        for name in config.modules:
            linear = model.get_submodule(name)
            layer = QuantLinear(
                linear.in_features,
                linear.out_features,
                config.bits,
                config.group_size,
                symmetric=config.symmetric,
                bias=linear.bias is not None,
                dtype=linear.weight.dtype,
                device=linear.weight.device,
            )
            replace_module(model, name, layer)

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        return model

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True  # LoRA adapters on top; the quantized weights stay frozen


if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:  # importing twice (reloads) registers once
    register_quantization_config(QUANT_METHOD)(AscendVLMQuantizationConfig)
    register_quantizer(QUANT_METHOD)(AscendVLMQuantizer)
