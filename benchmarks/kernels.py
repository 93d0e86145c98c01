"""Kernel micro-benchmarks: each Triton kernel vs its plain-torch reference (and torch SDPA where one
applies), at Llama-3-8B-like shapes (32 heads / 8 kv heads, head_dim 128, hidden 4096, bf16).

Prints a table and writes JSON (--output-json). Triton times are GPU times of a CUDA-graph replay with
L2 flushed (how the engine runs decode); eager times, which add this host's launch overhead, are
kept beside them. Decode attention reports achieved bandwidth
(K/V bytes read / time) against the H200's measured ~4.15 TB/s HBM read rate. A small launch-config
sweep of the attention kernels records which tile sizes were fastest here (skipped with --quick).

    PYTHONPATH=$PWD python3 benchmarks/kernels.py --output-json /tmp/kernels.json [--quick]

scripts/gpu/profile.sh runs it on the GPU machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

import torch

HBM_BW = 4.15e12  # bytes/s, HBM read measured on the H200 (see shared GPU notes)
H, HKV, D, HIDDEN, INTER = 32, 8, 128, 4096, 14336
DT = torch.bfloat16


def _bench(fn, warmup=10, rep=50) -> float:
    """Median time in microseconds (triton.testing.do_bench, which flushes L2 between runs)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")) * 1e3


_FLUSH: list = []


def _bench_gpu(fn, iters=40) -> float:
    """Median GPU time in microseconds of fn captured in a CUDA graph and replayed with L2 flushed
    before each replay. This host's launch overhead (~20 us per eager op) is excluded, as it is for
    the engine's graph-captured decode steps; falls back to eager do_bench if capture fails."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(512 * 2**20 // 4, dtype=torch.int32, device="cuda"))  # > 50 MB L2
    try:
        fn()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
    except Exception as e:  # pragma: no cover - depends on fn
        print(f"graph capture failed ({str(e)[:80]}); timing eagerly", flush=True)
        return _bench(fn)
    graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        _FLUSH[0].zero_()  # also keeps the GPU busy while the host issues the replay
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends))
    del graph
    return times[len(times) // 2] * 1e3


def _commit() -> str:
    from gyrfalcon import envs

    if envs.get().commit:
        return envs.get().commit
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def _paged(seq_lens, block_size=16, width=None, n_kv=HKV, head_dim=D):
    dev = torch.device("cuda")
    nbs = [-(-s // block_size) for s in seq_lens]
    total = sum(nbs) + 1
    kc = torch.randn(total, block_size, n_kv, head_dim, device=dev, dtype=DT)
    vc = torch.randn_like(kc)
    perm = torch.randperm(total, device=dev).int()
    bt = torch.zeros(len(seq_lens), width or max(nbs), dtype=torch.int32, device=dev)
    off = 0
    for i, n in enumerate(nbs):
        bt[i, :n] = perm[off : off + n]
        off += n
    return kc, vc, bt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer shapes, no sweep")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU")

    import triton

    from gyrfalcon.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
    from gyrfalcon.kernels.paged_attention import paged_attention_ref, paged_attention_triton
    from gyrfalcon.kernels.decode_attention import (
        default_num_splits,
        paged_decode_attention_ref,
        paged_decode_attention_triton,
    )
    from gyrfalcon.kernels.rms_norm import rms_norm_ref, rms_norm_triton
    from gyrfalcon.kernels.rotary import apply_rotary_ref, apply_rotary_triton
    from gyrfalcon.kernels.store_kv import store_kv_ref, store_kv_triton

    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows: list[dict] = []

    def record(kernel, shape, fn, ref_us=None, bytes_moved=None, flops=None, baseline=None,
               baseline_us=None, **extra):
        """fn: the Triton call. triton_us is its GPU time (graph replay); triton_eager_us adds the
        host launch cost of an eager call (do_bench)."""
        triton_us = _bench_gpu(fn)
        row = dict(kernel=kernel, shape=shape, triton_us=round(triton_us, 2),
                   triton_eager_us=round(_bench(fn), 2))
        if ref_us is not None:
            row["ref_us"] = round(ref_us, 2)
            row["speedup_vs_ref"] = round(ref_us / triton_us, 2)
        if baseline is not None:
            row["baseline"] = baseline
            row["baseline_us"] = round(baseline_us, 2)
            row["speedup_vs_baseline"] = round(baseline_us / triton_us, 2)
        if bytes_moved is not None:
            row["bytes"] = int(bytes_moved)
            row["gbps"] = round(bytes_moved / (triton_us * 1e-6) / 1e9, 1)
            row["frac_hbm"] = round(bytes_moved / (triton_us * 1e-6) / HBM_BW, 3)
        if flops is not None:
            row["tflops"] = round(flops / (triton_us * 1e-6) / 1e12, 1)
        row.update(extra)
        rows.append(row)
        print(json.dumps(row), flush=True)

    def dump(rows, sweeps, final=False):
        """Write the JSON now (also mid-run, so a run cut short by a time limit still leaves numbers)."""
        out = dict(
            benchmark="kernels",
            gpu=torch.cuda.get_device_name(),
            commit=_commit(),
            command=" ".join([os.path.basename(sys.executable)] + sys.argv),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            torch=torch.__version__,
            triton=triton.__version__,
            hbm_read_bytes_per_s=HBM_BW,
            dtype="bfloat16",
            model_shape=dict(heads=H, kv_heads=HKV, head_dim=D, hidden=HIDDEN, intermediate=INTER, block_size=16),
            results=rows,
            complete=final,
            sweeps=sweeps,
        )
        if args.output_json:
            os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
            with open(args.output_json, "w") as f:
                json.dump(out, f, indent=1)
            print(f"wrote {args.output_json}", flush=True)

    el = 2  # bytes per bf16 element

    # ---- rms_norm (+ residual), silu_and_mul, rotary, store_kv
    for T in ([1, 4096] if args.quick else [1, 64, 4096]):
        x = torch.randn(T, HIDDEN, device=dev, dtype=DT)
        r = torch.randn_like(x)
        w = torch.randn(HIDDEN, device=dev, dtype=DT)
        record("rms_norm+residual", f"T={T} hidden={HIDDEN}",
               lambda: rms_norm_triton(x, w, 1e-5, r), _bench(lambda: rms_norm_ref(x, w, 1e-5, r)),
               bytes_moved=4 * T * HIDDEN * el)
    qk = torch.randn(4096, H, D, device=dev, dtype=DT)
    wq = torch.randn(D, device=dev, dtype=DT)
    record("rms_norm per-head (q-norm)", f"T=4096 heads={H} d={D}",
           lambda: rms_norm_triton(qk, wq, 1e-6), _bench(lambda: rms_norm_ref(qk, wq, 1e-6)),
           bytes_moved=2 * qk.numel() * el)

    for T in ([1, 4096] if args.quick else [1, 64, 4096]):
        x = torch.randn(T, 2 * INTER, device=dev, dtype=DT)
        record("silu_and_mul", f"T={T} d={INTER}", lambda: silu_and_mul_triton(x),
               _bench(lambda: silu_and_mul_ref(x)), bytes_moved=3 * T * INTER * el)

    T = 4096
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D)
    ang = torch.arange(131072, device=dev, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cs = torch.cat((ang.cos(), ang.sin()), dim=-1)  # a real cache: repeated in-place replays stay finite
    q = torch.randn(T, H, D, device=dev, dtype=DT)
    k = torch.randn(T, HKV, D, device=dev, dtype=DT)
    pos = torch.randint(0, 131072, (T,), device=dev)
    record("apply_rotary (in place)", f"T={T} q={H}x{D} k={HKV}x{D}",
           lambda: apply_rotary_triton(q, k, pos, cs, D), _bench(lambda: apply_rotary_ref(q, k, pos, cs, D)),
           bytes_moved=2 * (q.numel() + k.numel()) * el)

    kc = torch.zeros(8192, 16, HKV, D, device=dev, dtype=DT)
    vc = torch.zeros_like(kc)
    for T in [1, 4096]:
        kk = torch.randn(T, HKV, D, device=dev, dtype=DT)
        slots = torch.randperm(8192 * 16, device=dev)[:T]
        record("store_kv", f"T={T} kv={HKV}x{D}", lambda: store_kv_triton(kk, kk, kc, vc, slots),
               _bench(lambda: store_kv_ref(kk, kk, kc, vc, slots)), bytes_moved=4 * kk.numel() * el)

    # ---- prefill attention (fresh and chunked); baseline torch SDPA (flash) on dense K/V
    sdpa = torch.nn.functional.scaled_dot_product_attention
    prefill_cases = [(2048, 2048), (8192, 8192), (1024, 8192)] if not args.quick else [(8192, 8192)]
    for q_len, ctx in prefill_cases:
        kc_p, vc_p, bt = _paged([ctx])
        qp = torch.randn(q_len, H, D, device=dev, dtype=DT)
        qsl = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
        sl = torch.tensor([ctx], dtype=torch.int32, device=dev)
        nb = -(-ctx // 16)
        kd = kc_p[bt[0, :nb].long()].flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0).contiguous()  # [1,Hkv,S,D]
        vd = vc_p[bt[0, :nb].long()].flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0).contiguous()
        qd = qp.transpose(0, 1).unsqueeze(0).contiguous()
        pairs = q_len * (ctx - q_len) + q_len * (q_len + 1) / 2  # (query, key) pairs attended
        flops = 4 * H * D * pairs
        if q_len == ctx:
            base = lambda: sdpa(qd, kd, vd, is_causal=True, enable_gqa=True)  # noqa: E731
        else:
            mask = torch.ones(q_len, ctx, dtype=torch.bool, device=dev).tril(ctx - q_len)
            base = lambda: sdpa(qd, kd, vd, attn_mask=mask, enable_gqa=True)  # noqa: E731
        tri = lambda: paged_attention_triton(qp, kc_p, vc_p, bt, sl, qsl, D ** -0.5)  # noqa: E731
        ref_us = _bench(lambda: paged_attention_ref(qp, kc_p, vc_p, bt, sl, qsl, D ** -0.5), 2, 5)
        record("paged_attention (prefill)", f"q_len={q_len} ctx={ctx}", tri, ref_us, flops=flops,
               baseline="torch sdpa dense" + (" causal" if q_len == ctx else " masked"), baseline_us=_bench_gpu(base))

    # ---- decode attention: bandwidth vs HBM roofline
    decode_cases = [(1, 8192), (1, 32768), (8, 8192), (32, 4096), (64, 8192), (256, 2048)]
    if args.quick:
        decode_cases = [(1, 8192), (64, 8192)]
    for B, ctx in decode_cases:
        kc_d, vc_d, bt = _paged([ctx] * B, width=ctx // 16)
        qd = torch.randn(B, H, D, device=dev, dtype=DT)
        sl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        kv_bytes = 2 * B * ctx * HKV * D * el
        ns = default_num_splits(B, HKV, bt.shape[1] * 16, dev)
        tri = lambda: paged_decode_attention_triton(qd, kc_d, vc_d, bt, sl, D ** -0.5)  # noqa: E731
        ref_us = _bench(lambda: paged_decode_attention_ref(qd, kc_d, vc_d, bt, sl, D ** -0.5), 2, 5) \
            if B * ctx <= 64 * 8192 else None
        # Dense SDPA over pre-gathered contiguous K/V: what an un-paged torch decode would cost.
        kd = kc_d[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()  # [B, Hkv, S, D]
        vd = vc_d[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
        qq = qd.unsqueeze(2)
        base_us = _bench_gpu(lambda: sdpa(qq, kd, vd, enable_gqa=True))
        del kd, vd
        record("paged_decode_attention", f"B={B} ctx={ctx}", tri, ref_us, bytes_moved=kv_bytes,
               baseline="torch sdpa dense (contiguous K/V)", baseline_us=base_us, num_splits=ns)

    sweeps: dict = {}
    dump(rows, sweeps)
    if not args.quick:
        # Decode launch configs (BLOCK_N, num_warps, num_stages) and split counts.
        for B, ctx in [(1, 8192), (64, 8192)]:
            kc_d, vc_d, bt = _paged([ctx] * B, width=ctx // 16)
            qd = torch.randn(B, H, D, device=dev, dtype=DT)
            sl = torch.full((B,), ctx, dtype=torch.int32, device=dev)
            kv_bytes = 2 * B * ctx * HKV * D * el
            res = []
            splits = [16, 32, 64] if B == 1 else [1, 2]
            for ns in splits:
                for bn, nw, st in [(32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 3)]:
                    try:
                        us = _bench_gpu(lambda: paged_decode_attention_triton(
                            qd, kc_d, vc_d, bt, sl, D ** -0.5, num_splits=ns, block_n=bn, num_warps=nw,
                            num_stages=st))
                        res.append(dict(num_splits=ns, block_n=bn, num_warps=nw, num_stages=st, us=round(us, 2),
                                        frac_hbm=round(kv_bytes / (us * 1e-6) / HBM_BW, 3)))
                    except Exception as e:  # e.g. out of shared memory
                        res.append(dict(num_splits=ns, block_n=bn, num_warps=nw, num_stages=st, error=str(e)[:120]))
            res.sort(key=lambda r: r.get("us", 1e30))
            sweeps[f"decode B={B} ctx={ctx}"] = res
            print(f"sweep decode B={B} ctx={ctx} best:", res[:3], flush=True)
        # Prefill tiles (BLOCK_M rows, BLOCK_N keys, num_warps, num_stages).
        q_len = ctx = 8192
        kc_p, vc_p, bt = _paged([ctx])
        qp = torch.randn(q_len, H, D, device=dev, dtype=DT)
        qsl = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
        sl = torch.tensor([ctx], dtype=torch.int32, device=dev)
        flops = 4 * H * D * q_len * (q_len + 1) / 2
        res = []
        for bm, bn, nw, st in [(128, 64, 8, 2), (128, 64, 4, 2), (128, 64, 8, 3), (64, 64, 4, 2),
                               (128, 128, 8, 2), (64, 32, 4, 3)]:
            try:
                us = _bench_gpu(lambda: paged_attention_triton(qp, kc_p, vc_p, bt, sl, qsl, D ** -0.5, block_m=bm,
                                                           block_n=bn, num_warps=nw, num_stages=st))
                res.append(dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=st, us=round(us, 2),
                                tflops=round(flops / (us * 1e-6) / 1e12, 1)))
            except Exception as e:
                res.append(dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=st, error=str(e)[:120]))
        res.sort(key=lambda r: r.get("us", 1e30))
        sweeps["prefill q_len=8192 ctx=8192"] = res
        print("sweep prefill best:", res[:3], flush=True)

    # ---- table
    print()
    print("triton us: GPU time (CUDA-graph replay, L2 flushed); eager us: same call launched eagerly")
    print(f"{'kernel':<28} {'shape':<26} {'triton us':>10} {'eager us':>9} {'ref us':>10} {'x ref':>7} {'base us':>9} "
          f"{'x base':>7} {'GB/s':>8} {'%HBM':>6} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['kernel'][:28]:<28} {r['shape'][:26]:<26} {r['triton_us']:>10.1f} {r['triton_eager_us']:>9.1f} "
              f"{r.get('ref_us', float('nan')):>10.1f} {r.get('speedup_vs_ref', float('nan')):>7.2f} "
              f"{r.get('baseline_us', float('nan')):>9.1f} {r.get('speedup_vs_baseline', float('nan')):>7.2f} "
              f"{r.get('gbps', float('nan')):>8.1f} {100 * r.get('frac_hbm', float('nan')):>6.1f} "
              f"{r.get('tflops', float('nan')):>8.1f}")

    dump(rows, sweeps, final=True)


if __name__ == "__main__":
    main()
