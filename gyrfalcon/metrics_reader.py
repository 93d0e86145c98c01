"""The offline engine's metrics as plain objects, the shape of vLLM's `LLM.get_metrics()` (vllm.v1.metrics.reader):
a list of Counter / Gauge / Vector, each with a name, labels and a value (Vector: one value per position, as
the spec-decode acceptance per draft position). Names are the server's /metrics names (gyrfalcon:...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List


@dataclass
class Metric:
    name: str
    labels: Dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    values: List[int] = field(default_factory=list)


def engine_metrics(engine, model_name: str) -> List[Metric]:
    """The engine's counters and gauges now: requests, tokens, prefix cache, preemptions, and speculative
    decoding's (when a proposer runs)."""
    bm, sch = engine.block_manager, engine.scheduler
    lbl = {"model_name": model_name}
    out: List[Metric] = [
        Gauge("gyrfalcon:num_requests_running", dict(lbl), sch.num_running),
        Gauge("gyrfalcon:num_requests_waiting", dict(lbl), sch.num_waiting),
        Gauge("gyrfalcon:kv_cache_usage_perc", dict(lbl), bm.usage),
        Counter("gyrfalcon:prompt_tokens", dict(lbl), engine.num_prompt_tokens_total),
        Counter("gyrfalcon:generation_tokens", dict(lbl), engine.num_generation_tokens_total),
        Counter("gyrfalcon:prefix_cache_queries", dict(lbl), bm.prefix_queries),
        Counter("gyrfalcon:prefix_cache_hits", dict(lbl), bm.prefix_hits),
        Counter("gyrfalcon:num_preemptions", dict(lbl), sch.num_preemptions_total),
    ]
    if getattr(engine.runner, "proposes_drafts", False):
        s = engine.spec_stats
        out += [Counter("gyrfalcon:spec_decode_num_drafts", dict(lbl), s.num_drafts),
                Counter("gyrfalcon:spec_decode_num_draft_tokens", dict(lbl), s.num_draft_tokens),
                Counter("gyrfalcon:spec_decode_num_accepted_tokens", dict(lbl), s.num_accepted_tokens),
                Vector("gyrfalcon:spec_decode_num_accepted_tokens_per_pos", dict(lbl), list(s.accepted_per_pos))]
    return out
