"""Builds an op from its spec: the ``torch.library`` op (schema, kernel, fake kernel, autograd)
and its public Python function, in one call of :func:`define_op`.

``op_plugins/<op>/spec.json`` is the op's one declaration of argument names, order, defaults and
keyword-only-ness; the functions taking the op's arguments are generated from it. An op module
supplies what a spec cannot say, each taking the spec's arguments positionally in spec order:

* ``check(*args)`` validates a call (every failure a ``ValueError`` naming the argument) and
  returns what the implementations need from it (e.g. the call's geometry) or None. It runs
  once per call, at one place on each path: the public function's eager fast path, the
  registered kernel and the fake kernel.
* ``reference(checked, *args)``: the plain-torch math, also what backward differentiates.
* ``npu(checked, *args)``: the torch_npu kernel call (the reference for what it does not take).
* ``fake(checked, *args)``: empty outputs of the right shapes and dtypes, for ``torch.compile``,
  ``torch.export`` and meta tensors.

Dispatch: one ``CompositeExplicitAutograd`` kernel serves every device. It calls ``npu`` when
:func:`ascend_vlm.kernel_backend.use_npu_kernels` says so (real NPU tensors, or any tensor under
the mock NPU) and ``reference`` otherwise.

Eager fast path: the public function runs that same kernel body directly, skipping the
dispatcher and the Python autograd wrapper (see scripts/bench_ops.py), when nothing could observe
the difference: not compiling/exporting, no torch function or dispatch mode active, only plain
tensors (``nn.Parameter`` included: module weights), a first input not on the meta device (torch
rejects meta inputs beside real ones either way) and no gradient needed. Everything else —
autograd, ``torch.compile``, ``torch.export``, fake tensors, ``torch.ops.ascend_vlm.*`` callers —
goes through the registered op.

Autograd: backward *recomputes* the forward through ``reference`` under ``torch.enable_grad`` and
differentiates it with ``torch.autograd.grad``. That costs one extra forward per backward, but
keeps a single source of truth for the math, is exact for every backend (the NPU kernels compute
the same function) and needs no hand-written gradient per op.
"""

from __future__ import annotations

import inspect
import linecache
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ascend_vlm._compat.torch_internals import torch_mode_stack_depths
from ascend_vlm.kernel_backend import use_npu_kernels
from ascend_vlm.ops._checks import invalid
from ascend_vlm.ops._op_spec import OpSpec

_LOG = logging.getLogger(__name__)
_LIBRARY = torch.library.Library("ascend_vlm", "DEF")
# Tensor types the kernel sees exactly as the dispatcher would. nn.Parameter qualifies: it
# disables __torch_function__ (torch.nn.parameter), so module weights stay on the fast path.
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_torch_function_modes, _dispatch_modes = torch_mode_stack_depths()

# The generated functions. `{signature}` is the spec's, with defaults named `_default_<arg>`;
# `{args}` passes every argument positionally in spec order.
_GUARD = """\
    if not isinstance({first}, _Tensor):  # the dispatcher lets None through
        raise _invalid({first!r}, "a Tensor", type({first}).__name__)
"""
_KERNEL = (
    "def {name}({signature}):\n"
    + _GUARD
    + """\
    checked = _check({args})
    return (_npu if _use_npu_kernels({first}) else _reference)(checked, {args})
"""
)
_FAKE = "def {name}({signature}):\n" + _GUARD + "    return _fake(_check({args}), {args})\n"
# The fast-path conditions are spelled out inline, with the module-level names bound once: this
# runs on every op call, where each extra frame or attribute lookup is a measurable share of a
# small op. The compiling test comes early: Dynamo folds it to True and traces no further.
_PUBLIC = """\
def {name}({signature}):
{fills}    if (
        type({first}) in _plain
        and not _is_compiling()
        and not {first}.is_meta
        and not _dispatch_modes()
        and not _torch_function_modes(){plain_others}
        and not (_grad_enabled() and ({requires_grad}))
    ):
        checked = _check({args})
        return (_npu if _use_npu_kernels({first}) else _reference)(checked, {args})
    return _overload({overload_args})
"""


def define_op(
    spec: OpSpec,
    *,
    check: Callable[..., Any],
    reference: Callable[..., Any],
    npu: Callable[..., Any],
    fake: Callable[..., Any],
    doc: str,
    fills: Mapping[str, Callable[..., Any]] | None = None,
) -> Callable[..., Any]:
    """Define ``torch.ops.ascend_vlm.<spec.name>`` from ``check``, ``reference``, ``npu`` and
    ``fake`` (module docstring) and return its public function, with the signature
    ``spec.signature()`` and docstring ``doc``.

    ``fills`` maps an argument to a function of the arguments its parameters name, whose result
    replaces that argument in the public function before anything else runs (callers of
    ``torch.ops.ascend_vlm.*`` pass it themselves): e.g. a dropout seed drawn when None.

    Bind the result in ``reference``'s module under ``spec.name``: it carries that module and
    name, so pickle finds it there (patched modules hold the public ops).
    """
    _LIBRARY.define(spec.name + spec.schema())
    namespace: dict[str, Any] = {
        "_Tensor": torch.Tensor,
        "_invalid": invalid,
        "_check": check,
        "_reference": reference,
        "_npu": npu,
        "_fake": fake,
        "_use_npu_kernels": use_npu_kernels,
        "_plain": _PLAIN_TENSOR_TYPES,
        "_is_compiling": torch.compiler.is_compiling,
        "_dispatch_modes": _dispatch_modes,
        "_torch_function_modes": _torch_function_modes,
        "_grad_enabled": torch.is_grad_enabled,
    }
    module = reference.__module__
    _LIBRARY.impl(
        spec.name,
        _generate(spec, "kernel", _KERNEL, namespace, module),
        "CompositeExplicitAutograd",
    )
    fake_kernel = _generate(spec, "fake", _FAKE, namespace, module)
    torch.library.register_fake(spec.qualname, fake_kernel, lib=_LIBRARY)
    _register_autograd(spec, check, reference)
    _register_descriptor(spec)
    namespace["_overload"] = getattr(torch.ops.ascend_vlm, spec.name).default
    fill_lines = ""
    for argument, fill in (fills or {}).items():
        namespace[f"_fill_{argument}"] = fill
        parameters = ", ".join(inspect.signature(fill).parameters)
        fill_lines += f"    {argument} = _fill_{argument}({parameters})\n"
    public = _generate(spec, "public function", _PUBLIC, namespace, module, fills=fill_lines)
    public.__doc__ = doc
    return public


def _generate(
    spec: OpSpec, role: str, template: str, namespace: dict[str, Any], module: str, **extra: str
) -> Callable[..., Any]:
    """``template`` filled in for ``spec`` and executed in ``namespace``: a function named
    ``spec.name`` of ``module`` whose signature is ``spec.signature()``."""
    signature = spec.signature()
    parameters = list(signature.parameters.values())
    tensors = [entry["name"] for entry in spec.raw["inputs"]]
    optional = {entry["name"] for entry in spec.raw["inputs"] if entry.get("optional", False)}
    first, others = tensors[0], tensors[1:]
    for parameter in parameters:
        if parameter.default is not inspect.Parameter.empty:
            namespace[f"_default_{parameter.name}"] = parameter.default
    rendered = []
    for parameter in parameters:
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and "*" not in rendered:
            rendered.append("*")
        has_default = parameter.default is not inspect.Parameter.empty
        rendered.append(
            f"{parameter.name}=_default_{parameter.name}" if has_default else parameter.name
        )
    plain_others = "".join(
        f"\n        and ({t} is None or type({t}) in _plain)"
        if t in optional
        else f"\n        and type({t}) in _plain"
        for t in others
    )
    requires_grad = " or ".join(
        f"({t} is not None and {t}.requires_grad)" if t in optional else f"{t}.requires_grad"
        for t in tensors
    )
    source = template.format(
        name=spec.name,
        signature=", ".join(rendered),
        args=", ".join(p.name for p in parameters),
        first=first,
        plain_others=plain_others,
        requires_grad=requires_grad,
        overload_args=", ".join(
            f"{p.name}={p.name}" if p.kind is inspect.Parameter.KEYWORD_ONLY else p.name
            for p in parameters
        ),
        **extra,
    )
    filename = f"<ascend_vlm.ops.{spec.name} {role}, generated from its spec>"
    exec(compile(source, filename, "exec"), namespace)
    # Tracebacks and inspect.getsource show the generated lines.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    function = namespace.pop(spec.name)
    function.__module__ = module
    return function


def _register_autograd(
    spec: OpSpec, check: Callable[..., Any], reference: Callable[..., Any]
) -> None:
    """Backward by recomputing ``reference`` (module docstring)."""
    keyword_only = [
        name
        for name, parameter in spec.signature().parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    ]

    def setup_context(
        ctx: Any,
        inputs: tuple[Any, ...],
        output: torch.Tensor | tuple[torch.Tensor, ...],
        keyword_only_inputs: dict[str, Any] | None = None,
    ) -> None:
        # Only positional inputs can receive gradients (torch.library's autograd contract), so
        # specs keep differentiable tensors positional.
        ctx.tensor_slots = [i for i, value in enumerate(inputs) if isinstance(value, torch.Tensor)]
        given = keyword_only_inputs or {}
        ctx.other_inputs = [None if isinstance(v, torch.Tensor) else v for v in inputs] + [
            given[name] for name in keyword_only
        ]
        ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_slots))

    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        args = list(ctx.other_inputs)
        wanted: list[int] = []
        for slot, saved in zip(ctx.tensor_slots, ctx.saved_tensors, strict=True):
            if ctx.needs_input_grad[slot]:
                args[slot] = saved.detach().requires_grad_(True)
                wanted.append(slot)
            else:
                args[slot] = saved
        with torch.enable_grad():
            outputs = reference(check(*args), *args)
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
                    [args[i] for i in wanted],
                    [grad for _, grad in pairs],
                    allow_unused=True,
                )
                if pairs
                else tuple(torch.zeros_like(args[i]) for i in wanted)
            )
        result: list[torch.Tensor | None] = [None] * (len(args) - len(keyword_only))
        for slot, grad in zip(wanted, grads, strict=True):
            result[slot] = grad
        return tuple(result)

    torch.library.register_autograd(
        spec.qualname, backward, setup_context=setup_context, lib=_LIBRARY
    )


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
    runtime.register_op(spec.descriptor())


def empty_like_first_input(_checked: object, first: torch.Tensor, *_: object) -> torch.Tensor:
    """The ``fake`` of an op whose one output has its first input's shape and dtype."""
    return torch.empty_like(first)
