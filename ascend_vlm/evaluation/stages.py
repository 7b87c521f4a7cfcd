"""Per-stage latency of one greedy generation of ``python -m ascend_vlm eval`` (one batch at a
time), read from :func:`ascend_vlm.observability.trace`. The stages are the tracer's: vision encode (the vision tower and its
projector, as the generation ran them: a vision-cache hit skips them), prefill (the language
model and output head over the prompt, yielding the first new token) and decode (one forward
per further token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ascend_vlm.observability import Trace, trace


@dataclass(frozen=True)
class StageTimes:
    """Seconds spent in each stage of one generation (see the module docstring)."""

    vision_seconds: float
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int

    @classmethod
    def of_request(cls, timeline: Trace, request: int) -> StageTimes:
        """The stage times of request ``request`` of a completed trace."""
        return cls(
            vision_seconds=timeline.stage_seconds(request, "vision_encode")
            + timeline.stage_seconds(request, "projector"),
            prefill_seconds=timeline.stage_seconds(request, "prefill"),
            decode_seconds=timeline.stage_seconds(request, "decode"),
            decode_steps=timeline.decode_steps(request),
        )

    @property
    def decode_seconds_per_token(self) -> float | None:
        """Mean seconds per decode step; None when prefill produced the only token."""
        if self.decode_steps == 0:
            return None
        return self.decode_seconds / self.decode_steps


def generate_with_stage_times(
    model: Any, inputs: Any, **generate_kwargs: Any
) -> tuple[torch.Tensor, StageTimes]:
    """``model.generate(**inputs, **generate_kwargs)`` traced, with its :class:`StageTimes`.

    Call under ``torch.no_grad()``. Returns the generated sequences (prompt included) and the
    times.
    """
    with trace(model) as timeline:
        output = model.generate(**inputs, **generate_kwargs)
    return output, StageTimes.of_request(timeline, 0)
