"""EasyDeL's eSurge (a JAX serving engine; ejkernel's Triton attention on a GPU) served on
``bench_serving``'s traces and model shapes: issue 37's JAX engine side by side. Run it in the same
device call as ``python -m benchmarks.bench_serving`` on the same trace, after it (the two engines
do not share the GPU's memory); given that run's section (``--against``, by default
``$OUT/<section>_results.md``, which bench_serving writes), the table puts jaxattn's row beside
eSurge's with the ratio of generated tokens/s.

    scripts/fetch_esurge_wheels.sh                   # easydel 0.3.0 + what its import reaches
    pip install --no-deps --target /tmp/site_esurge .whl_esurge/*.whl
    python3 -m benchmarks.bench_serving --trace chat --max-seqs 156 --max-step-tokens 2048
    PYTHONPATH=/tmp/site_esurge:benchmarks/esurge_stubs:$PWD \\
        python3 -m benchmarks.bench_esurge --trace chat --max-seqs 156 --max-step-tokens 2048

The same requests as bench_serving's (``make_trace``, seed 0: random prompt tokens, greedy, every
request runs to its output length with ``ignore_eos``), all at once; the same model shapes with
random bf16 weights (eSurge's own Llama), sequences in flight, tokens per step and page size.
eSurge sizes its KV pool from ``--hbm-utilization``; prefix caching is on for shared-prefix only,
as in bench_serving's "on" row. Requests go in as token ids with their own output lengths through
the calls ``eSurge.generate`` makes (easydel 0.3.0, inference/esurge/mixins/io.py), since
``generate`` takes one ``SamplingParams`` for all prompts. TTFT and TPOT are eSurge's own per-request
times (``first_token_time`` and ``processing_time`` from the request's admission); eSurge exposes no
step records, so there is no roofline column: the ratio against jaxattn's row is the figure.
What easydel needs beyond its wheels: ``benchmarks/esurge_smoke.py``'s docstring.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import tempfile
import time
from collections.abc import Sequence

os.environ.setdefault("ENABLE_DISTRIBUTED_INIT", "0")
os.environ.setdefault("EASYDEL_AUTO", "0")

import numpy as np  # noqa: E402

from benchmarks.bench_serving import (HEADINGS, SECTIONS, SMOKE, SPECS, TraceRequest, describe, make_trace,  # noqa: E402
                                      percentiles)
from benchmarks.common import device_name, write_section  # noqa: E402
from benchmarks.esurge_smoke import patch_easydel, tokenizer  # noqa: E402
from jaxattn.serve.models.llama import PRESETS, LlamaConfig  # noqa: E402

TRACES = ("decode-heavy", "chat", "shared-prefix", "throughput")
COLUMNS = ("engine | trace shape | requests | generated tokens | wall s | generated tokens/s | vs jaxattn | "
           "TTFT ms p50 / p90 / p99 | TPOT ms p50 / p90 / p99")
PRESETS_SERVED = sorted(name for name, cfg in PRESETS.items() if not cfg.num_experts)


@dataclasses.dataclass(frozen=True)
class Served:
    """What a trace took: wall seconds from the first request's admission to the last one's end,
    tokens, and per-request TTFT / TPOT in ms."""
    wall_s: float
    prompt_tokens: int
    generated: int
    short: int                   # requests that ended before their output length
    ttft_ms: np.ndarray
    tpot_ms: np.ndarray


def esurge_model(cfg: LlamaConfig, max_len: int, attention: str | None = None):
    """eSurge's Llama with ``cfg``'s shapes (a jaxattn preset), random weights in ``cfg.dtype``;
    ``attention``: its ``attn_mechanism`` (None: eSurge's choice for the platform)."""
    import easydel as ed
    import jax.numpy as jnp
    from flax import nnx

    dtype = jnp.dtype(cfg.dtype)
    config = ed.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim,
                            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_q_heads,
                            num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
                            rms_norm_eps=cfg.norm_eps, max_position_embeddings=max_len,
                            tie_word_embeddings=cfg.tie_embeddings, eos_token_id=cfg.vocab_size - 1,
                            pad_token_id=cfg.vocab_size - 2, bos_token_id=1, kvdtype=dtype,
                            **({"attn_mechanism": attention} if attention else {}))
    return ed.LlamaForCausalLM(config=config, dtype=dtype, param_dtype=dtype, precision=None, rngs=nnx.Rngs(0))


def serve(engine, trace: Sequence[TraceRequest]) -> Served:
    """Serves ``trace`` (all at once) on a warmed-up ``engine``; waits for every request to end."""
    from easydel.inference import SamplingParams

    admitted = {}
    start = time.perf_counter()
    for i, item in enumerate(trace):
        rid = f"trace-{i}"
        ids = item.prompt.tolist()
        text = " ".join(f"t{t}" for t in ids)
        params = engine._prepare_sampling_params_for_request(
            SamplingParams(max_tokens=item.new_tokens, temperature=0.0, top_k=1, ignore_eos=True),
            request_id=rid, prompt=text)
        admitted[rid] = time.perf_counter()
        engine._add_request(rid, text, params, prompt_token_ids=ids)
    engine._ensure_scheduler_running(context="bench_esurge")
    outputs = {}
    while len(outputs) < len(trace):
        engine._output_event.wait(timeout=0.1)
        engine._output_event.clear()
        engine._raise_if_scheduler_failed()
        with engine._output_lock:
            for rid, output in engine._request_outputs.items():
                if rid in admitted and rid not in outputs and output.finished:
                    outputs[rid] = output
    ends = [admitted[rid] + out.processing_time for rid, out in outputs.items()]
    generated = {rid: len(out.outputs[0].token_ids) for rid, out in outputs.items()}
    wanted = {f"trace-{i}": item.new_tokens for i, item in enumerate(trace)}
    tpot = [(out.processing_time - out.first_token_time) / (generated[rid] - 1)
            for rid, out in outputs.items() if generated[rid] > 1 and out.first_token_time is not None]
    return Served(wall_s=max(ends) - start, prompt_tokens=sum(r.prompt.size for r in trace),
                  generated=sum(generated.values()), short=sum(generated[rid] < wanted[rid] for rid in outputs),
                  ttft_ms=np.array([out.first_token_time for out in outputs.values()
                                    if out.first_token_time is not None]) * 1e3,
                  tpot_ms=np.array(tpot) * 1e3)


def jaxattn_row(path: str, label: str | None = None) -> tuple[str, dict[str, str]] | None:
    """From a bench_serving section (``path``): its header line (device, date) and its first row
    (or the row whose first cell is ``label``) by column; None when the file is missing or has no
    such row."""
    if not os.path.exists(path):
        return None
    lines = open(path).read().splitlines()
    header = next((line for line in lines if line.startswith("Device:")), "")
    table = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
    if not table or "generated tokens/s" not in table[0]:
        return None
    found = [cells for cells in table[1:] if len(cells) == len(table[0]) and (label is None or cells[0] == label)]
    return (header, dict(zip(table[0], found[0]))) if found else None


def row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_esurge", description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True, choices=TRACES)
    parser.add_argument("--preset", default="llama3-8b", choices=PRESETS_SERVED, help="model shapes (random weights)")
    parser.add_argument("--layers", type=int, default=None, help="number of layers (default: the preset's)")
    parser.add_argument("--requests", type=int, default=None, help="requests in the trace (default: the trace's)")
    parser.add_argument("--max-seqs", type=int, default=156,
                        help="sequences in flight (default: what jaxattn's Engine took for Llama-3-8B on an H100)")
    parser.add_argument("--max-step-tokens", type=int, default=2048, help="tokens per step")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--hbm-utilization", type=float, default=0.85, help="eSurge's share of GPU memory")
    parser.add_argument("--attention", default=None,
                        help="eSurge's attn_mechanism (default: its own choice, unified_attention on a GPU)")
    parser.add_argument("--against", default=None, metavar="PATH",
                        help="bench_serving's section of the same trace from this run (default: "
                             "$OUT/<section>_results.md)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and trace (CPU, about a minute); "
                                                              "RESULTS.md is left alone")
    args = parser.parse_args(argv)

    import jax

    spec = (SMOKE if args.smoke else SPECS)[args.trace]
    cfg = PRESETS["tiny" if args.smoke else args.preset]
    if args.smoke:
        args.page_size, args.max_seqs, args.max_step_tokens = 8, 4, 32
    if args.layers is not None:
        cfg = cfg.replace(num_layers=args.layers)
    args.requests = args.requests or spec.requests
    spec = dataclasses.replace(spec, requests=args.requests)
    trace = make_trace(args.trace, spec, cfg.vocab_size)
    longest = max(r.prompt.size + r.new_tokens for r in trace)
    max_len = -(-longest // args.page_size) * args.page_size

    from easydel.inference.esurge import eSurge

    patch_easydel()
    started = time.perf_counter()
    model = esurge_model(cfg, max_len, args.attention)
    engine = eSurge(model=model, processor=tokenizer(tempfile.mkdtemp(), cfg.vocab_size), dtype=model.dtype,
                    max_model_len=max_len, max_num_seqs=args.max_seqs, max_num_batched_tokens=args.max_step_tokens,
                    page_size=args.page_size, hbm_utilization=args.hbm_utilization,
                    enable_prefix_caching=args.trace == "shared-prefix", reserve_tokens=0, silent_mode=True,
                    esurge_name="jaxattn-peer")
    attention = engine.runner.model.config.attn_mechanism
    warm = make_trace(args.trace, dataclasses.replace(spec, requests=min(args.requests, args.max_seqs)),
                      cfg.vocab_size, seed=1)
    serve(engine, [dataclasses.replace(r, new_tokens=min(r.new_tokens, 8)) for r in warm])   # the rest compiles
    warmup_s = time.perf_counter() - started
    print(f"eSurge on {jax.default_backend()} ({attention}): built, compiled and warmed up in {warmup_s:.0f} s; "
          f"serving {len(trace)} requests", file=sys.stderr, flush=True)
    served = serve(engine, trace)
    engine.terminate()

    shape = describe(args.trace, trace, spec)
    section, heading = SECTIONS[args.trace], HEADINGS[args.trace]
    against = args.against or os.path.join(os.environ.get("OUT", ""), f"{section}_results.md")
    ours = jaxattn_row(against, "on" if args.trace == "shared-prefix" else None)   # bench_serving's caching-on row
    import easydel

    tokens_per_s = served.generated / served.wall_s
    theirs = float(ours[1]["generated tokens/s"].replace(",", "")) if ours else None
    rows = [row(f"eSurge (easydel {easydel.__version__})", shape, f"{len(trace):,}", f"{served.generated:,}",
                f"{served.wall_s:.2f}", f"{tokens_per_s:,.0f}", f"{tokens_per_s / theirs:.2f}x" if ours else "-",
                percentiles(served.ttft_ms, 1), percentiles(served.tpot_ms, 2))]
    if ours:
        cells = [ours[1].get(column, "-") for column in COLUMNS.split(" | ")]
        rows.append(row("jaxattn (bench_serving's row)", shape, *cells[2:6], "1.00x", *cells[7:]))
    lines = [
        f"Device: {device_name()}; date {datetime.date.today()}; jax {jax.__version__}; easydel "
        f"{easydel.__version__}; model {args.preset if not args.smoke else 'tiny'} shapes with {cfg.num_layers} "
        f"layers, {cfg.dtype}, random weights (eSurge's Llama); attention {attention}; {args.max_seqs} sequences "
        f"in flight, {args.max_step_tokens} tokens per step, pages of {args.page_size}, hbm_utilization "
        f"{args.hbm_utilization}, prefix caching {'on' if args.trace == 'shared-prefix' else 'off'}; built, compiled "
        f"and warmed up in {warmup_s:.0f} s, not timed.",
        f"Trace ({args.trace}, seed 0): {len(trace)} requests, {shape}; random prompt tokens, greedy, ignore_eos, "
        f"all at once: bench_serving's requests.",
        f"Command: `python -m benchmarks.bench_esurge --trace {args.trace} --preset {args.preset} --layers "
        f"{cfg.num_layers} --requests {args.requests} --max-seqs {args.max_seqs} --max-step-tokens "
        f"{args.max_step_tokens} --page-size {args.page_size} --hbm-utilization {args.hbm_utilization}"
        + (f" --attention {args.attention}" if args.attention else "") + (" --smoke" if args.smoke else "") + "`",
        "",
        "| " + COLUMNS + " |",
        "|" + "---|" * len(COLUMNS.split(" | ")),
        *rows,
        "",
        (f"jaxattn's row: {against} ({ours[0][:160]})." if ours else
         f"No jaxattn row beside it: {against} is missing or has no table (run bench_serving first, same call)."),
    ]
    if served.short:
        lines += ["", f"{served.short} requests ended before their output length (eSurge capped them)."]
    print(write_section(f"esurge_{section}", "\n".join(lines), heading=f"{heading}: EasyDeL eSurge",
                        update=not args.smoke))


if __name__ == "__main__":
    main()
