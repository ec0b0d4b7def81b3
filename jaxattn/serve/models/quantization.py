"""FP8 weights for the reference decoders: ``Fp8Linear``, a drop-in for the ``nnx.Linear`` that
``layers.linear`` builds, holding its kernel in float8_e4m3fn with float32 scales,
``Fp8Experts``, the same for a mixture of experts' stacked weights, and ``quantize``, which swaps
a model's decoder-block linears and expert stacks for them in place (vLLM's
``--quantization fp8``). ``jaxattn.serve.models.from_pretrained`` loads FP8 checkpoints into the same
module.

Scales multiply the stored values (``W = kernel * scale``, what Hugging Face / vLLM / DeepSeek-V3
checkpoints call ``weight_scale`` or ``weight_scale_inv``), at one of three granularities of the
``[in, out]`` kernel: per tensor (a scalar), per output channel (``[out]``), or per block
(``[ceil(in / bi), ceil(out / bo)]`` for blocks of ``bi`` rows and ``bo`` columns; DeepSeek-V3's
``weight_block_size: [128, 128]``)."""

from __future__ import annotations

import math
from typing import Iterator, Literal, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxattn.kernels.fp8_rows import FP8_MAX, quantize_rows
from jaxattn.serve.models import layers
from jaxattn.serve.models.experts import LAYOUTS, Fp8Stack

FP8_DTYPE = jnp.float8_e4m3fn
# "tensor", "channel", or (bi, bo): blocks of bi kernel rows (inputs) by bo columns (outputs)
Granularity = Union[Literal["tensor", "channel"], tuple[int, int]]
METHODS = ("fp8",)
# Linears of the decoder blocks kept in the model's dtype: the MoE router and Qwen2-MoE's shared
# expert gate (read in float32 / tiny, as vLLM keeps them), and MLA's kv_b_proj, whose kernel
# DeepSeek's attention reads directly to absorb it into the queries and outputs (vLLM dequantizes
# it too).
KEPT_LINEARS = ("router", "shared_expert_gate", "kv_b_proj")


def scale_shape(in_features: int, out_features: int, granularity: Granularity) -> tuple[int, ...]:
    """The shape of the scales of an ``[in_features, out_features]`` kernel."""
    if granularity == "tensor":
        return ()
    if granularity == "channel":
        return (out_features,)
    bi, bo = granularity
    return (math.ceil(in_features / bi), math.ceil(out_features / bo))


def expand_scale(scale, shape: tuple[int, int], granularity: Granularity):
    """``scale`` broadcastable against a kernel of ``shape`` (each block's scale repeated over its
    rows and columns). Works on NumPy and JAX arrays alike."""
    if granularity == "tensor":
        return scale
    if granularity == "channel":
        return scale[None, :]
    bi, bo = granularity
    return scale.repeat(bi, axis=0)[:shape[0]].repeat(bo, axis=1)[:, :shape[1]]


def dequantize(kernel, scale, granularity: Granularity):
    """float32 ``kernel * scale`` of an FP8 ``kernel [in, out]`` (NumPy or JAX arrays)."""
    return kernel.astype(np.float32) * expand_scale(scale, kernel.shape, granularity)


def quantize_kernel(kernel: jax.Array, granularity: Granularity = "channel") -> tuple[jax.Array, jax.Array]:
    """``(float8_e4m3fn [in, out], float32 scales)`` of ``kernel [in, out]``: each scale is the
    largest magnitude of its part over ``FP8_MAX`` (1 for an all-zero part), the values rounded to
    nearest."""
    w = jnp.asarray(kernel).astype(jnp.float32)
    if granularity == "tensor":
        amax = jnp.max(jnp.abs(w))
    elif granularity == "channel":
        amax = jnp.max(jnp.abs(w), axis=0)
    else:
        (bi, bo), (rows, cols) = granularity, scale_shape(*w.shape, granularity)
        padded = jnp.pad(jnp.abs(w), ((0, rows * bi - w.shape[0]), (0, cols * bo - w.shape[1])))
        amax = jnp.max(padded.reshape(rows, bi, cols, bo), axis=(1, 3))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    # the clip keeps amax / scale's rounding from leaving the finite range (e4m3fn has no inf)
    q = jnp.clip(w / expand_scale(scale, w.shape, granularity), -FP8_MAX, FP8_MAX)
    return q.astype(FP8_DTYPE), scale


def quantize_stack(stack: jax.Array, granularity: Granularity = "channel",
                   layout: str = "ekn") -> tuple[jax.Array, jax.Array]:
    """``quantize_kernel`` of each kernel of ``stack [E, in, out]`` (``layout`` "ekn"; "enk": each
    kernel transposed, ``[E, out, in]``): ``(float8_e4m3fn values in the stack's layout, float32
    scales [E, ...])``."""
    if layout not in LAYOUTS:
        raise ValueError(f"quantize_stack: layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "enk":
        values, scale = quantize_stack(jnp.swapaxes(jnp.asarray(stack), 1, 2), granularity)
        return jnp.swapaxes(values, 1, 2), scale
    return jax.vmap(lambda w: quantize_kernel(w, granularity))(jnp.asarray(stack))


def _param(value: jax.Array, axes: layers.Axes) -> nnx.Param:
    return nnx.Param(layers.partitioned(lambda: value, axes)())


class Fp8Linear(nnx.Module):
    """``y = x @ (kernel * scale) (+ bias)``: a linear layer whose ``kernel [in, out]`` is
    float8_e4m3fn with float32 ``scale`` per tensor (``[]``), per output channel (``[out]``) or per
    block (``[ceil(in / bi), ceil(out / bo)]`` with ``block_size=(bi, bo)``), and ``bias [out]``
    in the model's dtype.

    The ``kernel`` variable holds the kernel transposed, ``[out, in]`` (``LAYOUT``, as Hugging
    Face stores a linear's weight): FP8 tensor-core GEMMs (cuBLASLt's, which XLA's FP8 dots
    become) read both operands along the contraction, and a kernel stored ``[in, out]`` would be
    transposed on every call. It keeps the logical ``axes`` of the ``nnx.Linear`` it replaces (in
    that order), so tensor parallelism splits it the same way; per-channel scales are split like
    the output columns, block scales like both dimensions (a shard then holds whole blocks when its
    rows and columns are multiples of the block).

    ``activations``: None (weight-only FP8: one dot in ``dtype``) or "fp8" (``set_fp8_activations``;
    W8A8, vLLM's dynamic scheme): each row of ``x`` quantized to FP8 with its own scale
    (``fp8_rows.quantize_rows``), one FP8 x FP8 dot (accumulated in float32, given in
    ``dtype``; float32 for float16), the product times the rows' and the kernel's scales.
    Weight-only, per-tensor and per-channel scales are constant along the contraction, so the FP8
    values are only converted to ``dtype`` (exactly: e4m3 fits bf16), a convert XLA can fuse into
    the GEMM's operand so that the weights are read as FP8, and the scales multiply the product;
    block scales vary along the contraction, so such a kernel is dequantized first (the values
    times their broadcast scales in float32, rounded once to ``dtype``) and takes no FP8
    activations."""

    LAYOUT = "nk"           # the kernel variable's layout: [out, in]
    ACTIVATIONS = (None, "fp8")

    def __init__(self, kernel: jax.Array, scale: jax.Array, bias: jax.Array | None = None, *,
                 block_size: tuple[int, int] | None = None, dtype: str | jnp.dtype = "bfloat16",
                 axes: layers.Axes = (None, None), activations: str | None = None):
        granularity = _granularity("Fp8Linear", kernel, scale, block_size, stacked=False)
        if bias is not None and bias.shape != kernel.shape[1:]:
            raise ValueError(f"Fp8Linear: bias has shape {bias.shape}, expected {kernel.shape[1:]}")
        self.granularity = granularity
        self.dtype = jnp.dtype(dtype)
        self.in_features, self.out_features = kernel.shape
        self.kernel = _param(jnp.swapaxes(kernel, 0, 1), tuple(axes)[::-1])      # LAYOUT
        scale_axes = {"tensor": (), "channel": axes[1:]}[granularity] if isinstance(granularity, str) else axes
        self.scale = _param(jnp.asarray(scale, jnp.float32), scale_axes)
        self.bias = None if bias is None else _param(jnp.asarray(bias, self.dtype), axes[1:])
        if activations not in self.ACTIVATIONS or (activations and not isinstance(granularity, str)):
            raise ValueError(f"Fp8Linear: activations must be one of {self.ACTIVATIONS} (FP8 activations with "
                             f"per-tensor or per-channel scales only), got {activations!r} with {granularity!r} scales")
        self.activations = activations

    @classmethod
    def from_linear(cls, linear: nnx.Linear, granularity: Granularity = "channel") -> "Fp8Linear":
        """``linear`` quantized (``quantize_kernel``), with its bias, dtype and logical axes."""
        kernel, scale = quantize_kernel(linear.kernel[...], granularity)
        spec = tuple(nnx.get_partition_spec(nnx.state(linear))["kernel"].get_value())
        return cls(kernel, scale, None if linear.bias is None else linear.bias[...],
                   block_size=None if isinstance(granularity, str) else granularity,
                   dtype=linear.dtype or linear.param_dtype, axes=spec if len(spec) == 2 else (None, None))

    def values(self) -> jax.Array:
        """The FP8 kernel ``[in, out]`` (the variable holds it transposed)."""
        return jnp.swapaxes(self.kernel[...], 0, 1)

    def weight(self, dtype: str | jnp.dtype | None = None) -> jax.Array:
        """The dequantized kernel ``[in, out]`` in ``dtype`` (default: the layer's)."""
        return dequantize(self.values(), self.scale[...], self.granularity).astype(dtype or self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [..., in]`` -> ``[..., out]`` in the layer's dtype."""
        if self.activations == "fp8":
            values, row_scale = quantize_rows(x.reshape(-1, self.in_features))
            # the product in the layer's dtype (accumulated in float32 inside the GEMM), so tensor
            # parallelism all-reduces its partial sums in that dtype, as the weight-only dot's; not
            # float16, whose largest value (65504) is below one product of two 448s
            product = jnp.float32 if self.dtype == jnp.float16 else self.dtype
            y = jax.lax.dot_general(values, self.kernel[...], (((1,), (1,)), ((), ())), preferred_element_type=product)
            y = (y * row_scale * self.scale[...]).astype(self.dtype).reshape(*x.shape[:-1], self.out_features)
        elif isinstance(self.granularity, str):      # one scale per column: it scales the product
            y = jax.lax.dot_general(x.astype(self.dtype), self.kernel[...].astype(self.dtype),
                                    (((x.ndim - 1,), (1,)), ((), ())))
            y = (y * self.scale[...]).astype(self.dtype)
        else:
            y = jax.lax.dot_general(x.astype(self.dtype), self.weight(), (((x.ndim - 1,), (0,)), ((), ())))
        return y if self.bias is None else y + self.bias[...]


def set_fp8_activations(model: nnx.Module, activations: str | None = "fp8") -> int:
    """Sets ``activations`` (``Fp8Linear.ACTIVATIONS``: "fp8", W8A8; None, weight-only) on every
    ``Fp8Linear`` in ``model`` (a decoder, or one layer) whose scales are per tensor or per output
    channel, in place, before the model is jitted (it is static); returns how many. Block-scaled
    layers stay weight-only (their scales vary along the contraction, which one FP8 dot cannot
    apply). FP8 experts (``Fp8Experts``) already take FP8 rows in the Triton grouped GEMM."""
    if activations not in Fp8Linear.ACTIVATIONS:
        raise ValueError(f"set_fp8_activations: activations must be one of {Fp8Linear.ACTIVATIONS}, got "
                         f"{activations!r}")
    layers_set = [layer for _, layer in nnx.iter_graph(model)
                  if isinstance(layer, Fp8Linear) and isinstance(layer.granularity, str)]
    for layer in layers_set:
        layer.activations = activations
    return len(layers_set)


class Fp8Experts(nnx.Module):
    """A mixture of experts' stack of E kernels ``[E, in, out]`` in float8_e4m3fn with float32
    ``scale`` per expert (``[E]``), per output channel (``[E, out]``) or per block (``[E, ceil(in
    / bi), ceil(out / bo)]`` with ``block_size=(bi, bo)``): the drop-in for a ``layers.MoE``'s
    stacked ``nnx.Param``, on the same logical ``axes`` (scales split like the dimensions they
    cover). ``stack()`` gives the ``experts.Fp8Stack`` that ``routed_experts`` computes with: the
    Triton grouped GEMM reads the FP8 values and scales, "dense" converts the values and scales
    its products (per-expert and per-channel scales), the rest dequantize first.

    The ``kernel`` variable holds each expert's kernel transposed, ``[E, out, in]`` (as Hugging
    Face stores an expert's weight): FP8 tensor-core dots read FP8 operands along the contraction,
    and 8-bit values are not transposed on the way as 16-bit ones are."""

    LAYOUT = "enk"          # the kernel variable's layout (experts.Fp8Stack.layout)

    def __init__(self, kernel: jax.Array, scale: jax.Array, *, block_size: tuple[int, int] | None = None,
                 axes: layers.Axes = (None, None, None)):
        granularity = _granularity("Fp8Experts", kernel, scale, block_size, stacked=True)
        self.block_size = None if isinstance(granularity, str) else granularity
        self.kernel = _param(jnp.swapaxes(kernel, 1, 2), (axes[0], axes[2], axes[1]))     # LAYOUT
        scale_axes = {"tensor": axes[:1], "channel": axes[:1] + axes[2:]}.get(granularity, axes) \
            if isinstance(granularity, str) else axes
        self.scale = _param(jnp.asarray(scale, jnp.float32), scale_axes)

    @classmethod
    def from_stack(cls, stack: jax.Array, axes: layers.Axes, granularity: Granularity = "channel") -> "Fp8Experts":
        """``stack [E, in, out]`` quantized expert by expert (``quantize_kernel``)."""
        kernel, scale = quantize_stack(stack, granularity)
        return cls(kernel, scale, block_size=None if isinstance(granularity, str) else granularity, axes=axes)

    def stack(self) -> Fp8Stack:
        return Fp8Stack(self.kernel[...], self.scale[...], self.block_size, layout=self.LAYOUT)


def _granularity(owner: str, kernel: jax.Array, scale: jax.Array, block_size, stacked: bool) -> Granularity:
    """The granularity of ``scale`` for the FP8 ``kernel`` ``[in, out]`` (``stacked``: ``[E, in,
    out]``, one scale per expert first); ValueError naming ``owner``'s bad argument."""
    lead, dims = (1, "[E, in, out]") if stacked else (0, "[in, out]")
    if kernel.ndim != 2 + lead or kernel.dtype != FP8_DTYPE:
        raise ValueError(f"{owner}: kernel must be a {2 + lead}-D float8_e4m3fn array {dims}, got "
                         f"{kernel.dtype}{list(kernel.shape)}")
    if block_size is not None:
        granularity = _block_size(block_size, f"{owner}: block_size")
    elif scale.ndim - lead in (0, 1):
        granularity = ("tensor", "channel")[scale.ndim - lead]
    else:
        raise ValueError(f"{owner}: scale must be {'[E], [E, out]' if stacked else 'a scalar, [out]'} or, with "
                         f"block_size, {2 + lead}-D; got shape {scale.shape}")
    expected = kernel.shape[:lead] + scale_shape(*kernel.shape[lead:], granularity)
    if scale.shape != expected:
        raise ValueError(f"{owner}: scale has shape {scale.shape}; a kernel {kernel.shape} with "
                         f"{granularity!r} scales needs {expected}")
    return granularity


def _block_size(block_size, name: str) -> tuple[int, int]:
    """``block_size`` (an int b for b x b blocks, or a pair (bi, bo)) as a pair of positive ints."""
    pair = (block_size, block_size) if isinstance(block_size, (int, np.integer)) else block_size
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2
            and all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b >= 1 for b in pair)):
        raise ValueError(f"{name} must be a positive int or a pair of positive ints (rows, columns of the "
                         f"[in, out] kernel), got {block_size!r}")
    return int(pair[0]), int(pair[1])


def linears(model: layers.Decoder) -> Iterator[tuple[nnx.Module, str, nnx.Linear]]:
    """``(owner, attribute, linear)`` of each ``nnx.Linear`` that FP8 quantization replaces: the
    attention projections and the (shared-expert) MLP projections of every decoder block, not
    ``KEPT_LINEARS``; the embedding, LM head and norms are outside the blocks."""
    if not isinstance(model, layers.Decoder):
        raise ValueError(f"quantize: model must be a jaxattn.serve.models decoder (Llama, DeepSeek: a layers.Decoder), "
                         f"got {type(model).__name__}")
    for block in model.layers:
        owners = [block.attn, block.mlp, getattr(block.mlp, "shared_expert", None)]
        for owner in filter(None, owners):
            for name, value in list(vars(owner).items()):
                if isinstance(value, nnx.Linear) and name not in KEPT_LINEARS:
                    yield owner, name, value


def quantize(model: layers.Decoder, method: str = "fp8", *,
             block_size: int | tuple[int, int] | None = None) -> layers.Decoder:
    """Quantizes ``model`` (a ``Llama`` or ``DeepSeek`` in bfloat16 / float32) in place and
    returns it: every linear of ``linears(model)`` becomes an ``Fp8Linear`` with per-output-channel
    scales (``amax / 448``), or with ``block_size`` (an int b: b x b blocks, or ``(bi, bo)`` rows
    and columns of the ``[in, out]`` kernel; note Hugging Face's ``weight_block_size`` lists
    ``[out, in]``) block scales. Activations stay in the model's dtype (weights are dequantized
    into the GEMM), so no activation scales are needed; ``set_fp8_activations`` then quantizes
    the per-channel linears' inputs row by row as they run (W8A8).

    A mixture of experts' stacked weights (``MoE.gate_proj`` / ``up_proj`` / ``down_proj``)
    become ``Fp8Experts`` with the same granularity, each expert scaled on its own. Not quantized:
    the embedding, LM head, norms, MoE routers, Qwen2-MoE's ``shared_expert_gate`` and MLA's
    ``kv_b_proj`` (``KEPT_LINEARS``).

    Quantize before ``shard_model`` (the new variables are then placed with the rest)."""
    if method not in METHODS:
        raise ValueError(f"quantize: method must be one of {METHODS}, got {method!r}")
    granularity: Granularity = "channel" if block_size is None else _block_size(block_size, "quantize: block_size")
    for owner, name, linear in list(linears(model)):
        setattr(owner, name, Fp8Linear.from_linear(linear, granularity))
    for moe, name, stack in list(expert_stacks(model)):
        setattr(moe, name, Fp8Experts.from_stack(stack[...], layers.EXPERT_AXES[name], granularity))
    return model


def expert_stacks(model: layers.Decoder) -> Iterator[tuple[layers.MoE, str, nnx.Param]]:
    """``(moe, attribute, stacked weight)`` of each expert stack FP8 quantization replaces."""
    for block in model.layers:
        if isinstance(block.mlp, layers.MoE):
            for name in layers.EXPERT_AXES:
                if isinstance(getattr(block.mlp, name), nnx.Param):
                    yield block.mlp, name, getattr(block.mlp, name)
