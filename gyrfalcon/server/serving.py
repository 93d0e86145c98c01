"""OpenAIServing: what the completion and chat endpoints share.

The model-name check, prompt validation (the engine's own rules, answered as HTTP 400 before
anything is submitted), submission of a call's prompts to the engine client, the async iteration
over their updates (which aborts whatever is unfinished when the caller goes away), usage, SSE
framing, and the tokenize / detokenize endpoints.

Work that grows with a request's size (building its sampling params, rendering the chat template,
tokenizing, checking long token-id lists) runs in a thread pool once the request is past a few
kilobytes, so one heavy request never holds up the event loop that answers every other one (and
/health). Threads are enough: tokenizers' Rust encoder releases the GIL while it works, and the
Python parts (Jinja rendering, checks) give it up every few milliseconds. Small requests are
handled inline, which costs less than a hop to a thread and cannot queue behind heavy ones.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
import uuid
from concurrent.futures import Executor
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple

from fastapi import Request
from fastapi.responses import JSONResponse

from gyrfalcon.engine.engine import Engine
from gyrfalcon.output_processor import RequestState
from gyrfalcon.sampling_params import SamplingParams, SamplingParamsError
from gyrfalcon.server.engine_client import AsyncEngineClient, EngineDeadError, RequestRejected
from gyrfalcon.server.protocol import DetokenizeRequest, OpenAIError, TokenizeRequest, bad_request
from gyrfalcon.tokenizer import encode, render_chat

_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Requests whose text (characters) or token-id lists (items) add up to less than this are handled on the event
# loop: tokenizing 8k characters takes a few milliseconds even on a slow core.
INLINE_WORK_LIMIT = 8192
# Roles OpenAI's chat API accepts; anything else is a client's mistake, answered with a 400.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes any one token of the vocabulary (added tokens included) can stand for, read from its
    token strings. Byte-level BPE writes each byte as one character of 1-2 bytes, SentencePiece pieces are the
    text itself (with U+2581, 3 bytes, for a 1-byte space), byte-fallback tokens (<0x41>) are longer than their
    byte: each string is at least as long as the text it covers, so the result is an upper bound."""
    try:
        vocab = tokenizer.get_vocab()
        return max(len(t.encode("utf-8", "surrogatepass")) for t in vocab) if vocab else 0
    except Exception:  # a tokenizer without a readable vocabulary: no character limit
        return 0


def prompt_char_limit(tokenizer, max_model_len: int) -> Optional[int]:
    """The most characters a text prompt can have and still fit max_model_len tokens, or None when unknown.

    A text of B UTF-8 bytes (B >= its number of characters) needs at least B / max_token_bytes tokens, as long as
    tokenization keeps every byte of it (byte-level BPE and SentencePiece do). A normalizer may shrink text first
    (NFKC turns a 3-byte full-width letter into a 1-byte one), so with one the bound takes 4x more room. A longer
    prompt cannot fit, and is refused without being tokenized: tokenizing 20 MB takes ~40 s of a CPU core."""
    per_token = max_token_bytes(tokenizer)
    if per_token <= 0:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    shrink = 4 if backend is None or getattr(backend, "normalizer", None) is not None else 1
    return max_model_len * per_token * shrink


def work_size(value: Any, depth: int = 0) -> int:
    """A cheap estimate of how much work a prompt or messages value is: characters of text plus items, looking
    at a few hundred items at most (a bigger or deeper container counts as big: off the loop)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list) and value and type(value[0]) is int:
        return len(value)  # token ids: checking one is a fraction of a microsecond
    if isinstance(value, (list, dict)):
        if len(value) > 256 or depth >= 4:
            return max(len(value), INLINE_WORK_LIMIT)
        items = value.values() if isinstance(value, dict) else value
        return len(value) + sum(work_size(v, depth + 1) for v in items)
    return 1


class _PromptChecker:
    """Engine.validate_prompt (empty, too long, out-of-vocabulary ids) without an Engine."""

    validate_prompt = Engine.validate_prompt
    validate_params = Engine.validate_params

    def __init__(self, config) -> None:
        self.config = config
        self.max_model_len = config.model_config.max_model_len
        self.vocab_size = Engine.read_vocab_size(config)


def _tool_call_for_template(tc: Any) -> Any:
    """An earlier assistant turn's tool call with its arguments as an object: OpenAI sends them as JSON text, and
    templates that write them with `tojson` (Llama 3's, DeepSeek's) would otherwise quote the text again."""
    if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
        return tc
    args = tc["function"].get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            return tc
        if isinstance(parsed, dict):
            return {**tc, "function": {**tc["function"], "arguments": parsed}}
    return tc


def prompt_logprobs_json(entries: Optional[list]) -> Optional[list]:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in entries]


def clamp_logprob(x: float) -> float:
    """JSON has no -inf; OpenAI-compatible servers report -9999.0 instead."""
    return -9999.0 if (x is None or math.isnan(x) or x < -9999.0) else float(x)


def sse(obj: Any) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def stream_chunk(obj_type: str, request_id: str, created: int, model: str, choices, usage=None) -> str:
    """One server-sent event of a streamed response (`usage` only on the final chunk, when asked)."""
    body = {"id": request_id, "object": obj_type, "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return sse(body)


SSE_DONE = "data: [DONE]\n\n"


def error_from_exception(e: BaseException) -> OpenAIError:
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineDeadError):
        if e.code == "engine_dead":
            return OpenAIError(503, f"The engine is not running: {e}", code=e.code)
        return OpenAIError(503, str(e), code=e.code)
    if isinstance(e, RequestRejected):
        return bad_request(str(e))
    return OpenAIError(500, f"Internal error: {type(e).__name__}: {e}")


class OpenAIServing:
    def __init__(self, client: AsyncEngineClient, tokenizer, config, served_model_name: str,
                 max_logprobs: int = 20, chat_template: Optional[str] = None, executor: Optional[Executor] = None,
                 max_prompt_chars: Optional[int] = None) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.config = config
        self.served_model_name = served_model_name
        self.max_model_len = config.model_config.max_model_len
        self.max_logprobs = max_logprobs
        self.chat_template = chat_template
        self.executor = executor
        self.max_prompt_chars = max_prompt_chars
        self._checker = _PromptChecker(config)
        # Structured outputs parse their grammars here (SamplingParams.structured_outputs.build_grammar): xgrammar's
        # import (~0.3 s) happens now, while the engine core loads the model, not in a request's turn on the loop.
        import xgrammar  # noqa: F401
        gen = config.model_config.generation_config or {}
        # The checkpoint's recommended sampling settings apply where a request names none (as vLLM).
        self.sampling_defaults = {k: gen[k] for k in _SAMPLING_DEFAULT_KEYS if gen.get(k) is not None}

    # ---- checks -----------------------------------------------------------------------------------
    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name not in self.config.model_config.served_model_names:
            raise OpenAIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def check_engine(self) -> None:
        if self.client.is_dead:
            raise OpenAIError(503, f"The engine is not running: {self.client.dead_reason}", code="engine_dead")

    def validate_params(self, params: SamplingParams, structured_param: str = "structured_outputs") -> None:
        """structured_param: the request field the output constraint came from (response_format, guided_json, ...):
        its schema / regex / grammar is parsed here, so a bad one is a 400 naming that field."""
        try:
            self._checker.validate_params(params)
        except SamplingParamsError as e:
            raise bad_request(str(e), structured_param if e.param == "structured_outputs" else e.param) from None
        except ValueError as e:
            raise bad_request(str(e), "logit_bias") from None

    def validate_prompt(self, ids: List[int], max_tokens: Optional[int], param: str = "prompt",
                        max_tokens_param: str = "max_tokens") -> None:
        try:
            self._checker.validate_prompt(ids)
        except ValueError as e:
            raise bad_request(str(e), param) from None
        if max_tokens is not None and len(ids) + max_tokens > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or the completion.", max_tokens_param)

    def check_token_ids(self, ids: list, param: str = "prompt") -> None:
        """A token-id prompt: its length first (a list too long to fit is refused without looking at its
        items), then that every item is an integer (bools are not)."""
        if 0 < len(ids) < self.max_model_len and not all(type(t) is int for t in ids):
            raise bad_request(f"{param} token ids must be integers.", param)

    def encode_text(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> List[int]:
        """Token ids of a text prompt; one too long to fit max_model_len however it tokenizes is refused first."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise bad_request(
                f"The prompt is {len(text)} characters long, which cannot fit max_model_len={self.max_model_len} "
                f"tokens: no token of this model's vocabulary stands for enough text (at most "
                f"{self.max_prompt_chars} characters can fit).", param)
        return encode(self.tokenizer, text, add_special_tokens=add_special_tokens)

    async def offload(self, size: int, fn: Callable, *args):
        """fn(*args) inline for a small request, else in the thread pool (see the module docstring)."""
        if self.executor is None or size < INLINE_WORK_LIMIT:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    def render_chat(self, messages: Any, add_generation_prompt: bool = True,
                    kwargs: Optional[Dict[str, Any]] = None, tools: Optional[List[Dict[str, Any]]] = None) -> str:
        """The prompt text; `kwargs` (chat_template_kwargs: enable_thinking, ...) and `tools` (OpenAI's tool
        definitions) go to the template as transformers' apply_chat_template passes them."""
        if not isinstance(messages, list):
            raise bad_request("messages must be a list of messages.", "messages")
        if not messages:
            raise bad_request("messages must not be empty.", "messages")
        msgs = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise bad_request(f"Each message needs a 'role' (messages[{i}] has none).", "messages")
            role = m["role"]
            if role not in CHAT_ROLES:
                raise bad_request(f"messages[{i}].role {role!r} is not one of {', '.join(CHAT_ROLES)}.",
                                  "messages")
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if not isinstance(part, dict) or part.get("type") != "text":
                        raise bad_request("Only text content parts are supported.", "messages")
                    text = part.get("text")
                    if not isinstance(text, str):
                        raise bad_request(f"messages[{i}]: a text part needs a string 'text'.", "messages")
                    parts.append(text)
                content = "\n".join(parts)
            elif content is None:
                # As OpenAI: only an assistant turn (one that called tools) may come without content.
                if role not in ("assistant", "function"):
                    raise bad_request(f"messages[{i}].content must be a string or a list of text parts; only "
                                      "assistant messages may have none.", "messages")
            elif not isinstance(content, str):
                raise bad_request("Message content must be a string or a list of text parts.", "messages")
            msg = {**m, "content": content if content is not None else ""}
            if role == "assistant" and isinstance(m.get("tool_calls"), list):
                msg["tool_calls"] = [_tool_call_for_template(tc) for tc in m["tool_calls"]]
            msgs.append(msg)
        try:
            if tools:
                kwargs = {**(kwargs or {}), "tools": tools}
            if kwargs:
                if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
                    raise ValueError("This model's tokenizer has no chat template; start the server with "
                                     "--chat-template FILE.")
                return self.tokenizer.apply_chat_template(msgs, tokenize=False, chat_template=self.chat_template,
                                                          add_generation_prompt=add_generation_prompt, **kwargs)
            return render_chat(self.tokenizer, msgs, self.chat_template, add_generation_prompt)
        except Exception as e:  # jinja errors, a missing template
            raise bad_request(f"Could not apply the chat template: {e}", "messages") from None

    # ---- submission and results -------------------------------------------------------------------
    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def submit(self, request_id: str, prompts: Sequence[Tuple[Optional[str], List[int]]],
               params: SamplingParams, queue: asyncio.Queue, stream: bool = True) -> List[RequestState]:
        """Submit each prompt as `{request_id}-{i}`; on failure nothing stays submitted.
        stream=False: the text is read only at the end (decoded once, not token by token)."""
        self.check_engine()
        states: List[RequestState] = []
        arrival = time.monotonic()
        try:
            for i, (text, ids) in enumerate(prompts):
                states.append(self.client.add_request(f"{request_id}-{i}", text, ids, params, queue, arrival,
                                                      stream))
        except BaseException:
            self.abort(states)
            raise
        return states

    def abort(self, states: Sequence[RequestState]) -> None:
        for st in states:
            self.client.abort(st.request_id)

    @staticmethod
    async def updates(states: Sequence[RequestState], queue: asyncio.Queue) -> AsyncIterator[RequestState]:
        """The states as they change, until all have finished; raises what the engine client reports."""
        pending = {st.request_id for st in states}
        while pending:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.request_id not in pending:
                continue
            if any(s.finish_reason == "abort" for s in item.samples):
                # Ended from outside (shutdown, a dead engine, a rejected prompt): the reason was
                # queued together with the abort, behind this update.
                while not queue.empty():
                    err = queue.get_nowait()
                    if isinstance(err, BaseException):
                        raise err
                raise EngineDeadError("The request was aborted.", code="aborted")
            if item.finished:
                pending.discard(item.request_id)
            yield item

    async def wait_all(self, states: Sequence[RequestState], queue: asyncio.Queue) -> None:
        async for _ in self.updates(states, queue):
            pass

    @staticmethod
    def usage(states: Sequence[RequestState]) -> Dict[str, Any]:
        p = sum(len(st.prompt_token_ids) for st in states)
        c = sum(len(s.token_ids) for st in states for s in st.samples)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": sum(st.num_cached_tokens for st in states)}}

    # ---- tokenizer endpoints ----------------------------------------------------------------------
    async def tokenize(self, req: TokenizeRequest) -> JSONResponse:
        self.check_model(req.model)
        size = work_size(req.prompt) + work_size(req.messages)
        return await self.offload(size, self._tokenize, req)

    def _tokenize(self, req: TokenizeRequest) -> JSONResponse:
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("Give exactly one of 'prompt' and 'messages'.", "prompt")
        if req.messages is not None:
            text = self.render_chat(req.messages, req.add_generation_prompt)
            ids = self.encode_text(text, "messages", add_special_tokens=False)
        else:
            if not isinstance(req.prompt, str):
                raise bad_request("prompt must be a string.", "prompt")
            ids = self.encode_text(req.prompt, "prompt", add_special_tokens=req.add_special_tokens)
        out: Dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(out)  # rendered here, in the worker, not on the event loop

    async def detokenize(self, req: DetokenizeRequest) -> JSONResponse:
        self.check_model(req.model)
        return await self.offload(work_size(req.tokens), self._detokenize, req)

    def _detokenize(self, req: DetokenizeRequest) -> JSONResponse:
        tokens = req.tokens
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise bad_request("tokens must be a list of token ids (integers).", "tokens")
        vocab = len(self.tokenizer)
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"Token id {bad[0]} is out of range for a vocabulary of {vocab}.", "tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(tokens)})


async def run_unless_disconnected(raw_request: Request, coro):
    """Await `coro`, but cancel it (and return None) if the HTTP client goes away first."""
    task = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        watcher.cancel()
        task.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()  # the client left: the task's cleanup aborts its requests
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    return None
