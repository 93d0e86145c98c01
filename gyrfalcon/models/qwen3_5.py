"""Qwen3.5 (Qwen3.5-397B-A17B and the other Qwen3_5MoeForConditionalGeneration releases; dense
Qwen3_5ForConditionalGeneration): Qwen3-Next's hybrid language model (models/qwen3_next.py: Gated DeltaNet in three of
every four layers, gated attention in the fourth, (1 + w) norms, partial RoPE) inside a vision-language checkpoint.
gyrfalcon serves the language model and skips the vision tower.

What differs from Qwen3-Next:
- the checkpoint: text weights under `model.language_model.*` (here `model.*`), the vision tower's `model.visual.*`
  and the MTP head's `mtp.*` skipped (mtp_weights hands the latter to the MTP proposer), lm_head at the top;
  config.json nests the text settings under text_config (config.py language_model_config serves those);
- the GDN input projections flat, in four tensors: in_proj_qkv and in_proj_z land as the shards of in_proj_qkvz,
  in_proj_b and in_proj_a as those of in_proj_ba (layers/gated_deltanet.py flat_projections);
- the RoPE is multimodal (rope_parameters' mrope_section: each rotary frequency reads the temporal, height or width
  position id). For text all three ids are the token's position, so every frequency reads the same one: plain
  partial RoPE over head_dim x partial_rotary_factor dims (rotary_attention) is exact;
- the MoE (Qwen3.5-MoE) in every layer, its router always renormalizing the top-k (no mlp_only_layers,
  decoder_sparse_step nor norm_topk_prob in the config); the dense Qwen3.5 a SwiGLU MLP in every layer.

The bf16 releases store the routed experts packed, `experts.gate_up_proj` [E, 2I, hidden] (each expert's gate rows,
then its up rows) and `experts.down_proj` [E, hidden, I]; transformers' save_pretrained and the FP8 releases store
them one by one (`experts.<e>.gate_proj.weight`, ... with weight_scale_inv). Both load: packed tensors are cut into
per-expert views here and stacked into the same w13 / w2 (layers/moe.py).
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator, Set, Tuple

import torch

from gyrfalcon.distributed import CheckpointSlice
from gyrfalcon.layers.mlp import GatedMLP
from gyrfalcon.models.qwen3_next import Qwen3NextForCausalLM

# The flat GDN projections as shards of the layer's two fused ones; before Qwen3-Next's `linear_attn` rename, which
# the rest of the layer's tensors take (CausalLM.load_weights applies the first entry that matches).
FLAT_GDN_PARAMS = (
    (".linear_attn.in_proj_qkv.", ".self_attn.in_proj_qkvz.", "qkv"),
    (".linear_attn.in_proj_z.", ".self_attn.in_proj_qkvz.", "z"),
    (".linear_attn.in_proj_b.", ".self_attn.in_proj_ba.", "b"),
    (".linear_attn.in_proj_a.", ".self_attn.in_proj_ba.", "a"),
)
_TEXT_PREFIX = "model.language_model."
_SKIPPED = ("model.visual.", "mtp.")
_PACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def text_weights(weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
    """A Qwen3.5 checkpoint's tensors as the language model's: `model.language_model.x` -> `model.x` (a text-only
    save, `model.x`, passes as it is), vision tower and MTP head dropped, packed experts
    (gate_up_proj [E, 2I, H], down_proj [E, H, I]) cut into per-expert gate_proj / up_proj [I, H] and
    down_proj [H, I] views."""
    for name, tensor in weights:
        if name.startswith(_SKIPPED):
            continue
        if name.startswith(_TEXT_PREFIX):
            name = "model." + name[len(_TEXT_PREFIX):]
        yield from unpack_experts(name, tensor)


def unpack_experts(name: str, tensor) -> Iterator[Tuple[str, torch.Tensor]]:
    """One checkpoint tensor as the loader takes it: packed experts cut into per-expert views, others as they are."""
    packed = _PACKED_EXPERTS.match(name)
    if packed is None:
        yield name, tensor
        return
    prefix, kind = packed.groups()
    if tensor.dim() != 3:
        raise ValueError(f"Checkpoint tensor {name!r}: packed experts must be 3-D [experts, rows, cols], got "
                         f"shape {tuple(tensor.shape)}.")
    half = tensor.shape[1] // 2
    for e in range(tensor.shape[0]):
        # (under tensor parallelism a CheckpointSlice: picked lazily, so a rank reads only its part of each
        # expert, and with expert parallelism none of another rank's experts)
        lazy = isinstance(tensor, CheckpointSlice)
        if kind == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", tensor.pick(e) if lazy else tensor[e]
        else:
            gate, up = (tensor.pick(e, 0, half), tensor.pick(e, half, half)) if lazy else tensor[e].chunk(2, dim=0)
            yield f"{prefix}.{e}.gate_proj.weight", gate
            yield f"{prefix}.{e}.up_proj.weight", up


class Qwen3_5MoeForConditionalGeneration(Qwen3NextForCausalLM):
    """config: the text config (Qwen3_5MoeTextConfig; config.py serves text_config). The vision tower is not
    built: text prompts only."""

    stacked_params = FLAT_GDN_PARAMS + Qwen3NextForCausalLM.stacked_params
    flat_gdn_projections = True

    @staticmethod
    def mtp_weights(weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
        """The MTP module's tensors (`mtp.*`, which load_weights drops) for the MTP proposer
        (spec_decode/mtp_qwen3_next.py), packed experts cut as the language model's are."""
        for name, tensor in weights:
            if name.startswith("mtp."):
                yield from unpack_experts(name, tensor)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        # The loader routes FP8 linears' weight_scale_inv by their checkpoint names before this sees them, which
        # `model.language_model.` hides from it: routed again here, under the language model's names.
        from gyrfalcon.models.loader import route_scales

        scales: Set[str] = set()
        return super().load_weights(route_scales(self, text_weights(weights), scales)) | scales


class Qwen3_5ForConditionalGeneration(Qwen3_5MoeForConditionalGeneration):
    """Dense Qwen3.5 (Qwen3_5TextConfig): a SwiGLU MLP of intermediate_size in every layer."""

    def build_mlp(self, config, layer_idx: int):
        return GatedMLP(config.hidden_size, config.intermediate_size)
