"""The MoE router's selection in one Triton launch: scores, top-k, normalization and scaling per token.

Torch runs the selection as 5-9 small kernels (cast, softmax or sigmoid, bias add, topk, gather, sum, divide,
scale); in a batch-1 decode step every one is a ~2-3 us launch of a graph whose layers' weight streams last tens
of microseconds, so the router alone would cost more than a layer's attention. Here one program per token loads
the row of E logits (E <= 1024), computes the scores in fp32 and picks the top k by k rounds of "largest score,
lowest index among equals; then mask it out" (k <= 16), which gives torch.topk's descending order (its order among
exactly equal scores is unspecified; this picks the lower index first). The grouped noaux_tc selection
(n_group > 1) stays on the reference.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from gyrfalcon.kernels.common import HAS_TRITON, next_pow2, tl, triton
from gyrfalcon.kernels.moe_router.naive import SIGMOID

if HAS_TRITON:

    @triton.jit
    def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, stride_l, scale,
                      TOPK: tl.constexpr, SIGMOID_SCORES: tl.constexpr, HAS_BIAS: tl.constexpr,
                      NORM: tl.constexpr, E_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr):
        # Grid: (T,). One token's E logits -> its k (weight, expert) pairs at w_ptr / ids_ptr + t * TOPK.
        t = tl.program_id(0).to(tl.int64)
        es = tl.arange(0, E_BLOCK)
        emask = es < E
        x = tl.load(logits_ptr + t * stride_l + es, mask=emask, other=float("-inf")).to(tl.float32)
        if SIGMOID_SCORES:
            scores = 1.0 / (1.0 + tl.exp(-x))
            choice = scores
            if HAS_BIAS:
                choice = scores + tl.load(bias_ptr + es, mask=emask, other=0.0).to(tl.float32)
        else:
            m = tl.max(x, axis=0)
            ex = tl.exp(x - m)
            scores = ex / tl.sum(ex, axis=0)
            choice = scores
        # NaN ranks lowest (a row of garbage, e.g. a graph-capture pass over an unwritten cache, must still pick k
        # distinct experts in range: the grouped GEMMs index weights by them).
        # (NaN found by its bits: the GPU's max.f32 skips NaN operands, so a NaN left in would never equal the max.)
        bits = choice.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        choice = tl.where(bits > 0x7F800000, float("-inf"), choice)
        avail = emask
        ks = tl.arange(0, K_BLOCK)
        sel_w = tl.zeros([K_BLOCK], dtype=tl.float32)
        sel_i = tl.zeros([K_BLOCK], dtype=tl.int64)
        for j in tl.static_range(TOPK):
            key = tl.where(avail, choice, float("-inf"))
            best = tl.max(key, axis=0)
            idx = tl.min(tl.where(avail & (key == best), es, E_BLOCK), axis=0)
            # Never past the experts, whatever the scores held (the GEMMs index weights by it): no score matched
            # the max, so the lowest expert not yet taken.
            first = tl.min(tl.where(avail, es, E_BLOCK), axis=0)
            idx = tl.minimum(tl.where(idx < E, idx, first), E - 1)
            w = tl.sum(tl.where(es == idx, scores, 0.0), axis=0)
            sel_w = tl.where(ks == j, w, sel_w)
            sel_i = tl.where(ks == j, idx.to(tl.int64), sel_i)
            avail = avail & (es != idx)
        kmask = ks < TOPK
        if NORM:
            total = tl.sum(tl.where(kmask, sel_w, 0.0), axis=0)
            if SIGMOID_SCORES:
                total = total + 1e-20
            sel_w = sel_w / total
        sel_w = sel_w * scale
        tl.store(w_ptr + t * TOPK + ks, sel_w, mask=kmask)
        tl.store(ids_ptr + t * TOPK + ks, sel_i, mask=kmask)


# The largest E / k one program handles: a row of E fp32 scores and k rounds of two reductions over it.
MAX_EXPERTS, MAX_TOP_K = 1024, 16


def route_triton(logits: torch.Tensor, top_k: int, scoring: str, norm_topk_prob: bool = True,
                 bias: Optional[torch.Tensor] = None, routed_scaling_factor: float = 1.0
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """route_ref's contract for n_group = 1, E <= MAX_EXPERTS, top_k <= MAX_TOP_K; one launch, no host sync."""
    T, E = logits.shape
    assert E <= MAX_EXPERTS and 1 <= top_k <= min(MAX_TOP_K, E), (E, top_k)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return w, ids
    sig = scoring == SIGMOID
    has_bias = sig and bias is not None
    _route_kernel[(T,)](logits, bias if has_bias else logits, w, ids, E, logits.stride(0),
                        float(routed_scaling_factor), TOPK=top_k, SIGMOID_SCORES=sig, HAS_BIAS=has_bias,
                        NORM=norm_topk_prob, E_BLOCK=max(16, next_pow2(E)), K_BLOCK=max(2, next_pow2(top_k)),
                        num_warps=4 if E <= 256 else 8)
    return w, ids
