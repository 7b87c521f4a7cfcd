"""The metrics file of a run (``<output_dir>/metrics.jsonl``), written by rank 0 from Trainer's
logs (:class:`MetricsLogCallback`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ascend_vlm._files import atomic_write_text

METRICS_FILE = "metrics.jsonl"
# Trainer's log keys that the metrics file names more briefly.
_RENAMED = {"learning_rate": "lr"}


class MetricsLog:
    """Rank 0's JSON-lines metrics file, one object per log event."""

    def __init__(self, path: Path, enabled: bool):
        self.path = path
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step`` (written by a run that crashed later)."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [
            line
            for line in self.path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        atomic_write_text(self.path, "".join(f"{line}\n" for line in kept))

    def read_first(self, key: str) -> Any:
        """The value of ``key`` in the first record holding it, or None (also off rank 0)."""
        if not self.enabled or not self.path.is_file():
            return None
        for line in self.path.read_text(encoding="utf-8").splitlines():
            if line.strip() and key in (record := json.loads(line)):
                return record[key]
        return None

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")


class MetricsLogCallback(TrainerCallback):
    """Writes each of Trainer's log events to ``metrics`` as ``{"step": <global step>, ...}``:
    a training step's ``loss``, ``lr``, ``grad_norm``, ``epoch`` (and the sparse hook's fields,
    when its callback runs first) plus ``step_fields``, an evaluation's ``eval_loss``, the
    run's summary."""

    def __init__(self, metrics: MetricsLog, step_fields: dict[str, Any] | None = None) -> None:
        self.metrics = metrics
        self.step_fields = step_fields or {}

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs:
            fields = {_RENAMED.get(key, key): value for key, value in logs.items()}
            extra = self.step_fields if "loss" in logs else {}
            self.metrics.write({"step": state.global_step, **fields, **extra})
