"""Structured output in the engine (``jaxattn.serve.structured_output``): a random tiny model's outputs
under a JSON schema, a regex or a list of choices always match, greedy or sampled, with and
without the overlap; requests without a grammar get the tokens they get alone; bad specs and
missing compilers are ValueErrors."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("llguidance", reason="needs the [serve] extra (pip install -e \".[test]\")")
import jsonschema

from jaxattn.serve.engine import Engine
from jaxattn.serve.sampling import SamplingBatch, SamplingParams, mask_logits, sample
from jaxattn.serve.structured_output import GrammarCompiler, StructuredOutputs, mask_words

# A schema whose language is finite (enums, bounded integers and strings, no free whitespace):
# every output completes within MAX_NEW tokens whatever the model prefers.
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
    "required": ["name", "age", "ok", "color"], "additionalProperties": False}
MAX_NEW = 48


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, tokenizer, compiler) of the servers' tiny checkpoint (byte-level BPE, 384 tokens)."""
    from jaxattn.serve.http.text import TextTokenizer
    from jaxattn.serve.models import from_pretrained
    from tests.serve.helpers import save_chat_checkpoint

    path = tmp_path_factory.mktemp("tiny-llama")
    save_chat_checkpoint(path)
    model = from_pretrained(path, dtype="float32")
    tokenizer = TextTokenizer(path)
    compiler = GrammarCompiler.from_file(path / "tokenizer.json", vocab_size=model.cfg.vocab_size,
                                         eos_token_ids=tokenizer.stop_token_ids)
    return model, tokenizer, compiler


def engine_of(tiny, **kwargs) -> Engine:
    model, _, compiler = tiny
    kwargs = dict(max_seqs=4, max_seq_len=96, page_size=8, max_step_tokens=32, backend="xla",
                  grammar_compiler=compiler) | kwargs
    return Engine(model, **kwargs)


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    requests = [engine.add_request(p, MAX_NEW, sampling=s) for p, s in zip(prompts, params)]
    engine.run()
    return requests


def prompts_of(tokenizer, n: int) -> list[list[int]]:
    texts = ["Paged attention keeps", "user: Hi there", "The server answers", "Once upon a time"]
    return [tokenizer.encode(texts[i % len(texts)] + " " * (i // len(texts))) for i in range(n)]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}


@pytest.mark.parametrize("overlap, speculative", [(True, None), (False, None), (True, NGRAM)])
def test_json_schema_outputs_validate(tiny, overlap, speculative):
    """Greedy and sampled requests under SCHEMA, beside plain ones: each grammar output is a JSON
    object SCHEMA accepts, ended by its grammar ("stop"); the plain requests get the tokens they
    get in an engine without structured output (with speculation, whose drafts steps with a
    grammar row skip, the greedy ones)."""
    _, tokenizer, _ = tiny
    prompts = prompts_of(tokenizer, 6)
    spec = StructuredOutputs(json=SCHEMA)
    params = [SamplingParams(structured_outputs=spec), SamplingParams(temperature=1.0, seed=3, structured_outputs=spec),
              SamplingParams(), SamplingParams(temperature=1.0, top_k=20, seed=5, structured_outputs=spec),
              SamplingParams(temperature=0.7, seed=9), SamplingParams(structured_outputs=spec)]
    requests = run(engine_of(tiny, overlap=overlap, speculative=speculative), prompts, params)
    for request, p in zip(requests, params):
        if p.structured_outputs is None:
            continue
        text = tokenizer.decode(request.output)
        assert request.finish_reason == "stop", (request.finish_reason, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    plain = [i for i, p in enumerate(params) if p.structured_outputs is None and (p.greedy or not speculative)]
    alone = run(engine_of(tiny, grammar_compiler=None), [prompts[i] for i in plain], [params[i] for i in plain])
    assert [requests[i].output for i in plain] == [r.output for r in alone]


def test_overlap_gives_the_same_tokens(tiny):
    _, tokenizer, _ = tiny
    prompts = prompts_of(tokenizer, 4)
    params = [SamplingParams(temperature=1.0, seed=i, structured_outputs=StructuredOutputs(json_object=True))
              for i in range(4)]
    outputs = [[r.output for r in run(engine_of(tiny, overlap=overlap), prompts, params)] for overlap in (True, False)]
    assert outputs[0] == outputs[1]


def test_regex_choice_and_json_object(tiny):
    _, tokenizer, _ = tiny
    prompts = prompts_of(tokenizer, 4)
    choices = ("Paris", "the Seine", "Loire")
    specs = [StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2}"), StructuredOutputs(choice=choices),
             StructuredOutputs(json_object=True), StructuredOutputs(grammar='start: "yes" | "no" " " NUMBER\n'
                                                                             'NUMBER: /[1-9][0-9]?/')]
    requests = run(engine_of(tiny), prompts, [SamplingParams(temperature=1.0, seed=1, structured_outputs=s)
                                              for s in specs])
    texts = [tokenizer.decode(r.output) for r in requests]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[0]) and requests[0].finish_reason == "stop", texts[0]
    assert texts[1] in choices and requests[1].finish_reason == "stop", texts[1]
    if requests[2].finish_reason == "stop":          # a free JSON object may be cut at MAX_NEW
        assert isinstance(json.loads(texts[2]), dict), texts[2]
    assert texts[2].startswith("{"), texts[2]
    assert re.fullmatch(r"yes|no [1-9][0-9]?", texts[3]), texts[3]


def test_choices_of_one_prompt(tiny):
    """n choices (Engine.add_choices) each have a grammar of their own; greedy ones agree."""
    _, tokenizer, _ = tiny
    engine = engine_of(tiny)
    spec = StructuredOutputs(json=SCHEMA)
    greedy = engine.add_choices(prompts_of(tokenizer, 1)[0], MAX_NEW, 2, sampling=SamplingParams(
        structured_outputs=spec))
    sampled = engine.add_choices(prompts_of(tokenizer, 1)[0], MAX_NEW, 3, sampling=SamplingParams(
        temperature=1.0, seed=7, structured_outputs=spec))
    engine.run()
    assert greedy[0].output == greedy[1].output
    for request in greedy + sampled:
        jsonschema.validate(json.loads(tokenizer.decode(request.output)), SCHEMA)


def test_bad_specs_and_missing_compiler(tiny):
    model, tokenizer, _ = tiny
    prompt = prompts_of(tokenizer, 1)[0]
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputs(json=SCHEMA, regex="a+")
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputs(choice="abc")
    with pytest.raises(ValueError, match="structured_outputs must be None or a StructuredOutputs"):
        SamplingParams(structured_outputs={"json": SCHEMA})
    engine = engine_of(tiny)
    for spec in (StructuredOutputs(json={"type": 5}), StructuredOutputs(regex="(unclosed"),
                 StructuredOutputs(grammar="start: undefined_rule")):
        with pytest.raises(ValueError, match="sampling.structured_outputs does not compile"):
            engine.add_request(prompt, 4, sampling=SamplingParams(structured_outputs=spec))
    with pytest.raises(ValueError, match="needs an Engine made with a grammar_compiler"):
        engine_of(tiny, grammar_compiler=None).add_request(prompt, 4, sampling=SamplingParams(
            structured_outputs=StructuredOutputs(json_object=True)))
    for vocab_size in (0, 5.0, True, None):
        with pytest.raises(ValueError, match="GrammarCompiler: vocab_size must be an int >= 1"):
            GrammarCompiler(tokenizer.tokenizer.to_str(), vocab_size=vocab_size)
    with pytest.raises(ValueError, match="GrammarCompiler: tokenizer_json must be the text"):
        GrammarCompiler(b"{}", vocab_size=384)
    with pytest.raises(ValueError, match="grammar_compiler.vocab_size must be the model's"):
        engine_of(tiny, grammar_compiler=GrammarCompiler(tokenizer.tokenizer.to_str(), vocab_size=500))
    assert not engine.has_work


def test_masked_logits_keep_to_the_mask():
    """``sampling.mask_logits``: greedy and sampled rows pick allowed tokens only, whatever the
    logits; a row of all ones is unchanged."""
    rng = np.random.default_rng(0)
    vocab, rows = 70, 6
    logits = jnp.asarray(rng.standard_normal((rows, vocab)).astype(np.float32))
    allowed_sets = [set(rng.choice(vocab, size=k, replace=False).tolist()) for k in (1, 2, 5, 33, 69)] + [None]
    masks = np.zeros((rows, mask_words(vocab)), np.int32)
    for i, tokens in enumerate(allowed_sets):
        for t in (range(vocab) if tokens is None else tokens):
            masks[i, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    for bad in (masks[:, :-1], masks[:-1], masks.astype(np.uint32), masks[None]):
        with pytest.raises(ValueError, match=r"mask_logits: allowed must be int32\[6, 3\]"):
            mask_logits(logits, jnp.asarray(bad))
    masked = mask_logits(logits, jnp.asarray(masks))
    np.testing.assert_array_equal(masked[-1], logits[-1])
    sampled = sample(masked, SamplingBatch.from_params([SamplingParams(temperature=1.0)] * rows, list(range(rows))),
                     jnp.arange(rows, dtype=jnp.int32))
    for tokens in (jnp.argmax(masked, axis=-1), sampled):
        for i, allowed in enumerate(allowed_sets[:-1]):
            assert int(tokens[i]) in allowed


def test_a_step_with_a_grammar_row_is_picked_apart(tiny):
    """A step whose rows are greedy, one under a grammar, is deferred (its tokens picked after
    the step, with token masks) and takes no sampler; the others' rows are not masked."""
    from jaxattn.serve.step import pack_step

    _, tokenizer, _ = tiny
    engine = engine_of(tiny)
    first = engine.add_request(prompts_of(tokenizer, 1)[0], 4, sampling=SamplingParams(
        structured_outputs=StructuredOutputs(json_object=True)))
    engine.add_request(prompts_of(tokenizer, 2)[1], 4)
    schedule = engine.scheduler.schedule()
    inputs = pack_step(schedule, engine.buckets.shape(schedule), max_seqs=engine.max_seqs, page_size=engine.page_size,
                       max_pages_per_seq=engine.runner.table.max_pages_per_seq, step_pages=engine.runner.step_pages,
                       previous_rows={})
    assert inputs.deferred and inputs.sampling is None and inputs.grammars == [(first.grammar, 0)]


def test_rows_under_a_grammar_decode_every_step(tiny):
    """With the overlap, a request under a grammar gets a token from every step, as a plain one
    does (its tokens are picked once the step before has advanced its grammar)."""
    _, tokenizer, _ = tiny
    engine = engine_of(tiny)
    plain, constrained = [engine.add_request(p, 40, sampling=SamplingParams(structured_outputs=spec)) for p, spec in
                          zip(prompts_of(tokenizer, 2), (None, StructuredOutputs(regex="[a-z]{60}")))]
    got = []                                        # per engine step: tokens each request got
    while engine.has_work:
        events = dict(engine.step_events())
        got.append((len(events.get(plain, [])), len(events.get(constrained, []))))
    assert constrained.finish_reason == "stop" and re.fullmatch("[a-z]{60}", tokenizer.decode(constrained.output))
    first = next(i for i, (_, n) in enumerate(got) if n)
    assert [n for _, n in got[first:first + len(constrained.output)]] == [1] * len(constrained.output), got


def test_nothing_compiles_after_the_warmup(tiny):
    """warmup compiles the deferred steps and their picks: a mix of grammar, sampled and
    logprobs requests then compiles nothing."""
    from jaxattn.serve.step import pick_tokens

    _, tokenizer, _ = tiny
    engine = engine_of(tiny)
    engine.warmup()
    compiled = engine.runner._step._cache_size(), pick_tokens._cache_size()
    spec = StructuredOutputs(json=SCHEMA)
    params = [SamplingParams(structured_outputs=spec), SamplingParams(temperature=1.0, seed=1, logprobs=2),
              SamplingParams(temperature=0.8, seed=2, structured_outputs=spec, logprobs=3), SamplingParams()]
    run(engine, prompts_of(tokenizer, 4), params)
    assert (engine.runner._step._cache_size(), pick_tokens._cache_size()) == compiled


def check_grammars_on_mesh() -> None:
    """(On 2 CPU devices.) Grammar requests on an engine over a mesh of both devices (logits split
    by vocabulary) get the one-device engine's tokens."""
    import pathlib
    import tempfile

    import jax

    from jaxattn.serve.http.text import TextTokenizer
    from jaxattn.serve.models import from_pretrained
    from tests.serve.helpers import save_chat_checkpoint

    path = pathlib.Path(tempfile.mkdtemp())
    save_chat_checkpoint(path)
    tokenizer = TextTokenizer(path)
    spec = StructuredOutputs(json=SCHEMA)
    params = [SamplingParams(structured_outputs=spec), SamplingParams(temperature=1.0, seed=3, structured_outputs=spec),
              SamplingParams()]
    outputs = []
    for mesh in (None, jax.make_mesh((2,), ("tp",))):
        model = from_pretrained(path, dtype="float32", mesh=mesh)
        compiler = GrammarCompiler.from_file(path / "tokenizer.json", vocab_size=model.cfg.vocab_size,
                                             eos_token_ids=tokenizer.stop_token_ids)
        engine = Engine(model, max_seqs=4, max_seq_len=96, page_size=8, max_step_tokens=32, backend="xla",
                        grammar_compiler=compiler, mesh=mesh)
        outputs.append([r.output for r in run(engine, prompts_of(tokenizer, 3), params)])
    assert outputs[0] == outputs[1]
    for output in outputs[1][:2]:
        jsonschema.validate(json.loads(tokenizer.decode(output)), SCHEMA)


def test_grammars_on_two_cpu_devices():
    from tests.test_sharding import run_on_cpu_devices

    run_on_cpu_devices(2, "from tests.serve.test_structured_output import check_grammars_on_mesh; "
                          "check_grammars_on_mesh()")


def test_preempted_grammar_requests_get_the_same_tokens(tiny):
    """A pool too small for every request preempts some (recomputed later, their grammars kept):
    their greedy outputs are those of an engine with room for all, and still validate."""
    _, tokenizer, _ = tiny
    prompts = prompts_of(tokenizer, 4)
    params = [SamplingParams(structured_outputs=StructuredOutputs(json=SCHEMA))] * 3 + [SamplingParams()]
    roomy = [r.output for r in run(engine_of(tiny), prompts, params)]
    small = engine_of(tiny, num_pages=14)
    outputs = [r.output for r in run(small, prompts, params)]
    assert small.stats["preemptions"] > 0 and outputs == roomy
    for output in outputs[:3]:
        jsonschema.validate(json.loads(tokenizer.decode(output)), SCHEMA)
