"""Serving a request trace with a shared system prompt through the Engine, prefix caching off and on.

    python -m benchmarks.bench_serving [--preset llama3-8b] [--layers N] [--requests 128] [--system-len 1024]
                                       [--user-len 32,256] [--new-tokens 128] [--rate 0] [--max-seqs 64]
                                       [--chunk-size 512] [--backend auto] [--smoke]

The trace: ``requests`` prompts, each the same ``system-len`` random tokens followed by a user part
of a length drawn from ``user-len``, ``new-tokens`` greedy tokens each; they arrive all at once
(``--rate 0``) or as a Poisson process of ``rate`` requests/s. Both configurations serve the same
trace on an engine of the same shapes, after a warm-up that compiles both step shapes. Reported:
  * TTFT: arrival to first token (queueing included), mean / p50 / p99;
  * TPOT: (last token - first token) / (tokens - 1) per request, mean / p50;
  * tokens/s: generated tokens over the wall time from the first arrival to the last token, and
    prompt + generated tokens over the same time;
  * prefill tokens: prompt tokens the steps computed (recomputes after preemption included), and
    the share saved by prefix caching; preemptions.
``--smoke`` serves a tiny model on a short trace (seconds on a CPU) and writes only ``$OUT``.
Writes the serving section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import time

import jax
import numpy as np
from flax import nnx

from benchmarks.common import device_name, write_section
from jaxattn.engine import Engine
from jaxattn.models.llama import PRESETS, Llama


def make_trace(rng: np.random.Generator, vocab: int, requests: int, system_len: int, user_len: tuple[int, int],
               rate: float) -> list[tuple[float, np.ndarray]]:
    """(arrival time in s, prompt) per request, in order of arrival."""
    system = rng.integers(0, vocab, size=system_len)
    arrivals = np.cumsum(rng.exponential(1 / rate, size=requests)) if rate > 0 else np.zeros(requests)
    return [(float(t), np.concatenate([system, rng.integers(0, vocab, size=int(rng.integers(*user_len, endpoint=True)))]))
            for t in arrivals]


def serve(engine: Engine, trace: list[tuple[float, np.ndarray]], new_tokens: int) -> dict:
    """Serves ``trace`` in real time; per-request token times and the engine's counters."""
    pending = list(trace)
    first, last, outputs = {}, {}, {}
    arrival = {}
    start = time.perf_counter()

    def admit_arrived() -> None:
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            t, prompt = pending.pop(0)
            request = engine.add_request(prompt, new_tokens)
            arrival[request.id] = start + t
            outputs[request.id] = request

    while pending or engine.has_work:
        admit_arrived()
        if not engine.has_work:
            time.sleep(max(0.0, start + pending[0][0] - time.perf_counter()))
            continue
        for request, _ in engine.stream():
            now = time.perf_counter()
            first.setdefault(request.id, now)
            last[request.id] = now
            admit_arrived()
    wall = max(last.values()) - start
    ttft = [first[i] - arrival[i] for i in outputs]
    tpot = [(last[i] - first[i]) / (len(r.output) - 1) for i, r in outputs.items() if len(r.output) > 1]
    generated = sum(len(r.output) for r in outputs.values())
    stats = engine.stats
    return dict(wall_s=wall, ttft_ms=np.asarray(ttft) * 1e3, tpot_ms=np.asarray(tpot) * 1e3, generated=generated,
                prompt_tokens=stats["prompt_tokens"], cached_tokens=stats["cached_tokens"],
                prefill_tokens=stats["computed_tokens"] - (generated - len(outputs)),
                preemptions=stats["preemptions"], outputs=[outputs[i].output for i in sorted(outputs)])


def row(name: str, result: dict) -> str:
    ttft, tpot = result["ttft_ms"], result["tpot_ms"]
    saved = 1 - result["prefill_tokens"] / result["prompt_tokens"]
    return (f"| {name} | {result['prompt_tokens']:,} | {result['prefill_tokens']:,} ({100 * saved:.0f}% saved) | "
            f"{ttft.mean():.1f} / {np.percentile(ttft, 50):.1f} / {np.percentile(ttft, 99):.1f} | "
            f"{tpot.mean():.2f} / {np.percentile(tpot, 50):.2f} | {result['generated'] / result['wall_s']:,.0f} | "
            f"{(result['prompt_tokens'] + result['generated']) / result['wall_s']:,.0f} | {result['wall_s']:.2f} | "
            f"{result['preemptions']} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_serving", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS), help="model shapes (random weights)")
    parser.add_argument("--layers", type=int, default=None, help="number of layers (default: the preset's)")
    parser.add_argument("--requests", type=int, default=128, help="requests in the trace")
    parser.add_argument("--system-len", type=int, default=1024, help="tokens of the shared system prompt")
    parser.add_argument("--user-len", default="32,256", help="min,max tokens of each request's own part")
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per request")
    parser.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at once)")
    parser.add_argument("--max-seqs", type=int, default=64, help="sequences in flight")
    parser.add_argument("--chunk-size", type=int, default=512, help="prefill tokens per step")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--backend", default="auto", help="paged_attention backend")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and trace (CPU, seconds); RESULTS.md "
                                                              "is left alone")
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.layers, args.requests, args.system_len, args.user_len = "tiny", None, 12, 40, "2,12"
        args.new_tokens, args.max_seqs, args.chunk_size, args.page_size = 8, 4, 32, 8
    user_len = tuple(int(x) for x in args.user_len.split(","))
    cfg = PRESETS[args.preset]
    if args.layers is not None:
        cfg = cfg.replace(num_layers=args.layers)
    model = Llama(cfg, nnx.Rngs(0))
    trace = make_trace(np.random.default_rng(0), cfg.vocab_size, args.requests, args.system_len, user_len, args.rate)
    max_seq_len = args.system_len + user_len[1] + args.new_tokens

    def make_engine(prefix_caching: bool) -> Engine:
        return Engine(model, max_seqs=args.max_seqs, max_seq_len=max_seq_len, page_size=args.page_size,
                      chunk_size=args.chunk_size, backend=args.backend, enable_prefix_caching=prefix_caching)

    warmup = make_engine(False)                  # compiles both step shapes (shared by engines of these shapes)
    for prompt in (trace[0][1], trace[0][1][:5]):
        warmup.add_request(prompt, 2)
    warmup.run()
    del warmup

    results = {}
    for prefix_caching in (False, True):
        results[prefix_caching] = serve(make_engine(prefix_caching), trace, args.new_tokens)
        print(row(f"prefix caching {'on' if prefix_caching else 'off'}", results[prefix_caching]), flush=True)
    same = sum(a == b for a, b in zip(results[False]["outputs"], results[True]["outputs"]))
    arrivals = "all at once" if args.rate <= 0 else f"Poisson, {args.rate:g} requests/s"
    lines = [
        f"Device: {device_name()}; date {datetime.date.today()}; jax {jax.__version__}; model {args.preset} shapes "
        f"with {cfg.num_layers} layers, {cfg.dtype}, random weights; backend {args.backend}; {args.max_seqs} "
        f"sequences in flight, prefill chunk {args.chunk_size}, page {args.page_size}.",
        f"Trace: {args.requests} requests ({arrivals}), a shared {args.system_len}-token system prompt + "
        f"{user_len[0]}..{user_len[1]} own tokens each, {args.new_tokens} greedy tokens each.",
        f"Command: `python -m benchmarks.bench_serving --preset {args.preset} --layers {cfg.num_layers} "
        f"--requests {args.requests} --system-len {args.system_len} --user-len {args.user_len} --new-tokens "
        f"{args.new_tokens} --rate {args.rate:g} --max-seqs {args.max_seqs} --chunk-size {args.chunk_size} "
        f"--backend {args.backend}`",
        "",
        "| prefix caching | prompt tokens | prefill tokens computed | TTFT ms mean / p50 / p99 | TPOT ms mean / p50 "
        "| generated tokens/s | total tokens/s | wall s | preemptions |",
        "|---|---|---|---|---|---|---|---|---|",
        row("off", results[False]),
        row("on", results[True]),
        "",
        f"Requests whose tokens are the same with prefix caching on and off: {same}/{args.requests} (bf16 on the "
        f"GPU: a prefill that starts after cached pages rounds differently, and greedy tokens may part after a "
        f"near tie).",
    ]
    print(write_section("serving", "\n".join(lines), heading="Serving a trace with a shared system prompt",
                        update=not args.smoke))


if __name__ == "__main__":
    main()
