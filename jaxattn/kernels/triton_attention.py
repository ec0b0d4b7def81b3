"""Triton paged-attention kernels: a 2D kernel for prefill/mixed batches, and a 3D split-KV decode
kernel with its segment reduction.

Shared conventions (all kernels):
  q, out: ``[T, HQ, D]``; K/V pools addressed by strides (``SK_P`` page, ``SK_H`` KV head, ``SK_T``
  token within the page), so HND and NHD both work; tables: int32 ``[B, P]``; kv_lens: int32 ``[B]``
  (already clipped to ``P * PAGE``); cu: int32 ``[B + 1]``; nd: int32 ``[1]``, the number of leading
  sequences handled by the decode kernels; sinks: float32 ``[HQ]``; k_scale, v_scale: float32 ``[1]``
  each, the scales of FP8 pages (two operands, so the cache's scalars go in as they are, without a
  stack per call; when they are not both positive and finite, every sequence has no keys and every
  row is zero: the call's own check, no XLA op). Page ids outside
  ``[0, NUM_PAGES)`` read the null page 0.
  Logits are kept in base 2 (``s * log2(e)``) so the softmax uses ``exp2``. Dots take K, V and the
  probabilities in q's dtype, or float32 with ``DOT_F32`` (float32 q, and Triton's interpreter,
  whose dot reads bfloat16 as raw integers).

GQA packing: a program owns one KV head and ``BLOCK_M`` query rows, each a (token, query head)
pair of that KV head's group; ``G`` heads per group, padded to ``G_P`` (a power of two).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
# Running maximum before any key: finite, so that fully masked tiles give exp2(-inf - m) = 0
# without NaNs from (-inf) - (-inf).
NEG_INIT = tl.constexpr(-1.0e30)


@triton.jit
def _fp8_scales(k_scale_ptr, v_scale_ptr):
    """``(ok, k_scale, v_scale)`` of FP8 pages: ``ok`` when both are positive and finite (NaN fails
    every comparison, inf * 0 is NaN); otherwise the scales used are 1 and 0, so that nothing
    non-finite reaches a row that has no keys."""
    k_scale = tl.load(k_scale_ptr)
    v_scale = tl.load(v_scale_ptr)
    ok = (k_scale > 0) & (k_scale * 0.0 == 0.0) & (v_scale > 0) & (v_scale * 0.0 == 0.0)
    return ok, tl.where(ok, k_scale, 1.0), tl.where(ok, v_scale, 0.0)


@triton.jit
def _attend_tile(q, acc, m_i, l_i, k_ptr, v_ptr, table_row, kv_head_off, tile, kv_len, pos, qk_scale, masked,
                 BLOCK_N: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, PAGE: tl.constexpr,
                 NUM_PAGES: tl.constexpr, SK_P: tl.constexpr, SK_T: tl.constexpr, SOFTCAP: tl.constexpr,
                 WINDOW: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """One KV tile of online softmax. ``q: [M, D_P]``, ``acc: [M, D_P]`` f32, ``m_i, l_i: [M]``,
    ``pos: [M]`` absolute query positions; ``masked``: apply the kv_len/causal/window masks."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_P)
    n_ok = offs_n < kv_len
    page = tl.load(table_row + offs_n // PAGE, mask=n_ok, other=0)
    page = tl.where((page >= 0) & (page < NUM_PAGES), page, 0)
    kv_off = page.to(tl.int64) * SK_P + kv_head_off + (offs_n % PAGE) * SK_T
    kv_mask = n_ok[:, None] & (offs_d < D)[None, :]
    k = tl.load(k_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
    if SOFTCAP > 0:
        # softcap * tanh(x / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1)
        y = s * (qk_scale / SOFTCAP)
        s = (SOFTCAP * LOG2E) * (1.0 - 2.0 / (tl.exp2(y * (2.0 * LOG2E)) + 1.0))
    else:
        s = s * (qk_scale * LOG2E)
    if masked:
        visible = n_ok[None, :]
        if CAUSAL or WINDOW > 0:
            visible = visible & (offs_n[None, :] <= pos[:, None])
        if WINDOW > 0:
            visible = visible & (offs_n[None, :] > pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _find_seq(cu_ptr, key, first, last, LOG_N: tl.constexpr, BQ: tl.constexpr, BLOCKS: tl.constexpr):
    """Largest b in [first, last] whose start is <= key. The start of b is ``cu[b]`` (a token),
    or with ``BLOCKS`` its first q-block ``(cu[b] - cu[first]) // BQ + (b - first)``."""
    c0 = tl.load(cu_ptr + first)
    lo = first
    hi = last
    for _ in tl.static_range(LOG_N):
        mid = (lo + hi + 1) // 2
        start = tl.load(cu_ptr + mid)
        if BLOCKS:
            start = (start - c0) // BQ + mid - first
        ok = start <= key
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def paged_prefill_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, kv_lens_ptr, cu_ptr, nd_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr, prev_ptr,
        out_ptr,
        T: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr, P: tl.constexpr, HQ: tl.constexpr,
        G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, PAGE: tl.constexpr,
        NUM_PAGES: tl.constexpr, SK_P: tl.constexpr, SK_H: tl.constexpr, SK_T: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE: tl.constexpr, SOFTCAP: tl.constexpr,
        WINDOW: tl.constexpr, CAUSAL: tl.constexpr, HAS_SINKS: tl.constexpr, FP8: tl.constexpr,
        DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """2D kernel, grid ``(T // BQ + B + 2, HKV)`` with ``BQ = BLOCK_M // G_P`` tokens per q-block.

    Serves sequences ``[nd, B)`` and two padding pseudo-sequences with no keys (zeros): tokens
    ``[0, cu[0])``, as the first ``hb = cdiv(cu[0], BQ)`` programs, and tokens ``[cu[B], T)``
    as sequence B. Program ``pid >= hb`` is q-block ``pid - hb - start(b)`` of the sequence
    b whose first q-block ``start(b) = (cu[b] - cu[nd]) // BQ + (b - nd)`` is the last one
    <= ``pid - hb``: this launch skips decode q-blocks, not decode requests. ``prev_ptr`` is the
    buffer ``out_ptr`` aliases in split mode (it holds the decode rows), unused otherwise.
    """
    BQ: tl.constexpr = BLOCK_M // G_P
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    nd = tl.load(nd_ptr)
    head_end = tl.load(cu_ptr)
    hb = (head_end + BQ - 1) // BQ
    b = _find_seq(cu_ptr, pid - hb, nd, B, LOG_B, BQ, True)
    q_start = tl.load(cu_ptr + b)
    q_end = tl.load(cu_ptr + tl.minimum(b + 1, B))
    c_nd = tl.load(cu_ptr + nd)
    first = (q_start - c_nd) // BQ
    block = pid - hb - (first + b - nd)
    # A sequence's q-blocks run last first: under a causal mask the last ones see the most keys,
    # and starting them first shortens the launch's tail. Sequence b < B owns
    # start(b + 1) - start(b) = (q_end - c_nd) // BQ - first + 1 programs, at most one spare.
    block = tl.where(b < B, (q_end - c_nd) // BQ - first - block, block)
    row0 = q_start + block * BQ
    q_end = tl.where(b < B, q_end, T)
    kv_len = tl.minimum(tl.maximum(tl.load(kv_lens_ptr + tl.minimum(b, B - 1)), 0), P * PAGE)
    kv_len = tl.where(b < B, kv_len, 0)
    in_head = pid < hb
    q_start = tl.where(in_head, 0, q_start)
    row0 = tl.where(in_head, pid * BQ, row0)
    q_end = tl.minimum(tl.where(in_head, head_end, q_end), T)
    kv_len = tl.where(in_head, 0, kv_len)
    if FP8:
        scales_ok, k_scale, v_scale = _fp8_scales(k_scale_ptr, v_scale_ptr)
        kv_len = tl.where(scales_ok, kv_len, 0)
    if row0 >= q_end:
        return
    q_len = q_end - q_start

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_P)
    tok = row0 + offs_m // G_P
    head = kvh * G + offs_m % G_P
    row_ok = (tok < q_end) & (offs_m % G_P < G)
    pos = kv_len - q_len + (tok - q_start)
    q_off = tok.to(tl.int64)[:, None] * (HQ * D) + head[:, None] * D + offs_d[None, :]
    io_mask = row_ok[:, None] & (offs_d < D)[None, :]
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    # Keys any row of this block may see, and the tiles every row sees whole (no mask needed).
    p_first = kv_len - q_len + (row0 - q_start)
    p_last = kv_len - q_len + (tl.minimum(row0 + BQ, q_end) - 1 - q_start)
    hi_key = kv_len
    full_hi = kv_len // BLOCK_N
    if CAUSAL or WINDOW > 0:
        hi_key = tl.minimum(hi_key, p_last + 1)
        full_hi = tl.minimum(full_hi, tl.maximum(p_first + 1, 0) // BLOCK_N)
    lo_key = 0
    full_lo = 0
    if WINDOW > 0:
        lo_key = tl.maximum(p_first - WINDOW + 1, 0)
        full_lo = (tl.maximum(p_last - WINDOW + 1, 0) + BLOCK_N - 1) // BLOCK_N
    tile_lo = lo_key // BLOCK_N
    tile_hi = (tl.maximum(hi_key, 0) + BLOCK_N - 1) // BLOCK_N

    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * LOG2E
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], NEG_INIT, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], tl.float32)
    qk_scale = SCALE
    if FP8:
        qk_scale = SCALE * k_scale
    table_row = tables_ptr + tl.minimum(b, B - 1).to(tl.int64) * P
    for tile in range(tile_lo, tile_hi):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_ptr, v_ptr, table_row, kvh * SK_H, tile, kv_len, pos, qk_scale,
            (tile < full_lo) | (tile >= full_hi), BLOCK_N, D, D_P, PAGE, NUM_PAGES, SK_P, SK_T, SOFTCAP,
            WINDOW, CAUSAL, PRECISION)
    if FP8:
        acc = acc * v_scale
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, kv_lens_ptr, cu_ptr, nd_ptr, k_scale_ptr, v_scale_ptr, seg_acc_ptr, seg_ml_ptr,
        T: tl.constexpr, B: tl.constexpr, P: tl.constexpr, HQ: tl.constexpr, G: tl.constexpr, G_P: tl.constexpr,
        QT: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, PAGE: tl.constexpr,
        NUM_PAGES: tl.constexpr, SK_P: tl.constexpr, SK_H: tl.constexpr, SK_T: tl.constexpr, BLOCK_N: tl.constexpr,
        NSEG: tl.constexpr, SCALE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
        CAUSAL: tl.constexpr, FP8: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """3D split-KV decode, grid ``(B, HKV, NSEG)``: program (b, h, s) attends the query tokens of
    sequence b (rows: ``QT`` tokens x ``G_P`` heads of KV head h, ``BLOCK_M >= QT * G_P``) over the
    s-th of NSEG equal runs of its KV tiles. ``QT == 1``: the one token of each sequence b < nd
    whose query is one token; ``QT > 1`` (a short-query step, every query at most QT tokens): the
    first QT tokens of every sequence. Writes unnormalized ``seg_acc: [B * QT, HQ, NSEG, D]`` and
    ``seg_ml: [B * QT, HQ, NSEG, 2]`` (running max in base 2, and sum) at slot ``b * QT + i`` for
    the sequence's token i; other programs exit at once."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seg = tl.program_id(2)
    q_start = tl.load(cu_ptr + b)
    q_end = tl.minimum(tl.load(cu_ptr + b + 1), T)
    if QT == 1:
        if (b >= tl.load(nd_ptr)) | (q_end - q_start != 1):
            return
    if q_start >= q_end:
        return
    q_len = q_end - q_start
    kv_len = tl.minimum(tl.maximum(tl.load(kv_lens_ptr + b), 0), P * PAGE)
    if FP8:
        scales_ok, k_scale, _ = _fp8_scales(k_scale_ptr, v_scale_ptr)
        kv_len = tl.where(scales_ok, kv_len, 0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_P)
    i = offs_m // G_P
    head = kvh * G + offs_m % G_P
    row_ok = (i < QT) & (i < q_len) & (offs_m % G_P < G)
    io_mask = row_ok[:, None] & (offs_d < D)[None, :]
    q = tl.load(q_ptr + (q_start + i).to(tl.int64)[:, None] * (HQ * D) + head[:, None] * D + offs_d[None, :],
                mask=io_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    pos = kv_len - q_len + i
    # Keys any row may see, and the tiles every row sees whole (as in paged_prefill_kernel).
    p_first = kv_len - q_len
    p_last = kv_len - q_len + tl.minimum(q_len, QT) - 1
    hi_key = kv_len
    full_hi = kv_len // BLOCK_N
    if CAUSAL or WINDOW > 0:
        hi_key = tl.minimum(hi_key, p_last + 1)
        full_hi = tl.minimum(full_hi, tl.maximum(p_first + 1, 0) // BLOCK_N)
    lo_key = 0
    full_lo = 0
    if WINDOW > 0:
        lo_key = tl.maximum(p_first - WINDOW + 1, 0)
        full_lo = (tl.maximum(p_last - WINDOW + 1, 0) + BLOCK_N - 1) // BLOCK_N
    tile_lo = lo_key // BLOCK_N
    tile_hi = (tl.maximum(hi_key, 0) + BLOCK_N - 1) // BLOCK_N
    per_seg = (tile_hi - tile_lo + NSEG - 1) // NSEG
    seg_lo = tile_lo + seg * per_seg
    seg_hi = tl.minimum(seg_lo + per_seg, tile_hi)

    m_i = tl.full([BLOCK_M], NEG_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], tl.float32)
    qk_scale = SCALE
    if FP8:
        qk_scale = SCALE * k_scale
    table_row = tables_ptr + b.to(tl.int64) * P
    for tile in range(seg_lo, seg_hi):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_ptr, v_ptr, table_row, kvh * SK_H, tile, kv_len, pos, qk_scale,
            (tile < full_lo) | (tile >= full_hi), BLOCK_N, D, D_P, PAGE, NUM_PAGES, SK_P, SK_T, SOFTCAP,
            WINDOW, CAUSAL, PRECISION)
    row = ((b * QT + i) * HQ + head) * NSEG + seg
    tl.store(seg_acc_ptr + row.to(tl.int64)[:, None] * D + offs_d[None, :], acc, mask=io_mask)
    tl.store(seg_ml_ptr + row * 2, m_i, mask=row_ok)
    tl.store(seg_ml_ptr + row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def paged_decode_reduce_kernel(
        cu_ptr, nd_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr, seg_acc_ptr, seg_ml_ptr, out_ptr,
        T: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr, HQ: tl.constexpr, G: tl.constexpr, G_P: tl.constexpr,
        QT: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, NSEG: tl.constexpr, HAS_SINKS: tl.constexpr,
        FP8: tl.constexpr, WRITE_ALL: tl.constexpr):
    """Merges ``paged_decode_kernel``'s segments: ``out = sum_s 2^(m_s - m) acc_s /
    (sum_s 2^(m_s - m) l_s + 2^(sink - m))``. Grid ``(B, HKV)`` over sequences b < nd (token
    ``cu[b]``; ``QT == 1`` only), or with ``WRITE_ALL`` (decode-only and short-query steps) ``(T,
    HKV)`` over tokens, every token the decode kernel did not attend getting zeros."""
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    if WRITE_ALL:
        b = _find_seq(cu_ptr, r, 0, B - 1, LOG_B, 1, False)
        t = r
    else:
        b = r
        t = tl.load(cu_ptr + b)
    q_start = tl.load(cu_ptr + b)
    q_end = tl.load(cu_ptr + b + 1)
    active = (t >= q_start) & (t < q_end) & (t < T) & (t - q_start < QT)
    if QT == 1:
        active = active & (q_end - q_start == 1) & (b < tl.load(nd_ptr))
    if not WRITE_ALL:
        if not active:
            return
    offs_h = tl.arange(0, G_P)
    offs_s = tl.arange(0, NSEG)
    offs_d = tl.arange(0, D_P)
    head = kvh * G + offs_h
    h_ok = (offs_h < G) & active
    row = ((b * QT + t - q_start) * HQ + head)[:, None] * NSEG + offs_s[None, :]     # [G_P, NSEG]
    m_s = tl.load(seg_ml_ptr + row * 2, mask=h_ok[:, None], other=NEG_INIT)
    l_s = tl.load(seg_ml_ptr + row * 2 + 1, mask=h_ok[:, None], other=0.0)
    m = tl.max(m_s, 1)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=h_ok, other=NEG_INIT) * LOG2E
        m = tl.maximum(m, sink)
    w = tl.exp2(m_s - m[:, None])
    l_sum = tl.sum(w * l_s, 1)
    if HAS_SINKS:
        l_sum += tl.exp2(sink - m)
    d_ok = offs_d < D
    acc_s = tl.load(seg_acc_ptr + row.to(tl.int64)[:, :, None] * D + offs_d[None, None, :],
                    mask=h_ok[:, None, None] & d_ok[None, None, :], other=0.0)  # [G_P, NSEG, D_P]
    acc = tl.sum(w[:, :, None] * acc_s, 1)
    if FP8:
        acc = acc * _fp8_scales(k_scale_ptr, v_scale_ptr)[2]
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    out_mask = ((offs_h < G)[:, None]) & d_ok[None, :]
    tl.store(out_ptr + t.to(tl.int64) * (HQ * D) + head[:, None] * D + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=out_mask)
