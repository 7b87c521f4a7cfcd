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


class _Devices:
    """The state one mock ``torch.npu`` namespace shares: its devices, the current device, the
    default and the (per thread, as in torch_npu's c10_npu thread-local) current stream of each
    device, the live streams ``synchronize`` waits for, and the native runtime (or None)."""

    def __init__(self, device_count: int, runtime: Any | None) -> None:
        self.count = device_count
        self.runtime = runtime
        self.current_index = 0
        self.live_streams: weakref.WeakSet = weakref.WeakSet()
        self.default_streams: dict[int, _Stream] = {}
        self.local = threading.local()
        self.stream_class: type[_Stream] = _Stream  # the namespace's own subclass

    def index(self, device: Any) -> int:
        """The index of ``device`` (an int, ``"npu[:N]"`` or ``torch.device``; None: current)."""
        if device is None:
            return self.current_index
        if isinstance(device, torch.device):
            device = str(device)
        if isinstance(device, str):
            kind, _, index = device.partition(":")
            if kind != "npu" or (index and not index.isdigit()):
                raise ValueError(f"device: expected an int or 'npu[:N]', got {device!r}")
            device = int(index) if index else self.current_index
        if not isinstance(device, int) or not 0 <= device < self.count:
            raise ValueError(f"device: expected an index in [0, {self.count}), got {device!r}")
        return device

    def current_streams(self) -> dict[int, _Stream]:
        """This thread's current stream per device (absent: the default stream)."""
        if not hasattr(self.local, "streams"):
            self.local.streams = {}
        return self.local.streams

    def default_stream(self, device: Any = None) -> _Stream:
        index = self.index(device)
        if index not in self.default_streams:
            self.default_streams[index] = self.stream_class(index)
        return self.default_streams[index]

    def current_stream(self, device: Any = None) -> _Stream:
        index = self.index(device)
        return self.current_streams().get(index) or self.default_stream(index)

    @contextlib.contextmanager
    def stream(self, stream: _Stream | None) -> Iterator[None]:
        """Make ``stream`` the current stream of its device inside the block."""
        if stream is None:
            yield
            return
        current = self.current_streams()
        previous = current.get(stream.device_index)
        current[stream.device_index] = stream
        try:
            yield
        finally:
            if previous is None:
                current.pop(stream.device_index, None)
            else:
                current[stream.device_index] = previous

    def set_device(self, device: Any) -> None:
        self.current_index = self.index(device)

    def synchronize(self, device: Any = None) -> None:
        """Wait for every stream of the device (like ``torch.npu.synchronize``)."""
        index = self.index(device)
        for known in list(self.live_streams):
            if known.device_index == index:
                known.synchronize()


class _Event:
    """An NPU event (``torch.npu.Event``); each namespace subclasses it with its ``_devices``."""

    _devices: _Devices

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        runtime = self._devices.runtime
        self.enable_timing = enable_timing
        self._native = runtime.Event(timing=enable_timing) if runtime else None
        self._recorded_at: float | None = None

    def record(self, stream: _Stream | None = None) -> None:
        stream = stream if stream is not None else self._devices.current_stream()
        self._recorded_at = time.perf_counter()
        if self._native is not None:
            self._native.record(stream._native)
        stream._completion = [self]  # in order: done once this record is

    def wait(self, stream: _Stream | None = None) -> None:
        (stream if stream is not None else self._devices.current_stream()).wait_event(self)

    def query(self) -> bool:
        return self._native.query() if self._native is not None else True

    def synchronize(self) -> None:
        if self._native is not None:
            self._native.synchronize()

    def elapsed_time(self, end_event: _Event) -> float:
        """Milliseconds between this event and ``end_event`` (both timing, recorded)."""
        if not (self.enable_timing and end_event.enable_timing):
            raise ValueError(
                "elapsed_time: expected two events made with "
                "enable_timing=True, got a non-timing event"
            )
        if self._recorded_at is None or end_event._recorded_at is None:
            raise ValueError("elapsed_time: expected both events recorded, got an unrecorded event")
        if self._native is not None:
            return float(self._native.elapsed_ms(end_event._native))
        return (end_event._recorded_at - self._recorded_at) * 1e3


class _Stream:
    """An NPU stream (``torch.npu.Stream``); each namespace subclasses it with its
    ``_devices`` and ``_event_class``."""

    _devices: _Devices
    _event_class: type[_Event]

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        if kwargs:  # torch_npu passes them on to its C++ stream base (e.g. stream_id)
            raise NotImplementedError(f"mock Stream: {sorted(kwargs)} are not implemented")
        runtime = self._devices.runtime
        self.device_index = self._devices.index(device)
        self.priority = priority
        self._native = runtime.Stream(priority=priority) if runtime else None
        # Events whose completion means all work submitted so far has completed.
        self._completion: list[_Event] = []
        self._devices.live_streams.add(self)

    @property
    def npu_stream(self) -> int:
        """The raw ``aclrtStream`` (torch_npu's ``Stream.npu_stream``): the simulated
        runtime stream's handle."""
        if self._native is None:
            raise RuntimeError(
                "npu_stream: the mock has no AscendCL stream without ascend_vlm._C built"
            )
        return self._native.handle

    def wait_event(self, event: _Event) -> None:
        if self._native is not None and event._native is not None:
            self._native.wait_event(event._native)
        self._completion.append(event)

    def wait_stream(self, stream: _Stream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: _Event | None = None) -> _Event:
        event = event if event is not None else self._event_class()
        event.record(self)
        return event

    def query(self) -> bool:
        """Whether all work queued so far has completed (non-blocking)."""
        return all(event.query() for event in self._completion)

    def synchronize(self) -> None:
        if self._native is not None:
            self._native.synchronize()


def make_stream_api(device_count: int) -> dict[str, Any]:
    """Build the functions and classes of one mock ``torch.npu`` namespace: its own ``Stream``
    and ``Event`` classes (``isinstance`` tells this namespace's streams from others') over
    one shared device state."""
    devices = _Devices(device_count, _native_runtime())
    event_class = type("Event", (_Event,), {"_devices": devices, "__doc__": _Event.__doc__})
    stream_class = type(
        "Stream",
        (_Stream,),
        {"_devices": devices, "_event_class": event_class, "__doc__": _Stream.__doc__},
    )
    devices.stream_class = stream_class
    return {
        "is_available": lambda: True,
        "device_count": lambda: device_count,
        "current_device": lambda: devices.current_index,
        "set_device": devices.set_device,
        "synchronize": devices.synchronize,
        "Stream": stream_class,
        "Event": event_class,
        "current_stream": devices.current_stream,
        "default_stream": devices.default_stream,
        "stream": devices.stream,
    }
