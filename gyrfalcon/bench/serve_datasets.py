"""The request lists of `gyrfalcon bench serve`, as `vllm bench serve --dataset-name` builds them.

random: prompts of random token ids (exactly the drawn length; sent as token ids to /v1/completions, as their
decoded text to the chat endpoint), lengths drawn from [len * (1 - r), len * (1 + r)], optionally after a shared
random prefix (--random-prefix-len).
sharegpt: a local ShareGPT JSON file (a list of {"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}): each conversation's first turn is the prompt, the second's token count the
output length (or --sharegpt-output-len); as vLLM filters, conversations with fewer than two turns, a prompt or
reply under 4 tokens, a prompt over 1024 or a total over 2048 tokens are skipped.
prefix-repetition: --prefix-repetition-num-prefixes random prefixes of --prefix-repetition-prefix-len tokens, each
request one of them (in turn) followed by a fresh random suffix of --prefix-repetition-suffix-len tokens: the
prefix cache's workload.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, List, Optional, Set


@dataclass
class BenchRequest:
    prompt: Any  # token ids (completions) or text (chat, sharegpt)
    prompt_len: int
    output_len: int


class DatasetError(ValueError):
    """A dataset that cannot be built from the flags given (reported in one line)."""


def _vocab(tokenizer) -> List[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def _as_prompt(tokenizer, ids: List[int], chat: bool) -> Any:
    return tokenizer.decode(ids) if chat else ids


def random_requests(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                    chat: bool, prefix_len: int = 0) -> List[BenchRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {range_ratio}.")
    rng = random.Random(seed)
    vocab = _vocab(tokenizer)
    prefix = [rng.choice(vocab) for _ in range(prefix_len)]

    def length(n: int) -> int:
        lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.randint(lo, hi)

    out = []
    for _ in range(num):
        n_in, n_out = length(input_len), length(output_len)
        ids = prefix + [rng.choice(vocab) for _ in range(n_in)]
        out.append(BenchRequest(_as_prompt(tokenizer, ids, chat), len(ids), n_out))
    return out


def sharegpt_requests(tokenizer, path: Optional[str], num: int, seed: int,
                      output_len: Optional[int] = None) -> List[BenchRequest]:
    if not path:
        raise DatasetError("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT JSON file).")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise DatasetError(f"cannot read the ShareGPT file {path}: {e}") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of {{'conversations': [...]}} entries.")
    convs = [d["conversations"] for d in data if isinstance(d, dict) and len(d.get("conversations") or []) >= 2]
    random.Random(seed).shuffle(convs)
    out: List[BenchRequest] = []
    for conv in convs:
        if len(out) == num:
            break
        prompt, reply = str(conv[0].get("value", "")), str(conv[1].get("value", ""))
        n_in = len(tokenizer(prompt).input_ids)
        n_out = output_len if output_len is not None else len(tokenizer(reply).input_ids)
        if output_len is None and (n_in < 4 or n_out < 4 or n_in > 1024 or n_in + n_out > 2048):
            continue
        out.append(BenchRequest(prompt, n_in, n_out))
    if len(out) < num:
        raise DatasetError(f"{path} has {len(out)} usable conversations; --num-prompts asks for {num}.")
    return out


def prefix_repetition_requests(tokenizer, num: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                               output_len: int, seed: int, chat: bool) -> List[BenchRequest]:
    if num_prefixes < 1:
        raise DatasetError("--prefix-repetition-num-prefixes must be at least 1.")
    rng = random.Random(seed)
    vocab = _vocab(tokenizer)
    prefixes = [[rng.choice(vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    out = []
    for i in range(num):
        ids = prefixes[i % num_prefixes] + [rng.choice(vocab) for _ in range(suffix_len)]
        out.append(BenchRequest(_as_prompt(tokenizer, ids, chat), len(ids), output_len))
    rng.shuffle(out)
    return out


def unique_requests(tokenizer, num: int, input_len: int, output_len: int, rng: random.Random, chat: bool,
                    seen: Set[tuple]) -> List[BenchRequest]:
    """`num` prompts of random token ids whose first 16 tokens are in no other prompt of `seen` (updated): a fresh
    prompt every request, as Artificial Analysis sends, so that no prefix-cache hit shortens a TTFT."""
    vocab = _vocab(tokenizer)
    out = []
    while len(out) < num:
        ids = [rng.choice(vocab) for _ in range(input_len)]
        if tuple(ids[:16]) in seen:
            continue
        seen.add(tuple(ids[:16]))
        out.append(BenchRequest(_as_prompt(tokenizer, ids, chat), input_len, output_len))
    return out


def build_requests(args, tokenizer, chat: bool) -> List[BenchRequest]:
    """The requests of --dataset-name and its flags."""
    name = args.dataset_name
    if name == "random":
        return random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len,
                               args.random_range_ratio, args.seed, chat, args.random_prefix_len)
    if name == "sharegpt":
        return sharegpt_requests(tokenizer, args.dataset_path, args.num_prompts, args.seed, args.sharegpt_output_len)
    if name == "prefix-repetition":
        return prefix_repetition_requests(tokenizer, args.num_prompts, args.prefix_repetition_prefix_len,
                                          args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
                                          args.prefix_repetition_output_len, args.seed, chat)
    raise DatasetError(f"unknown dataset {name!r}")
