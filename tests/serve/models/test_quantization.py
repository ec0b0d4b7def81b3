"""FP8 weights (jaxattn.serve.models.quantization): Fp8Linear against its dequantized weight in float32,
``quantize`` on tiny random models against the unquantized logits (and served by the Engine),
their scales' shardings, and FP8 checkpoints written here with NumPy + safetensors (no torch)
loaded by ``from_pretrained`` against the same checkpoint dequantized to float32; errors name the
bad argument or config field."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxattn.kernels.grouped_gemm import quantize_rows
from jaxattn.serve.engine import Engine
from jaxattn.serve.models import from_pretrained
from jaxattn.serve.models.deepseek import PRESETS as DEEPSEEK_PRESETS
from jaxattn.serve.models.deepseek import DeepSeek
from jaxattn.serve.models.fusion import fuse_projections
from jaxattn.serve.models.hf import _deepseek_parameters, _hf_parameters, deepseek_config_from_hf, llama_config_from_hf
from jaxattn.serve.models.llama import PRESETS, Llama, param_shardings
from jaxattn.serve.models.quantization import (FP8_MAX, Fp8Experts, Fp8Linear, quantize, quantize_kernel,
                                              quantize_stack, set_fp8_activations)
from tests.paged_inputs import rel_error
from tests.serve.models.test_deepseek import _dense_hidden as deepseek_dense_hidden
from tests.serve.models.test_llama import dense_greedy, dense_hidden
from tests.test_sharding import run_on_cpu_devices

FP8 = ml_dtypes.float8_e4m3fn


def _expanded(scale: np.ndarray, shape: tuple[int, int], kind) -> np.ndarray:
    """The scale of each element of a kernel ``[in, out]`` (block: by index, not by repeat)."""
    if kind == "tensor":
        return np.full(shape, scale)
    if kind == "channel":
        return np.broadcast_to(scale[None, :], shape)
    rows, cols = np.arange(shape[0]) // kind[0], np.arange(shape[1]) // kind[1]
    return scale[rows[:, None], cols[None, :]]


@pytest.mark.parametrize("kind", ["tensor", "channel", (128, 128), (64, 96)])
def test_fp8_linear_is_its_dequantized_weight(kind):
    """Shapes not multiples of the blocks; bias added; FP8 rounding within e4m3's half ulp."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(300, 200)).astype(np.float32) * np.linspace(0.1, 3, 200, dtype=np.float32)
    x, bias = rng.normal(size=(5, 300)).astype(np.float32), rng.normal(size=200).astype(np.float32)
    kernel, scale = quantize_kernel(w, kind)
    layer = Fp8Linear(kernel, scale, jnp.asarray(bias), block_size=None if isinstance(kind, str) else kind,
                      dtype="float32")
    weight = np.asarray(kernel).astype(np.float32) * _expanded(np.asarray(scale), w.shape, kind)
    np.testing.assert_allclose(np.asarray(layer(jnp.asarray(x))), x @ weight + bias, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(layer.weight()), weight)
    # e4m3: 3 mantissa bits, so a relative error of at most 2^-4; below 2^-6 (subnormals) an
    # absolute one of half the smallest step, 2^-10, in units of the scale
    scales = _expanded(np.asarray(scale), w.shape, kind)
    assert np.all(np.abs(weight - w) <= 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * scales + 1e-12)
    assert np.max(np.abs(np.asarray(kernel).astype(np.float32))) == FP8_MAX     # each part's amax maps to 448
    assert layer(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.float32


@pytest.mark.parametrize("kind", ["tensor", "channel"])
def test_fp8_activations_multiply_fp8_rows_by_the_fp8_kernel(kind):
    """activations="fp8" (W8A8): each row quantized to FP8 with its own scale, the product of the
    FP8 values (exact in float32 for this K) times the rows' and the kernel's scales, as the
    dequantized rows times the dequantized kernel; the rows' rounding moves it by ~3% from the
    weight-only layer. Leading dimensions kept; a kernel held [out, in]."""
    rng = np.random.default_rng()
    w = rng.normal(size=(96, 40)).astype(np.float32) * np.linspace(0.1, 3, 40, dtype=np.float32)
    x, bias = rng.normal(size=(2, 3, 96)).astype(np.float32), rng.normal(size=40).astype(np.float32)
    kernel, scale = quantize_kernel(w, kind)
    layer = Fp8Linear(kernel, scale, jnp.asarray(bias), dtype="float32", activations="fp8")
    assert layer.kernel.shape == (40, 96) and layer.activations == "fp8"
    out = np.asarray(jax.jit(lambda x: layer(x))(jnp.asarray(x)))
    values, row_scale = quantize_rows(jnp.asarray(x.reshape(6, 96)))
    rows = np.asarray(values, np.float64) * np.asarray(row_scale, np.float64)
    weight = np.asarray(kernel).astype(np.float64) * _expanded(np.asarray(scale), w.shape, kind)
    assert out.shape == (2, 3, 40)
    assert rel_error(out.reshape(6, 40), rows @ weight + bias) < 1e-5
    weight_only = Fp8Linear(kernel, scale, jnp.asarray(bias), dtype="float32")
    assert 3e-3 < rel_error(out, weight_only(jnp.asarray(x))) < 0.1
    for dtype in ("bfloat16", "float16"):        # float16 could not hold the FP8 products (448^2 > 65504)
        rounded = jnp.asarray(x, dtype)
        low = Fp8Linear(kernel, scale, jnp.asarray(bias), dtype=dtype, activations="fp8")(rounded)
        assert low.dtype == jnp.dtype(dtype) and rel_error(low, layer(rounded.astype(jnp.float32))) < 1e-2, dtype


def test_fp8_activations_are_checked_and_set_on_a_model():
    """Block-scaled layers take no FP8 activations (the constructor refuses them by name;
    set_fp8_activations leaves them weight-only); set_fp8_activations reaches every other FP8
    linear and fused projection, and the logits stay within FP8 rounding of the weight-only model."""
    kernel, scale = quantize_kernel(np.ones((64, 32), np.float32), (32, 32))
    choices = "activations must be one of \\(None, 'fp8'\\)"
    with pytest.raises(ValueError, match=f"Fp8Linear: {choices}.*got 'fp8' with \\(32, 32\\)"):
        Fp8Linear(kernel, scale, block_size=(32, 32), activations="fp8")
    with pytest.raises(ValueError, match=f"Fp8Linear: {choices}.*got 'int8'"):
        Fp8Linear(*quantize_kernel(np.ones((64, 32), np.float32)), activations="int8")
    with pytest.raises(ValueError, match=f"set_fp8_activations: {choices}, got 'e5m2'"):
        set_fp8_activations(Llama(PRESETS["tiny"].replace(num_layers=1), nnx.Rngs(0)), "e5m2")
    tokens = np.random.default_rng(1).integers(0, PRESETS["tiny"].vocab_size, size=24).astype(np.int32)
    for block_size, count in ((None, 2 * 7), (64, 0)):
        model = quantize(Llama(PRESETS["tiny"], nnx.Rngs(0)), block_size=block_size)
        weight_only = _logits(model, tokens)
        assert set_fp8_activations(model) == count
        assert rel_error(_logits(model, tokens), weight_only) < (0.1 if count else 1e-6)
    fuse_projections(model := quantize(Llama(PRESETS["tiny"], nnx.Rngs(0))))
    assert set_fp8_activations(model) == 2 * 4 and model.layers[0].attn.qkv_proj.activations == "fp8"
    assert set_fp8_activations(model, None) == 8 and model.layers[0].mlp.gate_up_proj.activations is None


def test_fp8_linear_computes_in_its_dtype():
    kernel, scale = quantize_kernel(np.eye(8, dtype=np.float32))
    layer = Fp8Linear(kernel, scale, dtype="bfloat16")
    assert layer(jnp.ones((2, 8), jnp.float32)).dtype == jnp.bfloat16
    assert layer.weight("float32").dtype == jnp.float32


def test_fp8_linear_refuses_bad_arrays():
    kernel, scale = quantize_kernel(np.ones((8, 4), np.float32))
    with pytest.raises(ValueError, match="kernel must be a 2-D float8_e4m3fn"):
        Fp8Linear(jnp.ones((8, 4)), scale)
    with pytest.raises(ValueError, match="scale has shape \\(3,\\)"):
        Fp8Linear(kernel, scale[:3])
    with pytest.raises(ValueError, match="scale must be"):
        Fp8Linear(kernel, jnp.ones((2, 1)))
    with pytest.raises(ValueError, match="block_size must be"):
        Fp8Linear(kernel, jnp.ones((1, 1)), block_size=(0, 8))
    with pytest.raises(ValueError, match="bias has shape"):
        Fp8Linear(kernel, scale, jnp.ones(3))


def test_fp8_experts_refuse_bad_arrays():
    kernel, scale = quantize_stack(np.ones((2, 8, 4), np.float32))
    with pytest.raises(ValueError, match="Fp8Experts: kernel must be a 3-D float8_e4m3fn array \\[E, in, out\\]"):
        Fp8Experts(kernel[0], scale)
    with pytest.raises(ValueError, match="Fp8Experts: scale has shape \\(2, 3\\)"):
        Fp8Experts(kernel, scale[:, :3])
    with pytest.raises(ValueError, match="scale must be \\[E\\], \\[E, out\\] or, with block_size, 3-D"):
        Fp8Experts(kernel, jnp.ones((2, 1, 1)))
    with pytest.raises(ValueError, match="Fp8Experts: scale has shape \\(2, 1, 1\\)"):
        Fp8Experts(kernel, jnp.ones((2, 1, 1)), block_size=4)
    assert Fp8Experts(kernel, jnp.ones((2, 2, 1)), block_size=4).block_size == (4, 4)
    with pytest.raises(ValueError, match="quantize_stack: layout must be one of \\('ekn', 'enk'\\), got 'nk'"):
        quantize_stack(np.ones((2, 8, 4), np.float32), layout="nk")


# ----------------------------------------------------------------------------------- quantize()

def _logits(model, tokens: np.ndarray) -> np.ndarray:
    hidden_fn = deepseek_dense_hidden if isinstance(model, DeepSeek) else dense_hidden
    return np.asarray(model.logits(hidden_fn(*nnx.split(model), jnp.asarray(tokens))))


def _fp8_paths(model) -> set[str]:
    return {".".join(map(str, path)) for path, module in nnx.iter_graph(model) if isinstance(module, Fp8Linear)}


_MOE = PRESETS["tiny"].replace(num_layers=1, num_experts=4, num_experts_per_tok=2, moe_hidden_dim=64,
                               shared_expert_dim=96, qkv_bias=True)
_MODELS = {"llama": lambda: Llama(PRESETS["tiny"], nnx.Rngs(0)),
           "qwen2-moe": lambda: Llama(_MOE, nnx.Rngs(0)),
           "deepseek-v3": lambda: DeepSeek(DEEPSEEK_PRESETS["tiny"].replace(
               q_lora_rank=48, num_experts=4, num_experts_per_tok=2, moe_hidden_dim=64, shared_expert_dim=64,
               first_k_dense_replace=1), nnx.Rngs(0))}


@pytest.mark.parametrize("block_size", [None, 64])
@pytest.mark.parametrize("name", list(_MODELS))
def test_quantize_keeps_logits_close(name, block_size):
    """Each FP8 linear's output moves by about 2.6% rms (e4m3 keeps 3 mantissa bits: a weight's
    relative error is at most 2^-4, about 2^-5.3 rms), and a tiny random 2-layer model chains some
    5 linears per residual branch: the logits moved by 8-9% rms (measured; 12% with experts,
    whose routing flips at near ties; the expert stacks are quantized too). Bounds: relative L2
    error <= 0.15 (0.2 with experts), max |diff| <= 0.2 * max |logit| (0.5 with experts). Not
    greedy tokens: a random model's logits
    have near ties everywhere (the checkpoint tests below compare exact logits instead). A
    misplaced scale (transposed, another block) moves the logits by ~100%."""
    model = _MODELS[name]()
    tokens = np.random.default_rng(1).integers(0, model.cfg.vocab_size, size=24).astype(np.int32)
    reference = _logits(model, tokens)
    assert quantize(model, block_size=block_size) is model
    logits = _logits(model, tokens)
    experts = name != "llama"
    assert rel_error(logits, reference) <= (0.2 if experts else 0.15)
    assert np.abs(logits - reference).max() <= (0.5 if experts else 0.2) * np.abs(reference).max()

    paths = _fp8_paths(model)
    block = model.layers[-1]
    if name == "deepseek-v3":
        assert "layers.0.attn.q_a_proj" in paths and "layers.0.attn.kv_a_proj" in paths
        assert "layers.1.mlp.shared_expert.down_proj" in paths
        assert isinstance(block.attn.kv_b_proj, nnx.Linear)        # read directly by MLA's absorption
    else:
        assert {f"layers.0.attn.{p}_proj" for p in "qkvo"} <= paths
    if name == "qwen2-moe":
        assert {f"layers.0.mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")} <= paths
        assert isinstance(block.mlp.shared_expert_gate, nnx.Linear)
        assert block.attn.q_proj.bias is not None
    if name != "llama":
        assert isinstance(block.mlp.router, nnx.Linear) and isinstance(block.mlp.gate_proj, Fp8Experts)
        stack = block.mlp.down_proj                                 # [E, 64, dim]: per expert and column, or blocks
        assert stack.scale.get_value().shape == ((4, 128) if block_size is None else (4, 1, 2))
    assert isinstance(model.lm_head, nnx.Linear) and not any("lm_head" in p or "embed" in p for p in paths)


def test_engine_serves_a_quantized_model():
    """The paged step (Engine, xla) gives the dense forward's greedy tokens of the same FP8 model."""
    model = quantize(Llama(PRESETS["tiny"], nnx.Rngs(0)), block_size=64)
    engine = Engine(model, max_seqs=2, max_seq_len=64, page_size=16, backend="xla")
    prompts = [np.arange(5, dtype=np.int32) + 3, np.arange(9, dtype=np.int32) * 7]
    requests = [engine.add_request(prompt, max_new_tokens=6) for prompt in prompts]
    engine.run()
    assert [r.output for r in requests] == [dense_greedy(model, prompt, 6) for prompt in prompts]


def test_quantized_scales_are_split_like_their_kernels():
    """Per-channel scales follow the output columns, block scales both dimensions; kernels are
    held [out, in] (Fp8Linear.LAYOUT), split along their output rows."""
    mesh = jax.make_mesh((1,), ("tp",))
    for block_size, column, row in ((None, ("tp",), (None,)), (64, (None, "tp"), ("tp", None))):
        model = quantize(Llama(PRESETS["tiny"].replace(num_layers=1), nnx.Rngs(0)), block_size=block_size)
        specs = {".".join(map(str, path)): tuple(v.get_value().spec)
                 for path, v in nnx.to_flat_state(param_shardings(model, mesh))}
        assert specs["layers.0.attn.q_proj.kernel"] == ("tp", None)
        assert specs["layers.0.attn.o_proj.kernel"] == (None, "tp")
        assert specs["layers.0.attn.q_proj.scale"] == column and specs["layers.0.mlp.up_proj.scale"] == column
        assert specs["layers.0.attn.o_proj.scale"] == row and specs["layers.0.mlp.down_proj.scale"] == row


def test_quantize_refuses_bad_arguments():
    model = Llama(PRESETS["tiny"].replace(num_layers=1), nnx.Rngs(0))
    with pytest.raises(ValueError, match="method must be one of \\('fp8',\\), got 'int4'"):
        quantize(model, "int4")
    for bad in (0, (128,), (128, -1), True, 1.5):
        with pytest.raises(ValueError, match="block_size must be"):
            quantize(model, block_size=bad)
    with pytest.raises(ValueError, match="model must be a jaxattn.serve.models decoder"):
        quantize(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    assert not _fp8_paths(model)                                  # nothing changed by the refusals


# ----------------------------------------------------------------------------- FP8 checkpoints

LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=160, intermediate_size=288, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=40, max_position_embeddings=128,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="bfloat16")
DEEPSEEK_V3 = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=64, intermediate_size=96,
                   moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                   kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                   n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=4,
                   topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc",
                   scoring_func="sigmoid", rope_theta=10000.0, max_position_embeddings=128, rms_norm_eps=1e-6,
                   tie_word_embeddings=False, torch_dtype="bfloat16")


def _random_tensors(hf: dict) -> dict[str, np.ndarray]:
    """float32 tensors of every name the model reads, of the checkpoint's shapes."""
    rng = np.random.default_rng(0)
    if hf["model_type"] == "llama":
        abstract = nnx.eval_shape(lambda: Llama(llama_config_from_hf(hf, "float32"), nnx.Rngs(0)))
        targets = _hf_parameters(abstract, "llama")
    else:
        abstract = nnx.eval_shape(lambda: DeepSeek(deepseek_config_from_hf(hf, "float32"), nnx.Rngs(0)))
        targets = _deepseek_parameters(abstract, "deepseek_v3", True)
    tensors = {}
    for name, target in targets.items():
        shape = target.hf_shape
        scale = shape[-1] ** -0.5 if len(shape) == 2 else 0.1
        tensors[name] = (rng.normal(size=shape) * scale + (len(shape) == 1)).astype(np.float32)
    return tensors


def _quantized(w: np.ndarray, kind) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(FP8 weight, scale as stored, dequantized float32 weight) of ``w [out, in]``: ``kind`` is
    "tensor" (scale []), "channel" (scale [out, 1]) or HF's weight_block_size [bo, bi]
    (scale [ceil(out / bo), ceil(in / bi)])."""
    if kind == "tensor":
        scale = np.float32(np.abs(w).max() / 448)
        expanded = np.full(w.shape, scale)
    elif kind == "channel":
        scale = (np.abs(w).max(axis=1, keepdims=True) / 448).astype(np.float32)
        expanded = np.broadcast_to(scale, w.shape)
    else:
        (bo, bi), (out, fan_in) = kind, w.shape
        scale = np.array([[np.abs(w[i:i + bo, j:j + bi]).max() / 448 for j in range(0, fan_in, bi)]
                          for i in range(0, out, bo)], np.float32)
        expanded = scale[(np.arange(out) // bo)[:, None], (np.arange(fan_in) // bi)[None, :]]
    q = (w / expanded).astype(FP8)
    return q, np.asarray(scale, np.float32), q.astype(np.float32) * expanded


def _write(path: pathlib.Path, hf: dict, tensors: dict[str, np.ndarray]) -> str:
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def _fp8_checkpoint(tmp_path: pathlib.Path, hf: dict, kind, quantization_config: dict,
                    kept: tuple[str, ...] = ()) -> tuple[str, str]:
    """(FP8 checkpoint, the same dequantized to float32) directories: every 2-D weight of the
    decoder blocks but the routers (``mlp.gate``) and the ``kept`` modules in FP8, as
    DeepSeek-V3 / vLLM write them; with ``activation_scheme: static``, an ``input_scale`` each."""
    tensors, fp8, reference = _random_tensors(hf), {}, {}
    scale_name = "weight_scale_inv" if isinstance(kind, list) else "weight_scale"
    for name, w in tensors.items():
        module = name[:-len(".weight")]
        if (name.startswith("model.layers.") and name.endswith(".weight") and w.ndim == 2
                and not module.endswith("mlp.gate") and module not in kept):
            fp8[name], fp8[f"{module}.{scale_name}"], reference[name] = _quantized(w, kind)
            if quantization_config.get("activation_scheme") == "static":
                fp8[f"{module}.input_scale"] = np.full(1, 0.02, np.float32)
        else:
            fp8[name] = reference[name] = w
    config = {**hf, "quantization_config": {"quant_method": "fp8", **quantization_config}}
    return _write(tmp_path / "fp8", config, fp8), _write(tmp_path / "dequantized", {**hf, "torch_dtype": "float32"},
                                                         reference)


_FORMATS = {
    "block": (LLAMA, [128, 128], dict(activation_scheme="dynamic", weight_block_size=[128, 128]), ()),
    "tensor-static-ignored": (LLAMA, "tensor", dict(activation_scheme="static",
                                                    ignored_layers=["model.layers.1.mlp.down_proj"]),
                              ("model.layers.1.mlp.down_proj",)),
    "channel": (LLAMA, "channel", dict(activation_scheme="dynamic"), ()),
    # q_b_proj's RoPE rows, reordered on load, stay in their 16-row blocks
    "deepseek-v3": (DEEPSEEK_V3, [16, 32], dict(activation_scheme="dynamic", weight_block_size=[16, 32]), ()),
    # ... and cross 8-row blocks: q_b_proj and kv_a_proj are dequantized on load
    "deepseek-v3-small-blocks": (DEEPSEEK_V3, [8, 8], dict(weight_block_size=[8, 8]), ()),
}


@pytest.mark.parametrize("fmt", list(_FORMATS))
def test_fp8_checkpoint_matches_its_dequantized_float32_checkpoint(tmp_path, fmt):
    """float32 logits within 1e-5 (the same float32 products of FP8 values and scales, in a dot
    of another fusion): weights and scales are read as stored, not requantized."""
    hf, kind, quantization_config, kept = _FORMATS[fmt]
    fp8_path, reference_path = _fp8_checkpoint(tmp_path, hf, kind, quantization_config, kept)
    model, reference = from_pretrained(fp8_path, dtype="float32"), from_pretrained(reference_path)
    tokens = np.random.default_rng(1).integers(0, hf["vocab_size"], size=20).astype(np.int32)
    expected = _logits(reference, tokens)
    np.testing.assert_allclose(_logits(model, tokens), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())

    paths, attn = _fp8_paths(model), model.layers[1].attn
    assert "layers.0.mlp.down_proj" in paths and "lm_head" not in paths
    if fmt == "tensor-static-ignored":
        assert isinstance(model.layers[1].mlp.down_proj, nnx.Linear)
        assert model.layers[0].attn.q_proj.scale.get_value().shape == ()
    if hf is DEEPSEEK_V3:
        assert isinstance(attn.kv_b_proj, nnx.Linear)
        experts = model.layers[1].mlp.gate_proj                     # kept in FP8, with the stored block scales
        assert isinstance(experts, Fp8Experts) and experts.block_size == tuple(kind[::-1])
        assert isinstance(attn.o_proj, Fp8Linear)
        assert isinstance(attn.q_b_proj, Fp8Linear if fmt == "deepseek-v3" else nnx.Linear)


@pytest.mark.parametrize("hf", [LLAMA, DEEPSEEK_V3], ids=["llama", "deepseek-v3"])
def test_quantization_fp8_quantizes_as_it_loads(tmp_path, hf):
    """``from_pretrained(path, quantization="fp8")`` is ``quantize(from_pretrained(path))``, expert
    stacks included (quantized once all their experts are read)."""
    path = _write(tmp_path, {**hf, "torch_dtype": "float32"}, _random_tensors(hf))
    loaded, expected = from_pretrained(path, quantization="fp8"), quantize(from_pretrained(path))
    assert _fp8_paths(loaded) == _fp8_paths(expected) and _fp8_paths(loaded)
    if hf is DEEPSEEK_V3:
        assert isinstance(loaded.layers[1].mlp.down_proj, Fp8Experts)
    for (name, value), (_, other) in zip(nnx.to_flat_state(nnx.state(loaded)), nnx.to_flat_state(nnx.state(expected))):
        np.testing.assert_array_equal(np.asarray(value.get_value(), np.float32),
                                      np.asarray(other.get_value(), np.float32), err_msg=str(name))


def test_fp8_checkpoint_errors_name_the_field(tmp_path):
    hf = {**LLAMA, "num_hidden_layers": 1}
    fp8_path, reference_path = _fp8_checkpoint(tmp_path, hf, [128, 128], dict(weight_block_size=[128, 128]))
    config = json.loads((pathlib.Path(fp8_path) / "config.json").read_text())

    def load(quantization_config, quantization=None):
        (pathlib.Path(fp8_path) / "config.json").write_text(
            json.dumps({**config, "quantization_config": quantization_config}))
        return from_pretrained(fp8_path, dtype="float32", quantization=quantization)

    for method in ("gptq", "awq", "bitsandbytes", "compressed-tensors", None):
        with pytest.raises(ValueError, match=f"quantization_config.quant_method={method!r} is not supported; "
                                             f"expected one of \\('fp8',\\)"):
            load({"quant_method": method})
    for block in ([128], [0, 128], "128", [128.0, 128]):
        with pytest.raises(ValueError, match="quantization_config.weight_block_size"):
            load({"quant_method": "fp8", "weight_block_size": block})
    with pytest.raises(ValueError, match="_proj.weight_scale_inv' has shape \\(., 2\\), expected \\(., 3\\): the "
                                         "weight_block_size blocks"):
        load({"quant_method": "fp8", "weight_block_size": [64, 64]})
    with pytest.raises(ValueError, match="activation_scheme"):
        load({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "per-token"})
    with pytest.raises(ValueError, match="quantization must be None or one of \\('fp8',\\), got 'int8'"):
        from_pretrained(reference_path, quantization="int8")


def test_fp8_weight_without_a_scale_is_named(tmp_path):
    from safetensors.numpy import save_file

    hf = {**LLAMA, "num_hidden_layers": 1}
    fp8_path, _ = _fp8_checkpoint(tmp_path, hf, "channel", {})
    file = str(pathlib.Path(fp8_path) / "model.safetensors")
    tensors = {name: value for name, value in _read_all(file).items()
               if name != "model.layers.0.mlp.up_proj.weight_scale"}
    save_file(tensors, file)
    with pytest.raises(ValueError, match="FP8 tensor 'model.layers.0.mlp.up_proj.weight' has no"):
        from_pretrained(fp8_path)


def _read_all(file: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file (FP8 ones too, which safetensors' NumPy reader lacks)."""
    from jaxattn.serve.models.hf import _stored_tensors

    return {name: stored.read() for name, stored in _stored_tensors([file]).items()}


def check_fp8_checkpoints_on_mesh(path: str) -> None:
    """(On 2 CPU devices.) FP8 checkpoints loaded onto a mesh give the one-device logits (with FP8
    activations too), their scales split like their kernels (a DeepSeek's MLA whole on each
    device, its FP8 experts split by columns or whole); block counts the shards do not divide are
    named."""
    mesh = jax.make_mesh((jax.device_count(),), ("tp",))
    tokens = np.arange(10, dtype=np.int32)
    for kind, qc, column, row in (("channel", {}, P("tp"), P(None)),
                                  ([8, 8], dict(weight_block_size=[8, 8]), P(None, "tp"), P("tp", None))):
        fp8_path, reference_path = _fp8_checkpoint(pathlib.Path(path) / str(len(qc)), LLAMA, kind, qc)
        model = from_pretrained(fp8_path, dtype="float32", mesh=mesh)
        assert model.layers[0].attn.q_proj.scale.get_value().sharding.spec == column
        assert model.layers[0].attn.o_proj.scale.get_value().sharding.spec == row
        expected = _logits(single := from_pretrained(fp8_path, dtype="float32"), tokens)
        np.testing.assert_allclose(_logits(model, tokens), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
        if kind == "channel":     # FP8 activations: a row split over the devices is scaled by its whole amax
            assert set_fp8_activations(model) == set_fp8_activations(single) == 2 * 7
            expected = _logits(single, tokens)
            np.testing.assert_allclose(_logits(model, tokens), expected, rtol=1e-5,
                                       atol=1e-5 * np.abs(expected).max())
    quantized = from_pretrained(reference_path, quantization="fp8", mesh=mesh)
    assert quantized.layers[0].mlp.up_proj.scale.get_value().sharding.spec == P("tp")
    fp8_path, _ = _fp8_checkpoint(pathlib.Path(path) / "16", LLAMA, [16, 16], dict(weight_block_size=[16, 16]))
    with pytest.raises(ValueError, match="k_proj.weight_scale_inv' cannot be split over the mesh"):
        from_pretrained(fp8_path, mesh=mesh)                              # k_proj: 80 columns, 5 blocks
    # DeepSeek-V3: MLA whole on each device, the dense MLP and the experts split (by columns, or whole)
    fp8_path, _ = _fp8_checkpoint(pathlib.Path(path) / "deepseek", DEEPSEEK_V3, [8, 8], dict(weight_block_size=[8, 8]))
    expected = _logits(from_pretrained(fp8_path, dtype="float32"), tokens)
    for expert_parallel in (False, True):
        model = from_pretrained(fp8_path, dtype="float32", mesh=mesh, expert_parallel=expert_parallel)
        np.testing.assert_allclose(_logits(model, tokens), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    experts = model.layers[1].mlp.gate_proj                             # FP8 [8, 64, 32], blocks of 8 x 8
    assert experts.kernel.get_value().addressable_shards[0].data.shape == (4, 32, 64)    # kept [E, out, in]
    assert experts.scale.get_value().addressable_shards[0].data.shape == (4, 8, 4)
    assert model.layers[1].attn.o_proj.scale.get_value().sharding.is_fully_replicated


def test_fp8_checkpoints_on_a_mesh(tmp_path):
    run_on_cpu_devices(2, f"from tests.serve.models.test_quantization import check_fp8_checkpoints_on_mesh; "
                          f"check_fp8_checkpoints_on_mesh({str(tmp_path)!r})")


def test_random_model_quantized_and_split_over_a_mesh():
    """``random_model(quantization="fp8")`` (the server's and bench_serving's ``--quantization``)
    quantizes before placing: the linears are Fp8Linear, on the mesh's device."""
    from jaxattn.serve.models.llama import random_model

    model = random_model("tiny", quantization="fp8", mesh=jax.make_mesh((1,), ("tp",)))
    assert isinstance(model.layers[0].attn.q_proj, Fp8Linear)
    assert model.layers[0].mlp.down_proj.kernel[...].dtype == jnp.float8_e4m3fn
