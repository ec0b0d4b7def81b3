"""The Triton grouped GEMM's operand variants side by side at DeepSeek-V2-Lite's expert shapes (one
device run): bf16 and FP8 weights, laid out ``[E, K, N]`` ("ekn") or ``[E, N, K]`` ("enk"), FP8
weights with bf16 rows or with FP8 rows (``quantize_rows``, one scale per row, timed with the
quantization), each at the launch configurations of ``TILES``; prints the fastest per variant.

    python -m benchmarks.grouped_gemm_variants [--tokens 256,2048] [--smoke]

As ``benchmarks.tune_grouped_gemm``: the kernel alone (no routing), the token copies spread evenly
over the experts they touch in the blocks ``routed_experts`` makes (and 128-row blocks from 1,024
tokens), the timed calls cycling through ``ROTATIONS`` placements of the blocks over the experts;
GPU time per call from the profiler, median of 10. Each line: the best configuration's time, the
touched experts' weight bytes over it as a share of the copy rate, the routed FLOPs over it as a
share of the bf16 matmul rate (both measured in the same run), then the next four configurations.
From 1,024 tokens only bf16 "ekn", FP8 "ekn" with bf16 rows and FP8 "enk" with FP8 rows run, at
two configurations. Prints only (benchmarks/TUNING.md, "grouped-gemm-fp8-rows", quotes a run);
``--smoke``: tiny shapes on the CPU.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import copy_bandwidth, device_name, gemm_rate
from benchmarks.tune_grouped_gemm import placements, time_placements
from jaxattn.kernels.grouped_gemm import Tiles, grouped_gemm, quantize_rows
from jaxattn.serve.models.experts import block_rows

TILES = (Tiles(128, 64, 4, 4), Tiles(128, 128, 4, 4), Tiles(64, 128, 4, 4), Tiles(128, 128, 8, 3),
         Tiles(128, 128, 4, 4, swap_ab=True), Tiles(128, 128, 8, 3, swap_ab=True))
LARGE = 1024                # tokens from which fewer variants and configurations run, with 128-row blocks too
LARGE_VARIANTS = ((False, "ekn", False), (True, "ekn", False), (True, "enk", True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grouped_gemm_variants",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="32,256,2048", help="tokens per call, comma-separated")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one configuration (CPU, seconds)")
    args = parser.parse_args(argv)
    experts, k_top, dim, hidden = (8, 2, 64, 32) if args.smoke else (64, 6, 2048, 1408)
    tiles_set = (Tiles(32, 32, 4, 1),) if args.smoke else TILES
    rng = np.random.default_rng(0)
    print(device_name(), flush=True)
    copy = matmul = None
    if not args.smoke:
        copy, matmul = copy_bandwidth(), gemm_rate()
        print(f"copy {copy / 1e12:.2f} TB/s  bf16 matmul {matmul / 1e12:.0f} TFLOP/s", flush=True)
    for tokens in [int(t) for t in args.tokens.split(",")]:
        large = tokens >= LARGE
        rows_per_block = block_rows(tokens, experts, k_top)
        for block_m in sorted({rows_per_block, 128 if large else rows_per_block}):
            turns = placements(tokens, experts, k_top, block_m)
            touched = min(experts, tokens * k_top)
            for k, n, swiglu in ((dim, hidden, True), (hidden, dim, False)):
                rows = jnp.asarray(rng.normal(size=(turns[0].size * block_m, k)), jnp.bfloat16)
                bf16_bytes = touched * k * n * (2 if swiglu else 1) * 2
                flops = 2 * tokens * k_top * k * n * (2 if swiglu else 1)
                for fp8, layout, fp8_rows, stacks, scales in _variants(rng, experts, k, n, swiglu):
                    if large and (fp8, layout, fp8_rows) not in LARGE_VARIANTS:
                        continue
                    times = []
                    for tiles in (tiles_set[::3] if large else tiles_set):
                        def run(r, b, *w, tiles=tiles, layout=layout, fp8_rows=fp8_rows, scales=scales):
                            extra = {}
                            if fp8_rows:
                                r, row_scale = quantize_rows(r)
                                extra = dict(row_scale=row_scale, out_dtype=jnp.bfloat16)
                            return grouped_gemm(r, b, *w, block_m=block_m, tiles=tiles, weight_layout=layout,
                                                **scales, **extra)
                        seconds = time_placements(jax.jit(run), rows, turns, stacks, 10, f"   {tiles}")
                        if seconds is not None:
                            times.append((seconds, tiles))
                    times.sort(key=lambda pair: pair[0])
                    best, tiles = times[0]
                    line = (f"T={tokens:5d} bm={block_m:3d} {'gate+up' if swiglu else 'down   '} "
                            f"{'fp8 ' if fp8 else 'bf16'} {layout} act8={int(fp8_rows)} best {1e6 * best:8.1f} us "
                            f"{tuple(tiles)} ")
                    if copy:
                        line += (f"{bf16_bytes / (2 if fp8 else 1) / best / copy * 100:5.1f}% copy "
                                 f"{flops / best / matmul * 100:5.1f}% mm")
                    line += "  | " + " ".join(f"{tuple(t)[:2]}w{t.num_warps}{' swap' * t.swap_ab}:{1e6 * s:.0f}"
                                              for s, t in times[1:5])
                    print(line, flush=True)


def _variants(rng: np.random.Generator, experts: int, k: int, n: int, swiglu: bool):
    """``(fp8, layout, fp8 rows, weight stacks, scale keywords)`` of each variant at ``K x N``."""
    for fp8 in (False, True):
        dtype, magnitude = (jnp.float8_e4m3fn, 8.0) if fp8 else (jnp.bfloat16, k ** -0.5)
        ekn = [jnp.asarray(rng.normal(size=(experts, k, n)) * magnitude, dtype) for _ in range(1 + swiglu)]
        enk = [jnp.swapaxes(w, 1, 2).copy() for w in ekn]
        scales = {}
        if fp8:
            scale = jnp.full((experts, 1, n), k ** -0.5 / magnitude, jnp.float32)
            scales = dict(scale=scale, scale_block=(k, 1), **({"up_scale": scale} if swiglu else {}))
        for layout, stacks in (("ekn", ekn), ("enk", enk)):
            for fp8_rows in ((False, True) if fp8 else (False,)):
                yield fp8, layout, fp8_rows, stacks, scales


if __name__ == "__main__":
    main()
