"""Fused projections (jaxattn.serve.models.fusion): a fused model's logits equal
the unfused model's (float32 tiny models, FP8 kernels of every scale granularity), the
layouts regroup for other shard counts, tensor parallelism splits whole groups, and the Engine
fuses by default with the same greedy tokens."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxattn.serve.engine import Engine
from jaxattn.serve.models import fusion
from jaxattn.serve.models.deepseek import PRESETS as DEEPSEEK_PRESETS
from jaxattn.serve.models.deepseek import Attention as DeepSeekAttention
from jaxattn.serve.models.deepseek import DeepSeek
from jaxattn.serve.models.layers import EXPERT_AXES, MLP, set_expert_gemm
from jaxattn.serve.models.llama import PRESETS, Attention, Llama, param_shardings, shard_model
from jaxattn.serve.models.quantization import Fp8Experts, Fp8Linear, quantize, quantize_kernel, quantize_stack
from tests.serve.models.test_deepseek import _dense_hidden as deepseek_dense_hidden
from tests.serve.models.test_llama import dense_hidden
from tests.test_sharding import run_on_cpu_devices

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 512, size=11), jnp.int32)

MODELS = {
    "llama": lambda: Llama(PRESETS["tiny"], nnx.Rngs(1)),
    "qwen2 (q/k/v biases)": lambda: Llama(PRESETS["tiny"].replace(qkv_bias=True), nnx.Rngs(2)),
    "qwen3 (q/k norms, MHA)": lambda: Llama(PRESETS["tiny"].replace(qk_norm=True, num_kv_heads=4), nnx.Rngs(3)),
    "qwen2-moe (gated shared expert)": lambda: Llama(PRESETS["tiny"].replace(
        num_experts=4, num_experts_per_tok=2, moe_hidden_dim=48, shared_expert_dim=64), nnx.Rngs(4)),
    "deepseek (dense first layer, shared experts)": lambda: DeepSeek(DEEPSEEK_PRESETS["tiny"].replace(
        num_experts=4, num_experts_per_tok=2, moe_hidden_dim=48, shared_expert_dim=64, first_k_dense_replace=1),
        nnx.Rngs(5)),
    "deepseek (q_lora_rank)": lambda: DeepSeek(DEEPSEEK_PRESETS["tiny"].replace(q_lora_rank=48), nnx.Rngs(11)),
}


def _logits(model) -> np.ndarray:
    hidden = (deepseek_dense_hidden if isinstance(model, DeepSeek) else dense_hidden)(*nnx.split(model), TOKENS)
    return np.asarray(model.logits(hidden))


def _apart(model) -> list[str]:
    """The projections ``fuse_projections`` fuses that ``model`` still has apart."""
    apart = ("q_proj", "k_proj", "v_proj", "q_a_proj", "kv_a_proj", "gate_proj", "up_proj")
    return [f"{type(module).__name__}.{name}" for _, module in nnx.iter_graph(model)
            if isinstance(module, (Attention, DeepSeekAttention, MLP)) for name in apart if hasattr(module, name)]


@pytest.mark.parametrize("name", MODELS)
def test_fused_model_matches_unfused(name):
    model = MODELS[name]()
    expected = _logits(model)
    fusion.fuse_projections(model)
    assert not _apart(model), _apart(model)
    assert all(block.attn.fused for block in model.layers)
    np.testing.assert_allclose(_logits(model), expected, rtol=1e-5, atol=1e-5)


def test_latent_attention_fuses_fp8_blocks_ending_in_a_partial_one():
    """MLA's query and latent projections in 16 x 32 blocks: the query part (128 columns) is whole
    blocks, the latent + RoPE part (48) ends in half a block, which the fused layer keeps."""
    model = DeepSeek(DEEPSEEK_PRESETS["tiny"], nnx.Rngs(12))
    quantize(model, block_size=(16, 32))
    expected = _logits(model)
    fusion.fuse_projections(model)
    fused = model.layers[0].attn.qkv_a_proj
    assert isinstance(fused, Fp8Linear) and fused.granularity == (16, 32) and fused.scale.shape == (8, 6)
    np.testing.assert_allclose(_logits(model), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scales", ["tensor", "channel", 8, 32, (16, 64)])
def test_fp8_projections_fuse_in_fp8(scales):
    """FP8 parts stay FP8 and give the unfused model's logits; per-tensor scales become
    per-channel; block scales that straddle a group (64-column blocks over 32-column heads) leave
    the attention apart and fuse the MLP."""
    model = Llama(PRESETS["tiny"].replace(qkv_bias=True), nnx.Rngs(6))
    if scales == "tensor":
        for block in model.layers:
            for owner, name, axis in ((block.attn, "q_proj", "heads"), (block.attn, "k_proj", "kv_heads"),
                                      (block.attn, "v_proj", "kv_heads"), (block.mlp, "gate_proj", "mlp"),
                                      (block.mlp, "up_proj", "mlp")):
                linear = getattr(owner, name)
                kernel, scale = quantize_kernel(linear.kernel[...], "tensor")
                bias = None if linear.bias is None else linear.bias[...]
                setattr(owner, name, Fp8Linear(kernel, scale, bias, dtype=linear.dtype, axes=(None, axis)))
    else:
        quantize(model, block_size=None if scales == "channel" else scales)
    expected = _logits(model)
    fusion.fuse_projections(model)
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    assert isinstance(mlp.gate_up_proj, Fp8Linear) and mlp.gate_up_proj.kernel.dtype == jnp.float8_e4m3fn
    if scales == (16, 64):
        assert not attn.fused and isinstance(attn.q_proj, Fp8Linear)
    else:
        assert attn.fused and isinstance(attn.qkv_proj, Fp8Linear)
        assert attn.qkv_proj.granularity == ("channel" if scales == "tensor" else
                                             "channel" if isinstance(scales, str) else (scales, scales))
    np.testing.assert_allclose(_logits(model), expected, rtol=1e-5, atol=1e-5)


SHARED_EXPERT_MODELS = {
    "deepseek": lambda: DeepSeek(DEEPSEEK_PRESETS["tiny"].replace(
        num_experts=4, num_experts_per_tok=2, moe_hidden_dim=32, shared_expert_dim=64, first_k_dense_replace=1),
        nnx.Rngs(13)),
    "qwen2-moe (gated)": lambda: Llama(PRESETS["tiny"].replace(
        num_experts=4, num_experts_per_tok=2, moe_hidden_dim=32, shared_expert_dim=96), nnx.Rngs(14)),
}


@pytest.mark.parametrize("scales", [None, "tensor", "channel", 16])
@pytest.mark.parametrize("name", SHARED_EXPERT_MODELS)
@pytest.mark.parametrize("gemm", ["ragged_dot", "dense", "triton"])
def test_shared_expert_joins_the_expert_stacks(name, scales, gemm):
    """A shared expert of 2 or 3 ``moe_hidden_dim`` groups becomes the stacks' last experts (in FP8
    with per-expert, per-channel or 16 x 16 block scales; bf16 without) with the unfused logits.
    The Triton grouped GEMM multiplies FP8 experts scaled along whole rows with FP8 rows, so there
    the shared expert's inputs are rounded to FP8 too (each group's hidden units with their own
    scale): the logits agree to that rounding (a few % on these tiny random models)."""
    model = SHARED_EXPERT_MODELS[name]()
    set_expert_gemm(model, gemm)
    if scales == "tensor":
        _quantize_per_tensor(model)
    elif scales is not None:
        quantize(model, block_size=None if scales == "channel" else scales)
    expected = _logits(model)
    fusion.fuse_projections(model)
    moe = model.layers[-1].mlp
    groups = model.cfg.shared_expert_dim // model.cfg.moe_hidden_dim
    assert moe.fused_shared_experts == groups and not hasattr(moe, "shared_expert")
    stack = moe.down_proj.stack() if scales else moe.down_proj[...]
    assert stack.shape == (model.cfg.num_experts + groups, model.cfg.moe_hidden_dim, model.cfg.dim)
    logits = _logits(model)
    if gemm == "triton" and scales in ("tensor", "channel"):
        assert np.linalg.norm(logits - expected) < 0.05 * np.linalg.norm(expected)
    else:
        np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
    fusion.fuse_projections(model)                      # idempotent
    assert moe.fused_shared_experts == groups


def test_replaced_weights_are_freed_even_in_reference_cycles():
    """Weights that fusion replaces are freed before it returns, even where something left them in
    a reference cycle (as the GPU machine's jax / flax did with a bf16 DeepSeek's expert stacks,
    which then kept the engine's pool from fitting): with Python's collector off, the old stack of
    a layer held in a cycle is gone once ``fuse_projections`` returns."""
    model = SHARED_EXPERT_MODELS["deepseek"]()
    moe = model.layers[-1].mlp
    old_shape = moe.gate_proj[...].shape
    cycle = [moe.gate_proj]
    cycle.append(cycle)
    del cycle
    enabled = gc.isenabled()
    gc.disable()
    try:
        fusion.fuse_projections(model)
        assert not [a for a in jax.live_arrays() if a.shape == old_shape]
    finally:
        if enabled:
            gc.enable()
    assert moe.gate_proj[...].shape[0] == old_shape[0] + 2


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_shared_expert_joins_the_stacks_of_the_triton_gemm(fp8):
    """On the GPU (bfloat16, the compiled Triton grouped GEMM, FP8 rows with FP8 experts): the
    fused model's logits agree with the unfused model's to bfloat16 / FP8 rounding."""
    cfg = DEEPSEEK_PRESETS["tiny"].replace(num_experts=8, num_experts_per_tok=2, moe_hidden_dim=64,
                                           shared_expert_dim=128, first_k_dense_replace=1, dtype="bfloat16")
    model = DeepSeek(cfg, nnx.Rngs(16))
    set_expert_gemm(model, "triton")
    if fp8:
        quantize(model)
    expected = _logits(model).astype(np.float32)
    fusion.fuse_projections(model)
    assert model.layers[-1].mlp.fused_shared_experts == 2
    logits = _logits(model).astype(np.float32)
    assert np.linalg.norm(logits - expected) < (0.05 if fp8 else 0.02) * np.linalg.norm(expected)


def _quantize_per_tensor(model) -> None:
    """FP8 with per-tensor scales: the experts one per expert, the shared expert's linears one each."""
    quantize(model)
    for block in model.layers:
        moe = block.mlp
        if not hasattr(moe, "shared_expert"):
            continue
        for name in ("gate_proj", "up_proj", "down_proj"):
            stack = getattr(moe, name).stack()
            values, scale = quantize_stack(stack.dequantize(jnp.float32), "tensor")
            setattr(moe, name, Fp8Experts(values, scale, axes=EXPERT_AXES[name]))
            linear = getattr(moe.shared_expert, name)
            kernel, scale = quantize_kernel(linear.weight(jnp.float32), "tensor")
            setattr(moe.shared_expert, name, Fp8Linear(kernel, scale, dtype=linear.dtype))


@pytest.mark.parametrize("case", ["width not a multiple", "tensor parallel", "block scales across a group"])
def test_shared_expert_stays_an_mlp_where_it_cannot_join(case):
    cfg = DEEPSEEK_PRESETS["tiny"].replace(num_experts=4, num_experts_per_tok=2, moe_hidden_dim=32,
                                           shared_expert_dim=48 if case == "width not a multiple" else 64)
    model = DeepSeek(cfg, nnx.Rngs(15))
    if case == "block scales across a group":
        quantize(model, block_size=(16, 64))          # 64-column blocks over 32-column groups
    expected = _logits(model)
    fusion.fuse_projections(model, 2 if case == "tensor parallel" else 1)
    moe = model.layers[-1].mlp
    assert not moe.fused_shared_experts and moe.shared_expert.fused_shards
    np.testing.assert_allclose(_logits(model), expected, rtol=1e-5, atol=1e-5)


def test_regrouping_for_other_shard_counts():
    """Fused for 1, then 2, then 4 shards (more than the 2 KV heads: q/k/v apart again), then 1:
    the same logits throughout, and the MLP's groups follow."""
    model = Llama(PRESETS["tiny"], nnx.Rngs(7))
    expected = _logits(model)
    for shards, attention_fused in ((1, True), (2, True), (4, False), (1, True)):
        fusion.fuse_projections(model, shards)
        assert model.layers[0].mlp.fused_shards == shards and model.layers[0].attn.fused == attention_fused
        np.testing.assert_allclose(_logits(model), expected, rtol=1e-5, atol=1e-5)


def test_fused_layouts():
    """qkv_proj's columns: per KV head, its query heads, its key head, its value head; gate_up_proj's
    for 2 shards: gate then up of each half of the hidden units."""
    cfg = PRESETS["tiny"]
    model = Llama(cfg, nnx.Rngs(8))
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    q, k, v = (np.asarray(p.kernel[...]) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    gate, up = np.asarray(mlp.gate_proj.kernel[...]), np.asarray(mlp.up_proj.kernel[...])
    fusion.fuse_projections(model, 2)
    d, group, half = cfg.head_dim, cfg.num_q_heads // cfg.num_kv_heads, cfg.hidden_dim // 2
    qkv = np.asarray(attn.qkv_proj.kernel[...]).reshape(cfg.dim, cfg.num_kv_heads, group + 2, d)
    for j in range(cfg.num_kv_heads):
        np.testing.assert_array_equal(qkv[:, j, :group].reshape(cfg.dim, -1), q[:, j * group * d:(j + 1) * group * d])
        np.testing.assert_array_equal(qkv[:, j, group], k[:, j * d:(j + 1) * d])
        np.testing.assert_array_equal(qkv[:, j, group + 1], v[:, j * d:(j + 1) * d])
    expected = np.concatenate([gate[:, :half], up[:, :half], gate[:, half:], up[:, half:]], axis=1)
    np.testing.assert_array_equal(np.asarray(mlp.gate_up_proj.kernel[...]), expected)


def test_engine_fuses_by_default_with_the_same_tokens():
    prompts = [[5, 9, 2, 7, 1], [3] * 12, [8, 4]]

    def generate(fuse: bool) -> tuple[list[list[int]], Llama]:
        model = Llama(PRESETS["tiny"].replace(qkv_bias=True), nnx.Rngs(9))
        engine = Engine(model, max_seqs=3, max_seq_len=40, page_size=8, max_step_tokens=16, backend="xla",
                        fuse_projections=fuse)
        requests = [engine.add_request(p, max_new_tokens=12) for p in prompts]
        engine.run()
        return [list(r.output) for r in requests], model

    fused, model = generate(True)
    assert model.layers[0].attn.fused and model.layers[0].mlp.fused_shards == 1
    unfused, model = generate(False)
    assert not model.layers[0].attn.fused and not model.layers[0].mlp.fused_shards
    assert fused == unfused


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="fuse_projections: model must be a jaxattn.serve.models decoder"):
        fusion.fuse_projections(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="fuse_projections: shards must be a positive int, got 0"):
        fusion.fuse_projections(Llama(PRESETS["tiny"], nnx.Rngs(0)), 0)


def check_fused_model_on_mesh() -> None:
    """(On several CPU devices.) A model fused for the mesh's shard count is placed in whole groups
    (each device's gate_up_proj shard: its gate columns, then its up columns), gives the
    one-device logits; one fused for a count the mesh does not divide is refused by name."""
    num_devices = jax.device_count()
    model = Llama(PRESETS["tiny"].replace(qkv_bias=True), nnx.Rngs(10))
    expected = _logits(model)
    mlp = model.layers[0].mlp
    gate, up = np.asarray(mlp.gate_proj.kernel[...]), np.asarray(mlp.up_proj.kernel[...])
    mesh = jax.make_mesh((num_devices,), ("tp",))
    fusion.fuse_projections(model, 1)
    with pytest.raises(ValueError, match=rf"MLPs are fused for \[1\] shards.*fuse_projections\(model, {num_devices}\)"):
        param_shardings(model, mesh)
    fusion.fuse_projections(model, num_devices)
    shard_model(model, mesh)
    hidden = model.cfg.hidden_dim // num_devices
    for shard in mlp.gate_up_proj.kernel[...].addressable_shards:
        i = shard.index[1].start // (2 * hidden)
        np.testing.assert_array_equal(np.asarray(shard.data), np.concatenate(
            [gate[:, i * hidden:(i + 1) * hidden], up[:, i * hidden:(i + 1) * hidden]], axis=1))
    assert model.layers[0].attn.fused == (num_devices <= model.cfg.num_kv_heads)
    np.testing.assert_allclose(_logits(model), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("num_devices", [2, 4])
def test_fused_model_on_cpu_devices(num_devices):
    run_on_cpu_devices(num_devices, "from tests.serve.models.test_fusion import check_fused_model_on_mesh; "
                                    "check_fused_model_on_mesh()")
