"""The hidden states an EAGLE-3 draft is trained on, captured on the GPU (LLM.capture_hidden_states: eager prefills
with the fused kernels, fp32 and bf16), against transformers' hidden_states on the same GPU: the residual stream
entering the aux layers, and the final states' logits. The CPU twin is test_train_draft.py's
test_capture_and_training_forward_match_the_references; this one holds the GPU's fused path (add + RMSNorm folded
into the layers' kernels) to the same definition, since the shipped draft is trained on GPU captures and served on
both devices. Real Llama-3.1-8B width, 4 layers, aux layers 1, 2, 3."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from transformers import AutoModelForCausalLM  # noqa: E402

from gyrfalcon import LLM  # noqa: E402
from gyrfalcon.bench.common import random_prompts  # noqa: E402
from gyrfalcon.bench.make_checkpoint import make_checkpoint  # noqa: E402

AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint("llama-3.1-8b", tmp_path_factory.mktemp("cap"), num_layers=4, lm_head_std=0.1,
                           tokenizer_vocab=1024)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_states_are_transformers_hidden_states(ckpt, dtype):
    seqs = random_prompts(3, 200, 100000, 1)
    seqs[1] = seqs[1][:33]
    llm = LLM(str(ckpt), dtype=dtype, max_model_len=512, max_num_seqs=4, num_gpu_blocks_override=256)
    model = llm.engine.runner.model
    got = list(llm.capture_hidden_states(seqs, AUX, use_tqdm=False))
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=getattr(torch, dtype)).cuda().eval()
    # fp32: kernel-order differences only; bf16: each side rounds its own intermediates
    rtol, atol = (1e-3, 1e-3) if dtype == "float32" else (5e-2, 5e-2)
    with torch.no_grad():
        for seq, (aux, final) in zip(seqs, got):
            out = hf(torch.tensor([seq], device="cuda"), output_hidden_states=True)
            want = torch.cat([out.hidden_states[i][0] for i in AUX], -1).float()
            assert aux.shape == want.shape
            torch.testing.assert_close(aux.float().cuda(), want, rtol=rtol, atol=atol * want.abs().max().item())
            logits = model.compute_logits(final.cuda().to(model.model.norm.weight.dtype)).float()
            torch.testing.assert_close(logits, out.logits[0].float(), rtol=rtol,
                                       atol=atol * out.logits.abs().max().item())
