"""Weight-only quantization (W8A16, W4A16 per channel or per group) of a VLM's linear layers.

One :class:`QuantizationConfig` (bits, group size, symmetry, method ``"rtn"`` | ``"awq"``, which
layers, whether to keep the float weights) serves both ways in:

* ``quantize(model, config)`` swaps the selected ``nn.Linear``s for :class:`QuantLinear`
  modules that run :func:`ascend_vlm.ops.weight_quant_matmul` (torch_npu's
  ``npu_weight_quant_batchmatmul`` on the NPU) and returns a :class:`QuantizationReport`;
* ``from_pretrained(float_checkpoint, quantization_config=config)`` quantizes while loading
  (RTN), equal to ``quantize`` bit for bit.

The swaps go through the edit ledger, so ``unquantize(model)`` restores the float model when
the config kept its weights. ``model.save_pretrained`` writes a checkpoint that
``from_pretrained`` reads back; ``load_quantized(path)`` reads it strictly, as it reads AutoAWQ
GEMM and GPTQ checkpoints.
"""

from __future__ import annotations

# Lets transformers' from_pretrained take the config (module docstring there).
from ascend_vlm.quantization import transformers_quantizer  # noqa: F401
from ascend_vlm.quantization.config import QuantizationConfig
from ascend_vlm.quantization.feature import unquantize
from ascend_vlm.quantization.quant_linear import QuantLinear
from ascend_vlm.quantization.quantize import quantize
from ascend_vlm.quantization.quantized_checkpoint import load_quantized
from ascend_vlm.quantization.quantized_weight import QuantizedWeight
from ascend_vlm.quantization.report import QuantizationReport

__all__ = [
    "QuantLinear",
    "QuantizationConfig",
    "QuantizationReport",
    "QuantizedWeight",
    "load_quantized",
    "quantize",
    "unquantize",
]
