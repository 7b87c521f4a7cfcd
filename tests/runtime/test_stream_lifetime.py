"""Buffers used by queued stream work stay alive until that work is known to be done."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
from _runtime_helpers import ACL_ERROR_RT_INVALID_HANDLE, requires_sim

import ascend_vlm
from ascend_vlm import _C, runtime

SLOT = 64  # bytes per copy: aclrtMemcpyAsync wants 64-byte aligned addresses

pytestmark = requires_sim  # the freed-memory checks rely on the simulator's stream errors


def filled(value: int) -> runtime.PinnedBuffer:
    host = runtime.PinnedBuffer(SLOT)
    np.frombuffer(host, dtype=np.uint8)[:] = value
    return host


def contents(host: runtime.PinnedBuffer) -> np.ndarray:
    return np.frombuffer(host, dtype=np.uint8)


def held_only_by_the_stream(make: type, *args: object) -> tuple[object, weakref.ref]:
    """A new buffer and a weak reference, to be used once; the caller drops the strong one."""
    buffer = make(*args)
    return buffer, weakref.ref(buffer)


def is_alive(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is not None


@pytest.fixture
def gated_stream() -> Iterator[tuple[runtime.Stream, threading.Event]]:
    """A stream whose work waits behind a host callback until the gate opens."""
    stream = runtime.Stream()
    gate = threading.Event()
    stream.launch_host_func(lambda: gate.wait(10))
    yield stream, gate
    gate.set()
    if not stream.destroyed:
        stream.synchronize()


def test_synchronize_keeps_buffers_of_copies_queued_while_it_waited(monkeypatch):
    stream = runtime.Stream()
    host = filled(5)
    out = filled(0)
    gate = threading.Event()
    queued: list[weakref.ref] = []
    plain_synchronize = _C.Stream.synchronize

    def synchronize_then_other_thread_queues(self: _C.Stream, timeout_ms: int) -> None:
        plain_synchronize(self, timeout_ms)
        # What another thread may do while synchronize has released the GIL.
        self.launch_host_func(lambda: gate.wait(10))
        device, ref = held_only_by_the_stream(runtime.DeviceBuffer, SLOT)
        self.memcpy_async(device, host, SLOT)
        self.memcpy_async(out, device, SLOT)
        queued.append(ref)

    monkeypatch.setattr(_C.Stream, "synchronize", synchronize_then_other_thread_queues)
    stream.synchronize()
    monkeypatch.undo()
    assert is_alive(queued[0])  # its copies are still queued behind the gate
    gate.set()
    stream.synchronize()
    assert np.all(contents(out) == 5)
    assert not is_alive(queued[0])


def test_sim_copy_kernel_keeps_its_buffers_until_synchronize(gated_stream):
    stream, gate = gated_stream
    src, src_ref = held_only_by_the_stream(runtime.DeviceBuffer, SLOT)
    runtime.memcpy(src, filled(9), SLOT)
    dst = runtime.DeviceBuffer(SLOT)
    runtime.sim_copy_kernel(dst, src, SLOT, stream)
    del src
    assert is_alive(src_ref)
    gate.set()
    stream.synchronize()  # would raise ACL_ERROR_RT_PARAM_INVALID had src been freed
    assert not is_alive(src_ref)
    out = filled(0)
    runtime.memcpy(out, dst, SLOT)
    assert np.all(contents(out) == 9)


def test_event_synchronize_and_query_release_work_recorded_before_the_event():
    stream = runtime.Stream()
    out = filled(0)
    first, first_ref = held_only_by_the_stream(runtime.DeviceBuffer, SLOT)
    stream.memcpy_async(first, filled(1), SLOT)
    stream.memcpy_async(out, first, SLOT)
    del first
    event = runtime.Event(timing=False)
    event.record(stream)
    gate = threading.Event()
    stream.launch_host_func(lambda: gate.wait(10))
    second, second_ref = held_only_by_the_stream(runtime.DeviceBuffer, SLOT)
    stream.memcpy_async(second, filled(2), SLOT)
    del second

    event.synchronize()
    assert not is_alive(first_ref)
    assert np.all(contents(out) == 1)
    assert is_alive(second_ref)  # queued after the record, still behind the gate
    gate.set()
    after = runtime.Event(timing=False)
    after.record(stream)
    after.synchronize()
    assert event.query()  # an older, completed record releases nothing new
    assert not is_alive(second_ref)


def test_event_query_true_releases_the_recorded_work():
    stream = runtime.Stream()
    device, ref = held_only_by_the_stream(runtime.DeviceBuffer, SLOT)
    stream.memcpy_async(device, filled(3), SLOT)
    del device
    event = runtime.Event(timing=False)
    event.record(stream)
    while not event.query():
        pass
    assert not is_alive(ref)


def test_destroy_releases_the_buffers_it_waited_for(gated_stream):
    stream, gate = gated_stream
    device, ref = held_only_by_the_stream(runtime.DeviceBuffer, SLOT)
    stream.memcpy_async(device, filled(4), SLOT)
    del device
    threading.Timer(0.05, gate.set).start()
    stream.destroy()
    assert not is_alive(ref)


def test_dropping_a_stream_finishes_copies_before_their_buffers_go():
    stream = runtime.Stream()
    gate = threading.Event()
    stream.launch_host_func(lambda: gate.wait(10))
    out = filled(0)
    device = runtime.DeviceBuffer(SLOT)
    stream.memcpy_async(device, filled(6), SLOT)
    stream.memcpy_async(out, device, SLOT)
    del device
    threading.Timer(0.05, gate.set).start()
    del stream  # the C++ destructor waits; the buffers must outlive that wait
    assert np.all(contents(out) == 6)


def test_free_waits_for_queued_copies_that_use_the_buffer(gated_stream):
    stream, gate = gated_stream
    out = filled(0)
    device = runtime.DeviceBuffer(SLOT)
    stream.memcpy_async(device, filled(7), SLOT)
    stream.memcpy_async(out, device, SLOT)
    threading.Timer(0.05, gate.set).start()
    device.free()  # returns only after the copies ran
    assert device.closed
    stream.synchronize()  # no stream error: nothing touched freed memory
    assert np.all(contents(out) == 7)


def test_hold_until_done_contract_for_work_queued_outside_memcpy(gated_stream):
    """What a kernel launcher relies on: held operands live until the stream's work is done,
    and a held device buffer's free() waits for that work; unrelated buffers do not wait."""
    stream, gate = gated_stream
    ran: list[str] = []
    stream.launch_host_func(lambda: ran.append("kernel"))  # stands in for a launched kernel
    host, host_ref = held_only_by_the_stream(np.zeros, SLOT)
    device = runtime.DeviceBuffer(SLOT)
    unrelated = runtime.DeviceBuffer(SLOT)
    stream.hold_until_done(host, device, device.ptr)  # the int address is the caller's to keep
    del host
    stream.finish_work_on(unrelated)  # not held: returns with the stream still blocked
    unrelated.free()
    assert (ran, is_alive(host_ref)) == ([], True)
    threading.Timer(0.05, gate.set).start()
    device.free()  # waits for the held work first
    assert ran == ["kernel"]
    assert device.closed
    stream.synchronize()
    assert not is_alive(host_ref)


def test_free_after_synchronize_returns_device_memory_at_once():
    stream = runtime.Stream()
    device = runtime.DeviceBuffer(1 << 20)
    stream.memcpy_async(device, filled(8), SLOT)
    stream.synchronize()
    free_before, _ = runtime.mem_info()
    device.free()
    free_after, _ = runtime.mem_info()
    assert free_after - free_before >= 1 << 20


def test_destroy_racing_other_threads_gives_clear_errors():
    """Every call racing destroy() succeeds or raises ACL_ERROR_RT_INVALID_HANDLE; no crash."""
    host = filled(1)
    device = runtime.DeviceBuffer(SLOT)
    unexpected: list[BaseException] = []

    def issue(stream: runtime.Stream, started: threading.Barrier) -> None:
        event = runtime.Event(timing=False)
        started.wait()
        while True:
            try:
                stream.memcpy_async(device, host, SLOT)
                event.record(stream)
                stream.wait_event(event)
                runtime.sim_copy_kernel(device, device, SLOT, stream)
                stream.synchronize()
            except ascend_vlm.AclError as error:
                if error.code != ACL_ERROR_RT_INVALID_HANDLE:
                    unexpected.append(error)
                return
            except BaseException as error:  # reported by the assertion below
                unexpected.append(error)
                return

    for _ in range(20):
        stream = runtime.Stream()
        started = threading.Barrier(4)
        workers = [threading.Thread(target=issue, args=(stream, started)) for _ in range(3)]
        for worker in workers:
            worker.start()
        started.wait()
        stream.destroy()
        for worker in workers:
            worker.join()
        assert stream.destroyed
    assert unexpected == []
