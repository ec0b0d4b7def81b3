"""The loop that owns the ``Engine`` (it is not thread-safe: one thread calls it), and the server's
handle on it in a thread of the server's process (``EngineLoop``; ``engine_process.EngineProcess``
runs it in a process of its own).

HTTP handlers (on the asyncio event loop) hand it ``Job``s and aborts as commands; between steps
the loop adds the new requests and applies the aborts, then runs one step and publishes the step's
events, keyed by the jobs, with the ``EngineState`` the metrics show. A request the engine refuses
(``ValueError``) fails with 400, any other error in adding it with 500; a step that raises fails
the requests in flight with 500 and the loop goes on with the next requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable

from jaxattn.serve.engine import Engine, Request
from jaxattn.serve.http.metrics import Metrics
from jaxattn.serve.sampling import SamplingParams
from jaxattn.serve.scheduler import PageUsage, TokenLogprobs

__all__ = ["Admitted", "EngineLoop", "EngineRunner", "EngineState", "Failed", "Job", "Tokens", "dispatch",
           "hand_over_gil"]

log = logging.getLogger("jaxattn.serve")
# After a step that raised: a pause before the next, so an engine that keeps failing does not spin.
FAILED_STEP_PAUSE_S = 1.0
SHUTTING_DOWN = "the server is shutting down"


@dataclasses.dataclass(frozen=True)
class Admitted:
    """The engine took the request (its checks passed)."""


@dataclasses.dataclass(frozen=True)
class Tokens:
    """New tokens; ``finish_reason`` set on the request's last event; ``logprobs``, one entry per
    token, when the request asked for them."""

    ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


@dataclasses.dataclass(frozen=True)
class Failed:
    status: int
    message: str


Event = Admitted | Tokens | Failed


def is_last(event: Event) -> bool:
    """Whether no event comes after ``event`` for its job."""
    return isinstance(event, Failed) or (isinstance(event, Tokens) and event.finish_reason is not None)


@dataclasses.dataclass(frozen=True)
class EngineState:
    """What the metrics show of the engine after an iteration of its loop: requests ``waiting``
    (no token yet) and ``running``, its pages, its ``stats`` counts, and whether the last step
    failed."""

    waiting: int
    running: int
    pages: PageUsage
    stats: dict[str, int]
    step_failed: bool


class Job:
    """One HTTP request's generation: made on the event loop, its events delivered there."""

    def __init__(self, prompt: list[int], max_tokens: int, sampling: SamplingParams):
        self.prompt, self.max_tokens, self.sampling = prompt, max_tokens, sampling
        self._events: list[Event] = []                # delivered, not yet taken (event loop)
        self._waiter: asyncio.Future | None = None

    def put(self, event: Event) -> None:
        """(On the event loop.) Queues ``event``, waking the task waiting in ``take``."""
        self._events.append(event)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[Event]:
        """Every event delivered since the last call, in order (waits for one): a stream that fell
        behind the engine takes several steps' tokens at once."""
        while not self._events:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events, self._events = self._events, []
        return events


def hand_over_gil() -> None:
    """(On the event loop.) Lets the engine thread run now if it waits for the GIL. CPython takes
    the GIL from a running thread only after its switch interval (5 ms), and the engine thread
    needs it after each device wait of a step (a launch, a copy back, the host work of grammar
    rows between a step and its token pick) while the event loop streams the step before's chunks
    (~25 us each on a CPU: 128 streams hold it for ~3 ms): called once per stream and step, a
    sleep of 0 releases the GIL for a moment, so the engine waits for one chunk's work, not the
    whole step's. (With the engine in a process of its own it only yields to the thread that
    brings the engine's events.)"""
    time.sleep(0)


def dispatch(outbox: list[tuple[Job, Event]], metrics: Metrics) -> None:
    """(On the event loop.) Each event to its job, counted in ``metrics``."""
    generated = 0
    for job, event in outbox:
        if isinstance(event, Tokens):
            generated += len(event.ids)
        elif isinstance(event, Admitted):
            metrics.prompt_tokens.inc(len(job.prompt))
        job.put(event)
    if generated:
        metrics.generation_tokens.inc(generated)


Publish = Callable[[list[tuple[Hashable, Event]], EngineState], None]


class EngineRunner:
    """The loop that owns ``engine`` (``run``, in the one thread that calls the engine). Commands
    come through ``commands``: ``("add", keys, prompt, max_tokens, sampling)`` (the choices of one
    prompt, a key each), ``("abort", key)``, ``("abort_all",)`` (every request in flight fails
    with 503: shutting down) and ``("stop",)`` (the same, then ``run`` returns). After each
    iteration ``publish(events, state)`` gets the iteration's ``(key, event)``s in order (a key's
    last event is ``is_last``; none come for an aborted key) and the engine's state."""

    def __init__(self, engine: Engine, publish: Publish):
        self.engine, self._publish = engine, publish
        self.commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self.step_failed = False
        self._live: dict[Request, Hashable] = {}
        self._requests: dict[Hashable, Request] = {}
        self._outbox: list[tuple[Hashable, Event]] = []

    def run(self) -> None:
        self._flush()
        while True:
            commands = [self.commands.get()] if not self.engine.has_work else []
            while True:
                try:
                    commands.append(self.commands.get_nowait())
                except queue.Empty:
                    break
            for kind, *args in commands:
                if kind in ("stop", "abort_all"):
                    self._abort_all(Failed(503, SHUTTING_DOWN))
                if kind == "stop":
                    self._flush()
                    return
                if kind == "add":
                    self._add(*args)
                elif kind == "abort":
                    self._abort(*args)
            if self.engine.has_work:
                self._step()
            self._flush()
            if self.step_failed and self.engine.has_work:
                time.sleep(FAILED_STEP_PAUSE_S)

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        waiting = sum(not request.output for request in self._live)
        self._publish(outbox, EngineState(waiting, len(self._live) - waiting, self.engine.page_usage,
                                          dict(self.engine.stats), self.step_failed))

    def _add(self, keys: list[Hashable], prompt: list[int], max_tokens: int, sampling: SamplingParams) -> None:
        try:
            requests = self.engine.add_choices(prompt, max_tokens, len(keys), sampling=sampling)
        except ValueError as err:
            self._outbox += [(key, Failed(400, str(err))) for key in keys]
            return
        except Exception as err:  # this request fails alone
            log.exception("adding a request failed")
            failure = Failed(500, f"the engine failed to add the request: {type(err).__name__}: {err}")
            self._outbox += [(key, failure) for key in keys]
            return
        for key, request in zip(keys, requests):
            self._live[request], self._requests[key] = key, request
            self._outbox.append((key, Admitted()))

    def _abort(self, key: Hashable) -> None:
        request = self._requests.pop(key, None)
        if request is not None and self._live.pop(request, None) is not None:
            self._abort_request(request)

    def _abort_all(self, failure: Failed) -> None:
        for request, key in self._live.items():
            self._abort_request(request)
            self._outbox.append((key, failure))
        self._live.clear()
        self._requests.clear()

    def _abort_request(self, request: Request) -> None:
        try:
            self.engine.abort(request)
        except Exception:  # the loop goes on serving the others
            log.exception("aborting a request failed")

    def _step(self) -> None:
        try:
            events = self.engine.step_events()
        except Exception as err:  # fail the step's requests, serve the next
            log.exception("an engine step failed")
            self.step_failed = True
            self._abort_all(Failed(500, f"the engine step failed: {type(err).__name__}: {err}"))
            return
        self.step_failed = False
        for request, ids in events:
            key = self._live.get(request)
            if key is None:                          # aborted meanwhile
                continue
            logprobs = request.logprobs[len(request.logprobs) - len(ids):] if request.sampling.logprobs is not None \
                else None
            self._outbox.append((key, Tokens(list(ids), request.finish_reason, logprobs)))
            if request.done:
                del self._live[request], self._requests[key]


class EngineLoop:
    """The server's handle on ``engine`` run by an ``EngineRunner`` in a thread of this process
    (``start``, ``stop``); ``submit`` and ``abort`` from any thread. ``healthy`` is False once the
    thread died or while the last step failed. ``max_seq_len``, ``vocab_size`` and
    ``grammar_compiler`` are the engine's, for the handlers' checks."""

    def __init__(self, engine: Engine, metrics: Metrics | None = None):
        self.metrics = metrics or Metrics()
        self.max_seq_len, self.vocab_size = engine.max_seq_len, engine.model.cfg.vocab_size
        self.grammar_compiler = engine.grammar_compiler
        self._runner = EngineRunner(engine, self._publish)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._runner.run, name="jaxattn-engine", daemon=True)

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and not self._runner.step_failed

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starts the thread, which delivers events on ``loop`` (the handlers')."""
        self._loop = loop
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Aborts the requests still in flight and ends the thread."""
        self._runner.commands.put(("stop",))
        self._thread.join(timeout)

    def abort_all(self) -> None:
        """Ends every request in flight at the next step: each fails with 503 (shutting down)."""
        self._runner.commands.put(("abort_all",))

    def submit(self, jobs: list[Job]) -> None:
        """Adds ``jobs``, the choices of one prompt (the same prompt, length and sampling:
        ``Engine.add_choices``, which computes the prompt once); one job is a plain request."""
        first = jobs[0]
        self._runner.commands.put(("add", jobs, first.prompt, first.max_tokens, first.sampling))

    def abort(self, job: Job) -> None:
        """Ends ``job``'s request at the next step (its pages freed); no more events come for it."""
        self._runner.commands.put(("abort", job))

    def _publish(self, outbox: list[tuple[Job, Event]], state: EngineState) -> None:
        """(On the engine thread.) The gauges now, the events in one callback on the event loop
        (dropped once it closed)."""
        self.metrics.observe_state(state)
        if outbox:
            try:
                self._loop.call_soon_threadsafe(dispatch, outbox, self.metrics)
            except RuntimeError:
                pass
