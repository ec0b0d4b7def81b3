"""Hugging Face checkpoints of the Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3) into
``jaxattn.models.llama.Llama``: ``config.json`` becomes a ``LlamaConfig`` and the
``*.safetensors`` tensors are streamed into the model one at a time. Local directories only."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxattn.models.llama import Llama, Llama3RopeScaling, LlamaConfig, param_shardings

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# Tensors some checkpoints carry that the model recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _field(hf: dict[str, Any], name: str, expected: str) -> ValueError:
    return ValueError(f"from_pretrained: config.json field {name}={hf.get(name)!r} is not supported "
                      f"for model_type={hf.get('model_type')!r}; expected {expected}")


def _rope(hf: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from ``rope_theta`` + ``rope_scaling`` (transformers 4) or
    ``rope_parameters`` (transformers 5)."""
    name = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    params = hf.get(name) or {}
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise _field(hf, name, "partial_rotary_factor 1.0")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise _field(hf, name, "rope_type 'default' or 'llama3'")
    try:
        return theta, Llama3RopeScaling(
            factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings")
                                                 or hf["max_position_embeddings"]))
    except KeyError as missing:
        raise _field(hf, name, f"llama3 rope scaling with {missing}") from None


def _sliding_window(hf: dict[str, Any]) -> int | None:
    """The window every layer uses, or None; per-layer mixes are refused."""
    model_type = hf["model_type"]
    if model_type in ("qwen2", "qwen3"):
        if hf.get("use_sliding_window"):  # the window applies to some layers only (max_window_layers)
            raise _field(hf, "use_sliding_window", "false")
        return None
    window = hf.get("sliding_window") if model_type == "mistral" else None
    layer_types = set(hf.get("layer_types") or [])
    expected = {"sliding_attention"} if window is not None else {"full_attention"}
    if layer_types and layer_types != expected:
        raise _field(hf, "layer_types", f"all {expected.pop()!r} (with sliding_window={window})")
    return window


def llama_config_from_hf(hf: dict[str, Any], dtype: str) -> LlamaConfig:
    """The ``LlamaConfig`` of a Hugging Face ``config.json`` (as a dict); ValueError naming the
    field for anything the model does not implement."""
    if hf.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise _field(hf, "model_type", f"one of {SUPPORTED_MODEL_TYPES}")
    model_type = hf["model_type"]
    if hf.get("hidden_act", "silu") != "silu":
        raise _field(hf, "hidden_act", "'silu'")
    if hf.get("mlp_bias", False):
        raise _field(hf, "mlp_bias", "false")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise _field(hf, "partial_rotary_factor", "1.0")
    # Qwen2 always has q/k/v biases and none on o_proj; elsewhere attention_bias would put one on o_proj too.
    if model_type != "qwen2" and hf.get("attention_bias", False):
        raise _field(hf, "attention_bias", "false (biases on q/k/v only, as in qwen2)")
    missing = [name for name in _REQUIRED_FIELDS if name not in hf]
    if missing:
        raise ValueError(f"from_pretrained: config.json lacks the fields {missing}")
    theta, scaling = _rope(hf)
    num_q_heads = hf["num_attention_heads"]
    return LlamaConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_q_heads=num_q_heads, num_kv_heads=hf.get("num_key_value_heads") or num_q_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_q_heads, hidden_dim=hf["intermediate_size"],
        rope_theta=theta, norm_eps=hf.get("rms_norm_eps", 1e-6), dtype=dtype, rope_scaling=scaling,
        qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), sliding_window=_sliding_window(hf))


def _checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return [os.path.join(path, name) for name in sorted(set(json.load(f)["weight_map"].values()))]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"from_pretrained: path={path!r} has no *.safetensors files (other weight formats "
                         f"are not read)")
    return files


def _hf_parameters(model: Llama) -> dict[str, tuple[nnx.Variable, bool]]:
    """Hugging Face tensor name -> (the model's variable, whether HF stores it transposed)."""
    params = {"model.embed_tokens.weight": (model.embed.embedding, False),
              "model.norm.weight": (model.norm.scale, False)}
    if not model.cfg.tie_embeddings:
        params["lm_head.weight"] = (model.lm_head.kernel, True)
    for i, block in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        params[prefix + "input_layernorm.weight"] = (block.attn_norm.scale, False)
        params[prefix + "post_attention_layernorm.weight"] = (block.mlp_norm.scale, False)
        linears = {f"self_attn.{name}": getattr(block.attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        linears.update({f"mlp.{name}": getattr(block.mlp, name) for name in ("gate_proj", "up_proj", "down_proj")})
        for name, linear in linears.items():
            params[f"{prefix}{name}.weight"] = (linear.kernel, True)
            if linear.bias is not None:
                params[f"{prefix}{name}.bias"] = (linear.bias, False)
        if model.cfg.qk_norm:
            params[prefix + "self_attn.q_norm.weight"] = (block.attn.q_norm.scale, False)
            params[prefix + "self_attn.k_norm.weight"] = (block.attn.k_norm.scale, False)
    return params


def from_pretrained(path: str, dtype: str | jnp.dtype | None = None, mesh: jax.sharding.Mesh | None = None) -> Llama:
    """Loads a local Hugging Face checkpoint directory (``config.json`` and ``*.safetensors``,
    sharded with ``model.safetensors.index.json`` or not) of model_type llama, mistral, qwen2 or
    qwen3 into a ``Llama``. Tensors are read one at a time and converted to ``dtype`` (default:
    the checkpoint's ``torch_dtype``/``dtype``, else bfloat16) on the default device, or with a
    ``mesh``, each placed for tensor parallelism over all the mesh's devices as
    ``jaxattn.models.llama.shard_model`` places them (one tensor on the default device at a time).

    Raises ValueError naming the config field of an unsupported model, or the tensor that is
    missing, unexpected or of the wrong shape."""
    try:
        from safetensors import safe_open  # the one runtime use of safetensors, an optional dependency
    except ImportError:
        raise ImportError("from_pretrained needs the safetensors package: pip install 'jaxattn[hf]'") from None
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"from_pretrained: path={path!r} is not a local checkpoint directory with a config.json")
    with open(config_path) as f:
        hf = json.load(f)
    dtype = jnp.dtype(dtype or hf.get("torch_dtype") or hf.get("dtype") or "bfloat16").name
    cfg = llama_config_from_hf(hf, dtype)
    model = nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0)))
    expected = _hf_parameters(model)
    placement = {}
    if mesh is not None:
        variables = jax.tree.leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable))
        placement = {id(v): s for v, s in zip(variables, jax.tree.leaves(param_shardings(model, mesh)))}

    for file in _checkpoint_files(path):
        with safe_open(file, framework="numpy") as tensors:
            for name in tensors.keys():
                if name not in expected:
                    if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_embeddings):
                        continue
                    raise ValueError(f"from_pretrained: unexpected tensor {name!r} in {file} for {cfg}")
                variable, transposed = expected.pop(name)
                array = tensors.get_tensor(name)
                hf_shape = tuple(variable.shape[::-1] if transposed else variable.shape)
                if array.shape != hf_shape:
                    raise ValueError(f"from_pretrained: tensor {name!r} in {file} has shape {array.shape}, "
                                     f"expected {hf_shape}")
                value = jnp.asarray(array, dtype=dtype)
                value = value.T if transposed else value
                variable.set_value(jax.device_put(value, placement[id(variable)]) if placement else value)
    if expected:
        raise ValueError(f"from_pretrained: tensors missing from {path}: {sorted(expected)}")
    return model
