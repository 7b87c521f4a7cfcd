"""`PagedCache`: the transformers ``Cache`` a batched decode step runs with, its layers storing
in a :class:`~ascend_vlm.batching.block_pool.BlockPool`.

Before each step, :meth:`PagedCache.begin_step` takes every running row's block list and length.
When a decoder layer calls ``update`` with the step's keys and values ``[rows, kv_heads, 1,
head_dim]``, the layer writes row ``r``'s token into its block at slot ``lengths[r]`` and then
either

* hands the keys on unchanged, when the model's attention is ascend_vlm's: that function reads
  the blocks itself through the :class:`~ascend_vlm.ops.PagedKV` of :meth:`PagedCache.paged_kv`
  (``torch_npu.npu_fused_infer_attention_score`` on NPU); or
* returns each row's blocks gathered, left-aligned and ``width`` long (the CPU reference for any
  other attention: the row's keys in its first columns, the rest hidden by the step's attention
  mask, :meth:`PagedCache.attention_mask`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ascend_vlm.batching.block_pool import BlockPool
from ascend_vlm.ops import PagedKV, gather_blocks


class PagedLayer(CacheLayerMixin):
    """Decoder layer ``layer`` of a :class:`PagedCache`."""

    is_sliding = False

    def __init__(self, cache: PagedCache, layer: int) -> None:
        super().__init__()
        self._cache, self._layer = cache, layer
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to set up: the pools exist before the first step."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's token of every row into its block (module docstring)."""
        cache = self._cache
        pool = cache.pool
        for pools, states in ((pool.keys, key_states), (pool.values, value_states)):
            pools[self._layer][cache.slot_blocks, :, cache.slot_offsets] = states[:, :, 0]
        if not cache.gather:
            return key_states, value_states
        return tuple(
            gather_blocks(pools[self._layer], cache.block_table)[:, :, : cache.width]
            for pools in (pool.keys, pool.values)
        )

    def get_mask_sizes(self, query_length: Any = None) -> tuple[int, int]:
        return self._cache.width, 0

    def get_seq_length(self) -> int:
        return self._cache.width - 1

    def get_max_length(self) -> int:
        return -1


class PagedCache(Cache):
    """The cache of one decode step over ``pool``'s blocks; ``gather``: hand attention the
    rows' gathered keys (any attention function) rather than the new ones (ascend_vlm's, which
    reads :meth:`paged_kv`). See the module docstring."""

    def __init__(self, pool: BlockPool, gather: bool) -> None:
        super().__init__(layers=[PagedLayer(self, layer) for layer in range(len(pool.keys))])
        self.pool, self.gather = pool, gather
        self.lengths: list[int] = []
        self.width = 0
        self.block_table = torch.zeros(0, 0, dtype=torch.int32)
        self.slot_blocks = self.slot_offsets = torch.zeros(0, dtype=torch.long)

    def begin_step(self, tables: list[list[int]], lengths: list[int]) -> None:
        """The rows' block lists, each already holding a block for its next slot, and their
        lengths (tokens cached) before the step."""
        size = self.pool.block_size
        device = self.pool.keys[0].device
        self.slot_blocks = torch.tensor(
            [table[length // size] for table, length in zip(tables, lengths, strict=True)],
            device=device,
        )
        self.slot_offsets = torch.tensor([length % size for length in lengths], device=device)
        self.lengths = [length + 1 for length in lengths]
        self.width = max(self.lengths)
        columns = max(len(table) for table in tables)
        padded = [table + table[:1] * (columns - len(table)) for table in tables]
        self.block_table = torch.tensor(padded, dtype=torch.int32, device=device)

    def attention_mask(self) -> torch.Tensor:
        """``(rows, width)``: 1 on each row's cached tokens and its new one (left-aligned)."""
        columns = torch.arange(self.width)
        return (columns[None, :] < torch.tensor(self.lengths)[:, None]).long()

    def paged_kv(self) -> PagedKV:
        """The blocks and tables of this step for ascend_vlm's attention function."""
        return PagedKV(self.pool.keys, self.pool.values, self.block_table, list(self.lengths))
