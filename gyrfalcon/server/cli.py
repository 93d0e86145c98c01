"""`gyrfalcon serve MODEL`: flags only (argparse); the server itself is imported by the handler."""

from __future__ import annotations

import argparse
from typing import List

# A request body past this gets HTTP 413 unread (vLLM sets no limit). 16 MiB holds a text prompt of millions of
# tokens, and bounds what one request can make the server parse: a body near it takes ~0.5 s of JSON parsing
# on a slow core.
DEFAULT_MAX_REQUEST_BYTES = 16 << 20


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging
    import os
    import sys

    from gyrfalcon.server.api_server import run_server
    rc = run_server(args)
    # Everything is shut down and closed by now; skip the interpreter's final garbage collection of
    # torch / transformers / FastAPI objects, which takes seconds and can only delay the exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def expand_config_file(argv: List[str]) -> List[str]:
    """`serve --config FILE` (vLLM's): the YAML file's keys become flags placed before the command line's, so that
    the command line wins (argparse keeps the last value). Keys are flag names with '-' or '_' (`max-num-seqs: 8`,
    `model: org/name`); true is a switch, false `--no-KEY` (a switch's default is off anyway), a list the values
    of one flag, a mapping its JSON. A key gyrfalcon lacks is reported as the flag would be."""
    import json

    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        return argv
    out, path, i = [], None, 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
        elif argv[i].startswith("--config="):
            path, i = argv[i].split("=", 1)[1], i + 1
        else:
            out.append(argv[i])
            i += 1
    if path is None:
        raise ValueError("--config needs a YAML file.")
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values.")
    flags: List[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is None:
            continue
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            flags += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    at = out.index("serve") + 1 if "serve" in out else 0
    return out[:at] + flags + out[at:]


def _list_arg(value: str) -> list:
    """A JSON list (vLLM's form: '["http://a.com"]') or comma-separated words."""
    import json

    value = value.strip()
    if value.startswith("["):
        try:
            out = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(out, list) or not all(isinstance(x, str) for x in out):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return out
    return [v.strip() for v in value.split(",") if v.strip()]


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    from gyrfalcon.cli import add_engine_args

    p = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /tokenize, /detokenize, /health, /metrics, /version).")
    add_engine_args(p, model_positional=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind; 127.0.0.1 is this machine only")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", nargs="+", action="extend", default=None,
                   help="require 'Authorization: Bearer KEY' with one of these keys (several after one flag, or the "
                        "flag repeated; default: $GYRFALCON_API_KEY, else no key)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a YAML file of flags (vLLM's serve --config: `max-num-seqs: 64`, `api-key: [k1, k2]`, "
                        "`enable-prefix-caching: false`, ...); flags on the command line win")
    p.add_argument("--root-path", default=None,
                   help="the path prefix a proxy serves this server under (FastAPI's root_path): requests may carry "
                        "it or not, and the OpenAPI schema names it")
    p.add_argument("--allowed-origins", type=_list_arg, default=["*"],
                   help="CORS: the origins browsers may call from, a JSON list or comma-separated (default: any)")
    p.add_argument("--allowed-methods", type=_list_arg, default=["*"], help="CORS: the allowed methods (default: any)")
    p.add_argument("--allowed-headers", type=_list_arg, default=["*"], help="CORS: the allowed headers (default: any)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and auth headers")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log each request as it arrives: its id, prompt (see --max-log-len) and sampling fields")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="no per-request log line (the default; kept for vLLM launch scripts)")
    p.add_argument("--max-log-len", type=int, default=None,
                   help="with --enable-log-requests: the most prompt characters (and token ids) a log line shows "
                        "(default: all)")
    p.add_argument("--metrics-prefix", default="gyrfalcon", choices=["gyrfalcon", "vllm"],
                   help="the prefix of every /metrics name: vllm serves them under vLLM's names (vllm:...) for "
                        "dashboards and routers built for vLLM (docs/server.md has the table)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (or the template itself) instead of the tokenizer's")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs / top_logprobs a request may ask for")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="the largest request body accepted; a larger one gets HTTP 413 before it is parsed "
                        "(0: no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="on SIGINT / SIGTERM, seconds requests in flight get to finish before they are ended")
    p.add_argument("--keep-alive-on-engine-death", action="store_true",
                   help="when the engine core dies, keep answering 503 instead of exiting with code 1 (the "
                        "default lets a supervisor such as systemd or Kubernetes restart the server)")
    # Tool calling and reasoning (docs/server.md); vLLM's flags and parser names.
    from gyrfalcon.server.reasoning import REASONING_PARSERS
    from gyrfalcon.server.tool_parsers import TOOL_PARSERS
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let requests use tool_choice "auto" (the model decides; --tool-call-parser reads its calls)')
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model family's tool-call syntax: hermes / qwen3 (<tool_call> JSON), llama3_json, "
                        "deepseek_v3 / deepseek_v31, minimax_m2")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="return the model's <think> reasoning as reasoning_content, apart from content")
    p.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput / KV-usage log line")
    p.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    p.set_defaults(func=_cmd_serve)
    return p
