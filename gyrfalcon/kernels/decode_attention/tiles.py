"""jit helpers of the split-KV decode kernels (split_kv.py, with_prep.py): a K/V tile through the block table,
one online-softmax step over it, and a split's key range."""

from __future__ import annotations

from gyrfalcon.kernels.common import HAS_TRITON, tl, triton

if HAS_TRITON:

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
    def _split_range(seq_len, split, num_splits, BLOCK_N: tl.constexpr, MIN_PART: tl.constexpr):
        """Split `split`'s keys [start, end) of a sequence of seq_len keys in num_splits splits, and how many splits
        hold >= 1 key (n_active; 0 for a padding row). A split covers at least MIN_PART keys (>= one tile; seq_len 0
        would otherwise divide by zero)."""
        part = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, MIN_PART)
        start = split * part
        end = tl.minimum(start + part, seq_len)
        n_active = tl.cdiv(seq_len, part)
        return start, end, n_active
