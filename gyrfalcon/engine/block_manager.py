"""BlockManager: paged KV blocks, reference counts and the prefix cache.

Every layer's KV cache is cut into `num_blocks` blocks of `block_size` tokens; a request holds a
list of block ids (its block table) and a token at position p lives in block p // block_size.

Prefix caching keys each FULL block by a chained SHA-256 over (parent block's hash, the block's
token ids), so a hash names the whole prefix up to the end of that block. A freed block keeps its
hash and stays findable until it is reused: free blocks sit in an LRU queue and the head is evicted
first. A block shared by several requests (a common prefix, the n samples of one prompt) has a
reference count and returns to the free queue when the last holder lets go.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Dict, List, Optional

from gyrfalcon.engine.request import Request

_ROOT_HASH = b"gyrfalcon-prefix-root"


def hash_block(parent: Optional[bytes], token_ids: List[int]) -> bytes:
    """SHA-256 of the parent block's hash and this block's token ids (int64 little-endian)."""
    h = hashlib.sha256(parent or _ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"The KV cache must have at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt: List[int] = [0] * num_blocks
        self.block_hash: List[Optional[bytes]] = [None] * num_blocks
        # LRU order: the head is reused first. Holds every block with ref_cnt == 0.
        self.free_queue: "OrderedDict[int, None]" = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: Dict[bytes, int] = {}
        # Prefix-cache statistics, in tokens (as vLLM's prefix_cache_queries / hits).
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some request (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _ensure_hashes(self, request: Request, num_full_blocks: int) -> None:
        """request.block_hashes extended to its first num_full_blocks blocks: hash_block's chain, with the missing
        blocks' tokens packed into bytes once (not a list and an array per block: a batch of new prompts is
        hashed on the host before its prefill launches)."""
        hashes = request.block_hashes
        start = len(hashes)
        if start >= num_full_blocks:
            return
        bs = self.block_size
        packed = array("q", request.token_ids(start * bs, num_full_blocks * bs))
        data = memoryview(packed.tobytes())
        step = bs * packed.itemsize
        parent = hashes[-1] if hashes else _ROOT_HASH
        for j in range(num_full_blocks - start):
            h = hashlib.sha256(parent)
            h.update(data[j * step:(j + 1) * step])
            parent = h.digest()
            hashes.append(parent)

    def prefix_hash(self, request: Request, num_blocks: int) -> bytes:
        """The chained hash that names `request`'s first num_blocks (>= 1) full blocks (the key of a hybrid
        model's state snapshot at that boundary: engine/snapshot_pool.py)."""
        self._ensure_hashes(request, num_blocks)
        return request.block_hashes[num_blocks - 1]

    def get_computed_blocks(self, request: Request) -> List[int]:
        """The cached blocks that hold a prefix of `request`'s tokens (not yet referenced).

        The last token is never served from the cache: the model must run on at least one token
        to produce the logits of the next one.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []  # (prompt logprobs need every prompt position to run through the model)
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._ensure_hashes(request, max_blocks)
        hits: List[int] = []
        for h in request.block_hashes[:max_blocks]:
            bid = self.cached.get(h)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    # ---- allocation ---------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Optional[List[int]] = None) -> bool:
        """Give `request` blocks for `num_new_tokens` more tokens; False (and no change) if short.

        `computed_blocks` are prefix-cache hits for a request being admitted: they are referenced
        and become the head of its block table.
        """
        if not computed_blocks:
            # The common decode step: the last block has room and no block becomes full. Nothing to do
            # (this runs for every running request on every step).
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens <= len(request.block_ids) * self.block_size and (
                    not self.enable_prefix_caching
                    or min(num_tokens, request.num_tokens) // self.block_size <= request.num_registered_blocks):
                return True
        computed_blocks = computed_blocks or []
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = self.blocks_needed(num_tokens) - len(request.block_ids) - len(computed_blocks)
        # Hits that sit in the free queue leave it when touched, so they cost free capacity too.
        touched_free = sum(1 for b in computed_blocks if self.ref_cnt[b] == 0)
        if max(need, 0) + touched_free > len(self.free_queue):
            return False
        for b in computed_blocks:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
        request.block_ids.extend(computed_blocks)
        for _ in range(max(need, 0)):
            request.block_ids.append(self._pop_free())
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, num_tokens)
        return True

    def _pop_free(self) -> int:
        bid, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[bid]
        if h is not None:
            # Evict: the block's old content is about to be overwritten.
            if self.cached.get(h) == bid:
                del self.cached[h]
            self.block_hash[bid] = None
        self.ref_cnt[bid] = 1
        return bid

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that will be full once this step has written `num_tokens` tokens.

        Safe at scheduling time: within one forward pass every layer stores the new K/V before
        any attention reads, so a request that hits these blocks in the same step sees them.
        """
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        self._ensure_hashes(request, num_full)
        # Blocks before num_registered_blocks were handled in earlier steps: O(new blocks) per step.
        for i in range(request.num_registered_blocks, num_full):
            bid = request.block_ids[i]
            if self.block_hash[bid] is not None:
                continue
            h = request.block_hashes[i]
            self.block_hash[bid] = h
            self.cached.setdefault(h, bid)
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    def free(self, request: Request) -> None:
        """Drop `request`'s references; blocks nobody holds return to the free queue.

        Freed in reverse so a sequence's tail blocks are evicted before its head (the head is
        the more shareable prefix). Blocks with no hash go to the front: nothing can hit them.
        """
        for bid in reversed(request.block_ids):
            self.ref_cnt[bid] -= 1
            assert self.ref_cnt[bid] >= 0, f"block {bid} freed twice"
            if self.ref_cnt[bid] == 0:
                self.free_queue[bid] = None
                if self.block_hash[bid] is None:
                    self.free_queue.move_to_end(bid, last=False)
        request.block_ids = []
        request.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        for bid in list(self.free_queue):
            h = self.block_hash[bid]
            if h is not None and self.cached.get(h) == bid:
                del self.cached[h]
            self.block_hash[bid] = None
