"""The engine-core wire format: typed msgpack messages, no pickle, and loud failure on garbage."""

from __future__ import annotations

import msgpack
import pytest

from gyrfalcon.engine.core_process import (AbortRequests, AddRequest, EngineDead, FinishRequests, Outputs,
                                           ProtocolError, Ready, RequestFailed, Shutdown, StartupFailed, Stats,
                                           decode_message, decode_sampling_params, encode_sampling_params)
from gyrfalcon.sampling_params import SamplingParams


@pytest.mark.parametrize("msg", [
    AddRequest("r1", [1, 2, 3], {"n": 1, "max_tokens": 4}),
    AbortRequests(["a", "b"]), FinishRequests(["c"]), Shutdown(),
    Ready(123, 4096, 16, 2048), StartupFailed("boom"),
    Outputs([["r1", [5], [[-0.5, 1, [[5, -0.5], [7, -1.25]]]], True, "stop", "</s>", 3, 0, 0.01]],
            {"running": 1, "kv_usage": 0.5}),
    Stats({"running": 0}), RequestFailed("r2", "too long"), EngineDead("trace"),
])
def test_round_trip(msg):
    data = msg.encode()
    assert not data.startswith(b"\x80")  # not a pickle
    assert isinstance(msgpack.unpackb(data), list)
    assert decode_message(data) == msg


def test_sampling_params_round_trip():
    p = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=7, max_tokens=12, min_tokens=2,
                       stop=["x", "yz"], stop_token_ids=[4], ignore_eos=True, logprobs=3, presence_penalty=0.5,
                       frequency_penalty=-0.5, repetition_penalty=1.2, include_stop_str_in_output=True)
    d = msgpack.unpackb(msgpack.packb(encode_sampling_params(p)))
    assert "_eos_token_id" not in d
    assert decode_sampling_params(d) == p


@pytest.mark.parametrize("data", [
    b"\x80\x04garbage", msgpack.packb({"a": 1}), msgpack.packb([]), msgpack.packb([999]),
    msgpack.packb([AbortRequests.TAG]), msgpack.packb([AbortRequests.TAG, ["a"], "extra"]),
])
def test_bad_messages_raise(data):
    with pytest.raises(ProtocolError):
        decode_message(data)


def test_unknown_sampling_field_raises():
    with pytest.raises(ProtocolError):
        decode_sampling_params({"n": 1, "evil": 2})
