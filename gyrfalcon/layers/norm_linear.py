"""An RMSNorm and the linear layer it feeds, as one step that picks its kernels per batch.

A pre-norm block starts with norm(hidden + residual) -> linear. Three ways to run it, same math:
- "separate": the RMSNorm kernel (with the residual add fused), then the linear layer.
- "gemv": [residual add +] RMSNorm + GEMV (+ SiLU-and-mul) in one launch (kernels/gemv norm_gemv), for
  single rows, where it beats the norm kernel plus cuBLAS.
- "folded": the norm's weight was folded into the linear's at load (`fold_norms`), so the GEMM reads the
  un-normalized residual stream and its consumer (the fused qkv prep / decode attention, SiLU-and-mul) scales
  each row by its rstd: rms_norm(x) W^T = rstd(x) (x (W * w)^T). No norm launch; the block's output projection
  adds into the residual stream in place (add_to), so no add launch either.
`NormLinear.plan(rows)` chooses: gemv up to GEMV_MAX_ROWS rows, else folded once folded, else separate; the
unfused reference path (GYRFALCON_DISABLE_FUSION=1) is always separate, never folded.

The residual stream between blocks is (hidden, residual): hidden is the last block's output not yet added
(None when it was added in place: the folded form), residual the sum so far (None before the first block,
where hidden is the embedding).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import nn

from gyrfalcon import envs
from gyrfalcon.kernels.gemv import GEMV_MAX_ROWS, norm_gemv
from gyrfalcon.layers.activation import SiluAndMul
from gyrfalcon.layers.linear import Linear
from gyrfalcon.layers.norm import RMSNorm, fold_norm_into

SEPARATE, GEMV, FOLDED = "separate", "gemv", "folded"


class Normed(NamedTuple):
    """What a NormLinear hands its block. y: linear(norm(x)) [T, N] (after the activation when it has one;
    norm(x) without a linear). residual: the stream with the last block's output added. row_scale: (residual,
    eps) when y still needs each row scaled by its rstd (folded; the consumer applies it), else None. in_place:
    the block's output projection adds into residual (project_out)."""
    y: torch.Tensor
    residual: torch.Tensor
    row_scale: Optional[Tuple[torch.Tensor, float]]
    in_place: bool


def norm_stream(norm: RMSNorm, hidden: Optional[torch.Tensor],
                residual: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(norm(hidden + residual), hidden + residual) with either side absent (see the module docstring)."""
    if hidden is None:
        return norm(residual), residual
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


def project_out(proj: Linear, x: torch.Tensor, normed: Normed) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """A block's output projection -> the stream (hidden, residual) for the next block: proj(x) added into
    the residual in place when the block's input was folded (hidden None), else carried to the next norm."""
    if normed.in_place:
        return None, proj(x, add_to=normed.residual)
    return proj(x), normed.residual


class NormLinear(nn.Module):
    """norm -> linear [-> SiLU-and-mul] over the residual stream: forward(hidden, residual) -> Normed.

    The norm and the linear layer stay where their owners put them (the decoder layer's input_layernorm, the
    attention's qkv_proj: the checkpoint's names); this module holds them without registering them, and is
    itself the declaration that `fold_norms` looks for. act: a SiluAndMul applied to the linear's output (fused
    into the GEMV on the gemv path). linear None: the norm alone (a block whose input is no plain linear)."""

    def __init__(self, norm: RMSNorm, linear: Optional[Linear] = None, act: Optional[SiluAndMul] = None) -> None:
        super().__init__()
        self.__dict__["norm"] = norm  # held, not registered: one name per parameter
        self.__dict__["linear"] = linear
        self.__dict__["act"] = act
        fused = not envs.get().disable_fusion
        plain = linear is not None and linear.bias is None and norm.weight_offset == 0.0
        # The GEMV kernel takes no bias; a bias would also be scaled by the folded rstd.
        self._gemv = fused and plain and (act is None or isinstance(act, SiluAndMul))
        self._foldable = fused and plain
        self.folded = False  # set by fold_norms once the weights are folded

    def _plain_weight(self) -> bool:
        """The GEMV and the fold read a plain (bf16 / fp32) weight: not one quantized to FP8 (layers/quantization),
        which a checkpoint brings or `--quantization fp8` makes after the modules are built."""
        return getattr(self.linear, "quant_block", None) is None

    @property
    def gemv(self) -> bool:
        return self._gemv and self._plain_weight()

    @property
    def foldable(self) -> bool:
        return self._foldable and self._plain_weight()

    def plan(self, rows: int) -> str:
        """How a batch of `rows` rows runs: SEPARATE, GEMV or FOLDED (module docstring)."""
        if self.gemv and rows <= GEMV_MAX_ROWS:
            return GEMV
        return FOLDED if self.folded else SEPARATE

    def fold(self) -> None:
        """The norm's weight into the linear's (load time, after every weight is in place)."""
        if not self.foldable:
            raise ValueError("this norm cannot fold into its linear layer (bias, offset, or fusion disabled)")
        if not self.folded:
            fold_norm_into(self.linear.weight, self.norm)
            self.folded = True

    def forward(self, hidden: Optional[torch.Tensor], residual: Optional[torch.Tensor]) -> Normed:
        """hidden, residual: [T, hidden] each, or None (module docstring) -> Normed."""
        rows = (hidden if hidden is not None else residual).shape[0]
        mode = self.plan(rows)
        if mode == GEMV:
            x, res = (hidden, residual) if hidden is not None else (residual, None)
            y, new_res = norm_gemv(x, self.linear.weight, self.norm.weight, res, self.norm.eps,
                                   silu_mul=self.act is not None)
            return Normed(y, x if res is None else new_res, None, False)
        if mode == FOLDED:
            if hidden is not None:  # the stream arrives carried (not on the default paths): add it first
                residual = hidden if residual is None else residual + hidden
            y = self.linear(residual)
            row_scale = (residual, self.norm.eps)
            if self.act is not None:
                return Normed(self.act(y, row_scale), residual, None, True)
            return Normed(y, residual, row_scale, True)
        x, residual = norm_stream(self.norm, hidden, residual)
        if self.linear is not None:
            x = self.linear(x)
        if self.act is not None:
            x = self.act(x)
        return Normed(x, residual, None, False)


def fold_norms(model: nn.Module) -> int:
    """The load-time pass: every NormLinear of `model` that can fold its norm into its linear layer does
    (with fusion disabled none can: that is the unfused reference path). Returns how many folded."""
    n = 0
    for m in model.modules():
        if isinstance(m, NormLinear) and m.foldable and not m.folded:
            m.fold()
            n += 1
    return n
