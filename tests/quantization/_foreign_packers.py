"""Packers of AutoAWQ GEMM and GPTQ checkpoint tensors, written from the published formats
independently of the library's decoders, and the float64 dequantization those formats define;
shared by the decoder tests and the checkpoint-loading tests."""

from __future__ import annotations

import torch


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2**32) as the int32 tensor with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def int32_word(word: int) -> int:
    return word - 2**32 if word >= 2**31 else word


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM: unsigned 4-bit ``(R, N)`` -> int32 ``(R, N/8)``; nibble i of word j holds
    column 8*j + [0, 2, 4, 6, 1, 3, 5, 7][i]."""
    rows, columns = values.shape
    words = torch.zeros(rows, columns // 8, dtype=torch.int64)
    for j in range(columns // 8):
        for i, column in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
            words[:, j] |= values[:, 8 * j + column].to(torch.int64) << (4 * i)
    return as_int32(words)


def pack_gptq_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ qweight: unsigned ``(K, N)`` -> int32 ``(K*bits/32, N)``, rows in order."""
    per_word = 32 // bits
    words = torch.zeros(values.shape[0] // per_word, values.shape[1], dtype=torch.int64)
    for row in range(words.shape[0]):
        for i in range(per_word):
            words[row] |= values[row * per_word + i].to(torch.int64) << (bits * i)
    return as_int32(words)


def pack_gptq_columns(values: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ qzeros: unsigned ``(groups, N)`` -> int32 ``(groups, N*bits/32)``, columns in order."""
    return pack_gptq_rows(values.t(), bits).t().contiguous()


def reference_weight(unsigned, zeros, scales, group: int) -> torch.Tensor:
    """float64 ``W (N, K)`` with ``W^T[k, n] = (u[k, n] - z[k // G, n]) * s[k // G, n]``."""
    g = torch.arange(unsigned.shape[0]) // group
    return ((unsigned - zeros[g]).double() * scales[g].double()).t()
