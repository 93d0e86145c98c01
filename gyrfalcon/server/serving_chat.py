"""POST /v1/chat/completions: messages through the chat template -> chat.completion objects."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gyrfalcon.sampling_params import SamplingParams
from gyrfalcon.server.protocol import ChatCompletionRequest
from gyrfalcon.server.serving import (SSE_DONE, OpenAIServing, clamp_logprob, error_from_exception,
                                      run_unless_disconnected, sse, stream_chunk, work_size)


class OpenAIServingChat(OpenAIServing):
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

    def _prepare(self, req: ChatCompletionRequest) -> Tuple[SamplingParams, str, List[int]]:
        """Everything between the parsed request and its submission; raises the 400s."""
        params = req.sampling_params(self.max_logprobs, self.sampling_defaults)
        self.validate_params(params)
        text = self.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        ids = self.encode_text(text, "messages", add_special_tokens=False)
        self.validate_prompt(ids, params.max_tokens, "messages", req.param_name("max_tokens"))
        return params, text, ids

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_model(req.model)
        size = work_size(req.messages) + work_size(req.logit_bias)
        params, text, ids = await self.offload(size, self._prepare, req)
        self.check_engine()
        request_id = self.new_id("chatcmpl")
        created = int(time.time())
        model = self.served_model_name  # the first served name, whichever alias was asked for (as vLLM)
        prompts = [(text, ids)]
        if req.stream:
            return StreamingResponse(self._stream(req, request_id, created, model, prompts, params),
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
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                            "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse({"id": request_id, "object": "chat.completion", "created": created, "model": model,
                             "choices": choices, "usage": self.usage(states), "system_fingerprint": None})

    async def _stream(self, req: ChatCompletionRequest, request_id: str, created: int, model: str, prompts,
                      params) -> AsyncIterator[str]:
        states = []
        queue: asyncio.Queue = asyncio.Queue()

        def chunk(choices, usage=None) -> str:
            return stream_chunk("chat.completion.chunk", request_id, created, model, choices, usage)

        try:
            states = self.submit(request_id, prompts, params, queue)
            for i in range(params.n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            done = set()
            async for st in self.updates(states, queue):
                for s in st.samples:
                    if s.index in done:
                        continue
                    if s.finish_reason == "abort":
                        continue  # failed from outside: updates() raises the reason next
                    text, toks, lps = s.take_delta()
                    finish = s.finish_reason if s.finished else None
                    if not text and finish is None and not (params.logprobs is not None and toks):
                        continue
                    lp: Optional[Dict[str, Any]] = None
                    if params.logprobs is not None:
                        lp = self._logprobs(toks, lps, params.logprobs)
                    delta = {"content": text} if text or finish is None else {}
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
