"""Helpers of the HTTP server's tests (tests/test_serve.py, the README's serving section): a tiny
checkpoint with a chat template, a server subprocess on a free port, and (until the Engine has
them) ``step_events``, ``abort`` and ``page_usage`` over the current Engine's internals.

``python -m tests.serve_helpers ARGS`` runs ``python -m jaxattn.serve ARGS`` with that shim."""

from __future__ import annotations

import collections
import contextlib
import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

from jaxattn.engine import Engine

REPO = pathlib.Path(__file__).resolve().parents[1]
# The chat template of save_chat_checkpoint's tokenizer (its words are the vocabulary's: w10 opens
# a user turn, w11 an assistant turn, w12 asks for the answer).
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ 'w10' if m['role'] == 'user' else 'w11' }} "
                 "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w12{% endif %}")
BOS, EOS = 1, 2         # transformers' LlamaConfig defaults: generation_config.json's eos_token_id

PageUsage = collections.namedtuple("PageUsage", "in_use free cached")


def patch_engine_api() -> None:
    """Gives ``Engine`` the serving API it is getting (``step_events``, ``abort``, ``page_usage``)
    where it lacks it; a no-op once it has it."""
    if not hasattr(Engine, "step_events"):
        Engine.step_events = Engine._step_tokens
    if not hasattr(Engine, "abort"):
        def abort(self, request) -> None:
            scheduler = self.scheduler
            if request in scheduler.waiting:
                scheduler.waiting.remove(request)
            elif request in scheduler.running:
                scheduler._finish(request)
            request.finish_reason = request.finish_reason or "abort"
        Engine.abort = abort
    if not hasattr(Engine, "page_usage"):
        def page_usage(self) -> PageUsage:
            pool = self.scheduler.pool
            usable = self.table.refcount.shape[0] - 1
            return PageUsage(usable - pool.free - len(pool.evictable), pool.free, len(pool.evictable))
        Engine.page_usage = property(page_usage)


def save_chat_checkpoint(path: pathlib.Path, **overrides):
    """A tiny Llama checkpoint (tests/models/hf_checkpoints.py) with a word-level tokenizer saved
    by transformers (tokenizer.json, tokenizer_config.json, its chat template); returns the
    transformers model."""
    import transformers
    from tokenizers import Tokenizer

    from tests.models.hf_checkpoints import WORDS, save_checkpoint, save_tokenizer

    reference = save_checkpoint("llama", path, **overrides)
    save_tokenizer(path)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(path / "tokenizer.json")), bos_token=WORDS[BOS],
        eos_token=WORDS[EOS], unk_token=WORDS[0])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return reference


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(args: list[str]) -> list[str]:
    """The command that runs ``python -m jaxattn.serve args`` (with the Engine shim)."""
    return [sys.executable, "-m", "tests.serve_helpers", *args]


@contextlib.contextmanager
def running_server(args: list[str], port: int, *, timeout: float = 120.0,
                   log: pathlib.Path | None = None) -> Iterator[subprocess.Popen]:
    """A server subprocess (``args`` without ``--port``) that answers /health; killed at exit if
    it still runs. Its output goes to ``log`` (default: discarded)."""
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    out = open(log, "w") if log else subprocess.DEVNULL     # noqa: SIM115 - closed below
    proc = subprocess.Popen(server_command([*args, "--port", str(port)]), cwd=REPO, env=env, stdout=out,
                            stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if log:
            out.close()


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before answering /health")
        try:
            if httpx.get(f"{base_url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server did not answer /health within {timeout} s")


def metric(base_url: str, name: str) -> float:
    """A sample's value in the server's /metrics (the first line starting with ``name``)."""
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


if __name__ == "__main__":
    patch_engine_api()
    from jaxattn.serve.cli import main

    main()
