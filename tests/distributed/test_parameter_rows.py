"""The row geometry behind the default sparse_allreduce_hook: chunks follow parameter shapes."""

import pytest
import torch

from ascend_vlm.distributed.parameter_rows import MIN_CHUNK_BYTES, ParameterRows


def test_an_embedding_is_one_chunk_per_token_row() -> None:
    rows = ParameterRows([torch.Size([262144, 64])], element_size=4)
    assert rows.segments == ((0, 262144, 64),)
    assert rows.count == 262144 and rows.numel == 262144 * 64


def test_narrow_rows_are_grouped_and_biases_joined() -> None:
    # LoRA B of rank 8 (32-byte fp32 rows: 8 to a chunk, 3 left over), two biases, LoRA A.
    shapes = [torch.Size([4099, 8]), torch.Size([5]), torch.Size([7]), torch.Size([8, 4096])]
    rows = ParameterRows(shapes, element_size=4)
    group = MIN_CHUNK_BYTES // (8 * 4)
    assert rows.segments == (
        (0, 4099 // group, group * 8),
        (4096 * 8, 1, 3 * 8),
        (4099 * 8, 1, 12),
        (4099 * 8 + 12, 8, 4096),
    )
    assert rows.first_ids == [0, 512, 513, 514] and rows.count == 522
    assert rows.numel == sum(shape.numel() for shape in shapes)
    assert rows.matches(shapes, rows.numel) and not rows.matches(shapes[:3], rows.numel)


def test_equal_widths_merge_but_a_bias_does_not_join_a_matrix() -> None:
    rows = ParameterRows([torch.Size([3, 64]), torch.Size([2, 8, 8]), torch.Size([64])], 4)
    assert rows.segments == ((0, 5, 64), (320, 1, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_split_packs_selected_chunks_in_id_order(dtype: torch.dtype) -> None:
    shapes = [torch.Size([40, 128]), torch.Size([3]), torch.Size([9, 200])]  # rows >= 256 B
    rows = ParameterRows(shapes, torch.tensor([], dtype=dtype).element_size())
    flat = torch.randn(rows.numel, generator=torch.Generator().manual_seed(0)).to(dtype)
    chunks = rows.chunks(flat)
    selected = torch.tensor([2, 39, 40, 41, 49])  # rows of the first matrix, the bias, the last
    parts = rows.split(selected)
    assert [(segment, position, offset) for segment, position, offset, _ in parts] == [
        (0, 0, 0),
        (1, 2, 256),
        (2, 3, 259),
    ]
    assert rows.packed_numel(parts) == 2 * 128 + 3 + 2 * 200
    packed = torch.empty(rows.packed_numel(parts), dtype=dtype)
    for segment, _, offset, local in parts:
        chunks[segment].gather(local, False, packed[offset:])
    matrix, bias, last = flat[:5120].view(40, 128), flat[5120:5123], flat[5123:].view(9, 200)
    want = torch.cat([matrix[2], matrix[39], bias, last[0], last[8]])
    assert torch.equal(packed, want)
    mask = rows.nonzero_mask(
        rows.chunks(torch.zeros_like(flat).index_fill_(0, torch.tensor([128]), -0.0))
    )
    assert mask.nonzero().view(-1).tolist() == [1]
