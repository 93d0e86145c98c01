"""The OpenAI wire format: request models (pydantic), error bodies, and request -> SamplingParams.

Field names and defaults follow OpenAI's API, plus vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, ...) so clients written for vLLM work.
Unknown fields are accepted and ignored, as OpenAI's SDK sends some we have no use for.

The fields that can be big (prompt, messages, logit_bias, detokenize's tokens) are typed Any and checked by
the serving code, after the body's size limit and away from the event loop when large: pydantic's own check
of the prompt union took ~10 s on a 16 MB list of token ids.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from gyrfalcon.sampling_params import SamplingParams, SamplingParamsError

MAX_N = 128
# Every step checks a running request's stop strings (HTTP side) and stop token ids (engine core) one by one, so a
# request with a million of them would slow every step of every request. OpenAI allows 4 stop strings.
MAX_STOP = 256


class OpenAIError(Exception):
    """An error the API answers with `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, type: Optional[str] = None, param: Optional[str] = None,
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                             413: "invalid_request_error", 503: "service_unavailable"}.get(status, "server_error")
        self.param = param
        self.code = code

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    best_of: Optional[int] = None
    logit_bias: Optional[Any] = None  # token id strings -> numbers, checked by SamplingParams
    user: Optional[str] = None

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options can only be set when stream is true.", "stream_options")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad_request(f"n must be at least 1, got {self.n}.", "n")
        if self.n > MAX_N:
            raise bad_request(f"n must be at most {MAX_N}, got {self.n}.", "n")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (only best_of == n).", "best_of")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise bad_request(f"stop may hold at most {MAX_STOP} strings, got {len(self.stop)}.", "stop")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP:
            raise bad_request(f"stop_token_ids may hold at most {MAX_STOP} ids, got {len(self.stop_token_ids)}.",
                              "stop_token_ids")

    def param_name(self, name: str) -> str:
        """The request field a SamplingParams field came from (they differ for some chat fields)."""
        return name

    def _params(self, max_tokens: Optional[int], logprobs: Optional[int], defaults: Dict[str, Any]) -> SamplingParams:
        def pick(name, fallback):
            v = getattr(self, name)
            return v if v is not None else defaults.get(name, fallback)

        try:
            return SamplingParams(
                n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0), min_p=pick("min_p", 0.0), seed=self.seed, max_tokens=max_tokens,
                min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos, logprobs=logprobs,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=pick("repetition_penalty", 1.0), logit_bias=self.logit_bias,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output)
        except SamplingParamsError as e:
            raise bad_request(str(e), self.param_name(e.param)) from None
        except (ValueError, TypeError) as e:  # not expected: the model's types and SamplingParams catch all
            raise bad_request(str(e)) from None


class CompletionRequest(_SamplingFields):
    prompt: Any  # a string, a list of strings, token ids, or a list of token-id lists (serving_completion)
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None

    def sampling_params(self, max_logprobs: int, defaults: Dict[str, Any]) -> SamplingParams:
        self._check_common()
        if self.suffix:
            raise bad_request("suffix is not supported.", "suffix")
        if self.logprobs is not None:
            if self.logprobs < 0:
                raise bad_request(f"logprobs must be non-negative, got {self.logprobs}.", "logprobs")
            if self.logprobs > max_logprobs:
                raise bad_request(f"logprobs must be at most {max_logprobs}, got {self.logprobs}.", "logprobs")
        params = self._params(self.max_tokens, self.logprobs, defaults)
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = self.logprobs  # the echoed prompt tokens get theirs too (OpenAI)
        return params


class ChatCompletionRequest(_SamplingFields):
    messages: Any  # a list of {role, content, ...} (OpenAIServing.render_chat checks it)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[Dict[str, Any]] = None

    def sampling_params(self, max_logprobs: int, defaults: Dict[str, Any]) -> SamplingParams:
        self._check_common()
        if self.tools and self.tool_choice != "none":
            raise bad_request("Tool calling is not supported yet.", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("Only response_format {'type': 'text'} is supported.", "response_format")
        logprobs = None
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise bad_request("top_logprobs needs logprobs set to true.", "top_logprobs")
            if not 0 <= self.top_logprobs <= max_logprobs:
                raise bad_request(f"top_logprobs must be between 0 and {max_logprobs}, got "
                                  f"{self.top_logprobs}.", "top_logprobs")
        if self.logprobs:
            logprobs = self.top_logprobs or 0
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(max_tokens, logprobs, defaults)

    def param_name(self, name: str) -> str:
        if name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return {"logprobs": "top_logprobs"}.get(name, name)


class TokenizeRequest(_Request):
    model: Optional[str] = None
    prompt: Optional[Any] = None  # a string
    messages: Optional[Any] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: Any = Field(default_factory=list)  # token ids
