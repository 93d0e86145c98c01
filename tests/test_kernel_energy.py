"""benchmarks/kernel_energy.py's arithmetic (the probe itself needs a GPU and NVML: scripts/gpu_check.sh energy)."""

import pytest
from benchmark_scripts import load_benchmark


def test_energy_row():
    ke = load_benchmark("kernel_energy")
    # 1,000 calls in 2 s that spent 1,000 J on the card drawing 100 W idle, each reading 1 GB.
    r = ke.energy_row(calls=1000, seconds=2.0, joules=1000.0, nbytes=1e9, idle_w=100.0)
    assert r["us"] == pytest.approx(2000.0) and r["gb_s"] == pytest.approx(500.0)
    assert r["watts"] == pytest.approx(500.0) and r["watts_above_idle"] == pytest.approx(400.0)
    assert r["mj"] == pytest.approx(1000.0) and r["mj_above_idle"] == pytest.approx(800.0)
    assert r["pj_per_byte"] == pytest.approx(1000.0) and r["pj_per_byte_above_idle"] == pytest.approx(800.0)
    # A case that reads nothing (bytes unknown) reports no rate instead of dividing by zero.
    z = ke.energy_row(calls=10, seconds=1.0, joules=50.0, nbytes=0, idle_w=60.0)
    assert z["gb_s"] == 0.0 and z["pj_per_byte"] == 0.0 and z["mj_above_idle"] == 0.0


def test_nvml_absent_is_not_ok(monkeypatch):
    """Without the driver's library the probe says so instead of failing inside ctypes."""
    import ctypes

    ke = load_benchmark("kernel_energy")

    def missing(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert ke.Nvml().ok is False


def test_choose_config():
    ke = load_benchmark("kernel_energy")
    default = {"us": 100.0, "mj_above_idle": 10.0}
    configs = {"a": {"us": 104.0, "mj_above_idle": 8.0},   # within 5%, less energy
               "b": {"us": 110.0, "mj_above_idle": 6.0},   # least energy but too slow
               "c": {"us": 90.0, "mj_above_idle": 9.0}}    # faster, more energy than a
    assert ke.choose_config(default, configs) == "a"
    assert ke.choose_config(default, {"d": {"us": 99.0, "mj_above_idle": 10.5}}) is None
    # Within the energy counter's spread (less than 10% below the default) is no choice.
    assert ke.choose_config(default, {"e": {"us": 99.0, "mj_above_idle": 9.5}}) is None
    # The default launch measured again under its own name is never the choice.
    again = {"64,4,2/k1": {"us": 99.0, "mj_above_idle": 5.0}}
    assert ke.choose_config(default, again, default_name="64,4,2/k1") is None


def test_default_attn_name():
    """The launch the model takes at the probe's shapes, named as --attn-configs names them."""
    ke = load_benchmark("kernel_energy")
    from gyrfalcon.kernels.paged_decode_attention import _decode_config, k_rows

    for B in (64, 384):
        bn, nw, ns = _decode_config(128, B * 8)
        assert ke.default_attn_name(B) == f"{bn},{nw},{ns}/k{int(k_rows(B * 8))}"
    assert ke.default_attn_name(384) == "64,4,2/k1"  # many programs: 64-key tiles in row layout, 2 stages
