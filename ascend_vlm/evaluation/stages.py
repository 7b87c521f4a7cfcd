"""Per-stage latency of one greedy generation: vision encode, prefill, decode.

Shared by ``python -m ascend_vlm demo`` (one image) and ``python -m ascend_vlm eval`` (one
batch at a time). The stages are measured as follows:

* vision encode: the model's ``model.get_image_features`` alone on the batch's images, run
  once separately before the generation (the generation encodes the images again inside its
  prefill);
* prefill: from the call to ``generate`` to the first logits-processor call, i.e. the forward
  pass over the whole prompt, vision included, that yields the first new token;
* decode: from that first call to the end of ``generate``; it holds ``steps`` forward passes,
  one per further token (``steps`` is the number of logits-processor calls minus one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

# Keys of a processor's output that belong to the text; the rest feed the vision tower.
TEXT_KEYS = frozenset({"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids"})


@dataclass(frozen=True)
class StageTimes:
    """Seconds spent in each stage of one generation (see the module docstring)."""

    vision_seconds: float
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int

    @property
    def decode_seconds_per_token(self) -> float | None:
        """Mean seconds per decode step; None when prefill produced the only token."""
        if self.decode_steps == 0:
            return None
        return self.decode_seconds / self.decode_steps


class _StepClock:
    """Logits processor that timestamps every generation step (called once per new token)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


def vision_inputs(inputs: Any) -> dict[str, Any]:
    """The entries of a processor output that ``get_image_features`` takes (pixels, grids)."""
    return {key: value for key, value in inputs.items() if key not in TEXT_KEYS}


def vision_encode_seconds(model: Any, inputs: Any) -> float:
    """Wall seconds of the class's ``get_image_features`` of ``model.model`` on the images of
    ``inputs``: the encoder's own cost, past any per-instance wrapper (a vision cache would
    otherwise answer the generation's own encoding from this one)."""
    inner = model.model
    start = time.perf_counter()
    type(inner).get_image_features(inner, **vision_inputs(inputs))
    return time.perf_counter() - start


def generate_with_stage_times(
    model: Any, inputs: Any, **generate_kwargs: Any
) -> tuple[torch.Tensor, StageTimes]:
    """``model.generate(**inputs, **generate_kwargs)`` with its :class:`StageTimes`.

    Call under ``torch.no_grad()``. ``generate_kwargs`` must not carry a ``logits_processor``
    (the step clock is one). Returns the generated sequences (prompt included) and the times.
    """
    from transformers import LogitsProcessorList

    vision_seconds = vision_encode_seconds(model, inputs)
    clock = _StepClock()
    start = time.perf_counter()
    output = model.generate(
        **inputs, logits_processor=LogitsProcessorList([clock]), **generate_kwargs
    )
    end = time.perf_counter()
    times = StageTimes(
        vision_seconds=vision_seconds,
        prefill_seconds=clock.stamps[0] - start,
        decode_seconds=end - clock.stamps[0],
        decode_steps=len(clock.stamps) - 1,
    )
    return output, times
