"""MTP speculation (spec_decode/mtp.py) on DeepSeek-V3 / V3.2 tiny checkpoints whose MTP layer is written in the
released layout (mtp_checkpoints.py): the drafts equal a transformers-built reference of the MTP module at every
step, and greedy outputs with MTP drafts equal the same engine's without (tests/models holds those against
transformers)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from checkpoints import make_deepseek_checkpoint
from mtp_checkpoints import make_deepseek_mtp_checkpoint
from gyrfalcon import LLM, SamplingParams
from spec_testutil import record_drafts

PROMPTS = [[5, 9, 13, 2, 7, 5, 9, 13, 2], [11, 4, 4, 8, 30, 6, 1, 3, 17], [21, 3, 21, 3, 21]]
KW = dict(device="cpu", block_size=4, max_model_len=128, max_num_batched_tokens=8, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def ds_mtp(tmp_path_factory):
    return make_deepseek_mtp_checkpoint(tmp_path_factory.mktemp("dsmtp") / "t")


@pytest.fixture(scope="module")
def ds_ref(ds_mtp):
    return _greedy(LLM(str(ds_mtp), **KW))


def _greedy(llm, rounds: int = 1):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = None
    for _ in range(rounds):  # a later round starts from prefix-cache hits (the MTP layer's K/V comes along)
        out = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp,
                                                            use_tqdm=False)]
    return out


def _spec(k):
    return {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}}


@functools.lru_cache(maxsize=1)
def _hf_models(path: str):
    """transformers' target, and the (N + 1)-layer donor whose layer N the MTP checkpoint copied."""
    from transformers import AutoModelForCausalLM

    p = Path(path)
    return tuple(AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
                 for d in (p, p.parent / (p.name + "-mtp-donor")))


def _reference_drafts(path, tokens, k):
    """The k drafts after `tokens` (prompt + outputs so far), from scratch: the target's final-normed hidden states
    from transformers, and the MTP module as DeepSeek defines it around transformers' DeepseekV3DecoderLayer (the
    donor model's layer N holds the checkpoint's MTP-layer tensors), a DynamicCache for the chained steps."""
    from safetensors import safe_open
    from transformers import DynamicCache

    hf, donor = _hf_models(str(path))
    N, eps = hf.config.num_hidden_layers, hf.config.rms_norm_eps
    with safe_open(str(next(path.glob("*.safetensors"))), "pt") as sf:
        w = {n: sf.get_tensor(f"model.layers.{N}.{n}") for n in
             ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight")}
    layer, rope = donor.model.layers[N], donor.model.rotary_emb

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def run(ids, hidden, pos, cache):
        e = hf.model.embed_tokens(ids)
        e = torch.where((pos == 0)[:, None], torch.zeros_like(e), e)
        x = torch.nn.functional.linear(torch.cat([rms(e, w["enorm.weight"]), rms(hidden, w["hnorm.weight"])], -1),
                                       w["eh_proj.weight"])[None]
        y = layer(x, attention_mask=None, position_ids=pos[None], past_key_values=cache,
                  position_embeddings=rope(x, pos[None]))
        y = (y[0] if isinstance(y, tuple) else y)[0]
        logits = torch.nn.functional.linear(rms(y, w["shared_head.norm.weight"]), w["shared_head.head.weight"])
        return y, int(logits[-1].argmax())

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


def test_drafts_match_a_transformers_reference_mtp(ds_mtp):
    """Every step's drafts (after chunked prefills and verify steps, rejected positions rewritten, the chained pass
    in a lookahead slot, a prefix-cache hit's positions from the cached blocks) equal the reference's."""
    k = 2
    llm = LLM(str(ds_mtp), **KW, **_spec(k))
    seen = record_drafts(llm)
    _greedy(llm, rounds=2)
    assert llm.engine.block_manager.prefix_hits > 0
    assert len(seen) >= 2 * len(PROMPTS) * 4
    # (every distinct sequence once: the reference rebuilds transformers' models per call)
    for tokens, drafts in {tuple(t): d for t, d in seen}.items():
        assert drafts == _reference_drafts(ds_mtp, list(tokens), k), tokens


def _check_drafted(llm):
    s = llm.engine.spec_stats
    assert s.num_drafts > 0 and s.num_draft_tokens > 0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_parity_with_mtp(ds_mtp, ds_ref, k):
    """k = 1..3 over the one MTP layer (k > 1 reuses it), chunked prefill, and a second round from prefix-cache
    hits: outputs equal the engine's without drafts."""
    llm = LLM(str(ds_mtp), **KW, **_spec(k))
    assert _greedy(llm, rounds=2) == ds_ref
    _check_drafted(llm)
    assert llm.engine.block_manager.prefix_hits > 0


@pytest.mark.parametrize("v32,head", [(False, False), (True, True)], ids=["v3-target-lm-head", "v32-indexer"])
def test_mtp_layouts(tmp_path, v32, head):
    """A checkpoint without shared_head.head (the target's lm_head serves), and DeepSeek-V3.2 (the MTP layer's MLA
    with its lightning indexer's weights and its own index-key cache) with a sparse selection: index_topk 4 against
    sequences of 9-21 tokens, 4 index heads (exact ties in the scores: the selection breaks them by position)."""
    path = make_deepseek_mtp_checkpoint(tmp_path / "t", head=head, v32=v32, **({"index_topk": 4} if v32 else {}))
    ref = _greedy(LLM(str(path), **KW))
    llm = LLM(str(path), **KW, **_spec(2))
    assert llm.engine.runner.proposer.draft.uses_target_head == (not head)
    assert _greedy(llm) == ref
    _check_drafted(llm)


def test_two_mtp_layers_alternate(tmp_path):
    """num_nextn_predict_layers = 2 at k = 3: drafts 1 and 3 from MTP layer 0, draft 2 from layer 1 (step % 2), each
    layer its own paged cache layer; outputs equal the run without drafts."""
    path = make_deepseek_mtp_checkpoint(tmp_path / "t", n_mtp=2)
    ref = _greedy(LLM(str(path), **KW))
    llm = LLM(str(path), **KW, **_spec(3))
    prop = llm.engine.runner.proposer
    assert [m.layer.self_attn.layer_idx for m in prop.layers] == [3, 4]
    used = []
    for m in prop.layers:
        m.register_forward_hook(lambda mod, *_: used.append(prop.layers.index(mod)))
    assert _greedy(llm) == ref
    _check_drafted(llm)
    assert {0, 1} <= set(used) and used.count(0) > used.count(1)


def test_mtp_needs_mtp_layers(tmp_path):
    path = make_deepseek_checkpoint(tmp_path / "t")
    with pytest.raises(ValueError, match="ships no MTP layers"):
        LLM(str(path), device="cpu", max_model_len=128, **_spec(2))
