"""Speculative decoding through the Engine, against the same engine without it, in the same run.

    python -m benchmarks.bench_speculative [--preset llama3-8b] [--layers N] [--context 1024] [--output 128]
        [--batches 1,4,16,64] [--ks 2,4,8] [--ngram-batch 16] [--draft-preset llama3.2-1b] [--page-size 64]
        [--backend auto] [--section speculative] [--smoke]

Random weights make acceptance meaningless, so the table reports bounds (greedy requests, all at
once, ``--context`` prompt tokens and ``--output`` generated tokens each):
  * per batch B, the engine without speculation (its ms per step is a decode step's);
  * per K, an "oracle" drafter (``jaxattn.serve.speculative``) given each request's greedy continuation
    as the engine without speculation produced it: every draft is kept, the upper bound;
  * per K, the oracle given tokens the model never picks (each token of that continuation + 1):
    no draft is kept, so its ms per step is a verify step's and its tokens/s the overhead bound;
  * per B, a draft model of ``--draft-preset``'s shapes (K = 4; random weights, so its drafts are
    rarely kept: the cost of running a draft model, the bound of its overhead);
  * n-gram speculation (K = 4, prompt lookup 4..1) at B = ``--ngram-batch`` on a trace built to
    repeat (prompts that repeat a 16-token phrase): with random weights the model does not
    continue the phrase, so what it keeps comes from the model's own loops; said in the table.
Every run serves its trace through ``benchmarks.bench_serving.serve`` (overlap on): ms per step is
wall time / steps, TPOT is per request (first to last token / (tokens - 1)), p50. Each run's
outputs are checked against the engine without speculation (greedy: equal). Writes the
"speculative" section of benchmarks/RESULTS.md; ``--smoke`` serves a tiny model (CPU, seconds)
and writes only ``$OUT``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from benchmarks.bench_serving import TraceRequest, serve
from benchmarks.common import device_name, show_engine_log, write_section
from jaxattn.serve.engine import Engine
from jaxattn.serve.models.llama import PRESETS, Llama

PHRASE = 16
COLUMNS = ("B", "speculation", "K", "tokens / row-step", "ms / step", "vs no speculation", "TPOT ms p50", "tokens/s",
           "vs no speculation ", "steps")


@dataclasses.dataclass(frozen=True)
class Run:
    label: str
    k: int
    kept: str
    ms_per_step: float
    tpot_ms: float
    tokens_per_s: float
    steps: int
    outputs: list[list[int]]


def trace(rng: np.random.Generator, batch: int, context: int, output: int, vocab: int, repeat: bool,
          oracle: Sequence[np.ndarray] | None = None) -> list[TraceRequest]:
    """``batch`` requests of ``context`` random (``repeat``: a repeated random phrase) prompt tokens."""
    prompts = [np.resize(rng.integers(0, vocab, size=PHRASE if repeat else context), context).astype(np.int32)
               for _ in range(batch)]
    return [TraceRequest(0.0, p, output, None if oracle is None else oracle[i]) for i, p in enumerate(prompts)]


def run(model: Llama, requests: list[TraceRequest], args, speculative: dict | None, label: str) -> Run:
    """Serves ``requests`` on a fresh, warmed-up engine (``speculative``: its config)."""
    engine = Engine(model, max_seqs=len(requests), max_seq_len=args.context + args.output + 1,
                    page_size=args.page_size, max_step_tokens=max(args.max_step_tokens, len(requests)),
                    backend=args.backend, record_steps=True, speculative=speculative)
    engine.warmup(sampled=False)
    result = serve(engine, requests)
    records = result["records"]
    drafts = sum(r.draft_tokens for r in records)
    # tokens per decode row and step (each request's first token comes from its prompt's last chunk)
    gained = (result["generated"] - len(requests)) / max(1, sum(r.decode_rows for r in records))
    del engine
    gc.collect()
    return Run(label, speculative["num_speculative_tokens"] if speculative else 0, f"{gained:.2f}" if drafts else "-",
               1e3 * result["wall_s"] / len(records), float(np.median(result["tpot_ms"])),
               result["generated"] / result["wall_s"], len(records), result["outputs"])


def row(batch: int, r: Run, base: Run) -> str:
    cells = [str(batch), r.label, str(r.k or "-"), r.kept, f"{r.ms_per_step:.2f}",
             f"{r.ms_per_step / base.ms_per_step:.2f}x", f"{r.tpot_ms:.2f}", f"{r.tokens_per_s:,.0f}",
             f"{r.tokens_per_s / base.tokens_per_s:.2f}x", str(r.steps)]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_speculative",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS), help="model shapes (random weights)")
    parser.add_argument("--layers", type=int, default=None, help="number of layers (default: the preset's)")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--output", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--batches", default="1,4,16,64", help="requests in flight, comma-separated (\"\": none)")
    parser.add_argument("--ks", default="2,4,8", help="drafts per step, comma-separated")
    parser.add_argument("--ngram-batch", type=int, default=16, help="B of the n-gram run (0: none)")
    parser.add_argument("--draft-preset", default="llama3.2-1b", choices=["none", *sorted(PRESETS)],
                        help="the draft model's shapes (random weights; none: no draft-model rows)")
    parser.add_argument("--max-step-tokens", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--backend", default="auto", help="paged_attention backend")
    parser.add_argument("--section", default="speculative",
                        help="RESULTS.md section to write (runs split over several calls write one each)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model (CPU, seconds); RESULTS.md is left alone")
    args = parser.parse_args(argv)
    show_engine_log()
    if args.smoke:
        args.preset, args.context, args.output, args.page_size = "tiny", 24, 12, 8
        args.batches, args.ks, args.ngram_batch, args.max_step_tokens = "2", "2", 2, 64
        args.draft_preset = "tiny"
    batches = [int(b) for b in args.batches.split(",") if b]      # "": the n-gram rows only
    ks = [int(k) for k in args.ks.split(",") if k]
    cfg = PRESETS[args.preset]
    if args.layers is not None:
        cfg = cfg.replace(num_layers=args.layers)
    model = Llama(cfg, nnx.Rngs(0))
    vocab = cfg.vocab_size
    rows, mismatched = [], []

    def add(batch: int, r: Run, base: Run) -> None:
        """Adds ``r``'s row (printed as it comes: a run cut at the call's limit still says what ran)."""
        if r.outputs != base.outputs:
            mismatched.append(r.label)
        rows.append(row(batch, r, base))
        print(rows[-1], flush=True)

    for batch in batches:
        requests = trace(np.random.default_rng(batch), batch, args.context, args.output, vocab, repeat=False)
        base = run(model, requests, args, None, "none")
        add(batch, base, base)
        continuation = [np.asarray(o, np.int32) for o in base.outputs]
        for k in ks:
            for label, drafts in (("oracle: every draft kept", continuation),
                                  ("oracle: no draft kept", [(c + 1) % vocab for c in continuation])):
                given = [dataclasses.replace(r, draft_oracle=d) for r, d in zip(requests, drafts)]
                add(batch, run(model, given, args, {"method": "oracle", "num_speculative_tokens": k}, label), base)
        if args.draft_preset != "none":
            draft = {"method": "draft_model", "model": args.draft_preset, "num_speculative_tokens": 4}
            add(batch, run(model, requests, args, draft, f"draft model ({args.draft_preset} shapes, random weights)"),
                base)
    if args.ngram_batch:
        requests = trace(np.random.default_rng(0), args.ngram_batch, args.context, args.output, vocab, repeat=True)
        base = run(model, requests, args, None, "none (repeating prompts)")
        ngram = run(model, requests, args, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                            "prompt_lookup_min": 1}, "n-gram (repeating prompts)")
        add(args.ngram_batch, base, base)
        add(args.ngram_batch, ngram, base)
    header = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    command = (f"python -m benchmarks.bench_speculative --preset {args.preset} --layers {cfg.num_layers} "
               f"--context {args.context} --output {args.output} --batches {args.batches} --ks {args.ks} "
               f"--ngram-batch {args.ngram_batch} --draft-preset {args.draft_preset} --page-size {args.page_size} "
               f"--backend {args.backend} --section {args.section}"
               + (" --smoke" if args.smoke else ""))
    lines = [
        f"Device: {device_name()}; date {datetime.date.today()}; jax {jax.__version__}; model {args.preset} shapes "
        f"with {cfg.num_layers} layers, {cfg.dtype}, random weights; backend {args.backend}; greedy requests of "
        f"{args.context} prompt and {args.output} generated tokens, all at once, one engine per row (warmed up, "
        f"not timed), overlap on.",
        f"Command: `{command}`",
        "",
        *header, *rows,
        "",
        "ms / step: wall time / steps (with no speculation, a decode step; with the oracle that keeps no draft, a "
        "verify step of K + 1 tokens per row); tokens / row-step: tokens generated per decode row and step (1 "
        "without speculation, K + 1 when every draft is kept; a request's first token, from its prompt, not "
        "counted). The oracle drafter is given each request's greedy continuation from the run without "
        "speculation (or that + 1: never kept). The n-gram rows' prompts repeat "
        f"a {PHRASE}-token random phrase; with random weights the model does not continue it, so the drafts it "
        "keeps come from the model's own loops, not from what real text would give.",
        "Outputs equal to the engine's without speculation: "
        + ("all runs." if not mismatched else f"NOT {', '.join(mismatched)} (near ties in low precision)."),
    ]
    print(write_section(args.section, "\n".join(lines),
                        heading="Speculative decoding (benchmarks/bench_speculative.py)", update=not args.smoke))


if __name__ == "__main__":
    main()
