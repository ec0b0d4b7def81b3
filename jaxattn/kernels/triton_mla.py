"""Triton kernels of absorbed multi-head latent attention (``jaxattn.mla``): a split-KV kernel whose
M tile is query heads (of up to QT consecutive query tokens of one sequence: speculative decode),
one program per (token group, head block, KV segment), and the segment reduction.

Conventions: ``q_latent: [T, HQ, R]``, ``q_rope: [T, HQ, DR]``; the latent pool ``[NUM_PAGES, PAGE,
W]`` with ``W = R + DR`` (``c_kv`` then ``k_rope``); tables int32 ``[B, P]``; kv_lens int32 ``[B]``
(already clipped to ``P * PAGE``; 0 for sequences that break the contract); cu int32 ``[B + 1]``
(sanitized: non-decreasing in ``[0, T]``); scales float32 ``[1]``, the scale of FP8 pages. Every
key is shared by all heads (one latent "KV head"), so a program's (token, head) rows form the M
dimension of both dots: ``s = q_latent c^T + q_rope k_rope^T`` and ``acc += p c``. Logits are in
base 2, as in ``triton_attention``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from jaxattn.kernels.triton_attention import LOG2E, NEG_INIT, _find_seq


@triton.jit
def mla_decode_kernel(
        ql_ptr, qr_ptr, pages_ptr, tables_ptr, kv_lens_ptr, cu_ptr, scales_ptr, acc_ptr, ml_ptr,
        T: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr, P: tl.constexpr, HQ: tl.constexpr,
        R: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr, NUM_PAGES: tl.constexpr, QT: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NSEG: tl.constexpr, SCALE: tl.constexpr,
        CAUSAL: tl.constexpr, FP8: tl.constexpr, F16_DOTS: tl.constexpr, DIRECT: tl.constexpr,
        DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """Grid ``(T * NSEG * cdiv(HQ, BLOCK_H),)``, head blocks fastest, then KV segments: the programs
    that read the same keys (a token's head blocks) run side by side, so that a key tile's second
    read can come from L2 (no change measured at B=64 kv 4096 Hq 128). Program (t, hb, s) serves
    the query tokens ``t .. t + QT - 1`` of t's sequence when t is the first of such a group
    (``QT * BLOCK_H`` rows: each token's heads ``hb * BLOCK_H ...``), over the s-th of NSEG equal
    runs of the KV tiles they see;
    programs of other tokens of a sequence exit at once, and a token of no sequence (or of one
    without keys) gets rows that saw no key.

    ``F16_DOTS`` (FP8 pages): both dots in float16, the queries pre-scaled by the softmax scale
    (and the pages' scale) so that their logits come out in base 2 and f16's range holds them;
    e4m3 widens to f16 exactly, in one instruction per pair, where bf16 takes several.

    ``DIRECT`` (NSEG == 1): ``acc_ptr`` is the output ``[T, HQ, R]`` (normalized, q's dtype).
    Otherwise ``acc_ptr`` is float32 ``[T, HQ, NSEG, R]``, unnormalized. ``ml_ptr``: float32
    ``[T, HQ, NSEG, 2]``, each segment's running max (base 2) and sum.
    """
    W: tl.constexpr = R + DR
    BLOCK_M: tl.constexpr = QT * BLOCK_H
    HB: tl.constexpr = (HQ + BLOCK_H - 1) // BLOCK_H
    pid = tl.program_id(0)
    hb = pid % HB
    seg = (pid // HB) % NSEG
    t = pid // (HB * NSEG)
    b = _find_seq(cu_ptr, t, 0, B - 1, LOG_B, 1, False)
    q_start = tl.load(cu_ptr + b)
    q_end = tl.load(cu_ptr + b + 1)
    kv_len = tl.minimum(tl.maximum(tl.load(kv_lens_ptr + b), 0), P * PAGE)
    active = (t >= q_start) & (t < q_end)
    if active & ((t - q_start) % QT != 0):
        return
    tok_end = tl.where(active, tl.minimum(t + QT, q_end), t + 1)

    offs_m = tl.arange(0, BLOCK_M)
    tok = t + offs_m // BLOCK_H
    head = hb * BLOCK_H + offs_m % BLOCK_H
    row_ok = (tok < tok_end) & (head < HQ)
    hi_row = tl.where(active & row_ok, kv_len, 0)                        # keys each row sees
    if CAUSAL:
        hi_row = tl.minimum(hi_row, kv_len - (q_end - q_start) + (tok - q_start) + 1)
    hi_key = tl.max(hi_row, 0)
    tiles = (tl.maximum(hi_key, 0) + BLOCK_N - 1) // BLOCK_N
    per_seg = (tiles + NSEG - 1) // NSEG
    seg_lo = seg * per_seg
    seg_hi = tl.minimum(seg_lo + per_seg, tiles)

    offs_r = tl.arange(0, R)
    offs_dr = tl.arange(0, DR)
    q_row = tok.to(tl.int64) * HQ + head
    q_lat = tl.load(ql_ptr + q_row[:, None] * R + offs_r[None, :], mask=row_ok[:, None], other=0.0)
    q_rope = tl.load(qr_ptr + q_row[:, None] * DR + offs_dr[None, :], mask=row_ok[:, None], other=0.0)
    qk_scale = SCALE
    if FP8:
        qk_scale = SCALE * tl.load(scales_ptr)
    logit_scale = qk_scale * LOG2E
    if F16_DOTS:
        q_lat = (q_lat.to(tl.float32) * logit_scale).to(tl.float16)
        q_rope = (q_rope.to(tl.float32) * logit_scale).to(tl.float16)
        logit_scale = 1.0
    elif DOT_F32:
        q_lat = q_lat.to(tl.float32)
        q_rope = q_rope.to(tl.float32)
    m_i = tl.full([BLOCK_M], NEG_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, R], tl.float32)
    table_row = tables_ptr + b.to(tl.int64) * P
    for tile in range(seg_lo, seg_hi):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi_key
        page = tl.load(table_row + offs_n // PAGE, mask=n_ok, other=0)
        page = tl.where((page >= 0) & (page < NUM_PAGES), page, 0)
        key = (page.to(tl.int64) * PAGE + offs_n % PAGE) * W
        c = tl.load(pages_ptr + key[:, None] + offs_r[None, :], mask=n_ok[:, None], other=0.0).to(q_lat.dtype)
        k_rope = tl.load(pages_ptr + key[:, None] + R + offs_dr[None, :], mask=n_ok[:, None],
                         other=0.0).to(q_lat.dtype)
        if F16_DOTS:
            # c^T by a load of its own: Triton then async-copies every FP8 tile (and widens it after
            # its shared-memory load) instead of loading c synchronously for both dots. Measured
            # with the 16-head tiles; the 64-head ones (bf16 dots) run slower with it, out of
            # shared memory at 2 stages.
            c_t = tl.load(pages_ptr + key[None, :] + offs_r[:, None], mask=n_ok[None, :], other=0.0).to(q_lat.dtype)
        else:
            c_t = tl.trans(c)
        s = tl.dot(q_lat, c_t, input_precision=PRECISION)
        s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision=PRECISION)
        s = tl.where(offs_n[None, :] < hi_row[:, None], s * logit_scale, float("-inf"))
        # A row may see no key of a tile (causal, its token earlier): NEG_INIT keeps it finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
        m_i = m_new

    if FP8:
        acc = acc * tl.load(scales_ptr)
    row = q_row * NSEG + seg
    if DIRECT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(acc_ptr + row[:, None] * R + offs_r[None, :], out.to(acc_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        tl.store(acc_ptr + row[:, None] * R + offs_r[None, :], acc, mask=row_ok[:, None])
    tl.store(ml_ptr + row * 2, m_i, mask=row_ok)
    tl.store(ml_ptr + row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def mla_reduce_kernel(acc_ptr, ml_ptr, out_ptr, HQ: tl.constexpr, R: tl.constexpr, NSEG: tl.constexpr,
                      BLOCK_H: tl.constexpr):
    """Grid ``(T, cdiv(HQ, BLOCK_H))``: ``out = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s``,
    zero for rows that saw no key."""
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, NSEG)
    offs_r = tl.arange(0, R)
    h_ok = offs_h < HQ
    q_row = t.to(tl.int64) * HQ + offs_h
    rows = q_row[:, None] * NSEG + offs_s[None, :]                                   # [BLOCK_H, NSEG]
    m = tl.max(tl.load(ml_ptr + rows * 2, mask=h_ok[:, None], other=NEG_INIT), 1)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R], tl.float32)
    for s in range(NSEG):
        row = q_row * NSEG + s
        w = tl.exp2(tl.load(ml_ptr + row * 2, mask=h_ok, other=NEG_INIT) - m)
        l_sum += w * tl.load(ml_ptr + row * 2 + 1, mask=h_ok, other=0.0)
        acc += w[:, None] * tl.load(acc_ptr + row[:, None] * R + offs_r[None, :], mask=h_ok[:, None], other=0.0)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out_ptr + q_row[:, None] * R + offs_r[None, :], out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
