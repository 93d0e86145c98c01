"""The split-KV decode launch (split_kv.py's kernel, or with_prep.py's with the qkv prep fused in, then the reduce
kernel unless one split or the in-kernel merge makes it needless): buffers sized from shapes, no host syncs, so it
can be captured in a CUDA graph. Launch shapes from configs.py unless the caller passes them."""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import HAS_TRITON, cdiv, interpreting, next_pow2, pdl_launch_kwargs, use_pdl
from gyrfalcon.kernels.decode_attention.configs import (MID_TILE_CONFIG, REDUCE_WARPS, decode_config, default_min_part,
                                                        default_num_splits, k_rows, merge_in_kernel_default,
                                                        prefetch_default, v_staged, wide_tile_context)

if HAS_TRITON:
    from gyrfalcon.kernels.decode_attention.reduce import _decode_reduce_kernel
    from gyrfalcon.kernels.decode_attention.split_kv import _decode_split_kernel
    from gyrfalcon.kernels.decode_attention.with_prep import _decode_prep_kernel

_LOG2E = 1.4426950408889634

_MERGE_COUNTERS: dict = {}
_MAX_COUNTERS = 1 << 16  # (sequence, kv head) pairs one launch may merge in-kernel


def _merge_counters(device: torch.device) -> torch.Tensor:
    """Zeroed int32 arrival counters, one per (sequence, kv head), allocated once per device (outside
    any CUDA graph) and left at zero by every launch."""
    key = (device.type, device.index)
    if key not in _MERGE_COUNTERS:
        _MERGE_COUNTERS[key] = torch.zeros(_MAX_COUNTERS, dtype=torch.int32, device=device)
    return _MERGE_COUNTERS[key]


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    merge_in_kernel: bool | None = None,
    min_part: int | None = None,
    pdl: bool | None = None,
    key_rows: bool | None = None,
) -> torch.Tensor:
    """Triton split-KV decode attention; same contract as paged_decode_attention_ref.

    No host syncs, buffers sized from shapes, so it can be captured in a CUDA graph. num_splits=None
    picks default_num_splits from the batch shape and the block-table width. block_n / num_warps /
    num_stages override the launch config (tests and benchmark sweeps). Each split covers at least
    min_part keys (and one tile; None: default_min_part). merge_in_kernel=True lets the last split program to
    finish merge the splits instead of a second launch; None: merge_in_kernel_default(batch), on from 8
    sequences. key_rows: force the key tiles' row layout on or off (default k_rows).
    """
    assert q.dim() == 3 and q.stride(-1) == 1
    return _launch(q, q.shape[1], k_cache, v_cache, block_tables, seq_lens, scale, num_splits, None,
                   block_n=block_n, num_warps=num_warps, num_stages=num_stages, merge_in_kernel=merge_in_kernel,
                   min_part=min_part, pdl=pdl, key_rows=key_rows)


def decode_attention_with_prep_triton(qkv, num_heads, num_kv_heads, head_dim, positions, cos_sin_cache,
                                      rotary_dim, is_neox, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                                      scale, num_splits=None, q_norm_weight=None, k_norm_weight=None, eps=1e-6,
                                      row_scale=None, **launch):
    """fused_qkv_prep and decode attention in one split launch (+ the reduce): each split program
    normalizes and rotates its kv head's query group itself, and the split that holds the new token
    writes its K/V into the cache before reading its keys back. Decode only (one query per sequence,
    positions[i] = seq_lens[i] - 1). launch: paged_decode_attention_triton's keyword overrides."""
    assert qkv.dim() == 2 and k_cache.shape[2] == num_kv_heads and k_cache.shape[-1] == head_dim
    prep = (positions, cos_sin_cache, rotary_dim, is_neox, slot_mapping, q_norm_weight, k_norm_weight, eps,
            row_scale)
    return _launch(qkv, num_heads, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, prep, **launch)


def _launch(q, n_heads, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, prep, *, block_n=None,
            num_warps=None, num_stages=None, merge_in_kernel=None, min_part=None, pdl=None, prefetch=None,
            key_rows=None):
    """The split (+ reduce) launch. q: [B, n_heads, dk] queries, or with prep the fused qkv rows
    [B, (n_heads + 2 * n_kv) * dk] and prep = (positions, cos_sin_cache, rotary_dim, is_neox, slot_mapping,
    q_norm_weight, k_norm_weight, eps, row_scale (None, or (x [B, hidden], eps): qkv_prep_ref)).
    prefetch (prep only; default prefetch_default(pdl)): the first K/V tile loads before the qkv row. key_rows
    (default k_rows(...)): key tiles load in row layout (the kernel's K_ROWS; tests force it at small shapes)."""
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    n_seqs = q.shape[0]
    dk = k_cache.shape[-1]
    n_kv = k_cache.shape[2]
    dv = v_cache.shape[-1]
    assert n_heads % n_kv == 0, "num_heads must be a multiple of num_kv_heads"
    group = n_heads // n_kv
    o = torch.empty(n_seqs, n_heads, dv, dtype=q.dtype, device=q.device)
    if n_seqs == 0:
        return o
    block_size = k_cache.shape[1]
    pdl = use_pdl(q) if pdl is None else pdl
    # Prefetch keeps a K and a V tile live across the prep; with fp32 caches that outgrows shared memory
    # once the loop is software-pipelined (270 KB of 227 KB on the H200), so it is not the default there.
    if prefetch is None:
        prefetch = prefetch_default(pdl) and k_cache.element_size() <= 2
    prefetch = prefetch and prep is not None
    bn, nw, ns = decode_config(max(dk, dv), n_seqs * n_kv, prefetch, fp8=k_cache.element_size() == 1,
                                one_split=num_splits == 1,
                                wide_tile=(prep is not None
                                           and wide_tile_context(n_seqs * n_kv, k_cache.element_size(), q.device) > 0))
    bn, nw, ns = max(16, block_n or bn), num_warps or nw, num_stages or ns
    if num_splits is None:
        num_splits = default_num_splits(n_seqs, n_kv, block_tables.shape[1] * block_size, q.device)
    num_splits = max(1, int(num_splits))
    block_dv = max(16, next_pow2(dv))
    direct = num_splits == 1
    if merge_in_kernel is None:
        merge_in_kernel = merge_in_kernel_default(n_seqs)
    merge_in_kernel = merge_in_kernel and not direct and n_seqs * n_kv <= _MAX_COUNTERS
    if min_part is None:
        # mid_tile by launch shape: a shape forced to MID_TILE_CONFIG (block_n) splits the same way
        min_part = default_min_part(n_seqs * n_kv, prefetch, mid_tile=(bn, nw, ns) == MID_TILE_CONFIG)
    min_part_ = max(bn, cdiv(min_part, bn) * bn)
    counters = _merge_counters(q.device) if merge_in_kernel else o
    if direct:
        pacc = pml = o  # unused
    else:
        pacc = torch.empty(n_seqs * n_heads * num_splits, block_dv, dtype=torch.float32, device=q.device)
        pml = torch.empty(n_seqs * n_heads * num_splits, 2, dtype=torch.float32, device=q.device)
    k_rows_ = k_rows(n_seqs * n_kv, prefetch) if key_rows is None else key_rows
    common = dict(BLOCK_SIZE=block_size, GROUP=group, BLOCK_G=max(16, next_pow2(group)),
                  HEAD_DK=dk, HEAD_DV=dv, BLOCK_DK=max(16, next_pow2(dk)), BLOCK_DV=block_dv, BLOCK_N=bn,
                  BLOCK_S=next_pow2(num_splits), MIN_PART=min_part_, DIRECT=direct, MERGE_IN_KERNEL=merge_in_kernel,
                  DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=interpreting(), USE_PDL=pdl,
                  GROUP_P2=next_pow2(group), K_ROWS=k_rows_, V_STAGE=v_staged(), Q16=q.element_size() == 2,
                  num_warps=nw, num_stages=ns, **pdl_launch_kwargs(pdl))
    strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
               v_cache.stride(2), block_tables.stride(0))
    grid = (n_seqs, n_kv, num_splits)
    if prep is None:
        _decode_split_kernel[grid](
            q, k_cache, v_cache, block_tables, seq_lens, o, pacc, pml, counters, float(scale) * _LOG2E, num_splits,
            q.stride(0), q.stride(1), o.stride(0), o.stride(1), *strides, **common)
    else:
        pos, cs, rot_dim, neox, slot, qw, kw, eps, row_scale = prep
        assert dk == dv and cs.stride(-1) == 1
        assert q.shape[1] == (n_heads + 2 * n_kv) * dk, "qkv rows must be [q heads | k heads | v heads]"
        xs, eps_xs = row_scale if row_scale is not None else (q, 0.0)
        assert xs.stride(-1) == 1
        _decode_prep_kernel[grid](
            q, k_cache, v_cache, block_tables, seq_lens, o, pacc, pml, counters, float(scale) * _LOG2E, num_splits,
            q.stride(0), o.stride(0), o.stride(1), *strides,
            pos, cs, slot, q if qw is None else qw, q if kw is None else kw, cs.stride(0), float(eps), xs,
            xs.stride(0), float(eps_xs),
            NUM_HEADS=n_heads, ROT=int(rot_dim), IS_NEOX=bool(neox), HAS_QW=qw is not None, HAS_KW=kw is not None,
            PREFETCH=prefetch, ROW_SCALE=row_scale is not None, HIDDEN=xs.shape[-1] if row_scale is not None else 1,
            BLOCK_H=min(1024, max(16, next_pow2(xs.shape[-1]))) if row_scale is not None else 16, **common)
    if not direct and not merge_in_kernel:
        _decode_reduce_kernel[(n_seqs, n_heads)](
            pacc, pml, o, seq_lens, num_splits, n_heads, o.stride(0), o.stride(1),
            HEAD_DV=dv, BLOCK_DV=block_dv, BLOCK_S=next_pow2(num_splits), BLOCK_N=bn, MIN_PART=min_part_,
            USE_PDL=pdl, num_warps=REDUCE_WARPS, **pdl_launch_kwargs(pdl),
        )
    return o
