"""Many requests at once: no request lost, no cross-talk, and clients that leave free what they held."""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from server_testutil import MODEL_NAME
from gyrfalcon import SamplingParams

WORDS = ("def class return import json self value list dict the quick brown fox lazy dog for while if else "
         "print yield async await lambda None True False").split()


def test_many_concurrent_requests_match_offline(server, llm):
    """240 requests (completions and chat, streamed and not) at concurrency 32, each equal to its
    offline greedy output; afterwards nothing runs, waits or holds a KV block."""
    t0 = time.monotonic()
    rng = random.Random(0)
    reqs = []
    for i in range(240):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
        reqs.append({"prompt": prompt, "max_tokens": rng.randint(1, 24), "chat": i % 3 == 2, "stream": i % 2 == 1})
    # The oracle: one offline batch each for completions and chats.
    comp = [r for r in reqs if not r["chat"]]
    outs = llm.generate([r["prompt"] for r in comp],
                        [SamplingParams(temperature=0, max_tokens=r["max_tokens"]) for r in comp], use_tqdm=False)
    for r, o in zip(comp, outs):
        r["expected"] = o.outputs[0].text
    chats = [r for r in reqs if r["chat"]]
    outs = llm.chat([[{"role": "user", "content": r["prompt"]}] for r in chats],
                    [SamplingParams(temperature=0, max_tokens=r["max_tokens"]) for r in chats], use_tqdm=False)
    for r, o in zip(chats, outs):
        r["expected"] = o.outputs[0].text

    async def one(client, sem, r):
        async with sem:
            if r["chat"]:
                msgs = [{"role": "user", "content": r["prompt"]}]
                res = await client.chat.completions.create(model=MODEL_NAME, messages=msgs, temperature=0,
                                                           max_tokens=r["max_tokens"], stream=r["stream"])
                if r["stream"]:
                    return "".join([ch.choices[0].delta.content or "" async for ch in res if ch.choices])
                return res.choices[0].message.content
            res = await client.completions.create(model=MODEL_NAME, prompt=r["prompt"], temperature=0,
                                                  max_tokens=r["max_tokens"], stream=r["stream"])
            if r["stream"]:
                return "".join([ch.choices[0].text async for ch in res if ch.choices])
            return res.choices[0].text

    async def main():
        client = server.async_client()
        sem = asyncio.Semaphore(32)
        try:
            return await asyncio.gather(*(one(client, sem, r) for r in reqs), return_exceptions=True)
        finally:
            await client.close()

    t1 = time.monotonic()
    got = asyncio.run(main())
    elapsed = time.monotonic() - t1
    errors = [g for g in got if isinstance(g, BaseException)]
    assert not errors, errors[:3]
    mismatched = [(r["prompt"], r["expected"], g) for r, g in zip(reqs, got) if g != r["expected"]]
    assert not mismatched, (len(mismatched), mismatched[:3])
    m = server.wait_idle()
    assert m["gyrfalcon:kv_cache_usage_perc"] == 0.0
    print(f"offline oracle {t1 - t0:.1f} s, 240 requests over HTTP {elapsed:.1f} s")


def _sse_lines(resp):
    for line in resp.iter_lines():
        if line.startswith("data: "):
            yield line[6:]


def test_dropped_clients_free_everything(server):
    """50 streams asking for thousands of tokens whose clients leave after a few chunks (and 5
    non-streaming ones that time out): the engine stops them all, frees every block, and a new
    request is answered within seconds."""
    before = server.metrics()

    async def drop_stream(client, i):
        body = {"model": MODEL_NAME, "prompt": f"{i} " + " ".join(WORDS[: 5 + i % 20]), "max_tokens": 3000,
                "ignore_eos": True, "stream": True, "temperature": 0.8, "seed": i}
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            n = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    n += 1
                    if n >= 3:
                        break  # leaving the block closes the connection
        return n

    async def drop_blocking(client, i):
        body = {"model": MODEL_NAME, "prompt": f"blocking {i}", "max_tokens": 3000, "ignore_eos": True}
        try:
            await client.post("/v1/completions", json=body, timeout=1.5)
        except httpx.TimeoutException:
            return True
        return False

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers(), limits=limits,
                                     timeout=60) as client:
            return await asyncio.gather(*(drop_stream(client, i) for i in range(50)),
                                        *(drop_blocking(client, i) for i in range(5)))

    res = asyncio.run(main())
    assert all(n == 3 for n in res[:50]) and all(res[50:]), res
    t0 = time.monotonic()
    r = httpx.post(server.base_url + "/v1/completions", headers=server.headers(), timeout=30,
                   json={"model": MODEL_NAME, "prompt": "still there?", "max_tokens": 4})
    assert r.status_code == 200 and time.monotonic() - t0 < 5.0, (r.text, time.monotonic() - t0)
    after = server.wait_idle(timeout=15)
    aborted = after["gyrfalcon:request_success_total{finished_reason=abort}"] - \
        before["gyrfalcon:request_success_total{finished_reason=abort}"]
    assert aborted == 55
    # They stopped early: nowhere near 55 x 3000 tokens were generated.
    generated = after["gyrfalcon:generation_tokens_total"] - before["gyrfalcon:generation_tokens_total"]
    assert generated < 55 * 3000 / 4, generated
