"""When a run stops before ``max_steps``: at ``stop_after_steps`` as a crash would (no save), or
on SIGINT / SIGTERM after the step under way, with a checkpoint (:class:`RunInterruption`)."""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterruption(TrainerCallback):
    """Stops training early.

    ``stop_after_steps`` (None: never): training stops after that step as a crash would (saved
    only when ``save_every`` falls on it). SIGINT or SIGTERM (handled from ``on_train_begin`` to ``on_train_end``,
    in the main thread): the step under way finishes, a checkpoint of it is saved and training
    stops, so nothing since the last finished step is lost; ``signal_number`` then names the
    signal. Ranks agree through one all-reduce per step, so every rank stops after the same
    step although the signal reaches each at its own time.
    """

    def __init__(self, stop_after_steps: int | None) -> None:
        self.stop_after_steps = stop_after_steps
        self.signal_number: int | None = None
        self._received = 0
        self._previous: dict[int, Any] = {}

    def _receive(self, signal_number: int, _frame: Any) -> None:
        self._received = signal_number

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._receive) for s in STOP_SIGNALS}

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        received = self._received
        if dist.is_initialized():
            agreed = torch.tensor([received], dtype=torch.int64, device=args.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            received = int(agreed)
        if received:
            self.signal_number = received
            control.should_save = True
            control.should_training_stop = True
        elif self.stop_after_steps is not None and state.global_step >= self.stop_after_steps:
            control.should_training_stop = True
