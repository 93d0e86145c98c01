"""Prefill attention's launch shape, from shapes only (no autotune: it would benchmark inside CUDA-graph
capture and differ between runs)."""

from __future__ import annotations


SHORT_QUERY = 512  # queries up to this long take _prefill_config's short-query tiles


def prefill_config(head_dim: int, group: int, max_query_len: int | None = None):
    """(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages), chosen from shapes only (no autotune:
    autotuning would benchmark inside CUDA-graph capture and differ between runs). max_query_len: the
    longest query of the launch when the host knows it (a bound on it is enough)."""
    if head_dim <= 64:
        return 128, 64, 4, 2
    if head_dim <= 128:
        # H200 sweeps at Llama-8B's 32 / 8 heads: with queries of up to 512 tokens, 32-key tiles and 3 stages
        # win (64 x 128 tokens: ~20% faster) and lose on one 2048-token prompt; 8k causal: 64-key tiles.
        if max_query_len is not None and max_query_len <= SHORT_QUERY:
            return 64, 32, 4, 3
        return 64, 64, 4, 2
    return 64, 32, 8, 2
