"""Sampler: logits of the rows that need a next token -> token ids (and logprobs when asked).

Order of operations, as vLLM defines it:
1. logprobs are taken from the raw logits (before any penalty or temperature);
2. min_tokens: eos and stop ids are masked until a request has min_tokens outputs; logit_bias is added;
3. penalties: repetition over prompt + output tokens (divide positive logits, multiply negative
   ones), frequency (minus count x penalty) and presence (minus penalty if seen) over output tokens;
4. structured outputs: tokens the row's grammar does not allow go to -inf (runner/structured_output.py);
   greedy rows take the argmax here;
5. the rest: temperature, min_p (drop tokens below min_p x the top probability), top-k, top-p,
   then one Gumbel-max draw (kernels/sampling.py: one launch for the batch, no host sync) from
   uniforms hashed from each row's (seed, offset): a seeded request passes its own seed and the
   index of the output token being drawn, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from gyrfalcon.kernels.argmax import greedy_argmax
from gyrfalcon.kernels.sampling import gumbel_argmax
from gyrfalcon.runner.structured_output import apply_token_bitmask

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    """Per sampled row. All tensors on the logits' device; S = rows."""

    temperature: torch.Tensor  # [S] fp32, 0 for greedy
    top_p: torch.Tensor  # [S] fp32
    top_k: torch.Tensor  # [S] int64, 0 = off
    min_p: torch.Tensor  # [S] fp32
    all_greedy: bool
    all_random: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    seeds: torch.Tensor  # [S] int64 >= 0: the row's random stream (kernels/sampling.py)
    offsets: torch.Tensor  # [S] int64 >= 0: the draw's position in that stream
    # Penalties (None when no row uses them).
    presence_penalty: Optional[torch.Tensor] = None  # [S]
    frequency_penalty: Optional[torch.Tensor] = None  # [S]
    repetition_penalty: Optional[torch.Tensor] = None  # [S]
    prompt_token_ids: Optional[Sequence[Sequence[int]]] = None
    output_token_ids: Optional[Sequence[Sequence[int]]] = None
    # min_tokens: per row, the token ids to mask this step (empty when none).
    min_tokens_mask: Optional[List[List[int]]] = None
    # logit_bias of every row, flattened: logits[rows[j], ids[j]] += values[j] (None when no row has one).
    logit_bias: Optional[tuple] = None  # (rows [N] int64, ids [N] int64, values [N] fp32)
    max_num_logprobs: Optional[int] = None  # top-N logprobs to return (None: none asked)
    # Every row samples at temperature exactly 1.0 (vLLM's benchmarks do): the division is skipped.
    unit_temperature: bool = False
    # Structured outputs: (rows [R] int64, bitmask [R, ceil(V / 32)] int32) on the device, or None.
    token_bitmask: Optional[tuple] = None


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [S] int64
    # When asked: logprob of the sampled token [S], top-N ids [S, N] and logprobs [S, N].
    sampled_logprob: Optional[torch.Tensor] = None
    sampled_rank: Optional[torch.Tensor] = None  # [S], 1 = the most likely token
    top_ids: Optional[torch.Tensor] = None
    top_logprobs: Optional[torch.Tensor] = None


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    S, V = logits.shape
    dev = logits.device
    out_counts = torch.zeros(S, V, dtype=torch.int32, device=dev)
    for i, toks in enumerate(md.output_token_ids):
        if toks:
            t = torch.as_tensor(list(toks), dtype=torch.int64, device=dev)
            out_counts[i].scatter_add_(0, t, torch.ones_like(t, dtype=torch.int32))
    if md.repetition_penalty is not None:
        seen = out_counts > 0
        for i, toks in enumerate(md.prompt_token_ids):
            if toks:
                seen[i, torch.as_tensor(list(toks), dtype=torch.int64, device=dev)] = True
        rp = md.repetition_penalty.unsqueeze(1).expand(S, V)
        penalized = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalized, logits)
    if md.frequency_penalty is not None:
        logits = logits - md.frequency_penalty.unsqueeze(1) * out_counts.to(logits.dtype)
    if md.presence_penalty is not None:
        logits = logits - md.presence_penalty.unsqueeze(1) * (out_counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's allowed set. logits: [S, V] (temperature applied)."""
    if md.need_min_p:
        probs = logits.softmax(dim=-1)
        top = probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < md.min_p.unsqueeze(1) * top, _NEG_INF)
    if not (md.need_top_k or md.need_top_p):
        return logits
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    V = logits.shape[-1]
    if md.need_top_k:
        k = md.top_k.clamp(min=0)
        k = torch.where(k == 0, torch.full_like(k, V), k).clamp(max=V)
        # In ascending order the k-th largest sits at V - k; everything below it goes.
        kth = sorted_logits.gather(1, (V - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if md.need_top_p:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        # Drop the low tail whose mass is <= 1 - p; the top token always survives.
        drop = cum <= (1 - md.top_p.unsqueeze(1))
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """logits: [S, V] (fp32, or the model's dtype) -> SamplerOutput."""
        # fp32 wherever the logits are rewritten, filtered or reported. A bare draw (greedy, or temperature
        # 1.0 without filters) reads them as they come: the argmax and Gumbel kernels widen each value to
        # fp32 exactly, so the tokens are those of an fp32 copy, without the copy's launch.
        bare = (md.max_num_logprobs is None and md.min_tokens_mask is None and md.logit_bias is None
                and md.output_token_ids is None and md.token_bitmask is None
                and not (md.need_top_k or md.need_top_p or md.need_min_p)
                and (md.all_greedy or (md.all_random and md.unit_temperature)))
        if not bare:
            logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        if md.min_tokens_mask is not None:
            for i, ids in enumerate(md.min_tokens_mask):
                if ids:
                    logits[i, ids] = _NEG_INF
        if md.logit_bias is not None:
            rows, ids, values = md.logit_bias
            logits.index_put_((rows, ids), values, accumulate=True)
        if md.output_token_ids is not None:
            logits = apply_penalties(logits, md)
        if md.token_bitmask is not None:
            apply_token_bitmask(logits, *md.token_bitmask)
        # (Each shortcut below skips launches whose result is not used or would not change anything.)
        greedy = None if md.all_random else greedy_argmax(logits)
        if md.all_greedy:
            sampled = greedy
        else:
            if md.all_random and md.unit_temperature:
                scaled = logits  # x / 1.0 == x exactly
            else:
                scaled = logits / md.temperature.clamp(min=1e-5).unsqueeze(1)
            scaled = apply_top_k_top_p_min_p(scaled, md)
            random = gumbel_argmax(scaled.contiguous(), md.seeds, md.offsets)
            sampled = random if md.all_random else torch.where(md.temperature < 1e-5, greedy, random)
        out = SamplerOutput(sampled=sampled)
        if raw_logprobs is not None:
            out.sampled_logprob = raw_logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
            out.sampled_rank = (raw_logprobs > out.sampled_logprob.unsqueeze(1)).sum(dim=-1) + 1
            if md.max_num_logprobs > 0:
                out.top_logprobs, out.top_ids = raw_logprobs.topk(md.max_num_logprobs, dim=-1)
        return out
