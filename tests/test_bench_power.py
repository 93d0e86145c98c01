"""bench/power.py: the GPU clock / power sampler, against a stand-in nvidia-smi (a script printing its CSV)."""

import stat
import sys
import time

import pytest

from gyrfalcon.bench.power import PowerSampler, format_summary, parse_samples, summarize

# timestamp, SM MHz, memory MHz, power W, temperature C, clock event reasons (0x4: the software power cap)
LINES = ["2026/12/03 13:33:51.252, 1485, 3201, 698.61, 58, 0x0000000000000004\n",
         "2026/12/03 13:33:51.502, 1980, 3201, 312.40, 55, 0x0000000000000000\n",
         "2026/12/03 13:33:51.752, 1335, 3201, 715.67, 59, 0x0000000000000024\n"]


def test_parse_and_summarize_samples():
    samples = parse_samples(LINES + ["No devices were found\n", "2026/12/03, [N/A], 3201, 70.0, 40, 0x0\n"])
    assert [s["sm_mhz"] for s in samples] == [1485, 1980, 1335]
    assert [s["reasons"] for s in samples] == [0x4, 0x0, 0x24]
    s = summarize(samples)
    assert s["samples"] == 3 and s["sm_mhz_median"] == 1485 and (s["sm_mhz_min"], s["sm_mhz_max"]) == (1335, 1980)
    assert s["power_w_median"] == pytest.approx(698.61) and s["power_w_max"] == pytest.approx(715.67)
    assert s["power_cap_fraction"] == pytest.approx(2 / 3)  # 0x4 and 0x24
    assert s["slowdown_fraction"] == pytest.approx(1 / 3)  # 0x20: SW thermal slowdown
    line = format_summary(s)
    assert "SM clock median 1485 MHz (1335-1980)" in line and "67% at the power cap" in line and "33% slowed" in line
    # A driver without the reasons column: no fractions
    s2 = summarize(parse_samples([",".join(x.split(",")[:5]) + "\n" for x in LINES]))
    assert s2["samples"] == 3 and "power_cap_fraction" not in s2 and "power cap" not in format_summary(s2)
    assert summarize([]) == {} and format_summary({}) == ""
    assert "power_limit_w" not in s and summarize(samples, 700.0)["power_limit_w"] == 700.0


def _fake_smi(tmp_path, refuse_reasons: bool = False):
    """An executable that logs its arguments and prints LINES' samples every 20 ms until killed; with
    refuse_reasons it exits 2 at once when asked for the clock event reasons (as an older driver does)."""
    log = tmp_path / "args.txt"
    script = tmp_path / "nvidia-smi"
    script.write_text(f"""#!{sys.executable}
import sys, time
args = " ".join(sys.argv[1:])
open({str(log)!r}, "a").write(args + "\\n")
if "enforced.power.limit" in args:  # the one-shot limit query
    print("700.00", flush=True)
    sys.exit(0)
if {refuse_reasons!r} and "clocks_event_reasons" in args:
    print('Field "clocks_event_reasons.active" is not a valid field to query.', flush=True)
    sys.exit(2)
lines = {LINES!r}
i = 0
while True:
    line = lines[i % len(lines)]
    if "clocks_event_reasons" not in args:
        line = ",".join(line.split(",")[:5]) + "\\n"
    print(line, end="", flush=True)
    i += 1
    time.sleep(0.02)
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, log


def test_sampler_reads_samples_until_the_block_ends(tmp_path):
    exe, log = _fake_smi(tmp_path)
    with PowerSampler("GPU-1234", period_ms=20, exe=str(exe)) as ps:
        time.sleep(0.2)
    n = ps.summary()["samples"]
    assert n >= 3 and "power_cap_fraction" in ps.summary()
    assert ps.summary()["power_limit_w"] == pytest.approx(700.0) and ps.summary()["temp_c_max"] == 59
    assert "of a 700 W limit" in format_summary(ps.summary()) and "up to 59 C" in format_summary(ps.summary())
    calls = log.read_text().splitlines()
    assert "enforced.power.limit" in calls[0] and "--id=GPU-1234" in calls[0]
    args = calls[1].split()
    assert "--id=GPU-1234" in args and "--loop-ms=20" in args and "--format=csv,noheader,nounits" in args
    assert any(a.startswith("--query-gpu=") and a.endswith(",clocks_event_reasons.active") for a in args)
    time.sleep(0.1)
    assert ps.summary()["samples"] == n  # the process is gone: no samples after the block


def test_sampler_falls_back_without_the_reasons_field(tmp_path):
    exe, log = _fake_smi(tmp_path, refuse_reasons=True)
    with PowerSampler(None, period_ms=20, exe=str(exe)) as ps:
        time.sleep(0.1)
    s = ps.summary()
    assert s["samples"] >= 2 and "power_cap_fraction" not in s
    calls = log.read_text().splitlines()[1:]  # after the limit query
    assert len(calls) == 2 and "clocks_event_reasons" in calls[0] and "clocks_event_reasons" not in calls[1]
    assert not any("--id" in c for c in calls)


def test_sampler_without_nvidia_smi_records_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi there
    with PowerSampler() as ps:
        pass
    assert ps.summary() == {} and ps.proc is None
    exe, log = _fake_smi(tmp_path)
    with PowerSampler(exe=str(exe), enabled=False) as ps:  # a CPU run: not even started
        pass
    assert ps.summary() == {} and not log.exists()
