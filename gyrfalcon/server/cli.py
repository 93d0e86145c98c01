"""`gyrfalcon serve MODEL`: flags only (argparse); the server itself is imported by the handler."""

from __future__ import annotations

import argparse

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


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    from gyrfalcon.cli import add_engine_args

    p = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /tokenize, /detokenize, /health, /metrics, /version).")
    add_engine_args(p, model_positional=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind; 127.0.0.1 is this machine only")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $GYRFALCON_API_KEY, else no key)")
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
