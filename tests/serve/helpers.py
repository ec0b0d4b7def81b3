"""Helpers of the HTTP server's tests (tests/serve/http/test_app.py, the README's serving section): a tiny
checkpoint with a chat template, and a server subprocess on a free port."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import httpx
import numpy as np

from jaxattn.serve.http.process import wait_healthy

REPO = pathlib.Path(__file__).resolve().parents[2]
# The servers' compiled steps, shared by the tests' server processes (a server starts in seconds
# instead of compiling its steps for ~20 s on a 2-core CPU).
JAX_CACHE = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "jaxattn-serve-jax-cache")
VOCAB = 384             # the tokenizer's: its 2 special tokens, the 256 bytes and 126 merges
BOS, EOS = 0, 1         # its special tokens <s> and </s>
SHAPES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# The byte-level BPE's training text: its merges are pieces of these words (other text encodes
# byte by byte).
CORPUS = """Paged attention keeps the keys and values of every sequence in fixed-size pages of one pool.
A page table maps each sequence's positions to its pages, so sequences grow without copying.
The server answers OpenAI's completions and chat completions, streamed or not.
{"model": "tiny-llama", "prompt": "Hello there", "max_tokens": 16, "temperature": 0}
Once upon a time, the capital of France was Paris; name three rivers: the Seine, the Loire, the Rhône.
user: Hi there, how are you?
assistant: I am fine, thank you. What would you like to know?"""
# Each message on a line of its own after its role; the generation prompt is the assistant's role.
# Tools, when given, are a first line of their names (short: the tests' sequences are short).
CHAT_TEMPLATE = ("{{ bos_token }}{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n"
                 "{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def save_tokenizer(path: pathlib.Path):
    """Writes ``path/tokenizer.json``: a byte-level BPE of VOCAB tokens trained on CORPUS (it adds
    no BOS: an empty text is no tokens); returns the ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    assert tokenizer.get_vocab_size() == VOCAB and tokenizer.token_to_id("</s>") == EOS
    tokenizer.save(str(path / "tokenizer.json"))
    return tokenizer


def save_chat_checkpoint(path: pathlib.Path) -> None:
    """Writes a tiny Llama checkpoint into ``path`` with numpy, safetensors and tokenizers (no
    torch): config.json, model.safetensors (float32, seeded), generation_config.json, and
    save_tokenizer's tokenizer with CHAT_TEMPLATE in tokenizer_config.json. The lm_head rows of BOS
    and of the tokens that are no printable whole characters (control bytes, the bytes of
    multi-byte characters) are zero: greedy outputs are text that decodes token by token."""
    from safetensors.numpy import save_file

    tokenizer = save_tokenizer(path)
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=VOCAB, **SHAPES,
                  max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
                  tie_word_embeddings=False, torch_dtype="float32", bos_token_id=BOS, eos_token_id=EOS)
    dim, hidden = SHAPES["hidden_size"], SHAPES["intermediate_size"]
    kv_dim = dim // SHAPES["num_attention_heads"] * SHAPES["num_key_value_heads"]
    rng = np.random.default_rng(0)

    def normal(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    def norm():
        return (1 + rng.standard_normal(dim) * 0.2).astype(np.float32)

    linears = {"self_attn.q_proj": (dim, dim), "self_attn.k_proj": (kv_dim, dim), "self_attn.v_proj": (kv_dim, dim),
               "self_attn.o_proj": (dim, dim), "mlp.gate_proj": (hidden, dim), "mlp.up_proj": (hidden, dim),
               "mlp.down_proj": (dim, hidden)}
    tensors = {"model.embed_tokens.weight": normal(VOCAB, dim), "model.norm.weight": norm(),
               "lm_head.weight": normal(VOCAB, dim)}
    for i in range(SHAPES["num_hidden_layers"]):
        tensors.update({f"model.layers.{i}.{name}.weight": normal(*shape) for name, shape in linears.items()})
        for name in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{name}.weight"] = norm()
    texts = [tokenizer.decode([i]) for i in range(VOCAB)]
    tensors["lm_head.weight"][[i for i, text in enumerate(texts)
                               if i == BOS or not text.isprintable() or "\ufffd" in text]] = 0
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": EOS}))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE,
         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))


@contextlib.contextmanager
def running_server(args: list[str], port: int, *, timeout: float = 300.0,
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

