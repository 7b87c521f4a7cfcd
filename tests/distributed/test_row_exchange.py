"""The row exchange's density sample: it may skip the mask only for buckets that are dense."""

import pytest
import torch

from ascend_vlm.distributed.row_exchange import (
    DENSITY_SAMPLE_MIN_NUMEL,
    _sample_says_dense,
)


class _GroupOfTwo:
    def size(self) -> int:
        return 2


class _TwoRankState:
    """The two members of SparseAllReduceState the density decision reads."""

    density_threshold = 0.5

    def _group(self) -> _GroupOfTwo:
        return _GroupOfTwo()


def rows_touched(fraction: float, dtype: torch.dtype, rows: int = 4096) -> torch.Tensor:
    """A flat [rows, 64] bucket with a random ``fraction`` of rows random, the rest +0.0."""
    generator = torch.Generator().manual_seed(0)
    bucket = torch.zeros(rows, 64, dtype=dtype)
    touched = torch.randperm(rows, generator=generator)[: round(fraction * rows)]
    bucket[touched] = torch.randn(len(touched), 64, generator=generator).to(dtype)
    return bucket.view(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_only_a_bucket_touched_far_beyond_the_threshold_skips_the_mask(
    dtype: torch.dtype,
) -> None:
    state = _TwoRankState()
    # Two ranks, threshold 0.5: each rank's message must stay under half the bucket.
    assert _sample_says_dense(state, rows_touched(1.0, dtype))
    assert _sample_says_dense(state, rows_touched(0.8, dtype))
    assert not _sample_says_dense(state, rows_touched(0.5, dtype))
    assert not _sample_says_dense(state, rows_touched(0.1, dtype))
    # Signed zeros have bits set: a bucket of -0.0 travels, so it counts as touched.
    assert _sample_says_dense(state, torch.full((DENSITY_SAMPLE_MIN_NUMEL,), -0.0, dtype=dtype))


def test_a_small_bucket_is_always_masked_in_full() -> None:
    dense = torch.ones(DENSITY_SAMPLE_MIN_NUMEL - 1)
    assert not _sample_says_dense(_TwoRankState(), dense)
