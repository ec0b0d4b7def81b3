"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent pool (``MLACache``).

Each token's KV is one latent ``[c_kv, k_rope]`` (``R = kv_lora_rank``, 512, plus ``Dr``, 64), and
head h's key and value are ``[c_kv W_UK[:, h], k_rope]`` and ``c_kv W_UV[:, h]`` (``w_uk: [R, Hq, Dn]``,
``w_uv: [R, Hq, Dv]``, the two halves of DeepSeek's ``kv_b_proj``). Two equal forms of the attention:

* ``mla_paged_attention`` (decode, speculative decode, any query length): absorbed, in the latent
  space. The caller folds ``W_UK`` into the query (``absorb_query``), every head attends over the
  latents as one shared KV head (logits ``scale * (q_latent . c_kv + q_rope . k_rope)``, values
  ``c_kv``), and ``project_values`` applies ``W_UV`` to the ``[T, Hq, R]`` output. Reads ``R + Dr``
  values per key for all heads.
* ``mla_prefill`` (long queries): the latents of each sequence's keys are expanded to per-head K
  (``Dn + Dr``, 192) and V (``Dv``, 128) and attended as ordinary multi-head attention, which costs
  fewer FLOPs per (query, key) pair when queries are many.

Both follow ``paged_attention``'s contract: packed ragged queries, bottom-right causal masks, the
step's latents already written to the pool, the same ``AttentionMetadata`` and bad-data rules
(broken sequences get zero rows and ``valid=False``; every sequence, when an FP8 pool's scale is
not positive and finite), zero rows for padding.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxattn import backends, dispatch
from jaxattn.attention import check_metadata, sanitize
from jaxattn.backends.base import AttentionParams, Call
from jaxattn.checks import is_real
from jaxattn.kv_cache import MLACache
from jaxattn.metadata import SPEC_DECODE_MAX_Q_LEN, AttentionMetadata

# Steps of at most this many query tokens per sequence (decode, speculative decode) suit the
# absorbed form (``mla_paged_attention``); longer ones the expanded form (``mla_prefill``).
MAX_DECODE_Q_LEN = SPEC_DECODE_MAX_Q_LEN
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def mla_paged_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    cache: MLACache,
    meta: AttentionMetadata,
    *,
    scale: float,
    causal: bool = True,
    backend: str = "auto",
    return_status: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Absorbed MLA of packed ragged queries over the paged latent pool.

    Args:
      q_latent: ``[T, Hq, R]``, the no-RoPE query already multiplied by ``W_UK`` (``absorb_query``).
      q_rope: ``[T, Hq, Dr]``, the RoPE'd query part.
      cache: the layer's ``MLACache`` (``R = cache.kv_lora_rank``, ``Dr = cache.rope_dim``); this
        step's latents must already be written to it.
      meta: ``AttentionMetadata`` for the step (B sequences).
      scale: logit scale (DeepSeek: ``1/sqrt(Dn + Dr)``, times the YaRN mscale squared where it applies), required.
      causal: bottom-right causal mask.
      backend: "auto" or a backend that implements this op (``jaxattn.backends.names(
        "mla_paged_attention")``: xla, triton, flashinfer). auto: flashinfer where it runs and
        takes the call; else triton for short queries past a few thousand token-keys
        (``triton.mla_rank``); else xla.
      return_status: also return which sequences kept the contract.

    Returns:
      ``out``: ``[T, Hq, R]`` in ``q_latent.dtype`` (``project_values`` maps it to ``[T, Hq, Dv]``);
      with ``return_status``, ``(out, valid)`` as ``paged_attention``.
    """
    where = "mla_paged_attention"
    params = _check_common(where, (("q_latent", q_latent, "kv_lora_rank"), ("q_rope", q_rope, "rope_dim")),
                           cache, meta, scale, causal, return_status, backend)
    name = dispatch.choose(Call(where, q_latent, cache, meta, params, q_rope=q_rope), backend)
    meta, valid = sanitize(q_latent, cache, meta)
    out = backends.REGISTRY[name].ops[where].run(q_latent, q_rope, cache, meta, params)
    return (out, valid) if return_status else out


def mla_prefill(
    q_nope: jax.Array,
    q_rope: jax.Array,
    cache: MLACache,
    meta: AttentionMetadata,
    w_uk: jax.Array,
    w_uv: jax.Array,
    *,
    scale: float,
    causal: bool = True,
    backend: str = "auto",
    return_status: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """MLA over per-head K/V expanded from the latent pool: the new tokens and the cached context
    of each sequence (all its ``kv_lens[b]`` keys), packed ragged, bottom-right causal.

    Args:
      q_nope: ``[T, Hq, Dn]`` (128 in DeepSeek), the no-RoPE query part (not absorbed).
      q_rope: ``[T, Hq, Dr]`` (64), the RoPE'd query part.
      cache, meta, scale, causal, return_status: as ``mla_paged_attention``.
      w_uk: ``[R, Hq, Dn]``, latent -> no-RoPE key of each head.
      w_uv: ``[R, Hq, Dv]`` (Dv 128), latent -> value of each head.
      backend: "auto" or a backend that implements this op (xla; cudnn: cuDNN's paged prefill over
        the latents expanded to per-head K/V, V zero-padded to K's width; fa4: FlashAttention-4's
        SM90 kernel over K and V pages of their own widths). auto: the order this GPU's measured
        choice table gives the nearest bucket (sm_90: fa4, then cudnn, at every measured point;
        benchmarks/RESULTS.md), else cudnn, then fa4, else xla, where each runs and takes the call.

    Returns:
      ``out``: ``[T, Hq, Dv]`` in ``q_nope.dtype``; with ``return_status``, ``(out, valid)``.
    """
    where = "mla_prefill"
    params = _check_common(where, (("q_nope", q_nope, None), ("q_rope", q_rope, "rope_dim")),
                           cache, meta, scale, causal, return_status, backend)
    num_q_heads, nope_dim = q_nope.shape[1:]
    for name, w, last, last_name in (("w_uk", w_uk, nope_dim, f"Dn={nope_dim}"), ("w_uv", w_uv, None, "Dv")):
        shape = tuple(getattr(w, "shape", ()))
        if len(shape) != 3 or shape[:2] != (cache.kv_lora_rank, num_q_heads) or last not in (None, shape[2]):
            raise ValueError(f"{where}: {name} must be [kv_lora_rank={cache.kv_lora_rank}, Hq={num_q_heads}, "
                             f"{last_name}], got {list(shape)}")
        if w.dtype != q_nope.dtype:
            raise ValueError(f"{where}: {name}.dtype must be {q_nope.dtype} (like q_nope), got {w.dtype}")
    name = dispatch.choose(Call(where, q_nope, cache, meta, params, q_rope=q_rope, w_uv=w_uv), backend)
    meta, valid = sanitize(q_nope, cache, meta)
    out = backends.REGISTRY[name].ops[where].run(q_nope, q_rope, cache, meta, w_uk, w_uv, params)
    return (out, valid) if return_status else out


def absorb_query(q_nope: jax.Array, w_uk: jax.Array) -> jax.Array:
    """``q_latent[t, h] = W_UK[:, h] q_nope[t, h]``: ``[T, Hq, Dn]``, ``[R, Hq, Dn]`` -> ``[T, Hq, R]``
    (float32 accumulation, in ``q_nope.dtype``)."""
    return jnp.einsum("thn,rhn->thr", q_nope, w_uk, preferred_element_type=jnp.float32).astype(q_nope.dtype)


def project_values(out_latent: jax.Array, w_uv: jax.Array) -> jax.Array:
    """``out[t, h] = out_latent[t, h] W_UV[:, h]``: ``[T, Hq, R]``, ``[R, Hq, Dv]`` -> ``[T, Hq, Dv]``
    (float32 accumulation, in ``out_latent.dtype``)."""
    return jnp.einsum("thr,rhv->thv", out_latent, w_uv, preferred_element_type=jnp.float32).astype(out_latent.dtype)


def _check_common(where: str, queries: tuple[tuple[str, jax.Array, str | None], ...], cache: MLACache,
                  meta: AttentionMetadata, scale, causal, return_status, backend) -> AttentionParams:
    """Checks shared by both entry points; ``queries``: (name, array, the cache property its last
    dimension must equal, or None)."""
    if not isinstance(cache, MLACache):
        raise ValueError(f"{where}: cache must be a jaxattn.MLACache, got {type(cache).__name__}")
    first_name, first, _ = queries[0]
    if getattr(first, "ndim", None) != 3 or first.shape[0] < 1:
        raise ValueError(f"{where}: {first_name} must be [T, Hq, D] with T >= 1, got "
                         f"shape {getattr(first, 'shape', None)}")
    if not any(first.dtype == jnp.dtype(d) for d in _DTYPES):
        raise ValueError(f"{where}: {first_name}.dtype must be float32, bfloat16 or float16, got {first.dtype}")
    for name, x, last in queries:
        if getattr(x, "ndim", None) != 3 or x.shape[:2] != first.shape[:2]:
            raise ValueError(f"{where}: {name} must be [T={first.shape[0]}, Hq={first.shape[1]}, D] like "
                             f"{first_name}, got shape {getattr(x, 'shape', None)}")
        if last is not None and x.shape[2] != getattr(cache, last):
            raise ValueError(f"{where}: {name} must have the cache's {last}={getattr(cache, last)} values per "
                             f"head, got {x.shape[2]}")
        if x.dtype != first.dtype or not (cache.is_fp8 or x.dtype == cache.dtype):
            raise ValueError(f"{where}: {name}.dtype must be the cache's {cache.dtype} (or any query dtype "
                             f"over FP8 pages) and {first_name}'s, got {x.dtype}")
    check_metadata(where, meta, cache)
    dispatch.check_name(where, backend)
    if not (is_real(scale) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{where}: scale must be a positive finite float, got {scale!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"{where}: causal must be a bool, got {causal!r}")
    if not isinstance(return_status, bool):
        raise ValueError(f"{where}: return_status must be a bool, got {return_status!r}")
    return AttentionParams(scale=float(scale), causal=causal, sliding_window=None, softcap=None, has_sinks=False)
