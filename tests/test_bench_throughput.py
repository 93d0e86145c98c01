"""`gyrfalcon bench throughput` on the CPU, and the roofline floor it reports (StepFloor)."""

import json
from types import SimpleNamespace

import pytest

from gyrfalcon import envs


def test_step_floor_arithmetic():
    from gyrfalcon.bench.common import BF16_FLOP_PER_S, HBM_BYTES_PER_S, StepFloor

    f = StepFloor(step_weight_bytes=1000, kv_bytes_per_token=10, layer_params=50, attn_flops_per_pair=3)
    f.add(SimpleNamespace(is_empty=True, reqs=[]))
    assert f.steps == 0
    # A decode row at context 7 (start 6, one token) and a prompt chunk of 4 tokens after 2 cached ones.
    f.add(SimpleNamespace(is_empty=False, reqs=[SimpleNamespace(start=6, num_new_tokens=1),
                                                 SimpleNamespace(start=2, num_new_tokens=4)]))
    assert f.steps == 1
    assert f.bytes == 1000 + (7 + 6) * 10
    # GEMMs 2 x 50 per token (5 tokens); attention pairs: 7 for the decode row, 3 + 4 + 5 + 6 for the chunk.
    assert f.flops == 2 * 50 * 5 + 3 * (7 + 18)
    assert f.floor_s == pytest.approx(max(f.bytes / HBM_BYTES_PER_S, f.flops / BF16_FLOP_PER_S))
    assert f.report(2 * f.floor_s)["roofline_fraction"] == pytest.approx(0.5)


def test_step_floor_serial():
    """The serial floor: a step's GEMMs (the LM head for each sampling row) then its attention, each at the larger
    of its bytes and its FLOPs at the machine's matmul rate."""
    from gyrfalcon.bench.common import HBM_BYTES_PER_S, MATMUL_FLOP_PER_S, StepFloor

    f = StepFloor(step_weight_bytes=8e9, kv_bytes_per_token=1e6, layer_params=4e9, attn_flops_per_pair=1e6,
                  head_params=5e8)
    # A decode row at context 1,000 and a chunk of 2,000 prompt tokens that leaves the rest for later.
    f.add(SimpleNamespace(is_empty=False, reqs=[SimpleNamespace(start=999, num_new_tokens=1, sample=True),
                                                 SimpleNamespace(start=0, num_new_tokens=2000, sample=False)]))
    gemm = (2 * 4e9 * 2001 + 2 * 5e8 * 1) / MATMUL_FLOP_PER_S  # one LM-head row: the chunk samples nothing
    pairs = 1000 + 2000 * 2001 // 2
    attn = max((1000 + 2000) * 1e6 / HBM_BYTES_PER_S, 1e6 * pairs / MATMUL_FLOP_PER_S)
    assert f.serial_s == pytest.approx(gemm + attn)
    # The overlapped floor is never above the serial one here (and the report carries both).
    r = f.report(2 * f.serial_s)
    assert r["serial_floor_fraction"] == pytest.approx(0.5) and r["floor_s"] <= r["serial_floor_s"]
    # A pure decode step of few rows is bound by its weight and K/V bytes, read one after the other.
    g = StepFloor(step_weight_bytes=8e9, kv_bytes_per_token=1e6, layer_params=4e9, attn_flops_per_pair=1e6)
    g.add(SimpleNamespace(is_empty=False, reqs=[SimpleNamespace(start=99, num_new_tokens=1)]))
    assert g.serial_s == pytest.approx((8e9 + 100 * 1e6) / HBM_BYTES_PER_S)


def test_bench_throughput_cpu_reports_the_floor(qwen3_ckpt, tmp_path, capsys):
    from gyrfalcon.cli import main

    out = tmp_path / "tput.json"
    rc = main(["bench", "throughput", "--model", str(qwen3_ckpt), "--num-prompts", "6", "--input-len", "12",
               "--output-len", "5", "--max-model-len", "64", "--max-num-seqs", "4", "--output-json", str(out)])
    assert rc == 0
    g = json.loads(out.read_text())["results"]["gyrfalcon"]
    assert g["gpu_power"] == {}  # no GPU clock or power sampled on a CPU run
    assert g["output_tok_s"] > 0 and g["elapsed_s"] > 0
    fl = g["floor"]
    # 6 requests, at most 4 at a time, 5 tokens each: at least 2 waves of 5 steps.
    assert fl["steps"] >= 10 and fl["bytes_read_gb"] > 0 and fl["tflop"] > 0
    assert 0 < fl["floor_s"] < g["elapsed_s"]
    # Every step is charged to its kind: both kinds ran, and their steps, floors and wall times add up.
    bk = g["by_kind"]
    assert set(bk) == {"decode", "prefill"}
    assert sum(d["steps"] for d in bk.values()) == fl["steps"]
    assert sum(d["floor_s"] for d in bk.values()) == pytest.approx(fl["floor_s"])
    assert 0 < sum(d["wall_s"] for d in bk.values()) <= g["elapsed_s"]
    assert 1 <= bk["decode"]["mean_rows"] <= 4
    # Host time per phase of each kind's steps (a real run: every phase took some time).
    for d in bk.values():
        hm = d["host_ms_per_step"]
        assert set(hm) == {"schedule", "launch", "complete", "gc_schedule", "gc_launch", "gc_complete"}
        assert all(hm[k] > 0 for k in ("schedule", "launch", "complete"))
        assert all(hm[f"gc_{k}"] <= hm[k] for k in ("schedule", "launch", "complete"))
    assert set(g["gc"]) == {"collections", "ms", "elsewhere_ms"}
    printed = capsys.readouterr().out
    assert "of the roofline" in printed and "decode steps:" in printed and "garbage collector:" in printed
    assert fl["floor_s"] <= fl["serial_floor_s"] < g["elapsed_s"] and "serial floor" in printed


def test_gc_clock_charges_pauses_to_the_phase_and_step():
    import gc

    from gyrfalcon.bench.throughput import GCClock

    host = {"schedule": [0.1, 0.1, 0.1], "launch": [0.1, 0.1, 0.1], "complete": [0.1, 0.1, 0.1]}
    with GCClock(host) as clock:
        with clock.inside("launch", 1):
            gc.collect()
        gc.collect()  # outside any phase
        with clock.inside("complete", 2):
            gc.collect(0)
    gc.collect()  # after the run: not counted
    per = clock.per_step()
    assert [t > 0 for t in per["gc_launch"]] == [False, True, False]
    assert [t > 0 for t in per["gc_complete"]] == [False, False, True]
    assert per["gc_schedule"] == [0.0, 0.0, 0.0]
    s = clock.summary()
    assert s["collections"] == {"0": 1, "2": 2} and s["elsewhere_ms"] > 0


def test_step_floor_by_kind():
    """Intervals between read-backs are charged to the steps in launch order, split by kind."""
    from gyrfalcon.bench.common import StepFloor

    f = StepFloor(step_weight_bytes=1000, kv_bytes_per_token=10, layer_params=50, attn_flops_per_pair=3)
    row = lambda start, n: SimpleNamespace(start=start, num_new_tokens=n)  # noqa: E731
    f.add(SimpleNamespace(is_empty=False, reqs=[row(0, 8), row(0, 8)]))  # prefill
    f.add(SimpleNamespace(is_empty=False, reqs=[row(8, 1), row(8, 1)]))  # decode
    f.add(SimpleNamespace(is_empty=False, reqs=[row(9, 1), row(0, 4)]))  # a decode row with a chunk
    bk = f.by_kind(10.0, [10.5, 10.6, 11.0])
    assert bk["prefill"]["steps"] == 2 and bk["prefill"]["wall_s"] == pytest.approx(0.5 + 0.4)
    assert bk["decode"]["steps"] == 1 and bk["decode"]["wall_s"] == pytest.approx(0.1)
    assert bk["decode"]["mean_rows"] == 2 and bk["decode"]["ms_per_step"] == pytest.approx(100.0)
    assert bk["decode"]["floor_s"] == pytest.approx(f.step_log[1][2])
    host = {"launch": [0.002, 0.004, 0.008]}
    bk = f.by_kind(10.0, [10.5, 10.6, 11.0], host)
    assert bk["prefill"]["host_ms_per_step"] == {"launch": pytest.approx(5.0)}  # (2 + 8) / 2 steps
    assert bk["decode"]["host_ms_per_step"] == {"launch": pytest.approx(4.0)}


def test_hf_sampling_kwargs():
    from gyrfalcon.bench.common import hf_sampling_kwargs

    assert hf_sampling_kwargs(0.0) == {"do_sample": False}
    assert hf_sampling_kwargs(1.0) == {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


def test_bench_throughput_launch_phases(qwen3_ckpt, tmp_path, capsys):
    """--launch-phases times the host inside each eager launch (CPU: every step is eager) and puts the model back
    as it was."""
    from gyrfalcon.cli import main

    out = tmp_path / "tput.json"
    rc = main(["bench", "throughput", "--model", str(qwen3_ckpt), "--num-prompts", "4", "--input-len", "12",
               "--output-len", "3", "--max-model-len", "64", "--max-num-seqs", "4", "--launch-phases",
               "--output-json", str(out)])
    assert rc == 0
    g = json.loads(out.read_text())["results"]["gyrfalcon"]
    lp = g["launch_phases"]
    assert set(lp) == {"decode", "prefill"}
    assert lp["prefill"]["steps"] == g["by_kind"]["prefill"]["steps"]
    for d in lp.values():
        assert d["build_ms"] > 0 and d["layers_ms"] > 0 and 0 < d["max_gap_ms"] <= d["layers_ms"]
        assert d["to_first_layer_ms"] >= 0 and d["after_forward_ms"] > 0
        assert 0 < d["lm_head_ms"] < d["after_forward_ms"]  # the LM head's call is stamped inside that phase
        assert 0 <= d["max_gap_layer"] < 2 and sum(d["gap_layers"].values()) == d["steps"]  # the tiny model: 2 layers
    assert "eager prefill launches" in capsys.readouterr().out
    import gyrfalcon.runner.model_runner as mr
    from gyrfalcon.runner.forward_batch import build_forward_batch
    assert mr.build_forward_batch is build_forward_batch  # unwrapped again


def test_busy_span_gaps_unions_overlapping_kernels():
    from gyrfalcon.bench.common import busy_span_gaps

    # (start us, end us, name): b overlaps a, c sits inside b, then a 500 us gap, d; then 2 ms before e
    ev = [(0, 1000, "a"), (500, 3000, "b"), (1000, 2000, "c"), (3500, 4000, "d"), (6000, 6100, "e")]
    busy, span, gaps = busy_span_gaps(ev)
    assert busy == pytest.approx(3.0 + 0.5 + 0.1) and span == pytest.approx(6.1)
    assert gaps == [(pytest.approx(2.0), "d", "e"), (pytest.approx(0.5), "b", "d")]
    assert busy_span_gaps([]) == (0.0, 0.0, [])


def test_gaps_by_pair_sums_each_pair_per_step():
    from gyrfalcon.bench.common import gaps_by_pair

    # over 2 steps: head -> graph idles 0.03 + 0.01 ms, graph -> head 0.005 ms once
    gaps = [(0.03, "head", "graph"), (0.005, "graph", "head"), (0.01, "head", "graph")]
    rows = gaps_by_pair(gaps, steps=2)
    assert rows == [[pytest.approx(20.0), 1.0, "head", "graph"], [pytest.approx(2.5), 0.5, "graph", "head"]]
    assert gaps_by_pair(gaps, steps=2, top=1) == rows[:1]
    assert gaps_by_pair([], steps=4) == []


def test_bench_throughput_gpu_timeline(qwen3_ckpt, tmp_path, capsys, monkeypatch):
    """--gpu-timeline N: a window of N steps from the first one that runs prompt tokens beside decoding
    sequences (on a CPU the profiler records CPU ops: the plumbing only). The JSON records the run's
    switches (gyrfalcon/envs.py's values, without the API key) and GYRFALCON_COMMIT as its commit."""
    from gyrfalcon.cli import main

    monkeypatch.setenv("GYRFALCON_PDL", "0")  # recorded; a GPU-only setting
    monkeypatch.setenv("GYRFALCON_COMMIT", "abc1234")
    monkeypatch.setenv("GYRFALCON_API_KEY", "secret")
    envs.refresh()

    out = tmp_path / "tput.json"
    # 16 tokens per step: the second prompt's chunks run beside the first one's decoding
    rc = main(["bench", "throughput", "--model", str(qwen3_ckpt), "--num-prompts", "3", "--input-len", "12",
               "--output-len", "6", "--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
               "--gpu-timeline", "3", "--output-json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["switches"]["pdl"] == "0" and res["switches"]["kernels"] == "triton"
    assert "commit" not in res["switches"] and "api_key" not in res["switches"] and "secret" not in out.read_text()
    assert res["commit"] == "abc1234"
    g = res["results"]["gyrfalcon"]
    tl = g["gpu_timeline"]
    assert tl["first_step"] >= 1 and tl["steps"][0] == "prefill" and len(tl["steps"]) == 3
    assert len(tl["host_launch_ms"]) == 3 and tl["kernels"] > 0
    assert 0 < tl["busy_ms"] <= tl["span_ms"] + 1e-6 and tl["idle_ms"] == pytest.approx(tl["span_ms"] - tl["busy_ms"])
    assert tl["first_step_decoders"] >= 1
    assert "device timeline (mixed) over 3 steps" in capsys.readouterr().out
    # No step of this run holds 4 decoders beside a prompt chunk: no window, nothing recorded
    rc = main(["bench", "throughput", "--model", str(qwen3_ckpt), "--num-prompts", "3", "--input-len", "12",
               "--output-len", "6", "--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
               "--gpu-timeline", "3", "--gpu-timeline-decoders", "4", "--output-json", str(out)])
    assert rc == 0 and json.loads(out.read_text())["results"]["gyrfalcon"]["gpu_timeline"] == {}


def test_bench_throughput_gpu_timeline_decode(qwen3_ckpt, tmp_path, capsys):
    """--gpu-timeline-kind decode: the window starts at a step of decoding sequences only, no earlier than the
    --gpu-timeline-after-th step, and reports each kernel's time a step (on a CPU, the profiler's CPU ops)."""
    from gyrfalcon.cli import main

    out = tmp_path / "tput.json"
    # 2 prompts of 12 tokens, 6 new each, 16 tokens per step: prefill steps first, then decode-only steps
    args = ["bench", "throughput", "--model", str(qwen3_ckpt), "--num-prompts", "2", "--input-len", "12",
            "--output-len", "6", "--max-model-len", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
            "--gpu-timeline", "2", "--gpu-timeline-kind", "decode", "--gpu-timeline-decoders", "2",
            "--gpu-timeline-after", "3", "--output-json", str(out)]
    assert main(args) == 0
    tl = json.loads(out.read_text())["results"]["gyrfalcon"]["gpu_timeline"]
    assert tl["kind"] == "decode" and tl["first_step"] >= 3 and tl["steps"] == ["decode", "decode"]
    assert tl["first_step_decoders"] == 2
    # the window's 2 steps, and the one launched before the window's last was read back (async scheduling)
    assert tl["profiled_steps"] in (2, 3)
    top = tl["top_kernels"]
    assert top and all(ms > 0 and n > 0 for _, ms, n in top)
    assert [ms for _, ms, _ in top] == sorted((ms for _, ms, _ in top), reverse=True)
    assert "device timeline (decode) over 2 steps" in capsys.readouterr().out
    # the run has no decode-only step of 3 sequences: no window
    assert main(args[:-6] + ["--gpu-timeline-decoders", "3", "--output-json", str(out)]) == 0
    assert json.loads(out.read_text())["results"]["gyrfalcon"]["gpu_timeline"] == {}


def test_gpu_timeline_rejects_an_unknown_kind():
    from gyrfalcon.bench.throughput import GpuTimeline

    with pytest.raises(ValueError, match="mixed or decode"):
        GpuTimeline(2, cuda=False, kind="prefill")


def test_scoped_env_sets_unsets_and_restores(monkeypatch):
    """scoped_env (the benchmarks' A/B switch setter): values set, None unset, inside the block; as before after,
    also when the block raises."""
    import os

    from gyrfalcon.bench.common import scoped_env

    monkeypatch.setenv("GYRFALCON_TEST_A", "keep")
    monkeypatch.delenv("GYRFALCON_TEST_B", raising=False)
    with scoped_env({"GYRFALCON_TEST_A": None, "GYRFALCON_TEST_B": "1"}):
        assert "GYRFALCON_TEST_A" not in os.environ and os.environ["GYRFALCON_TEST_B"] == "1"
    assert os.environ["GYRFALCON_TEST_A"] == "keep" and "GYRFALCON_TEST_B" not in os.environ
    with pytest.raises(RuntimeError), scoped_env({"GYRFALCON_TEST_A": "other"}):
        raise RuntimeError
    assert os.environ["GYRFALCON_TEST_A"] == "keep"
    # envs.get() sees the values inside the block, and the old ones after it
    monkeypatch.delenv("GYRFALCON_PDL", raising=False)
    envs.refresh()
    with scoped_env({"GYRFALCON_PDL": "serial"}):
        assert envs.get().pdl == "serial"
    assert envs.get().pdl == "auto"


def test_moe_step_bytes_count_the_selected_experts(tmp_path):
    """An MoE model's step reads only the experts its tokens select: top_k of them at one row, the uniform-routing
    expectation E (1 - (1 - k / E)^rows) for more; StepFloor charges that per step and runs top_k / E of the
    experts' parameters per token."""
    from transformers import AutoConfig

    from checkpoints import make_moe_checkpoint
    from gyrfalcon.bench.common import StepFloor, experts_touched, moe_blocks, step_weight_bytes
    from gyrfalcon.models.registry import resolve_model_class

    ck = make_moe_checkpoint(tmp_path / "moe", "qwen3_moe")  # 3 layers, layer 1 dense; 8 experts, top 2
    cfg = AutoConfig.from_pretrained(ck)
    model = resolve_model_class(cfg)(cfg)
    blocks = moe_blocks(model)
    assert [(E, k) for _, _, E, k in blocks] == [(8, 2), (8, 2)]
    layer1 = model.model.layers[0].mlp.experts
    per_layer = sum(p.numel() * p.element_size() for p in layer1.parameters())
    assert blocks[0][0] == per_layer and per_layer == 8 * 3 * 32 * 64 * 4  # fp32 w13 [8, 64, 64] + w2 [8, 64, 32]
    everything = step_weight_bytes(model, rows=8 ** 6)  # so many rows that every expert is read
    assert everything == pytest.approx(
        sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
        + model.lm_head.weight.numel() * 4 + model.model.norm.weight.numel() * 4, rel=1e-6)
    assert everything - step_weight_bytes(model, rows=1) == 2 * (per_layer - per_layer * 2 // 8)
    assert experts_touched(8, 2, 1) == 2 and experts_touched(8, 2, 0) == 0
    assert experts_touched(8, 2, 2) == pytest.approx(8 * (1 - 0.75 ** 2))  # 3.5: two rows overlap by 1/2 expert
    f = StepFloor.for_model(model, kv_bytes_per_token=0)
    f.add(SimpleNamespace(is_empty=False, reqs=[SimpleNamespace(start=5, num_new_tokens=1)]))
    assert f.bytes == step_weight_bytes(model, rows=1)
    dense_params = sum(p.numel() for p in model.model.layers.parameters()) - 2 * per_layer // 4
    assert f.layer_params == dense_params + 2 * (per_layer // 4) * 2 // 8
