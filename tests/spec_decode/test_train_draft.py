"""`gyrfalcon train-draft` end to end on a tiny Llama target: regenerate, capture gyrfalcon's own hidden states,
train an EAGLE-3 head with training-time test, save it in the speculators layout; the trained head raises the
engine's mean acceptance length on held-out prompts, loads back through the speculators path, and a stopped and
resumed run ends with the same weights as an uninterrupted one.

The target is made learnable on purpose: a random tiny model's greedy text is close to noise that no head of its
width can predict. Here the layers' output projections are scaled down (the residual stream is mostly the current
token's embedding) and the LM head scores token y by the embedding of y's predecessor in a cycle of 16 ids, so the
target's greedy continuation walks that cycle (with the small context terms still there): repetitive text, as a
real model's is in places, that an EAGLE-3 head can learn from a few hundred tokens."""

from __future__ import annotations

import contextlib
import io
import json
import random
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import make_checkpoint, make_tokenizer
from gyrfalcon.cli import main as cli_main
from gyrfalcon.models.eagle3 import load_eagle3_draft
from gyrfalcon.train.evaluate import held_out_acceptance
from gyrfalcon.train.vocab import choose_draft_vocab, d2t_t2d

ENGINE = ["--device", "cpu", "--block-size", "16"]
AUX = ["--aux-layers", "1", "2", "3"]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "fast", "blue", "sky", "red"]


def _cyclic_target(path):
    """A 4-layer Llama whose greedy text walks cycles of 16 token ids (module docstring)."""
    ckpt = make_checkpoint(path, "llama", num_hidden_layers=4)
    f = ckpt / "model.safetensors"
    t = load_file(str(f))
    for name in t:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t[name] = t[name] * 0.05
    emb = t["model.embed_tokens.weight"]
    ids = torch.arange(emb.shape[0])
    t["lm_head.weight"] = emb[(ids // 16) * 16 + (ids - 1) % 16].clone()
    t["model.norm.weight"] = torch.ones_like(t["model.norm.weight"])
    save_file(t, str(f), metadata={"format": "pt"})
    return ckpt


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_draft")
    target = _cyclic_target(root / "target")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))) for _ in range(24)]
    (root / "prompts.txt").write_text("\n".join(lines[:20]) + "\n")
    (root / "heldout.txt").write_text("\n".join(lines[20:]) + "\n")
    tok = make_tokenizer()
    heldout = [tok.encode(line) for line in lines[20:]]
    return root, target, heldout


def _train(target, prompts, out, *extra, rc=0):
    argv = ["train-draft", "--model", str(target), "--prompts", str(prompts), "--out", str(out), *ENGINE, *AUX,
            "--raw-prompts", "--max-tokens", "32", "--draft-vocab-size", "256", "--batch-size", "4", "--lr", "3e-3",
            *extra]
    assert cli_main(argv) == rc


@pytest.fixture(scope="module")
def trained(setup):
    """The trained head, and what the run printed (its --eval-prompts line)."""
    root, target, _ = setup
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        _train(target, root / "prompts.txt", root / "draft", "--epochs", "30", "--save-every", "0",
               "--eval-prompts", str(root / "heldout.txt"))
    return root / "draft", printed.getvalue()


def test_training_raises_acceptance(setup, trained):
    """Held-out prompts, greedy, k = 3: the untrained head (the same run stopped before its first step) drafts
    nothing the target keeps; the trained one most of each chain."""
    root, target, heldout = setup
    draft, printed = trained
    _train(target, root / "prompts.txt", root / "untrained", "--stop-after-steps", "0")
    kw = dict(device="cpu", block_size=16)
    before = held_out_acceptance(str(target), str(root / "untrained"), heldout, 3, 32, ignore_eos=True, **kw)[0]
    after = held_out_acceptance(str(target), str(draft), heldout, 3, 32, ignore_eos=True, **kw)[0]
    assert before < 1.5, before
    assert after > 3.0, (before, after)
    # The run's own --eval-prompts report (the same prompts, stopping at eos).
    reported = re.search(r"held-out mean acceptance length \(k=3, greedy, 4 prompts\): ([0-9.]+); accepted per "
                         r"position ([0-9.]+) / ([0-9.]+) / ([0-9.]+)", printed)
    assert reported and float(reported.group(1)) > 2.5, printed
    # Each drafting step accepts a prefix of its chain: the positions' shares fall, and sum to the mean less one.
    per_pos = [float(reported.group(i)) for i in (2, 3, 4)]
    assert per_pos == sorted(per_pos, reverse=True), per_pos
    assert sum(per_pos) == pytest.approx(float(reported.group(1)) - 1, abs=2e-3), printed


def test_saved_draft_is_the_speculators_layout(setup, trained):
    root, target, _ = setup
    trained = trained[0]
    cfg = json.loads((trained / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["transformer_layer_config"]["model_type"] == "llama"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and cfg["draft_vocab_size"] == 256
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    tensors = load_file(str(trained / "model.safetensors"))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "layers.0.self_attn.q_proj.weight",
            "layers.0.mlp.down_proj.weight", "layers.0.hidden_norm.weight"} <= set(tensors)
    assert tensors["lm_head.weight"].shape[0] == 256 and tensors["t2d"].sum() == 256
    from gyrfalcon import LLM
    model = LLM(str(target), device="cpu", block_size=16).engine.runner.model
    draft = load_eagle3_draft(str(trained), None, model, "cpu", torch.float32, layer_idx=4)
    assert draft.spec.fmt == "speculators" and draft.spec.aux_layer_ids == [1, 2, 3]
    assert draft.spec.norm_before_residual
    torch.testing.assert_close(draft.q_proj.weight, tensors["layers.0.self_attn.q_proj.weight"])
    # d2t and t2d name the same target ids, and those are the most frequent ones in the captured data.
    draft_ids = torch.arange(256) + draft.d2t
    assert torch.equal(torch.nonzero(tensors["t2d"]).flatten(), draft_ids)
    from gyrfalcon.train.data import load_captured
    data = load_captured(trained / "captured.pt")
    assert torch.equal(draft_ids, choose_draft_vocab([s.ids for s in data], 512, 256))


def test_resume_ends_with_the_uninterrupted_weights(setup, capsys):
    root, target, _ = setup
    args = ["--epochs", "2", "--save-every", "2"]
    _train(target, root / "prompts.txt", root / "whole", *args)
    _train(target, root / "prompts.txt", root / "split", *args, "--stop-after-steps", "3")
    first = load_file(str(root / "split" / "model.safetensors"))
    _train(target, root / "prompts.txt", root / "split", *args, "--resume")
    whole, split = load_file(str(root / "whole" / "model.safetensors")), \
        load_file(str(root / "split" / "model.safetensors"))
    assert sorted(whole) == sorted(split)
    for name in whole:
        assert torch.equal(whole[name], split[name]), name
    assert not torch.equal(first["fc.weight"], whole["fc.weight"])  # the stop really was mid-run
    # A second run into a checkpointed directory must say --resume; --resume needs a checkpoint.
    capsys.readouterr()
    _train(target, root / "prompts.txt", root / "split", *args, rc=2)
    assert "pass --resume to continue it" in capsys.readouterr().err
    _train(target, root / "prompts.txt", root / "nothing", *args, "--resume", rc=2)
    assert "no train_state.pt" in capsys.readouterr().err


def test_init_draft_continues_from_a_saved_head(setup, trained, capsys):
    """--init-draft starts from a saved draft: stopped before its first step, the run exports that draft's tensors
    unchanged (its vocabulary, aux layers and config kept, --draft-vocab-size unused); one step moves them; a
    fresh head from the same flags is another one; an --aux-layers that the draft does not read is refused."""
    root, target, _ = setup
    draft = trained[0]
    init = ["--init-draft", str(draft), "--epochs", "1", "--save-every", "0"]
    _train(target, root / "prompts.txt", root / "ft0", *init, "--stop-after-steps", "0", "--draft-vocab-size", "128")
    _train(target, root / "prompts.txt", root / "ft1", *init, "--stop-after-steps", "1")
    _train(target, root / "prompts.txt", root / "fresh0", "--epochs", "1", "--save-every", "0",
           "--stop-after-steps", "0")
    src, ft0, ft1, fresh = (load_file(str(d / "model.safetensors")) for d in
                            (draft, root / "ft0", root / "ft1", root / "fresh0"))
    assert sorted(ft0) == sorted(src)
    for name in src:
        assert torch.equal(ft0[name], src[name]), name
    assert json.loads((root / "ft0" / "config.json").read_text())["draft_vocab_size"] == 256
    assert torch.equal(ft1["d2t"], src["d2t"]) and not torch.equal(ft1["fc.weight"], src["fc.weight"])
    assert not torch.equal(fresh["fc.weight"], src["fc.weight"])
    capsys.readouterr()
    _train(target, root / "prompts.txt", root / "ft_bad", "--init-draft", str(draft), "--aux-layers", "0", "1", "2",
           rc=2)
    assert "reads [1, 2, 3]" in capsys.readouterr().err


def test_draft_vocab_is_the_most_frequent_tokens():
    ids = choose_draft_vocab([[5, 5, 5, 2, 2, 9], [9, 9, 9, 7]], 12, 3)
    assert ids.tolist() == [2, 5, 9]
    d2t, t2d = d2t_t2d(ids, 12)
    assert (torch.arange(3) + d2t).tolist() == [2, 5, 9] and torch.nonzero(t2d).flatten().tolist() == [2, 5, 9]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        choose_draft_vocab([[1]], 12, 13)


def test_capture_and_training_forward_match_the_references(tmp_path):
    """The capture hook's aux states are transformers' hidden_states of the aux layers and its final states give the
    target's logits; the training forward's step j at chain position p proposes what the inference reference head
    (test_eagle3's, from transformers' layers and a KV cache) drafts j + 1 tokens ahead, when fed those drafts as the
    chain's tokens: TTT trains the computation the proposer runs."""
    from transformers import AutoModelForCausalLM

    from eagle3_checkpoints import make_eagle3_draft
    from gyrfalcon import LLM
    from gyrfalcon.train.ttt import ttt_forward
    from test_eagle3 import _reference_drafts

    target = make_checkpoint(tmp_path / "t", "llama", num_hidden_layers=4)
    head = make_eagle3_draft(tmp_path / "d", target, "speculators", aux_ids=[1, 2, 3], draft_vocab=300,
                             qk_norm=True, norm_before_residual=True, norm_before_fc=True)
    llm = LLM(str(target), device="cpu", block_size=4)
    model = llm.engine.runner.model
    draft = load_eagle3_draft(str(head), None, model, "cpu", torch.float32, layer_idx=4)
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    seq = [5, 9, 13, 2, 7, 5, 9, 13, 11, 4, 4, 8]
    aux, final = next(llm.capture_hidden_states([seq], [1, 2, 3], use_tqdm=False))
    with torch.no_grad():
        out = hf(torch.tensor([seq]), output_hidden_states=True)
        torch.testing.assert_close(aux, torch.cat([out.hidden_states[i][0] for i in (1, 2, 3)], -1),
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model.compute_logits(final), out.logits[0], rtol=1e-4, atol=1e-4)
        for L in (3, 7, 12):
            want = _reference_drafts(draft, hf, [1, 2, 3], seq[:L], 3, "qwen3")
            ids = seq[:L] + want[:2]
            a, _ = next(llm.capture_hidden_states([ids], [1, 2, 3], use_tqdm=False))
            logp = ttt_forward(draft, torch.tensor([ids]), a[None], torch.tensor([len(ids)]), 3)
            got = [int(draft.to_target_ids(lp[0, L - 2].argmax())) for lp in logp]
            assert got == want, L


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "deepseek_v32"])
def test_batched_capture_equals_one_sequence_at_a_time(tmp_path, arch):
    """Capture runs sequences in varlen batches (up to the prefill budget); each sequence's states equal those of
    a capture of it alone: own blocks, own linear-attention state slot (Qwen3-Next), own sparse-attention
    index (DeepSeek-V3.2)."""
    from checkpoints import make_deepseek_v32_checkpoint, make_qwen3_next_checkpoint
    from gyrfalcon import LLM

    make = {"llama": lambda p: make_checkpoint(p, "llama"), "qwen3_next": make_qwen3_next_checkpoint,
            "deepseek_v32": make_deepseek_v32_checkpoint}[arch]
    llm = LLM(str(make(tmp_path / arch)), device="cpu", block_size=4, max_num_batched_tokens=40)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 13, 1, 22, 9, 30)]
    layers = [0, 1, 2]
    batched = list(llm.capture_hidden_states(seqs, layers, use_tqdm=False))
    assert [a.shape[0] for a, _ in batched] == [len(s) for s in seqs]
    for s, (aux, final) in zip(seqs, batched):
        a1, f1 = next(llm.capture_hidden_states([s], layers, use_tqdm=False))
        torch.testing.assert_close(aux, a1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final, f1, rtol=1e-5, atol=1e-5)
    # The budget of 40 tokens split the six sequences (82 tokens) into batches of several; a longer one runs alone.
    calls = []
    runner = llm.engine.runner
    orig = runner.capture_hidden_states
    runner.capture_hidden_states = lambda b, a: calls.append([len(x) for x in b]) or orig(b, a)
    list(llm.capture_hidden_states(seqs + [[5] * 50], layers, use_tqdm=False))
    assert calls == [[7, 13, 1], [22, 9], [30], [50]]


def test_prompt_files(tmp_path):
    """.jsonl lines are prompts or conversations; other files one prompt per line; bad lines are named; chat
    prompts go through the chat template unless raw."""
    from gyrfalcon.train.data import encode_prompts, load_prompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello there"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    prompts = load_prompts(str(f))
    assert prompts == ["hello there", [{"role": "user", "content": "hi"}]]
    tok = make_tokenizer()
    chat, raw = encode_prompts(tok, prompts[:1]), encode_prompts(tok, prompts[:1], raw=True)
    assert raw == [tok.encode("hello there")] and len(chat[0]) > len(raw[0])
    (tmp_path / "p.txt").write_text("one\n\n two \n")
    assert load_prompts(str(tmp_path / "p.txt")) == ["one", "two"]
    f.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: expected"):
        load_prompts(str(f))
    (tmp_path / "e.txt").write_text("\n")
    with pytest.raises(ValueError, match="No prompts"):
        load_prompts(str(tmp_path / "e.txt"))
