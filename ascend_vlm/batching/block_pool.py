"""`BlockPool`: the KV cache of every running sequence, in fixed-size blocks.

Each decoder layer has one key pool and one value pool of shape
``[num_blocks, kv_heads, block_size, head_dim]`` (the page-attention layout of
``torch_npu.npu_fused_infer_attention_score`` for BNSD queries). A sequence holds a list of
block ids (its block table): token ``t`` of the sequence lives in block ``blocks[t //
block_size]`` at offset ``t % block_size``, in every layer. Joining or leaving the batch only
hands out or takes back ids: no stored key or value moves.

Blocks are reference-counted. A block whose tokens are a full block of some prompt (or of a
finished sequence) can be *published* under the chained hash of everything up to its end
(:mod:`~ascend_vlm.batching.prefix_keys`); a later sequence whose prefix hashes the same takes
it (``share``) instead of recomputing it. A published block no sequence holds stays cached,
least recently used first in line for eviction when a fresh block is needed.

Capacity: ``max_blocks`` (from the ``max_kv_bytes`` budget) or unbounded. The pools start small
and double when every block is held, or when a decode step's page attention wants more blocks
than they have (:meth:`BlockPool.reserve`; the only times stored blocks are copied).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

_FIRST_BLOCKS = 64


class BlockPool:
    """Block storage and bookkeeping (see the module docstring). ``geometry`` lists, per
    decoder layer, ``(kv_heads, head_dim)``; the pools take ``dtype`` on ``device``."""

    def __init__(
        self,
        geometry: list[tuple[int, int]],
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_blocks: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        first = _FIRST_BLOCKS if max_blocks is None else min(_FIRST_BLOCKS, max_blocks)
        self.keys = [
            torch.zeros(first, heads, block_size, dim, dtype=dtype, device=device)
            for heads, dim in geometry
        ]
        self.values = [torch.zeros_like(pool) for pool in self.keys]
        self._free = list(range(first - 1, -1, -1))  # popped from the end: lowest id first
        self._references = [0] * first
        self._hash_of: dict[int, int] = {}  # published block -> its prefix hash
        self._block_of: dict[int, int] = {}  # prefix hash -> published block
        self._idle: OrderedDict[int, None] = OrderedDict()  # published, unheld; LRU first
        self.block_bytes = sum(
            2 * heads * block_size * dim * pool.element_size()
            for (heads, dim), pool in zip(geometry, self.keys, strict=True)
        )

    @property
    def num_blocks(self) -> int:
        return len(self._references)

    @property
    def held_blocks(self) -> int:
        """Blocks some sequence holds."""
        return sum(1 for count in self._references if count)

    @property
    def cached_blocks(self) -> int:
        """Published blocks no sequence holds (kept for reuse, evicted first when needed)."""
        return len(self._idle)

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh blocks, each held once: free ones first, then the least recently
        used cached ones (unpublished), then new ones. RuntimeError when ``max_blocks`` are
        all held (admission keeps the running sequences within it), holding none of them."""
        blocks = []
        for _ in range(count):
            if not self._free and not self._idle and not self.reserve(self.num_blocks + 1):
                self.release(blocks)
                raise RuntimeError(
                    f"max_kv_bytes: all {self.num_blocks} KV blocks are held by running "
                    "sequences; the budget admits no more"
                )
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._idle.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._references[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Hold ``blocks`` (published ones a prefix lookup found) once more."""
        for block in blocks:
            self._idle.pop(block, None)
            self._references[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one hold of each of ``blocks`` (a sequence's, in order); a block no longer held
        becomes free, or cached when it is published. The last block is cached first, so
        eviction takes a chain from its tail and leaves its head reachable."""
        for block in reversed(blocks):
            self._references[block] -= 1
            if self._references[block]:
                continue
            if block in self._hash_of:
                self._idle[block] = None
            else:
                self._free.append(block)

    def lookup(self, hashes: list[int]) -> list[int]:
        """The published blocks of the longest run of ``hashes`` from the first (each the
        chained hash of a block and everything before it), refreshed as recently used from the
        last to the first, so the first is evicted last."""
        found = []
        for key in hashes:
            block = self._block_of.get(key)
            if block is None:
                break
            found.append(block)
        for block in reversed(found):
            if block in self._idle:
                self._idle.move_to_end(block)
        return found

    def publish(self, blocks: list[int], hashes: list[int]) -> None:
        """Publish each full block of ``blocks`` under its prefix hash (``hashes[i]`` for
        ``blocks[i]``; extra blocks are partial and skipped). A hash already published keeps
        its first block."""
        for block, key in zip(blocks, hashes, strict=False):
            if key not in self._block_of and block not in self._hash_of:
                self._block_of[key] = block
                self._hash_of[block] = key

    def write(
        self, layer: int, blocks: list[int], keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store ``keys`` / ``values`` [kv_heads, length, head_dim] of layer ``layer`` as the
        tokens ``0 .. length - 1`` of ``blocks`` (enough blocks for ``length``)."""
        length = keys.shape[1]
        count = -(-length // self.block_size)
        padding = count * self.block_size - length
        index = torch.tensor(blocks[:count], device=keys.device)
        for pool, states in ((self.keys[layer], keys), (self.values[layer], values)):
            padded = torch.nn.functional.pad(states, (0, 0, 0, padding))
            heads, _, dim = padded.shape
            pool[index] = padded.view(heads, count, self.block_size, dim).transpose(0, 1)

    def reserve(self, count: int) -> bool:
        """Make the pools at least ``count`` blocks long (doubling them, within ``max_blocks``);
        False, leaving them as they are, when ``max_blocks`` is below ``count``."""
        old = self.num_blocks
        if count <= old:
            return True
        if self.max_blocks is not None and count > self.max_blocks:
            return False
        new = old
        while new < count:
            new *= 2
        if self.max_blocks is not None:
            new = min(new, self.max_blocks)
        for pools in (self.keys, self.values):
            for layer, pool in enumerate(pools):
                grown = pool.new_zeros((new, *pool.shape[1:]))
                grown[:old].copy_(pool)
                pools[layer] = grown
        self._free.extend(range(new - 1, old - 1, -1))
        self._references.extend([0] * (new - old))
        return True
