"""Decode attention with the qkv prep fused in: each split program normalizes and rotates its kv head's query group
itself (q/k RMSNorm, RoPE: fused_qkv_prep's jit helpers), and the split that holds the new token writes its K/V
into the cache before reading its keys back: one launch fewer per decode layer than fused_qkv_prep followed by
split_kv.py's kernel (faster at batch 1, 16 and 64 on the H200; docs/performance.md). Decode only: one query per
sequence, positions[i] = seq_lens[i] - 1."""

from __future__ import annotations

from gyrfalcon.kernels.common import HAS_TRITON, gdc_launch_dependents, gdc_wait, tl, triton

if HAS_TRITON:
    from gyrfalcon.kernels.decode_attention.reduce import _finish_split
    from gyrfalcon.kernels.decode_attention.tiles import _attend_tile, _kv_tile, _split_range
    from gyrfalcon.kernels.fused_qkv_prep.triton import _norm_rope_values, _norm_weights, _rope_tables
    from gyrfalcon.kernels.rms_norm.triton import _row_rstd

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
    def _decode_prep_kernel(
        qkv_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, o_ptr, pacc_ptr, pml_ptr, count_ptr,
        scale_log2, num_splits,
        s_qb, s_ob, s_oh,
        s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, s_bt,
        pos_ptr, cs_ptr, slot_ptr, qw_ptr, kw_ptr, s_cs, eps, xs_ptr, s_xs, eps_xs,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
        HEAD_DK: tl.constexpr, HEAD_DV: tl.constexpr,
        BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
        MIN_PART: tl.constexpr, DIRECT: tl.constexpr, MERGE_IN_KERNEL: tl.constexpr, DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
        NUM_HEADS: tl.constexpr, ROT: tl.constexpr, IS_NEOX: tl.constexpr,
        HAS_QW: tl.constexpr, HAS_KW: tl.constexpr, PREFETCH: tl.constexpr, GROUP_P2: tl.constexpr,
        K_ROWS: tl.constexpr, ROW_SCALE: tl.constexpr, HIDDEN: tl.constexpr,
        BLOCK_H: tl.constexpr, V_STAGE: tl.constexpr, Q16: tl.constexpr,
    ):
        """split_kv.py's kernel over this step's fused qkv rows [B, (NUM_HEADS + 2 * num_kv_heads) * HEAD_DK]
        (q heads | k heads | v heads, HEAD_DK = HEAD_DV) instead of a ready query.
        ROW_SCALE: the qkv row comes from a GEMM with the layer's input norm folded in, so the q / k / v values are
        first scaled by rstd of the sequence's row of xs (the residual stream, HIDDEN wide).
        PREFETCH: only the qkv row comes from the previous kernel. The step's inputs (seq_lens, positions, block
        tables, slots) were copied before the step began and the cached keys were written by earlier steps, so the
        first K/V tile, the RoPE tables and the norm weights load first (with PDL: before the wait, while the
        previous kernel finishes); the new token's slot, stale in that tile, is patched from registers (no store ->
        barrier -> reload round trip)."""
        if USE_PDL:
            gdc_launch_dependents()
            if not PREFETCH:
                gdc_wait()  # q and this step's K/V come from the previous kernel; every program waits
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + b)
        start, end, n_active = _split_range(seq_len, split, num_splits, BLOCK_N, MIN_PART)
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
        # q/k RMSNorm + RoPE happen here, and the split holding the new token (the last active one) writes its
        # K/V into the cache, so fused_qkv_prep's launch is not needed.
        dmask = dk < HEAD_DK
        row = qkv_ptr + b.to(tl.int64) * s_qb
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
                              HEAD_DK).to(qkv_ptr.dtype.element_ty)
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

        _finish_split(acc, m_i, l_i, o_ptr, pacc_ptr, pml_ptr, count_ptr, b, kvh, split, head, gmask, dv, n_active,
                      num_splits, s_ob, s_oh, GROUP, HEAD_DV, BLOCK_DV, BLOCK_S, GROUP_P2, DIRECT, MERGE_IN_KERNEL)
