"""Graphs for prefill / mixed steps (runner/mixed_graph.py), as far as a CPU can check them: the token
ladder, the padded static inputs, and the padded forward (which a CPU runs eagerly) giving the same
tokens and logprobs as the unpadded eager path."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon import LLM, SamplingParams
from gyrfalcon.engine.request import Request
from checkpoints import step_row
from gyrfalcon.runner.forward_batch import build_forward_batch, pack_host_batch
from gyrfalcon.runner.mixed_graph import MixedInputs, token_sizes


def test_token_ladder():
    assert token_sizes(8192) == [16, 32, 64, 128, 256, 512]
    assert token_sizes(100) == [16, 32, 64, 128]
    assert token_sizes(16) == [16]
    assert token_sizes(8) == [16]


def _mixed_reqs(block_size):
    """A prefill chunk (8 tokens from position 4), a whole prompt, and a decode whose token is pending."""
    out = []
    r = Request("a", list(range(10, 30)), SamplingParams(max_tokens=5))
    r.num_computed_tokens, r.block_ids = 4, [3, 9, 4]
    out.append(step_row(r, 8, False, 4))
    r = Request("b", list(range(40, 45)), SamplingParams(max_tokens=5))
    r.block_ids = [7, 2]
    out.append(step_row(r, 5, True, 0))
    r = Request("c", list(range(50, 56)), SamplingParams(max_tokens=5))
    r.output_token_ids = [60, 61]
    r.block_ids = [5, 6]
    out.append(step_row(r, 1, True, 8))  # position 8: the token sampled last step, not yet here
    return out


def test_mixed_inputs_describe_the_same_step_padded():
    bs = 4
    sched = _mixed_reqs(bs)
    last_rows = {"c": 3}
    hb = pack_host_batch(sched, bs, last_rows)
    eager = build_forward_batch(sched, bs, torch.device("cpu"), last_rows, torch.arange(100, 108))
    inputs = MixedInputs(max_tokens=32, max_seqs=8, max_blocks_per_seq=6, device=torch.device("cpu"))
    inputs.fill(hb, 16, 8)
    fb, src, li = inputs.views(16, 8)
    n, m = hb.num_tokens, hb.num_seqs
    assert (n, m) == (14, 3)
    ids = torch.where(src >= 0, torch.arange(100, 108)[src.clamp(min=0)], fb.input_ids)
    assert ids[:n].tolist() == eager.input_ids.tolist()
    assert ids[n - 1].item() == 103  # the pending decode token, read from last_sampled[3]
    assert fb.positions[:n].tolist() == eager.positions.tolist()
    assert fb.slot_mapping[:n].tolist() == eager.slot_mapping.tolist()
    assert fb.slot_mapping[n:].tolist() == [-1] * (16 - n)  # padding writes nothing
    assert fb.query_start_loc.tolist() == eager.query_start_loc.tolist() + [n] * (8 - m)
    assert fb.seq_lens.tolist() == eager.seq_lens.tolist() + [0] * (8 - m)
    assert li[:2].tolist() == eager.logits_indices.tolist() and li[2:].tolist() == [0] * 6
    for i in range(m):
        w = len(sched[i].request.block_ids)
        assert fb.block_tables[i, :w].tolist() == eager.block_tables[i, :w].tolist()
    # The other staging buffer, a smaller step: stale rows from the first fill must not leak in.
    hb2 = pack_host_batch(sched[1:2], bs)
    inputs.fill(hb2, 16, 8)
    fb, src, li = inputs.views(16, 8)
    assert fb.query_start_loc.tolist() == [0, 5] + [5] * 7 and fb.seq_lens.tolist() == [5] + [0] * 7
    assert (src == -1).all() and fb.slot_mapping[5:].tolist() == [-1] * 11


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_padded_forward_gives_the_eager_tokens_and_logprobs(qwen3_ckpt, async_scheduling):
    """Chunked prefills mixed with decodes (a small token budget), padded to the ladder: the same greedy
    tokens and logprobs as the eager path."""
    kw = dict(block_size=4, max_model_len=256, max_num_batched_tokens=40, async_scheduling=async_scheduling)
    prompts = [list(range(5, 5 + n)) for n in (3, 30, 11, 57, 1)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    want = LLM(str(qwen3_ckpt), **kw).generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    padded, steps = _padded_llm(qwen3_ckpt, kw)
    got = padded.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    calls = [n for n, _, _ in steps]
    assert calls and max(calls) > 1  # prefill steps went through it
    _assert_same_outputs(got, want, same_keys=True)
    bm = padded.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def _padded_llm(ckpt, kw):
    """An LLM whose prefill / mixed steps run the mixed-graph runner's padded forward (on a CPU, eagerly), and
    the list it appends (num_tokens, num_seqs, graph size) to for each such step."""
    padded = LLM(str(ckpt), **kw)
    runner = padded.engine.runner
    mg = runner.mixed_graph_runner = runner._mixed_graph_runner()
    steps = []
    run = mg.run
    mg.run = lambda hb: steps.append((hb.num_tokens, hb.num_seqs, mg.size_for(hb.num_tokens, hb.num_seqs))) or run(hb)
    return padded, steps


def _assert_same_outputs(got, want, same_keys: bool):
    """Identical greedy tokens; logprobs within 1e-4 (and, with same_keys, the same top tokens reported)."""
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for eg, ew in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            if same_keys:
                assert eg.keys() == ew.keys()
            for t in eg:
                assert abs(eg[t].logprob - ew[t].logprob) < 1e-4


def test_graph_choice_by_tokens_and_sequences():
    """A step replays the smallest ladder size that holds its tokens, with room for min(size, MAX_SEQS)
    sequences; a larger step runs eagerly."""
    from gyrfalcon.runner import mixed_graph

    r = mixed_graph.MixedGraphRunner(None, [], 8192, 384, 256, 4, torch.device("cpu"),
                                     torch.zeros(8, dtype=torch.int64))
    assert r.sizes == [16, 32, 64, 128, 256, 512]
    assert [r.seqs_for(t) for t in (16, 512)] == [16, 32] and r.inputs.T == 512 and r.inputs.B == 32
    assert r.size_for(100, 3) == 128 and r.size_for(512, 32) == 512 and r.size_for(0, 1) == 16
    assert r.size_for(10, 20) == 32  # 20 sequences: not the 16-token graph (16 rows), the 32-token one
    assert r.size_for(300, 200) is None and r.size_for(513, 1) is None
