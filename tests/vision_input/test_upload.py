"""BatchUploader: staged batches go up on a dedicated runtime stream, with no host-to-host
copy, and the consumer (a runtime event wait, or torch_npu's stream) is ordered after them."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from ascend_vlm import AclError, runtime
from ascend_vlm.runtime import Event
from ascend_vlm.vision_input.staging import StagingPool
from ascend_vlm.vision_input.upload import BatchUploader


def _staged_batch(pool: StagingPool, rows: int) -> dict:
    pixels = torch.from_numpy(pool.acquire(rows * 16 * 4).view(np.float32).reshape(rows, 16))
    pixels.copy_(torch.arange(rows * 16, dtype=torch.float32).reshape(rows, 16))
    return {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, rows, 1]]), "tag": "b"}


def _read_back(buffer: runtime.DeviceBuffer, like: torch.Tensor) -> torch.Tensor:
    host = torch.empty_like(like)
    runtime.memcpy(host, buffer, host.numel() * host.element_size())
    return host


def test_runtime_uploads_count_only_host_to_device_bytes():
    uploader = BatchUploader("runtime")
    with StagingPool(slots=1) as pool:
        batch = _staged_batch(pool, rows=10)
        runtime.sim_reset_stats()
        uploaded = uploader.upload(batch)
        values = uploaded.ready()
        stats = runtime.sim_stats()
        pixel_bytes = 10 * 16 * 4
        grid_bytes = 3 * 8
        assert stats["h2h"] == 0
        assert stats["h2d"] == pixel_bytes + grid_bytes
        assert stats["d2h"] == 0 and stats["d2d"] == 0
        assert values["tag"] == "b"
        for key in ("pixel_values", "image_grid_thw"):
            assert isinstance(values[key], runtime.DeviceBuffer)
            assert torch.equal(_read_back(values[key], batch[key]), batch[key])
    uploader.close()
    uploader.close()


def test_the_copies_run_on_the_uploaders_own_stream_and_the_event_orders_them():
    uploader = BatchUploader("runtime")
    gate = threading.Event()
    uploader.stream.launch_host_func(lambda: gate.wait(10))  # hold the upload stream
    with StagingPool(slots=1) as pool:
        batch = {"pixel_values": _staged_batch(pool, rows=4)["pixel_values"]}
        # Returns at once: a copy from page-locked memory is only queued (one from pageable
        # memory, such as a small tensor made by torch, returns once it is done).
        uploaded = uploader.upload(batch)
        assert not uploaded.event.query()
        consumer = runtime.Stream()
        consumer.wait_event(uploaded.event)
        after = Event(timing=False)
        after.record(consumer)
        assert not after.query()  # the consumer waits for the upload, on the device
        gate.set()
        after.synchronize()
        assert torch.equal(
            _read_back(uploaded.values["pixel_values"], batch["pixel_values"]),
            batch["pixel_values"],
        )
        consumer.destroy()
    uploader.close()


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="destination: expected one of"):
        BatchUploader("gpu")
    uploader = BatchUploader("runtime")
    with pytest.raises(ValueError, match=r"batch\['x'\]: expected a CPU tensor"):
        uploader.upload({"x": torch.empty(2, device="meta")})
    uploader.close()


def test_npu_destination_needs_torch_npu():
    from ascend_vlm import kernel_backend

    with kernel_backend.using_backend("cpu"), pytest.raises(ValueError, match="needs torch_npu"):
        BatchUploader("npu")


@pytest.mark.mock_npu
def test_mock_npu_tensors_arrive_after_torch_npus_stream_waits_for_the_upload():
    uploader = BatchUploader("npu")
    gate = threading.Event()
    uploader.stream.launch_host_func(lambda: gate.wait(10))
    with StagingPool(slots=1) as pool:
        batch = _staged_batch(pool, rows=6)
        expected = {key: value.clone() for key, value in batch.items() if key != "tag"}
        runtime.sim_reset_stats()
        done = threading.Event()
        result: dict = {}

        def upload() -> None:  # a producer thread, as in the prefetcher
            result["uploaded"] = uploader.upload(batch)
            done.set()

        producer = threading.Thread(target=upload)
        producer.start()
        assert not done.wait(0.2)  # the mock's host-memory tensors need the stream to reach them
        gate.set()
        producer.join(10)
        waits: list[int] = []
        make_stream_wait = Event.make_stream_wait

        def spy(event, handle):
            waits.append(handle)
            make_stream_wait(event, handle)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Event, "make_stream_wait", spy)
            values = result["uploaded"].ready()
        assert waits == [torch.npu.current_stream().npu_stream]  # ordered on the device
        current = torch.npu.current_stream()
        marker = Event(timing=False)
        marker.record(current._native)
        marker.synchronize()
        for key, value in expected.items():
            assert torch.equal(values[key], value)
        stats = runtime.sim_stats()
        assert stats["h2h"] == 0
        assert stats["h2d"] == stats["d2h"] == 6 * 16 * 4 + 3 * 8
    uploader.close()


@pytest.mark.mock_npu
def test_torch_npus_stream_waits_on_the_device_through_its_raw_handle():
    upload_stream = runtime.Stream()
    gate = threading.Event()
    upload_stream.launch_host_func(lambda: gate.wait(10))
    event = Event(timing=False)
    event.record(upload_stream)
    current = torch.npu.current_stream()
    event.make_stream_wait(current.npu_stream)
    marker = Event(timing=False)
    marker.record(current._native)
    assert not marker.query()  # torch_npu's stream is held behind the upload stream
    gate.set()
    marker.synchronize()
    with pytest.raises(AclError, match="aclrtStreamWaitEvent"):
        event.make_stream_wait(12345)  # not a stream AscendCL knows
    upload_stream.destroy()


@pytest.mark.mock_npu
def test_handing_over_records_the_consumer_stream_and_allocates_on_a_side_stream():
    uploader = BatchUploader("npu")
    consumer = torch.npu.current_stream()
    assert uploader._allocation_stream is not consumer
    with StagingPool(slots=1) as pool:
        uploaded = uploader.upload(_staged_batch(pool, rows=2))
        torch.npu.recorded_streams.clear()
        values = uploaded.ready()
    recorded = {id(tensor): stream for tensor, stream in torch.npu.recorded_streams}
    tensors = [value for value in values.values() if isinstance(value, torch.Tensor)]
    assert len(tensors) == 2 and all(recorded[id(t)] is consumer for t in tensors)
    uploader.close()


def test_the_target_must_be_torch_npus_current_device():
    from ascend_vlm.testing.mock_npu import mock_npu

    with mock_npu(device_count=2):
        with pytest.raises(ValueError, match=r"expected torch_npu's current device npu:0"):
            BatchUploader("npu", _npu(1))
        torch.npu.set_device(1)
        uploader = BatchUploader("npu", _npu(1))
        assert uploader.stream.device == 1
        assert uploader._consumer_stream.device_index == 1
        assert uploader._allocation_stream.device_index == 1
        uploader.close()
        torch.npu.set_device(0)
        runtime.set_device(0)


def _npu(index: int):
    """A stand-in for torch.device("npu", index), which the CPU build of torch refuses."""
    from types import SimpleNamespace

    return SimpleNamespace(type="npu", index=index)
