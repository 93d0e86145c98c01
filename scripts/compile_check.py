"""Compile gyrfalcon's GPU kernels for an NVIDIA target on a machine without a GPU.

Runs the real launch wrappers (launch-shape choice included) on CPU tensors of the models' decode shapes,
with every Triton launch turned into a compile-only warm-up for sm_90 (Hopper, the H200), and checks
that each kernel compiles and fits the target's shared memory. It catches what the interpreter cannot:
code-generator errors (a variable redefined across branches), shared-memory overflow of a launch shape
(the fp32 prefetch's 128-key tiles need 270 KB of 227 KB). It also prints each kernel's registers and local
memory (spills) from cuobjdump, where Triton ships it. Speed still needs the GPU.

python3 scripts/compile_check.py [--arch 90] [--smem-limit 232448] [--sass LABEL]
--sass LABEL compiles only the launches whose label contains LABEL and prints, per loop of each kernel's SASS
(cuobjdump), its instructions and the commonest opcodes; the SASS goes to --sass-dir.
Exit status: 0 all compiled and fit; 1 a kernel failed; 2 this Triton's internals do not allow the
compile-only harness (nothing was checked).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target, not the interpreter (set by tests)
import torch  # noqa: E402



def _harness(arch: int):
    """Point Triton at a fake CUDA device of compute capability `arch` and make every launch compile
    only; reload the kernel modules so that they build real @triton.jit kernels (a CPU-only torch keeps
    them as plain-torch references). Returns (modules, compiled) where compiled collects
    (kernel name, shared bytes, num_warps) per compile."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class _FakeCuda:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(_FakeCuda())
    compiled = []
    real_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        k = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.__name__, k.metadata.shared, k.metadata.num_warps, _resources(k), k))
        return k

    JITFunction.run = compile_only
    from gyrfalcon.kernels import common as C
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    C.HAS_TRITON, C.triton, C.tl = True, triton, tl
    C.gdc_wait, C.gdc_launch_dependents = gdc_wait, gdc_launch_dependents
    mods = C.reload_kernel_modules()  # {"rms_norm": the op package, ...}
    importlib.import_module("gyrfalcon.kernels.decode_attention.configs")._sm_count = lambda device: 132  # the H200's
    return mods, compiled


def _cuobjdump(kernel, flag: str):
    """cuobjdump's output (`flag`: -sass, -res-usage) for a compiled kernel's cubin; None where Triton ships no
    cuobjdump or the kernel has no cubin."""
    import subprocess
    import tempfile

    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    cubin = kernel.asm.get("cubin")
    if not cubin or not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def sass_loops(kernel, out_path=None) -> list:
    """[(first address, last address, collections.Counter of opcodes)] for each loop of a compiled kernel's SASS
    (a branch back to a lower address closes one); [] without cuobjdump. out_path: where to write the SASS."""
    import collections
    import re

    sass = _cuobjdump(kernel, "-sass")
    if sass is None:
        return []
    if out_path:
        with open(out_path, "w") as f:
            f.write(sass)
    instrs = [(int(a, 16), op, rest) for a, op, rest in
              re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", sass)]
    loops = []
    for addr, op, rest in instrs:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            loops.append((lo, addr, collections.Counter(o for a, o, _ in instrs if lo <= a <= addr)))
    return loops


def _resources(kernel) -> dict:
    """{"REG": registers a thread, "LOCAL": bytes of local memory a thread (> 0: spills), ...} from
    cuobjdump's resource usage of the compiled cubin; {} where that tool is not at hand."""
    for line in (_cuobjdump(kernel, "-res-usage") or "").splitlines():
        if "REG:" in line:
            return {k: int(v) for k, v in (kv.split(":")[:2] for kv in line.split() if kv.count(":") == 1)
                    if v.isdigit()}
    return {}


# (heads, kv heads, head dim, hidden, intermediate) of the decode rows the benchmarks track.
SHAPES = {"qwen3-0.6b": (16, 8, 128, 1024, 3072), "llama-3.1-8b": (32, 8, 128, 4096, 14336)}


def cases(mods):
    """(label, thunk) per launch to compile: batch-1 decode with and without PDL, the prefetch on / off,
    the in-kernel merge, batch 16 to 256, the GEMVs, the prefill kernels and the argmax."""
    A, G, P, M = (mods[m] for m in ("decode_attention", "gemv", "fused_qkv_prep", "argmax"))
    PA, S = mods["paged_attention"], mods["store_kv"]
    bf = torch.bfloat16

    def model_cases(name, H, KVH, D, hid, inter):
        """One model shape's launches. (A function of its own, not a loop body: each thunk's closure must see
        its own model's shapes when it runs, after the loop; in the loop they all saw the last model's.)"""
        out = []

        def attn(B, dtype=bf, splits=None, kv_dtype=None, fold=False, **kw):
            def run():
                if fold:  # folded norms: the rows' rstd from the residual stream
                    kw["row_scale"] = (torch.zeros(B, hid, dtype=dtype), 1e-5)
                qkv = torch.zeros(B, (H + 2 * KVH) * D, dtype=dtype)
                kc = torch.zeros(64, 16, KVH, D, dtype=kv_dtype or dtype)
                vc = torch.zeros_like(kc)
                bt = torch.zeros(B, 40960 // 16, dtype=torch.int32)
                sl = torch.ones(B, dtype=torch.int32)
                pos = torch.zeros(B, dtype=torch.int64)
                cs = torch.zeros(40960, D, dtype=torch.float32)
                w = torch.ones(D, dtype=dtype)
                return A.decode_attention_with_prep_triton(qkv, H, KVH, D, pos, cs, D, True, kc, vc, pos, bt, sl,
                                                           D ** -0.5, splits, w, w, 1e-6, **kw)
            return run
        out += [(f"{name} attention b1 pdl (prefetch)", attn(1, pdl=True)),
                (f"{name} attention b1 pdl, no prefetch", attn(1, pdl=True, prefetch=False)),
                (f"{name} attention b1 no pdl", attn(1, pdl=False)),
                (f"{name} attention b1 pdl, in-kernel merge", attn(1, pdl=True, merge_in_kernel=True)),
                (f"{name} attention b1 fp32 pdl", attn(1, dtype=torch.float32, pdl=True)),
                (f"{name} attention b16 prefetch, no pdl", attn(16, pdl=False, prefetch=True)),
                (f"{name} attention b16", attn(16, pdl=False)),
                (f"{name} attention b256 (key rows)", attn(256, pdl=False)),
                (f"{name} attention b256, key rows off", attn(256, pdl=False, key_rows=False)),
                (f"{name} attention b1 pdl (prefetch), one split", attn(1, pdl=True, splits=1)),
                (f"{name} attention b1 no pdl, one split", attn(1, pdl=False, splits=1)),
                (f"{name} attention b16, one split", attn(16, pdl=False, splits=1)),
                (f"{name} attention b16, folded norms", attn(16, pdl=False, fold=True)),
                (f"{name} attention b64, folded norms", attn(64, pdl=False, fold=True)),
                (f"{name} attention b1 pdl (prefetch), folded norms", attn(1, pdl=True, fold=True)),
                (f"{name} attention b256 (key rows), folded norms", attn(256, pdl=False, fold=True))]
        f8 = torch.float8_e4m3fn
        out += [(f"{name} attention b1 pdl (prefetch), fp8 cache", attn(1, pdl=True, kv_dtype=f8)),
                (f"{name} attention b1 no pdl, fp8 cache", attn(1, pdl=False, kv_dtype=f8)),
                (f"{name} attention b16 mid tile, fp8 cache", attn(16, pdl=False, kv_dtype=f8)),
                (f"{name} attention b64 (key rows), fp8 cache", attn(64, pdl=False, kv_dtype=f8)),
                (f"{name} attention b256 (key rows), fp8 cache", attn(256, pdl=False, kv_dtype=f8)),
                (f"{name} attention b1 one split, fp8 cache", attn(1, pdl=False, splits=1, kv_dtype=f8))]

        def plain(B, pdl=False):
            def run():  # split-KV over a ready query (the unfused layers: qkv prep, then attention)
                kc = torch.zeros(64, 16, KVH, D, dtype=bf)
                return A.paged_decode_attention_triton(torch.zeros(B, H, D, dtype=bf), kc, torch.zeros_like(kc),
                                                       torch.zeros(B, 40960 // 16, dtype=torch.int32),
                                                       torch.ones(B, dtype=torch.int32), D ** -0.5, pdl=pdl)
            return run
        out += [(f"{name} attention b{B} over a ready query", plain(B)) for B in (1, 16, 256)]
        out.append((f"{name} attention b1 pdl over a ready query", plain(1, pdl=True)))

        def prefill(kv_dtype, max_query_len=None):
            def run():  # (max_query_len None: the 512 tokens bound it, so the short-query tiles)
                q = torch.zeros(512, H, D, dtype=bf)
                kc = torch.zeros(64, 16, KVH, D, dtype=kv_dtype)
                bt = torch.zeros(4, 32, dtype=torch.int32)
                sl = torch.full((4,), 128, dtype=torch.int32)
                qsl = torch.arange(0, 513, 128, dtype=torch.int32)
                return PA.paged_attention_triton(q, kc, torch.zeros_like(kc), bt, sl, qsl, D ** -0.5,
                                                 max_query_len=max_query_len)
            return run

        def store(kv_dtype):
            def run():
                k = torch.zeros(512, KVH, D, dtype=bf)
                kc = torch.zeros(64, 16, KVH, D, dtype=kv_dtype)
                return S.store_kv_triton(k, k, kc, torch.zeros_like(kc), torch.zeros(512, dtype=torch.int64))
            return run
        out += [(f"{name} prefill attention, {t}", prefill(dt)) for t, dt in (("bf16 cache", bf), ("fp8 cache", f8))]
        # A long prompt's tiles (a host max_query_len above paged_attention.SHORT_QUERY).
        out += [(f"{name} prefill attention, long-query tiles, {t}", prefill(dt, 2048))
                for t, dt in (("bf16 cache", bf), ("fp8 cache", f8))]
        out += [(f"{name} KV store, {t}", store(dt)) for t, dt in (("bf16 cache", bf), ("fp8 cache", f8))]

        def gemv(M_, N, K, silu=False, norm=False, res=False, add=False, **kw):
            def run():
                if add:  # folded norms: the residual add in the epilogue
                    kw["add_to"] = torch.zeros(M_, N, dtype=bf)
                x = torch.zeros(M_, K, dtype=bf)
                w = torch.zeros((2 * N if silu else N), K, dtype=bf)
                nw = torch.ones(K, dtype=bf) if norm else None
                return G.norm_gemv_triton(x, w, nw, x if res else None, 1e-6, silu, **kw)
            return run
        qkv_n = (H + 2 * KVH) * D
        for pdl in (True, False):
            out += [(f"{name} qkv GEMV pdl={pdl}", gemv(1, qkv_n, hid, norm=True, res=True, pdl=pdl)),
                    (f"{name} o_proj GEMV pdl={pdl}", gemv(1, hid, H * D, pdl=pdl)),
                    (f"{name} gate_up GEMV pdl={pdl}", gemv(1, inter, hid, silu=True, norm=True, res=True, pdl=pdl)),
                    (f"{name} down GEMV pdl={pdl}", gemv(1, hid, inter, pdl=pdl))]
        out += [(f"{name} qkv GEMV pdl, no peel", gemv(1, qkv_n, hid, norm=True, res=True, pdl=True, peel=False)),
                (f"{name} gate_up GEMV pdl, no peel",
                 gemv(1, inter, hid, silu=True, norm=True, res=True, pdl=True, peel=False)),
                (f"{name} qkv GEMV pdl, one-pass norm",
                 gemv(1, qkv_n, hid, norm=True, res=True, pdl=True, one_pass=True)),
                (f"{name} gate_up GEMV pdl, one-pass norm",
                 gemv(1, inter, hid, silu=True, norm=True, res=True, pdl=True, one_pass=True)),
                (f"{name} o_proj GEMM M=16", gemv(16, hid, H * D, pdl=False)),
                (f"{name} down GEMM M=16", gemv(16, hid, inter, pdl=False)),
                (f"{name} o_proj GEMM M=16, residual add", gemv(16, hid, H * D, pdl=False, add=True)),
                (f"{name} down GEMM M=16, residual add", gemv(16, hid, inter, pdl=False, add=True)),
                (f"{name} o_proj GEMM M=16 pdl, no peel, residual add",
                 gemv(16, hid, H * D, pdl=True, peel=False, add=True)),
                (f"{name} down GEMM M=16 pdl, no peel, residual add",
                 gemv(16, hid, inter, pdl=True, peel=False, add=True))]
        out.append((f"{name} o_proj GEMM M=64", gemv(64, hid, H * D, pdl=False)))
        # down_proj of 17-64 rows at its launch shape of its own (gemv.configs.WIDE_ROWS_SHAPES), residual add
        out += [(f"{name} down GEMM M={rows} wide-rows shape, residual add",
                 gemv(rows, hid, inter, pdl=False, add=True)) for rows in (64, 24)]
        # The norm's rstd applied after the loop (ONE_PASS, rows > 1): batch-16 qkv / gate_up.
        for pdl in (True, False):
            out += [(f"{name} qkv GEMM M=16 one-pass norm pdl={pdl}",
                     gemv(16, qkv_n, hid, norm=True, res=True, pdl=pdl)),
                    (f"{name} gate_up GEMM M=16 one-pass norm pdl={pdl}",
                     gemv(16, inter, hid, silu=True, norm=True, res=True, pdl=pdl))]

        def prep(pdl, kv_dtype=bf, tokens=4, fold=False):
            def run():
                qkv = torch.zeros(tokens, (H + 2 * KVH) * D, dtype=bf)
                kc = torch.zeros(8, 16, KVH, D, dtype=kv_dtype)
                pos = torch.zeros(tokens, dtype=torch.int64)
                w = torch.ones(D, dtype=bf)
                rs = (torch.zeros(tokens, hid, dtype=bf), 1e-5) if fold else None
                return P.qkv_prep_triton(qkv, H, KVH, D, pos, torch.zeros(64, D), D, True, kc, torch.zeros_like(kc),
                                         pos, w, w, 1e-6, pdl=pdl, row_scale=rs)
            return run
        out += [(f"{name} qkv prep pdl={p}", prep(p)) for p in (True, False)]
        out.append((f"{name} qkv prep, fp8 cache", prep(False, f8)))
        # A prefill's size: several heads per program (fused_qkv_prep.configs.heads_per_program).
        out.append((f"{name} qkv prep, 512-token prefill", prep(False, tokens=512)))
        out.append((f"{name} qkv prep, 512-token prefill, folded norms", prep(False, tokens=512, fold=True)))
        out.append((f"{name} qkv prep, folded norms", prep(False, fold=True)))
        Act = mods["activation"]
        for rows in (16, 8192):  # a decode batch (blocks spread over programs) and a prefill (a program per row)
            out.append((f"{name} SiLU-and-mul, folded norms, {rows} rows",
                        lambda r=rows: Act.silu_and_mul_triton(torch.zeros(r, 2 * inter, dtype=bf),
                                                               (torch.zeros(r, hid, dtype=bf), 1e-5))))
        return out

    out = []
    for name, shape in SHAPES.items():
        out += model_cases(name, *shape)
    out.append(("greedy argmax, Llama vocab", lambda: M.greedy_argmax_triton(torch.zeros(1, 128256))))
    out.append(("greedy argmax, bf16 Qwen vocab",
                lambda: M.greedy_argmax_triton(torch.zeros(16, 151936, dtype=torch.bfloat16))))
    S_ = mods["sampling"]
    for rows in (1, 64, 512):  # split rows (two launches) and, at 512 rows, one program per row
        out.append((f"gumbel draw, Llama vocab, {rows} rows",
                    lambda r=rows: S_.gumbel_argmax_triton(torch.zeros(r, 128256), torch.zeros(r, dtype=torch.int64),
                                                           torch.zeros(r, dtype=torch.int64))))
    out += deepseek_cases(mods)
    E = mods["embedding"]
    ids = torch.zeros(16, dtype=torch.int64)
    out.append(("embedding with pending tokens, Llama width",
                lambda: E.embedding_with_pending_triton(torch.zeros(1000, 4096, dtype=torch.bfloat16), ids,
                                                        ids, ids)))
    return out


def deepseek_cases(mods):
    """DeepSeek-V3.2's MLA launches at the real dims (128 heads, kv_lora_rank 512, rope 64, q_lora_rank 1536, 64 index
    heads of 128): the fused prep (kernels/mla_prep) at batch 1 under PDL and at an 8k-token prefill, the split-K
    decode under PDL, the tiled prefill, the expanded-form prefill."""
    P, A = mods["mla_prep"], mods["mla_attention"]
    bf = torch.bfloat16
    H, L, R, Q, NOPE, V, HI, DI = 128, 512, 64, 1536, 128, 128, 64, 128

    def kv_prep(T, pdl):
        y = torch.zeros(T, Q + DI + L + R, dtype=bf)  # fused_qkv_a_proj's output [q_a | wk | kv_a]
        pos = torch.zeros(T, dtype=torch.int64)
        ix = P.IndexKeyPrep(y[:, Q:Q + DI], torch.ones(DI, dtype=bf), torch.zeros(DI, dtype=bf), 1e-6,
                            torch.zeros(8, 64, 1, DI, dtype=bf))
        return P.mla_kv_prep_triton(y[:, Q + DI:], pos, torch.zeros(64, R), R, False, torch.ones(L, dtype=bf), 1e-6,
                                    torch.zeros(8, 64, 1, L + R, dtype=bf), pos, y[:, :Q], torch.ones(Q, dtype=bf),
                                    ix, pdl=pdl)

    def q_prep(T, pdl):
        y = torch.zeros(T, HI * DI + H * (NOPE + R), dtype=bf)  # fused_q_b_proj's output [wq_b | q_b]
        ix = P.IndexQueryPrep(y[:, :HI * DI].view(T, HI, DI), torch.zeros(T, HI), 0.01)
        w_kv_b = torch.zeros(H, NOPE + V, L, dtype=bf)
        return P.mla_q_prep_triton(y[:, HI * DI:].view(T, H, NOPE + R), torch.zeros(T, dtype=torch.int64),
                                   torch.zeros(64, R), R, False, w_kv_b[:, :NOPE], ix, pdl=pdl)

    def v_proj(T, pdl):
        w_kv_b = torch.zeros(H, NOPE + V, L, dtype=bf)
        return P.mla_v_proj_triton(torch.zeros(T, H, L, dtype=bf), w_kv_b[:, NOPE:], pdl=pdl)

    def decode():
        return A.mla_decode_triton(torch.zeros(1, H, L + R, dtype=bf), torch.zeros(8, 64, 1, L + R, dtype=bf),
                                   torch.zeros(1, 64, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.1, L, 4,
                                   pdl=True)

    def tiled_prefill():
        cache, bt = torch.zeros(64, 64, 1, L + R, dtype=bf), torch.zeros(4, 32, dtype=torch.int32)
        return A.mla_prefill_tiled_triton(torch.zeros(512, H, L + R, dtype=bf), cache, bt,
                                          torch.full((4,), 128, dtype=torch.int32),
                                          torch.arange(0, 513, 128, dtype=torch.int32), 0.1, L)
    def expanded_prefill():  # the expanded form: strided K_nope / V views of kv_b_proj's output, an 8k prompt
        T = 8192
        kv = torch.zeros(T, H, NOPE + V, dtype=bf)
        return A.mla_prefill_expanded_triton(torch.zeros(T, H, NOPE, dtype=bf), torch.zeros(T, H, R, dtype=bf),
                                             kv[..., :NOPE], torch.zeros(T, R, dtype=bf), kv[..., NOPE:],
                                             torch.tensor([0, T], dtype=torch.int32),
                                             torch.tensor([[0, T, 0]], dtype=torch.int32), 0.1)
    return [("deepseek MLA kv prep b1 pdl", lambda: kv_prep(1, True)),
            ("deepseek MLA kv prep, 8k-token prefill", lambda: kv_prep(8192, False)),
            ("deepseek MLA q prep b1 pdl", lambda: q_prep(1, True)),
            ("deepseek MLA q prep, 8k-token prefill", lambda: q_prep(8192, False)),
            ("deepseek MLA V projection b1 pdl", lambda: v_proj(1, True)),
            ("deepseek MLA V projection, 8k-token prefill", lambda: v_proj(8192, False)),
            ("deepseek MLA decode b1 pdl, 4 splits", decode),
            ("deepseek MLA tiled prefill", tiled_prefill),
            ("deepseek MLA expanded prefill, 8k-token prompt", expanded_prefill)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--smem-limit", type=int, default=232448, help="bytes of shared memory per block (H200)")
    p.add_argument("--sass", metavar="LABEL", help="only the launches whose label contains LABEL, with their SASS "
                   "loops' instruction counts")
    p.add_argument("--sass-dir", default="/tmp/gyrfalcon-sass", help="where --sass writes each kernel's SASS")
    args = p.parse_args(argv)
    try:
        mods, compiled = _harness(args.arch)
        todo = [(label, thunk) for label, thunk in cases(mods) if not args.sass or args.sass in label]
    except Exception:  # this Triton's internals differ: nothing checked
        traceback.print_exc()
        print("compile_check: the compile-only harness does not work with this Triton", file=sys.stderr)
        return 2
    failed = 0
    for label, thunk in todo:
        n0 = len(compiled)
        try:
            thunk()
        except Exception as e:  # a compile error: report it, go on with the rest
            failed += 1
            print(f"FAIL {label}: {type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}")
            if os.environ.get("COMPILE_CHECK_TRACEBACK"):
                traceback.print_exc()
            continue
        for i, (kname, smem, nw, res, kernel) in enumerate(compiled[n0:]):
            over = smem > args.smem_limit
            failed += over
            regs = f", {res['REG']} registers, {res.get('LOCAL', 0)} B local (spills)" if "REG" in res else ""
            print(f"{'FAIL' if over else 'ok  '} {label}: {kname} {smem / 1024:.0f} KB shared, {nw} warps{regs}")
            if args.sass:
                os.makedirs(args.sass_dir, exist_ok=True)
                out = os.path.join(args.sass_dir, f"{n0 + i}_{kname}.sass")
                for lo, hi, ops in sass_loops(kernel, out):
                    top = ", ".join(f"{op} {n}" for op, n in ops.most_common(12))
                    print(f"     loop 0x{lo:x}-0x{hi:x}: {sum(ops.values())} instructions; {top}")
    print(f"compile_check sm_{args.arch}: {len(todo)} launches, {len(compiled)} kernels compiled, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
