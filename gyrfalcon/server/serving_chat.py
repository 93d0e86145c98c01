"""POST /v1/chat/completions: messages through the chat template -> chat.completion objects; tool calls and
reasoning are read out of the generated text by chat_choice.ChatChoice."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gyrfalcon.sampling_params import SamplingParams
from gyrfalcon.server.chat_choice import ChatChoice
from gyrfalcon.server.protocol import ChatCompletionRequest
from gyrfalcon.server.reasoning import REASONING_PARSERS
from gyrfalcon.server.reasoning.parser import THINK_END
from gyrfalcon.server.serving import (SSE_DONE, OpenAIServing, clamp_logprob, error_from_exception,
                                      prompt_logprobs_json, run_unless_disconnected, sse, stream_chunk, work_size)
from gyrfalcon.server.tool_parsers import TOOL_PARSERS
from gyrfalcon.server.tool_parsers.tool_plan import ToolPlan


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args, tool_call_parser: Optional[str] = None, enable_auto_tool_choice: bool = False,
                 reasoning_parser: Optional[str] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for name, table, flag in ((tool_call_parser, TOOL_PARSERS, "--tool-call-parser"),
                                  (reasoning_parser, REASONING_PARSERS, "--reasoning-parser")):
            if name is not None and name not in table:
                raise ValueError(f"{flag} {name!r} is not one of {', '.join(sorted(table))}.")
        self.tool_parser_cls = TOOL_PARSERS[tool_call_parser] if tool_call_parser else None
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning_parser = REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None
        self.reasoning_end_ids = (self.tokenizer.encode(THINK_END, add_special_tokens=False)
                                  if reasoning_parser else None)

    def _logprobs(self, token_ids, logprobs, num_top: int) -> Dict[str, Any]:
        """OpenAI's chat logprobs: {content: [{token, logprob, bytes, top_logprobs: [...]}]}."""
        def item(tid, e) -> Dict[str, Any]:
            s = e.decoded_token if e.decoded_token is not None else self.tokenizer.decode([tid])
            return {"token": s, "logprob": clamp_logprob(e.logprob), "bytes": list(s.encode("utf-8"))}

        content: List[Dict[str, Any]] = []
        for tid, entry in zip(token_ids, logprobs or []):
            top = sorted(((t, e) for t, e in entry.items() if e.rank is not None and e.rank <= num_top),
                         key=lambda te: te[1].rank)
            content.append({**item(tid, entry[tid]), "top_logprobs": [item(t, e) for t, e in top[:num_top]]})
        return {"content": content}

    def _prepare(self, req: ChatCompletionRequest) -> Tuple[SamplingParams, str, List[int], ToolPlan]:
        """Everything between the parsed request and its submission; raises the 400s (a bad schema, regex or
        grammar among them: parsed here, naming the request field it came from)."""
        plan = ToolPlan.from_request(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser_cls,
                                     self.enable_auto_tool_choice)
        constraint = plan.constraint()
        params = req.sampling_params(self.max_logprobs, self.sampling_defaults, constraint)
        source = req.structured_outputs_params(constraint)
        self.validate_params(params, source[0] if source else "structured_outputs")
        if plan.mode == "auto" and "skip_special_tokens" not in req.model_fields_set:
            # Some families' call markers are special tokens, which the text would otherwise drop (as vLLM does).
            params.skip_special_tokens = False
        kwargs = dict(req.chat_template_kwargs or {})
        if req.continue_final_message:
            kwargs["continue_final_message"] = True
        text = self.render_chat(req.messages, req.add_generation_prompt, kwargs, plan.tools or None)
        ids = self.encode_text(text, "messages", add_special_tokens=False)
        self.validate_prompt(ids, params.max_tokens, "messages", req.param_name("max_tokens"))
        if params.structured_outputs is not None and self.reasoning_parser is not None \
                and self.reasoning_parser.constraint_waits(text):
            # A thinking model reasons freely first; the constraint holds for what follows </think> (as vLLM).
            params.structured_outputs.reasoning_end = self.reasoning_end_ids
        return params, text, ids, plan

    def _choice(self, plan: ToolPlan, prompt: str, req: ChatCompletionRequest) -> ChatChoice:
        return ChatChoice(plan, self.reasoning_parser, prompt, req.include_reasoning)

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_model(req.model)
        size = (work_size(req.messages) + work_size(req.logit_bias) + work_size(req.tools)
                + work_size(req.response_format) + work_size(req.structured_outputs) + work_size(req.guided_json))
        params, text, ids, plan = await self.offload(size, self._prepare, req)
        self.check_engine()
        request_id = self.new_id("chatcmpl")
        created = int(time.time())
        model = self.served_model_name  # the first served name, whichever alias was asked for (as vLLM)
        prompts = [(text, ids)]
        if req.stream:
            return StreamingResponse(self._stream(req, request_id, created, model, prompts, params, plan),
                                     media_type="text/event-stream")
        queue: asyncio.Queue = asyncio.Queue()
        states = self.submit(request_id, prompts, params, queue, stream=False)

        async def run():
            try:
                await self.wait_all(states, queue)
                return True
            finally:
                self.abort(states)

        if await run_unless_disconnected(raw_request, run()) is None:
            return Response(status_code=499)
        out = states[0].request_output()
        choices = []
        for c in out.outputs:
            lp = self._logprobs(c.token_ids, c.logprobs, params.logprobs) if params.logprobs is not None else None
            choice = self._choice(plan, text, req)
            message = choice.message(c.text)
            choices.append({"index": c.index, "message": message, "logprobs": lp,
                            "finish_reason": choice.finish_reason(c.finish_reason), "stop_reason": c.stop_reason})
        body = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": self.usage(states), "system_fingerprint": None}
        if params.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        return JSONResponse(body)

    async def _stream(self, req: ChatCompletionRequest, request_id: str, created: int, model: str, prompts,
                      params, plan: ToolPlan) -> AsyncIterator[str]:
        states = []
        queue: asyncio.Queue = asyncio.Queue()
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats

        def chunk(choices, usage=None) -> str:
            if usage is None and continuous:
                usage = self.usage(states)  # the counts so far, on every chunk (vLLM's continuous_usage_stats)
            return stream_chunk("chat.completion.chunk", request_id, created, model, choices, usage)

        try:
            states = self.submit(request_id, prompts, params, queue)
            for i in range(params.n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            done = set()
            parsers = {i: self._choice(plan, prompts[0][0], req) for i in range(params.n)}
            async for st in self.updates(states, queue):
                for s in st.samples:
                    if s.index in done:
                        continue
                    if s.finish_reason == "abort":
                        continue  # failed from outside: updates() raises the reason next
                    text, toks, lps = s.take_delta()
                    choice = parsers[s.index]
                    delta = choice.delta(text, s.finished)
                    finish = choice.finish_reason(s.finish_reason) if s.finished else None
                    if not delta and finish is None and not (params.logprobs is not None and toks):
                        continue
                    if not delta and finish is None:
                        delta = {"content": ""}  # a chunk for the logprobs of tokens still held back
                    lp: Optional[Dict[str, Any]] = None
                    if params.logprobs is not None:
                        lp = self._logprobs(toks, lps, params.logprobs)
                    yield chunk([{"index": s.index, "delta": delta, "logprobs": lp, "finish_reason": finish,
                                  "stop_reason": s.stop_reason if finish else None}])
                    if finish is not None:
                        done.add(s.index)
            if req.stream_options is not None and req.stream_options.include_usage:
                yield chunk([], self.usage(states))
        except Exception as e:
            yield sse(error_from_exception(e).body())
        finally:
            self.abort(states)
        yield SSE_DONE
