"""Session lifecycle, devices and error mapping of ascend_vlm.runtime."""

from __future__ import annotations

import threading

import pytest
from _runtime_helpers import (
    ACL_ERROR_INVALID_PARAM,
    ACL_ERROR_RT_INVALID_DEVICEID,
    ACL_ERROR_UNINITIALIZE,
    requires_sim,
    run_python,
)

import ascend_vlm
from ascend_vlm import runtime


@requires_sim
def test_acl_backend_is_sim_here():
    result = run_python("import ascend_vlm; print(ascend_vlm.runtime.acl_backend())")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "sim"


def test_acl_error_is_runtime_error_with_code_name_and_function():
    with pytest.raises(ascend_vlm.AclError) as raised:
        runtime.DeviceBuffer(0)
    error = raised.value
    assert isinstance(error, RuntimeError)
    assert (error.code, error.name, error.function) == (
        ACL_ERROR_INVALID_PARAM,
        "ACL_ERROR_INVALID_PARAM",
        "aclrtMalloc",
    )


@requires_sim
def test_device_count_follows_env():
    default = run_python("from ascend_vlm import runtime; print(runtime.device_count())")
    four = run_python(
        "from ascend_vlm import runtime; print(runtime.device_count())",
        ASCEND_VLM_SIM_DEVICE_COUNT="4",
    )
    assert default.stdout.strip() == "2", default.stderr
    assert four.stdout.strip() == "4", four.stderr


def test_set_device_switches_device_for_all_threads():
    runtime.set_device(1)
    try:
        assert runtime.current_device() == 1
        seen: list[int] = []
        worker = threading.Thread(target=lambda: seen.append(runtime.current_device()))
        worker.start()
        worker.join()
        assert seen == [1]
        assert runtime.DeviceBuffer(64).device == 1
    finally:
        runtime.set_device(0)


def test_set_device_out_of_range_raises_invalid_deviceid():
    with pytest.raises(ascend_vlm.AclError) as raised:
        runtime.set_device(runtime.device_count())
    assert raised.value.code == ACL_ERROR_RT_INVALID_DEVICEID
    assert "device: expected an id in [0, " in str(raised.value)
    with pytest.raises(TypeError, match="device: expected an int"):
        runtime.set_device("0")


def test_mem_info_tracks_allocations():
    free_before, total = runtime.mem_info()
    buffer = runtime.DeviceBuffer(1 << 20)
    free_during, total_during = runtime.mem_info()
    buffer.free()
    free_after, _ = runtime.mem_info()
    assert total_during == total
    # aclrtMalloc charges the size rounded up to 32 bytes plus a 32-byte pad.
    assert free_before - free_during == (1 << 20) + 32
    assert free_after == free_before


def test_init_finalize_are_reference_counted_and_idempotent():
    while runtime.is_initialized():  # drop the references earlier tests left behind
        runtime.finalize()
    runtime.finalize()  # without references: harmless
    runtime.init()
    runtime.init()
    stream = runtime.Stream()
    runtime.finalize()
    assert runtime.is_initialized()
    stream.synchronize()  # still usable: one reference left
    runtime.finalize()
    assert not runtime.is_initialized()
    with pytest.raises(ascend_vlm.AclError) as raised:
        stream.synchronize()
    assert raised.value.code == ACL_ERROR_UNINITIALIZE
    del stream  # destructor of a stale stream must not touch the new session
    assert runtime.DeviceBuffer(32).nbytes == 32  # implicit re-initialisation
    assert runtime.is_initialized()


def test_concurrent_init_finalize_keeps_count_consistent():
    runtime.init()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for _ in range(50):
                runtime.init()
                buffer = runtime.DeviceBuffer(128)
                buffer.free()
                runtime.finalize()
        except BaseException as error:  # surfaced by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert runtime.is_initialized()  # our own reference is still held
    runtime.finalize()


def test_finalize_while_a_callback_runs_and_another_thread_allocates():
    """No lock-order inversion between the GIL, the session lock and the report thread."""
    code = (
        "import threading, time\n"
        "from ascend_vlm import runtime\n"
        "runtime.init()\n"
        "stream = runtime.Stream()\n"
        "stream.launch_host_func(lambda: time.sleep(0.3))\n"
        "time.sleep(0.05)\n"
        "closer = threading.Thread(target=runtime.finalize)\n"
        "closer.start()\n"
        "time.sleep(0.05)\n"
        "runtime.init()  # takes the session lock while holding the GIL\n"
        "closer.join()\n"
        "runtime.finalize()\n"
        "print('done', flush=True)\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "done"


def test_exit_with_live_objects_and_pending_callback_is_clean():
    code = (
        "from ascend_vlm import runtime\n"
        "import numpy as np\n"
        "s = runtime.Stream(); m = runtime.MappedBuffer(4096); d = runtime.DeviceBuffer(4096)\n"
        "v = np.frombuffer(m, dtype=np.uint8); v[:] = 1\n"
        "s.memcpy_async(d, m, 4096)\n"
        "s.launch_host_func(lambda: print('callback ran', flush=True))\n"
        "e = runtime.Event(); e.record(s)\n"
        "print('exiting', flush=True)\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "exiting" in result.stdout
    assert "Traceback" not in result.stderr
