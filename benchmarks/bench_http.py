"""HTTP serving (``python -m jaxattn.serve``) against the in-process Engine: the same trace, the
same engine settings.

    python -m benchmarks.bench_http [--preset llama3-8b] [--layers N] [--requests 512] [--prompt-len 256]
        [--new-tokens 128] [--rate 0] [--max-seqs 128] [--max-seq-len 2048] [--max-step-tokens N]
        [--num-pages N] [--page-size 64] [--backend auto] [--clients 4] [--logprobs-share 0]
        [--top-logprobs 5] [--json-share 0] [--engine-modes process] [--repeats 1] [--section http] [--smoke]

The trace (random weights and prompts, seed 0): ``requests`` prompts of lognormal lengths (sigma 1,
mean ``prompt-len`` before clipping to [4, 4 x prompt-len]), ``new-tokens`` greedy tokens each,
all at once (``--rate 0``) or as a Poisson process of ``rate`` requests/s; a ``logprobs-share`` of
them (drawn with seed 1) ask for logprobs with ``top-logprobs`` alternatives, and a ``json-share``
(drawn with seed 2) for JSON output of ``JSON_SCHEMA`` (structured output; both runs then have a
synthetic tokenizer of the preset's vocabulary: ``synthetic_tokenizer``). Two runs, each in a
process of its own (the device holds one engine at a time), both after the engine's warm-up:
  * engine: this module in a subprocess serves the trace through ``Engine.step_events``, arrival
    to token on the host;
  * http, once per ``--engine-modes`` entry (``process``: the server's default, the engine in a
    process of its own; ``thread``: ``--engine-in-thread``): ``python -m jaxattn.serve --preset ...``
    with the same engine arguments, and ``clients``
    processes as its clients over loopback (the trace dealt round-robin; one asyncio httpx process
    reads only about 7k streamed tokens/s on a 2-core CPU): one streamed ``/v1/completions``
    request of token ids per trace request at its arrival time, all processes timed from one start
    on ``time.monotonic()`` (the host's one clock), tokens read from the stream
    (``return_token_ids``), after one request per process that warms the server's and the
    client's code paths up.
With ``--repeats R`` each run serves the trace R times in turn (one engine, one server start),
each repeat with other prompt tokens of the same lengths (``make_trace``), and reports its median
repeat; the ratio is the median of the repeats' ratios (run-to-run spread is a few percent).
Reported per run: generated tokens/s (over the wall time from the first arrival to the last
token), TTFT (arrival to first token) and TPOT ((last - first token) / (tokens - 1), per request)
p50 / p90 / p99; the HTTP / engine tokens/s ratio, and how many requests got the same tokens in
both. ``--smoke`` serves a tiny model on a tiny trace (seconds on a CPU) and writes only ``$OUT``.
Writes the ``--section`` section (default http) of benchmarks/RESULTS.md. This process never
touches the device.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import numpy as np

from benchmarks.bench_serving import lognormal_lengths, percentiles
from benchmarks.common import write_section
from jaxattn.serve.cli_args import positive_int
from jaxattn.serve.http.process import free_port, wait_healthy

HEADING = "HTTP serving vs the in-process engine (benchmarks/bench_http.py)"
# --engine-modes: where the server runs its engine, as python -m jaxattn.serve flags, and as the report says it
ENGINE_MODES = {"process": ([], "engine in a process of its own"),
                "thread": (["--engine-in-thread"], "engine in a thread of the server")}
# What the structured-output requests ask for: an object with free strings and numbers, as tool
# arguments are (a random model fills it until its tokens run out, or closes it early).
JSON_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}, "score": {"type": "number"}},
    "required": ["name", "tags", "score"]}
SERVER_START_S = 1800            # the server compiles every step shape before it answers
MODEL_NAME = "bench"


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    arrival: float               # s after the start
    prompt: list[int]
    new_tokens: int
    logprobs: int | None = None  # top logprobs asked for (None: no logprobs)
    json: bool = False           # the output is JSON of JSON_SCHEMA


def make_trace(args: argparse.Namespace, vocab: int, repeat: int = 0) -> list[TraceRequest]:
    """The trace; ``repeat`` r > 0 draws other prompt tokens (seed 100 + r) of the same lengths, so
    that it finds nothing of the repeats before it in the prefix cache."""
    rng = np.random.default_rng(0)
    lengths = lognormal_lengths(rng, args.prompt_len, args.requests, 4 * args.prompt_len)
    arrivals = np.cumsum(rng.exponential(1 / args.rate, args.requests)) if args.rate > 0 else np.zeros(args.requests)
    asks = np.random.default_rng(1).random(args.requests) < args.logprobs_share
    json_asks = np.random.default_rng(2).random(args.requests) < args.json_share
    tokens = rng if repeat == 0 else np.random.default_rng(100 + repeat)
    return [TraceRequest(float(t), tokens.integers(0, vocab, size=n).tolist(), args.new_tokens,
                         args.top_logprobs if ask else None, bool(in_json))
            for t, n, ask, in_json in zip(arrivals, lengths, asks, json_asks)]


def synthetic_tokenizer(directory: str, vocab_size: int) -> int:
    """Writes ``directory/tokenizer.json``: a byte-level BPE of about ``vocab_size`` tokens (the 256
    bytes, then every string of 2 and 3 characters, then of 4, over 50 printable ASCII
    characters, JSON's punctuation and the space among them, as far as the vocabulary goes), so
    that the grammar engine works over a vocabulary of a real model's size. Its merges make each
    token from its prefix and its last character. Returns its number of tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    space = chr(0x120)                               # the byte-level alphabet's space
    alphabet = [space] + list('{}[]":,.0123456789') + list("abcdefghijklmnopqrstuvwxyzABCDE")
    vocab = {c: i for i, c in enumerate(byte_chars)}
    merges, layer = [], list(alphabet)
    while len(vocab) < vocab_size:
        layer = [a + c for a in layer for c in alphabet]
        for token in layer[:vocab_size - len(vocab)]:
            vocab[token] = len(vocab)
            merges.append((token[:-1], token[-1]))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    return len(vocab)


def summarize(arrival: Sequence[float], first: Sequence[float], last: Sequence[float],
              outputs: Sequence[list[int]]) -> dict:
    """Tokens/s, TTFT and TPOT (ms) of one run; times in s from the same start."""
    arrival, first, last = np.asarray(arrival), np.asarray(first), np.asarray(last)
    counts = np.asarray([len(o) for o in outputs])
    wall = float(last.max() - arrival.min())
    many = counts > 1
    return {"wall_s": wall, "tokens_per_s": float(counts.sum() / wall), "ttft_ms": ((first - arrival) * 1e3).tolist(),
            "tpot_ms": ((last - first)[many] / (counts[many] - 1) * 1e3).tolist(),
            "outputs": [list(o) for o in outputs]}


# ------------------------------------------------------------------------------ the engine run

def max_logprobs(args: argparse.Namespace) -> int:
    """The engine's ``max_logprobs``: 0 (no logprobs step variants to compile) unless the trace asks."""
    return args.top_logprobs if args.logprobs_share > 0 else 0


def engine_arguments(args: argparse.Namespace) -> list[str]:
    """The engine's settings as ``jaxattn.serve`` flags (the engine run takes the same)."""
    flags = ["--preset", args.preset, "--max-seq-len", str(args.max_seq_len), "--page-size", str(args.page_size),
             "--backend", args.backend]
    for name in ("layers", "max_seqs", "max_step_tokens", "num_pages"):
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return flags


def run_engine(args: argparse.Namespace, traces: list[list[TraceRequest]]) -> dict:
    """(In the subprocess.) Each trace through the in-process Engine in turn, in real time (with
    ``--tokenizer``, that tokenizer's grammar compiler): ``repeats``, one summary per trace."""
    import jax
    from flax import nnx

    from benchmarks.common import device_name
    from jaxattn.serve.engine import Engine
    from jaxattn.serve.models.llama import PRESETS, Llama
    from jaxattn.serve.structured_output import GrammarCompiler

    cfg = PRESETS[args.preset] if args.layers is None else PRESETS[args.preset].replace(num_layers=args.layers)
    compiler = None
    if args.tokenizer:
        compiler = GrammarCompiler.from_file(os.path.join(args.tokenizer, "tokenizer.json"), vocab_size=cfg.vocab_size)
    engine = Engine(Llama(cfg, nnx.Rngs(0)), max_seqs=args.max_seqs, max_seq_len=args.max_seq_len,
                    page_size=args.page_size, num_pages=args.num_pages, max_step_tokens=args.max_step_tokens,
                    backend=args.backend, grammar_compiler=compiler, max_logprobs=max_logprobs(args))
    engine.warmup()
    repeats = [_serve_engine(engine, trace) for trace in traces]
    return dict(repeats=repeats, device=device_name(), jax=jax.__version__, dtype=str(cfg.dtype),
                layers=cfg.num_layers, max_seqs=engine.max_seqs, num_pages=engine.num_pages)


def _serve_engine(engine, trace: list[TraceRequest]) -> dict:
    from jaxattn.serve.sampling import SamplingParams
    from jaxattn.serve.structured_output import StructuredOutputs

    index, pending = {}, list(enumerate(trace))
    first, last = [0.0] * len(trace), [0.0] * len(trace)
    start = time.perf_counter()
    while pending or engine.has_work:
        now = time.perf_counter() - start
        while pending and pending[0][1].arrival <= now:
            i, request = pending.pop(0)
            sampling = SamplingParams(logprobs=request.logprobs, structured_outputs=StructuredOutputs(
                json=JSON_SCHEMA) if request.json else None)
            index[engine.add_request(request.prompt, request.new_tokens, sampling=sampling)] = i
        if not engine.has_work:
            time.sleep(max(0.0, pending[0][1].arrival - now))
            continue
        events = engine.step_events()
        now = time.perf_counter() - start
        for request, _ in events:
            i = index[request]
            first[i] = first[i] or now
            last[i] = now
    outputs = [None] * len(trace)
    for request, i in index.items():
        outputs[i] = request.output
    return summarize([r.arrival for r in trace], first, last, outputs)


# -------------------------------------------------------------------------------- the HTTP run

async def _stream(http, request: TraceRequest, start: float) -> tuple[float, float, list[int]]:
    """(first, last token time, token ids) of one streamed request sent at its arrival time; times
    in s after ``start`` (``time.monotonic()``: one clock for every process of the host)."""
    import httpx

    await asyncio.sleep(max(0.0, start + request.arrival - time.monotonic()))
    body = {"model": MODEL_NAME, "prompt": request.prompt, "max_tokens": request.new_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True, "logprobs": request.logprobs}
    if request.json:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": JSON_SCHEMA}}
    first = last = 0.0
    ids: list[int] = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise httpx.HTTPStatusError(f"{response.status_code}: {(await response.aread())[:300]!r}",
                                        request=response.request, response=response)
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            new = choice["token_ids"]
            if request.logprobs is not None and new and len(choice["logprobs"]["token_logprobs"]) != len(new):
                raise RuntimeError(f"a chunk of {len(new)} tokens came with logprobs of "
                                   f"{len(choice['logprobs']['token_logprobs'])}")
            if new:
                last = time.monotonic() - start
                first = first or last
                ids += new
    return first, last, ids


async def _clients(base_url: str, trace: list[TraceRequest], start: float) -> list[tuple[float, float, list[int]]]:
    import httpx

    limits = httpx.Limits(max_connections=len(trace), max_keepalive_connections=len(trace))
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=None) as http:
        return await asyncio.gather(*(_stream(http, r, start) for r in trace))


def _client_process(base_url: str, trace: list[TraceRequest], conn) -> None:
    """(In a client process.) Warms its code paths up with one request, says it is ready, and
    serves its share of the trace from the start time it is sent; sends back the results."""
    asyncio.run(_clients(base_url, [TraceRequest(0.0, [0, 1], 2)], time.monotonic()))
    conn.send("ready")
    conn.send(asyncio.run(_clients(base_url, trace, conn.recv())))


def run_clients(base_url: str, trace: list[TraceRequest], processes: int) -> list[tuple[float, float, list[int]]]:
    """The trace's requests from ``processes`` client processes (request i from process i mod
    ``processes``), all timed from one start: (first, last token time, token ids) per request."""
    context = multiprocessing.get_context("spawn")
    shares = [trace[k::processes] for k in range(processes)]
    pipes = [context.Pipe() for _ in shares]
    workers = [context.Process(target=_client_process, args=(base_url, share, child), daemon=True)
               for share, (_, child) in zip(shares, pipes)]
    for worker, (_, child) in zip(workers, pipes):
        worker.start()
        child.close()                    # a process that dies: EOFError here
    try:
        try:
            for conn, _ in pipes:
                conn.recv()
            start = time.monotonic() + 0.1
            for conn, _ in pipes:
                conn.send(start)
            parts = [conn.recv() for conn, _ in pipes]
        except EOFError:
            raise RuntimeError("a client process failed (its traceback is above)") from None
    finally:
        for worker in workers:
            worker.join(timeout=60)
    results = [None] * len(trace)
    for k, part in enumerate(parts):
        results[k::processes] = part
    return results


def run_http(args: argparse.Namespace, traces: list[list[TraceRequest]], env: dict, mode: str) -> dict:
    """Each trace in turn through one ``python -m jaxattn.serve`` (a subprocess, its engine where
    ``mode`` says) from ``clients`` client processes: ``repeats``, one summary per trace."""
    port = free_port()
    command = [sys.executable, "-m", "jaxattn.serve", *engine_arguments(args), *ENGINE_MODES[mode][0],
               "--served-model-name", MODEL_NAME,
               "--port", str(port), "--log-level", "warning", "--max-logprobs", str(max_logprobs(args)),
               *(["--tokenizer", args.tokenizer] * bool(args.tokenizer))]
    server = subprocess.Popen(command, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(base_url, server, SERVER_START_S)
        except (RuntimeError, TimeoutError) as err:
            sys.exit(str(err))
        repeats = []
        for trace in traces:
            first, last, outputs = zip(*run_clients(base_url, trace, args.clients))
            repeats.append(summarize([r.arrival for r in trace], first, last, outputs))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    return {"repeats": repeats}


# -------------------------------------------------------------------------------------- report

def median_repeat(run: dict) -> dict:
    """The repeat of ``run`` with the median tokens/s (the lower middle one of an even count)."""
    repeats = sorted(run["repeats"], key=lambda r: r["tokens_per_s"])
    return repeats[(len(repeats) - 1) // 2]


def row(label: str, run: dict) -> str:
    r = median_repeat(run)
    return (f"| {label} | {r['tokens_per_s']:,.0f} | {percentiles(r['ttft_ms'], 1)} | {percentiles(r['tpot_ms'], 2)} "
            f"| {r['wall_s']:.2f} |")


def command(args: argparse.Namespace) -> str:
    flags = ["--requests", str(args.requests), "--prompt-len", str(args.prompt_len), "--new-tokens",
             str(args.new_tokens), "--rate", f"{args.rate:g}", "--clients", str(args.clients), *engine_arguments(args)]
    if args.logprobs_share > 0:
        flags += ["--logprobs-share", f"{args.logprobs_share:g}", "--top-logprobs", str(args.top_logprobs)]
    if args.json_share > 0:
        flags += ["--json-share", f"{args.json_share:g}"]
    if args.engine_modes != ["process"]:
        flags += ["--engine-modes", ",".join(args.engine_modes)]
    if args.repeats > 1:
        flags += ["--repeats", str(args.repeats)]
    return "python -m benchmarks.bench_http " + " ".join(flags)


def http_label(mode: str) -> str:
    return f"HTTP (python -m jaxattn.serve, {ENGINE_MODES[mode][1]})"


def report(args: argparse.Namespace, trace: list[TraceRequest], engine: dict, https: dict[str, dict]) -> str:
    prompts = np.asarray([len(r.prompt) for r in trace])
    arrivals = "all at once" if args.rate <= 0 else f"Poisson, {args.rate:g} requests/s"
    settings = (f"Device: {engine['device']}; date {datetime.date.today()}; jax {engine['jax']}; model {args.preset} "
                f"shapes with {engine['layers']} layers, {engine['dtype']}, random weights; backend {args.backend}; "
                f"{engine['max_seqs']} sequences in flight, {engine['num_pages']} pages of {args.page_size}, "
                f"max_seq_len {args.max_seq_len}, max_step_tokens {args.max_step_tokens or 'default'}.")
    asking = sum(r.logprobs is not None for r in trace)
    logprobs = f", {asking} of them asking for logprobs with the top {args.top_logprobs}" if asking else ""
    in_json = sum(r.json for r in trace)
    if in_json:
        logprobs += (f", {in_json} for JSON of a schema ({json.dumps(JSON_SCHEMA)}; tokenizer: "
                     f"`synthetic_tokenizer`, {args.tokenizer_tokens:,} tokens)")
    repeats = (f" Each run served the trace {args.repeats} times in turn (one engine, one server; each repeat "
               "other prompt tokens of the same lengths); a row is its run's median repeat by tokens/s."
               if args.repeats > 1 else "")
    workload = (f"Trace: {args.requests} requests ({arrivals}), prompts of {prompts.min()}..{prompts.max()} tokens "
                f"(mean {prompts.mean():.0f}), {args.new_tokens} greedy tokens each{logprobs}. HTTP: streamed "
                f"/v1/completions over loopback, one connection per request, from {args.clients} asyncio client "
                f"processes.{repeats}")
    lines = [
        settings,
        workload,
        f"Command: `{command(args)}`",
        "",
        "| run | generated tokens/s | TTFT ms p50 / p90 / p99 | TPOT ms p50 / p90 / p99 | wall s |",
        "|---|---|---|---|---|",
        row("Engine in process", engine),
        *(row(http_label(mode), http) for mode, http in https.items()),
        "",
    ]
    for mode, http in https.items():
        same = sum(a == b for a, b in zip(engine["repeats"][0]["outputs"], http["repeats"][0]["outputs"]))
        ratios = [h["tokens_per_s"] / e["tokens_per_s"] for h, e in zip(http["repeats"], engine["repeats"])]
        by_repeat = f" (median of the repeats' ratios: {', '.join(f'{r:.3f}' for r in ratios)})" if len(ratios) > 1 else ""
        lines.append(f"HTTP ({ENGINE_MODES[mode][1]}) / engine generated tokens/s: {float(np.median(ratios)):.3f}x"
                     f"{by_repeat}; requests with the same tokens in both runs: {same}/{args.requests}.")
    lines.append("Greedy tokens may differ between runs: a different batch mix rounds differently in bf16, and "
                 "greedy tokens part after a near tie.")
    return "\n".join(lines)


def engine_modes(text: str) -> list[str]:
    """argparse type: a comma-separated list of ``ENGINE_MODES``."""
    modes = text.split(",")
    if not modes or any(mode not in ENGINE_MODES for mode in modes) or len(set(modes)) < len(modes):
        raise argparse.ArgumentTypeError(f"must be distinct entries of {', '.join(ENGINE_MODES)}, comma-separated, "
                                         f"got {text!r}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    from jaxattn.serve.models.llama import PRESETS

    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_http", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS), help="model shapes (random weights)")
    parser.add_argument("--layers", type=int, help="number of layers (default: the preset's)")
    parser.add_argument("--requests", type=int, default=512, help="requests in the trace")
    parser.add_argument("--prompt-len", type=int, default=256, help="mean prompt length before clipping")
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per request")
    parser.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at once)")
    parser.add_argument("--max-seqs", type=int, default=128, help="sequences in flight")
    parser.add_argument("--max-seq-len", type=int, default=2048, help="longest prompt + generated tokens")
    parser.add_argument("--max-step-tokens", type=int, help="tokens per engine step (default: the engine's)")
    parser.add_argument("--num-pages", type=int, help="KV cache pages (default: the engine's)")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--backend", default="auto", help="paged_attention backend")
    parser.add_argument("--clients", type=int, default=4, help="client processes sending the HTTP run's requests "
                        "(one asyncio process reads about 7k streamed tokens/s)")
    parser.add_argument("--logprobs-share", type=float, default=0.0, help="the share of requests asking for logprobs")
    parser.add_argument("--top-logprobs", type=int, default=5, help="alternatives per token those requests ask for")
    parser.add_argument("--json-share", type=float, default=0.0, help="the share of requests asking for JSON output "
                        "of JSON_SCHEMA")
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)    # set by main when --json-share > 0
    parser.add_argument("--smoke", action="store_true", help="a tiny model and trace (CPU, seconds); RESULTS.md "
                                                              "is left alone")
    parser.add_argument("--engine-modes", type=engine_modes, default=["process"], metavar="MODES",
                        help="one HTTP run per entry, in order: process (the server's engine in a process of its "
                             "own, its default), thread (--engine-in-thread); default: process")
    parser.add_argument("--repeats", type=positive_int, default=1, help="serve the trace this many times in each run, "
                        "each with other prompt tokens; the report takes the median (default: %(default)s)")
    parser.add_argument("--section", default="http", help="the RESULTS.md section written (default: %(default)s)")
    parser.add_argument("--engine-run", metavar="JSON", help=argparse.SUPPRESS)   # the engine run's subprocess
    return parser


def main(argv: list[str] | None = None) -> None:
    from jaxattn.serve.models.llama import PRESETS

    args = build_parser().parse_args(argv)
    if args.smoke:
        args.preset, args.layers, args.requests, args.prompt_len, args.new_tokens = "tiny", 1, 8, 8, 6
        args.max_seqs, args.max_seq_len, args.max_step_tokens, args.page_size, args.clients = 4, 64, 8, 8, 2
    traces = [make_trace(args, PRESETS[args.preset].vocab_size, repeat) for repeat in range(args.repeats)]
    trace = traces[0]
    if args.engine_run:
        with open(args.engine_run, "w") as f:
            json.dump(run_engine(args, traces), f)
        return
    # This process only sends requests: it keeps off the device the runs need (whatever an import
    # might ask JAX for). Both runs compile the same steps: the server finds the engine run's in
    # the cache.
    import jax

    jax.config.update("jax_platforms", "cpu")
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tmp, "jax_cache"))
        path = os.path.join(tmp, "engine.json")
        tokenizer = []
        if args.json_share > 0:
            args.tokenizer = tmp
            args.tokenizer_tokens = synthetic_tokenizer(tmp, PRESETS[args.preset].vocab_size)
            tokenizer = ["--tokenizer", tmp]
        subprocess.run([sys.executable, "-m", "benchmarks.bench_http", *(argv if argv is not None else sys.argv[1:]),
                        "--engine-run", path, *tokenizer], env=env, check=True)
        with open(path) as f:
            engine = json.load(f)
        print(row("Engine in process", engine), flush=True)
        https = {}
        for mode in args.engine_modes:
            https[mode] = run_http(args, traces, env, mode)
            print(row(http_label(mode), https[mode]), flush=True)
    heading = HEADING if args.section == "http" else f"{HEADING}: {args.section}"
    print(write_section(args.section, report(args, trace, engine, https), heading=heading, update=not args.smoke))


if __name__ == "__main__":
    main()
