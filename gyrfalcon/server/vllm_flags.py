"""The flag names of `vllm serve` (its server and engine arguments, vLLM 0.8 - 0.11), so that a vLLM launch script
run against gyrfalcon stops with a message naming the vLLM flag gyrfalcon does not support, rather than argparse's
bare "unrecognized arguments". Names only: gyrfalcon's own flags (most of vLLM's common ones) are matched first,
so this list only decides how an unknown flag is reported.
"""

from __future__ import annotations

from typing import List, Optional

VLLM_SERVE_FLAGS = frozenset("""
--additional-config --allow-credentials --allowed-headers --allowed-local-media-path --allowed-media-domains
--allowed-methods --allowed-origins --api-key --api-server-count --async-scheduling --block-size
--calculate-kv-scales --chat-template --chat-template-content-format --code-revision --collect-detailed-traces
--compilation-config --config --config-format --cpu-offload-gb --cuda-graph-sizes --data-parallel-address
--data-parallel-backend --data-parallel-hybrid-lb --data-parallel-rank --data-parallel-rpc-port
--data-parallel-size --data-parallel-size-local --data-parallel-start-rank --decode-context-parallel-size
--default-mm-loras --device --disable-async-output-proc --disable-cascade-attn --disable-chunked-mm-input
--disable-custom-all-reduce --disable-fastapi-docs --disable-frontend-multiprocessing --disable-hybrid-kv-cache-manager
--disable-log-requests --disable-log-stats --disable-mm-preprocessor-cache --disable-sliding-window
--disable-uvicorn-access-log --distributed-executor-backend --download-dir --dtype --enable-auto-tool-choice
--enable-chunked-prefill --enable-dbo --enable-eplb --enable-expert-parallel --enable-force-include-usage
--enable-log-outputs --enable-log-requests --enable-lora --enable-lora-bias --enable-multimodal-encoder-data-parallel
--enable-prefix-caching --enable-prompt-embeds --enable-prompt-tokens-details --enable-request-id-headers
--enable-server-load-tracking --enable-sleep-mode --enable-ssl-refresh --enable-tokenizer-info-endpoint
--enforce-eager --eplb-config --eplb-log-balancedness --eplb-step-interval --eplb-window-size
--exclude-tools-when-tool-choice-none
--fully-sharded-loras --generation-config --gpu-memory-utilization --guided-decoding-backend
--guided-decoding-disable-additional-properties --guided-decoding-disable-any-whitespace
--guided-decoding-disable-fallback --h11-max-header-count --h11-max-incomplete-event-size --headless
--hf-config-path --hf-overrides --hf-token --host --ignore-patterns --interleave-mm-strings --kv-cache-dtype
--kv-cache-memory --kv-events-config --kv-sharing-fast-prefill --kv-transfer-config --limit-mm-per-prompt
--load-format --log-config-file --log-error-stack --logits-processor-pattern --logits-processors --logprobs-mode
--long-lora-scaling-factors --long-prefill-token-threshold --lora-dtype --lora-extra-vocab-size --lora-modules
--max-cpu-loras --max-log-len --max-logprobs --max-long-partial-prefills --max-lora-rank --max-loras
--max-model-len --max-num-batched-tokens --max-num-partial-prefills --max-num-seqs --max-parallel-loading-workers
--max-seq-len-to-capture --middleware --mm-encoder-tp-mode --mm-processor-cache-gb --mm-processor-cache-type
--mm-processor-kwargs --model --model-impl --model-loader-extra-config --multi-step-stream-outputs
--num-gpu-blocks-override --num-lookahead-slots --num-redundant-experts --num-scheduler-steps
--otlp-traces-endpoint --override-attention-dtype --override-generation-config --override-neuron-config
--override-pooler-config --pipeline-parallel-size --port --preemption-mode --prefix-caching-hash-algo
--pt-load-map-location --qlora-adapter-name-or-path --quantization --ray-workers-use-nsight --reasoning-parser
--reasoning-parser-plugin --response-role --return-tokens-as-token-ids --revision --root-path --rope-scaling
--rope-theta --runner --safetensors-load-strategy --scheduler-cls --scheduler-delay-factor --scheduling-policy
--seed --served-model-name --show-hidden-metrics-for-version --skip-tokenizer-init --speculative-config
--ssl-ca-certs --ssl-cert-reqs --ssl-certfile --ssl-keyfile --structured-outputs-config --swap-space --task
--tensor-parallel-size --tokenizer --tokenizer-mode --tokenizer-pool-extra-config --tokenizer-pool-size
--tokenizer-pool-type --tokenizer-revision --tool-call-parser --tool-parser-plugin --tool-server --trust-remote-code
--uds --use-tqdm-on-load --uvicorn-log-level --worker-cls --worker-extension-cls --enable-return-routed-experts
--no-enable-prefix-caching --no-enable-chunked-prefill --no-trust-remote-code --no-enforce-eager
--no-async-scheduling --no-enable-expert-parallel --no-enable-log-requests -tp -pp -dp -q -asc -dpr -O
""".split())


# `vllm bench serve`'s flags (vLLM 0.10 - 0.11), for `gyrfalcon bench serve`.
VLLM_BENCH_SERVE_FLAGS = frozenset("""
--append-result --backend --base-url --blazedit-max-distance --blazedit-min-distance --burstiness
--custom-output-len --custom-skip-chat-template --dataset-name --dataset-path --disable-shuffle --disable-tqdm
--endpoint --endpoint-type --extra-body --goodput --header --hf-name --hf-output-len --hf-split --hf-subset --host
--ignore-eos --insecure --label --logprobs --lora-modules --max-concurrency --metadata --metric-percentiles --min-p
--model --no-oversample --no-stream --num-prompts --num-warmups --percentile-metrics --port
--prefix-repetition-num-prefixes --prefix-repetition-output-len --prefix-repetition-prefix-len
--prefix-repetition-suffix-len --profile --ramp-up-end-rps --ramp-up-start-rps --ramp-up-strategy --random-batch-size
--random-input-len --random-mm-base-items-per-request --random-mm-bucket-config --random-mm-limit-mm-per-prompt
--random-mm-num-mm-items-range-ratio --random-output-len --random-prefix-len --random-range-ratio
--ready-check-timeout-sec --request-id-prefix --request-rate --result-dir --result-filename --save-detailed
--save-result --seed --served-model-name --sharegpt-output-len --skip-chat-template --sonnet-input-len
--sonnet-output-len --sonnet-prefix-len --spec-bench-category --spec-bench-output-len --temperature --tokenizer
--tokenizer-mode --top-k --top-p --trust-remote-code --use-beam-search
""".split())


def unsupported_vllm_flags(extra: List[str], known: frozenset = VLLM_SERVE_FLAGS) -> List[str]:
    """The words of `extra` (what argparse did not recognize) that are in `known` (vLLM's flags), in order."""
    out = []
    for word in extra:
        name = word.split("=", 1)[0]
        if name.startswith("-") and name in known and name not in out:
            out.append(name)
    return out


def unknown_flags_message(extra: List[str], command: str = "serve") -> Optional[str]:
    """What to tell the user about unrecognized words of `gyrfalcon <command>` ("serve", "bench serve", ...); None
    when none of them is a vLLM flag (argparse's own message then)."""
    known = VLLM_BENCH_SERVE_FLAGS if command == "bench serve" else VLLM_SERVE_FLAGS
    vllm = unsupported_vllm_flags(extra, known)
    if not vllm:
        return None
    flags = ", ".join(vllm)
    what = "vllm bench serve" if command == "bench serve" else "vLLM"
    return (f"{flags} {'is a ' + what + ' flag' if len(vllm) == 1 else 'are ' + what + ' flags'} that gyrfalcon "
            f"does not support; remove {'it' if len(vllm) == 1 else 'them'} from the command line (`gyrfalcon "
            f"{command} --help` lists the flags gyrfalcon has).")
