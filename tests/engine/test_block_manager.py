"""BlockManager: allocation, reference counts, chained-hash prefix caching, LRU eviction."""

from __future__ import annotations

from gyrfalcon.engine.block_manager import BlockManager, hash_block
from gyrfalcon.engine.request import Request
from gyrfalcon.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def test_hash_is_chained():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6, 7, 8])


def test_block_hashes_are_hash_blocks_chain_also_when_extended():
    """_ensure_hashes packs the missing blocks' tokens at once; the hashes are hash_block's chain, also when a
    request's later blocks (output tokens past the prompt, a block across the boundary) are added afterwards."""
    bm = BlockManager(16, 4)
    r = req("a", list(range(100, 110)))  # 2 full blocks and 2 tokens of a third
    bm._ensure_hashes(r, 2)
    want = [hash_block(None, [100, 101, 102, 103])]
    want.append(hash_block(want[0], [104, 105, 106, 107]))
    assert r.block_hashes == want
    r.output_token_ids += [7, 8, 9, 10, 11, 12]  # block 2: 108, 109, 7, 8; block 3: 9, 10, 11, 12
    bm._ensure_hashes(r, 4)
    want.append(hash_block(want[1], [108, 109, 7, 8]))
    want.append(hash_block(want[2], [9, 10, 11, 12]))
    assert r.block_hashes == want
    bm._ensure_hashes(r, 3)  # nothing to add, nothing changed
    assert r.block_hashes == want


def test_allocate_and_free_return_every_block():
    bm = BlockManager(10, 4, enable_prefix_caching=False)
    r = req("a", list(range(9)))
    assert bm.allocate_slots(r, 9)
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 7
    r.num_computed_tokens = 9
    assert bm.allocate_slots(r, 3)  # 12 tokens: still 3 blocks
    assert len(r.block_ids) == 3
    assert bm.allocate_slots(r, 4)  # 13..16 tokens -> 4 blocks
    assert len(r.block_ids) == 4
    bm.free(r)
    assert bm.num_free_blocks == 10 and r.block_ids == []


def test_allocation_fails_cleanly_when_short():
    bm = BlockManager(3, 4, enable_prefix_caching=False)
    r = req("a", list(range(20)))
    assert not bm.allocate_slots(r, 20)
    assert r.block_ids == [] and bm.num_free_blocks == 3


def test_prefix_hits_share_blocks_and_keep_last_token_uncached():
    bm = BlockManager(16, 4)
    a = req("a", list(range(10)))
    assert bm.get_computed_blocks(a) == []
    assert bm.allocate_slots(a, 10)
    b = req("b", list(range(10)) + [77, 78])
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_ids[:2]  # two full blocks of 4; the third is partial in a
    assert bm.allocate_slots(b, 12 - 8, hits)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert all(bm.ref_cnt[x] == 2 for x in hits)
    # A prompt that is exactly two full blocks: only one can be a hit (one token must run).
    c = req("c", list(range(8)))
    assert len(bm.get_computed_blocks(c)) == 1
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_freed_cached_blocks_are_reused_until_evicted():
    bm = BlockManager(4, 4)
    a = req("a", list(range(8)) + [1])
    assert bm.allocate_slots(a, 9)
    cached = a.block_ids[:2]
    bm.free(a)
    assert bm.usage == 0.0
    b = req("b", list(range(8)) + [2])
    assert bm.get_computed_blocks(b) == cached  # still there after free
    # Filling the cache with other content evicts them (LRU): the unhashed block goes first,
    # then the tail block, then the head.
    other = req("o", [100 + i for i in range(16)])
    assert bm.allocate_slots(other, 16)
    assert bm.get_computed_blocks(b) == []
    bm.free(other)


def test_same_content_twice_keeps_one_cache_entry():
    bm = BlockManager(8, 4)
    a, b = req("a", [1, 2, 3, 4, 5]), req("b", [1, 2, 3, 4, 6])
    assert bm.allocate_slots(a, 5)
    assert bm.allocate_slots(b, 5)  # no lookup: computes its own copy of block [1,2,3,4]
    assert len(bm.cached) == 1
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_token_ids_slices_prompt_and_outputs():
    """Request.token_ids(lo, hi) is all_token_ids[lo:hi] on either side of the prompt's end and across it."""
    r = req("a", [10, 11, 12, 13, 14])
    r.output_token_ids += [20, 21, 22]
    full = r.all_token_ids
    for lo in range(9):
        for hi in range(lo, 9):
            assert r.token_ids(lo, hi) == full[lo:hi], (lo, hi)


def test_block_hashes_cover_outputs():
    """A block that spans the prompt's end hashes the same tokens as a prompt that holds them all: a
    later request with that prompt hits the cache."""
    bm = BlockManager(16, 4)
    r = req("a", [1, 2, 3, 4, 5, 6])
    assert bm.allocate_slots(r, 6)
    r.num_computed_tokens = 6
    r.output_token_ids += [7, 8]
    assert bm.allocate_slots(r, 2)  # registers the blocks full after this step: tokens 0-3 and 4-7
    r.num_computed_tokens = 8
    bm.free(r)
    r2 = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(bm.get_computed_blocks(r2)) == 2
