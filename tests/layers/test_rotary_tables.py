"""RoPE frequency tables (default, linear, llama3, YaRN) against transformers' own computation."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from gyrfalcon.layers.rotary import compute_inv_freq, rope_parameters_of

CASES = [
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6},
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: p["rope_type"] + str(p["factor"]))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_inv_freq_matches_transformers(params, head_dim):
    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                      max_position_embeddings=131072, rope_scaling=dict(params))
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    inv, scale = compute_inv_freq(head_dim, rope_parameters_of(cfg), cfg.max_position_embeddings)
    torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_default_rope():
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=10000.0)
    inv, scale = compute_inv_freq(64, rope_parameters_of(cfg), 4096)
    torch.testing.assert_close(inv, 1.0 / 10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    assert scale == 1.0


def test_unknown_rope_type():
    with pytest.raises(ValueError, match="Unsupported rope_type 'longrope'"):
        compute_inv_freq(64, {"rope_type": "longrope", "rope_theta": 1e4}, 4096)
