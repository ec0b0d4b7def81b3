"""``AttentionMetadata.sanitize`` as one Triton kernel.

XLA runs the jnp formulation as 3-5 small kernels (a cumulative max of the offsets, a reduction of
the page checks over the block tables, selects on its results), about 1 us each: on the GPU that is
most of what a small attention call pays besides its kernel (RESULTS.md section call_profile). Here
program b of a ``(B,)`` grid checks sequence b and writes its sanitized row, in one launch. The
semantics are ``AttentionMetadata.sanitize``'s, which stays the reference (tests compare the two).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

COLS = 1024          # block-table entries checked per step
_INT32_MIN = tl.constexpr(-2147483647 - 1)


@triton.jit
def sanitize_kernel(cu_ptr, kv_ptr, tables_ptr, cu_out_ptr, kv_out_ptr, tables_out_ptr, valid_out_ptr,
                    T: tl.constexpr, B: tl.constexpr, P: tl.constexpr, PAGE: tl.constexpr,
                    NUM_PAGES: tl.constexpr, MAX_Q: tl.constexpr, B_P: tl.constexpr, COLS: tl.constexpr):
    """Program b sanitizes sequence b: ``cu: [B+1]``, ``kv: [B]``, ``tables: [B, P]`` in, the same
    sanitized out, and ``valid_out: [B]`` (1 where b keeps the contract). ``MAX_Q``: the step's
    ``max_q_len``, 0 for none; ``B_P``: a power of two above B."""
    b = tl.program_id(0)
    idx = tl.arange(0, B_P)
    offsets = tl.load(cu_ptr + idx, mask=idx <= B, other=0)
    # Sequence b's offsets after the running maximum (cummax), then clipped to [0, T].
    start_raw = tl.max(tl.where(idx <= b, offsets, _INT32_MIN), axis=0)
    end_raw = tl.max(tl.where(idx <= b + 1, offsets, _INT32_MIN), axis=0)
    start = tl.minimum(tl.maximum(start_raw, 0), T)
    end = tl.minimum(tl.maximum(end_raw, 0), T)
    q_len = end - start
    kv_len = tl.load(kv_ptr + b)
    capacity = P * PAGE
    valid = (start == tl.load(cu_ptr + b)) & (end == tl.load(cu_ptr + b + 1))
    valid &= (kv_len >= q_len) & (kv_len <= capacity)
    if MAX_Q > 0:
        valid &= q_len <= MAX_Q
    pages_used = (tl.maximum(tl.minimum(kv_len, capacity), 0) + PAGE - 1) // PAGE

    row = tables_ptr + b.to(tl.int64) * P
    bad = tl.zeros([COLS], tl.int32)
    for p0 in range(0, P, COLS):
        cols = p0 + tl.arange(0, COLS)
        pages = tl.load(row + cols, mask=cols < P, other=1)
        bad += ((cols < pages_used) & ((pages < 1) | (pages >= NUM_PAGES))).to(tl.int32)
    valid &= tl.sum(bad, axis=0) == 0
    # Entries past the sequence's keys repeat its first page (the null page without keys).
    first = 0
    if P > 0:
        first = tl.load(row)
    own = tl.where(valid & (pages_used > 0), first, 0)
    row_out = tables_out_ptr + b.to(tl.int64) * P
    for p0 in range(0, P, COLS):
        cols = p0 + tl.arange(0, COLS)
        pages = tl.load(row + cols, mask=cols < P, other=0)
        tl.store(row_out + cols, tl.where(valid & (cols < pages_used), pages, own), mask=cols < P)

    tl.store(kv_out_ptr + b, tl.where(valid, kv_len, 0))
    tl.store(valid_out_ptr + b, valid.to(tl.int32))
    tl.store(cu_out_ptr + b + 1, end)
    if b == 0:
        tl.store(cu_out_ptr, start)


@functools.partial(jax.jit, static_argnames=("num_tokens", "num_pages", "page_size", "max_q_len"))
def sanitize(cu_q_lens: jax.Array, kv_lens: jax.Array, block_tables: jax.Array, *, num_tokens: int, num_pages: int,
             page_size: int, max_q_len: int | None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``AttentionMetadata.sanitize``'s arrays: ``(cu_q_lens [B+1], kv_lens [B], block_tables [B, P],
    valid bool[B])`` sanitized for ``q: [num_tokens, ...]`` over a pool of ``num_pages`` pages of
    ``page_size`` tokens; inputs int32. Jitted: a primitive without an eager rule still runs
    from eager ``paged_attention`` calls."""
    from jaxattn.kernels.triton_call import triton_call

    batch, width = block_tables.shape
    cu, kv, tables, valid = triton_call(
        cu_q_lens, kv_lens, block_tables, kernel=sanitize_kernel,
        out_shape=[jax.ShapeDtypeStruct(cu_q_lens.shape, jnp.int32), jax.ShapeDtypeStruct(kv_lens.shape, jnp.int32),
                   jax.ShapeDtypeStruct(block_tables.shape, jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32)],
        grid=(batch,), num_warps=4, num_stages=1, T=num_tokens, B=batch, P=width, PAGE=page_size,
        NUM_PAGES=num_pages, MAX_Q=max_q_len or 0, B_P=triton.next_power_of_2(batch + 1),
        COLS=min(COLS, triton.next_power_of_2(max(width, 1))))
    return cu, kv, tables, valid != 0
