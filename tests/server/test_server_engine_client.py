"""AsyncEngineClient's bookkeeping without a core process: outputs fed in by hand, messages captured."""

from __future__ import annotations

import asyncio

import pytest

from gyrfalcon.engine.core_process import AbortRequests, AddRequest, FinishRequests, RequestFailed, decode_message
from gyrfalcon.sampling_params import SamplingParams
from gyrfalcon.server.engine_client import AsyncEngineClient, EngineDeadError, RequestRejected
from gyrfalcon.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(qwen3_ckpt):
    return load_tokenizer(str(qwen3_ckpt))


@pytest.fixture
def client(tokenizer):
    c = AsyncEngineClient("unused", {})
    c.set_tokenizer(tokenizer)
    c.sent = []
    c._send_bytes = lambda data: c.sent.append(decode_message(data))  # capture instead of a socket
    return c


def update(eid, tok, finished=False, reason=None):
    return [eid, [tok], [], finished, reason, None, 3, 0, 0.0 if reason is None else None, None]


def token_for(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, ids
    return ids[0]


def test_stop_string_ignores_late_tokens(client, tokenizer):
    """n=2: sample 0 meets its stop string; a step the core ran before it read FinishRequests still
    carries a token for sample 0, which must not reach the finished sample."""
    a, stop, b = token_for(tokenizer, "a"), token_for(tokenizer, "x"), token_for(tokenizer, "b")
    q = asyncio.Queue()
    st = client.add_request("r", "p", [1, 2, 3], SamplingParams(n=2, stop=["x"], max_tokens=10), q)
    assert [type(m) for m in client.sent] == [AddRequest, AddRequest]
    e0, e1 = (s.engine_id for s in st.samples)
    client._handle_outputs([update(e0, a), update(e1, a)])
    client._handle_outputs([update(e0, stop), update(e1, b)])
    assert isinstance(client.sent[-1], FinishRequests) and client.sent[-1].request_ids == [e0]
    assert st.samples[0].finished and st.samples[0].text == "a"
    client._handle_outputs([update(e0, b), update(e1, b)])  # the late step
    assert st.samples[0].text == "a" and st.samples[0].token_ids == [a, stop]
    client._handle_outputs([update(e1, a, True, "length")])
    assert st.finished and st.samples[1].text == "abba"
    assert client.num_in_flight == 0 and not client._stopped and not client._started


def test_abort_sends_live_engine_ids(client):
    q = asyncio.Queue()
    st = client.add_request("r", None, [1, 2], SamplingParams(n=3, max_tokens=5), q)
    ids = [s.engine_id for s in st.samples]
    client._handle_outputs([update(ids[1], 7, True, "length")])
    client.abort("r")
    assert isinstance(client.sent[-1], AbortRequests) and sorted(client.sent[-1].request_ids) == sorted([ids[0], ids[2]])
    client.abort("r")  # twice is harmless
    assert len(client.sent) == 4 and client.num_in_flight == 0


def test_rejected_request_and_dead_engine(client):
    q1, q2 = asyncio.Queue(), asyncio.Queue()
    client.add_request("r1", None, [1], SamplingParams(), q1)
    client.add_request("r2", None, [1], SamplingParams(), q2)
    client._handle_failed(RequestFailed("r1", "nope"))
    assert isinstance(q1.get_nowait(), RequestRejected)
    client._mark_dead("gone")
    err = q2.get_nowait()
    assert isinstance(err, EngineDeadError) and err.code == "engine_dead"
    with pytest.raises(EngineDeadError):
        client.add_request("r3", None, [1], SamplingParams(), asyncio.Queue())


def test_unencodable_request_leaves_nothing_behind(client):
    """SamplingParams refuses a seed past 64 bits; one set afterwards still cannot reach the socket."""
    params = SamplingParams()
    params.seed = 2 ** 70
    with pytest.raises(RequestRejected):
        client.add_request("big", None, [1], params, asyncio.Queue())
    assert client.sent == [] and client.num_in_flight == 0 and "big" not in client.processor.requests
