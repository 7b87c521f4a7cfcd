"""StagingPool: page-locked slots reused across batches, bounded, returned when unreferenced."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from ascend_vlm import runtime
from ascend_vlm.vision_input import QwenVLPixels
from ascend_vlm.vision_input.staging import StagingExhausted, StagingPool


def test_slots_are_page_locked_runtime_memory_and_reused():
    with StagingPool(slots=2) as pool:
        first = pool.acquire(1000)
        address = first.ctypes.data
        assert runtime.memory.known_address("slot", address, 1000)[1] is False  # host side
        del first
        assert pool.in_use == 0
        again = pool.acquire(1024)  # fits the same buffer (1000 rounded up to 2**10)
        assert again.ctypes.data == address and again.nbytes == 1024
        assert pool.allocations == 1
        bigger = pool.acquire(5000)  # the other slot, allocated now
        assert pool.allocations == 2 and pool.in_use == 2
        del again, bigger


def test_a_slot_stays_taken_while_any_view_of_it_lives():
    with StagingPool(slots=1) as pool:
        tensor = torch.from_numpy(pool.acquire(64).view(np.float32)[4:8])
        tensor.fill_(3.0)
        assert pool.in_use == 1
        with pytest.raises(StagingExhausted, match="all 1 staging slots"):
            pool.acquire(64, timeout=0.05)
        del tensor
        gc.collect()
        assert pool.in_use == 0
        assert pool.acquire(64, timeout=0.05).nbytes == 64


def test_acquire_blocks_until_a_slot_returns_and_grows_a_small_buffer():
    with StagingPool(slots=1) as pool:
        held = pool.acquire(16)
        got: list[np.ndarray] = []
        waiter = threading.Thread(target=lambda: got.append(pool.acquire(4096)))
        waiter.start()
        waiter.join(0.1)
        assert waiter.is_alive() and pool.waiting == 1  # backpressure
        del held
        waiter.join(5)
        assert not waiter.is_alive() and got[0].nbytes == 4096
        assert pool.allocations == 2  # the 16-byte buffer was replaced


def test_close_wakes_waiters_and_refuses_later_acquires():
    pool = StagingPool(slots=1)
    held = pool.acquire(16)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            pool.acquire(16)
        except RuntimeError as error:
            errors.append(error)

    waiter = threading.Thread(target=wait)
    waiter.start()
    while pool.waiting == 0:
        threading.Event().wait(0.01)
    pool.close()
    waiter.join(5)
    assert not waiter.is_alive() and "closed" in str(errors[0])
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(16)
    held[:] = 7  # handed-out memory stays valid after close
    assert held.sum() == 7 * 16
    del held


def test_the_smallest_fitting_buffer_serves_and_tensors_keep_their_slot():
    with StagingPool(slots=2) as pool:
        big, small = pool.acquire(4096), pool.acquire(64)
        big_address, small_address = big.ctypes.data, small.ctypes.data
        del big, small
        again_small = pool.acquire(60)  # not the 4 KiB buffer
        assert again_small.ctypes.data == small_address
        tensor = pool.tensor((8, 16), torch.bfloat16)
        assert tensor.shape == (8, 16) and tensor.dtype == torch.bfloat16
        assert tensor.data_ptr() == big_address and pool.allocations == 2
        del again_small
        view = tensor[2:4]
        del tensor
        assert pool.in_use == 1  # the view keeps the slot
        del view
        assert pool.in_use == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_sizes_are_refused(bad):
    with StagingPool() as pool, pytest.raises(ValueError, match="nbytes: expected an int >= 1"):
        pool.acquire(bad)
    with pytest.raises(ValueError, match="slots: expected an int >= 1"):
        StagingPool(slots=bad)


def test_qwen_vl_pixels_write_into_a_slot_and_equal_the_unstaged_output():
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    reference = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=224 * 224)
    images = [
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))
        for seed, (h, w) in enumerate([(100, 60), (224, 224), (31, 300)])
    ]
    pixels = QwenVLPixels(reference, workers=2)
    with StagingPool(slots=1) as pool:
        staged = pixels(images, staging=pool)
        plain = pixels(images)
        value = staged["pixel_values"]
        assert torch.equal(value, plain["pixel_values"])
        assert torch.equal(staged["image_grid_thw"], plain["image_grid_thw"])
        assert pool.in_use == 1
        assert runtime.memory.known_address("pixel_values", value.data_ptr(), 4)[1] is False
        del staged, value
        assert pool.in_use == 0
    pixels.close()
