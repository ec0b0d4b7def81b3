"""Paged KV caches: K and V page pools plus optional FP8 scales (``KVCache``), the latent pool of
multi-head latent attention (``MLACache``), and the slots a step writes (``SlotMapping``)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxattn.checks import int_array, is_positive_float32, is_positive_int

Layout = Literal["HND", "NHD"]
LAYOUTS: tuple[str, ...] = ("HND", "NHD")
FP8_DTYPE = jnp.float8_e4m3fn
_FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)
CACHE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, FP8_DTYPE)


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) == jnp.dtype(FP8_DTYPE)


def kv_head_axis(layout: Layout) -> int:
    """The KV-head axis of a page pool: 1 in HND ``[N, Hkv, page, D]``, 2 in NHD ``[N, page, Hkv, D]``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return 1 if layout == "HND" else 2


def pool_sharding(mesh: Mesh, axis: str | tuple[str, ...], layout: Layout = "HND") -> NamedSharding:
    """The sharding of page pools split by KV heads over mesh ``axis`` (tensor parallelism):
    ``P(None, axis, None, None)`` for HND, ``P(None, None, axis, None)`` for NHD."""
    spec = [None] * 4
    spec[kv_head_axis(layout)] = axis
    return NamedSharding(mesh, PartitionSpec(*spec))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotMapping:
    """The cache slot of each packed token of a step, as ``PageTable.slot_mapping`` makes it.

    Attributes:
      slots: int32[T], ``page * page_size + offset`` of each token; -1 for padding tokens.
      page_size, num_pages: static, the pool of the ``PageTable`` that made them. A slot is only
        meaningful in a pool of the same page size (and pool size): ``KVCache.write`` and
        ``MLACache.write`` raise ``ValueError`` when they differ from the cache's. A plain int
        array of slots carries no pool and is written as it is.
    """

    slots: jax.Array
    page_size: int = dataclasses.field(metadata=dict(static=True))
    num_pages: int = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """K and V page pools of one attention layer.

    Attributes:
      k_pages, v_pages: ``[num_pages, Hkv, page_size, D]`` (HND) or
        ``[num_pages, page_size, Hkv, D]`` (NHD).
      k_scale, v_scale: float32 scalars for FP8 pages (stored value = value / scale), else None.
      layout: "HND" or "NHD" (static).
    """

    k_pages: jax.Array
    v_pages: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    layout: Layout = dataclasses.field(default="HND", metadata=dict(static=True))

    def __post_init__(self):
        _check_cache(self)

    @classmethod
    def create(
        cls,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype=jnp.bfloat16,
        layout: Layout = "HND",
        k_scale: float | None = None,
        v_scale: float | None = None,
        sharding: NamedSharding | None = None,
    ) -> "KVCache":
        """A zeroed cache. FP8 caches get scales (default 1.0, positive and finite); other
        dtypes take none.

        ``sharding``: where the pools live, ``pool_sharding(mesh, axis, layout)`` to split them by
        KV heads over a mesh axis (each device allocates only its heads; the scales are replicated
        on the same mesh); None: JAX's default device.
        """
        for name, value in (("num_pages", num_pages), ("page_size", page_size),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not is_positive_int(value):
                raise ValueError(f"KVCache.create: {name} must be a positive int, got {value!r}")
        if num_pages < 2:
            raise ValueError(f"KVCache.create: num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        if layout not in LAYOUTS:
            raise ValueError(f"KVCache.create: layout must be one of {LAYOUTS}, got {layout!r}")
        dtype = _cache_dtype("KVCache.create", dtype)
        if layout == "HND":
            shape = (num_pages, num_kv_heads, page_size, head_dim)
        else:
            shape = (num_pages, page_size, num_kv_heads, head_dim)
        scale_device = None
        if sharding is not None:
            _check_pool_sharding(sharding, layout, num_kv_heads)
            scale_device = NamedSharding(sharding.mesh, PartitionSpec())
        if is_fp8(dtype):
            k_scale = jnp.asarray(1.0 if k_scale is None else _checked_scale("KVCache.create", "k_scale", k_scale),
                                  jnp.float32, device=scale_device)
            v_scale = jnp.asarray(1.0 if v_scale is None else _checked_scale("KVCache.create", "v_scale", v_scale),
                                  jnp.float32, device=scale_device)
        elif k_scale is not None or v_scale is not None:
            raise ValueError(f"KVCache.create: k_scale/v_scale are only for {jnp.dtype(FP8_DTYPE).name} "
                             f"pages, got dtype={jnp.dtype(dtype).name}")
        return cls(jnp.zeros(shape, dtype, device=sharding), jnp.zeros(shape, dtype, device=sharding),
                   k_scale, v_scale, layout)

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2 if self.layout == "HND" else 1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pages.shape[1 if self.layout == "HND" else 2]

    @property
    def head_dim(self) -> int:
        return self.k_pages.shape[3]

    @property
    def dtype(self) -> jnp.dtype:
        return self.k_pages.dtype

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.dtype)

    @property
    def scales(self) -> tuple[jax.Array, ...]:
        """The FP8 scales (k_scale, v_scale); empty for other dtypes."""
        return () if self.k_scale is None else (self.k_scale, self.v_scale)

    def write(self, k: jax.Array, v: jax.Array, slot_mapping: SlotMapping | jax.Array) -> "KVCache":
        """Scatters tokens ``k, v: [T, Hkv, D]`` to ``slot = page * page_size + offset``.

        ``slot_mapping``: a ``SlotMapping`` (``PageTable.slot_mapping``'s, ValueError unless its
        page table has this cache's page size and pool size), or int[T] slots (an array or a
        list). Tokens with ``slot < 0`` (padding), a slot in the null page 0 or outside the pool
        are skipped. The update is in place when the caller's jit donates the cache.
        """
        t = _check_tokens("KVCache.write", self, k, v)
        page, offset = _slots("KVCache.write", slot_mapping, t, self.num_pages, self.page_size)
        return dataclasses.replace(
            self,
            k_pages=self._scatter(self.k_pages, page, offset, _quantize(k, self.dtype, self.k_scale)),
            v_pages=self._scatter(self.v_pages, page, offset, _quantize(v, self.dtype, self.v_scale)),
        )

    def copy_pages(self, copies: jax.Array) -> "KVCache":
        """Copies whole pages: ``copies`` is int[N, 2] of (src, dst) rows; rows with an id
        outside ``[1, num_pages)`` are skipped (e.g. the ``-1`` padding of ``PageTable.fork``):
        the null page 0 is never read or written."""
        src, dst = _copy_rows("KVCache.copy_pages", copies, self.num_pages)
        return dataclasses.replace(
            self,
            k_pages=self.k_pages.at[dst].set(self.k_pages[src], mode="drop"),
            v_pages=self.v_pages.at[dst].set(self.v_pages[src], mode="drop"),
        )

    def zero_pages(self, pages: jax.Array) -> "KVCache":
        """Zeroes the listed pages (int[N]); ids outside ``[1, num_pages)`` are skipped (the
        null page 0 is never written)."""
        pages = _zeroed_pages("KVCache.zero_pages", pages, self.num_pages)
        return dataclasses.replace(
            self,
            k_pages=self.k_pages.at[pages].set(0, mode="drop"),
            v_pages=self.v_pages.at[pages].set(0, mode="drop"),
        )

    def _scatter(self, pages: jax.Array, page: jax.Array, offset: jax.Array, values: jax.Array) -> jax.Array:
        # The KV-head axis stays a whole (sliced) dimension of the scatter, so a pool sharded by
        # KV heads is written per shard without gathering it.
        if self.layout == "NHD":
            return pages.at[page, offset].set(values, mode="drop")
        return pages.at[page, :, offset].set(values, mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLACache:
    """The latent page pool of one multi-head latent attention (MLA) layer (DeepSeek-V2/V3).

    A token stores one latent of ``kv_lora_rank + rope_dim`` values (512 + 64 = 576 in DeepSeek):
    its compressed KV ``c_kv`` (after the RMSNorm) followed by its RoPE'd key part ``k_rope``,
    shared by every query head. With a single "KV head", HND and NHD are the same layout.

    Attributes:
      pages: ``[num_pages, page_size, kv_lora_rank + rope_dim]``.
      scale: float32 scalar for FP8 pages (stored value = value / scale), else None.
      kv_lora_rank: width of the ``c_kv`` part (static); the remaining ``rope_dim`` values are ``k_rope``.
    """

    pages: jax.Array
    scale: jax.Array | None = None
    kv_lora_rank: int = dataclasses.field(default=512, metadata=dict(static=True))

    def __post_init__(self):
        if isinstance(self.pages, list):
            raise ValueError("MLACache: pages must be an array, got a list")
        if not isinstance(self.pages, (jax.Array, np.ndarray)):
            return  # placeholder leaves while JAX rebuilds the pytree
        if not is_positive_int(self.kv_lora_rank):
            raise ValueError(f"MLACache: kv_lora_rank must be a positive int, got {self.kv_lora_rank!r}")
        if self.pages.ndim != 3 or self.pages.shape[2] <= self.kv_lora_rank or min(self.pages.shape) < 1:
            raise ValueError(f"MLACache: pages must be [num_pages, page_size, kv_lora_rank + rope_dim] with "
                             f"rope_dim >= 1 (kv_lora_rank={self.kv_lora_rank}), got {list(self.pages.shape)} "
                             f"(every size >= 1)")
        if not any(self.pages.dtype == jnp.dtype(d) for d in CACHE_DTYPES):
            raise ValueError(f"MLACache: page dtype must be one of "
                             f"{[jnp.dtype(d).name for d in CACHE_DTYPES]}, got {self.pages.dtype}")
        if self.is_fp8 != (self.scale is not None):
            raise ValueError(f"MLACache: FP8 pages need a scale (float32 scalar) and other dtypes take none, "
                             f"got dtype {self.pages.dtype} and scale {self.scale!r}")
        if self.scale is not None:
            _checked_scale("MLACache", "scale", self.scale)

    @classmethod
    def create(cls, num_pages: int, page_size: int, kv_lora_rank: int = 512, rope_dim: int = 64,
               dtype=jnp.bfloat16, scale: float | None = None,
               sharding: NamedSharding | None = None) -> "MLACache":
        """A zeroed pool of ``num_pages`` pages (page 0 is the null page). FP8 pools get a scale
        (default 1.0, positive and finite); other dtypes take none. ``sharding``: where the pool
        and its scale live, replicated (``PartitionSpec()``) over a mesh: every device attends
        with its whole latent pool."""
        for name, value in (("num_pages", num_pages), ("page_size", page_size),
                            ("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim)):
            if not is_positive_int(value):
                raise ValueError(f"MLACache.create: {name} must be a positive int, got {value!r}")
        if num_pages < 2:
            raise ValueError(f"MLACache.create: num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        dtype = _cache_dtype("MLACache.create", dtype)
        if sharding is not None and not (isinstance(sharding, NamedSharding) and sharding.is_fully_replicated):
            raise ValueError(f"MLACache.create: sharding must be a replicated NamedSharding (the latent pool is not "
                             f"split over devices), got {sharding!r}")
        if is_fp8(dtype):
            scale = jnp.asarray(1.0 if scale is None else _checked_scale("MLACache.create", "scale", scale),
                                jnp.float32, device=sharding)
        elif scale is not None:
            raise ValueError(f"MLACache.create: scale is only for {jnp.dtype(FP8_DTYPE).name} pages, "
                             f"got dtype={jnp.dtype(dtype).name}")
        return cls(jnp.zeros((num_pages, page_size, kv_lora_rank + rope_dim), dtype, device=sharding), scale,
                   kv_lora_rank)

    @property
    def num_pages(self) -> int:
        return self.pages.shape[0]

    @property
    def page_size(self) -> int:
        return self.pages.shape[1]

    @property
    def head_dim(self) -> int:
        """Latent width, ``kv_lora_rank + rope_dim``."""
        return self.pages.shape[2]

    @property
    def rope_dim(self) -> int:
        return self.head_dim - self.kv_lora_rank

    @property
    def dtype(self) -> jnp.dtype:
        return self.pages.dtype

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.dtype)

    @property
    def scales(self) -> tuple[jax.Array, ...]:
        """The FP8 scale, as ``(scale,)``; empty for other dtypes."""
        return () if self.scale is None else (self.scale,)

    def write(self, latents: jax.Array, slot_mapping: SlotMapping | jax.Array) -> "MLACache":
        """Scatters ``latents: [T, kv_lora_rank + rope_dim]`` (``c_kv`` then ``k_rope``) to
        ``slot = page * page_size + offset``; ``slot_mapping`` is checked and its slots skipped
        as in ``KVCache.write``."""
        if getattr(latents, "ndim", None) != 2 or latents.shape[1] != self.head_dim \
                or not jnp.issubdtype(latents.dtype, jnp.floating):
            raise ValueError(f"MLACache.write: latents must be [T, {self.head_dim}] (kv_lora_rank + rope_dim) "
                             f"floats, got {_describe(latents)}")
        page, offset = _slots("MLACache.write", slot_mapping, latents.shape[0], self.num_pages, self.page_size)
        values = _quantize(latents, self.dtype, self.scale)
        return dataclasses.replace(self, pages=self.pages.at[page, offset].set(values, mode="drop"))

    def copy_pages(self, copies: jax.Array) -> "MLACache":
        """Copies whole pages, as ``KVCache.copy_pages``."""
        src, dst = _copy_rows("MLACache.copy_pages", copies, self.num_pages)
        return dataclasses.replace(self, pages=self.pages.at[dst].set(self.pages[src], mode="drop"))

    def zero_pages(self, pages: jax.Array) -> "MLACache":
        """Zeroes the listed pages, as ``KVCache.zero_pages``."""
        pages = _zeroed_pages("MLACache.zero_pages", pages, self.num_pages)
        return dataclasses.replace(self, pages=self.pages.at[pages].set(0, mode="drop"))


def _quantize(x: jax.Array, dtype, scale: jax.Array | None) -> jax.Array:
    """``x`` as stored in pages of ``dtype``: divided by the scale for FP8 pages."""
    if not is_fp8(dtype):
        return x.astype(dtype)
    # e4m3fn has no infinity: saturate instead of producing NaN.
    return jnp.clip(x.astype(jnp.float32) / scale, -_FP8_MAX, _FP8_MAX).astype(dtype)


def _slots(where: str, slot_mapping, num_tokens: int, num_pages: int, page_size: int) -> tuple[jax.Array, jax.Array]:
    """(page, offset) of each token's slot; slots outside ``[page_size, num_pages * page_size)``
    (padding, the null page, outside the pool) get page ``num_pages``, which ``mode="drop"`` discards.
    ValueError when a ``SlotMapping``'s page table describes another pool than the cache's."""
    if isinstance(slot_mapping, SlotMapping):
        for field, actual in (("page_size", page_size), ("num_pages", num_pages)):
            made_for = getattr(slot_mapping, field)
            if made_for != actual:
                raise ValueError(f"{where}: slot_mapping was made by a PageTable with {field}={made_for}, but the "
                                 f"cache has {field}={actual}; the page table and the cache must describe the "
                                 f"same pool")
        slot_mapping = slot_mapping.slots
    slot_mapping = int_array(where, "slot_mapping", slot_mapping, f"int[{num_tokens}]", (num_tokens,))
    in_pool = (slot_mapping >= page_size) & (slot_mapping < num_pages * page_size)
    page = jnp.where(in_pool, slot_mapping // page_size, num_pages)
    offset = jnp.where(in_pool, slot_mapping % page_size, 0)
    return page, offset


def _copy_rows(where: str, copies, num_pages: int) -> tuple[jax.Array, jax.Array]:
    """(src, dst) of ``copies`` int[N, 2]; rows with an id outside ``[1, num_pages)`` read page 0
    and write page ``num_pages`` (dropped)."""
    copies = int_array(where, "copies", copies, "int[N, 2]")
    if copies.ndim != 2 or copies.shape[1] != 2:
        raise ValueError(f"{where}: copies must be int[N, 2], got {copies.dtype}{list(copies.shape)}")
    src, dst = copies[:, 0], copies[:, 1]
    valid = (src >= 1) & (src < num_pages) & (dst >= 1) & (dst < num_pages)
    return jnp.where(valid, src, 0), jnp.where(valid, dst, num_pages)


def _zeroed_pages(where: str, pages, num_pages: int) -> jax.Array:
    """``pages`` int[N] with ids outside ``[1, num_pages)`` made ``num_pages`` (dropped)."""
    pages = int_array(where, "pages", pages, "int[N]")
    if pages.ndim != 1:
        raise ValueError(f"{where}: pages must be int[N], got {pages.dtype}{list(pages.shape)}")
    return jnp.where((pages >= 1) & (pages < num_pages), pages, num_pages)


def _check_cache(cache: KVCache) -> None:
    if any(isinstance(x, list) for x in (cache.k_pages, cache.v_pages)):
        raise ValueError("KVCache: k_pages and v_pages must be arrays, got a list")
    # Skip checks when JAX rebuilds the pytree with placeholder leaves (shape structs, specs).
    if not all(isinstance(x, (jax.Array, np.ndarray)) for x in (cache.k_pages, cache.v_pages)):
        return
    if cache.layout not in LAYOUTS:
        raise ValueError(f"KVCache: layout must be one of {LAYOUTS}, got {cache.layout!r}")
    if cache.k_pages.ndim != 4 or cache.k_pages.shape != cache.v_pages.shape or min(cache.k_pages.shape) < 1:
        raise ValueError(f"KVCache: k_pages and v_pages must be 4-D arrays of the same shape, "
                         f"got {list(cache.k_pages.shape)} and {list(cache.v_pages.shape)} (every size >= 1)")
    if cache.k_pages.dtype != cache.v_pages.dtype:
        raise ValueError(f"KVCache: k_pages and v_pages must share a dtype, "
                         f"got {cache.k_pages.dtype} and {cache.v_pages.dtype}")
    if not any(cache.k_pages.dtype == jnp.dtype(d) for d in CACHE_DTYPES):
        raise ValueError(f"KVCache: page dtype must be one of "
                         f"{[jnp.dtype(d).name for d in CACHE_DTYPES]}, got {cache.k_pages.dtype}")
    has_scales = (cache.k_scale is not None, cache.v_scale is not None)
    if is_fp8(cache.k_pages.dtype) and has_scales != (True, True):
        raise ValueError("KVCache: FP8 pages need both k_scale and v_scale (float32 scalars)")
    if not is_fp8(cache.k_pages.dtype) and any(has_scales):
        raise ValueError(f"KVCache: k_scale/v_scale are only for FP8 pages, got dtype {cache.k_pages.dtype}")
    for name in ("k_scale", "v_scale"):
        if getattr(cache, name) is not None:
            _checked_scale("KVCache", name, getattr(cache, name))


def _checked_scale(where: str, name: str, scale):
    """An FP8 scale: a float scalar; positive and finite where its value is known on the host
    (a device array's value is checked on the device: ``paged_attention`` flags every sequence)."""
    if isinstance(scale, jax.Array):
        if scale.shape != () or not jnp.issubdtype(scale.dtype, jnp.floating):
            raise ValueError(f"{where}: {name} must be a float32 scalar, got {scale.dtype}{list(scale.shape)}")
        return scale
    value = np.asarray(scale) if isinstance(scale, (np.ndarray, np.generic)) else scale
    if isinstance(value, np.ndarray):
        value = value.item() if value.shape == () else None
    if not is_positive_float32(value):
        raise ValueError(f"{where}: {name} must be a positive finite float, got {scale!r} (float32 must hold it)")
    return scale


def is_cache_dtype(dtype) -> bool:
    """Whether ``dtype`` names one of ``CACHE_DTYPES`` (float64 does not: JAX would make float32
    pages of it without x64)."""
    try:
        return dtype is not None and any(jnp.dtype(dtype) == jnp.dtype(d) for d in CACHE_DTYPES)
    except TypeError:
        return False


def _cache_dtype(where: str, dtype) -> jnp.dtype:
    """``dtype`` as a page dtype (``is_cache_dtype``), else a ValueError."""
    if not is_cache_dtype(dtype):
        raise ValueError(f"{where}: page dtype must be one of {[jnp.dtype(d).name for d in CACHE_DTYPES]}, "
                         f"got {dtype!r}")
    return jnp.dtype(dtype)


def _describe(x) -> str:
    """``dtype[shape]`` of an array, else the type's name."""
    return f"{x.dtype}{list(x.shape)}" if hasattr(x, "shape") and hasattr(x, "dtype") else type(x).__name__


def _check_pool_sharding(sharding: NamedSharding, layout: Layout, num_kv_heads: int) -> None:
    if not isinstance(sharding, NamedSharding):
        raise ValueError(f"KVCache.create: sharding must be a jax.sharding.NamedSharding "
                         f"(jaxattn.kv_cache.pool_sharding(mesh, axis, layout)), got {type(sharding).__name__}")
    spec = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))
    axis = kv_head_axis(layout)
    if len(spec) != 4 or any(entry is not None for i, entry in enumerate(spec) if i != axis):
        raise ValueError(f"KVCache.create: sharding may split only the KV-head axis of {layout} pages "
                         f"(dimension {axis}, as pool_sharding(mesh, axis, {layout!r}) does), got {sharding.spec}")
    shape = (1, num_kv_heads, 1, 1) if axis == 1 else (1, 1, num_kv_heads, 1)
    try:
        sharding.shard_shape(shape)
    except ValueError as err:
        raise ValueError(f"KVCache.create: num_kv_heads ({num_kv_heads}) must be a multiple of the number of "
                         f"shards of {sharding.spec}; with more shards than KV heads, create the cache with "
                         f"num_kv_heads = the number of shards (jaxattn.sharding.replicate_kv_heads)") from err


def _check_tokens(where: str, cache: KVCache, k: jax.Array, v: jax.Array) -> int:
    expected = (cache.num_kv_heads, cache.head_dim)
    arrays = all(hasattr(x, "shape") and hasattr(x, "dtype") for x in (k, v))
    if not arrays or k.ndim != 3 or k.shape[1:] != expected or k.shape != v.shape \
            or not all(jnp.issubdtype(x.dtype, jnp.floating) for x in (k, v)):
        raise ValueError(f"{where}: k and v must both be [T, {expected[0]}, {expected[1]}] "
                         f"(num_kv_heads, head_dim of the cache) float arrays, got {_describe(k)} and {_describe(v)}")
    return k.shape[0]
