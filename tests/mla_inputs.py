"""Random paged MLA problems, broken metadata for them, and float64 references (expanded and
absorbed), shared by the MLA tests."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn
from jaxattn.backends import xla
from jaxattn.backends.base import AttentionParams
from jaxattn.mla import absorb_query
from tests.paged_inputs import Problem, rel_error, random_tables, reference
from tests.xla_dump import run_with_dump, thunk_sequences, top_level_thunks

DEEPSEEK = dict(kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128, page_size=64)

BAD_PAGE_IDS = (-1, 0, 2**30)   # and num_pages


@dataclasses.dataclass
class MLAProblem:
    q_nope: jax.Array            # [T_pad, Hq, Dn]
    q_rope: jax.Array            # [T_pad, Hq, Dr]
    w_uk: jax.Array              # [R, Hq, Dn]
    w_uv: jax.Array              # [R, Hq, Dv]
    cache: jaxattn.MLACache
    meta: jaxattn.AttentionMetadata
    latents: list[np.ndarray]    # per sequence [kv_len, R + Dr] float64, as stored
    q_lens: list[int]
    kv_lens: list[int]
    tables: np.ndarray           # int32 [B, P]

    @property
    def scale(self) -> float:
        return float(1 / np.sqrt(self.q_nope.shape[2] + self.q_rope.shape[2]))

    @property
    def q(self) -> jax.Array:
        """The whole query ``[T_pad, Hq, Dn + Dr]`` (``mla_prefill``'s one internal form)."""
        return jnp.concatenate([self.q_nope, self.q_rope], -1)

    @property
    def q_latent(self) -> jax.Array:
        return absorb_query(self.q_nope, self.w_uk)

    def expanded_reference(self, causal: bool = True) -> np.ndarray:
        """Float64 attention over per-head K/V expanded from the latents: ``[T_pad, Hq, Dv]``."""
        rank = self.cache.kv_lora_rank
        w_uk, w_uv = (np.asarray(w.astype(jnp.float32), np.float64) for w in (self.w_uk, self.w_uv))
        heads = w_uk.shape[1]
        k = [np.concatenate([np.einsum("sr,rhn->shn", x[:, :rank], w_uk),
                             np.repeat(x[:, None, rank:], heads, axis=1)], axis=-1) for x in self.latents]
        v = [np.einsum("sr,rhv->shv", x[:, :rank], w_uv) for x in self.latents]
        return self._reference(self.q, k, v, causal)

    def absorbed_reference(self, q_latent: jax.Array, causal: bool = True) -> np.ndarray:
        """Float64 MQA of ``[q_latent, q_rope]`` over the latents (values ``c_kv``): ``[T_pad, Hq, R]``."""
        rank = self.cache.kv_lora_rank
        return self._reference(jnp.concatenate([q_latent.astype(jnp.float32), self.q_rope.astype(jnp.float32)], -1),
                               [x[:, None] for x in self.latents], [x[:, None, :rank] for x in self.latents], causal)

    def _reference(self, q, k, v, causal: bool = True) -> np.ndarray:
        problem = Problem(q, None, self.meta, k, v, self.q_lens, self.kv_lens, None)
        return reference(problem, scale=self.scale, causal=causal)

    def stale_slots_poisoned(self) -> jaxattn.MLACache:
        """The cache with NaN in every slot past its sequence's ``kv_lens`` on the pages it owns
        (stale latents, which no kernel may read)."""
        pages = np.array(self.cache.pages.astype(jnp.float32))
        for b, n in enumerate(self.kv_lens):
            last, used = divmod(n, self.cache.page_size)
            if used:
                pages[self.tables[b, last], used:] = np.nan
        return dataclasses.replace(self.cache, pages=jnp.asarray(pages, self.cache.dtype))

    def without(self, broken: np.ndarray) -> "MLAProblem":
        """The same problem with the broken sequences' keys removed (their rows are zeros)."""
        return dataclasses.replace(self, kv_lens=[0 if bad else n for bad, n in zip(broken, self.kv_lens)],
                                   latents=[x[:0] if bad else x for bad, x in zip(broken, self.latents)])


def make_mla_problem(rng: np.random.Generator, *, q_lens, kv_lens, num_q_heads, kv_lora_rank, rope_dim, nope_dim,
                     v_dim, page_size, dtype=jnp.float32, kv_dtype=None, pages_per_seq=None, pad_seqs=1, pad_tokens=2,
                     extra_pages=3, max_q_len=None) -> MLAProblem:
    """Sequences in the given order; pages are a random permutation of the pool, and every page no
    sequence owns (page 0 included) holds NaN. ``kv_dtype`` (default ``dtype``) float8_e4m3fn
    stores the latents divided by a scale of 0.5."""
    tables, need, num_pages = random_tables(rng, kv_lens, page_size, pages_per_seq, extra_pages, pad_seqs)
    width = kv_lora_rank + rope_dim
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    scale = 0.5 if jnp.dtype(kv_dtype) == jnp.float8_e4m3fn else None
    stored = jnp.asarray(rng.normal(size=(num_pages, page_size, width)) * 3 / (scale or 1.0), kv_dtype)
    pool = np.asarray(stored.astype(jnp.float32), np.float64)
    owned = np.zeros(num_pages, bool)
    owned[tables[tables > 0]] = True
    pool[~owned] = np.nan
    stored = jnp.asarray(pool, kv_dtype)
    pool *= scale or 1.0
    latents = [pool[tables[b, :need[b]]].reshape(-1, width)[:n] for b, n in enumerate(kv_lens)]
    num_tokens = sum(q_lens) + pad_tokens
    rand = lambda *shape, scale=1.0: jnp.asarray(rng.normal(size=shape) * scale, dtype)  # noqa: E731
    cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * pad_seqs]).astype(np.int32)
    ones = 0
    while ones < len(q_lens) and q_lens[ones] == 1:
        ones += 1
    meta = jaxattn.AttentionMetadata(
        cu_q_lens=jnp.asarray(cu), kv_lens=jnp.asarray(list(kv_lens) + [0] * pad_seqs, jnp.int32),
        block_tables=jnp.asarray(tables), num_decodes=jnp.asarray(ones, jnp.int32), max_q_len=max_q_len)
    return MLAProblem(
        q_nope=rand(num_tokens, num_q_heads, nope_dim), q_rope=rand(num_tokens, num_q_heads, rope_dim),
        w_uk=rand(kv_lora_rank, num_q_heads, nope_dim, scale=kv_lora_rank ** -0.5),
        w_uv=rand(kv_lora_rank, num_q_heads, v_dim, scale=kv_lora_rank ** -0.5),
        cache=jaxattn.MLACache(stored, None if scale is None else jnp.float32(scale), kv_lora_rank), meta=meta,
        latents=latents,
        q_lens=list(q_lens), kv_lens=list(kv_lens), tables=tables)


def break_metadata(rng: np.random.Generator, problem: MLAProblem, faults: list[str]
                   ) -> tuple[jaxattn.AttentionMetadata, np.ndarray]:
    """The problem's metadata with ``faults[b]`` ("none", "page": a bad id among its pages,
    "short": kv_len < q_len, "long": kv_len past its block-table row) applied to sequence b, and
    which sequences then break the contract (those, and queries longer than ``meta.max_q_len``)."""
    page_size, num_pages = problem.cache.page_size, problem.cache.num_pages
    kv_in, tables = np.array(problem.meta.kv_lens), problem.tables.copy()
    broken = np.zeros(len(kv_in), bool)
    for b, fault in enumerate(faults):
        used = -(-problem.kv_lens[b] // page_size)
        if fault == "page" and used:
            tables[b, rng.integers(used)] = rng.choice(BAD_PAGE_IDS + (num_pages,))
        elif fault == "short" and problem.q_lens[b]:
            kv_in[b] = problem.q_lens[b] - 1
        elif fault == "long":
            kv_in[b] = tables.shape[1] * page_size + 1 + rng.integers(5)
        else:
            continue
        broken[b] = True
    if problem.meta.max_q_len is not None:
        broken[:len(problem.q_lens)] |= np.array(problem.q_lens) > problem.meta.max_q_len
    meta = dataclasses.replace(problem.meta, kv_lens=jnp.asarray(kv_in, jnp.int32), block_tables=jnp.asarray(tables))
    return meta, broken


def check_deepseek_decode(backend: str, num_q_heads: int, kv_len: int) -> None:
    """GPU: decode at DeepSeek's shapes in bfloat16 (32768 keys over B sequences of kv_len / 2 ..
    kv_len keys) through ``backend`` against the xla backend and the float64 reference; padding
    tokens are zero."""
    rng = np.random.default_rng(kv_len + num_q_heads)
    batch = max(1, 32768 // kv_len)
    kv_lens = [int(x) for x in rng.integers(kv_len // 2, kv_len + 1, batch)]
    problem = make_mla_problem(rng, q_lens=[1] * batch, kv_lens=kv_lens, num_q_heads=num_q_heads, max_q_len=1,
                               dtype=jnp.bfloat16, **DEEPSEEK)
    run = jax.jit(lambda ql, qr, c, m: jaxattn.mla_paged_attention(ql, qr, c, m, scale=problem.scale, backend=backend))
    out = run(problem.q_latent, problem.q_rope, problem.cache, problem.meta)
    params = AttentionParams(scale=problem.scale, causal=True, sliding_window=None, softcap=None, has_sinks=False)
    assert rel_error(out, xla.mla_attention(problem.q_latent, problem.q_rope, problem.cache, problem.meta, params)) < 2e-2
    assert rel_error(out, problem.absorbed_reference(problem.q_latent)) < 2e-2
    assert not np.asarray(out[batch:].astype(jnp.float32)).any()


def check_deepseek_fp8_pool(backend: str, num_q_heads: int, max_q_len: int) -> None:
    """GPU: 16 sequences of ``max_q_len`` bf16 query tokens over FP8 latents (stored divided by a
    scale of 0.5) through ``backend``, against the float64 reference; every sequence is valid."""
    rng = np.random.default_rng(num_q_heads + max_q_len)
    problem = make_mla_problem(rng, q_lens=[max_q_len] * 16, kv_lens=[int(x) for x in rng.integers(2048, 4097, 16)],
                               num_q_heads=num_q_heads, max_q_len=max_q_len, dtype=jnp.bfloat16,
                               kv_dtype=jnp.float8_e4m3fn, **DEEPSEEK)
    run = jax.jit(lambda ql, qr, c, m: jaxattn.mla_paged_attention(ql, qr, c, m, scale=problem.scale, backend=backend,
                                                                   return_status=True))
    out, valid = run(problem.q_latent, problem.q_rope, problem.cache, problem.meta)
    assert np.asarray(valid).all()
    assert rel_error(out, problem.absorbed_reference(problem.q_latent)) < 2e-2


def check_deepseek_broken_sequences(backend: str, num_q_heads: int, q_lens: list[int], causal: bool = True) -> None:
    """GPU: sequences of ``q_lens`` query tokens (``max_q_len`` their maximum) at DeepSeek's shapes
    through ``backend``, with every fault of ``break_metadata`` and NaN in every unowned page:
    broken sequences are flagged and zero, the rest match the float64 reference (fresh seed, in
    the failure message)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    kv_lens = [int(rng.integers(q, 2049)) for q in q_lens]
    problem = make_mla_problem(rng, q_lens=q_lens, kv_lens=kv_lens, num_q_heads=num_q_heads, max_q_len=max(q_lens),
                               dtype=jnp.bfloat16, **DEEPSEEK)
    meta, broken = break_metadata(rng, problem, ["page", "none", "short", "long", "none", "page", "none", "none"])
    run = jax.jit(lambda ql, qr, c, m: jaxattn.mla_paged_attention(ql, qr, c, m, scale=problem.scale, causal=causal,
                                                                   backend=backend, return_status=True))
    out, valid = run(problem.q_latent, problem.q_rope, problem.cache, meta)
    np.testing.assert_array_equal(valid, ~broken, err_msg=f"seed {seed}")
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert not np.isnan(out).any(), f"a page the sequence does not own reached its output (seed {seed})"
    expected = problem.without(broken).absorbed_reference(problem.q_latent, causal)
    assert rel_error(out, expected) < 2e-2, f"seed {seed}"


def check_deepseek_prefill(backend: str, num_q_heads: int, page_size: int = 64, causal: bool = True,
                           kv_dtype=None) -> None:
    """GPU: ``mla_prefill`` at DeepSeek dims (Dn 128 + Dr 64 keys, Dv 128 values), bf16 queries,
    chunked prefill over cached context, a decode and padding, through ``backend`` against the
    xla backend and the float64 reference; padding rows are zero. The query whole and as its two
    parts give the same output."""
    rng = np.random.default_rng(num_q_heads + page_size)
    problem = make_mla_problem(rng, num_q_heads=num_q_heads, q_lens=[1, 200, 64, 9], kv_lens=[700, 200, 1000, 9],
                               dtype=jnp.bfloat16, kv_dtype=kv_dtype, **{**DEEPSEEK, "page_size": page_size})
    rest = (problem.cache, problem.meta, problem.w_uk, problem.w_uv)
    run = {name: jax.jit(lambda *a, name=name: jaxattn.mla_prefill(*a, scale=problem.scale, causal=causal,
                                                                   backend=name))
           for name in (backend, "xla")}
    out = run[backend](problem.q, None, *rest)
    np.testing.assert_array_equal(np.asarray(run[backend](problem.q_nope, problem.q_rope, *rest)), np.asarray(out))
    assert rel_error(out, run["xla"](problem.q, None, *rest)) < 2e-2
    assert rel_error(out, problem.expanded_reference(causal)) < 2e-2
    assert not np.asarray(out[sum(problem.q_lens):].astype(jnp.float32)).any()


def check_deepseek_prefill_broken_sequences(backend: str) -> None:
    """GPU: ``mla_prefill`` (the query whole) through ``backend`` with every fault at DeepSeek dims (16 heads):
    broken sequences get zero rows and a False flag, the others match the float64 reference, no
    unowned page reaches an output (fresh seed, in the failure message)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    q_lens = [1, 150, 64, 9, 40, 1]
    kv_lens = [700, 300, 1000, 9, 40, 65]
    problem = make_mla_problem(rng, num_q_heads=16, q_lens=q_lens, kv_lens=kv_lens, max_q_len=150,
                               dtype=jnp.bfloat16, **DEEPSEEK)
    meta, broken = break_metadata(rng, problem, ["page", "none", "short", "none", "long", "none"])
    run = jax.jit(lambda *a: jaxattn.mla_prefill(*a, scale=problem.scale, backend=backend, return_status=True))
    out, valid = run(problem.q, None, problem.cache, meta, problem.w_uk, problem.w_uv)
    np.testing.assert_array_equal(valid, ~broken, err_msg=f"seed {seed}")
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert not np.isnan(out).any(), f"a page the sequence does not own reached its output (seed {seed})"
    assert rel_error(out, problem.without(broken).expanded_reference()) < 2e-2, f"seed {seed}"


_CAPTURE_SCRIPT = """
import json
import jax, jax.numpy as jnp, numpy as np
import jaxattn
from tests.mla_inputs import DEEPSEEK, make_mla_problem
from tests.paged_inputs import rel_error

problem = make_mla_problem(np.random.default_rng(0), q_lens=[1] * 8, kv_lens=[3000] * 8, num_q_heads={heads},
                           max_q_len=1, dtype=jnp.bfloat16, **DEEPSEEK)
{setup}
step = jax.jit(lambda ql, qr, c, m: jaxattn.mla_paged_attention(ql, qr, c, m, scale=problem.scale,
                                                                backend="{backend}") * 2)
args = (problem.q_latent, problem.q_rope, problem.cache, problem.meta)
outs = [step(*args).block_until_ready() for _ in range(3)]
errors = [rel_error(o, problem.absorbed_reference(problem.q_latent) * 2) for o in outs]
print(json.dumps(dict(errors=errors)))
"""


def check_captured_in_command_buffer(tmp_path, backend: str, num_q_heads: int, setup: str = "",
                                     min_custom_calls: int = 1) -> None:
    """GPU: a jitted decode step (8 sequences of 3000 keys, run three times) through ``backend``
    is right and runs inside one kCommandBuffer with at least ``min_custom_calls`` custom calls in
    it; ``setup``: script lines run before the step is built."""
    script = _CAPTURE_SCRIPT.format(heads=num_q_heads, backend=backend, setup=setup)
    run = run_with_dump(script, tmp_path, timeout=300)
    errors = json.loads(run.stdout.strip().splitlines()[-1])["errors"]
    assert max(errors) < 2e-2, errors
    for name, thunks in thunk_sequences(tmp_path, "jit__lambda").items():
        top = top_level_thunks(thunks)
        assert "kCommandBuffer" in top and "kCustomCall" not in top, (name, thunks[-3000:])
        assert thunks.split("\n\n")[0].count(": kCustomCall") >= min_custom_calls, (name, thunks[-3000:])
