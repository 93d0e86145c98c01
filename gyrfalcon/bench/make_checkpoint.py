"""Write a random-weight checkpoint of a real model's shape, so benchmarks run on any machine.

The directory is a real Hugging Face checkpoint: config.json (the real model's dimensions, layer
count optionally cut), safetensors shards with an index, a byte-level BPE tokenizer trained here on
local Python sources (its vocabulary is smaller than the model's; ids beyond it decode to nothing),
generation_config.json. Parameter names and shapes come from transformers' own model class built on
the meta device, so the files are exactly what that class would save.

--fp8 writes the FP8 format that DeepSeek-V3 / V3.2, Qwen3-*-FP8 and MiniMax-M2 ship: every decoder linear weight
(attention q/k/v/o or MLA's projections and V3.2's indexer wq_b / wk, the dense MLP's and each expert's gate/up/down
or w1/w3/w2) float8_e4m3fn with a
`<name>_scale_inv` fp32 [ceil(rows / 128), ceil(cols / 128)], the random weight quantized per 128 x 128 block
(the same draws as without --fp8, so the two checkpoints of a seed hold the same model up to e4m3 rounding), and
config.json's quantization_config. Embeddings, the LM head, norms, the router and its correction bias stay in
--dtype (fp32 for the bias), and so does V3.2's indexer weights_proj (unquantized in the release: its fp32 head
weights order the top-k).

Qwen3-Next and Qwen3.5 (the hybrid presets): their zero-centred norms ((1 + w): every RMSNorm but the Gated
DeltaNet's output norm) get w around 0. qwen3.5-397b-a17b is written as the release lays it out,
Qwen3_5MoeForConditionalGeneration: config.json nests the text settings under text_config (--num-layers cuts
text_config.num_hidden_layers; layer_types follow full_attention_interval 4), tensors under `model.language_model.*`,
lm_head at the top, the routed experts packed (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) as
the bf16 release stores them, one by one with their scales under --fp8 as the FP8 release does. The vision tower's
config is written, its weights are not (gyrfalcon skips `model.visual.*`; a benchmark never reads them).

--config-only writes everything but the weights, for `--load-format dummy` (models/loader.py): the engine builds
the model from config.json and fills it with random values on the device, so shapes larger than the disk run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

_DEEPSEEK_V3_DIMS = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    first_k_dense_replace=1, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5,
    max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0})

PRESETS = {
    "llama-3.1-8b": dict(
        arch="LlamaForCausalLM", model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_theta": 500000.0}),
    "qwen3-0.6b": dict(
        arch="Qwen3ForCausalLM", model_type="qwen3", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3-8b": dict(
        arch="Qwen3ForCausalLM", model_type="qwen3", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # 128 experts top-8 of intermediate 768 in every layer; ~61 GB in bf16.
    "qwen3-30b-a3b": dict(
        arch="Qwen3MoeForCausalLM", model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Real per-layer dims (62 layers in the release, ~7 GB each in bf16): cut with --num-layers (14: ~98 GB).
    "minimax-m2": dict(
        arch="MiniMaxM2ForCausalLM", model_type="minimax_m2", vocab_size=200064, hidden_size=3072,
        intermediate_size=1536, num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8,
        head_dim=128, rotary_dim=64, num_local_experts=256, num_experts_per_tok=8, scoring_func="sigmoid",
        use_routing_bias=True, use_qk_norm=True, qk_norm_type="per_layer", max_position_embeddings=196608,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=5000000.0),
    # Real per-layer dims (61 layers in the release: ~22 GB per MoE layer in bf16), cut with --num-layers: the
    # benchmark slice of ../shared/MODELS.md is 5 layers with only the first dense (~90 GiB). The release has 3
    # dense layers (first_k_dense_replace=3); the preset says 1 so that the slice is that one, and any cut keeps
    # MoE layers.
    "deepseek-v3": dict(
        arch="DeepseekV3ForCausalLM", model_type="deepseek_v3", **_DEEPSEEK_V3_DIMS, rope_interleave=True),
    # V3 plus the lightning indexer (DeepSeek sparse attention) in every layer: 64 heads of 128, top-2048 keys.
    "deepseek-v3.2": dict(
        arch="DeepseekV32ForCausalLM", model_type="deepseek_v32", **_DEEPSEEK_V3_DIMS, index_n_heads=64,
        index_head_dim=128, index_topk=2048),
    # Qwen3-Next-80B-A3B's public config: 48 layers = 12 x (3 Gated DeltaNet + 1 gated attention), 512 experts top-10
    # of 512 plus a gated shared expert of 512 in every layer (~3.2 GB per layer in bf16); ../shared/MODELS.md's
    # bench slice is 32 layers.
    "qwen3-next-80b-a3b": dict(
        arch="Qwen3NextForCausalLM", model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
        intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, full_attention_interval=4, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}),
    # Qwen3.5-397B-A17B (../shared/MODELS.md): 60 layers = 15 x (3 GDN + 1 gated attention), GDN 16 key / 64 value
    # heads of 128, attention 32 / 2 heads of 256, 512 experts top-10 of 1024 plus a gated shared expert of 1024,
    # vocab 248320 (~12.8 GB per layer in bf16); the GPU run cuts it to 4 layers (one block), 8 when memory allows.
    # Not in MODELS.md, as the Qwen3.5 releases' configs have them: rope_theta 1e7 over 25% of head_dim with M-RoPE
    # sections [11, 11, 10] interleaved, context 262144 (Qwen3_5MoeTextConfig's default is 32768); conv kernel 4
    # and rms_norm_eps 1e-6 are Qwen3_5MoeTextConfig's defaults; the vision config is transformers' default with
    # out_hidden_size = hidden_size.
    "qwen3.5-397b-a17b": dict(
        arch="Qwen3_5MoeForConditionalGeneration", model_type="qwen3_5_moe", tie_word_embeddings=False,
        text_config=dict(
            vocab_size=248320, hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2,
            head_dim=256, linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4, num_experts=512,
            num_experts_per_tok=10, moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
            max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [11, 11, 10], "mrope_interleaved": True}),
        vision_config=dict(out_hidden_size=4096)),
}

# Checkpoints store MoE experts one by one (transformers keeps them stacked in memory): per model type, the
# per-expert names of the stacked gate_up rows (gate, up) and of down, the MoE block's name on disk, and whether the
# router's e_score_correction_bias sits on the block (MiniMax-M2) rather than on its gate (DeepSeek).
_QWEN_EXPERTS = ("gate_proj", "up_proj", "down_proj")
_EXPERT_NAMES = {"qwen3_moe": (_QWEN_EXPERTS, "mlp", False),
                 "minimax_m2": (("w1", "w3", "w2"), "block_sparse_moe", True),
                 "deepseek_v3": (_QWEN_EXPERTS, "mlp", False),
                 "deepseek_v32": (_QWEN_EXPERTS, "mlp", False),
                 "qwen3_next": (_QWEN_EXPERTS, "mlp", False),
                 "qwen3_5_moe": (_QWEN_EXPERTS, "mlp", False)}
# Model types released as vision-language checkpoints: their language model's tensors live under
# `model.language_model.` on disk (transformers' *ForCausalLM of the text config names them `model.`), and the
# bf16 release keeps the routed experts packed (FP8: one by one, as _EXPERT_NAMES says).
_LANGUAGE_MODEL_PREFIX = {"qwen3_5_moe": "model.language_model."}
_PACKED_EXPERTS_UNLESS_FP8 = {"qwen3_5_moe"}
# Model types whose RMSNorms scale by (1 + w) (w initialized to 0), all but the Gated DeltaNet's output norm.
_ZERO_CENTRED_NORMS = {"qwen3_next", "qwen3_5_moe"}


def checkpoint_entries(model_type: str, name: str, shape, fp8: bool = False) -> list:
    """One tensor of transformers' in-memory state dict -> [(name on disk, shape)]: stacked experts
    (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) become per-expert tensors (Qwen3.5: only with
    fp8, its bf16 release keeps them packed), the MoE block takes its on-disk name (MiniMax-M2: block_sparse_moe,
    the correction bias on the block), a vision-language release's language model its `model.language_model.`."""
    prefix = _LANGUAGE_MODEL_PREFIX.get(model_type)
    if prefix is not None and name.startswith("model."):
        name = prefix + name[len("model."):]
    if model_type not in _EXPERT_NAMES or (model_type in _PACKED_EXPERTS_UNLESS_FP8 and not fp8):
        return [(name, tuple(shape))]
    (gate, up, down), block, bias_on_block = _EXPERT_NAMES[model_type]
    name = name.replace(".mlp.", f".{block}.")
    if bias_on_block:
        name = name.replace(f".{block}.gate.e_score_correction_bias", f".{block}.e_score_correction_bias")
    if name.endswith(".experts.gate_up_proj"):
        E, two_i, H = shape
        return [(f"{name[:-len('gate_up_proj')]}{e}.{proj}.weight", (two_i // 2, H))
                for e in range(E) for proj in (gate, up)]
    if name.endswith(".experts.down_proj"):
        E, H, inter = shape
        return [(f"{name[:-len('down_proj')]}{e}.{down}.weight", (H, inter)) for e in range(E)]
    return [(name, tuple(shape))]


FP8_BLOCK = (128, 128)
# Modules left unquantized among the decoder layers' 2-D weights, named as MiniMax-M2's release does (the router
# `gate` matches model.layers.N.mlp.gate / block_sparse_moe.gate but not gate_proj); the embeddings, norms and the
# correction bias are not 2-D layer weights and stay unquantized regardless.
FP8_MODULES_TO_NOT_CONVERT = ["gate", "e_score_correction_bias", "lm_head"]
# Per model type, more modules that its release keeps unquantized (DeepSeek-V3.2's indexer head weights; Qwen3.5's
# GDN in_proj_b / in_proj_a, and the conv, which is 3-D and never selected; the one-row shared_expert_gate [1, H]
# of both hybrids). Qwen3-Next's grouped in_proj_qkvz / in_proj_ba stay unquantized too: gyrfalcon does not reorder
# FP8 blocks of the per-key-head groups (layers/gated_deltanet.py GroupedHeadsLinear) yet.
_FP8_ALSO_NOT_CONVERTED = {"deepseek_v32": ["weights_proj"],
                           "qwen3_next": ["in_proj_qkvz", "in_proj_ba", "shared_expert_gate"],
                           "qwen3_5_moe": ["in_proj_a", "in_proj_b", "shared_expert_gate"]}


def fp8_quantization_config(model_type: str) -> dict:
    """config.json's quantization_config of an --fp8 checkpoint, as the model's release writes it."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK),
            # MiniMax-M2 spells the format by its torch dtype, DeepSeek-V3 and Qwen3-FP8 as e4m3
            "fmt": "float8_e4m3fn" if model_type == "minimax_m2" else "e4m3",
            "modules_to_not_convert": FP8_MODULES_TO_NOT_CONVERT + _FP8_ALSO_NOT_CONVERTED.get(model_type, [])}


def is_fp8_weight(name: str, shape, model_type: str = "") -> bool:
    """Whether on-disk tensor `name` [rows, cols] is stored float8_e4m3fn with a `<name>_scale_inv`: a 2-D
    `.weight` inside the decoder layers whose module is not in model_type's modules_to_not_convert."""
    from gyrfalcon.layers.quantization import matches_module

    keep = fp8_quantization_config(model_type)["modules_to_not_convert"]
    return (len(shape) == 2 and ".layers." in name and name.endswith(".weight")
            and not matches_module(name[:-len(".weight")], keep))


def fp8_scale_shape(shape) -> tuple:
    """weight [rows, cols] -> its weight_scale_inv [ceil(rows / 128), ceil(cols / 128)]."""
    return tuple(-(-d // b) for d, b in zip(shape, FP8_BLOCK))


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--num-layers", type=int, default=None, help="cut the layer count (tests)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--std", type=float, default=0.02, help="std of the random linear weights")
    p.add_argument("--lm-head-std", type=float, default=None,
                   help="std of the LM head (larger gives peakier logits, stabler greedy tests)")
    p.add_argument("--tokenizer-vocab", type=int, default=4096)
    p.add_argument("--fp8", action="store_true",
                   help="decoder linear weights (attention, MLP, experts) as float8_e4m3fn with 128 x 128 block "
                        "weight_scale_inv and an fp8 quantization_config, as DeepSeek-V3 / Qwen3-FP8 / MiniMax-M2 "
                        "ship them (about half the bytes)")
    p.add_argument("--config-only", action="store_true",
                   help="write config.json, tokenizer and generation_config but no weights: the directory for "
                        "--load-format dummy (random weights made on the device at load)")


def build_config(preset: str, num_layers=None):
    from transformers import AutoConfig

    spec = dict(PRESETS[preset])
    arch, model_type = spec.pop("arch"), spec.pop("model_type")
    if num_layers is not None:
        if "text_config" in spec:  # a vision-language release: the language model's layers
            spec["text_config"] = dict(spec["text_config"], num_hidden_layers=num_layers)
        else:
            spec["num_hidden_layers"] = num_layers
    cfg = AutoConfig.for_model(model_type, **spec)
    cfg.architectures = [arch]
    return cfg


def train_tokenizer(vocab_size: int):
    """A byte-level BPE with ChatML special tokens, trained on Python sources of this machine."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:200]
    texts = (f.read_text(errors="ignore") for f in files)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return fast


def disk_entries(cfg, fp8: bool = False) -> list:
    """[(name on disk, shape)] of every tensor the writer draws for `cfg` (before --fp8 adds the scales), from
    transformers' causal-LM class of it built on the meta device (a vision-language config: its language model)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        state = AutoModelForCausalLM.from_config(cfg).state_dict()
    return [e for name, meta in state.items() for e in checkpoint_entries(cfg.model_type, name, meta.shape, fp8)]


def make_checkpoint(preset: str, out: str, num_layers=None, dtype: str = "bfloat16", seed: int = 0,
                    std: float = 0.02, lm_head_std=None, tokenizer_vocab: int = 4096,
                    shard_bytes: int = 4 << 30, fp8: bool = False, config_only: bool = False) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from gyrfalcon.kernels.fp8_gemm import quantize_weight_blockwise

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = build_config(preset, num_layers)
    tok = train_tokenizer(tokenizer_vocab)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    for c in {id(cfg): cfg, id(cfg.get_text_config()): cfg.get_text_config()}.values():
        c.eos_token_id = eos
        c.bos_token_id = None
    cfg.dtype = dtype
    tdtype = getattr(torch, dtype)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    shards, cur, cur_bytes, index = [], {}, 0, {}
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    entries = [] if config_only else disk_entries(cfg, fp8)
    zero_centred = cfg.model_type in _ZERO_CENTRED_NORMS
    for name, shape in entries:
        if tied and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight") or "layernorm" in name:
            t = 0.1 * torch.randn(shape, generator=g, device=dev)
            if not zero_centred or ".linear_attn.norm." in name:
                t += 1.0
        elif name.endswith("e_score_correction_bias"):  # fp32 (a selection bias: bf16 would blur near-ties)
            t = (0.01 * torch.randn(shape, generator=g, device=dev)).cpu()
        elif name == "lm_head.weight" and lm_head_std is not None:
            t = lm_head_std * torch.randn(shape, generator=g, device=dev)
        elif name.endswith("embed_tokens.weight") and tied and lm_head_std is not None:
            t = lm_head_std * torch.randn(shape, generator=g, device=dev)
        else:
            t = std * torch.randn(shape, generator=g, device=dev)
        if fp8 and is_fp8_weight(name, shape, cfg.model_type):
            q, scale = quantize_weight_blockwise(t, FP8_BLOCK)
            tensors = {name: q.cpu(), f"{name}_scale_inv": scale.cpu()}
        else:
            tensors = {name: t if name.endswith("e_score_correction_bias") else t.to(tdtype).cpu()}
        nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
        if cur and cur_bytes + nbytes > shard_bytes:  # a weight and its scales stay in one shard
            shards.append(cur)
            cur, cur_bytes = {}, 0
        cur.update(tensors)
        cur_bytes += nbytes
    if cur:
        shards.append(cur)
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        for k, v in shard.items():
            index[k] = fname
            total += v.numel() * v.element_size()
    if shards:
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1))
    if fp8:
        cfg.quantization_config = fp8_quantization_config(cfg.model_type)
    cfg.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    GenerationConfig(eos_token_id=eos, pad_token_id=eos).save_pretrained(str(out_dir))
    return out_dir


def main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    path = make_checkpoint(args.preset, args.out, args.num_layers, args.dtype, args.seed, args.std,
                           args.lm_head_std, args.tokenizer_vocab, fp8=args.fp8, config_only=args.config_only)
    what = ", fp8" * args.fp8 + ", config only" * args.config_only
    print(f"wrote {args.preset} ({args.num_layers or 'all'} layers{what}) to {path} in "
          f"{time.perf_counter() - t0:.1f} s")
    return 0
