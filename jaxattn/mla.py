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
  fewer FLOPs per (query, key) pair when queries are many. Its query is taken whole
  (``[T, Hq, Dn + Dr]``, as K's columns), or as its two parts, which it concatenates once.

Both follow ``paged_attention``'s contract: packed ragged queries, bottom-right causal masks, the
step's latents already written to the pool, the same ``AttentionMetadata`` and bad-data rules
(broken sequences get zero rows and ``valid=False``; every sequence, when an FP8 pool's scale is
not positive and finite), zero rows for padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxattn import attention_plan
from jaxattn.attention_plan import AttentionPlan
from jaxattn.backends.base import AttentionParams
from jaxattn.kv_cache import MLACache
from jaxattn.metadata import SPEC_DECODE_MAX_Q_LEN, AttentionMetadata

# Steps of at most this many query tokens per sequence (decode, speculative decode) suit the
# absorbed form (``mla_paged_attention``); longer ones the expanded form (``mla_prefill``).
MAX_DECODE_Q_LEN = SPEC_DECODE_MAX_Q_LEN


def mla_paged_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    cache: MLACache,
    meta: AttentionMetadata | AttentionPlan,
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
      meta: ``AttentionMetadata`` for the step (B sequences), or the step's ``AttentionPlan``
        (``jaxattn.plan(..., op="mla_paged_attention")``), as ``paged_attention`` takes it.
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
    plan, params = _plan(where, q_latent, q_rope, cache, meta, None, scale, causal, backend, return_status)
    out = plan.main.run((q_latent, q_rope, cache), (params,))
    out, valid = attention_plan.with_scales_checked(plan, cache, out)
    return (out, valid) if return_status else out


def mla_prefill(
    q: jax.Array,
    q_rope: jax.Array | None,
    cache: MLACache,
    meta: AttentionMetadata | AttentionPlan,
    w_uk: jax.Array,
    w_uv: jax.Array,
    *,
    scale: float,
    causal: bool = True,
    backend: str = "auto",
    return_status: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """MLA over per-head K/V expanded from the latent pool: the new tokens and the cached context
    of each sequence (all its ``kv_lens[b]`` keys), packed ragged, bottom-right causal. Under
    ``auto``, a mixed batch's leading decodes run absorbed (``mla_paged_attention``'s kernels,
    ``W_UK`` and ``W_UV`` applied around them), the rest expanded; with ``meta.max_prefill_seqs``,
    over that many sequences past the decodes rather than B.

    Args:
      q: the whole query ``[T, Hq, Dn + Dr]`` (no-RoPE part first, RoPE'd part last; 128 + 64 in
        DeepSeek) with ``q_rope`` None, or its no-RoPE part ``q_nope`` ``[T, Hq, Dn]`` (not absorbed).
      q_rope: ``[T, Hq, Dr]``, the RoPE'd query part, or None when ``q`` is whole. Parts are
        concatenated here, once: every backend takes the whole query, so a model that applies RoPE to
        the last Dr columns of its query in place saves that copy.
      cache, meta, scale, causal, return_status: as ``mla_paged_attention``.
      w_uk: ``[R, Hq, Dn]``, latent -> no-RoPE key of each head.
      w_uv: ``[R, Hq, Dv]`` (Dv 128), latent -> value of each head.
      backend: "auto" or a backend that implements this op (xla; cudnn: cuDNN's paged prefill over
        the latents expanded to per-head K/V, V zero-padded to K's width; triton: jaxattn's Triton
        paged kernels over the same pool; fa4: FlashAttention-4's SM90 kernel over K and V pages
        of their own widths). auto: the order this GPU's measured choice table gives the nearest
        bucket (sm_90: fa4, then cudnn, at every measured point; benchmarks/RESULTS.md; backends it
        did not time keep their rank's place), else cudnn, then fa4, then triton, else xla, where
        each runs and takes the call.

    Returns:
      ``out``: ``[T, Hq, Dv]`` in ``q.dtype``; with ``return_status``, ``(out, valid)``.
    """
    where = "mla_prefill"
    plan, params = _plan(where, q, q_rope, cache, meta, (w_uk, w_uv), scale, causal, backend, return_status)
    if q_rope is not None:
        q = jnp.concatenate([q, q_rope], axis=-1)
    out = plan.main.run((q, cache), (w_uk, w_uv, params))
    if plan.decode is not None:
        q_dec = q[:plan.decode_rows.shape[0]]
        nope_dim = w_uk.shape[2]
        out_latent = plan.decode.run((absorb_query(q_dec[..., :nope_dim], w_uk), q_dec[..., nope_dim:], cache),
                                     (params,))
        out = attention_plan.with_decodes(plan, out, project_values(out_latent, w_uv))
    out, valid = attention_plan.with_scales_checked(plan, cache, out)
    return (out, valid) if return_status else out


def absorb_query(q_nope: jax.Array, w_uk: jax.Array) -> jax.Array:
    """``q_latent[t, h] = W_UK[:, h] q_nope[t, h]``: ``[T, Hq, Dn]``, ``[R, Hq, Dn]`` -> ``[T, Hq, R]``
    (float32 accumulation, in ``q_nope.dtype``)."""
    return jnp.einsum("thn,rhn->thr", q_nope, w_uk, preferred_element_type=jnp.float32).astype(q_nope.dtype)


def project_values(out_latent: jax.Array, w_uv: jax.Array) -> jax.Array:
    """``out[t, h] = out_latent[t, h] W_UV[:, h]``: ``[T, Hq, R]``, ``[R, Hq, Dv]`` -> ``[T, Hq, Dv]``
    (float32 accumulation, in ``out_latent.dtype``)."""
    return jnp.einsum("thr,rhv->thv", out_latent, w_uv, preferred_element_type=jnp.float32).astype(out_latent.dtype)


def _plan(where: str, q: jax.Array, q_rope: jax.Array | None, cache: MLACache, meta: AttentionMetadata | AttentionPlan,
          weights: tuple[jax.Array, jax.Array] | None, scale, causal, backend: str,
          return_status) -> tuple[AttentionPlan, AttentionParams]:
    """The call's checks, and its plan: ``meta`` when it is one (checked against the call), else
    made for this call."""
    if not isinstance(return_status, bool):
        raise ValueError(f"{where}: return_status must be a bool, got {return_status!r}")
    w_uk, w_uv = weights or (None, None)
    attention_plan.check_operands(where, **{"q_latent" if where == "mla_paged_attention" else "q": q}, q_rope=q_rope,
                                  w_uk=w_uk, w_uv=w_uv)
    planned = isinstance(meta, AttentionPlan)
    metadata = meta.meta if planned else meta
    params = attention_plan.check_mla_args(where, q, q_rope, cache, metadata, scale=scale, causal=causal,
                                           backend=backend, w_uk=w_uk, w_uv=w_uv)
    call = attention_plan.mla_call(where, q, q_rope, cache, metadata, params, w_uv)
    if not planned:
        return attention_plan.build(call, backend), params
    params = attention_plan.merge_options(where, meta, params, given={"scale"} | ({"causal"} if not causal else set()))
    attention_plan.check_plan(where, meta, call, backend)
    return meta, params
