"""The block-scaled FP8 GEMM on a GPU at Llama-3.1-8B's linear shapes (qkv 6144 x 4096, o 4096 x 4096, gate_up
28672 x 4096, down 4096 x 14336) against its dequantizing reference, per-channel mode, CUDA-graph replay, and a
tiny FP8 checkpoint served on the GPU (bf16, CUDA graphs) against the reference path. Run through
scripts/gpu/test.sh or `pytest tests/gpu/test_fp8_gpu.py`.

Written in a session whose device time was spent: not yet run on a GPU (the kernel's sm_90 compile is checked on
the CPU by tests/kernels/test_kernel_fp8_gemm.py); its first GPU run is the check."""

import json

import pytest
import torch

# Skip before importing the kernels: on a CPU-only run, importing triton here (before tests/kernels'
# conftest turns the interpreter on) would leave the interpreted CPU kernel tests unable to run.
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gyrfalcon.kernels.fp8_gemm import (dequantize_weight, fp8_block_gemm, fp8_block_gemm_ref,  # noqa: E402
                                        fp8_block_gemm_triton, fp8_weight_only_ref, quantize_weight_blockwise,
                                        quantize_weight_per_channel)

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _data(M, N, K, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
    w = torch.randn(N, K, device=DEV, generator=g) * K ** -0.5
    return x, w


def _check(y, ref, x, wd):
    """bf16 output (half an ulp: 2^-9 relative) over fp32 accumulations in different orders, plus the activations'
    e4m3 rounding, where the kernel's division and the reference's may fall on either side of a tie (each such
    element moves its term by 2^-4): 1% of the row's sum of |x_k w_k| covers many of them."""
    mag = x.float().abs() @ wd.abs().t()
    err = (y.float() - ref.float()).abs()
    assert (err <= 2 ** -8 * ref.float().abs() + 1e-2 * mag / 16 + 1e-3).all(), err.max()


@pytest.mark.parametrize("M", [1, 16, 64, 256, 1024])
@pytest.mark.parametrize("name", list(LLAMA_8B))
def test_block_gemm_llama8b_shapes(name, M):
    N, K = LLAMA_8B[name]
    x, w = _data(M, N, K)
    q, s = quantize_weight_blockwise(w)
    y = fp8_block_gemm_triton(x, q, s)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    _check(y, fp8_block_gemm_ref(x.float(), q, s), x, dequantize_weight(q, s))
    # against the unquantized activations: the e4m3 rounding's bound, 2^-4 of sum |x_k w_k| per element
    wd = dequantize_weight(q, s)
    bound = (x.float().abs() @ wd.abs().t()) / 16 + 2 ** -8 * y.float().abs() + 1e-3
    assert ((y.float() - fp8_weight_only_ref(x.float(), q, s)).abs() <= bound).all()


@pytest.mark.parametrize("M", [1, 200])
def test_edge_blocks_and_per_channel_on_gpu(M):
    for N, K in [(4000, 1000), (200, 4096)]:
        x, w = _data(M, N, K, seed=1)
        q, s = quantize_weight_blockwise(w)
        _check(fp8_block_gemm(x, q, s), fp8_block_gemm_ref(x.float(), q, s), x, dequantize_weight(q, s))
        q, s = quantize_weight_per_channel(w)
        _check(fp8_block_gemm(x, q, s, (1, K)), fp8_block_gemm_ref(x.float(), q, s, (1, K)), x,
               dequantize_weight(q, s, (1, K)))


def test_cuda_graph_replay():
    N, K = LLAMA_8B["o"]
    x, w = _data(8, N, K)
    q, s = quantize_weight_blockwise(w)
    static_x = x.clone()
    fp8_block_gemm(static_x, q, s)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_block_gemm(static_x, q, s)
    x2, _ = _data(8, N, K, seed=3)
    static_x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, fp8_block_gemm_ref(x2.float(), q, s), x2, dequantize_weight(q, s))


def test_fp8_checkpoint_on_gpu(tmp_path, monkeypatch):
    """A tiny Qwen3 block-quantized into the real format, served on the GPU in bf16 (CUDA graphs, the Triton
    kernel) and with GYRFALCON_KERNELS=ref (the dequantizing reference, eager): prefill logits within bf16's
    reach of each other and greedy decode completes."""
    from safetensors.torch import load_file, save_file

    from checkpoints import make_checkpoint
    from gyrfalcon import LLM, SamplingParams

    src = make_checkpoint(tmp_path / "src", "qwen3", hidden_size=320, intermediate_size=384, head_dim=64,
                          num_attention_heads=4, num_key_value_heads=2)
    t = load_file(str(src / "model.safetensors"))
    for name in list(t):
        if ".layers." in name and name.endswith("proj.weight"):
            t[name], t[name + "_scale_inv"] = quantize_weight_blockwise(t[name])
    save_file(t, str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic"}
    (src / "config.json").write_text(json.dumps(cfg))
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 7, 40)]
    llm = LLM(str(src), block_size=16, gpu_memory_utilization=0.3)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn
    del llm
    torch.cuda.empty_cache()
    monkeypatch.setenv("GYRFALCON_KERNELS", "ref")
    from gyrfalcon import envs
    envs.refresh()
    ref = LLM(str(src), block_size=16, gpu_memory_utilization=0.3, enforce_eager=True)
    ref_outs = ref.generate(prompts, sp, use_tqdm=False)
    # the first token's logprob (from the prefill) agrees to bf16 precision
    for o, r in zip(outs, ref_outs):
        a = o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob
        b = r.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob if o.outputs[0].token_ids[0] in \
            r.outputs[0].logprobs[0] else None
        assert b is not None and abs(a - b) < 0.1
