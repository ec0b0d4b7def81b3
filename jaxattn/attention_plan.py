"""Plan once per step, run per layer: ``plan`` and ``AttentionPlan``.

Every layer of a model step calls the same op with the same metadata and shapes; only the layer's
query, cache pools (and FP8 scales), sinks and weights differ. ``plan`` does, once, the work that
depends on the metadata and the static shapes alone: the argument checks,
``AttentionMetadata.sanitize`` (and the ``valid`` flags), the backends the call runs
(``dispatch.route``: for ``paged_attention`` under ``auto``, a mixed batch's leading decodes may go
to another backend, with the split metadata made here), and each chosen backend's prepared operands
(``OpSupport.prepare``: XQA's per-token request arrays or speculative-decode mask, fa4's
rows-with-keys, cuDNN's lengths, FlashInfer's MLA schedule, the Triton split launch's decode count).
The result is an ``AttentionPlan``, a pytree that passes through ``jit``, ``scan`` and
``custom_partitioning`` like the metadata does. The ops (``paged_attention``,
``mla_paged_attention``, ``mla_prefill``) take a plan in place of the metadata and then only launch
kernels; given bare metadata, they plan per call (the same result).

FP8 scales are per layer, so the plan leaves them out: each call checks its cache's scales as one
scalar (``scales_ok``), zeroes its output when they are not positive and finite, and reports every
sequence invalid then. Page contents and metadata never depend on them, so the plan stays valid for
every layer.

The argument checks of the three ops live here too (``check_attention_args``, ``check_mla_args``), so
that a plan is checked exactly as a call is.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import backends, dispatch
from jaxattn.backends.base import OPS, AttentionParams, Call
from jaxattn.checks import is_positive_float32, is_positive_int
from jaxattn.kv_cache import KVCache, MLACache
from jaxattn.metadata import AttentionMetadata, check_metadata

_Q_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PhasePlan:
    """One backend's part of a call: the op it runs (an ``mla_prefill`` call's decodes run
    ``mla_paged_attention``), the sanitized metadata it runs on and its prepared operands
    (``OpSupport.prepare``'s pytree, or None)."""

    meta: AttentionMetadata
    prepared: Any
    backend: str = dataclasses.field(metadata=dict(static=True))
    op: str = dataclasses.field(metadata=dict(static=True))

    def run(self, before: tuple, after: tuple) -> jax.Array:
        """Backend ``backend``'s ``op`` kernel entry: ``run(*before, meta, *after)`` (the op's
        signature, ``jaxattn.backends.base``), given the prepared operands when it prepares any."""
        support = backends.REGISTRY[self.backend].ops[self.op]
        if support.prepare is None:
            return support.run(*before, self.meta, *after)
        return support.run(*before, self.meta, *after, prepared=self.prepared)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """Everything one step's calls of an op share (module docstring); pass it in place of the
    metadata to every layer's call.

    Attributes:
      meta: the step's sanitized metadata (``AttentionMetadata.sanitize``).
      valid: bool[B], which sequences keep the contract (an FP8 call also ANDs its scales' check).
      main: the backend that serves the batch, or its non-decode rows when ``decode`` is set.
      decode: the backend that serves the leading decodes of a mixed batch, or None.
      decode_rows: int32[min(T, B)] when ``decode`` is set: decode b's output row (b), or T (dropped)
        past the step's decodes.
      op, backend: the op and the ``backend=`` it was planned for.
      params: the static attention options.
      signature: the static facts of the call it was planned for (queries, pools), which every
        call given the plan must share.
    """

    meta: AttentionMetadata
    valid: jax.Array
    main: PhasePlan
    decode: PhasePlan | None
    decode_rows: jax.Array | None
    op: str = dataclasses.field(metadata=dict(static=True))
    backend: str = dataclasses.field(metadata=dict(static=True))
    params: AttentionParams = dataclasses.field(metadata=dict(static=True))
    signature: tuple = dataclasses.field(metadata=dict(static=True))

    @property
    def route(self) -> dispatch.Route:
        """The backends it runs."""
        return dispatch.Route(self.main.backend, None if self.decode is None else self.decode.backend)


def plan(meta: AttentionMetadata, cache: KVCache | MLACache, q, *, op: str = "paged_attention",
         backend: str = "auto", scale: float | None = None, causal: bool = True, sliding_window: int | None = None,
         softcap: float | None = None, sinks=None, q_rope=None, w_uk=None, w_uv=None) -> AttentionPlan:
    """The plan of one step's calls of ``op`` (module docstring), made once and passed in place of
    ``meta`` to every layer's call.

    Args:
      meta: the step's ``AttentionMetadata``.
      cache: any one layer's cache (only its static facts and pool geometry are read: every layer's
        cache must share them; FP8 scales may differ).
      q: the op's first query, an array or a ``jax.ShapeDtypeStruct`` (only its shape and dtype are
        read): ``q`` ``[T, Hq, D]`` (paged_attention), ``q_latent`` ``[T, Hq, R]``
        (mla_paged_attention), or mla_prefill's whole query ``[T, Hq, Dn + Dr]`` (``q_rope`` None)
        or its no-RoPE part ``q_nope`` ``[T, Hq, Dn]``: a plan of either form serves calls of both.
      op: "paged_attention", "mla_paged_attention" or "mla_prefill".
      backend, scale, causal: as the op takes them (MLA ops: ``scale`` required).
      sliding_window, softcap: paged_attention's options.
      sinks: paged_attention's sinks (an array or a ``ShapeDtypeStruct`` of float32 ``[Hq]``) when the
        calls pass sinks; only its shape is read, each call passes its own values.
      q_rope: the MLA ops' ``[T, Hq, Dr]`` query part (array or ``ShapeDtypeStruct``); None for
        mla_prefill's whole query.
      w_uk, w_uv: mla_prefill's projections (arrays or ``ShapeDtypeStruct``), for their shapes.

    Returns:
      An ``AttentionPlan``. ValueError (at trace time) for bad arguments, as the op raises them.
    """
    if op not in OPS:
        raise ValueError(f"jaxattn.plan: op must be one of {OPS}, got {op!r}")
    if op == "paged_attention":
        for name, value in (("q_rope", q_rope), ("w_uk", w_uk), ("w_uv", w_uv)):
            if value is not None:
                raise ValueError(f"jaxattn.plan: {name} is an MLA argument; op='paged_attention' takes none")
        params = check_attention_args(q, cache, meta, scale=scale, causal=causal, sliding_window=sliding_window,
                                      softcap=softcap, sinks=sinks, backend=backend)
        return build(Call(op, abstract(q), cache, meta, params), backend)
    for name, value in (("sliding_window", sliding_window), ("softcap", softcap), ("sinks", sinks)):
        if value is not None:
            raise ValueError(f"jaxattn.plan: {name} is a paged_attention option; op={op!r} takes none")
    params = check_mla_args(op, q, q_rope, cache, meta, scale=scale, causal=causal, backend=backend, w_uk=w_uk,
                            w_uv=w_uv)
    return build(mla_call(op, q, q_rope, cache, meta, params, w_uv), backend)


def mla_call(op: str, q, q_rope, cache: MLACache, meta: AttentionMetadata, params: AttentionParams,
             w_uv=None) -> Call:
    """The ``Call`` of a checked MLA op call (``check_mla_args``), its arrays abstract. mla_prefill's
    query is in its one internal form, whole (``[T, Hq, Dn + Dr]``, ``q_rope`` None), whichever form
    was given, so that a plan of one form serves calls of the other."""
    if op == "mla_prefill" and q_rope is not None:
        q, q_rope = jax.ShapeDtypeStruct((*q.shape[:2], q.shape[2] + q_rope.shape[2]), q.dtype), None
    return Call(op, abstract(q), cache, meta, params, q_rope=abstract(q_rope), w_uv=abstract(w_uv))


def build(call: Call, backend: str, route: dispatch.Route | None = None) -> AttentionPlan:
    """The plan of a checked ``call`` (its metadata not yet sanitized): on ``route``, or the one
    ``dispatch.route`` gives for ``backend``."""
    route = route or dispatch.route(call, backend)
    meta, valid = sanitize(call.q.shape[0], call.cache, call.meta)
    call = dataclasses.replace(call, q=abstract(call.q), q_rope=abstract(call.q_rope), w_uv=abstract(call.w_uv))
    if route.decode is None:
        decode = decode_rows = None
        main = _phase(dataclasses.replace(call, meta=meta), route.main)
    else:
        decodes = dispatch.decode_call(call)
        meta_dec, meta_rest, decode_rows = split_decodes(meta, call.q.shape[0], decodes.q.shape[0])
        if call.op == "mla_prefill" and meta.max_prefill_seqs is not None:
            meta_rest = prefill_part(meta_rest, meta_dec.num_decodes, meta.max_prefill_seqs)
        decode = _phase(dataclasses.replace(decodes, meta=meta_dec), route.decode)
        main = _phase(dataclasses.replace(call, meta=meta_rest), route.main)
    return AttentionPlan(meta=meta, valid=valid, main=main, decode=decode, decode_rows=decode_rows, op=call.op,
                         backend=backend, params=call.params, signature=signature(call))


def _phase(call: Call, name: str) -> PhasePlan:
    prepare = backends.REGISTRY[name].ops[call.op].prepare
    return PhasePlan(meta=call.meta, prepared=None if prepare is None else prepare(call), backend=name, op=call.op)


def signature(call: Call) -> tuple:
    """The static facts of ``call`` a plan fixes: the op, the queries' shapes and dtypes, the
    pools' (cache type, layout, page geometry, dtypes) and ``w_uv``'s shape."""
    leaves, treedef = jax.tree.flatten(call.cache)
    return (call.op, _abstract_key(call.q), _abstract_key(call.q_rope), _abstract_key(call.w_uv), treedef,
            tuple(_abstract_key(leaf) for leaf in leaves))


def check_plan(where: str, plan_: AttentionPlan, call: Call, backend: str) -> None:
    """ValueError unless ``plan_`` was made for ``where`` and for calls like ``call`` (its
    queries' shapes and dtypes, its cache's geometry) with ``backend`` ("auto": any)."""
    if plan_.op != where:
        raise ValueError(f"{where}: the plan was made for {plan_.op}, not {where}")
    if backend != "auto" and backend != plan_.backend:
        raise ValueError(f"{where}: backend={backend!r}, but the plan was made for backend={plan_.backend!r}")
    made, got = plan_.signature, signature(call)
    if made != got:
        names = ("op", "the query", "q_rope", "w_uv", "the cache's structure", "the cache's arrays")
        diffs = [f"{name}: planned {_describe(a)}, got {_describe(b)}" for name, a, b in zip(names, made, got)
                 if a != b]
        raise ValueError(f"{where}: this call does not match the plan it was given ({'; '.join(diffs)}); make one "
                         f"plan per step for calls of one shape (jaxattn.plan)")


def merge_options(where: str, plan_: AttentionPlan, checked: AttentionParams, given: set[str]) -> AttentionParams:
    """The options of a call given ``plan_``: the plan's. ValueError when the call sets one of
    ``given`` (the options it passed, ``checked``'s values) other than the plan's, or passes sinks
    the plan was not made for (or none when it was)."""
    if checked.has_sinks != plan_.params.has_sinks:
        raise ValueError(f"{where}: the plan was made {'with' if plan_.params.has_sinks else 'without'} sinks, "
                         f"this call passes {'sinks' if checked.has_sinks else 'none'}")
    for field in sorted(given):
        value, planned = getattr(checked, field), getattr(plan_.params, field)
        if value != planned:
            raise ValueError(f"{where}: {field}={value!r}, but the plan was made with {field}={planned!r}")
    return plan_.params


def sanitize(num_tokens: int, cache: KVCache | MLACache, meta: AttentionMetadata
             ) -> tuple[AttentionMetadata, jax.Array]:
    """``meta.sanitize(num_tokens, cache.num_pages, cache.page_size)``. Lowered for CUDA where
    jaxattn's Triton kernels run (the triton backend's requirements: a GPU, the triton package,
    jaxlib's launcher), the checks are one kernel (``kernels.sanitize``), not XLA's 3-5; elsewhere
    (lowering for CUDA on a machine without a GPU, as tests do, included) the jnp form serves
    every platform."""
    args = (meta.cu_q_lens, meta.kv_lens, meta.block_tables)
    reference = functools.partial(_sanitized_arrays, meta, num_tokens, cache)
    if backends.unavailable_reason("triton") is not None:
        cu, kv_lens, tables, valid = reference(*args)
    else:
        from jaxattn.kernels import sanitize as kernel

        one_kernel = functools.partial(kernel.sanitize, num_tokens=num_tokens, num_pages=cache.num_pages,
                                       page_size=cache.page_size, max_q_len=meta.max_q_len)
        cu, kv_lens, tables, valid = jax.lax.platform_dependent(*args, cuda=one_kernel, default=reference)
    return dataclasses.replace(meta, cu_q_lens=cu, kv_lens=kv_lens, block_tables=tables), valid


def _sanitized_arrays(meta: AttentionMetadata, num_tokens: int, cache: KVCache | MLACache, cu_q_lens: jax.Array,
                      kv_lens: jax.Array, block_tables: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``meta.sanitize`` (XLA ops) with these arrays: ``(cu_q_lens, kv_lens, block_tables, valid)``."""
    checked, valid = dataclasses.replace(meta, cu_q_lens=cu_q_lens, kv_lens=kv_lens, block_tables=block_tables
                                         ).sanitize(num_tokens, cache.num_pages, cache.page_size)
    return checked.cu_q_lens, checked.kv_lens, checked.block_tables, valid


def scales_ok(cache: KVCache | MLACache) -> jax.Array | None:
    """bool[]: whether an FP8 cache's scales are all positive and finite; None for other caches."""
    if not cache.is_fp8:
        return None
    scales = jnp.stack(cache.scales).astype(jnp.float32)
    return jnp.all(jnp.isfinite(scales) & (scales > 0))


def with_scales_checked(plan_: AttentionPlan, cache: KVCache | MLACache, out: jax.Array
                        ) -> tuple[jax.Array, jax.Array]:
    """``(out, valid)`` of a call of ``plan_`` over ``cache``: all zero and all False when its FP8
    scales are not positive and finite (``scales_ok``), else ``out`` and the plan's flags. The
    output is selected only where a routed backend's kernels do not zero such rows themselves
    (``OpSupport.checks_fp8_scales``): a select is one more pass over the output per layer."""
    ok = scales_ok(cache)
    if ok is None:
        return out, plan_.valid
    phases = [phase for phase in (plan_.decode, plan_.main) if phase is not None]
    if not all(backends.REGISTRY[phase.backend].ops[phase.op].checks_fp8_scales for phase in phases):
        out = jnp.where(ok, out, jnp.zeros((), out.dtype))
    return out, plan_.valid & ok


def split_decodes(meta: AttentionMetadata, num_tokens: int, num_decode_rows: int
                  ) -> tuple[AttentionMetadata, AttentionMetadata, jax.Array]:
    """Splits a sanitized batch into its leading decodes and the rest.

    Returns ``(meta_dec, meta_rest, decode_rows)``: ``meta_dec`` describes the decodes as one token
    each over ``q[:num_decode_rows]`` (``num_decode_rows = min(T, B)``; other sequences empty),
    ``meta_rest`` the same batch with the decodes emptied, and ``decode_rows`` int32[num_decode_rows]
    the output row of each decode row (decode b is token b), ``num_tokens`` past the step's decodes
    (``meta.checked_num_decodes``), where a scatter drops it.
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
    rows = jnp.arange(num_decode_rows, dtype=jnp.int32)
    return meta_dec, meta_rest, jnp.where(rows < num_decodes, rows, num_tokens)


def with_decodes(plan_: AttentionPlan, out: jax.Array, out_dec: jax.Array) -> jax.Array:
    """The main phase's ``out`` ``[T, ...]`` with the decode phase's rows ``out_dec`` written in."""
    # Decode b is token b: only the decodes' rows are rewritten, in place (a select over all T rows
    # would cost a pass over a prefill's whole output). A scatter, not a dynamic_update_slice of
    # the first rows: XLA's GPU DynamicSliceFusion rewriter (jax 0.11) fails on a DUS into a
    # custom call's output ("DUS target must be a fusion parameter").
    return out.at[plan_.decode_rows].set(out_dec, mode="drop", indices_are_sorted=True)


def prefill_part(meta_rest: AttentionMetadata, num_decodes: jax.Array, count: int) -> AttentionMetadata:
    """``meta_rest`` (``split_decodes``' second part, sanitized with ``max_prefill_seqs = count``)
    as the ``count`` sequences from ``num_decodes`` on, the only ones in it with query tokens;
    itself when ``count`` is not below B. Their offsets keep pointing into the step's tokens (the
    first starts past the decodes'); the part's kernels run over ``count`` sequences, not B."""
    if count >= meta_rest.batch_size:
        return meta_rest
    # dynamic_slice moves a start past B - count back to it: the sequences added in front are
    # decodes, empty in meta_rest.
    rows = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=num_decodes, axis=0)
    return dataclasses.replace(meta_rest, cu_q_lens=rows(meta_rest.cu_q_lens, slice_size=count + 1),
                               kv_lens=rows(meta_rest.kv_lens, slice_size=count),
                               block_tables=rows(meta_rest.block_tables, slice_size=count),
                               num_decodes=jnp.zeros((), jnp.int32), max_prefill_seqs=None)


def abstract(x) -> jax.ShapeDtypeStruct | None:
    """``x``'s shape and dtype (None stays None)."""
    return None if x is None else jax.ShapeDtypeStruct(tuple(x.shape), jnp.dtype(x.dtype))


def _abstract_key(x) -> tuple | None:
    return None if x is None else (tuple(x.shape), jnp.dtype(x.dtype).name)


def _describe(value) -> str:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
        return f"{value[1]}{list(value[0])}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return str(value)


# ----------------------------------------------------------------------------------- argument checks

def check_operands(where: str, **operands) -> None:
    """ValueError unless each operand given (not None) is an array: shape structs are for
    ``jaxattn.plan``, which needs no values; an op computes with them."""
    for name, x in operands.items():
        if x is not None and not isinstance(x, (jax.Array, np.ndarray)):
            raise ValueError(f"{where}: {name} must be an array, got {type(x).__name__}"
                             + (" (shapes alone are for jaxattn.plan)" if isinstance(x, jax.ShapeDtypeStruct) else ""))


def check_attention_args(q, cache, meta, *, scale=None, causal=True, sliding_window=None, softcap=None, sinks=None,
                         backend="auto") -> AttentionParams:
    """``paged_attention``'s checks; its static options as ``AttentionParams``."""
    where = "paged_attention"
    dispatch.check_name(where, backend)
    if not isinstance(cache, KVCache):
        raise ValueError(f"{where}: cache must be a jaxattn.KVCache, got {type(cache).__name__}")
    if len(getattr(q, "shape", ())) != 3 or min(q.shape) < 1:
        raise ValueError(f"{where}: q must be [T, Hq, D] with T >= 1 (and Hq, D >= 1), got shape "
                         f"{getattr(q, 'shape', None)}")
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
    elif not is_positive_float32(scale):
        raise ValueError(f"{where}: scale must be a positive finite float, got {scale!r} (float32 must hold it)")
    if not isinstance(causal, bool):
        raise ValueError(f"{where}: causal must be a bool, got {causal!r}")
    if sliding_window is not None and not is_positive_int(sliding_window):
        raise ValueError(f"{where}: sliding_window must be None or an int >= 1, got {sliding_window!r} (below 2**31)")
    if softcap is not None and not is_positive_float32(softcap):
        raise ValueError(f"{where}: softcap must be None or a positive float, got {softcap!r} (finite in float32)")
    if sinks is not None:
        if getattr(sinks, "shape", None) != (num_q_heads,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise ValueError(f"{where}: sinks must be float32[{num_q_heads}] (one per query head; any float "
                             f"dtype is used in float32), got "
                             f"{getattr(sinks, 'dtype', type(sinks).__name__)}{list(getattr(sinks, 'shape', []))}")
    return AttentionParams(
        scale=float(scale),
        causal=causal,
        sliding_window=None if sliding_window is None else int(sliding_window),
        softcap=None if softcap is None else float(softcap),
        has_sinks=sinks is not None,
    )


def check_mla_args(where: str, q, q_rope, cache, meta, *, scale, causal=True, backend="auto", w_uk=None,
                   w_uv=None) -> AttentionParams:
    """The MLA ops' checks (``where``: "mla_paged_attention", whose ``q`` is ``q_latent``, or
    "mla_prefill", whose ``q`` is ``q_nope`` with ``q_rope``, or the whole query with ``q_rope`` None,
    and which also takes ``w_uk`` and ``w_uv``); their static options as ``AttentionParams``."""
    whole = where == "mla_prefill" and q_rope is None
    if where == "mla_paged_attention":
        queries = (("q_latent", q, "kv_lora_rank"), ("q_rope", q_rope, "rope_dim"))
    elif whole:
        queries = (("q", q, None),)
    else:
        queries = (("q_nope", q, None), ("q_rope", q_rope, "rope_dim"))
    if not isinstance(cache, MLACache):
        raise ValueError(f"{where}: cache must be a jaxattn.MLACache, got {type(cache).__name__}")
    first_name, first, _ = queries[0]
    if len(getattr(first, "shape", ())) != 3 or min(first.shape) < 1:
        raise ValueError(f"{where}: {first_name} must be [T, Hq, D] with T >= 1 (and Hq, D >= 1), got "
                         f"shape {getattr(first, 'shape', None)}")
    if not any(first.dtype == jnp.dtype(d) for d in _Q_DTYPES):
        raise ValueError(f"{where}: {first_name}.dtype must be float32, bfloat16 or float16, got {first.dtype}")
    for name, x, last in queries:
        if len(getattr(x, "shape", ())) != 3 or tuple(x.shape[:2]) != tuple(first.shape[:2]):
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
    if not is_positive_float32(scale):
        raise ValueError(f"{where}: scale must be a positive finite float, got {scale!r} (float32 must hold it)")
    if not isinstance(causal, bool):
        raise ValueError(f"{where}: causal must be a bool, got {causal!r}")
    if where == "mla_prefill":
        num_q_heads = first.shape[1]
        nope_dim = None if whole else first.shape[2]     # the whole query's Dn is w_uk's
        if not whole and getattr(w_uk, "ndim", 0) == 3 and nope_dim == w_uk.shape[2] + cache.rope_dim:
            raise ValueError(f"{where}: q_nope is {nope_dim} wide, the whole query's Dn + Dr = {w_uk.shape[2]} + "
                             f"{cache.rope_dim}, and q_rope was given too: pass the whole query with q_rope=None, "
                             f"or q_nope [T, Hq, Dn] with q_rope")
        for name, w, last, last_name in (("w_uk", w_uk, nope_dim, "Dn" if whole else f"Dn={nope_dim}"),
                                         ("w_uv", w_uv, None, "Dv")):
            shape = tuple(getattr(w, "shape", ()))
            if len(shape) != 3 or shape[:2] != (cache.kv_lora_rank, num_q_heads) or last not in (None, shape[2]) \
                    or shape[2] < 1:
                raise ValueError(f"{where}: {name} must be [kv_lora_rank={cache.kv_lora_rank}, Hq={num_q_heads}, "
                                 f"{last_name}], got {list(shape)}")
            if w.dtype != first.dtype:
                raise ValueError(f"{where}: {name}.dtype must be {first.dtype} (like {first_name}), got {w.dtype}")
        if whole and first.shape[2] != w_uk.shape[2] + cache.rope_dim:
            raise ValueError(f"{where}: q must be the whole query [T, Hq, Dn + Dr] (no-RoPE part first), "
                             f"Dn + Dr = {w_uk.shape[2]} + {cache.rope_dim} (w_uk's Dn, the cache's rope_dim), got "
                             f"shape {tuple(first.shape)}; or pass q_nope [T, Hq, Dn] with q_rope [T, Hq, Dr]")
    return AttentionParams(scale=float(scale), causal=causal, sliding_window=None, softcap=None, has_sinks=False)
