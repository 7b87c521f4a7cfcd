"""The ``torch.npu`` namespace of the mock NPU: devices, streams and events.

Mirrors the torch_npu API the project uses (Ascend/pytorch ``torch_npu/npu/streams.py``;
npu_api.md §3): ``Stream(device=None, priority=0, **kwargs)`` with ``wait_event``, ``wait_stream``,
``record_event``, ``query``, ``synchronize`` and ``npu_stream`` (the raw ``aclrtStream``);
``Event(enable_timing=False, blocking=False, interprocess=False)`` with ``record``, ``wait``,
``query``, ``elapsed_time``, ``synchronize``; ``current_stream``, ``default_stream`` and the
``stream(s)`` context manager (the current stream is per thread, as in torch_npu).

When ``ascend_vlm._C`` is built, streams and events are backed by ``ascend_vlm.runtime``'s
``Stream``/``Event`` (the simulated AscendCL runtime), so ordering bugs show up there. Without
it they are host-side stand-ins: CPU tensor work is synchronous, so every stream is always
complete and events only carry timestamps.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch


def _native_runtime() -> Any | None:
    """``ascend_vlm.runtime`` if it exposes native Stream and Event, else None."""
    try:
        runtime = importlib.import_module("ascend_vlm.runtime")
    except ImportError:
        return None
    if hasattr(runtime, "Stream") and hasattr(runtime, "Event"):
        return runtime
    return None


def make_stream_api(device_count: int) -> dict[str, Any]:
    """Build the functions and classes of one mock ``torch.npu`` namespace."""
    runtime = _native_runtime()
    state = {"device": 0}
    live_streams: weakref.WeakSet = weakref.WeakSet()  # what synchronize() waits for

    def _device_index(device: Any) -> int:
        if isinstance(device, torch.device):
            device = str(device)
        if isinstance(device, str):
            kind, _, index = device.partition(":")
            if kind != "npu" or (index and not index.isdigit()):
                raise ValueError(f"device: expected an int or 'npu[:N]', got {device!r}")
            device = int(index) if index else state["device"]
        if not isinstance(device, int) or not 0 <= device < device_count:
            raise ValueError(f"device: expected an index in [0, {device_count}), got {device!r}")
        return device

    class Event:
        """An NPU event (``torch.npu.Event``)."""

        def __init__(
            self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
        ) -> None:
            self.enable_timing = enable_timing
            self._native = runtime.Event(timing=enable_timing) if runtime else None
            self._recorded_at: float | None = None

        def record(self, stream: Stream | None = None) -> None:
            stream = stream if stream is not None else current_stream()
            self._recorded_at = time.perf_counter()
            if self._native is not None:
                self._native.record(stream._native)
            stream._completion = [self]  # in order: done once this record is

        def wait(self, stream: Stream | None = None) -> None:
            (stream if stream is not None else current_stream()).wait_event(self)

        def query(self) -> bool:
            return self._native.query() if self._native is not None else True

        def synchronize(self) -> None:
            if self._native is not None:
                self._native.synchronize()

        def elapsed_time(self, end_event: Event) -> float:
            """Milliseconds between this event and ``end_event`` (both timing, recorded)."""
            if not (self.enable_timing and end_event.enable_timing):
                raise ValueError(
                    "elapsed_time: expected two events made with "
                    "enable_timing=True, got a non-timing event"
                )
            if self._recorded_at is None or end_event._recorded_at is None:
                raise ValueError(
                    "elapsed_time: expected both events recorded, got an unrecorded event"
                )
            if self._native is not None:
                return float(self._native.elapsed_ms(end_event._native))
            return (end_event._recorded_at - self._recorded_at) * 1e3

    class Stream:
        """An NPU stream (``torch.npu.Stream``)."""

        def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
            if kwargs:  # torch_npu passes them on to its C++ stream base (e.g. stream_id)
                raise NotImplementedError(f"mock Stream: {sorted(kwargs)} are not implemented")
            self.device_index = state["device"] if device is None else _device_index(device)
            self.priority = priority
            self._native = runtime.Stream(priority=priority) if runtime else None
            # Events whose completion means all work submitted so far has completed.
            self._completion: list[Event] = []
            live_streams.add(self)

        @property
        def npu_stream(self) -> int:
            """The raw ``aclrtStream`` (torch_npu's ``Stream.npu_stream``): the simulated
            runtime stream's handle."""
            if self._native is None:
                raise RuntimeError(
                    "npu_stream: the mock has no AscendCL stream without ascend_vlm._C built"
                )
            return self._native.handle

        def wait_event(self, event: Event) -> None:
            if self._native is not None and event._native is not None:
                self._native.wait_event(event._native)
            self._completion.append(event)

        def wait_stream(self, stream: Stream) -> None:
            self.wait_event(stream.record_event())

        def record_event(self, event: Event | None = None) -> Event:
            event = event if event is not None else Event()
            event.record(self)
            return event

        def query(self) -> bool:
            """Whether all work queued so far has completed (non-blocking)."""
            return all(event.query() for event in self._completion)

        def synchronize(self) -> None:
            if self._native is not None:
                self._native.synchronize()

    default_streams: dict[int, Stream] = {}
    # The current stream per device is per thread, as in torch_npu (c10_npu's thread-local).
    local = threading.local()

    def _current() -> dict[int, Stream]:
        if not hasattr(local, "streams"):
            local.streams = {}
        return local.streams

    def default_stream(device: Any = None) -> Stream:
        index = state["device"] if device is None else _device_index(device)
        if index not in default_streams:
            default_streams[index] = Stream(index)
        return default_streams[index]

    def current_stream(device: Any = None) -> Stream:
        index = state["device"] if device is None else _device_index(device)
        return _current().get(index) or default_stream(index)

    @contextlib.contextmanager
    def stream(stream: Stream | None) -> Iterator[None]:
        """Make ``stream`` the current stream of its device inside the block."""
        if stream is None:
            yield
            return
        current = _current()
        previous = current.get(stream.device_index)
        current[stream.device_index] = stream
        try:
            yield
        finally:
            if previous is None:
                current.pop(stream.device_index, None)
            else:
                current[stream.device_index] = previous

    def set_device(device: Any) -> None:
        state["device"] = _device_index(device)

    def synchronize(device: Any = None) -> None:
        """Wait for every stream of the device (like ``torch.npu.synchronize``)."""
        index = state["device"] if device is None else _device_index(device)
        for known in list(live_streams):
            if known.device_index == index:
                known.synchronize()

    return {
        "is_available": lambda: True,
        "device_count": lambda: device_count,
        "current_device": lambda: state["device"],
        "set_device": set_device,
        "synchronize": synchronize,
        "Stream": Stream,
        "Event": Event,
        "current_stream": current_stream,
        "default_stream": default_stream,
        "stream": stream,
    }
