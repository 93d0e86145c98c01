"""Decode attention's launch policy, from shapes only (CUDA-graph safe: no autotune): split counts, tiles (BLOCK_N keys,
warps, stages), the least keys a split covers, the in-kernel merge and the prefetch; tuned on the H200
(docs/performance.md)."""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import cdiv, max_shared_mem, next_pow2, sm_count


_SMALL_LAUNCH_PROGRAMS = 128  # (sequence, kv head) programs up to which the launch uses 128-key tiles
MERGE_IN_KERNEL_MIN_SEQS = 8  # batch from which the splits merge in-kernel by default (merge_in_kernel_default)
MAX_SPLITS = 16
SHORT_SPLIT_TOKENS = 256  # keys a split covers at least in batched launches (default_min_part)
REDUCE_WARPS = 4  # warps of the split-merge (reduce) launch


def _sm_count(device: torch.device) -> int:
    """The device's SMs (16 off CUDA); scripts/compile_check.py and startup_compiles.py patch it to the H200's."""
    return sm_count(device, 16)


def prefetch_default(pdl: bool) -> bool:
    """Whether decode attention with prep loads its first K/V tile before the qkv row: with PDL, where those
    loads overlap the previous kernel's tail (the batch-1 graphs). Without PDL it was slower (the tile's
    registers held across the prep)."""
    return pdl


def default_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Splits per sequence from shapes only (CUDA-graph safe): enough programs to fill the GPU about
    twice over, but at least ~256 context tokens per split, rounded to a power of two to bound the
    number of compiled variants, and at most MAX_SPLITS. max_context is an upper bound (e.g.
    block-table width * block_size: under a CUDA graph, max_model_len), so most of the grid is empty
    splits at short contexts; each costs a block launch, which is why the grid stays small (a 64-split grid
    was ~1.5x slower than 4-8 splits at batch 1 with 128-512 tokens on the H200)."""
    want = cdiv(2 * _sm_count(device), max(1, num_seqs * num_kv_heads))
    want = min(want, cdiv(max(1, max_context), 256), MAX_SPLITS)
    return min(MAX_SPLITS, next_pow2(max(1, want)))


def default_min_part(programs: int, prefetch: bool, mid_tile: bool = False) -> int:
    """Least keys one split covers when the caller does not say (0: one tile). SHORT_SPLIT_TOKENS for launches
    of at least _SMALL_LAUNCH_PROGRAMS (sequence, kv head) programs without the prefetch (batch 16 and up at 8
    kv heads: the batched decode graphs), else one tile. The decode graphs size the split count from
    max_model_len (default_num_splits: 4 at batch 16), so at 129-256 tokens 2 splits of one 128-key tile each
    would hold keys and merge; with 256-key splits one program holds them all and writes its output directly.
    mid_tile: the launch runs MID_TILE_CONFIG at up to _SMALL_LAUNCH_PROGRAMS programs (the batch 8 / 16 main
    graphs, whose contexts of up to 256 tokens replay the one-split graphs): one-tile splits, faster there at
    320-600 tokens than 256-key ones."""
    if mid_tile and programs <= _SMALL_LAUNCH_PROGRAMS:
        return 0
    return SHORT_SPLIT_TOKENS if programs >= _SMALL_LAUNCH_PROGRAMS and not prefetch else 0


def v_staged() -> bool:
    """Whether an fp8 cache's V tile widens to fp16 in its row layout and is staged through shared memory for the
    dot (the kernel's V_STAGE; 15% faster than widening it in the dot's operand layout at Llama-8B's shape, batch
    256). The pin (_pin_f16) is PTX: off on ROCm builds."""
    return getattr(torch.version, "hip", None) is None


def k_rows(programs: int, prefetch: bool = False) -> bool:
    """Whether key tiles load in the cache's row layout ([keys, head_dim], as V loads) and are transposed in
    registers (_kv_tile's K_ROWS) instead of loading the transposed tile directly: for the 64-key-tile launches
    of many programs without the prefetch (with 2 stages, decode_config), 3-4% faster at batch 64 / 256 with
    1-2k tokens of context on the H200."""
    return programs > _SMALL_LAUNCH_PROGRAMS and not prefetch


def merge_in_kernel_default(n_seqs: int) -> bool:
    """Whether the last split program to finish merges the splits (no reduce launch) when the caller does not
    say: from MERGE_IN_KERNEL_MIN_SEQS sequences. At batch 1-4 the reduce launch was faster (the merging
    program's extra round trips through L2 cost more than the launch they save)."""
    return n_seqs >= MERGE_IN_KERNEL_MIN_SEQS


_FP8_WIDE_TILE_PROGRAMS = 1024  # fp8 launches of more (sequence, kv head) programs: 128-key tiles (decode_config)


# Keys a tile of the prefetching (batch-1, PDL) launch when it splits the context (decode_config).
B1_SPLIT_TILE = 64


# The fused-prep launch of a 2-byte cache in one split at (WIDE_TILE_MIN_PROGRAMS, _SMALL_LAUNCH_PROGRAMS] programs
# (batch 5-16 at 8 kv heads: the one-split graphs, wide_tile_context): one stage of 256-key tiles at 8 warps
# (decode_config). Two stages would need 256 KB of shared memory.
WIDE_TILE_CONFIG = (256, 8, 1)
WIDE_TILE_SHARED = 140 * 1024  # shared memory a program may need for it (sm_90 code: 132 KB) -> max_shared_mem
WIDE_TILE_MIN_PROGRAMS = _SMALL_LAUNCH_PROGRAMS // 4  # (sequence, kv head) programs above which it may be taken


# The split launch of (WIDE_TILE_MIN_PROGRAMS, _SMALL_LAUNCH_PROGRAMS] programs (the batch 8 / 16 main decode graphs
# at 8 kv heads) without the prefetch, on a 2-byte or an fp8 cache: 64-key tiles, 4 warps, 2 stages (decode_config).
MID_TILE_CONFIG = (64, 4, 2)


def wide_tile_context(programs: int, element_size: int, device: torch.device) -> int:
    """Tokens of context up to which a one-split launch of `programs` (sequence, kv head) programs with the fused
    prep on a cache of element_size bytes runs WIDE_TILE_CONFIG (one tile holds the whole context), 0 where it
    never does (decode_config's rule: 33-128 programs, a 2-byte cache, no prefetch, a card with WIDE_TILE_SHARED
    of shared memory a program). The decode graphs capture a one-split graph of such sizes for these contexts
    (cuda_graph.CudaGraphRunner); the main graph keeps its splits, which won from 320 tokens on."""
    ok = (WIDE_TILE_MIN_PROGRAMS < programs <= _SMALL_LAUNCH_PROGRAMS and element_size == 2
          and max_shared_mem(device) >= WIDE_TILE_SHARED)
    return WIDE_TILE_CONFIG[0] if ok else 0


def decode_config(head_dim: int, programs: int, prefetch: bool = False, fp8: bool = False,
                   one_split: bool = False, wide_tile: bool = False):
    """(BLOCK_N keys per tile, num_warps, num_stages) from shapes only (no autotune under graphs); programs =
    sequences * kv heads. Chosen by sweeps on the H200 at 8 kv heads, head_dim 128 (docs/performance.md):
    - up to 128 programs (batch 16): 128-key tiles, 4 warps, 3 stages; 8 warps with the prefetch (its first
      tile held in registers across the qkv prep);
    - one_split (the caller asked for one split: the short graphs, a whole context in one program) with
      wide_tile (the fused prep on a 2-byte cache; an fp32 cache's 256-key tiles need 270 KB of shared memory)
      at 33-128 programs: WIDE_TILE_CONFIG, one tile for contexts of up to 256 tokens (~25% faster there; past
      one tile it lost, hence only the one-split graphs take it);
    - the prefetching launch that splits the context: B1_SPLIT_TILE-key tiles at 8 warps, so that twice the
      splits hold keys, each with one prefetched tile, and less of the work follows the PDL wait; the one-split
      launch keeps 128-key tiles (a second tile would load after the wait);
    - the split launch at 33-128 programs without the prefetch (the batch 8 / 16 main graphs): MID_TILE_CONFIG
      (38 KB of shared memory and ~85 registers a thread against 72 KB and 130 for 128-key tiles: 5 programs an
      SM instead of 3);
    - many programs: 64-key tiles (2 stages with key tiles in row layout, k_rows); an fp8 cache over more than
      1024 programs (batch 256): 128-key tiles with 3 stages."""
    if head_dim <= 128:
        if programs <= _SMALL_LAUNCH_PROGRAMS:
            if wide_tile and one_split and not prefetch and not fp8 and programs > WIDE_TILE_MIN_PROGRAMS:
                return WIDE_TILE_CONFIG
            if prefetch and not one_split:
                return B1_SPLIT_TILE, 8, 3
            if not prefetch and not one_split and programs > WIDE_TILE_MIN_PROGRAMS:
                return MID_TILE_CONFIG
            return 128, (8 if prefetch else 4), 3
        if fp8 and not prefetch and programs > _FP8_WIDE_TILE_PROGRAMS:
            return 128, 4, 3
        return 64, (8 if prefetch else 4), (2 if k_rows(programs, prefetch) else 3)
    return 32, 4, 3
