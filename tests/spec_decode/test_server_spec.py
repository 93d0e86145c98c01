"""`gyrfalcon serve --speculative-config`: the flag reaches the engine core, greedy completions equal the offline
engine's without speculation, and /metrics carries the spec_decode counters, moving with the traffic."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))

from server_testutil import MODEL_NAME, ServerProcess  # noqa: E402

from gyrfalcon import LLM, SamplingParams  # noqa: E402

PROMPTS = ["def f(x):\n    return x\ndef f(x):\n    return", "a b c a b c a b c a b", "hello hello hello"]


def test_serve_with_ngram_speculation(qwen3_ckpt, tmp_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    srv = ServerProcess(qwen3_ckpt, tmp_path / "server.log", "--max-model-len", "256",
                        "--speculative-config", json.dumps(spec))
    try:
        # The core's first stats message follows its ready message: until then the page has no spec counters.
        deadline = time.monotonic() + 30
        while "gyrfalcon:spec_decode_num_drafts_total" not in srv.metrics():
            assert time.monotonic() < deadline, srv.metrics()
            time.sleep(0.1)
        assert srv.metrics()["gyrfalcon:spec_decode_num_drafts_total"] == 0
        c = srv.client()
        got = [c.completions.create(model=MODEL_NAME, prompt=p, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
        after = srv.wait_idle()
        import httpx

        from gyrfalcon.bench.serve_report import spec_decode_counts
        counters = spec_decode_counts(httpx.get(srv.base_url + "/metrics", timeout=10).text)
    finally:
        rc = srv.stop()
    assert rc == 0, srv.log()[-3000:]
    ref = LLM(str(qwen3_ckpt), max_model_len=256, device="cpu").generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert got == [o.outputs[0].text for o in ref]
    drafts = after["gyrfalcon:spec_decode_num_drafts_total"]
    draft_tokens = after["gyrfalcon:spec_decode_num_draft_tokens_total"]
    assert 0 < drafts <= draft_tokens <= 3 * drafts
    accepted = after["gyrfalcon:spec_decode_num_accepted_tokens_total"]
    per_pos = [after.get(f"gyrfalcon:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}", 0)
               for i in range(3)]
    assert sum(per_pos) == accepted
    # What bench serve reads off the page.
    assert counters["drafts"] == drafts and counters["accepted_tokens"] == accepted
    assert [counters.get("per_pos", {}).get(i, 0) for i in range(3)] == per_pos
