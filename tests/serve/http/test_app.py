"""``python -m jaxattn.serve`` over loopback, on a tiny Llama checkpoint written without torch
(tests/serve/helpers.py: a byte-level BPE tokenizer and a chat template): the openai client's
completions, chats and streams equal the greedy tokens of the checkpoint's model run densely (no
paging, no cache), their text the tokenizer's decoding; bad input gets a 4xx naming the field; 64
concurrent streams with a quarter of the clients leaving mid-stream all end well and free their
pages (the pool short, so requests are preempted); SIGTERM during load exits 0, the streams
finished within the grace period and ended by a 503 event after it; logprobs and a JSON schema
cross the engine process's pipe; the README's section runs as
written; the benchmark's smoke mode runs. In process (no checkpoint): a request, or a step, that fails in the
engine fails alone; the command line's usage errors."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="needs the [serve] extra (pip install -e \".[test]\")")
openai = pytest.importorskip("openai", reason="needs the openai client (pip install -e \".[test]\")")
import httpx

from jaxattn.serve.http.process import free_port
from tests.serve.helpers import BOS, EOS, VOCAB, metric, running_server, save_chat_checkpoint
from tests.serve.models.test_llama import dense_greedy

MAX_SEQ_LEN = 64
# 16 pages (2 sequences of 64 tokens), so loads preempt; steps of at most 8 tokens (few shapes to compile)
SERVER_ARGS = ["--dtype", "float32", "--backend", "xla", "--max-seqs", "8", "--max-seq-len", str(MAX_SEQ_LEN),
               "--page-size", "8", "--num-pages", "17", "--max-step-tokens", "8"]
NEW_TOKENS = 12
LEAVER_TOKENS = 40      # a client that leaves mid-stream asks for more, so its request is still running
FINISH_REASONS = ("stop", "length", "abort", "error")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(checkpoint directory, its model from jaxattn.serve.models.from_pretrained, its tokenizers.Tokenizer)."""
    from tokenizers import Tokenizer

    from jaxattn.serve.models import from_pretrained

    path = tmp_path_factory.mktemp("tiny-llama")
    save_chat_checkpoint(path)
    return path, from_pretrained(str(path), dtype="float32"), Tokenizer.from_file(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
    """The module server's compilation cache directory."""
    return tmp_path_factory.mktemp("xla")


@pytest.fixture(scope="module")
def server(checkpoint, compilation_cache, tmp_path_factory):
    """The base URL of a server on the checkpoint (named "tiny-llama"), for the module's tests."""
    path = checkpoint[0]
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "server.log"
    args = ["--model", str(path), "--served-model-name", "tiny-llama", *SERVER_ARGS,
            "--compilation-cache-dir", str(compilation_cache)]
    with running_server(args, port, log=log):
        yield f"http://127.0.0.1:{port}"


def test_compiled_steps_are_kept_for_the_next_start(server, compilation_cache):
    """--compilation-cache-dir holds the engine's compiled steps once the server is up."""
    assert any(entry.name.startswith("jit_step") for entry in compilation_cache.iterdir()), \
        sorted(entry.name for entry in compilation_cache.iterdir())


def expected_tokens(model, prompt: list[int], new_tokens: int) -> list[int]:
    """The dense greedy tokens (tests/serve/models/test_llama.py), ending at the first EOS (included), as
    the server's."""
    out = dense_greedy(model, prompt, new_tokens, max_len=MAX_SEQ_LEN)
    return out[:out.index(EOS) + 1] if EOS in out else out


def expected_text(tokenizer, prompt: list[int], output: list[int]) -> str:
    """The output's text as a continuation of the prompt's (its EOS is no text)."""
    output = output[:-1] if output[-1:] == [EOS] else output
    return tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)):]


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def wait_idle(base_url: str, timeout: float = 20.0) -> None:
    """Until no request is in flight and no page held (the pages of aborted requests come back
    at the next step)."""
    deadline = time.monotonic() + timeout
    names = ("jaxattn_requests_running", "jaxattn_requests_waiting", "jaxattn_kv_pages_in_use")
    while any(metric(base_url, name) for name in names):
        assert time.monotonic() < deadline, {name: metric(base_url, name) for name in names}
        time.sleep(0.05)


# ------------------------------------------------------------------------------- the openai client

def test_models_and_health(server):
    assert [m.id for m in client(server).models.list().data] == ["tiny-llama"]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_completions_equal_the_dense_greedy_tokens(server, checkpoint):
    _, model, tokenizer = checkpoint
    text = 'The "café" {costs: [3 €]}'            # non-ASCII and JSON's punctuation: byte tokens
    prompt = tokenizer.encode(text).ids
    expected = expected_tokens(model, prompt, NEW_TOKENS)
    for given in (text, prompt):
        out = client(server).completions.create(model="tiny-llama", prompt=given, max_tokens=NEW_TOKENS,
                                                temperature=0, extra_body={"return_token_ids": True})
        choice = out.choices[0]
        assert choice.token_ids == expected
        assert choice.text == expected_text(tokenizer, prompt, expected)
        assert choice.finish_reason == ("stop" if expected[-1] == EOS else "length")
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), len(expected))


def test_logprobs_and_json_schema_through_the_engine_process(server):
    """The server's default engine process answers what crosses its pipe beside token ids:
    logprobs (the chosen token most likely, greedy) and a JSON schema's grammar (valid JSON,
    ended by the grammar)."""
    import jsonschema

    from tests.serve.http.test_protocol import YES_NO

    out = client(server).completions.create(model="tiny-llama", prompt="Hi", max_tokens=4, temperature=0,
                                            logprobs=2).choices[0].logprobs
    assert len(out.tokens) == len(out.token_logprobs) == len(out.top_logprobs) == 4
    for token, logprob, top in zip(out.tokens, out.token_logprobs, out.top_logprobs):
        assert len(top) == 2 and top[token] == logprob == max(top.values())
    chat = client(server).chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=40, temperature=0.8, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "yes_no", "schema": YES_NO}}).choices[0]
    jsonschema.validate(json.loads(chat.message.content), YES_NO)
    assert chat.finish_reason == "stop"


def test_streamed_completion_is_the_completion(server, checkpoint):
    _, model, tokenizer = checkpoint
    prompt = [BOS, 40, 41, 42, 43, 44]
    expected = expected_tokens(model, prompt, NEW_TOKENS)
    chunks = list(client(server).completions.create(model="tiny-llama", prompt=prompt, max_tokens=NEW_TOKENS,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected_text(tokenizer, prompt, expected)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(expected)


def test_chat_applies_the_chat_template(server, checkpoint):
    from jaxattn.serve.http.text import TextTokenizer

    path, model, tokenizer = checkpoint
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Name three rivers."}]
    rendered = "<s>user: Hi there\nassistant: Hello.\nuser: Name three rivers.\nassistant:"
    prompt = tokenizer.encode(rendered, add_special_tokens=False).ids      # the chat template written out
    assert prompt[0] == BOS and TextTokenizer(path).encode_chat(messages) == prompt
    expected = expected_tokens(model, prompt, NEW_TOKENS)
    out = client(server).chat.completions.create(model="tiny-llama", messages=messages, max_tokens=NEW_TOKENS,
                                                 temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected_text(tokenizer, prompt, expected)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), len(expected))
    stream = client(server).chat.completions.create(model="tiny-llama", messages=messages, max_tokens=NEW_TOKENS,
                                                    temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason


def test_stop_strings_cut_the_text_and_end_the_request(server, checkpoint):
    _, model, tokenizer = checkpoint
    prompt = [BOS, 30, 31, 32]
    expected = expected_tokens(model, prompt, NEW_TOKENS)
    full = expected_text(tokenizer, prompt, expected)
    assert len(full) >= 8, full
    stop = full[len(full) // 2:][:3]          # the text ends before its first appearance
    for stream in (False, True):
        out = client(server).completions.create(model="tiny-llama", prompt=prompt, max_tokens=NEW_TOKENS,
                                                temperature=0, stop=[stop, "never"], stream=stream)
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks) == full[:full.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"
    wait_idle(server)


def test_a_seed_repeats_a_sampled_output(server):
    def sample(seed):
        out = client(server).completions.create(model="tiny-llama", prompt=[BOS, 9, 8], max_tokens=8, temperature=1.0,
                                                top_p=0.9, seed=seed, extra_body={"top_k": 50, "return_token_ids": True})
        return out.choices[0].token_ids

    assert sample(7) == sample(7)


# --------------------------------------------------------------------------------------- bad input

def _too_long() -> list[int]:
    return [BOS] * MAX_SEQ_LEN


COMPLETION = {"model": "tiny-llama", "prompt": "Hello there", "max_tokens": 4}
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
# (endpoint, body (or raw bytes), status, the field the error names)
BAD = [
    ("completions", b'{"model": "tiny-llama", "prompt": ', 400, None),
    ("completions", b'[1, 2]', 400, None),
    ("completions", {"model": "tiny-llama", "max_tokens": 4}, 400, "prompt"),
    ("chat/completions", {"model": "tiny-llama", "max_tokens": 4}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"content": "Hi"}]}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages"),
    ("completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {**COMPLETION, "max_tokens": -3}, 400, "max_tokens"),
    ("completions", {**COMPLETION, "max_tokens": 2.5}, 400, "max_tokens"),
    ("completions", {**COMPLETION, "max_tokens": "8"}, 400, "max_tokens"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("completions", {**COMPLETION, "temperature": -0.5}, 400, "temperature"),
    ("completions", {**COMPLETION, "top_p": 0}, 400, "top_p"),
    ("completions", {**COMPLETION, "top_p": 1.5}, 400, "top_p"),
    ("completions", {**COMPLETION, "temperature": 1e39}, 400, "temperature"),       # inf in float32
    ("completions", {**COMPLETION, "top_p": 1e-46}, 400, "top_p"),                  # 0 in float32
    ("completions", {**COMPLETION, "top_k": -2}, 400, "top_k"),
    ("completions", {**COMPLETION, "top_k": 2.5}, 400, "top_k"),
    ("completions", {**COMPLETION, "seed": -1}, 400, "seed"),
    ("completions", {**COMPLETION, "stop": ""}, 400, "stop"),
    ("completions", {**COMPLETION, "prompt": ""}, 400, "prompt"),
    ("completions", {**COMPLETION, "prompt": _too_long()}, 400, "prompt"),
    ("completions", {**COMPLETION, "prompt": [BOS] * 10, "max_tokens": MAX_SEQ_LEN - 9}, 400, "max_tokens"),
    ("chat/completions", {**CHAT, "max_tokens": MAX_SEQ_LEN}, 400, "max_tokens"),
    ("completions", {**COMPLETION, "prompt": [BOS, VOCAB]}, 400, "prompt"),
    ("completions", {**COMPLETION, "prompt": [BOS, -1]}, 400, "prompt"),
    ("completions", {**COMPLETION, "prompt": [[1, 2], [3]]}, 400, "prompt"),
    ("completions", {**COMPLETION, "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model"),
    ("completions", {**COMPLETION, "n": 0}, 400, "n"),
    ("completions", {**COMPLETION, "n": 129}, 400, "n"),
    ("completions", {**COMPLETION, "logprobs": 21}, 400, "logprobs"),
    ("chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("completions", {**COMPLETION, "stream": "yes"}, 400, "stream"),
]


def test_bad_input_gets_a_4xx_naming_the_field(server):
    with httpx.Client(base_url=f"{server}/v1") as http:
        for endpoint, body, status, param in BAD:
            if isinstance(body, bytes):
                response = http.post(endpoint, content=body, headers={"content-type": "application/json"})
            else:
                response = http.post(endpoint, json=body)
            case = f"{endpoint} {body!r}: {response.status_code} {response.text}"
            assert response.status_code == status, case
            error = response.json()["error"]
            assert error["param"] == param and error["message"] and error["type"], case
            if param is not None:
                assert param in error["message"], case
        assert http.post("completions", json=COMPLETION).status_code == 200, "and it goes on serving"


def test_the_openai_client_raises_on_bad_input(server):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client(server).completions.create(model="tiny-llama", prompt="Hi", max_tokens=MAX_SEQ_LEN)
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])



# ----------------------------------------------------------------------------------------- load

async def _stream(http: httpx.AsyncClient, prompt: list[int], leave_after: int | None,
                  first_chunk: asyncio.Event | None = None, max_tokens: int = NEW_TOKENS) -> tuple[int, object]:
    """(status, streamed token ids of ``max_tokens`` asked for, or None for a client that left after
    ``leave_after`` chunks of LEAVER_TOKENS asked for, or the message of an error event); sets
    ``first_chunk`` when a chunk arrives."""
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens if leave_after is None else LEAVER_TOKENS,
            "temperature": 0, "stream": True, "return_token_ids": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return response.status_code, None
        ids, chunks = [], 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[len("data: "):])
            if "error" in data:
                return response.status_code, data["error"]["message"]
            ids += data["choices"][0]["token_ids"]
            chunks += 1
            if first_chunk is not None:
                first_chunk.set()
            if chunks == leave_after:
                return response.status_code, None   # closing the response drops the connection
        return response.status_code, ids


async def _leave_a_plain_request(http: httpx.AsyncClient, prompt: list[int], streaming: asyncio.Event) -> str:
    """A non-streamed request, sent once the server streams (the other requests are in by then),
    whose client gives up waiting after 10 ms: "left" (else "finished"). Its LEAVER_TOKENS take at
    least as many engine steps: with a 0.1 s wait, a server that admitted it at once (as this one
    may: it preempts) could finish it first (3 of 8 local runs did)."""
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": LEAVER_TOKENS, "temperature": 0}
    await asyncio.wait_for(streaming.wait(), timeout=60)
    try:
        await http.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.01))
    except httpx.ReadTimeout:
        return "left"
    return "finished"


async def _load(base_url: str, prompts: list[list[int]], leave: set[int], plain: bool = False,
                max_tokens: int = NEW_TOKENS) -> list:
    """Streams of ``prompts`` asking for ``max_tokens`` (those of ``leave`` leave after 2 chunks)
    and, with ``plain``, a last non-streamed request that its client leaves
    (``_leave_a_plain_request``)."""
    limits = httpx.Limits(max_connections=len(prompts) + 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as http:
        streaming = asyncio.Event()
        clients = [_stream(http, p, 2 if i in leave else None, streaming, max_tokens) for i, p in enumerate(prompts)]
        if plain:
            clients.append(_leave_a_plain_request(http, prompts[0], streaming))
        return await asyncio.gather(*clients, return_exceptions=True)


def _load_prompts(count: int) -> list[list[int]]:
    """Prompts of 4 to 19 tokens; eight distinct ones, some sharing a page-long prefix."""
    rng = np.random.default_rng(0)
    shared = [BOS] + rng.integers(EOS + 1, VOCAB, size=8).tolist()
    distinct = [(shared if i % 2 else [BOS]) + rng.integers(EOS + 1, VOCAB, size=3 + i).tolist() for i in range(8)]
    return [distinct[i % 8] for i in range(count)]


def test_64_streams_a_quarter_leaving(server, checkpoint):
    """64 concurrent streams, 16 of them leaving after 2 tokens, and a non-streamed request whose
    client gives up: no error, the others' tokens right, every request counted once (most leavers'
    aborted), no page held at the end (the pool holds 2 sequences of max_seq_len: requests wait or
    are preempted; which of the two depends on how far the leavers got, so neither is asserted)."""
    model = checkpoint[1]
    prompts = _load_prompts(64)
    expected = {p: expected_tokens(model, list(p), NEW_TOKENS) for p in set(map(tuple, prompts))}
    leave = set(range(0, 64, 4))
    finished = {reason: metric(server, f'jaxattn_requests_finished_total{{finish_reason="{reason}"}}')
                for reason in FINISH_REASONS}
    start = time.monotonic()
    *results, plain = asyncio.run(_load(server, prompts, leave, plain=True))
    elapsed = time.monotonic() - start
    assert elapsed < 90, f"64 streams took {elapsed:.0f} s"
    assert plain == "left"
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(status == 200 for status, _ in results), [status for status, _ in results]
    for i, (prompt, (_, ids)) in enumerate(zip(prompts, results)):
        if i not in leave:
            assert ids == expected[tuple(prompt)], (i, prompt)
    wait_idle(server)
    assert metric(server, "jaxattn_kv_pages_in_use") == 0
    ended = {reason: metric(server, f'jaxattn_requests_finished_total{{finish_reason="{reason}"}}') - count
             for reason, count in finished.items()}
    assert sum(ended.values()) == len(prompts) + 1 and ended["error"] == 0, ended
    # A leaver's request ends "length" when the server had sent its last chunk before the client
    # left: under load the client reads far behind the server (the rest waits in its socket buffer).
    assert len(leave) // 2 < ended["abort"] - 1 <= len(leave), ended


@pytest.mark.parametrize("grace", ["30", "0"], ids=["finish", "abort"])
def test_sigterm_during_load_exits_0(checkpoint, tmp_path, grace):
    """SIGTERM with streams in flight: no new connections; exit status 0; within the grace period
    (--shutdown-timeout) the streams finish, after it they end with a 503 error event. Without a
    grace period the streams ask for LEAVER_TOKENS: with NEW_TOKENS a fast machine could finish
    all 16 before the signal lands (1 of 6 local runs did), leaving none to end."""
    path, model, _ = checkpoint
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    prompts = _load_prompts(16)
    max_tokens = NEW_TOKENS if grace != "0" else LEAVER_TOKENS

    async def load_then_sigterm(proc) -> list:
        """SIGTERM once the engine has taken every request (so all are in flight)."""
        task = asyncio.ensure_future(_load(base_url, prompts, set(), max_tokens=max_tokens))
        deadline = time.monotonic() + 60
        while metric(base_url, "jaxattn_prompt_tokens_total") < sum(map(len, prompts)):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        return await task

    args = ["--model", str(path), "--served-model-name", "tiny-llama", *SERVER_ARGS, "--shutdown-timeout", grace]
    with running_server(args, port, log=tmp_path / "server.log") as proc:
        results = asyncio.run(load_then_sigterm(proc))
        assert proc.wait(timeout=60) == 0, (tmp_path / "server.log").read_text()[-3000:]
    aborted = 0
    for prompt, result in zip(prompts, results):
        assert not isinstance(result, BaseException), result
        if result != (200, expected_tokens(model, prompt, max_tokens)):
            assert grace == "0" and result == (200, "the server is shutting down"), result
            aborted += 1
    assert aborted > 0 if grace == "0" else aborted == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base_url}/health")


# ---------------------------------------------------------------------------------- in process

def test_command_line(capsys):
    """Every option has a help; a model is required, one of --model and --preset."""
    from jaxattn.serve import cli

    assert all(action.help for action in cli.build_parser()._actions)
    for argv, message in (([], "one of the arguments --model --preset is required"),
                          (["--preset", "tiny", "--model", "x"], "not allowed with argument"),
                          (["--model", "/nonexistent"], "is not a local checkpoint directory"),
                          (["--preset", "tiny", "--max-seqs", "0"], "must be an int >= 1"),
                          (["--preset", "tiny", "--speculative-config", '{"method": "eagle"}'],
                           "speculative: SpeculativeConfig: method must be one of"),
                          (["--preset", "qwen1.5-moe-a2.7b", "--enable-expert-parallel"],
                           "--enable-expert-parallel splits the experts over the --tp devices"),
                          (["--preset", "tiny", "--quantization", "int4"], "invalid choice: 'int4'"),
                          (["--preset", "tiny", "--fp8-activations"], "--fp8-activations needs FP8 linears")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, argv


class _FailingEngine:
    """An Engine whose add_choices (the server's way in) raises (not a ValueError) for prompts
    starting with FAIL, and whose next step's jitted call raises after ``fail_next_step`` is set
    (inside the engine, which recovers: ``Engine.step_events``)."""

    FAIL = 13

    def __init__(self, engine):
        self._engine = engine
        self.fail_next_step = False

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def add_choices(self, prompt, *args, **kwargs):
        if prompt[0] == self.FAIL:
            raise RuntimeError("injected fault")
        return self._engine.add_choices(prompt, *args, **kwargs)

    def step_events(self):
        runner, step = self._engine.runner, self._engine.runner._step
        if self.fail_next_step:
            self.fail_next_step = False

            def failing_step(*args, **kwargs):
                runner._step = step                  # once
                raise RuntimeError("injected step fault")
            runner._step = failing_step
        return self._engine.step_events()


def test_a_request_failing_in_the_engine_fails_alone():
    """(In process, a random-weight preset, no tokenizer.) The failing request gets a 500 naming
    the error; the requests beside it and after it are served; a failing step fails its requests
    with a 500, and the next are served; text needs a tokenizer (400)."""
    from fastapi.testclient import TestClient
    from flax import nnx

    from jaxattn.serve.engine import Engine
    from jaxattn.serve.http.app import build_app
    from jaxattn.serve.models.llama import PRESETS, Llama

    engine = Engine(Llama(PRESETS["tiny"].replace(num_layers=1), nnx.Rngs(0)), max_seqs=4, max_seq_len=32,
                    page_size=8, max_step_tokens=8, backend="xla")
    failing = _FailingEngine(engine)
    app = build_app(failing, model_name="tiny")
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0}
    with TestClient(app) as http:
        def post(prompt, **extra):
            return http.post("/v1/completions", json={**body, "prompt": prompt, **extra})

        assert post("some text").json()["error"]["param"] == "prompt"
        ok, failed = post([1, 2, 3], return_token_ids=True), post([_FailingEngine.FAIL, 2, 3])
        assert failed.status_code == 500 and "injected fault" in failed.json()["error"]["message"]
        streamed = post([_FailingEngine.FAIL, 5], stream=True)
        assert streamed.status_code == 500 and "injected fault" in streamed.json()["error"]["message"]
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 4
        failing.fail_next_step = True
        step_failed = post([1, 2, 3])
        assert step_failed.status_code == 500 and "injected step fault" in step_failed.json()["error"]["message"]
        again = post([1, 2, 3], return_token_ids=True)
        assert again.json()["choices"][0]["token_ids"] == ok.json()["choices"][0]["token_ids"]
        assert http.get("/health").status_code == 200


def _generate(tokenizer, deliveries: list[list], stop: tuple[str, ...] = ()) -> tuple[list, list[str], bool]:
    """(chunks of ``Generation.chunks``, the events it was handed, whether it aborted the request) when
    each list of ``deliveries`` reaches the job before the stream takes its events: a stream that
    fell behind takes several steps at once."""
    import types

    from jaxattn.serve.http.app import Generation
    from jaxattn.serve.http.loop import Admitted, Job
    from jaxattn.serve.sampling import SamplingParams

    async def run():
        aborted = []
        job = Job([BOS, 30, 31], 16, SamplingParams(stop_token_ids=(EOS,)))
        generation = Generation(types.SimpleNamespace(abort=aborted.append), job, tokenizer, stop)
        job.put(Admitted())
        await generation.start()
        chunks, pending = [], list(deliveries)
        try:
            for event in pending.pop(0):
                job.put(event)
            async for chunk in generation.chunks():
                chunks.append(chunk)
                for event in pending.pop(0) if pending else []:
                    job.put(event)
        except Exception as err:                     # an APIError of a Failed event
            chunks.append(err)
        return chunks, bool(aborted)

    return asyncio.run(run())


def test_a_stream_behind_the_engine_gets_the_same_tokens_and_text(checkpoint):
    """Several steps' events taken at once make one chunk with all their tokens: the same ids,
    text and finish as one chunk per step, a stop string cutting the text and aborting the request
    as it does step by step; tokens before a failure come before its error."""
    from jaxattn.serve.http.loop import Failed, Tokens
    from jaxattn.serve.http.protocol import APIError
    from jaxattn.serve.http.text import TextTokenizer

    tokenizer = TextTokenizer(checkpoint[0])
    words = tokenizer.encode(" the sequence pages and completions", add_special_tokens=False)
    assert len(words) == 5, "a token a word"
    steps = [Tokens([word], None) for word in words] + [Tokens([EOS], "stop")]
    full = "".join(chunk[0] for chunk in _generate(tokenizer, [[step] for step in steps])[0])
    stop = " " + full.split()[3]
    for stops in ((), (stop,)):
        one_by_one, aborted = _generate(tokenizer, [[step] for step in steps], stops)
        assert len(one_by_one) == (6 if not stops else 4), one_by_one
        for deliveries in ([steps[:3], steps[3:]], [steps], [steps[:1], steps[1:4], steps[4:]]):
            chunks, aborted_too = _generate(tokenizer, deliveries, stops)
            assert len(chunks) < len(one_by_one)
            assert "".join(c[0] for c in chunks) == "".join(c[0] for c in one_by_one) == \
                (full if not stops else full[:full.index(stop)])
            assert sum((c[1] for c in chunks), []) == sum((c[1] for c in one_by_one), [])
            assert chunks[-1][2] == one_by_one[-1][2] == "stop" and aborted_too == aborted == bool(stops)
    chunks, _ = _generate(None, [[Tokens([7], None), Tokens([8], None), Failed(500, "injected")]])
    assert chunks[0] == ("", [7, 8], None, None) and isinstance(chunks[1], APIError) and chunks[1].status == 500


# -------------------------------------------------------------------------- the README's section

README_SECTION = "### HTTP serving (OpenAI-compatible)"
README_PATH = "/path/to/Llama-3.1-8B-Instruct"


def readme_blocks() -> list[tuple[str, str]]:
    """(language, code) of the fenced blocks of the README's HTTP serving section, in order."""
    from tests.serve.helpers import REPO

    text = (REPO / "README.md").read_text()
    section = text[text.index(README_SECTION) + len(README_SECTION):]
    section = section[:re.search(r"^##", section, flags=re.MULTILINE).start()]
    return re.findall(r"^```(\w+)\n(.*?)^```", section, flags=re.DOTALL | re.MULTILINE)


def test_readme_http_serving_section(checkpoint, tmp_path, capsys):
    """The section's commands as written, on the tiny checkpoint (at the placeholder's name) and
    a free port: the server command (with the module's engine sizes added, for a CPU), the curl
    command, the openai block."""
    (serve, curl), (python,) = [code for lang, code in readme_blocks() if lang == "bash"], \
        [code for lang, code in readme_blocks() if lang == "python"]
    model_dir = tmp_path / pathlib.PurePath(README_PATH).name
    model_dir.symlink_to(checkpoint[0], target_is_directory=True)
    port = free_port()
    command = shlex.split(serve.replace(README_PATH, str(model_dir)))
    assert command[:3] == ["python", "-m", "jaxattn.serve"] and command[-2:] == ["--port", "8000"], command
    with running_server([*command[3:-2], *SERVER_ARGS], port, log=tmp_path / "server.log"):
        out = subprocess.run(["bash", "-c", curl.replace(":8000", f":{port}")], capture_output=True, text=True,
                             check=True).stdout
        assert 1 <= json.loads(out)["usage"]["completion_tokens"] <= 16
        exec(compile(python.replace(":8000", f":{port}"), "README.md", "exec"), {})  # noqa: S102 - the README block
    printed = capsys.readouterr().out
    assert printed.strip(), "the block printed the chat's answer and the stream"


def test_bench_http_smoke(tmp_path):
    """benchmarks/bench_http.py --smoke: the engine run and an HTTP run per engine mode of a tiny
    trace served twice (CPU), the same greedy tokens in each."""
    from tests.serve.helpers import JAX_CACHE, REPO

    env = {**os.environ, "OUT": str(tmp_path), "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": JAX_CACHE}
    result = subprocess.run([sys.executable, "-m", "benchmarks.bench_http", "--smoke", "--engine-modes", "process,thread",
                             "--repeats", "2"],
                            check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    section = (tmp_path / "http_results.md").read_text()
    for mode in ("engine in a process of its own", "engine in a thread of the server"):
        assert f"HTTP ({mode}) / engine generated tokens/s" in section, section
    assert section.count("requests with the same tokens in both runs: 8/8") == 2, section
    assert section.count("median of the repeats' ratios") == 2, section
