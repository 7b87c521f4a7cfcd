"""HostValueCache: one host read per tensor object and in-place version (masks, cu_seqlens)."""

from __future__ import annotations

import gc

import torch

from ascend_vlm.ops._host_values import HostValueCache
from ascend_vlm.ops.varlen_attention import _equal_segment_count as equal_segment_count
from ascend_vlm.ops.varlen_attention import host_bounds


def _counting_cache() -> tuple[HostValueCache, list[int]]:
    reads: list[int] = []

    def read(tensor: torch.Tensor) -> tuple[int, ...]:
        reads.append(id(tensor))
        return tuple(tensor.tolist())

    return HostValueCache(read), reads


def test_reads_once_per_tensor_and_again_after_an_in_place_change() -> None:
    cache, reads = _counting_cache()
    offsets = torch.tensor([0, 3, 6])
    assert cache(offsets) == cache(offsets) == (0, 3, 6)
    assert len(reads) == 1
    offsets[2] = 7  # bumps the version counter
    assert cache(offsets) == (0, 3, 7)
    assert len(reads) == 2
    assert cache(torch.tensor([0, 3, 6])) == (0, 3, 6)  # another object: read again
    assert len(reads) == 3


def test_entry_leaves_with_its_tensor_and_inference_tensors_are_always_read() -> None:
    cache, reads = _counting_cache()
    offsets = torch.tensor([0, 2])
    cache(offsets)
    assert len(cache._entries) == 1
    del offsets
    gc.collect()
    assert not cache._entries
    with torch.inference_mode():
        frozen = torch.tensor([0, 4])
    cache(frozen)
    cache(frozen)
    assert len(reads) == 3 and not cache._entries


def test_equal_segment_count() -> None:
    cu = torch.tensor([0, 3, 6, 9], dtype=torch.int32)
    assert equal_segment_count(cu, cu, 9, 9) == 3
    assert host_bounds(cu) == (0, 3, 6, 9)
    assert equal_segment_count(cu, cu, 9, 9, max_seqlen_q=2) is None  # over the bound: varlen
    assert equal_segment_count(cu, cu.clone(), 9, 9) is None  # not self-attention
    uneven = torch.tensor([0, 2, 6, 9], dtype=torch.int32)
    assert equal_segment_count(uneven, uneven, 9, 9) is None
    assert equal_segment_count(cu, cu, 10, 10) is None  # malformed: left to varlen's checks
