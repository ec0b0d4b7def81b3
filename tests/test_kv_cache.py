"""KVCache and MLACache: creation, scatter writes (round trips, skipped slots, donation), page copies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import KVCache, MLACache, PageTable, kv_cache
from jaxattn.kv_cache import SlotMapping


def _read_slots(cache: KVCache, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Host-side read of tokens at ``slots`` -> [T, Hkv, D] each."""
    page, off = slots // cache.page_size, slots % cache.page_size
    out = []
    for pages, scale in ((cache.k_pages, cache.k_scale), (cache.v_pages, cache.v_scale)):
        x = np.asarray(pages.astype(jnp.float32))
        x = x[page, :, off] if cache.layout == "HND" else x[page, off]
        out.append(x * (1.0 if scale is None else float(scale)))
    return out[0], out[1]


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_create_shapes(layout):
    cache = KVCache.create(10, 16, 4, 64, dtype=jnp.float16, layout=layout)
    expected = (10, 4, 16, 64) if layout == "HND" else (10, 16, 4, 64)
    assert cache.k_pages.shape == cache.v_pages.shape == expected
    assert (cache.num_pages, cache.page_size, cache.num_kv_heads, cache.head_dim) == (10, 16, 4, 64)
    assert cache.k_scale is None and cache.layout == layout


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
def test_write_round_trip_skips_padding_null_page_and_out_of_pool_slots(layout, dtype):
    rng = np.random.default_rng()
    cache = KVCache.create(6, 8, 2, 16, dtype=dtype, layout=layout)
    slots = rng.permutation(6 * 8)[:20].astype(np.int32)
    slots[[3, 11]] = -1                       # padding
    slots[7] = 6 * 8 + 5                      # past the pool: dropped, never wraps around
    slots[9] = 2                              # the null page 0: never written
    k = rng.normal(size=(20, 2, 16)).astype(np.float32)
    v = rng.normal(size=(20, 2, 16)).astype(np.float32)
    out = jax.jit(KVCache.write)(cache, jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(slots))
    keep = (slots >= 8) & (slots < 48)
    k_read, v_read = _read_slots(out, slots[keep])
    tol = 0.07 if dtype == jnp.float8_e4m3fn else 1e-2
    np.testing.assert_allclose(k_read, k[keep], rtol=tol, atol=tol)
    np.testing.assert_allclose(v_read, v[keep], rtol=tol, atol=tol)
    written = np.zeros(48, bool)
    written[slots[keep]] = True
    k_all, _ = _read_slots(out, np.arange(48))
    assert not k_all[~written].any(), "a skipped slot was written"


def test_fp8_write_saturates_instead_of_nan():
    cache = KVCache.create(2, 4, 1, 8, dtype=jnp.float8_e4m3fn, k_scale=0.5, v_scale=2.0)
    big = jnp.full((1, 1, 8), 1e6, jnp.float32)
    out = cache.write(big, -big, jnp.asarray([4], jnp.int32))
    k, v = _read_slots(out, np.array([4]))
    assert np.isfinite(k).all() and np.isfinite(v).all()
    assert k.min() == 448 * 0.5 and v.max() == -448 * 2.0


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_write_is_in_place_when_donated(layout):
    cache = KVCache.create(64, 16, 4, 64, dtype=jnp.float32, layout=layout)
    cache = jax.tree.map(lambda x: x + 1, cache)   # a buffer of our own to donate
    write = jax.jit(KVCache.write, donate_argnums=0)
    k = jnp.ones((5, 4, 64), jnp.float32)
    slots = jnp.asarray([17, 30, -1, 900, 40], jnp.int32)
    hlo = write.lower(cache, k, k, slots).compile().as_text()
    pool_shape = "f32[" + ",".join(map(str, cache.k_pages.shape)) + "]"
    assert "copy(" not in " ".join(line for line in hlo.splitlines() if pool_shape in line.split("=")[0]), hlo
    before = (cache.k_pages.unsafe_buffer_pointer(), cache.v_pages.unsafe_buffer_pointer())
    out = write(cache, k, k, slots)
    after = (out.k_pages.unsafe_buffer_pointer(), out.v_pages.unsafe_buffer_pointer())
    assert after == before
    assert cache.k_pages.is_deleted()


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_copy_pages_and_zero_pages(layout):
    rng = np.random.default_rng()
    cache = KVCache(*(jnp.asarray(rng.normal(size=(5, 2, 4, 8)), jnp.float32) for _ in range(2)), layout=layout)
    copies = [[1, 3], [-1, -1], [2, 7], [4, 0], [0, 2]]      # a list; page 0 is never read or written
    out = cache.copy_pages(copies)
    k0, k1 = np.asarray(cache.k_pages), np.asarray(out.k_pages)
    np.testing.assert_array_equal(k1[3], k0[1])
    np.testing.assert_array_equal(k1[[0, 1, 2, 4]], k0[[0, 1, 2, 4]])
    zeroed = out.zero_pages([2, -1, 99, 0])
    assert not np.asarray(zeroed.v_pages[2]).any()
    np.testing.assert_array_equal(np.asarray(zeroed.v_pages)[[0, 1, 3, 4]], np.asarray(out.v_pages)[[0, 1, 3, 4]])
    k = jnp.full((2, cache.num_kv_heads, 8), 5.0, jnp.float32)
    written = cache.write(k, k, [3 * cache.page_size + 1, 1])               # slots as a list; slot 1 is page 0
    np.testing.assert_array_equal(_read_slots(written, np.array([3 * cache.page_size + 1]))[0], 5.0)
    np.testing.assert_array_equal(np.asarray(written.k_pages[0]), k0[0])


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_pages=1), "num_pages must be >= 2"),
    (dict(page_size=0), "page_size must be a positive int"),
    (dict(layout="HDN"), "layout must be one of"),
    (dict(dtype=jnp.bfloat16, k_scale=2.0), "only for float8_e4m3fn"),
    (dict(dtype=jnp.int8), "page dtype must be one of"),
    (dict(page_size=True), "page_size must be a positive int"),
    (dict(dtype=jnp.float8_e4m3fn, k_scale=-1.0), "k_scale must be a positive finite float"),
    (dict(dtype=jnp.float8_e4m3fn, v_scale=float("nan")), "v_scale must be a positive finite float"),
    (dict(dtype=jnp.float8_e4m3fn, v_scale=np.float32(0)), "v_scale must be a positive finite float"),
    (dict(dtype=jnp.float8_e4m3fn, k_scale=1e39), "k_scale must be a positive finite float"),   # inf in float32
    (dict(dtype=jnp.float8_e4m3fn, k_scale=10 ** 400), "k_scale must be a positive finite float"),
    (dict(dtype=None), "page dtype must be one of"),
    (dict(dtype=jnp.float64), "page dtype must be one of"),     # JAX would make float32 pages of it
    (dict(dtype="not a dtype"), "page dtype must be one of"),
    (dict(head_dim=2 ** 31), "head_dim must be a positive int"),
])
def test_create_errors(kwargs, match):
    args = dict(num_pages=4, page_size=16, num_kv_heads=2, head_dim=64)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        KVCache.create(**args)


def test_constructor_errors():
    pages = jnp.zeros((4, 2, 16, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="same shape"):
        KVCache(pages, pages[:, :1])
    with pytest.raises(ValueError, match="share a dtype"):
        KVCache(pages, pages.astype(jnp.float16))
    with pytest.raises(ValueError, match="need both k_scale and v_scale"):
        KVCache(pages.astype(jnp.float8_e4m3fn), pages.astype(jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="layout must be one of"):
        KVCache(pages, pages, layout="BSHD")
    for empty in (pages[:, :0], pages[:, :, :0], pages[:0]):
        with pytest.raises(ValueError, match="every size >= 1"):
            KVCache(empty, empty)
    with pytest.raises(ValueError, match="must be arrays, got a list"):
        KVCache([[0.0]], [[0.0]])
    with pytest.raises(ValueError, match="every size >= 1"):
        MLACache(jnp.zeros((4, 0, 12), jnp.bfloat16), kv_lora_rank=8)
    with pytest.raises(ValueError, match="pages must be an array, got a list"):
        MLACache([[0.0]], kv_lora_rank=8)


def test_write_errors():
    cache = KVCache.create(4, 16, 2, 64)
    k = jnp.zeros((3, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"k and v must both be \[T, 2, 64\]"):
        cache.write(k[:, :1], k[:, :1], jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match=r"float arrays, got int32\[3, 2, 64\] and int32\[3, 2, 64\]"):
        cache.write(k.astype(jnp.int32), k.astype(jnp.int32), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match=r"float arrays, got list and bfloat16\[3, 2, 64\]"):
        cache.write(k.tolist(), k, jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match=r"slot_mapping must be int\[3\] with int32 values"):
        cache.write(k, k, np.asarray([2 ** 32, 0, 0]))        # JAX would wrap it to slot 0
    with pytest.raises(ValueError, match=r"slot_mapping must be int\[3\]"):
        cache.write(k, k, jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match=r"slot_mapping must be int\[3\]"):
        cache.write(k, k, jnp.zeros(3, jnp.float32))
    with pytest.raises(ValueError, match=r"copies must be int\[N, 2\]"):
        cache.copy_pages(jnp.zeros((3,), jnp.int32))


def test_write_takes_a_slot_mapping_of_its_own_pool_only():
    """A ``SlotMapping`` writes what its slots as a plain array write; one made by a table of
    another page size or pool size is refused at trace time, naming ``slot_mapping`` and both
    sizes, for ``KVCache`` and ``MLACache`` alike."""
    table = PageTable.create(6, 2, 4, 4)
    ids, q_lens = jnp.asarray([0, 1]), jnp.asarray([5, 2])
    table, _ = table.extend(ids, q_lens)
    slots = table.slot_mapping(ids, q_lens, 8)
    assert isinstance(slots, SlotMapping) and (slots.page_size, slots.num_pages) == (4, 6)
    assert slots.slots.dtype == jnp.int32 and slots.slots.shape == (8,)
    k = jnp.arange(8 * 2 * 3, dtype=jnp.float32).reshape(8, 2, 3)
    cache = KVCache.create(6, 4, 2, 3, dtype=jnp.float32)
    written = jax.jit(KVCache.write)(cache, k, -k, slots)
    expected = cache.write(k, -k, np.asarray(slots.slots))
    np.testing.assert_array_equal(written.k_pages, expected.k_pages)
    np.testing.assert_array_equal(written.v_pages, expected.v_pages)
    mla = MLACache.create(6, 4, kv_lora_rank=4, rope_dim=2, dtype=jnp.float32)
    np.testing.assert_array_equal(mla.write(k.reshape(8, 6), slots).pages,
                                  mla.write(k.reshape(8, 6), slots.slots).pages)
    refused = [
        (KVCache.create(6, 8, 2, 3), lambda c: c.write(k, k, slots), "page_size=4, but the cache has page_size=8"),
        (KVCache.create(9, 4, 2, 3), lambda c: c.write(k, k, slots), "num_pages=6, but the cache has num_pages=9"),
        (MLACache.create(6, 2, kv_lora_rank=4, rope_dim=2), lambda c: c.write(k.reshape(8, 6), slots),
         "page_size=4, but the cache has page_size=2"),
    ]
    for other, write, sizes in refused:
        with pytest.raises(ValueError, match=f"write: slot_mapping was made by a PageTable with {sizes}"):
            jax.jit(write)(other)


@pytest.mark.gpu
def test_gpu_write_is_in_place_when_donated():
    gpu = jax.devices("gpu")[0]
    cache = jax.device_put(KVCache.create(256, 64, 8, 128), gpu)
    cache = jax.tree.map(lambda x: x + 1, cache)
    write = jax.jit(KVCache.write, donate_argnums=0)
    k = jax.device_put(jnp.ones((7, 8, 128), jnp.bfloat16), gpu)
    before = cache.k_pages.unsafe_buffer_pointer()
    out = write(cache, k, k, jax.device_put(jnp.arange(7, dtype=jnp.int32) * 50, gpu))
    assert out.k_pages.unsafe_buffer_pointer() == before


def test_create_rejects_shardings_of_other_axes():
    mesh = jax.make_mesh((1,), ("tp",))
    with pytest.raises(ValueError, match="sharding may split only the KV-head axis of NHD pages"):
        KVCache.create(6, 4, 2, 8, layout="NHD", sharding=kv_cache.pool_sharding(mesh, "tp", "HND"))
    with pytest.raises(ValueError, match="sharding must be a jax.sharding.NamedSharding"):
        KVCache.create(6, 4, 2, 8, sharding=jax.devices()[0])


def test_mla_cache_write_copy_zero():
    cache = MLACache.create(num_pages=4, page_size=4, kv_lora_rank=8, rope_dim=4, dtype=jnp.float32)
    assert (cache.num_pages, cache.page_size, cache.head_dim, cache.rope_dim) == (4, 4, 12, 4)
    latents = jnp.arange(5 * 12, dtype=jnp.float32).reshape(5, 12) + 1
    # Padding (-1), the null page (slot 2) and a slot past the pool (16) are skipped.
    cache = jax.jit(MLACache.write)(cache, latents, jnp.asarray([4, -1, 2, 13, 16]))
    pages = np.asarray(cache.pages)
    np.testing.assert_array_equal(pages[1, 0], latents[0])
    np.testing.assert_array_equal(pages[3, 1], latents[3])
    assert np.count_nonzero(pages.any(-1)) == 2
    cache = cache.copy_pages([[1, 2], [3, 0], [-1, 2]])
    np.testing.assert_array_equal(cache.pages[2], pages[1])
    assert not np.asarray(cache.pages[0]).any()
    cache = cache.zero_pages([1, 0, 9])
    assert not np.asarray(cache.pages[1]).any() and np.asarray(cache.pages[2]).any()


def test_mla_cache_fp8_write_divides_by_the_scale_and_saturates():
    cache = MLACache.create(num_pages=2, page_size=2, kv_lora_rank=2, rope_dim=2, dtype=jnp.float8_e4m3fn, scale=0.5)
    cache = cache.write(jnp.asarray([[1.0, -2.0, 3.0, 1e6]]), jnp.asarray([2]))
    np.testing.assert_array_equal(np.asarray(cache.pages[1, 0].astype(jnp.float32)), [2.0, -4.0, 6.0, 448.0])


@pytest.mark.parametrize("make, match", [
    (lambda: MLACache.create(1, 4), "num_pages must be >= 2"),
    (lambda: MLACache.create(4, 4, rope_dim=0), "rope_dim must be a positive int"),
    (lambda: MLACache(jnp.zeros((4, 4, 8)), kv_lora_rank=8), "rope_dim >= 1"),
    (lambda: MLACache(jnp.zeros((4, 4, 16), jnp.int8), kv_lora_rank=8), "page dtype must be one of"),
    (lambda: MLACache(jnp.zeros((4, 4, 16), jnp.float8_e4m3fn), kv_lora_rank=8), "FP8 pages need a scale"),
    (lambda: MLACache.create(4, 4, 8, 4, scale=2.0), "scale is only for float8_e4m3fn pages"),
    (lambda: MLACache.create(4, 4, 8, 4, dtype=jnp.float8_e4m3fn, scale=0.0), "scale must be a positive finite"),
    (lambda: MLACache.create(4, 4, 8, 4).write(jnp.zeros((2, 11)), [4, 5]), "latents must be \\[T, 12\\]"),
    (lambda: MLACache.create(4, 4, 8, 4).write(jnp.zeros((2, 12)), [4]), "slot_mapping must be int\\[2\\]"),
])
def test_mla_cache_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_mla_cache_lives_where_its_sharding_says_replicated_only():
    """A DeepSeek on a mesh keeps its whole latent pool (and an FP8 pool's scale) on every device."""
    from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

    replicated = NamedSharding(jax.make_mesh((1,), ("tp",)), PartitionSpec())
    cache = MLACache.create(4, 8, kv_lora_rank=32, rope_dim=16, dtype=jnp.float8_e4m3fn, sharding=replicated)
    assert cache.pages.sharding == replicated and cache.scale.sharding == replicated
    with pytest.raises(ValueError, match="MLACache.create: sharding must be a replicated NamedSharding"):
        MLACache.create(4, 8, kv_lora_rank=32, rope_dim=16, sharding=SingleDeviceSharding(jax.devices()[0]))
