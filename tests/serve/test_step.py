"""The engine's jitted step (straight-line code for the GPU) and the packing of a schedule into
its operands."""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from jaxattn.serve.engine import Engine
from jaxattn.serve.models.llama import PRESETS, Llama
from jaxattn.serve.sampling import SamplingBatch, SamplingParams
from jaxattn.serve.scheduler import Request, Row, Schedule
from jaxattn.serve.step import StepBuckets, StepShape, pack_step, page_window


def trace_step(engine: Engine, shape: StepShape):
    """The engine's jitted step traced for one of its step shapes with operands of the shapes
    ``Engine.step`` passes, sampling and prefix-caching operations included."""
    rows = shape.rows
    sampling = SamplingBatch.from_params([SamplingParams(temperature=0.7, top_k=5, top_p=0.9)] * rows,
                                         list(range(1, rows + 1)))
    inputs = dataclasses.replace(engine.runner.padding_inputs(shape, sampled=False), sampling=sampling,
                                 seq_ids=np.arange(rows, dtype=np.int32), q_lens=np.ones((rows,), np.int32))
    return engine.runner.trace(inputs)


def test_step_has_no_loops():
    """The engine step lowers to straight-line code for the GPU: a while loop (e.g.
    jnp.searchsorted's default method) would not be captured into command buffers and would sync
    the host. (The GPU lowering: on the CPU, jax.random's threefry is a rolled loop.)"""
    model = Llama(PRESETS["tiny"], nnx.Rngs(0))
    engine = Engine(model, max_seqs=4, max_seq_len=64, page_size=8, max_step_tokens=16, backend="xla")
    for shape in (engine.buckets.shapes[0], engine.buckets.shapes[-1]):
        hlo = trace_step(engine, shape).lower(lowering_platforms=("cuda",)).as_text()
        assert "stablehlo.while" not in hlo and "stablehlo.sort" not in hlo, shape


def test_buckets():
    """Decode-only steps: the smallest row bucket that holds the rows (one up to 128 rows, then
    128, 256, 512, ..., max_seqs); mixed steps: max_seqs rows and the smallest token bucket
    (max(max_seqs, 64), doubling, ..., the budget)."""
    buckets = StepBuckets.default(max_seqs=100, max_step_tokens=1000)
    assert buckets.rows == (100,) and buckets.tokens == (100, 228, 356, 612, 1000)
    assert StepBuckets.default(max_seqs=600, max_step_tokens=600).rows == (128, 256, 512, 600)
    assert StepBuckets.default(max_seqs=4, max_step_tokens=16) == StepBuckets((4,), (16,))
    assert len(buckets.shapes) == 6
    decode = _request(0, [1], [2], computed=1, slot=0, blocks=[0])
    rows = [Row(decode, 1, 1, True)] * 17
    assert buckets.shape(Schedule(rows, [], [], [], [])) == StepShape(100, 100, 1)
    big = StepBuckets.default(max_seqs=600, max_step_tokens=600)
    assert big.shape(Schedule(rows * 20, [], [], [], [])) == StepShape(512, 512, 1)
    assert big.shape(Schedule(rows * 7, [], [], [], [])) == StepShape(128, 128, 1)
    chunk = Row(_request(1, list(range(300)), [], computed=0, slot=1, blocks=[]), 0, 300, True)
    assert buckets.shape(Schedule(rows + [chunk], [], [], [], [])) == StepShape(100, 356, 356)
    assert page_window(356, 16) == 24 and page_window(400, 16) == 26 and page_window(1, 16) == 1


def _request(id: int, prompt: list[int], output: list[int], computed: int, slot: int, blocks: list[int],
             sampling: SamplingParams = SamplingParams()) -> Request:
    return Request(id, np.asarray(prompt, np.int32), 8, sampling, seed=100 + id, output=list(output),
                   computed=computed, slot=slot, blocks=blocks)


def test_pack_step_packs_rows_in_order():
    """A decode whose input the previous step sampled (row 5 there), then a new request starting
    on two cached pages (page size 2) with a 3-token chunk: tokens packed in row order, the
    pending token taken on the device, the admitted row's cached pages to attach, -1 padding."""
    decode = _request(0, [5, 6, 7], [8], computed=4, slot=2, blocks=[0, 0, 0])
    decode.pending = 2                                # the input, and the token this row samples
    admitted = _request(1, [1, 2, 3, 4, 9, 10, 11], [], computed=7, slot=0, blocks=[6, 7, 0, 0],
                        sampling=SamplingParams(temperature=0.5, seed=3))
    schedule = Schedule(rows=[Row(decode, 4, 1, True), Row(admitted, 4, 3, True)], admitted=[admitted],
                        evicted=[4], release=[1], mark=[9])
    shape = StepShape(rows=3, tokens=7, max_q_len=7)
    inputs = pack_step(schedule, shape, max_seqs=3, page_size=2, max_pages_per_seq=5, step_pages=4,
                       previous_rows={decode: 5})
    np.testing.assert_array_equal(inputs.tokens, [0, 9, 10, 11, 0, 0, 0])
    np.testing.assert_array_equal(inputs.token_src, [5, -1, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(inputs.seq_ids, [2, 0, -1])
    np.testing.assert_array_equal(inputs.q_lens, [1, 3, 0])
    np.testing.assert_array_equal(inputs.release_ids, [1, -1, -1])
    np.testing.assert_array_equal(inputs.prefix.mark, [9, -1, -1, -1])
    np.testing.assert_array_equal(inputs.prefix.evict, [4, -1, -1, -1])
    np.testing.assert_array_equal(inputs.prefix.attach, [[0] * 5, [6, 7, 0, 0, 0], [0] * 5])
    np.testing.assert_array_equal(inputs.sampling.temperature, [0.0, 0.5, 0.0])
    assert not inputs.deferred and inputs.grammars == []    # no row has a grammar: tokens picked in the step

    greedy = pack_step(Schedule([Row(decode, 3, 1, True)], [], [], [], []), StepShape(3, 3, 1), max_seqs=3,
                       page_size=2, max_pages_per_seq=5, step_pages=None, previous_rows={})
    assert greedy.tokens.tolist() == [8, 0, 0] and greedy.sampling is None and greedy.prefix is None
