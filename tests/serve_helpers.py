"""Helpers of the HTTP server's tests (tests/test_serve.py, the README's serving section): a tiny
checkpoint with a chat template, and a server subprocess on a free port."""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import httpx

from jaxattn.serve.process import wait_healthy

REPO = pathlib.Path(__file__).resolve().parents[1]
# The chat template of save_chat_checkpoint's tokenizer (its words are the vocabulary's: w30 opens
# a user turn, w31 an assistant turn, w32 asks for the answer). BOS and EOS (w1, w2) are added
# tokens, matched inside words too: "w10" is w1 and an unknown "0".
CHAT_TEMPLATE = ("{{ bos_token }} {% for m in messages %}{{ 'w30' if m['role'] == 'user' else 'w31' }} "
                 "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w32{% endif %}")
# The servers' compiled steps, shared by the tests' server processes (a server starts in seconds
# instead of compiling its steps for ~20 s on a 2-core CPU).
JAX_CACHE = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "jaxattn-serve-jax-cache")
BOS, EOS = 1, 2         # transformers' LlamaConfig defaults: generation_config.json's eos_token_id


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


@contextlib.contextmanager
def running_server(args: list[str], port: int, *, timeout: float = 120.0,
                   log: pathlib.Path | None = None) -> Iterator[subprocess.Popen]:
    """A server subprocess (``args`` without ``--port``) that answers /health; killed at exit if
    it still runs. Its output goes to ``log`` (default: discarded)."""
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "JAX_COMPILATION_CACHE_DIR": JAX_CACHE}
    out = open(log, "w") if log else subprocess.DEVNULL     # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "jaxattn.serve", *args, "--port", str(port)], cwd=REPO, env=env, stdout=out,
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


def metric(base_url: str, name: str) -> float:
    """A sample's value in the server's /metrics (``name`` with its labels, if any; 0 for a
    labelled sample not there yet)."""
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    if "{" in name:
        return 0.0
    raise KeyError(name)

