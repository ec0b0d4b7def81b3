"""Tile sweep for jaxattn's Triton MLA decode kernel (``jaxattn.kernels.triton_mla``), one device run.

    python -m benchmarks.tune_mla [--fp8] [--quick] [--budget-s 360] [--compile-only]

Points (bf16, latent 512 + RoPE 64, page 64, randomly permuted pool; ``benchmarks.common.mla_inputs``):
B=64 x kv 4096 x Hq 128 (the issue's target), B=128 x kv 4096 x Hq 16 and B=1 x kv 16384 x Hq 128;
``--fp8``: float8_e4m3fn latents at B=256 x kv 1536 x Hq 16 (DeepSeek-V2-Lite's 256-row decode step
in the serving trace), B=128 x kv 4096 x Hq 16 and B=64 x kv 4096 x Hq 128.
Candidates: ``MLAConfig`` tiles (heads per tile, keys per tile, warps, stages; FP8: the dots in bf16
or f16) and KV segment counts for ``mla_config``'s choice, which is always a candidate, and for the
tiles it takes at the run's other points of the same head count. Every candidate is first
compiled for sm_90 in parallel CPU processes (``triton_call._compile`` fills Triton's on-disk
cache, so the timed process only loads), then timed as the GPU time of the decode and reduce
kernels per call (profiler, median of 3 rounds of 20 calls); a candidate whose output is more than
2e-2 (relative) from the xla backend's fails, as do those that do not compile or launch.
``--compile-only`` stops after the compile phase (any machine). Writes the mla-tiles (``--fp8``:
mla-tiles-fp8) section of benchmarks/TUNING.md (``--quick``: only ``$OUT``) and prints it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import multiprocessing
import os
import statistics
import sys
import time

import jax

import jaxattn
from benchmarks.common import (MLA_SCALE, TUNING, MLACase, command_line, device_event_seconds, device_name,
                               mla_inputs, rel_error, utc_now, write_section)
from jaxattn.backends import triton as tb
from jaxattn.backends.base import AttentionParams

SECTION, HEADING = "mla-tiles", "MLA decode tiles (benchmarks/tune_mla.py)"
POINTS = (MLACase(64, 4096, 128), MLACase(128, 4096, 16), MLACase(1, 16384, 128))
FP8_POINTS = (MLACase(256, 1536, 16, fp8=True), MLACase(128, 4096, 16, fp8=True), MLACase(64, 4096, 128, fp8=True))


def rule_config(case: MLACase) -> tb.MLAConfig:
    """``mla_config``'s choice at a point (a decode step: one query token per sequence)."""
    return tb.mla_config(case.batch, case.heads, 512, case.kv_len, 1, fp8=case.fp8)


def candidates(case: MLACase, quick: bool, points: tuple[MLACase, ...] = ()) -> list[tb.MLAConfig]:
    """mla_config's choice first, then the tile grid at its segment count, then segment counts for
    each tile mla_config takes at ``points`` of this head count (so that a tile the rule keeps for
    other batch sizes is timed at this one's segment counts too)."""
    default = rule_config(case)
    if quick:
        return [default, dataclasses.replace(default, num_stages=3)]
    tiles = []
    keys, stages_, f16 = ((32, 64, 128), (2, 3, 4), (False, True)) if case.fp8 else ((16, 32, 64), (1, 2, 3), (False,))
    for block_h, block_n, warps, stages, f16_dots in itertools.product(
            (16,) if case.heads <= 16 else (32, 64), keys, (4, 8), stages_, f16):
        if block_h == 64 and warps == 4:
            continue
        tiles.append(dataclasses.replace(default, block_h=block_h, block_n=block_n, num_warps=warps,
                                         num_stages=stages, f16_dots=f16_dots))
    rule_tiles = dict.fromkeys([default] + [dataclasses.replace(rule_config(p), num_segments=default.num_segments)
                                            for p in points if p.heads == case.heads])
    segments = [dataclasses.replace(tile, num_segments=s, f16_dots=f16_dots) for tile in rule_tiles
                for f16_dots in f16 for s in (1, 2, 4, 8, 16, 32, 64, 128)
                if s * 4 * tile.block_n <= case.kv_len]
    return list(dict.fromkeys([default] + tiles + segments))


PARAMS = AttentionParams(scale=MLA_SCALE, causal=True, sliding_window=None, softcap=None, has_sinks=False)


def _compile_worker(case: MLACase, cfg: tb.MLAConfig) -> str | None:
    """Compiles the launches of one candidate into Triton's cache (CPU process); an error line or None."""
    from jaxattn.kernels.triton_call import _compile
    jax.config.update("jax_platforms", "cpu")
    tb._interpreting = lambda: False                                 # the launches a GPU gets
    try:
        shapes = jax.eval_shape(lambda: (lambda x: (x.q_latent, x.q_rope, x.cache, x.meta))(mla_inputs(case)))
        jaxpr = jax.make_jaxpr(lambda ql, qr, c, m: tb.mla_attention(ql, qr, c, m, PARAMS, config=cfg))(
            *shapes)
        for eqn in (e for e in jaxpr.eqns if e.primitive.name == "jaxattn_triton_call"):
            dtypes = tuple(v.aval.dtype for v in [*eqn.invars, *eqn.outvars])
            _compile(eqn.params["kernel"], dtypes, eqn.params["metaparams"], eqn.params["num_warps"],
                     eqn.params["num_stages"], 90)
        return None
    except Exception as err:  # noqa: BLE001 (a candidate that does not compile is reported)
        return f"{type(err).__name__}: {str(err).splitlines()[0][:100] if str(err) else ''}"


def compile_all(jobs: list[tuple[MLACase, tb.MLAConfig]]) -> dict:
    """{(case, config): error or None}, compiled in parallel processes."""
    context = multiprocessing.get_context("spawn")
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 1))
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        return dict(zip(jobs, pool.map(_compile_worker, *zip(*jobs))))


def kernel_seconds(case: MLACase, cfg: tb.MLAConfig, x, reference: jax.Array) -> tuple[float, float]:
    """(GPU seconds per call, relative error against ``reference``)."""
    fn = jax.jit(lambda ql, qr, c, m: tb.mla_attention(ql, qr, c, m, PARAMS, config=cfg))
    call = lambda: fn(x.q_latent, x.q_rope, x.cache, x.meta)   # noqa: E731
    error = rel_error(call(), reference)
    return statistics.median(sum(device_event_seconds(call, 20).values()) for _ in range(3)), error


def describe(cfg: tb.MLAConfig) -> str:
    return (f"{cfg.block_h} heads x {cfg.block_n} keys, {cfg.num_warps} warps, {cfg.num_stages} stages, "
            f"{cfg.num_segments} segments{', f16 dots' if cfg.f16_dots else ''}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tune_mla", description=__doc__.splitlines()[0])
    parser.add_argument("--fp8", action="store_true", help="FP8 latents (float8_e4m3fn pages with a scale)")
    parser.add_argument("--quick", action="store_true", help="two candidates per point (checks the script)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile the candidates for sm_90 and report failures (any machine, no timing)")
    parser.add_argument("--budget-s", type=float, default=360.0,
                        help="time no new candidate after this (an equal share per point)")
    args = parser.parse_args()
    start = time.time()
    if jax.default_backend() != "gpu" and not args.compile_only:
        sys.exit("tune_mla needs a GPU (or --compile-only)")
    points = FP8_POINTS if args.fp8 else POINTS
    section, heading = (SECTION + "-fp8", "MLA decode tiles over FP8 latents (benchmarks/tune_mla.py --fp8)") \
        if args.fp8 else (SECTION, HEADING)
    jobs = [(case, cfg) for case in points for cfg in candidates(case, args.quick, points)]
    errors = compile_all(jobs)
    if args.compile_only:
        failed = {f"{case} {describe(cfg)}": error for (case, cfg), error in errors.items() if error}
        print(f"{len(jobs)} candidates compiled for sm_90; failed: {failed or 'none'}")
        sys.exit(1 if failed else 0)
    lines = [f"Device: {device_name()}; jax {jax.__version__}; {utc_now()}; "
             f"command: `{command_line()}`; {len(jobs)} candidates "
             f"compiled in {time.time() - start:.0f} s. GPU time per call of the decode and reduce kernels, us; "
             f"first row: mla_config's choice."]
    for i, case in enumerate(points):
        x = mla_inputs(case)
        reference = jax.jit(lambda ql, qr, c, m: jaxattn.mla_paged_attention(
            ql, qr, c, m, scale=MLA_SCALE, backend="xla"))(x.q_latent, x.q_rope, x.cache, x.meta)
        results = []
        for cfg in candidates(case, args.quick, points):
            if time.time() - start > args.budget_s * (i + 1) / len(points):
                break
            error = errors[(case, cfg)]
            if error is None:
                try:
                    sec, error = kernel_seconds(case, cfg, x, reference)
                    results.append((cfg, sec, "") if error < 2e-2 else (cfg, float("inf"), f"rel err {error:.1e}"))
                except Exception as err:  # noqa: BLE001
                    results.append((cfg, float("inf"), f"{type(err).__name__}: {str(err)[:100]}"))
            else:
                results.append((cfg, float("inf"), error))
            jax.clear_caches()
        if not results:
            continue
        default_s = results[0][1]
        lines += ["", f"### {case}: latent {case.latent_bytes / 1e6:.0f} MB", "",
                  "| config | us | vs mla_config | TB/s |", "|---|---|---|---|"]
        for rank, (cfg, sec, error) in enumerate(sorted(results, key=lambda r: r[1])):
            if sec == float("inf"):
                lines.append(f"| {describe(cfg)} | failed: {error} | | |")
            elif rank < 12 or cfg == results[0][0]:
                lines.append(f"| {describe(cfg)}{' (mla_config)' if cfg == results[0][0] else ''} | "
                             f"{sec * 1e6:.1f} | {default_s / sec:.2f}x | {case.latent_bytes / sec / 1e12:.2f} |")
        print("\n".join(lines[-len(results) - 4:]), flush=True)
        write_section(section, "\n".join(lines), heading=heading, path=TUNING, update=False)   # a cut run keeps $OUT's
    print(write_section(section, "\n".join(lines), heading=heading, path=TUNING, update=not args.quick))


if __name__ == "__main__":
    main()
