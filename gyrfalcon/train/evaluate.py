"""A draft's mean acceptance length through the engine: 1 + accepted draft tokens per drafting step (vLLM's
definition; k + 1 at most), greedy, over held-out prompts."""

from __future__ import annotations

from typing import Sequence


def mean_acceptance_length(model: str, draft: str, prompts: Sequence[Sequence[int]], k: int, max_tokens: int,
                           ignore_eos: bool = False, **engine_kwargs) -> float:
    """prompts: token-id lists. engine_kwargs: LLM() settings (device=, max_model_len=, ...)."""
    from gyrfalcon.llm import LLM
    from gyrfalcon.sampling_params import SamplingParams

    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": k}
    llm = LLM(model, **{**engine_kwargs, "speculative_config": spec})
    llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos), use_tqdm=False)
    m = {x.name: x.value for x in llm.get_metrics() if hasattr(x, "value")}
    drafts = m.get("gyrfalcon:spec_decode_num_drafts", 0)
    return 1.0 + m.get("gyrfalcon:spec_decode_num_accepted_tokens", 0) / drafts if drafts else 1.0
