"""The registry's vocabulary: what a backend declares, and the call it is asked to take.

A backend is one module of ``jaxattn.backends`` that defines ``BACKEND = Backend(...)`` and one
entry in the registry (``jaxattn.backends.REGISTRY``). Its ``Backend`` says, as data, where it
runs (``archs``) and which ops it implements (``ops``: op name -> ``OpSupport``); each
``OpSupport`` carries the op's kernel entry (``run``), its ``Capabilities`` (dtypes, FP8 pages,
layouts, query lengths, options), a ``check`` for the limits that data does not express (page
sizes, head dims, ...), the ``rank`` by which ``auto`` orders the backends for a call, and an
optional ``prepare``: the operands the kernel needs that depend on the metadata and static shapes
alone, made once per step by ``jaxattn.plan`` and passed to every layer's ``run``.

The ops and their ``run`` signatures (all static options in ``AttentionParams``):
  paged_attention:      run(q, cache, meta, params, sinks) -> [T, Hq, D]
  mla_paged_attention:  run(q_latent, q_rope, cache, meta, params) -> [T, Hq, R]
  mla_prefill:          run(q, cache, meta, w_uk, w_uv, params) -> [T, Hq, Dv]
(mla_prefill's ``q`` is the whole query ``[T, Hq, Dn + Dr]``, no-RoPE part first: the op takes it
whole or concatenates its two parts once, so backends see one form.)
An op with a ``prepare`` also takes ``prepared=``: ``prepare``'s result for this call's metadata,
or None (the default), in which case ``run`` prepares it itself.

``prepare(call)`` gets the call with abstract queries (``jax.ShapeDtypeStruct``) and sanitized
metadata, and returns a pytree of arrays. It must not depend on the number of query or KV heads
beyond ``call.group_size`` where the op can be split over devices by heads (``paged_attention``:
``jaxattn.sharding`` runs ``run`` per head shard on the plan made for all heads).

Every op hands ``run`` sanitized metadata (``AttentionMetadata.sanitize``): offsets
non-decreasing within ``[0, T]``, ``kv_lens`` within the block tables' width and 0 for sequences
that broke the contract, and every block-table entry a page id in ``[0, num_pages)``. Backends
rely on this; only the Triton kernels keep an in-kernel bound on page ids, a guard that costs one
select per tile.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax

from jaxattn.kv_cache import KVCache, MLACache
from jaxattn.metadata import SPEC_DECODE_MAX_Q_LEN, AttentionMetadata

NO_GPU = "no NVIDIA GPU is visible to JAX (jax.devices('gpu') is empty)"


def gpu_devices() -> list[jax.Device]:
    """JAX's GPU devices; empty on a machine (or a jax install) without one."""
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@functools.cache
def sm_count() -> int:
    """SMs of the smallest local GPU: grids and workspaces sized by it fit every device of this
    process (a persistent, cooperative grid must fit the device that runs it)."""
    return min(int(d.core_count) for d in jax.local_devices(backend="gpu"))


@dataclasses.dataclass(frozen=True)
class AttentionParams:
    """Static (hashable) attention options, already validated by ``paged_attention``."""

    scale: float
    causal: bool
    sliding_window: int | None
    softcap: float | None
    has_sinks: bool


OPS: tuple[str, ...] = ("paged_attention", "mla_paged_attention", "mla_prefill")
# Options a backend may lack: a non-causal mask, and the AttentionParams / arguments of these names.
OPTIONS: tuple[str, ...] = ("non_causal", "sliding_window", "softcap", "sinks")
# Bands of ``OpSupport.rank``: lower ranks go first in ``auto``; None leaves the backend out.
RANK_FIRST, RANK_GENERAL, RANK_REFERENCE = 0, 10, 100


@dataclasses.dataclass(frozen=True)
class Call:
    """One op call as the registry judges it: static facts only (shapes, dtypes, options).

    ``q`` is the op's first query (``q``, ``q_latent``, or ``mla_prefill``'s whole query
    ``[T, Hq, Dn + Dr]``: ``[T, Hq, D]``, an array or a ``jax.ShapeDtypeStruct``: only its shape and
    dtype are read); ``q_rope`` ``mla_paged_attention``'s RoPE part (None for the other ops),
    ``w_uv`` ``mla_prefill``'s value projection.
    """

    op: str
    q: jax.Array
    cache: KVCache | MLACache
    meta: AttentionMetadata
    params: AttentionParams
    q_rope: jax.Array | None = None
    w_uv: jax.Array | None = None

    @property
    def phase(self) -> str:
        """"decode" (``meta.max_q_len == 1``), "spec_decode" (2..``SPEC_DECODE_MAX_Q_LEN``) or "prefill"."""
        max_q_len = self.meta.max_q_len
        if max_q_len == 1:
            return "decode"
        return "spec_decode" if max_q_len is not None and max_q_len <= SPEC_DECODE_MAX_Q_LEN else "prefill"

    @property
    def group_size(self) -> int:
        """Query heads per KV head (Hq // Hkv; MLA: Hq)."""
        return self.q.shape[1] // getattr(self.cache, "num_kv_heads", 1)

    def options(self) -> tuple[str, ...]:
        """The ``OPTIONS`` this call uses."""
        used = {"non_causal": not self.params.causal, "sliding_window": self.params.sliding_window is not None,
                "softcap": self.params.softcap is not None, "sinks": self.params.has_sinks}
        return tuple(name for name in OPTIONS if used[name])


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend takes for one op, as data (the registry checks these before ``check``).

    Attributes:
      dtypes: query dtypes (pages are like the query, or FP8 where ``fp8_pages``).
      fp8_pages: takes ``float8_e4m3fn`` pages.
      layouts: page layouts (``KVCache.layout``; empty for the MLA ops, whose pools have one).
      max_q_len: the largest static ``meta.max_q_len`` taken; None: any, unbounded included.
      options: the ``OPTIONS`` it implements.
    """

    dtypes: tuple[str, ...]
    fp8_pages: bool = False
    layouts: tuple[str, ...] = ("HND", "NHD")
    max_q_len: int | None = None
    options: tuple[str, ...] = OPTIONS

    def reason(self, call: Call) -> str | None:
        """Why ``call`` is outside these capabilities, or None."""
        dtype = call.q.dtype.name
        if dtype not in self.dtypes:
            return f"{dtype} queries are not supported; supported: {self.dtypes}"
        if call.cache.is_fp8 and not self.fp8_pages:
            return f"{call.cache.dtype} pages are not supported; supported: pages like the query ({self.dtypes})"
        if not call.cache.is_fp8 and call.cache.dtype != call.q.dtype:
            return f"{call.cache.dtype} pages with {dtype} queries are not supported; pages must be like the query"
        layout = getattr(call.cache, "layout", None)
        if layout is not None and layout not in self.layouts:
            return f"layout {layout!r} is not supported; supported: {self.layouts}"
        max_q_len = call.meta.max_q_len
        if self.max_q_len is not None and (max_q_len is None or max_q_len > self.max_q_len):
            return (f"meta.max_q_len={max_q_len} is not supported: it runs steps whose queries are at most "
                    f"{self.max_q_len} tokens (a static meta.max_q_len <= {self.max_q_len})")
        missing = [name for name in call.options() if name not in self.options]
        if missing:
            return f"{', '.join(missing)} not supported; supported options: {self.options or 'none'}"
        return None

    def describe(self) -> str:
        """One line for ``jaxattn.info``."""
        queries = "any q length" if self.max_q_len is None else f"max_q_len <= {self.max_q_len}"
        pages = " + fp8 pages" if self.fp8_pages else ""
        layouts = f"{'/'.join(self.layouts)}; " if self.layouts else ""
        return f"{'/'.join(self.dtypes)}{pages}; {layouts}{queries}; options: {', '.join(self.options) or 'none'}"


def no_limits(call: Call) -> str | None:
    """``OpSupport.check`` of a backend whose ``Capabilities`` say everything."""
    del call
    return None


def constant_rank(rank: int | None) -> Callable[[Call], int | None]:
    """``OpSupport.rank`` that ranks every call the same."""
    return lambda call: rank


@dataclasses.dataclass(frozen=True)
class OpSupport:
    """One op of a backend: its kernel entry, what it takes, and where ``auto`` puts it.

    Attributes:
      run: the op's kernel entry (signatures in the module docstring).
      capabilities: what it takes, as data.
      check: the limits ``capabilities`` do not express; None or why not (no op or backend prefix).
      rank: ``auto``'s order for this call (lower first, ``RANK_*`` bands); None: ``auto`` skips it.
      prepare: the kernel's per-step operands for this call (module docstring), or None: it has none.
      checks_fp8_scales: its kernels give all-zero rows themselves over FP8 pages whose scales are
        not positive and finite, so the op adds no select over their output (the op still reports
        every sequence invalid then).
    """

    run: Callable[..., jax.Array]
    capabilities: Capabilities
    check: Callable[[Call], str | None] = no_limits
    rank: Callable[[Call], int | None] = constant_rank(RANK_GENERAL)
    prepare: Callable[[Call], Any] | None = None
    checks_fp8_scales: bool = False


@dataclasses.dataclass(frozen=True)
class Backend:
    """A backend as the registry knows it.

    Attributes:
      name: what ``backend=`` takes.
      kernel: one line on what it runs (``jaxattn.info``).
      archs: where it runs: "cpu", "gpu" (any NVIDIA GPU), "sm_90" (compute capability 9.x only) or
        "sm_80+" (8.0 and newer).
      ops: the ops it implements.
      requirements: why it cannot run on a machine whose arch it takes (missing packages, a
        toolchain), or None.
    """

    name: str
    kernel: str
    archs: tuple[str, ...]
    ops: dict[str, OpSupport]
    requirements: Callable[[], str | None] = lambda: None


def compute_capability(device: jax.Device) -> tuple[int, int]:
    """(major, minor) of a GPU device; (0, 0) where JAX does not say."""
    major, minor = str(getattr(device, "compute_capability", "0.0")).split(".")[:2]
    return int(major), int(minor)


def arch_reason(archs: tuple[str, ...]) -> str | None:
    """Why a backend that runs on ``archs`` cannot run on this machine's first device, or None."""
    gpus = gpu_devices()
    if not gpus:
        return None if "cpu" in archs else NO_GPU
    if "gpu" in archs:
        return None
    major, minor = compute_capability(gpus[0])
    for arch in archs:
        if arch.startswith("sm_"):
            want = int(arch[3:].rstrip("+"))
            if (arch.endswith("+") and major * 10 + minor >= want) or major == want // 10:
                return None
    return f"runs on {', '.join(archs)}; {gpus[0].device_kind} has compute capability {major}.{minor}"
