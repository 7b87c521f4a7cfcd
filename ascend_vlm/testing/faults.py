"""Faults injected on purpose (test-only): into the mock NPU's kernels, to test that
`ascend_vlm.verify` finds them, and into one object's method, to test that a caller survives it.

Each context manager replaces one kernel of the installed mock ``torch_npu`` by a wrapper that
perturbs its call, for the block only, and yields a :class:`Fault` counting the perturbed
calls (a test checks the fault fired). The ops look the kernels up on ``torch_npu`` at every
call, so every patched module running that kernel is faulty inside the block:

* :func:`rope_sin_flipped`: ``npu_rotary_mul`` with sin's sign flipped (the rotation runs
  backwards);
* :func:`rms_norm_eps_scaled`: ``npu_rms_norm`` with its epsilon times ``factor`` (1e4);
* :func:`attention_scale_off`: ``npu_fusion_attention`` with its softmax scale times
  ``factor`` (1.01: off by 1%);
* :func:`moe_expert_swapped`: ``npu_grouped_matmul`` with the weights of experts ``expert`` and
  ``other`` swapped (the tokens routed to one get the other's).

RuntimeError when the mock NPU is not installed (a real torch_npu is never perturbed).

:func:`method_raises` makes one object's method raise for the calls a predicate picks (e.g. a
model's forward for one prompt's prefill, so a server fails that request alone).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ascend_vlm.kernel_backend import mock_installed


@dataclass
class Fault:
    """The kernel a fault perturbs and how many calls it perturbed."""

    kernel: str
    calls: int = 0


@contextlib.contextmanager
def _perturbed(kernel: str, perturb: Callable[..., Any]) -> Iterator[Fault]:
    """The mock's ``kernel`` replaced for the block by ``perturb(original, *args, **kwargs)``."""
    if not mock_installed():
        raise RuntimeError(f"{kernel}: expected the mock NPU installed to inject a fault, got none")
    torch_npu = sys.modules["torch_npu"]
    original = getattr(torch_npu, kernel)
    fault = Fault(kernel)

    def faulty(*args: Any, **kwargs: Any) -> Any:
        fault.calls += 1
        return perturb(original, *args, **kwargs)

    setattr(torch_npu, kernel, faulty)
    try:
        yield fault
    finally:
        setattr(torch_npu, kernel, original)


def rope_sin_flipped() -> contextlib.AbstractContextManager[Fault]:
    """``npu_rotary_mul(x, r1, r2)`` computes with ``-r2`` (sin's sign flipped)."""

    def perturb(kernel, input, r1, r2, *args, **kwargs):
        return kernel(input, r1, -r2, *args, **kwargs)

    return _perturbed("npu_rotary_mul", perturb)


def rms_norm_eps_scaled(factor: float = 1e4) -> contextlib.AbstractContextManager[Fault]:
    """``npu_rms_norm(x, gamma, epsilon)`` computes with ``epsilon * factor``."""

    def perturb(kernel, input, gamma, epsilon=1e-6):
        return kernel(input, gamma, epsilon * factor)

    return _perturbed("npu_rms_norm", perturb)


def attention_scale_off(factor: float = 1.01) -> contextlib.AbstractContextManager[Fault]:
    """``npu_fusion_attention(..., scale=s)`` computes with ``s * factor``."""

    def perturb(kernel, *args, scale=1.0, **kwargs):
        return kernel(*args, scale=scale * factor, **kwargs)

    return _perturbed("npu_fusion_attention", perturb)


def moe_expert_swapped(expert: int = 0, other: int = 1) -> contextlib.AbstractContextManager[Fault]:
    """``npu_grouped_matmul(x, [weight (E, K, N)], ...)`` computes with the weights of experts
    ``expert`` and ``other`` swapped."""

    def perturb(kernel, x, weight, **kwargs):
        order = list(range(weight[0].shape[0]))
        order[expert], order[other] = other, expert
        return kernel(x, [weight[0][order], *weight[1:]], **kwargs)

    return _perturbed("npu_grouped_matmul", perturb)


@contextlib.contextmanager
def method_raises(
    owner: Any, method: str, error: Exception, when: Callable[..., bool] = lambda *a, **k: True
) -> Iterator[Fault]:
    """``owner.method(*args, **kwargs)`` raises ``error`` for the block whenever ``when(*args,
    **kwargs)`` is true (and runs as before otherwise); the fault counts the raising calls.
    Only the instance ``owner`` changes (its class and other instances do not)."""
    original = getattr(owner, method)
    own = vars(owner)
    had_own, previous = method in own, own.get(method)
    fault = Fault(f"{type(owner).__name__}.{method}")

    def faulty(*args: Any, **kwargs: Any) -> Any:
        if when(*args, **kwargs):
            fault.calls += 1
            raise error
        return original(*args, **kwargs)

    setattr(owner, method, faulty)
    try:
        yield fault
    finally:
        if had_own:
            setattr(owner, method, previous)
        else:
            delattr(owner, method)
