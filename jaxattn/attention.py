"""``paged_attention``: argument checks and dispatch to a backend."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from jaxattn import backends, choice_table, dispatch
from jaxattn.backends.base import AttentionParams, Call
from jaxattn.checks import is_int, is_real
from jaxattn.kv_cache import KVCache, MLACache
from jaxattn.metadata import AttentionMetadata
from jaxattn.sharding import shard_by_heads

_Q_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def paged_attention(
    q: jax.Array,
    cache: KVCache,
    meta: AttentionMetadata,
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
      meta: ``AttentionMetadata`` for the step (B sequences).
      scale: logit scale, default ``1/sqrt(D)``.
      causal: bottom-right causal mask (query at position i sees keys ``0..i``).
      sliding_window: W, a query at position i sees keys ``i-W+1 .. i``.
      softcap: c, logits become ``c * tanh(s / c)``.
      sinks: float32 ``[Hq]``; each head's softmax denominator gains ``exp(sinks[h])``.
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
    params = _check_args(q, cache, meta, scale=scale, causal=causal, sliding_window=sliding_window,
                         softcap=softcap, sinks=sinks, backend=backend)
    if not isinstance(return_status, bool):
        raise ValueError(f"paged_attention: return_status must be a bool, got {return_status!r}")
    if sinks is not None:
        sinks = sinks.astype(jnp.float32)
    meta, valid = sanitize(q, cache, meta)
    # Under head sharding this runs once per shard, on its local heads (jaxattn.sharding).
    out = shard_by_heads(functools.partial(_run_plan, params, backend), q, cache, meta, sinks)
    return (out, valid) if return_status else out


def sanitize(q: jax.Array, cache: KVCache | MLACache, meta: AttentionMetadata) -> tuple[AttentionMetadata, jax.Array]:
    """``meta.sanitize`` for this call, with every sequence emptied when an FP8 cache's scales
    are not positive and finite (traced scales cannot be checked at trace time). Lowered for CUDA
    where jaxattn's Triton kernels run (the triton backend's requirements: a GPU, the triton
    package, jaxlib's launcher), the checks are one kernel (``kernels.sanitize``), not XLA's 3-5;
    elsewhere (lowering for CUDA on a machine without a GPU, as tests do, included) the jnp form
    serves every platform."""
    args = (meta.cu_q_lens, meta.kv_lens, meta.block_tables)
    reference = functools.partial(_sanitized_arrays, meta, q.shape[0], cache)
    if backends.unavailable_reason("triton") is not None:
        cu, kv_lens, tables, valid = reference(*args)
    else:
        from jaxattn.kernels import sanitize as kernel

        one_kernel = functools.partial(kernel.sanitize, num_tokens=q.shape[0], num_pages=cache.num_pages,
                                       page_size=cache.page_size, max_q_len=meta.max_q_len)
        cu, kv_lens, tables, valid = jax.lax.platform_dependent(*args, cuda=one_kernel, default=reference)
    meta = dataclasses.replace(meta, cu_q_lens=cu, kv_lens=kv_lens, block_tables=tables)
    if cache.is_fp8:
        scales = jnp.stack(cache.scales).astype(jnp.float32)
        valid &= jnp.all(jnp.isfinite(scales) & (scales > 0))
        meta = dataclasses.replace(meta, kv_lens=jnp.where(valid, meta.kv_lens, 0))
    return meta, valid


def _sanitized_arrays(meta: AttentionMetadata, num_tokens: int, cache: KVCache | MLACache, cu_q_lens: jax.Array,
                      kv_lens: jax.Array, block_tables: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``meta.sanitize`` (XLA ops) with these arrays: ``(cu_q_lens, kv_lens, block_tables, valid)``."""
    checked, valid = dataclasses.replace(meta, cu_q_lens=cu_q_lens, kv_lens=kv_lens, block_tables=block_tables
                                         ).sanitize(num_tokens, cache.num_pages, cache.page_size)
    return checked.cu_q_lens, checked.kv_lens, checked.block_tables, valid


def _run_plan(params: AttentionParams, backend: str, q: jax.Array, cache: KVCache, meta: AttentionMetadata,
              sinks: jax.Array | None) -> jax.Array:
    """Plans the backends on these (per-shard) shapes and runs them on sanitized metadata:
    ``[T, Hq, D]``."""
    return run_plan(plan_backends(q, cache, meta, params, backend), q, cache, meta, params, sinks)


def run_plan(plan: Plan, q: jax.Array, cache: KVCache, meta: AttentionMetadata, params: AttentionParams,
             sinks: jax.Array | None) -> jax.Array:
    """Runs ``plan``'s backends on sanitized metadata (``sanitize``): ``q: [T, Hq, D]`` -> ``[T, Hq, D]``."""
    if plan.decode is None:
        return _kernel(plan.main)(q, cache, meta, params, sinks)
    q_dec, meta_dec, meta_rest, num_decodes = split_decodes(q, meta)
    out_dec = _kernel(plan.decode)(q_dec, cache, meta_dec, params, sinks)
    out = _kernel(plan.main)(q, cache, meta_rest, params, sinks)
    # Decode b is token b: only the decodes' rows are rewritten, in place (a select over all T rows
    # would cost a pass over a prefill's whole output). A scatter, not a dynamic_update_slice of
    # the first rows: XLA's GPU DynamicSliceFusion rewriter (jax 0.11) fails on a DUS into a
    # custom call's output ("DUS target must be a fusion parameter").
    rows = jnp.arange(q_dec.shape[0], dtype=jnp.int32)
    decode_rows = jnp.where(rows < num_decodes, rows, q.shape[0])       # past the end: dropped
    return out.at[decode_rows].set(out_dec, mode="drop", indices_are_sorted=True)


def _kernel(name: str) -> Callable[..., jax.Array]:
    """Backend ``name``'s paged_attention entry."""
    return backends.REGISTRY[name].ops["paged_attention"].run


@dataclasses.dataclass(frozen=True)
class Plan:
    """The backends that run one call: ``decode`` serves the leading decodes of a mixed batch
    and ``main`` the rest; with ``decode=None``, ``main`` serves the whole batch."""

    main: str
    decode: str | None = None

    @property
    def label(self) -> str:
        """Its name in a measured choice table: ``"main"``, or ``"decode+main"`` when split."""
        return choice_table.plan_label(self.main, self.decode)

    def __str__(self) -> str:
        return self.main if self.decode is None else f"{self.decode} (decodes) + {self.main} (the rest)"


def backend_for(q: jax.Array, cache: KVCache, meta: AttentionMetadata, *, backend: str = "auto",
                **attention_kwargs) -> Plan:
    """The backends ``paged_attention`` would run for these arguments (trace time)."""
    params = _check_args(q, cache, meta, backend=backend, **attention_kwargs)
    return plan_backends(q, cache, meta, params, backend)


def plan_backends(q: jax.Array, cache: KVCache, meta: AttentionMetadata, params: AttentionParams,
                  backend: str = "auto") -> Plan:
    """Chooses backends from static information only (``jaxattn.dispatch.choose``).

    An explicit backend serves the whole call. ``auto`` takes the first backend in
    ``dispatch.ranking``'s order (the measured table's, else the ranks) that takes the call, and
    ``auto_plan`` decides whether the step's leading decodes go to another backend.
    """
    call = Call("paged_attention", q, cache, meta, params)
    main = dispatch.choose(call, backend)
    return Plan(main) if backend != "auto" else auto_plan(call, main)


def auto_plan(call: Call, main: str) -> Plan:
    """The plan ``auto`` makes for a ``paged_attention`` call once it chose ``main`` for it:
    ``split_plan``'s plan when there is one and the measured table does not have ``main`` whole
    before it, else ``main`` whole. The nearest entry of this GPU's table decides when it timed both
    plans (``choice_table.measured_split``); otherwise (no table, no near entry, a table of plain
    backend names) the split is taken: the rule."""
    split = split_plan(call, main)
    if split is None or choice_table.measured_split(call, main, split.decode) is False:
        return Plan(main)
    return split


def split_plan(call: Call, main: str) -> Plan | None:
    """The split plan ``auto`` weighs against ``main`` whole for a ``paged_attention`` call: in a
    step that is not decode-only, the leading decodes to the backend ``auto`` picks for a
    decode-only step, when that is another backend and the step is a prefill step (``meta.max_q_len``
    None or above ``SPEC_DECODE_MAX_Q_LEN``) or ``main`` does not rank decodes (cudnn); None when
    there is none (a speculative-decode kernel serves its step whole)."""
    if call.phase == "decode":
        return None
    meta = call.meta
    decodes = Call("paged_attention", call.q[: min(call.q.shape[0], meta.batch_size)], call.cache,
                   dataclasses.replace(meta, max_q_len=1), call.params)
    decode = dispatch.choose(decodes, "auto")
    main_takes_decodes = backends.REGISTRY[main].ops["paged_attention"].rank(decodes) is not None
    split = decode != main and (call.phase == "prefill" or not main_takes_decodes)
    return Plan(main, decode) if split else None


def split_decodes(q: jax.Array, meta: AttentionMetadata
                  ) -> tuple[jax.Array, AttentionMetadata, AttentionMetadata, jax.Array]:
    """Splits a batch into its leading decodes and the rest.

    Returns ``(q_dec, meta_dec, meta_rest, num_decodes)``: ``q_dec = q[:min(T, B)]`` with
    ``meta_dec`` describing the decodes as one token each (other sequences empty), and
    ``meta_rest`` the same batch with the decodes emptied. ``num_decodes`` is
    ``meta.checked_num_decodes``.
    """
    seq = jnp.arange(meta.batch_size, dtype=jnp.int32)
    num_decodes = meta.checked_num_decodes
    is_decode = seq < num_decodes
    bounds = jnp.arange(meta.batch_size + 1, dtype=jnp.int32)
    meta_dec = dataclasses.replace(
        meta,
        cu_q_lens=jnp.minimum(bounds, num_decodes),
        kv_lens=jnp.where(is_decode, meta.kv_lens, 0),
        num_decodes=num_decodes,
        max_q_len=1,
    )
    meta_rest = dataclasses.replace(
        meta,
        cu_q_lens=jnp.maximum(meta.cu_q_lens, num_decodes),   # decode b holds token b
        kv_lens=jnp.where(is_decode, 0, meta.kv_lens),
        num_decodes=jnp.zeros((), jnp.int32),
    )
    return q[: min(q.shape[0], meta.batch_size)], meta_dec, meta_rest, num_decodes


def _check_args(q, cache, meta, *, scale=None, causal=True, sliding_window=None, softcap=None, sinks=None,
                backend="auto") -> AttentionParams:
    where = "paged_attention"
    dispatch.check_name(where, backend)
    if not isinstance(cache, KVCache):
        raise ValueError(f"{where}: cache must be a jaxattn.KVCache, got {type(cache).__name__}")
    if getattr(q, "ndim", None) != 3 or q.shape[0] < 1:
        raise ValueError(f"{where}: q must be [T, Hq, D] with T >= 1, got shape {getattr(q, 'shape', None)}")
    if not any(q.dtype == jnp.dtype(d) for d in _Q_DTYPES):
        raise ValueError(f"{where}: q.dtype must be float32, bfloat16 or float16, got {q.dtype}")
    num_tokens, num_q_heads, head_dim = q.shape
    if head_dim != cache.head_dim:
        raise ValueError(f"{where}: q head_dim {head_dim} does not match the cache's head_dim {cache.head_dim}")
    if num_q_heads % cache.num_kv_heads:
        raise ValueError(f"{where}: the number of query heads ({num_q_heads}) must be a multiple of "
                         f"the cache's num_kv_heads ({cache.num_kv_heads})")
    if not cache.is_fp8 and cache.dtype != q.dtype:
        raise ValueError(f"{where}: cache pages are {cache.dtype} but q is {q.dtype}; "
                         f"pages must match q.dtype or be float8_e4m3fn")
    check_metadata(where, meta, cache)

    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif not (is_real(scale) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{where}: scale must be a positive finite float, got {scale!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"{where}: causal must be a bool, got {causal!r}")
    if sliding_window is not None and not (is_int(sliding_window) and sliding_window >= 1):
        raise ValueError(f"{where}: sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if softcap is not None and not (is_real(softcap) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"{where}: softcap must be None or a positive float, got {softcap!r}")
    if sinks is not None:
        if getattr(sinks, "shape", None) != (num_q_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise ValueError(f"{where}: sinks must be float32[{num_q_heads}] (one per query head), got "
                             f"{getattr(sinks, 'dtype', type(sinks).__name__)}{list(getattr(sinks, 'shape', []))}")
    return AttentionParams(
        scale=float(scale),
        causal=causal,
        sliding_window=None if sliding_window is None else int(sliding_window),
        softcap=None if softcap is None else float(softcap),
        has_sinks=sinks is not None,
    )


def check_metadata(where: str, meta: AttentionMetadata, cache: KVCache | MLACache) -> None:
    """ValueError (prefixed by ``where``) unless ``meta`` has consistent shapes, int32 arrays and
    a valid ``max_q_len``, and was built for ``cache``'s pool (page size, pool size) when it says."""
    if not isinstance(meta, AttentionMetadata):
        raise ValueError(f"{where}: meta must be a jaxattn.AttentionMetadata, got {type(meta).__name__}")
    if meta.kv_lens.ndim != 1 or meta.kv_lens.shape[0] < 1:
        raise ValueError(f"{where}: meta.kv_lens must have shape [B] with B >= 1, got {list(meta.kv_lens.shape)}")
    batch = meta.kv_lens.shape[0]
    for field, shape in (("cu_q_lens", (batch + 1,)), ("num_decodes", ())):
        value = getattr(meta, field)
        if value.shape != shape:
            raise ValueError(f"{where}: meta.{field} must have shape {list(shape)} (B={batch}), got {list(value.shape)}")
    if meta.block_tables.ndim != 2 or meta.block_tables.shape[0] != batch:
        raise ValueError(f"{where}: meta.block_tables must be [B={batch}, P], got {list(meta.block_tables.shape)}")
    for field in ("cu_q_lens", "kv_lens", "block_tables", "num_decodes"):
        dtype = getattr(meta, field).dtype
        if dtype != jnp.int32:
            raise ValueError(f"{where}: meta.{field} must be int32, got {dtype}")
    if meta.max_q_len is not None and not (is_int(meta.max_q_len) and meta.max_q_len >= 1):
        raise ValueError(f"{where}: meta.max_q_len must be None or an int >= 1, got {meta.max_q_len!r}")
    for field in ("page_size", "num_pages"):
        built_for, actual = getattr(meta, field), getattr(cache, field)
        if built_for is not None and built_for != actual:
            raise ValueError(f"{where}: meta was built by a PageTable with {field}={built_for}, but the cache has "
                             f"{field}={actual}; the page table and the cache must describe the same pool")
