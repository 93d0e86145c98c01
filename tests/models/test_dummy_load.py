"""load_format "dummy" (vLLM's --load-format dummy): a directory with config.json and tokenizer files but no
weights builds the model and fills it with random values (models/loader.py fill_dummy_weights). Tiny Llama /
Qwen3 / Qwen3-MoE / MiniMax-M2 configs (tests/checkpoints.py, their safetensors deleted) generate finite logits,
the same ones twice under a seed; FP8 configs and --quantization fp8 get e4m3 weights whose scales give the
intended std; parameters of families to come (A_log, dt_bias, conv, FP8 experts) get their own ranges."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from gyrfalcon import LLM, SamplingParams
from gyrfalcon.kernels.fp8_gemm import dequantize_weight
from gyrfalcon.layers.quantization import is_quantized
from gyrfalcon.models.loader import DUMMY_EMBED_STD, DUMMY_NORM_NOISE, fill_dummy_weights
from checkpoints import make_checkpoint, make_moe_checkpoint

ARCHS = ("llama", "qwen3", "qwen3_moe", "minimax_m2")
PROMPTS = ["def add(a, b):", "The capital of", "x"]
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
# Whole 128-row shards and edge blocks (hidden 320 = 2.5 blocks), as tests/models/test_fp8_weights.py uses.
FP8_SHAPES = dict(hidden_size=320, intermediate_size=384, head_dim=64, num_attention_heads=4, num_key_value_heads=2)


def _strip_weights(path: Path) -> Path:
    for f in list(path.glob("*.safetensors")) + list(path.glob("*.safetensors.index.json")):
        f.unlink()
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """arch -> a checkpoint directory without weight files (config.json, tokenizer, generation_config)."""
    base = tmp_path_factory.mktemp("dummy")
    out = {}
    for arch in ARCHS:
        make = make_checkpoint if arch in ("llama", "qwen3") else make_moe_checkpoint
        out[arch] = _strip_weights(make(base / arch, arch))
    return out


def _run(llm):
    """Greedy tokens and every sampled / prompt logprob of PROMPTS."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    lps = [lp.logprob for o in outs for step in (o.outputs[0].logprobs + o.prompt_logprobs[1:])
           for lp in step.values()]
    return tokens, lps


@pytest.mark.parametrize("arch", ARCHS)
def test_dummy_load_generates_finite_and_seeded(dirs, arch, caplog):
    with caplog.at_level(logging.INFO, logger="gyrfalcon.models.loader"):
        llm = LLM(str(dirs[arch]), load_format="dummy", block_size=8, seed=3)
    assert any(r.getMessage().startswith("dummy weights: ") and " parameters (" in r.getMessage()
               for r in caplog.records)
    tokens, lps = _run(llm)
    vocab = llm.config.model_config.hf_config.vocab_size
    assert all(0 <= t < vocab for ts in tokens for t in ts) and all(len(ts) == 6 for ts in tokens)
    assert lps and all(math.isfinite(x) for x in lps)
    # O(1) logits: the top token is neither certain nor lost in a flat distribution over the 512 ids
    top = [max(lp.logprob for lp in step.values()) for o in llm.generate(PROMPTS, SamplingParams(
        temperature=0, max_tokens=1, logprobs=1), use_tqdm=False) for step in o.outputs[0].logprobs]
    assert all(-math.log(vocab) + 0.2 < t < -0.01 for t in top), top
    again = LLM(str(dirs[arch]), load_format="dummy", block_size=8, seed=3)
    assert _run(again) == (tokens, lps)
    other = LLM(str(dirs[arch]), load_format="dummy", block_size=8, seed=4)
    assert _run(other)[0] != tokens


def test_parameter_ranges(dirs):
    """Every parameter filled, by kind: matrices N(0, 1 / fan_in), embeddings 0.02, norms 1 + noise, the fp32
    correction bias small and still fp32."""
    from transformers import AutoConfig

    from gyrfalcon.models.registry import resolve_model_class

    cfg = AutoConfig.from_pretrained(str(dirs["minimax_m2"]))
    model = resolve_model_class(cfg)(cfg, max_position=64)
    for p in model.parameters():
        p.data.fill_(float("nan"))  # what the fill misses stays NaN
    n, nbytes = fill_dummy_weights(model, seed=0)
    params = dict(model.named_parameters())
    assert n == len(params) and nbytes == sum(p.numel() * p.element_size() for p in params.values())
    for name, p in params.items():
        assert torch.isfinite(p).all(), name
        if name.endswith("norm.weight"):
            assert abs(p.mean().item() - 1) < 0.1 and 0.5 * DUMMY_NORM_NOISE < p.std().item() < 2 * DUMMY_NORM_NOISE
        elif name.endswith("e_score_correction_bias"):
            assert p.dtype == torch.float32 and 0 < p.abs().max().item() < 0.1
        elif "embed_tokens" in name:
            assert abs(p.std().item() / DUMMY_EMBED_STD - 1) < 0.1
        elif p.dim() >= 2:
            assert abs(p.std().item() * p.shape[-1] ** 0.5 - 1) < 0.15, name
    kinds = {name.rsplit(".", 1)[-1] for name in params}
    assert {"w13", "w2", "e_score_correction_bias"} <= kinds  # the MoE parameters were among them


def test_future_parameter_kinds_and_fp8_experts():
    """By name and dtype alone: Gated DeltaNet's A_log / dt_bias / conv, and FP8 experts (e4m3 w13 with an fp32
    w13_scale_inv [E, ceil(2I / 128), ceil(H / 128)], layers/moe.py's FP8 format) dequantize to std 1 / sqrt(H)."""
    E, I, H, heads = 4, 192, 320, 8
    m = nn.Module()
    m.A_log = nn.Parameter(torch.empty(heads), requires_grad=False)
    m.dt_bias = nn.Parameter(torch.empty(heads), requires_grad=False)
    m.conv1d = nn.Conv1d(256, 256, 4, groups=256, bias=False)
    m.w13 = nn.Parameter(torch.empty(E, 2 * I, H, dtype=torch.float8_e4m3fn), requires_grad=False)
    m.w13_scale_inv = nn.Parameter(torch.empty(E, 3, 3), requires_grad=False)
    fill_dummy_weights(m, seed=0)
    A = m.A_log.exp()
    assert (A >= 1).all() and (A <= 16).all() and A.std() > 1
    dt = torch.nn.functional.softplus(m.dt_bias)
    assert (dt >= 0.9e-3).all() and (dt <= 1.1e-1).all()
    assert abs(m.conv1d.weight.std().item() * 2 - 1) < 0.15  # fan_in: the 4-token window
    assert m.w13.dtype == torch.float8_e4m3fn and m.w13.float().abs().max() <= 448
    deq = torch.stack([dequantize_weight(m.w13[e], m.w13_scale_inv[e]) for e in range(E)])
    assert abs(deq.std().item() * H ** 0.5 - 1) < 0.05


def test_fp8_checkpoint_config_and_quantization_flag(dirs, tmp_path):
    """A config.json with an fp8 quantization_config builds e4m3 linear layers with block scales; --quantization
    fp8 quantizes the filled bf16 ones per channel. Both dequantize to N(0, 1 / K) and generate finitely."""
    src = _strip_weights(make_checkpoint(tmp_path / "plain", "qwen3", **FP8_SHAPES))
    fp8 = tmp_path / "fp8"
    shutil.copytree(src, fp8)
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = FP8_CONFIG
    (fp8 / "config.json").write_text(json.dumps(cfg))
    for path, quantization, block in ((fp8, None, (128, 128)), (src, "fp8", None)):
        llm = LLM(str(path), load_format="dummy", quantization=quantization, block_size=8)
        model = llm.engine.runner.model
        linears = [m for m in model.modules() if is_quantized(m)]
        assert len(linears) == 4 * len(model.model.layers)  # qkv, o, gate_up, down
        for m in linears:
            assert m.weight.dtype == torch.float8_e4m3fn
            assert m.quant_block == (block or (1, m.in_features))
            w = dequantize_weight(m.weight, m.weight_scale_inv, m.quant_block)
            assert abs(w.std().item() * m.in_features ** 0.5 - 1) < 0.1
        tokens, lps = _run(llm)
        assert all(math.isfinite(x) for x in lps)


def test_missing_config_and_unknown_format(dirs, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json is missing.*load_format dummy"):
        LLM(str(empty), load_format="dummy")
    with pytest.raises(ValueError, match=r"Unknown load_format 'pt'.*'auto', 'safetensors', 'dummy'"):
        LLM(str(dirs["qwen3"]), load_format="pt")
    # without dummy, the same directory is an incomplete checkpoint
    with pytest.raises(FileNotFoundError, match="No \\*.safetensors"):
        LLM(str(dirs["qwen3"]))
