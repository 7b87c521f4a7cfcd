"""Argument checks shared by the mock NPU's stand-ins: errors name the argument, what was
expected and what came."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ascend_vlm.ops.kernel_constraints import KernelRefusal


def bad(argument: str, expected: str, got: object) -> ValueError:
    return ValueError(f"{argument}: expected {expected}, got {got}")


def check_dtype(argument: str, tensor: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise bad(argument, f"dtype in ({names})", tensor.dtype)


class KernelRefused(RuntimeError, ValueError):
    """A call outside a kernel's documented limits (``ops.kernel_constraints``).

    A RuntimeError, as torch_npu raises when the aclnn API behind a kernel rejects its
    arguments; also a ValueError, the type of every other argument error of the mock.
    """


def refuse(kernel: str, refusal: KernelRefusal) -> KernelRefused:
    """``refusal`` in torch_npu's message style: the kernel, the aclnn status of an invalid
    parameter (ACLNN_ERR_PARAM_INVALID, 161002), then the argument, expected, got and source."""
    return KernelRefused(
        f"{kernel}: NPU function error: call failed, error code is 161002 "
        f"(ACLNN_ERR_PARAM_INVALID)\n{refusal.argument}: expected {refusal.expected}, "
        f"got {refusal.got} [documented limit: {refusal.source}]"
    )
