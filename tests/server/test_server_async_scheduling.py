"""`gyrfalcon serve --async-scheduling`: the engine core schedules a step ahead of its results;
what clients receive must not change, and everything is released afterwards."""

from __future__ import annotations

import asyncio
import random

import pytest

from gyrfalcon import SamplingParams
from server_testutil import MODEL_NAME, ServerProcess

WORDS = "the of def return import class self value data list for in if else while print".split()


@pytest.fixture(scope="module")
def async_server(server_ckpt, tmp_path_factory):
    srv = ServerProcess(server_ckpt, tmp_path_factory.mktemp("logs") / "async.log", "--async-scheduling")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_outputs_match_offline_and_nothing_stays_held(async_server, llm):
    rng = random.Random(1)
    reqs = []
    for i in range(48):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
        reqs.append({"prompt": prompt, "max_tokens": rng.randint(1, 20), "stream": i % 2 == 0,
                     "stop": [" the"] if i % 3 == 0 else None})
    outs = llm.generate([r["prompt"] for r in reqs],
                        [SamplingParams(temperature=0, max_tokens=r["max_tokens"], stop=r["stop"]) for r in reqs],
                        use_tqdm=False)
    for r, o in zip(reqs, outs):
        r["expected"] = (o.outputs[0].text, o.outputs[0].finish_reason)

    async def one(client, sem, r):
        async with sem:
            res = await client.completions.create(model=MODEL_NAME, prompt=r["prompt"], temperature=0,
                                                  max_tokens=r["max_tokens"], stop=r["stop"], stream=r["stream"])
            if r["stream"]:
                text, finish = "", None
                async for ch in res:
                    if ch.choices:
                        text += ch.choices[0].text
                        finish = ch.choices[0].finish_reason or finish
                return text, finish
            return res.choices[0].text, res.choices[0].finish_reason

    async def main():
        client = async_server.async_client()
        sem = asyncio.Semaphore(16)
        try:
            return await asyncio.gather(*(one(client, sem, r) for r in reqs))
        finally:
            await client.close()

    got = asyncio.run(main())
    assert [r["expected"] for r in reqs] == got
    m = async_server.wait_idle()
    assert m["gyrfalcon:kv_cache_usage_perc"] == 0.0
