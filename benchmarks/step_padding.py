"""How much of a trace's mixed steps is padding, for the engine's ladder of step shapes and others:
the Engine's scheduler replayed on the CPU over a bench_serving trace.

    python -m benchmarks.step_padding --trace chat [--requests N] [--max-seqs 156] [--num-pages 5015]
        [--max-step-tokens 2048] [--page-size 64] [--smoke]

Which tokens each step computes depends on the scheduler alone (the trace's lengths, ``max_seqs``,
the pool, the token budget, ``prefill_chunk``, overlap), not on the model or the device: every
request runs to its output length. So the Engine runs here with a model that skips its layers
(the tiny preset's embedding and LM head) and its ``StepRecord``s give every step's rows and
tokens. Pass the ``max_seqs`` and ``num_pages`` a GPU run reported (bench_serving's header) and
the step counts match that run's. Each ladder of mixed-step token buckets is then scored by the
share of the mixed steps' computed tokens that are padding (the smallest bucket that holds each
step) and by how many mixed shapes it compiles (about 37 s each for Llama-3-8B on an H100). Mixed
steps of a few hundred tokens or more are compute-bound on an H100 (bf16 GEMMs at 270 tokens do as
many FLOPs per weight byte as the GPU's matmul rate over its copy rate), so their padding costs
time in proportion. Decode-only steps are left out: their rows are padded to one bucket, which
costs a weight-bound GEMM next to nothing. Writes the "step_padding_<trace>" section of
benchmarks/RESULTS.md (``--smoke``: a few requests on a small engine, only ``$OUT``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import sys

import jax
import numpy as np
from flax import nnx

from benchmarks.bench_serving import SPECS, TRACES, make_trace
from benchmarks.common import write_section
from jaxattn.serve.engine import DEFAULT_MAX_STEP_TOKENS, DEFAULT_PREFILL_CHUNK, Engine
from jaxattn.serve.models.llama import PRESETS, Llama
from jaxattn.serve.step import StepBuckets, buckets, mixed_buckets


class Layerless(Llama):
    """A Llama whose step skips its layers and attention: the scheduler's steps, at CPU speed."""

    def forward_paged(self, tokens, caches, meta, slots, backend="auto", plan=None):
        return self.embed(tokens), caches


def mixed_steps(trace: str, requests: int | None, max_seqs: int, num_pages: int, max_step_tokens: int,
                page_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens per mixed step, the tokens of the shape each ran in, steps in all) of ``trace``."""
    spec = SPECS[trace] if requests is None else dataclasses.replace(SPECS[trace], requests=requests)
    cfg = PRESETS["tiny"].replace(num_layers=1)
    requests = make_trace(trace, spec, cfg.vocab_size)
    engine = Engine(Layerless(cfg, nnx.Rngs(0)), max_seqs=max_seqs, num_pages=num_pages, page_size=page_size,
                    max_seq_len=max(r.prompt.size + r.new_tokens for r in requests),
                    max_step_tokens=max_step_tokens, backend="xla", record_steps=True)
    for request in requests:
        engine.add_request(request.prompt, max_new_tokens=request.new_tokens)
    engine.run()
    mixed = [record for record in engine.step_records if record.tokens != record.decode_rows]
    return (np.array([r.tokens for r in mixed]), np.array([r.padded_tokens for r in mixed]),
            len(engine.step_records))


def ladders(max_seqs: int, max_step_tokens: int) -> dict[str, tuple[int, ...]]:
    """Candidate mixed-step token ladders, from ``max(max_seqs, 64)`` up to ``max_step_tokens``."""
    first = max(max_seqs, 64)

    def geometric(ratio: float) -> tuple[int, ...]:
        sizes = [first]
        while sizes[-1] < max_step_tokens:
            sizes.append(min(max_step_tokens, math.ceil(sizes[-1] * ratio)))
        return tuple(sizes)

    return {"the engine's (StepBuckets.default: max_seqs + 128 x 2^i)": StepBuckets.default(max_seqs,
                                                                                             max_step_tokens).tokens,
            "doubling from max_seqs (before 2026-11-27)": buckets(first, max_step_tokens),
            "x1.5 from max_seqs": geometric(1.5), "x sqrt(2) from max_seqs": geometric(2 ** 0.5),
            "max_seqs + 64 x 2^i": mixed_buckets(first, max_step_tokens, 64),
            "max_seqs, then every 256": tuple(sorted({first, *range(256, max_step_tokens, 256), max_step_tokens}))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_padding", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="chat", choices=TRACES)
    parser.add_argument("--requests", type=int, default=None, help="requests in the trace (default: the trace's)")
    parser.add_argument("--max-seqs", type=int, default=156, help="the Engine's max_seqs in the GPU run to match")
    parser.add_argument("--num-pages", type=int, default=5015, help="the Engine's num_pages in that run")
    parser.add_argument("--max-step-tokens", type=int, default=DEFAULT_MAX_STEP_TOKENS)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="12 requests, 4 sequences: RESULTS.md is left alone")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.max_seqs, args.num_pages, args.max_step_tokens = 12, 4, 200, 256
    tokens, ran, steps = mixed_steps(args.trace, args.requests, args.max_seqs, args.num_pages, args.max_step_tokens,
                                     args.page_size)
    lines = [f"Device: CPU (the scheduler only: {jax.devices()[0].platform}); date {datetime.date.today()}; "
             f"jax {jax.__version__}. The Engine's scheduler replayed over the {args.trace} trace of bench_serving "
             f"(seed 0, {args.requests or SPECS[args.trace].requests} requests) with a model that skips its "
             f"layers: max_seqs {args.max_seqs}, {args.num_pages:,} pages of {args.page_size}, "
             f"{args.max_step_tokens} tokens per step, prefill chunks of {DEFAULT_PREFILL_CHUNK}, overlap on. "
             f"{steps:,} steps, {tokens.size:,} of them mixed; mixed-step tokens p5 / p25 / p50 / p75 / p95: "
             f"{' / '.join(str(int(q)) for q in np.percentile(tokens, [5, 25, 50, 75, 95]))}; in the shapes "
             f"this run's engine compiled, {100 * (1 - tokens.sum() / ran.sum()):.1f}% of the mixed steps' "
             f"tokens were padding.",
             f"Command: `python -m benchmarks.step_padding --trace {args.trace} --max-seqs {args.max_seqs} "
             f"--num-pages {args.num_pages} --max-step-tokens {args.max_step_tokens} --page-size {args.page_size}"
             f"{f' --requests {args.requests}' if args.requests else ''}`", "",
             "| ladder of mixed-step tokens | mixed shapes | padded share of mixed-step tokens | buckets |",
             "|---|---|---|---|"]
    for name, ladder in ladders(args.max_seqs, args.max_step_tokens).items():
        sizes = np.array(ladder)
        padded = sizes[np.searchsorted(sizes, tokens)]
        lines.append(f"| {name} | {len(ladder)} | {100 * (1 - tokens.sum() / padded.sum()):.1f}% | "
                     f"{', '.join(map(str, ladder))} |")
    text = "\n".join(lines)
    print(text, flush=True)
    write_section(f"step_padding_{args.trace}", text,
                  heading=f"Padding of mixed steps by bucket ladder: {args.trace} (benchmarks/step_padding.py)",
                  update=not args.smoke)


if __name__ == "__main__":
    sys.exit(main())
