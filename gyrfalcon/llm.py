"""LLM: the offline API. Drives an in-process Engine; names and shapes follow vLLM's `LLM`."""

from __future__ import annotations

import itertools
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from gyrfalcon.config import EngineConfig
from gyrfalcon.engine.engine import Engine, freeze_gc_after_startup, gc_frozen_while_running
from gyrfalcon.engine_args import check_kwargs, llm_signature
from gyrfalcon.output_processor import OutputProcessor
from gyrfalcon.outputs import RequestOutput
from gyrfalcon.runner.model_runner import start_device_init
from gyrfalcon.sampling_params import SamplingParams
from gyrfalcon.tokenizer import encode, load_tokenizer, render_chat

PromptType = Union[str, List[int], Dict[str, Any]]

# generation_config.json fields that become sampling defaults (vLLM's set), with SamplingParams' names. A GGUF
# file's general.sampling.* keys arrive under the same names (models/gguf_loader.py sampling_defaults).
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


class LLM:
    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        """model: a checkpoint directory, GGUF file or hub id (None: the default model); kwargs: the engine
        settings declared in engine_args.ENGINE_ARGS, by vLLM's names (max_model_len=, block_size=, ...), which
        __signature__ lists with their defaults."""
        check_kwargs(kwargs, public_only=True, who="LLM")
        # (with worker processes, each makes its own on its GPU: none here)
        if kwargs.get("tensor_parallel_size", 1) == kwargs.get("pipeline_parallel_size", 1) == 1:
            start_device_init(kwargs.get("device", "auto"))  # the CUDA context, while the config and tokenizer load
        self.config = EngineConfig.create(model, **kwargs, offline=True)
        mc = self.config.model_config
        self.tokenizer = load_tokenizer(mc.tokenizer_path, mc.trust_remote_code)
        self.engine = Engine(self.config, mc.eos_token_ids(self.tokenizer.eos_token_id))
        freeze_gc_after_startup(default=False)  # GYRFALCON_GC_FREEZE=1 (engine.py)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def get_metrics(self):
        """The engine's metrics now, as vLLM's LLM.get_metrics() gives them: a list of Counter / Gauge / Vector
        (gyrfalcon/metrics_reader.py), named as on the server's /metrics (gyrfalcon:spec_decode_num_drafts, ...)."""
        from gyrfalcon.metrics_reader import engine_metrics
        return engine_metrics(self.engine, self.config.model_config.served_model_name)

    def default_sampling_overrides(self) -> Dict[str, Any]:
        """The sampling fields the model's generation_config.json sets (temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens as max_tokens)."""
        gen = self.config.model_config.generation_config
        return {ours: gen[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items() if gen.get(theirs) is not None}

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate / chat use when given no sampling params (as vLLM does): SamplingParams' defaults with
        the model's generation_config.json values over them."""
        return SamplingParams(**self.default_sampling_overrides())

    def _to_token_ids(self, prompt: PromptType):
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return None, list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("A prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            return prompt, encode(self.tokenizer, prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError(f"Unsupported prompt type {type(prompt).__name__}: use a string, a list of "
                        "token ids, or a dict with 'prompt' / 'prompt_token_ids'.")

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> List[RequestOutput]:
        """One RequestOutput per prompt, in the order given."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"Got {len(params)} sampling params for {len(prompts)} prompts.")
        # Validate everything first so a bad prompt leaves nothing half-submitted.
        encoded = [self._to_token_ids(p) for p in prompts]
        for (_, ids), p in zip(encoded, params):
            self.engine.validate_prompt(ids)
            self.engine.validate_params(p)
        return self._run([(text, ids, p) for (text, ids), p in zip(encoded, params)], use_tqdm)

    def chat(self, messages, sampling_params: Optional[SamplingParams] = None, use_tqdm: bool = True,
             chat_template: Optional[str] = None, add_generation_prompt: bool = True) -> List[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"}) or a list of conversations."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            text = render_chat(self.tokenizer, conv, chat_template, add_generation_prompt)
            prompts.append({"prompt_token_ids": encode(self.tokenizer, text, add_special_tokens=False)})
        outs = self.generate(prompts, sampling_params, use_tqdm)
        for o, p in zip(outs, prompts):
            o.prompt = self.tokenizer.decode(p["prompt_token_ids"])
        return outs

    def capture_hidden_states(self, sequences: Sequence[Sequence[int]], aux_layer_ids: Sequence[int],
                              use_tqdm: bool = True) -> Iterator[tuple]:
        """Per token sequence (prompt + response ids), one prefill of it through the engine's own model, outside
        the scheduler (ModelRunner.capture_hidden_states): yields (aux [T, len(aux_layer_ids) * hidden], final
        [T, hidden]) on the CPU in the model's dtype. aux: the residual stream entering each of aux_layer_ids
        (ascending; 0: the embedding output), what an EAGLE-3 draft reads; final: the final-normed hidden state,
        whose compute_logits are the target's logits. For draft training (gyrfalcon/train/)."""
        runner = self.engine.runner
        if not callable(getattr(runner, "capture_hidden_states", None)):
            raise ValueError("capture_hidden_states needs the in-process runner (tensor_parallel_size 1).")
        max_len = self.config.model_config.max_model_len
        # Sequences go in varlen batches of up to the engine's prefill budget (a longer one alone): the memory
        # profile sized the activations for that many tokens.
        budget = self.config.scheduler_config.max_num_batched_tokens
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(sequences), desc="Capturing hidden states", dynamic_ncols=True)
        batch: List[List[int]] = []
        tokens = 0  # in batch
        for n, ids in enumerate(sequences):
            if len(ids) > max_len:
                raise ValueError(f"A sequence of {len(ids)} tokens is longer than max_model_len {max_len}.")
            batch.append(list(ids))
            tokens += len(ids)
            if n + 1 == len(sequences) or tokens + len(sequences[n + 1]) > budget:
                for aux, final in runner.capture_hidden_states(batch, aux_layer_ids):
                    yield aux.cpu(), final.cpu()
                if bar is not None:
                    bar.update(len(batch))
                batch, tokens = [], 0
        if bar is not None:
            bar.close()

    def stream(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None) -> Iterator[str]:
        """One prompt's completion as it is generated: the new text of each engine step that added some (stop
        strings held back until they cannot match). n must be 1. Closing the iterator early (break, an
        exception, Ctrl-C) aborts the request."""
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        if params.n != 1:
            raise ValueError("stream() generates one sample; use n=1.")
        text, ids = self._to_token_ids(prompt)
        self.engine.validate_prompt(ids)
        self.engine.validate_params(params)
        processor = OutputProcessor(self.tokenizer)  # text token by token: the stream reads it as it grows
        rid = str(next(self._counter))
        [(eid, child)] = processor.add_request(rid, text, ids, params)
        sample = processor.requests[rid].samples[0]
        self.engine.add_request(eid, ids, child)
        try:
            while not sample.finished and self.engine.has_unfinished_requests():
                _, to_finish = processor.process(self.engine.step())
                for done in to_finish:
                    self.engine.finish_request(done)
                delta = sample.take_delta()[0]
                if delta:
                    yield delta
        finally:
            if not sample.finished:
                self.engine.abort_request(eid)

    def _run(self, items, use_tqdm: bool) -> List[RequestOutput]:
        processor = OutputProcessor(self.tokenizer, defer_text=True)
        order: List[str] = []
        submitted: List[str] = []
        try:
            for text, ids, params in items:
                rid = str(next(self._counter))
                order.append(rid)
                for eid, child in processor.add_request(rid, text, ids, params):
                    self.engine.add_request(eid, ids, child)
                    submitted.append(eid)
            results: Dict[str, RequestOutput] = {}
            bar = None
            if use_tqdm:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(order), desc="Processed prompts", dynamic_ncols=True)
            with gc_frozen_while_running():
                while self.engine.has_unfinished_requests():
                    touched, to_finish = processor.process(self.engine.step())
                    for eid in to_finish:
                        self.engine.finish_request(eid)
                    for st in touched:
                        if st.finished:
                            results[st.request_id] = st.request_output()
                            if bar is not None:
                                bar.update(1)
            if bar is not None:
                bar.close()
            return [results[rid] for rid in order]
        except BaseException:
            # Interrupted (or failed): nothing may keep holding KV blocks.
            for eid in submitted:
                self.engine.abort_request(eid)
            raise


LLM.__init__.__signature__ = llm_signature()  # type: ignore[attr-defined]
