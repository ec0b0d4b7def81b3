"""Hugging Face checkpoints of the Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, and the
mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE) into ``jaxattn.models.llama.Llama``:
``config.json`` becomes a ``LlamaConfig`` and the ``*.safetensors`` tensors are streamed into the
model one at a time (an expert stack is assembled on the host from its experts' tensors). Local
directories only."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import numpy as np

from jaxattn.models.llama import Llama, Llama3RopeScaling, LlamaConfig, param_shardings

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
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
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if hf.get("use_sliding_window"):  # the window applies to some layers only (max_window_layers)
            raise _field(hf, "use_sliding_window", "false")
        return None
    window = hf.get("sliding_window") if model_type in ("mistral", "mixtral") else None
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
    if model_type not in ("qwen2", "qwen2_moe") and hf.get("attention_bias", False):
        raise _field(hf, "attention_bias", "false (biases on q/k/v only, as in qwen2)")
    missing = [name for name in _REQUIRED_FIELDS if name not in hf]
    if missing:
        raise ValueError(f"from_pretrained: config.json lacks the fields {missing}")
    theta, scaling = _rope(hf)
    num_q_heads = hf["num_attention_heads"]
    return _moe_config(hf, LlamaConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_q_heads=num_q_heads, num_kv_heads=hf.get("num_key_value_heads") or num_q_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_q_heads, hidden_dim=hf["intermediate_size"],
        rope_theta=theta, norm_eps=hf.get("rms_norm_eps", 1e-6), dtype=dtype, rope_scaling=scaling,
        qkv_bias=model_type in ("qwen2", "qwen2_moe"), qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), sliding_window=_sliding_window(hf)))


def _moe_config(hf: dict[str, Any], cfg: LlamaConfig) -> LlamaConfig:
    """``cfg`` with the experts of a mixture-of-experts ``config.json`` (Mixtral: every layer's
    ``num_local_experts`` experts of ``intermediate_size``, weights renormalized; Qwen2/3-MoE:
    ``num_experts`` of ``moe_intermediate_size``, ``norm_topk_prob``, Qwen2-MoE's shared expert)."""
    model_type = hf["model_type"]
    if model_type not in MOE_MODEL_TYPES:
        return cfg
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    if not experts or not hf.get("num_experts_per_tok"):
        raise _field(hf, "num_experts", "a number of experts and num_experts_per_tok")
    if model_type == "mixtral":
        return cfg.replace(num_experts=experts, num_experts_per_tok=hf["num_experts_per_tok"],
                           moe_hidden_dim=hf["intermediate_size"], norm_topk_prob=True)
    if hf.get("decoder_sparse_step", 1) != 1:
        raise _field(hf, "decoder_sparse_step", "1 (experts in every layer)")
    if hf.get("mlp_only_layers"):
        raise _field(hf, "mlp_only_layers", "[] (experts in every layer)")
    shared = hf.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
    return cfg.replace(num_experts=experts, num_experts_per_tok=hf["num_experts_per_tok"],
                       moe_hidden_dim=hf.get("moe_intermediate_size") or hf["intermediate_size"],
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)), shared_expert_dim=shared or 0)


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


# (variable, whether HF stores it transposed, the expert it is in a stacked expert variable or None)
Target = tuple[nnx.Variable, bool, int | None]


def _hf_parameters(model: Llama, model_type: str) -> dict[str, Target]:
    """Hugging Face tensor name -> where it goes in the model (``Target``)."""
    params = {"model.embed_tokens.weight": (model.embed.embedding, False, None),
              "model.norm.weight": (model.norm.scale, False, None)}
    if not model.cfg.tie_embeddings:
        params["lm_head.weight"] = (model.lm_head.kernel, True, None)
    for i, block in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        params[prefix + "input_layernorm.weight"] = (block.attn_norm.scale, False, None)
        params[prefix + "post_attention_layernorm.weight"] = (block.mlp_norm.scale, False, None)
        linears = {f"self_attn.{name}": getattr(block.attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        if model.cfg.num_experts:
            params.update(_expert_parameters(block.mlp, prefix, model_type))
            if model.cfg.shared_expert_dim:
                linears.update({f"mlp.shared_expert.{name}": getattr(block.mlp.shared_expert, name)
                                for name in ("gate_proj", "up_proj", "down_proj")})
                linears["mlp.shared_expert_gate"] = block.mlp.shared_expert_gate
        else:
            linears.update({f"mlp.{name}": getattr(block.mlp, name) for name in ("gate_proj", "up_proj", "down_proj")})
        for name, linear in linears.items():
            params[f"{prefix}{name}.weight"] = (linear.kernel, True, None)
            if linear.bias is not None:
                params[f"{prefix}{name}.bias"] = (linear.bias, False, None)
        if model.cfg.qk_norm:
            params[prefix + "self_attn.q_norm.weight"] = (block.attn.q_norm.scale, False, None)
            params[prefix + "self_attn.k_norm.weight"] = (block.attn.k_norm.scale, False, None)
    return params


def _expert_parameters(moe, prefix: str, model_type: str) -> dict[str, Target]:
    """The router's and each expert's tensors of a layer's ``MoE`` (Mixtral's ``block_sparse_moe``
    names w1 / w3 / w2 for gate / up / down; Qwen's ``mlp``)."""
    if model_type == "mixtral":
        module, names = "block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    else:
        module, names = "mlp", {name: name for name in ("gate_proj", "up_proj", "down_proj")}
    params = {f"{prefix}{module}.gate.weight": (moe.router.kernel, True, None)}
    for j in range(moe.cfg.num_experts):
        for ours, theirs in names.items():
            params[f"{prefix}{module}.experts.{j}.{theirs}.weight"] = (getattr(moe, ours), True, j)
    return params


def from_pretrained(path: str, dtype: str | jnp.dtype | None = None, mesh: jax.sharding.Mesh | None = None) -> Llama:
    """Loads a local Hugging Face checkpoint directory (``config.json`` and ``*.safetensors``,
    sharded with ``model.safetensors.index.json`` or not) of a model_type of
    ``SUPPORTED_MODEL_TYPES`` (llama, mistral, qwen2, qwen3; the mixtures of experts mixtral,
    qwen2_moe and qwen3_moe) into a ``Llama``. Tensors are read one at a time and converted to ``dtype`` (default:
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
    expected = _hf_parameters(model, hf["model_type"])
    stacks: dict[int, list] = {}         # id(variable) -> [host array, experts still to read]
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
                variable, transposed, expert = expected.pop(name)
                array = tensors.get_tensor(name)
                shape = variable.shape if expert is None else variable.shape[1:]
                hf_shape = tuple(shape[::-1] if transposed else shape)
                if array.shape != hf_shape:
                    raise ValueError(f"from_pretrained: tensor {name!r} in {file} has shape {array.shape}, "
                                     f"expected {hf_shape}")
                if expert is not None:           # one expert of a stack: set once all are read
                    stack = stacks.setdefault(id(variable), [np.empty(variable.shape, array.dtype),
                                                             variable.shape[0]])
                    stack[0][expert] = array.T if transposed else array
                    stack[1] -= 1
                    if stack[1]:
                        continue
                    array, transposed = stacks.pop(id(variable))[0], False
                value = jnp.asarray(array, dtype=dtype)
                value = value.T if transposed else value
                variable.set_value(jax.device_put(value, placement[id(variable)]) if placement else value)
    if expected:
        raise ValueError(f"from_pretrained: tensors missing from {path}: {sorted(expected)}")
    return model
