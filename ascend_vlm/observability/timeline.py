"""What a trace recorded: requests, their stages, the instant events features emitted, and
the views of them people read: a summary table, Chrome trace JSON, a stage matrix.

Times are seconds since the trace began, on the trace's clock ("host": ``perf_counter``;
"device": NPU events). A request is one ``generate`` call, or one forward of the model made
outside ``generate``. Its stages never overlap and come in model order: ``vision_encode`` (the
vision tower up to its projector), ``projector`` (the projector or merger), then ``prefill`` (the
language model and output head over a prompt: a ``generate``'s first call, or any call with
more than one new token per row) or ``decode`` (one new token per row, numbered from 1 within
the request).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STAGES = ("vision_encode", "projector", "prefill", "decode")


@dataclass(frozen=True)
class StageSpan:
    """Stage ``name`` of request ``request``, from ``start`` to ``end`` seconds; ``step`` numbers
    the decode steps of a request from 1 (0 for the other stages)."""

    request: int
    name: str
    start: float
    end: float
    step: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def label(self) -> str:
        return f"{self.name} {self.step}" if self.step else self.name


@dataclass(frozen=True)
class TraceMark:
    """Instant event ``name`` with its ``fields`` at ``time`` seconds, during request
    ``request`` (None: between requests)."""

    name: str
    time: float
    request: int | None
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TracedRequest:
    """Request ``index``: a ``generate`` call or a lone forward (``kind``), ``start`` to ``end``."""

    index: int
    kind: str
    start: float
    end: float


@dataclass
class Trace:
    """The record of one enabled period of a :class:`~ascend_vlm.observability.Tracer`; empty
    until the tracer is disabled (``complete`` False)."""

    clock: str = ""
    requests: list[TracedRequest] = field(default_factory=list)
    spans: list[StageSpan] = field(default_factory=list)
    marks: list[TraceMark] = field(default_factory=list)
    complete: bool = False

    def _check_complete(self) -> None:
        if not self.complete:
            raise RuntimeError(
                "trace: still recording; read it after the `with ascend_vlm.trace(model)` block "
                "(or Tracer.disable())"
            )

    def stages_of(self, request: int) -> list[StageSpan]:
        """The stages of request ``request`` in time order. ValueError for a request the
        trace does not hold."""
        self._check_complete()
        if not isinstance(request, int) or not 0 <= request < len(self.requests):
            raise ValueError(
                f"request: expected an index in [0, {len(self.requests)}), got {request!r}"
            )
        return sorted((s for s in self.spans if s.request == request), key=lambda s: s.start)

    def stage_seconds(self, request: int, name: str) -> float:
        """Total seconds request ``request`` spent in stage ``name`` (0 when absent)."""
        if name not in STAGES:
            raise ValueError(f"name: expected one of {', '.join(STAGES)}, got {name!r}")
        return sum(span.seconds for span in self.stages_of(request) if span.name == name)

    def decode_steps(self, request: int) -> int:
        """Decode steps request ``request`` ran."""
        return sum(1 for span in self.stages_of(request) if span.name == "decode")

    # ------------------------------------------------------------------ views

    def summary(self) -> str:
        """A table of each stage over all requests: calls, total, mean, median and max
        milliseconds, share of the traced requests' time; an ``other`` row for the requests'
        time outside every stage; then the request count and clock."""
        self._check_complete()
        traced = sum(request.end - request.start for request in self.requests)
        lines = [
            f"{'stage':<14}{'calls':>6}{'total ms':>11}{'mean ms':>10}{'p50 ms':>10}"
            f"{'max ms':>10}{'share':>8}"
        ]
        for name in STAGES:
            seconds = [span.seconds for span in self.spans if span.name == name]
            if not seconds:
                continue
            share = f"{sum(seconds) / traced:7.1%}" if traced > 0 else "      -"
            lines.append(
                f"{name:<14}{len(seconds):>6}{sum(seconds) * 1e3:>11.2f}"
                f"{statistics.fmean(seconds) * 1e3:>10.2f}{statistics.median(seconds) * 1e3:>10.2f}"
                f"{max(seconds) * 1e3:>10.2f} {share}"
            )
        outside = traced - sum(span.seconds for span in self.spans)
        share = f"{outside / traced:7.1%}" if traced > 0 else "      -"
        lines.append(f"{'other':<14}{'':>6}{outside * 1e3:>11.2f}{'':>30} {share}")
        lines.append(
            f"{len(self.requests)} request(s), {traced * 1e3:.2f} ms traced, {self.clock} clock; "
            "other: generation outside the stages (embedding, sampling, bookkeeping)"
        )
        return "\n".join(lines)

    def stage_matrix(self) -> tuple[list[str], list[str], list[list[float]]]:
        """Rows (one per request), columns (the stages present, then ``decode 1`` ...) and
        milliseconds per cell (NaN where a request has no such stage; repeated stages summed)."""
        self._check_complete()
        steps = max((self.decode_steps(r.index) for r in self.requests), default=0)
        present = [n for n in STAGES[:3] if any(s.name == n for s in self.spans)]
        columns = present + [f"decode {step}" for step in range(1, steps + 1)]
        rows, cells = [], []
        for request in self.requests:
            row = dict.fromkeys(columns, math.nan)
            for span in self.stages_of(request.index):
                previous = row[span.label]
                row[span.label] = (0.0 if math.isnan(previous) else previous) + span.seconds * 1e3
            rows.append(f"{request.index}: {request.kind}")
            cells.append([row[column] for column in columns])
        return rows, columns, cells

    def chrome_trace(self) -> dict[str, Any]:
        """The trace in Chrome's Trace Event Format (JSON object form; opens in Perfetto and
        chrome://tracing): one thread per request holding the request and its stages as
        complete events (``ph`` "X", microseconds), instant events (``ph`` "i") for the marks."""
        self._check_complete()
        pid = 1
        events: list[dict[str, Any]] = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "args": {"name": "ascend_vlm"},
            }
        ]
        for request in self.requests:
            tid = request.index + 1
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": pid,
                    "tid": tid,
                    "args": {"name": f"request {request.index} ({request.kind})"},
                }
            )
            events.append(
                _complete_event("request", request.kind, request.start, request.end, pid, tid)
            )
        for span in self.spans:
            event = _complete_event(
                "stage", span.label, span.start, span.end, pid, span.request + 1
            )
            event["args"] = {"stage": span.name, "step": span.step}
            events.append(event)
        for mark in self.marks:
            tid = 0 if mark.request is None else mark.request + 1
            events.append(
                {
                    "name": mark.name,
                    "cat": "event",
                    "ph": "i",
                    "s": "t",
                    "ts": mark.time * 1e6,
                    "pid": pid,
                    "tid": tid,
                    "args": mark.fields,
                }
            )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"clock": self.clock, "producer": "ascend_vlm.trace"},
        }

    def save_chrome_trace(self, path: str | Path) -> Path:
        """Write :meth:`chrome_trace` as JSON to ``path``; returns the path."""
        path = Path(path)
        path.write_text(json.dumps(self.chrome_trace(), indent=1))
        return path

    def save_heatmap(self, path: str | Path, *, title: str = "") -> Path:
        """The stage matrix as a PNG heat map (requests x stages and decode steps, ms)."""
        from ascend_vlm.observability.pictures import save_stage_heatmap

        rows, columns, cells = self.stage_matrix()
        return save_stage_heatmap(path, rows, columns, cells, title=title)


def _complete_event(
    category: str, name: str, start: float, end: float, pid: int, tid: int
) -> dict[str, Any]:
    return {
        "name": name,
        "cat": category,
        "ph": "X",
        "ts": start * 1e6,
        "dur": max(end - start, 0.0) * 1e6,
        "pid": pid,
        "tid": tid,
    }
