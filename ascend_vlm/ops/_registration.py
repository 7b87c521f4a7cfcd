"""Registers an op from its spec: schema, kernel, fake kernel and autograd, all in one call.

Dispatch: one ``CompositeExplicitAutograd`` kernel serves every device. It calls the op's NPU
implementation when :func:`ascend_vlm.device.use_npu_kernels` says so (real NPU tensors, or any
tensor under the mock NPU) and the plain-torch reference otherwise.

Eager fast path: the public wrapper runs that same kernel directly, skipping the dispatcher
and the Python autograd wrapper (~15-25 us per call on CPU, see scripts/bench_ops.py), when
nothing could observe the difference: not compiling/exporting, no torch function or dispatch mode
active, only plain tensors (``nn.Parameter`` included: module weights), a first input not on
the meta device (torch rejects meta inputs beside real ones either way) and no gradient needed.
Everything else — autograd, ``torch.compile``, ``torch.export``, fake tensors,
``torch.ops.ascend_vlm.*`` callers — goes through the registered op.

Autograd: backward *recomputes* the forward through the reference implementation under
``torch.enable_grad`` and differentiates it with ``torch.autograd.grad``. That costs one extra
forward per backward, but keeps a single source of truth for the math, is exact for every
backend (the NPU kernels compute the same function) and needs no hand-written gradient per op.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ascend_vlm.device import use_npu_kernels
from ascend_vlm.ops._checks import invalid
from ascend_vlm.ops._spec import OpSpec

_LOG = logging.getLogger(__name__)
_LIBRARY = torch.library.Library("ascend_vlm", "DEF")
# Tensor types the kernel sees exactly as the dispatcher would. nn.Parameter qualifies: it
# disables __torch_function__ (torch.nn.parameter), so module weights stay on the fast path.
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


# Bound once: the eager fast path below runs on every op call, and each `torch.x.y` spelled out
# there is two more attribute lookups per call. Dynamo still recognises the bound functions.
_is_compiling = torch.compiler.is_compiling
_torch_function_modes = torch._C._len_torch_function_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack
_grad_enabled = torch.is_grad_enabled


def register_op(
    spec: OpSpec,
    *,
    reference: Callable[..., torch.Tensor],
    npu: Callable[..., torch.Tensor],
    fake: Callable[..., torch.Tensor],
) -> Callable[..., Callable[..., Any]]:
    """Define ``torch.ops.ascend_vlm.<spec.name>`` and return its ``kernel_for(*tensors)``: the
    public wrapper calls ``kernel_for(<tensor args>)(<all args>)``, which is the op's default
    overload or, on the eager fast path described in the module docstring, its implementation.

    ``reference``, ``npu`` and ``fake`` take the schema's arguments (kwarg-only ones by keyword)
    and must validate their inputs with the op's shared check function. Bind the result in
    ``reference``'s module as ``<spec.name>_kernel_for``: it carries that name, so pickle finds
    it there (patched modules hold it, and a pickled patched model refers to it by name).
    """
    _LIBRARY.define(spec.name + spec.schema())

    first_input = spec.raw["inputs"][0]["name"]

    def kernel(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not isinstance(args[0], torch.Tensor):  # the dispatcher lets None through
            raise invalid(first_input, "a Tensor", type(args[0]).__name__)
        implementation = npu if use_npu_kernels(args[0]) else reference
        return implementation(*args, **kwargs)

    _LIBRARY.impl(spec.name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(spec.qualname, fake, lib=_LIBRARY)

    def setup_context(
        ctx: Any,
        inputs: tuple[Any, ...],
        output: torch.Tensor | tuple[torch.Tensor, ...],
        keyword_only_inputs: dict[str, Any] | None = None,
    ) -> None:
        # Only positional inputs can receive gradients (torch.library's autograd contract), so
        # specs keep differentiable tensors positional.
        ctx.tensor_slots = [i for i, value in enumerate(inputs) if isinstance(value, torch.Tensor)]
        ctx.other_inputs = [None if isinstance(v, torch.Tensor) else v for v in inputs]
        ctx.keyword_only_inputs = keyword_only_inputs or {}
        ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_slots))

    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = list(ctx.other_inputs)
        wanted: list[int] = []
        for slot, saved in zip(ctx.tensor_slots, ctx.saved_tensors, strict=True):
            if ctx.needs_input_grad[slot]:
                inputs[slot] = saved.detach().requires_grad_(True)
                wanted.append(slot)
            else:
                inputs[slot] = saved
        with torch.enable_grad():
            outputs = reference(*inputs, **ctx.keyword_only_inputs)
            # The op marks every output as requiring grad when any input does, but an output
            # computed only from inputs without grad (k_out when only q requires grad, varlen
            # rows with no key) has no graph here, and an output the loss does not use may come
            # without a gradient: differentiate only the outputs that have both. With none left,
            # every wanted gradient is zero.
            pairs = [
                (output, grad)
                for output, grad in zip(
                    outputs if isinstance(outputs, tuple) else (outputs,), grad_outputs, strict=True
                )
                if grad is not None and output.requires_grad
            ]
            grads = (
                torch.autograd.grad(
                    [output for output, _ in pairs],
                    [inputs[i] for i in wanted],
                    [grad for _, grad in pairs],
                    allow_unused=True,
                )
                if pairs
                else tuple(torch.zeros_like(inputs[i]) for i in wanted)
            )
        result: list[torch.Tensor | None] = [None] * len(inputs)
        for slot, grad in zip(wanted, grads, strict=True):
            result[slot] = grad
        return tuple(result)

    torch.library.register_autograd(
        spec.qualname, backward, setup_context=setup_context, lib=_LIBRARY
    )
    _register_descriptor(spec)
    overload = getattr(torch.ops.ascend_vlm, spec.name).default

    def kernel_for(*tensors: torch.Tensor | None) -> Callable[..., Any]:
        """What to call with this call's arguments: the implementation itself when that is
        indistinguishable from calling the op (module docstring), else the registered overload,
        which also reports bad arguments. ``tensors`` are the call's tensor arguments in schema
        order (None for an absent optional one); the first selects the implementation. Called
        per op call, and cheaper than forwarding ``*args, **kwargs`` through one more frame."""
        first = tensors[0]
        if (
            type(first) in _PLAIN_TENSOR_TYPES
            and not _is_compiling()  # first: Dynamo folds it to True and traces no further
            and not first.is_meta  # other inputs on meta fail the device check either way
            and not _dispatch_modes()
            and not _torch_function_modes()
        ):
            grad_enabled = _grad_enabled()
            for tensor in tensors:
                if tensor is not None and (
                    type(tensor) not in _PLAIN_TENSOR_TYPES
                    or (grad_enabled and tensor.requires_grad)
                ):
                    return overload
            return npu if use_npu_kernels(first) else reference
        return overload

    kernel_for.__module__ = reference.__module__
    kernel_for.__name__ = kernel_for.__qualname__ = f"{spec.name}_kernel_for"
    return kernel_for


def _register_descriptor(spec: OpSpec) -> None:
    """Hand the spec to the C++ op registry of ``ascend_vlm._C`` when it is built.

    Without the extension the ops still work; only the registry (used for introspection and the
    simulated runtime) misses them, which is logged at debug level.
    """
    try:
        from ascend_vlm import runtime
    except ImportError as error:
        _LOG.debug(
            "op %s: ascend_vlm.runtime unavailable (%s); descriptor not registered",
            spec.name,
            error,
        )
        return
    register = getattr(runtime, "register_op", None)
    if register is None:
        _LOG.debug("op %s: ascend_vlm.runtime has no register_op yet", spec.name)
        return
    register(spec.descriptor())
