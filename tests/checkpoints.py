"""Tiny random checkpoints built with transformers' own classes (the oracle), saved to disk.

Every parameter is randomized, norm weights included (ones would hide a missing norm), and the
tokenizer is a byte-level BPE trained here on local text with a chat template.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus():
    import inspect
    import json as j
    import textwrap
    # Local text: a few standard-library modules' source plus some Unicode, so that multi-byte
    # characters exist in the vocabulary as several byte tokens.
    text = [inspect.getsource(j), inspect.getsource(textwrap), inspect.getsource(os.path)]
    text.append("café naïve Grüße 東京 日本語のテキスト 😀 emoji ✓ — “quotes” ") 
    return text


def make_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL), special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / max(p.shape[-1], 1) ** 0.5 * 2))


def make_checkpoint(path, arch: str = "qwen3", seed: int = 0, **overrides) -> Path:
    """Save a tiny random `arch` ('qwen3' | 'llama' | 'qwen2' | 'mistral') checkpoint plus tokenizer under `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    tok = make_tokenizer()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=eos, bos_token_id=None, pad_token_id=eos, tie_word_embeddings=False)
    if arch == "qwen3":
        cfg = Qwen3Config(**{**common, "head_dim": 32, "rope_theta": 1e6, **overrides})
        model = Qwen3ForCausalLM(cfg)
    elif arch == "llama":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256, "rope_theta": 500000.0}
        cfg = LlamaConfig(**{**common, "head_dim": 16, "rope_scaling": rope, **overrides})
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM
        # q/k/v biases (randomized below like every parameter); head_dim from hidden / heads = 16.
        cfg = Qwen2Config(**{**common, "rope_theta": 1e6, **overrides})
        model = Qwen2ForCausalLM(cfg)
    elif arch == "mistral":
        from transformers import MistralConfig, MistralForCausalLM
        # sliding_window None as current Mistral configs ship it (MistralConfig's default is 4096).
        cfg = MistralConfig(**{**common, "head_dim": 16, "rope_theta": 1e6, "sliding_window": None, **overrides})
        model = MistralForCausalLM(cfg)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    return _randomize_and_save(path, model, tok, eos, seed)


def step_row(request, num_new_tokens: int, sample: bool, start: int, spec=()):
    """A scheduled request with its state attached, as the runner's RequestStates.apply leaves it: for tests that
    drive input preparation directly (request: an engine Request, which has the same token accessors)."""
    from gyrfalcon.step_io import ScheduledRequest
    return ScheduledRequest(request.request_id, start, num_new_tokens, sample, spec_token_ids=spec, request=request)


def _randomize_and_save(path: Path, model, tok, eos: int, seed: int, extra=None) -> Path:
    """The tail every tiny-checkpoint maker shares: randomize_ every parameter, then from a second generator (seed
    + 1) the e_score_correction_bias buffers (they start at zero) and `extra(model, g)` (family-specific ranges),
    then save the model, the tokenizer and a generation_config."""
    from transformers import GenerationConfig

    randomize_(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
        if extra is not None:
            extra(model, g)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    GenerationConfig(eos_token_id=eos, pad_token_id=eos).save_pretrained(str(path))
    return path


def make_moe_checkpoint(path, arch: str = "qwen3_moe", seed: int = 0, **overrides) -> Path:
    """Save a tiny random mixture-of-experts checkpoint ('qwen3_moe' | 'minimax_m2', ../shared/MODELS.md's
    tiny configs) plus tokenizer under `path`. Every parameter and buffer that the checkpoint holds is
    randomized, e_score_correction_bias included (it starts at zero)."""
    path = Path(path)
    tok = make_tokenizer()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    common = dict(vocab_size=512, hidden_size=64, max_position_embeddings=1024, num_attention_heads=4,
                  num_key_value_heads=2, eos_token_id=eos, bos_token_id=None, pad_token_id=eos,
                  tie_word_embeddings=False)
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        # 3 layers: layer 1 dense (mlp_only_layers), 0 and 2 sparse.
        cfg = Qwen3MoeConfig(**{**common, "intermediate_size": 128, "moe_intermediate_size": 32,
                                "num_hidden_layers": 3, "head_dim": 32, "rope_theta": 1e6, "num_experts": 8,
                                "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [1],
                                **overrides})
        model = Qwen3MoeForCausalLM(cfg)
    elif arch == "minimax_m2":
        from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM
        cfg = MiniMaxM2Config(**{**common, "intermediate_size": 32, "num_hidden_layers": 2, "head_dim": 16,
                                 "rotary_dim": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                                 "rope_theta": 5e6, **overrides})
        model = MiniMaxM2ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    return _randomize_and_save(path, model, tok, eos, seed)


DEEPSEEK_V3_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=4096 * 40,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0})


def make_deepseek_checkpoint(path, seed: int = 0, v32: bool = False, **overrides) -> Path:
    """Save a tiny random DeepSeek-V3 checkpoint (../shared/MODELS.md's tiny config without the V3.2 indexer:
    MLA with YaRN and interleaved RoPE, layer 0 dense, layers 1-2 MoE with grouped sigmoid routing and a shared
    expert) plus tokenizer under `path`; v32: DeepSeek-V3.2's (the same plus a lightning indexer of 4 heads x 16
    dims and index_topk 4 in every layer). Every parameter is randomized, the MLA norms, the indexer's LayerNorm
    and fp32 weights_proj and e_score_correction_bias included. overrides: the config's fields (q_lora_rank=None:
    a plain q_proj; index_topk >= the sequence length: dense-equivalent; index_n_heads)."""
    if v32:
        from transformers import DeepseekV32Config as Config, DeepseekV32ForCausalLM as Model
    else:
        from transformers import DeepseekV3Config as Config, DeepseekV3ForCausalLM as Model

    path = Path(path)
    tok = make_tokenizer()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = Config(**{**(DEEPSEEK_V32_TINY if v32 else DEEPSEEK_V3_TINY), "eos_token_id": eos, "bos_token_id": None,
                    "pad_token_id": eos, "tie_word_embeddings": False, **overrides})
    torch.manual_seed(seed)
    return _randomize_and_save(path, Model(cfg), tok, eos, seed)


DEEPSEEK_V32_TINY = dict(DEEPSEEK_V3_TINY, index_n_heads=4, index_head_dim=16, index_topk=4)


def make_deepseek_v32_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """make_deepseek_checkpoint's V3.2 checkpoint."""
    return make_deepseek_checkpoint(path, seed, v32=True, **overrides)


QWEN3_NEXT_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.25, rope_theta=1e7, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    full_attention_interval=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, norm_topk_prob=True, max_position_embeddings=1024)


def make_qwen3_next_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random Qwen3-Next checkpoint (../shared/MODELS.md's tiny Qwen3NextConfig: layers 0-2 Gated
    DeltaNet, layer 3 gated attention, MoE with a gated shared expert everywhere) plus tokenizer under `path`.
    Every parameter is randomized: norms (the (1 + w) ones around w = 0), conv weights, dt_bias, and A_log with decay
    rates A = exp(A_log) in [0.02, 1], so the recurrent state remembers over tens of tokens (transformers'
    init range [0.01, 16] would forget most of it within a few tokens and hide a state lost between chunks).
    overrides: Qwen3NextConfig fields (layer_types, mlp_only_layers, linear_num_value_heads, ...)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    path = Path(path)
    tok = make_tokenizer()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = Qwen3NextConfig(**{**QWEN3_NEXT_TINY, "eos_token_id": eos, "bos_token_id": None, "pad_token_id": eos,
                             "tie_word_embeddings": False, **overrides})
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(cfg)
    return _randomize_and_save(path, model, tok, eos, seed, _gdn_ranges_)


def _gdn_ranges_(model, g, zero_centred=lambda name: True) -> None:
    """The hybrid families' ranges over randomize_'s: A_log with decays exp(A_log) in [0.02, 1], dt_bias ~ N(0,
    0.5), matrices (not conv, not embeddings) at half scale, and the (1 + w) norms that zero_centred(name) picks
    (not the GDN output norm, a plain-weight one) around w = 0."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.02, 1.0, generator=g).log())
        elif name.endswith("dt_bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        elif p.dim() >= 2 and "conv1d" not in name and "embed" not in name:
            # Matrices at half randomize_'s scale: at full scale the residual stream reaches ~7 and transformers'
            # own fp32 logits differ from its fp64 ones by up to 9e-5, above the 1e-5 that parity is held to; at
            # half, ~1e-5 at most.
            p.mul_(0.5)
        elif name.endswith("norm.weight") and ".linear_attn.norm." not in name and zero_centred(name):
            # Zero-centred norms scale by (1 + w): w around 0, as trained checkpoints have it (randomize_'s
            # 1 + noise would double every normed activation and the logits' rounding noise with it).
            p.copy_(0.3 * torch.randn(p.shape, generator=g))


# Qwen3.5's text config: QWEN3_NEXT_TINY's dims, the rope settings inside rope_parameters as the releases write them
# (M-RoPE sections over the 4 rotary frequencies of head_dim 32 x 0.25, interleaved), no full_attention_interval
# (layer_types says it), and the MoE fields only for Qwen3.5-MoE (whose router always renormalizes: no
# norm_topk_prob).
QWEN3_5_TEXT_TINY = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, max_position_embeddings=1024,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True})
QWEN3_5_MOE_TINY = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32)
# The smallest vision tower transformers builds (one block); gyrfalcon never reads it.
QWEN3_5_VISION_TINY = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                           patch_size=2, temporal_patch_size=1, num_position_embeddings=16)


def make_qwen3_5_checkpoint(path, moe: bool = True, packed_experts: bool = True, seed: int = 0,
                            **overrides) -> Path:
    """Save a tiny random Qwen3.5 checkpoint as the releases ship it plus tokenizer under `path`:
    Qwen3_5MoeForConditionalGeneration (moe) or Qwen3_5ForConditionalGeneration (dense, intermediate_size 128),
    config.json with text_config / vision_config, the language model under `model.language_model.*`, a one-block
    vision tower under `model.visual.*`, lm_head at the top. packed_experts: the routed experts as the bf16 releases
    store them, `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I] (transformers' save_pretrained
    writes them one by one, as the FP8 releases do: packed_experts=False keeps that). Every parameter is randomized
    as make_qwen3_next_checkpoint does (A_log's decays in [0.02, 1], (1 + w) norms around w = 0, matrices at half
    scale), the vision tower's too. overrides: text config fields."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    tok = make_tokenizer()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    text = {**QWEN3_5_TEXT_TINY, **(QWEN3_5_MOE_TINY if moe else {"intermediate_size": 128}),
            "eos_token_id": eos, "bos_token_id": None, "pad_token_id": eos, "tie_word_embeddings": False,
            **overrides}
    if moe:
        from transformers import Qwen3_5MoeConfig as Config, Qwen3_5MoeForConditionalGeneration as Model
    else:
        from transformers import Qwen3_5Config as Config, Qwen3_5ForConditionalGeneration as Model
    cfg = Config(text_config=text, vision_config=QWEN3_5_VISION_TINY, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Model(cfg)
    # (the vision tower's norms are plain LayerNorms: only the language model's are (1 + w))
    _randomize_and_save(path, model, tok, eos, seed,
                        lambda m, g: _gdn_ranges_(m, g, lambda name: ".language_model." in name))
    if moe and packed_experts:
        (file,) = path.glob("*.safetensors")
        sd = load_file(str(file))
        packed = {}
        for layer in range(text["num_hidden_layers"]):
            pre = f"model.language_model.layers.{layer}.mlp.experts"
            E = text["num_experts"]
            gate_up = [torch.cat([sd.pop(f"{pre}.{e}.gate_proj.weight"), sd.pop(f"{pre}.{e}.up_proj.weight")])
                       for e in range(E)]
            packed[f"{pre}.gate_up_proj"] = torch.stack(gate_up)
            packed[f"{pre}.down_proj"] = torch.stack([sd.pop(f"{pre}.{e}.down_proj.weight") for e in range(E)])
        save_file({**sd, **packed}, str(file), metadata={"format": "pt"})
    return path
