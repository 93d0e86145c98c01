"""GGUF checkpoints (llama.cpp's one-file format): the model config from the file's metadata, and its tensors
under gyrfalcon's (Hugging Face) checkpoint names, dequantized at load with the gguf package's own
dequantization. The tokenizer is built from the same file by transformers (gyrfalcon/tokenizer.py).

Facts about the format that the mapping relies on:
- Tensor names are `token_embd`, `output_norm`, `output` (absent: the LM head is tied to the embedding) and
  `blk.N.<piece>` per layer (attn_norm, attn_q / _k / _v / _output, attn_q_norm / attn_k_norm, ffn_norm,
  ffn_gate / _up / _down), each with `.weight` (and `.bias` where the model has one).
- A tensor's dims are listed innermost first: a linear weight [out, in] is stored as (in, out), and the reader's
  numpy view is already [out, in] (quantized: [out, bytes per row]), so no transpose is needed.
- llama.cpp's converter permutes the rows of q and k for the `llama` architecture (its RoPE rotates adjacent
  pairs of a head, Hugging Face's rotates the two halves): within each head, HF row (half h, index i) is written
  at (i, h). qwen2 / qwen3 files keep the HF order (their RoPE in llama.cpp is the halves form).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

# GGUF general.architecture -> the Hugging Face architecture gyrfalcon builds for it.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Tensor types dequantized at load (names of gguf.GGMLQuantizationType): floats, the legacy 32-wide blocks and
# the 256-wide k-quants; gguf.quants.dequantize implements each.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# rope_freqs: Llama 3.1's per-dimension RoPE divisors, which gguf_config turns back into rope_parameters.
_CONFIG_TENSORS = ("rope_freqs.weight",)


def is_gguf(path) -> bool:
    """A path to a GGUF file (vLLM's convention: the file itself, named *.gguf)."""
    return str(path).endswith(".gguf") and os.path.isfile(path)


@functools.lru_cache(maxsize=2)
def _open(path: str, size: int, mtime: float):
    from gguf import GGUFReader
    return GGUFReader(path)


def open_gguf(path):
    """The file's gguf.GGUFReader, one per file and process: parsing the metadata of a file with a 49k-token
    vocabulary takes seconds, and the config, the weights and the checks all read it."""
    path = os.path.abspath(str(path))
    st = os.stat(path)
    try:
        return _open(path, st.st_size, st.st_mtime)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


def metadata(reader, key: str, default: Any = None) -> Any:
    """A metadata value (a scalar, a string, or a list for arrays), or `default` when the key is absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _arch(reader, path) -> str:
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"Unsupported GGUF architecture {arch!r} in {path}; gyrfalcon loads GGUF files of "
                         f"architecture {', '.join(ARCHITECTURES)}.")
    return arch


def _tensor_shapes(reader) -> Dict[str, Tuple[int, ...]]:
    """name -> shape in PyTorch order ([out, in] for a linear weight)."""
    return {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}


def _one(value, what: str, path) -> int:
    """GGUF allows per-layer arrays for some counts (head_count_kv); gyrfalcon's dense models need one."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"GGUF {path}: {what} differs between layers ({sorted(set(value))}); gyrfalcon "
                             "supports one value for every layer.")
        value = value[0]
    return int(value)


# Llama 3.x's RoPE scaling besides its factor: every release uses these (HF rope_parameters names).
_LLAMA3_LOW, _LLAMA3_HIGH, _LLAMA3_ORIGINAL = 1.0, 4.0, 8192


def _llama3_rope(freqs, theta: float, head_dim: int, path) -> Dict[str, Any]:
    """Llama 3.1 / 3.2 files carry their RoPE scaling as rope_freqs [head_dim / 2]: the divisor of each
    frequency (1 for wavelengths under original / high, `factor` over original / low, a smooth ramp between).
    The converter computes it from (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings);
    take the released low / high / original with factor = the largest divisor, and accept them only if they
    reproduce the tensor."""
    import math

    import numpy as np

    freqs = np.asarray(freqs, dtype=np.float64).reshape(-1)
    factor = float(freqs.max())
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    smooth = (_LLAMA3_ORIGINAL / wavelen - _LLAMA3_LOW) / (_LLAMA3_HIGH - _LLAMA3_LOW)
    divisor = np.where(wavelen < _LLAMA3_ORIGINAL / _LLAMA3_HIGH, 1.0,
                       np.where(wavelen > _LLAMA3_ORIGINAL / _LLAMA3_LOW, factor,
                                1.0 / ((1 - smooth) / factor + smooth)))
    if freqs.shape != divisor.shape or not np.allclose(freqs, divisor, rtol=1e-3):
        raise ValueError(f"GGUF {path}: rope_freqs does not match Llama 3's RoPE scaling (factor {factor}, low "
                         f"{_LLAMA3_LOW}, high {_LLAMA3_HIGH}, original context {_LLAMA3_ORIGINAL}); gyrfalcon "
                         "cannot reproduce this file's RoPE.")
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": _LLAMA3_LOW,
            "high_freq_factor": _LLAMA3_HIGH, "original_max_position_embeddings": _LLAMA3_ORIGINAL}


def gguf_config(path):
    """The transformers config (LlamaConfig / Qwen2Config / Qwen3Config) of a GGUF file, from its metadata:
    architecture, sizes, RoPE, norms, special token ids; tie_word_embeddings when the file has no `output`
    tensor; attention biases when it has them."""
    import transformers

    reader = open_gguf(path)
    arch = _arch(reader, path)
    shapes = _tensor_shapes(reader)

    def get(key, default=KeyError):
        value = metadata(reader, f"{arch}.{key}", None)
        if value is None:
            if default is KeyError:
                raise ValueError(f"GGUF {path} lacks the metadata key {arch}.{key}.")
            return default
        return value

    hidden = int(get("embedding_length"))
    heads = _one(get("attention.head_count"), "attention.head_count", path)
    kv_heads = _one(get("attention.head_count_kv", heads), "attention.head_count_kv", path)
    # key_length: Qwen3 has head_dim 128 beside hidden / heads = 64 (0.6B); files without it use hidden / heads.
    head_dim = int(get("attention.key_length", hidden // heads))
    value_dim = int(get("attention.value_length", head_dim))
    rope_dims = int(get("rope.dimension_count", head_dim))
    if value_dim != head_dim or rope_dims != head_dim:
        raise ValueError(f"GGUF {path}: key / value / RoPE dims {head_dim} / {value_dim} / {rope_dims} differ; "
                         f"gyrfalcon's {arch} attention needs them equal.")
    if "token_embd.weight" not in shapes:
        raise ValueError(f"GGUF {path} has no token_embd.weight tensor.")
    vocab = shapes["token_embd.weight"][0]
    context = int(get("context_length"))
    theta = float(get("rope.freq_base", 10000.0))
    rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    scaling = get("rope.scaling.type", None)
    if "rope_freqs.weight" in shapes:
        rope = _llama3_rope(_dequantized(reader, "rope_freqs.weight"), theta, head_dim, path)
    elif scaling in ("linear", "yarn"):
        rope = {"rope_type": scaling, "rope_theta": theta, "factor": float(get("rope.scaling.factor"))}
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF {path}: unsupported RoPE scaling {scaling!r} ({arch}.rope.scaling.type).")

    kw: Dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")), num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=context,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")), rope_parameters=rope,
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=metadata(reader, "tokenizer.ggml.padding_token_id"),
        architectures=[ARCHITECTURES[arch]])
    if arch == "llama":
        kw["attention_bias"] = "blk.0.attn_q.bias" in shapes
        kw["mlp_bias"] = "blk.0.ffn_up.bias" in shapes
        cls = transformers.LlamaConfig
    elif arch == "qwen2":
        cls = transformers.Qwen2Config
    else:
        cls = transformers.Qwen3Config
    config = cls(**kw)
    config.name_or_path = str(path)
    return config


def sampling_defaults(path) -> Dict[str, Any]:
    """The file's recommended sampling (general.sampling.*), in generation_config.json's names."""
    reader = open_gguf(path)
    out = {}
    for key, name in (("temp", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"), ("min_p", "min_p")):
        value = metadata(reader, f"general.sampling.{key}")
        if value is not None:
            out[name] = value
    return out


def _dequantize(t):
    """A gguf ReaderTensor as float32 numpy [PyTorch shape], through gguf's dequantization; a writable array of
    its own (F32 comes back as a view of the read-only file mapping)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(t.tensor_type)
    if qtype.name not in SUPPORTED_TYPES:
        raise ValueError(f"GGUF tensor {t.name} has type {qtype.name}, which gyrfalcon does not load; supported "
                         f"types: {', '.join(SUPPORTED_TYPES)}.")
    out = dequantize(t.data, qtype)
    if out.dtype != np.float32 or not out.flags.writeable or not out.flags.c_contiguous:
        out = np.array(out, dtype=np.float32)
    return out


def _dequantized(reader, name: str):
    return _dequantize(next(t for t in reader.tensors if t.name == name))


def _hf_name(name: str, arch: str, path) -> Optional[str]:
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL_TENSORS and suffix == "weight":
        return f"{_GLOBAL_TENSORS[base]}.weight"
    m = _LAYER_NAME.match(name)
    if m is not None and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF {path}: tensor {name!r} has no place in gyrfalcon's {arch} model.")


def _unpermute_rows(w, n_heads: int):
    """Undo the llama converter's q / k row order. w: [n_heads * head_dim, ...] with head h's rows ordered
    (i, half) for i < head_dim / 2 -> the Hugging Face order (half, i)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iterate_gguf(path, hf_config) -> Iterator[Tuple[str, "object"]]:
    """(checkpoint name, float32 torch tensor) for every weight of the file, one tensor dequantized at a time;
    load_weights casts each into the model's dtype."""
    import torch

    reader = open_gguf(path)
    arch = _arch(reader, path)
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    for t in reader.tensors:
        if t.name in _CONFIG_TENSORS:
            continue
        name = _hf_name(t.name, arch, path)
        w = _dequantize(t)
        if arch == "llama" and ".attn_q." in t.name:
            w = _unpermute_rows(w, heads)
        elif arch == "llama" and ".attn_k." in t.name:
            w = _unpermute_rows(w, kv_heads)
        yield name, torch.from_numpy(w)


def gguf_file_description(path) -> str:
    """For log lines: the file name, its architecture and its tensor types."""
    from collections import Counter

    from gguf import GGMLQuantizationType

    reader = open_gguf(path)
    types = Counter(GGMLQuantizationType(t.tensor_type).name for t in reader.tensors)
    return (f"{Path(path).name} ({metadata(reader, 'general.architecture')}, "
            + ", ".join(f"{n} x {k}" for k, n in types.most_common()) + ")")
