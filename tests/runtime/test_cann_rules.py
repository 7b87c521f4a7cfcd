"""Rules of real CANN 8.x that the simulator enforces, and the runtime's behaviour under them.

Issue 15: host registration resolved at run time, report-thread codes, device contexts, one
report thread per device, balanced device resets, one aclInit per process, synchronisation
timeouts, and the leak counters across two devices.
"""

from __future__ import annotations

import ast
import re
import threading

import numpy as np
import pytest
from _runtime_helpers import requires_sim, run_python

import ascend_vlm
from ascend_vlm import _C, runtime

pytestmark = requires_sim

ACL_ERROR_RT_STREAM_CONTEXT = 107003
ACL_ERROR_RT_THREAD_SUBSCRIBE = 107012
ACL_ERROR_RT_REPORT_TIMEOUT = 507012
ACL_ERROR_RT_STREAM_SYNC_TIMEOUT = 507046
ACL_ERROR_RT_EVENT_SYNC_TIMEOUT = 507047
ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000

HIDE_HOST_REGISTER = "aclrtHostRegister,aclrtHostUnregister"


def test_capabilities_of_the_default_simulator():
    caps = runtime.capabilities()
    assert caps["backend"] == "sim"
    assert caps["soc_name"] == "Ascend910B1"
    assert caps["host_mapping"] is True
    assert caps["stream_sync_timeout"] is True and caps["event_sync_timeout"] is True
    assert "CANN >= 8.1.RC1" in caps["host_mapping_requirement"]


def test_without_host_registration_mapped_buffers_name_the_requirement_or_fall_back():
    code = (
        "import numpy as np\n"
        "import ascend_vlm\n"
        "from ascend_vlm import runtime\n"
        "caps = runtime.capabilities()\n"
        "print(caps['host_register_exported'], caps['host_mapping'])\n"
        "try:\n"
        "    runtime.MappedBuffer(4096)\n"
        "except ascend_vlm.AclError as e:\n"
        "    print(e.code, e.function, 'CANN >= 8.1.RC1' in str(e))\n"
        "m = runtime.MappedBuffer(4096, fallback=True)\n"
        "np.frombuffer(m, dtype=np.uint8)[:] = 9\n"
        "d = runtime.DeviceBuffer(4096)\n"
        "s = runtime.Stream()\n"
        "runtime.sim_reset_stats()\n"
        "m.sync_to_device(s)\n"
        "runtime.sim_copy_kernel(d, m, 4096, s)\n"
        "s.synchronize()\n"
        "out = np.zeros(4096, dtype=np.uint8)\n"
        "runtime.memcpy(out, d, 4096)\n"
        "print(m.zero_copy, runtime.sim_stats()['h2d'], runtime.sim_stats()['kernel'],"
        " int(out.min()))\n"
    )
    result = run_python(code, ASCEND_VLM_SIM_HIDE_SYMBOLS=HIDE_HOST_REGISTER)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == [
        "False False",
        f"{ACL_ERROR_RT_FEATURE_NOT_SUPPORT} aclrtHostRegister True",
        "False 4096 4096 9",  # the fallback copies (counted), then the kernel reads
    ]


def test_zero_copy_mapped_buffer_sync_calls_copy_nothing():
    mapped = runtime.MappedBuffer(4096, fallback=True)
    stream = runtime.Stream()
    runtime.sim_reset_stats()
    mapped.sync_to_device(stream)
    mapped.sync_to_host(stream)
    stream.synchronize()
    assert mapped.zero_copy
    assert runtime.sim_stats()["h2d"] == runtime.sim_stats()["d2h"] == 0


def test_soc_without_host_registration_is_feature_not_supported():
    code = (
        "import ascend_vlm\n"
        "from ascend_vlm import runtime\n"
        "print(runtime.capabilities()['host_mapping'])\n"
        "try:\n"
        "    runtime.MappedBuffer(64)\n"
        "except ascend_vlm.AclError as e:\n"
        "    print(e.code, 'Atlas A2/A3' in str(e))\n"
    )
    result = run_python(code, ASCEND_VLM_SIM_SOC="Ascend310P3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["False", f"{ACL_ERROR_RT_FEATURE_NOT_SUPPORT} True"]


def test_without_timed_waits_synchronize_still_works():
    code = (
        "from ascend_vlm import runtime\n"
        "caps = runtime.capabilities()\n"
        "s = runtime.Stream(); e = runtime.Event(); e.record(s)\n"
        "s.synchronize(); e.synchronize()\n"
        "print(caps['stream_sync_timeout'], caps['event_sync_timeout'])\n"
    )
    hidden = "aclrtSynchronizeStreamWithTimeout,aclrtSynchronizeEventWithTimeout"
    result = run_python(code, ASCEND_VLM_SIM_HIDE_SYMBOLS=hidden)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False False"


def test_process_report_codes_of_cann_8():
    """Idle poll: ACL_ERROR_RT_REPORT_TIMEOUT; thread without streams: ACL_ERROR_RT_THREAD_SUBSCRIBE."""
    assert _C._testing_acl.process_report(10) == ACL_ERROR_RT_THREAD_SUBSCRIBE
    stream = runtime.Stream()
    ran = threading.Event()
    stream.launch_host_func(ran.set)  # the runtime's report thread handles these codes
    stream.synchronize()
    assert ran.is_set()


def test_streams_keep_their_device_across_set_device():
    stream0 = runtime.Stream()
    event0 = runtime.Event()
    runtime.set_device(1)
    try:
        stream1 = runtime.Stream()
        assert (stream0.device, stream1.device, event0.device) == (0, 1, 0)
        device0 = _on_device(0, lambda: runtime.DeviceBuffer(64))
        host = runtime.PinnedBuffer(64)
        np.frombuffer(host, dtype=np.uint8)[:] = 6
        stream0.memcpy_async(device0, host, 64)  # device 0's stream, device 1 current
        event0.record(stream0)
        stream1.wait_event(event0)  # cross-device ordering is allowed
        stream0.synchronize()
        event0.synchronize()
        with pytest.raises(ascend_vlm.AclError) as raised:
            event0.record(stream1)  # an event of device 0 on a stream of device 1
        assert raised.value.code == ACL_ERROR_RT_STREAM_CONTEXT
        stream0.destroy()
        stream1.destroy()
    finally:
        runtime.set_device(0)


def _on_device(device: int, make):
    previous = runtime.current_device()
    runtime.set_device(device)
    try:
        return make()
    finally:
        runtime.set_device(previous)


def test_synchronize_times_out_with_the_stream_and_the_timeout():
    stream = runtime.Stream()
    gate = threading.Event()
    stream.launch_host_func(lambda: gate.wait(10))
    event = runtime.Event(timing=False)
    event.record(stream)
    with pytest.raises(ascend_vlm.AclError) as raised:
        stream.synchronize(timeout_ms=20)
    assert raised.value.code == ACL_ERROR_RT_STREAM_SYNC_TIMEOUT
    assert re.search(
        r"stream 0x[0-9a-f]+ on device 0 did not complete within 20 ms", str(raised.value)
    )
    with pytest.raises(ascend_vlm.AclError) as raised:
        event.synchronize(timeout_ms=0)
    assert raised.value.code == ACL_ERROR_RT_EVENT_SYNC_TIMEOUT
    gate.set()
    stream.synchronize(timeout_ms=-1)
    event.synchronize()


def test_default_sync_timeout_is_configurable():
    assert runtime.sync_timeout_ms() == 600000
    with pytest.raises(ValueError, match="timeout_ms: expected -1"):
        runtime.set_sync_timeout_ms(-5)
    result = run_python(
        "from ascend_vlm import runtime\nprint(runtime.sync_timeout_ms())",
        ASCEND_VLM_SYNC_TIMEOUT_MS="1234",
    )
    assert result.stdout.strip() == "1234", result.stderr


def test_sessions_release_their_resources_without_reinitialising_acl():
    # A fresh process: host buffers of other tests would keep their devices open (by design).
    code = (
        "import numpy as np\n"
        "from ascend_vlm import runtime\n"
        "for _ in range(3):\n"
        "    runtime.init()\n"
        "    stream = runtime.Stream()\n"
        "    runtime.Event().record(stream)\n"
        "    device = runtime.DeviceBuffer(1 << 16)\n"
        "    stream.memcpy_async(device, np.zeros(1 << 16, dtype=np.uint8), 1 << 16)\n"
        "    stream.launch_host_func(lambda: None)\n"
        "    runtime.finalize()\n"
        "    print(sorted(runtime.sim_resources().items()), flush=True)\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().split("\n")
    assert len(lines) == 3 and len(set(lines)) == 1  # every session ends the same way
    counts = dict(ast.literal_eval(lines[0]))
    assert counts == {
        "device_allocations": 0,
        "device_refs": 0,  # one aclrtResetDevice per aclrtSetDevice
        "events": 0,
        "finalize_calls": 0,  # aclFinalize only at exit
        "host_allocations": 0,
        "host_registrations": 0,
        "init_calls": 1,  # aclInit once per process
        "live_contexts": 0,
        "resets_with_live_handles": 0,  # streams and events destroyed before the reset
        "streams": 0,
        "subscribed_streams": 0,
    }


def test_two_devices_switching_back_and_forth_leaves_no_leaks_at_exit():
    code = (
        "import threading\n"
        "import numpy as np\n"
        "from ascend_vlm import runtime\n"
        "streams, events, buffers, ran = [], [], [], []\n"
        "for round in range(3):\n"
        "    for device in (0, 1, 0, 1):\n"
        "        runtime.set_device(device)\n"
        "        s = runtime.Stream(); e = runtime.Event()\n"
        "        d = runtime.DeviceBuffer(4096); p = runtime.PinnedBuffer(4096)\n"
        "        np.frombuffer(p, dtype=np.uint8)[:] = device + 1\n"
        "        streams.append(s); events.append(e); buffers += [d, p]\n"
        "    for s, e in zip(streams, events):\n"
        "        d = buffers[2 * streams.index(s)]\n"
        "        s.memcpy_async(d, buffers[2 * streams.index(s) + 1], 4096)\n"
        "        e.record(s)\n"
        "        s.launch_host_func(lambda s=s: ran.append(s.device))\n"
        "    runtime.set_device(round % 2)\n"
        "    for s in streams[::2] + streams[1::2][::-1]:\n"
        "        s.destroy()\n"
        "    for e in events: e.synchronize()\n"
        "    streams.clear(); events.clear()\n"
        "print(sorted(ran) == sorted([0, 1, 0, 1] * 3), flush=True)\n"
        "m = runtime.MappedBuffer(4096)\n"
        "view = np.frombuffer(m, dtype=np.uint8)\n"
        "keep = runtime.Stream()\n"
    )
    result = run_python(code, ASCEND_VLM_SIM_LEAK_REPORT="1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
    report = re.search(r"aclsim resources at exit: (.*)", result.stderr)
    assert report is not None, result.stderr
    counts = dict(item.split("=") for item in report.group(1).split())
    assert counts == {
        "streams": "0",
        "events": "0",
        "deviceAllocations": "0",
        "hostAllocations": "0",
        "hostRegistrations": "0",
        "subscribedStreams": "0",
        "deviceRefs": "0",
        "liveContexts": "0",
        "resetsWithLiveHandles": "0",
        "initCalls": "1",
        "finalizeCalls": "1",
    }


def test_documented_constants_are_accepted():
    assert runtime.DeviceBuffer(64, policy="huge1g_only").nbytes == 64
    device = runtime.DeviceBuffer(64)
    host = runtime.PinnedBuffer(64)
    for kind in (5, 6, 7):
        _C.memcpy(device.ptr, 64, host.ptr, 64, kind)
