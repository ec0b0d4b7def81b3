"""Random paged-attention problems and a dense float64 reference, shared by the backend tests."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn


@dataclasses.dataclass
class Problem:
    q: jax.Array                 # [T_pad, Hq, D]
    cache: jaxattn.KVCache
    meta: jaxattn.AttentionMetadata
    k_dense: list[np.ndarray]    # per sequence [kv_len, Hkv, D] float64, as stored (dequantized)
    v_dense: list[np.ndarray]
    q_lens: list[int]
    kv_lens: list[int]
    owned: np.ndarray            # bool[num_pages], pages some sequence holds


def make_problem(rng: np.random.Generator, *, q_lens, kv_lens, num_q_heads, num_kv_heads, head_dim,
                 page_size, layout="HND", dtype=jnp.float32, kv_dtype=None, extra_pages=3,
                 pad_seqs=1, pad_tokens=3, pages_per_seq=None, max_q_len=None) -> Problem:
    """Sequences in the given order (decodes first is the caller's choice); pages are a random
    permutation of the pool; unowned pages and slots past kv_len hold random garbage."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    tables, need, num_pages = random_tables(rng, kv_lens, page_size, pages_per_seq, extra_pages, pad_seqs)
    fp8 = jnp.dtype(kv_dtype) == jnp.float8_e4m3fn
    shape = ((num_pages, num_kv_heads, page_size, head_dim) if layout == "HND"
             else (num_pages, page_size, num_kv_heads, head_dim))
    scales = (0.5, 0.25) if fp8 else (None, None)
    pools, dense = [], []
    for scale in scales:
        pool = rng.normal(size=shape) * 3
        stored = np.asarray(jnp.asarray(pool / (scale or 1.0), kv_dtype).astype(jnp.float32), np.float64)
        pools.append(jnp.asarray(pool / (scale or 1.0), kv_dtype))
        values = stored * (scale or 1.0)
        per_seq = []
        for b, n in enumerate(kv_lens):
            x = values[tables[b, :need[b]]]                            # [n_pages, ...]
            if layout == "HND":
                x = np.swapaxes(x, 1, 2)
            per_seq.append(x.reshape(-1, num_kv_heads, head_dim)[:n])
        dense.append(per_seq)
    cache = jaxattn.KVCache(pools[0], pools[1],
                            None if not fp8 else jnp.float32(scales[0]),
                            None if not fp8 else jnp.float32(scales[1]), layout)
    num_tokens = sum(q_lens) + pad_tokens
    q = jnp.asarray(rng.normal(size=(num_tokens, num_q_heads, head_dim)), dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * pad_seqs]).astype(np.int32)
    ones = 0
    while ones < len(q_lens) and q_lens[ones] == 1:
        ones += 1
    meta = jaxattn.AttentionMetadata(
        cu_q_lens=jnp.asarray(cu),
        kv_lens=jnp.asarray(list(kv_lens) + [0] * pad_seqs, jnp.int32),
        block_tables=jnp.asarray(tables),
        num_decodes=jnp.asarray(ones, jnp.int32),
        max_q_len=max_q_len,
    )
    owned = np.zeros(num_pages, bool)
    owned[tables[tables > 0]] = True
    return Problem(q, cache, meta, dense[0], dense[1], list(q_lens), list(kv_lens), owned)


def same_shape_problems() -> tuple[Problem, Problem]:
    """Two batches with different lengths, offsets and page tables but the same static shapes (bf16,
    HND, 8/2 heads, D 64, pages of 16, 12 per sequence, equal pools of 61 pages): one compiled step
    must serve both."""
    shape = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, layout="HND", dtype=jnp.bfloat16,
                 pages_per_seq=12, pad_tokens=0)
    first = make_problem(np.random.default_rng(1), q_lens=[60, 40, 28], kv_lens=[60, 90, 150], extra_pages=40,
                         **shape)
    second = make_problem(np.random.default_rng(2), q_lens=[100, 2, 26], kv_lens=[180, 2, 26], extra_pages=45,
                          **shape)
    assert first.q.shape == second.q.shape and first.cache.k_pages.shape == second.cache.k_pages.shape
    return first, second


def random_tables(rng: np.random.Generator, kv_lens, page_size: int, pages_per_seq: int | None, extra_pages: int,
                  pad_seqs: int) -> tuple[np.ndarray, list[int], int]:
    """Block tables of the sequences (then ``pad_seqs`` empty rows) over a random permutation of a
    pool with ``extra_pages`` unowned pages: ``(tables int32[B, P], pages each uses, num_pages)``."""
    need = [-(-n // page_size) for n in kv_lens]
    pages_per_seq = pages_per_seq or max(max(need), 1) + 1
    num_pages = 1 + sum(need) + extra_pages
    perm = rng.permutation(np.arange(1, num_pages))
    tables = np.zeros((len(kv_lens) + pad_seqs, pages_per_seq), np.int32)
    start = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[start:start + n]
        start += n
    return tables, need, num_pages


def reference(problem: Problem, *, scale=None, causal=True, sliding_window=None, softcap=None,
              sinks=None) -> np.ndarray:
    """Dense float64 attention per sequence, docs/design.md semantics; [T_pad, Hq, Dv]."""
    q = np.asarray(problem.q.astype(jnp.float32), np.float64)
    num_q_heads, head_dim = q.shape[1:]
    value_dim = problem.v_dense[0].shape[-1] if problem.v_dense else head_dim
    out = np.zeros(q.shape[:2] + (value_dim,))
    scale = 1 / np.sqrt(head_dim) if scale is None else scale
    start = 0
    for b, (ql, kl) in enumerate(zip(problem.q_lens, problem.kv_lens)):
        k, v = problem.k_dense[b], problem.v_dense[b]
        group = num_q_heads // k.shape[1]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)   # [S, Hq, D]
        qb = q[start:start + ql]
        s = np.einsum("thd,shd->hts", qb, k) * scale
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        pos = np.arange(ql)[:, None] + kl - ql
        key = np.arange(kl)[None, :]
        visible = np.ones((ql, kl), bool)
        if causal:
            visible &= key <= pos
        if sliding_window is not None:
            visible &= (key > pos - sliding_window) & (key <= pos)
        s = np.where(visible[None], s, -np.inf)
        m = s.max(axis=-1, keepdims=True) if kl else np.full((num_q_heads, ql, 1), -np.inf)
        if sinks is not None:
            m = np.maximum(m, np.asarray(sinks, np.float64)[:, None, None])
        m = np.where(np.isfinite(m), m, 0)
        p = np.exp(s - m)
        denom = p.sum(-1, keepdims=True)
        if sinks is not None:
            denom = denom + np.exp(np.asarray(sinks, np.float64)[:, None, None] - m)
        o = np.einsum("hts,shd->thd", p / np.where(denom > 0, denom, 1), v)
        out[start:start + ql] = np.where(visible.any(-1)[:, None, None], o, 0)
        start += ql
    return out


def dot_product_attention_reference(problem: Problem, *, scale=None, sliding_window=None, sinks=None) -> np.ndarray:
    """The same through ``jax.nn.dot_product_attention`` in float32 with an explicit bottom-right
    causal (and window) mask; sinks become an extra zero key whose logit is the sink (via bias)."""
    q = problem.q.astype(jnp.float32)
    out = np.zeros(q.shape, np.float32)
    start = 0
    for b, (ql, kl) in enumerate(zip(problem.q_lens, problem.kv_lens)):
        if kl == 0:
            start += ql
            continue
        k = jnp.asarray(problem.k_dense[b], jnp.float32)
        v = jnp.asarray(problem.v_dense[b], jnp.float32)
        pos = jnp.arange(ql)[:, None] + kl - ql
        key = jnp.arange(kl)[None, :]
        mask = key <= pos
        if sliding_window is not None:
            mask &= key > pos - sliding_window
        mask = jnp.broadcast_to(mask, (q.shape[1], ql, kl))
        bias = None
        if sinks is not None:
            k = jnp.concatenate([k, jnp.zeros_like(k[:1])])
            v = jnp.concatenate([v, jnp.zeros_like(v[:1])])
            mask = jnp.concatenate([mask, jnp.ones_like(mask[..., :1])], axis=-1)
            bias = jnp.zeros(mask.shape, jnp.float32).at[..., -1].set(jnp.asarray(sinks)[:, None])[None]
        o = _dot_product_attention(q[None, start:start + ql], k[None], v[None], bias, mask[None], scale)
        out[start:start + ql] = np.asarray(o[0])
        start += ql
    return out


@functools.partial(jax.jit, static_argnums=5)
def _dot_product_attention(q, k, v, bias, mask, scale):
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale)


def rel_error(x, ref) -> float:
    x = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    assert not np.isnan(x).any(), "NaN in output"
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 4e-3}

# Elementwise tolerances (np.testing.assert_allclose keywords) for two computations of the same
# attention output that may sum in different orders: another CPU's vector width, a sharded vs an
# unsharded call, another batch shape. float32 over tens to hundreds of terms (scores, softmax sum,
# weighted values of magnitude ~1) drifts by a few 1e-7 to a few 1e-6 between such orders, so 1e-5
# relative plus 1e-5 absolute (for outputs near zero); bf16/fp16: the output's own rounding.
ALLCLOSE = {jnp.dtype(jnp.float32): dict(rtol=1e-5, atol=1e-5), jnp.dtype(jnp.bfloat16): dict(rtol=2e-2, atol=2e-2),
            jnp.dtype(jnp.float16): dict(rtol=4e-3, atol=4e-3)}


# ------------------------------------------------------------------ random configurations

PHASES = ("decode", "spec_decode", "prefill", "chunked", "mixed")
RANDOM_SEEDS = range(10)              # two configurations of each phase
# Relative error against float64 by query dtype (bf16 / fp16 rounding); over FP8 pages XQA (trtllm)
# quantizes q and P to e4m3 as well (tests/backends/test_trtllm.py).
RANDOM_TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3}
XQA_FP8_TOLERANCE = 8e-2


@dataclasses.dataclass
class RandomCase:
    """One random paged_attention call: the problem (one sequence's pages possibly broken), the
    options, and the float64 rows every backend must give (zero for padding and the broken one)."""

    problem: Problem
    options: dict
    sinks: jax.Array | None
    broken: int | None          # the sequence whose first page id is outside the pool
    expected: np.ndarray        # [T, Hq, D] float64

    def check(self, out: jax.Array, valid: jax.Array, tolerance: float, who: str) -> None:
        """A call's ``(out, valid)`` against the float64 rows: relative error below ``tolerance``, the
        rows of padding tokens and of the broken sequence exactly zero, and ``valid`` False for the
        broken sequence alone (padding sequences are valid)."""
        out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
        error = rel_error(out, self.expected)
        assert error < tolerance, f"{who}: rel. error {error:.2e} > {tolerance} on {self}"
        zero_rows = ~self.expected.any(axis=(1, 2))
        assert not out[zero_rows].any(), f"{who}: rows of padding or of the broken sequence are not zero on {self}"
        num_seqs = len(self.problem.q_lens)
        assert np.asarray(valid)[:num_seqs].tolist() == [b != self.broken for b in range(num_seqs)], \
            f"{who}: valid is wrong on {self}"

    def __str__(self) -> str:
        p = self.problem
        return (f"q_lens {p.q_lens} kv_lens {p.kv_lens} q {p.q.shape} {p.q.dtype} pages "
                f"{p.cache.k_pages.dtype} {p.cache.layout} page {p.cache.page_size} {self.options} "
                f"sinks {self.sinks is not None} broken {self.broken} max_q_len {p.meta.max_q_len}")


def random_case(seed: int) -> RandomCase:
    """Phase by seed (decode, speculative decode, prefill, chunked prefill, mixed), the rest at
    random: B 1-5, GQA 1-8, head_dim 64/128, pages 16-64 in either layout, bf16/fp16 with FP8
    pages at times, window / softcap / sinks / non-causal, padding, a contract-breaking sequence."""
    rng = np.random.default_rng(1000 + seed)
    phase = PHASES[seed % len(PHASES)]
    batch = int(rng.integers(1, 6))
    max_q_len = None
    if phase == "decode":
        q_lens, max_q_len = [1] * batch, 1
    elif phase == "spec_decode":
        max_q_len = int(rng.integers(2, 7))
        q_lens = [int(rng.integers(1, max_q_len + 1)) for _ in range(batch)]
    else:
        decodes = int(rng.integers(1, batch + 1)) if phase == "mixed" else 0
        q_lens = [1] * decodes + [int(rng.integers(2, 300)) for _ in range(max(batch - decodes, 1))]
    kv_lens = [q if phase == "prefill" else q + int(rng.integers(0, 900)) for q in q_lens]
    num_kv_heads = int(rng.choice([1, 2, 8]))
    dtype = [jnp.bfloat16, jnp.float16][int(rng.random() < 0.25)]
    kv_dtype = jnp.float8_e4m3fn if rng.random() < 0.25 else dtype
    problem = make_problem(rng, q_lens=q_lens, kv_lens=kv_lens, num_q_heads=num_kv_heads * int(rng.choice([1, 4, 8])),
                           num_kv_heads=num_kv_heads, head_dim=int(rng.choice([64, 128])),
                           page_size=int(rng.choice([16, 32, 64])), layout=str(rng.choice(["HND", "NHD"])),
                           dtype=dtype, kv_dtype=kv_dtype, pad_seqs=int(rng.integers(0, 3)),
                           pad_tokens=int(rng.integers(0, 6)), max_q_len=max_q_len)
    options = {}
    if rng.random() < 0.3:
        options["sliding_window"] = int(rng.integers(1, 400))
    if rng.random() < 0.3:
        options["softcap"] = 30.0
    if phase in ("prefill", "chunked") and "sliding_window" not in options and rng.random() < 0.2:
        options["causal"] = False
    sinks = jnp.asarray(rng.normal(size=problem.q.shape[1]), jnp.float32) if rng.random() < 0.3 else None
    expected = reference(problem, sinks=None if sinks is None else np.asarray(sinks), **options)
    broken = int(rng.integers(len(q_lens))) if rng.random() < 0.3 else None
    if broken is not None:
        tables = problem.meta.block_tables.at[broken, 0].set(problem.cache.num_pages + 5)
        problem = dataclasses.replace(problem, meta=dataclasses.replace(problem.meta, block_tables=tables))
        start = sum(q_lens[:broken])
        expected[start:start + q_lens[broken]] = 0
    return RandomCase(problem, options, sinks, broken, expected)
