"""BlockPool and the prefix keys: reference counts, publishing, least-recently-used eviction,
growth that keeps stored blocks, and hashes that follow tokens and images."""

from __future__ import annotations

import pytest
import torch

from ascend_vlm.batching.block_pool import BlockPool
from ascend_vlm.batching.prefill import reusable_tokens
from ascend_vlm.batching.prefix_keys import block_hashes, image_digest


def _pool(max_blocks: int | None) -> BlockPool:
    return BlockPool([(2, 4), (2, 4)], 4, torch.float32, torch.device("cpu"), max_blocks)


def test_released_published_blocks_stay_cached_until_evicted_least_recently_used_first():
    pool = _pool(max_blocks=4)
    first, second = pool.allocate(2), pool.allocate(2)
    pool.publish(first, [11, 12])
    pool.publish(second, [21, 22])
    pool.release(first)
    pool.release(second)
    assert pool.held_blocks == 0 and pool.cached_blocks == 4
    assert pool.lookup([11, 12, 13]) == first  # refreshes them: the second pair is now older
    fresh = pool.allocate(2)
    assert sorted(fresh) == sorted(second)
    assert pool.lookup([21]) == [] and pool.lookup([11, 12]) == first
    pool.share(first)
    assert pool.held_blocks == 4 and pool.cached_blocks == 0
    with pytest.raises(RuntimeError, match=r"^max_kv_bytes: all 4 KV blocks are held"):
        pool.allocate(1)


def test_a_shared_block_is_freed_only_by_its_last_holder():
    pool = _pool(max_blocks=None)
    (block,) = pool.allocate(1)
    pool.publish([block], [7])
    pool.share([block])
    pool.release([block])
    assert pool.held_blocks == 1
    pool.release([block])
    assert pool.held_blocks == 0 and pool.cached_blocks == 1


def test_growing_the_pool_keeps_every_stored_block():
    pool = _pool(max_blocks=None)
    blocks = pool.allocate(3)
    states = torch.arange(2 * 10 * 4, dtype=torch.float32).view(2, 10, 4)
    pool.write(0, blocks, states, -states)
    pool.allocate(pool.num_blocks - 3 + 1)  # one more than is left: the pools double
    assert pool.num_blocks == 128
    stored = pool.keys[0][blocks].transpose(0, 1).reshape(2, 12, 4)[:, :10]
    torch.testing.assert_close(stored, states)
    assert pool.block_bytes == 2 * 2 * (2 * 4 * 4 * 4)


def test_block_hashes_chain_tokens_and_take_images_from_the_first_image_token_on():
    tokens = list(range(12))
    red = image_digest({"pixel_values": torch.zeros(2, 3)})
    blue = image_digest({"pixel_values": torch.ones(2, 3)})
    with_red = block_hashes(tokens, 4, red, first_image=5)
    with_blue = block_hashes(tokens, 4, blue, first_image=5)
    assert len(with_red) == 3 and with_red[0] == with_blue[0]  # block 0 ends before the image
    assert with_red[1] != with_blue[1] and with_red[2] != with_blue[2]
    changed = block_hashes([99, *tokens[1:]], 4, red, first_image=5)
    assert all(a != b for a, b in zip(changed, with_red, strict=True))  # the chain carries it
    assert block_hashes(tokens[:11], 4, red, 5) == with_red[:2]  # a partial block has none


def test_reuse_keeps_every_image_token_in_the_prefix_or_none():
    # 40-token prompt, blocks of 8, image tokens at 10..20
    images = list(range(10, 21))
    assert reusable_tokens(5, 40, 8, images) == 32  # past the last image token
    assert reusable_tokens(2, 40, 8, images) == 8  # would cut the image: stop before it
    assert reusable_tokens(5, 40, 8, []) == 32
    assert reusable_tokens(5, 33, 8, []) == 32 and reusable_tokens(5, 32, 8, []) == 24


def test_eviction_takes_a_cached_chain_from_its_tail_keeping_its_head_reachable():
    pool = _pool(max_blocks=3)
    chain = pool.allocate(3)
    pool.publish(chain, [1, 2, 3])
    pool.release(chain)
    pool.allocate(2)
    assert pool.lookup([1, 2, 3]) == chain[:1] and pool.cached_blocks == 1


def test_a_looked_up_chain_is_refreshed_so_its_tail_is_evicted_first():
    pool = _pool(max_blocks=4)
    chain, other = pool.allocate(3), pool.allocate(1)
    pool.publish(chain, [1, 2, 3])
    pool.publish(other, [9])
    pool.release(other)
    pool.release(chain)
    assert pool.lookup([1, 2, 3]) == chain  # refreshed: [9] is now the oldest
    assert pool.allocate(2) == [other[0], chain[2]]
    assert pool.lookup([1, 2, 3]) == chain[:2] and pool.lookup([9]) == []
