"""Weight-only quantization (W8A16, W4A16 per channel or per group) of a VLM's linear layers.

``quantize(model, bits=8|4, group_size=128, method="rtn"|"awq", ...)`` swaps the selected
``nn.Linear``s for :class:`QuantLinear` modules that run :func:`ascend_vlm.ops.weight_quant_matmul`
(torch_npu's ``npu_weight_quant_batchmatmul`` on the NPU); ``model.save_pretrained`` then writes
a checkpoint that ``load_quantized(path)`` reads back, as it reads AutoAWQ GEMM and GPTQ
checkpoints.
"""

from __future__ import annotations

# Lets transformers' from_pretrained load this library's checkpoints (module docstring there).
from ascend_vlm.quantization import transformers_quantizer  # noqa: F401
from ascend_vlm.quantization.quant_linear import QuantLinear
from ascend_vlm.quantization.quantize import QuantizationReport, quantize
from ascend_vlm.quantization.quantized_checkpoint import load_quantized
from ascend_vlm.quantization.quantized_weight import QuantizedWeight

__all__ = ["QuantLinear", "QuantizationReport", "QuantizedWeight", "load_quantized", "quantize"]
