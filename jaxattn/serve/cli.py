"""``python -m jaxattn.serve``: the OpenAI-compatible HTTP server over one Engine.

Serves a local Hugging Face checkpoint directory (``--model DIR``:
``jaxattn.serve.models.from_pretrained``, its ``tokenizer.json`` and chat template) or a random-weight
preset (``--preset NAME``, for benchmarks: prompts as token ids only, unless ``--tokenizer DIR``
gives it a tokenizer). With a tokenizer and llguidance installed, requests may ask for
structured output. The engine runs in a process of its own (``--engine-in-thread``: in a thread of
the server's) on ``--tp`` devices of that process, as ``python -m jaxattn.serve.demo --tp`` does;
the server's process touches no device. SIGTERM (or Ctrl-C) stops accepting connections, lets
requests in flight finish for up to ``--shutdown-timeout`` seconds, then aborts the rest (their
clients get a 503 error) and exits with status 0.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
import threading

import jax
import uvicorn

import jaxattn
from jaxattn.serve.cli_args import (DTYPES, add_compilation_cache_argument, positive_int, tp_mesh,
                                   use_compilation_cache)
from jaxattn.serve.engine import Engine
from jaxattn.serve.http.app import MAX_REQUEST_BYTES, build_app
from jaxattn.serve.http.engine_process import EngineProcess
from jaxattn.serve.http.loop import EngineLoop
from jaxattn.serve.http.text import TextTokenizer
from jaxattn.serve.models import from_pretrained
from jaxattn.serve.models.llama import PRESETS, random_model
from jaxattn.serve.models.quantization import METHODS, set_fp8_activations
from jaxattn.serve.sampling import MAX_LOGPROBS
from jaxattn.serve.structured_output import GrammarCompiler

__all__ = ["GracefulServer", "build_engine", "build_parser", "main"]

# Seconds uvicorn waits, after the requests in flight were aborted, for their answers to close
# before it cancels their tasks.
CLOSE_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    summary, *details = __doc__.replace("``", "").split("\n\n")
    parser = argparse.ArgumentParser(prog="python -m jaxattn.serve", description=summary.split(": ", 1)[1],
                                     epilog="\n\n".join(details))
    model = parser.add_argument_group("model")
    which = model.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="DIR", help="local Hugging Face checkpoint directory (config.json, "
                       "*.safetensors, tokenizer.json)")
    which.add_argument("--preset", choices=sorted(PRESETS), help="a random-weight preset instead (benchmarks; "
                       "token-id prompts only)")
    model.add_argument("--tokenizer", metavar="DIR", help="a directory with the tokenizer.json (and "
                       "tokenizer_config.json) to use instead of the model's (a preset has none)")
    model.add_argument("--layers", type=positive_int, metavar="N", help="override the preset's number of layers")
    model.add_argument("--dtype", choices=DTYPES, help="weights and activations (default: the checkpoint's or "
                       "the preset's)")
    model.add_argument("--served-model-name", metavar="NAME", help="the model name clients ask for (default: "
                       "the directory's name, or the preset's)")
    model.add_argument("--backend", default="auto", choices=("auto",) + jaxattn.backends.ALL_BACKENDS,
                       help="paged_attention backend (default: auto)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-seqs", type=positive_int, metavar="N",
                        help="sequences in flight (default: as many as the KV cache holds at max-seq-len, "
                             "at most 256)")
    engine.add_argument("--max-seq-len", type=positive_int, metavar="N",
                        help="longest prompt + generated tokens of a request (default: 4096 on a GPU, else 512)")
    engine.add_argument("--page-size", type=positive_int, metavar="N",
                        help="tokens per KV cache page (default: 64 on a GPU, else 16)")
    engine.add_argument("--num-pages", type=positive_int, metavar="N",
                        help="KV cache pages (default: enough for max-seqs sequences of max-seq-len; without "
                             "--max-seqs, 90%% of the device's free memory)")
    engine.add_argument("--max-step-tokens", type=positive_int, metavar="N",
                        help="tokens one engine step computes at most, decodes included (default: the "
                             "engine's, 2048); each power of two up to it is a step shape compiled at start")
    engine.add_argument("--max-logprobs", type=int, choices=range(MAX_LOGPROBS + 1), metavar="N",
                        default=MAX_LOGPROBS, help=f"the most top logprobs a request may ask for (0 to {MAX_LOGPROBS}; "
                        "0 turns logprobs off and compiles no step for them; default: %(default)s)")
    engine.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    engine.add_argument("--speculative-config", metavar="JSON",
                        help="speculative decoding, as vLLM spells it, e.g. '{\"method\": \"ngram\", "
                             "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' (default: none)")
    engine.add_argument("--tp", type=positive_int, metavar="N", default=1,
                        help="split the model over this many devices of this process (default: 1)")
    engine.add_argument("--quantization", choices=METHODS, default=None,
                        help="quantize the weights as they load (fp8: the decoder blocks' linears, per output "
                             "channel); an FP8 checkpoint is read as FP8 without it")
    engine.add_argument("--fp8-activations", action="store_true",
                        help="with FP8 weights (--quantization fp8 or an FP8 checkpoint): quantize each row of a "
                             "linear's input to FP8 as well and multiply FP8 by FP8 (W8A8, vLLM's dynamic scheme); "
                             "block-scaled linears stay weight-only")
    engine.add_argument("--enable-expert-parallel", action="store_true",
                        help="with --tp: each device holds whole experts of a mixture of experts instead of a slice "
                             "of every expert")
    add_compilation_cache_argument(engine)
    engine.add_argument("--engine-in-thread", action="store_true",
                        help="run the engine in a thread of the server's process instead of a process of its own "
                             "(the event loop and the engine's host work then share one GIL)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    server.add_argument("--max-request-bytes", type=positive_int, metavar="N", default=MAX_REQUEST_BYTES,
                        help="larger request bodies get a 413 (default: %(default)s, 8 MiB)")
    server.add_argument("--shutdown-timeout", type=float, metavar="S", default=30.0,
                        help="on SIGTERM, seconds requests in flight may take to finish before they are "
                             "aborted (default: %(default)s)")
    server.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                        help="uvicorn's and the server's logging (default: %(default)s)")
    return parser


def served_name(args: argparse.Namespace) -> str:
    """The model name clients ask for."""
    return args.served_model_name or args.preset or os.path.basename(os.path.normpath(args.model))


def load_model(args: argparse.Namespace, mesh):
    """The model of ``--model`` or ``--preset`` (with ``--fp8-activations``, its FP8 linears
    taking FP8 inputs); ValueError naming the flag."""
    expert_parallel = args.enable_expert_parallel
    if expert_parallel and mesh is None:
        raise ValueError("--enable-expert-parallel splits the experts over the --tp devices: give --tp 2 or more")
    if args.model is None:
        try:
            model = random_model(args.preset, layers=args.layers, dtype=args.dtype, mesh=mesh,
                                 expert_parallel=expert_parallel, quantization=args.quantization)
        except ValueError as err:
            raise ValueError(f"--preset {args.preset}: {err}") from None
    elif args.layers is not None:
        raise ValueError("--layers changes a preset: not with --model")
    else:
        try:
            model = from_pretrained(args.model, dtype=args.dtype, mesh=mesh, expert_parallel=expert_parallel,
                                    quantization=args.quantization)
        except (ValueError, OSError, ImportError) as err:
            raise ValueError(f"--model {args.model}: {err}") from None
    if args.fp8_activations and not set_fp8_activations(model):
        raise ValueError("--fp8-activations needs FP8 linears scaled per tensor or per output channel "
                         "(--quantization fp8, or an FP8 checkpoint without block scales); this model has none")
    return model


def load_tokenizer(args: argparse.Namespace) -> TextTokenizer | None:
    """``--tokenizer``'s, else ``--model``'s tokenizer (None without a tokenizer.json); ValueError
    naming the flag."""
    flag = "--tokenizer" if args.tokenizer else "--model"
    directory = args.tokenizer or args.model
    if directory is None or not (args.tokenizer or os.path.isfile(os.path.join(directory, "tokenizer.json"))):
        return None
    try:
        return TextTokenizer(directory)
    except ImportError as err:
        raise ValueError(f"{flag} {directory} has a tokenizer.json: {err} (pip install -e \".[serve]\")") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"{flag} {directory}: {err}") from None


def build_engine(args: argparse.Namespace, tokenizer: TextTokenizer | None = None) -> Engine:
    """The engine ``args`` ask for, compiled (``Engine.warmup``), each phase logged; ValueError
    naming the flag that does not fit. Runs where the engine will (the engine process).
    ``tokenizer``: the one of ``args`` where it is already loaded (None: ``load_tokenizer``)."""
    configure_logging(args.log_level)
    log = logging.getLogger("jaxattn.serve")
    on_gpu = jax.default_backend() == "gpu"
    if args.tp > jax.local_device_count():
        raise ValueError(f"--tp {args.tp}: there are only {jax.local_device_count()} devices")
    use_compilation_cache(args.compilation_cache_dir)
    mesh = tp_mesh(jax.local_devices()[:args.tp])
    log.info("loading the model")
    model = load_model(args, mesh)
    tokenizer = tokenizer or load_tokenizer(args)
    engine = Engine(model, max_seqs=args.max_seqs, max_seq_len=args.max_seq_len or (4096 if on_gpu else 512),
                    page_size=args.page_size or (64 if on_gpu else 16), num_pages=args.num_pages,
                    max_step_tokens=args.max_step_tokens, backend=args.backend,
                    enable_prefix_caching=not args.no_prefix_caching, mesh=mesh, max_logprobs=args.max_logprobs,
                    speculative=args.speculative_config,
                    grammar_compiler=grammar_compiler(tokenizer, model.cfg.vocab_size, log))
    log.info("compiling the engine's steps (%d sequences in flight, %d pages)", engine.max_seqs, engine.num_pages)
    log.info("compiled in %.1f s", engine.warmup())
    return engine


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def grammar_compiler(tokenizer: TextTokenizer | None, vocab_size: int, log: logging.Logger) -> GrammarCompiler | None:
    """Structured output's compiler over ``tokenizer`` (None without one, or without llguidance)."""
    if tokenizer is None:
        return None
    try:
        return GrammarCompiler(tokenizer.tokenizer.to_str(), vocab_size=vocab_size,
                               eos_token_ids=tokenizer.stop_token_ids)
    except ImportError as err:
        log.warning("%s: requests asking for structured output are refused", err)
        return None


class GracefulServer(uvicorn.Server):
    """uvicorn's server that, ``grace`` seconds after a shutdown signal, aborts the requests still
    in flight: their clients get a 503 error (a stream: as its last event) instead of a cut."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop | EngineProcess, grace: float):
        super().__init__(config)
        self.engine_loop, self.grace = engine_loop, grace

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            timer = threading.Timer(self.grace, self.engine_loop.abort_all)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    log = logging.getLogger("jaxattn.serve")
    try:
        tokenizer = load_tokenizer(args)
        if args.engine_in_thread:
            engine = build_engine(args, tokenizer)
        else:
            # Whatever this process might ask JAX for lands on the CPU, never on the engine's
            # devices (the child, a fresh interpreter, does not inherit this).
            jax.config.update("jax_platforms", "cpu")
            engine = EngineProcess(functools.partial(build_engine, args))
            engine.grammar_compiler = grammar_compiler(tokenizer, engine.vocab_size, log)
    except ValueError as err:
        parser.error(str(err))
    except RuntimeError as err:                      # the engine process died (its error is in the log)
        log.error("%s", err)
        sys.exit(1)
    app = build_app(engine, model_name=served_name(args), tokenizer=tokenizer,
                    max_request_bytes=args.max_request_bytes)
    # uvicorn re-raises the signal that stopped it once it has shut down: a handler of ours makes
    # that a no-op, so a SIGTERM'd server exits with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + CLOSE_S)
    GracefulServer(config, app.state.engine_loop, args.shutdown_timeout).run()
