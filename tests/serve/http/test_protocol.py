"""What a client can send the HTTP server, in process (``fastapi.testclient``, one engine over a
tiny checkpoint): malformed text, non-finite numbers, oversized and deeply nested bodies, fields
the server does not implement get a 4xx naming the field; unknown fields are ignored; logprobs
are the model's (a dense float64 reference), streamed or not; a property-based fuzz of request
bodies gets no 5xx; a long prompt is tokenized off the event loop (the server answers meanwhile)
and an oversized one is a 413 before it is read."""

from __future__ import annotations

import json
import math
import re
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="needs the [serve] extra (pip install -e \".[test]\")")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxattn.serve.http.protocol import APIError, ChatRequest, CompletionRequest, parse_body
from tests.serve.models.test_llama import dense_logprobs

MAX_SEQ_LEN = 96
MAX_REQUEST_BYTES = 4 * 2**20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the tiny checkpoint's directory, its model in float32, its TextTokenizer)."""
    from jaxattn.serve.http.text import TextTokenizer
    from jaxattn.serve.models import from_pretrained
    from tests.serve.helpers import save_chat_checkpoint

    path = tmp_path_factory.mktemp("tiny-llama")
    save_chat_checkpoint(path)
    return path, from_pretrained(path, dtype="float32"), TextTokenizer(path)


@pytest.fixture(scope="module")
def http(checkpoint):
    """A TestClient of the app over the checkpoint's engine (its thread runs while the module's
    tests do), its tokenizer and grammar compiler included, bodies limited to MAX_REQUEST_BYTES."""
    with app_client(checkpoint) as client:
        yield client


def app_client(checkpoint, **engine_args):
    """A TestClient context of the app over an engine of the checkpoint (``engine_args`` added),
    with the tokenizer and grammar compiler, bodies limited to MAX_REQUEST_BYTES."""
    from fastapi.testclient import TestClient

    from jaxattn.serve.engine import Engine
    from jaxattn.serve.http.app import build_app
    from jaxattn.serve.structured_output import GrammarCompiler

    path, model, tokenizer = checkpoint
    compiler = GrammarCompiler.from_file(path / "tokenizer.json", vocab_size=model.cfg.vocab_size,
                                         eos_token_ids=tokenizer.stop_token_ids)
    engine = Engine(model, max_seqs=4, max_seq_len=MAX_SEQ_LEN, page_size=8, max_step_tokens=8, backend="xla",
                    grammar_compiler=compiler, **engine_args)
    engine.warmup()
    app = build_app(engine, model_name="tiny", tokenizer=tokenizer, max_request_bytes=MAX_REQUEST_BYTES)
    return TestClient(app)


def post(http, body: bytes | str | dict, endpoint: str = "completions"):
    if isinstance(body, dict):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    return http.post(f"/v1/{endpoint}", content=body, headers={"content-type": "application/json"})


def refused(response, status: int, param: str | None) -> str:
    """The error message of ``response``, after checking its status, body and ``param``."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] and error["message"], error
    if param is not None:
        assert error["message"].startswith(param), error
    return error["message"]


COMPLETION = '{"model": "tiny", "max_tokens": 2, "prompt": %s}'
CHAT = '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": %s}]}'

# (endpoint, raw body, status, the field the error names, a piece of its message)
MALFORMED = [
    ("completions", COMPLETION % '"a\\ud800b"', 400, "prompt", "surrogate"),
    ("completions", COMPLETION % '"\\udfff"', 400, "prompt", "surrogate"),
    ("chat/completions", CHAT % '"a\\ud800b"', 400, "messages", "messages[0].content"),
    ("chat/completions", CHAT % '[{"type": "text", "text": "\\udc00"}]', 400, "messages", "surrogate"),
    ("completions", '{"model": "tiny", "prompt": "a", "\\ud800": 1}', 400, None, "a field name"),
    ("completions", '{"model": "tiny", "prompt": "a", "metadata": {"\\ud800": 1}}', 400, "metadata", "key"),
    ("completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None, "not UTF-8"),
    ("completions", b'{"model": "tiny", "prompt": "\xed\xa0\x80"}', 400, None, "not UTF-8"),  # an encoded surrogate
    ("completions", '{"model": "tiny", "prompt": "a", "temperature": Infinity}', 400, "temperature", "finite"),
    ("completions", '{"model": "tiny", "prompt": "a", "temperature": NaN}', 400, "temperature", "finite"),
    ("completions", '{"model": "tiny", "prompt": "a", "top_p": -Infinity}', 400, "top_p", "finite"),
    ("completions", '{"model": "tiny", "prompt": "a", "temperature": 1e999}', 400, "temperature", "finite"),
    ("completions", '{"model": "tiny", "prompt": "a", "user": {"x": [NaN]}}', 400, "user", "user.x[0]"),
    ("completions", '{"model": "tiny", "prompt": "a", "max_tokens": %s}' % ("9" * 5000), 400, None, "4300 digits"),
    ("completions", "[" * 100_000 + "]" * 100_000, 400, None, "too deeply"),
    ("completions", '{"model": "tiny", "prompt": ', 400, None, "not valid JSON"),
    ("completions", "null", 400, None, "got null"),
    ("completions", '"text"', 400, None, "got a string"),
    ("completions", '{"model": "tiny", "prompt": "a", "top_k": 4294967296}', 400, "top_k", "less than"),
    ("completions", '{"model": "tiny", "prompt": [1, 4294967296]}', 400, "prompt", "less than"),
    # token ids with one value that is no int: the list is walked (a list of ints alone is not)
    ("completions", '{"model": "tiny", "prompt": [1, 2, NaN]}', 400, "prompt", "prompt[2]"),
    ("completions", '{"model": "tiny", "prompt": [1, true, "\\ud800"]}', 400, "prompt", "surrogate"),
    ("completions", '{"model": "tiny", "prompt": "a", "stop_token_ids": [-1]}', 400, "stop_token_ids", ""),
]


@pytest.mark.parametrize("endpoint,body,status,param,says", MALFORMED)
def test_malformed_bodies_get_a_400_naming_the_field(http, endpoint, body, status, param, says):
    assert says in refused(post(http, body, endpoint), status, param)


# Fields that change what is returned: refused unless null or at their default, never ignored.
UNIMPLEMENTED = [
    ("completions", {"best_of": 3}), ("chat/completions", {"echo": True}), ("completions", {"suffix": "x"}),
    ("completions", {"presence_penalty": 0.5}), ("completions", {"presence_penalty": False}),
    ("completions", {"logit_bias": {"5": 100}}), ("completions", {"min_p": 0.1}),
    ("completions", {"repetition_penalty": 1.2}),
    ("completions", {"skip_special_tokens": False}),
    ("chat/completions", {"functions": [{"name": "f"}]}), ("chat/completions", {"add_generation_prompt": False}),
    ("chat/completions", {"chat_template": "{{ messages }}"}),
]
ACCEPTED_DEFAULTS = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0, "logit_bias": {},
                     "response_format": {"type": "text"}, "best_of": 1, "echo": False, "min_tokens": 0}


@pytest.mark.parametrize("endpoint,extra", UNIMPLEMENTED, ids=lambda v: v if isinstance(v, str) else next(iter(v)))
def test_fields_that_would_change_the_answer_are_refused(http, endpoint, extra):
    base = {"model": "tiny", "max_tokens": 2, **({"prompt": "Hi"} if endpoint == "completions" else
                                               {"messages": [{"role": "user", "content": "Hi"}]})}
    (name,) = extra
    assert "does not implement" in refused(post(http, {**base, **extra}, endpoint), 400, name)


def test_defaults_and_unknown_fields_are_accepted(http, caplog):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, **ACCEPTED_DEFAULTS, "user": "u1",
            "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}
    with caplog.at_level("WARNING", logger="jaxattn.serve"):
        assert post(http, body).status_code == 200
        assert post(http, body).status_code == 200
    ignored = [r.getMessage() for r in caplog.records if "is not one this server knows" in r.getMessage()]
    assert sum("'service_tier'" in m for m in ignored) <= 1, ignored      # once per name, not per request


def test_stop_token_ids_end_the_request_after_min_tokens(http):
    out = post(http, {"model": "tiny", "prompt": "Paged attention", "max_tokens": 8, "temperature": 0,
                      "ignore_eos": True, "return_token_ids": True}).json()["choices"][0]
    first = out["token_ids"][0]
    stopped = post(http, {"model": "tiny", "prompt": "Paged attention", "max_tokens": 8, "temperature": 0,
                          "ignore_eos": True, "return_token_ids": True, "stop_token_ids": [first]}).json()
    assert stopped["choices"][0]["token_ids"] == [first] and stopped["choices"][0]["finish_reason"] == "stop"
    held = post(http, {"model": "tiny", "prompt": "Paged attention", "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True, "stop_token_ids": [first],
                       "min_tokens": 3}).json()["choices"][0]
    assert first not in held["token_ids"][:3] and len(held["token_ids"]) >= 3
    refused(post(http, {"model": "tiny", "prompt": "Paged attention", "max_tokens": 2, "min_tokens": 3}), 400,
            "min_tokens")


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_completion_logprobs(http, checkpoint, temperature):
    """``logprobs: 3``: per generated token its text, log-probability and the 3 most likely
    alternatives of the model's distribution (within 2e-3 of a float64 log-softmax of the dense
    model's logits), and text offsets; streamed chunks carry the same."""
    _, model, tokenizer = checkpoint
    body = {"model": "tiny", "prompt": "Paged attention keeps", "max_tokens": 6, "temperature": temperature,
            "seed": 5, "logprobs": 3, "return_token_ids": True, "ignore_eos": True}
    out = post(http, body).json()
    choice, prompt = out["choices"][0], out["prompt_token_ids"]
    ids, logprobs = choice["token_ids"], choice["logprobs"]
    reference = dense_logprobs(model, prompt, ids)
    assert logprobs["tokens"] == [tokenizer.token_text(t) for t in ids]
    np.testing.assert_allclose(logprobs["token_logprobs"], reference[np.arange(len(ids)), ids], atol=2e-3)
    for row, top in zip(reference, logprobs["top_logprobs"]):
        best = np.argsort(-row)[:3]
        assert list(top) == [tokenizer.token_text(t) for t in best]
        np.testing.assert_allclose(list(top.values()), row[best], atol=2e-3)
    assert logprobs["text_offset"] == np.cumsum([0] + [len(t) for t in logprobs["tokens"][:-1]]).tolist()
    if temperature == 0:
        assert logprobs["token_logprobs"] == [max(top.values()) for top in logprobs["top_logprobs"]]

    events = [json.loads(line[len("data: "):]) for line in post(http, {**body, "stream": True}).text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((chunk[key] for chunk in streamed), []) == logprobs[key], key


def test_chat_logprobs(http, checkpoint):
    """``logprobs: true, top_logprobs: 2``: ``content[*]`` with token, logprob, bytes and the 2 most
    likely alternatives; without top_logprobs, none; the answer's tokens as without logprobs."""
    _, model, tokenizer = checkpoint
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4,
            "temperature": 0, "return_token_ids": True}
    plain = post(http, body, "chat/completions").json()
    out = post(http, {**body, "logprobs": True, "top_logprobs": 2}, "chat/completions").json()
    choice = out["choices"][0]
    assert plain["choices"][0]["logprobs"] is None and choice["token_ids"] == plain["choices"][0]["token_ids"]
    reference = dense_logprobs(model, out["prompt_token_ids"], choice["token_ids"])
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [tokenizer.token_text(t) for t in choice["token_ids"]]
    for item, row, token in zip(content, reference, choice["token_ids"]):
        assert item["bytes"] == list(item["token"].encode()) and abs(item["logprob"] - row[token]) < 2e-3
        assert [t["token"] for t in item["top_logprobs"]] == [tokenizer.token_text(t) for t in np.argsort(-row)[:2]]
    alone = post(http, {**body, "logprobs": True}, "chat/completions").json()["choices"][0]["logprobs"]["content"]
    assert [c["top_logprobs"] for c in alone] == [[]] * len(content)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_n_choices(http, endpoint):
    """``n: 3``: three choices, indexed, the greedy ones identical, the usage counting the prompt
    once and every choice's tokens; streamed, each index's chunks make its choice (a chat's start
    with its role); sampled choices with a seed differ and repeat."""
    chat = endpoint == "chat/completions"
    body = {"model": "tiny", "max_tokens": 5, "temperature": 0, "n": 3, "return_token_ids": True,
            "ignore_eos": True, **({"messages": [{"role": "user", "content": "Hi there"}]} if chat else
                                   {"prompt": "Paged attention keeps"})}
    out = post(http, body, endpoint).json()
    texts = [c["message"]["content"] if chat else c["text"] for c in out["choices"]]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2] and len(set(texts)) == 1
    assert len({tuple(c["token_ids"]) for c in out["choices"]}) == 1
    assert out["usage"]["completion_tokens"] == 15
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 15 == len(out["prompt_token_ids"]) + 15

    events = [json.loads(line[len("data: "):]) for line in post(http, {**body, "stream": True}, endpoint).text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    for i, text in enumerate(texts):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == i]
        if chat:
            assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") if chat else c["text"] for c in mine) == text
        assert mine[-1]["finish_reason"] == "length"

    sampled = {**body, "temperature": 1.0, "seed": 11, "stream": False}
    first, again = (post(http, sampled, endpoint).json()["choices"] for _ in range(2))
    assert [c["token_ids"] for c in first] == [c["token_ids"] for c in again]
    assert len({tuple(c["token_ids"]) for c in first}) > 1


YES_NO = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 99}},
          "required": ["answer", "n"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(http, stream):
    """A chat with a JSON schema answers JSON the schema accepts, ended by its grammar; the same
    streamed; json_object answers an object (or its start, cut at max_tokens)."""
    import jsonschema

    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0.8,
            "seed": 3, "n": 2, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": YES_NO}}}
    response = post(http, body, "chat/completions")
    assert response.status_code == 200, response.text
    texts, finish = ["", ""], [None, None]
    if stream:
        for line in response.text.splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["delta"].get("content") or ""
                    finish[choice["index"]] = choice["finish_reason"] or finish[choice["index"]]
    else:
        for choice in response.json()["choices"]:
            texts[choice["index"]], finish[choice["index"]] = choice["message"]["content"], choice["finish_reason"]
    for text in texts:
        jsonschema.validate(json.loads(text), YES_NO)
    assert finish == ["stop", "stop"]
    out = post(http, {"model": "tiny", "prompt": "Hi", "max_tokens": 12, "temperature": 0,
                      "response_format": {"type": "json_object"}}).json()["choices"][0]
    assert out["text"].startswith("{") and (out["finish_reason"] == "length" or isinstance(json.loads(out["text"]),
                                                                                           dict)), out


def test_structured_outputs_regex_and_choice(http):
    """vLLM's structured_outputs (and its older guided_* fields): a regex and a list of choices,
    on completions."""
    out = post(http, {"model": "tiny", "prompt": "Hi", "max_tokens": 12, "temperature": 1.0, "seed": 1,
                      "structured_outputs": {"regex": "[0-9]{2}-[a-z]{3}"}}).json()["choices"][0]
    assert re.fullmatch("[0-9]{2}-[a-z]{3}", out["text"]) and out["finish_reason"] == "stop", out
    out = post(http, {"model": "tiny", "prompt": "Hi", "max_tokens": 12, "temperature": 1.0, "seed": 2,
                      "structured_outputs": {"choice": ["Paris", "the Seine"]}}).json()["choices"][0]
    assert out["text"] in ("Paris", "the Seine") and out["finish_reason"] == "stop", out
    out = post(http, {"model": "tiny", "prompt": "Hi", "max_tokens": 12, "temperature": 1.0, "seed": 3,
                      "guided_regex": "[a-z]{4}!"}).json()["choices"][0]
    assert re.fullmatch("[a-z]{4}!", out["text"]) and out["finish_reason"] == "stop", out
    out = post(http, {"model": "tiny", "prompt": "Hi", "max_tokens": 12, "temperature": 0,
                      "guided_choice": ["yes", "no"]}).json()["choices"][0]
    assert out["text"] in ("yes", "no"), out


@pytest.mark.parametrize("endpoint,extra,param,says", [
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": 5}}}}, "response_format", "type must be a string"),
    ("chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema is given"),
    ("chat/completions", {"response_format": {"type": "xml"}}, "response_format", "type"),
    ("completions", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "not several"),
    ("completions", {"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex", "not several"),
    ("completions", {"guided_json": {"type": 5}}, "guided_json", "does not compile"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ("completions", {"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ("completions", {"structured_outputs": {"regex": "(a"}}, "structured_outputs", "does not compile"),
    ("completions", {"structured_outputs": {"choice": []}}, "structured_outputs", "at least 1"),
    ("completions", {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "not permitted"),
])
def test_bad_structured_output_is_a_400(http, endpoint, extra, param, says):
    base = {"model": "tiny", "max_tokens": 2, **({"prompt": "Hi"} if endpoint == "completions" else
                                               {"messages": [{"role": "user", "content": "Hi"}]})}
    assert says in refused(post(http, {**base, **extra}, endpoint), 400, param)


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]


def stream_events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_calls_that_function(http, stream):
    """tool_choice naming a function: the answer is a call of it, arguments its schema accepts."""
    import jsonschema

    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24, "temperature": 0.9,
            "seed": 4, "tools": TOOLS, "stream": stream,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    response = post(http, body, "chat/completions")
    assert response.status_code == 200, response.text
    if stream:
        events = stream_events(response)
        assert all("content" not in e["choices"][0]["delta"] or e["choices"][0]["delta"]["content"] in ("", None)
                   for e in events), events
        (last,) = [e["choices"][0] for e in events if e["choices"][0]["finish_reason"]]
        calls, finish = last["delta"]["tool_calls"], last["finish_reason"]
        assert [c.pop("index") for c in calls] == [0]
    else:
        (choice,) = response.json()["choices"]
        assert choice["message"]["content"] is None
        calls, finish = choice["message"]["tool_calls"], choice["finish_reason"]
    (call,) = calls
    assert finish == "stop" and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)


@pytest.mark.parametrize("parallel", [None, False])
def test_required_tool_choice_calls_the_tools(http, parallel):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 1.0,
            "seed": 5, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": parallel}
    response = post(http, body, "chat/completions")
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    if choice["finish_reason"] == "length":        # a free number of calls may be cut at max_tokens
        assert choice["message"]["content"].startswith("[")
        return
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and len(calls) >= 1 and (parallel is not False or len(calls) == 1)
    for call in calls:
        assert call["function"]["name"] in ("get_weather", "get_time")
        assert set(json.loads(call["function"]["arguments"])) <= {"city", "zone"}


@pytest.mark.parametrize("extra,param,says", [
    ({"tools": TOOLS}, "tool_choice", '"auto"'),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", '"auto"'),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tools": TOOLS[:1] * 2, "tool_choice": "required"}, "tools", "same name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools", "not with"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}], "tool_choice":
      "required"}, "tools", "does not compile"),
    ({"tools": [{"type": "code_interpreter"}], "tool_choice": "required"}, "tools", "function"),
])
def test_bad_tool_requests_are_a_400(http, extra, param, says):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra}
    assert says in refused(post(http, body, "chat/completions"), 400, param)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_starts_the_text_with_the_prompt(http, stream):
    body = {"model": "tiny", "prompt": "Paged attention", "max_tokens": 4, "temperature": 0, "n": 2, "stream": stream}
    plain = post(http, {**body, "stream": False}).json()["choices"][0]["text"]
    response = post(http, {**body, "echo": True})
    assert response.status_code == 200, response.text
    texts = ["", ""]
    if stream:
        for event in stream_events(response):
            for choice in event["choices"]:
                texts[choice["index"]] += choice["text"]
    else:
        for choice in response.json()["choices"]:
            texts[choice["index"]] = choice["text"]
    assert texts == ["Paged attention" + plain] * 2
    assert "logprobs" in refused(post(http, {**body, "echo": True, "logprobs": 1}), 400, "echo")


def test_tool_plan_reads_only_complete_calls():
    """ToolPlan.calls: the calls of a complete output; None for one cut or of another shape."""
    from jaxattn.serve.http.tools import ToolPlan

    required, named = ToolPlan(None, TOOLS), ToolPlan("get_weather", TOOLS)
    (call,) = required.calls('[{"name": "get_time", "parameters": {"zone": "UTC"}}]')
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'} and call["type"] == "function"
    assert named.calls('{"city": "Rome"}')[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    for text in ('[{"name": "get_time", "parameters": {"zo', "[1]", '[{"name": "get_time"}]', '{"name": "x"}', ""):
        assert required.calls(text) is None, text
    assert named.calls('{"city": "Ro') is None
    assert (required.finish_reason, named.finish_reason) == ("tool_calls", "stop")
    assert ToolPlan(None, TOOLS, parallel=False).constraint.json.count('"maxItems": 1') == 1


def test_tool_choice_none_answers_text(http):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
            "tools": TOOLS, "tool_choice": "none"}
    (choice,) = post(http, body, "chat/completions").json()["choices"]
    assert isinstance(choice["message"]["content"], str) and "tool_calls" not in choice["message"]


def test_parse_body_alone():
    """parse_body without HTTP: the request types, their defaults, an APIError naming the field."""
    request = parse_body(b'{"model": "m", "prompt": [1, 2], "user": "x"}', CompletionRequest)
    assert request.prompt == [1, 2] and request.max_tokens == 16 and request.stop_strings == ()
    chat = parse_body(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                  "stop": "x"}).encode(), ChatRequest)
    assert chat.stop_strings == ("x",) and chat.token_limit is None
    with pytest.raises(APIError) as err:
        parse_body(b'{"model": "m", "messages": [], "functions": [{}]}', ChatRequest)
    assert err.value.param == "functions" and err.value.status == 400


def test_an_oversized_body_is_a_413_and_a_long_prompt_stalls_no_one(http):
    """A body over the limit is refused from its Content-Length; a long prompt under it (about
    3 MB of text: seconds of tokenizing) is tokenized in a worker thread while /health and a short
    request are answered within a second each."""
    big = "x" * (MAX_REQUEST_BYTES + 1)
    start = time.monotonic()
    refused(post(http, {"model": "tiny", "prompt": big}), 413, None)
    assert time.monotonic() - start < 5

    words = "Paged attention keeps the keys and values of every sequence in pages; "
    long_prompt = {"model": "tiny", "prompt": words * (3_000_000 // len(words))}
    answers = {}
    worker = threading.Thread(target=lambda: answers.setdefault("long", post(http, long_prompt)))
    worker.start()
    time.sleep(0.3)                                  # the long request is being tokenized
    latencies = []
    while worker.is_alive() and len(latencies) < 50:
        start = time.monotonic()
        assert http.get("/health").status_code == 200
        latencies.append(time.monotonic() - start)
        time.sleep(0.05)
    worker.join()
    assert "max_seq_len" in refused(answers["long"], 400, "prompt")
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies


# ------------------------------------------------------------------------------------------ fuzz

# Any code point (lone surrogates too, rare there), and short texts full of surrogates and JSON's
# own characters.
_TEXT = (st.text(st.characters(exclude_categories=()), max_size=12)
         | st.text(st.sampled_from('ab \ud800\udc00{}"\\\x00'), max_size=6))
_SCALARS = (st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True, allow_infinity=True)
            | _TEXT)
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                     max_leaves=6)
_TOKEN_IDS = st.lists(st.integers(-2, 400), min_size=0, max_size=30)
_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]) | _TEXT},
                                           optional={"content": _TEXT | st.none() | _JSON, "name": _JSON}),
                     max_size=3)
# Each known field: plausible values, mostly in range, and any JSON value now and then.
_FIELDS = {
    "model": st.just("tiny") | _TEXT, "prompt": _TEXT | _TOKEN_IDS, "messages": _MESSAGES,
    "max_tokens": st.integers(-1, 30) | st.none(), "max_completion_tokens": st.integers(-1, 30),
    "temperature": st.floats(-1, 3) | st.sampled_from([0, 1e-30, 1e30, float("inf"), float("nan")]),
    "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-3, 2**32), "seed": st.integers(-1, 2**33),
    "stop": _TEXT | st.lists(_TEXT, max_size=3), "stop_token_ids": _TOKEN_IDS, "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _JSON,
    "ignore_eos": st.booleans(), "return_token_ids": st.booleans(), "n": st.integers(0, 3),
    "logprobs": st.booleans() | st.integers(0, 5), "top_logprobs": st.integers(0, 5), "echo": st.booleans(),
    "presence_penalty": st.floats(-2, 2), "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"])},
        optional={"json_schema": st.fixed_dictionaries({"name": _TEXT}, optional={"schema": _JSON})}),
    "structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "json_object"]),
                                          _JSON | _TEXT, max_size=2),
    "tools": _JSON | st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "g"])}, optional={"parameters": _JSON})}), max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required",
                                    {"type": "function", "function": {"name": "f"}}]) | _JSON,
    "parallel_tool_calls": st.booleans(), "guided_regex": _TEXT, "guided_choice": st.lists(_TEXT, max_size=3),
    "guided_json": _JSON, "user": _JSON,
}


@st.composite
def _bodies(draw) -> tuple[str, bytes]:
    """(endpoint, raw body): a JSON object of known and unknown fields (any value now and then,
    NaN and lone surrogates serialized as Python's json writes them), sometimes cut or corrupted."""
    endpoint = draw(st.sampled_from(["completions", "chat/completions"]))
    names = draw(st.lists(st.sampled_from(sorted(_FIELDS)), max_size=8, unique=True))
    body = {"model": "tiny", **({"prompt": "Hi"} if endpoint == "completions" else
                                {"messages": [{"role": "user", "content": "Hi"}]})}
    for name in names:
        body[name] = draw(_JSON) if draw(st.integers(0, 9)) == 0 else draw(_FIELDS[name])
    if draw(st.booleans()):
        body.update(draw(st.dictionaries(_TEXT, _JSON, max_size=2)))
    if body.get("max_tokens") is None or not isinstance(body.get("max_tokens"), int) or body["max_tokens"] > 4:
        body.setdefault("max_completion_tokens", 4)
    raw = json.dumps(body).encode()
    mutation = draw(st.integers(0, 9))
    if mutation == 0:
        raw = raw[:draw(st.integers(0, len(raw)))]
    elif mutation == 1:
        at = draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at + 1:]
    return endpoint, raw


@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=_bodies())
def test_fuzzed_bodies_get_no_5xx(http, case):
    endpoint, raw = case
    response = post(http, raw, endpoint)
    assert response.status_code < 500, (raw, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]["message"], response.text
    elif "text/event-stream" in response.headers["content-type"]:
        events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", (raw, response.text)
    else:
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length"), response.text
        assert all(math.isfinite(v) for v in response.json()["usage"].values())


def test_a_speculating_server_answers_the_same_greedy_tokens(http, checkpoint):
    """With n-gram speculation (``--speculative-config``'s engine), greedy completions, streamed or
    not, with a stop token, n choices and a JSON schema beside them, carry the tokens the server
    without speculation answers."""
    import jsonschema

    bodies = [{"prompt": "the pages the pages the pages the", "max_tokens": 24},
              {"prompt": "Paged attention", "max_tokens": 16, "stream": True},
              {"prompt": "a b a b a b", "max_tokens": 20, "n": 2},
              {"prompt": "Hi", "max_tokens": 20, "stop_token_ids": [40]}]
    bodies = [{"model": "tiny", "temperature": 0, "ignore_eos": True, "return_token_ids": True} | b for b in bodies]
    schema = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40,
              "response_format": {"type": "json_schema", "json_schema": {"name": "yes_no", "schema": YES_NO}}}

    def token_ids(client, body) -> list[list[int]]:
        response = post(client, body)
        assert response.status_code == 200, response.text
        if not body.get("stream"):
            return [choice["token_ids"] for choice in response.json()["choices"]]
        ids = []
        for line in response.text.splitlines():
            if line.startswith("data: {"):
                ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
        return [ids]

    expected = [token_ids(http, body) for body in bodies]
    assert all(ids for choices in expected for ids in choices)
    with app_client(checkpoint, speculative={"method": "ngram", "num_speculative_tokens": 3,
                                             "prompt_lookup_max": 2}) as speculating:
        assert [token_ids(speculating, body) for body in bodies] == expected
        answer = post(speculating, schema, "chat/completions").json()["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(answer), YES_NO)
