"""FP8 linears against the bf16 one at a model's projection shapes: ``Fp8Linear`` weight-only
(its default: the FP8 kernel converted into a bf16 dot) and W8A8 (``activations="fp8"``: rows
quantized per row, an FP8 x FP8 dot), at decode and prefill row counts.

    python -m benchmarks.bench_fp8_linear [--preset llama3-8b|deepseek-v2-lite|...] [--rows 64,128,256,2048,8192]
        [--trials 20] [--smoke]

The cases are one decoder block's projections as the Engine runs them (``fusion``): a Llama's
q/k/v fused, o, gate/up fused and down; DeepSeek-V2-Lite's q_proj and kv_a_proj fused (MLA's
kv_b_proj stays bf16), o, the shared experts' gate/up and down, and the dense first layer's.
Random bf16 kernels quantized per output channel; each is one jitted call on ``x [rows, in]``
(the W8A8 call includes quantizing the rows), timed as GPU time per call from the profiler
(``common.device_seconds``), the calls cycling through ``COPIES`` copies of the weights so that
none finds its weights in L2 (an H100's 50 MB holds a 4096 x 6144 FP8 kernel).
Columns: microseconds per call, the speed-up over bf16 in the same run, and each variant's
bytes (weights, rows in, rows out) over its time as a share of the copy rate (read + write,
measured in the same run), the decode rows' bound; its FLOPs over the bf16 matmul rate at prefill
rows (an H100's FP8 peak is twice bf16's). The kernels XLA ran for W8A8 (their names: cuBLASLt's
FP8 GEMM or a Triton fusion) are listed below the table. Writes the ``fp8_linear_<preset>``
section of RESULTS.md (``--smoke``: the tiny preset on the CPU, wall time, only ``$OUT``).
"""

from __future__ import annotations

import argparse
import itertools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import (command_line, copy_bandwidth, device_events, device_name, device_seconds, gemm_rate,
                               utc_now, write_section)
from jaxattn.serve.models import layers
from jaxattn.serve.models.deepseek import PRESETS as DEEPSEEK_PRESETS
from jaxattn.serve.models.deepseek import DeepSeekConfig
from jaxattn.serve.models.llama import PRESETS, LlamaConfig
from jaxattn.serve.models.quantization import Fp8Linear, set_fp8_activations

COPIES = 4                  # weight copies the timed calls cycle through
VARIANTS = ("bf16", "fp8 weight-only", "fp8 w8a8")


def projections(cfg: LlamaConfig | DeepSeekConfig) -> dict[str, tuple[int, int]]:
    """``{name: (in, out)}`` of a decoder block's linears as the Engine fuses them."""
    if isinstance(cfg, DeepSeekConfig):           # no q_lora_rank (V2-Lite): q_proj and kv_a_proj fused
        q = cfg.num_q_heads * (cfg.qk_nope_dim + cfg.qk_rope_dim)
        return {"qkv_a": (cfg.dim, q + cfg.kv_lora_rank + cfg.qk_rope_dim), "o": (cfg.num_q_heads * cfg.v_head_dim,
                cfg.dim), "shared gate_up": (cfg.dim, 2 * cfg.shared_expert_dim),
                "shared down": (cfg.shared_expert_dim, cfg.dim), "dense gate_up": (cfg.dim, 2 * cfg.hidden_dim),
                "dense down": (cfg.hidden_dim, cfg.dim)}
    q, kv = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (cfg.dim, q + 2 * kv), "o": (q, cfg.dim), "gate_up": (cfg.dim, 2 * cfg.hidden_dim),
            "down": (cfg.hidden_dim, cfg.dim)}


def make_layer(cfg: LlamaConfig | DeepSeekConfig, shape: tuple[int, int], variant: str, seed: int) -> nnx.Module:
    linear = layers.linear(cfg, *shape, nnx.Rngs(seed), (None, None))
    if variant == "bf16":
        return linear
    layer = Fp8Linear.from_linear(linear)
    set_fp8_activations(layer, "fp8" if variant == "fp8 w8a8" else None)
    return layer


def cycled_call(cfg: LlamaConfig | DeepSeekConfig, shape: tuple[int, int], variant: str,
                x: jax.Array) -> Callable[[], jax.Array]:
    """A call of the variant's layer on ``x``, each call on the next of ``COPIES`` weight copies."""
    graphdefs, states = zip(*(nnx.split(make_layer(cfg, shape, variant, seed)) for seed in range(COPIES)))
    apply = jax.jit(lambda state, x: nnx.merge(graphdefs[0], state)(x))
    jax.block_until_ready([apply(state, x) for state in states])
    turns = itertools.cycle(states)
    return lambda: apply(next(turns), x)


def nbytes(shape: tuple[int, int], rows: int, variant: str) -> int:
    """Bytes a call reads and writes at least: the kernel, the rows in and out (bf16)."""
    return shape[0] * shape[1] * (2 if variant == "bf16" else 1) + 2 * rows * (shape[0] + shape[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_fp8_linear", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b", choices=sorted([*PRESETS, "deepseek-v2-lite"]))
    parser.add_argument("--rows", default="64,128,256,2048,8192", help="rows per call (tokens of a step)")
    parser.add_argument("--trials", type=int, default=20, help="calls timed per case")
    parser.add_argument("--smoke", action="store_true", help="the tiny preset, 16 and 64 rows, on the CPU")
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.rows, args.trials = "tiny", "16,64", 3
    cfg = (DEEPSEEK_PRESETS["v2-lite-moe"] if args.preset == "deepseek-v2-lite" else PRESETS[args.preset]).replace(
        dtype="bfloat16")
    row_counts = [int(r) for r in args.rows.split(",")]
    copy_rate = copy_bandwidth(1 << 24, trials=3) if args.smoke else copy_bandwidth()
    matmul_rate = gemm_rate(256, trials=3) if args.smoke else gemm_rate()
    print(f"copy rate {copy_rate / 1e9:,.0f} GB/s, matmul rate {matmul_rate / 1e12:.3g} TFLOP/s", flush=True)
    lines = [f"Device: {device_name()}; {utc_now()}; jax {jax.__version__}; {args.preset} projections "
             f"(q/k/v and gate/up fused), random kernels, FP8 per output channel; {COPIES} weight copies cycled; "
             f"copy rate {copy_rate / 1e9:,.0f} GB/s (read + write), bf16 matmul rate "
             f"{matmul_rate / 1e12:.3g} TFLOP/s, measured in the same run.",
             f"Command: `{command_line()}`", "",
             "| linear (in x out) | rows | " + " | ".join(f"{v} us" for v in VARIANTS)
             + " | weight-only / bf16 | w8a8 / bf16 | w8a8 / weight-only | % copy rate (bf16, wo, w8a8) "
             "| % bf16 matmul rate (bf16, wo, w8a8) |",
             "|---|---|" + "---|" * (len(VARIANTS) + 5)]
    kernels = {}
    for (name, shape), rows in itertools.product(projections(cfg).items(), row_counts):
        x = jax.random.normal(jax.random.key(rows), (rows, shape[0]), jnp.bfloat16)
        calls = {variant: cycled_call(cfg, shape, variant, x) for variant in VARIANTS}
        us = {variant: device_seconds(call, args.trials) * 1e6 for variant, call in calls.items()}
        if jax.default_backend() == "gpu":
            events = device_events(calls["fp8 w8a8"], args.trials)
            kernels[(name, rows)] = max(events, key=lambda event: events[event][0])
        copy = ", ".join(f"{100 * nbytes(shape, rows, v) / (us[v] * 1e-6) / copy_rate:.0f}" for v in VARIANTS)
        flops = ", ".join(f"{100 * 2 * rows * shape[0] * shape[1] / (us[v] * 1e-6) / matmul_rate:.0f}"
                          for v in VARIANTS)
        lines.append(f"| {name} ({shape[0]} x {shape[1]}) | {rows} | "
                     + " | ".join(f"{us[v]:.1f}" for v in VARIANTS)
                     + f" | {us['bf16'] / us['fp8 weight-only']:.2f}x | {us['bf16'] / us['fp8 w8a8']:.2f}x | "
                     f"{us['fp8 weight-only'] / us['fp8 w8a8']:.2f}x | {copy} | {flops} |")
        print(lines[-1], flush=True)
    if kernels:
        lines += ["", "The W8A8 call's longest kernel per case: "
                  + "; ".join(f"{name} at {rows} rows `{kernel}`" for (name, rows), kernel in kernels.items()) + "."]
    print(write_section(f"fp8_linear_{args.preset}", "\n".join(lines),
                        heading=f"FP8 linears (benchmarks/bench_fp8_linear.py): {args.preset}", update=not args.smoke))


if __name__ == "__main__":
    main()
