"""Greedy argmax on a GPU at real vocabularies (Llama-3 128,256; Qwen 151,936): the Triton kernel and the
dispatcher against torch.argmax, bitwise, including ties, NaN and a CUDA-graph capture."""

import pytest
import torch

# Skip before importing the kernels (see test_kernels_gpu.py: triton must not be imported before
# tests/kernels' conftest turns the interpreter on in a CPU-only run).
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from gyrfalcon.kernels.argmax import TORCH_MIN_ROWS, greedy_argmax, greedy_argmax_triton  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [128256, 151936])
@pytest.mark.parametrize("S", [1, 16, 64])
def test_greedy_argmax_real_vocab(S, V, dtype):
    g = torch.Generator(device=DEV).manual_seed(S + V)
    x = (torch.randn(S, V, device=DEV, generator=g) * 5).to(dtype)
    assert torch.equal(greedy_argmax_triton(x), x.argmax(dim=-1))
    assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))
    # Ties everywhere (bf16 / small integers), and planted ones across chunk boundaries.
    t = torch.randint(-20, 21, (S, V), device=DEV, generator=g).to(dtype)
    t[:, [4095, 4096, 8192, V - 1]] = 50
    t[-1, :] = float("-inf")
    t[0, V - 1] = 60  # row 0: the last element
    assert torch.equal(greedy_argmax_triton(t), t.argmax(dim=-1))
    if S > 1:
        t[1, [3, 90000]] = float("nan")
        assert torch.equal(greedy_argmax_triton(t), t.argmax(dim=-1))


@pytest.mark.parametrize("block,min_chunk,warps", [(1024, 2048, 4), (2048, 4096, 4), (4096, 16384, 8),
                                                   (8192, 8192, 8)])
def test_greedy_argmax_launch_shapes(block, min_chunk, warps):
    x = torch.randint(-5, 6, (16, 151936), device=DEV).float()
    got = greedy_argmax_triton(x, block=block, min_chunk=min_chunk, num_warps=warps)
    assert torch.equal(got, x.argmax(dim=-1))


def test_greedy_argmax_many_rows_and_graph():
    x = torch.randn(TORCH_MIN_ROWS + 3, 32000, device=DEV)
    assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))
    # Captured into a CUDA graph, then replayed on new logits in the same buffer.
    logits = torch.randn(4, 128256, device=DEV)
    greedy_argmax(logits)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = greedy_argmax(logits)
    for seed in range(3):
        logits.copy_(torch.randn(4, 128256, device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, logits.argmax(dim=-1))
