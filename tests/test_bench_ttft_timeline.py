"""bench/ttft_timeline.py: the TTFT generate's host / device timeline (its arithmetic on made-up events, and the
real profile's plumbing on the CPU, where it sees host events only)."""

import pytest

from gyrfalcon.bench.ttft_timeline import (ADD_REQUEST, GENERATE, STEP, format_timeline, summarize_timeline,
                                           ttft_timeline)


def test_summarize_timeline_offsets_from_the_generate_start():
    t0 = 1_000.0  # us
    ranges = [(GENERATE, t0, t0 + 20_000), (ADD_REQUEST, t0 + 100, t0 + 600), (ADD_REQUEST, t0 + 600, t0 + 1_100),
              (STEP, t0 + 4_000, t0 + 6_000), (STEP, t0 + 1_200, t0 + 3_000)]
    device = [("gemm", t0 + 2_000, t0 + 10_000), ("copy", t0 + 9_000, t0 + 11_000),  # overlapping: one busy stretch
              ("silu", t0 + 12_000, t0 + 17_000)]
    host = [("aten::empty", t0 + 1_300, t0 + 1_500, 150.0), ("aten::empty", t0 + 1_600, t0 + 1_700, 50.0),
            ("cudaStreamSynchronize", t0 + 17_000, t0 + 18_500, 1_500.0),  # slow, after the first kernel
            ("cudaLaunchKernel", t0 + 1_900, t0 + 1_910, 10.0),
            ("aten::late", t0 + 3_000, t0 + 3_500, 500.0)]  # after the first device activity: not "before"
    t = summarize_timeline(ranges, device, host)
    assert t["generate_ms"] == pytest.approx(20.0)
    assert t["admission_ms"] == pytest.approx(1.0) and t["admission_end_ms"] == pytest.approx(1.1)
    assert t["steps"] == [[pytest.approx(1.2), pytest.approx(1.8)], [pytest.approx(4.0), pytest.approx(2.0)]]
    assert t["first_device_ms"] == pytest.approx(2.0) and t["first_device_name"] == "gemm"
    assert t["last_device_end_ms"] == pytest.approx(17.0) and t["after_device_ms"] == pytest.approx(3.0)
    assert t["device_busy_ms"] == pytest.approx(14.0) and t["device_idle_ms"] == pytest.approx(1.0)
    assert t["device_gaps"] == [[pytest.approx(1.0), "copy", "silu"]]
    assert t["host_before_device"] == [["aten::empty", pytest.approx(0.2)], ["cudaLaunchKernel", pytest.approx(0.01)]]
    assert t["slow_runtime_calls"] == [["cudaStreamSynchronize", pytest.approx(17.0), pytest.approx(1.5)]]
    lines = format_timeline(t)
    assert "admission 1.00" in lines[0] and any("cudaStreamSynchronize at 17.00: 1.50 ms" in x for x in lines)


def test_summarize_timeline_without_a_generate_or_device():
    assert summarize_timeline([], [], []) == {} and format_timeline({}) == []
    t = summarize_timeline([(GENERATE, 0.0, 5_000.0)], [], [("aten::mm", 10.0, 20.0, 10.0)])
    assert t["admission_ms"] == 0 and t["admission_end_ms"] is None and t["steps"] == []
    assert "first_device_ms" not in t and t["host_before_device"] == [["aten::mm", pytest.approx(0.01)]]


def test_ttft_timeline_on_the_cpu(qwen3_ckpt):
    """The real profile: the generate, one add_request range per prompt and the engine steps are found, the
    engine's methods are restored and nothing is left holding KV blocks."""
    from gyrfalcon import LLM

    llm = LLM(str(qwen3_ckpt), max_model_len=64, max_num_seqs=4)
    engine = llm.engine
    t = ttft_timeline(llm, [[3, 4, 5, 6], [7, 8, 9]])
    assert t["generate_ms"] > 0 and t["admission_ms"] > 0 and len(t["steps"]) >= 1
    assert t["admission_end_ms"] <= t["steps"][0][0] <= t["generate_ms"]
    assert "first_device_ms" not in t  # no CUDA activity on the CPU
    assert "step" not in vars(engine) and "add_request" not in vars(engine)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # the engine still generates afterwards
    from gyrfalcon.sampling_params import SamplingParams
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_step_events_summary_and_cpu_watch(qwen3_ckpt):
    """bench/step_events.py: the quantiles of replay and gap times, and that off CUDA the watcher only runs the
    function (no events, an empty summary)."""
    from gyrfalcon import LLM
    from gyrfalcon.bench.step_events import StepEvents, format_step_events, summarize_step_events

    s = summarize_step_events([4.0, 4.2, 4.1, 5.0], [0.1, 0.3, 0.02])
    assert s["replays"] == 4 and s["replay_ms"]["median"] == 4.2 and s["replay_ms"]["max"] == 5.0
    assert s["replay_ms"]["p90"] == 4.2 and s["replay_ms"]["sum"] == pytest.approx(17.3)
    assert s["gap_ms"]["median"] == 0.1 and s["gap_ms"]["sum"] == pytest.approx(0.42)
    line = format_step_events(s, {"main@192": 4.05})
    assert "replay median 4.200" in line and "between replays median 0.100" in line and "main@192: 4.050" in line
    assert summarize_step_events([], []) == {} and format_step_events({}, {}) == ""
    assert "gap_ms" not in summarize_step_events([4.0], []) and "late_fraction" not in s
    s = summarize_step_events([4.0, 4.0, 4.0], [0.2, 0.3], [True, False], [0.1, 0.2, 0.3], [3.5, 0.01, 0.02])
    assert s["late_fraction"] == 0.5 and s["run_host_ms"]["median"] == 0.2 and s["complete_host_ms"]["median"] == 0.02
    line = format_step_events(s, {})
    assert "50% launched after the previous replay had ended" in line and "host completing a step median 0.020" in line

    llm = LLM(str(qwen3_ckpt), max_model_len=64, max_num_seqs=4)
    ev = StepEvents(llm.engine.runner)
    assert not ev.enabled and ev.watch(lambda: 7) == 7 and ev.summary(0) == {} and ev.summary(3) == {}
