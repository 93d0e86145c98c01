"""The EAGLE-3 head's training forward with training-time test (TTT), in plain differentiable torch over the
parameters of models/eagle3.py's Eagle3Draft (its inference forward runs paged attention inside a forward context
and the fused kernels, which have no backward).

Why unrolled steps. At inference the head drafts k tokens in a chain: step 0 at the last known position p reads the
target's aux hidden states; step j >= 1 (position p + j) reads step j - 1's own output and the token step j - 1
proposed. Trained only on step 0, the head never sees its own outputs as input. TTT runs the same chain in training,
for every position p of a sequence at once:

  step j, position p:  token ids[p + 1 + j] (the target's own greedy continuation: what verification keeps),
                       hidden h_j[p] (h_0 = fc(aux[p]); h_j = the output of step j - 1 at p), RoPE position p + j,
                       attention over step 0's keys at positions <= p (what the draft's cache holds from the target's
                       states) and over steps 1..j's keys at p itself (the chain's own entries), as at inference;
                       predicts the token at p + 2 + j: the target's distribution at row p + 1 + j.

Loss: forward KL(target || draft) with the target's distribution restricted to the draft vocabulary and
renormalized, averaged over the valid positions of each step (the predicted token is a response token and inside
the sequence), summed over the steps.

Shapes: B sequences padded to T; aux [B, T, 3 * H_t]; ids [B, T]; target_logp [B, T, V_draft] (row r: the target's
log-probabilities of the token after r); lens, prompt_lens [B].
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F

from gyrfalcon.kernels.rotary.naive import apply_rotary_ref


def _rms(x: torch.Tensor, norm, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm.weight


def ttt_forward(draft, ids: torch.Tensor, aux: torch.Tensor, lens: torch.Tensor, steps: int) -> List[torch.Tensor]:
    """-> per step j, the draft's log-probabilities [B, T, V_draft] at every chain position p (row p: the
    prediction of the token at p + 2 + j; rows whose input token p + 1 + j is past the sequence are padding)."""
    s = draft.spec
    B, T = ids.shape
    dev = ids.device
    h, kvh, d = s.num_heads, s.num_kv_heads, s.head_dim
    scale = d ** -0.5
    rep = h // kvh
    x_aux = aux
    if draft.input_norm is not None:
        x_aux = _rms(x_aux, draft.input_norm, s.eps)
    hidden = draft.fc(x_aux)
    if draft.fc_norm is not None:
        hidden = _rms(hidden, draft.fc_norm, s.eps)
    p = torch.arange(T, device=dev)
    causal = p[None, :] <= p[:, None]  # [T(query), T(key)]
    k0 = v0 = None
    chain: List[tuple] = []  # steps 1..j: (k, v) [B, h, T, d] at each chain position p
    out_logp: List[torch.Tensor] = []
    for j in range(steps):
        tok_pos = p + 1 + j
        in_range = tok_pos < lens[:, None]                                       # [B, T]
        tok = torch.where(in_range, ids.gather(1, tok_pos.clamp(max=T - 1).expand(B, T)), torch.zeros_like(ids))
        with torch.no_grad():
            emb = draft.embed(tok.reshape(-1)).view(B, T, -1).to(hidden.dtype)  # (the embedding takes [N] ids)
        e = _rms(emb, draft.input_layernorm, s.eps)
        n = _rms(hidden, draft.hidden_norm, s.eps)
        residual = n if s.norm_before_residual else hidden
        x = torch.cat([e, n], dim=-1)
        q = draft.q_proj(x).view(B * T, h, d)
        k = draft.k_proj(x).view(B * T, kvh, d)
        v = draft.v_proj(x).view(B, T, kvh, d)
        if draft.q_norm is not None:
            q, k = _rms(q, draft.q_norm, s.eps), _rms(k, draft.k_norm, s.eps)
        pos = (p + j).clamp(max=draft.rotary.cos_sin_cache.shape[0] - 1).repeat(B)
        q, k = apply_rotary_ref(q, k, pos, draft.rotary.cos_sin_cache, d, True)
        q = q.view(B, T, h, d).transpose(1, 2)                                   # [B, h, T, d]
        k = k.view(B, T, kvh, d).transpose(1, 2).repeat_interleave(rep, dim=1)
        v = v.transpose(1, 2).repeat_interleave(rep, dim=1)
        if j == 0:
            k0, v0 = k, v
        else:
            chain.append((k, v))
        scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
        scores += [(q * ck).sum(-1, keepdim=True) * scale for ck, _ in chain]
        prob = torch.cat(scores, dim=-1).softmax(-1)
        att = prob[..., :T] @ v0
        for i, (_, cv) in enumerate(chain):
            att = att + prob[..., T + i:T + i + 1] * cv
        x = residual + draft.o_proj(att.transpose(1, 2).reshape(B, T, h * d))
        m = _rms(x, draft.post_attention_layernorm, s.eps)
        y = x + draft.down_proj(F.silu(draft.gate_proj(m)) * draft.up_proj(m))
        normed = _rms(y, draft.norm, s.eps)
        out_logp.append(draft.lm_head(normed).float().log_softmax(-1))
        hidden = normed if s.norm_output else y
    return out_logp


def ttt_loss(draft, ids: torch.Tensor, aux: torch.Tensor, target_logp: torch.Tensor, lens: torch.Tensor,
             prompt_lens: torch.Tensor, steps: int) -> Tuple[torch.Tensor, List[float]]:
    """-> (the loss, summed over steps; per step the draft's top-1 agreement with the target on valid positions)."""
    B, T = ids.shape
    p = torch.arange(T, device=ids.device)
    loss = aux.new_zeros((), dtype=torch.float32)
    agree: List[float] = []
    for j, logp in enumerate(ttt_forward(draft, ids, aux, lens, steps)):
        tok_pos = p + 1 + j
        # The predicted token (p + 2 + j) is a response token, and its input token (p + 1 + j) is in the sequence.
        valid = (tok_pos < lens[:, None]) & (tok_pos >= (prompt_lens[:, None] - 1))
        tgt = target_logp.gather(1, tok_pos.clamp(max=T - 1)[None, :, None].expand(B, T, target_logp.shape[-1]))
        kl = (tgt.exp() * (tgt - logp)).sum(-1)                                  # [B, T]
        nvalid = valid.sum().clamp(min=1)
        loss = loss + (kl * valid).sum() / nvalid
        with torch.no_grad():
            agree.append(float(((logp.argmax(-1) == tgt.argmax(-1)) & valid).sum() / nvalid))
    return loss, agree
