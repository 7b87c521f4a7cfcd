"""The vision cache's host tier: two-tier LRU order and byte bounds, exact features after a
round trip through pinned memory (host tensors and simulated device tensors on the runtime
stream), released resources, and bad budgets."""

from __future__ import annotations

import gc
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_vlm import runtime
from ascend_vlm.models import tiny
from ascend_vlm.reuse import host_tier
from ascend_vlm.reuse.cache_entry import CachedFeatures
from ascend_vlm.reuse.cached_features import enable_vision_cache
from ascend_vlm.reuse.host_tier import HostTier, produced_event
from ascend_vlm.reuse.vision_cache import VisionCache


def _value(key: int, size: int) -> CachedFeatures:
    return CachedFeatures(object, False, (torch.full((size,), key, dtype=torch.uint8),))


class _TwoTierReference:
    """The documented policy, on sizes only: device LRU, evictions demoted to a host LRU."""

    def __init__(self, max_bytes: int, host_bytes: int) -> None:
        self.max_bytes, self.host_bytes = max_bytes, host_bytes
        self.device: OrderedDict[int, int] = OrderedDict()
        self.host: OrderedDict[int, int] = OrderedDict()

    def store(self, key: int, size: int) -> None:
        self.host.pop(key, None)
        self._insert(key, size)

    def lookup(self, key: int) -> int | None:
        if key in self.device:
            self.device.move_to_end(key)
            return self.device[key]
        if key in self.host:
            size = self.host.pop(key)
            self._insert(key, size)
            return size
        return None

    def _insert(self, key: int, size: int) -> None:
        if size > self.max_bytes:
            return
        self.device.pop(key, None)
        self.device[key] = size
        while sum(self.device.values()) > self.max_bytes:
            oldest, evicted = self.device.popitem(last=False)
            if evicted <= self.host_bytes:
                while sum(self.host.values()) + evicted > self.host_bytes:
                    self.host.popitem(last=False)
                self.host[oldest] = evicted


@settings(max_examples=60, deadline=None)
@given(
    st.integers(min_value=1, max_value=48),
    st.integers(min_value=1, max_value=64),
    st.lists(
        st.tuples(st.sampled_from(["store", "lookup"]), st.integers(0, 7), st.integers(1, 40)),
        max_size=60,
    ),
)
def test_two_tiers_follow_the_reference_and_return_exact_features(
    max_bytes, host_bytes, operations
):
    cache = VisionCache(max_bytes=max_bytes, host_bytes=host_bytes)
    reference = _TwoTierReference(max_bytes, host_bytes)
    for operation, key, size in operations:
        if operation == "store":
            cache.store(1, "weights", key, _value(key, size))
            reference.store(key, size)
        else:
            (found,) = cache.lookup(1, "weights", [key])
            expected = reference.lookup(key)
            assert (found is None) == (expected is None)
            if found is not None:
                assert torch.equal(
                    found.tensors[0], torch.full((expected,), key, dtype=torch.uint8)
                )
        assert cache.cached_keys() == list(reference.device)
        assert cache.host_cached_keys() == list(reference.host)
        stats = cache.stats()
        assert stats.bytes == sum(reference.device.values()) <= max_bytes
        assert stats.host_bytes == sum(reference.host.values()) <= host_bytes


def test_a_model_answers_from_the_host_tier_exactly():
    model = tiny.build_model("qwen2_vl", attn_implementation="sdpa")
    inputs = tiny.make_inputs("qwen2_vl", model, n_images=2)
    with torch.no_grad():
        expected = model(**inputs).logits
    probe = VisionCache(max_bytes=1 << 30)
    enable_vision_cache(model, probe)
    with torch.no_grad():
        model(**inputs)
    per_image = probe.stats().bytes // 2
    # The device tier holds one image: each lookup brings one back and demotes the other.
    cache = VisionCache(max_bytes=per_image, host_bytes=4 * per_image)
    enable_vision_cache(model, cache)
    for _ in range(3):
        with torch.no_grad():
            torch.testing.assert_close(model(**inputs).logits, expected, rtol=0, atol=0)
    stats = cache.stats()
    assert (stats.misses, stats.hits, stats.host_hits) == (2, 4, 4)
    assert (stats.entries, stats.host_entries, stats.evictions) == (1, 1, 0)
    assert stats.demotions == 5


def test_a_host_tier_too_small_drops_what_it_cannot_hold():
    cache = VisionCache(max_bytes=10, host_bytes=15)
    for key in range(4):
        cache.store(1, "weights", key, _value(key, 10))
    # 0 went to the host tier, then 1 replaced it there, then 2 replaced 1.
    assert (cache.cached_keys(), cache.host_cached_keys()) == ([3], [2])
    assert cache.stats().evictions == 2
    cache.store(1, "weights", 9, _value(9, 10))
    cache.store(
        1, "weights", 8, CachedFeatures(object, False, (torch.zeros(20, dtype=torch.uint8),))
    )
    assert (cache.cached_keys(), cache.host_cached_keys()) == ([9], [3])
    assert cache.lookup(1, "weights", [2]) == [None]


def test_pinned_buffers_are_released_with_the_cache():
    gc.collect()
    before = runtime.sim_resources()["host_allocations"]
    cache = VisionCache(max_bytes=10, host_bytes=100)
    for key in range(5):
        cache.store(1, "weights", key, _value(key, 10))
    assert runtime.sim_resources()["host_allocations"] == before + 4
    cache.clear()
    assert runtime.sim_resources()["host_allocations"] == before
    cache.store(1, "weights", 0, _value(0, 10))
    cache.store(1, "weights", 1, _value(1, 10))
    del cache
    gc.collect()
    assert runtime.sim_resources()["host_allocations"] == before


class _SimDeviceTensor:
    """Stands in for a torch_npu tensor: its bytes live in simulated device memory, so the tier
    moves them with AscendCL copies on its stream."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.dtype = torch.Size(shape), dtype
        self.device = SimpleNamespace(type="npu", index=0)
        self.memory = runtime.DeviceBuffer(max(self.numel() * self.element_size(), 1))

    @classmethod
    def holding(cls, host: torch.Tensor) -> _SimDeviceTensor:
        tensor = cls(tuple(host.shape), host.dtype)
        runtime.memcpy(tensor.memory, host.contiguous(), host.numel() * host.element_size())
        return tensor

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def data_ptr(self) -> int:
        return self.memory.ptr

    def is_contiguous(self) -> bool:
        return True

    def contiguous(self) -> _SimDeviceTensor:
        return self

    def to_host(self) -> torch.Tensor:
        host = torch.empty(self.shape, dtype=self.dtype)
        runtime.memcpy(host, self.memory, self.numel() * self.element_size())
        return host


def test_device_features_leave_and_return_on_the_runtime_stream(mock_npu, monkeypatch):
    monkeypatch.setattr(
        host_tier, "_device_tensor", lambda slot: _SimDeviceTensor(slot.shape, slot.dtype)
    )
    pooled = torch.randn(6, 8)
    deepstack = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    value = produced_event(
        CachedFeatures(
            object, True, (_SimDeviceTensor.holding(pooled), _SimDeviceTensor.holding(deepstack))
        )
    )
    assert value.produced is not None
    streams_before = runtime.sim_resources()["streams"]
    runtime.sim_reset_stats()
    tier = HostTier(1 << 20)
    assert tier.keep("image", value) == 0
    restored = tier.take("image")
    assert restored.ready is not None and tier.take("image") is None
    restored.wait_ready()
    assert torch.equal(restored.tensors[0].to_host(), pooled)
    assert torch.equal(restored.tensors[1].to_host(), deepstack)
    moved = pooled.numel() * 4 + deepstack.numel() * 2
    stats = runtime.sim_stats()
    assert (stats["d2h"], stats["h2d"], stats["h2h"]) == (2 * moved, moved, 0)
    assert runtime.sim_resources()["streams"] == streams_before + 1
    tier.close()
    assert runtime.sim_resources()["streams"] == streams_before


def test_bad_host_budgets_are_refused():
    with pytest.raises(ValueError, match=r"^host_bytes: expected >= 0, got -1"):
        VisionCache(max_bytes=1, host_bytes=-1)
    with pytest.raises(TypeError, match=r"^host_bytes: expected an int, got float"):
        VisionCache(max_bytes=1, host_bytes=1.5)
