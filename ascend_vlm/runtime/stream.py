"""Streams, events, asynchronous copies and host callbacks.

Work issued to one :class:`Stream` runs in issue order; work on different streams runs
concurrently unless ordered with events (``event.record(a)``, then ``b.wait_event(event)``).
Blocking waits (``synchronize``) release the GIL; host callbacks take it.

Buffer lifetime: a :class:`Stream` holds a reference to every buffer its queued copies and
kernels use, and drops the references once that work is known to be done: after
:meth:`Stream.synchronize` or :meth:`Stream.destroy`, or, for work queued before an
:meth:`Event.record` on the stream, once :meth:`Event.synchronize` returns or
:meth:`Event.query` returns True. ``DeviceBuffer.free()`` first waits for the streams still
holding the buffer. Host objects used as endpoints (tensors, arrays) are held the same way; an
int address must lie inside a live buffer (see :mod:`ascend_vlm.runtime.memory`), which the
caller keeps alive.
Code that queues work by other means (a kernel launch) holds its operands the same way through
:meth:`Stream.hold_until_done`.

Devices: a stream or event belongs to the device that was current when it was created, and every
call on it runs in that device's context, whatever :func:`ascend_vlm.runtime.set_device` selected
since. Events order work across devices (``stream.wait_event(event_of_other_device)``), but are
recorded only on streams of their own device.

Timeouts: :meth:`Stream.synchronize`, :meth:`Stream.destroy` and :meth:`Event.synchronize` wait at
most ``timeout_ms`` (default :func:`ascend_vlm.runtime.sync_timeout_ms`), then raise
``AclError`` (``ACL_ERROR_RT_STREAM_SYNC_TIMEOUT`` / ``ACL_ERROR_RT_EVENT_SYNC_TIMEOUT``) naming the
stream or event, its device and the timeout. Where AscendCL lacks the timed waits
(``capabilities()``), the waits are unbounded.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable

from ascend_vlm import _C
from ascend_vlm._errors import AclError
from ascend_vlm.runtime._arguments import require_byte_count, require_int
from ascend_vlm.runtime.memory import (
    DeviceBuffer,
    Endpoint,
    known_address,
    require_fits,
    resolve_copy,
)

MAX_STREAM_PRIORITY = 7  # aclrtCreateStreamWithConfig: priority 0 (highest) to 7


class Stream(_C.Stream):
    """A dedicated stream on the current device (``aclrtCreateStreamWithConfig``).

    Buffers used by queued work are kept alive until that work is known to be done (see the
    module docstring); raw addresses are the caller's to keep valid. Dropping the stream waits
    for its work. Any method may be called from any thread; a call racing :meth:`destroy`
    raises ``AclError(ACL_ERROR_RT_INVALID_HANDLE)``.
    """

    def __init__(self, priority: int = 0) -> None:
        level = require_int("priority", priority)
        if not 0 <= level <= MAX_STREAM_PRIORITY:
            raise ValueError(f"priority: expected 0..{MAX_STREAM_PRIORITY}, got {level}")
        super().__init__(level)
        # Buffers of queued work in issue order. Buffer number k (counting from 0 since the
        # stream was created) is held while _released <= k < _issued; a mark is an _issued value.
        self._in_flight: deque[_C.Buffer] = deque()
        self._issued = 0
        self._released = 0
        self._in_flight_lock = threading.Lock()

    def __del__(self) -> None:
        # CPython drops the instance __dict__ (and the buffers held in it) before the C++
        # destructor waits for the stream's work, so wait here while they are still held.
        # At interpreter exit the runtime has shut down first (atexit), discarding the work, so
        # the wait fails; turning that failure into AclError imports ascend_vlm._errors, which
        # fails as ImportError once the import system is torn down: nothing is left to wait for.
        if getattr(self, "_in_flight", None) and not self.destroyed:
            with contextlib.suppress(AclError, ImportError):
                super().synchronize()

    def memcpy_async(
        self, dst: Endpoint, src: Endpoint, nbytes: int, kind: str | None = None
    ) -> None:
        """Queue a copy of ``nbytes`` from ``src`` to ``dst`` (``aclrtMemcpyAsync``).

        ``dst``/``src`` are buffers, CPU or NPU tensors, buffer-protocol objects or int addresses
        inside a live buffer; ``kind`` is ``"h2d"``, ``"d2h"``, ``"d2d"``, ``"default"`` or None
        (see :func:`ascend_vlm.runtime.memory.resolve_copy`). As documented for
        ``aclrtMemcpyAsync``: host-to-host is refused (``ACL_ERROR_RT_FEATURE_NOT_SUPPORT``),
        and with pageable (not pinned) host memory the call returns only once the copy has run.
        The GIL is released meanwhile.
        """
        super().memcpy_async(*resolve_copy(dst, src, nbytes, kind, "aclrtMemcpyAsync"))
        self.hold_until_done(dst, src)

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

    def synchronize(self, timeout_ms: int | None = None) -> None:
        """Block until all queued work has finished (the GIL is released meanwhile).

        Waits at most ``timeout_ms`` (None: :func:`ascend_vlm.runtime.sync_timeout_ms`; -1:
        forever), then raises ``AclError(ACL_ERROR_RT_STREAM_SYNC_TIMEOUT)``. Drops the buffers
        of the work queued before the call; work another thread queues meanwhile keeps its
        buffers.
        """
        mark = self._mark()
        super().synchronize(_timeout(timeout_ms))
        self._release_through(mark)

    def destroy(self) -> None:
        """Wait for all queued work, then destroy the stream and drop the buffers it held.

        A stream error reported by that wait raises ``AclError`` and leaves the stream alive.
        """
        super().destroy()
        self._release_through(self._mark())

    def hold_until_done(self, *operands: Endpoint) -> None:
        """Keep ``operands`` alive until the work queued on this stream so far is known done.

        Call it right after queueing work that uses ``operands`` (buffers, host objects; int
        addresses are skipped, they are the caller's to keep valid). The stream drops them at
        the next :meth:`synchronize` or :meth:`destroy` that covers the work, or once an
        :class:`Event` recorded after it reports completion. A :class:`DeviceBuffer` among them
        also learns of the stream (:meth:`DeviceBuffer.used_on`), so its ``free()`` first waits
        for that work (:meth:`finish_work_on`).
        """
        buffers = [operand for operand in operands if not isinstance(operand, int)]
        with self._in_flight_lock:
            self._in_flight.extend(buffers)
            self._issued += len(buffers)
        for buffer in buffers:
            if isinstance(buffer, DeviceBuffer):
                buffer.used_on(self)

    def _mark(self) -> int:
        """The position reached by the buffers held so far (for :meth:`_release_through`)."""
        with self._in_flight_lock:
            return self._issued

    def _release_through(self, mark: int) -> None:
        """Drop the held buffers before ``mark``: their work is known to have completed."""
        with self._in_flight_lock:
            while self._released < mark:
                self._in_flight.popleft()
                self._released += 1

    def finish_work_on(self, buffer: _C.Buffer) -> None:
        """Synchronize if work queued on this stream may still use ``buffer`` (it is held, see
        :meth:`hold_until_done`); otherwise return at once."""
        with self._in_flight_lock:
            holds = any(held is buffer for held in self._in_flight)
        if holds:
            self.synchronize()

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
        # (stream, mark) of the latest record: the stream's buffers before mark are released
        # once the record completes. The stream is referenced weakly so events never keep it.
        self._recorded: tuple[weakref.ref[Stream], int] | None = None

    def record(self, stream: Stream) -> None:
        """Capture the work queued on ``stream`` so far."""
        if not isinstance(stream, _C.Stream):
            raise TypeError(f"stream: expected a Stream, got {type(stream).__name__}")
        # The mark is taken first, so it never covers a buffer whose work the record misses.
        recorded = (weakref.ref(stream), stream._mark()) if isinstance(stream, Stream) else None
        super().record(stream)
        self._recorded = recorded

    def query(self) -> bool:
        """True once the latest record has completed (or if the event was never recorded).

        When True, the recorded stream drops the buffers of work queued before the record.
        """
        recorded = self._recorded
        done = super().query()
        if done:
            _release_recorded(recorded)
        return done

    def synchronize(self, timeout_ms: int | None = None) -> None:
        """Block until the latest record has completed (the GIL is released meanwhile).

        Waits at most ``timeout_ms`` (as :meth:`Stream.synchronize`; a timeout raises
        ``AclError(ACL_ERROR_RT_EVENT_SYNC_TIMEOUT)``). The recorded stream then drops the
        buffers of work queued before the record.
        """
        recorded = self._recorded
        super().synchronize(_timeout(timeout_ms))
        _release_recorded(recorded)

    def make_stream_wait(self, stream_handle: int) -> None:
        """Make work queued later on a stream this runtime does not own wait for the latest
        record (``aclrtStreamWaitEvent`` on the raw handle, on the device).

        ``stream_handle`` is an ``aclrtStream`` address, e.g. torch_npu's
        ``torch.npu.current_stream().npu_stream``: how a torch_npu stream consumes what a
        runtime stream produced without blocking the host. A handle AscendCL does not know
        raises ``AclError``.
        """
        super().make_stream_wait(require_int("stream_handle", stream_handle))

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
    dst: Endpoint,
    src: Endpoint,
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
    stream.hold_until_done(dst, src)


def _release_recorded(recorded: tuple[weakref.ref[Stream], int] | None) -> None:
    """Let a completed event record's stream drop the buffers queued before the record."""
    if recorded is None:
        return
    stream_ref, mark = recorded
    stream = stream_ref()
    if stream is not None:
        stream._release_through(mark)


def _device_address(name: str, value: _C.Buffer | int, count: int) -> int:
    """The device address of a kernel operand, checking that ``count`` bytes fit in it."""
    if isinstance(value, _C.Buffer):
        require_fits(name, value, count)
        return value.device_ptr
    known_address(name, require_int(name, value), count)
    return value


def _timeout(timeout_ms: int | None) -> int:
    """The native timeout argument: -2 selects the runtime default."""
    if timeout_ms is None:
        return -2
    timeout = require_int("timeout_ms", timeout_ms)
    if timeout < -1:
        raise ValueError(f"timeout_ms: expected -1 (forever), >= 0 or None, got {timeout}")
    return timeout
