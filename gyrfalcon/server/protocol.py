"""The OpenAI wire format: request models (pydantic), error bodies, and request -> SamplingParams.

Field names and defaults follow OpenAI's API, plus vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, ...) so clients written for vLLM work.
Unknown fields are accepted and ignored, as OpenAI's SDK sends some we have no use for.

The fields that can be big (prompt, messages, logit_bias, detokenize's tokens) are typed Any and checked by
the serving code, after the body's size limit and away from the event loop when large: pydantic's own check
of the prompt union took ~10 s on a 16 MB list of token ids.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field

from gyrfalcon.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams

logger = logging.getLogger(__name__)

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


# vLLM / OpenAI request fields gyrfalcon does not implement. Set to anything but the harmless value, those that
# would change the result are refused (400 naming the field); the rest are ignored with a warning (logged once per
# field per process), so a client ported from vLLM never gets a different result silently.
_REFUSED: Dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0, "early_stopping": False, "truncate_prompt_tokens": None,
    "allowed_token_ids": None, "bad_words": None, "logits_processors": None,
    "prompt_embeds": None, "guided_whitespace_pattern": None, "return_tokens_as_token_ids": False,
    "return_token_ids": False, "detokenize": True, "spaces_between_special_tokens": True, "documents": None,
    "functions": None, "function_call": None, "prediction": None, "audio": None, "web_search_options": None,
}
_CHAT_ONLY_REFUSED: Dict[str, Any] = {"echo": False, "chat_template": None}
_WARNED: Dict[str, Any] = {
    "guided_decoding_backend": None, "priority": 0, "cache_salt": None, "kv_transfer_params": None,
    "vllm_xargs": None, "mm_processor_kwargs": None, "reasoning_effort": None, "service_tier": None,
    "store": None, "metadata": None, "request_id": None, "modalities": None, "verbosity": None,
}
_warned_once: set = set()


def _is_default(value: Any, default: Any) -> bool:
    if value is None or value == default:
        return True
    return isinstance(value, (list, dict)) and not value and default is None


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # every chunk carries the usage so far (vLLM)


# vLLM's older guided_* fields -> the StructuredOutputsParams kind each stands for.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")
_SO_IGNORED = ("disable_fallback", "disable_additional_properties", "backend", "whitespace_pattern",
               "structural_tag")


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
    prompt_logprobs: Optional[int] = None
    # Structured outputs (docs/server.md): OpenAI's response_format, vLLM's structured_outputs and guided_*.
    response_format: Optional[Any] = None
    structured_outputs: Optional[Any] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[Any] = None
    guided_choice: Optional[Any] = None
    guided_grammar: Optional[Any] = None

    def _check_unsupported(self, extra_refused: Optional[Dict[str, Any]] = None) -> None:
        given = dict(self.model_extra or {})
        for name, default in {**_REFUSED, **(extra_refused or {})}.items():
            if name in given and not _is_default(given[name], default):
                raise bad_request(f"{name} is not supported by gyrfalcon (it would change the result); leave it "
                                  "out or at its default.", name)
        for name, default in _WARNED.items():
            if name in given and not _is_default(given[name], default) and name not in _warned_once:
                _warned_once.add(name)
                logger.warning("request field %s is not supported and is ignored (it does not change the "
                               "output); logged once", name)

    def structured_outputs_params(self, extra: Optional[Tuple[str, StructuredOutputsParams]] = None
                                  ) -> Optional[Tuple[str, StructuredOutputsParams]]:
        """(the request field it came from, StructuredOutputsParams) for the constraint the request asks for, or
        None; several at once are a 400 naming the second. `extra`: one the handler derives (tool_choice)."""
        found: List[Tuple[str, StructuredOutputsParams]] = []

        def make(param: str, **kw) -> StructuredOutputsParams:
            try:
                return StructuredOutputsParams(**kw)
            except SamplingParamsError as e:
                raise bad_request(str(e).replace("structured_outputs", param, 1), param) from None
            except TypeError as e:
                raise bad_request(f"{param}: {e}", param) from None

        rf = self.response_format
        if rf is not None:
            if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
                raise bad_request("response_format must be an object with a 'type'.", "response_format")
            kind = rf["type"]
            if kind == "json_object":
                found.append(("response_format", make("response_format", json_object=True)))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
                if not isinstance(schema, (dict, str)):
                    raise bad_request("response_format json_schema needs json_schema.schema (a JSON schema).",
                                      "response_format")
                found.append(("response_format", make("response_format", json=schema)))
            elif kind != "text":
                raise bad_request(f"response_format type {kind!r} is not supported (text, json_object, "
                                  "json_schema).", "response_format")
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, dict):
                raise bad_request("structured_outputs must be an object.", "structured_outputs")
            unknown = [k for k in so if k not in _SO_KEYS and k not in _SO_IGNORED]
            if unknown:
                raise bad_request(f"structured_outputs.{unknown[0]} is not supported (one of json, regex, choice, "
                                  "grammar, json_object).", "structured_outputs")
            for k in ("whitespace_pattern", "structural_tag", "disable_additional_properties"):
                if so.get(k) not in (None, False):
                    raise bad_request(f"structured_outputs.{k} is not supported.", "structured_outputs")
            found.append(("structured_outputs",
                          make("structured_outputs", **{k: v for k, v in so.items() if k in _SO_KEYS})))
        for field_name, kind in _GUIDED.items():
            value = getattr(self, field_name)
            if value is not None:
                found.append((field_name, make(field_name, **{kind: value})))
        if extra is not None:
            found.append(extra)
        if len(found) > 1:
            raise bad_request(f"Only one output constraint per request: got {found[0][0]} and {found[1][0]}.",
                              found[1][0])
        return found[0] if found else None

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

    def _params(self, max_tokens: Optional[int], logprobs: Optional[int], defaults: Dict[str, Any],
                max_logprobs: int = 20, structured: Optional[StructuredOutputsParams] = None) -> SamplingParams:
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs are not available when stream is true.", "prompt_logprobs")
        if self.prompt_logprobs is not None and not (isinstance(self.prompt_logprobs, int)
                                                     and 0 <= self.prompt_logprobs <= max_logprobs):
            raise bad_request(f"prompt_logprobs must be between 0 and {max_logprobs}, got {self.prompt_logprobs}.",
                              "prompt_logprobs")

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
                include_stop_str_in_output=self.include_stop_str_in_output,
                prompt_logprobs=self.prompt_logprobs, structured_outputs=structured)
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
        self._check_unsupported()
        if self.suffix:
            raise bad_request("suffix is not supported.", "suffix")
        if self.logprobs is not None:
            if self.logprobs < 0:
                raise bad_request(f"logprobs must be non-negative, got {self.logprobs}.", "logprobs")
            if self.logprobs > max_logprobs:
                raise bad_request(f"logprobs must be at most {max_logprobs}, got {self.logprobs}.", "logprobs")
        so = self.structured_outputs_params()
        params = self._params(self.max_tokens, self.logprobs, defaults, max_logprobs, so[1] if so else None)
        if self.echo and self.logprobs is not None:
            # The echoed prompt tokens get theirs too (OpenAI).
            params.prompt_logprobs = max(self.logprobs, params.prompt_logprobs or 0)
        return params


class ChatCompletionRequest(_SamplingFields):
    messages: Any  # a list of {role, content, ...} (OpenAIServing.render_chat checks it)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    tools: Optional[Any] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    include_reasoning: bool = True
    continue_final_message: bool = False

    def sampling_params(self, max_logprobs: int, defaults: Dict[str, Any],
                        tool_constraint: Optional[Tuple[str, StructuredOutputsParams]] = None) -> SamplingParams:
        """tool_constraint: the schema tool_choice "required" or a named function puts on the output."""
        self._check_common()
        self._check_unsupported(_CHAT_ONLY_REFUSED)
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt set to false.",
                              "continue_final_message")
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
        so = self.structured_outputs_params(tool_constraint)
        return self._params(max_tokens, logprobs, defaults, max_logprobs, so[1] if so else None)

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
