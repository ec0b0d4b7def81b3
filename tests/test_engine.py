"""The engine: continuous batching with chunked prefill gives the dense model's greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jaxattn.engine import Engine
from jaxattn.models.llama import PRESETS, Llama
from tests.models.test_llama import dense_greedy


def test_continuous_batching_matches_dense_greedy():
    model = Llama(PRESETS["tiny"], nnx.Rngs(0))
    rng = np.random.default_rng()
    # more requests than slots, prompts longer than a chunk, different lengths
    engine = Engine(model, max_seqs=3, max_seq_len=48, page_size=8, chunk_size=16, backend="xla")
    requests = [engine.add_request(rng.integers(0, 512, size=n), m)
                for n, m in ((5, 4), (33, 3), (1, 6), (20, 2), (17, 5))]
    done = engine.run()
    assert [r.id for r in done] == [r.id for r in requests]
    for r in done:
        assert r.output == dense_greedy(model, r.prompt, r.max_new_tokens), r.id
    # everything is released once the next step runs: the pool drains back to full
    engine.add_request([1, 2, 3], 1)
    engine.run()
    engine.step()
    assert int(engine.table.num_free) == engine.table.num_pages - 1


def test_add_request_errors():
    engine = Engine(Llama(PRESETS["tiny"], nnx.Rngs(0)), max_seqs=2, max_seq_len=16, page_size=8, chunk_size=8)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        engine.add_request(np.arange(10), 7)
    with pytest.raises(ValueError, match="non-empty prompt"):
        engine.add_request([], 3)


_DECODE_STEP_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jaxattn.engine import Engine
from jaxattn.models.llama import PRESETS, Llama

cfg = PRESETS["small"].replace(vocab_size=1024, dim=512, num_layers=2, num_q_heads=8, num_kv_heads=2,
                               hidden_dim=1024)
engine = Engine(Llama(cfg, nnx.Rngs(0)), max_seqs=8, max_seq_len=256, page_size=64, chunk_size=64)
for n in (40, 100, 7):
    engine.add_request(np.arange(n) % 1000, 12)
engine.run()
"""


@pytest.mark.gpu
def test_gpu_decode_step_runs_in_command_buffers(tmp_path):
    """Every custom call of the jitted decode step (attention in every layer) runs inside an XLA
    command buffer: none is left to run thunk by thunk."""
    from tests.xla_dump import run_with_dump, thunk_sequences, top_level_thunks
    run_with_dump(_DECODE_STEP_SCRIPT, tmp_path)
    steps = thunk_sequences(tmp_path, "jit_step")
    assert len(steps) == 2, list(steps)            # the decode-only and the mixed step
    for name, thunks in steps.items():
        top = top_level_thunks(thunks)
        assert "kCommandBuffer" in top, (name, thunks[-3000:])
        assert "kCustomCall" not in top, (name, top)
