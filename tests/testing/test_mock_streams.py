"""The mock torch.npu namespace: devices, streams, events, the pytest fixture and marker."""

from __future__ import annotations

import importlib.util
import re
import threading
from types import SimpleNamespace

import pytest
import torch

from ascend_vlm.kernel_backend import active_backend
from ascend_vlm.testing import _streams


def test_devices(mock_npu) -> None:
    if not mock_npu.is_mock:
        pytest.skip("checks the mock's own device bookkeeping")
    assert torch.npu.is_available()
    assert torch.npu.device_count() == 1
    assert torch.npu.current_device() == 0
    torch.npu.set_device("npu:0")
    with pytest.raises(ValueError, match=re.escape("device: expected an index in [0, 1), got 1")):
        torch.npu.set_device(1)
    with pytest.raises(ValueError, match=re.escape("device: expected an int or 'npu[:N]'")):
        torch.npu.set_device("cuda:0")


def test_stream_context_switches_the_current_stream(mock_npu) -> None:
    main = torch.npu.current_stream()
    side = torch.npu.Stream()
    with torch.npu.stream(side):
        assert torch.npu.current_stream() is side
    assert torch.npu.current_stream() is main


def _order_and_time(npu) -> None:
    main, side = npu.current_stream(), npu.Stream()
    start = npu.Event(enable_timing=True)
    end = npu.Event(enable_timing=True)
    start.record(main)
    side.wait_event(start)
    side.wait_stream(main)
    end.record(side)
    npu.synchronize()
    # synchronize() waited for every stream: all recorded work is complete.
    assert (start.query(), end.query(), main.query(), side.query()) == (True, True, True, True)
    assert start.elapsed_time(start) == 0.0
    assert start.elapsed_time(end) >= 0.0
    unrecorded = npu.Event(enable_timing=True)
    with pytest.raises(ValueError, match="elapsed_time: expected both events recorded"):
        start.elapsed_time(unrecorded)
    untimed = main.record_event()
    with pytest.raises(ValueError, match="elapsed_time: expected two events made with"):
        untimed.elapsed_time(end)


def test_events_order_and_time_work(mock_npu) -> None:
    _order_and_time(torch.npu)


def test_query_is_false_while_work_is_queued(mock_npu) -> None:
    if not mock_npu.is_mock:
        pytest.skip("holds a stream through the mock's native runtime stream")
    main, side = torch.npu.current_stream(), torch.npu.Stream()
    gate = threading.Event()
    main._native.launch_host_func(lambda: gate.wait(10))  # main stays busy until the gate opens
    done = main.record_event()
    side.wait_stream(main)
    assert (main.query(), done.query(), side.query()) == (False, False, False)
    gate.set()
    torch.npu.synchronize()
    assert (main.query(), done.query(), side.query()) == (True, True, True)


def test_host_side_streams_when_the_runtime_is_not_built(monkeypatch) -> None:
    monkeypatch.setattr(_streams, "_native_runtime", lambda: None)
    _order_and_time(SimpleNamespace(**_streams.make_stream_api(device_count=1)))


def test_fixture_selects_the_npu_backend(mock_npu) -> None:
    assert active_backend() == ("mock" if mock_npu.is_mock else "npu")


@pytest.mark.mock_npu
def test_marker_installs_the_mock_without_naming_the_fixture() -> None:
    assert active_backend() in ("mock", "npu")


@pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="a real torch_npu is installed"
)
def test_without_the_fixture_the_backend_is_cpu() -> None:
    assert active_backend() == "cpu"
