"""POST /v1/completions: prompts (strings or token ids, one or many) -> text_completion objects."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gyrfalcon.server.protocol import CompletionRequest, bad_request
from gyrfalcon.sampling_params import SamplingParams
from gyrfalcon.server.serving import (SSE_DONE, OpenAIServing, clamp_logprob, error_from_exception,
                                      prompt_logprobs_json, run_unless_disconnected, sse, stream_chunk, work_size)


class OpenAIServingCompletion(OpenAIServing):
    def _prompts(self, prompt: Any, max_tokens: Optional[int]) -> List[Tuple[Optional[str], List[int]]]:
        """(text, token ids) per prompt, each validated as soon as it is tokenized (a bad one ends the work).

        The field is typed Any in the request model: pydantic's check of the four-way union took ~10 s on a
        16 MB list of token ids, on the event loop. Here the kind is read from the first item, a list's length
        is checked before its items, and all of it runs off the loop for a big request."""
        def text(p: str) -> Tuple[str, List[int]]:
            ids = self.encode_text(p)
            self.validate_prompt(ids, max_tokens)
            return p, ids

        def token_ids(p: list) -> Tuple[None, List[int]]:
            self.check_token_ids(p)
            self.validate_prompt(p, max_tokens)
            return None, p

        if isinstance(prompt, str):
            return [text(prompt)]
        if isinstance(prompt, list) and not prompt:
            raise bad_request("prompt must not be empty.", "prompt")
        if isinstance(prompt, list):
            first = prompt[0]
            if type(first) is int:
                return [token_ids(prompt)]
            if isinstance(first, str) and all(isinstance(p, str) for p in prompt):
                return [text(p) for p in prompt]
            if isinstance(first, list) and all(isinstance(p, list) for p in prompt):
                return [token_ids(p) for p in prompt]
        raise bad_request("prompt must be a string, a list of strings, a list of token ids, or a list of "
                          "lists of token ids.", "prompt")

    def _prepare(self, req: CompletionRequest) -> Tuple[SamplingParams, List[Tuple[Optional[str], List[int]]]]:
        """Everything between the parsed request and its submission; raises the 400s."""
        params = req.sampling_params(self.max_logprobs, self.sampling_defaults)
        source = req.structured_outputs_params()
        self.validate_params(params, source[0] if source else "structured_outputs")
        return params, self._prompts(req.prompt, params.max_tokens)

    def _prompt_text(self, st) -> str:
        return st.prompt if st.prompt is not None else self.tokenizer.decode(st.prompt_token_ids)

    def _logprobs(self, token_ids, logprobs, num_top: int, offset: int,
                  echo_ids: Optional[List[int]] = None,
                  prompt_logprobs: Optional[list] = None) -> Tuple[Dict[str, Any], int]:
        """OpenAI's completion logprobs {tokens, token_logprobs, top_logprobs, text_offset};
        returns it and the text offset after it. Echoed prompt tokens carry their prompt logprobs
        (null for the first, which nothing predicts)."""
        tokens: List[str] = []
        token_lps: List[Optional[float]] = []
        tops: List[Optional[Dict[str, float]]] = []
        offsets: List[int] = []

        def add(tid, entry):
            lp = entry[tid] if entry is not None else None
            s = lp.decoded_token if lp is not None and lp.decoded_token is not None else self.tokenizer.decode([tid])
            tokens.append(s)
            if lp is None:
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(clamp_logprob(lp.logprob))
                ranked = sorted(((t, e) for t, e in entry.items() if t == tid or (e.rank or 0) <= num_top),
                                key=lambda te: te[1].rank or 0)
                tops.append({e.decoded_token: clamp_logprob(e.logprob) for _, e in ranked})
            offsets.append(offset)
            return len(s)

        for j, tid in enumerate(echo_ids or []):
            offset += add(tid, prompt_logprobs[j] if prompt_logprobs is not None and j < len(prompt_logprobs)
                          else None)
        for tid, entry in zip(token_ids, logprobs or []):
            offset += add(tid, entry)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset

    async def create_completion(self, req: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(req.model)
        size = (work_size(req.prompt) + work_size(req.logit_bias) + work_size(req.response_format)
                + work_size(req.structured_outputs) + work_size(req.guided_json))  # (a big schema parses off the loop)
        params, prompts = await self.offload(size, self._prepare, req)
        self.check_engine()
        request_id = self.new_id("cmpl")
        created = int(time.time())
        model = self.served_model_name  # the first served name, whichever alias was asked for (as vLLM)
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
                self.abort(states)  # a no-op for finished ones; stops the rest on an error or disconnect

        if await run_unless_disconnected(raw_request, run()) is None:
            return Response(status_code=499)  # nobody is listening any more
        choices = []
        for i, st in enumerate(states):
            out = st.request_output()
            prompt_text = self._prompt_text(st) if req.echo else ""
            for c in out.outputs:
                lp = None
                if params.logprobs is not None:
                    lp, _ = self._logprobs(c.token_ids, c.logprobs, params.logprobs, 0,
                                           st.prompt_token_ids if req.echo else None, out.prompt_logprobs)
                choice = {"index": i * params.n + c.index, "text": prompt_text + c.text, "logprobs": lp,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                choices.append(choice)
        return JSONResponse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                             "choices": choices, "usage": self.usage(states), "system_fingerprint": None})

    async def _stream(self, req: CompletionRequest, request_id: str, created: int, model: str, prompts,
                      params) -> AsyncIterator[str]:
        states = []
        queue: asyncio.Queue = asyncio.Queue()
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats

        def chunk(choices, usage=None) -> str:
            if usage is None and continuous:
                usage = self.usage(states)  # the counts so far, on every chunk (vLLM's continuous_usage_stats)
            return stream_chunk("text_completion", request_id, created, model, choices, usage)

        try:
            # Submitted here, not before the response starts: a client gone before the first byte
            # then leaves nothing behind, as this generator never runs.
            states = self.submit(request_id, prompts, params, queue)
            index_of = {st.request_id: i for i, st in enumerate(states)}
            echoed, done = set(), set()
            offsets: Dict[Tuple[int, int], int] = {}
            async for st in self.updates(states, queue):
                i = index_of[st.request_id]
                for s in st.samples:
                    key = (i, s.index)
                    if key in done:
                        continue
                    if s.finish_reason == "abort":
                        continue  # failed from outside: updates() raises the reason next
                    text, toks, lps = s.take_delta()
                    echo_ids = None
                    if req.echo and key not in echoed:
                        echoed.add(key)
                        text = self._prompt_text(st) + text
                        echo_ids = st.prompt_token_ids
                    finish = s.finish_reason if s.finished else None
                    if not text and finish is None and not (params.logprobs is not None and toks):
                        continue
                    lp = None
                    if params.logprobs is not None:
                        lp, offsets[key] = self._logprobs(toks, lps, params.logprobs, offsets.get(key, 0), echo_ids,
                                                          st.prompt_logprobs)
                    yield chunk([{"index": i * params.n + s.index, "text": text, "logprobs": lp,
                                  "finish_reason": finish, "stop_reason": s.stop_reason if finish else None}])
                    if finish is not None:
                        done.add(key)
            if req.stream_options is not None and req.stream_options.include_usage:
                yield chunk([], self.usage(states))
        except Exception as e:  # an error mid-stream becomes an error event, then [DONE]
            yield sse(error_from_exception(e).body())
        finally:
            self.abort(states)
        yield SSE_DONE
