"""The metrics file of a run (``<output_dir>/metrics.jsonl``), written by rank 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ascend_vlm.finetune import checkpoint

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Rank 0's JSON-lines metrics file, one object per optimizer step."""

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
        checkpoint.atomic_write_text(self.path, "".join(f"{line}\n" for line in kept))

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
