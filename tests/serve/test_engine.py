"""The engine: continuous batching with chunked prefill gives the dense model's greedy tokens."""

from __future__ import annotations

import dataclasses
import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxattn
from jaxattn import attention as attention_module
from jaxattn import dispatch
from jaxattn.serve.engine import MAX_CHOICES, Engine, Request
from jaxattn.serve.models.deepseek import PRESETS as DEEPSEEK_PRESETS
from jaxattn.serve.models.deepseek import DeepSeek
from jaxattn.serve.models.llama import PRESETS, Llama, forward_paged
from jaxattn.serve.sampling import SamplingParams
from tests.conftest import HAS_GPU
from tests.paged_inputs import rel_error
from tests.serve.models.test_llama import dense_greedy, dense_hidden, dense_logprobs
from tests.serve.test_step import trace_step
from tests.test_sharding import run_on_cpu_devices
from tests.xla_dump import run_with_dump, thunk_sequences, top_level_thunks


def test_continuous_batching_matches_dense_greedy():
    model = Llama(PRESETS["tiny"], nnx.Rngs(0))
    rng = np.random.default_rng()
    # more requests than slots, prompts longer than a chunk, different lengths
    engine = Engine(model, max_seqs=3, max_seq_len=48, page_size=8, max_step_tokens=16, backend="xla")
    requests = [engine.add_request(rng.integers(0, 512, size=n), m)
                for n, m in ((5, 4), (33, 3), (1, 6), (20, 2), (17, 5))]
    done = engine.run()
    assert [r.id for r in done] == [r.id for r in requests]
    for r in done:
        assert r.output == dense_greedy(model, r.prompt, r.max_new_tokens), r.id
    # everything is released once the next step runs: the pool drains back to free and cached pages
    engine.add_request([1, 2, 3], 1)
    engine.run()
    engine.step()
    check_drained(engine)


def check_host_view(engine: Engine) -> None:
    """Between steps: each running request's pages and length are the device table's, and the
    cached pages are the host's (less those it marks in the next step)."""
    tables, lens = np.asarray(engine.runner.table.block_tables), np.asarray(engine.runner.table.seq_lens)
    for r in engine.scheduler.running:
        assert lens[r.slot] == r.computed and len(r.blocks) == -(-r.computed // engine.page_size)
        known = np.asarray(r.blocks) > 0
        np.testing.assert_array_equal(tables[r.slot, :len(r.blocks)][known], np.asarray(r.blocks)[known])
    cached = set(np.nonzero(np.asarray(engine.runner.table.cached))[0].tolist())
    assert cached == set(engine.scheduler.pool.key_of) - set(engine.scheduler.to_mark)


def check_drained(engine: Engine) -> None:
    """After an idle step: no page is held, and the host's view of the pool is the device's."""
    table, pool = engine.runner.table, engine.scheduler.pool
    cached = np.asarray(table.cached)
    assert not np.asarray(table.refcount).any() and not np.asarray(table.seq_lens).any()
    assert int(table.num_free) == pool.free
    assert set(np.nonzero(cached)[0].tolist()) == set(pool.evictable) == set(pool.key_of)
    assert int(table.num_free) + int(cached.sum()) == table.num_pages - 1


def _outputs(model: Llama, requests: list[tuple[np.ndarray, int, SamplingParams | None]], **engine_args) -> list:
    engine = Engine(model, **{**dict(max_seqs=3, max_seq_len=48, page_size=8, max_step_tokens=16, backend="xla"),
                              **engine_args})
    handles = [engine.add_request(prompt, n, sampling=sampling) for prompt, n, sampling in requests]
    engine.run()
    return [r.output for r in handles]


def test_top_k_1_and_a_tiny_temperature_are_greedy():
    model = Llama(PRESETS["tiny"], nnx.Rngs(0))
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 512, size=n) for n in (5, 20, 9)]
    greedy = _outputs(model, [(p, 6, None) for p in prompts])
    for sampling in (SamplingParams(temperature=1.5, top_k=1, seed=3), SamplingParams(temperature=1e-6, top_p=0.5)):
        assert _outputs(model, [(p, 6, sampling) for p in prompts]) == greedy, sampling


def test_a_seed_gives_the_same_tokens_whatever_else_is_in_the_batch():
    model = Llama(PRESETS["tiny"], nnx.Rngs(0))
    rng = np.random.default_rng()
    prompt = rng.integers(0, 512, size=13)
    sampling = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = _outputs(model, [(prompt, 12, sampling)])[0]
    others = [(rng.integers(0, 512, size=n), 7, s)
              for n, s in ((30, SamplingParams(temperature=0.8, seed=5)), (4, None), (17, SamplingParams(temperature=2.0)))]
    crowded = _outputs(model, others[:2] + [(prompt, 12, sampling)] + others[2:], max_seqs=2)
    assert crowded[2] == alone
    assert crowded[2] != _outputs(model, [(prompt, 12, None)])[0], "sampled like greedy: is sampling on?"


def test_stop_token_ends_a_request_and_is_its_last_token():
    model = Llama(PRESETS["tiny"], nnx.Rngs(0))
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 512, size=n) for n in (5, 20, 9)]
    greedy = _outputs(model, [(p, 8, None) for p in prompts])
    stop = greedy[1][3]
    engine = Engine(model, max_seqs=3, max_seq_len=48, page_size=8, max_step_tokens=16, backend="xla")
    requests = [engine.add_request(p, 8, sampling=SamplingParams(stop_token_ids=(stop, 511))) for p in prompts]
    engine.run()
    for request, expected in zip(requests, greedy):
        if stop in expected:
            assert request.output == expected[:expected.index(stop) + 1] and request.finish_reason == "stop"
        else:
            assert request.output == expected and request.finish_reason == "length"
    engine.step()
    check_drained(engine)


def test_stream_yields_each_token_as_it_comes():
    model = Llama(PRESETS["tiny"], nnx.Rngs(0))
    rng = np.random.default_rng()
    engine = Engine(model, max_seqs=3, max_seq_len=48, page_size=8, max_step_tokens=16, backend="xla")
    requests = [engine.add_request(rng.integers(0, 512, size=n), m) for n, m in ((5, 4), (33, 3), (1, 6))]
    streamed: dict[int, list[int]] = {}
    finished: set[int] = set()
    for request, new_tokens in engine.stream():
        assert request.id not in finished and len(new_tokens) == 1
        if request.done:
            finished.add(request.id)
        streamed.setdefault(request.id, []).extend(new_tokens)
        assert request.output == streamed[request.id], "streamed tokens are the output so far"
        if len(requests) == 3:                   # a request added while streaming is served too
            requests.append(engine.add_request([1, 2, 3], 2))
    assert all(r.done for r in requests)
    assert streamed == {r.id: r.output for r in requests}


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_overlap_gives_the_same_tokens_as_waiting_after_every_step(prefix_caching):
    """Overlapped steps (tokens one step late, decodes taking the previous step's token on the
    device) give every request the tokens of an engine that waits after each step: greedy and
    sampled requests, stop tokens, and a pool small enough that requests are preempted."""
    model = _tiny_model()
    rng = np.random.default_rng()
    requests = [(rng.integers(0, 512, size=n), m, SamplingParams(temperature=0.9, seed=n) if n % 3 == 0 else
                 SamplingParams(stop_token_ids=(55, 189)) if n % 3 == 1 else None)
                for n, m in ((20, 14), (33, 10), (5, 20), (17, 16), (26, 12), (1, 9))]
    outputs, stats = {}, {}
    for overlap in (False, True):
        engine = Engine(model, max_seqs=3, max_seq_len=48, page_size=8, max_step_tokens=16, backend="xla",
                        num_pages=9, enable_prefix_caching=prefix_caching, overlap=overlap)
        handles = [engine.add_request(prompt, n, sampling=sampling) for prompt, n, sampling in requests]
        engine.run()
        outputs[overlap], stats[overlap] = [r.output for r in handles], engine.stats
        assert engine.page_usage.in_use == 0
    assert outputs[True] == outputs[False]
    assert stats[True]["preemptions"] > 0 and stats[False]["preemptions"] > 0


def test_prefill_chunk_bounds_each_rows_tokens():
    """With ``prefill_chunk=8`` a step computes at most 8 prompt tokens of one request (mixed
    steps are compiled with max_q_len 8), several prompts share a step, and tokens are unchanged."""
    model = _tiny_model()
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 512, size=n) for n in (20, 3, 13)]
    engine = Engine(model, max_seqs=3, max_seq_len=48, page_size=8, max_step_tokens=16, prefill_chunk=8,
                    backend="xla", record_steps=True)
    assert {s.max_q_len for s in engine.buckets.shapes} == {1, 8}
    handles = [engine.add_request(p, 4) for p in prompts]
    engine.run()
    assert engine.step_records[0].prefill_tokens == 8 + 3 + 5
    for handle, prompt in zip(handles, prompts):
        assert handle.output == dense_greedy(model, prompt, 4)


def test_abort_ends_a_request_and_frees_its_pages():
    """Aborting a running request mid-stream and a waiting one: they end with finish_reason
    "abort" and no more tokens; the others are served as if alone; every page comes back."""
    model = _tiny_model()
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 512, size=n) for n in (9, 30, 4, 12)]
    engine = Engine(model, max_seqs=2, max_seq_len=48, page_size=8, max_step_tokens=16, backend="xla")
    handles = [engine.add_request(p, 8) for p in prompts]
    engine.abort(handles[3])                         # waiting
    seen = {}
    for request, tokens in engine.stream():
        seen.setdefault(request.id, []).extend(tokens)
        if request is handles[1] and len(request.output) == 2:
            engine.abort(request)                    # running, a token in flight
            assert engine.page_usage.in_use < 5
    assert [r.finish_reason for r in handles] == ["length", "abort", "length", "abort"]
    assert handles[1].output == seen[1] == dense_greedy(model, prompts[1], 2) and 3 not in seen
    for handle, prompt in zip(handles[::2], prompts[::2]):
        assert handle.output == dense_greedy(model, prompt, 8)
    for not_ours in (handles[0].id, Request(99, np.ones(2, np.int32), 1)):
        with pytest.raises(ValueError, match="Engine.abort: request must be a Request from this engine's"):
            engine.abort(not_ours)
    engine.abort(handles[0])                         # finished: nothing changes
    assert handles[0].finish_reason == "length" and engine.page_usage.in_use == 0
    engine.step()
    check_drained(engine)


def test_abort_of_another_engines_request_raises_and_changes_neither_engine():
    """Two engines' first requests share id 0: each engine refuses to abort the other's (running or
    waiting there, or finished), and both then serve their own requests to the dense tokens."""
    model = _tiny_model()
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 512, size=n) for n in (9, 20)]
    engines = [Engine(model, max_seqs=2, max_seq_len=48, page_size=8, max_step_tokens=16, backend="xla")
               for _ in prompts]
    handles = [engine.add_request(prompt, 4) for engine, prompt in zip(engines, prompts)]
    engines[0].step()                                # handles[0] running, handles[1] waiting
    for engine, foreign in ((engines[0], handles[1]), (engines[1], handles[0])):
        with pytest.raises(ValueError, match="Engine.abort: request must be a Request from this engine's add_request"):
            engine.abort(foreign)
    for engine, handle, prompt in zip(engines, handles, prompts):
        engine.run()
        assert handle.finish_reason == "length" and handle.output == dense_greedy(model, prompt, 4)
        engine.step()
        check_drained(engine)
    with pytest.raises(ValueError, match="Engine.abort: request must be a Request from this engine's add_request"):
        engines[1].abort(handles[0])                 # finished, but not this engine's
    engines[0].abort(handles[0])                     # its own, finished: nothing changes
    assert handles[0].finish_reason == "length"


@pytest.mark.parametrize("failure, speculating", [("launch", False), ("after donation", False), ("tokens", False),
                                                   ("after donation", True)])
def test_a_failed_step_ends_its_requests_and_the_engine_serves_on(monkeypatch, failure, speculating):
    """A step that fails before it runs ("launch"), after the call consumed the donated caches
    and table ("after donation"; also with a draft model's caches), or when its tokens reach the
    host ("tokens", with overlap): the error reaches the caller, every request the engine held
    ends with finish_reason "abort", and requests added afterwards get the dense model's greedy
    tokens with every page back."""
    model = _tiny_model()
    rng = np.random.default_rng()
    speculative = {}
    if speculating:
        speculative = dict(speculative={"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2},
                           draft_model=Llama(PRESETS["tiny"].replace(num_layers=1), nnx.Rngs(1)))
    engine = Engine(model, max_seqs=2, max_seq_len=48, page_size=8, max_step_tokens=16, backend="xla",
                    enable_prefix_caching=True, **speculative)
    held = [engine.add_request(rng.integers(0, 512, size=n), 6) for n in (9, 20, 5)]
    engine.step()
    engine.step()
    step, calls = engine.runner._step, []
    pool = jax.tree.leaves(engine.runner.caches)[0]
    draft_pool = jax.tree.leaves(engine.runner.drafting.caches)[0] if speculating else None

    def failing_step(*args, **kwargs):
        calls.append(1)
        if failure == "after donation" and len(calls) == 1:
            step(*args, **kwargs)
        if len(calls) == 1:
            raise RuntimeError("injected step failure")
        return step(*args, **kwargs)

    def failing_complete(*args, **kwargs):
        raise RuntimeError("injected step failure")

    if failure == "tokens":
        monkeypatch.setattr(engine.scheduler, "complete", failing_complete)
    else:
        monkeypatch.setattr(engine.runner, "_step", failing_step)
    with pytest.raises(RuntimeError, match="injected step failure"):
        engine.step()
    assert [r.finish_reason for r in held] == ["abort"] * 3 and not engine.has_work
    # the pool is kept unless the failed call consumed it
    assert not jax.tree.leaves(engine.runner.caches)[0].is_deleted()
    if failure == "launch":
        assert jax.tree.leaves(engine.runner.caches)[0] is pool
    if failure == "after donation":
        assert pool.is_deleted()
    if speculating:
        assert draft_pool.is_deleted() and not jax.tree.leaves(engine.runner.drafting.caches)[0].is_deleted()
    prompts = [rng.integers(0, 512, size=n) for n in (7, 17, 3)]
    handles = [engine.add_request(p, 5) for p in prompts]
    engine.run()
    for handle, prompt in zip(handles, prompts):
        assert handle.finish_reason == "length" and handle.output == dense_greedy(model, prompt, 5)
    engine.step()
    check_drained(engine)


def test_warmup_out_of_memory_names_the_pool(monkeypatch):
    """A step that runs out of device memory in warm-up (its temporaries beside a pool sized from
    free memory: seen on an H200 with DeepSeek-V2-Lite's shapes) is a RuntimeError naming the
    pool and what to shrink; other runtime errors pass through."""
    engine = Engine(_tiny_model(), **_ARGS)

    def out_of_memory(**_):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.05GiB\n...")

    monkeypatch.setattr(engine.runner, "warmup", out_of_memory)
    with pytest.raises(RuntimeError, match=rf"beside the KV pool of {engine.num_pages:,} pages .*\(num_pages, "
                                           r"max_seqs, or a kv_memory_fraction .* XLA said: RESOURCE_EXHAUSTED"):
        engine.warmup()

    def other(**_):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(engine.runner, "warmup", other)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        engine.warmup()


def test_warmup_compiles_every_step_shape_and_records_steps(caplog):
    """After ``warmup`` a trace compiles nothing more (greedy requests with and without logprobs),
    and the warm-up logged each step it compiled (on the ``jaxattn.serve.engine`` logger, which reaches
    the root logger's handlers); ``step_records`` count what each step ran."""
    model = _tiny_model()
    engine = Engine(model, max_seqs=3, max_seq_len=48, page_size=8, max_step_tokens=16, backend="xla",
                    record_steps=True)
    with caplog.at_level(logging.INFO, logger="jaxattn.serve.engine"):
        assert engine.warmup(sampled=False, compile_threads=1) > 0 and engine.step_records == []
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxattn.serve.engine"]
    shapes = engine.buckets.shapes
    assert [(s.rows, s.tokens, s.max_q_len) for s in shapes] == [(3, 3, 1), (3, 16, 16)]
    assert len(lines) == 2 * len(shapes) + 1        # each shape greedy, and greedy with logprobs
    for i, (line, shape) in enumerate(zip(lines, ["decode, 3 rows, 3 tokens, max_q_len 1"] * 2
                                              + ["mixed, 3 rows, 16 tokens, max_q_len 16"] * 2), 1):
        variant = "greedy with logprobs" if i % 2 == 0 else "greedy"
        assert re.fullmatch(rf"compiled step {i}/4 \({shape}, {variant}\) in \d+\.\d s", line), line
    assert re.fullmatch(r"compiled 4 steps in \d+\.\d s", lines[4])
    compiled = engine.runner._step._cache_size()
    rng = np.random.default_rng()
    handles = [engine.add_request(rng.integers(0, 512, size=n), m, sampling=SamplingParams(logprobs=i or None))
               for i, (n, m) in enumerate(((5, 4), (33, 3), (1, 6), (20, 2)))]
    engine.run()
    assert engine.runner._step._cache_size() == compiled
    records = engine.step_records
    assert sum(r.tokens for r in records) == engine.stats["computed_tokens"]
    assert sum(r.prefill_tokens for r in records) + sum(r.decode_rows for r in records) == sum(r.tokens for r in records)
    assert all(r.t_start <= r.t_launched <= r.t_done for r in records)
    assert all(r.tokens <= r.padded_tokens and r.rows <= r.padded_rows for r in records)
    assert records[0].context_tokens == 5 + 11 and records[0].attention_pairs == 5 * 6 // 2 + 11 * 12 // 2
    assert [len(r.output) for r in handles] == [4, 3, 6, 2]


def test_warmup_compiles_steps_on_threads(caplog):
    """With ``compile_threads`` the steps compile ahead, several at a time: each logged once, and
    serving afterwards (with and without logprobs) compiles nothing more; 0 threads is a ValueError."""
    engine = Engine(_tiny_model(), max_seqs=2, max_seq_len=40, page_size=8, max_step_tokens=24, backend="xla")
    with pytest.raises(ValueError, match="compile_threads must be an int >= 1, got 0"):
        engine.warmup(compile_threads=0)
    with caplog.at_level(logging.INFO, logger="jaxattn.serve.engine"):
        engine.warmup(sampled=False, compile_threads=3)
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxattn.serve.engine"]
    steps = 2 * len(engine.buckets.shapes)
    assert sorted(int(re.match(r"compiled step (\d+)/", line)[1]) for line in lines[:-1]) == list(range(1, steps + 1))
    assert re.fullmatch(rf"compiled {steps} steps in \d+\.\d s", lines[-1])
    compiled = engine.runner._step._cache_size()
    rng = np.random.default_rng()
    handles = [engine.add_request(rng.integers(0, 512, size=n), m, sampling=SamplingParams(logprobs=i or None))
               for i, (n, m) in enumerate(((7, 3), (30, 2)))]
    engine.run()
    assert engine.runner._step._cache_size() == compiled and [len(r.output) for r in handles] == [3, 2]


def test_default_compile_threads_are_half_the_cpus(monkeypatch):
    from jaxattn.serve import engine as engine_module

    for cpus, threads in ((None, 1), (1, 1), (6, 3), (16, 8), (64, engine_module.MAX_COMPILE_THREADS)):
        monkeypatch.setattr(engine_module.os, "cpu_count", lambda: cpus)
        assert engine_module.default_compile_threads() == threads


def _rounds(engine: Engine, rounds: list[list[tuple[np.ndarray, SamplingParams | None]]]) -> list[list[int]]:
    """Serves each round's requests (6 new tokens each) to the end before the next round starts."""
    outputs = []
    for requests in rounds:
        handles = [engine.add_request(prompt, 6, sampling=sampling) for prompt, sampling in requests]
        engine.run()
        outputs += [r.output for r in handles]
    return outputs


def _shared_prefix_rounds(rng: np.random.Generator) -> list[list[tuple[np.ndarray, SamplingParams | None]]]:
    """Requests on a 20-token system prompt (2.5 pages of 8), in rounds; some sample, one prompt
    (3 full pages) comes back whole in a later round, and a shorter one comes back as a prefix."""
    system = rng.integers(0, 512, size=20)
    rounds = [[(np.concatenate([system, rng.integers(0, 512, size=n)]), None if n % 2 else SamplingParams(
        temperature=1.0, top_k=50, seed=int(n))) for n in sizes] for sizes in ((4, 11, 0, 7), (2, 9), (5, 12, 3))]
    rounds[1].append(rounds[0][0])
    rounds[2].append((rounds[0][1][0][:17], None))
    return rounds


def test_prefix_caching_gives_the_same_tokens():
    """Rounds of requests sharing a system prompt, with prefix caching on and off: the same tokens.
    With it on, prompt pages are reused (the prefill computes only the uncached tokens) and, as
    the pool fills with cached pages, evicted; with it off, this pool preempts requests."""
    model = Llama(PRESETS["tiny"], nnx.Rngs(0))
    rounds = _shared_prefix_rounds(np.random.default_rng())
    engines = {on: Engine(model, max_seqs=3, max_seq_len=48, page_size=8, max_step_tokens=16, backend="xla",
                          num_pages=12, enable_prefix_caching=on) for on in (False, True)}
    outputs = {on: _rounds(engine, rounds) for on, engine in engines.items()}
    assert outputs[True] == outputs[False]
    on, off = engines[True].stats, engines[False].stats
    assert on["cached_tokens"] >= 7 * 16 and off["cached_tokens"] == 0
    decodes = 5 * sum(len(r) for r in rounds)
    assert on["computed_tokens"] == on["prompt_tokens"] + decodes - on["cached_tokens"]
    assert on["evicted_pages"] > 0 and on["preemptions"] == 0 and off["preemptions"] > 0
    for engine in engines.values():
        engine.step()
        check_drained(engine)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_pool_too_small_for_all_requests_preempts_and_recomputes(prefix_caching):
    """A pool of 8 pages (one request of max_seq_len needs 6) serves requests that together need
    many more: requests are preempted and recomputed, and every token equals a big pool's."""
    model = Llama(PRESETS["tiny"], nnx.Rngs(0))
    rng = np.random.default_rng()
    requests = [(rng.integers(0, 512, size=n), m, None if n % 2 else SamplingParams(temperature=0.9, seed=n))
                for n, m in ((20, 14), (33, 10), (5, 20), (17, 16), (26, 12))]
    big = _outputs(model, requests, enable_prefix_caching=prefix_caching)
    engine = Engine(model, max_seqs=3, max_seq_len=48, page_size=8, max_step_tokens=16, backend="xla", num_pages=8,
                    enable_prefix_caching=prefix_caching)
    handles = [engine.add_request(prompt, n, sampling=sampling) for prompt, n, sampling in requests]
    engine.run()
    assert [r.output for r in handles] == big
    assert engine.stats["preemptions"] > 0
    # cached tokens are prompt tokens, each counted at most once per admission
    assert engine.stats["cached_tokens"] <= (1 + engine.stats["preemptions"]) * engine.stats["prompt_tokens"]
    engine.step()
    check_drained(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_logprobs_are_the_models_on_a_small_pool(overlap):
    """Requests asking for logprobs (greedy and sampled, 0 and 5 alternatives) beside ones that do
    not, on a pool that preempts: one entry per output token, the chosen token's and the top
    alternatives' log-probabilities within 2e-3 of a float64 log-softmax of the dense model's
    logits (recomputed requests keep theirs), none for requests that did not ask; an engine's
    max_logprobs bounds what a request may ask."""
    model = Llama(PRESETS["tiny"], nnx.Rngs(0))
    rng = np.random.default_rng()
    asks = [SamplingParams(logprobs=5), None, SamplingParams(temperature=0.9, seed=4, logprobs=0),
            SamplingParams(temperature=0.7, seed=9), SamplingParams(logprobs=2)]
    engine = Engine(model, max_seqs=3, max_seq_len=48, page_size=8, max_step_tokens=16, backend="xla", num_pages=8,
                    overlap=overlap)
    prompts = [rng.integers(0, 512, size=n) for n in (20, 33, 5, 17, 26)]
    handles = [engine.add_request(prompt, 12, sampling=sampling) for prompt, sampling in zip(prompts, asks)]
    engine.run()
    assert engine.stats["preemptions"] > 0
    for prompt, request in zip(prompts, handles):
        if request.sampling.logprobs is None:
            assert request.logprobs == []
            continue
        assert len(request.logprobs) == len(request.output)
        for entry, row, token in zip(request.logprobs, dense_logprobs(model, prompt, request.output), request.output):
            assert abs(entry.logprob - row[token]) < 2e-3
            top_ids = [t for t, _ in entry.top]
            assert len(top_ids) == request.sampling.logprobs
            np.testing.assert_allclose([lp for _, lp in entry.top], np.sort(row)[::-1][:len(top_ids)], atol=2e-3)
            np.testing.assert_allclose([row[t] for t in top_ids], [lp for _, lp in entry.top], atol=2e-3)
    limited = Engine(model, max_seqs=2, max_seq_len=16, page_size=8, backend="xla", max_logprobs=2)
    with pytest.raises(ValueError, match="sampling.logprobs must be <= this engine's max_logprobs=2"):
        limited.add_request([1, 2], 2, sampling=SamplingParams(logprobs=3))
    with pytest.raises(ValueError, match="max_logprobs must be an int in"):
        Engine(model, max_seqs=2, max_seq_len=16, page_size=8, backend="xla", max_logprobs=21)
    refusing = Engine(model, max_seqs=2, max_seq_len=16, page_size=8, backend="xla", max_logprobs=0)
    with pytest.raises(ValueError, match="sampling.logprobs must be <= this engine's max_logprobs=0"):
        refusing.add_request([1, 2], 2, sampling=SamplingParams(logprobs=0))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_hold_stop_tokens_back(temperature):
    """A request whose stop token comes early (by its sixth token without min_tokens) generates no
    stop token before its min_tokens outputs, overlapped or not; without min_tokens it stops there."""
    model = Llama(PRESETS["tiny"], nnx.Rngs(0))
    rng = np.random.default_rng()
    base = SamplingParams(temperature=temperature, seed=5)
    for _ in range(20):  # the stop token must first appear at output 1..5, so a prompt whose output repeats is redrawn
        prompt = rng.integers(0, 512, size=13)
        free = Engine(model, max_seqs=2, max_seq_len=48, page_size=8, backend="xla")
        first = free.add_request(prompt, 12, sampling=base)
        free.run()
        fresh = [k for k in range(1, 6) if first.output[k] not in first.output[:k]]
        if fresh:
            break
    else:
        pytest.fail(f"no prompt gave an output with a new token in its first six: {first.output}")
    stop_at = fresh[0]
    stop = first.output[stop_at]
    for overlap in (True, False):
        engine = Engine(model, max_seqs=2, max_seq_len=48, page_size=8, backend="xla", overlap=overlap)
        early = engine.add_request(prompt, 12, sampling=dataclasses.replace(base, stop_token_ids=(stop,)))
        held = engine.add_request(prompt, 12, sampling=dataclasses.replace(base, stop_token_ids=(stop,), min_tokens=6))
        engine.run()
        assert early.output == first.output[:stop_at + 1] and early.finish_reason == "stop"
        assert stop not in held.output[:6], held.output
        if held.finish_reason == "stop":
            assert held.output[-1] == stop and len(held.output) >= 7, held.output
        else:
            assert held.finish_reason == "length" and len(held.output) == 12, held.output


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_choices_of_one_prompt_compute_it_once(prefix_caching):
    """add_choices: n greedy choices are the dense model's greedy tokens; with prefix caching the
    prompt's full pages are computed once (the other choices start on them, while a request added
    after them is not held back); sampled choices draw from seeds sampling.seed + i; a first
    choice aborted before its prompt ran does not hold the others; n is checked."""
    model = Llama(PRESETS["tiny"], nnx.Rngs(0))
    rng = np.random.default_rng()
    prompt = rng.integers(0, 512, size=29)
    engine = Engine(model, max_seqs=4, max_seq_len=64, page_size=8, max_step_tokens=64, backend="xla",
                    enable_prefix_caching=prefix_caching)
    choices = engine.add_choices(prompt, 5, 3)
    other = engine.add_request(rng.integers(0, 512, size=6), 3)
    engine.step()
    admitted = [request.slot >= 0 for request in choices + [other]]
    assert admitted == ([True, False, False, True] if prefix_caching else [True, True, True, False])
    engine.run()
    expected = dense_greedy(model, prompt, 5)
    assert [c.output for c in choices] == [expected] * 3
    reused = 2 * ((29 - 1) // 8 * 8) if prefix_caching else 0     # 3 full pages, for each other choice
    assert engine.stats["cached_tokens"] == reused
    assert engine.stats["computed_tokens"] == 3 * (29 + 4) - reused + 6 + 2

    sampled = engine.add_choices(prompt, 4, 2, sampling=SamplingParams(temperature=1.0, seed=2**32 - 1))
    assert [c.seed for c in sampled] == [2**32 - 1, 0]
    first, *rest = engine.add_choices(prompt[:20], 3, 3)
    engine.abort(first)
    engine.run()
    assert all(c.finish_reason == "length" for c in sampled + rest) and first.finish_reason == "abort"
    queued = len(engine.scheduler.waiting)
    for n in (0, MAX_CHOICES + 1, 2**31 - 1, 2.0):
        with pytest.raises(ValueError, match=r"Engine.add_choices: n must be an int in \[1, 65536\]"):
            engine.add_choices(prompt, 2, n)
    assert len(engine.scheduler.waiting) == queued          # refused before anything is queued


request_st = st.tuples(st.sampled_from([None, "a", "b"]), st.integers(1, 10), st.integers(1, 8), st.booleans())


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(request_st, min_size=2, max_size=7), st.integers(0, 2**32 - 1), st.integers(0, 6))
def test_random_traces_on_a_small_pool_match_dense_greedy(requests, seed, wave):
    """Random traces (shared prefixes of 16 and 11 tokens, a second wave arriving mid-run, stop
    tokens) on a pool of 10 pages of 4 tokens with prefix caching: pages are cached, evicted and
    requests preempted, and every request's tokens are the dense model's greedy tokens up to its
    first stop token."""
    model = _tiny_model()
    rng = np.random.default_rng(seed)
    prefixes = {None: np.zeros(0, np.int64), "a": rng.integers(0, 512, size=16), "b": rng.integers(0, 512, size=11)}
    prompts = [np.concatenate([prefixes[p], rng.integers(0, 512, size=n)]) for p, n, _, _ in requests]
    engine = Engine(model, max_seqs=3, max_seq_len=40, page_size=4, max_step_tokens=8, backend="xla", num_pages=11)
    stop = (55, 189)             # tokens this model likes to repeat
    params = [SamplingParams(stop_token_ids=stop if use_stop else ()) for *_, use_stop in requests]
    half = len(prompts) // 2
    handles = [engine.add_request(p, m, sampling=s) for p, (_, _, m, _), s in zip(prompts[:half], requests, params)]
    for _ in range(wave):
        engine.step()
    handles += [engine.add_request(p, m, sampling=s)
                for p, (_, _, m, _), s in zip(prompts[half:], requests[half:], params[half:])]
    while engine.has_work:
        engine.step()
        check_host_view(engine)
    for handle, prompt, (_, _, m, use_stop) in zip(handles, prompts, requests):
        expected = dense_greedy(model, prompt, m)
        if use_stop and set(stop) & set(expected):
            expected = expected[:min(expected.index(t) for t in stop if t in expected) + 1]
        assert handle.output == expected, (handle.id, dict(engine.stats))
    engine.step()
    check_drained(engine)


@functools.cache
def _tiny_model() -> Llama:
    return Llama(PRESETS["tiny"], nnx.Rngs(0))


_ARGS = dict(max_seqs=2, max_seq_len=16, page_size=8, max_step_tokens=8)


@pytest.mark.parametrize("prompt, max_new_tokens, match", [
    ([1, 2], 2.5, "max_new_tokens must be an int >= 1, got 2.5"),
    ([1, 2], True, "max_new_tokens must be an int >= 1, got True"),
    ([1, 2], 0, "max_new_tokens must be an int >= 1, got 0"),
    ([1, 2], -1, "max_new_tokens must be an int >= 1, got -1"),
    ([1, 2], np.float32(3), "max_new_tokens must be an int >= 1"),
    ([1.7, 2.9], 3, r"prompt must be a non-empty 1-D sequence of int token ids, got float64\[2\]"),
    ([[1, 2], [3, 4]], 3, r"prompt must be .*, got int64\[2, 2\]"),
    ([[1, 2], [3]], 3, r"prompt must be .*, got list"),
    ([], 3, r"prompt must be a non-empty .*, got float64\[0\]"),
    (np.zeros(0, np.int32), 3, r"prompt must be a non-empty .*, got int32\[0\]"),
    (5, 3, r"prompt must be .*, got int64\[\]"),
    ([True, False], 3, r"prompt must be .*, got bool\[2\]"),
    ([1, True], 3, r"prompt must be .*, got list"),                    # NumPy would make True token 1
    ("hello", 3, r"prompt must be .*, got <U5\[\]"),
    ([1, 512], 3, r"prompt token ids must be in \[0, 512\) \(the model's vocab_size\), got ids from 1 to 512"),
    ([-1, 2], 3, r"prompt token ids must be in \[0, 512\)"),
    ([2**40], 3, r"prompt token ids must be in \[0, 512\)"),
    (np.arange(10), 7, r"len\(prompt\) \+ max_new_tokens must be <= max_seq_len=16, got 10 \+ 7"),
])
def test_add_request_errors(prompt, max_new_tokens, match):
    engine = Engine(_tiny_model(), **_ARGS)
    with pytest.raises(ValueError, match=f"Engine.add_request: {match}"):
        engine.add_request(prompt, max_new_tokens)
    assert not engine.has_work and engine.stats["prompt_tokens"] == 0


def test_add_request_takes_int_sequences_and_numpy_ints():
    engine = Engine(_tiny_model(), **_ARGS)
    for prompt in ([1, 2, 3], (1, 2, 3), np.asarray([1, 2, 3], np.uint16), jnp.asarray([1, 2, 3]),
                   [np.int64(1), 2, 3]):
        request = engine.add_request(prompt, np.int64(4))
        assert request.prompt.dtype == np.int32 and request.prompt.tolist() == [1, 2, 3], prompt
        assert type(request.max_new_tokens) is int and request.max_new_tokens == 4
    assert engine.add_request(np.arange(12), 4).prompt.size == 12        # exactly max_seq_len
    with pytest.raises(ValueError, match="sampling must be a SamplingParams, got dict"):
        engine.add_request([1], 2, sampling={"temperature": 1.0})


@pytest.mark.parametrize("name, value, match", [
    ("page_size", 0, "an int >= 1, got 0"),
    ("max_seqs", 0, "None or an int >= 1, got 0"),
    ("max_seq_len", True, "an int >= 1, got True"),
    ("max_step_tokens", 1.5, "None or an int >= 1, got 1.5"),
    ("max_step_tokens", 1, r">= max_seqs=2 \(every decode fits in a step\), got 1"),
    ("num_pages", 0, "None or an int >= 1, got 0"),
    ("num_pages", 2, r">= 3 \(the null page and one sequence of max_seq_len=16\), got 2"),
    ("layout", "NCHW", r"one of \('HND', 'NHD'\), got 'NCHW'"),
    ("kv_dtype", "float99", r"None \(the model's dtype\) or a dtype, got 'float99'"),
    ("enable_prefix_caching", "yes", "a bool, got 'yes'"),
    ("overlap", 1, "a bool, got 1"),
    ("record_steps", None, "a bool, got None"),
    ("fuse_projections", "no", "a bool, got 'no'"),
    ("kv_memory_fraction", 0.0, r"a number in \(0, 1\], got 0.0"),
    ("prefill_chunk", 0, "None or an int >= 1, got 0"),
    ("max_prefill_seqs", 0, "None or an int >= 1, got 0"),
    ("mesh", ("tp",), "None or a jax.sharding.Mesh, got tuple"),
    ("backend", "fastest", r"'auto' or one of \(.*\), got 'fastest'"),
    ("backend", None, r"'auto' or one of \(.*\), got None"),
])
def test_engine_argument_errors(name, value, match):
    with pytest.raises(ValueError, match=f"Engine: {name} must be {match}"):
        Engine(_tiny_model(), **{**_ARGS, name: value})


def test_max_prefill_seqs_is_not_taken_with_speculation():
    with pytest.raises(ValueError, match="Engine: max_prefill_seqs is not taken with speculative"):
        Engine(_tiny_model(), **_ARGS, max_prefill_seqs=2,
               speculative={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})


@pytest.mark.parametrize("model, backend, match", [
    ("deepseek", "flashinfer", "does not implement mla_prefill"),
    ("deepseek", "cudnn", "does not implement mla_paged_attention"),
    ("deepseek", "trtllm", "does not implement mla_paged_attention, mla_prefill"),
    ("llama", "flashinfer", "does not implement paged_attention"),
])
def test_a_backend_must_implement_every_op_the_model_runs(model, backend, match):
    model = _tiny_model() if model == "llama" else _tiny_deepseek()
    with pytest.raises(ValueError, match=f"Engine: backend '{backend}' {match}"):
        Engine(model, **_ARGS, backend=backend)


@pytest.mark.skipif(HAS_GPU, reason="a GPU is visible")
@pytest.mark.parametrize("backend", ["cudnn", "trtllm", "triton"])
def test_a_gpu_backend_on_a_cpu_machine_is_refused_at_construction(backend):
    with pytest.raises(ValueError, match=f"Engine: backend '{backend}' cannot run here: no NVIDIA GPU"):
        Engine(_tiny_model(), **_ARGS, backend=backend)


def test_the_model_must_implement_the_protocol():
    with pytest.raises(ValueError, match="Engine: model must be an nnx.Module implementing "
                                         "jaxattn.serve.models.base.PagedModel .*, got Linear"):
        Engine(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), **_ARGS)
    model = Llama(PRESETS["tiny"], nnx.Rngs(0))
    model.attention_ops = ("paged_attention", "flash_attention")
    with pytest.raises(ValueError, match=r"Engine: model.attention_ops must be a non-empty tuple of ops from "
                                         r"\('paged_attention', .*\), got \('paged_attention', 'flash_attention'\)"):
        Engine(model, **_ARGS)


def test_models_implement_the_protocol():
    from jaxattn.backends import OPS
    from jaxattn.serve.models.base import PagedModel

    for model, ops in ((_tiny_model(), ("paged_attention",)),
                       (_tiny_deepseek(), ("mla_paged_attention", "mla_prefill"))):
        assert isinstance(model, PagedModel) and model.attention_ops == ops and set(ops) <= set(OPS)


@functools.cache
def _tiny_deepseek() -> DeepSeek:
    return DeepSeek(DEEPSEEK_PRESETS["tiny"], nnx.Rngs(0))


def _greedy_outputs(engine: Engine, prompts: list[np.ndarray], new_tokens: int) -> list[list[int]]:
    for prompt in prompts:
        engine.add_request(prompt, new_tokens)
    return [r.output for r in engine.run()]


def _communicated(hlo: str) -> dict[str, list[int]]:
    """Collective kind -> the element count of each such op's result in compiled ``hlo``."""
    found: dict[str, list[int]] = {}
    for line in hlo.splitlines():
        for kind in ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
            if f" {kind}(" in line or f" {kind}-start(" in line:
                shape = line.split("=", 1)[1].split("{", 1)[0].split("[", 1)[1].split("]", 1)[0]
                found.setdefault(kind, []).append(int(np.prod([int(d) for d in shape.split(",") if d])))
    return found


def check_engine_on_mesh() -> None:
    """(On several CPU devices.) The engine on a mesh of all devices gives the one-device engine's
    greedy tokens (tiny model: Hkv 2, so 4 devices replicate KV heads); its caches stay split by
    KV heads and its table replicated; each step shape communicates with all-reduces (embedding,
    o and down projections) and only small gathers (the argmax over the vocabulary shards),
    nothing the size of a pool shard, and no all-to-all."""
    num_devices = jax.device_count()
    model = Llama(PRESETS["tiny"], nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, size=n) for n in (5, 33, 1, 20, 17)]

    def engine(mesh=None) -> Engine:
        return Engine(model, max_seqs=3, max_seq_len=48, page_size=8, max_step_tokens=16, backend="xla", mesh=mesh)

    expected = _greedy_outputs(engine(), prompts, 5)
    sharded = engine(jax.make_mesh((num_devices,), ("tp",)))
    assert _greedy_outputs(sharded, prompts, 5) == expected
    pools = jaxattn.kv_cache.pool_sharding(sharded.runner.caches[0].k_pages.sharding.mesh, "tp")
    assert all(c.k_pages.sharding.is_equivalent_to(pools, 4) for c in sharded.runner.caches)
    assert sharded.runner.caches[0].num_kv_heads == max(2, num_devices)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(sharded.runner.table))
    pool_shard = sharded.runner.caches[0].k_pages.addressable_shards[0].data.size
    for shape in (sharded.buckets.shapes[0], sharded.buckets.shapes[-1]):
        hlo = trace_step(sharded, shape).lower().compile().as_text()
        sizes = _communicated(hlo)
        assert len(sizes.pop("all-reduce", [])) >= 1 + 2 * model.cfg.num_layers, (shape, sizes)
        assert set(sizes) <= {"all-gather"}, (shape, sizes)
        assert max(sizes.get("all-gather", [0])) <= 3 * num_devices < pool_shard, (shape, sizes)


@pytest.mark.parametrize("num_devices", [2, 4])
def test_engine_on_cpu_devices(num_devices):
    run_on_cpu_devices(num_devices, "from tests.serve.test_engine import check_engine_on_mesh; check_engine_on_mesh()")


_DECODE_STEP_SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jaxattn.serve.engine import Engine
from jaxattn.serve.models.llama import PRESETS, Llama
from jaxattn.serve.sampling import SamplingParams

tp = int(sys.argv[2]) if len(sys.argv) > 2 else 1
mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp]) if tp > 1 else None
cfg = PRESETS["small"].replace(vocab_size=1024, dim=512, num_layers=2, num_q_heads=8, num_kv_heads=2,
                               hidden_dim=1024)
engine = Engine(Llama(cfg, nnx.Rngs(0)), max_seqs=8, max_seq_len=256, page_size=64, max_step_tokens=64, mesh=mesh)
for n in (40, 100, 7):
    engine.add_request(np.arange(n) % 1000, 12, sampling=SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
                       if n == 100 else None)
engine.run()
engine.add_request(np.arange(150) % 1000, 12)   # starts on the cached page of the 100-token prompt
engine.run()
assert engine.stats["cached_tokens"] == 64, engine.stats
"""


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.multigpu)])
def test_gpu_decode_step_runs_in_command_buffers(tmp_path, tp):
    """Every custom call of the jitted decode step (attention in every layer, sampling, prefix
    caching's page operations) runs inside an XLA command buffer: none is left to run thunk by
    thunk; split over 2 GPUs too (the all-reduces between the command buffers or inside them)."""
    run_with_dump(_DECODE_STEP_SCRIPT, tmp_path, str(tp))
    steps = thunk_sequences(tmp_path, "jit_step")
    assert len(steps) >= 2, list(steps)            # decode-only and mixed steps
    for name, thunks in steps.items():
        top = top_level_thunks(thunks)
        assert "kCommandBuffer" in top, (name, thunks[-3000:])
        assert "kCustomCall" not in top, (name, top)
        assert "kWhile" not in top and "kConditional" not in top, (name, top)


def _small_model() -> Llama:
    cfg = PRESETS["small"].replace(vocab_size=1024, dim=512, num_layers=2, num_q_heads=8, num_kv_heads=2,
                                   hidden_dim=1024)
    return Llama(cfg, nnx.Rngs(0))


def _mixed_step(model: Llama, rng: np.random.Generator, kv_lens: list[int], q_lens: list[int], max_q_len: int,
                num_tokens: int):
    """One step of 4 sequences (kv_lens include the q_lens new tokens) over random caches:
    ``(hidden_states(backend) -> float32 rows of the real tokens, first layer's cache, meta)``."""
    table = jaxattn.PageTable.create(32, 4, 8, 64)
    ids = jnp.arange(4, dtype=jnp.int32)
    table, _ = table.extend(ids, jnp.asarray(kv_lens, jnp.int32))
    caches = [jaxattn.KVCache(jnp.asarray(rng.normal(size=c.k_pages.shape), c.dtype),
                              jnp.asarray(rng.normal(size=c.v_pages.shape), c.dtype), layout=c.layout)
              for c in model.init_caches(32, 64)]
    q_lens = jnp.asarray(q_lens, jnp.int32)
    meta = table.metadata(ids, q_lens, max_q_len=max_q_len)
    slots = table.slot_mapping(ids, q_lens, num_tokens)
    tokens_in = jnp.asarray(rng.integers(0, 1024, size=num_tokens), jnp.int32)
    step = jax.jit(lambda g, s, c, backend: forward_paged(nnx.merge(g, s), tokens_in, c, meta, slots, backend)[0],
                   static_argnums=(0, 3))
    graphdef, state = nnx.split(model)
    real = int(q_lens.sum())

    def hidden_states(backend: str) -> np.ndarray:
        return np.asarray(step(graphdef, state, caches, backend)[:real], np.float32)
    return hidden_states, caches[0], meta


@pytest.mark.gpu
def test_gpu_backends_agree():
    """One mixed step (decodes + prefill chunks) through the model gives the xla backend's hidden
    states with every GPU backend; greedy generation starts with the same tokens, unless the first
    token is a near tie in a float32 reference (random weights make ties common; after a first
    bf16-level difference greedy sequences are free to part)."""
    model = _small_model()
    rng = np.random.default_rng()
    backends = ("xla", "auto", "cudnn", "triton")

    # Hidden states of one mixed step: 2 decodes over 90/40 tokens, then 50 and 7 new tokens.
    hidden_states, _, _ = _mixed_step(model, rng, [90, 40, 80, 7], [1, 1, 50, 7], max_q_len=64, num_tokens=64)
    hidden = {b: hidden_states(b) for b in backends}
    errors = {b: rel_error(hidden[b], hidden["xla"]) for b in backends[1:]}
    print("hidden-state rel. error vs xla:", errors)
    assert max(errors.values()) < 2e-2, errors

    prompts = [rng.integers(0, 1024, size=n) for n in (70, 5, 130, 33)]
    outputs = {}
    for backend in backends:
        engine = Engine(model, max_seqs=4, max_seq_len=256, page_size=64, max_step_tokens=64, backend=backend)
        for prompt in prompts:
            engine.add_request(prompt, 8)
        outputs[backend] = [r.output for r in engine.run()]
    agree = {b: [next((i for i, (x, y) in enumerate(zip(o, r)) if x != y), len(o))
                 for o, r in zip(outputs[b], outputs["xla"])] for b in backends[1:]}
    print("tokens agreeing with xla before the first difference, per request:", agree)
    for b, counts in agree.items():
        for prompt, n, out, ref in zip(prompts, counts, outputs[b], outputs["xla"]):
            assert n >= 1 or _near_tie(model, prompt, out[0], ref[0]), (b, agree)


def _near_tie(model: Llama, prompt: np.ndarray, token: int, other: int, tolerance: float = 1e-2) -> bool:
    """Whether the next-token logits after ``prompt`` (attended densely) put ``token`` and
    ``other`` within bf16 noise of each other (``tolerance`` of the largest logit)."""
    logits = model.logits(dense_hidden(*nnx.split(model), jnp.asarray(prompt, jnp.int32))[-1])
    return bool(jnp.abs(logits[token] - logits[other]) <= tolerance * jnp.abs(logits).max())


@pytest.mark.gpu
def test_gpu_short_prefill_chunks_run_whole_on_one_fast_backend():
    """With prefill chunks of at most 16 tokens a mixed step is speculative-decode shaped: auto
    runs it as one trtllm call (8 tokens x 4 heads per KV head fit one XQA tile). Its hidden
    states match the xla backend's, and the engine's greedy tokens start the same."""
    model = _small_model()
    rng = np.random.default_rng()
    hidden_states, cache, meta = _mixed_step(model, rng, [90, 40, 80, 5], [1, 1, 8, 5], max_q_len=8, num_tokens=20)
    q = jnp.zeros((20, model.cfg.num_q_heads, model.cfg.head_dim), jnp.bfloat16)
    assert attention_module.backend_for(q, cache, meta) == dispatch.Route("trtllm")
    assert rel_error(hidden_states("auto"), hidden_states("xla")) < 2e-2

    outputs = {}
    for backend in ("xla", "auto"):
        engine = Engine(model, max_seqs=4, max_seq_len=128, page_size=64, max_step_tokens=8, backend=backend)
        for n in (30, 5, 17):
            engine.add_request(np.arange(n) * 7 % 1000, 6)
        outputs[backend] = [r.output for r in engine.run()]
    assert all(a[0] == b[0] for a, b in zip(outputs["auto"], outputs["xla"])), outputs


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["xla", "auto", "cudnn", "triton"])
def test_gpu_engine_on_two_gpus(backend):
    """The bf16 engine split over 2 GPUs against one GPU, same backend: greedy tokens start the
    same for every request (a bf16 all-reduce sums in another order, so later tokens may part
    after a near tie); the caches stay split and the step gathers nothing the size of a pool."""
    model = _small_model()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1024, size=n) for n in (70, 5, 130, 33)]

    def engine(mesh=None) -> Engine:
        return Engine(model, max_seqs=4, max_seq_len=256, page_size=64, max_step_tokens=64, backend=backend, mesh=mesh)

    one_gpu = _greedy_outputs(engine(), prompts, 8)
    sharded = engine(jax.make_mesh((2,), ("tp",), devices=jax.devices("gpu")[:2]))
    two_gpus = _greedy_outputs(sharded, prompts, 8)
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(one_gpu, two_gpus)]
    print(f"{backend}: tokens agreeing with one GPU before the first difference, per request:", agree)
    assert min(agree) >= 1, agree
    assert sharded.runner.caches[0].k_pages.addressable_shards[0].data.shape[1] == model.cfg.num_kv_heads // 2
    hlo = trace_step(sharded, sharded.buckets.shapes[0]).lower().compile().as_text()
    sizes = _communicated(hlo)
    assert sizes.get("all-reduce") and set(sizes) <= {"all-reduce", "all-gather"}, sizes
    assert max(sizes.get("all-gather", [0])) < sharded.runner.caches[0].k_pages.addressable_shards[0].data.size, sizes


@pytest.mark.parametrize("sizes, param", [(dict(num_pages=2**31 - 1), "num_pages"), (dict(max_seqs=2**28), "max_seqs"),
                                          (dict(max_seqs=None, max_seq_len=2**31 - 1), "max_seq_len")])
def test_a_pool_larger_than_memory_is_refused_before_it_is_allocated(sizes, param):
    """A pool the device (here the host's memory) cannot hold: a ValueError naming what set its size,
    not the allocator's RESOURCE_EXHAUSTED or a host out of memory."""
    with pytest.raises(ValueError, match=rf"Engine: a pool of [\d,]+ pages \({param}\) takes [\d,]+ bytes per device, "
                                         r"more than the [\d,]+ free on cpu:0"):
        Engine(_tiny_model(), **{**_ARGS, "max_step_tokens": None, **sizes})


@pytest.mark.parametrize("max_step_tokens", [None, 64, 2**31 - 1])
def test_the_step_budget_is_capped_at_what_the_sequences_hold(max_step_tokens):
    """2 sequences of 2 pages of 8 hold 32 tokens: a larger budget (DEFAULT_MAX_STEP_TOKENS, or one
    that would size a step's buffers past memory) is taken as 32."""
    engine = Engine(_tiny_model(), **{**_ARGS, "max_step_tokens": max_step_tokens})
    assert engine.max_step_tokens == 32 and engine.scheduler.max_step_tokens == 32
    assert max(engine.buckets.tokens) <= 32


def test_numpy_sizes_and_kv_dtype_are_checked_as_python_ints():
    """Sizes given as NumPy ints (uint64, int8) are used as Python ints (arithmetic on them wrapped:
    a page count of 2**64 - 32); a kv_dtype the caches cannot hold is named."""
    engine = Engine(_tiny_model(), max_seqs=np.int8(2), max_seq_len=np.uint64(16), page_size=np.uint32(8),
                    max_step_tokens=np.int16(8))
    assert (engine.max_seqs, engine.max_seq_len, engine.page_size) == (2, 16, 8)
    assert all(type(v) is int for v in (engine.max_seqs, engine.max_seq_len, engine.page_size, engine.num_pages))
    for kv_dtype in ("int8", jnp.float64, "not a dtype"):
        with pytest.raises(ValueError, match="Engine: kv_dtype must be None \\(the model's dtype\\) or a dtype"):
            Engine(_tiny_model(), kv_dtype=kv_dtype, **_ARGS)

