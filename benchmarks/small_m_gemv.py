"""Decode-sized linear layers on the GPU: the Triton norm+GEMV kernel (default launch shape and a sweep of
launch shapes) against the unfused path (RMSNorm kernel + cuBLAS + silu_and_mul), and the decode
attention kernel with its split merge in-kernel vs a separate reduce kernel; with --argmax, the greedy
argmax kernel against torch's argmax at sampler shapes.

Each timing is a CUDA graph of the op applied to enough distinct weight copies (>= 256 MB) that nothing
stays in the 50 MB L2 between calls, as in a model whose every layer has its own weights; the time per
call is the graph's time divided by the number of calls. Bandwidth is against the 4.15 TB/s roofline.

python3 benchmarks/small_m_gemv.py [--quick] [--output-json FILE]
python3 benchmarks/small_m_gemv.py --skip-attention --ms 64 --shapes l8_qkv l8_o l8_down   (64 rows: split-K)
python3 benchmarks/small_m_gemv.py --skip-attention --ms 8 16 --shapes l8_qkv_plain l8_gate_up_plain   (folded qkv)
python3 benchmarks/small_m_gemv.py --argmax [--quick] [--output-json FILE]
python3 benchmarks/small_m_gemv.py --attn-real [--output-json FILE]   (decode attention on a throughput run's layout)
python3 benchmarks/small_m_gemv.py --attn-prep-sweep [--quick | --ab-env NAME]   (the fused-prep kernel, b16 / b64)
python3 benchmarks/small_m_gemv.py --pdl-chain | --gemv-chain-sweep | --chain-env NAME=V1/V2 [--chain-ctx N ...]
                                                                                     (the Qwen3-0.6B b1 chain)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

import torch
import triton

from gyrfalcon.bench.common import HBM_BYTES_PER_S, run_info, scoped_env
from gyrfalcon.kernels import rms_norm, silu_and_mul
from gyrfalcon.kernels.small_m_gemv import GemvConfig, default_config, norm_gemv_triton

# name: (K, N, norm, silu). N is the output width (gate_up: the weight has 2N rows).
SHAPES = {
    "q06_qkv": (1024, 4096, True, False), "q06_o": (2048, 1024, False, False),
    "q06_gate_up": (1024, 3072, True, True), "q06_down": (3072, 1024, False, False),
    "l8_qkv": (4096, 6144, True, False), "l8_o": (4096, 4096, False, False),
    "l8_gate_up": (4096, 14336, True, True), "l8_down": (14336, 4096, False, False),
    # qkv / gate_up as folded norms run them in batched steps: plain GEMMs (gate_up's output is both halves)
    "q06_qkv_plain": (1024, 4096, False, False), "q06_gate_up_plain": (1024, 6144, False, False),
    "l8_qkv_plain": (4096, 6144, False, False), "l8_gate_up_plain": (4096, 28672, False, False),
}


def graph_time_us(fns, reps: int = 5) -> float:
    """Mean device time of one call, fns being a list of calls on distinct weights, via a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * len(fns)))
    del g
    return sorted(times)[len(times) // 2]


def sweep_configs(M: int, wide: bool = False):
    if wide and M > 16:
        # --wide at 17-64 rows: 64-row tiles with 256-input steps, 8 warps and 128-column tiles too, within ~220 KB
        for bn, bk, (nw, ns), sk in itertools.product((32, 64, 128), (64, 128, 256), ((4, 3), (4, 4), (8, 3)),
                                                        (1, 2, 4)):
            if (bn + 64) * bk * 2 * ns <= 220 * 1024:
                yield GemvConfig(bn, bk, nw, ns, sk)
        return
    if wide and 1 < M <= 16:
        # --wide: 8 warps, deeper pipelines, 512-input steps and split-K too (2-4 programs a column tile), within
        # ~220 KB of shared memory (weight and input tiles times stages)
        for bn, bk, (nw, ns), sk in itertools.product((16, 32, 64), (128, 256, 512), ((4, 4), (4, 6), (8, 4)),
                                                        (1, 2, 4)):
            if (bn + 16) * bk * 2 * ns <= 220 * 1024:
                yield GemvConfig(bn, bk, nw, ns, sk)
        return
    if M == 1:
        for bn, bk, nw, ns in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4,), (2, 4)):
            yield GemvConfig(bn, bk, nw, ns)
        for bn, bk in ((8, 1024), (16, 1024), (16, 512), (32, 512)):
            yield GemvConfig(bn, bk, 8, 3)
    elif M <= 16:
        for bn, bk, nw, ns in itertools.product((16, 32, 64), (64, 128, 256), (4,), (3, 4)):
            yield GemvConfig(bn, bk, nw, ns)
    else:  # 64-row tiles: narrower K steps (the input tile fills shared memory too), and split-K
        for bn, bk, ns, sk in itertools.product((32, 64), (64, 128), (3, 4), (1, 2, 4)):
            yield GemvConfig(bn, bk, 4, ns, sk)


def bench_gemv(args, rows):
    for M in args.ms:
        for name, (K, N, norm, silu) in SHAPES.items():
            if args.shapes and name not in args.shapes:
                continue
            wbytes = (2 * N if silu else N) * K * 2
            copies = max(2, min(64, -(-256 * 2**20 // wbytes)))
            x = torch.randn(M, K, device="cuda").bfloat16()
            r = torch.randn(M, K, device="cuda").bfloat16()
            ws = [(torch.randn(2 * N if silu else N, K, device="cuda") / K ** 0.5).bfloat16() for _ in range(copies)]
            nw = torch.ones(K, device="cuda").bfloat16()
            kw = dict(norm_weight=nw if norm else None, residual=r if norm else None, silu_mul=silu)

            def unfused(w):
                h = rms_norm(x, nw, 1e-6, residual=r)[0] if norm else x
                y = torch.nn.functional.linear(h, w)
                return silu_and_mul(y) if silu else y

            t_u = graph_time_us([lambda w=w: unfused(w) for w in ws])
            dflt = default_config(M, N, K, silu)
            t_d = graph_time_us([lambda w=w: norm_gemv_triton(x, w, config=dflt, **kw) for w in ws])
            best = (t_d, dflt)
            timed = []
            if not args.quick and args.wide:
                # the wide grid's ~60 variants a shape compiled in threads first (the startup's way), not one by one
                try:
                    from gyrfalcon.runner.precompile import precompile
                    precompile([lambda c=c: norm_gemv_triton(x, ws[0], config=c, **kw) for c in sweep_configs(M, True)])
                except Exception as e:  # one variant the compiler rejects: the loop below compiles the rest
                    print(f"  {name} M={M}: parallel compile stopped ({type(e).__name__}); compiling in the loop",
                          file=sys.stderr)
            if not args.quick:
                for cfg in sweep_configs(M, args.wide):
                    if cfg.block_k > max(64, triton.next_power_of_2(K)):
                        continue
                    try:
                        t = graph_time_us([lambda w=w: norm_gemv_triton(x, w, config=cfg, **kw) for w in ws], reps=3)
                    except Exception as e:  # a launch shape the compiler rejects (e.g. out of resources)
                        print(f"  {name} M={M} {cfg}: {type(e).__name__}", file=sys.stderr)
                        continue
                    timed.append((round(t, 2), list(cfg)))
                    if t < best[0]:
                        best = (t, cfg)
            frac = lambda t: wbytes / (t * 1e-6) / HBM_BYTES_PER_S  # noqa: E731
            row = {"shape": name, "M": M, "K": K, "N": N, "unfused_us": round(t_u, 2),
                   "default_us": round(t_d, 2), "default_config": list(dflt),
                   "best_us": round(best[0], 2), "best_config": list(best[1]),
                   "speedup_default": round(t_u / t_d, 3), "speedup_best": round(t_u / best[0], 3),
                   "frac_hbm_unfused": round(frac(t_u), 3), "frac_hbm_best": round(frac(best[0]), 3),
                   "top": sorted(timed)[:8]}
            rows.append(row)
            print(f"{name:12s} M={M:2d} unfused {t_u:6.1f} us ({frac(t_u):4.0%})  default {t_d:6.1f} us {tuple(dflt)}"
                  f"  best {best[0]:6.1f} us ({frac(best[0]):4.0%}) {tuple(best[1])}  x{t_u / best[0]:.2f}", flush=True)
            del ws


def _attn_inputs(B, ctx, n_heads, n_kv, d, max_len=40960, block=16, copies=8, kv_dtype=torch.bfloat16,
                 device="cuda"):
    """q [B, H, d] and `copies` distinct paged K/V caches (kv_dtype: bf16, or float8_e4m3fn for the fp8 cache)
    holding ctx tokens per sequence, with a block table as wide as max_len (as under a CUDA graph) and
    seq_lens."""
    width = max_len // block
    blocks_per = -(-ctx // block)
    caches = []
    for _ in range(copies):
        kc = torch.randn(B * blocks_per + 1, block, n_kv, d, device=device)
        caches.append((kc.to(kv_dtype), torch.randn_like(kc).to(kv_dtype)))
    bt = torch.zeros(B, width, dtype=torch.int32, device=device)
    bt[:, :blocks_per] = torch.arange(B * blocks_per, dtype=torch.int32, device=device).view(B, blocks_per)
    sl = torch.full((B,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(B, n_heads, d, device=device).bfloat16()
    return q, caches, bt, sl


def bench_decode_attention(rows):
    from gyrfalcon.kernels.paged_decode_attention import paged_decode_attention_triton

    for (n_heads, n_kv, d), B, ctx in itertools.product(
            [(16, 8, 128), (32, 8, 128)], (1, 16, 64), (256, 2048, 8192)):
        q, caches, bt, sl = _attn_inputs(B, ctx, n_heads, n_kv, d)
        res = {}
        for merge, min_part in ((False, 64), (True, 64), (False, 256), (True, 256)):
            res[merge, min_part] = graph_time_us([lambda kc=kc, vc=vc: paged_decode_attention_triton(
                q, kc, vc, bt, sl, d ** -0.5, merge_in_kernel=merge, min_part=min_part) for kc, vc in caches])
        kv_bytes = 2 * B * ctx * n_kv * d * 2
        best = min(res, key=res.get)
        rows.append({"heads": n_heads, "kv_heads": n_kv, "B": B, "ctx": ctx,
                     "us": {f"{'merge' if m else 'reduce'}_minpart{p}": round(t, 2) for (m, p), t in res.items()},
                     "frac_hbm_default": round(kv_bytes / (res[True, 256] * 1e-6) / HBM_BYTES_PER_S, 3)})
        print(f"decode attn H={n_heads}/{n_kv} B={B:3d} ctx={ctx:5d}: " + "  ".join(
            f"{'merge' if m else 'reduce'}/{p} {t:6.1f}" for (m, p), t in res.items())
            + f" us; best {best}; default at {rows[-1]['frac_hbm_default']:.0%} of HBM", flush=True)


def bench_decode_attention_sweep(rows):
    """Launch-shape sweep of decode attention where the model spends it: short contexts at batch 1-64
    (the benchmark rows use 128-token prompts + 128 new tokens), and batch 1 at long ones. Forced split
    counts (1 = no reduce launch), keys per tile, warps, pipeline stages; each against the default
    launch shape, with programmatic dependent launch off and on."""
    from gyrfalcon.kernels.paged_decode_attention import default_num_splits, paged_decode_attention_triton

    for (n_heads, n_kv, d), B, ctx in itertools.chain(
            itertools.product([(16, 8, 128), (32, 8, 128)], (1,), (128, 256, 512, 2048, 8192)),
            itertools.product([(16, 8, 128), (32, 8, 128)], (16, 64), (256,))):
        q, caches, bt, sl = _attn_inputs(B, ctx, n_heads, n_kv, d)

        def timed(pdl=False, **kw):
            return graph_time_us([lambda kc=kc, vc=vc: paged_decode_attention_triton(
                q, kc, vc, bt, sl, d ** -0.5, pdl=pdl, **kw) for kc, vc in caches])

        t_default, t_default_pdl = timed(False), timed(True)
        res = {}
        for splits, bn, nw in itertools.product((1, 2, 4, 8, 16), (64, 128), (4, 8)):
            if splits > 1 and bn * (splits - 1) >= ctx:
                continue  # splits past the context are empty: the same as fewer splits
            try:
                res[splits, bn, nw] = timed(num_splits=splits, block_n=bn, num_warps=nw, num_stages=3)
            except Exception as e:  # e.g. out of shared memory for the largest tiles
                print(f"  skip {(splits, bn, nw)}: {type(e).__name__}", flush=True)
        best = sorted(res, key=res.get)[:5]
        kv_bytes = 2 * B * ctx * n_kv * d * 2
        rows.append({"heads": n_heads, "kv_heads": n_kv, "B": B, "ctx": ctx,
                     "default_us": round(t_default, 2), "default_pdl_us": round(t_default_pdl, 2),
                     "default_splits": default_num_splits(B, n_kv, bt.shape[1] * 16, q.device),
                     "best": [{"splits": k[0], "block_n": k[1], "warps": k[2], "us": round(res[k], 2)}
                              for k in best],
                     "all": {"/".join(map(str, k)): round(t, 2) for k, t in res.items()},
                     "frac_hbm_default": round(kv_bytes / (t_default * 1e-6) / HBM_BYTES_PER_S, 3)})
        print(f"attn sweep H={n_heads}/{n_kv} B={B:3d} ctx={ctx:5d}: default {t_default:6.2f} us, with PDL "
              f"{t_default_pdl:6.2f}; best (splits, block_n, warps) "
              + ", ".join(f"{k}={res[k]:.2f}" for k in best), flush=True)


def alternating_rounds(timers: dict, rounds: int = 4) -> dict:
    """timers {name: timed()} run in `rounds` rounds of alternating order (forward, reversed, ...), so that drift
    hits all alike -> {name: [us per round]}."""
    out = {name: [] for name in timers}
    for rnd in range(rounds):
        for name in (list(timers) if rnd % 2 == 0 else list(timers)[::-1]):
            out[name].append(round(timers[name](), 2))
    return out


def ab_rounds(timed, name: str, a_val: str, b_val: str, rounds: int = 4) -> dict:
    """A same-process A/B of an environment switch read at launch: timed() with `name` at a_val and at b_val
    ("unset": the variable removed), in `rounds` rounds of alternating order (A B, B A, ...) -> {value: [us per
    round]}."""
    def with_env(val):
        def run():
            with scoped_env({name: None if val == "unset" else val}):
                return timed()
        return run

    return alternating_rounds({a_val: with_env(a_val), b_val: with_env(b_val)}, rounds)


def bench_decode_attention_tput(rows, fp8: bool = False, sweep: bool = True, ab_env: str | None = None):
    """Decode attention where the throughput benchmark spends its steps (768 x 1024/1024 on Llama-3.1-8B:
    ~256 sequences at 1-2k tokens of context, where the KV reads are ~3/4 of a step's bytes): launch
    shapes (splits, keys per tile, warps, stages) and the key-tile layout (GYRFALCON_DECODE_K_ROWS),
    each against the default launch and as a fraction of the HBM roofline of its K/V bytes.
    fp8: the cache in float8 e4m3 (--kv-cache-dtype fp8), half the bytes, with 256-key tiles in the sweep too:
    at the bf16 cache's launch shapes it ran slower than bf16 in whole steps (Llama-8B b64 decode attention
    761 vs 550 us per step, run 29), where a tile of 1-byte elements keeps half as many bytes in flight.
    sweep=False (--quick): the default launch only. ab_env (--ab-env NAME or NAME=VALUE): the default launch with the
    environment variable NAME at "0" and at "1" (or unset and at VALUE), in four rounds of alternating order
    (A B B A ...), each round's time kept:
    a same-process A/B of a kernel switch read at launch (e.g. GYRFALCON_DECODE_FP8_V_STAGED; run 56 timed session
    16's GYRFALCON_DECODE_FP8_K_STAGED, since removed)."""
    from gyrfalcon.kernels.paged_decode_attention import paged_decode_attention_triton

    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    for (n_heads, n_kv, d), B, ctx in itertools.product([(32, 8, 128)], (64, 256), (1024, 2048)):
        q, caches, bt, sl = _attn_inputs(B, ctx, n_heads, n_kv, d, max_len=4096, copies=4, kv_dtype=kv_dtype)
        kv_bytes = 2 * B * ctx * n_kv * d * (1 if fp8 else 2)

        def timed(k_rows=None, **kw):  # k_rows None: the default launch's own choice
            with scoped_env({} if k_rows is None else {"GYRFALCON_DECODE_K_ROWS": k_rows}):
                return graph_time_us([lambda kc=kc, vc=vc: paged_decode_attention_triton(
                    q, kc, vc, bt, sl, d ** -0.5, **kw) for kc, vc in caches], reps=3)

        frac = lambda us: kv_bytes / (us * 1e-6) / HBM_BYTES_PER_S  # noqa: E731
        t_default = timed()
        ab = {}
        if ab_env:
            # NAME: the variable at "0" against "1"; NAME=VALUE: unset against VALUE.
            name, _, value = ab_env.partition("=")
            a_val, b_val = ("0", "1") if not value else ("unset", value)
            ab = ab_rounds(timed, name, a_val, b_val)
            med = {v: statistics.median(ts) for v, ts in ab.items()}
            print(f"attn tput{' fp8' if fp8 else ''} B={B:3d} ctx={ctx:5d}: {name}={a_val} {med[a_val]:.1f} us "
                  f"({frac(med[a_val]):.0%}), ={b_val} {med[b_val]:.1f} us ({frac(med[b_val]):.0%}); b/a "
                  f"{med[b_val] / med[a_val]:.3f}; rounds {a_val}: {ab[a_val]}, {b_val}: {ab[b_val]}", flush=True)
        res = {}
        for splits, bn, nw, ns, kr in itertools.product((1, 2), (64, 128, 256) if fp8 else (64, 128), (4, 8), (2, 3),
                                                        ("0", "1")) if sweep else ():
            try:
                res[splits, bn, nw, ns, kr] = timed(kr, num_splits=splits, block_n=bn, num_warps=nw, num_stages=ns)
            except Exception as e:  # e.g. out of shared memory for the largest tiles
                print(f"  skip {(splits, bn, nw, ns, kr)}: {type(e).__name__}", flush=True)
        best = sorted(res, key=res.get)[:5]
        rows.append({"heads": n_heads, "kv_heads": n_kv, "B": B, "ctx": ctx, "kv_dtype": str(kv_dtype),
                     "default_us": round(t_default, 2), "frac_hbm_default": round(frac(t_default), 3),
                     **({"ab_env": ab_env, "ab_rounds_us": ab,
                         "ab_median_us": {v: statistics.median(ts) for v, ts in ab.items()}} if ab else {}),
                     "best": [{"splits": k[0], "block_n": k[1], "warps": k[2], "stages": k[3], "k_rows": k[4],
                               "us": round(res[k], 2), "frac_hbm": round(frac(res[k]), 3)} for k in best],
                     "all": {"/".join(map(str, k)): round(t, 2) for k, t in res.items()}})
        print(f"attn tput{' fp8' if fp8 else ''} H={n_heads}/{n_kv} B={B:3d} ctx={ctx:5d}: default {t_default:7.1f} us "
              f"({frac(t_default):.0%} of HBM); best (splits, block_n, warps, stages, k_rows) "
              + ", ".join(f"{k}={res[k]:.1f} ({frac(res[k]):.0%})" for k in best), flush=True)
        del caches


def kv_pool(pool_blocks, device, n_kv=8, d=128, block=16, seed=0, dtype=torch.bfloat16):
    """A run's whole K/V cache for one layer: (k_cache, v_cache), each [pool_blocks, block, n_kv, d]."""
    from gyrfalcon.runner.model_runner import allocate_kv_cache

    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(2):
        c = allocate_kv_cache(pool_blocks, block, n_kv, d, dtype, torch.device(device))
        c.copy_(torch.randn(pool_blocks, block, n_kv, d, generator=g, device=device))
        out.append(c)
    return tuple(out)


def real_decode_inputs(B, ctx, pool, scattered, n_heads=32, seed=0):
    """A decode step's attention inputs as a throughput run holds them (Llama-3.1-8B's shape by default): B
    sequences of ctx tokens in `pool` (kv_pool: the run's whole cache, not just the blocks in use), whose
    blocks are consecutive (scattered=False) or drawn at random from the pool (scattered=True: what a long
    run's block manager hands out); the new token at position ctx - 1 (its slot in its last block); the fused
    kernel's qkv row and a llama-style RoPE table.
    -> dict(qkv [B, (H + 2 KV) d], positions [B], cos_sin [ctx, d], slots [B], bt [B, W], seq_lens [B],
    k_cache, v_cache, n_heads, n_kv, d)."""
    kc, vc = pool
    pool_blocks, block, n_kv, d = kc.shape
    device = kc.device
    g = torch.Generator(device="cpu").manual_seed(seed)
    per = -(-ctx // block)
    assert B * per <= pool_blocks, (B, per, pool_blocks)
    ids = torch.randperm(pool_blocks, generator=g)[:B * per] if scattered else torch.arange(B * per)
    bt = ids.to(torch.int32).view(B, per).to(device)
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
    pos = seq_lens.long() - 1
    slots = bt.long().gather(1, (pos // block)[:, None]).squeeze(1) * block + pos % block
    qkv = torch.randn(B, (n_heads + 2 * n_kv) * d, generator=g).to(device=device, dtype=kc.dtype)
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(ctx).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1).to(device)
    return dict(qkv=qkv, positions=pos, cos_sin=cos_sin, slots=slots, bt=bt, seq_lens=seq_lens, k_cache=kc,
                v_cache=vc, n_heads=n_heads, n_kv=n_kv, d=d)


def bench_decode_attention_real(rows, pool_blocks: int = 54835):
    """Decode attention at the throughput row's batches and contexts as the run holds them, each step apart:
    consecutive blocks (as --attn-tput, which reached 100-104% of the 4.15 TB/s figure at b256 / 1k in run 22)
    vs blocks scattered over the run's whole pool (54,835 blocks: Llama-3.1-8B's KV cache on the H200), one
    token past a tile (ctx 1025), and the kernel the decode graphs run (q/k RoPE and the KV store fused in,
    decode_attention_with_prep). mixed_step.py's decode step of 288 sequences at ~1,025 tokens spent 358-365 us
    per layer in it (runs 39-40), ~80% of that figure: which of these costs the difference? None (H200, run 42,
    benchmarks/results/attn_real-h200-2026-12-01-run42.json): every variant ran at 95-108%, scattered blocks
    within 1-2% of consecutive ones (B=288 ctx 1024: 292-303 us; B=384 ctx 2047: 719-731 us). A layout storing
    each kv head's block slice contiguously (session 12's GYRFALCON_KV_LAYOUT=hnd) timed the same and was
    removed."""
    from gyrfalcon.kernels.paged_decode_attention import (decode_attention_with_prep_triton,
                                                          paged_decode_attention_triton)

    # Two pools of 1.8 GB each for K and V (7.2 GB): calls alternate between them, so nothing stays in L2
    pools = [kv_pool(pool_blocks, "cuda", seed=i) for i in range(2)]
    for B, ctx in itertools.product((288, 384), (1024, 1025, 2047)):
        res = {}
        for scattered in (False, True):
            ins = [real_decode_inputs(B, ctx, pool, scattered, seed=i) for i, pool in enumerate(pools)]
            d = ins[0]["d"]
            q = [x["qkv"][:, :x["n_heads"] * d].reshape(B, x["n_heads"], d).contiguous() for x in ins]
            tag = "scattered" if scattered else "consecutive"
            res[f"attention_{tag}"] = graph_time_us([
                lambda x=x, qq=qq: paged_decode_attention_triton(qq, x["k_cache"], x["v_cache"], x["bt"],
                                                                 x["seq_lens"], d ** -0.5) for x, qq in zip(ins, q)],
                reps=3)
            res[f"with_prep_{tag}"] = graph_time_us([
                lambda x=x: decode_attention_with_prep_triton(
                    x["qkv"], x["n_heads"], x["n_kv"], d, x["positions"], x["cos_sin"], d, True, x["k_cache"],
                    x["v_cache"], x["slots"], x["bt"], x["seq_lens"], d ** -0.5) for x in ins], reps=3)
        kv_bytes = 2 * B * ctx * ins[0]["n_kv"] * d * 2
        frac = lambda us: kv_bytes / (us * 1e-6) / HBM_BYTES_PER_S  # noqa: E731
        rows.append({"B": B, "ctx": ctx, "pool_blocks": pool_blocks, "kv_bytes": kv_bytes,
                     **{k + "_us": round(v, 2) for k, v in res.items()},
                     **{k + "_frac_hbm": round(frac(v), 3) for k, v in res.items()}})
        print(f"attn real B={B:3d} ctx={ctx:5d}: "
              + ", ".join(f"{k} {v:.1f} us ({frac(v):.0%})" for k, v in res.items()), flush=True)


def bench_decode_attention_prep_sweep(rows, quick: bool = False, ab_env: str | None = None,
                                      batches=(16, 64), contexts=(144, 192, 250), splits=(1, 2, 4),
                                      configs=None, min_part=None, prefetch=(False, True)):
    """Decode attention with its fused prep (RoPE, KV store, folded input norm's rstd) as Llama-3.1-8B's batch 16 /
    64 decode graphs launch it, at the latency rows' contexts (128-token prompts, 128 new tokens): the kernel the
    model runs, where --attn-sweep timed the plain kernel. In the model it takes ~23 us a layer at batch 64 (50 MB
    of K/V at 192 tokens: 12 us at 4.15 TB/s) and ~11 at 16 (3 us); under Nsight Compute (run 62) the batch-64
    launch spent 40% of its stall samples waiting at the loop's barrier for K/V and read DRAM at 55%, and each
    program's K/V loads only start after the prep's chain of dependent loads (seq_len, position, RoPE row,
    residual row, qkv row, the new token's store). Swept: the first K/V tile loaded before the prep (prefetch,
    which the batch-1 graphs use under PDL) or not, splits, keys per tile, warps, stages; each against the
    default launch, cycling over enough layers' caches (>= 200 MB) that the K/V comes from HBM as in the model.
    ab_env (--ab-env NAME): instead of the sweep, the default launch with NAME at "0" and at "1", four rounds
    in alternating order, each round's time kept.
    H200, run 65 (attn_prep_sweep-h200-2026-12-01-run65.json): the prefetch never won; at batch 64 the default
    (one split, 64-key tiles, 4 warps, 2 stages) was the best at 144-250 tokens (18.0-23.1 us, 51-69% of HBM); at
    batch 16 one split of 128-key tiles beat the default 4 splits (11.20 vs 11.89 us at 192 tokens), which
    paged_decode_attention.default_min_part made the default. Run 90 (attn_prep_sweep-h200-2026-12-02-run90.json): at
    batch 16 one split of 256-key tiles, 8 warps, one stage 9.20-10.75 us against 12.49-12.89
    (paged_decode_attention.WIDE_TILE_CONFIG; since run 93 the one-split graphs' launch up to 256 tokens, where the
    default here is the main graphs'). batches / contexts (--prep-batches, --prep-contexts): other rows; splits /
    configs / min_part / prefetch (--prep-splits, --prep-configs "bn,warps,stages ...", --prep-min-part,
    --prep-no-prefetch): another grid, e.g. more splits of fewer keys at 1-2k tokens (min_part 0: splits below
    default_min_part's 256 keys), where the main graphs' default reached 51-67% of HBM at b16 (run 92)."""
    from gyrfalcon.kernels.paged_decode_attention import decode_attention_with_prep_triton

    hidden = 4096
    for B, ctx in itertools.product(batches, contexts):
        layers = max(2, -(-(200 << 20) // (2 * B * ctx * 8 * 128 * 2)))
        pool = kv_pool(layers * B * (-(-ctx // 16)) + 1, "cuda")
        ins = []
        for i in range(layers):
            x = real_decode_inputs(B, ctx, pool, scattered=False, seed=i)
            x["bt"] = x["bt"] + i * B * (-(-ctx // 16))  # each layer its own blocks of the pool
            per = x["bt"].shape[1]
            wide = torch.zeros(B, 40960 // 16, dtype=torch.int32, device="cuda")  # graph-width table
            wide[:, :per] = x["bt"]
            x["slots"] = x["bt"].long()[:, -1] * 16 + (x["positions"] % 16)
            x["bt"] = wide
            x["resid"] = torch.randn(B, hidden, device="cuda", dtype=torch.bfloat16)
            ins.append(x)
        d = ins[0]["d"]

        def timed(**kw):
            return graph_time_us([lambda x=x: decode_attention_with_prep_triton(
                x["qkv"], x["n_heads"], x["n_kv"], d, x["positions"], x["cos_sin"], d, True, x["k_cache"],
                x["v_cache"], x["slots"], x["bt"], x["seq_lens"], d ** -0.5, row_scale=(x["resid"], 1e-5), **kw)
                for x in ins], reps=3)

        kv_bytes = 2 * B * ctx * 8 * d * 2
        frac = lambda us: kv_bytes / (us * 1e-6) / HBM_BYTES_PER_S  # noqa: E731
        if ab_env:
            ab = ab_rounds(timed, ab_env, "0", "1")
            med = {v: statistics.median(ts) for v, ts in ab.items()}
            rows.append({"B": B, "ctx": ctx, "layers": layers, "ab_env": ab_env, "ab_rounds_us": ab,
                         "ab_median_us": med})
            print(f"attn prep B={B:3d} ctx={ctx:4d}: {ab_env}=0 {med['0']:.2f} us ({frac(med['0']):.0%}), =1 "
                  f"{med['1']:.2f} us ({frac(med['1']):.0%}); 1/0 {med['1'] / med['0']:.3f}; rounds {ab}", flush=True)
            del ins, pool
            continue
        t_default = timed()
        res = {}
        more = {} if min_part is None else {"min_part": min_part}
        # (64, 8, 3 / 2): the batch-1 prefetching launch's shape since run 77; (256, 4 / 8, 1): a whole short
        # context in one tile, all its loads issued at once (one stage: 128 KB of K/V; at 16 warps since run 91)
        grid = itertools.product(prefetch, splits, configs or ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3),
                                                               (32, 4, 3), (128, 8, 3), (64, 8, 3), (64, 8, 2),
                                                               (256, 4, 1), (256, 8, 1), (256, 16, 1)))
        for pf, sp, (bn, nw, ns) in grid:
            if quick and (nw == 8 or bn == 32 or bn == 256):
                continue
            if bn == 256 and pf:
                continue  # a whole short context in one tile: nothing to prefetch ahead of the prep
            if sp > 1 and bn * (sp - 1) >= ctx:
                continue  # splits past the context are empty: the same as fewer splits
            try:
                res[pf, sp, bn, nw, ns] = timed(prefetch=pf, num_splits=sp, block_n=bn, num_warps=nw, num_stages=ns,
                                                **more)
            except Exception as e:  # e.g. out of shared memory
                print(f"  skip {(pf, sp, bn, nw, ns)}: {type(e).__name__}", flush=True)
        best = sorted(res, key=res.get)[:6]
        rows.append({"B": B, "ctx": ctx, "layers": layers, "min_part": min_part, "default_us": round(t_default, 2),
                     "frac_hbm_default": round(frac(t_default), 3),
                     "best": [{"prefetch": k[0], "splits": k[1], "block_n": k[2], "warps": k[3], "stages": k[4],
                               "us": round(res[k], 2), "frac_hbm": round(frac(res[k]), 3)} for k in best],
                     "all": {"/".join(map(str, k)): round(t, 2) for k, t in res.items()}})
        print(f"attn prep B={B:3d} ctx={ctx:4d}: default {t_default:6.2f} us ({frac(t_default):.0%} of HBM); best "
              "(prefetch, splits, block_n, warps, stages) "
              + ", ".join(f"{k}={res[k]:.2f}" for k in best), flush=True)
        del ins, pool


class QwenB1Chain:
    """A Qwen3-0.6B-shaped decode layer's kernels at batch 1 as the model runs them (norm+qkv GEMV, decode
    attention with the q/k norm, RoPE and KV store fused in over 256 tokens + its reduce, o GEMV, then the MLP:
    norm+gate_up+SiLU GEMV and down GEMV), layer after layer, on distinct weights per layer (as the model: 31.5 MB
    a layer, read from HBM). step(Ws, pdl[, gemv]) runs the 28 layers once.
    device / dtype / dims (H, KV, D, hid, inter, layers, ctx): smaller chains for the CPU tests of this script."""

    H, KV, D, hid, inter, layers, ctx = 16, 8, 128, 1024, 3072, 28, 256

    def __init__(self, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, **dims) -> None:
        for k, v in dims.items():
            setattr(self, k, v)
        dev, bf = device, dtype
        H, KV, D, hid, inter = self.H, self.KV, self.D, self.hid, self.inter
        _, self.caches, self.bt, self.sl = _attn_inputs(1, self.ctx, H, KV, D, copies=self.layers, kv_dtype=dtype,
                                                        device=device)
        self.pos = torch.tensor([self.ctx - 1], device=dev)
        self.slot = torch.tensor([self.ctx - 1], device=dev)
        self.cs = torch.randn(max(4096, self.ctx), D, device=dev)
        self.distinct = [dict(qkv=torch.randn((H + 2 * KV) * D, hid, device=dev, dtype=bf) * 0.02,
                              o=torch.randn(hid, H * D, device=dev, dtype=bf) * 0.02,
                              gu=torch.randn(2 * inter, hid, device=dev, dtype=bf) * 0.02,
                              down=torch.randn(hid, inter, device=dev, dtype=bf) * 0.02,
                              n1=torch.ones(hid, device=dev, dtype=bf), n2=torch.ones(hid, device=dev, dtype=bf),
                              qn=torch.ones(D, device=dev, dtype=bf), kn=torch.ones(D, device=dev, dtype=bf))
                         for _ in range(self.layers)]
        self.x0 = torch.randn(1, hid, device=dev, dtype=bf)
        self.bytes = (sum(t.numel() * t.element_size() for t in self.distinct[0].values()) * self.layers
                      + self.layers * 2 * self.ctx * KV * D * self.caches[0][0].element_size())

    def step(self, Ws, pdl: bool, gemv: dict | None = None):
        """gemv: {"qkv" | "o" | "gu" | "down": GemvConfig}, launch shapes that replace those GEMVs' defaults (the
        others keep theirs)."""
        from gyrfalcon.kernels.paged_decode_attention import decode_attention_with_prep_triton

        H, KV, D = self.H, self.KV, self.D
        cfg = gemv or {}
        x, res = self.x0, torch.zeros_like(self.x0)
        for w, (kc, vc) in zip(Ws, self.caches):
            qkv, res = norm_gemv_triton(x, w["qkv"], w["n1"], res, pdl=pdl, config=cfg.get("qkv"))
            o = decode_attention_with_prep_triton(qkv, H, KV, D, self.pos, self.cs, D, True, kc, vc, self.slot,
                                                  self.bt, self.sl, D ** -0.5, q_norm_weight=w["qn"],
                                                  k_norm_weight=w["kn"], pdl=pdl)
            x = norm_gemv_triton(o.view(1, -1), w["o"], pdl=pdl, config=cfg.get("o"))[0]
            h, res = norm_gemv_triton(x, w["gu"], w["n2"], res, silu_mul=True, pdl=pdl, config=cfg.get("gu"))
            x, _ = norm_gemv_triton(h, w["down"], pdl=pdl, config=cfg.get("down"))
        return x


def bench_pdl_chain(rows):
    """QwenB1Chain with programmatic dependent launch off, serialized, and on; each on distinct weights per layer
    and on one layer's weights shared by all (after the first layer they sit in the 50 MB L2: the bound of what
    prefetching the next kernels' weights into L2 ahead of time could gain). On the H200 (run 58,
    pdl_chain-h200-2026-12-01-run58.json) PDL on: 634.0 us a step distinct, 564.4 shared, so ~20 us a layer is
    the chain of dependent launches itself; GEMVs that pulled the GEMV two launches on into L2
    (prefetch.global.L2, GYRFALCON_L2_PREFETCH at commit b027b23) ran 639.6 us, and the model's step 0.731 vs 0.722 ms
    (ABBA): removed."""
    c = QwenB1Chain()
    layers, ctx = c.layers, c.ctx
    for mode, Ws in (("distinct", c.distinct), ("shared", [c.distinct[0]] * layers)):
        out = {}
        for pdl in (False, "serial", True):
            def step(pdl=bool(pdl)):
                return c.step(Ws, pdl)
            # "serial": the PDL kernel variants launched without the attribute (no overlap, same arithmetic)
            with scoped_env({"GYRFALCON_PDL": "serial" if pdl == "serial" else "1"}):
                out[pdl] = step().float()
                out[pdl, "us"] = graph_time_us([step], reps=3)
        same = torch.equal(out["serial"], out[True])
        for pdl, name in ((False, "off"), ("serial", "serial"), (True, "on")):
            t = out[pdl, "us"]
            print(f"pdl chain ({layers} Qwen3-0.6B layers, {mode} weights, batch 1, ctx {ctx}): PDL {name:6s} "
                  f"{t:7.1f} us per step ({c.bytes / (t * 1e-6) / HBM_BYTES_PER_S:.0%} of HBM, "
                  f"{t / layers:.2f} us a layer)", flush=True)
        print(f"pdl chain ({mode}): PDL output identical to its serialized launch: {same}; speedup over PDL off "
              f"x{out[False, 'us'] / out[True, 'us']:.3f}", flush=True)
        rows.append({"layers": layers, "ctx": ctx, "weights": mode, "us_pdl_off": round(out[False, "us"], 1),
                     "us_pdl_serial": round(out["serial", "us"], 1),
                     "us_pdl_on": round(out[True, "us"], 1), "identical_to_serial": same,
                     "speedup": round(out[False, "us"] / out[True, "us"], 3)})


def chain_gemv_dims(c: QwenB1Chain) -> dict:
    """QwenB1Chain's four single-row GEMVs: {name: (N outputs (gate_up: units), K inputs, SiLU-and-mul)}."""
    return {"qkv": ((c.H + 2 * c.KV) * c.D, c.hid, False), "o": (c.hid, c.H * c.D, False),
            "gu": (c.inter, c.hid, True), "down": (c.hid, c.inter, False)}


def chain_gemv_configs(c: QwenB1Chain) -> dict:
    """Launch shapes for QwenB1Chain's four single-row GEMVs to try in place of each default: {(gemv, BLOCK_N,
    warps): GemvConfig}, each default_config's peeled (PDL) launch with that override (GYRFALCON_GEMV_B1_SHAPES),
    so BLOCK_K and stages follow its rules (one tile over the row where the slice fits WHOLE_ROW_MAX_BYTES)."""
    out = {}
    for name, (N, K, silu) in chain_gemv_dims(c).items():
        base = default_config(1, N, K, silu, 2, whole_row=True)
        # (32 rows a program lost up to 4x in run 76's sweep; run 76's winners sat at its grid's narrow end: 2 rows /
        # 1 warp added.)
        for bn in (2, 4, 8, 16):
            for warps in (1, 2, 4, 8):
                with scoped_env({"GYRFALCON_GEMV_B1_SHAPES": f"{N}x{K}={bn},{warps}"}):
                    cfg = default_config(1, N, K, silu, 2, whole_row=True)
                if cfg != base:
                    out[name, bn, warps] = cfg
    return out


def _checked(rows: list, row: dict, label: str, fn):
    """fn() -> its result; or, where it raises (a launch shape that does not compile), None after printing why and
    appending row with the error to rows: that variant is reported and left out of the timing."""
    try:
        return fn()
    except Exception as e:
        print(f"{label} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:500]}"})
        return None


def bench_gemv_chain_sweep(rows, rounds: int = 2):
    """QwenB1Chain (distinct weights, PDL on, as the Qwen3-0.6B batch-1 graph runs) with one of its four GEMVs at
    another launch shape (chain_gemv_configs: 15 a GEMV), each against the all-default chain in the same rounds of
    alternating order. The default shapes come from sweeps of each GEMV alone (small_m_gemv_sweep-*.json: throughput of one
    launch); in the chain what counts is the work after each PDL wait (docs/performance.md: one-pass norm, run 74),
    which fewer rows a program or fewer warps (a narrower block-wide sum) may shorten."""
    c = QwenB1Chain()
    dims = chain_gemv_dims(c)
    variants = {("default", 0, 0): None, **chain_gemv_configs(c)}

    def row(key):  # (N, K): the GEMV's shape, the key of GYRFALCON_GEMV_B1_SHAPES
        n, k = dims[key[0]][:2] if key[0] in dims else (0, 0)
        return {"gemv": key[0], "block_n": key[1], "num_warps": key[2], "n": n, "k": k}

    with scoped_env({"GYRFALCON_PDL": "1"}):
        ref = c.step(c.distinct, True).float()
        diffs, timers = {}, {}
        for key, cfg in variants.items():
            gemv = None if cfg is None else {key[0]: cfg}
            out = _checked(rows, row(key), f"gemv chain: {key}", lambda: c.step(c.distinct, True, gemv=gemv))
            if out is None:
                continue
            diffs[key] = float((out.float() - ref).abs().max())
            timers[key] = lambda gemv=gemv: graph_time_us([lambda: c.step(c.distinct, True, gemv=gemv)], reps=3)
        times = alternating_rounds(timers, rounds)
    base = statistics.median(times["default", 0, 0])
    for key, ts in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
        t = statistics.median(ts)
        cfg = variants[key]
        label = "all defaults" if cfg is None else f"{key[0]} BLOCK_N {key[1]} {key[2]} warps BLOCK_K {cfg.block_k}"
        print(f"gemv chain ({c.layers} Qwen3-0.6B layers, batch 1, ctx {c.ctx}, PDL): {label:38s} {t:7.1f} us a step "
              f"(x{base / t:.3f} vs defaults; rounds {ts}); max |out - defaults'| {diffs[key]:.3g}", flush=True)
        rows.append({**row(key), "config": cfg._asdict() if cfg else None, "us_rounds": ts, "us_median": t,
                     "speedup_vs_default": round(base / t, 4), "max_abs_diff": diffs[key]})


def bench_chain_env(rows, spec: str, rounds: int = 4, chain=None, timer=None, pdl: bool = True):
    """QwenB1Chain (distinct weights, PDL on) with an environment switch read at launch at each of its values
    (spec "NAME=V1/V2/...", each against the variable unset) in rounds of alternating order: launch shapes of
    the chain's other kernels chosen in the chain, e.g. GYRFALCON_DECODE_ATTN_CONFIG=64,8/128,4 (decode
    attention's keys a tile and warps), GYRFALCON_DECODE_REDUCE_WARPS=1/2/8. chain: a QwenB1Chain (default: the
    real one); timer(step) -> us (default: graph_time_us in a CUDA graph); pdl=False: the kernels' non-PDL
    variants (the interpreter's tests)."""
    name, _, vals = spec.partition("=")
    values = ["unset"] + [v for v in vals.split("/") if v]
    c = chain or QwenB1Chain()
    timer = timer or (lambda step: graph_time_us([step], reps=3))

    def env(val):
        return scoped_env({"GYRFALCON_PDL": "1", name: None if val == "unset" else val})

    def timed(val):
        def run():
            with env(val):
                return timer(lambda: c.step(c.distinct, pdl))
        return run

    def run(val):
        with env(val):
            return c.step(c.distinct, pdl).float()

    outs = {"unset": run("unset")}  # the reference must run
    for val in values[1:]:
        out = _checked(rows, {"env": name, "value": val}, f"chain env: {name}={val}", lambda: run(val))
        if out is not None:
            outs[val] = out
    values = [v for v in values if v in outs]
    times = alternating_rounds({v: timed(v) for v in values}, rounds)
    base = statistics.median(times["unset"])
    for val, ts in times.items():
        t = statistics.median(ts)
        diff = float((outs[val] - outs["unset"]).abs().max())
        print(f"chain env ({c.layers} Qwen3-0.6B layers, batch 1, ctx {c.ctx}, PDL): {name}={val:12s} {t:7.1f} us a "
              f"step (x{base / t:.3f} vs unset; rounds {ts}); max |out - unset's| {diff:.3g}", flush=True)
        rows.append({"env": name, "value": val, "ctx": c.ctx, "us_rounds": ts, "us_median": t,
                     "speedup_vs_unset": round(base / t, 4), "max_abs_diff": diff})


def bench_argmax(rows, sweep: bool = True):
    """Greedy argmax of [S, V] logits (S = 1, 16, 64; Llama-3 and Qwen vocabularies; fp32, which is what
    the runner's compute_logits returns, and bf16): torch's argmax against greedy_argmax (the dispatcher,
    default launch shape). "hot": 8 calls on one buffer (fresh logits sit in L2 when they fit, as after
    the LM head); "cold": distinct buffers, >= 128 MB in all, so that each call reads HBM. The sweep
    (hot) tries other launch shapes of the Triton kernel: (block, min_chunk, warps)."""
    from gyrfalcon.kernels.argmax import argmax_launch, greedy_argmax, greedy_argmax_triton

    configs = [(1024, 2048, 4), (2048, 4096, 4), (4096, 4096, 8), (4096, 8192, 8), (8192, 8192, 8),
               (4096, 16384, 8)]
    for dtype, V, S in itertools.product((torch.float32, torch.bfloat16), (128256, 151936), (1, 16, 64)):
        nbytes = S * V * dtype.itemsize
        copies = max(1, min(256, -(-(128 << 20) // nbytes)))
        xs = [torch.randn(S, V, device="cuda", dtype=dtype) * 4 for _ in range(copies)]
        equal = all(torch.equal(greedy_argmax(x), x.argmax(dim=-1)) for x in xs[:4])

        def hot(f):
            return graph_time_us([lambda: f(xs[0])] * 8)

        def cold(f):
            return graph_time_us([lambda x=x: f(x) for x in xs], reps=2)

        torch_argmax = lambda x: x.argmax(dim=-1)  # noqa: E731
        t = {"torch_hot": hot(torch_argmax), "ours_hot": hot(greedy_argmax),
             "torch_cold": cold(torch_argmax), "ours_cold": cold(greedy_argmax)}
        res = {}
        for block, min_chunk, warps in configs if sweep else ():
            res[block, min_chunk, warps] = hot(lambda x, b=block, c=min_chunk, w=warps: greedy_argmax_triton(
                x, block=b, min_chunk=c, num_warps=w))
        best = sorted(res, key=res.get)[:3]
        launch = argmax_launch(S, V)
        rows.append({"dtype": str(dtype).replace("torch.", ""), "S": S, "V": V,
                     "chunk": launch and launch[0], "programs_per_row": launch and launch[1],
                     **{f"{k}_us": round(v, 2) for k, v in t.items()},
                     "speedup_hot": round(t["torch_hot"] / t["ours_hot"], 2),
                     "speedup_cold": round(t["torch_cold"] / t["ours_cold"], 2), "equal_to_torch": equal,
                     "sweep_hot": {"/".join(map(str, k)): round(v, 2) for k, v in res.items()},
                     "best": [{"block": k[0], "min_chunk": k[1], "warps": k[2], "us": round(res[k], 2)}
                              for k in best]})
        print(f"argmax {rows[-1]['dtype']:8s} S={S:2d} V={V}: torch {t['torch_hot']:6.2f} / {t['torch_cold']:6.2f} us "
              f"(hot / cold), greedy_argmax {t['ours_hot']:6.2f} / {t['ours_cold']:6.2f} us, launch {launch}, "
              f"equal {equal}" + ("; best (block, min_chunk, warps) " + ", ".join(
                  f"{k}={res[k]:.2f}" for k in best) if best else ""), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output-json")
    ap.add_argument("--quick", action="store_true", help="default launch shapes only, no sweep")
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16], help="rows (at most 64)")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="only these GEMV shapes")
    ap.add_argument("--wide", action="store_true",
                    help="at 2-16 rows sweep 8 warps, 6 stages, 512-input steps and split-K 2 / 4 too; at 17-64 rows "
                         "256-input steps, 8 warps and 128-column tiles")
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--skip-gemv", action="store_true")
    ap.add_argument("--attn-sweep", action="store_true", help="decode-attention launch-shape sweep only")
    ap.add_argument("--attn-tput", action="store_true",
                    help="decode attention at the throughput benchmark's batch and contexts: launch-shape sweep")
    ap.add_argument("--fp8", action="store_true", help="with --attn-tput: the float8 e4m3 KV cache")
    ap.add_argument("--ab-env", help="with --attn-tput or --attn-prep-sweep: the default launch with this environment "
                    "variable at 0 and at 1 (--attn-tput also NAME=VALUE: unset and at VALUE), alternately (a kernel "
                    "switch's same-process A/B)")
    ap.add_argument("--attn-real", action="store_true",
                    help="decode attention as a throughput run holds it: consecutive vs scattered blocks over the "
                         "whole KV pool, one token past a tile, the fused-prep kernel")
    ap.add_argument("--prep-batches", type=int, nargs="+", default=[16, 64],
                    help="with --attn-prep-sweep: the batches (default 16 64)")
    ap.add_argument("--prep-contexts", type=int, nargs="+", default=[144, 192, 250],
                    help="with --attn-prep-sweep: the contexts in tokens (default 144 192 250: the latency rows')")
    ap.add_argument("--prep-splits", type=int, nargs="+", default=[1, 2, 4],
                    help="with --attn-prep-sweep: the split counts of its grid (default 1 2 4)")
    ap.add_argument("--prep-configs", nargs="+", metavar="BN,WARPS,STAGES",
                    help="with --attn-prep-sweep: the launch shapes of its grid (default: eleven, 32-256-key tiles)")
    ap.add_argument("--prep-min-part", type=int,
                    help="with --attn-prep-sweep: the grid's least keys a split (default: default_min_part's)")
    ap.add_argument("--prep-no-prefetch", action="store_true",
                    help="with --attn-prep-sweep: no grid point loads the first tile before the prep")
    ap.add_argument("--attn-prep-sweep", action="store_true",
                    help="decode attention with its fused prep at Llama-8B batch 16 / 64 and short contexts: prefetch, "
                         "splits and launch shapes (--quick: 4 warps, 64 / 128-key tiles)")
    ap.add_argument("--pdl-chain", action="store_true", help="a decode layer's kernel chain, PDL off / on")
    ap.add_argument("--gemv-chain-sweep", action="store_true",
                    help="the Qwen3-0.6B batch-1 chain with each GEMV at other launch shapes")
    ap.add_argument("--chain-env", action="append", default=[], metavar="NAME=V1/V2",
                    help="the Qwen3-0.6B batch-1 chain with an environment switch at each value vs unset (repeatable)")
    ap.add_argument("--chain-ctx", type=int, nargs="+", default=[QwenB1Chain.ctx], metavar="TOKENS",
                    help="with --chain-env: the chain at these contexts (each spec at each)")
    ap.add_argument("--argmax", action="store_true", help="greedy argmax vs torch's (--quick: no sweep)")
    args = ap.parse_args()
    gemv_rows, attn_rows, chain_rows, argmax_rows = [], [], [], []
    if args.argmax:
        args.skip_gemv = args.skip_attention = True
        bench_argmax(argmax_rows, sweep=not args.quick)
    if args.pdl_chain:
        args.skip_gemv = args.skip_attention = True
        bench_pdl_chain(chain_rows)
    if args.gemv_chain_sweep:
        args.skip_gemv = args.skip_attention = True
        bench_gemv_chain_sweep(chain_rows)
    for ctx in args.chain_ctx if args.chain_env else ():
        args.skip_gemv = args.skip_attention = True
        chain = QwenB1Chain(ctx=ctx)
        for spec in args.chain_env:
            bench_chain_env(chain_rows, spec, chain=chain)
        del chain
    if args.attn_sweep:
        args.skip_gemv = args.skip_attention = True
        bench_decode_attention_sweep(attn_rows)
    if args.attn_tput:
        args.skip_gemv = args.skip_attention = True
        bench_decode_attention_tput(attn_rows, fp8=args.fp8, sweep=not args.quick, ab_env=args.ab_env)
    if args.attn_prep_sweep:
        args.skip_gemv = args.skip_attention = True
        configs = [tuple(int(v) for v in c.split(",")) for c in args.prep_configs] if args.prep_configs else None
        bench_decode_attention_prep_sweep(attn_rows, quick=args.quick, ab_env=args.ab_env,
                                          batches=args.prep_batches, contexts=args.prep_contexts,
                                          splits=args.prep_splits, configs=configs, min_part=args.prep_min_part,
                                          prefetch=(False,) if args.prep_no_prefetch else (False, True))
    if args.attn_real:
        args.skip_gemv = args.skip_attention = True
        bench_decode_attention_real(attn_rows)
    if not args.skip_gemv:
        bench_gemv(args, gemv_rows)
    if not args.skip_attention:
        bench_decode_attention(attn_rows)
    if args.output_json:
        info = run_info(args)
        info["command"] = "python3 benchmarks/small_m_gemv.py " + " ".join(sys.argv[1:])
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "small_m_gemv", **info, "gemv": gemv_rows, "decode_attention": attn_rows,
                       "pdl_chain": chain_rows, "argmax": argmax_rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
