"""`gyrfalcon serve` on a hybrid model (tiny Qwen3-Next: three Gated DeltaNet layers, each request holding a state
slot, and one gated attention layer): completions, a concurrent batch and streamed chat answered with exactly the
offline engine's greedy tokens, prompts crossing the delta rule's 64-token chunks. The server runs with as many
state slots as concurrent requests (--max-num-seqs 4), so a slot that a finished or aborted request kept would leave
a later full batch waiting forever: full batches after every kind of ending must finish, and the server go idle with
every KV block free."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from checkpoints import make_qwen3_next_checkpoint
from server_testutil import MAX_MODEL_LEN, MODEL_NAME, Oracle, ServerProcess

SLOTS = 4
LONG = ("import json\nimport os\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n"
        "        self.values = {}\n\n    def load(self):\n        with open(self.path) as f:\n"
        "            self.values = json.load(f)\n        return self\n")
PROMPTS = ["def fib(n):", LONG, "The capital of", "x = [1, 2, 3]\nfor i in x:"]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from gyrfalcon import LLM

    ckpt = make_qwen3_next_checkpoint(tmp_path_factory.mktemp("qwen3_next"), max_position_embeddings=MAX_MODEL_LEN)
    srv = ServerProcess(ckpt, tmp_path_factory.mktemp("logs") / "qwen3_next.log", "--max-num-seqs", str(SLOTS))
    oracle = Oracle(LLM(str(ckpt), max_model_len=MAX_MODEL_LEN))
    yield srv, oracle
    assert srv.stop() == 0, srv.log()[-3000:]


def _offline(oracle, max_tokens=12):
    from gyrfalcon import SamplingParams

    return [o.outputs[0].text for o in oracle.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)]


def _batch(srv, max_tokens=12, timeout=90):
    """PROMPTS concurrently: one continuous batch of SLOTS requests, each holding a state slot."""
    async def run():
        ac = srv.async_client()
        try:
            rs = await asyncio.wait_for(asyncio.gather(*[ac.completions.create(
                model=MODEL_NAME, prompt=p, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
                for p in PROMPTS]), timeout)
        finally:
            await ac.close()
        return [x.choices[0].text for x in rs]

    return asyncio.run(run())


def _assert_idle(srv):
    m = srv.wait_idle()
    assert m["gyrfalcon:num_requests_running"] == 0 and m["gyrfalcon:num_requests_waiting"] == 0
    assert m["gyrfalcon:kv_cache_usage_perc"] == 0.0


def test_prompts_cross_gdn_chunks(hybrid):
    _, oracle = hybrid
    assert len(oracle.tokenizer.encode(LONG)) > 64 and len(PROMPTS) == SLOTS


def test_completions_and_batch_match_offline(hybrid):
    srv, oracle = hybrid
    want = _offline(oracle)
    c = srv.client()
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == want[1] and r.usage.completion_tokens == 12
    assert _batch(srv) == want  # every slot taken at once
    _assert_idle(srv)
    assert _batch(srv) == want  # the slots came back: a second full batch runs, from zeroed states
    _assert_idle(srv)


def test_streamed_chat_matches_offline(hybrid):
    from gyrfalcon import SamplingParams

    srv, oracle = hybrid
    msgs = [{"role": "user", "content": "Write a loop."}]
    want = oracle.chat(msgs, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].text
    stream = srv.client().chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=10, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == want
    _assert_idle(srv)


def test_dropped_streams_free_their_slots(hybrid):
    """SLOTS streams asking for thousands of tokens, dropped after a few chunks: the engine aborts them, and a full
    batch afterwards finishes with the offline tokens (an aborted request's slot back in the pool, its state not
    leaking into the next holder's)."""
    srv, oracle = hybrid
    before = srv.metrics()

    async def drop(client, prompt):
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3000, "ignore_eos": True, "stream": True,
                "temperature": 0}
        n = 0
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    n += 1
                    if n >= 3:
                        break  # leaving the block closes the connection
        return n

    async def main():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as client:
            return await asyncio.gather(*(drop(client, p) for p in PROMPTS))

    assert asyncio.run(main()) == [3] * SLOTS
    _assert_idle(srv)
    after = srv.metrics()
    key = "gyrfalcon:request_success_total{finished_reason=abort}"
    assert after[key] - before.get(key, 0.0) == SLOTS
    assert _batch(srv) == _offline(oracle)
    _assert_idle(srv)


def test_multi_turn_chat_hits_the_prefix_cache(hybrid):
    """Each turn of a chat re-sends the earlier ones: from the second on, the prompt resumes at the last block
    boundary of the previous turn's prompt (a Gated DeltaNet state snapshot restored there), answers with the offline
    engine's text, and the hits show in the usage (cached_tokens) and in the same Prometheus counters as a dense
    model's."""
    from gyrfalcon import SamplingParams

    srv, oracle = hybrid
    before = srv.metrics()
    msgs = [{"role": "system", "content": "You are a careful Python assistant. " * 6},
            {"role": "user", "content": "Write a loop."}]
    cached = []
    for turn in range(3):
        r = srv.client().chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=8, temperature=0,
                                                 extra_body={"ignore_eos": True})
        want = oracle.chat(msgs, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].text
        assert r.choices[0].message.content == want
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        msgs = msgs + [{"role": "assistant", "content": want}, {"role": "user", "content": f"Again, {turn}."}]
    assert cached[0] == 0 and cached[1] >= 16 and cached[2] > cached[1]
    after = srv.wait_idle()
    assert after["gyrfalcon:prefix_cache_hits_total"] - before.get("gyrfalcon:prefix_cache_hits_total", 0.0) == sum(
        cached)
