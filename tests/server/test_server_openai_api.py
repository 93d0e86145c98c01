"""/v1/completions and /v1/chat/completions through the real `openai` client against a real server:
each output equals the offline LLM's for the same request, and streamed deltas concatenate to it."""

from __future__ import annotations

import re

import httpx
import pytest

from server_testutil import MODEL_NAME
from gyrfalcon import SamplingParams

PROMPTS = ["def fib(n):", "import json\nclass Encoder:", "The quick brown fox"]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, **kw})


def offline(llm, prompt, params: SamplingParams):
    return llm.generate(prompt, params, use_tqdm=False)[0]


def test_models_health_version(server):
    c = server.client()
    models = c.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/version").json()["version"]


def test_completion_matches_offline(server, llm):
    c = server.client()
    for prompt in PROMPTS:
        r = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
        ref = offline(llm, prompt, greedy()).outputs[0]
        assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL_NAME
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == "length"
        n_prompt = len(llm.tokenizer(prompt)["input_ids"])
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)


def test_completion_batch_and_token_prompts(server, llm):
    c = server.client()
    ids = llm.tokenizer(PROMPTS[0])["input_ids"]
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=8, temperature=0)
    refs = llm.generate(PROMPTS, greedy(max_tokens=8, ignore_eos=False), use_tqdm=False)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [o.outputs[0].text for o in refs]
    r = c.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == refs[0].outputs[0].text
    r = c.completions.create(model=MODEL_NAME, prompt=[ids, ids[:2]], max_tokens=8, temperature=0)
    assert r.choices[0].text == refs[0].outputs[0].text
    assert r.choices[1].text == offline(llm, ids[:2], greedy(max_tokens=8, ignore_eos=False)).outputs[0].text


def test_completion_stream_concatenates(server, llm):
    c = server.client()
    for prompt in PROMPTS:
        ref = offline(llm, prompt, greedy(max_tokens=20)).outputs[0]
        chunks = list(c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}))
        texts = [ch.choices[0].text for ch in chunks if ch.choices]
        assert "".join(texts) == ref.text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_completion_echo_and_params(server, llm):
    c = server.client()
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == PROMPTS[0] + offline(llm, PROMPTS[0], greedy(max_tokens=6)).outputs[0].text
    kw = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3, min_tokens=4, top_k=5)
    ref = offline(llm, PROMPTS[1], greedy(max_tokens=10, ignore_eos=False, **kw)).outputs[0]
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=10, temperature=0,
                             presence_penalty=0.5, frequency_penalty=0.3,
                             extra_body={"repetition_penalty": 1.3, "min_tokens": 4, "top_k": 5})
    assert r.choices[0].text == ref.text
    base = offline(llm, PROMPTS[2], greedy(max_tokens=10)).outputs[0]
    stop_tok = base.token_ids[4]
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=10, temperature=0,
                             extra_body={"stop_token_ids": [stop_tok]})
    ref = offline(llm, PROMPTS[2], greedy(max_tokens=10, ignore_eos=False, stop_token_ids=[stop_tok])).outputs[0]
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(ref.token_ids) == base.token_ids.index(stop_tok) + 1


def _stop_string(text: str) -> str:
    """A short alphanumeric piece from the middle of `text`."""
    for m in re.finditer(r"[A-Za-z0-9]{2,3}", text):
        if m.start() >= 4:
            return m.group(0)
    pytest.skip(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(server, llm, stream):
    c = server.client()
    prompt = PROMPTS[0]
    full = offline(llm, prompt, greedy(max_tokens=40)).outputs[0].text
    stop = _stop_string(full)
    ref = offline(llm, prompt, greedy(max_tokens=40, stop=[stop])).outputs[0]
    assert ref.text == full[:full.index(stop)] and ref.finish_reason == "stop"
    r = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0, stop=[stop],
                             stream=stream, extra_body={"ignore_eos": True})
    if stream:
        chunks = [ch.choices[0] for ch in r]
        assert "".join(ch.text for ch in chunks) == ref.text
        assert chunks[-1].finish_reason == "stop"
    else:
        assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "stop"
    # The same through chat.
    msgs = [{"role": "user", "content": "hi"}]
    full = llm.chat(msgs, greedy(max_tokens=40), use_tqdm=False)[0].outputs[0].text
    stop = _stop_string(full)
    ref = llm.chat(msgs, greedy(max_tokens=40, stop=stop), use_tqdm=False)[0].outputs[0]
    r = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=40, temperature=0, stop=stop,
                                  stream=stream, extra_body={"ignore_eos": True})
    text = "".join(ch.choices[0].delta.content or "" for ch in r) if stream else r.choices[0].message.content
    assert text == ref.text


@pytest.mark.parametrize("stream", [False, True])
def test_n_seeded_sampling(server, llm, stream):
    c = server.client()
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    refs = [o.text for o in offline(llm, PROMPTS[0], params).outputs]
    assert len(set(refs)) > 1
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], n=3, temperature=0.9, top_p=0.95, seed=1234,
                             max_tokens=10, stream=stream, extra_body={"ignore_eos": True})
    got = ["", "", ""]
    if stream:
        for ch in r:
            for choice in ch.choices:
                got[choice.index] += choice.text
    else:
        got = [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
        assert r.usage.completion_tokens == 30
    assert got == refs


def test_completion_logprobs(server, llm):
    c = server.client()
    ref = offline(llm, PROMPTS[1], greedy(max_tokens=6, logprobs=3)).outputs[0]
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3,
                             extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for i, (tid, entry) in enumerate(zip(ref.token_ids, ref.logprobs)):
        assert lp.token_logprobs[i] == pytest.approx(entry[tid].logprob, abs=1e-4)
        assert lp.tokens[i] == entry[tid].decoded_token
        assert 3 <= len(lp.top_logprobs[i]) <= 4
        # Greedy: the sampled token is the most likely one.
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i], abs=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # Streamed logprobs cover every token once.
    chunks = list(c.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                       logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    toks = [t for ch in chunks for t in (ch.choices[0].logprobs.token_logprobs if ch.choices[0].logprobs else [])]
    assert toks == pytest.approx(lp.token_logprobs, abs=1e-5)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_matches_offline(server, llm, stream):
    c = server.client()
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    ref = llm.chat(msgs, greedy(max_tokens=16), use_tqdm=False)[0].outputs[0]
    r = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_completion_tokens=16, temperature=0,
                                  stream=stream, stream_options={"include_usage": True} if stream else None,
                                  extra_body={"ignore_eos": True})
    if stream:
        chunks = list(r)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(ch.object == "chat.completion.chunk" and ch.id.startswith("chatcmpl-") for ch in chunks)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 16
    else:
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    assert text == ref.text


def test_chat_logprobs(server, llm):
    c = server.client()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    ref = llm.chat([{"role": "user", "content": "Hello"}], greedy(max_tokens=5, logprobs=2),
                   use_tqdm=False)[0].outputs[0]
    r = c.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                  top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == ref.text and len(content) == 5
    for item, tid, entry in zip(content, ref.token_ids, ref.logprobs):
        assert item.token == entry[tid].decoded_token
        assert item.logprob == pytest.approx(entry[tid].logprob, abs=1e-4)
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-5)


def test_tokenize_detokenize(server, llm):
    h = server.headers()
    r = httpx.post(server.base_url + "/tokenize", json={"model": MODEL_NAME, "prompt": "def f(x): return x"},
                   headers=h).json()
    assert r["tokens"] == llm.tokenizer("def f(x): return x")["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 4096
    r2 = httpx.post(server.base_url + "/detokenize", json={"tokens": r["tokens"]}, headers=h).json()
    assert r2["prompt"] == "def f(x): return x"
    msgs = [{"role": "user", "content": "hi"}]
    r3 = httpx.post(server.base_url + "/tokenize", json={"messages": msgs}, headers=h).json()
    text = llm.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert r3["tokens"] == llm.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_logit_bias_forces_and_bans_tokens(server, llm):
    """OpenAI's logit_bias (string token ids): +100 makes a token the greedy choice at every step;
    -100 on the unbiased first token moves the choice away from it. Same as the offline LLM."""
    c = server.client()
    forced = llm.tokenizer("x")["input_ids"][0]
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                             logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    ref = offline(llm, PROMPTS[0], greedy(max_tokens=5, logit_bias={forced: 100})).outputs[0]
    assert ref.token_ids == [forced] * 5 and r.choices[0].text == ref.text
    first = offline(llm, PROMPTS[0], greedy(max_tokens=1)).outputs[0].token_ids[0]
    r = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                  temperature=0, logit_bias={str(first): -100})
    assert r.choices[0].message.content is not None
    banned = offline(llm, PROMPTS[0], greedy(max_tokens=1, logit_bias={first: -100})).outputs[0].token_ids[0]
    assert banned != first


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_echo_logprobs_score_the_prompt(server, llm, stream):
    """echo + logprobs (how evaluation harnesses score a text): every echoed prompt token but the first
    carries its logprob given the tokens before it, the offline LLM's prompt_logprobs."""
    c = server.client()
    ids = llm.tokenizer(PROMPTS[1])["input_ids"]
    ref = offline(llm, PROMPTS[1], greedy(max_tokens=2, prompt_logprobs=2)).prompt_logprobs
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=2, temperature=0, echo=True,
                             logprobs=2, stream=stream, extra_body={"ignore_eos": True})
    if stream:
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        for chunk in r:
            for ch in chunk.choices:
                if ch.logprobs is not None:
                    for key in lp:
                        lp[key] += getattr(ch.logprobs, key)
    else:
        lp = {k: getattr(r.choices[0].logprobs, k) for k in ("tokens", "token_logprobs", "top_logprobs")}
    n = len(ids)
    assert len(lp["tokens"]) == n + 2
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, n):
        assert lp["token_logprobs"][j] == pytest.approx(ref[j][ids[j]].logprob, abs=1e-4)
        assert len(lp["top_logprobs"][j]) <= 3
    assert all(v is not None for v in lp["token_logprobs"][n:])
