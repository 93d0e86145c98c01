"""Structured outputs offline: SamplingParams(structured_outputs=...) through the LLM on a random-weight model (the
outputs must satisfy their constraint whatever the weights), the grammar mask against xgrammar's own op, the
matcher bookkeeping of verify rows and resumed requests, and the params' trip across msgpack."""

from __future__ import annotations

import json
import re

import pytest
import torch

from gyrfalcon import SamplingParams, StructuredOutputsParams
from gyrfalcon.sampling_params import SamplingParamsError

# (A string bounded by maxLength alone may hold control characters in xgrammar 0.2.9, which strict JSON refuses:
# the bounded name uses a pattern.)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "kind"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                         "kind": {"enum": ["cat", "dog"]}}}
PROMPTS = ["hello", "def f(x):", "a b c", "Grüße"]


@pytest.fixture(scope="module")
def llm(qwen3_ckpt):
    from gyrfalcon import LLM
    return LLM(str(qwen3_ckpt), max_model_len=1024)


def _gen(llm, so: StructuredOutputsParams, **kw):
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 96), structured_outputs=so, **kw)
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7)], ids=["greedy", "seeded"])
def test_json_schema_outputs_validate(llm, sampling):
    jsonschema = pytest.importorskip("jsonschema")
    for out in _gen(llm, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), **sampling):
        assert out.finish_reason == "stop", out.text  # the grammar's end is the request's end
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_choice_regex_and_json_object_hold(llm):
    choices = ["yes", "no", 'say "maybe"']
    for out in _gen(llm, StructuredOutputsParams(choice=choices), temperature=1.0, seed=1):
        assert out.text in choices and out.finish_reason == "stop"
    for out in _gen(llm, StructuredOutputsParams(regex=r"[a-z]{2,4}-\d{2}"), temperature=1.0, seed=2):
        assert re.fullmatch(r"[a-z]{2,4}-\d{2}", out.text), out.text
    outs = _gen(llm, StructuredOutputsParams(json_object=True, disable_any_whitespace=True), temperature=0,
                max_tokens=400)
    for out in outs:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict), out.text
        else:  # cut by max_tokens: still a prefix of an object
            assert out.text.startswith("{"), out.text
    grammar = 'root ::= "x" ("ab" | "cd")+ "y"'
    for out in _gen(llm, StructuredOutputsParams(grammar=grammar), temperature=1.0, seed=3, max_tokens=64):
        assert re.fullmatch(r"x(ab|cd)+y", out.text) or out.finish_reason == "length", out.text


def test_constrained_and_free_requests_share_a_batch(llm):
    """A constrained request beside unconstrained greedy ones: theirs are the tokens they get alone."""
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate(PROMPTS[:2], free, use_tqdm=False)
    con = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=["zz"]))
    mixed = llm.generate(PROMPTS[:2] + ["x"], [free, free, con], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    assert mixed[2].outputs[0].text == "zz"


@pytest.mark.parametrize("so, needle", [
    (dict(json={"type": "wizard"}), "wizard"),
    (dict(json='{"type": "object"'), "JSON schema"),
    (dict(regex="a(b"), "parenthesis"),
    (dict(grammar="root ::= undefined_rule"), "undefined_rule"),
])
def test_bad_constraints_are_value_errors_naming_the_problem(llm, so, needle):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**so))
    with pytest.raises(ValueError, match=re.escape(needle)):
        llm.generate(["x"], params, use_tqdm=False)


def test_params_need_exactly_one_constraint():
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(SamplingParamsError, match="json, regex"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(SamplingParamsError, match="choice"):
        StructuredOutputsParams(choice=[])


def test_params_cross_msgpack():
    from gyrfalcon.engine.core_process import decode_sampling_params, encode_sampling_params
    from gyrfalcon.step_io import NewRequestData, ScheduledBatch, ScheduledRequest, decode_batch, encode_batch

    p = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    import msgpack
    back = decode_sampling_params(msgpack.unpackb(msgpack.packb(encode_sampling_params(p)), raw=False))
    assert back.structured_outputs == p.structured_outputs
    batch = ScheduledBatch([ScheduledRequest("r", 0, 1, True, [0], (), NewRequestData([1], p, [0]))])
    assert decode_batch(encode_batch(batch)).reqs[0].new_request.sampling_params.structured_outputs.json == SCHEMA


def test_bitmask_op_matches_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(0)
    for V in (100, 128, 517):
        logits = torch.randn(5, V, generator=g)
        bm = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, (V + 31) // 32), dtype=torch.int32, generator=g)
        rows = [0, 2, 4]
        ours = logits.clone()
        from gyrfalcon.runner.structured_output import apply_token_bitmask
        apply_token_bitmask(ours, torch.tensor(rows), bm)
        ref = logits.clone()
        full = torch.full((5, bm.shape[1]), -1, dtype=torch.int32)
        full[rows] = bm
        xgr.apply_token_bitmask_inplace(ref, full, vocab_size=V)
        assert torch.equal(ours, ref)
    # Logits wider than the grammar's vocabulary (padded embedding rows): the extra columns are never allowed.
    logits = torch.zeros(1, 70)
    apply_token_bitmask(logits, torch.tensor([0]), torch.full((1, 2), -1, dtype=torch.int32))
    assert torch.isinf(logits[0, 64:]).all() and not torch.isinf(logits[0, :64]).any()


class _State:
    def __init__(self, rid, outputs=()):
        self.request_id = rid
        self.output_token_ids = list(outputs)
        self.num_inflight = 1


def test_verify_rows_and_resumed_requests(qwen3_ckpt):
    """Verify rows see the grammar advanced through the drafts before them (and the matcher is rolled back after);
    a request that comes back after preemption replays its outputs into a fresh matcher."""
    from gyrfalcon.runner.structured_output import StructuredOutputs
    from gyrfalcon.step_io import NewRequestData, ScheduledBatch, ScheduledRequest
    from gyrfalcon.tokenizer import load_tokenizer

    tok = load_tokenizer(str(qwen3_ckpt))
    so = StructuredOutputs(str(qwen3_ckpt), False, 512)
    a, b, c = (tok.convert_tokens_to_ids(t) for t in "abc")
    p = SamplingParams(structured_outputs=StructuredOutputsParams(regex="abc"))

    def allowed(bm, i):
        return {t for t in range(512) if (int(bm[i, t // 32]) >> (t % 32)) & 1}

    sr = ScheduledRequest("r", 0, 3, True, [0], [a, b], NewRequestData([1], p, [0]))
    sr.request = _State("r")
    so.update(ScheduledBatch([sr]))
    idx, bm = so.bitmask([sr])
    assert idx == [0, 1, 2]
    # (Multi-character tokens such as "ab" may fit too.)
    assert a in allowed(bm, 0) and not {b, c} & allowed(bm, 0)
    assert b in allowed(bm, 1) and not {a, c} & allowed(bm, 1)
    assert allowed(bm, 2) == {c}
    sr.request.output_token_ids += [a, b, c]
    so.accept(sr.request, [a, b, c])  # (had the matcher not been rolled back, `a` would not fit now)
    nxt = ScheduledRequest("r", 3, 1, True)
    nxt.request = sr.request
    assert allowed(so.bitmask([nxt])[1], 0) == {0}  # the grammar is complete: only eos
    # Preempted and resumed with [a] already out: the fresh matcher expects b.
    again = ScheduledRequest("r", 0, 2, True, [0], (), NewRequestData([1], p, [0], [a]))
    again.request = _State("r", [a])
    so.update(ScheduledBatch([again], finished_request_ids=set()))
    mask = allowed(so.bitmask([again])[1], 0)
    assert b in mask and not {a, c} & mask
    so.update(ScheduledBatch([], finished_request_ids={"r"}))
    assert "r" not in so


def test_async_scheduling_waits_for_constrained_requests(qwen3_ckpt, llm):
    """With async scheduling a step is launched before the last one's tokens are read; a constrained request's
    mask needs them, so the engine waits: the outputs are the synchronous engine's."""
    from gyrfalcon import LLM

    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(max_tokens=96, temperature=1.0, seed=3, structured_outputs=so),
              SamplingParams(max_tokens=20, temperature=0)]
    prompts = PROMPTS[:2]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alt = LLM(str(qwen3_ckpt), max_model_len=1024, async_scheduling=True)
    assert alt.engine.async_scheduling
    got = [o.outputs[0].token_ids for o in alt.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_batched_fill_is_each_matchers_own(qwen3_ckpt):
    """Several plain rows are filled together on xgrammar's threads: each row must be its own matcher's mask."""
    import xgrammar as xgr

    from gyrfalcon.runner.structured_output import StructuredOutputs
    from gyrfalcon.step_io import NewRequestData, ScheduledBatch, ScheduledRequest

    so = StructuredOutputs(str(qwen3_ckpt), False, 512)
    specs = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex="[0-9]+x"),
             StructuredOutputsParams(choice=["alpha", "beta"]), StructuredOutputsParams(json_object=True)]
    rows = []
    for i, spec in enumerate(specs):
        sr = ScheduledRequest(f"r{i}", 0, 1, True, [i], (), NewRequestData([1], SamplingParams(structured_outputs=spec),
                                                                            [0]))
        sr.request = _State(f"r{i}")
        rows.append(sr)
    so.update(ScheduledBatch(rows))
    so.bitmask(rows)  # makes the matchers
    for sr, text in zip(rows, ['{"na', "12", "al", "{"]):
        so.grammars[sr.request_id].matcher.accept_string(text)
    idx, bm = so.bitmask(rows)
    assert idx == [0, 1, 2, 3]
    for i, sr in enumerate(rows):
        one = xgr.allocate_token_bitmask(1, 512)
        so.grammars[sr.request_id].matcher.fill_next_token_bitmask(one, 0)
        assert torch.equal(bm[i], one[0]), i
    assert len({tuple(r.tolist()) for r in bm}) == 4  # four different masks


def test_constraint_waits_for_the_end_of_reasoning(qwen3_ckpt):
    """With reasoning_end, rows are free until the outputs hold those ids; then the grammar reads what follows
    (also for a request resumed with the end already among its outputs)."""
    from gyrfalcon.runner.structured_output import StructuredOutputs
    from gyrfalcon.step_io import NewRequestData, ScheduledBatch, ScheduledRequest
    from gyrfalcon.tokenizer import load_tokenizer

    tok = load_tokenizer(str(qwen3_ckpt))
    end = tok.encode("</think>", add_special_tokens=False)
    x, y = (tok.convert_tokens_to_ids(t) for t in "xy")
    p = SamplingParams(structured_outputs=StructuredOutputsParams(regex="xy", reasoning_end=end))
    so = StructuredOutputs(str(qwen3_ckpt), False, 512)

    def step(sr, tokens):
        sr.request.output_token_ids += tokens
        so.accept(sr.request, tokens)

    sr = ScheduledRequest("r", 0, 1, True, [0], (), NewRequestData([1], p, [0]))
    sr.request = _State("r")
    so.update(ScheduledBatch([sr]))
    assert so.bitmask([sr]) is None  # reasoning: free
    step(sr, [y, y] + end[:1])
    assert so.bitmask([sr]) is None
    step(sr, end[1:] + [x])  # the end and the first constrained token in one step (a verify step's kept tokens)
    idx, bm = so.bitmask([sr])
    assert idx == [0] and [t for t in range(512) if (int(bm[0, t // 32]) >> (t % 32)) & 1] == [y]
    resumed = ScheduledRequest("r", 0, 1, True, [0], (), NewRequestData([1], p, [0], [y] + end + [x]))
    resumed.request = _State("r", [y] + end + [x])
    so.update(ScheduledBatch([resumed]))
    idx, bm = so.bitmask([resumed])
    assert [t for t in range(512) if (int(bm[0, t // 32]) >> (t % 32)) & 1] == [y]


def test_a_grammar_that_fails_to_compile_leaves_the_engine_running(qwen3_ckpt, caplog):
    from gyrfalcon.runner.structured_output import StructuredOutputs
    from gyrfalcon.step_io import NewRequestData, ScheduledBatch, ScheduledRequest

    so = StructuredOutputs(str(qwen3_ckpt), False, 512)
    so._compile = lambda spec: (_ for _ in ()).throw(RuntimeError("boom"))
    p = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"))
    sr = ScheduledRequest("r", 0, 1, True, [0], (), NewRequestData([1], p, [0]))
    sr.request = _State("r")
    so.update(ScheduledBatch([sr]))
    assert so.bitmask([sr]) is None and "r" not in so
    assert "did not compile" in caplog.text
    so.accept(sr.request, [5])  # nothing to advance: no error


def test_compiled_grammars_are_cached_by_constraint_within_bounds(qwen3_ckpt, monkeypatch):
    from gyrfalcon.runner import structured_output as mod

    so = mod.StructuredOutputs(str(qwen3_ckpt), False, 512)
    a, b = StructuredOutputsParams(regex="ab+"), StructuredOutputsParams(json={"type": "object"})
    fa = so._compiled(a)
    assert so._compiled(StructuredOutputsParams(regex="ab+")) is fa  # the same constraint: compiled once
    assert fa.result().memory_size_bytes > 0
    monkeypatch.setattr(mod, "_CACHE_BYTES", 1)  # over the bound: only the newest stays
    so._compiled(b).result()
    assert list(so._cache) == [b.key()]
