"""What each variant of the engine's step costs: greedy, sampled, with structured output's token
masks, with logprobs (Llama-3-8B shapes, random weights, the decode shape of 128 rows).

    python -m benchmarks.bench_step_variants [--preset llama3-8b] [--layers 8] [--max-seqs 128] [--backend triton]
        [--steps 20] [--smoke]

Each variant (``jaxattn.serve.step.StepRunner.padding_inputs``; with token masks, the step and its pick
launched apart, as structured output's are; every row a padding row, so attention
reads nothing and the rest of the step, the LM head over every row included, runs in full) is
timed as GPU busy time per step under the profiler (``steps`` steps after warm-up; on a CPU, none),
and as wall time per step with ``block_until_ready`` (median of ``steps``). The host side of structured
output is timed too: llguidance filling 32 rows' masks (at most) over a tokenizer of the model's vocabulary
(``bench_http.synthetic_tokenizer``) and putting the masks of every row on the device. Prints
a table (not written to RESULTS.md: its numbers go into the http-features section's notes).
``--smoke``: a tiny model on the xla backend (a CPU, seconds).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from benchmarks.bench_http import JSON_SCHEMA, synthetic_tokenizer
from benchmarks.common import device_busy_seconds, device_name
from jaxattn.serve.engine import Engine
from jaxattn.serve.models.llama import PRESETS, Llama
from jaxattn.serve.structured_output import GrammarCompiler, StructuredOutputs, fill_masks, mask_words

VARIANTS = {
    "greedy": {}, "greedy + logprobs": dict(logprobs=True), "greedy + token masks": dict(masked=True),
    "greedy + token masks + logprobs": dict(masked=True, logprobs=True), "sampled": dict(sampled=True),
    "sampled + token masks": dict(sampled=True, masked=True),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_step_variants",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-seqs", type=int, default=128)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 8 rows, xla backend, 3 steps")
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.layers, args.max_seqs, args.backend, args.steps = "tiny", 1, 8, "xla", 3
    cfg = PRESETS[args.preset].replace(num_layers=args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        tokens = synthetic_tokenizer(tmp, cfg.vocab_size)
        compiler = GrammarCompiler.from_file(f"{tmp}/tokenizer.json", vocab_size=cfg.vocab_size)
    engine = Engine(Llama(cfg, nnx.Rngs(0)), max_seqs=args.max_seqs, max_seq_len=1408, page_size=64,
                    backend=args.backend, grammar_compiler=compiler, max_logprobs=5)
    runner = engine.runner
    shape = runner.buckets.shapes[0]
    print(f"{device_name()}; jax {jax.__version__}; {args.preset}, {args.layers} layers, "
          f"decode step of {shape.rows} rows, "
          f"backend {args.backend}")
    print("| variant | GPU busy ms per step | wall ms per step |\n|---|---|---|")
    for name, options in VARIANTS.items():
        inputs = runner.padding_inputs(shape, sampled=options.get("sampled", False),
                                       masked=options.get("masked", False), logprobs=options.get("logprobs", False))

        def step():
            launch = runner._launch(inputs)
            if inputs.deferred:
                runner.pick(launch)
            return runner.table, launch.next_tokens

        for _ in range(3):
            jax.block_until_ready(step())
        walls = []
        for _ in range(args.steps):
            start = time.perf_counter()
            jax.block_until_ready(step())
            walls.append(time.perf_counter() - start)
        busy = f"{device_busy_seconds(step, args.steps) * 1e3:.2f}" if jax.default_backend() == "gpu" else "-"
        print(f"| {name} | {busy} | {statistics.median(walls) * 1e3:.2f} |", flush=True)
    grammars = [(compiler.grammar(StructuredOutputs(json=JSON_SCHEMA)), i) for i in range(min(32, shape.rows))]
    masks = np.full((shape.rows, mask_words(cfg.vocab_size)), -1, np.int32)
    fill_masks(grammars, masks)
    start = time.perf_counter()
    for _ in range(args.steps):
        fill_masks(grammars, masks)
    fill_ms = (time.perf_counter() - start) / args.steps * 1e3
    start = time.perf_counter()
    for _ in range(args.steps):
        jax.block_until_ready(jax.device_put(masks))
    put_ms = (time.perf_counter() - start) / args.steps * 1e3
    print(f"Host: llguidance fills {len(grammars)} rows' masks ({tokens:,} tokens) in {fill_ms:.2f} ms; "
          f"the {shape.rows} rows' "
          f"masks ({masks.nbytes / 1e6:.1f} MB) reach the device in {put_ms:.2f} ms.")


if __name__ == "__main__":
    main()
