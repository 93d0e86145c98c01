"""`gyrfalcon bench latency` on the CPU (the GPU-only profile parts are exercised by scripts/gpu/):
the table's numbers and the JSON, and the prefill profile's plumbing and arithmetic."""

import json

import pytest
import torch


def test_bench_latency_cpu_writes_json(qwen3_ckpt, tmp_path, capsys):
    from gyrfalcon.cli import main

    out = tmp_path / "lat.json"
    rc = main(["bench", "latency", "--model", str(qwen3_ckpt), "--batch-size", "2", "--input-len", "8",
               "--output-len", "16", "--num-iters", "3", "--max-model-len", "64", "--output-json", str(out)])
    assert rc == 0
    g = json.loads(out.read_text())["results"]["gyrfalcon"]
    assert g["ttft_ms"] > 0 and g["e2e_s"] > 0
    # The step time is the median full run less the median TTFT, over the 15 steps after the first token (vLLM's
    # bench latency arithmetic). Its sign is not asserted: on CI's busy 2-core host one slow TTFT run has exceeded
    # a whole full run (the bench then prints a warning), which is timing noise, not a wrong result.
    assert g["decode_step_ms"] == pytest.approx((g["e2e_s"] * 1e3 - g["ttft_ms"]) / 15)
    assert g["output_tok_s"] == pytest.approx(2 * 16 / g["e2e_s"])
    assert g["decode_tok_s"] == pytest.approx(2 / (g["decode_step_ms"] * 1e-3))
    # The read roofline leaves out the untied embedding table (only its batch's rows are gathered a step).
    from safetensors import safe_open
    with safe_open(str(qwen3_ckpt / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()  # untied: the LM head is a weight of its own
        numel = {k: f.get_slice(k).get_shape() for k in f.keys()}
    numel = {k: int(torch.Size(v).numel()) for k, v in numel.items()}
    elem = g["weight_bytes"] // sum(numel.values())  # the engine's weight dtype
    assert g["weight_bytes"] == elem * sum(numel.values())
    assert g["read_weight_bytes"] == g["weight_bytes"] - elem * numel["model.embed_tokens.weight"]
    assert g["roofline_read_fraction"] == pytest.approx(
        g["roofline_fraction"] * (g["read_weight_bytes"] + g["kv_bytes_per_step"])
        / (g["weight_bytes"] + g["kv_bytes_per_step"]))
    # The startup's phases (a CPU runner has no device init and no graphs) add up to the measured startup.
    ph = g["startup_phases"]
    assert list(ph) == ["load", "kv_sizing", "kv_alloc", "other"] and min(ph.values()) >= 0
    assert sum(ph.values()) == pytest.approx(g["startup_s"]) and ph["load"] == g["load_s"]
    printed = capsys.readouterr().out
    assert "latency: batch 2, input 8, output 16, greedy" in printed
    assert f"startup {g['startup_s']:.1f} s: load {ph['load']:.1f}, kv_sizing" in printed


def test_bench_latency_step_clock(qwen3_ckpt, tmp_path, capsys):
    """The step clock counts the engine steps of the median full run and splits its wall time."""
    from gyrfalcon.cli import main

    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", str(qwen3_ckpt), "--batch-size", "2", "--input-len", "8",
                 "--output-len", "8", "--num-iters", "1", "--max-model-len", "64", "--output-json", str(out),
                 "--step-events", "--ttft-timeline"]) == 0
    g = json.loads(out.read_text())["results"]["gyrfalcon"]
    # --step-events records CUDA events only: nothing on the CPU; --ttft-timeline profiles the host there
    assert "step_events" not in g
    tl = g["ttft_timeline"]
    assert tl["generate_ms"] > 0 and len(tl["steps"]) >= 1 and tl["admission_ms"] > 0
    sc = g["step_clock"]
    # Async scheduling is off on the CPU: one step for the prefill, then one per further token.
    assert sc["steps"] == 8
    assert len(sc["first_intervals_ms"]) == 3 and 0 < sc["median_ms"] <= sc["p90_ms"] <= sc["max_ms"]
    assert sc["steady_excess_ms"] >= 0 and sc["tail_ms"] >= 0
    assert g["steady_decode_tok_s"] == pytest.approx(2 / (sc["median_ms"] * 1e-3))
    # The steps and the tail fit inside the run that the e2e time measured.
    assert sum(sc["first_intervals_ms"]) + sc["median_ms"] * 4 <= g["e2e_s"] * 1e3 * 1.5
    printed = capsys.readouterr().out
    assert "engine steps of the median run: 8" in printed and "TTFT timeline (ms from the generate's start" in printed
    assert g["gpu_power"] == {}  # no GPU clock or power sampled on a CPU run


def test_step_clock_sums_gc_time():
    """A collection that runs inside a watched call is timed, by generation."""
    import gc

    from gyrfalcon.bench.latency import StepClock

    class FakeEngine:
        def step(self):
            return []

    eng = FakeEngine()
    clock = StepClock(eng)

    def run():
        for _ in range(5):
            eng.step()
        gc.collect(1)
        return "done"

    hooks = list(gc.callbacks)
    assert clock.watch(run) == "done"
    assert eng.step.__func__ is FakeEngine.step  # unwrapped afterwards
    assert len(clock.runs[0][1]) == 5 and clock.runs[0][3].get(1, 0) > 0
    assert gc.callbacks == hooks  # its GC hook removed again
    timed = dict(clock.runs[0][3])
    gc.collect(1)  # after the run: not counted
    assert clock.runs[0][3] == timed


def test_bench_latency_cpu_sampled(qwen3_ckpt, tmp_path, capsys):
    """--temperature 1.0: vLLM's bench latency samples (temperature 1.0, top-p 1.0), not greedy."""
    from gyrfalcon.cli import main

    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", str(qwen3_ckpt), "--batch-size", "2", "--input-len", "8",
                 "--output-len", "32", "--num-iters", "3", "--max-model-len", "64", "--temperature", "1.0",
                 "--output-json", str(out)]) == 0
    d = json.loads(out.read_text())
    g = d["results"]["gyrfalcon"]
    assert d["args"]["temperature"] == 1.0 and g["e2e_s"] > 0
    assert g["decode_step_ms"] == pytest.approx((g["e2e_s"] * 1e3 - g["ttft_ms"]) / 31)
    assert "output 32, temperature 1;" in capsys.readouterr().out


def test_bench_latency_warns_when_ttft_exceeds_the_full_run(qwen3_ckpt, tmp_path, monkeypatch, capsys):
    """A slow TTFT run longer than the whole full run gives a negative step time: the bench still prints its table
    and writes its JSON, and warns that the steps are below the measurement's noise."""
    from gyrfalcon.bench import latency
    from gyrfalcon.cli import main

    real = latency.run_gyrfalcon

    def slow_ttft(args):
        g = real(args)
        g["ttft_ms"] = g["e2e_s"] * 1e3 + 5.0  # as one slow 1-token run on a busy host
        g["decode_step_ms"] = (g["e2e_s"] * 1e3 - g["ttft_ms"]) / (args.output_len - 1)
        return g

    monkeypatch.setattr(latency, "run_gyrfalcon", slow_ttft)
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", str(qwen3_ckpt), "--batch-size", "1", "--input-len", "4",
                 "--output-len", "4", "--num-iters", "1", "--max-model-len", "32", "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "took no longer than TTFT" in printed and "raise --output-len or --num-iters" in printed
    assert json.loads(out.read_text())["results"]["gyrfalcon"]["decode_step_ms"] < 0


def test_prefill_summary_arithmetic():
    from gyrfalcon.bench.latency import prefill_summary

    assert prefill_summary([], 10, 100) == {}
    k = [("gemm", 0.0, 600.0), ("norm", 600.0, 700.0), ("gemm", 800.0, 1400.0)]  # us; a 100 us gap
    s = prefill_summary(k, tokens=1000, layer_params=5 * 10**8)
    assert s["kernels"] == 3 and s["gpu_span_ms"] == pytest.approx(1.4) and s["gpu_busy_ms"] == pytest.approx(1.3)
    assert s["layer_tflop"] == pytest.approx(1.0)  # 2 x 5e8 x 1000
    assert s["layer_tflop_per_s_over_span"] == pytest.approx(1.0 / 1.4e-3)
    assert s["top_kernels"][0] == ["gemm", 2, pytest.approx(1.2)]


def test_profile_prefill_drains_the_engine(qwen3_ckpt, monkeypatch):
    """On the CPU the profiler sees no CUDA kernels ({}), but the step it profiles and the drain after it
    run for real: no request may be left behind."""
    from gyrfalcon import LLM
    from gyrfalcon.bench.latency import profile_prefill

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    llm = LLM(str(qwen3_ckpt), max_model_len=64, max_num_seqs=4)
    assert profile_prefill(llm, [[3, 4, 5, 6], [7, 8, 9]]) == {}
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_count_launches_drains_the_engine(qwen3_ckpt, monkeypatch):
    """The decode-step profile's plumbing on the CPU: no CUDA activity, so no kernels, no busy time and no idle
    pairs, while the profiled steps and the drain run for real."""
    from gyrfalcon import LLM
    from gyrfalcon.bench.latency import count_launches

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    llm = LLM(str(qwen3_ckpt), max_model_len=64, max_num_seqs=4)
    pr = count_launches(llm, [[3, 4, 5, 6], [7, 8, 9]], steps=3)
    assert pr["kernels_per_step"] == 0 and pr["gpu_busy_union_us_per_step"] == 0 and pr["idle_by_pair"] == []
    assert pr["kernels_by_op"] == {}
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_kernel_op_names():
    """Launches are charged to the op their kernel belongs to: the fused-MoE steps, cuBLAS GEMMs, torch's router
    kernels, gyrfalcon's Triton kernels by their jit names."""
    from gyrfalcon.bench.latency import kernel_op

    assert kernel_op("_moe_align_kernel") == "moe_sort" and kernel_op("_moe_gate_up_kernel") == "moe_gate_up"
    assert kernel_op("_moe_down_kernel") == "moe_down" and kernel_op("_moe_sum_kernel") == "moe_sum"
    assert kernel_op("nvjet_tst_128x64_64x8_1x1_v_bz_coopA_TNT") == "gemm"
    assert kernel_op("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert kernel_op("_fp8_gemm_kernel") == "fp8_gemm" and kernel_op("_norm_gemv_kernel") == "norm_gemv"
    assert kernel_op("void at::native::sbtopk::gatherTopK<float, unsigned int, 2>") == "torch_topk_sort"
    assert kernel_op("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>") == "torch_softmax"
    assert kernel_op("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>") \
        == "torch_other"
    assert kernel_op("_decode_split_kernel") == "attention" and kernel_op("_qkv_prep_kernel") == "qkv_prep"
    assert kernel_op("_mla_kv_prep_kernel") == "mla_prep" and kernel_op("_mla_q_prep_kernel") == "mla_prep"
    assert kernel_op("_mla_decode_split_kernel") == "attention" and kernel_op("_indexer_scores_kernel") == "dsa_indexer"
    assert kernel_op("_mla_prefill_tiled_kernel") == "attention" == kernel_op("_mla_prefill_expanded_kernel")
    assert kernel_op("some_new_kernel") == "other"


def test_bench_latency_compare_unfused(qwen3_ckpt, tmp_path, capsys):
    """--compare-unfused: the same benchmark in a child process with GYRFALCON_DISABLE_FUSION=1, both reported."""
    from gyrfalcon.cli import main

    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", str(qwen3_ckpt), "--batch-size", "1", "--input-len", "8",
                 "--output-len", "4", "--num-iters", "1", "--num-iters-warmup", "0", "--max-model-len", "64",
                 "--output-json", str(out), "--compare-unfused"]) == 0
    res = json.loads(out.read_text())["results"]
    g, u = res["gyrfalcon"], res["unfused"]
    assert g["fusion"] is True and u["fusion"] is False  # the child did read the switch
    assert u["ttft_ms"] > 0 and u["e2e_s"] > 0
    assert res["fused_vs_unfused"]["ttft_ratio"] == pytest.approx(u["ttft_ms"] / g["ttft_ms"])
    printed = capsys.readouterr().out
    assert "fused vs unfused (GYRFALCON_DISABLE_FUSION=1" in printed
