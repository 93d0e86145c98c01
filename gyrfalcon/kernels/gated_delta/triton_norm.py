"""The Gated DeltaNet output norm fused with its gate in one launch: rms_norm(x) * w * silu(z) per head
(gated_rms_norm_ref's contract).

x is the delta rule's output [T, HV, dv]; z is a slice of in_proj_qkvz's output viewed as [T, HV, dv], whose token
stride is the projection's row, not HV * dv: the kernel reads both through (token, head) strides instead of
copying z into a dense tensor first.
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import HAS_TRITON, next_pow2, tl, triton
from gyrfalcon.kernels.gated_delta import configs

if HAS_TRITON:

    @triton.jit
    def _gated_norm_kernel(x_ptr, z_ptr, w_ptr, o_ptr, N, NH, D, sx_0, sx_1, sz_0, sz_1, so_0, so_1, eps,
                           BR: tl.constexpr, BD: tl.constexpr):
        # Grid: (cdiv(N, BR),). Rows r = (r // NH, r % NH) of [N / NH, NH, D] views of x, z and the output.
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rm = rows < N
        r0 = (rows // NH).to(tl.int64)
        r1 = (rows % NH).to(tl.int64)
        ds = tl.arange(0, BD)
        m = rm[:, None] & (ds < D)[None, :]
        x = tl.load(x_ptr + (r0 * sx_0 + r1 * sx_1)[:, None] + ds[None, :], mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + (r0 * sz_0 + r1 * sz_1)[:, None] + ds[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + ds, mask=ds < D, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        y = x * rstd[:, None] * w[None, :] * (z / (1.0 + tl.exp(-z)))
        tl.store(o_ptr + (r0 * so_0 + r1 * so_1)[:, None] + ds[None, :], y.to(o_ptr.dtype.element_ty), mask=m)


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """[..., D] -> a [N0, N1, D] view with unit last stride (a copy only where no such view exists)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 3:
        return t
    try:
        return t.view(-1, t.shape[-2], t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-2], t.shape[-1])


def gated_rms_norm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """gated_rms_norm_ref's contract: x, z [..., dv] (z may be a strided view) -> [..., dv] in x's dtype."""
    assert x.shape == z.shape and weight.shape == x.shape[-1:], (x.shape, z.shape, weight.shape)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    xv, zv, ov = _rows_view(x), _rows_view(z), _rows_view(out)
    N0, N1, D = xv.shape
    N = N0 * N1
    br = configs.GATED_NORM_ROWS
    _gated_norm_kernel[(triton.cdiv(N, br),)](
        xv, zv, weight, ov, N, N1, D, xv.stride(0), xv.stride(1), zv.stride(0), zv.stride(1), ov.stride(0),
        ov.stride(1), float(eps), BR=br, BD=next_pow2(D), num_warps=configs.GATED_NORM_NUM_WARPS)
    return out
