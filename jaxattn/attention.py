"""``paged_attention``: check the call, plan it (or take the step's plan), run its kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxattn import attention_plan, dispatch
from jaxattn.attention_plan import AttentionPlan
from jaxattn.backends.base import Call
from jaxattn.kv_cache import KVCache
from jaxattn.metadata import AttentionMetadata
from jaxattn.sharding import shard_by_heads


def paged_attention(
    q: jax.Array,
    cache: KVCache,
    meta: AttentionMetadata | AttentionPlan,
    *,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    backend: str = "auto",
    return_status: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of packed ragged queries over a paged KV cache.

    Args:
      q: ``[T, Hq, D]`` query tokens of all sequences, packed in ``meta.cu_q_lens`` order.
      cache: the layer's ``KVCache``; this step's K/V must already be written to it.
      meta: ``AttentionMetadata`` for the step (B sequences), or the step's ``AttentionPlan``
        (``jaxattn.plan``), made once and passed to every layer's call: the call then only runs
        kernels. With a plan, options left at their defaults are the plan's, and an option given
        (``backend`` other than "auto" included) must be the plan's; ``sinks`` are passed per call
        when the plan was made with sinks.
      scale: logit scale, default ``1/sqrt(D)``.
      causal: bottom-right causal mask (query at position i sees keys ``0..i``).
      sliding_window: W, a query at position i sees keys ``i-W+1 .. i``.
      softcap: c, logits become ``c * tanh(s / c)``.
      sinks: ``[Hq]`` floats (used in float32); each head's softmax denominator gains ``exp(sinks[h])``.
      backend: "auto" or a backend that implements ``paged_attention``: "xla", "cudnn", "trtllm",
        "triton" or "fa4" (``jaxattn.backends.names("paged_attention")``).
      return_status: also return which sequences kept the contract.

    Returns:
      ``out``: ``[T, Hq, D]`` in ``q.dtype``; rows of padding tokens, of empty sequences and of
      sequences that break the contract are zero. With ``return_status``, ``(out, valid)``:
      ``valid`` bool[B] is False for a sequence whose metadata breaks the contract
      (``AttentionMetadata.sanitize``) or, for every sequence, when an FP8 cache's scales are
      not positive and finite.
    """
    where = "paged_attention"
    if not isinstance(return_status, bool):
        raise ValueError(f"{where}: return_status must be a bool, got {return_status!r}")
    attention_plan.check_operands(where, q=q, sinks=sinks)
    options = dict(scale=scale, causal=causal, sliding_window=sliding_window, softcap=softcap, sinks=sinks,
                   backend=backend)
    if isinstance(meta, AttentionPlan):
        plan = meta
        params = attention_plan.check_attention_args(q, cache, plan.meta, **options)
        params = attention_plan.merge_options(where, plan, params, given={
            name for name, default in (("scale", None), ("causal", True), ("sliding_window", None),
                                       ("softcap", None)) if options[name] is not default})
        attention_plan.check_plan(where, plan, Call(where, q, cache, plan.meta, params), backend)
    else:
        params = attention_plan.check_attention_args(q, cache, meta, **options)
        plan = attention_plan.build(Call(where, q, cache, meta, params), backend)
    if sinks is not None:
        sinks = sinks.astype(jnp.float32)
    # Under head sharding this runs once per shard, on its local heads (jaxattn.sharding); the
    # plan's arrays enter it as replicated operands.
    out = shard_by_heads(run, q, cache, plan, sinks)
    out, valid = attention_plan.with_scales_checked(plan, cache, out)
    return (out, valid) if return_status else out


def run(q: jax.Array, cache: KVCache, plan: AttentionPlan, sinks: jax.Array | None) -> jax.Array:
    """The kernels of ``plan``'s backends on ``q: [T, Hq, D]`` (all heads, or one head shard's)
    -> ``[T, Hq, D]``."""
    options = (plan.params, sinks)
    if plan.decode is None:
        return plan.main.run((q, cache), options)
    out_dec = plan.decode.run((q[:plan.decode_rows.shape[0]], cache), options)
    return attention_plan.with_decodes(plan, plan.main.run((q, cache), options), out_dec)


def backend_for(q: jax.Array, cache: KVCache, meta: AttentionMetadata, *, backend: str = "auto",
                **attention_kwargs) -> dispatch.Route:
    """The backends ``paged_attention`` would run for these arguments (trace time)."""
    params = attention_plan.check_attention_args(q, cache, meta, backend=backend, **attention_kwargs)
    return dispatch.route(Call("paged_attention", q, cache, meta, params), backend)


