"""ops.paged_attention: a decode step over KV in blocks equals dense attention over each row's
own keys, on CPU (gather, then fused_attention) and through the mock
npu_fused_infer_attention_score (held to torch_npu's page-attention contract)."""

from __future__ import annotations

import pytest
import torch

from ascend_vlm import ops
from ascend_vlm.testing._checks import KernelRefused

HEADS, KV_HEADS, DIM = 4, 2, 8


def _paged_case(dtype: torch.dtype, block_size: int, lengths: list[int]):
    """Query, block pools, table and, per row, its dense keys and values (its blocks in a
    shuffled order inside the pool)."""
    generator = torch.Generator().manual_seed(0)
    counts = [-(-n // block_size) for n in lengths]
    num_blocks = sum(counts) + 3
    keys = torch.randn(num_blocks, KV_HEADS, block_size, DIM, generator=generator).to(dtype)
    values = torch.randn(num_blocks, KV_HEADS, block_size, DIM, generator=generator).to(dtype)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for count in counts:
        tables.append(order[start : start + count])
        start += count
    width = max(counts)
    table = torch.tensor([t + [order[-1]] * (width - len(t)) for t in tables], dtype=torch.int32)
    query = torch.randn(len(lengths), HEADS, 1, DIM, generator=generator).to(dtype)
    dense = [
        (
            keys[ids].transpose(0, 1).reshape(KV_HEADS, -1, DIM)[:, :length],
            values[ids].transpose(0, 1).reshape(KV_HEADS, -1, DIM)[:, :length],
        )
        for ids, length in zip(tables, lengths, strict=True)
    ]
    return query, keys, values, table, dense


def _dense_attention(query: torch.Tensor, dense, scale: float) -> torch.Tensor:
    rows = []
    for row, (keys, values) in enumerate(dense):
        keys = keys.float().repeat_interleave(HEADS // KV_HEADS, 0)
        values = values.float().repeat_interleave(HEADS // KV_HEADS, 0)
        scores = query[row].float() @ keys.transpose(1, 2) * scale
        rows.append(scores.softmax(-1) @ values)
    return torch.stack(rows)


def test_the_cpu_reference_equals_dense_attention_over_each_rows_keys():
    lengths = [1, 7, 16, 23]
    query, keys, values, table, dense = _paged_case(torch.float32, 4, lengths)
    output = ops.paged_attention(query, keys, values, table, lengths, scale=0.3)
    assert output.shape == query.shape
    torch.testing.assert_close(output, _dense_attention(query, dense, 0.3))


def test_the_npu_path_calls_page_attention_and_matches_the_reference(mock_npu, monkeypatch):
    lengths = [3, 40, 17]
    query, keys, values, table, dense = _paged_case(torch.float16, 16, lengths)
    calls = []
    kernel = mock_npu.torch_npu.npu_fused_infer_attention_score

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(mock_npu.torch_npu, "npu_fused_infer_attention_score", spy)
    output = ops.paged_attention(query, keys, values, table, lengths)
    assert len(calls) == 1 and calls[0]["block_size"] == 16 and calls[0]["input_layout"] == "BNSD"
    assert calls[0]["actual_seq_lengths_kv"] == lengths
    expected = _dense_attention(query, dense, DIM**-0.5).to(torch.float16)
    torch.testing.assert_close(output, expected, atol=2e-3, rtol=2e-3)


def test_calls_outside_the_kernels_limits_run_the_reference(mock_npu, monkeypatch):
    # float32 and a block size that is not a multiple of 16 are outside the documented limits
    for dtype, block_size in ((torch.float32, 16), (torch.float16, 8)):
        lengths = [5, 12]
        query, keys, values, table, dense = _paged_case(dtype, block_size, lengths)
        monkeypatch.setattr(
            mock_npu.torch_npu, "npu_fused_infer_attention_score", pytest.fail, raising=True
        )
        output = ops.paged_attention(query, keys, values, table, lengths)
        expected = _dense_attention(query, dense, DIM**-0.5).to(dtype)
        torch.testing.assert_close(output, expected, atol=2e-3, rtol=2e-3)


def test_the_mock_kernel_refuses_what_torch_npu_refuses(mock_npu):
    kernel = mock_npu.torch_npu.npu_fused_infer_attention_score
    query, keys, values, table, _ = _paged_case(torch.float16, 16, [4])
    paged = dict(num_heads=HEADS, num_key_value_heads=KV_HEADS, input_layout="BNSD")
    with pytest.raises(NotImplementedError, match=r"^block_table: the mock models page"):
        kernel(query, keys, values, actual_seq_lengths_kv=[4], **paged)
    with pytest.raises(KernelRefused, match="block_size: expected a multiple of 16"):
        kernel(query, keys, values, block_table=table, actual_seq_lengths_kv=[4],
               block_size=8, **paged)  # fmt: skip
    with pytest.raises(ValueError, match=r"^actual_seq_lengths_kv: expected 1 lengths"):
        kernel(query, keys, values, block_table=table, block_size=16, **paged)
    shared = torch.zeros(2, 1, dtype=torch.int32)  # two rows in one block: 2 counted, 1 held
    with pytest.raises(ValueError, match=r"^key: expected blocknum >= 2 .*, got 1$"):
        kernel(query.expand(2, -1, -1, -1), keys[:1], values[:1], block_table=shared,
               actual_seq_lengths_kv=[4, 4], block_size=16, **paged)  # fmt: skip


def test_bad_arguments_name_the_argument():
    query, keys, values, table, _ = _paged_case(torch.float32, 4, [5])
    with pytest.raises(ValueError, match=r"^block_table: expected int32 \[1, max_blocks\]"):
        ops.paged_attention(query, keys, values, table.long(), [5])
    with pytest.raises(ValueError, match=r"^lengths: expected 1 ints in \[1, 8\], got \[9\]"):
        ops.paged_attention(query, keys, values, table, [9])
    with pytest.raises(ValueError, match=r"^query: expected \[B, N, 1, D\]"):
        ops.paged_attention(query.expand(1, HEADS, 2, DIM), keys, values, table, [5])
