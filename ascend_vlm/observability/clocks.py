"""Where a trace's timestamps come from: the host's ``perf_counter`` or NPU events.

A clock hands out marks while the model runs and turns them into seconds since its origin only
when the trace ends (:meth:`resolve`). The NPU clock records one ``torch.npu.Event`` per mark on
the current stream, so a mark costs an event record and never a host synchronisation; reading
them waits for the device once, at the end. Device time is what the NPU spent, which host time
misses when kernels are launched asynchronously. The NPU clock also opens an mstx range per
stage (``torch_npu.npu.mstx.range_start(msg, stream)`` / ``range_end(range_id)``), which the
torch_npu profiler shows on the device timeline.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ascend_vlm import kernel_backend

CLOCKS = ("auto", "device", "host")


class HostClock:
    """``time.perf_counter`` marks."""

    name = "host"

    def open_range(self, name: str) -> None:
        """No device-side range on the host clock."""

    def close_range(self, handle: None) -> None:
        """No device-side range on the host clock."""

    def __init__(self) -> None:
        self._origin = time.perf_counter()

    def mark(self) -> float:
        return time.perf_counter()

    def resolve(self, marks: list[Any]) -> list[float]:
        """Seconds from the clock's creation to each mark."""
        return [mark - self._origin for mark in marks]


class DeviceClock:
    """Timing ``torch.npu.Event`` marks recorded on ``device``'s current NPU stream."""

    name = "device"

    def __init__(self, device: torch.device) -> None:
        self._device = device if device.type == "npu" else None  # the mock: current device
        # torch_npu builds without the mstx API get no device-side ranges.
        self._mstx = getattr(torch.npu, "mstx", None)
        self._origin = self.mark()

    def _stream(self) -> Any:
        return torch.npu.current_stream(self._device)

    def mark(self) -> Any:
        event = torch.npu.Event(enable_timing=True)
        event.record(self._stream())
        return event

    def open_range(self, name: str) -> int:
        """Start an mstx range ``name`` on the stream (host and device timelines of the
        torch_npu / msprof profiler); returns its id for :meth:`close_range` (0: none)."""
        return self._mstx.range_start(name, self._stream()) if self._mstx is not None else 0

    def close_range(self, handle: int) -> None:
        """End the mstx range ``handle`` (0: it failed to start, nothing to end)."""
        if handle:
            self._mstx.range_end(handle)

    def resolve(self, marks: list[Any]) -> list[float]:
        """Seconds from the clock's creation to each mark, after one device synchronisation."""
        torch.npu.synchronize(self._device)
        return [self._origin.elapsed_time(mark) / 1e3 for mark in marks]


def check_clock(clock: object) -> None:
    """ValueError unless ``clock`` is one of :data:`CLOCKS`."""
    if clock not in CLOCKS:
        raise ValueError(f"clock: expected one of {', '.join(CLOCKS)}, got {clock!r}")


def make_clock(clock: str, device: torch.device) -> HostClock | DeviceClock:
    """The clock called ``clock`` (one of :data:`CLOCKS`) for a model on ``device``: "auto" is
    "device" when the model's ops run the NPU kernels (a real NPU, or the mock NPU), else "host"."""
    check_clock(clock)
    if clock == "auto":
        clock = "device" if kernel_backend.use_npu_kernels(device) else "host"
    if clock == "host":
        return HostClock()
    if not hasattr(torch, "npu"):
        raise ValueError("clock: 'device' needs torch_npu (torch.npu), which is not imported")
    return DeviceClock(device)
