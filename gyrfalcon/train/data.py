"""Training data for a draft: the target's own responses to a prompt file, and its hidden states over them.

Prompts file: a .jsonl of {"prompt": text} or {"messages": [{"role", "content"}, ...]} lines, or any other text file
with one prompt per non-empty line. Plain-text prompts go through the tokenizer's chat template when it has one
(raw=False), as a served chat request would, so the draft learns the distribution it will see.

Per sequence the capture keeps (CapturedSequence): the token ids [T] (prompt + response), the prompt's length, the
aux hidden states [T, 3 * H] and the final-normed hidden states [T, H] in the model's dtype. The target's logits are
not stored ([T, V] would dwarf the rest): the trainer recomputes them through the target's LM head, restricted to the
draft vocabulary, batch by batch. That is exact, and bounds the data at 4 * H values per token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import torch


@dataclass
class CapturedSequence:
    ids: torch.Tensor        # [T] int64: prompt + response
    prompt_len: int
    aux: torch.Tensor        # [T, 3 * H]: the residual stream entering the aux layers
    final: torch.Tensor      # [T, H]: the final-normed hidden state (compute_logits' input)


def load_prompts(path: str) -> List[object]:
    """A prompt file -> a list of str (plain prompts) or list-of-message conversations."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"No prompts file {path}.")
    out: List[object] = []
    lines = p.read_text(encoding="utf-8").splitlines()
    if p.suffix == ".jsonl":
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e}).") from None
            if isinstance(item, dict) and isinstance(item.get("messages"), list):
                out.append(item["messages"])
            elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
                out.append(item["prompt"])
            else:
                raise ValueError(f"{path}:{n}: expected {{\"prompt\": str}} or {{\"messages\": [...]}}.")
    else:
        out = [line.strip() for line in lines if line.strip()]
    if not out:
        raise ValueError(f"No prompts in {path}.")
    return out


def encode_prompts(tok, prompts: Sequence[object], raw: bool = False) -> List[List[int]]:
    """Prompts (load_prompts' items) -> token ids: conversations, and plain prompts unless raw, through the
    tokenizer's chat template with the generation prompt."""
    from gyrfalcon.tokenizer import encode, render_chat

    use_chat = not raw and getattr(tok, "chat_template", None)
    encoded = []
    for p in prompts:
        if isinstance(p, list) or use_chat:
            conv = p if isinstance(p, list) else [{"role": "user", "content": p}]
            if not getattr(tok, "chat_template", None):
                raise ValueError("A conversation prompt, but the tokenizer has no chat template.")
            encoded.append(encode(tok, render_chat(tok, conv, None, True), add_special_tokens=False))
        else:
            encoded.append(encode(tok, p))
    return encoded


def generate_sequences(llm, prompts: Sequence[object], max_tokens: int, temperature=0.0,
                       raw: bool = False, seed: Optional[int] = None) -> List[tuple]:
    """Regenerate responses with the target itself: [(prompt ids + response ids, prompt length)], one response per
    prompt and temperature (a float or a sequence of them), grouped by temperature. A greedy response is what
    verification keeps; sampled ones show the head more contexts of the same prompts at no cost in prompts. Response
    j of a prompt draws from seed + j, so two sampled responses at one temperature differ."""
    from gyrfalcon.sampling_params import SamplingParams

    temps = [float(temperature)] if isinstance(temperature, (int, float)) else [float(t) for t in temperature]
    if not temps or any(t < 0 for t in temps):
        raise ValueError(f"temperatures must be >= 0, got {temps}.")
    if temps.count(0.0) > 1:
        raise ValueError("two greedy responses per prompt would be the same sequence twice.")
    encoded = encode_prompts(llm.get_tokenizer(), prompts, raw)
    reqs, params = [], []
    for j, t in enumerate(temps):
        sp = SamplingParams(temperature=t, max_tokens=max_tokens, seed=None if seed is None else seed + j)
        reqs += [{"prompt_token_ids": ids} for ids in encoded]
        params += [sp] * len(encoded)
    outs = llm.generate(reqs, params)
    return [(list(r["prompt_token_ids"]) + list(o.outputs[0].token_ids), len(r["prompt_token_ids"]))
            for r, o in zip(reqs, outs)]


def capture(llm, sequences: Sequence[tuple], aux_layer_ids: Sequence[int]) -> List[CapturedSequence]:
    """The target's hidden states over each (ids, prompt length) through gyrfalcon's own forward pass."""
    out = []
    for (ids, plen), (aux, final) in zip(sequences, llm.capture_hidden_states([s[0] for s in sequences],
                                                                              aux_layer_ids)):
        out.append(CapturedSequence(torch.tensor(ids, dtype=torch.int64), plen, aux, final))
    return out


def save_captured(data: List[CapturedSequence], path: Path) -> None:
    torch.save([vars(d) for d in data], path)


def load_captured(path: Path) -> List[CapturedSequence]:
    return [CapturedSequence(**d) for d in torch.load(path, weights_only=True)]
