"""The HTTP server's host work on a CPU: the event loop handing the GIL over to the engine thread
once per stream and step (``jaxattn.serve.http.loop.hand_over_gil``) against not doing so.

    python -m benchmarks.bench_server_host [--pairs 3] [--streams 64] [--new-tokens 96]
        [--logprobs-share 0.25] [--json-share 0.25] [--no-tokenizer] [--smoke]

Each run is a Python of its own: a tiny engine (the ``tiny`` preset, one layer, ``xla`` backend,
``streams`` sequences in flight) and the server's app over it in uvicorn, with
``benchmarks.bench_http.synthetic_tokenizer`` at the model's vocabulary (so the server
detokenizes every stream) unless ``--no-tokenizer``; one client process (bench_http's) streams
``streams`` requests at once of 16 prompt tokens and ``new-tokens`` greedy tokens, a
``logprobs-share`` asking for the top 5 logprobs and a ``json-share`` for JSON (structured output:
the engine's host work then sits between each step and its token pick). The engine's steps are
short here (about a millisecond), so the host's share is large: this measures the mechanism, not
a GPU's ratio. Runs alternate handover off / on, the order swapped every pair. Reported per run:
generated tokens/s (from the trace's start, after the client's warm-up, to its last token) and the
event loop thread's CPU time per streamed token; and first the mechanism alone, in this process
(``engine_gil_wait``). Writes the ``--section`` (default server-host) of benchmarks/RESULTS.md
(not with ``--smoke``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.common import write_section
from jaxattn.serve.cli_args import positive_int

SECTION, HEADING = "server-host", "The HTTP server's host work on a CPU (benchmarks/bench_server_host.py)"


def run_server(args: argparse.Namespace) -> dict:
    """(In the run's own process.) Serves the trace once; tokens/s and event-loop CPU per token."""
    import uvicorn

    from benchmarks.bench_http import MODEL_NAME, TraceRequest, run_clients, synthetic_tokenizer
    from jaxattn.serve.engine import Engine
    from jaxattn.serve.http import app as app_module
    from jaxattn.serve.http.process import free_port
    from jaxattn.serve.http.text import TextTokenizer
    from jaxattn.serve.models.llama import random_model
    from jaxattn.serve.structured_output import GrammarCompiler

    model = random_model("tiny", layers=1)
    vocab = model.cfg.vocab_size
    tokenizer = compiler = None
    if not args.no_tokenizer:
        directory = tempfile.mkdtemp()
        synthetic_tokenizer(directory, vocab)
        tokenizer = TextTokenizer(directory)
        compiler = GrammarCompiler(tokenizer.tokenizer.to_str(), vocab_size=vocab, eos_token_ids=())
    engine = Engine(model, max_seqs=args.streams, max_seq_len=16 + args.new_tokens + 16, page_size=16,
                    max_step_tokens=256, backend="xla", max_logprobs=5 if args.logprobs_share > 0 else 0,
                    grammar_compiler=compiler)
    engine.warmup()
    if args.no_handover:
        app_module.hand_over_gil = lambda: None
    app = app_module.build_app(engine, model_name=MODEL_NAME, tokenizer=tokenizer)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    rng = random.Random(0)
    trace = [TraceRequest(0.0, [rng.randrange(256) for _ in range(16)], args.new_tokens,
                          5 if rng.random() < args.logprobs_share else None,
                          tokenizer is not None and rng.random() < args.json_share) for _ in range(args.streams)]
    result = {}

    def clients() -> None:
        while not server.started:
            time.sleep(0.05)
        outputs = run_clients(f"http://127.0.0.1:{port}", trace, 1)     # times from the trace's start
        result["wall_s"] = max(last for _, last, _ in outputs)
        result["tokens"] = sum(len(ids) for _, _, ids in outputs)
        server.should_exit = True

    thread = threading.Thread(target=clients, daemon=True)
    thread.start()
    cpu = time.thread_time()
    server.run()
    cpu = time.thread_time() - cpu
    thread.join()
    result["tokens_per_s"] = result["tokens"] / result["wall_s"]
    result["loop_us_per_token"] = cpu / result["tokens"] * 1e6
    return result


def engine_gil_wait(handover: bool, streams: int = 128, steps: int = 60) -> dict:
    """The engine thread's wait for the GIL while the event loop works through a step's chunks
    (the mechanism alone, in this process): each step the engine thread posts the step before's
    events, then does 10 pieces of host work of 50 us, each after a GIL-free wait of 0.2 ms (a
    launch, a copy back), then waits 12 ms for the device; per event the loop does a stream's
    chunk work (``TextStream`` over the synthetic tokenizer, logprobs for a quarter, the JSON)
    and 30 us of Python for the server's write, calling ``hand_over_gil`` first if ``handover``.
    Returns the median step period and the GIL wait per step (ms)."""
    import asyncio

    from benchmarks.bench_http import synthetic_tokenizer
    from jaxattn.serve.http.logprobs import completion_logprobs
    from jaxattn.serve.http.loop import hand_over_gil
    from jaxattn.serve.http.text import TextStream, TextTokenizer
    from jaxattn.serve.scheduler import TokenLogprobs

    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    directory = tempfile.mkdtemp()
    vocab = synthetic_tokenizer(directory, 128256)
    tokenizer, rng = TextTokenizer(directory), random.Random(0)
    texts = [TextStream(tokenizer, [rng.randrange(vocab) for _ in range(8)]) for _ in range(streams)]

    def chunk(s: int) -> None:
        if handover:
            hand_over_gil()
        token = rng.randrange(vocab)
        texts[s].add([token])
        out = {"text": texts[s].take(), "token_ids": [token]}
        if s % 4 == 0:
            top = tuple((rng.randrange(vocab), -2.0) for _ in range(5))
            out["logprobs"] = completion_logprobs([token], [TokenLogprobs(-1.0, top)], tokenizer.token_text, 0)
        json.dumps(out)
        spin(30e-6)

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    waits, periods, last = [], [], time.perf_counter()
    for _ in range(steps):
        loop.call_soon_threadsafe(lambda: [chunk(s) for s in range(streams)])
        wait = 0.0
        for _ in range(10):
            start = time.perf_counter()
            time.sleep(2e-4)
            wait += time.perf_counter() - start - 2e-4
            spin(50e-6)
        waits.append(wait * 1e3)
        time.sleep(0.012)
        now = time.perf_counter()
        periods.append((now - last) * 1e3)
        last = now
    loop.call_soon_threadsafe(loop.stop)
    return {"period_ms": statistics.median(periods[5:]), "wait_ms": statistics.median(waits[5:])}


def run_once(argv: list[str], handover: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.json")
        flags = [] if handover else ["--no-handover"]
        subprocess.run([sys.executable, "-m", "benchmarks.bench_server_host", *argv, *flags, "--run", path],
                       check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        with open(path) as f:
            return json.load(f)


def share(text: str) -> float:
    """argparse type: a fraction of the requests, in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=positive_int, default=3, help="handover off / on pairs")
    parser.add_argument("--streams", type=positive_int, default=64, help="requests, all in flight at once")
    parser.add_argument("--new-tokens", type=positive_int, default=96, help="greedy tokens per request")
    parser.add_argument("--logprobs-share", type=share, default=0.25)
    parser.add_argument("--json-share", type=share, default=0.25)
    parser.add_argument("--no-tokenizer", action="store_true", help="token ids only (no text, no structured output)")
    parser.add_argument("--section", default=SECTION, help="the RESULTS.md section to write (default: %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="one short pair; RESULTS.md is left alone")
    parser.add_argument("--no-handover", action="store_true", help=argparse.SUPPRESS)   # a run's own flag
    parser.add_argument("--run", metavar="JSON", help=argparse.SUPPRESS)                # a run's subprocess
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.run:
        with open(args.run, "w") as f:
            json.dump(run_server(args), f)
        return
    if args.smoke:
        argv += ["--streams", "4", "--new-tokens", "8", "--pairs", "1", "--no-tokenizer", "--logprobs-share", "0"]
        args = build_parser().parse_args(argv)
    waits = {handover: engine_gil_wait(handover, steps=10 if args.smoke else 60) for handover in (False, True)}
    rows, ratios = [], []
    for pair in range(args.pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        runs = {handover: run_once(argv, handover) for handover in order}
        off, on = runs[False], runs[True]
        ratios.append(on["tokens_per_s"] / off["tokens_per_s"])
        rows.append(f"| {pair + 1} | {'off, on' if order[0] is False else 'on, off'} | {off['tokens_per_s']:,.0f} | "
                    f"{on['tokens_per_s']:,.0f} | {ratios[-1]:.3f}x | {off['loop_us_per_token']:.1f} | "
                    f"{on['loop_us_per_token']:.1f} |")
        print(rows[-1], flush=True)
    trace = "token ids only" if args.no_tokenizer else (
        f"text (synthetic tokenizer), {args.logprobs_share:.0%} asking for the top 5 logprobs, "
        f"{args.json_share:.0%} for JSON")
    text = "\n".join([
        f"Host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; date "
        f"{datetime.date.today()}; Python {platform.python_version()}; tiny preset, 1 layer, xla backend on the CPU.",
        f"Trace: {args.streams} streamed /v1/completions at once, 16 prompt and {args.new_tokens} greedy tokens each, "
        f"{trace}; one client process.",
        f"Command: `python -m benchmarks.bench_server_host {' '.join(argv)}`",
        "",
        "The mechanism alone (`engine_gil_wait`: 128 streams' chunk work on the loop, an engine thread's "
        "10 pieces of host work after GIL-free waits and a 12 ms device wait per step; ideal period 14.5 ms "
        "plus the waits' own wake-up latency):",
        "",
        "| handover | step period ms | engine's GIL wait per step ms |",
        "|---|---|---|",
        *(f"| {'on' if h else 'off'} | {w['period_ms']:.2f} | {w['wait_ms']:.2f} |" for h, w in waits.items()),
        "",
        "The server end to end:",
        "",
        "| pair | order | tok/s, handover off | tok/s, on | on / off | event loop us per token, off | on |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Median on / off: {statistics.median(ratios):.3f}x over {len(ratios)} pairs.",
    ])
    print(write_section(args.section, text, heading=HEADING, update=not args.smoke))


if __name__ == "__main__":
    main()
