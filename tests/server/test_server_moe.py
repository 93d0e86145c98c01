"""`gyrfalcon serve` on the MoE families (tiny Qwen3-MoE with a dense layer among sparse ones; tiny MiniMax-M2 with
its sigmoid, bias-selected router and whole-projection QK-norm): completions, streamed chat and a concurrent batch
answered with exactly the offline engine's greedy tokens, and every KV block free afterwards."""

from __future__ import annotations

import asyncio

import pytest

from checkpoints import make_moe_checkpoint
from server_testutil import MAX_MODEL_LEN, MODEL_NAME, ServerProcess

PROMPTS = ["def fib(n):", "The capital of", "import os\nimport sys\n", "x = [1, 2, 3]\nfor i in x:"]


@pytest.fixture(scope="module", params=["qwen3_moe", "minimax_m2"])
def moe(request, tmp_path_factory):
    from gyrfalcon import LLM

    ckpt = make_moe_checkpoint(tmp_path_factory.mktemp(request.param), request.param,
                               max_position_embeddings=MAX_MODEL_LEN)
    srv = ServerProcess(ckpt, tmp_path_factory.mktemp("logs") / f"{request.param}.log")
    oracle = LLM(str(ckpt), max_model_len=MAX_MODEL_LEN)
    yield srv, oracle
    assert srv.stop() == 0, srv.log()[-3000:]


def test_completions_and_batch_match_offline(moe):
    from gyrfalcon import SamplingParams

    srv, oracle = moe
    want = [o.outputs[0].text for o in oracle.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)]
    c = srv.client()
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == want[0] and r.usage.completion_tokens == 12

    async def batch():
        ac = srv.async_client()
        rs = await asyncio.gather(*[ac.completions.create(
            model=MODEL_NAME, prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
            for p in PROMPTS])
        await ac.close()
        return [x.choices[0].text for x in rs]

    assert asyncio.run(batch()) == want  # one continuous batch through the routers and experts
    m = srv.wait_idle()
    assert m["gyrfalcon:kv_cache_usage_perc"] == 0.0


def test_streamed_chat_matches_offline(moe):
    from gyrfalcon import SamplingParams

    srv, oracle = moe
    msgs = [{"role": "user", "content": "Write a loop."}]
    want = oracle.chat(msgs, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].text
    stream = srv.client().chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=10, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == want
