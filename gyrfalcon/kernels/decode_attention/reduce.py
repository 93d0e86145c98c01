"""Merging the splits' partial softmaxes: the reduce kernel (a second launch), and the split kernels' own end
(_finish_split), which writes the output directly (one split), stores its partials, or (MERGE_IN_KERNEL) lets the
last split program of a (sequence, kv head) merge them all: one launch instead of two."""

from __future__ import annotations

from gyrfalcon.kernels.common import HAS_TRITON, gdc_launch_dependents, gdc_wait, tl, triton

if HAS_TRITON:

    @triton.jit
    def _finish_split(acc, m_i, l_i, o_ptr, pacc_ptr, pml_ptr, count_ptr, b, kvh, split, head, gmask, dv, n_active,
                      num_splits, s_ob, s_oh, GROUP: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                      BLOCK_S: tl.constexpr, GROUP_P2: tl.constexpr, DIRECT: tl.constexpr,
                      MERGE_IN_KERNEL: tl.constexpr):
        """A split program's end: with one split (DIRECT) or as the only split holding keys under MERGE_IN_KERNEL, the
        normalized output; else its partial softmax (acc [BLOCK_G, BLOCK_DV] unnormalized, (m, l)) for the reduce
        kernel, or, MERGE_IN_KERNEL, for the last split program of its (sequence, kv head) to merge."""
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
