"""Tensor-parallel decode step: bench_e2e's jitted engine step (page allocation, KV writes,
attention, all layers) with the model split over N GPUs by heads (``shard_model``), against the
same step on one GPU.

    python -m benchmarks.bench_tp [--gpus 2] [--layers 8] [--batch 64] [--contexts 4096,16384]
                                  [--big-layers 4] [--big-contexts 4096] [--backend auto]
    python -m benchmarks.bench_tp --smoke        # tiny shapes on CPU devices: runs, measures nothing

Cases: Llama-3-8B shapes (``--layers`` layers) at batch ``--batch`` and each context, on 1 and on
``--gpus`` GPUs; then Llama-3-70B shapes (Hq 64, Hkv 8, dim 8192, ffn 28672, ``--big-layers``
layers) at each ``--big-contexts``, on 1 GPU where it fits and on ``--gpus`` GPUs. For each:
  * step time and tokens/s as in bench_e2e (chained decode steps, median of 3 runs);
  * speed-up: tokens/s over the same case on one GPU;
  * all-reduce: the GPU time of the NCCL all-reduce kernels per step and GPU (profile), and its
    share of the step;
  * roofline: the bytes a step must read (bench_e2e's count: weights + KV) over N times one
    GPU's copy bandwidth (bench_e2e's measure), and the step's share of it.
Then attention alone, per shard: ``paged_attention`` on 8B shapes (Hq 32, Hkv 8, D 128, batch
``--batch``, each context) with q and the pools split by heads over the GPUs, against the same call
on one GPU with 1/N of the heads (what each shard computes): GPU time per call and GPU (profile,
median of 3 rounds of 10 calls).
Writes the tp section of benchmarks/RESULTS.md and ``tp.json`` (in $OUT, else benchmarks/out/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import jax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import jaxattn

from benchmarks.common import (Case, copy_bandwidth, device_event_seconds, device_free_bytes, make_inputs, profiled,
                               time_steps, write_json, write_section)
from benchmarks.engine_step import decode_step, fits, step_bytes
from jaxattn.kv_cache import pool_sharding
from jaxattn.serve.models.llama import PRESETS, Llama, LlamaConfig

# The targets: N-GPU / 1-GPU tokens/s by context at batch 64 (8B shapes), share of the roofline.
SPEEDUP_TARGETS = {4096: 1.7, 16384: 1.85}
ROOFLINE_TARGET = 0.75
SHARD_TARGET = 1.05   # sharded attention per GPU / the unsharded call on 1/N of the heads


def all_reduce_seconds(events: dict[str, float]) -> float:
    """The all-reduce kernels' share of ``device_event_seconds``' events (NCCL's
    ``ncclDevKernel_AllReduce_...``, or XLA's own all-reduce kernels)."""
    return sum(s for name, s in events.items() if "allreduce" in name.lower().replace("_", "").replace("-", ""))


def run_case(name: str, model: Llama, mesh: jax.sharding.Mesh | None, backend: str, batch: int, context: int,
             steps: int, bandwidth: float | None) -> dict:
    """One case on ``mesh`` (None: one device): timings, and with a ``bandwidth`` (one device's,
    bytes/s; None on CPU) the profile's all-reduce time and the roofline over all devices."""
    num_devices = 1 if mesh is None else mesh.size
    model_step, state, weights, plan = decode_step(model, backend, batch, context, steps, mesh=mesh)
    for _ in range(3):
        state = jax.block_until_ready(model_step(state))
    step_s, host_s, state = time_steps(model_step, state, steps)
    row = dict(model=name, layers=model.cfg.num_layers, gpus=num_devices, plan=plan, batch=batch,
               context=context, step_ms=step_s * 1e3, host_ms=host_s * 1e3, tokens_per_s=batch / step_s)
    if bandwidth is not None:
        state, events = profiled(model_step, state, steps, measure=device_event_seconds)
        weight_bytes, kv_bytes = step_bytes(model.cfg, weights, batch, context)
        roofline_s = (weight_bytes + kv_bytes) / (num_devices * bandwidth)
        all_reduce_s = all_reduce_seconds(events) / num_devices
        row.update(busy_ms=sum(events.values()) / num_devices * 1e3, all_reduce_ms=all_reduce_s * 1e3,
                   all_reduce_share=all_reduce_s / step_s, roofline_ms=roofline_s * 1e3,
                   roofline_share=roofline_s / step_s)
    del state
    return row


def run_model(name: str, cfg: LlamaConfig, contexts: list[int], mesh: jax.sharding.Mesh, args: argparse.Namespace,
              bandwidth: float | None, free_bytes: float) -> list[dict]:
    """Every context on one device (where the KV fits), then on ``mesh`` (the same weights split)."""
    model = Llama(cfg, nnx.Rngs(0))
    rows = []
    for placement in (None, mesh):        # decode_step fuses the projections for it and places the model
        for context in contexts:
            num_devices = 1 if placement is None else placement.size
            if not fits(cfg, args.batch, context, num_devices * free_bytes):
                print(f"skip {name} on {num_devices} devices, ctx={context}: KV does not fit", flush=True)
                continue
            row = run_case(name, model, placement, args.backend, args.batch, context, args.steps, bandwidth)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def attention_per_shard(cfg: LlamaConfig, mesh: jax.sharding.Mesh, backend: str, batch: int, contexts: list[int],
                        measure: bool) -> list[dict]:
    """``paged_attention`` split by heads over ``mesh`` against one device's call on 1/N of the
    heads, per context: GPU ms per call and GPU (``measure``; else both only run, on CPU).
    The heads are ``cfg``'s; head_dim and page size are the benchmarks' standard (128, 64)."""
    n = mesh.size
    attend = jax.jit(lambda q, c, m: jaxattn.paged_attention(q, c, m, backend=backend))
    rows = []
    for context in contexts:
        full = make_inputs(Case.decode(batch, context), num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads)
        pools = pool_sharding(mesh, "tp", full.cache.layout)
        sharded = (jax.device_put(full.q, NamedSharding(mesh, PartitionSpec(None, "tp", None))),
                   jaxattn.KVCache(jax.device_put(full.cache.k_pages, pools), jax.device_put(full.cache.v_pages, pools)),
                   full.meta)
        del full
        x = make_inputs(Case.decode(batch, context), num_q_heads=cfg.num_q_heads // n, num_kv_heads=cfg.num_kv_heads // n)
        shard = (x.q, x.cache, x.meta)
        row = dict(context=context, batch=batch, gpus=n)
        for key, args, devices in (("sharded_ms", sharded, n), ("shard_heads_ms", shard, 1)):
            jax.block_until_ready(attend(*args))
            if measure:
                row[key] = 1e3 * statistics.median(
                    sum(device_event_seconds(lambda: attend(*args), 10).values()) / devices for _ in range(3))
        if measure:
            row["ratio"] = row["sharded_ms"] / row["shard_heads_ms"]
            print(json.dumps(row), flush=True)
        rows.append(row)
        del sharded, shard, x
    return rows


def attention_table(rows: list[dict], backend: str) -> list[str]:
    lines = ["", f"Attention per shard (backend {backend}, 8B shapes, decode): `paged_attention` split by heads over "
             "the GPUs, GPU time per call and GPU, against one GPU's call on 1/N of the heads (target: within "
             f"{100 * (SHARD_TARGET - 1):.0f}%).", "",
             "| GPUs | batch | context | sharded ms / GPU | one shard's heads ms | ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gpus']} | {r['batch']} | {r['context']} | {r['sharded_ms']:.3f} | "
                     f"{r['shard_heads_ms']:.3f} | {r['ratio']:.3f} |")
    return lines


def write_results(rows: list[dict], header: str, attention: list[str] = ()) -> str:
    one = {(r["model"], r["context"]): r["step_ms"] for r in rows if r["gpus"] == 1}
    lines = [header, "",
             "| model | GPUs | decode plan | batch | context | step ms | tokens/s | vs 1 GPU | all-reduce ms (share) | "
             "busy ms / GPU | roofline ms | % of roofline |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    targets = []
    for r in rows:
        base = one.get((r["model"], r["context"]))
        speedup = base / r["step_ms"] if base else None
        lines.append(f"| {r['model']}, {r['layers']} layers | {r['gpus']} | {r['plan']} | {r['batch']} | "
                     f"{r['context']} | {r['step_ms']:.2f} | {r['tokens_per_s']:,.0f} | "
                     f"{'%.2fx' % speedup if speedup else '-'} | "
                     f"{r['all_reduce_ms']:.2f} ({100 * r['all_reduce_share']:.0f}%) | {r['busy_ms']:.2f} | "
                     f"{r['roofline_ms']:.2f} | {100 * r['roofline_share']:.0f}% |")
        if speedup and r["model"] == "8B shapes" and r["gpus"] > 1 and r["batch"] == 64 \
                and r["context"] in SPEEDUP_TARGETS:
            targets.append(f"- {r['gpus']} GPUs, context {r['context']}: {speedup:.2f}x one GPU's tokens/s (target >= "
                           f"{SPEEDUP_TARGETS[r['context']]}), {100 * r['roofline_share']:.0f}% of the "
                           f"{r['gpus']}-GPU roofline (target >= {100 * ROOFLINE_TARGET:.0f}%); all-reduce "
                           f"{100 * r['all_reduce_share']:.0f}% of the step.")
    lines += ["", "The roofline counts the bytes every GPU together must read (weights once, embedding rows "
              "read only, K/V of every layer once) over the GPUs' summed copy bandwidth; all-reduce is the "
              "NCCL kernels' GPU time per step and GPU, from a profile."]
    if targets:
        lines += ["", "Targets (8B shapes, batch 64):", *targets]
    lines += attention
    return write_section("tp", "\n".join(lines), heading="Tensor parallelism (decode step over several GPUs)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2, help="devices to split the model over")
    parser.add_argument("--layers", type=int, default=8, help="layers of the 8B-shaped model")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--contexts", default="4096,16384", help="contexts of the 8B-shaped model")
    parser.add_argument("--big-layers", type=int, default=4, help="layers of the 70B-shaped model (0: skip it)")
    parser.add_argument("--big-contexts", default="4096", help="contexts of the 70B-shaped model")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on 2 CPU devices, no profile: checks that the benchmark runs")
    args = parser.parse_args(argv)
    if args.smoke:
        # CPU devices must be asked for before JAX starts its CPU backend.
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
        jax.config.update("jax_platforms", "cpu")
        args.gpus, args.batch, args.steps, args.backend = 2, 4, 2, "xla"
    if jax.device_count() < args.gpus:
        sys.exit(f"bench_tp: --gpus {args.gpus} needs as many devices, found {jax.device_count()}")
    start = time.perf_counter()
    mesh = jax.make_mesh((args.gpus,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:args.gpus])
    device = jax.devices()[0]
    if args.smoke:
        models = [("tiny", PRESETS["tiny"].replace(num_layers=1), [64])]
        bandwidth, free = None, float("inf")
    else:
        models = [("8B shapes", PRESETS["llama3-8b"].replace(num_layers=args.layers),
                   [int(c) for c in args.contexts.split(",")])]
        if args.big_layers:
            models.append(("70B shapes", PRESETS["llama3-70b"].replace(num_layers=args.big_layers),
                           [int(c) for c in args.big_contexts.split(",")]))
        bandwidth = copy_bandwidth()
        print(f"{device.device_kind}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write) per GPU", flush=True)
        free = device_free_bytes(device)
    rows = []
    for name, cfg, contexts in models:
        rows += run_model(name, cfg, contexts, mesh, args, bandwidth, free)
    attention = attention_per_shard(models[0][1], mesh, args.backend, args.batch, models[0][2], measure=not args.smoke)
    if args.smoke:
        print(f"bench_tp smoke run: {len(rows)} step cases and {len(attention)} attention cases in "
              f"{time.perf_counter() - start:.0f} s")
        return
    write_json("tp.json", dict(device=device.device_kind, gpus=args.gpus, bandwidth=bandwidth, rows=rows,
                               attention=attention))
    header = (f"Device: {args.gpus} x {device.device_kind}; date {datetime.date.today()}; jax {jax.__version__}; "
              f"bf16, page 64, HND, backend {args.backend}; copy bandwidth {bandwidth / 1e12:.2f} TB/s per GPU "
              f"(read + write), measured in the same run.\n"
              f"Command: `python -m benchmarks.bench_tp --gpus {args.gpus} --layers {args.layers} --batch {args.batch} "
              f"--contexts {args.contexts} --big-layers {args.big_layers} --big-contexts {args.big_contexts} "
              f"--backend {args.backend}`")
    print(write_results(rows, header, attention_table(attention, args.backend)))


if __name__ == "__main__":
    main()
