"""Functions transformers decorates: rebuilding a decorator's wrapper around another function
(`rewrap`), finding the function kernels turned into a module (`plain_function`), and whether a
class's forward can have its RoPE function rebound (`rope_problem`).

========================== ==========================================================================
probe                      detail
========================== ==========================================================================
deprecate-kwarg-wrapper    ``deprecate_kwarg`` (on attention forwards since 5.24) keeps the function
                           in one closure cell, so `rewrap` rebuilds it around the RoPE-rebound one.
kernels-wrappers           with ``kernels`` installed (a dependency of transformers >= 5.25): the
                           class wrapper of ``use_kernelized_func`` is rebuilt by `rewrap`, and
                           `plain_function` finds the function ``use_kernel_forward_from_hub``
                           turned into a module.
========================== ==========================================================================

Neither can go by raising the lowest supported version: the decorators are on the newest tested
version's attention forwards (``deprecate_kwarg`` from 5.24, ``use_kernelized_func`` on 5.17 and
5.25 with ``kernels`` installed).
"""

from __future__ import annotations

import inspect
import os
import sys
import types
import warnings
from collections.abc import Callable

from ascend_vlm._compat.probe import NEEDED_ON_EVERY_SUPPORTED_VERSION, Probe

ROPE_PARAMETERS = {
    "text": ("q", "k", "cos", "sin", "unsqueeze_dim"),
    "text-interleaved": ("q", "k", "cos", "sin", "unsqueeze_dim"),
    "vision": ("q", "k", "cos", "sin"),
    "text-single": ("x", "cos", "sin", "unsqueeze_dim"),
    "axial": ("x", "cos", "sin", "position_ids", "unsqueeze_dim"),
    "complex": ("xq", "xk", "freqs_cis"),
    "complex_vision": ("query", "key", "freqs_ci"),
}


def _from_kernels(function: object) -> bool:
    """Whether `function` was defined inside the installed ``kernels`` package."""
    kernels = sys.modules.get("kernels")
    code = getattr(function, "__code__", None)
    if kernels is None or code is None or kernels.__file__ is None:
        return False
    return code.co_filename.startswith(os.path.dirname(kernels.__file__) + os.sep)


def plain_function(function: object) -> object:
    """The function kernels' ``use_kernel_forward_from_hub`` turned into a module instance (its
    forward dispatches to a hub kernel or calls the function), or `function` itself."""
    forward = getattr(type(function), "forward", None)
    if not _from_kernels(forward):
        return function
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or (), strict=True))
    return cells["func"].cell_contents if "func" in cells else function


def _cell_of_wrapped(wrapper: Callable) -> int | None:
    """Index of the one closure cell of `wrapper` holding ``wrapper.__wrapped__``, else None."""
    wrapped = getattr(wrapper, "__wrapped__", None)
    cells = getattr(wrapper, "__closure__", None) or ()
    held = [index for index, cell in enumerate(cells) if _contents(cell) is wrapped]
    return held[0] if len(held) == 1 else None


def _contents(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # a cell whose variable is not assigned yet
        return None


def rewrap(wrapper: types.FunctionType, inner: Callable) -> types.FunctionType:
    """A copy of the decorator's `wrapper` that calls `inner` where it called its ``__wrapped__``.

    transformers decorates attention forwards (``deprecate_kwarg``; kernels'
    ``use_kernelized_func`` when installed) with functions that keep the decorated function in
    one closure cell; the copy keeps what the decorator does (kwarg renames, kernel routing).
    Raises ValueError when no single cell holds ``__wrapped__``.
    """
    index = _cell_of_wrapped(wrapper)
    if index is None:
        raise ValueError(
            f"wrapper: expected one closure cell holding __wrapped__, got {wrapper.__code__.co_name}"
            f" from {wrapper.__code__.co_filename}"
        )
    closure = list(wrapper.__closure__)
    closure[index] = types.CellType(inner)
    clone = types.FunctionType(
        wrapper.__code__,
        wrapper.__globals__,
        wrapper.__name__,
        wrapper.__defaults__,
        tuple(closure),
    )
    clone.__kwdefaults__ = wrapper.__kwdefaults__
    clone.__qualname__ = wrapper.__qualname__
    clone.__dict__.update(wrapper.__dict__)
    clone.__wrapped__ = inner
    return clone


def undecorated_forward(cls: type) -> types.FunctionType | str:
    """`cls.forward` under every decorator `rewrap` can rebuild around a rebound copy, or why
    it cannot be reached (a decorator keeping it elsewhere than one closure cell, a forward that
    is not a Python function)."""
    forward = cls.forward
    while hasattr(forward, "__wrapped__"):
        if _cell_of_wrapped(forward) is None:
            code = getattr(forward, "__code__", None)
            where = f"{code.co_name} ({code.co_filename})" if code else repr(forward)
            return f"{cls.__name__}.forward is decorated by {where}, which rebinding cannot rebuild"
        forward = forward.__wrapped__
    if not isinstance(forward, types.FunctionType):
        return f"{cls.__name__}.forward is not a Python function: {forward!r}"
    return forward


def parameters_problem(function: object, name: str, expected: tuple[str, ...]) -> str | None:
    """Why `function` (module-level `name`, possibly turned into a module by kernels) does not
    take exactly the parameters `expected`, or None when it does."""
    original = plain_function(function)
    parameters = tuple(inspect.signature(original).parameters) if callable(original) else ()
    if parameters != expected:
        return f"{name}{parameters} does not have the expected signature {expected}"
    return None


def rope_problem(cls: type, function_name: str, style: str) -> str | None:
    """Why `cls`'s forward cannot have its module-level `function_name` (a RoPE function of
    `style`, a key of ``ROPE_PARAMETERS``) resolved to an adapter, or None when it can.

    A decorated forward qualifies when each decorator can be rebuilt around the rebound function
    (`rewrap`)."""
    forward = undecorated_forward(cls)
    if isinstance(forward, str):
        return forward
    if function_name not in forward.__code__.co_names:
        return f"{cls.__name__}.forward does not call {function_name}"
    function = forward.__globals__.get(function_name)
    return parameters_problem(function, function_name, ROPE_PARAMETERS[style])


def _rewrapped_call(wrapper: types.FunctionType, *args, **kwargs) -> object:
    """What `wrapper` rebuilt around a recorder hands to the function it decorates."""
    calls = []
    rewrap(wrapper, lambda *a, **k: calls.append((a, k)))(*args, **kwargs)
    return calls[0] if calls else None


def _deprecate_kwarg_wrapper() -> str | None:
    from transformers.utils.deprecation import deprecate_kwarg

    def forward(self, cache=None):
        return cache

    wrapper = deprecate_kwarg("past_key_values", "99.0.0", new_name="cache")(forward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        call = _rewrapped_call(wrapper, "self", past_key_values=1)
    if call != (("self",), {"cache": 1}):
        return f"deprecate_kwarg's wrapper, rebuilt by rewrap, passed on {call} instead of cache=1"
    return None


def _kernels_wrappers() -> str | None:
    try:
        from kernels import use_kernel_forward_from_hub, use_kernelized_func
    except ImportError:
        return None  # transformers then defines plain functions and forwards
    import torch

    def rotate(q, k, cos, sin):
        return q, k

    hub_function = use_kernel_forward_from_hub("ascend_vlm_probe")(rotate)

    class Module(torch.nn.Module):
        def forward(self, x):
            return hub_function(x, x, x, x)

    module = use_kernelized_func(hub_function)(Module)()
    if plain_function(hub_function) is not rotate:
        return "plain_function does not find the function use_kernel_forward_from_hub wraps"
    call = _rewrapped_call(Module.forward, module, 2)
    if call != ((module, 2), {}):
        return f"use_kernelized_func's wrapper, rebuilt by rewrap, passed on {call}"
    return None


DECORATOR_PROBES = (
    Probe("deprecate-kwarg-wrapper", _deprecate_kwarg_wrapper, NEEDED_ON_EVERY_SUPPORTED_VERSION),
    Probe("kernels-wrappers", _kernels_wrappers, NEEDED_ON_EVERY_SUPPORTED_VERSION),
)
