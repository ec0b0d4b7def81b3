"""The engine's jitted step (straight-line code for the GPU) and the packing of a schedule into
its operands."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxattn.engine import Engine
from jaxattn.engine_step import PrefixOps, pack_step
from jaxattn.models.llama import PRESETS, Llama
from jaxattn.sampling import SamplingBatch, SamplingParams
from jaxattn.scheduler import Request, Schedule


def trace_step(engine: Engine, max_q_len: int):
    """The engine's jitted step traced for one of its two step shapes (decode-only: ``max_q_len``
    1; mixed: ``chunk_size``) with operands of the shapes ``Engine.step`` passes, sampling and
    prefix-caching operations included."""
    rows = engine.max_seqs
    num_tokens = rows if max_q_len == 1 else rows + engine.chunk_size
    sampling = SamplingBatch.from_params([SamplingParams(temperature=0.7, top_k=5, top_p=0.9)] * rows,
                                         list(range(1, rows + 1)))
    prefix = PrefixOps(mark=np.full(engine._step_pages, -1, np.int32), evict=np.full(engine._step_pages, -1, np.int32),
                       attach=np.zeros((rows, engine.table.max_pages_per_seq), np.int32))
    return engine._step.trace(
        engine._weights, engine.caches, engine.table, jnp.full((rows,), -1, jnp.int32),
        jnp.zeros((num_tokens,), jnp.int32), jnp.arange(rows, dtype=jnp.int32), jnp.ones((rows,), jnp.int32),
        sampling, prefix, max_q_len=max_q_len, backend=engine.backend)


def test_step_has_no_loops():
    """The engine step lowers to straight-line code for the GPU: a while loop (e.g.
    jnp.searchsorted's default method) would not be captured into command buffers and would sync
    the host. (The GPU lowering: on the CPU, jax.random's threefry is a rolled loop.)"""
    model = Llama(PRESETS["tiny"], nnx.Rngs(0))
    engine = Engine(model, max_seqs=4, max_seq_len=64, page_size=8, chunk_size=16, backend="xla")
    for max_q_len in (1, engine.chunk_size):
        hlo = trace_step(engine, max_q_len).lower(lowering_platforms=("cuda",)).as_text()
        assert "stablehlo.while" not in hlo and "stablehlo.sort" not in hlo, max_q_len


def _request(id: int, prompt: list[int], output: list[int], computed: int, slot: int, blocks: list[int],
             sampling: SamplingParams = SamplingParams()) -> Request:
    return Request(id, np.asarray(prompt, np.int32), 8, sampling, seed=100 + id, output=list(output),
                   computed=computed, slot=slot, blocks=blocks)


def test_pack_step_packs_rows_in_order():
    """A decode, then a new request starting on two cached pages (page size 2) with a 3-token
    chunk: tokens packed in row order, the admitted row's cached pages to attach, -1 padding."""
    decode = _request(0, [5, 6, 7], [8], computed=3, slot=2, blocks=[0, 0])
    admitted = _request(1, [1, 2, 3, 4, 9, 10, 11], [], computed=4, slot=0, blocks=[6, 7, 0, 0],
                        sampling=SamplingParams(temperature=0.5, seed=3))
    schedule = Schedule(rows=[(decode, 1), (admitted, 3)], admitted=[admitted], evicted=[4], release=[1], mark=[9])
    inputs = pack_step(schedule, max_seqs=3, chunk_size=4, page_size=2, max_pages_per_seq=5, step_pages=4)
    np.testing.assert_array_equal(inputs.tokens, [8, 9, 10, 11, 0, 0, 0])      # max_seqs + chunk_size
    np.testing.assert_array_equal(inputs.seq_ids, [2, 0, -1])
    np.testing.assert_array_equal(inputs.q_lens, [1, 3, 0])
    np.testing.assert_array_equal(inputs.release_ids, [1, -1, -1])
    np.testing.assert_array_equal(inputs.prefix.mark, [9, -1, -1, -1])
    np.testing.assert_array_equal(inputs.prefix.evict, [4, -1, -1, -1])
    np.testing.assert_array_equal(inputs.prefix.attach, [[0] * 5, [6, 7, 0, 0, 0], [0] * 5])
    np.testing.assert_array_equal(inputs.sampling.temperature, [0.0, 0.5, 0.0])
    assert inputs.max_q_len == 4

    decodes = pack_step(Schedule([(decode, 1)], [], [], [], []), max_seqs=3, chunk_size=4, page_size=2,
                        max_pages_per_seq=5, step_pages=4)
    assert decodes.max_q_len == 1 and decodes.tokens.tolist() == [8, 0, 0]
