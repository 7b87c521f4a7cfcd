"""The tracer: hooks on a VLM's stage boundaries that time each request's stages.

Hooks go on four modules only (the vision tower, its projector, the language model and the
model for generation) plus a per-instance ``generate`` wrapper, so a decode step costs a few
clock marks, never a per-layer hook or a host synchronisation. Each stage is also a named range
(``torch.autograd.profiler.record_function``, prefixed ``ascend_vlm::``) that ``torch.profiler``
and the torch_npu profiler show on their timelines. :meth:`Tracer.disable` removes every hook and
the wrapper: a model traced and then untraced is exactly the model it was.

A request opens at ``generate`` or at a forward of the model for generation made outside it;
its language-model stage ends with that forward (the output head included). Inner modules
called on their own (``model.model.visual(...)``) are not requests and are not recorded.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ascend_vlm import trace_events as events
from ascend_vlm._base_model import base_model
from ascend_vlm.models import descriptor_for
from ascend_vlm.models.parts import LANGUAGE_MODEL_ATTRIBUTES, PROJECTOR_MARKERS, VISION_MARKERS
from ascend_vlm.observability.clocks import check_clock, make_clock
from ascend_vlm.observability.timeline import StageSpan, Trace, TracedRequest, TraceMark
from ascend_vlm.patching.ledger import Edits, applied_features, apply_feature, remove_feature


def _child(module: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, nn.Module):
            return child
    return None


def _new_tokens(args: tuple, kwargs: dict) -> int:
    """Sequence length of a language-model call (``inputs_embeds`` or ``input_ids``)."""
    for tensor in (kwargs.get("inputs_embeds"), kwargs.get("input_ids"), *args[:1]):
        if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2:
            return tensor.shape[1]
    return 1


def _compiling() -> bool:
    """Whether torch.compile is tracing: hooks then stand aside (a clock read or profiler range
    would break or be dropped from the graph)."""
    return torch.compiler.is_compiling()


class _OpenStage:
    """A stage begun and not yet ended: its mark, decode step and profiler ranges."""

    def __init__(self, name: str, step: int, clock: Any) -> None:
        self.name, self.step = name, step
        label = f"ascend_vlm::{name}" + (f" {step}" if step else "")
        self.range = torch.autograd.profiler.record_function(label)
        self.range.__enter__()
        self.device_range = clock.open_range(label)
        self.mark = clock.mark()

    def close(self, clock: Any) -> Any:
        """End the ranges; returns the end mark."""
        end = clock.mark()
        clock.close_range(self.device_range)
        self.range.__exit__(None, None, None)
        return end


class Tracer:
    """A ledger feature (``"tracer"``, one per model) that times the stages of every request
    ``model`` serves while enabled.

    ``model`` is a transformers VLM for generation (``...ForConditionalGeneration``; a PEFT
    or ``torch.compile`` wrapper is looked through) whose multimodal model (``.model``, or
    where its family's layout says) holds a language model (``language_model`` or
    ``text_model``) and usually a vision tower and projector (found by the names in
    :mod:`ascend_vlm.models.parts`). ``clock``: "auto" (NPU events when the model's ops run the
    NPU kernels, else ``perf_counter``), "device" or "host". Features that emit
    :mod:`~ascend_vlm.trace_events` for this model (pruning, vision cache, batching)
    appear as marks. Code torch.compile traces runs the hooks inside its graph, where they
    stand aside (a clock read would break the graph): a compiled model's own forward calls are
    not recorded; its ``generate`` (which transformers runs on the wrapped module) is.
    """

    name = "tracer"

    def __init__(self, model: nn.Module, *, clock: str = "auto") -> None:
        base = base_model(model)
        descriptor = descriptor_for(getattr(base, "config", None))
        multimodal = (
            getattr(base, "model", None)
            if descriptor is None
            else descriptor.layout.multimodal_model(base)
        )
        language = _child(multimodal, LANGUAGE_MODEL_ATTRIBUTES) if multimodal is not None else None
        if language is None:
            raise ValueError(
                f"model: expected a transformers VLM for generation with .model."
                f"{{{'|'.join(LANGUAGE_MODEL_ATTRIBUTES)}}}, got {type(model).__name__}"
            )
        self._base = base
        self._multimodal = multimodal
        self._language = language
        self._vision = _child(multimodal, VISION_MARKERS)
        self._projector = _child(multimodal, PROJECTOR_MARKERS)
        if self._projector is None and self._vision is not None:
            self._projector = _child(self._vision, PROJECTOR_MARKERS)
        self._clock_name = clock
        check_clock(clock)
        self.trace = Trace()
        self._reset()

    def _device(self) -> torch.device:
        parameter = next(self._base.parameters(), None)
        return parameter.device if parameter is not None else torch.device("cpu")

    def _reset(self) -> None:
        self._clock: Any = None
        self._requests: list[tuple[str, Any, Any]] = []  # kind, start mark, end mark
        self._request: int | None = None
        self._implicit = False
        self._kind, self._first_call = "", False
        self._steps = 0
        self._open: dict[str, _OpenStage] = {}
        self._spans: list[tuple[int, str, int, Any, Any]] = []
        self._marks: list[tuple[str, Any, int | None, dict]] = []

    @property
    def enabled(self) -> bool:
        return any(f is self for f in applied_features(self._base, self.name))

    # ------------------------------------------------------------------ enable / disable

    def enable(self) -> None:
        """Start a new :attr:`trace` and apply the tracer to the model (a ledger feature).
        RuntimeError when this model is already traced (by this tracer or another)."""
        if applied_features(self._base, self.name):
            raise RuntimeError(
                "model: already traced; disable its tracer (or leave its `trace` block) first"
            )
        self._reset()
        self.trace = Trace()
        self._clock = make_clock(self._clock_name, self._device())
        apply_feature(self._base, self)

    def install(self, edits: Edits) -> None:
        """Ledger feature ``"tracer"``: hooks around the model, its language model, vision tower
        and projector, a ``generate`` wrapper, and this tracer listening to events."""
        hook = edits.add_hook
        base, language = self._base, self._language
        hook(base.register_forward_pre_hook(self._top_begin))
        hook(base.register_forward_hook(self._top_end, always_call=True))
        hook(language.register_forward_pre_hook(self._language_begin, with_kwargs=True))
        if self._vision is not None:
            hook(self._vision.register_forward_pre_hook(self._vision_begin))
            hook(self._vision.register_forward_hook(self._vision_end, always_call=True))
        if self._projector is not None:
            hook(self._projector.register_forward_pre_hook(self._projector_begin))
            hook(self._projector.register_forward_hook(self._projector_end, always_call=True))
        if hasattr(base, "generate"):
            edits.set_attribute(base, "generate", self._traced_generate(base.generate))
        events.add_listener(self._on_event)
        edits.on_undo(functools.partial(events.remove_listener, self._on_event))

    def disable(self) -> Trace:
        """Remove the tracer from the model, read the clock once and return the completed
        :attr:`trace` (no-op returning it when not enabled)."""
        if not self.enabled:
            return self.trace
        remove_feature(self._base, self)
        for name in list(self._open):
            self._end_stage(name)
        if self._request is not None:
            self._end_request()
        self._finish()
        return self.trace

    def _finish(self) -> None:
        marks = [m for _, start, end in self._requests for m in (start, end)]
        marks += [m for *_, start, end in self._spans for m in (start, end)]
        marks += [mark for _, mark, _, _ in self._marks]
        seconds = iter(self._clock.resolve(marks))
        trace = self.trace
        trace.clock = self._clock.name
        for index, (kind, _, _) in enumerate(self._requests):
            trace.requests.append(TracedRequest(index, kind, next(seconds), next(seconds)))
        for request, name, step, _, _ in self._spans:
            start, end = next(seconds), next(seconds)
            trace.spans.append(StageSpan(request, name, start, end, step))
        for name, _, request, fields in self._marks:
            trace.marks.append(TraceMark(name, next(seconds), request, fields))
        trace.complete = True

    # ------------------------------------------------------------------ requests and stages

    def _begin_request(self, kind: str) -> None:
        self._kind, self._first_call = kind, True
        self._request = len(self._requests)
        self._requests.append((kind, self._clock.mark(), None))
        self._steps = 0

    def _end_request(self) -> None:
        kind, start, _ = self._requests[self._request]
        self._requests[self._request] = (kind, start, self._clock.mark())
        self._request = None

    def _begin_stage(self, name: str, step: int = 0) -> None:
        if self._request is None:  # an inner module called on its own: not a request
            return
        self._end_stage(name)  # a stage whose end hook did not run ends where the next begins
        self._open[name] = _OpenStage(name, step, self._clock)

    def _end_stage(self, name: str) -> None:
        stage = self._open.pop(name, None)
        if stage is None:
            return
        end = stage.close(self._clock)
        self._spans.append((self._request, stage.name, stage.step, stage.mark, end))

    def _traced_generate(self, generate: Any) -> Any:
        @functools.wraps(generate)
        def traced(*args: Any, **kwargs: Any) -> Any:
            if self._request is not None:  # generate inside a traced request: one request
                return generate(*args, **kwargs)
            self._begin_request("generate")
            try:
                return generate(*args, **kwargs)
            finally:
                if self.enabled and self._request is not None:  # not disabled meanwhile
                    for name in list(self._open):
                        self._end_stage(name)
                    self._end_request()

        return traced

    def _on_event(self, name: str, source: nn.Module, fields: dict[str, Any]) -> None:
        if source is not self._base and source is not self._multimodal:
            return  # another model's event
        self._marks.append((name, self._clock.mark(), self._request, dict(fields)))

    # ------------------------------------------------------------------ hooks

    def _top_begin(self, module: nn.Module, args: tuple) -> None:
        if _compiling():
            return
        if self._request is None:
            self._implicit = True
            self._begin_request("forward")

    def _top_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if _compiling():
            return
        for name in ("prefill", "decode"):
            self._end_stage(name)
        if self._implicit:
            self._implicit = False
            self._end_request()

    def _language_begin(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if _compiling():
            return
        # Within a generate the first call is the prompt (even a one-token one) and every later
        # call a step (even one re-reading the whole sequence, as without a cache); elsewhere
        # a call with more than one new token per row is a prompt.
        first, self._first_call = self._first_call, False
        prompt = first if self._kind == "generate" else _new_tokens(args, kwargs) > 1
        if prompt:
            self._begin_stage("prefill")
        else:
            self._steps += 1
            self._begin_stage("decode", self._steps)

    def _vision_begin(self, module: nn.Module, args: tuple) -> None:
        if _compiling():
            return
        self._begin_stage("vision_encode")

    def _vision_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if _compiling():
            return
        self._end_stage("vision_encode")

    def _projector_begin(self, module: nn.Module, args: tuple) -> None:
        if _compiling():
            return
        self._end_stage("vision_encode")
        self._begin_stage("projector")

    def _projector_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if _compiling():
            return
        self._end_stage("projector")


@contextlib.contextmanager
def trace(model: nn.Module, *, clock: str = "auto") -> Iterator[Trace]:
    """Trace ``model`` for the block: yields the :class:`Trace`, complete after the block.

    >>> with ascend_vlm.trace(model) as timeline:
    ...     model.generate(**inputs, max_new_tokens=8)
    >>> print(timeline.summary())
    """
    tracer = Tracer(model, clock=clock)
    tracer.enable()
    try:
        yield tracer.trace
    finally:
        tracer.disable()
