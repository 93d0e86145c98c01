"""Shared helpers for tests/kernels (imported by the test modules; conftest.py sets interpreter mode)."""

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")



def _triton_status() -> str:
    """'' when the Triton kernels can run here, else why not."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # pragma: no cover
        return "triton not installed"
    if HAS_CUDA:
        return ""

    # Without a GPU the interpreter must have been on when triton was FIRST imported (triton's own
    # @jit helpers such as tl.sum are built then); probe a tiny kernel to find out.
    @triton.jit
    def _probe(x_ptr):
        tl.store(x_ptr, tl.sum(tl.load(x_ptr + tl.arange(0, 2)), axis=0))

    try:
        x = torch.ones(2)
        _probe[(1,)](x)
        assert x[0].item() == 2.0
    except Exception:
        return ("triton was imported before TRITON_INTERPRET=1 was set; set it in tests/conftest.py "
                "(or the environment) before anything imports triton")
    return ""


TRITON_STATUS = _triton_status()
HAS_TRITON = TRITON_STATUS == ""
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason=TRITON_STATUS)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (atol, rtol) for comparing a kernel with its reference at the given dtype. The interpreter
# truncates fp32 -> bf16 where the GPU rounds to nearest, so bf16 allows a couple of ulps.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
# Attention: half-precision kernels round the softmax probabilities to the model dtype before P @ V.
ATTN_TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, head_dim_v=None,
                  extra_blocks=3, table_width=None, fill=0, device=DEVICE):
    """Random dense K/V per sequence scattered into shuffled cache blocks.

    Returns (k_cache, v_cache, block_tables int32, dense_k list, dense_v list). Unused block-table
    entries hold `fill`; cache slots past each sequence's end hold random junk (must be ignored).
    """
    head_dim_v = head_dim_v or head_dim
    n_blocks_per = [-(-s // block_size) for s in seq_lens]
    total = sum(n_blocks_per) + extra_blocks
    width = table_width or max(1, max(n_blocks_per, default=1))
    k_cache = torch.randn(total, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    v_cache = torch.randn(total, block_size, num_kv_heads, head_dim_v, device=device).to(dtype)
    perm = torch.randperm(total).tolist()
    block_tables = torch.full((len(seq_lens), width), fill, dtype=torch.int32)
    dense_k, dense_v = [], []
    for i, s in enumerate(seq_lens):
        ids = [perm.pop() for _ in range(n_blocks_per[i])]
        block_tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        if ids:
            idx = torch.tensor(ids, device=device)
            dense_k.append(k_cache[idx].flatten(0, 1)[:s].clone())
            dense_v.append(v_cache[idx].flatten(0, 1)[:s].clone())
        else:
            dense_k.append(k_cache.new_zeros(0, num_kv_heads, head_dim))
            dense_v.append(v_cache.new_zeros(0, num_kv_heads, head_dim_v))
    return k_cache, v_cache, block_tables.to(device), dense_k, dense_v


def naive_causal_attention(q, k, v, scale):
    """Dense float64 attention of q [q_len, H, D] (the LAST q_len positions) over k, v [S, Hkv, D*]."""
    q_len, n_heads, _ = q.shape
    s = k.shape[0]
    group = n_heads // k.shape[1]
    kd = k.double().repeat_interleave(group, dim=1)  # [S, H, D]
    vd = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.double(), kd) * scale
    q_pos = torch.arange(s - q_len, s, device=q.device)[:, None]
    k_pos = torch.arange(s, device=q.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    return torch.einsum("hqs,shd->qhd", torch.softmax(scores, dim=-1), vd)


class LaunchSpy:
    """Stands in for a Triton kernel (monkeypatched over it): every launch records its keyword `key` (a constexpr,
    num_warps, ...) in .seen, then runs the real kernel."""

    def __init__(self, kernel, key: str):
        self.kernel, self.key, self.seen = kernel, key, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append(kw[self.key])
            return self.kernel[grid](*args, **kw)
        return launch
