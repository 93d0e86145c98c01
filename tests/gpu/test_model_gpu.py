"""gyrfalcon vs transformers on the GPU, bf16, checkpoints of real width with a few layers:
prefill logits close; greedy tokens identical for 32 steps in fp32 and argmax-consistent in bf16,
CUDA graphs on and off."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from transformers import AutoModelForCausalLM  # noqa: E402

from gyrfalcon import LLM, SamplingParams, envs  # noqa: E402
from gyrfalcon.bench.common import random_prompts  # noqa: E402
from gyrfalcon.bench.make_checkpoint import make_checkpoint  # noqa: E402
from gyrfalcon.engine.request import Request  # noqa: E402
from checkpoints import step_row  # noqa: E402
from gyrfalcon.forward_context import forward_context  # noqa: E402
from gyrfalcon.layers.attention import triton as attention_triton  # noqa: E402
from gyrfalcon.runner.forward_batch import build_forward_batch  # noqa: E402

STEPS = 32
# A fixed KV cache (4 prompts of <= 132 tokens need ~40 blocks): the tests do not depend on how much of
# the card an earlier test's engine or reference model still holds; memory planning is exercised by the
# benchmarks (scripts/gpu/).
BLOCKS = dict(num_gpu_blocks_override=256)


@pytest.fixture(scope="module", params=[("llama-3.1-8b", 2), ("qwen3-0.6b", 4)], ids=lambda p: p[0])
def ckpt(request, tmp_path_factory):
    preset, layers = request.param
    path = make_checkpoint(preset, tmp_path_factory.mktemp(preset), num_layers=layers, lm_head_std=0.1,
                           tokenizer_vocab=1024)
    prompts = random_prompts(4, 100, 100000, 0)
    prompts[1] = prompts[1][:37]
    prompts[2] = prompts[2][:5]
    refs = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).cuda().eval()
        rows = []
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(ids, max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0)
            with torch.no_grad():
                logits = hf(ids).logits[0].float()
            rows.append((p, out[0, len(p):].tolist(), logits))
        refs[dtype] = rows
        del hf
        torch.cuda.empty_cache()
    return path, refs


class _OracleProposer:
    """Drafts the reference continuation (right drafts, then one wrong one every third step): verify steps of
    1 + k tokens, accepted and rejected."""

    def __init__(self, conts, k):
        self.conts, self.k, self.calls = conts, k, 0

    def propose(self, rows, sampled):
        self.calls += 1
        out = []
        for r in rows:
            cont = self.conts[tuple(r.request.prompt_token_ids)]
            n = r.request.num_output_tokens
            d = list(cont[n:n + self.k])
            if self.calls % 3 == 0 and d:
                d[-1] = (d[-1] + 1) % 1024
            out.append(d)
        return out


@pytest.mark.parametrize("mode", ["graphs", "eager", "pdl", "unfused", "short-graph", "wide-rows", "verify-graphs"])
def test_greedy_tokens_match_transformers_fp32(ckpt, mode, monkeypatch):
    """In fp32 both implementations agree to ~1e-6, so greedy paths must be identical; in bf16 two
    implementations round differently and random-weight logits have near-ties that flip.
    graphs: decode steps and prefills replayed as CUDA graphs (every mode but eager and unfused);
    pdl: one request at a time, the batch-1 graphs' kernels launched with programmatic dependent launch
    (GYRFALCON_PDL=1); unfused: GYRFALCON_DISABLE_FUSION=1 (separate norm, RoPE and K/V store launches, no folded
    norms), eagerly; short-graph: decode steps replay the one-split graphs at every context (ONE_SPLIT_CONTEXT
    patched to 512; by default up to 128 tokens); wide-rows: prefill chunks of <= 64 tokens
    (max_num_batched_tokens=64), which run Llama-3.1-8B's down_proj of 17-64 rows on the GEMV kernel;
    verify-graphs: a proposer drafts 2 tokens a step (the reference continuation, sometimes wrong), and the verify
    steps of 3 tokens per sequence replay their own graphs."""
    path, refs = ckpt
    enforce_eager = mode in ("eager", "unfused")
    one_at_a_time = mode == "pdl"
    monkeypatch.setenv("GYRFALCON_PDL", "1" if one_at_a_time else "0")
    if mode == "unfused":
        monkeypatch.setenv("GYRFALCON_DISABLE_FUSION", "1")
    if mode == "short-graph":
        monkeypatch.setattr(attention_triton, "ONE_SPLIT_CONTEXT", 512)
    envs.refresh()
    chunk = dict(max_num_batched_tokens=64) if mode == "wide-rows" else {}
    llm = LLM(str(path), dtype="float32", max_model_len=1024, enforce_eager=enforce_eager,
              max_num_seqs=8, **BLOCKS, **chunk)
    runner = llm.engine.runner
    assert (runner.graph_runner is None) == enforce_eager
    assert (runner.mixed_graph_runner is None) == enforce_eager
    if mode == "short-graph":
        assert runner.graph_runner.short_graphs
    layer0 = runner.model.model.layers[0]
    llama = layer0.self_attn.qkv_proj.weight.shape == (6144, 4096)
    if mode != "unfused":
        assert layer0.mlp.gate_up_proj.small_m_rows == 1
        assert layer0.self_attn.qkv_proj.small_m_rows == (16 if llama else 1)
        assert layer0.mlp.down_proj.small_m_rows == (64 if llama else 16)
        assert layer0.self_attn.o_proj.small_m_rows == 16
    assert runner._d2h_stream is not None
    if not enforce_eager:
        assert runner.graph_runner.inputs._copy_stream is not None
    sp = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    rows = refs[torch.float32]
    seen_q = []
    if mode == "verify-graphs":
        from gyrfalcon.runner.cuda_graph import CudaGraphRunner
        gr = CudaGraphRunner(runner.model, runner.kv_caches, 8, 1024, runner.block_size, runner.device,
                             runner.last_sampled, query_lens=(1, 3))
        gr.capture()
        runner.graph_runner = gr
        q_of = gr.query_len_of
        gr.query_len_of = lambda reqs: seen_q.append(q_of(reqs)) or seen_q[-1]
        runner.proposer = _OracleProposer({tuple(r[0]): r[1] for r in rows}, 2)
    if one_at_a_time:  # batch-1 decode paths: one request at a time
        outs = [llm.generate([{"prompt_token_ids": r[0]}], sp, use_tqdm=False)[0] for r in rows]
    else:
        outs = llm.generate([{"prompt_token_ids": r[0]} for r in rows], sp, use_tqdm=False)
    for out, (_, ref_tokens, _) in zip(outs, rows):
        assert out.outputs[0].token_ids == ref_tokens
    if mode == "verify-graphs":
        assert seen_q.count(3) >= 3, seen_q  # verify steps replayed the (b * 3, 3) graphs
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("mode", ["graphs", "eager", "wide-tile"])
def test_bf16_greedy_follows_transformers_argmax(ckpt, mode, monkeypatch):
    """bf16: each token gyrfalcon picks (graphs or eager) is transformers' argmax on gyrfalcon's own
    sequence, up to bf16 rounding; a decode bug (wrong KV, position, block) breaks this at once. wide-tile: the
    prompts twice over, a batch of 8 (64 programs at 8 kv heads) whose contexts of <= 132 tokens replay the
    one-split graph of the one-stage 256-key tile (kernels/decode_attention wide_tile_context).
    Rounding: the two implementations' bf16 logits differ by up to ~3% of the largest logit (the same
    bound test_prefill_logits_close holds them to), so a chosen token may trail transformers' argmax by
    that much at a near-tie, but rarely: most steps must pick transformers' argmax exactly."""
    path, refs = ckpt
    llm = LLM(str(path), max_model_len=1024, enforce_eager=mode == "eager", max_num_seqs=8, **BLOCKS)
    rows = refs[torch.bfloat16]
    sp = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    if mode == "wide-tile":
        rows = rows * 2
        gr = llm.engine.runner.graph_runner
        assert gr.short_limits[8] == 256 and 8 in gr.short_graphs
        choices, uses_short = [], gr.uses_short_graph
        gr.uses_short_graph = lambda reqs, b: choices.append((b, uses_short(reqs, b))) or choices[-1][1]
    outs = llm.generate([{"prompt_token_ids": r[0]} for r in rows], sp, use_tqdm=False)
    if mode == "wide-tile":
        assert choices.count((8, True)) >= STEPS // 2, choices  # the decode steps replayed the one-split graph
    del llm
    torch.cuda.empty_cache()
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    exact = steps = ties = 0
    for out, (prompt, ref_tokens, _) in zip(outs, rows):
        got = out.outputs[0].token_ids
        exact += got == ref_tokens
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + got], device="cuda")).logits[0, len(prompt) - 1:-1].float()
        chosen = logits.gather(1, torch.tensor(got, device="cuda").unsqueeze(1)).squeeze(1)
        shortfall = logits.max(dim=1).values - chosen
        scale = logits.abs().max().item()
        assert shortfall.max().item() <= 0.03 * scale, (shortfall.tolist(), scale)
        steps += len(got)
        ties += int((shortfall > 0).sum())
    assert ties <= 0.1 * steps, f"{ties} of {steps} steps did not pick transformers' argmax"
    # Whole 32-token paths equal to transformers' are not required in bf16: after one near-tie flips, the
    # two sequences differ (token-for-token identity is the fp32 test's job).
    print(f"bf16: {exact} of {len(rows)} greedy paths identical to transformers'; {ties} of {steps} steps "
          "picked a near-tie")


def test_pdl_bf16_tokens_identical(ckpt, monkeypatch):
    """Programmatic dependent launch changes when kernels start, never what they compute: bf16 greedy
    tokens with it on and with the same kernels launched one after another (GYRFALCON_PDL=serial),
    in batch-1 decode graphs where it is used, must be identical. A kernel that read its predecessor's
    output before gdc_wait would show up here as a different path."""
    path, refs = ckpt
    rows = refs[torch.bfloat16]
    sp = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    got = {}
    for pdl in ("serial", "1"):
        monkeypatch.setenv("GYRFALCON_PDL", pdl)
        envs.refresh()
        llm = LLM(str(path), max_model_len=1024, max_num_seqs=8, **BLOCKS)
        got[pdl] = [llm.generate([{"prompt_token_ids": r[0]}], sp, use_tqdm=False)[0].outputs[0].token_ids
                    for r in rows]
        del llm
        torch.cuda.empty_cache()
    assert got["serial"] == got["1"]


def test_prefill_logits_close(ckpt):
    path, refs = ckpt
    refs = refs[torch.bfloat16]
    llm = LLM(str(path), max_model_len=1024, enforce_eager=True, max_num_seqs=8, **BLOCKS)
    runner, bm = llm.engine.runner, llm.engine.block_manager
    reqs = [Request(str(i), r[0], SamplingParams(max_tokens=1)) for i, r in enumerate(refs)]
    for r in reqs:
        assert bm.allocate_slots(r, r.num_tokens)
    sched = [step_row(r, r.num_tokens, True, 0) for r in reqs]
    fb = build_forward_batch(sched, runner.block_size, runner.device)
    with torch.inference_mode(), forward_context(fb, runner.kv_caches):
        logits = runner.model.compute_logits(runner.model(fb.input_ids, fb.positions))
    qsl = fb.query_start_loc.tolist()
    for i, (_, _, ref) in enumerate(refs):
        got = logits[qsl[i]:qsl[i + 1]]
        err = (got - ref).abs()
        scale = ref.abs().max().item()
        # bf16 keeps ~3 significant digits; two implementations round differently.
        assert err.max().item() < 0.03 * scale and err.mean().item() < 0.005 * scale, \
            (err.max().item(), err.mean().item(), scale)


def test_prompt_logprobs_and_logit_bias_fp32(ckpt):
    """prompt_logprobs against transformers' prompt logits (fp32), and logit_bias forcing a token, on the
    GPU paths (prompt-scoring steps run eagerly; the forced decode runs in the graphs)."""
    path, refs = ckpt
    rows = refs[torch.float32]
    llm = LLM(str(path), dtype="float32", max_model_len=1024, max_num_seqs=8, **BLOCKS)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": r[0]} for r in rows], sp, use_tqdm=False)
    for out, (prompt, _, logits) in zip(outs, rows):
        lsm = logits.log_softmax(-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for j in range(1, len(prompt)):
            assert abs(out.prompt_logprobs[j][prompt[j]].logprob - lsm[j - 1, prompt[j]].item()) < 1e-3
    forced = rows[0][1][0] + 1
    out = llm.generate([{"prompt_token_ids": rows[0][0]}],
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={forced: 100}),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [forced] * 6
