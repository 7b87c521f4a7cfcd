"""Round-to-nearest (RTN) weight quantization: the grid every method here ends on.

Per group of ``G`` input columns of each output row (the whole row when ``group_size`` is 0):

* symmetric: ``scale = max|W| / (2^(b-1) - 1)``, ``q = clamp(round(W / scale), -2^(b-1),
  2^(b-1) - 1)``, no offset;
* asymmetric: ``scale = (max W - min W) / (2^b - 1)``, zero point ``z = round(-min W / scale)``,
  unsigned ``u = clamp(round(W / scale) + z, 0, 2^b - 1)``, stored signed as ``q = u - 2^(b-1)``
  with ``offset = 2^(b-1) - z``, so ``(q + offset) * scale = (u - z) * scale``.

A group of one repeated value ``c`` reproduces it (up to float rounding): its range is taken
as ``|c|`` (scale 1 when ``c`` is 0). Scales and offsets are kept in float32 unless ``dtype``
says otherwise.
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
            f"group_size: expected 0 (per channel) or a multiple of 32 from 32 to 256, got "
            f"{group_size}"
        )


def _grouped(weight: torch.Tensor, group: int) -> torch.Tensor:
    """``(N, K)`` as ``(N, ceil(K/G), G)``, the last group padded by repeating its last column
    (padding never widens a group's range)."""
    rows, columns = weight.shape
    pad = -columns % group
    if pad:
        weight = torch.cat((weight, weight[:, -1:].expand(rows, pad)), dim=1)
    return weight.reshape(rows, -1, group)


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
    if symmetric is None:
        symmetric = bits == 8
    columns = weight.shape[1]
    grouped = _grouped(weight.detach().to(torch.float32), group_size or columns)
    half = 2 ** (bits - 1)
    if symmetric:
        scale = grouped.abs().amax(dim=-1, keepdim=True) / (half - 1)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.clamp(torch.round(grouped / scale), -half, half - 1)
        offset = None
    else:
        low = grouped.amin(dim=-1, keepdim=True)
        high = grouped.amax(dim=-1, keepdim=True)
        span = high - low
        span = torch.where(span > 0, span, torch.maximum(low.abs(), high.abs()))
        scale = span / (2 * half - 1)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.round(-low / scale)
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
