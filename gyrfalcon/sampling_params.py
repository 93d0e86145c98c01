"""SamplingParams: how one request's tokens are chosen and when it stops.

Names, defaults and meanings follow vLLM's `SamplingParams`, so code written for vLLM runs by
changing the import.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Union

_SAMPLING_EPS = 1e-5
_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1
# JSON whitespace between two tokens is capped at this many characters (a newline and the indentation of
# pretty-printing 15 levels deep fit): without a cap, a weak model can fill max_tokens with blanks, which JSON
# allows without bound. disable_any_whitespace allows none.
JSON_MAX_WHITESPACE = 32
# top_k travels to the sampler as a 64-bit integer and is clamped to the vocabulary there; any value past a
# 32-bit vocabulary is a mistake, not a setting.
_MAX_TOP_K = 2 ** 31 - 1


class SamplingParamsError(ValueError):
    """An invalid sampling value; `param` names the field (the server's 400 body carries it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output, compiled by xgrammar into a token mask applied before sampling (vLLM's
    `StructuredOutputsParams`): exactly one of `json` (a JSON schema, as a dict or its text), `regex`, `choice`
    (the output is one of these strings), `grammar` (EBNF, xgrammar's dialect: GBNF-like) or `json_object`
    (any JSON object). The output ends (finish_reason "stop") when the constraint is complete: from there only
    the end-of-sequence token is allowed.

    disable_any_whitespace: JSON without whitespace between tokens (a small model can otherwise loop on
    newlines and spaces, which JSON allows without bound)."""

    json: Optional[Union[str, Dict[str, Any]]] = None
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False
    # Token ids that end a thinking model's reasoning (its "</think>"): the constraint applies to the output after
    # them, and the reasoning before is free. The server sets it for chat requests when it runs a
    # --reasoning-parser and the prompt has not already closed the reasoning (thinking off).
    reasoning_end: Optional[List[int]] = None

    _KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self._KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs needs exactly one of json, regex, choice, grammar and json_object"
                + (f"; got {', '.join(given)}." if given else "; got none."), "structured_outputs")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise SamplingParamsError("structured_outputs.json must be a JSON schema (an object or its text).",
                                      "structured_outputs")
        if self.regex is not None and not isinstance(self.regex, str):
            raise SamplingParamsError("structured_outputs.regex must be a string.", "structured_outputs")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise SamplingParamsError("structured_outputs.grammar must be a string.", "structured_outputs")
        end = self.reasoning_end
        if end is not None and (not isinstance(end, (list, tuple)) or not end
                                or not all(isinstance(t, int) for t in end)):
            raise SamplingParamsError("structured_outputs.reasoning_end must be a non-empty list of token ids.",
                                      "structured_outputs")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise SamplingParamsError("structured_outputs.choice must be a non-empty list of strings.",
                                          "structured_outputs")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(k for k in self._KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """One string per distinct grammar: what compiled grammars are cached by (reasoning_end is not part of it)."""
        value = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.disable_any_whitespace], sort_keys=True, ensure_ascii=False)

    def to_dict(self) -> Dict[str, Any]:
        """Plain data for msgpack (the engine core and a runner in another process rebuild it)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def build_grammar(self):
        """The xgrammar Grammar (parsed, not yet compiled against a vocabulary); a SamplingParamsError (a
        ValueError) that names the problem when the schema, regex or grammar is invalid. The server calls it while
        validating a request, so a bad one is a 400, never an error inside the engine."""
        import xgrammar as xgr

        try:
            if self.json is not None or self.json_object:
                # json_object: a JSON object (OpenAI's meaning), not any JSON value as xgrammar's builtin grammar.
                schema = self.json if self.json is not None else {"type": "object"}
                if self.disable_any_whitespace:
                    return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
                return xgr.Grammar.from_json_schema(schema, max_whitespace_cnt=JSON_MAX_WHITESPACE)
            if self.regex is not None:
                return xgr.Grammar.from_regex(self.regex)
            if self.choice is not None:
                # EBNF string literals take JSON's escapes (quotes, backslashes, control characters).
                alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
                return xgr.Grammar.from_ebnf(f"root ::= {alts}")
            return xgr.Grammar.from_ebnf(self.grammar)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types with the reason
            what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}[self.kind]
            msg = str(e).strip()
            # xgrammar prefixes its C++ messages with "[time] file:line: "; the reason is what follows.
            if msg.startswith("[") and ": " in msg:
                msg = msg.split(": ", 1)[1].strip()
            raise SamplingParamsError(f"Invalid {what} for structured outputs: {msg}", "structured_outputs") from None


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Token id -> value added to its logit before sampling (OpenAI's logit_bias: -100 bans, +100 forces).
    logit_bias: Optional[Dict[int, float]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # A constraint on the output (JSON schema, regex, choice, grammar): a token mask before sampling.
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Filled in by the engine from the tokenizer / generation config, not by users.
    _eos_token_id: Optional[int] = field(default=None, repr=False)
    _all_stop_token_ids: frozenset = field(default_factory=frozenset, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            try:  # JSON object keys arrive as strings
                self.logit_bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()} or None
            except (TypeError, ValueError):
                raise SamplingParamsError("logit_bias must map token ids to numbers.", "logit_bias") from None
        if isinstance(self.structured_outputs, dict):  # as it crosses a process boundary (msgpack)
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                   StructuredOutputsParams):
            raise SamplingParamsError("structured_outputs must be a StructuredOutputsParams.", "structured_outputs")
        if self.top_k is None or self.top_k == -1:  # vLLM's "no top-k"
            self.top_k = 0
        self._verify()  # the values as given: greedy requests get no pass for invalid ones
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other sampling knobs cannot change an argmax.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        def bad(param: str, msg: str) -> None:
            raise SamplingParamsError(msg, param)

        def finite(param: str) -> None:
            # JSON parsers accept NaN and Infinity; NaN slips past every range check below, and either one
            # reaching the sampler would turn a request's logits into NaN.
            v = getattr(self, param)
            try:
                ok = math.isfinite(float(v))
            except (TypeError, ValueError):
                ok = False
            if not ok:
                bad(param, f"{param} must be a finite number, got {v!r}.")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            finite(name)
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"n must be an integer >= 1, got {self.n}.")
        if self.temperature < 0.0:
            bad("temperature", f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            bad("top_k", f"top_k must be an integer, got {self.top_k!r}.")
        if self.top_k < -1 or self.top_k > _MAX_TOP_K:
            bad("top_k", f"top_k must be -1 or 0 (no top-k) or in [1, {_MAX_TOP_K}], got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            bad("min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens}).")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", f"repetition_penalty must be positive, got {self.repetition_penalty}.")
        if any(not isinstance(s, str) for s in self.stop):
            bad("stop", "stop must be a string or a list of strings.")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must not be empty.")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= _INT64_MAX:
                bad("stop_token_ids", f"stop_token_ids must be token ids (non-negative integers), got {t!r}.")
        if self.seed is not None:
            # A 64-bit integer (it crosses to the engine core as one), and so is the last sample's seed + n - 1.
            if not isinstance(self.seed, int) or isinstance(self.seed, bool):
                bad("seed", f"seed must be an integer, got {self.seed!r}.")
            if not _INT64_MIN <= self.seed <= _INT64_MAX - (self.n - 1):
                bad("seed", f"seed must be a 64-bit integer in [-2**63, 2**63 - {self.n}] (sample i of n uses seed "
                            f"+ i), got {self.seed}.")
        if self.logit_bias:
            for tok, b in self.logit_bias.items():
                if tok < 0:
                    bad("logit_bias", f"logit_bias token ids must be non-negative, got {tok}.")
                if not -100.0 <= b <= 100.0:
                    bad("logit_bias", f"logit_bias values must be in [-100, 100], got {b} for token {tok}.")

    def to_dict(self) -> Dict[str, Any]:
        """The public fields as plain data (msgpack across processes); the engine fills the private ones."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        if self.structured_outputs is not None:
            d["structured_outputs"] = self.structured_outputs.to_dict()
        return d

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)

    def child(self, index: int) -> "SamplingParams":
        """The params of the index-th of n parallel samples: n=1, and a distinct seed if seeded."""
        p = self.clone()
        p.n = 1
        if p.seed is not None:
            p.seed = p.seed + index
        if index > 0:
            p.prompt_logprobs = None  # the prompt's logprobs come once, with the first sample
        return p
