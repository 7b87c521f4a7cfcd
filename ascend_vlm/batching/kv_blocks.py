"""`KVBlocks`: the running sequences' KV in blocks, as the batch generator drives it.

A sequence's lifetime in blocks:

1. :meth:`KVBlocks.reuse`: before its prefill, the longest run of its prompt's leading full
   blocks the prefix cache holds (limited by :func:`~ascend_vlm.batching.prefill.reusable_tokens`)
   is shared with it; :meth:`KVBlocks.prefill_call` gives the cache and keywords to prefill the
   rest with;
2. :meth:`KVBlocks.store`: after its prefill, its prompt's remaining tokens are written into
   fresh blocks, and the prompt's full blocks are published for later prompts;
3. :meth:`KVBlocks.decode_cache`: before each decode step, a row whose blocks are full gets one
   more, and the step's :class:`~ascend_vlm.batching.paged_cache.PagedCache` is set up;
4. :meth:`KVBlocks.release`: when it leaves, the full blocks of everything it cached (prompt and
   generated tokens) are published, and its blocks handed back.
"""

from __future__ import annotations

from typing import Any

import torch

from ascend_vlm._compat.cache import cache_layer_kind
from ascend_vlm.batching.block_pool import BlockPool
from ascend_vlm.batching.paged_cache import PagedCache
from ascend_vlm.batching.prefill import reusable_tokens, seeded_cache, store_prompt, suffix_inputs
from ascend_vlm.batching.prefix_keys import block_hashes, prompt_image_digest
from ascend_vlm.batching.request import SequenceState


class KVBlocks:
    """Blocks of ``block_size`` tokens for the sequences of one generator; ``prefix_cache``
    turns reuse across requests on; ``max_blocks`` bounds the pool (None: unbounded);
    ``image_token`` is the model's image placeholder id (None for none)."""

    def __init__(
        self,
        block_size: int,
        prefix_cache: bool,
        max_blocks: int | None,
        image_token: int | None,
        config: Any,
    ) -> None:
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self._max_blocks = max_blocks
        self._image_token = image_token
        self._config = config
        self.pool: BlockPool | None = None  # made from the first prefill's cache
        self._cache: PagedCache | None = None

    def held_bytes(self) -> int:
        """Bytes of the blocks some sequence holds (a shared block once)."""
        return 0 if self.pool is None else self.pool.held_blocks * self.pool.block_bytes

    def key_prompt(self, sequence: SequenceState) -> None:
        """Note what ``sequence``'s prefix-cache keys hash beside its tokens: its images and
        where the first image token is."""
        if not self.prefix_cache:
            return
        images = self._image_positions(sequence.inputs["input_ids"][0])
        sequence.first_image = images[0] if images else None
        sequence.image_digest = prompt_image_digest(sequence.inputs, sequence.image_keys)

    def reuse(self, sequence: SequenceState) -> int:
        """Share with ``sequence`` the cached blocks of its prompt's longest reusable prefix
        (its ``blocks`` then start with them) and return that prefix's length in tokens."""
        if not self.prefix_cache or self.pool is None:
            return 0
        ids = sequence.inputs["input_ids"][0]
        found = self.pool.lookup(self._hashes(sequence, ids.tolist()))
        positions = self._image_positions(ids)
        start = reusable_tokens(len(found), len(ids), self.block_size, positions)
        sequence.blocks = found[: start // self.block_size]
        self.pool.share(sequence.blocks)
        return start

    def prefill_call(
        self, sequence: SequenceState, inputs: dict[str, torch.Tensor], start: int,
        positions: torch.Tensor | None,
    ) -> tuple[Any, dict[str, torch.Tensor]]:  # fmt: skip
        """The cache and model keywords that prefill ``inputs`` (on the model's device) after
        the ``start`` tokens :meth:`reuse` found; ``positions`` the prompt's position ids
        (None: ``0 .. L - 1``)."""
        if not start:
            from transformers import DynamicCache

            return DynamicCache(config=self._config), inputs
        if positions is None:
            ids = inputs["input_ids"]
            positions = torch.arange(ids.shape[1], device=ids.device)[None]
        cache = seeded_cache(self.pool, sequence.blocks, start, self._config)
        return cache, suffix_inputs(inputs, start, self._image_token, positions)

    def store(self, sequence: SequenceState, cache: Any, start: int) -> None:
        """Write the prefilled ``cache``'s tokens from ``start`` into fresh blocks of
        ``sequence`` and publish its prompt's full blocks."""
        if self.pool is None:
            self._make_pool(cache)
        length = cache.layers[0].keys.shape[2]
        fresh = self.pool.allocate(-(-(length - start) // self.block_size))
        # held by the sequence before the write, so that its release hands them back if it fails
        sequence.blocks = [*sequence.blocks, *fresh]
        store_prompt(self.pool, fresh, cache, start)
        sequence.cached_tokens = length
        if self.prefix_cache:
            tokens = sequence.inputs["input_ids"][0].tolist()
            self.pool.publish(sequence.blocks, self._hashes(sequence, tokens))

    def decode_cache(self, running: list[SequenceState], gather: bool) -> PagedCache:
        """The cache of one decode step of ``running`` (each gets a block for its next token
        when its blocks are full); ``gather`` as :class:`PagedCache` takes it, and also when
        the pool cannot grow to the page-attention kernel's size for the step: its block
        count at least the sum of every row's, a block rows share counted once per row."""
        for sequence in running:
            if sequence.cached_tokens == len(sequence.blocks) * self.block_size:
                sequence.blocks.extend(self.pool.allocate(1))
        rows_blocks = sum(-(-(s.cached_tokens + 1) // self.block_size) for s in running)
        cache = self._cache
        cache.gather = gather or not self.pool.reserve(rows_blocks)
        cache.begin_step([s.blocks for s in running], [s.cached_tokens for s in running])
        return cache

    def release(self, sequences: list[SequenceState]) -> None:
        """``sequences`` leave: publish the full blocks of all they cached, hand theirs back."""
        for sequence in sequences:
            if self.prefix_cache and sequence.blocks:
                prompt = sequence.inputs["input_ids"][0].tolist()
                generated = sequence.tokens[: sequence.cached_tokens - len(prompt)]
                hashes = self._hashes(sequence, prompt + generated)
                self.pool.publish(sequence.blocks, hashes)
            if sequence.blocks:
                self.pool.release(sequence.blocks)
            sequence.blocks = []

    def _image_positions(self, ids: torch.Tensor) -> list[int]:
        """Where the image tokens of the prompt ``ids`` are, in order."""
        if self._image_token is None:
            return []
        return [int(position) for position in (ids == self._image_token).nonzero()]

    def _hashes(self, sequence: SequenceState, tokens: list[int]) -> list[int]:
        return block_hashes(
            tokens,
            self.block_size,
            sequence.image_digest,
            sequence.first_image,
            namespace=(sequence.adapter or "").encode(),
        )

    def _make_pool(self, cache: Any) -> None:
        keys = cache.layers[0].keys
        geometry = [(layer.keys.shape[1], layer.keys.shape[3]) for layer in cache.layers]
        self.pool = BlockPool(geometry, self.block_size, keys.dtype, keys.device, self._max_blocks)
        self._cache = PagedCache(self.pool, gather=True)


def full_attention_only(config: Any) -> bool:
    """Whether every decoder layer of ``config`` (a text config) is full attention, whose KV
    the blocks hold: its ``layer_types`` say so and the ``DynamicCache`` transformers makes
    for it has only dynamic layers. Sliding-window, chunked and linear-attention layers keep
    other state (a window, chunks, a recurrent state) that a block table does not page."""
    from transformers import DynamicCache

    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):
        return False
    cache = DynamicCache(config=config)
    return all(cache_layer_kind(cache, layer) == "dynamic" for layer in range(len(cache.layers)))
