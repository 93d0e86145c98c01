"""Speculation on hybrid (linear-attention) targets: a verify step keeps each Gated DeltaNet layer's conv window
and recurrent state after every verify token, and the runner rolls the slot back to the state after the last
accepted one (layers/gated_deltanet.py). Greedy outputs with partly rejected drafts equal the engine's without."""

from __future__ import annotations

import pytest
import torch

from checkpoints import make_qwen3_next_checkpoint
from mtp_checkpoints import make_qwen3_5_mtp_checkpoint, make_qwen3_next_mtp_checkpoint
from gyrfalcon import LLM, SamplingParams
from gyrfalcon.kernels.gated_delta import (conv_position_windows_ref, gated_delta_position_states_ref,
                                           gated_delta_prefill_ref)
from spec_testutil import OracleDrafts, record_drafts

PROMPTS = [[5, 9, 13, 2, 7, 5, 9, 13, 2], [11, 4, 4, 8, 30, 6, 1, 3, 17], [21, 3, 21, 3, 21]]
KW = dict(device="cpu", block_size=4, max_model_len=128, max_num_batched_tokens=8, enable_prefix_caching=True)


def test_position_states_equal_the_prefill_rule_over_each_prefix():
    g = torch.Generator().manual_seed(0)
    L, H, HV, dk, dv, C, K = 5, 2, 4, 8, 8, 12, 4
    q, k = torch.randn(L, H, dk, generator=g), torch.randn(L, H, dk, generator=g)
    v, a, b = torch.randn(L, HV, dv, generator=g), torch.randn(L, HV, generator=g), torch.randn(L, HV, generator=g)
    A_log, dt_bias = torch.randn(HV, generator=g) * 0.5, torch.randn(HV, generator=g)
    s0 = torch.randn(HV, dk, dv, generator=g)
    got = gated_delta_position_states_ref(q, k, v, a, b, A_log, dt_bias, s0)
    for j in range(L):
        pool = s0[None].clone()
        gated_delta_prefill_ref(q[:j + 1], k[:j + 1], v[:j + 1], a[:j + 1], b[:j + 1], A_log, dt_bias, pool,
                                torch.tensor([0]), torch.tensor([0, j + 1]), torch.tensor([True]))
        torch.testing.assert_close(got[j], pool[0], rtol=1e-4, atol=1e-4)
    x, w0 = torch.randn(L, C, generator=g), torch.randn(K - 1, C, generator=g)
    wins = conv_position_windows_ref(x, w0)
    full = torch.cat([w0, x])
    for j in range(L):
        assert torch.equal(wins[j], full[j + 1:j + K])


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = make_qwen3_next_checkpoint(tmp_path_factory.mktemp("hyb") / "t")
    return path, _greedy(LLM(str(path), **KW))


def _greedy(llm, rounds: int = 1):
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out = None
    for _ in range(rounds):
        out = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp,
                                                            use_tqdm=False)]
    return out


def _oracle(refs, k):
    return OracleDrafts(PROMPTS, refs, k, lambda d: (d + 1) % 512)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_hybrid_greedy_parity_with_rejections(hybrid, k):
    path, ref = hybrid
    llm = LLM(str(path), **KW, speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                                    "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    llm.engine.runner.proposer = _oracle(ref, k)
    assert _greedy(llm, rounds=2) == ref  # (the second round from prefix-cache hits: restored state snapshots)
    assert llm.engine.block_manager.prefix_hits > 0
    s = llm.engine.spec_stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # some drafts rejected, some kept


# ---- Qwen3-Next MTP ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def q3n_mtp(tmp_path_factory):
    path = make_qwen3_next_mtp_checkpoint(tmp_path_factory.mktemp("q3nmtp") / "t")
    return path, _greedy(LLM(str(path), **KW))


def _reference_drafts(path, tokens, k, models):
    """The k drafts after `tokens`, from scratch: the target's final-normed hidden states from transformers, and
    the MTP module around transformers' Qwen3NextDecoderLayer (the donor's layer 3 holds the checkpoint's
    mtp.layers.0 tensors), (1 + w) norms, a DynamicCache for the chained steps."""
    from safetensors import safe_open
    from transformers import DynamicCache

    hf, donor = models
    eps = hf.config.rms_norm_eps
    with safe_open(str(next(path.glob("*.safetensors"))), "pt") as sf:
        w = {n: sf.get_tensor(f"mtp.{n}.weight") for n in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden",
                                                           "norm")}
    layer, rope = donor.model.layers[3], donor.model.rotary_emb

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)

    def run(ids, hidden, pos, cache):
        e = hf.model.embed_tokens(ids)
        x = torch.nn.functional.linear(torch.cat([rms(e, w["pre_fc_norm_embedding"]),
                                                  rms(hidden, w["pre_fc_norm_hidden"])], -1), w["fc"])[None]
        y = layer(x, position_embeddings=rope(x, pos[None]), attention_mask=None, position_ids=pos[None],
                  past_key_values=cache)
        y = rms((y[0] if isinstance(y, tuple) else y)[0], w["norm"])
        return y, int(hf.lm_head(y)[-1].argmax())

    with torch.no_grad():
        L = len(tokens)
        h = hf.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
        cache = DynamicCache(config=donor.config)
        y, d = run(torch.tensor(tokens[1:]), h, torch.arange(L - 1), cache)
        out = [d]
        for j in range(1, k):
            y, d = run(torch.tensor([out[-1]]), y[-1:], torch.tensor([L - 2 + j]), cache)
            out.append(d)
    return out


def test_qwen3_next_mtp_drafts_match_a_transformers_reference(q3n_mtp):
    from transformers import AutoModelForCausalLM

    path, ref = q3n_mtp
    k = 2
    llm = LLM(str(path), **KW, speculative_config={"method": "mtp", "num_speculative_tokens": k})
    seen = record_drafts(llm)
    assert _greedy(llm, rounds=2) == ref
    assert llm.engine.block_manager.prefix_hits > 0
    assert len(seen) >= 2 * len(PROMPTS) * 4
    models = tuple(AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
                   for d in (path, path.parent / (path.name + "-mtp-donor")))
    for tokens, drafts in {tuple(t): d for t, d in seen}.items():
        assert drafts == _reference_drafts(path, list(tokens), k, models), tokens


@pytest.mark.parametrize("k", [1, 3])
def test_qwen3_next_greedy_parity_with_mtp(q3n_mtp, k):
    path, ref = q3n_mtp
    llm = LLM(str(path), **KW, speculative_config={"method": "mtp", "num_speculative_tokens": k})
    assert _greedy(llm, rounds=2) == ref
    assert llm.engine.spec_stats.num_drafts > 0


def test_qwen3_5_mtp_loads_packed_experts_and_keeps_greedy_outputs(tmp_path):
    """Qwen3.5's release layout (mtp_num_hidden_layers in text_config, the MTP layer's experts packed)."""
    path = make_qwen3_5_mtp_checkpoint(tmp_path / "t")
    ref = _greedy(LLM(str(path), **KW))
    llm = LLM(str(path), **KW, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert len(llm.engine.runner.proposer.layers) == 1
    assert _greedy(llm) == ref
    assert llm.engine.spec_stats.num_drafts > 0


def test_qwen3_next_mtp_under_preemption(q3n_mtp):
    """A cache far too small for the batch: requests are preempted mid-speculation (their state slot and MTP K/V
    recomputed from the prompt) and still finish with the tokens of the run without drafts; async scheduling."""
    path, ref = q3n_mtp
    longest = max(len(p) for p in PROMPTS) + 16
    llm = LLM(str(path), device="cpu", block_size=4, num_gpu_blocks_override=-(-longest // 4) + 2,
              max_model_len=longest + 4, enable_prefix_caching=True, max_num_batched_tokens=8,
              async_scheduling=True, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert _greedy(llm) == ref
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert llm.engine.spec_stats.num_drafts > 0
