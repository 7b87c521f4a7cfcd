"""The chunk view behind sparse_allreduce_hook: mask, norms, gather/scatter (no processes)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_vlm.distributed.gradient_chunks import GradientChunks

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SPECIALS = (0.0, -0.0, float("nan"), float("inf"), 1e-40, -3.5)
CHUNK_CASES = {
    "numel": st.integers(1, 300),
    "chunk_size": st.integers(1, 40),
    "dtype": st.sampled_from(DTYPES),
    "seed": st.integers(0, 2**16),
}


def chunk_tensor(numel: int, chunk_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """+0.0 except, in some chunks, a few values drawn from SPECIALS (incl. -0.0 and NaN)."""
    generator = torch.Generator().manual_seed(seed)
    flat = torch.zeros(numel, dtype=dtype)
    positions = torch.randint(
        0, max(numel, 1), (numel // (2 * chunk_size) + 1,), generator=generator
    )
    picks = torch.randint(0, len(SPECIALS), positions.shape, generator=generator)
    for position, pick in zip(positions.tolist(), picks.tolist(), strict=True):
        if position < numel:
            flat[position] = SPECIALS[pick]
    return flat


def expected_mask(flat: torch.Tensor, chunk_size: int) -> list[int]:
    raw = flat.view(torch.uint8).tolist()
    width = chunk_size * flat.element_size()
    return [int(any(raw[start : start + width])) for start in range(0, len(raw), width)]


@settings(max_examples=60, deadline=None)
@given(**CHUNK_CASES, via_bytes=st.booleans())
def test_nonzero_mask_flags_every_chunk_that_is_not_all_positive_zero(
    numel: int, chunk_size: int, dtype: torch.dtype, seed: int, via_bytes: bool
) -> None:
    flat = chunk_tensor(numel, chunk_size, dtype, seed)
    chunks = GradientChunks(flat, chunk_size)
    mask = chunks.nonzero_mask(via_bytes=via_bytes)
    assert mask.dtype == torch.int8
    assert chunks.count == math.ceil(numel / chunk_size) == mask.numel()
    assert mask.tolist() == expected_mask(flat, chunk_size)


@settings(max_examples=60, deadline=None)
@given(**CHUNK_CASES)
def test_gather_then_scatter_moves_exactly_the_selected_chunks(
    numel: int, chunk_size: int, dtype: torch.dtype, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    source = GradientChunks(torch.randn(numel, generator=generator).to(dtype), chunk_size)
    selected = torch.rand(source.count, generator=generator) < 0.5
    row_ids = selected[: source.num_full].nonzero().view(-1)
    with_tail = source.count > source.num_full and bool(selected[-1])
    packed = source.gather(row_ids, with_tail)
    assert packed.dtype == dtype
    space = torch.full((numel + 3,), float("nan"), dtype=dtype)
    packed_in_space = source.gather(row_ids, with_tail, space)
    assert packed_in_space.untyped_storage().data_ptr() == space.untyped_storage().data_ptr()
    assert torch.equal(packed_in_space, packed)
    assert source.packed_numel(row_ids, with_tail) == packed.numel()
    assert packed.numel() == int(selected.repeat_interleave(chunk_size)[:numel].sum())
    element_selected = selected.repeat_interleave(chunk_size)[:numel]
    want = torch.where(element_selected, source.flat, torch.zeros((), dtype=dtype))
    for via_numpy in (True, False):  # the CPU row assignment and the index_copy_ of devices
        target = GradientChunks(torch.zeros(numel, dtype=dtype), chunk_size)
        target.scatter_(row_ids, with_tail, packed, via_numpy=via_numpy)
        assert torch.equal(target.flat.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_are_per_chunk_l2_in_float32(dtype: torch.dtype) -> None:
    flat = torch.tensor([3.0, 4.0, 0.0, 0.0, -1.0], dtype=dtype)
    norms = GradientChunks(flat, 2).norms()
    assert norms.dtype == torch.float32
    assert norms.tolist() == [5.0, 0.0, 1.0]
