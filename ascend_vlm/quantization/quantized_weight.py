"""`QuantizedWeight`: one linear layer's weight-only quantized form, as every part of
:mod:`ascend_vlm.quantization` hands it around (quantizers produce it, checkpoint readers decode
foreign formats into it, `QuantLinear` holds it).

Math, for a weight ``W`` of ``N`` output rows and ``K`` input columns, with ``G`` the group size
(``K`` when ``group_size`` is 0, per channel) and ``g = k // G``::

    W[n, k] ~= (q[n, k] + offset[g, n]) * scale[g, n]

``q`` is signed: int8 values in [-128, 127] for 8 bits, [-8, 7] for 4 bits (stored packed, see
:mod:`ascend_vlm.ops.int4_layout`). ``offset`` is None for symmetric quantization (0). The
offset is added, as ``torch_npu.npu_weight_quant_batchmatmul`` adds ``antiquant_offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ascend_vlm.ops import dequantize_weight
from ascend_vlm.ops.int4_layout import unpack_int4
from ascend_vlm.ops.weight_quant_matmul import GROUP_SIZE_MAX, GROUP_SIZE_STEP

BITS = (4, 8)
# 0 (per channel) and the op's per-group sizes.
GROUP_SIZES = (0, *range(GROUP_SIZE_STEP, GROUP_SIZE_MAX + 1, GROUP_SIZE_STEP))


def group_count(in_features: int, group_size: int) -> int:
    """Scale rows of a weight of ``in_features`` columns: ``ceil(K / G)``, 1 per channel."""
    return -(-in_features // group_size) if group_size else 1


def storage_of(bits: int, in_features: int) -> tuple[torch.dtype, int]:
    """``(dtype, columns)`` of ``qweight`` for ``bits``: int8 ``K``, or uint8 ``ceil(K/2)``."""
    return (torch.int8, in_features) if bits == 8 else (torch.uint8, (in_features + 1) // 2)


@dataclass(frozen=True)
class QuantizedWeight:
    """``qweight``: int8 ``(N, K)`` for 8 bits, uint8 ``(N, ceil(K/2))`` packed for 4 bits;
    ``scale`` and ``offset``: ``(ceil(K/G), N)`` (``(1, N)`` per channel) floating tensors;
    ``in_features``: K."""

    qweight: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    bits: int
    group_size: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.scale.shape[-1]

    def values(self) -> torch.Tensor:
        """The signed integers ``q`` as int8 ``(N, K)``."""
        if self.bits == 4:
            return unpack_int4(self.qweight, self.in_features)
        return self.qweight

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``W`` as ``(N, K)``, computed in ``dtype`` by the math above
        (:func:`ascend_vlm.ops.dequantize_weight`)."""
        return dequantize_weight(
            self.qweight, self.scale, self.offset, self.group_size, self.in_features, dtype
        )
