"""FP8 block-quantized checkpoints under tensor_parallel_size=2 over gloo (two worker processes on the CPU) against one
process on the same checkpoint, every decoder projection and expert in e4m3 with 128 x 128 weight_scale_inv blocks
(the real checkpoints' format): a tiny Qwen3-MoE with expert parallelism (each rank loads only its experts' scales;
q / k / v, o_proj and the dense MLP split by block rows / columns) and a tiny DeepSeek-V3 with the experts split
inside each expert (block rows of w13's scales, block columns of w2's; MLA's q_b / kv_b by head, the replicated
q_a / kv_a fused projection whole, the shared expert). The same greedy tokens and every step's distribution within
fp32 tolerance. The rank shapes are whole blocks (256 = 2 x 128 rows or columns wherever a tensor splits); a shard
off the block grid is refused before anything loads (the unit tests at the end, which set the rank by hand)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import make_deepseek_checkpoint, make_moe_checkpoint
from gyrfalcon import LLM, SamplingParams
from gyrfalcon.distributed import parallel_state
from gyrfalcon.kernels.fp8_gemm import quantize_weight_blockwise

KW = dict(block_size=8, max_model_len=128, device="cpu", dtype="float32", num_gpu_blocks_override=64,
          max_num_batched_tokens=32)
PROMPTS = [list(range(3, 43)), [7], [90, 91, 92, 93, 94, 95]]
MAX_NEW = 6
# config -> (checkpoint maker, extra engine arguments). Qwen3-MoE: 4 query and 4 K/V heads of 64 (256 rows each,
# 128 a rank), a dense layer and experts of 256 intermediate rows. DeepSeek-V3: 4 MLA heads of 64 + 64 (q_b / kv_b
# 512 rows, o_proj 256 columns), q_lora_rank 128 (the fused q_a / kv_a's first projection a whole block).
CONFIGS = {
    "qwen3moe-ep": (lambda p: make_moe_checkpoint(p, "qwen3_moe", hidden_size=64, num_attention_heads=4,
                                                  num_key_value_heads=4, head_dim=64, intermediate_size=256,
                                                  moe_intermediate_size=256),
                    dict(enable_expert_parallel=True)),
    "deepseek-v3-tp": (lambda p: make_deepseek_checkpoint(p, hidden_size=256, intermediate_size=256,
                                                          moe_intermediate_size=256, q_lora_rank=128,
                                                          qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64),
                       {}),
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
               "kv_a_proj_with_mqa", "kv_b_proj")
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def _quantize_in_place(src: Path) -> Path:
    """src's decoder projections (the experts' too) quantized in place, with the quantization_config."""
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if ".layers." in name and name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS:
                out[name], out[name + "_scale_inv"] = quantize_weight_blockwise(t)
            else:
                out[name] = t
        f.unlink()
    save_file(out, str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = dict(FP8_CONFIG)
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    return src


def _generate(llm, vocab):
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=vocab)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp8_tp2_matches_one_process(tmp_path, name):
    make, kw = CONFIGS[name]
    ckpt = _quantize_in_place(make(tmp_path / name))
    one = LLM(str(ckpt), **KW, **kw)
    experts = [m for m in one.engine.runner.model.modules() if hasattr(m, "w13")]
    assert experts and all(m.w13.dtype == torch.float8_e4m3fn for m in experts)
    vocab = one.engine.vocab_size
    want = _generate(one, vocab)
    del one, experts
    llm = LLM(str(ckpt), tensor_parallel_size=2, **KW, **kw)
    try:
        got = _generate(llm, vocab)
    finally:
        llm.engine.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for w, g in zip(want, got):
        assert len(g.logprobs) == MAX_NEW
        for step_w, step_g in zip(w.logprobs, g.logprobs):
            ids = sorted(step_w)
            torch.testing.assert_close(torch.tensor([step_g[i].logprob for i in ids]),
                                       torch.tensor([step_w[i].logprob for i in ids]), rtol=1e-4, atol=1e-4)


# ---- the shard checks and the scales' narrowing, on one rank of two set by hand --------------------------------
@pytest.fixture
def rank_1_of_2(monkeypatch):
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.ParallelState(1, 2))


def _fp8_layer(cls, *args):
    from gyrfalcon.layers.quantization import fp8_scope
    with fp8_scope((128, 128)):
        return cls(*args)


def test_rank_loads_its_scale_blocks(rank_1_of_2):
    from gyrfalcon.layers.linear import ColumnParallelLinear, MergedLinear, RowParallelLinear
    from gyrfalcon.layers.quantization.fp8 import check_tp_shards

    col = _fp8_layer(ColumnParallelLinear, 64, 512)  # 256 rows a rank: block rows 2, 3 of 4
    row = _fp8_layer(RowParallelLinear, 512, 64)  # 256 input columns a rank: block columns 2, 3 of 4
    merged = _fp8_layer(MergedLinear, 64, {"gate": 256, "up": 256})
    for m in (col, row, merged):
        check_tp_shards(m)
    scales = torch.arange(8, dtype=torch.float32)
    col.weight_loader(col.weight_scale_inv, scales.view(4, 2)[:, :1].contiguous())
    assert col.weight_scale_inv.view(-1).tolist() == [4.0, 6.0]
    row.weight_loader(row.weight_scale_inv, scales[:4].view(1, 4))
    assert row.weight_scale_inv.view(-1).tolist() == [2.0, 3.0]
    merged.weight_loader(merged.weight_scale_inv, torch.tensor([[1.0], [2.0]]), "gate")
    merged.weight_loader(merged.weight_scale_inv, torch.tensor([[3.0], [4.0]]), "up")
    assert merged.weight_scale_inv.view(-1).tolist() == [2.0, 4.0]


def test_shards_off_the_block_grid_are_refused(rank_1_of_2):
    from gyrfalcon.layers.linear import ColumnParallelLinear, RowParallelLinear
    from gyrfalcon.layers.moe import FusedExperts
    from gyrfalcon.layers.quantization.fp8 import check_expert_alignment, check_tp_shards

    with pytest.raises(ValueError, match="output rows of ColumnParallelLinear kv_b is 96, not a multiple of the 128"):
        check_tp_shards(_fp8_layer(ColumnParallelLinear, 64, 192), "kv_b")
    with pytest.raises(ValueError, match="input columns of RowParallelLinear o is 64, not a multiple of the 128"):
        check_tp_shards(_fp8_layer(RowParallelLinear, 128, 64), "o")
    with pytest.raises(ValueError, match="192 intermediate rows.*expert parallelism"):
        check_expert_alignment(_fp8_layer(FusedExperts, 4, 64, 192))
    from gyrfalcon.layers.gated_deltanet import FlatQKVZLinear
    with pytest.raises(ValueError, match="FlatQKVZLinear in_proj takes its shard from several parts"):
        check_tp_shards(_fp8_layer(FlatQKVZLinear, 64, (256, 256, 512), 512), "in_proj")
