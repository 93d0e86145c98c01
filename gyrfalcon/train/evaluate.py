"""A draft's mean acceptance length through the engine: 1 + accepted draft tokens per drafting step (vLLM's
definition; k + 1 at most), greedy, over held-out prompts, and the accepted share at each draft position (their sum
is the mean length less one)."""

from __future__ import annotations

from typing import List, Sequence, Tuple


def held_out_acceptance(model: str, draft: str, prompts: Sequence[Sequence[int]], k: int, max_tokens: int,
                        ignore_eos: bool = False, **engine_kwargs) -> Tuple[float, List[float]]:
    """prompts: token-id lists. engine_kwargs: LLM() settings (device=, max_model_len=, ...). -> (mean acceptance
    length, [k] accepted drafts per drafting step at positions 1..k)."""
    from gyrfalcon.llm import LLM
    from gyrfalcon.sampling_params import SamplingParams

    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": k}
    llm = LLM(model, **{**engine_kwargs, "speculative_config": spec})
    llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos), use_tqdm=False)
    m = {x.name: x for x in llm.get_metrics()}
    drafts = m["gyrfalcon:spec_decode_num_drafts"].value if "gyrfalcon:spec_decode_num_drafts" in m else 0
    if not drafts:
        return 1.0, [0.0] * k
    per_pos = list(m["gyrfalcon:spec_decode_num_accepted_tokens_per_pos"].values)
    per_pos = [v / drafts for v in per_pos] + [0.0] * (k - len(per_pos))
    return 1.0 + m["gyrfalcon:spec_decode_num_accepted_tokens"].value / drafts, per_pos

