"""The library's int4 weight layout: two signed 4-bit values per byte, packed along K.

A weight of N rows (output features) and K columns (input features) with values in [-8, 7] is
stored as ``uint8`` of shape ``(N, ceil(K / 2))``: column ``k`` lives in byte ``k // 2``, in the
low nibble for even ``k`` and the high nibble for odd ``k``, as the two's-complement nibble
(``value & 0xF``). An odd K leaves the last high nibble 0. The layout is the one checkpoints
of this library save; kernels that want another (``torch_npu.npu_convert_weight_to_int4pack``)
convert from it once, when the weights are loaded.
"""

from __future__ import annotations

import torch

INT4_MIN, INT4_MAX = -8, 7


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Pack an integer tensor ``(N, K)`` with values in [-8, 7] into ``uint8 (N, ceil(K/2))``.

    Raises ValueError for a tensor that is not 2-D, not of an integer dtype, or holds values
    outside [-8, 7].
    """
    if values.dim() != 2:
        raise ValueError(f"values: expected a 2-D (N, K) tensor, got shape {tuple(values.shape)}")
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise ValueError(f"values: expected an integer dtype, got {values.dtype}")
    if values.numel() and (values.min() < INT4_MIN or values.max() > INT4_MAX):
        raise ValueError(
            f"values: expected int4 values in [{INT4_MIN}, {INT4_MAX}], got "
            f"[{int(values.min())}, {int(values.max())}]"
        )
    nibbles = (values.to(torch.int16) & 0xF).to(torch.uint8)
    if nibbles.shape[1] % 2:
        nibbles = torch.nn.functional.pad(nibbles, (0, 1))
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The ``int8 (N, in_features)`` values of a ``uint8 (N, ceil(in_features/2))`` packing.

    Raises ValueError when ``packed`` is not such a tensor.
    """
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(
            f"packed: expected a 2-D uint8 tensor, got {packed.dtype} of shape "
            f"{tuple(packed.shape)}"
        )
    if packed.shape[1] != (in_features + 1) // 2:
        raise ValueError(
            f"packed: expected {(in_features + 1) // 2} bytes per row for in_features="
            f"{in_features}, got {packed.shape[1]}"
        )
    low = (packed & 0xF).to(torch.int8)
    high = (packed >> 4).to(torch.int8)
    values = torch.stack((low, high), dim=-1).flatten(-2)[:, :in_features]
    return values - ((values & 0x8) << 1)  # sign-extend the nibble
