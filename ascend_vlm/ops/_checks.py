"""Input checks shared by the ops: every failure is a ``ValueError`` naming the argument, what was
expected and what came, e.g. ``query: expected 4-D [B, N, S, D] for layout 'BNSD', got shape
(2, 8, 16)``."""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch


def invalid(argument: str, expected: str, got: object) -> ValueError:
    """The one error format of the ops."""
    return ValueError(f"{argument}: expected {expected}, got {got}")


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


def check_dtype(argument: str, tensor: torch.Tensor, allowed: Collection[torch.dtype]) -> None:
    """``allowed`` is tested as given (the ops pass the spec's frozensets): this runs per call."""
    if tensor.dtype not in allowed:
        raise invalid(argument, f"dtype in ({_dtype_names(allowed)})", tensor.dtype)


def check_rank(argument: str, tensor: torch.Tensor, rank: int, description: str) -> None:
    """``description`` spells the expected shape, e.g. ``"4-D [B, N, S, D] for layout 'BNSD'"``."""
    if tensor.dim() != rank:
        raise invalid(argument, description, f"shape {tuple(tensor.shape)}")


def check_same_dtype(argument: str, tensor: torch.Tensor, reference_name: str, dtype) -> None:
    if tensor.dtype != dtype:
        raise invalid(argument, f"dtype {dtype} (same as {reference_name})", tensor.dtype)
