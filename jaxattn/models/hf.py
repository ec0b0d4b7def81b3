"""Hugging Face checkpoints of the Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, and the
mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE) into ``jaxattn.models.llama.Llama``, and of
DeepSeek-V2/V3 into ``jaxattn.models.deepseek.DeepSeek``: ``config.json`` becomes the model's
config and the ``*.safetensors`` tensors are streamed into the model one at a time (an expert
stack is assembled on the host from its experts' tensors). Local directories only."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxattn.models.deepseek import DeepSeek, DeepSeekConfig
from jaxattn.models.layers import MoE, MoERouting, YarnRopeScaling
from jaxattn.models.llama import Llama, Llama3RopeScaling, LlamaConfig, param_shardings

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES)
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
SUPPORTED_MODEL_TYPES = (*LLAMA_MODEL_TYPES, *DEEPSEEK_MODEL_TYPES)
SWIGLU = ("gate_proj", "up_proj", "down_proj")      # an MLP's linears, as the modules and checkpoints name them
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# Tensors some checkpoints carry that the model recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _field(hf: dict[str, Any], name: str, expected: str) -> ValueError:
    return ValueError(f"from_pretrained: config.json field {name}={hf.get(name)!r} is not supported "
                      f"for model_type={hf.get('model_type')!r}; expected {expected}")


def _rope_parameters(hf: dict[str, Any]) -> tuple[str, dict[str, Any], float, str]:
    """``(field name, its dict, rope_theta, rope type)`` from ``rope_theta`` + ``rope_scaling``
    (transformers 4) or ``rope_parameters`` (transformers 5)."""
    name = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    params = hf.get(name) or {}
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    return name, params, theta, params.get("rope_type", params.get("type", "default"))


def _rope(hf: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, Llama 3.1 scaling or None) of a Llama-family ``config.json``."""
    name, params, theta, rope_type = _rope_parameters(hf)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise _field(hf, name, "partial_rotary_factor 1.0")
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
    if hf.get("model_type") not in LLAMA_MODEL_TYPES:
        raise _field(hf, "model_type", f"one of {LLAMA_MODEL_TYPES}")
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


def deepseek_config_from_hf(hf: dict[str, Any], dtype: str) -> DeepSeekConfig:
    """The ``DeepSeekConfig`` of a deepseek_v2 / deepseek_v3 ``config.json``: MLA (with or without
    ``q_lora_rank``), dense layers before ``first_k_dense_replace``, then V2's softmax routing
    (greedy or group-limited) or V3's sigmoid routing with its score bias, YaRN rope scaling or
    none; ValueError naming the field for anything the model does not implement."""
    model_type = hf.get("model_type")
    if model_type not in DEEPSEEK_MODEL_TYPES:
        raise _field(hf, "model_type", f"one of {DEEPSEEK_MODEL_TYPES}")
    if hf.get("hidden_act", "silu") != "silu":
        raise _field(hf, "hidden_act", "'silu'")
    if hf.get("attention_bias", False):
        raise _field(hf, "attention_bias", "false")
    theta, yarn = _yarn(hf)
    if hf.get("moe_layer_freq", 1) not in (1, None):
        raise _field(hf, "moe_layer_freq", "1 (experts in every layer from first_k_dense_replace on)")
    experts = hf.get("n_routed_experts") or 0
    groups = dict(n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1)
    scaling_factor = float(hf.get("routed_scaling_factor") or 1.0)
    if model_type == "deepseek_v2":
        if hf.get("topk_method", "greedy") not in ("greedy", "group_limited_greedy"):
            raise _field(hf, "topk_method", "'greedy' or 'group_limited_greedy'")
        if hf.get("scoring_func", "softmax") not in ("softmax", None):
            raise _field(hf, "scoring_func", "'softmax'")
        if hf.get("norm_topk_prob"):
            raise _field(hf, "norm_topk_prob", "false (transformers' DeepSeek-V2 does not renormalize)")
        if hf.get("topk_method", "greedy") == "greedy":
            groups = dict(n_group=1, topk_group=1)
        routing = MoERouting(routed_scaling_factor=scaling_factor, gated_shared_expert=False, **groups)
    else:
        if hf.get("topk_method", "noaux_tc") not in ("noaux_tc", None):
            raise _field(hf, "topk_method", "'noaux_tc'")
        if hf.get("scoring_func", "sigmoid") not in ("sigmoid", None):
            raise _field(hf, "scoring_func", "'sigmoid'")
        routing = MoERouting(scoring="sigmoid", score_bias=True, routed_scaling_factor=scaling_factor,
                             gated_shared_expert=False, **groups)
    moe_hidden = hf.get("moe_intermediate_size") or 0
    return DeepSeekConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_q_heads=hf["num_attention_heads"], kv_lora_rank=hf["kv_lora_rank"], qk_nope_dim=hf["qk_nope_head_dim"],
        qk_rope_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], hidden_dim=hf["intermediate_size"],
        rope_theta=theta, norm_eps=hf.get("rms_norm_eps", 1e-6), dtype=dtype,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), q_lora_rank=hf.get("q_lora_rank"),
        num_experts=experts, num_experts_per_tok=hf.get("num_experts_per_tok") or 1, moe_hidden_dim=moe_hidden,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)) and model_type == "deepseek_v3",
        shared_expert_dim=(hf.get("n_shared_experts") or 0) * moe_hidden,
        first_k_dense_replace=hf.get("first_k_dense_replace") or 0, routing=routing, rope_scaling=yarn)


def _yarn(hf: dict[str, Any]) -> tuple[float, YarnRopeScaling | None]:
    """(rope_theta, YaRN scaling or None) of a DeepSeek ``config.json``."""
    name, params, theta, rope_type = _rope_parameters(hf)
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn" or params.get("attention_factor") is not None:
        raise _field(hf, name, "rope_type 'default' or 'yarn' (without attention_factor)")
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor") or (hf["max_position_embeddings"] / original if original else None)
    if not original or not factor:
        raise _field(hf, name, "yarn with factor and original_max_position_embeddings")
    return theta, YarnRopeScaling(
        factor=float(factor), original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        truncate=bool(params.get("truncate", True)))


def _interleaved_to_half(rope_dim: int) -> np.ndarray:
    """The order that takes a RoPE part stored in interleaved pairs (DeepSeek's checkpoints:
    dimensions 2i and 2i + 1 rotate together) to the half-split convention of ``layers.rope``."""
    return np.concatenate([np.arange(0, rope_dim, 2), np.arange(1, rope_dim, 2)])


def _past_the_layers(name: str, num_layers: int) -> bool:
    """Whether tensor ``name`` belongs to a layer at or past ``num_layers`` (DeepSeek-V3's
    multi-token-prediction layers, which the model does not run)."""
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers


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


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: ``variable``; ``transposed``: HF stores it transposed;
    ``expert``: its index in a stacked expert variable (None: the whole variable); ``rows``: the
    order to take the HF tensor's rows in (None: as stored)."""

    variable: nnx.Variable
    transposed: bool
    expert: int | None = None
    rows: np.ndarray | None = None


def _hf_parameters(model: Llama, model_type: str) -> dict[str, Target]:
    """Hugging Face tensor name -> where it goes in the model (``Target``)."""
    params = _ends(model)
    for i, block in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        params[prefix + "input_layernorm.weight"] = Target(block.attn_norm.scale, False)
        params[prefix + "post_attention_layernorm.weight"] = Target(block.mlp_norm.scale, False)
        linears = {f"self_attn.{name}": getattr(block.attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        if model.cfg.num_experts:
            params.update(_expert_parameters(block.mlp, prefix, model_type))
            if model.cfg.shared_expert_dim:
                linears.update(_swiglu("mlp.shared_expert", block.mlp.shared_expert))
                linears["mlp.shared_expert_gate"] = block.mlp.shared_expert_gate
        else:
            linears.update(_swiglu("mlp", block.mlp))
        params.update(_linears(prefix, linears))
        if model.cfg.qk_norm:
            params[prefix + "self_attn.q_norm.weight"] = Target(block.attn.q_norm.scale, False)
            params[prefix + "self_attn.k_norm.weight"] = Target(block.attn.k_norm.scale, False)
    return params


def _ends(model: Llama | DeepSeek) -> dict[str, Target]:
    """The embedding, final norm and (untied) LM head."""
    params = {"model.embed_tokens.weight": Target(model.embed.embedding, False),
              "model.norm.weight": Target(model.norm.scale, False)}
    if not model.cfg.tie_embeddings:
        params["lm_head.weight"] = Target(model.lm_head.kernel, True)
    return params


def _swiglu(name: str, mlp) -> dict[str, nnx.Linear]:
    """The linears of a SwiGLU ``mlp`` (an ``MLP``) by HF name under ``name``."""
    return {f"{name}.{linear}": getattr(mlp, linear) for linear in SWIGLU}


def _linears(prefix: str, linears: dict[str, nnx.Linear], rows: dict[str, np.ndarray] | None = None
             ) -> dict[str, Target]:
    """The weight (and bias) tensors of ``linears`` by HF name (``rows``: a weight's row order)."""
    params = {}
    for name, linear in linears.items():
        params[f"{prefix}{name}.weight"] = Target(linear.kernel, True, rows=(rows or {}).get(name))
        if linear.bias is not None:
            params[f"{prefix}{name}.bias"] = Target(linear.bias, False)
    return params


def _deepseek_parameters(model: DeepSeek, model_type: str, interleaved: bool) -> dict[str, Target]:
    """HF tensor name -> ``Target`` of a DeepSeek model (``interleaved``: the checkpoint's RoPE
    parts are in interleaved pairs, reordered on load)."""
    cfg = model.cfg
    head = cfg.qk_nope_dim + cfg.qk_rope_dim
    rope_order = _interleaved_to_half(cfg.qk_rope_dim) if interleaved else np.arange(cfg.qk_rope_dim)
    q_rows = np.concatenate([h * head + np.concatenate([np.arange(cfg.qk_nope_dim), cfg.qk_nope_dim + rope_order])
                             for h in range(cfg.num_q_heads)])
    kv_rows = np.concatenate([np.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + rope_order])
    params = _ends(model)
    for i, block in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        attn = block.attn
        params[prefix + "input_layernorm.weight"] = Target(block.attn_norm.scale, False)
        params[prefix + "post_attention_layernorm.weight"] = Target(block.mlp_norm.scale, False)
        params[prefix + "self_attn.kv_a_layernorm.weight"] = Target(attn.kv_a_norm.scale, False)
        linears = {"self_attn.kv_a_proj_with_mqa": attn.kv_a_proj, "self_attn.kv_b_proj": attn.kv_b_proj,
                   "self_attn.o_proj": attn.o_proj}
        rows = {"self_attn.kv_a_proj_with_mqa": kv_rows, "self_attn.q_proj": q_rows, "self_attn.q_b_proj": q_rows}
        if cfg.q_lora_rank:
            linears.update({"self_attn.q_a_proj": attn.q_a_proj, "self_attn.q_b_proj": attn.q_b_proj})
            params[prefix + "self_attn.q_a_layernorm.weight"] = Target(attn.q_a_norm.scale, False)
        else:
            linears["self_attn.q_proj"] = attn.q_proj
        if isinstance(block.mlp, MoE):
            params.update(_expert_parameters(block.mlp, prefix, model_type))
            if cfg.shared_expert_dim:
                linears.update(_swiglu("mlp.shared_experts", block.mlp.shared_expert))
            if cfg.routing.score_bias:
                params[prefix + "mlp.gate.e_score_correction_bias"] = Target(block.mlp.score_bias, False)
        else:
            linears.update(_swiglu("mlp", block.mlp))
        params.update(_linears(prefix, linears, rows))
    return params


def _expert_parameters(moe, prefix: str, model_type: str) -> dict[str, Target]:
    """The router's and each expert's tensors of a layer's ``MoE`` (Mixtral's ``block_sparse_moe``
    names w1 / w3 / w2 for gate / up / down; Qwen's ``mlp``)."""
    if model_type == "mixtral":
        module, names = "block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    else:
        module, names = "mlp", {name: name for name in SWIGLU}
    params = {f"{prefix}{module}.gate.weight": Target(moe.router.kernel, True)}
    for j in range(moe.cfg.num_experts):
        for ours, theirs in names.items():
            params[f"{prefix}{module}.experts.{j}.{theirs}.weight"] = Target(getattr(moe, ours), True, j)
    return params


def from_pretrained(path: str, dtype: str | jnp.dtype | None = None,
                    mesh: jax.sharding.Mesh | None = None) -> Llama | DeepSeek:
    """Loads a local Hugging Face checkpoint directory (``config.json`` and ``*.safetensors``,
    sharded with ``model.safetensors.index.json`` or not) of a model_type of
    ``SUPPORTED_MODEL_TYPES`` into a ``Llama`` (llama, mistral, qwen2, qwen3; the mixtures of
    experts mixtral, qwen2_moe and qwen3_moe) or a ``DeepSeek`` (deepseek_v2, deepseek_v3, YaRN or
    not; the layers past ``num_hidden_layers``, V3's multi-token prediction, are skipped).
    Tensors are read one at a time and converted to ``dtype`` (default: the checkpoint's
    ``torch_dtype``/``dtype``, else bfloat16) on the default device, or with a ``mesh`` (Llama
    only), each placed for tensor parallelism over all the mesh's devices as
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
    if hf.get("quantization_config"):
        raise _field(hf, "quantization_config", "none (quantized weights such as FP8 are not read yet)")
    dtype = jnp.dtype(dtype or hf.get("torch_dtype") or hf.get("dtype") or "bfloat16").name
    if hf.get("model_type") in DEEPSEEK_MODEL_TYPES:
        if mesh is not None:
            raise ValueError("from_pretrained: mesh must be None for DeepSeek models (MLA is not split over "
                             "devices yet)")
        cfg = deepseek_config_from_hf(hf, dtype)
        model = nnx.eval_shape(lambda: DeepSeek(cfg, nnx.Rngs(0)))
        interleaved = hf["model_type"] == "deepseek_v2" or hf.get("rope_interleave", True)
        expected = _deepseek_parameters(model, hf["model_type"], interleaved)
    else:
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
                    if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_embeddings) \
                            or _past_the_layers(name, cfg.num_layers):
                        continue
                    raise ValueError(f"from_pretrained: unexpected tensor {name!r} in {file} for {cfg}")
                target = expected.pop(name)
                variable, transposed, expert = target.variable, target.transposed, target.expert
                array = tensors.get_tensor(name)
                shape = variable.shape if expert is None else variable.shape[1:]
                hf_shape = tuple(shape[::-1] if transposed else shape)
                if array.shape != hf_shape:
                    raise ValueError(f"from_pretrained: tensor {name!r} in {file} has shape {array.shape}, "
                                     f"expected {hf_shape}")
                if target.rows is not None:
                    array = array[target.rows]
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
