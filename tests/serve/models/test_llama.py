"""The Llama model with paged attention (xla backend) against the same weights run densely."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

import jaxattn
from jaxattn.kv_cache import pool_sharding
from jaxattn.serve.models.llama import (PRESETS, AttendFn, Llama, forward_paged, param_shardings, shard_model,
                                        tensor_parallel_rules)
from tests.paged_inputs import rel_error


def dense_attend(sliding_window: int | None = None) -> AttendFn:
    """Causal attention over the whole sequence (T == S: no offset), no paging."""
    local_window = None if sliding_window is None else (sliding_window - 1, 0)

    def attend(layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                            local_window_size=local_window)[0]

    return attend


@functools.partial(jax.jit, static_argnums=0)
def _dense_next_token(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, length: jax.Array) -> jax.Array:
    """Greedy next token after ``tokens[:length]``; tokens past ``length`` are padding that the
    causal mask keeps out of earlier rows."""
    model = nnx.merge(graphdef, state)
    hidden = model.hidden(tokens, jnp.arange(tokens.shape[0], dtype=jnp.int32), dense_attend(model.cfg.sliding_window))
    return jnp.argmax(model.logits(hidden[length - 1]))


@functools.partial(jax.jit, static_argnums=0)
def dense_hidden(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array) -> jax.Array:
    """The model's final hidden states ``[T, dim]`` for one whole sequence, attended densely."""
    model = nnx.merge(graphdef, state)
    return model.hidden(tokens, jnp.arange(tokens.shape[0], dtype=jnp.int32), dense_attend(model.cfg.sliding_window))


def dense_logprobs(model: Llama, prompt, output) -> np.ndarray:
    """float64 [len(output), V]: the log-softmax of the logits before each token of ``output``
    after ``prompt`` (the whole sequence attended densely)."""
    sequence = jnp.asarray(np.concatenate([np.asarray(prompt), np.asarray(output)]), jnp.int32)
    logits = np.asarray(model.logits(dense_hidden(*nnx.split(model), sequence)[len(prompt) - 1:-1]), np.float64)
    logits -= logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def dense_greedy(model: Llama, prompt: np.ndarray, new_tokens: int, max_len: int = 64) -> list[int]:
    """Greedy generation that recomputes the whole sequence each step with
    ``jax.nn.dot_product_attention`` (no paging, no cache)."""
    graphdef, state = nnx.split(model)
    seq = np.zeros(max_len, np.int32)
    seq[: len(prompt)] = prompt
    for n in range(len(prompt), len(prompt) + new_tokens):
        seq[n] = int(_dense_next_token(graphdef, state, jnp.asarray(seq), jnp.asarray(n)))
    return seq[len(prompt): len(prompt) + new_tokens].tolist()


def test_paged_step_matches_dense_forward():
    model = Llama(PRESETS["tiny"], nnx.Rngs(2))
    rng = np.random.default_rng()
    lens = [13, 1, 30]
    table = jaxattn.PageTable.create(16, 3, 4, 16)
    caches = model.init_caches(16, 16, layout="NHD")
    ids, q_lens = jnp.asarray([1, 0, 2]), jnp.asarray(lens)
    table, ok = table.extend(ids, q_lens)
    tokens = rng.integers(0, 512, size=sum(lens)).astype(np.int32)
    meta = table.metadata(ids, q_lens, max_q_len=30)
    slots = table.slot_mapping(ids, q_lens, sum(lens))
    paged = jax.jit(lambda g, s, *a: forward_paged(nnx.merge(g, s), *a, backend="xla"), static_argnums=0)
    hidden, _ = paged(*nnx.split(model), jnp.asarray(tokens), caches, meta, slots)
    start = 0
    for n in lens:
        dense = dense_hidden(*nnx.split(model), jnp.asarray(tokens[start:start + n]))
        np.testing.assert_allclose(hidden[start:start + n], dense, rtol=2e-5, atol=2e-5)
        start += n


def _compiled_step(layers: int, device: jax.Device) -> str:
    """The compiled HLO of a ``layers``-layer paged forward step (xla backend) on ``device``."""
    batch, num_tokens = 3, 8
    fields = ([0, 1, 4, 8], [5, 9, 20], [[1, 1]] * batch, 1)      # cu_q_lens, kv_lens, block_tables, num_decodes
    meta = jaxattn.AttentionMetadata(*(np.asarray(x, np.int32) for x in fields))
    with jax.default_device(device):
        model = Llama(PRESETS["tiny"].replace(num_layers=layers), nnx.Rngs(0))
        step = jax.jit(lambda g, s, *a: forward_paged(nnx.merge(g, s), *a, backend="xla")[0], static_argnums=0)
        return step.lower(*nnx.split(model), jnp.zeros(num_tokens, jnp.int32), model.init_caches(8, 16),
                          meta, jnp.arange(num_tokens, dtype=jnp.int32)).compile().as_text()


def test_metadata_checks_run_once_per_step_not_per_layer():
    """Every layer's ``paged_attention`` sanitizes the same metadata; XLA computes it once for the
    whole step (its cummax over ``cu_q_lens`` is in the compiled step once, at 1 layer or 3), so
    the per-call metadata work a single-call benchmark counts is paid once per model step."""
    cummax = re.compile(r"= s32\[4(,1)?\]\S* reduce-window\(")     # B + 1 = 4 offsets
    counts = [len(cummax.findall(_compiled_step(layers, jax.devices("cpu")[0]))) for layers in (1, 3)]
    assert counts == [1, 1], f"sanitize's cummax in the compiled step at 1 and 3 layers: {counts}"


@pytest.mark.gpu
def test_gpu_metadata_kernel_runs_once_per_step_not_per_layer():
    """On a GPU the checks are one Triton kernel (``kernels.sanitize``; the xla backend launches no
    other), and XLA merges the layers' launches into one."""
    launches = re.compile(r'custom_call_target="triton_kernel_call_ffi"')
    counts = [len(launches.findall(_compiled_step(layers, jax.devices("gpu")[0]))) for layers in (1, 3)]
    assert counts == [1, 1], f"sanitize kernels in the compiled step at 1 and 3 layers: {counts}"


# ------------------------------------------------------------------------------- tensor parallelism

def _flat_specs(model: Llama, mesh) -> dict[str, tuple]:
    """``"layers.0.attn.q_proj.kernel" -> PartitionSpec`` of each weight under ``param_shardings``."""
    return {".".join(map(str, path)): tuple(v.get_value().spec)
            for path, v in nnx.to_flat_state(param_shardings(model, mesh))}


def test_tensor_parallel_shardings():
    """Column-parallel q/k/v (with their biases), gate and up; row-parallel o and down;
    vocab-parallel embedding and LM head; norms replicated."""
    model = Llama(PRESETS["tiny"].replace(qkv_bias=True, qk_norm=True, num_layers=1), nnx.Rngs(0))
    specs = _flat_specs(model, jax.make_mesh((1,), ("tp",)))
    columns, rows = (None, "tp"), ("tp", None)
    expected = {"embed.embedding": rows, "lm_head.kernel": columns, "norm.scale": ()}
    for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        expected[f"layers.0.{name}.kernel"] = columns
    for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj"):
        expected[f"layers.0.{name}.bias"] = ("tp",)
    for name in ("attn.o_proj", "mlp.down_proj"):
        expected[f"layers.0.{name}.kernel"] = rows
    for name in ("attn_norm", "mlp_norm", "attn.q_norm", "attn.k_norm"):
        expected[f"layers.0.{name}.scale"] = ()
    assert specs == expected


def test_tensor_parallel_rules():
    """KV heads split while the shards divide them, replicated beyond; anything else refused."""
    cfg = PRESETS["tiny"]                                      # Hq 4, Hkv 2, hidden 256, vocab 512
    assert dict(tensor_parallel_rules(cfg, AbstractMesh((2,), ("tp",)), "tp"))["kv_heads"] == "tp"
    assert dict(tensor_parallel_rules(cfg, AbstractMesh((4,), ("tp",)), "tp"))["kv_heads"] is None
    with pytest.raises(ValueError, match="num_q_heads \\(4\\) must be a multiple of 3"):
        tensor_parallel_rules(cfg, AbstractMesh((3,), ("tp",)), "tp")
    with pytest.raises(ValueError, match="num_kv_heads \\(3\\) and 2 must divide one another"):
        tensor_parallel_rules(cfg.replace(num_q_heads=6, num_kv_heads=3), AbstractMesh((2,), ("tp",)), "tp")
    with pytest.raises(ValueError, match="hidden_dim \\(255\\)"):
        tensor_parallel_rules(cfg.replace(hidden_dim=255), AbstractMesh((2,), ("tp",)), "tp")
    with pytest.raises(ValueError, match="axes must name axes of the mesh"):
        param_shardings(Llama(cfg, nnx.Rngs(0)), jax.make_mesh((1,), ("tp",)), "model")


def check_sharded_forward() -> None:
    """(On several CPU devices.) ``shard_model`` on an Explicit mesh places the weights on its
    devices with Auto axes, ``init_caches(mesh=)`` splits the pools by KV heads (replicating them
    with more shards than KV heads), and a jitted paged step of the sharded model gives the
    one-device hidden states and logits; tied embeddings and q/k/v biases included."""
    num_devices = jax.device_count()
    model = Llama(PRESETS["tiny"].replace(qkv_bias=True, tie_embeddings=True), nnx.Rngs(3))
    rng = np.random.default_rng(0)
    lens = [13, 1, 30]
    tokens = jnp.asarray(rng.integers(0, 512, size=sum(lens)), jnp.int32)
    ids, q_lens = jnp.asarray([1, 0, 2]), jnp.asarray(lens)
    table, _ = jaxattn.PageTable.create(16, 3, 4, 16).extend(ids, q_lens)
    meta, slots = table.metadata(ids, q_lens, max_q_len=30), table.slot_mapping(ids, q_lens, sum(lens))

    @functools.partial(jax.jit, static_argnums=0)
    def step(graphdef, state, caches):
        model = nnx.merge(graphdef, state)
        hidden, caches = forward_paged(model, tokens, caches, meta, slots, backend="xla")
        return hidden, model.logits(hidden), caches

    expected = step(*nnx.split(model), model.init_caches(16, 16))
    mesh = jax.make_mesh((num_devices,), ("tp",))            # Explicit axes: the model uses them as Auto
    shard_model(model, mesh)
    for (path, sharding), (_, weight) in zip(nnx.to_flat_state(param_shardings(model, mesh)),
                                             nnx.to_flat_state(nnx.state(model))):
        placed = weight.get_value().sharding
        assert placed == sharding.get_value() and placed.mesh.axis_types == (AxisType.Auto,), (path, placed)
    caches = model.init_caches(16, 16, mesh=mesh)
    assert caches[0].num_kv_heads == max(2, num_devices)
    pools = pool_sharding(mesh.update(axis_types=(AxisType.Auto,)), "tp")
    assert caches[0].k_pages.sharding == pools
    hidden, logits, caches = step(*nnx.split(model), caches)
    np.testing.assert_allclose(hidden, expected[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(logits, expected[1], rtol=2e-5, atol=2e-5)
    assert caches[0].k_pages.sharding.is_equivalent_to(pools, 4), caches[0].k_pages.sharding


@pytest.mark.parametrize("num_devices", [2, 4])
def test_sharded_forward_on_cpu_devices(num_devices):
    from tests.test_sharding import run_on_cpu_devices

    run_on_cpu_devices(num_devices, "from tests.serve.models.test_llama import check_sharded_forward; "
                                    "check_sharded_forward()")


@pytest.mark.parametrize("shared_expert_dim, norm_topk_prob", [(0, True), (40, False)])
def test_mixture_of_experts_layer(shared_expert_dim, norm_topk_prob):
    """layers.MoE equals its definition token by token (each token's top-k experts by softmax
    probability, weighted, plus the gated shared expert), and the Engine serving a mixture-of-experts
    model gives the dense forward's greedy tokens."""
    from jaxattn.serve.engine import Engine

    cfg = PRESETS["tiny"].replace(num_experts=5, num_experts_per_tok=2, moe_hidden_dim=48,
                                  shared_expert_dim=shared_expert_dim, norm_topk_prob=norm_topk_prob)
    model = Llama(cfg, nnx.Rngs(0))
    moe = model.layers[0].mlp
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(9, cfg.dim)), jnp.float32)
    probs = np.asarray(jax.nn.softmax(moe.router(x), axis=-1))
    expected = np.zeros(x.shape, np.float64)
    gate, up, down = (np.asarray(w[...], np.float64) for w in (moe.gate_proj, moe.up_proj, moe.down_proj))
    xs = np.asarray(x, np.float64)
    for t in range(x.shape[0]):
        chosen = np.argsort(-probs[t])[:2]
        weights = probs[t, chosen] / (probs[t, chosen].sum() if norm_topk_prob else 1.0)
        for e, w in zip(chosen, weights):
            h = xs[t] @ gate[e]
            expected[t] += w * ((h / (1 + np.exp(-h)) * (xs[t] @ up[e])) @ down[e])
    if shared_expert_dim:
        expected += np.asarray(jax.nn.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x))
    assert rel_error(moe(x), expected) < 1e-5
    prompts = [rng.integers(0, cfg.vocab_size, size=n) for n in (3, 17, 9)]
    engine = Engine(model, max_seqs=2, max_seq_len=40, page_size=8, max_step_tokens=16, backend="xla")
    requests = [engine.add_request(p, 6) for p in prompts]
    engine.run()
    assert [r.output for r in requests] == [dense_greedy(model, p, 6) for p in prompts]


@pytest.mark.parametrize("change, match", [(dict(num_layers=0), "num_layers must be an int >= 1, got 0"),
                                           (dict(vocab_size=0), "vocab_size must be an int >= 1"),
                                           (dict(num_layers=2.5), "num_layers must be an int >= 1"),
                                           (dict(num_kv_heads=3), r"num_q_heads \(4\) must be a multiple of "
                                                                  r"num_kv_heads \(3\)")])
def test_config_sizes_are_checked(change, match):
    """A model of no layers or heads that do not group would fail only at its first step."""
    with pytest.raises(ValueError, match=f"LlamaConfig: {match}"):
        PRESETS["tiny"].replace(**change)

