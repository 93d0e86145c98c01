"""Joules per kernel: which of a decode step's kernels spend the H200's 700 W.

The Llama-3.1-8B batch-64 decode steps and the throughput row run at the card's 700 W power limit (run 110: b64
with 100% of its power samples at the cap, SM clock median 1,425 MHz; the throughput row 1,470 MHz), so a step's
time there is set by the energy its kernels spend as much as by their bytes and FLOPs. This probe replays each of a
decoder layer's decode kernels alone, at Llama-3.1-8B's shapes over `--layers` layers of distinct weights and
caches (benchmarks/overlap_probe.py's make_layers: nothing stays in L2), for `--seconds` each in a CUDA graph, and
reads the GPU's energy counter (NVML's total energy, mJ) around the replays:

  qkv, o_proj, gate_up, down  cuBLAS (torch.matmul into a preallocated output)
  down_gemv                   gyrfalcon's GEMV kernel for down_proj (its wide-rows launch: the default to 64 rows)
  attn                        decode attention with its fused prep (RoPE, K/V store, the row's norm scale)
  silu                        SiLU-and-mul
  layer                       the whole layer as the model runs it (overlap_probe's seq)
  hbm_read                    a reduction over 1 GiB: the energy of streaming bytes from HBM and nothing else

For each: microseconds a call, GB/s over its weight + K/V bytes, mean watts (energy / time), the SM clock
(NVML, sampled), millijoules a call and picojoules per byte. Sets: b64 (64 sequences at 192 tokens: the b64
row's middle) and b384 (384 at 1,536: the throughput row's decode steps). The idle draw is measured first.

--attn-configs "BLOCK_N,warps,stages[/k0|/k1];...": also decode attention alone at each of those launch shapes
(GYRFALCON_DECODE_ATTN_CONFIG; /k0 /k1 set GYRFALCON_DECODE_K_ROWS, the key-tile layout) over the sets' shapes,
and the choice among them: the least energy above the idle draw a call, at least 10% below the default launch's
and within 5% of its time ("attn_choice" in the JSON, printed last; choose_config). Under the power cap a step's
time follows its energy, so a launch that spends fewer joules for the same bytes can win there while tying alone.

python3 benchmarks/kernel_energy.py [--sets b64,b384] [--layers 4] [--seconds 2.5] [--attn-configs ...]
  [--output-json FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SETS = {"b64": (64, 192), "b384": (384, 1536)}


class Nvml:
    """The few NVML calls the probe needs, through ctypes (libnvidia-ml ships with the driver). uuid: the GPU's
    ("GPU-..."); None picks index 0. ok is False where the library or the energy counter is missing."""

    def __init__(self, uuid: Optional[str] = None) -> None:
        self.ok = False
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
            if self.lib.nvmlInit_v2() != 0:
                return
            self.handle = ctypes.c_void_p()
            rc = (self.lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(self.handle)) if uuid
                  else self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle)))
            self.ok = rc == 0 and self.energy_mj() is not None
        except OSError:
            pass

    def energy_mj(self) -> Optional[int]:
        e = ctypes.c_ulonglong()
        return e.value if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(e)) == 0 else None

    def sm_mhz(self) -> Optional[int]:
        c = ctypes.c_uint()
        return c.value if self.lib.nvmlDeviceGetClockInfo(self.handle, 1, ctypes.byref(c)) == 0 else None  # 1: SM


def energy_row(calls: int, seconds: float, joules: float, nbytes: float, idle_w: float) -> dict:
    """One case's figures from `calls` calls in `seconds` that spent `joules` (the whole card's counter), each
    reading nbytes: us a call, GB/s, mean W, W above the idle draw, mJ a call, pJ a byte (total and above idle)."""
    watts = joules / seconds
    us = seconds / calls * 1e6
    mj = joules / calls * 1e3
    above = max(watts - idle_w, 0.0) * seconds / calls * 1e3
    return {"us": us, "gb_s": nbytes / (us * 1e-6) / 1e9 if nbytes else 0.0, "watts": watts,
            "watts_above_idle": watts - idle_w, "mj": mj, "mj_above_idle": above,
            "pj_per_byte": mj * 1e9 / nbytes if nbytes else 0.0,
            "pj_per_byte_above_idle": above * 1e9 / nbytes if nbytes else 0.0}


def run_case(nvml: Nvml, body: Callable[[], None], nbytes: float, seconds: float, idle_w: float) -> dict:
    """Capture body (one call) in a CUDA graph, replay it for about `seconds`, and read the energy around."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    # How many replays make ~0.1 s (the energy counter's reads are ~ms apart; launch in batches).
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    per = max((time.perf_counter() - t) / 10, 1e-6)
    batch = max(1, int(0.1 / per))
    for _ in range(batch):  # warm: the clock settles under this load
        g.replay()
    torch.cuda.synchronize()
    clocks: List[int] = []
    calls = 0
    e0, t0 = nvml.energy_mj(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(batch):
            g.replay()
        calls += batch
        c = nvml.sm_mhz()
        if c:
            clocks.append(c)
        torch.cuda.synchronize()
    t1, e1 = time.perf_counter(), nvml.energy_mj()
    del g
    row = energy_row(calls, t1 - t0, (e1 - e0) / 1e3, nbytes, idle_w)
    row["sm_mhz_median"] = statistics.median(clocks) if clocks else None
    return row


def choose_config(default: dict, configs: Dict[str, dict], slack: float = 1.05, saving: float = 0.10,
                  default_name: Optional[str] = None) -> Optional[str]:
    """The launch shape of least energy above idle a call among `configs` ({name: energy_row}) no slower than
    slack x the default's time and spending at least `saving` less than it; None when there is none. The default
    launch itself (default_name "BLOCK_N,warps,stages/kN", listed with its layout suffix or without it: then it
    takes the default layout) is never the choice. saving: run 112 measured the default
    launch twice in one call, 148 and 132 pJ a byte above idle: the counter's spread over 2-second windows."""
    same = {default_name, default_name.split("/")[0]} if default_name else set()
    ok = {k: r for k, r in configs.items() if k not in same and r["us"] <= default["us"] * slack
          and r["mj_above_idle"] < default["mj_above_idle"] * (1 - saving)}
    return min(ok, key=lambda k: ok[k]["mj_above_idle"]) if ok else None


def default_attn_name(B: int) -> str:
    """The decode-attention launch the model takes at B sequences of Llama-8B's 8 kv heads, as --attn-configs
    names it ("BLOCK_N,warps,stages/kN")."""
    from gyrfalcon.kernels.paged_decode_attention import _decode_config, k_rows

    from overlap_probe import D, KV

    bn, nw, ns = _decode_config(D, B * KV)
    return f"{bn},{nw},{ns}/k{int(k_rows(B * KV))}"


def cases(B: int, ctx: int, L: int) -> Dict[str, tuple]:
    """{name: (body over the L layers, bytes it reads)} at B sequences of ctx tokens. The bodies read their launch
    shapes when they run (captured), so one set of them serves every --attn-configs launch."""
    import torch

    from overlap_probe import HID, INTER, KV, D, H, layer_fns, make_layers

    from gyrfalcon.kernels import silu_and_mul
    from gyrfalcon.kernels.paged_decode_attention import decode_attention_with_prep_triton
    from gyrfalcon.kernels.small_m_gemv import MAX_M, norm_gemv_triton

    layers, inp = make_layers(B, ctx, L)
    bf = torch.bfloat16
    resid = torch.randn(B, HID, device="cuda", dtype=bf) * 0.1
    qkv = torch.randn(B, (H + 2 * KV) * D, device="cuda", dtype=bf)
    o = torch.randn(B, H * D, device="cuda", dtype=bf) * 0.1
    gu = torch.randn(B, 2 * INTER, device="cuda", dtype=bf)
    act = torch.randn(B, INTER, device="cuda", dtype=bf) * 0.1
    out = torch.empty(B, HID, device="cuda", dtype=bf)
    kv_bytes = B * ctx * KV * D * 2 * 2
    wb = {n: w.numel() * 2 for n, w in layers[0][0].items()}

    def each(fn):
        def body():
            for w, kc, vc in layers:
                fn(w, kc, vc)
        return body

    def attn(w, kc, vc):
        decode_attention_with_prep_triton(qkv, H, KV, D, inp["pos"], inp["cs"], D, True, kc, vc, inp["slots"],
                                          inp["bt"], inp["sl"], D ** -0.5, row_scale=(resid, 1e-5))

    full = layer_fns(layers, inp, slice(0, B), resid)

    def layer():
        for a, m in full:
            m(a())

    res = {
        "qkv": (each(lambda w, kc, vc: torch.matmul(resid, w["qkv"].t(), out=qkv)), wb["qkv"] * L),
        "attn": (each(attn), kv_bytes * L),
        "o_proj": (each(lambda w, kc, vc: torch.matmul(o, w["o"].t(), out=out)), wb["o"] * L),
        "gate_up": (each(lambda w, kc, vc: torch.matmul(resid, w["gu"].t(), out=gu)), wb["gu"] * L),
        "silu": (each(lambda w, kc, vc: silu_and_mul(gu)), gu.numel() * 2 * 1.5 * L),
        "down": (each(lambda w, kc, vc: torch.matmul(act, w["d"].t(), out=out)), wb["d"] * L),
    }
    if B <= MAX_M:
        res["down_gemv"] = (each(lambda w, kc, vc: norm_gemv_triton(act, w["d"])), wb["d"] * L)
    res["layer"] = (layer, (sum(wb.values()) + kv_bytes) * L)
    return res


def main() -> None:
    import torch

    from gyrfalcon.bench.common import run_info
    from gyrfalcon.bench.power import device_uuid

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="b64,b384")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=2.5)
    ap.add_argument("--attn-configs", default="")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    nvml = Nvml(device_uuid(0))
    if not nvml.ok:
        sys.exit("kernel_energy: no NVML energy counter on this machine")
    torch.cuda.synchronize()
    time.sleep(1.0)
    e0, t0 = nvml.energy_mj(), time.perf_counter()
    time.sleep(2.0)
    idle_w = (nvml.energy_mj() - e0) / 1e3 / (time.perf_counter() - t0)
    print(f"idle: {idle_w:.0f} W", flush=True)
    res: dict = {"idle_w": idle_w}
    big = torch.ones(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    res["hbm_read"] = run_case(nvml, lambda: big.sum(dtype=torch.float32), big.numel() * 2, args.seconds, idle_w)
    del big
    head = (f"{'case':12s} {'us':>9s} {'GB/s':>7s} {'W':>5s} {'W-idle':>6s} {'MHz':>5s} {'mJ':>8s} {'pJ/B':>6s} "
            f"{'pJ/B-idle':>9s}")

    def show(name, r):
        print(f"{name:12s} {r['us']:9.1f} {r['gb_s']:7.0f} {r['watts']:5.0f} {r['watts_above_idle']:6.0f} "
              f"{r['sm_mhz_median'] or 0:5.0f} {r['mj']:8.3f} {r['pj_per_byte']:6.1f} "
              f"{r['pj_per_byte_above_idle']:9.1f}", flush=True)
    print(head)
    show("hbm_read", res["hbm_read"])
    cfgs = [c.strip() for c in args.attn_configs.split(";") if c.strip()]
    for name in args.sets.split(","):
        B, ctx = SETS[name]
        print(f"-- {name}: {B} sequences at {ctx} tokens, {args.layers} layers a call", flush=True)
        rows = {}
        built = cases(B, ctx, args.layers)
        for case, (body, nbytes) in built.items():
            rows[case] = run_case(nvml, body, nbytes, args.seconds, idle_w)
            show(case, rows[case])
        parts = [k for k in rows if k not in ("layer", "down_gemv")]
        rows["sum_of_parts_mj"] = sum(rows[k]["mj"] for k in parts)
        rows["sum_of_parts_us"] = sum(rows[k]["us"] for k in parts)
        print(f"   parts (cuBLAS down) {rows['sum_of_parts_us']:.1f} us, {rows['sum_of_parts_mj']:.3f} mJ for "
              f"{args.layers} layers; the layer {rows['layer']['us']:.1f} us, {rows['layer']['mj']:.3f} mJ", flush=True)
        res[name] = rows
        if cfgs:
            # Each launch shape from the environment at capture (_decode_config reads it per launch).
            att = {}
            for cfg in cfgs:
                # "BLOCK_N,warps,stages[/k0|/k1]": the suffix sets the key-tile layout (GYRFALCON_DECODE_K_ROWS)
                shape, _, layout = cfg.partition("/")
                os.environ["GYRFALCON_DECODE_ATTN_CONFIG"] = shape
                if layout:
                    os.environ["GYRFALCON_DECODE_K_ROWS"] = layout[1:]
                try:
                    body, nbytes = built["attn"]
                    att[cfg] = run_case(nvml, body, nbytes, args.seconds, idle_w)
                    show(f"attn {cfg}", att[cfg])
                except Exception as e:  # a shape that does not fit (shared memory) is skipped, not fatal
                    print(f"attn {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                finally:
                    os.environ.pop("GYRFALCON_DECODE_ATTN_CONFIG", None)
                    os.environ.pop("GYRFALCON_DECODE_K_ROWS", None)
            rows["attn_configs"] = att
            rows["attn_default"] = default_attn_name(B)
            rows["attn_choice"] = choose_config(rows["attn"], att, default_name=rows["attn_default"])
            print(f"   attn launch of least energy (>= 10% below the default {rows['attn_default']}, within 5% of its "
                  f"time): {rows['attn_choice']}", flush=True)
        del built  # this set's weights and caches, before the next set's
        torch.cuda.empty_cache()
    if args.output_json:
        with open(args.output_json, "w") as f:
            info = {**run_info(args), "command": "python3 benchmarks/kernel_energy.py " + " ".join(sys.argv[1:])}
            json.dump({"benchmark": "kernel_energy", **info, "layers": args.layers, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
