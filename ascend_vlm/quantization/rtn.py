"""Round-to-nearest (RTN) weight quantization: the grid every method here ends on.

Per group of ``G`` input columns of each output row (the whole row when ``group_size`` is 0):

* symmetric: ``scale = max|W| / (2^(b-1) - 1)``, ``q = clamp(round(W / scale), -2^(b-1),
  2^(b-1) - 1)``, no offset;
* asymmetric: the range ``[lo, hi] = [min(min W, 0), max(max W, 0)]`` (widened to hold 0, as
  GPTQ does, so the zero point is a grid point), ``scale = (hi - lo) / (2^b - 1)``, zero point
  ``z = round(-lo / scale)`` in ``[0, 2^b - 1]``, unsigned ``u = clamp(round(W / scale) + z, 0,
  2^b - 1)``, stored signed as ``q = u - 2^(b-1)`` with ``offset = 2^(b-1) - z`` (an integer
  of magnitude <= 2^(b-1), exact in fp16 and bf16), so ``(q + offset) * scale = (u - z) *
  scale``.

The scale is rounded up to ``dtype`` (the scales' and offsets' dtype, float32 by default)
before ``q`` is chosen, so every weight lies within half a step of the grid it is stored on. A
group of zeros gets scale 1.
"""

from __future__ import annotations

import torch

from ascend_vlm.ops.int4_layout import pack_int4
from ascend_vlm.quantization.quantized_weight import BITS, GROUP_SIZES, QuantizedWeight


def check_scheme(bits: object, group_size: object) -> None:
    """Raise ValueError / TypeError unless ``bits`` is 4 or 8 and ``group_size`` one of
    :data:`GROUP_SIZES`."""
    if not isinstance(bits, int) or isinstance(bits, bool):
        raise TypeError(f"bits: expected an int, got {type(bits).__name__}")
    if bits not in BITS:
        raise ValueError(f"bits: expected one of {BITS}, got {bits}")
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        raise TypeError(f"group_size: expected an int, got {type(group_size).__name__}")
    if group_size not in GROUP_SIZES:
        raise ValueError(
            f"group_size: expected 0 (per channel) or a multiple of {GROUP_SIZES[1]} from "
            f"{GROUP_SIZES[1]} to {GROUP_SIZES[-1]}, got {group_size}"
        )


def resolve_symmetric(bits: int, symmetric: bool | None) -> bool:
    """``symmetric``, or its default for ``bits``: symmetric 8 bits (no offset: the int8
    kernels' fast case), asymmetric 4 bits."""
    return bits == 8 if symmetric is None else symmetric


def _grouped(weight: torch.Tensor, group: int) -> torch.Tensor:
    """``(N, K)`` as ``(N, ceil(K/G), G)``, the last group padded by repeating its last column
    (padding never widens a group's range)."""
    rows, columns = weight.shape
    pad = -columns % group
    if pad:
        weight = torch.cat((weight, weight[:, -1:].expand(rows, pad)), dim=1)
    return weight.reshape(rows, -1, group)


def _stored(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale`` as it is stored in ``dtype`` (back in float32), 1 where it is 0. Rounded up,
    never down: a smaller step would push the group's extremes past the grid's ends."""
    widened = scale * (1 + torch.finfo(dtype).eps) if dtype != torch.float32 else scale
    stored = widened.to(dtype).to(torch.float32)
    return torch.where(stored > 0, stored, torch.ones_like(stored))


def quantize_rtn(
    weight: torch.Tensor,
    bits: int,
    group_size: int = 128,
    symmetric: bool | None = None,
    dtype: torch.dtype = torch.float32,
) -> QuantizedWeight:
    """Quantize a float ``weight (N, K)`` to the nearest point of the grid above.

    ``symmetric`` defaults to True for 8 bits (no offset: the int8 kernels' fast case) and
    False for 4 bits. ``dtype``: the scales' and offsets' dtype.
    """
    check_scheme(bits, group_size)
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(
            f"weight: expected a 2-D floating (N, K) tensor, got {weight.dtype} of shape "
            f"{tuple(weight.shape)}"
        )
    symmetric = resolve_symmetric(bits, symmetric)
    columns = weight.shape[1]
    grouped = _grouped(weight.detach().to(torch.float32), group_size or columns)
    half = 2 ** (bits - 1)
    if symmetric:
        scale = _stored(grouped.abs().amax(dim=-1, keepdim=True) / (half - 1), dtype)
        q = torch.clamp(torch.round(grouped / scale), -half, half - 1)
        offset = None
    else:
        low = grouped.amin(dim=-1, keepdim=True).clamp(max=0)
        high = grouped.amax(dim=-1, keepdim=True).clamp(min=0)
        scale = _stored((high - low) / (2 * half - 1), dtype)
        zero = torch.clamp(torch.round(-low / scale), 0, 2 * half - 1)
        unsigned = torch.clamp(torch.round(grouped / scale) + zero, 0, 2 * half - 1)
        q = unsigned - half
        offset = (half - zero).squeeze(-1).t().contiguous().to(dtype)
    q = q.reshape(weight.shape[0], -1)[:, :columns].to(torch.int8)
    return QuantizedWeight(
        qweight=pack_int4(q) if bits == 4 else q.contiguous(),
        scale=scale.squeeze(-1).t().contiguous().to(dtype),
        offset=offset,
        bits=bits,
        group_size=group_size,
        in_features=columns,
    )
