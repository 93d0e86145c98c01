"""Single-token decode attention over the paged KV cache.

q: [num_seqs, num_heads, head_dim], one query per sequence at position seq_lens[i] - 1;
k_cache: [num_blocks, block_size, num_kv_heads, head_dim]; v_cache: [..., head_dim_v];
block_tables: int32 [num_seqs, max_blocks_per_seq]; seq_lens: int32 [num_seqs] (0 = CUDA-graph padding
row: output zeros, read nothing). Returns o: [num_seqs, num_heads, head_dim_v] in q.dtype.

decode_attention_with_prep takes the fused qkv rows instead of q and does fused_qkv_prep's work in the
same launch (q/k RMSNorm, RoPE, this step's K/V into the cache): one launch fewer per decode layer (faster
at batch 1, 16 and 64 on the H200; docs/performance.md).
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels._common import (HAS_TRITON, cdiv, gdc_launch_dependents, gdc_wait, interpreting,
                                       max_shared_mem, next_pow2, pdl_launch_kwargs, sm_count, tl, triton, use_pdl,
                                       use_triton)
from gyrfalcon.kernels.fused_qkv_prep import qkv_prep_ref

_LOG2E = 1.4426950408889634


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Plain-torch decode attention, batched: gathers every sequence's blocks up to the longest
    context (padded, masked), so the CPU decode step is a handful of ops rather than a Python loop."""
    n_seqs, n_heads, _ = q.shape
    block_size, n_kv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(n_seqs, n_heads, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    if n_seqs == 0:
        return out
    lens = seq_lens.long()
    max_len = int(lens.max())
    if max_len == 0:
        return out
    n_blocks = -(-max_len // block_size)
    # Unused block-table entries may hold anything: clamp them into range; they are masked anyway.
    blocks = block_tables[:, :n_blocks].long().clamp(0, k_cache.shape[0] - 1)
    k = k_cache[blocks].flatten(1, 2)[:, :max_len].float()  # [B, S, Hkv, D]
    v = v_cache[blocks].flatten(1, 2)[:, :max_len].float()  # [B, S, Hkv, Dv]
    group = n_heads // n_kv
    qf = q.float().view(n_seqs, n_kv, group, -1)
    scores = torch.einsum("bhgd,bshd->bhgs", qf, k) * scale
    pad = torch.arange(max_len, device=q.device)[None, :] >= lens[:, None]  # [B, S]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # seq_len 0 rows: all -inf -> zeros
    o = torch.einsum("bhgs,bshd->bhgd", probs, v).reshape(n_seqs, n_heads, -1)
    return o.to(q.dtype)


if HAS_TRITON:
    from gyrfalcon.kernels.fused_qkv_prep import _norm_rope_values, _norm_weights, _rope_tables
    from gyrfalcon.kernels.rms_norm import _row_rstd

    @triton.jit
    def _kv_tile(kc_ptr, vc_ptr, bt_row, kstart, end, kvh, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, dk, dv,
                 BLOCK_SIZE: tl.constexpr, HEAD_DK: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                 K_ROWS: tl.constexpr = False):
        """BLOCK_N key positions kstart.. (< end) of one kv head: (kpos, kmask, K^T [BLOCK_DK, BLOCK_N],
        V [BLOCK_N, BLOCK_DV]), gathered through the block table row bt_row.
        K_ROWS: K loads as [BLOCK_N, BLOCK_DK] (the cache's layout, head dim contiguous, as V loads) and is
        transposed in registers, instead of loading the transposed tile directly (k_rows: the large-batch
        launches)."""
        kpos = kstart + tl.arange(0, BLOCK_N)
        kmask = kpos < end
        phys = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
        off = kpos % BLOCK_SIZE
        if K_ROWS:
            k = tl.trans(tl.load(kc_ptr + (phys * s_kb + off * s_ko + kvh * s_kh)[:, None] + dk[None, :],
                                 mask=kmask[:, None] & (dk[None, :] < HEAD_DK), other=0.0))
        else:
            k = tl.load(kc_ptr + (phys * s_kb + off * s_ko + kvh * s_kh)[None, :] + dk[:, None],
                        mask=kmask[None, :] & (dk[:, None] < HEAD_DK), other=0.0)
        v = tl.load(vc_ptr + (phys * s_vb + off * s_vo + kvh * s_vh)[:, None] + dv[None, :],
                    mask=kmask[:, None] & (dv[None, :] < HEAD_DV), other=0.0)
        return kpos, kmask, k, v

    @triton.jit
    def _pin_f16(x):
        """x unchanged, through an asm statement that Triton may not move (not pure): the fp16 values exist in
        x's own layout, so layout propagation cannot hoist the layout change above the widening (ptxas drops
        the mov). GPU only: the interpreter runs no PTX."""
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float16, is_pure=False, pack=2)

    @triton.jit
    def _attend_tile(q, k, v, kmask, m_i, l_i, acc, scale_log2, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                     V_STAGE: tl.constexpr = True, Q16: tl.constexpr = True):
        """One online-softmax step over a tile: q [BLOCK_G, BLOCK_DK], K^T [BLOCK_DK, BLOCK_N],
        V [BLOCK_N, BLOCK_DV] -> the new (m, l, acc); scores in log2 units. V_STAGE: an fp8 V tile widened before
        its layout change (v_staged)."""
        if k.dtype == tl.float8e4nv:
            # An fp8 cache: the tiles widen for the dots, to fp32 beside an fp32 query, else to fp16 with a 16-bit
            # query and the probabilities converted along. e4m3 to fp16 is one instruction a pair
            # (cvt.rn.f16x2.e4m3x2); to bf16 it took two more a pair (f16 -> bf16), 256 of them a 128-key tile
            # (sm_90 PTX via scripts/compile_check.py's harness). fp16 holds every e4m3 value exactly, and a bf16
            # query too between 2^-14 and 65504 in magnitude (fp16's normal range, 10-bit mantissa).
            # (Q16: the query's own dtype is 16-bit; under the interpreter, UPCAST, q is already fp32 here and
            # stays so, the tiles taking the fp16 path all the same before their upcast below.)
            if not Q16:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            else:
                k = k.to(tl.float16)
                v = v.to(tl.float16)
                if V_STAGE and not UPCAST:
                    # Pinned in its row layout: Triton then widens V there and stages it through shared memory
                    # as fp16 (ldmatrix), instead of loading the fp8 tile byte by byte in the dot's operand
                    # layout (128 ld.shared.b8 a 128-key tile on sm_90, and more registers). A tl.where on the
                    # key mask pinned it too, but cost a select and two byte permutes per value (1137 instructions
                    # a 128-key tile at Llama-8B's shape against 686 with the asm; scripts/compile_check.py --sass).
                    # K pinned the same way ran slower on the H200.
                    v = _pin_f16(v)
                if not UPCAST:
                    q = q.to(tl.float16)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PREC) * scale_log2
        s = tl.where(kmask[None, :], s, float("-inf"))
        # Every tile holds >= 1 valid key (kstart < end), so m_new is finite here.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(v.dtype)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
        return m_new, l_i, acc

    @triton.jit
    def _new_kv(row, kvh, d, partner, dmask, kwd, kwp, cos, sin, sign, rot, scale, eps, HAS_KW: tl.constexpr,
                NUM_HEADS: tl.constexpr, HEAD_D: tl.constexpr, K_DTYPE: tl.constexpr, V_DTYPE: tl.constexpr,
                ROW_SCALE: tl.constexpr):
        """This step's key (normed, rotated) [1, BLOCK_D] and value [BLOCK_D] of kv head kvh from the fused
        qkv row, in the cache dtypes (ROW_SCALE: both scaled by the row's rstd first, see _norm_rope)."""
        kcol = (NUM_HEADS + kvh) * HEAD_D
        kx = tl.load(row + kcol + d, mask=dmask, other=0.0)[None, :]
        kxp = tl.load(row + kcol + partner, mask=dmask, other=0.0)[None, :]
        vx = tl.load(row + (NUM_HEADS + tl.num_programs(1) + kvh) * HEAD_D + d, mask=dmask, other=0.0)
        knew = _norm_rope_values(kx, kxp, kwd, kwp, cos, sin, sign, rot, scale, eps, HAS_KW, HEAD_D).to(K_DTYPE)
        vnew = vx
        if ROW_SCALE:
            vnew = vx.to(tl.float32) * scale
        return knew, vnew.to(V_DTYPE)

    @triton.jit
    def _store_kv_slot(kc_ptr, vc_ptr, slot, kvh, knew, vnew, d, dmask, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh,
                       BLOCK_SIZE: tl.constexpr):
        """knew [1, BLOCK_D] / vnew [BLOCK_D] into cache slot `slot` of kv head kvh."""
        blk = slot // BLOCK_SIZE
        boff = slot % BLOCK_SIZE
        tl.store(kc_ptr + blk * s_kb + boff * s_ko + kvh * s_kh + d[None, :], knew, mask=dmask[None, :])
        tl.store(vc_ptr + blk * s_vb + boff * s_vo + kvh * s_vh + d, vnew, mask=dmask)

    @triton.jit
    def _decode_split_kernel(
        q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, o_ptr, pacc_ptr, pml_ptr, count_ptr,
        scale_log2, num_splits,
        s_qb, s_qh, s_ob, s_oh,
        s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, s_bt,
        pos_ptr, cs_ptr, slot_ptr, qw_ptr, kw_ptr, s_cs, eps, xs_ptr, s_xs, eps_xs,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
        HEAD_DK: tl.constexpr, HEAD_DV: tl.constexpr,
        BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
        MIN_PART: tl.constexpr, DIRECT: tl.constexpr, MERGE_IN_KERNEL: tl.constexpr, DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
        PREP: tl.constexpr, NUM_HEADS: tl.constexpr, ROT: tl.constexpr, IS_NEOX: tl.constexpr,
        HAS_QW: tl.constexpr, HAS_KW: tl.constexpr, PREFETCH: tl.constexpr = False, GROUP_P2: tl.constexpr = 1,
        K_ROWS: tl.constexpr = False, ROW_SCALE: tl.constexpr = False, HIDDEN: tl.constexpr = 1,
        BLOCK_H: tl.constexpr = 16, V_STAGE: tl.constexpr = True, Q16: tl.constexpr = True,
    ):
        # ROW_SCALE (with PREP): the qkv row comes from a GEMM with the layer's input norm folded in, so the
        # q / k / v values are first scaled by rstd of the sequence's row of xs (the residual stream, HIDDEN
        # wide: the layer's input norm folded into the qkv GEMM).
        # Grid: (num_seqs, num_kv_heads, num_splits). The GROUP query heads of one kv head form a
        # [BLOCK_G, head_dim] tile, so each K/V block is read from HBM once per kv head. Split s
        # covers context tokens [s * part, (s + 1) * part) of its sequence, part sized on the device
        # from seq_len (flash-decoding without a host sync; splits past the end are empty).
        # PREFETCH (with PREP): only the qkv row comes from the previous kernel. The step's inputs
        # (seq_lens, positions, block tables, slots) were copied before the step began and the cached
        # keys were written by earlier steps, so the first K/V tile, the RoPE tables and the norm weights
        # load first (with PDL: before the wait, while the previous kernel finishes); the new token's slot,
        # stale in that tile, is patched from registers (no store -> barrier -> reload round trip).
        if USE_PDL:
            gdc_launch_dependents()
            if not PREFETCH:
                gdc_wait()  # q and this step's K/V come from the previous kernel; every program waits
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + b)
        # At least MIN_PART keys per split (>= one tile; seq_len 0 would otherwise divide by zero below).
        part = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, MIN_PART)
        start = split * part
        end = tl.minimum(start + part, seq_len)
        n_active = tl.cdiv(seq_len, part)  # splits holding >= 1 key (0 for a padding row)
        if DIRECT or MERGE_IN_KERNEL:
            if split >= tl.maximum(n_active, 1):
                return  # empty split: nothing to write, and it does not count towards the merge
        else:
            if split >= n_active:
                # Empty split: the reduce kernel reads only the active ones. With PREFETCH it exits before
                # the PDL wait; the split holding the new token waits, which keeps "this kernel complete
                # => the previous one complete" true down the chain. A row with no keys at all (seq_len 0)
                # has no such split: its first program waits instead.
                if PREFETCH and USE_PDL:
                    if (n_active == 0) & (kvh == 0) & (split == 0):
                        gdc_wait()
                return

        g = tl.arange(0, BLOCK_G)
        head = kvh * GROUP + g
        gmask = g < GROUP
        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        bt_row = bt_ptr + b.to(tl.int64) * s_bt
        if PREFETCH:
            kpos0, kmask0, k0, v0 = _kv_tile(kc_ptr, vc_ptr, bt_row, start, end, kvh, s_kb, s_ko, s_kh,
                                             s_vb, s_vo, s_vh, dk, dv, BLOCK_SIZE, HEAD_DK, HEAD_DV, BLOCK_N, K_ROWS)
        if PREP:
            # q_ptr is this step's fused qkv row [q heads | k heads | v heads] (HEAD_DK = HEAD_DV):
            # q/k RMSNorm + RoPE happen here, and the split holding the new token (the last active
            # one) writes its K/V into the cache, so fused_qkv_prep's launch is not needed.
            dmask = dk < HEAD_DK
            row = q_ptr + b.to(tl.int64) * s_qb
            pos = tl.load(pos_ptr + b).to(tl.int64)
            slot = tl.load(slot_ptr + b).to(tl.int64)
            partner, cos, sin, sign, rot = _rope_tables(dk, dmask, cs_ptr + pos * s_cs, ROT, IS_NEOX)
            qwd, qwp = _norm_weights(qw_ptr, dk, partner, dmask, HAS_QW)
            kwd, kwp = _norm_weights(kw_ptr, dk, partner, dmask, HAS_KW)
            if PREFETCH and USE_PDL:
                gdc_wait()
            scale = 1.0
            if ROW_SCALE:
                scale = _row_rstd(xs_ptr + b.to(tl.int64) * s_xs, eps_xs, HIDDEN, BLOCK_H)
            qmask = gmask[:, None] & dmask[None, :]
            qx = tl.load(row + head[:, None] * HEAD_DK + dk[None, :], mask=qmask, other=0.0)
            qxp = tl.load(row + head[:, None] * HEAD_DK + partner[None, :], mask=qmask, other=0.0)
            # Rounded to the activation dtype, as the unfused path stores q before attention reads it.
            q = _norm_rope_values(qx, qxp, qwd, qwp, cos, sin, sign, rot, scale, eps, HAS_QW,
                                  HEAD_DK).to(q_ptr.dtype.element_ty)
            if PREFETCH:
                # Every program of the kv head computes the new K/V (one L2-resident row); only the
                # split holding the new token stores it, and patches it into whichever tile holds it.
                knew, vnew = _new_kv(row, kvh, dk, partner, dmask, kwd, kwp, cos, sin, sign, rot, scale, eps,
                                     HAS_KW, NUM_HEADS, HEAD_DK, kc_ptr.dtype.element_ty, vc_ptr.dtype.element_ty,
                                     ROW_SCALE)
                knew_t = tl.trans(knew)  # [BLOCK_DK, 1], the layout of a K^T tile
                if (split == n_active - 1) & (slot >= 0):
                    _store_kv_slot(kc_ptr, vc_ptr, slot, kvh, knew, vnew, dk, dmask, s_kb, s_ko, s_kh, s_vb, s_vo,
                                   s_vh, BLOCK_SIZE)
                new_pos = tl.where(slot >= 0, seq_len - 1, -1)
            elif split == n_active - 1:
                if slot >= 0:
                    knew, vnew = _new_kv(row, kvh, dk, partner, dmask, kwd, kwp, cos, sin, sign, rot, scale,
                                         eps, HAS_KW, NUM_HEADS, HEAD_DK, kc_ptr.dtype.element_ty,
                                         vc_ptr.dtype.element_ty, ROW_SCALE)
                    _store_kv_slot(kc_ptr, vc_ptr, slot, kvh, knew, vnew, dk, dmask, s_kb, s_ko, s_kh, s_vb, s_vo,
                                   s_vh, BLOCK_SIZE)
                    # The loop below reads this slot back: every thread's stores must be visible first.
                    tl.debug_barrier()
        else:
            q = tl.load(
                q_ptr + b * s_qb + head[:, None] * s_qh + dk[None, :],
                mask=gmask[:, None] & (dk[None, :] < HEAD_DK), other=0.0,
            )

        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
        loop_start = start
        if PREFETCH:
            if start < end:  # not a DIRECT launch's padding row (seq_len 0): those attend to nothing
                k0 = tl.where((kpos0 == new_pos)[None, :], knew_t, k0)
                v0 = tl.where((kpos0 == new_pos)[:, None], vnew[None, :], v0)
                m_i, l_i, acc = _attend_tile(q, k0, v0, kmask0, m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST,
                                             V_STAGE, Q16)
            loop_start = start + BLOCK_N
        for kstart in range(loop_start, end, BLOCK_N):
            kpos, kmask, k, v = _kv_tile(kc_ptr, vc_ptr, bt_row, kstart, end, kvh, s_kb, s_ko, s_kh,
                                         s_vb, s_vo, s_vh, dk, dv, BLOCK_SIZE, HEAD_DK, HEAD_DV, BLOCK_N, K_ROWS)
            if PREFETCH:
                k = tl.where((kpos == new_pos)[None, :], knew_t, k)
                v = tl.where((kpos == new_pos)[:, None], vnew[None, :], v)
            m_i, l_i, acc = _attend_tile(q, k, v, kmask, m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST, V_STAGE,
                                         Q16)

        if DIRECT:
            # One split: normalize here and skip the reduce launch. seq_len 0 -> l = 0 -> zeros.
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            tl.store(
                o_ptr + b * s_ob + head[:, None] * s_oh + dv[None, :],
                (acc / l_safe[:, None]).to(o_ptr.dtype.element_ty),
                mask=gmask[:, None] & (dv[None, :] < HEAD_DV),
            )
        elif MERGE_IN_KERNEL and n_active <= 1:
            # The only non-empty split (or a padding row): write the output directly, as DIRECT does.
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            tl.store(
                o_ptr + b * s_ob + head[:, None] * s_oh + dv[None, :],
                (acc / l_safe[:, None]).to(o_ptr.dtype.element_ty),
                mask=gmask[:, None] & (dv[None, :] < HEAD_DV),
            )
        else:
            # Partials: acc [B, H, S, BLOCK_DV] unnormalized, (m, l) [B, H, S, 2]; fp32.
            prow = (b * (tl.num_programs(1) * GROUP) + head) * num_splits + split
            tl.store(pacc_ptr + prow[:, None] * BLOCK_DV + dv[None, :], acc, mask=gmask[:, None])
            tl.store(pml_ptr + prow * 2, m_i, mask=gmask)
            tl.store(pml_ptr + prow * 2 + 1, l_i, mask=gmask)
            if MERGE_IN_KERNEL:
                # The last split of (sequence, kv head) to finish merges all of them: one launch instead
                # of two. Every thread's partial stores are done (barrier) before the release atomic;
                # the merging program reads the others' partials through L2 (.cg), after the acquire.
                tl.debug_barrier()
                cnt_ptr = count_ptr + b * tl.num_programs(1) + kvh
                done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
                if done == n_active - 1:
                    tl.atomic_xchg(cnt_ptr, 0)  # ready for the next launch (or graph replay)
                    # The group's heads and all splits at once ([GROUP_P2, BLOCK_S(, BLOCK_DV)] tiles): one
                    # round trip through L2; a loop over heads or splits is a chain of them (slower than a
                    # second launch at long contexts).
                    g2 = tl.arange(0, GROUP_P2)
                    sp = tl.arange(0, BLOCK_S)
                    m2 = (g2 < GROUP)[:, None] & (sp < n_active)[None, :]
                    hrow = ((b * tl.num_programs(1) + kvh) * GROUP + g2)[:, None] * num_splits + sp[None, :]
                    m_s = tl.load(pml_ptr + hrow * 2, mask=m2, other=float("-inf"), cache_modifier=".cg")
                    l_s = tl.load(pml_ptr + hrow * 2 + 1, mask=m2, other=0.0, cache_modifier=".cg")
                    a_s = tl.load(pacc_ptr + hrow[:, :, None] * BLOCK_DV + dv[None, None, :], mask=m2[:, :, None],
                                  other=0.0, cache_modifier=".cg")
                    m_max = tl.max(m_s, axis=1)
                    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
                    w_s = tl.where(m2, tl.math.exp2(m_s - m_max[:, None]), 0.0)
                    l_tot = tl.sum(w_s * l_s, axis=1)
                    o_g = tl.sum(a_s * w_s[:, :, None], axis=1) / tl.where(l_tot == 0.0, 1.0, l_tot)[:, None]
                    tl.store(o_ptr + b * s_ob + (kvh * GROUP + g2)[:, None] * s_oh + dv[None, :],
                             o_g.to(o_ptr.dtype.element_ty), mask=(g2 < GROUP)[:, None] & (dv[None, :] < HEAD_DV))

    @triton.jit
    def _decode_reduce_kernel(
        pacc_ptr, pml_ptr, o_ptr, seq_lens_ptr, num_splits, n_heads, s_ob, s_oh,
        HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
        MIN_PART: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        # Grid: (num_seqs, num_heads). Log-sum-exp merge of the splits' partial softmaxes: only the
        # splits that held keys (the split kernel's own arithmetic; empty ones wrote nothing).
        b = tl.program_id(0)
        h = tl.program_id(1)
        seq_len = tl.load(seq_lens_ptr + b)  # a step input: loads before the wait
        part = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, MIN_PART)
        if USE_PDL:
            gdc_launch_dependents()
            gdc_wait()  # the partials are the split kernel's output
        sp = tl.arange(0, BLOCK_S)
        smask = sp < tl.cdiv(seq_len, part)
        row = (b * n_heads + h) * num_splits + sp
        m = tl.load(pml_ptr + row * 2, mask=smask, other=float("-inf"))
        l = tl.load(pml_ptr + row * 2 + 1, mask=smask, other=0.0)
        m_max = tl.max(m, axis=0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # empty sequence: all splits empty
        w = tl.math.exp2(m - m_max)
        w = tl.where(smask, w, 0.0)
        l_tot = tl.sum(w * l, axis=0)
        dv = tl.arange(0, BLOCK_DV)
        acc = tl.load(pacc_ptr + row[:, None] * BLOCK_DV + dv[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0)
        out = out / tl.where(l_tot == 0.0, 1.0, l_tot)
        tl.store(o_ptr + b * s_ob + h * s_oh + dv, out.to(o_ptr.dtype.element_ty), mask=dv < HEAD_DV)


_MERGE_COUNTERS: dict = {}
_MAX_COUNTERS = 1 << 16  # (sequence, kv head) pairs one launch may merge in-kernel
MERGE_IN_KERNEL_MIN_SEQS = 8  # batch from which the splits merge in-kernel by default (merge_in_kernel_default)
_SMALL_LAUNCH_PROGRAMS = 128  # (sequence, kv head) programs up to which the launch uses 128-key tiles


def _merge_counters(device: torch.device) -> torch.Tensor:
    """Zeroed int32 arrival counters, one per (sequence, kv head), allocated once per device (outside
    any CUDA graph) and left at zero by every launch."""
    key = (device.type, device.index)
    if key not in _MERGE_COUNTERS:
        _MERGE_COUNTERS[key] = torch.zeros(_MAX_COUNTERS, dtype=torch.int32, device=device)
    return _MERGE_COUNTERS[key]


def _sm_count(device: torch.device) -> int:
    """The device's SMs (16 off CUDA); scripts/compile_check.py and startup_compiles.py patch it to the H200's."""
    return sm_count(device, 16)


MAX_SPLITS = 16


def prefetch_default(pdl: bool) -> bool:
    """Whether decode attention with prep loads its first K/V tile before the qkv row: with PDL, where those
    loads overlap the previous kernel's tail (the batch-1 graphs). Without PDL it was slower (the tile's
    registers held across the prep)."""
    return pdl


def default_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Splits per sequence from shapes only (CUDA-graph safe): enough programs to fill the GPU about
    twice over, but at least ~256 context tokens per split, rounded to a power of two to bound the
    number of compiled variants, and at most MAX_SPLITS. max_context is an upper bound (e.g.
    block-table width * block_size: under a CUDA graph, max_model_len), so most of the grid is empty
    splits at short contexts; each costs a block launch, which is why the grid stays small (a 64-split grid
    was ~1.5x slower than 4-8 splits at batch 1 with 128-512 tokens on the H200)."""
    want = cdiv(2 * _sm_count(device), max(1, num_seqs * num_kv_heads))
    want = min(want, cdiv(max(1, max_context), 256), MAX_SPLITS)
    return min(MAX_SPLITS, next_pow2(max(1, want)))


SHORT_SPLIT_TOKENS = 256  # keys a split covers at least in batched launches (default_min_part)


def default_min_part(programs: int, prefetch: bool, mid_tile: bool = False) -> int:
    """Least keys one split covers when the caller does not say (0: one tile). SHORT_SPLIT_TOKENS for launches
    of at least _SMALL_LAUNCH_PROGRAMS (sequence, kv head) programs without the prefetch (batch 16 and up at 8
    kv heads: the batched decode graphs), else one tile. The decode graphs size the split count from
    max_model_len (default_num_splits: 4 at batch 16), so at 129-256 tokens 2 splits of one 128-key tile each
    would hold keys and merge; with 256-key splits one program holds them all and writes its output directly.
    mid_tile: the launch runs MID_TILE_CONFIG at up to _SMALL_LAUNCH_PROGRAMS programs (the batch 8 / 16 main
    graphs, whose contexts of up to 256 tokens replay the one-split graphs): one-tile splits, faster there at
    320-600 tokens than 256-key ones."""
    if mid_tile and programs <= _SMALL_LAUNCH_PROGRAMS:
        return 0
    return SHORT_SPLIT_TOKENS if programs >= _SMALL_LAUNCH_PROGRAMS and not prefetch else 0


def v_staged() -> bool:
    """Whether an fp8 cache's V tile widens to fp16 in its row layout and is staged through shared memory for the
    dot (the kernel's V_STAGE; 15% faster than widening it in the dot's operand layout at Llama-8B's shape, batch
    256). The pin (_pin_f16) is PTX: off on ROCm builds."""
    return getattr(torch.version, "hip", None) is None


def k_rows(programs: int, prefetch: bool = False) -> bool:
    """Whether key tiles load in the cache's row layout ([keys, head_dim], as V loads) and are transposed in
    registers (_kv_tile's K_ROWS) instead of loading the transposed tile directly: for the 64-key-tile launches
    of many programs without the prefetch (with 2 stages, _decode_config), 3-4% faster at batch 64 / 256 with
    1-2k tokens of context on the H200."""
    return programs > _SMALL_LAUNCH_PROGRAMS and not prefetch


def merge_in_kernel_default(n_seqs: int) -> bool:
    """Whether the last split program to finish merges the splits (no reduce launch) when the caller does not
    say: from MERGE_IN_KERNEL_MIN_SEQS sequences. At batch 1-4 the reduce launch was faster (the merging
    program's extra round trips through L2 cost more than the launch they save)."""
    return n_seqs >= MERGE_IN_KERNEL_MIN_SEQS


_FP8_WIDE_TILE_PROGRAMS = 1024  # fp8 launches of more (sequence, kv head) programs: 128-key tiles (_decode_config)


# Keys a tile of the prefetching (batch-1, PDL) launch when it splits the context (_decode_config).
B1_SPLIT_TILE = 64


# The fused-prep launch of a 2-byte cache in one split at (WIDE_TILE_MIN_PROGRAMS, _SMALL_LAUNCH_PROGRAMS] programs
# (batch 5-16 at 8 kv heads: the one-split graphs, wide_tile_context): one stage of 256-key tiles at 8 warps
# (_decode_config). Two stages would need 256 KB of shared memory.
WIDE_TILE_CONFIG = (256, 8, 1)
WIDE_TILE_SHARED = 140 * 1024  # shared memory a program may need for it (sm_90 code: 132 KB) -> max_shared_mem
WIDE_TILE_MIN_PROGRAMS = _SMALL_LAUNCH_PROGRAMS // 4  # (sequence, kv head) programs above which it may be taken


# The split launch of (WIDE_TILE_MIN_PROGRAMS, _SMALL_LAUNCH_PROGRAMS] programs (the batch 8 / 16 main decode graphs
# at 8 kv heads) without the prefetch, on a 2-byte or an fp8 cache: 64-key tiles, 4 warps, 2 stages (_decode_config).
MID_TILE_CONFIG = (64, 4, 2)


def wide_tile_context(programs: int, element_size: int, device: torch.device) -> int:
    """Tokens of context up to which a one-split launch of `programs` (sequence, kv head) programs with the fused
    prep on a cache of element_size bytes runs WIDE_TILE_CONFIG (one tile holds the whole context), 0 where it
    never does (_decode_config's rule: 33-128 programs, a 2-byte cache, no prefetch, a card with WIDE_TILE_SHARED
    of shared memory a program). The decode graphs capture a one-split graph of such sizes for these contexts
    (cuda_graph.CudaGraphRunner); the main graph keeps its splits, which won from 320 tokens on."""
    ok = (WIDE_TILE_MIN_PROGRAMS < programs <= _SMALL_LAUNCH_PROGRAMS and element_size == 2
          and max_shared_mem(device) >= WIDE_TILE_SHARED)
    return WIDE_TILE_CONFIG[0] if ok else 0


def _decode_config(head_dim: int, programs: int, prefetch: bool = False, fp8: bool = False,
                   one_split: bool = False, wide_tile: bool = False):
    """(BLOCK_N keys per tile, num_warps, num_stages) from shapes only (no autotune under graphs); programs =
    sequences * kv heads. Chosen by sweeps on the H200 at 8 kv heads, head_dim 128 (docs/performance.md):
    - up to 128 programs (batch 16): 128-key tiles, 4 warps, 3 stages; 8 warps with the prefetch (its first
      tile held in registers across the qkv prep);
    - one_split (the caller asked for one split: the short graphs, a whole context in one program) with
      wide_tile (the fused prep on a 2-byte cache; an fp32 cache's 256-key tiles need 270 KB of shared memory)
      at 33-128 programs: WIDE_TILE_CONFIG, one tile for contexts of up to 256 tokens (~25% faster there; past
      one tile it lost, hence only the one-split graphs take it);
    - the prefetching launch that splits the context: B1_SPLIT_TILE-key tiles at 8 warps, so that twice the
      splits hold keys, each with one prefetched tile, and less of the work follows the PDL wait; the one-split
      launch keeps 128-key tiles (a second tile would load after the wait);
    - the split launch at 33-128 programs without the prefetch (the batch 8 / 16 main graphs): MID_TILE_CONFIG
      (38 KB of shared memory and ~85 registers a thread against 72 KB and 130 for 128-key tiles: 5 programs an
      SM instead of 3);
    - many programs: 64-key tiles (2 stages with key tiles in row layout, k_rows); an fp8 cache over more than
      1024 programs (batch 256): 128-key tiles with 3 stages."""
    if head_dim <= 128:
        if programs <= _SMALL_LAUNCH_PROGRAMS:
            if wide_tile and one_split and not prefetch and not fp8 and programs > WIDE_TILE_MIN_PROGRAMS:
                return WIDE_TILE_CONFIG
            if prefetch and not one_split:
                return B1_SPLIT_TILE, 8, 3
            if not prefetch and not one_split and programs > WIDE_TILE_MIN_PROGRAMS:
                return MID_TILE_CONFIG
            return 128, (8 if prefetch else 4), 3
        if fp8 and not prefetch and programs > _FP8_WIDE_TILE_PROGRAMS:
            return 128, 4, 3
        return 64, (8 if prefetch else 4), (2 if k_rows(programs, prefetch) else 3)
    return 32, 4, 3


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    merge_in_kernel: bool | None = None,
    min_part: int | None = None,
    pdl: bool | None = None,
    key_rows: bool | None = None,
) -> torch.Tensor:
    """Triton split-KV decode attention; same contract as paged_decode_attention_ref.

    No host syncs, buffers sized from shapes, so it can be captured in a CUDA graph. num_splits=None
    picks default_num_splits from the batch shape and the block-table width. block_n / num_warps /
    num_stages override the launch config (tests and benchmark sweeps). Each split covers at least
    min_part keys (and one tile; None: default_min_part). merge_in_kernel=True lets the last split program to
    finish merge the splits instead of a second launch; None: merge_in_kernel_default(batch), on from 8
    sequences. key_rows: force the key tiles' row layout on or off (default k_rows).
    """
    assert q.dim() == 3 and q.stride(-1) == 1
    return _launch(q, q.shape[1], k_cache, v_cache, block_tables, seq_lens, scale, num_splits, None,
                   block_n=block_n, num_warps=num_warps, num_stages=num_stages, merge_in_kernel=merge_in_kernel,
                   min_part=min_part, pdl=pdl, key_rows=key_rows)


REDUCE_WARPS = 4  # warps of the split-merge (reduce) launch


def _launch(q, n_heads, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, prep, *, block_n=None,
            num_warps=None, num_stages=None, merge_in_kernel=None, min_part=None, pdl=None, prefetch=None,
            key_rows=None):
    """The split (+ reduce) launch. q: [B, n_heads, dk] queries, or with prep the fused qkv rows
    [B, (n_heads + 2 * n_kv) * dk] and prep = (positions, cos_sin_cache, rotary_dim, is_neox, slot_mapping,
    q_norm_weight, k_norm_weight, eps, row_scale (None, or (x [B, hidden], eps): qkv_prep_ref)).
    prefetch (prep only; default prefetch_default(pdl)): the first K/V tile loads before the qkv row. key_rows
    (default k_rows(...)): key tiles load in row layout (the kernel's K_ROWS; tests force it at small shapes)."""
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    n_seqs = q.shape[0]
    dk = k_cache.shape[-1]
    n_kv = k_cache.shape[2]
    dv = v_cache.shape[-1]
    assert n_heads % n_kv == 0, "num_heads must be a multiple of num_kv_heads"
    group = n_heads // n_kv
    o = torch.empty(n_seqs, n_heads, dv, dtype=q.dtype, device=q.device)
    if n_seqs == 0:
        return o
    block_size = k_cache.shape[1]
    pdl = use_pdl(q) if pdl is None else pdl
    # Prefetch keeps a K and a V tile live across the prep; with fp32 caches that outgrows shared memory
    # once the loop is software-pipelined (270 KB of 227 KB on the H200), so it is not the default there.
    if prefetch is None:
        prefetch = prefetch_default(pdl) and k_cache.element_size() <= 2
    prefetch = prefetch and prep is not None
    bn, nw, ns = _decode_config(max(dk, dv), n_seqs * n_kv, prefetch, fp8=k_cache.element_size() == 1,
                                one_split=num_splits == 1,
                                wide_tile=(prep is not None
                                           and wide_tile_context(n_seqs * n_kv, k_cache.element_size(), q.device) > 0))
    bn, nw, ns = max(16, block_n or bn), num_warps or nw, num_stages or ns
    if num_splits is None:
        num_splits = default_num_splits(n_seqs, n_kv, block_tables.shape[1] * block_size, q.device)
    num_splits = max(1, int(num_splits))
    block_dv = max(16, next_pow2(dv))
    direct = num_splits == 1
    if merge_in_kernel is None:
        merge_in_kernel = merge_in_kernel_default(n_seqs)
    merge_in_kernel = merge_in_kernel and not direct and n_seqs * n_kv <= _MAX_COUNTERS
    if min_part is None:
        # mid_tile by launch shape: a shape forced to MID_TILE_CONFIG (block_n) splits the same way
        min_part = default_min_part(n_seqs * n_kv, prefetch, mid_tile=(bn, nw, ns) == MID_TILE_CONFIG)
    min_part_ = max(bn, cdiv(min_part, bn) * bn)
    counters = _merge_counters(q.device) if merge_in_kernel else o
    if direct:
        pacc = pml = o  # unused
    else:
        pacc = torch.empty(n_seqs * n_heads * num_splits, block_dv, dtype=torch.float32, device=q.device)
        pml = torch.empty(n_seqs * n_heads * num_splits, 2, dtype=torch.float32, device=q.device)
    row_scale = None
    if prep is None:
        pos = cs = slot = qw = kw = q  # valid pointers, never read
        s_cs, eps, rot_dim, neox = 0, 0.0, 0, True
        s_qb, s_qh = q.stride(0), q.stride(1)
    else:
        pos, cs, rot_dim, neox, slot, qw, kw, eps, row_scale = prep
        assert dk == dv and q.stride(-1) == 1 and cs.stride(-1) == 1
        assert q.shape[1] == (n_heads + 2 * n_kv) * dk, "qkv rows must be [q heads | k heads | v heads]"
        s_cs, s_qb, s_qh = cs.stride(0), q.stride(0), dk
        qw = q if qw is None else qw
        kw = q if kw is None else kw
    xs, eps_xs = row_scale if row_scale is not None else (q, 0.0)
    assert xs.stride(-1) == 1
    _decode_split_kernel[(n_seqs, n_kv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, o, pacc, pml, counters,
        float(scale) * _LOG2E, num_splits,
        s_qb, s_qh, o.stride(0), o.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        pos, cs, slot, qw, kw, s_cs, float(eps), xs, xs.stride(0), float(eps_xs),
        BLOCK_SIZE=block_size, GROUP=group, BLOCK_G=max(16, next_pow2(group)),
        HEAD_DK=dk, HEAD_DV=dv, BLOCK_DK=max(16, next_pow2(dk)), BLOCK_DV=block_dv, BLOCK_N=bn,
        BLOCK_S=next_pow2(num_splits), MIN_PART=min_part_,
        DIRECT=direct, MERGE_IN_KERNEL=merge_in_kernel,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=interpreting(),
        USE_PDL=pdl,
        PREP=prep is not None, NUM_HEADS=n_heads, ROT=int(rot_dim), IS_NEOX=bool(neox),
        HAS_QW=prep is not None and prep[5] is not None, HAS_KW=prep is not None and prep[6] is not None,
        PREFETCH=prefetch, GROUP_P2=next_pow2(group), K_ROWS=k_rows(n_seqs * n_kv, prefetch) if key_rows is None else key_rows,
        ROW_SCALE=row_scale is not None, HIDDEN=xs.shape[-1] if row_scale is not None else 1,
        BLOCK_H=min(1024, max(16, next_pow2(xs.shape[-1]))) if row_scale is not None else 16,
        V_STAGE=v_staged(), Q16=q.element_size() == 2,
        num_warps=nw, num_stages=ns,
        **pdl_launch_kwargs(pdl),
    )
    if not direct and not merge_in_kernel:
        _decode_reduce_kernel[(n_seqs, n_heads)](
            pacc, pml, o, seq_lens, num_splits, n_heads, o.stride(0), o.stride(1),
            HEAD_DV=dv, BLOCK_DV=block_dv, BLOCK_S=next_pow2(num_splits), BLOCK_N=bn, MIN_PART=min_part_,
            USE_PDL=pdl, num_warps=REDUCE_WARPS, **pdl_launch_kwargs(pdl),
        )
    return o


def decode_attention_with_prep_ref(qkv, num_heads, num_kv_heads, head_dim, positions, cos_sin_cache, rotary_dim,
                                   is_neox, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale,
                                   num_splits=None, q_norm_weight=None, k_norm_weight=None, eps=1e-6,
                                   row_scale=None):
    """The unfused composition: qkv_prep (norms, RoPE, K/V into the cache), then decode attention.
    row_scale: see qkv_prep_ref (folded input norm)."""
    q = qkv_prep_ref(qkv, num_heads, num_kv_heads, head_dim, positions, cos_sin_cache, rotary_dim, is_neox,
                     k_cache, v_cache, slot_mapping, q_norm_weight, k_norm_weight, eps, row_scale=row_scale)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits)


def decode_attention_with_prep_triton(qkv, num_heads, num_kv_heads, head_dim, positions, cos_sin_cache,
                                      rotary_dim, is_neox, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                                      scale, num_splits=None, q_norm_weight=None, k_norm_weight=None, eps=1e-6,
                                      row_scale=None, **launch):
    """fused_qkv_prep and decode attention in one split launch (+ the reduce): each split program
    normalizes and rotates its kv head's query group itself, and the split that holds the new token
    writes its K/V into the cache before reading its keys back. Decode only (one query per sequence,
    positions[i] = seq_lens[i] - 1). launch: paged_decode_attention_triton's keyword overrides."""
    assert qkv.dim() == 2 and k_cache.shape[2] == num_kv_heads and k_cache.shape[-1] == head_dim
    prep = (positions, cos_sin_cache, rotary_dim, is_neox, slot_mapping, q_norm_weight, k_norm_weight, eps,
            row_scale)
    return _launch(qkv, num_heads, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, prep, **launch)


def decode_attention_with_prep(*args, **kw) -> torch.Tensor:
    """-> o [num_seqs, num_heads, head_dim]; the arguments of decode_attention_with_prep_ref."""
    fn = decode_attention_with_prep_triton if use_triton(args[0]) else decode_attention_with_prep_ref
    return fn(*args, **kw)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention -> o [num_seqs, num_heads, head_dim_v]; see module docstring."""
    args = (q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits)
    if use_triton(q):
        return paged_decode_attention_triton(*args)
    return paged_decode_attention_ref(*args)
