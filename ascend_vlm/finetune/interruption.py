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
    only when ``save_every`` falls on it). SIGINT or SIGTERM (handled from ``on_train_begin`` to
    ``on_train_end``, in the main thread): training stops after a finished step with a checkpoint
    of it, so nothing since the last finished step is lost; ``signal_number`` then names the
    signal. Ranks agree through an all-reduce started at the end of every step and read at the
    end of the next, so no rank waits for it: a signal received during step ``n`` stops every
    rank after step ``n + 1`` (after step ``n`` in one process), although it reaches each rank
    at its own time.
    """

    def __init__(self, stop_after_steps: int | None) -> None:
        self.stop_after_steps = stop_after_steps
        self.signal_number: int | None = None
        self._received = 0
        self._previous: dict[int, Any] = {}
        # The all-reduce started at the end of the previous step: (its tensor, its work).
        self._agreeing: tuple[torch.Tensor, Any] | None = None

    def _receive(self, signal_number: int, _frame: Any) -> None:
        self._received = signal_number

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._receive) for s in STOP_SIGNALS}

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._agreeing is not None:  # every rank started it, so every rank finishes it
            self._agreeing[1].wait()
            self._agreeing = None
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        received = self._received if not dist.is_initialized() else self._agreed(args.device)
        if received:
            self.signal_number = received
            control.should_save = True
            control.should_training_stop = True
        elif self.stop_after_steps is not None and state.global_step >= self.stop_after_steps:
            control.should_training_stop = True

    def _agreed(self, device: torch.device) -> int:
        """The largest signal number any rank had received when the previous step ended (0:
        none); starts the same question for this step."""
        received = 0
        if self._agreeing is not None:
            agreed, work = self._agreeing
            work.wait()
            received = int(agreed)
        agreed = torch.tensor([self._received], dtype=torch.int64, device=device)
        self._agreeing = (agreed, dist.all_reduce(agreed, op=dist.ReduceOp.MAX, async_op=True))
        return received
