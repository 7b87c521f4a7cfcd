"""Argument checks shared by the mock NPU's stand-ins: errors name the argument, what was
expected and what came."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def bad(argument: str, expected: str, got: object) -> ValueError:
    return ValueError(f"{argument}: expected {expected}, got {got}")


def check_dtype(argument: str, tensor: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise bad(argument, f"dtype in ({names})", tensor.dtype)
