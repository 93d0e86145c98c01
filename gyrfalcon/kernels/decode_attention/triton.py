"""Triton split-KV decode attention: the split kernel (plain, or with the fused qkv prep), the reduce kernel
and their launcher."""

from __future__ import annotations

import torch

from gyrfalcon.kernels.common import (HAS_TRITON, cdiv, gdc_launch_dependents, gdc_wait, interpreting, next_pow2,
                                      pdl_launch_kwargs, tl, triton, use_pdl)
from gyrfalcon.kernels.decode_attention.configs import (MID_TILE_CONFIG, REDUCE_WARPS, decode_config, default_min_part,
                                                        default_num_splits, k_rows, merge_in_kernel_default,
                                                        prefetch_default, v_staged, wide_tile_context)


_LOG2E = 1.4426950408889634


if HAS_TRITON:
    from gyrfalcon.kernels.fused_qkv_prep.triton import _norm_rope_values, _norm_weights, _rope_tables
    from gyrfalcon.kernels.rms_norm.triton import _row_rstd

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


def _merge_counters(device: torch.device) -> torch.Tensor:
    """Zeroed int32 arrival counters, one per (sequence, kv head), allocated once per device (outside
    any CUDA graph) and left at zero by every launch."""
    key = (device.type, device.index)
    if key not in _MERGE_COUNTERS:
        _MERGE_COUNTERS[key] = torch.zeros(_MAX_COUNTERS, dtype=torch.int32, device=device)
    return _MERGE_COUNTERS[key]


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
    bn, nw, ns = decode_config(max(dk, dv), n_seqs * n_kv, prefetch, fp8=k_cache.element_size() == 1,
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
