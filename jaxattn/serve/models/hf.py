"""Hugging Face checkpoints of the Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, and the
mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE) into ``jaxattn.serve.models.llama.Llama``, and of
DeepSeek-V2/V3 into ``jaxattn.serve.models.deepseek.DeepSeek``: ``config.json`` becomes the model's
config and the ``*.safetensors`` tensors are streamed into the model one at a time (an expert
stack is assembled on the host from its experts' tensors). Local directories only.

FP8 checkpoints (``quantization_config.quant_method == "fp8"``: float8_e4m3fn weights with
``weight_scale_inv`` block scales or ``weight_scale`` per-tensor / per-channel scales) load their
decoder-block linears as ``jaxattn.serve.models.quantization.Fp8Linear`` with the scales as stored,
and the FP8 tensors the model keeps in its dtype dequantized; ``quantization="fp8"`` quantizes a
bf16 / float32 checkpoint's linears per output channel as they are read."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxattn.checks import is_positive_float32, is_positive_int
from jaxattn.serve.models.deepseek import DeepSeek, DeepSeekConfig
from jaxattn.serve.models.layers import EXPERT_AXES, MoE, MoERouting, YarnRopeScaling
from jaxattn.serve.models.llama import Llama, Llama3RopeScaling, LlamaConfig
from jaxattn.serve.models.parallel import enable_expert_parallel, param_shardings, place_experts
from jaxattn.serve.models.quantization import (FP8_DTYPE, METHODS, Fp8Experts, Fp8Linear, Granularity, dequantize,
                                               expert_stacks, quantize_kernel, quantize_stack)
from jaxattn.serve.models.quantization import linears as quantizable_linears

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES)
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
SUPPORTED_MODEL_TYPES = (*LLAMA_MODEL_TYPES, *DEEPSEEK_MODEL_TYPES)
SWIGLU = ("gate_proj", "up_proj", "down_proj")      # an MLP's linears, as the modules and checkpoints name them
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_DEEPSEEK_REQUIRED_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# Tensors some checkpoints carry that the model recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# safetensors dtypes read from the file's bytes (safetensors' NumPy reader has no float8 dtype)
_RAW_DTYPES = {"F8_E4M3": FP8_DTYPE, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16}


def _field(hf: dict[str, Any], name: str, expected: str, value: Any = None) -> ValueError:
    """The error for config field ``name`` (``value``, when given: a field inside an object, as
    ``rope_scaling.factor``)."""
    value = hf.get(name) if value is None else value
    return ValueError(f"from_pretrained: config.json field {name}={value!r} is not supported "
                      f"for model_type={hf.get('model_type')!r}; expected {expected}")


def _check_sizes(hf: dict[str, Any], required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """ValueError naming the first of ``required`` that ``hf`` lacks, or the first field of
    ``required`` + ``optional`` (when set: not null) that is not an int in [1, 2**31 - 1]."""
    missing = [name for name in required if name not in hf]
    if missing:
        raise ValueError(f"from_pretrained: config.json lacks the fields {missing}")
    for name in required + optional:
        value = hf.get(name)
        if (name in required or value is not None) and not is_positive_int(value):
            raise _field(hf, name, "an int in [1, 2**31 - 1]")


def _number(hf: dict[str, Any], name: str, value: Any, default: float) -> float:
    """``value`` (config field ``name``; ``default`` when null) as a float, positive and finite in
    float32 (the model computes with it there)."""
    if value is None:
        return default
    if not is_positive_float32(value):
        raise _field(hf, name, "a number > 0, finite in float32", value)
    return float(value)


def _flag(hf: dict[str, Any], name: str) -> bool:
    """Config field ``name`` as a bool (False when absent or null); JSON's true or false only (a
    string "false" would otherwise read as true)."""
    value = hf.get(name)
    if value is not None and not isinstance(value, bool):
        raise _field(hf, name, "true or false")
    return bool(value)


def _rope_parameters(hf: dict[str, Any]) -> tuple[str, dict[str, Any], float, str]:
    """``(field name, its dict, rope_theta, rope type)`` from ``rope_theta`` + ``rope_scaling``
    (transformers 4) or ``rope_parameters`` (transformers 5)."""
    name = "rope_parameters" if hf.get("rope_parameters") is not None else "rope_scaling"
    params = hf.get(name) or {}
    if not isinstance(params, dict):
        raise _field(hf, name, "an object (or null)")
    theta = _number(hf, "rope_theta", params.get("rope_theta") or hf.get("rope_theta"), 10000.0)
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
    factors = ("factor", "low_freq_factor", "high_freq_factor")
    missing = [key for key in factors if params.get(key) is None]
    if missing:
        raise _field(hf, name, f"llama3 rope scaling with {missing}")
    factor, low, high = (_number(hf, f"{name}.{key}", params[key], 0.0) for key in factors)
    original = params.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
    if not is_positive_int(original):
        raise _field(hf, f"{name}.original_max_position_embeddings", "an int in [1, 2**31 - 1] (or "
                     "max_position_embeddings)", original)
    return theta, Llama3RopeScaling(factor=factor, low_freq_factor=low, high_freq_factor=high,
                                    original_max_position_embeddings=original)


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
    _check_sizes(hf, _REQUIRED_FIELDS, ("num_key_value_heads", "head_dim"))
    theta, scaling = _rope(hf)
    num_q_heads = hf["num_attention_heads"]
    return _moe_config(hf, LlamaConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_q_heads=num_q_heads, num_kv_heads=hf.get("num_key_value_heads") or num_q_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_q_heads, hidden_dim=hf["intermediate_size"],
        rope_theta=theta, norm_eps=_number(hf, "rms_norm_eps", hf.get("rms_norm_eps"), 1e-6), dtype=dtype,
        rope_scaling=scaling,
        qkv_bias=model_type in ("qwen2", "qwen2_moe"), qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tie_embeddings=_flag(hf, "tie_word_embeddings"), sliding_window=_sliding_window(hf)))


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
                       norm_topk_prob=_flag(hf, "norm_topk_prob"), shared_expert_dim=shared or 0)


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
    _check_sizes(hf, _REQUIRED_FIELDS + _DEEPSEEK_REQUIRED_FIELDS, ("q_lora_rank", "n_routed_experts",
                                                                    "num_experts_per_tok", "moe_intermediate_size"))
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
        rope_theta=theta, norm_eps=_number(hf, "rms_norm_eps", hf.get("rms_norm_eps"), 1e-6), dtype=dtype,
        tie_embeddings=_flag(hf, "tie_word_embeddings"), q_lora_rank=hf.get("q_lora_rank"),
        num_experts=experts, num_experts_per_tok=hf.get("num_experts_per_tok") or 1, moe_hidden_dim=moe_hidden,
        norm_topk_prob=_flag(hf, "norm_topk_prob") and model_type == "deepseek_v3",
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
    files = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
    if not files:
        raise ValueError(f"from_pretrained: path={path!r} has no *.safetensors files (other weight formats "
                         f"are not read)")
    return files


@dataclasses.dataclass(frozen=True)
class Stored:
    """A tensor of a checkpoint file as its safetensors header describes it."""

    file: str
    dtype: str                   # safetensors' name: "BF16", "F8_E4M3", ...
    shape: tuple[int, ...]
    offset: int                  # of its bytes in the file

    def read(self) -> np.ndarray:
        """The tensor, read from the file's bytes (dtypes of ``_RAW_DTYPES``)."""
        if self.dtype not in _RAW_DTYPES:
            raise ValueError(f"from_pretrained: a {self.dtype} tensor in {self.file} is not read here; FP8 weights "
                             f"and their scales must be one of {sorted(_RAW_DTYPES)}")
        dtype = np.dtype(_RAW_DTYPES[self.dtype])
        return np.fromfile(self.file, dtype, math.prod(self.shape), offset=self.offset).reshape(self.shape)


def _stored_tensors(files: list[str]) -> dict[str, Stored]:
    """Every tensor of the checkpoint ``files`` by name, from their headers (nothing else is read)."""
    stored = {}
    for file in files:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                stored[name] = Stored(file, info["dtype"], tuple(info["shape"]), 8 + size + info["data_offsets"][0])
    return stored


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: ``variable``; ``transposed``: HF stores it transposed;
    ``expert``: its index in a stacked expert variable (None: the whole variable); ``rows``: the
    order to take the HF tensor's rows in (None: as stored). FP8: ``stored_shape``, the shape a
    scale is stored in when it is not the variable's (``[out, 1]``, ``[1]``); ``scale`` and
    ``granularity``, the checkpoint scale that dequantizes this FP8 tensor on load (the model
    keeps it in its dtype); ``quantize``, the scale variable of the ``Fp8Linear`` whose kernel
    is quantized from this tensor on load (per output channel)."""

    variable: nnx.Variable
    transposed: bool
    expert: int | None = None
    rows: np.ndarray | None = None
    stored_shape: tuple[int, ...] | None = None
    scale: str | None = None
    granularity: Granularity | None = None
    quantize: nnx.Variable | None = None

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape the checkpoint stores the tensor in (``stored_shape`` aside)."""
        shape = self.variable.shape if self.expert is None else self.variable.shape[1:]
        return tuple(shape[::-1] if self.transposed else shape)


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


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """How FP8 weights are read: ``stored``: the checkpoint's own (scales as stored; ``block``:
    its ``weight_block_size`` as (rows, columns) of the ``[in, out]`` kernel, else each scale's
    shape says per tensor or per channel); else quantized per output channel on load."""

    stored: bool
    block: tuple[int, int] | None = None


def fp8_format(hf: dict[str, Any], quantization: str | None) -> Fp8Format | None:
    """The FP8 format of a ``config.json`` and ``from_pretrained``'s ``quantization`` argument
    (None: no quantization); ValueError naming what is not supported."""
    if quantization not in (None, *METHODS):
        raise ValueError(f"from_pretrained: quantization must be None or one of {METHODS}, got "
                         f"{quantization!r}")
    config = hf.get("quantization_config")
    if not config:
        return Fp8Format(stored=False) if quantization else None
    method = config.get("quant_method") if isinstance(config, dict) else None
    if method not in METHODS:
        raise ValueError(f"from_pretrained: config.json field quantization_config.quant_method={method!r} is not "
                         f"supported; expected one of {METHODS} (float8_e4m3fn weights with weight_scale or "
                         f"weight_scale_inv scales: per tensor, per output channel or weight_block_size blocks). "
                         f"Other methods (awq, gptq, bitsandbytes, compressed-tensors, ...) are not read")
    if config.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise ValueError(f"from_pretrained: config.json field quantization_config.activation_scheme="
                         f"{config['activation_scheme']!r} is not supported; expected 'dynamic' or 'static'")
    block = config.get("weight_block_size")
    if block is None:
        return Fp8Format(stored=True)
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise ValueError(f"from_pretrained: config.json field quantization_config.weight_block_size={block!r} is "
                         f"not supported; expected two positive ints [block_out, block_in]")
    return Fp8Format(stored=True, block=(block[1], block[0]))    # HF's [out, in] -> the kernel's [in, out]


def _stored_scale(stored: dict[str, Stored], weight: str, hf_shape: tuple[int, ...],
                  block: tuple[int, int] | None) -> tuple[str, Granularity]:
    """The name and granularity of the scale of FP8 tensor ``weight`` (stored ``[out, in]``)."""
    base = weight[:-len("weight")]
    names = [base + suffix for suffix in ("weight_scale_inv", "weight_scale") if base + suffix in stored]
    if not names:
        raise ValueError(f"from_pretrained: FP8 tensor {weight!r} has no {base}weight_scale_inv or "
                         f"{base}weight_scale in the checkpoint")
    name, (out, fan_in) = names[0], hf_shape
    shape = stored[name].shape
    if block is not None:
        expected = (math.ceil(out / block[1]), math.ceil(fan_in / block[0]))
        if shape != expected:
            raise ValueError(f"from_pretrained: tensor {name!r} has shape {shape}, expected {expected}: the "
                             f"weight_block_size blocks of {weight!r} {hf_shape}")
        return name, block
    if math.prod(shape) == 1:
        return name, "tensor"
    if shape in ((out,), (out, 1)):
        return name, "channel"
    raise ValueError(f"from_pretrained: tensor {name!r} has shape {shape}: expected a per-tensor scale ([] or [1]) "
                     f"or per-channel scales ([{out}] or [{out}, 1]) for {weight!r} {hf_shape}, or "
                     f"quantization_config.weight_block_size for block scales")


def _fp8_targets(model: Llama | DeepSeek, expected: dict[str, Target], stored: dict[str, Stored],
                 fp8: Fp8Format) -> set[str]:
    """Makes each linear of ``quantizable_linears(model)`` (abstract) an ``Fp8Linear`` where the
    checkpoint holds its weight in FP8 (with ``fp8.stored``; else every one, quantized on load)
    and points its tensors there in ``expected``, and each expert stack an ``Fp8Experts``
    likewise (``_fp8_expert_targets``); the checkpoint's other FP8 tensors (MLA's kv_b_proj,
    ignored-but-quantized layers, experts scaled unlike their stack) are dequantized on load. A block-scaled linear
    whose rows the loader reorders across blocks (DeepSeek's RoPE rows) is dequantized too.
    Returns the names of the tensors read with others (their scales) or not needed (activation
    scales: activations are not quantized)."""
    weights = {id(target.variable): name for name, target in expected.items()}
    for owner, attr, linear in list(quantizable_linears(model)):
        weight = weights[id(linear.kernel)]
        target, granularity = expected[weight], "channel"
        if fp8.stored:
            if weight not in stored or stored[weight].dtype != "F8_E4M3":
                continue
            scale, granularity = _stored_scale(stored, weight, target.hf_shape, fp8.block)
            if (not isinstance(granularity, str) and target.rows is not None
                    and np.any(target.rows // granularity[1] != np.arange(len(target.rows)) // granularity[1])):
                continue
        layer = nnx.eval_shape(lambda lin: Fp8Linear.from_linear(lin, granularity), linear)
        setattr(owner, attr, layer)
        expected[weight] = dataclasses.replace(target, variable=layer.kernel, transposed=False,    # as stored
                                               quantize=None if fp8.stored else layer.scale)
        if layer.bias is not None:
            expected[weight[:-len("weight")] + "bias"] = Target(layer.bias, False)
        if fp8.stored:
            expected[scale] = Target(layer.scale, not isinstance(granularity, str), stored_shape=stored[scale].shape,
                                     rows=target.rows if granularity == "channel" else None)
    _fp8_expert_targets(model, expected, stored, fp8)
    if not fp8.stored:
        return set()
    read_along = {name for name in stored if name.endswith(".input_scale")}
    for name, target in list(expected.items()):
        if name in stored and stored[name].dtype == "F8_E4M3" and target.variable.dtype != FP8_DTYPE:
            scale, granularity = _stored_scale(stored, name, target.hf_shape, fp8.block)
            expected[name] = dataclasses.replace(target, scale=scale, granularity=granularity)
            read_along.add(scale)
    return read_along


def _fp8_expert_targets(model: Llama | DeepSeek, expected: dict[str, Target], stored: dict[str, Stored],
                        fp8: Fp8Format) -> None:
    """Makes each expert stack of ``model`` (abstract) an ``Fp8Experts`` where every expert's
    weight is stored in FP8 with scales of one granularity (with ``fp8.stored``; else every
    stack, quantized once all its experts are read), its experts' weights and scales pointed
    there in ``expected``."""
    names: dict[int, list[str]] = {}
    for name, target in expected.items():
        names.setdefault(id(target.variable), []).append(name)
    for moe, attr, param in list(expert_stacks(model)):
        weights = sorted(names[id(param)], key=lambda name: expected[name].expert)
        granularity, scales = "channel", []
        if fp8.stored:
            if not all(name in stored and stored[name].dtype == "F8_E4M3" for name in weights):
                continue                                     # dequantized on load with the other FP8 tensors
            scales = [_stored_scale(stored, name, expected[name].hf_shape, fp8.block) for name in weights]
            if len({granularity for _, granularity in scales}) != 1:
                continue
            granularity = scales[0][1]
        stack = nnx.eval_shape(lambda p: Fp8Experts.from_stack(p[...], EXPERT_AXES[attr], granularity), param)
        setattr(moe, attr, stack)
        for name in weights:     # the stack keeps each expert's kernel as stored, [out, in] (Fp8Experts.LAYOUT)
            expected[name] = dataclasses.replace(expected[name], variable=stack.kernel, transposed=False,
                                                 quantize=None if fp8.stored else stack.scale)
        for name, (scale, _) in zip(weights, scales):     # block scales stored [out blocks, in blocks]
            expected[scale] = Target(stack.scale, not isinstance(granularity, str), expected[name].expert,
                                     stored_shape=stored[scale].shape)


def _dequantized(weight: np.ndarray, scale: np.ndarray, granularity: Granularity) -> np.ndarray:
    """float32 ``weight * scale`` of an FP8 tensor stored ``[out, in]`` and its stored scale."""
    if isinstance(granularity, str):
        scale = scale.reshape(() if granularity == "tensor" else (-1,))
    else:
        scale = scale.T
    return dequantize(weight.T, scale, granularity).T


def read_config(path: str) -> dict[str, Any]:
    """The checkpoint directory ``path``'s ``config.json`` as a dict; ValueError naming the file
    when there is none, or it is not JSON (or not UTF-8), or not a JSON object."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"from_pretrained: path={path!r} is not a local checkpoint directory with a config.json")
    with open(config_path, "rb") as f:
        try:
            hf = json.load(f)
        except ValueError as error:                  # not JSON, or not UTF-8
            raise ValueError(f"from_pretrained: {config_path} is not a JSON file: {error}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"from_pretrained: {config_path} holds a JSON {type(hf).__name__}, not an object")
    return hf


def _model_dtype(hf: dict[str, Any], dtype: str | jnp.dtype | None) -> str:
    """The parameters' dtype name: ``dtype``, else the config's ``torch_dtype`` / ``dtype``, else
    bfloat16; ValueError naming where a name that is not a float dtype came from."""
    field = None if dtype is not None else next((name for name in ("torch_dtype", "dtype") if hf.get(name)), None)
    value = dtype if dtype is not None else hf[field] if field else "bfloat16"
    try:
        name = jnp.dtype(value).name
    except TypeError:
        name = None
    if name not in ("float32", "bfloat16", "float16"):
        if field:
            raise _field(hf, field, "float32, bfloat16 or float16")
        raise ValueError(f"from_pretrained: dtype={value!r} is not supported; expected float32, bfloat16 or float16")
    return name


def from_pretrained(path: str, dtype: str | jnp.dtype | None = None, mesh: jax.sharding.Mesh | None = None,
                    quantization: str | None = None, expert_parallel: bool = False) -> Llama | DeepSeek:
    """Loads a local Hugging Face checkpoint directory (``config.json`` and ``*.safetensors``,
    sharded with ``model.safetensors.index.json`` or not) of a model_type of
    ``SUPPORTED_MODEL_TYPES`` into a ``Llama`` (llama, mistral, qwen2, qwen3; the mixtures of
    experts mixtral, qwen2_moe and qwen3_moe) or a ``DeepSeek`` (deepseek_v2, deepseek_v3, YaRN or
    not; the layers past ``num_hidden_layers``, V3's multi-token prediction, are skipped).
    Tensors are read one at a time and converted to ``dtype`` (default: the checkpoint's
    ``torch_dtype``/``dtype``, else bfloat16) on the default device, or with a ``mesh``, each
    placed for tensor parallelism over all the mesh's devices as
    ``jaxattn.serve.models.parallel.shard_model`` places them (one tensor on the default device at a
    time; DeepSeek's MLA replicated); with ``expert_parallel`` too, a mixture of experts' experts
    whole per device (``jaxattn.serve.models.parallel.enable_expert_parallel``).

    FP8: a checkpoint with ``quantization_config.quant_method == "fp8"`` (transformers'
    FineGrainedFP8, vLLM's and DeepSeek-V3's format: float8_e4m3fn weights, ``weight_scale_inv``
    block scales of ``weight_block_size``, or ``weight_scale`` per tensor / per output channel;
    layers in ``modules_to_not_convert`` / ``ignored_layers`` stored unquantized) loads the linears
    ``jaxattn.serve.models.quantization.quantize`` would replace as ``Fp8Linear``s with their scales as
    stored, a mixture's expert stacks as ``Fp8Experts`` with their scales, and dequantizes its other
    FP8 tensors (MLA's kv_b_proj) to ``dtype``;
    activation scales (``input_scale``) are skipped, activations are not quantized.
    ``quantization="fp8"`` quantizes an unquantized checkpoint's linears and expert stacks per
    output channel as they are read (``quantize``'s result, without holding the unquantized model;
    a stack once all its experts are read).

    Raises ValueError naming the config field of an unsupported model (``quantization_config``:
    another ``quant_method``, a bad ``weight_block_size``) or a malformed one (a size that is not an
    int in int32's range, a number that is not finite and positive, a flag that is not true or
    false, a dtype that is not a float type), a ``config.json`` that is not a JSON object, or the
    tensor that is missing, unexpected or of the wrong shape."""
    try:
        from safetensors import safe_open  # the one runtime use of safetensors, an optional dependency
    except ImportError:
        raise ImportError("from_pretrained needs the safetensors package: pip install 'jaxattn[hf]'") from None
    hf = read_config(path)
    fp8 = fp8_format(hf, quantization)
    if expert_parallel and mesh is None:
        raise ValueError("from_pretrained: expert_parallel splits the experts over a mesh: give mesh")
    dtype = _model_dtype(hf, dtype)
    if hf.get("model_type") in DEEPSEEK_MODEL_TYPES:
        cfg = deepseek_config_from_hf(hf, dtype)
        model = nnx.eval_shape(lambda: DeepSeek(cfg, nnx.Rngs(0)))
        if expert_parallel:
            enable_expert_parallel(model, mesh)
        interleaved = hf["model_type"] == "deepseek_v2" or hf.get("rope_interleave", True)
        expected = _deepseek_parameters(model, hf["model_type"], interleaved)
    else:
        cfg = llama_config_from_hf(hf, dtype)
        model = nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0)))
        if expert_parallel:
            enable_expert_parallel(model, mesh)
        expected = _hf_parameters(model, hf["model_type"])
    files = _checkpoint_files(path)
    stored = _stored_tensors(files)
    read_along = _fp8_targets(model, expected, stored, fp8) if fp8 else set()
    stacks: dict[int, list] = {}         # id(variable) -> [host array, experts still to read]
    placement = {}
    if mesh is not None:
        place_experts(model, mesh)
        variables = jax.tree.leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable))
        placement = {id(v): s for v, s in zip(variables, jax.tree.leaves(param_shardings(model, mesh)))}
        for name, target in expected.items():     # FP8 block scales: a count of blocks the shards may not divide
            try:
                placement[id(target.variable)].shard_shape(target.variable.shape)
            except ValueError as error:
                raise ValueError(f"from_pretrained: tensor {name!r} cannot be split over the mesh: {error}") from None

    def put(variable: nnx.Variable, value: jax.Array) -> None:
        variable.set_value(jax.device_put(value, placement[id(variable)]) if placement else value)

    for file in files:
        with safe_open(file, framework="numpy") as tensors:
            for name in tensors.keys():
                if name not in expected:
                    if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_embeddings) \
                            or _past_the_layers(name, cfg.num_layers) or name in read_along:
                        continue
                    raise ValueError(f"from_pretrained: unexpected tensor {name!r} in {file} for {cfg}")
                target = expected.pop(name)
                variable, transposed, expert = target.variable, target.transposed, target.expert
                array = stored[name].read() if stored[name].dtype == "F8_E4M3" else tensors.get_tensor(name)
                if array.shape != (target.stored_shape or target.hf_shape):
                    raise ValueError(f"from_pretrained: tensor {name!r} in {file} has shape {array.shape}, "
                                     f"expected {target.stored_shape or target.hf_shape}")
                array = array.reshape(target.hf_shape)
                if target.scale is not None:     # FP8 that the model keeps in its dtype
                    array = _dequantized(array, stored[target.scale].read(), target.granularity)
                    array = array.astype(variable.dtype)
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
                if target.quantize is not None:  # quantized on load, per output channel
                    if expert is not None:
                        kernel, scale = quantize_stack(array, layout=Fp8Experts.LAYOUT)
                    else:                        # kept as stored, [out, in] (Fp8Linear.LAYOUT)
                        kernel, scale = quantize_kernel(jnp.asarray(array).T)
                        kernel = kernel.T
                    put(variable, kernel)
                    put(target.quantize, scale)
                    continue
                value = jnp.asarray(array, dtype=variable.dtype)
                put(variable, value.T if transposed else value)
    if expected:
        raise ValueError(f"from_pretrained: tensors missing from {path}: {sorted(expected)}")
    return model
