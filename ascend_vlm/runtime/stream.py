"""Streams, events, asynchronous copies and host callbacks.

Work issued to one :class:`Stream` runs in issue order; work on different streams runs
concurrently unless ordered with events (``event.record(a)``, then ``b.wait_event(event)``).
Blocking waits (``synchronize``) release the GIL; host callbacks take it.
"""

from __future__ import annotations

from collections.abc import Callable

from ascend_vlm import _C
from ascend_vlm.runtime._checks import require_byte_count, require_int
from ascend_vlm.runtime.memory import require_fits, resolve_copy

MAX_STREAM_PRIORITY = 7  # aclrtCreateStreamWithConfig: priority 0 (highest) to 7


class Stream(_C.Stream):
    """A dedicated stream on the current device (``aclrtCreateStreamWithConfig``).

    Buffers passed to :meth:`memcpy_async` are kept alive until the next :meth:`synchronize`;
    raw addresses are the caller's to keep valid. Dropping the stream waits for its work.
    """

    def __init__(self, priority: int = 0) -> None:
        level = require_int("priority", priority)
        if not 0 <= level <= MAX_STREAM_PRIORITY:
            raise ValueError(f"priority: expected 0..{MAX_STREAM_PRIORITY}, got {level}")
        super().__init__(level)
        self._in_flight: list[object] = []

    def memcpy_async(
        self, dst: _C.Buffer | int, src: _C.Buffer | int, nbytes: int, kind: str | None = None
    ) -> None:
        """Queue a copy of ``nbytes`` from ``src`` to ``dst`` (``aclrtMemcpyAsync``).

        ``dst``/``src`` are buffers or int addresses such as a CPU tensor's ``data_ptr()``;
        ``kind`` is ``"h2d"``, ``"d2h"``, ``"d2d"``, ``"default"`` or None (see
        :func:`ascend_vlm.runtime.memory.resolve_copy`). As documented for
        ``aclrtMemcpyAsync``: both addresses must be 64-byte aligned
        (``ACL_ERROR_RT_ADDR_UNALIGNED``), host-to-host is refused
        (``ACL_ERROR_RT_FEATURE_NOT_SUPPORT``), and with pageable (not pinned) host memory the
        call returns only once the copy has run. The GIL is released meanwhile.
        """
        super().memcpy_async(*resolve_copy(dst, src, nbytes, kind, "aclrtMemcpyAsync"))
        self._in_flight.extend(end for end in (dst, src) if isinstance(end, _C.Buffer))

    def wait_event(self, event: Event) -> None:
        """Make work queued after this call wait for ``event``'s latest record."""
        if not isinstance(event, _C.Event):
            raise TypeError(f"event: expected an Event, got {type(event).__name__}")
        super().wait_event(event)

    def launch_host_func(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the runtime's report thread once prior work completes.

        Later work on this stream waits for ``fn`` to return. An exception from ``fn`` is
        reported through ``sys.unraisablehook`` and does not stop the stream. As CANN requires
        of ``aclrtLaunchCallback`` callbacks, ``fn`` must not allocate or free runtime
        resources, issue work or synchronize (it runs on the single report thread, so waiting
        for stream work would wait for itself).
        """
        if not callable(fn):
            raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
        super().launch_host_func(fn)

    def synchronize(self) -> None:
        """Block until all queued work has finished (the GIL is released meanwhile)."""
        super().synchronize()
        self._in_flight.clear()

    def __repr__(self) -> str:
        state = "destroyed" if self.destroyed else f"device={self.device}"
        return f"Stream(priority={self.priority}, {state})"


class Event(_C.Event):
    """A point in a stream's work (``aclrtCreateEventWithFlag``).

    ``timing=True`` events carry timestamps (``ACL_EVENT_TIME_LINE``) for :meth:`elapsed_time`.
    """

    def __init__(self, timing: bool = True) -> None:
        if not isinstance(timing, bool):
            raise TypeError(f"timing: expected a bool, got {type(timing).__name__}")
        super().__init__(timing)

    def record(self, stream: Stream) -> None:
        """Capture the work queued on ``stream`` so far."""
        if not isinstance(stream, _C.Stream):
            raise TypeError(f"stream: expected a Stream, got {type(stream).__name__}")
        super().record(stream)

    def elapsed_time(self, end: Event) -> float:
        """Milliseconds from this event to ``end`` (both timing events, both completed).

        Raises ``AclError``: ``ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID`` if either was never
        recorded or is not a timing event, ``ACL_ERROR_RT_EVENT_NOT_COMPLETE`` if a record is
        still pending.
        """
        if not isinstance(end, _C.Event):
            raise TypeError(f"end: expected an Event, got {type(end).__name__}")
        return self.elapsed_ms(end)


def memcpy_async(
    dst: _C.Buffer | int,
    src: _C.Buffer | int,
    nbytes: int,
    stream: Stream,
    kind: str | None = None,
) -> None:
    """Queue a copy on ``stream``; same as ``stream.memcpy_async(dst, src, nbytes, kind)``."""
    if not isinstance(stream, Stream):
        raise TypeError(f"stream: expected a Stream, got {type(stream).__name__}")
    stream.memcpy_async(dst, src, nbytes, kind)


def sim_copy_kernel(
    dst: _C.Buffer | int, src: _C.Buffer | int, nbytes: int, stream: Stream
) -> None:
    """Queue the simulator's copy kernel: device code moving ``nbytes`` between device addresses.

    It stands in for an Ascend C kernel that touches memory through device addresses, which is
    the only way to use a :class:`~ascend_vlm.runtime.MappedBuffer`'s ``device_ptr``: CANN
    documents that a mapped device address cannot be used for copies. The bytes a kernel moves
    are counted under ``sim_stats()["kernel"]``. ``dst``/``src`` are a ``DeviceBuffer``, a
    ``MappedBuffer`` (its ``device_ptr``) or an int device address; a host address raises
    ``AclError(ACL_ERROR_RT_PARAM_INVALID)``. Simulator only (``RuntimeError`` on ``cann``).
    """
    if not isinstance(stream, Stream):
        raise TypeError(f"stream: expected a Stream, got {type(stream).__name__}")
    count = require_byte_count("nbytes", nbytes, "aclsimLaunchCopyKernel")
    _C.sim_copy_kernel(
        stream, _device_address("dst", dst, count), _device_address("src", src, count), count
    )


def _device_address(name: str, value: _C.Buffer | int, count: int) -> int:
    """The device address of a kernel operand, checking that ``count`` bytes fit in a buffer."""
    if isinstance(value, _C.Buffer):
        require_fits(name, value, count)
        return value.device_ptr
    return require_int(name, value)
