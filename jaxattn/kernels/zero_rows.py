"""A Triton kernel that zeroes, in place, the output rows an attention kernel did not write.

Kernels that give a sequence without keys no tiles (``fa4``) leave its rows, and the tokens past
the last sequence, unwritten. An XLA select or scatter over the output to zero them is a pass over
all ``T`` rows (a scatter's cost follows its update count, ``T x row`` elements, even when every
index is dropped: 160 us of fa4's 2059 us at prefill B=8 x 4096 on the H100, RESULTS.md section
call_profile). This kernel reads the metadata alone where its rows were written, and writes zeros
only where they were not, in the output's own buffer (aliased).
"""

from __future__ import annotations

import jax
import triton
import triton.language as tl

ROWS = 16            # output rows per program
SEQS = 128           # sequences compared per step
COLS = 1024          # row elements stored per step


@triton.jit
def zero_unwritten_rows_kernel(cu_ptr, used_ptr, out_in_ptr, out_ptr, T: tl.constexpr, B: tl.constexpr,
                               ROW: tl.constexpr, ROWS: tl.constexpr, SEQS: tl.constexpr,
                               COLS: tl.constexpr):
    """Row t of ``out: [T, ROW]`` was written iff ``cu[b] <= t < cu[b] + used[b]`` for some b
    (``cu``: int32 [B + 1] non-decreasing offsets, ``used``: int32 [B] rows written from each)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    written = tl.zeros([ROWS], tl.int32)
    for s0 in range(0, B, SEQS):
        seqs = s0 + tl.arange(0, SEQS)
        start = tl.load(cu_ptr + seqs, mask=seqs < B, other=0)
        end = start + tl.load(used_ptr + seqs, mask=seqs < B, other=0)
        inside = (rows[:, None] >= start[None, :]) & (rows[:, None] < end[None, :])
        written += tl.sum(inside.to(tl.int32), axis=1)
    unwritten = (written == 0) & (rows < T)
    if tl.max(unwritten.to(tl.int32), axis=0) > 0:
        row_base = out_ptr + rows.to(tl.int64)[:, None] * ROW
        for c0 in range(0, ROW, COLS):
            cols = c0 + tl.arange(0, COLS)
            zeros = tl.zeros([ROWS, COLS], out_ptr.dtype.element_ty)
            tl.store(row_base + cols[None, :], zeros, mask=unwritten[:, None] & (cols[None, :] < ROW))


def zero_unwritten_rows(out: jax.Array, cu_q_lens: jax.Array, rows_used: jax.Array) -> jax.Array:
    """``out: [T, ...]`` with every row outside ``[cu_q_lens[b], cu_q_lens[b] + rows_used[b])`` for
    all b zeroed; ``cu_q_lens: int32[B + 1]`` non-decreasing (sanitized), ``rows_used: int32[B]``
    at most each sequence's query length. In place: ``out``'s buffer is reused."""
    from jaxattn.kernels.triton_call import triton_call

    num_tokens = out.shape[0]
    if num_tokens == 0:
        return out
    row = out.size // num_tokens
    flat = out.reshape(num_tokens, row)
    (zeroed,) = triton_call(
        cu_q_lens, rows_used, flat, kernel=zero_unwritten_rows_kernel,
        out_shape=[jax.ShapeDtypeStruct(flat.shape, flat.dtype)], grid=(triton.cdiv(num_tokens, ROWS),),
        input_output_aliases={2: 0}, T=num_tokens, B=rows_used.shape[0], ROW=row, ROWS=ROWS,
        SEQS=min(SEQS, triton.next_power_of_2(rows_used.shape[0])), COLS=min(COLS, triton.next_power_of_2(row)))
    return zeroed.reshape(out.shape)
