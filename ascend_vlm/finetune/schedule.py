"""The learning-rate schedule of a run.

The learning rate of step s (1-based) of T = ``max_steps`` steps, with W = min(``warmup_steps``,
T) and peak ``learning_rate``, is (:func:`scheduled_lr`)

    lr(s) = peak * s / W                                        for s <= W
    lr(s) = peak * (1 + cos(pi * (s - W) / (T - W + 1))) / 2    for s > W

so no step runs at lr 0: the first warm-up step already moves the weights (peak / W), the peak
is reached at step W, and the cosine decay would reach 0 at step T + 1, one step after the last.
(transformers' ``get_cosine_schedule_with_warmup`` counts steps from 0, so its first step runs at
lr 0 whenever W > 0, a step that updates AdamW's moments but not the weights.) The rate is a
function of the step alone: a resumed run picks it up at its step, and a run resumed with a
larger ``max_steps`` follows the curve for the new count.
"""

from __future__ import annotations

import math


def scheduled_lr(step: int, peak: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (1-based) of ``max_steps``: linear warm-up over
    min(``warmup_steps``, ``max_steps``) steps from ``peak / warmup`` to ``peak``, then cosine
    decay towards 0 at step ``max_steps + 1`` (the module docstring's formula)."""
    warmup = min(warmup_steps, max_steps)
    if step <= warmup:
        return peak * step / warmup
    progress = (step - warmup) / (max_steps - warmup + 1)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))
