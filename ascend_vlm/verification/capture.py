"""Capturing what a model computes at its capture points, as a ledger feature.

:class:`Capture` (ledger feature ``"verify_capture"``, stacked above `patch` and every other
feature, so it sees what the model really computes) hands each capture to a sink as soon as
the module returns: ``sink(key, tensors)`` with ``key = (point name, call index)`` (a module
called several times in one forward, such as a rotary function per q and k, gives one key per
call) and ``tensors`` the output's hidden states (`output_tensors`). What the sink keeps is its
own choice; the feature keeps nothing.

Modules are captured by a forward hook. A RoPE point is captured inside its attention module's
forward: the forward is rebuilt (`patching.rebound_globals.with_globals`) with its module-level
rotary function resolved to a recorder around the function the module resolves it to now (the
modeling module's in a stock model, the `patching.adapters` drop-in in a patched one), so the
rotated q/k are seen whichever runs. An attention module whose forward another feature replaced
by something else is not captured there.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ascend_vlm._base_model import base_model
from ascend_vlm._compat.decorators import undecorated_forward
from ascend_vlm._compat.module_internals import forward_attribute
from ascend_vlm.patching.ledger import Edits, apply_feature, remove_feature
from ascend_vlm.patching.rebound_globals import ReboundForward, with_globals
from ascend_vlm.verification.capture_points import CapturePoint

CaptureKey = tuple[str, int]
Sink = Callable[[CaptureKey, tuple[torch.Tensor, ...]], None]
# on_call(key, target, args, kwargs): the module or rotary function a capture came from, and
# the arguments of that call.
CallSink = Callable[[CaptureKey, Callable, tuple, dict], None]


def output_tensors(output: Any, *, every: bool = False) -> tuple[torch.Tensor, ...]:
    """The hidden states in a module's ``output``: the tensor itself, or the first tensor of a
    tuple, list or ModelOutput (attention weights, router logits and caches that follow are
    not compared); with ``every``, every tensor of a tuple (a rotary function's q and k)."""
    if isinstance(output, torch.Tensor):
        return (output,)
    values = output.values() if isinstance(output, Mapping) else output
    if not isinstance(values, (tuple, list)) and not isinstance(output, Mapping):
        return ()
    tensors = tuple(value for value in values if isinstance(value, torch.Tensor))
    return tensors if every else tensors[:1]


def _resolved_function(forward: object, function_name: str) -> Callable | None:
    """The function ``forward`` (a class forward, possibly decorated, or a rebound one) calls
    under the module-level name ``function_name``, or None when it is not a Python function
    reading it from its globals."""
    while hasattr(forward, "__wrapped__"):
        forward = forward.__wrapped__
    return getattr(forward, "__globals__", {}).get(function_name)


class Capture:
    """Ledger feature: each of ``points`` of ``model`` hands what it computes to ``sink`` (see
    the module docstring) and, with ``on_call``, the call it came from to ``on_call`` (a repro
    of one call is made from it); call indices restart at every `reset`."""

    name = "verify_capture"

    def __init__(
        self,
        model: nn.Module,
        points: list[CapturePoint],
        sink: Sink,
        on_call: CallSink | None = None,
    ) -> None:
        self.base = base_model(model)
        self.points = list(points)
        self.sink = sink
        self.on_call = on_call
        self.calls: dict[str, int] = {}

    def reset(self) -> None:
        """Count calls from 0 again (before each input)."""
        self.calls.clear()

    def _record(
        self,
        point: CapturePoint,
        tensors: tuple[torch.Tensor, ...],
        call: tuple[Callable, tuple, dict],
    ) -> None:
        if not tensors:
            return
        index = self.calls.get(point.name, 0)
        self.calls[point.name] = index + 1
        self.sink((point.name, index), tensors)
        if self.on_call is not None:
            self.on_call((point.name, index), *call)

    def _hook(
        self, point: CapturePoint, module: nn.Module, args: tuple, kwargs: dict, output: Any
    ) -> None:
        self._record(point, output_tensors(output), (module, args, kwargs))

    def _recorder(self, point: CapturePoint, function: Callable) -> Callable:
        @functools.wraps(function)
        def recording(*args: Any, **kwargs: Any) -> Any:
            output = function(*args, **kwargs)
            self._record(point, output_tensors(output, every=True), (function, args, kwargs))
            return output

        return recording

    def _rope_forward(self, point: CapturePoint, module: nn.Module) -> Callable | None:
        """The module's forward with its rotary function recorded, or None when its forward
        is neither its class's nor one `patch` rebound."""
        current = vars(module).get(forward_attribute(module))
        if current is not None and not isinstance(current, ReboundForward):
            return None
        if isinstance(undecorated_forward(type(module)), str):
            return None
        resolved = _resolved_function(
            type(module).forward if current is None else current.func, point.rope_function
        )
        if resolved is None:
            return None
        recorder = self._recorder(point, resolved)
        rebuilt = with_globals(type(module).forward, {point.rope_function: recorder})
        return functools.partial(rebuilt, module)

    def install(self, edits: Edits) -> None:
        modules = dict(self.base.named_modules())
        for point in self.points:
            module = modules[point.module]
            if point.rope_function is None:
                hook = functools.partial(self._hook, point)
                edits.add_hook(module.register_forward_hook(hook, with_kwargs=True))
                continue
            forward = self._rope_forward(point, module)
            if forward is not None:
                edits.set_attribute(module, "forward", forward)


@contextlib.contextmanager
def capturing(
    model: nn.Module, points: list[CapturePoint], sink: Sink, on_call: CallSink | None = None
) -> Iterator[Capture]:
    """``with capturing(model, points, sink) as capture:`` a :class:`Capture` applied for the
    block."""
    capture = Capture(model, points, sink, on_call)
    apply_feature(capture.base, capture)
    try:
        yield capture
    finally:
        remove_feature(capture.base, capture)
