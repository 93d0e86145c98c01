"""`gyrfalcon bench make-checkpoint --fp8`: the FP8 block format of DeepSeek-V3 / Qwen3-FP8 / MiniMax-M2
releases. A one-layer qwen3-0.6b (the smallest dense preset) is written, checked tensor by tensor and loaded by
gyrfalcon; the MoE presets' expert tensors are GBs even at one layer, so their FP8 selection is checked on names
and shapes from the meta model, and the writer's per-expert path on a shrunken MoE preset."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from gyrfalcon.bench.make_checkpoint import (PRESETS, build_config, checkpoint_entries, disk_entries,
                                             fp8_quantization_config, fp8_scale_shape, is_fp8_weight, make_checkpoint)
from gyrfalcon.config import QuantizationConfig
from gyrfalcon.kernels.fp8_gemm import dequantize_weight

DENSE_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


def _entries(preset):
    from transformers import AutoModelForCausalLM

    cfg = build_config(preset, num_layers=1)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return [e for n, t in model.state_dict().items() for e in checkpoint_entries(cfg.model_type, n, t.shape)]


@pytest.fixture(scope="module")
def fp8_dense(tmp_path_factory):
    base = tmp_path_factory.mktemp("mkckpt")
    return (make_checkpoint("qwen3-0.6b", str(base / "bf16"), num_layers=1, lm_head_std=0.1),
            make_checkpoint("qwen3-0.6b", str(base / "fp8"), num_layers=1, lm_head_std=0.1, fp8=True))


def test_dense_preset_writes_fp8_weights_and_scales(fp8_dense):
    plain_dir, fp8_dir = fp8_dense
    plain, fp8 = _tensors(plain_dir), _tensors(fp8_dir)
    cfg = json.loads((fp8_dir / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                          "activation_scheme": "dynamic",
                                          "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    assert "quantization_config" not in json.loads((plain_dir / "config.json").read_text())
    index = json.loads((fp8_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(fp8)
    quantized = {n for n, t in fp8.items() if t.dtype == torch.float8_e4m3fn}
    want = {f"model.layers.0.{'self_attn' if p.startswith(('q', 'k', 'v', 'o')) else 'mlp'}.{p}.weight"
            for p in DENSE_LINEARS}
    assert quantized == want
    assert set(fp8) == set(plain) | {f"{n}_scale_inv" for n in want}
    for n in want:
        w, s = fp8[n], fp8[f"{n}_scale_inv"]
        assert w.shape == plain[n].shape and s.dtype == torch.float32
        assert s.shape == (math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128))
        # the same draw as the plain checkpoint, quantized: e4m3 keeps 3 mantissa bits (<= 6.25% per element)
        torch.testing.assert_close(dequantize_weight(w, s), plain[n].float(), rtol=0.07, atol=1e-6)
    assert fp8["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (16, 8)  # q_proj [2048, 1024]
    for n in set(plain) - want:  # embeddings (tied LM head), norms: as without --fp8
        assert torch.equal(fp8[n], plain[n]), n


def test_dense_fp8_checkpoint_loads_and_generates(fp8_dense):
    from gyrfalcon import LLM, SamplingParams
    from gyrfalcon.layers.quantization import is_quantized

    _, fp8_dir = fp8_dense
    llm = LLM(str(fp8_dir), block_size=8, max_model_len=128)
    model = llm.engine.runner.model
    assert llm.config.model_config.quant_config.weight_block_size == (128, 128)
    assert sum(is_quantized(m) for m in model.modules()) == 4  # qkv, o, gate_up, down of the one layer
    out = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4
    assert all(math.isfinite(lp.logprob) for step in out.logprobs for lp in step.values())


@pytest.mark.parametrize("preset, linears", [
    ("qwen3-30b-a3b", 4 + 128 * 3),  # q/k/v/o + each expert's gate/up/down
    ("minimax-m2", 4 + 256 * 3),  # q/k/v/o + each expert's w1/w3/w2
])
def test_moe_preset_fp8_selection(preset, linears):
    """Names and shapes only (one layer of experts is GBs): the per-expert and attention weights are FP8, the
    router, its correction bias, norms, embeddings and LM head are not; scale shapes are per 128 x 128 block."""
    entries = _entries(preset)
    fp8 = {n: s for n, s in entries if is_fp8_weight(n, s)}
    assert len(fp8) == linears
    rest = {n for n, _ in entries} - set(fp8)
    moe = "block_sparse_moe" if preset == "minimax-m2" else "mlp"
    assert f"model.layers.0.{moe}.gate.weight" in rest and "lm_head.weight" in rest
    assert "model.embed_tokens.weight" in rest
    assert all("norm" in n or n.endswith(("gate.weight", "e_score_correction_bias", "embed_tokens.weight",
                                           "lm_head.weight")) for n in rest), rest
    H, inter = PRESETS[preset]["hidden_size"], PRESETS[preset].get("moe_intermediate_size",
                                                                   PRESETS[preset]["intermediate_size"])
    up, down = ("w1", "w2") if preset == "minimax-m2" else ("gate_proj", "down_proj")
    assert fp8_scale_shape(fp8[f"model.layers.0.{moe}.experts.7.{up}.weight"]) == (math.ceil(inter / 128), H // 128)
    assert fp8_scale_shape(fp8[f"model.layers.0.{moe}.experts.7.{down}.weight"]) == (H // 128, math.ceil(inter / 128))
    qc = QuantizationConfig.resolve(fp8_quantization_config(PRESETS[preset]["model_type"]), None, preset)
    assert qc.weight_block_size == (128, 128) and qc.from_checkpoint


def test_moe_writer_quantizes_each_expert(tmp_path, monkeypatch):
    """The writer's MoE path on MiniMax-M2's layout shrunk to 4 experts of 128 x 256 (no flag for it: a preset
    added for this test): every expert's w1 / w3 / w2 e4m3 with its scales, the router and the fp32 correction
    bias as they are without --fp8; config.json's fmt spelled as MiniMax-M2's release does."""
    tiny = dict(PRESETS["minimax-m2"], vocab_size=512, hidden_size=256, intermediate_size=128,
                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64, rotary_dim=32,
                num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256)
    monkeypatch.setitem(PRESETS, "tiny-minimax", tiny)
    path = make_checkpoint("tiny-minimax", str(tmp_path / "m"), tokenizer_vocab=300, fp8=True)
    t = _tensors(path)
    moe = "model.layers.0.block_sparse_moe"
    for e in range(4):
        for proj, shape in (("w1", (128, 256)), ("w3", (128, 256)), ("w2", (256, 128))):
            w, s = t[f"{moe}.experts.{e}.{proj}.weight"], t[f"{moe}.experts.{e}.{proj}.weight_scale_inv"]
            assert w.dtype == torch.float8_e4m3fn and tuple(w.shape) == shape
            assert s.dtype == torch.float32 and tuple(s.shape) == fp8_scale_shape(shape)
    assert t[f"{moe}.gate.weight"].dtype == torch.bfloat16
    assert t[f"{moe}.e_score_correction_bias"].dtype == torch.float32
    assert not any(n.startswith(f"{moe}.gate.") and n.endswith("scale_inv") for n in t)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["fmt"] == "float8_e4m3fn" and "e_score_correction_bias" in qc["modules_to_not_convert"]
    assert QuantizationConfig.resolve(qc, None, str(path)).weight_block_size == (128, 128)


def test_config_only_directory_loads_with_dummy_weights(tmp_path):
    """--config-only --fp8: config.json with the quantization_config and the tokenizer, no weight files; the
    engine's --load-format dummy builds the FP8 model from it and generates (an ordinary load refuses it)."""
    from gyrfalcon import LLM, SamplingParams
    from gyrfalcon.layers.quantization import is_quantized

    path = make_checkpoint("qwen3-0.6b", str(tmp_path / "cfg"), num_layers=2, fp8=True, config_only=True)
    assert not list(path.glob("*.safetensors*"))
    assert json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    assert (path / "tokenizer.json").exists() and (path / "generation_config.json").exists()
    with pytest.raises(FileNotFoundError, match="No \\*.safetensors"):
        LLM(str(path))
    llm = LLM(str(path), load_format="dummy", block_size=8, max_model_len=128)
    assert sum(is_quantized(m) for m in llm.engine.runner.model.modules()) == 8  # 4 per layer
    out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_cli_flag_reaches_the_writer(monkeypatch, tmp_path):
    import gyrfalcon.bench.make_checkpoint as mk
    from gyrfalcon.cli import build_parser

    calls = []
    monkeypatch.setattr(mk, "make_checkpoint", lambda *a, **kw: calls.append((a, kw)) or tmp_path)
    for flags in ([], ["--fp8"], ["--config-only"]):
        args = build_parser().parse_args(["bench", "make-checkpoint", "--preset", "minimax-m2", "--out",
                                          str(tmp_path), "--num-layers", "2", *flags])
        assert args.func(args) == 0
    assert [(kw["fp8"], kw["config_only"]) for _, kw in calls] == [(False, False), (True, False), (False, True)]


def _meta_model(cfg, fp8: bool):
    """gyrfalcon's model of `cfg` on the meta device, built as models/loader.py builds it (FP8 linears under the
    preset's quantization_config when fp8; a vision-language config's language model, as config.py serves it)."""
    from gyrfalcon.config import language_model_config
    from gyrfalcon.layers.quantization import fp8_scope, prepare_model
    from gyrfalcon.models.registry import resolve_model_class

    qc = fp8_quantization_config(cfg.model_type) if fp8 else None
    cfg = language_model_config(cfg)
    with torch.device("meta"), fp8_scope(tuple(qc["weight_block_size"]) if fp8 else None):
        model = resolve_model_class(cfg)(cfg, max_position=64)
    if fp8:
        prepare_model(model, qc["modules_to_not_convert"], torch.bfloat16)
    return model


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("preset", ["deepseek-v3", "deepseek-v3.2"])
def test_deepseek_presets_fill_the_model(preset, fp8):
    """The DeepSeek presets' tensors, names and shapes as the writer puts them on disk (two layers of the real dims
    on the meta device: the dense first layer and an MoE layer; with --fp8 each selected weight e4m3 plus its
    weight_scale_inv), fill gyrfalcon's model exactly through the loader's scale routing: every expected weight and
    scale, nothing left over. V3.2's indexer: wq_b / wk quantized, weights_proj not (fp32 in the model)."""
    from gyrfalcon.layers.dsa_indexer import LightningIndexer
    from gyrfalcon.layers.mlp import GatedMLP
    from gyrfalcon.layers.moe import SparseMoE
    from gyrfalcon.models.loader import route_scales

    cfg = build_config(preset, num_layers=2)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim, cfg.v_head_dim) == (7168, 128, 1536, 512, 128, 64, 128)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.moe_intermediate_size,
            cfg.intermediate_size, cfg.routed_scaling_factor,
            cfg.vocab_size) == (256, 8, 8, 4, 2048, 18432, 2.5, 129280)
    assert cfg.first_k_dense_replace == 1 and cfg.rope_parameters["factor"] == 40.0
    entries = _entries_of(cfg)
    names = [n for n, _ in entries]
    assert "model.layers.1.mlp.experts.255.down_proj.weight" in names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names  # on the router, as DeepSeek saves it
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in names
    tensors = []
    for n, shape in entries:
        if fp8 and is_fp8_weight(n, shape, cfg.model_type):
            tensors += [(n, torch.empty(shape, device="meta", dtype=torch.float8_e4m3fn)),
                        (f"{n}_scale_inv", torch.empty(fp8_scale_shape(shape), device="meta"))]
        else:
            tensors.append((n, torch.empty(shape, device="meta")))
    model = _meta_model(cfg, fp8)
    scales: set = set()
    loaded = model.load_weights(route_scales(model, tensors, scales))
    assert model.expected_weights() == loaded | scales
    # The linears' scales went to their Linear (scales), the experts' to the stacked experts (load_weights).
    assert len(scales) == (16 + 4 * (preset == "deepseek-v3.2")) * fp8  # 5 MLA (+ 2 indexer) per layer, dense MLP
    assert any("experts.w13" in n and "scale" in n for n in loaded) == fp8
    layers = model.model.layers
    assert [type(layer.mlp) for layer in layers] == [GatedMLP, SparseMoE]
    indexer = layers[1].self_attn.indexer
    if preset == "deepseek-v3":
        assert indexer is None
        return
    assert isinstance(indexer, LightningIndexer) and (indexer.n_heads, indexer.head_dim, indexer.index_topk) == (
        64, 128, 2048)
    assert indexer.weights_proj.weight.dtype == torch.float32
    fp8_names = {n for n, s in entries if is_fp8_weight(n, s, cfg.model_type)}
    assert "model.layers.1.self_attn.indexer.wq_b.weight" in fp8_names
    assert "model.layers.1.self_attn.indexer.wk.weight" in fp8_names
    assert "model.layers.1.self_attn.indexer.weights_proj.weight" not in fp8_names
    assert "model.layers.1.self_attn.kv_b_proj.weight" in fp8_names
    assert "model.layers.1.mlp.gate.weight" not in fp8_names
    assert len(fp8_names) == 2 * 5 + 2 * 2 + 3 + 256 * 3 + 3  # MLA + indexer per layer, dense MLP, experts, shared
    if fp8:  # wq_b / wk are shards of MLA's GEMMs (layers/mla.py)
        attn = layers[1].self_attn
        assert attn.fused_q_b_proj.quant_block == (128, 128)
        assert attn.fused_qkv_a_proj.weight.dtype == torch.float8_e4m3fn and "wk" in attn.fused_qkv_a_proj.shards


def _entries_of(cfg):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        state = AutoModelForCausalLM.from_config(cfg).state_dict()
    return [e for n, t in state.items() for e in checkpoint_entries(cfg.model_type, n, t.shape)]


def test_deepseek_config_only_is_the_bench_slice(tmp_path):
    """--config-only --fp8 --num-layers 5 for deepseek-v3.2 (what the GPU run loads with --load-format dummy): the
    real dims, the first layer dense and four MoE layers, the indexer, the FP8 quantization_config keeping the
    indexer's weights_proj unquantized; gyrfalcon resolves and builds it."""
    from transformers import AutoConfig

    from gyrfalcon.layers.mlp import GatedMLP
    from gyrfalcon.layers.moe import SparseMoE

    path = make_checkpoint("deepseek-v3.2", str(tmp_path / "ds"), num_layers=5, fp8=True, config_only=True,
                           tokenizer_vocab=300)
    assert not list(path.glob("*.safetensors*"))
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["DeepseekV32ForCausalLM"] and raw["num_hidden_layers"] == 5
    assert raw["mlp_layer_types"] == ["dense"] + ["sparse"] * 4
    assert (raw["index_n_heads"], raw["index_head_dim"], raw["index_topk"]) == (64, 128, 2048)
    qc = raw["quantization_config"]
    assert "weights_proj" in qc["modules_to_not_convert"] and qc["fmt"] == "e4m3"
    assert QuantizationConfig.resolve(qc, None, str(path)).weight_block_size == (128, 128)
    cfg = AutoConfig.from_pretrained(str(path))
    model = _meta_model(cfg, fp8=True)
    assert [type(layer.mlp) for layer in model.model.layers] == [GatedMLP] + [SparseMoE] * 4


def test_deepseek_writer_fp8_loads_and_generates(tmp_path, monkeypatch):
    """The writer's DeepSeek path on deepseek-v3.2 shrunk to 2 layers of 256 wide (a preset added for this test; shards
    and MLA projections multiples of the 128-row block): MLA, indexer wq_b / wk, dense MLP, shared and routed experts
    e4m3 with scales; weights_proj, the router and its fp32 correction bias (on the gate, as DeepSeek saves it) not.
    gyrfalcon loads the directory (FP8 linears, kv_b_proj dequantized for absorption) and generates."""
    from gyrfalcon import LLM, SamplingParams
    from gyrfalcon.layers.quantization import is_quantized

    tiny = dict(PRESETS["deepseek-v3.2"], vocab_size=512, hidden_size=256, intermediate_size=128,
                moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64,
                n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, index_n_heads=2,
                index_head_dim=128, index_topk=4, max_position_embeddings=4096 * 40)
    monkeypatch.setitem(PRESETS, "tiny-deepseek-v3.2", tiny)
    path = make_checkpoint("tiny-deepseek-v3.2", str(tmp_path / "d"), tokenizer_vocab=300, fp8=True, lm_head_std=0.1)
    t = _tensors(path)
    attn, moe = "model.layers.1.self_attn", "model.layers.1.mlp"
    for n in (f"{attn}.kv_b_proj.weight", f"{attn}.indexer.wq_b.weight", f"{attn}.indexer.wk.weight",
              f"{moe}.experts.3.down_proj.weight", f"{moe}.shared_experts.gate_proj.weight",
              "model.layers.0.mlp.up_proj.weight"):
        assert t[n].dtype == torch.float8_e4m3fn and t[f"{n}_scale_inv"].shape == fp8_scale_shape(t[n].shape), n
    assert t[f"{attn}.indexer.weights_proj.weight"].dtype == torch.bfloat16
    assert t[f"{moe}.gate.weight"].dtype == torch.bfloat16
    assert t[f"{moe}.gate.e_score_correction_bias"].dtype == torch.float32
    llm = LLM(str(path), block_size=4, max_model_len=64)
    model = llm.engine.runner.model
    assert is_quantized(model.model.layers[1].self_attn.fused_q_b_proj)  # wq_b's shard beside q_b_proj
    assert model.model.layers[1].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    out = llm.generate([list(range(3, 15))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4
    assert all(math.isfinite(lp.logprob) for step in out.logprobs for lp in step.values())


def _meta_tensors(entries, model_type, fp8):
    """The writer's tensors as meta tensors: with fp8 each selected weight e4m3 plus its weight_scale_inv."""
    out = []
    for n, shape in entries:
        if fp8 and is_fp8_weight(n, shape, model_type):
            out += [(n, torch.empty(shape, device="meta", dtype=torch.float8_e4m3fn)),
                    (f"{n}_scale_inv", torch.empty(fp8_scale_shape(shape), device="meta"))]
        else:
            out.append((n, torch.empty(shape, device="meta")))
    return out


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("preset", ["qwen3-next-80b-a3b", "qwen3.5-397b-a17b"])
def test_hybrid_presets_fill_the_model(preset, fp8):
    """4 layers of the hybrid presets' real dims (one block: 3 Gated DeltaNet + 1 gated attention), names and shapes
    as the writer puts them on disk, fill gyrfalcon's model exactly on the meta device: every expected weight and
    scale, nothing left over. Qwen3.5 in its release layout: `model.language_model.*`, flat GDN projections, experts
    packed in bf16 and one by one with scales in FP8; Qwen3-Next's grouped GDN projections and experts one by one.
    FP8: the GDN's b / a (and Qwen3-Next's grouped) projections, the conv and the shared-expert gate stay unquantized."""
    from gyrfalcon.layers.gated_deltanet import GatedDeltaNet
    from gyrfalcon.layers.moe import SparseMoE
    from gyrfalcon.layers.quantization import is_quantized
    from gyrfalcon.layers.self_attention import RotarySelfAttention
    from gyrfalcon.models.loader import route_scales

    cfg = build_config(preset, num_layers=4)
    text = cfg.get_text_config()
    qwen35 = preset == "qwen3.5-397b-a17b"
    dims = (text.hidden_size, text.num_attention_heads, text.num_key_value_heads, text.head_dim,
            text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim, text.num_experts,
            text.num_experts_per_tok, text.moe_intermediate_size, text.shared_expert_intermediate_size, text.vocab_size)
    assert dims == ((4096, 32, 2, 256, 16, 64, 128, 512, 10, 1024, 1024, 248320) if qwen35 else
                    (2048, 16, 2, 256, 16, 32, 128, 512, 10, 512, 512, 151936))
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"] and text.num_hidden_layers == 4
    assert text.rope_parameters["partial_rotary_factor"] == 0.25 and text.rope_parameters["rope_theta"] == 1e7
    entries = disk_entries(cfg, fp8)
    names = {n for n, _ in entries}
    pre = "model.language_model.layers" if qwen35 else "model.layers"
    gdn = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a") if qwen35 else ("in_proj_qkvz", "in_proj_ba")
    assert {f"{pre}.2.linear_attn.{p}.weight" for p in gdn} <= names and "lm_head.weight" in names
    assert not any(n.startswith(("model.visual.", "mtp.")) for n in names)
    assert f"{pre}.3.self_attn.q_proj.weight" in names and f"{pre}.3.mlp.shared_expert_gate.weight" in names
    per_expert = f"{pre}.3.mlp.experts.511.down_proj.weight" in names
    assert per_expert == (fp8 or not qwen35)
    assert (f"{pre}.3.mlp.experts.gate_up_proj" in names) == (qwen35 and not fp8)
    fp8_names = {n for n, s in entries if is_fp8_weight(n, s, cfg.model_type)}
    kept = ({f"{pre}.0.linear_attn.in_proj_{p}.weight" for p in "ab"} if qwen35
            else {f"{pre}.0.linear_attn.in_proj_{p}.weight" for p in ("qkvz", "ba")})
    assert not kept & fp8_names and f"{pre}.0.mlp.shared_expert_gate.weight" not in fp8_names
    assert f"{pre}.0.linear_attn.out_proj.weight" in fp8_names and f"{pre}.3.self_attn.o_proj.weight" in fp8_names
    if qwen35:
        assert f"{pre}.0.linear_attn.in_proj_qkv.weight" in fp8_names
    model = _meta_model(cfg, fp8)
    scales: set = set()
    loaded = model.load_weights(route_scales(model, _meta_tensors(entries, cfg.model_type, fp8), scales))
    assert model.expected_weights() == loaded | scales
    layers = model.model.layers
    assert [type(layer.self_attn) for layer in layers] == [GatedDeltaNet] * 3 + [RotarySelfAttention]
    assert all(isinstance(layer.mlp, SparseMoE) for layer in layers)
    assert layers[0].self_attn.in_proj_qkvz.weight.shape == (2 * 16 * 128 + 2 * text.linear_num_value_heads * 128,
                                                            text.hidden_size)
    assert layers[3].self_attn.rotary_emb.rotary_dim == 64
    g = layers[0].self_attn
    assert is_quantized(g.in_proj_qkvz) == (fp8 and qwen35) and not is_quantized(g.in_proj_ba)
    assert is_quantized(g.out_proj) == fp8 and is_quantized(layers[0].mlp.experts) == fp8
    assert not is_quantized(layers[0].mlp.shared_expert_gate)


def test_qwen35_config_only_is_the_bench_slice(tmp_path):
    """--config-only --fp8 --num-layers 4 for qwen3.5-397b-a17b (what the GPU run loads with --load-format dummy):
    config.json in the release's nesting (text_config cut to one block, the quantization_config at the top);
    gyrfalcon serves its text config and builds the model from it."""
    from gyrfalcon.config import ModelConfig
    from gyrfalcon.layers.quantization import is_quantized

    path = make_checkpoint("qwen3.5-397b-a17b", str(tmp_path / "q"), num_layers=4, fp8=True, config_only=True,
                           tokenizer_vocab=300)
    assert not list(path.glob("*.safetensors*"))
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and "num_hidden_layers" not in raw
    assert raw["text_config"]["num_hidden_layers"] == 4 and raw["text_config"]["hidden_size"] == 4096
    assert {"in_proj_a", "in_proj_b", "shared_expert_gate"} <= set(raw["quantization_config"]["modules_to_not_convert"])
    mc = ModelConfig(str(path), load_format="dummy")
    mc.resolve("cpu")
    assert mc.max_model_len == 262144 and mc.quant_config.weight_block_size == (128, 128)
    assert mc.eos_token_ids(None) == [json.loads((path / "generation_config.json").read_text())["eos_token_id"]]
    from transformers import AutoConfig
    model = _meta_model(AutoConfig.from_pretrained(str(path)), fp8=True)
    assert len(model.model.layers) == 4 and is_quantized(model.model.layers[3].self_attn.qkv_proj)


# The hybrid presets shrunk to 4 layers of 256 wide (FP8-aligned: every fused shard a multiple of 128 rows).
_TINY_HYBRID = dict(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=128, linear_num_key_heads=1, linear_num_value_heads=2,
                    linear_key_head_dim=64, linear_value_head_dim=64, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=128, shared_expert_intermediate_size=128, max_position_embeddings=4096)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("preset", ["qwen3-next-80b-a3b", "qwen3.5-397b-a17b"])
def test_hybrid_writer_loads_in_transformers_and_gyrfalcon(preset, fp8, tmp_path, monkeypatch):
    """The writer's hybrid path on the presets shrunk (presets added for this test), fp32: transformers reads the
    directory with every language-model tensor found (Qwen3.5: only the vision tower, which the writer leaves out,
    missing) and gyrfalcon generates its greedy tokens; with --fp8 gyrfalcon loads the e4m3 weights and scales."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeForConditionalGeneration

    from gyrfalcon import LLM, SamplingParams

    spec = dict(PRESETS[preset])
    if "text_config" in spec:
        spec["text_config"] = dict(spec["text_config"], **_TINY_HYBRID)
        spec["vision_config"] = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=256)
    else:
        spec.update(_TINY_HYBRID, intermediate_size=128)
    monkeypatch.setitem(PRESETS, "tiny-hybrid", spec)
    path = make_checkpoint("tiny-hybrid", str(tmp_path / "h"), dtype="float32", tokenizer_vocab=300,
                           lm_head_std=0.1, std=0.05, fp8=fp8)
    prompt = list(range(3, 90))  # past one 64-token chunk of the delta rule
    llm = LLM(str(path), block_size=8, max_model_len=256)
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert len(got) == 6
    if fp8:
        from gyrfalcon.layers.quantization import is_quantized

        t = _tensors(path)
        assert any(v.dtype == torch.float8_e4m3fn for v in t.values())
        gdn = llm.engine.runner.model.model.layers[0].self_attn
        assert is_quantized(gdn.out_proj) and is_quantized(gdn.in_proj_qkvz) == (preset == "qwen3.5-397b-a17b")
        return
    if preset == "qwen3.5-397b-a17b":
        model, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32,
                                                                         output_loading_info=True)
    else:
        model, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    assert all(k.startswith("model.visual.") for k in info["missing_keys"]), info["missing_keys"]
    assert not info["unexpected_keys"]
    want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert got == want
