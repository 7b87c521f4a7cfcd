"""Streams and events: in-order execution, cross-stream ordering, timing, host callbacks."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
from _runtime_helpers import (
    ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID,
    ACL_ERROR_RT_EVENT_TIMESTAMP_REVERSAL,
    ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
    ACL_ERROR_RT_INVALID_HANDLE,
    ACL_ERROR_RT_PARAM_INVALID,
    requires_sim,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import ascend_vlm
from ascend_vlm import _C, runtime

SLOT = 64  # bytes per copy: aclrtMemcpyAsync wants 64-byte aligned addresses


def aligned_zeros(nbytes: int) -> np.ndarray:
    """Zeroed pageable (numpy-owned) bytes at a 64-byte aligned address."""
    raw = np.zeros(nbytes + SLOT, dtype=np.uint8)
    start = -raw.ctypes.data % SLOT
    return raw[start : start + nbytes]


def test_pipeline_of_8_streams_x_1000_ops_keeps_event_order():
    """Stage i copies slot r from stage i-1's buffer after waiting for stage i-1's event.

    Each stage's buffer starts as all-ones sentinels, so a copy that ran before the copy it
    depends on would carry a sentinel to the output instead of the round's value.
    """
    stages, rounds = 8, 1000
    nbytes = rounds * SLOT
    source = runtime.PinnedBuffer(nbytes)
    values = np.frombuffer(source, dtype=np.uint64)
    values[:] = np.arange(values.size, dtype=np.uint64) * 7 + 1
    output = runtime.PinnedBuffer(nbytes)
    sentinel = runtime.PinnedBuffer(nbytes)
    np.frombuffer(sentinel, dtype=np.uint64)[:] = np.iinfo(np.uint64).max
    buffers = [runtime.DeviceBuffer(nbytes) for _ in range(stages)]
    for buffer in buffers:
        runtime.memcpy(buffer, sentinel, nbytes)
    streams = [runtime.Stream() for _ in range(stages)]
    done = [runtime.Event(timing=False) for _ in range(stages)]

    for r in range(rounds):
        offset = r * SLOT
        streams[0].memcpy_async(buffers[0].ptr + offset, source.ptr + offset, SLOT, kind="h2d")
        done[0].record(streams[0])
        for i in range(1, stages):
            streams[i].wait_event(done[i - 1])
            streams[i].memcpy_async(
                buffers[i].ptr + offset, buffers[i - 1].ptr + offset, SLOT, kind="d2d"
            )
            done[i].record(streams[i])
        streams[-1].memcpy_async(output.ptr + offset, buffers[-1].ptr + offset, SLOT, kind="d2h")
    streams[-1].synchronize()

    assert np.array_equal(
        np.frombuffer(output, dtype=np.uint64), np.frombuffer(source, dtype=np.uint64)
    )
    assert all(event.query() for event in done)


def test_elapsed_time_is_non_negative_and_ordered():
    stream = runtime.Stream()
    device = runtime.DeviceBuffer(1 << 22)
    host = runtime.PinnedBuffer(1 << 22)
    marks = [runtime.Event() for _ in range(4)]
    marks[0].record(stream)
    for mark in marks[1:]:
        stream.memcpy_async(device, host, 1 << 22)
        mark.record(stream)
    marks[-1].synchronize()
    times = [marks[0].elapsed_time(mark) for mark in marks]
    assert times[0] == 0.0
    assert all(t >= 0.0 for t in times)
    assert times == sorted(times)
    # Each is the difference of two timestamps: spans add up, and the reverse order fails.
    assert times[1] + marks[1].elapsed_time(marks[3]) == pytest.approx(times[3], abs=1e-3)
    with pytest.raises(ascend_vlm.AclError) as raised:
        marks[3].elapsed_time(marks[0])
    assert raised.value.code == ACL_ERROR_RT_EVENT_TIMESTAMP_REVERSAL


def test_elapsed_time_needs_recorded_timing_events():
    stream = runtime.Stream()
    plain, timed, never = runtime.Event(timing=False), runtime.Event(), runtime.Event()
    plain.record(stream)
    timed.record(stream)
    stream.synchronize()
    for start, end in [(plain, timed), (timed, never)]:
        with pytest.raises(ascend_vlm.AclError) as raised:
            start.elapsed_time(end)
        assert raised.value.code == ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID
    assert never.query()  # never recorded: nothing pending


def test_host_callbacks_run_in_stream_order_and_block_later_work():
    stream = runtime.Stream()
    host = runtime.PinnedBuffer(SLOT)
    device = runtime.DeviceBuffer(SLOT)
    result = runtime.PinnedBuffer(SLOT)
    values = np.frombuffer(host, dtype=np.uint64)
    seen: list[tuple[int, int]] = []

    def writer(step: int):
        def callback() -> None:
            seen.append((step, int(values[0])))
            values[0] = step * 10  # later copies must observe this write

        return callback

    values[0] = 0
    for step in range(1, 6):
        stream.launch_host_func(writer(step))
        stream.memcpy_async(device, host, SLOT)
    stream.memcpy_async(result, device, SLOT)
    stream.synchronize()
    assert seen == [(1, 0), (2, 10), (3, 20), (4, 30), (5, 40)]
    assert int(np.frombuffer(result, dtype=np.uint64)[0]) == 50


def test_raising_callback_is_reported_and_stream_continues(monkeypatch):
    stream = runtime.Stream()
    reported: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: reported.append(info.exc_value))
    after: list[int] = []
    stream.launch_host_func(lambda: 1 / 0)
    stream.launch_host_func(lambda: after.append(1))
    stream.synchronize()
    assert after == [1]
    assert len(reported) == 1 and isinstance(reported[0], ZeroDivisionError)


def test_wait_event_orders_across_streams_behind_a_slow_callback():
    producer, consumer = runtime.Stream(), runtime.Stream()
    host = runtime.PinnedBuffer(SLOT)
    device = runtime.DeviceBuffer(SLOT)
    out = runtime.PinnedBuffer(SLOT)
    values = np.frombuffer(host, dtype=np.uint64)
    values[0] = 1
    gate = threading.Event()
    ready = runtime.Event(timing=False)

    producer.launch_host_func(lambda: gate.wait(10))
    producer.memcpy_async(device, host, SLOT)
    ready.record(producer)
    consumer.wait_event(ready)
    consumer.memcpy_async(out, device, SLOT)
    assert not ready.query()
    values[0] = 42  # still in time: the producer's copy waits behind the callback
    gate.set()
    consumer.synchronize()
    assert int(np.frombuffer(out, dtype=np.uint64)[0]) == 42


def test_dropping_a_stream_waits_for_its_callbacks():
    ran: list[int] = []
    stream = runtime.Stream()
    gate = threading.Event()
    stream.launch_host_func(lambda: gate.wait(10))
    stream.launch_host_func(lambda: ran.append(1))
    threading.Timer(0.05, gate.set).start()
    del stream  # releases the GIL while the callbacks (which need it) finish
    assert ran == [1]


@requires_sim
def test_destroy_waits_for_queued_work_then_invalidates_the_handle():
    stream = runtime.Stream()
    device = runtime.DeviceBuffer(SLOT)
    host = runtime.PinnedBuffer(SLOT)
    np.frombuffer(host, dtype=np.uint8)[:] = 3
    out = runtime.PinnedBuffer(SLOT)
    np.frombuffer(out, dtype=np.uint8)[:] = 0
    gate = threading.Event()
    stream.launch_host_func(lambda: gate.wait(10))
    stream.memcpy_async(device, host, SLOT)
    stream.memcpy_async(out, device, SLOT)
    threading.Timer(0.05, gate.set).start()
    handle = stream.handle
    stream.destroy()  # aclrtDestroyStream waits for unfinished tasks
    assert stream.destroyed
    assert np.all(np.frombuffer(out, dtype=np.uint8) == 3)
    with pytest.raises(ascend_vlm.AclError) as raised:
        _C._testing_acl.destroy_stream(handle)  # destroyed handle
    assert raised.value.code == ACL_ERROR_RT_INVALID_HANDLE
    with pytest.raises(ascend_vlm.AclError) as raised:
        stream.synchronize()
    assert raised.value.code == ACL_ERROR_RT_INVALID_HANDLE


@requires_sim
def test_copy_into_memory_freed_while_queued_fails_at_synchronize():
    stream = runtime.Stream()
    gate = threading.Event()
    device_ptr = _C._testing_acl.malloc(64)
    host = runtime.PinnedBuffer(64)
    stream.launch_host_func(lambda: gate.wait(10))
    # The native call: the Python layer only takes addresses of the runtime's own buffers.
    _C.Stream.memcpy_async(stream, device_ptr, 64, host.ptr, 64, 1)  # valid when issued
    _C._testing_acl.free(device_ptr)  # freed before the copy runs
    gate.set()
    with pytest.raises(ascend_vlm.AclError) as raised:
        stream.synchronize()
    assert (raised.value.code, raised.value.function) == (
        ACL_ERROR_RT_PARAM_INVALID,
        "aclrtSynchronizeStream",
    )
    stream.synchronize()  # the error is reported once


@requires_sim
def test_async_copy_rules_from_the_acl_reference():
    stream = runtime.Stream()
    device = runtime.DeviceBuffer(256)
    pinned = runtime.PinnedBuffer(256)
    np.frombuffer(pinned, dtype=np.uint8)[:] = 4
    # No alignment is required of async copies (hicann/runtime api_ref 11-03 lists none).
    stream.memcpy_async(device.ptr + 8, pinned.ptr + 3, 64, kind="h2d")
    back = np.zeros(64, dtype=np.uint8)
    stream.memcpy_async(back, device.ptr + 8, 64)
    stream.synchronize()
    assert np.all(back == 4)
    with pytest.raises(ascend_vlm.AclError) as raised:
        stream.memcpy_async(runtime.PinnedBuffer(256), pinned, 256)  # async host-to-host
    assert raised.value.code == ACL_ERROR_RT_FEATURE_NOT_SUPPORT


@requires_sim
def test_async_copy_with_pageable_memory_returns_after_the_copy():
    stream = runtime.Stream()
    device = runtime.DeviceBuffer(SLOT)
    runtime.memcpy(device, np.full(SLOT, 5, dtype=np.uint8), SLOT)
    pinned_out = runtime.PinnedBuffer(SLOT)
    np.frombuffer(pinned_out, dtype=np.uint8)[:] = 0  # host allocations start uninitialised
    gate = threading.Event()
    stream.launch_host_func(lambda: gate.wait(10))
    stream.memcpy_async(pinned_out, device, SLOT)  # pinned: queued behind the gate
    assert not np.frombuffer(pinned_out, dtype=np.uint8).any()
    threading.Timer(0.1, gate.set).start()
    pageable = aligned_zeros(SLOT)
    stream.memcpy_async(pageable, device, SLOT)  # waits for the gate
    assert np.all(pageable == 5)
    assert np.all(np.frombuffer(pinned_out, dtype=np.uint8) == 5)


@requires_sim
def test_foreign_and_destroyed_event_handles_are_invalid():
    event = runtime.Event()
    with pytest.raises(ascend_vlm.AclError) as raised:
        _C._testing_acl.destroy_event(event.handle + 8)
    assert raised.value.code == ACL_ERROR_RT_INVALID_HANDLE
    with pytest.raises(ascend_vlm.AclError) as raised:
        _C._testing_acl.destroy_stream(event.handle)  # an event is not a stream
    assert raised.value.code == ACL_ERROR_RT_INVALID_HANDLE


def test_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"priority: expected 0\.\.7, got 9"):
        runtime.Stream(priority=9)
    stream = runtime.Stream(priority=3)
    assert stream.priority == 3
    with pytest.raises(TypeError, match="fn: expected a callable"):
        stream.launch_host_func(42)
    with pytest.raises(TypeError, match="event: expected an Event"):
        stream.wait_event(stream)
    with pytest.raises(TypeError, match="stream: expected a Stream"):
        runtime.memcpy_async(runtime.DeviceBuffer(8), runtime.PinnedBuffer(8), 8, stream=None)
    with pytest.raises(ValueError, match="kind: expected one of"):
        stream.memcpy_async(runtime.DeviceBuffer(8), runtime.PinnedBuffer(8), 8, kind="up")


def test_threads_issue_work_concurrently():
    errors: list[BaseException] = []
    results: dict[int, np.ndarray] = {}

    def worker(index: int) -> None:
        try:
            stream = runtime.Stream()
            n = 4096
            host = runtime.PinnedBuffer(n)
            device = runtime.DeviceBuffer(n)
            back = runtime.PinnedBuffer(n)
            values = np.frombuffer(host, dtype=np.uint32)
            for step in range(100):
                values[:] = index * 1000 + step
                stream.memcpy_async(device, host, n)
                stream.memcpy_async(back, device, n)
                stream.synchronize()
            results[index] = np.frombuffer(back, dtype=np.uint32).copy()
        except BaseException as error:  # surfaced by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for index in range(6):
        assert np.all(results[index] == index * 1000 + 99)


@settings(max_examples=40, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=4096),
    src_slot=st.integers(0, 7),
    dst_slot=st.integers(0, 7),
)
def test_async_roundtrip_at_aligned_offsets_preserves_bytes(data, src_slot, dst_slot):
    """H2D then D2D then D2H at 64-byte aligned offsets returns exactly the bytes sent."""
    n = len(data)
    span = 8 * SLOT + 4096
    host = runtime.PinnedBuffer(span)
    back = runtime.PinnedBuffer(span)
    first, second = runtime.DeviceBuffer(span), runtime.DeviceBuffer(span)
    src_offset, dst_offset = src_slot * SLOT, dst_slot * SLOT
    np.frombuffer(host, dtype=np.uint8)[src_offset : src_offset + n] = np.frombuffer(
        data, dtype=np.uint8
    )
    stream = runtime.Stream()
    stream.memcpy_async(first.ptr + dst_offset, host.ptr + src_offset, n, kind="h2d")
    stream.memcpy_async(second.ptr + src_offset, first.ptr + dst_offset, n, kind="d2d")
    stream.memcpy_async(back.ptr + dst_offset, second.ptr + src_offset, n, kind="d2h")
    stream.synchronize()
    assert bytes(np.frombuffer(back, dtype=np.uint8)[dst_offset : dst_offset + n]) == data
