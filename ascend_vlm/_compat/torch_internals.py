"""torch internals the ops and caches use: the mode-stack depths, the fake-tensor test, the
in-place version counter and the int8 weight-only CPU matmul.

========================== ==========================================================================
probe                      detail
========================== ==========================================================================
torch-mode-stacks          ``torch._C._len_torch_function_stack`` / ``_len_torch_dispatch_stack``
                           count the active torch function / dispatch modes
                           (`torch_mode_stack_depths`: the ops' eager fast path).
torch-fake-tensors         ``torch._subclasses.fake_tensor.is_fake`` tells the fake tensors of
                           ``torch.compile`` / ``torch.export`` from real ones (`fake_tensor_test`:
                           the ops read no values of fake tensors).
tensor-versions            ``Tensor._version`` counts in-place writes (`tensor_version`: the vision
                           cache's weights fingerprint).
torch-int8pack-mm          ``torch._weight_int8pack_mm(x, weight, scales)`` computes
                           ``x @ (weight * scales[:, None])^T`` for int8 ``weight (N, K)``
                           (`int8_weight_matmul`: ``ops.weight_quant_matmul``'s bf16 CPU path).
========================== ==========================================================================

These probe torch, not transformers: no transformers version makes one removable; each is
needed on every supported version.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ascend_vlm._compat.probe import NEEDED_ON_EVERY_SUPPORTED_VERSION, Probe


def torch_mode_stack_depths() -> tuple[Callable[[], int], Callable[[], int]]:
    """The functions counting the active ``__torch_function__`` and ``__torch_dispatch__``
    modes. The public way to ask (``torch.overrides._get_current_function_mode_stack``) builds
    a list per call; the ops ask on every call."""
    import torch

    return torch._C._len_torch_function_stack, torch._C._len_torch_dispatch_stack


def fake_tensor_test() -> Callable[[object], bool]:
    """The function telling whether a tensor is (or wraps) a fake tensor of ``torch.compile``,
    AOT autograd or ``torch.export``, whose values do not exist."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake


def tensor_version(tensor: object) -> int:
    """torch's in-place modification counter of `tensor` (``Tensor._version``): it grows with
    every in-place write (``copy_`` in ``load_state_dict``, optimizer steps), so a vision-feature
    cache can tell the weights changed without hashing them."""
    return tensor._version


def int8_weight_matmul(x: object, weight: object, scales: object) -> object:
    """``x (M, K) @ (weight (N, K) * scales (N,)[:, None])^T`` by torch's int8 weight-only CPU
    kernel (``torch._weight_int8pack_mm``)."""
    import torch

    return torch._weight_int8pack_mm(x, weight, scales)


def _tensor_versions() -> str | None:
    import torch

    tensor = torch.zeros(2)
    before = tensor_version(tensor)
    tensor.add_(1)
    after = tensor_version(tensor)
    return None if after == before + 1 else f"_version gives {before} then {after} around add_"


def _torch_mode_stacks() -> str | None:
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    function_modes, dispatch_modes = torch_mode_stack_depths()
    outside = (function_modes(), dispatch_modes())
    with TorchFunctionMode():
        in_function_mode = (function_modes(), dispatch_modes())
    with TorchDispatchMode():
        in_dispatch_mode = (function_modes(), dispatch_modes())
    found = (outside, in_function_mode, in_dispatch_mode)
    if found != ((0, 0), (1, 0), (0, 1)):
        return (
            f"(function, dispatch) mode depths outside, in a function mode, in a dispatch mode: "
            f"{found}, expected ((0, 0), (1, 0), (0, 1))"
        )
    return None


def _torch_fake_tensors() -> str | None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(2)
    is_fake = fake_tensor_test()
    found = (is_fake(fake), is_fake(torch.empty(2)))
    return None if found == (True, False) else f"is_fake (fake, real) gives {found}"


def _torch_int8pack_mm() -> str | None:
    import torch

    if not hasattr(torch, "_weight_int8pack_mm"):
        return "torch._weight_int8pack_mm is missing"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, generator=generator).to(torch.bfloat16)
    weight = torch.randint(-127, 128, (3, 64), dtype=torch.int8, generator=generator)
    scales = torch.tensor([0.5, 1.0, 2.0], dtype=torch.bfloat16)
    got = int8_weight_matmul(x, weight, scales).float()
    expected = x.float() @ (weight.float() * scales.float()[:, None]).t()
    error = float((got - expected).abs().max() / expected.abs().max())
    return None if error < 2e-2 else f"relative error {error:.3g} against x @ (w * s)^T"


def compiled_module(module: object) -> object:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) wraps, else ``module``.
    torch keeps it in the private ``_orig_mod`` on every supported version."""
    return getattr(module, "_orig_mod", module)


@functools.cache
def cpu_grouped_mm() -> Callable | None:
    """torch's grouped GEMM on CPU (``ops.moe_experts``' reference):
    ``torch.nn.functional.grouped_mm`` (torch >= 2.10) or the private ``torch._grouped_mm``
    (2.9; the releases before have no CPU kernel), None without either. The private fallback
    can go once torch 2.10 is the oldest supported."""
    import torch

    public = getattr(torch.nn.functional, "grouped_mm", None)
    if public is not None:
        return public
    if torch.torch_version.TorchVersion(torch.__version__) >= (2, 9):
        return getattr(torch, "_grouped_mm", None)
    return None


TORCH_PROBES = (
    Probe("tensor-versions", _tensor_versions, NEEDED_ON_EVERY_SUPPORTED_VERSION),
    Probe("torch-mode-stacks", _torch_mode_stacks, NEEDED_ON_EVERY_SUPPORTED_VERSION),
    Probe("torch-fake-tensors", _torch_fake_tensors, NEEDED_ON_EVERY_SUPPORTED_VERSION),
    Probe("torch-int8pack-mm", _torch_int8pack_mm, NEEDED_ON_EVERY_SUPPORTED_VERSION),
)
