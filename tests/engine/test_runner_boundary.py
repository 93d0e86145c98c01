"""The runner needs nothing but the plain-data batch: every step's ScheduledBatch and RunnerOutput go through
msgpack (as they would to a runner in a worker process) and the outputs stay those of the in-process runner,
through prefix-cache hits, chunked prefill, preemption, n > 1, logprobs and seeded sampling."""

from __future__ import annotations

from gyrfalcon import LLM, SamplingParams
from gyrfalcon.step_io import decode_batch, decode_output, encode_batch, encode_output


class _ThroughMsgpack:
    """Wraps a runner: launch() sees only the decoded batch; complete() returns the decoded output."""

    def __init__(self, inner):
        self.inner = inner
        self.num_steps = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def launch(self, batch):
        self.num_steps += 1
        handle = self.inner.launch(decode_batch(encode_batch(batch)))
        handle.batch = batch  # the engine's side keeps its own batch (with its Request objects)
        return handle

    def complete(self, handle):
        return decode_output(encode_output(self.inner.complete(handle)))


def test_outputs_unchanged_through_the_codec(qwen3_ckpt):
    kw = dict(block_size=4, max_model_len=64, max_num_batched_tokens=24, num_gpu_blocks_override=20,
              device="cpu")
    shared = list(range(3, 19))
    prompts = [{"prompt_token_ids": shared + [i, i + 1]} for i in range(4)] + \
              [{"prompt_token_ids": list(range(20, 60))}]
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True, n=2),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    want = LLM(str(qwen3_ckpt), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(qwen3_ckpt), **kw)
    wrapped = _ThroughMsgpack(llm.engine.runner)
    llm.engine.runner = wrapped
    got = llm.generate(prompts, params, use_tqdm=False)
    assert wrapped.num_steps > 5 and llm.engine.scheduler.num_preemptions_total > 0
    for g, w in zip(got, want):
        assert [(c.token_ids, c.logprobs) for c in g.outputs] == [(c.token_ids, c.logprobs) for c in w.outputs]
        assert g.prompt_logprobs == w.prompt_logprobs
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
