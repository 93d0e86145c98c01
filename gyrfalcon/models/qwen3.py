"""Qwen3 dense: Llama's layers plus a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from gyrfalcon.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
