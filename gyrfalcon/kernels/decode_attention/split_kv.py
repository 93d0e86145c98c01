"""The split-KV decode kernel over a ready query (flash-decoding without a host sync).

Grid: (num_seqs, num_kv_heads, num_splits). The GROUP query heads of one kv head form a [BLOCK_G, head_dim]
tile, so each K/V block is read from HBM once per kv head. Split s covers context tokens
[s * part, (s + 1) * part) of its sequence, part sized on the device from seq_len (_split_range; splits past
the end are empty).
"""

from __future__ import annotations

from gyrfalcon.kernels.common import HAS_TRITON, gdc_launch_dependents, gdc_wait, tl, triton

if HAS_TRITON:
    from gyrfalcon.kernels.decode_attention.reduce import _finish_split
    from gyrfalcon.kernels.decode_attention.tiles import _attend_tile, _kv_tile, _split_range

    @triton.jit
    def _decode_split_kernel(
        q_ptr, kc_ptr, vc_ptr, bt_ptr, seq_lens_ptr, o_ptr, pacc_ptr, pml_ptr, count_ptr,
        scale_log2, num_splits,
        s_qb, s_qh, s_ob, s_oh,
        s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, s_bt,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
        HEAD_DK: tl.constexpr, HEAD_DV: tl.constexpr,
        BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
        MIN_PART: tl.constexpr, DIRECT: tl.constexpr, MERGE_IN_KERNEL: tl.constexpr, DOT_PREC: tl.constexpr,
        UPCAST: tl.constexpr, USE_PDL: tl.constexpr, GROUP_P2: tl.constexpr, K_ROWS: tl.constexpr,
        V_STAGE: tl.constexpr, Q16: tl.constexpr,
    ):
        """q: [B, num_heads, HEAD_DK] (strides s_qb, s_qh). DIRECT (one split): each program normalizes and writes
        its output; else partials for the reduce kernel, or MERGE_IN_KERNEL (reduce.py's _finish_split)."""
        if USE_PDL:
            gdc_launch_dependents()
            gdc_wait()  # q comes from the previous kernel; every program waits
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
                return  # empty split: the reduce kernel reads only the active ones

        g = tl.arange(0, BLOCK_G)
        head = kvh * GROUP + g
        gmask = g < GROUP
        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        bt_row = bt_ptr + b.to(tl.int64) * s_bt
        q = tl.load(
            q_ptr + b * s_qb + head[:, None] * s_qh + dk[None, :],
            mask=gmask[:, None] & (dk[None, :] < HEAD_DK), other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
        for kstart in range(start, end, BLOCK_N):
            kpos, kmask, k, v = _kv_tile(kc_ptr, vc_ptr, bt_row, kstart, end, kvh, s_kb, s_ko, s_kh,
                                         s_vb, s_vo, s_vh, dk, dv, BLOCK_SIZE, HEAD_DK, HEAD_DV, BLOCK_N, K_ROWS)
            m_i, l_i, acc = _attend_tile(q, k, v, kmask, m_i, l_i, acc, scale_log2, DOT_PREC, UPCAST, V_STAGE,
                                         Q16)
        _finish_split(acc, m_i, l_i, o_ptr, pacc_ptr, pml_ptr, count_ptr, b, kvh, split, head, gmask, dv, n_active,
                      num_splits, s_ob, s_oh, GROUP, HEAD_DV, BLOCK_DV, BLOCK_S, GROUP_P2, DIRECT, MERGE_IN_KERNEL)
