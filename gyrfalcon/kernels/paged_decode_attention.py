"""Single-token decode attention over the paged KV cache.

q: [num_seqs, num_heads, head_dim], one query per sequence at position seq_lens[i] - 1;
k_cache: [num_blocks, block_size, num_kv_heads, head_dim]; v_cache: [..., head_dim_v];
block_tables: int32 [num_seqs, max_blocks_per_seq]; seq_lens: int32 [num_seqs] (0 = CUDA-graph padding
row: output zeros, read nothing). Returns o: [num_seqs, num_heads, head_dim_v] in q.dtype.

decode_attention_with_prep takes the fused qkv rows instead of q and does fused_qkv_prep's work in the
same launch (q/k RMSNorm, RoPE, this step's K/V into the cache): one launch fewer per decode layer. On the
H200 (benchmarks/results/*-h200-2026-11-30-run9/10.json) the Qwen3-0.6B batch-1 graph went from 0.756 to
0.729 ms per step, Llama-3.1-8B from 2998 to 3029 output tok/s at batch 16 and 9100 to 9164 at batch 64.
"""

from __future__ import annotations

import os
from typing import NamedTuple

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
    from gyrfalcon.kernels.fused_qkv_prep import _norm_rope_values, _norm_weights, _rope_pairs, _rope_tables
    from gyrfalcon.kernels.rms_norm import _row_rstd

    @triton.jit
    def _kv_tile(kc_ptr, vc_ptr, bt_row, s_bt_blk, kstart, end, kvh, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, dk, dv,
                 BLOCK_SIZE: tl.constexpr, HEAD_DK: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                 K_ROWS: tl.constexpr = False):
        """BLOCK_N key positions kstart.. (< end) of one kv head: (kpos, kmask, K^T [BLOCK_DK, BLOCK_N],
        V [BLOCK_N, BLOCK_DV]), gathered through the block table row bt_row, whose entries are s_bt_blk apart
        (1 in a row-major table; GYRFALCON_DECODE_BT_COLUMNS=1 makes the decode graphs' table column-major, see
        cuda_graph.DecodeInputs).
        K_ROWS: K loads as [BLOCK_N, BLOCK_DK] (the cache's layout, head dim contiguous, as V loads) and is
        transposed in registers, instead of loading the transposed tile directly (k_rows: the large-batch
        launches)."""
        kpos = kstart + tl.arange(0, BLOCK_N)
        kmask = kpos < end
        phys = tl.load(bt_row + (kpos // BLOCK_SIZE) * s_bt_blk, mask=kmask, other=0).to(tl.int64)
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
        its layout change (fp8_v_staged)."""
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
                    # layout (128 ld.shared.b8 a 128-key tile on sm_90; 198 registers a thread, 145 pinned).
                    # A tl.where on the key mask pinned it too, but cost a select and two byte permutes per
                    # value: 1137 instructions a 128-key tile (Llama-8B shape, batch 256) against 686 with
                    # the asm (sm_90 SASS through scripts/compile_check.py's harness). fp8_v_staged.
                    # K pinned and staged the same way cut the loop to 654 instructions from 692 but ran 24-39%
                    # slower (H200 run 56, decode_attn_tput_fp8_kstaged_ab-h200-2026-12-01-run56.json: batch 256,
                    # 2048 tokens 513.9 vs 369.6 us) and was removed.
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
        kx, kxp, vx = _new_kv_loads(row, kvh, d, partner, dmask, NUM_HEADS, HEAD_D)
        return _new_kv_values(kx, kxp, vx, kwd, kwp, cos, sin, sign, rot, scale, eps, HAS_KW, HEAD_D, K_DTYPE,
                              V_DTYPE, ROW_SCALE)

    @triton.jit
    def _new_kv_loads(row, kvh, d, partner, dmask, NUM_HEADS: tl.constexpr, HEAD_D: tl.constexpr):
        """_new_kv's loads from the fused qkv row: kv head kvh's key at dims d and at their RoPE partners
        [1, BLOCK_D] each, and its value [BLOCK_D]."""
        kcol = (NUM_HEADS + kvh) * HEAD_D
        kx = tl.load(row + kcol + d, mask=dmask, other=0.0)[None, :]
        kxp = tl.load(row + kcol + partner, mask=dmask, other=0.0)[None, :]
        vx = tl.load(row + (NUM_HEADS + tl.num_programs(1) + kvh) * HEAD_D + d, mask=dmask, other=0.0)
        return kx, kxp, vx

    @triton.jit
    def _new_kv_values(kx, kxp, vx, kwd, kwp, cos, sin, sign, rot, scale, eps, HAS_KW: tl.constexpr,
                       HEAD_D: tl.constexpr, K_DTYPE: tl.constexpr, V_DTYPE: tl.constexpr, ROW_SCALE: tl.constexpr):
        """_new_kv's arithmetic on its loads (_new_kv_loads)."""
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
        s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, s_bt, s_bt_blk,
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
        EARLY_LOADS: tl.constexpr = False,
    ):
        # ROW_SCALE (with PREP): the qkv row comes from a GEMM with the layer's input norm folded in, so the
        # q / k / v values are first scaled by rstd of the sequence's row of xs (the residual stream, HIDDEN
        # wide; GYRFALCON_FOLD_NORMS).
        # Grid: (num_seqs, num_kv_heads, num_splits). The GROUP query heads of one kv head form a
        # [BLOCK_G, head_dim] tile, so each K/V block is read from HBM once per kv head. Split s
        # covers context tokens [s * part, (s + 1) * part) of its sequence, part sized on the device
        # from seq_len (flash-decoding without a host sync; splits past the end are empty).
        # PREFETCH (with PREP): only the qkv row comes from the previous kernel. The step's inputs
        # (seq_lens, positions, block tables, slots) were copied before the step began and the cached
        # keys were written by earlier steps, so the first K/V tile, the RoPE tables and the norm weights
        # load first (with PDL: before the wait, while the previous kernel finishes); the new token's slot,
        # stale in that tile, is patched from registers (no store -> barrier -> reload round trip).
        # EARLY_LOADS (with PREP, without PREFETCH): every load of the prep whose address needs no other load
        # (position, slot, the qkv row's q heads and new K/V, the residual row for rstd) issues beside seq_len's,
        # and the RoPE row's right after the position's, ahead of the empty-split exit. The sm_90 code of the
        # batch-64 launch otherwise ran ~6 dependent round trips before its first K/V load: seq_len (the exit),
        # the residual row and position, the RoPE row and the q heads, the new K/V (inside its branch), the
        # store's barrier, the block table; with them, seq_len and position, the RoPE row, the block table.
        if USE_PDL:
            gdc_launch_dependents()
            if not PREFETCH:
                gdc_wait()  # q and this step's K/V come from the previous kernel; every program waits
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + b)
        if EARLY_LOADS:
            d_e = tl.arange(0, BLOCK_DK)
            dmask_e = d_e < HEAD_DK
            g_e = tl.arange(0, BLOCK_G)
            head_e = kvh * GROUP + g_e
            qmask_e = (g_e < GROUP)[:, None] & dmask_e[None, :]
            pos_e = tl.load(pos_ptr + b).to(tl.int64)
            slot_e = tl.load(slot_ptr + b).to(tl.int64)
            row_e = q_ptr + b.to(tl.int64) * s_qb
            partner_e = _rope_pairs(d_e, ROT, IS_NEOX)[0]  # needs no load: the rows load before the RoPE tables
            qx_e = tl.load(row_e + head_e[:, None] * HEAD_DK + d_e[None, :], mask=qmask_e, other=0.0)
            qxp_e = tl.load(row_e + head_e[:, None] * HEAD_DK + partner_e[None, :], mask=qmask_e, other=0.0)
            kx_e, kxp_e, vx_e = _new_kv_loads(row_e, kvh, d_e, partner_e, dmask_e, NUM_HEADS, HEAD_DK)
            qwd_e, qwp_e = _norm_weights(qw_ptr, d_e, partner_e, dmask_e, HAS_QW)
            kwd_e, kwp_e = _norm_weights(kw_ptr, d_e, partner_e, dmask_e, HAS_KW)
            rope_e = _rope_tables(d_e, dmask_e, cs_ptr + pos_e * s_cs, ROT, IS_NEOX)
            scale_e = 1.0
            if ROW_SCALE:
                scale_e = _row_rstd(xs_ptr + b.to(tl.int64) * s_xs, eps_xs, HIDDEN, BLOCK_H)
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
            kpos0, kmask0, k0, v0 = _kv_tile(kc_ptr, vc_ptr, bt_row, s_bt_blk, start, end, kvh, s_kb, s_ko, s_kh,
                                             s_vb, s_vo, s_vh, dk, dv, BLOCK_SIZE, HEAD_DK, HEAD_DV, BLOCK_N, K_ROWS)
        if PREP:
            # q_ptr is this step's fused qkv row [q heads | k heads | v heads] (HEAD_DK = HEAD_DV):
            # q/k RMSNorm + RoPE happen here, and the split holding the new token (the last active
            # one) writes its K/V into the cache, so fused_qkv_prep's launch is not needed.
            dmask = dk < HEAD_DK
            row = q_ptr + b.to(tl.int64) * s_qb
            if EARLY_LOADS:
                slot = slot_e
                partner, cos, sin, sign, rot = rope_e
                qwd, qwp, kwd, kwp = qwd_e, qwp_e, kwd_e, kwp_e
                scale = scale_e
                qx, qxp = qx_e, qxp_e
            else:
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
                    if EARLY_LOADS:
                        knew, vnew = _new_kv_values(kx_e, kxp_e, vx_e, kwd, kwp, cos, sin, sign, rot, scale, eps,
                                                    HAS_KW, HEAD_DK, kc_ptr.dtype.element_ty,
                                                    vc_ptr.dtype.element_ty, ROW_SCALE)
                    else:
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
            kpos, kmask, k, v = _kv_tile(kc_ptr, vc_ptr, bt_row, s_bt_blk, kstart, end, kvh, s_kb, s_ko, s_kh,
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
    """Whether decode attention with prep loads its first K/V tile before the qkv row.
    GYRFALCON_ATTN_PREFETCH: "pdl" (default) with PDL, when the loads overlap the previous kernel's tail
    (H200 run 14: Qwen3-0.6B batch-1 graph 0.711 vs 0.788 ms); "1" always (without PDL the tile's loads
    still overlap the qkv row's and skip the store -> barrier -> reload; slower on Llama-3.1-8B batch 16,
    5.115 vs 4.940 ms per step, run 17); "0" never."""
    mode = os.environ.get("GYRFALCON_ATTN_PREFETCH", "pdl")
    return mode == "1" or (mode != "0" and pdl)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device,
                       max_splits: int = MAX_SPLITS, split_tokens: int = 256) -> int:
    """Splits per sequence from shapes only (CUDA-graph safe): enough programs to fill the GPU about
    twice over, but at least ~256 context tokens per split, rounded to a power of two to bound the
    number of compiled variants, and at most MAX_SPLITS. max_context is an upper bound (e.g.
    block-table width * block_size: under a CUDA graph, max_model_len), so most of the grid is empty
    splits at short contexts; each costs a block launch: on the H200 (decode_attn_sweep-h200-2026-11-30-
    run5.json) a 64-split grid took 7.3-7.4 us at batch 1 with 128-512 tokens of context where 4-8
    splits took 5.3-6.0; at 8192 tokens 16 splits of 128-key tiles took 19.0 us (run 6).
    max_splits / split_tokens: see prefetch_splits."""
    want = cdiv(2 * _sm_count(device), max(1, num_seqs * num_kv_heads))
    want = min(want, cdiv(max(1, max_context), split_tokens), max_splits)
    return min(max_splits, next_pow2(max(1, want)))


SHORT_SPLIT_TOKENS = 256  # keys a split covers at least in batched launches (default_min_part)


def default_min_part(programs: int, prefetch: bool, mid_tile: bool = False) -> int:
    """Least keys one split covers when the caller does not say (0: one tile). GYRFALCON_DECODE_MIN_PART=N
    forces N. By default SHORT_SPLIT_TOKENS for launches of at least _SMALL_LAUNCH_PROGRAMS (sequence, kv head)
    programs without the prefetch (batch 16 and up at 8 kv heads: the batched decode graphs), else one tile.
    The decode graphs size the split count from max_model_len (default_num_splits: 4 at batch 16), so at the
    latency rows' 129-256 tokens 2 splits of one 128-key tile each held keys and merged; with 256-key splits
    one program holds them all and writes its output directly. The fused-prep launch at Llama-3.1-8B's 32 / 8
    heads, batch 16, L2-cold (small_m_gemv.py --attn-prep-sweep, attn_prep_sweep-h200-2026-12-01-run65.json):
    one split of 128-key tiles 11.00 / 11.20 / 11.90 us at 144 / 192 / 250 tokens against 11.14 / 11.89 / 12.69
    for the default 4 splits. From 1,024 tokens the splits are >= 256 keys anyway; batch 64 runs one split.
    mid_tile: the launch runs MID_TILE_CONFIG at up to _SMALL_LAUNCH_PROGRAMS programs (the batch 8 / 16 main graphs
    since run 96, whose contexts of up to 256 tokens replay the one-split graphs): one tile. At batch 16 its 4 splits
    took 13.59 / 16.48 / 18.25 us at 320 / 480 / 600 tokens with one-tile splits against 16.26 / 18.21 / 18.96 with
    256-key ones (midtile_minpart_*-h200-2026-12-03-run97.json)."""
    env = os.environ.get("GYRFALCON_DECODE_MIN_PART")
    if env is not None:
        return max(0, int(env))
    if mid_tile and programs <= _SMALL_LAUNCH_PROGRAMS:
        return 0
    return SHORT_SPLIT_TOKENS if programs >= _SMALL_LAUNCH_PROGRAMS and not prefetch else 0


def early_loads_default() -> bool:
    """Whether decode attention with prep and without the prefetch issues the prep's loads beside seq_len's (the
    kernel's EARLY_LOADS): GYRFALCON_DECODE_EARLY_LOADS=1; off by default. On the H200 (run 68) the launch alone
    ran 3-5% faster with them (Llama-8B shapes, L2-cold, ABAB: b16 12.86 -> 12.23 us, b64 19.10 -> 18.47 us at
    192 tokens; attn_prep_early_ab-h200-2026-12-01-run68.json), but whole steps did not move (b64 5.187 / 5.192
    ms against 5.189 / 5.192 off, ABAB; b16 4.582 against 4.568, one pair; latency_llama-3.1-8b_b*_early_*-
    h200-2026-12-01-run68.json); its GPU model token tests pass."""
    return os.environ.get("GYRFALCON_DECODE_EARLY_LOADS", "0") == "1"


def wide_tile_default() -> bool:
    """Whether the fused-prep launch may take WIDE_TILE_CONFIG (_decode_config), and so whether the decode graphs
    capture one-split graphs for it (wide_tile_context): GYRFALCON_DECODE_WIDE_TILE=0 turns both off (128-key tiles
    of 4 warps and 3 stages, as before run 91)."""
    return os.environ.get("GYRFALCON_DECODE_WIDE_TILE", "1") != "0"


def mid_tile_default(fp8: bool = False) -> bool:
    """Whether the split launch of 33-128 (sequence, kv head) programs without the prefetch takes MID_TILE_CONFIG
    (_decode_config): GYRFALCON_DECODE_MID_TILE=0 keeps 128-key tiles of 4 warps and 3 stages there, as before run 96;
    GYRFALCON_DECODE_MID_TILE_FP8=0 does so on an fp8 cache (fp8) only. There the 128-key launch held 181 registers a
    thread and 72 KB of shared memory (2 programs an SM), MID_TILE_CONFIG 96 and 38 KB (compile_check.py); Llama-3.1-8B
    batch 16 with --kv-cache-dtype fp8 at 1,024-token prompts (H200 run 100, ABAB, latency_llama-3.1-8b_b16_fp8mt1k_*
    -h200-2026-12-03-run100.json) ran steady 4.807 / 4.804 ms a step against 5.087 / 5.091."""
    if os.environ.get("GYRFALCON_DECODE_MID_TILE", "1") == "0":
        return False
    return not fp8 or os.environ.get("GYRFALCON_DECODE_MID_TILE_FP8", "1") != "0"


def prefetch_splits() -> int:
    """Most splits per sequence for the prefetching launch, GYRFALCON_DECODE_PREFETCH_SPLITS (default
    MAX_SPLITS; 64: one 128-key tile per split up to 8192 tokens). The prefetch covers a split's first
    tile only; its later tiles load after the prep, serialized behind it: on the H200 (run 13) the
    Qwen3-0.6B batch-1 graph was faster with the prefetch up to 1024 tokens (0.717 vs 0.798 ms at 256)
    and slower at 4096 / 8192 (1.039 vs 0.916, 1.264 vs 1.141 ms), where 16 splits hold 2-4 tiles.
    64 splits did not help (run 15: 0.717 vs 0.701 ms at 256 tokens, 1.622 vs 1.236 at 8192: 512
    programs of 8 warps run in several waves); with whole-row GEMV tiles the long-context cost of the
    prefetch shrank to 0.864 vs 0.830 ms at 4096 tokens (run 16)."""
    return max(1, int(os.environ.get("GYRFALCON_DECODE_PREFETCH_SPLITS", MAX_SPLITS)))


def fp8_v_staged() -> bool:
    """Whether an fp8 cache's V tile widens to fp16 in its row layout and is staged through shared memory for the
    dot (the default; GYRFALCON_DECODE_FP8_V_STAGED=0: widened in the dot's operand layout, loaded from shared
    memory a byte at a time). On the H200 (decode_attn_tput_fp8*-h200-2026-12-01-run52.json, Llama-8B's
    32 / 8 heads, batch 256, 2048 tokens), staged with a tl.where as the pin it took 395 us against 448 unstaged
    and 494 for a bf16 cache; pinned by the asm statement (_pin_f16), 384 us at the same launch shape (run 54).
    The pin is PTX: off on ROCm builds."""
    on = os.environ.get("GYRFALCON_DECODE_FP8_V_STAGED", "1") != "0"
    return on and getattr(torch.version, "hip", None) is None


def k_rows(programs: int, prefetch: bool = False) -> bool:
    """Whether key tiles load in the cache's row layout ([keys, head_dim], as V loads) and are transposed in
    registers (_kv_tile's K_ROWS) instead of loading the transposed tile directly. GYRFALCON_DECODE_K_ROWS=1 / 0
    forces it; by default on for the 64-key-tile launches of many programs without the prefetch (with 2
    stages, _decode_config): in the H200 sweep at 8 kv heads, head_dim 128 (decode_attn_tput-h200-2026-11-30-
    run22.json) it was the best launch at batch 64 / 256 with 1-2k tokens of context, 2.8-3.6% faster than
    the direct transposed load (batch 256, 1024 tokens: 248.3 vs 257.7 us; 2048: 482.1 vs 496.2)."""
    env = os.environ.get("GYRFALCON_DECODE_K_ROWS")
    if env in ("0", "1"):
        return env == "1"
    return programs > _SMALL_LAUNCH_PROGRAMS and not prefetch


def splits_override(n_seqs: int) -> int | None:
    """GYRFALCON_DECODE_SPLITS="B:N[,B:N...]": launches of B sequences that the caller gives no split count (the main
    decode graphs) split each context N ways instead of default_num_splits'. An experiment's switch: the default
    launch at batch 16 holds 3 programs an SM (72 KB of shared memory, 130 registers), so its 4 splits (512 programs)
    take 1.3 waves of the H200's 396 slots once every split holds keys (>= ~1,500 tokens), 3 splits one."""
    env = os.environ.get("GYRFALCON_DECODE_SPLITS", "")
    for item in filter(None, (x.strip() for x in env.split(","))):
        b, _, n = item.partition(":")
        if not n or int(n) < 1:
            raise ValueError(f"GYRFALCON_DECODE_SPLITS: {item!r} is not BATCH:SPLITS with SPLITS >= 1")
        if int(b) == n_seqs:
            return int(n)
    return None


def merge_in_kernel_default(n_seqs: int) -> bool:
    """Whether the last split program to finish merges the splits (no reduce launch) when the caller does not
    say. GYRFALCON_DECODE_MERGE_IN_KERNEL=1 / 0 forces it; by default on from MERGE_IN_KERNEL_MIN_SEQS
    sequences. Whole decode steps on the H200 (latency_*_merge_in_kernel-h200-2026-11-30-run21.json, 128-token
    prompts): Llama-3.1-8B batch 16 4.848 vs 4.899 ms, Qwen3-0.6B batch 16 1.408 vs 1.418 and batch 4 1.352
    vs 1.371, but Llama-3.1-8B batch 4 4.710 vs 4.636 and Qwen3-0.6B batch 1 0.920 vs 0.801 (run 15)."""
    env = os.environ.get("GYRFALCON_DECODE_MERGE_IN_KERNEL")
    if env in ("0", "1"):
        return env == "1"
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


# The split launch of (WIDE_TILE_MIN_PROGRAMS, _SMALL_LAUNCH_PROGRAMS] programs (the batch 8 / 16 main decode graphs at 8 kv
# heads) without the prefetch, on a 2-byte or an fp8 cache: 64-key tiles, 4 warps, 2 stages (_decode_config, mid_tile_default).
MID_TILE_CONFIG = (64, 4, 2)


def wide_tile_context(programs: int, element_size: int, device: torch.device) -> int:
    """Tokens of context up to which a one-split launch of `programs` (sequence, kv head) programs with the fused
    prep on a cache of element_size bytes runs WIDE_TILE_CONFIG (one tile holds the whole context), 0 where it
    never does (_decode_config's rule: 33-128 programs, a 2-byte cache, no prefetch, GYRFALCON_DECODE_WIDE_TILE,
    a card with WIDE_TILE_SHARED of shared memory a program). The decode graphs capture a one-split graph of such
    sizes for these contexts (cuda_graph.CudaGraphRunner); the main graph keeps 128-key tiles over its splits,
    which won from 320 tokens on (widetile_attn_ab-h200-2026-12-03-run92.json)."""
    ok = (WIDE_TILE_MIN_PROGRAMS < programs <= _SMALL_LAUNCH_PROGRAMS and element_size == 2 and wide_tile_default()
          and max_shared_mem(device) >= WIDE_TILE_SHARED)
    return WIDE_TILE_CONFIG[0] if ok else 0


def _decode_config(head_dim: int, programs: int, prefetch: bool = False, fp8: bool = False,
                   one_split: bool = False, wide_tile: bool = False):
    """(BLOCK_N keys per tile, num_warps, num_stages) from shapes only (no autotune under graphs).
    one_split: the caller asked for one split (the short graphs: a whole context in one program).
    wide_tile: a one-split launch of 33-128 programs may take WIDE_TILE_CONFIG (the caller passes it for the fused
    prep on a 2-byte cache; an fp32 cache's 256-key tiles need 270 KB of shared memory). H200, Llama-3.1-8B's 32 / 8
    heads, batch 16 (128 programs), L2-cold (small_m_gemv.py --attn-prep-sweep, attn_prep_sweep-h200-2026-12-02-
    run90.json): one split of 256-key tiles, 8 warps, 1 stage 9.20 / 9.85 / 10.75 us at 144 / 192 / 250 tokens
    against 12.49 / 12.62 / 12.89 for 128-key tiles at 4 warps and 3 stages (4 warps 9.78 / 10.55 / 11.57). Whole
    steps, same call ABAB (latency_*_b16_t256_*-h200-2026-12-02-run91.json): Llama-3.1-8B batch 16 4.471 / 4.473 ms
    against 4.521 / 4.515, Qwen3-0.6B batch 16 1.126 against 1.215. Past one tile it lost (run 92, same sweep, the
    graphs' 4 splits of >= 256 keys): 18.97 / 28.20 / 42.27 / 68.19 / 121.36 us at 320 / 600 / 1,100 / 2,100 /
    4,100 tokens against 14.97 / 23.67 / 33.93 / 49.53 / 79.58, and the Llama batch-16 step at 1,024-token prompts
    5.46 against 5.20 ms; so only the one-split graphs (wide_tile_context: contexts of up to 256 tokens) take it
    (run 93, ABAB: Llama-3.1-8B batch 16 steady 4.370 / 4.375 ms against 4.509 / 4.518, batch 8 4.303 against
    4.463). At batch 8 (64 programs) one split of it took 8.67 us at 192 tokens against 10.88 for the graphs'
    default (widetile_sweep-h200-2026-12-03-run92.json); at batch 32 (256 programs) 64-key tiles stay the best.
    programs = sequences * kv heads. H200 sweep (decode_attn_sweep-h200-2026-11-30-run6.json, 8 kv heads,
    head_dim 128): up to batch 16, 128-key tiles with 4 warps were the best at batch 16 (10.3 us vs
    12.4 for 64-key tiles at 256 tokens) and at batch 1 with long contexts (9.2 vs 10.1 us at 2048 tokens,
    19.0 vs 23.1 at 8192), within ~0.5 us of the best at 128-512 tokens; at batch 64, 64-key tiles
    (22.5 vs 24.4 us). With the first tile prefetched (its K and V held in registers across the qkv
    prep) 8 warps: the Qwen3-0.6B batch-1 graph at 256 tokens replayed in 0.717 ms with 8 warps, 0.771
    with 4, 0.775 with 64-key tiles and 4 warps (latency_qwen3-0.6b_b1_prefetch*-h200-2026-11-30-run13).
    Since run 77 the prefetching launch that splits the context uses B1_SPLIT_TILE-key tiles (8 warps): twice the
    splits hold keys, each with one prefetched tile, so less of the work follows the PDL wait. Timed inside the
    28-layer Qwen3-0.6B batch-1 chain at 256 tokens (small_m_gemv.py --chain-env, chain_env-h200-2026-12-02-
    run77.json): 526.5 us a step against 600.0 with 128-key tiles (64 keys and 4 warps 580.7, 128 / 4 643.2,
    128 / 16 602.0); the model, same call ABAB: 0.619 / 0.634 ms a step against 0.679 / 0.680, and the batch-1
    graph at 1,024 tokens of context 0.573 / 0.582 against 0.613 / 0.625 (latency_qwen3-0.6b_b1_env_*-h200-
    2026-12-02-run77.json). The one-split launch keeps 128-key tiles: a second tile would load after the wait.
    2 stages instead of 3 (GYRFALCON_DECODE_ATTN_CONFIG=64,8,2; runs 78, 80): the chain x1.005 / 1.029 / 1.011 at
    256 / 1,024 / 4,096 tokens, the model 0.617 / 0.618 ms a step against 0.622 / 0.651 (ABAB), within the calls'
    variance; not adopted yet (the GPU tests ran with 3).
    The split launch at 33-128 programs (the batch 8 / 16 main graphs) takes MID_TILE_CONFIG: at batch 16, L2-cold,
    4 splits of 64-key tiles, 4 warps and 2 stages took 18.33 / 26.67 / 42.21 us at 600 / 1,100 / 2,100 tokens
    against 24.00 / 34.45 / 50.07 for 128-key tiles at 4 warps and 3 stages (ctx_sweep_long-h200-2026-12-03-run96.json,
    min_part 0). Its sm_90 code takes 38 KB of shared memory and 80-86 registers a thread against 72 KB and 130 for
    the 128-key launch (compile_check.py), so 5 programs fit an SM instead of 3."""
    env = os.environ.get("GYRFALCON_DECODE_ATTN_CONFIG")  # "block_n,num_warps[,num_stages]": launch-shape experiments
    if env:
        parts = [int(x) for x in env.split(",")]
        return parts[0], parts[1], parts[2] if len(parts) > 2 else 3
    if head_dim <= 128:
        if programs <= _SMALL_LAUNCH_PROGRAMS:
            if wide_tile and one_split and not prefetch and not fp8 and programs > WIDE_TILE_MIN_PROGRAMS:
                return WIDE_TILE_CONFIG
            if prefetch and not one_split:
                return B1_SPLIT_TILE, 8, 3
            if (not prefetch and not one_split and programs > WIDE_TILE_MIN_PROGRAMS
                    and mid_tile_default(fp8)):
                return MID_TILE_CONFIG
            return 128, (8 if prefetch else 4), 3
        if fp8 and not prefetch and programs > _FP8_WIDE_TILE_PROGRAMS:
            # An fp8 cache (half the bytes a key) over many programs: 128-key tiles with 3 stages. With V pinned
            # in its row layout (decode_attn_tput_fp8-h200-2026-12-01-run54.json, 8 kv heads, head_dim 128, batch
            # 256 = 2048 programs) they took 192.2 / 370.2 us at 1024 / 2048 tokens, against 197.0 / 382.2 with 2
            # stages and 198.1 / 383.3 for 64-key tiles; at batch 64 (512 programs) 64-key tiles with 2 stages,
            # the bf16 launch below, won instead (53.9 / 100.6 us against 65.8 / 127.9). This launch holds 184
            # registers a thread (2 programs an SM); capped at 128 (3 an SM, no spills) it lost: 203.6 vs 193.0 us
            # at 1024 tokens, 393.9 vs 371.7 at 2048 (decode_attn_tput_fp8_maxnreg_ab-h200-2026-12-01-run60.json).
            return 128, 4, 3
        # Many programs: 64-key tiles; with key tiles in row layout (k_rows) 2 stages were the best
        # (decode_attn_tput-h200-2026-11-30-run22.json, 65.7-482 us vs 66.7-484 with 3).
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
) -> torch.Tensor:
    """Triton split-KV decode attention; same contract as paged_decode_attention_ref.

    No host syncs, buffers sized from shapes, so it can be captured in a CUDA graph. num_splits=None
    picks default_num_splits from the batch shape and the block-table width. block_n / num_warps /
    num_stages override the launch config (tests and benchmark sweeps). Each split covers at least
    min_part keys (and one tile; None: default_min_part). merge_in_kernel=True lets the last split program to
    finish merge the splits instead of a second launch; None: merge_in_kernel_default(batch), on from 8
    sequences. At batch
    1 the reduce launch wins: on the H200 (benchmarks/small_m_gemv.py,
    benchmarks/results/small_m_gemv_attn-h200-2026-11-30-run4.json) one-tile splits merged by the reduce kernel
    were as fast or faster at every shape, up to 1.5x at batch 1 with 2-8k contexts, where the
    merging program's extra round trips through L2 cost more than the launch they save; in whole steps
    Qwen3-0.6B batch 1 took 0.920 vs 0.801 ms per step with the in-kernel merge (run 15). From batch 8 the
    saved launch wins (merge_in_kernel_default).
    """
    assert q.dim() == 3 and q.stride(-1) == 1
    return _launch(q, q.shape[1], k_cache, v_cache, block_tables, seq_lens, scale, num_splits, None,
                   block_n=block_n, num_warps=num_warps, num_stages=num_stages, merge_in_kernel=merge_in_kernel,
                   min_part=min_part, pdl=pdl)


class DecodePartials(NamedTuple):
    """The split kernel's output before the reduce: pacc [B * num_heads * num_splits, BLOCK_DV] fp32
    unnormalized accumulators, pml [B * num_heads * num_splits, 2] fp32 (running max in log2 units, sum),
    rows (b, head, split); only the splits that held keys (the split kernel's arithmetic from seq_lens,
    num_splits, block_n and min_part) are written. A consumer merges them (merge_partials_ref,
    small_m_gemv.merged_heads_gemv)."""
    pacc: torch.Tensor
    pml: torch.Tensor
    seq_lens: torch.Tensor
    num_splits: int
    block_n: int
    min_part: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype


def merge_partials_ref(parts: DecodePartials) -> torch.Tensor:
    """Plain-torch reduce of DecodePartials -> o [B, num_heads * head_dim] in parts.dtype (what the
    reduce kernel writes)."""
    B, H, S, dv = parts.seq_lens.shape[0], parts.num_heads, parts.num_splits, parts.head_dim
    lens = parts.seq_lens.long()
    part = torch.clamp(-(-(-(-lens // S)) // parts.block_n) * parts.block_n, min=parts.min_part)
    n_active = -(-lens // part)  # [B]
    active = torch.arange(S, device=lens.device)[None, :] < n_active[:, None]  # [B, S]
    ml = parts.pml.view(B, H, S, 2)
    m = ml[..., 0].masked_fill(~active[:, None, :], float("-inf"))
    m_max = m.amax(-1, keepdim=True)
    m_max = torch.where(torch.isinf(m_max), torch.zeros_like(m_max), m_max)
    w = torch.exp2(m - m_max).masked_fill(~active[:, None, :], 0.0)  # [B, H, S]
    l_tot = (w * ml[..., 1].masked_fill(~active[:, None, :], 0.0)).sum(-1)
    acc = parts.pacc.view(B, H, S, -1)[..., :dv].masked_fill(~active[:, None, :, None], 0.0)
    o = (acc * w[..., None]).sum(2) / torch.where(l_tot == 0, torch.ones_like(l_tot), l_tot)[..., None]
    return o.reshape(B, H * dv).to(parts.dtype)


def _launch(q, n_heads, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, prep, *, block_n=None,
            num_warps=None, num_stages=None, merge_in_kernel=None, min_part=None, pdl=None, partials=False,
            prefetch=None, early_loads=None):
    """The split (+ reduce) launch. q: [B, n_heads, dk] queries, or with prep the fused qkv rows
    [B, (n_heads + 2 * n_kv) * dk] and prep = (positions, cos_sin_cache, rotary_dim, is_neox, slot_mapping,
    q_norm_weight, k_norm_weight, eps, row_scale (None, or (x [B, hidden], eps): qkv_prep_ref)).
    partials=True: no reduce; returns DecodePartials. prefetch (prep
    only; default prefetch_default(pdl)): the first K/V tile loads before the qkv row. early_loads (prep without
    the prefetch; default early_loads_default()): the prep's loads issue beside seq_len's."""
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
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
    if early_loads is None:
        early_loads = early_loads_default()
    early_loads = early_loads and prep is not None and not prefetch
    bn, nw, ns = _decode_config(max(dk, dv), n_seqs * n_kv, prefetch, fp8=k_cache.element_size() == 1,
                                one_split=num_splits == 1,
                                wide_tile=(prep is not None
                                           and wide_tile_context(n_seqs * n_kv, k_cache.element_size(), q.device) > 0))
    bn, nw, ns = max(16, block_n or bn), num_warps or nw, num_stages or ns
    if num_splits is None:
        num_splits = splits_override(n_seqs)
    if num_splits is None:
        ms = prefetch_splits() if prefetch else MAX_SPLITS
        num_splits = default_num_splits(n_seqs, n_kv, block_tables.shape[1] * block_size, q.device,
                                        max_splits=ms, split_tokens=min(256, bn) if ms > MAX_SPLITS else 256)
    num_splits = max(1, int(num_splits))
    block_dv = max(16, next_pow2(dv))
    direct = num_splits == 1 and not partials
    if merge_in_kernel is None:
        merge_in_kernel = merge_in_kernel_default(n_seqs)
    merge_in_kernel = merge_in_kernel and not direct and not partials and n_seqs * n_kv <= _MAX_COUNTERS
    if min_part is None:
        # mid_tile by launch shape: a shape forced to MID_TILE_CONFIG (block_n / env) splits the same way
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
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), block_tables.stride(1),
        pos, cs, slot, qw, kw, s_cs, float(eps), xs, xs.stride(0), float(eps_xs),
        BLOCK_SIZE=block_size, GROUP=group, BLOCK_G=max(16, next_pow2(group)),
        HEAD_DK=dk, HEAD_DV=dv, BLOCK_DK=max(16, next_pow2(dk)), BLOCK_DV=block_dv, BLOCK_N=bn,
        BLOCK_S=next_pow2(num_splits), MIN_PART=min_part_,
        DIRECT=direct, MERGE_IN_KERNEL=merge_in_kernel,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=interpreting(),
        USE_PDL=pdl,
        PREP=prep is not None, NUM_HEADS=n_heads, ROT=int(rot_dim), IS_NEOX=bool(neox),
        HAS_QW=prep is not None and prep[5] is not None, HAS_KW=prep is not None and prep[6] is not None,
        PREFETCH=prefetch, GROUP_P2=next_pow2(group), K_ROWS=k_rows(n_seqs * n_kv, prefetch),
        ROW_SCALE=row_scale is not None, HIDDEN=xs.shape[-1] if row_scale is not None else 1,
        BLOCK_H=min(1024, max(16, next_pow2(xs.shape[-1]))) if row_scale is not None else 16,
        V_STAGE=fp8_v_staged(), Q16=q.element_size() == 2, EARLY_LOADS=early_loads,
        num_warps=nw, num_stages=ns,
        **pdl_launch_kwargs(pdl),
    )
    if partials:
        return DecodePartials(pacc, pml, seq_lens, num_splits, bn, min_part_, n_heads, dv, q.dtype)
    if not direct and not merge_in_kernel:
        _decode_reduce_kernel[(n_seqs, n_heads)](
            pacc, pml, o, seq_lens, num_splits, n_heads, o.stride(0), o.stride(1),
            HEAD_DV=dv, BLOCK_DV=block_dv, BLOCK_S=next_pow2(num_splits), BLOCK_N=bn, MIN_PART=min_part_,
            USE_PDL=pdl, num_warps=reduce_warps(), **pdl_launch_kwargs(pdl),
        )
    return o


def reduce_warps() -> int:
    """Warps of the split-merge (reduce) launch: 4, or GYRFALCON_DECODE_REDUCE_WARPS (1, 2, 4 or 8; an experiment
    for the batch-1 chain, where what the launch does after its PDL wait is on the step's path:
    benchmarks/small_m_gemv.py --chain-env)."""
    w = int(os.environ.get("GYRFALCON_DECODE_REDUCE_WARPS", "4"))
    if w not in (1, 2, 4, 8):
        raise ValueError(f"GYRFALCON_DECODE_REDUCE_WARPS must be 1, 2, 4 or 8, not {w}")
    return w


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
