"""The CUDA-graph code paths that run without a GPU: the size ladder, padding, and the static
decode inputs, which must describe the same step as the eager ForwardBatch."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon import envs
from gyrfalcon.engine.request import Request
from checkpoints import step_row
from gyrfalcon.runner.cuda_graph import DecodeInputs, capture_sizes, padded_size
from gyrfalcon.runner.forward_batch import build_forward_batch
from gyrfalcon.sampling_params import SamplingParams


def test_capture_sizes_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(256)[-1] == 256 and capture_sizes(256)[:5] == [1, 2, 4, 8, 16]
    # Past 256 the ladder steps by 16, and it stops at 512: larger decode batches run eagerly.
    assert capture_sizes(300)[-3:] == [272, 288, 304]
    assert capture_sizes(1024)[-1] == 512 and len(capture_sizes(1024)) == 3 + 32 + 16


@pytest.mark.parametrize("n,want", [(1, 1), (3, 4), (5, 8), (9, 16), (17, 24), (24, 24)])
def test_padded_size(n, want):
    assert padded_size(capture_sizes(24), n) == want


def test_padded_size_overflow():
    with pytest.raises(ValueError, match="exceeds"):
        padded_size([1, 2, 4], 5)


def _decode_reqs(block_size):
    reqs = []
    for i, (n_prompt, n_out) in enumerate([(5, 3), (17, 1), (2, 9)]):
        r = Request(str(i), list(range(10 + i, 10 + i + n_prompt)), SamplingParams(max_tokens=50))
        r.output_token_ids = [100 + i * 10 + j for j in range(n_out)]
        r.num_computed_tokens = r.num_tokens - 1
        nb = -(-r.num_tokens // block_size)
        r.block_ids = [7 * i + j + 1 for j in range(nb)]
        reqs.append(step_row(r, 1, True, r.num_computed_tokens))
    return reqs


def test_decode_inputs_match_eager_forward_batch():
    bs = 4
    sched = _decode_reqs(bs)
    eager = build_forward_batch(sched, bs, torch.device("cpu"))
    inputs = DecodeInputs(max_batch=8, max_blocks_per_seq=6, device=torch.device("cpu"))
    n = inputs.fill(sched, 4, bs)
    fb = inputs.views(4)
    assert n == 3 and eager.is_decode and fb.is_decode
    assert fb.input_ids[:n].tolist() == eager.input_ids.tolist()
    assert fb.positions[:n].tolist() == eager.positions.tolist()
    assert fb.slot_mapping[:n].tolist() == eager.slot_mapping.tolist()
    assert fb.seq_lens[:n].tolist() == eager.seq_lens.tolist()
    assert fb.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    for i in range(n):
        w = len(sched[i].request.block_ids)
        assert fb.block_tables[i, :w].tolist() == eager.block_tables[i, :w].tolist()
    # The padding row does nothing: no KV write, no context.
    assert fb.slot_mapping[3].item() == -1 and fb.seq_lens[3].item() == 0


def test_row_major_block_table():
    """The table is row-major, [b, W] with strides (W, 1), its b rows sent whole."""
    sched = _decode_reqs(4)
    inputs = DecodeInputs(max_batch=8, max_blocks_per_seq=6, device=torch.device("cpu"))
    inputs.raw.view(torch.int32).fill_(-7)
    inputs.fill(sched, 4, 4)
    fb = inputs.views(4)
    assert fb.block_tables.stride() == (6, 1)
    for i, sr in enumerate(sched):
        assert fb.block_tables[i, :len(sr.request.block_ids)].tolist() == sr.request.block_ids
    assert not (inputs.i32[2 * 8 + 1:2 * 8 + 1 + 4 * 6] == -7).any()  # all b rows, full width


def test_decode_inputs_reuse_clears_old_rows():
    bs = 4
    inputs = DecodeInputs(max_batch=8, max_blocks_per_seq=6, device=torch.device("cpu"))
    inputs.fill(_decode_reqs(bs), 4, bs)
    inputs.fill(_decode_reqs(bs)[:1], 2, bs)
    fb = inputs.views(2)
    assert fb.seq_lens.tolist()[1] == 0 and fb.slot_mapping.tolist()[1] == -1


@pytest.mark.parametrize("impl", ["triton", "ref"])
def test_fresh_decode_inputs_never_read_last_sampled(impl):
    """Before any fill (what the captures' warm-up steps see) no row is pending: the embedding reads input_ids, not
    last_sampled, which may hold garbage before the first step (an out-of-range token id would be an illegal
    memory access on the GPU)."""
    from gyrfalcon.kernels.embedding import embedding_with_pending_ref, embedding_with_pending_triton

    embed = embedding_with_pending_triton if impl == "triton" else embedding_with_pending_ref
    inputs = DecodeInputs(max_batch=8, max_blocks_per_seq=6, device=torch.device("cpu"))
    assert inputs.src(8).tolist() == [-1] * 8
    weight = torch.randn(50, 4)
    last_sampled = torch.full((8,), 10**9, dtype=torch.int64)  # garbage: far past the vocabulary
    fb = inputs.views(4)
    got = embed(weight, fb.input_ids, inputs.src(4), last_sampled)
    torch.testing.assert_close(got, weight[torch.zeros(4, dtype=torch.long)])
    # set_context keeps it so; a fill marks only the rows it is told about
    inputs.set_context(2, 40, 16)
    assert inputs.src(8).tolist() == [-1] * 8


def test_decode_inputs_mark_tokens_still_on_the_device():
    """A request whose last token is in flight (scheduled ahead) points at its row in the previous
    step's samples; the graph reads the token from there."""
    bs = 4
    sched = _decode_reqs(bs)
    r = sched[1].request
    r.num_computed_tokens = r.num_tokens  # the token at this position has not reached the host
    sched[1] = step_row(r, 1, True, r.num_computed_tokens)
    r.block_ids = r.block_ids + [99]
    inputs = DecodeInputs(max_batch=8, max_blocks_per_seq=8, device=torch.device("cpu"))
    inputs.fill(sched, 4, bs, last_rows={"1": 5})
    src = inputs.src(4).tolist()
    assert src == [-1, 5, -1, -1]
    fb = inputs.views(4)
    assert fb.positions[1].item() == r.num_tokens and fb.seq_lens[1].item() == r.num_tokens + 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fold", ["0", "1"], ids=["norms", "folded-norms"])
def test_padded_decode_step_gives_the_eager_tokens(qwen3_ckpt, async_scheduling, fold, monkeypatch):
    """The decode-graph step (static inputs padded to the ladder, tokens still in flight gathered from
    last_sampled inside the step), run eagerly on a CPU:
    the same tokens and logprobs as the eager path, greedy and seeded sampling alike; also with the norms
    folded (GYRFALCON_FOLD_NORMS=1: the padding rows' residual stream is added into in place too)."""
    from gyrfalcon import LLM

    monkeypatch.setenv("GYRFALCON_FOLD_NORMS", fold)
    from gyrfalcon.runner.cuda_graph import CudaGraphRunner

    kw = dict(block_size=4, max_model_len=128, max_num_batched_tokens=32, async_scheduling=async_scheduling,
              max_num_seqs=5)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 9)]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)]
    want = LLM(str(qwen3_ckpt), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(qwen3_ckpt), **kw)
    r = llm.engine.runner
    r.graph_runner = CudaGraphRunner(r.model, r.kv_caches, 5, 128, r.block_size, r.device, r.last_sampled)
    calls = []
    run = r.graph_runner.run
    r.graph_runner.run = lambda reqs, rows=None: calls.append(len(reqs)) or run(reqs, rows)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert calls and 3 in calls  # decode steps of the whole batch went through it (padded to 4)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        if w.outputs[0].logprobs is not None:
            for eg, ew in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert eg.keys() == ew.keys()
                assert all(abs(eg[t].logprob - ew[t].logprob) < 1e-4 for t in eg)


class _FakeGraph:
    def __init__(self, name):
        self.name = name

    def pool(self):
        return None


@pytest.mark.parametrize("mode,ms,want", [("auto", (4.3, 3.9), "off"), ("auto", (0.73, 0.80), "pdl"),
                                          ("1", (4.3, 3.9), "pdl"), ("serial", (4.3, 3.9), "pdl")])
def test_batch1_graph_keeps_the_faster_of_pdl_and_not(monkeypatch, mode, ms, want):
    """With GYRFALCON_PDL unset the batch-1 graph is captured with and without PDL and the faster replay
    is kept; other sizes are captured once; GYRFALCON_PDL=1 / serial keep the PDL capture untimed."""
    import gyrfalcon.runner.cuda_graph as cg
    from gyrfalcon.kernels import common as _common

    monkeypatch.setenv("GYRFALCON_PDL", mode)
    envs.refresh()
    captured = []

    def fake_capture(fb, step, kv_caches, pool):
        name = f"{fb}-{'off' if _common._PDL_OFF[0] else 'pdl'}"
        captured.append(name)
        return _FakeGraph(name), name

    monkeypatch.setattr(cg, "_capture", fake_capture)
    monkeypatch.setattr(cg, "precompile", lambda steps: None)  # the fake steps have no kernels to precompile
    monkeypatch.setattr(cg, "pdl_possible", lambda t: True)
    timed = []
    monkeypatch.setattr(cg, "time_replays", lambda graphs: timed.append([g.name for g in graphs]) or list(ms))
    monkeypatch.setattr(cg.torch.cuda, "synchronize", lambda: None)

    class FB:
        def __init__(self, b):
            self.b, self.input_ids = b, torch.zeros(b)

        def __str__(self):
            return f"b{self.b}"

    graphs, outputs, _ = cg.capture_ladder([1, 2, 4], None, lambda b: (FB(b), None))
    assert outputs[2] == "b2-pdl" and outputs[4] == "b4-pdl"
    assert outputs[1] == f"b1-{want}" and graphs[1].name == outputs[1]
    if mode == "auto":
        assert timed == [["b1-pdl", "b1-off"]]
    else:
        assert timed == [] and "b1-off" not in captured


def test_set_context_points_rows_at_one_token_and_restores():
    """The timing helper behind the startup PDL choice and bench latency's replay by context."""
    inputs = DecodeInputs(max_batch=4, max_blocks_per_seq=8, device=torch.device("cpu"))
    assert inputs.set_context(2, 37, 16)  # 3 blocks per row
    fb = inputs.views(2)
    assert fb.seq_lens.tolist() == [37, 37] and fb.positions.tolist() == [36, 36]
    assert fb.block_tables[:, :3].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert fb.slot_mapping.tolist() == [2 * 16 + 4, 5 * 16 + 4]  # token 36: block 2, offset 4
    assert inputs.src(2).tolist() == [-1, -1] and fb.input_ids.tolist() == [0, 0]
    assert not inputs.set_context(2, 8 * 16 + 1, 16)  # wider than the block table: untouched
    assert fb.seq_lens.tolist() == [37, 37]
    assert inputs.set_context(2, 0, 16)
    assert fb.seq_lens.tolist() == [0, 0] and fb.slot_mapping.tolist() == [-1, -1]


def test_short_graph_ladder_and_choice(monkeypatch):
    """The sizes up to ONE_SPLIT_MAX_BATCH get a one-split ladder; a batch replays it when every context
    (start + 1) fits ONE_SPLIT_CONTEXT (128) tokens; none when max_model_len is not longer than that."""
    from types import SimpleNamespace

    import gyrfalcon.layers.attention.triton as tb
    from gyrfalcon.runner.cuda_graph import CudaGraphRunner

    def runner(max_num_seqs=64, max_model_len=1024):
        kv = [(torch.empty(2, 16, 1, 32, dtype=torch.float32),) * 2]  # no wide-tile sizes on a 4-byte cache
        return CudaGraphRunner(None, kv, max_num_seqs, max_model_len, 16, torch.device("cpu"), None)

    r = runner()
    assert tb.ONE_SPLIT_CONTEXT == 128 and tb.ONE_SPLIT_MAX_BATCH == 4
    assert r.short_sizes == [1, 2, 4] and set(r.short_limits.values()) == {128}
    assert runner(max_model_len=128).short_sizes == []
    reqs = lambda *starts: [SimpleNamespace(start=s) for s in starts]  # noqa: E731
    assert r.uses_short_graph(reqs(0, 127), 2)  # contexts 1 and 128
    assert not r.uses_short_graph(reqs(0, 128), 2)  # context 129
    assert not r.uses_short_graph(reqs(*range(8)), 8)  # no one-split graph of 8
    monkeypatch.setattr(tb, "ONE_SPLIT_CONTEXT", 256)  # the limit follows the backend's policy
    r = runner()
    assert r.uses_short_graph(reqs(0, 255), 2) and not r.uses_short_graph(reqs(0, 256), 2)
    fb = r.views(2, short=True)
    assert fb.decode_num_splits == 1 and r.views(2).decode_num_splits is None
    assert fb.block_tables.shape == r.views(2).block_tables.shape  # the full table: any context is correct


def test_wide_tile_one_split_graphs():
    """Sizes whose one-split decode attention takes the wide tile (wide_tile_context: 33-128
    (sequence, kv head) programs on a 2-byte cache) get a one-split graph for contexts of up to one 256-key tile,
    beside the small sizes' 128-token ones; not on an fp32 cache, or when max_model_len is not longer than the
    tile."""
    from types import SimpleNamespace

    from gyrfalcon.runner.cuda_graph import CudaGraphRunner

    def runner(n_kv=8, dtype=torch.bfloat16, max_model_len=1024):
        kv = [(torch.empty(2, 16, n_kv, 32, dtype=dtype),) * 2]
        return CudaGraphRunner(None, kv, 64, max_model_len, 16, torch.device("cpu"), None)

    r = runner()
    assert r.short_limits == {1: 128, 2: 128, 4: 128, 8: 256, 16: 256} and r.short_sizes == [1, 2, 4, 8, 16]
    reqs = lambda *starts: [SimpleNamespace(start=s) for s in starts]  # noqa: E731
    assert r.uses_short_graph(reqs(*range(15), 255), 16)  # contexts up to 256
    assert not r.uses_short_graph(reqs(*range(15), 256), 16)  # one of 257
    assert not r.uses_short_graph(reqs(*range(24)), 24)
    assert r.views(16, short=True).decode_num_splits == 1
    assert runner(n_kv=4).short_limits == {1: 128, 2: 128, 4: 128, 16: 256, 24: 256, 32: 256}
    assert runner(dtype=torch.float32).short_sizes == [1, 2, 4]
    assert runner(max_model_len=256).short_sizes == [1, 2, 4]


def _eager_and_graph_runner_tokens(ckpt, kw, prompts, params, probe):
    """(eager outputs, outputs through a CudaGraphRunner stepping eagerly on the CPU, and probe(fb) of every
    ForwardBatch the runner stepped)."""
    from gyrfalcon import LLM
    from gyrfalcon.runner.cuda_graph import CudaGraphRunner

    want = LLM(str(ckpt), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(ckpt), **kw)
    r = llm.engine.runner
    r.graph_runner = CudaGraphRunner(r.model, r.kv_caches, kw["max_num_seqs"], kw["max_model_len"], r.block_size,
                                     r.device, r.last_sampled)
    seen = []
    forward = r.graph_runner._forward
    r.graph_runner._forward = lambda fb, src: seen.append(probe(fb)) or forward(fb, src)
    return want, llm.generate(prompts, params, use_tqdm=False), seen


def test_short_graph_step_gives_the_eager_tokens(qwen3_ckpt, monkeypatch):
    """The one-split decode step (run eagerly on a CPU, padded like the graph) for batches whose contexts
    fit ONE_SPLIT_CONTEXT (here lowered to 22 tokens), the main one past it: the eager path's tokens either
    way."""
    import gyrfalcon.layers.attention.triton as tb

    monkeypatch.setattr(tb, "ONE_SPLIT_CONTEXT", 22)
    kw = dict(block_size=4, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=5)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 9)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want, got, splits = _eager_and_graph_runner_tokens(  # contexts reach 17 + 10 tokens
        qwen3_ckpt, kw, prompts, params, lambda fb: fb.decode_num_splits)
    assert 1 in splits and None in splits  # both ladders served steps
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids


def test_second_ladder_follows_the_batch1_pdl_choice(monkeypatch):
    """capture_ladder(batch1_pdl=False / True) captures batch 1 that way once, untimed, in the given pool."""
    import gyrfalcon.runner.cuda_graph as cg
    from gyrfalcon.kernels import common as _common

    monkeypatch.setenv("GYRFALCON_PDL", "auto")
    envs.refresh()
    pools = []

    def fake_capture(fb, step, kv_caches, pool):
        pools.append(pool)
        name = f"b{fb}-{'off' if _common._PDL_OFF[0] else 'pdl'}"
        return _FakeGraph(name), name

    monkeypatch.setattr(cg, "_capture", fake_capture)
    monkeypatch.setattr(cg, "precompile", lambda steps: None)  # the fake steps have no kernels to precompile
    monkeypatch.setattr(cg, "pdl_possible", lambda t: True)
    monkeypatch.setattr(cg, "time_replays", lambda graphs: pytest.fail("timed a second ladder"))
    monkeypatch.setattr(cg.torch.cuda, "synchronize", lambda: None)
    FB = type("FB", (), {"input_ids": torch.zeros(1), "__init__": lambda self, b: setattr(self, "b", b),
                         "__str__": lambda self: str(self.b)})
    for choice, want in ((False, "b1-off"), (True, "b1-pdl")):
        pools.clear()
        _, outputs, _ = cg.capture_ladder([1, 2], None, lambda b: (FB(b), None), pool="main-pool",
                                          batch1_pdl=choice)
        assert outputs == {2: "b2-pdl", 1: want} and pools[0] == "main-pool"


def test_steps_take_logits_in_the_weights_dtype(qwen3_ckpt):
    """The LM head gives bf16 logits for every step (a greedy argmax or a bare Gumbel draw reads them as
    they are; the Sampler converts where it rewrites, filters or reports)."""
    from gyrfalcon import LLM

    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    cases = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=1, max_tokens=3, ignore_eos=True),
             SamplingParams(temperature=0.8, top_p=0.9, seed=2, max_tokens=3, ignore_eos=True),
             SamplingParams(temperature=0, logprobs=2, max_tokens=3, ignore_eos=True)]
    llm = LLM(str(qwen3_ckpt), dtype="bfloat16", max_model_len=64, max_num_seqs=2)
    model = llm.engine.runner.model
    seen = []
    compute = model.compute_logits

    def spy(hidden, *args, **kwargs):
        out = compute(hidden, *args, **kwargs)
        seen.append(out.dtype)
        return out
    model.compute_logits = spy
    outs = [llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0] for sp in cases]
    assert seen and set(seen) == {torch.bfloat16}
    assert all(len(o.token_ids) == 3 for o in outs)


def test_lm_head_bf16_logits_give_the_fp32_argmax():
    """The property the greedy shortcut rests on: argmax of bf16 logits == argmax of their fp32 copy, ties
    (first index) included."""
    from gyrfalcon.layers.embedding import LMHead

    g = torch.Generator().manual_seed(0)
    head = LMHead(300, 32)
    head.weight.data = torch.randn(300, 32, generator=g).to(torch.bfloat16)
    head.weight.data[7] = head.weight.data[200]  # a tie in every row: the first index must win
    hidden = torch.randn(9, 32, generator=g).to(torch.bfloat16)
    low, full = head(hidden, fp32=False), head(hidden)
    assert low.dtype == torch.bfloat16 and full.dtype == torch.float32
    assert torch.equal(low.argmax(-1), full.argmax(-1))
    assert torch.equal(low.float(), full)


def test_cpu_inputs_fill_without_streams():
    """CPU inputs (no pinned staging, no side stream for the copy) fill as on a GPU, and replayed() is a no-op
    there."""
    sched = _decode_reqs(4)
    inputs = DecodeInputs(max_batch=8, max_blocks_per_seq=6, device=torch.device("cpu"))
    assert inputs._copy_stream is None
    assert inputs.fill(sched, 4, 4) == 3
    inputs.replayed()
    eager = build_forward_batch(sched, 4, torch.device("cpu"))
    assert inputs.views(4).positions[:3].tolist() == eager.positions.tolist()
