"""Prefetcher: order, backpressure, errors naming the batch and image, and clean shutdown with
slow consumers and slow producers; with staging and uploads, no leaked slot or thread."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

from ascend_vlm import runtime
from ascend_vlm.vision_input import QwenVLPixels
from ascend_vlm.vision_input.prefetch import Prefetcher
from ascend_vlm.vision_input.staging import StagingPool
from ascend_vlm.vision_input.upload import BatchUploader


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ascend-vlm-prefetch"]


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    yield
    gc.collect()
    deadline = time.monotonic() + 5
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _prefetch_threads()


def test_batches_come_in_source_order_under_load():
    def prepare(i: int) -> int:
        time.sleep(0.001 * (i % 3))  # uneven work
        return i * i

    assert list(Prefetcher(range(200), prepare, depth=4)) == [i * i for i in range(200)]


def test_a_slow_consumer_holds_the_producer_back_at_depth():
    prepared: list[int] = []

    def prepare(i: int) -> int:
        prepared.append(i)
        return i

    with Prefetcher(range(100), prepare, depth=3) as batches:
        assert next(batches) == 0
        time.sleep(0.3)  # a slow step: the producer fills the queue and waits
        # Taken: 1; queued: 3; one more prepared and waiting for room.
        assert len(prepared) == 5
        assert [next(batches) for _ in range(3)] == [1, 2, 3]


def test_a_slow_producer_is_waited_for():
    def prepare(i: int) -> int:
        time.sleep(0.05)
        return -i

    with Prefetcher(range(5), prepare, depth=2) as batches:
        assert list(batches) == [0, -1, -2, -3, -4]


def test_a_failure_surfaces_at_its_position_naming_the_batch_and_image():
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    pixels = QwenVLPixels(Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112))
    good = Image.new("RGB", (60, 60), "red")
    sources = [[good], [good, "not an image"], [good]]
    with StagingPool(slots=4) as pool:
        batches = Prefetcher(
            sources,
            lambda images: pixels(images, staging=pool),
            depth=2,
            staging=pool,
            describe=lambda images: f"{len(images)} images",
        )
        assert next(batches)["pixel_values"].shape[1] == 1176
        with pytest.raises(
            ValueError,
            match=r"images\[1\]: expected a local image file, .*got .not an image. \(no such file\)",
        ) as caught:
            next(batches)
        assert "while preparing batch 1 (2 images) ahead" in caught.value.__notes__
        with pytest.raises(StopIteration):  # the producer stopped at the failure
            next(batches)
        gc.collect()
        assert pool.in_use == 0
    pixels.close()


def test_a_failing_source_is_named():
    def source():
        yield 1
        raise OSError("disk gone")

    batches = Prefetcher(source(), lambda i: i)
    assert next(batches) == 1
    with pytest.raises(OSError, match="disk gone") as caught:
        next(batches)
    assert "while preparing batch 1 (the source) ahead" in caught.value.__notes__


@pytest.mark.parametrize("where", ["waiting for room", "waiting for a slot", "preparing"])
def test_close_stops_the_producer_wherever_it_waits(where):
    # Enough slots for the queue, so "waiting for room" really waits on the full queue.
    pool = StagingPool(slots=1 if where == "waiting for a slot" else 4)
    release = threading.Event()

    def prepare(i: int):
        if where == "preparing":
            release.wait(0.5)
        return torch.from_numpy(pool.acquire(64))

    batches = Prefetcher(range(10), prepare, depth=1, staging=pool)
    held = next(batches) if where == "waiting for a slot" else None
    reached = {
        "waiting for a slot": lambda: pool.waiting == 1,
        "waiting for room": lambda: pool.in_use == 2,  # one queued, one waiting to be
        "preparing": lambda: True,
    }[where]
    deadline = time.monotonic() + 5
    while not reached() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reached()
    if where == "waiting for room":
        time.sleep(0.05)
        assert pool.waiting == 0 and pool.in_use == 2  # blocked on the full queue
    started = time.monotonic()
    batches.close()
    assert time.monotonic() - started < 2 and not _prefetch_threads()
    del held
    gc.collect()
    assert pool.in_use == 0
    with pytest.raises(StopIteration):
        next(batches)


def test_close_while_the_producer_prepares_and_every_slot_is_taken_does_not_hang():
    pool = StagingPool(slots=2)

    def prepare(i: int):
        if i == 2:
            time.sleep(0.3)  # close() arrives now; the slot wait comes after it
        return pool.acquire(8)

    batches = Prefetcher(range(10), prepare, depth=1, staging=pool)
    held = [next(batches), next(batches)]  # every slot taken by the consumer
    started = time.monotonic()
    batches.close()
    assert time.monotonic() - started < 2 and not _prefetch_threads()
    del held


def test_an_abandoned_prefetcher_stops_its_thread():
    batches = Prefetcher(iter(range(1000)), lambda i: i, depth=2)
    next(batches)
    del batches  # no close(): garbage collection stops the producer (checked by the fixture)


def test_holding_every_slot_raises_instead_of_waiting_forever():
    pool = StagingPool(slots=2)
    held = []
    with pytest.raises(RuntimeError, match="all 2 staging slots are held, by batches already"):
        for batch in Prefetcher(range(10), lambda i: pool.acquire(8), depth=1, staging=pool):
            held.append(batch)
    assert len(held) == 2


def test_staged_uploaded_batches_reuse_a_bounded_pool_with_no_host_copies():
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    reference = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=224 * 224)
    rng = np.random.default_rng(0)
    sources = [
        [Image.fromarray(rng.integers(0, 256, (112, 140, 3), dtype=np.uint8))] for _ in range(6)
    ]
    pixels = QwenVLPixels(reference, workers=2)
    uploader = BatchUploader("runtime")
    runtime.sim_reset_stats()
    uploaded_bytes = 0
    with StagingPool(slots=2) as pool:
        batches = Prefetcher(
            sources,
            lambda images: pixels(images, staging=pool),
            depth=1,
            uploader=uploader,
            staging=pool,
        )
        for images, values in zip(sources, batches, strict=True):
            expected = reference(images=images, return_tensors="pt")
            for key in ("pixel_values", "image_grid_thw"):
                host = torch.empty_like(expected[key])
                nbytes = host.numel() * host.element_size()
                uploaded_bytes += nbytes
                runtime.memcpy(host, values[key], nbytes)
                assert torch.equal(host, expected[key])
        # A slot returns as soon as its batch is uploaded: one buffer serves every batch.
        assert pool.allocations == 1 and pool.in_use == 0
    stats = runtime.sim_stats()
    assert stats["h2h"] == 0 and stats["h2d"] == uploaded_bytes
    uploader.close()
    pixels.close()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="depth: expected an int >= 1"):
        Prefetcher([], lambda i: i, depth=0)
    with pytest.raises(TypeError, match="prepare: expected a callable"):
        Prefetcher([], "nope")
    uploader = BatchUploader("runtime")
    with pytest.raises(TypeError, match="an uploaded batch must be a mapping"):
        list(Prefetcher([1], lambda i: [i], uploader=uploader))
    uploader.close()


@pytest.mark.mock_npu
def test_the_npu_path_stages_uploads_and_returns_every_slot_under_the_mock():
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    from ascend_vlm.vision_input.prefetch import device_prefetcher

    reference = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    pixels = QwenVLPixels(reference, workers=1)
    rng = np.random.default_rng(1)
    sources = [
        [Image.fromarray(rng.integers(0, 256, (64, 64 + 8 * k, 3), dtype=np.uint8))]
        for k in range(5)
    ]
    staging_pools: list[StagingPool] = []

    def prepare(images, staging):
        staging_pools.append(staging)
        return dict(pixels(images, staging=staging))

    runtime.sim_reset_stats()
    batches = device_prefetcher(sources, prepare, torch.device("cpu"), depth=2, upload=True)
    for images, batch in zip(sources, batches, strict=True):
        expected = reference(images=images, return_tensors="pt")
        assert torch.equal(batch["pixel_values"], expected["pixel_values"])
        assert torch.equal(batch["image_grid_thw"], expected["image_grid_thw"])
    pool = staging_pools[0]
    # The producer waits for each upload, so one slot serves every batch.
    assert all(staging is pool for staging in staging_pools) and pool.slots == 1
    assert pool.in_use == 0 and runtime.sim_stats()["h2h"] == 0
    pixels.close()
