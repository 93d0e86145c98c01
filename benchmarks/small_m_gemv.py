"""Time the fused small-batch norm+GEMV kernel against the unfused path (RMSNorm kernel + cuBLAS +
silu_and_mul), each replayed as a CUDA graph, and report bandwidth against the 4.15 TB/s roofline.

python3 benchmarks/small_m_gemv.py [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from gyrfalcon.bench.common import HBM_BYTES_PER_S, run_info
from gyrfalcon.kernels import rms_norm, silu_and_mul
from gyrfalcon.kernels.small_m_gemv import norm_gemv_triton

SHAPES = {"l8_qkv": (4096, 6144, True, False), "l8_o": (4096, 4096, False, False),
          "l8_gate_up": (4096, 14336, True, True), "l8_down": (14336, 4096, False, False),
          "q06_qkv": (1024, 4096, True, False), "q06_gate_up": (1024, 3072, True, True),
          "q06_down": (3072, 1024, False, False)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-json")
    args = ap.parse_args()
    rows = []
    for M in (1, 8):
        for name, (K, N, norm, silu) in SHAPES.items():
            x = torch.randn(M, K, device="cuda").bfloat16()
            r = torch.randn(M, K, device="cuda").bfloat16()
            w = (torch.randn(2 * N if silu else N, K, device="cuda") / K ** 0.5).bfloat16()
            nw = torch.ones(K, device="cuda").bfloat16()

            def fused():
                return norm_gemv_triton(x, w, nw if norm else None, r if norm else None, silu_mul=silu)

            def unfused():
                h = rms_norm(x, nw, 1e-6, residual=r)[0] if norm else x
                y = torch.nn.functional.linear(h, w)
                return silu_and_mul(y) if silu else y

            t_f = triton.testing.do_bench_cudagraph(fused) * 1e3
            t_u = triton.testing.do_bench_cudagraph(unfused) * 1e3
            nbytes = w.numel() * 2
            rows.append({"shape": name, "M": M, "fused_us": round(t_f, 2), "unfused_us": round(t_u, 2),
                         "speedup": round(t_u / t_f, 2), "frac_hbm_fused": round(nbytes / (t_f * 1e-6) / HBM_BYTES_PER_S, 3)})
            print(f"{name:12s} M={M:2d}  fused {t_f:7.1f} us  unfused {t_u:7.1f} us  "
                  f"x{t_u / t_f:4.2f}  fused at {rows[-1]['frac_hbm_fused']:.0%} of HBM")
    if args.output_json:
        info = run_info(args)
        info["command"] = "python3 benchmarks/small_m_gemv.py"
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "small_m_gemv", **info, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
