"""The engine thread: the only thread that calls the ``Engine`` (it is not thread-safe).

HTTP handlers (on the asyncio event loop) hand it ``Job``s and aborts through a queue; between
steps it adds the new requests and applies the aborts, then runs one step and delivers the jobs'
new events to their jobs, all of a step's in one callback on the event loop. A request
the engine refuses (``ValueError``) fails with 400, any other error in adding it with 500; a step
that raises fails the requests in flight with 500 and the thread goes on with the next requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time

from jaxattn.serve.engine import Engine, Request
from jaxattn.serve.http.metrics import Metrics
from jaxattn.serve.sampling import SamplingParams
from jaxattn.serve.scheduler import TokenLogprobs

__all__ = ["Admitted", "EngineLoop", "Failed", "Job", "Tokens", "hand_over_gil"]

log = logging.getLogger("jaxattn.serve")
# After a step that raised: a pause before the next, so an engine that keeps failing does not spin.
FAILED_STEP_PAUSE_S = 1.0


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


class Job:
    """One HTTP request's generation: made on the event loop, its events delivered there."""

    def __init__(self, prompt: list[int], max_tokens: int, sampling: SamplingParams):
        self.prompt, self.max_tokens, self.sampling = prompt, max_tokens, sampling
        self.request: Request | None = None           # set by the engine thread
        self.generated = 0                            # tokens delivered (engine thread)
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
    whole step's."""
    time.sleep(0)


def _dispatch(outbox: list[tuple[Job, Event]]) -> None:
    """(On the event loop.) Each event to its job."""
    for job, event in outbox:
        job.put(event)


class EngineLoop:
    """Runs ``engine`` in a thread of its own (``start``, ``stop``); ``submit`` and ``abort`` from
    any thread. ``healthy`` is False once the thread died or while the last step failed."""

    def __init__(self, engine: Engine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        self._inbox: queue.SimpleQueue[tuple[str, list[Job] | Job | None]] = queue.SimpleQueue()
        self._live: dict[Request, Job] = {}
        self._outbox: list[tuple[Job, Event]] = []       # this iteration's events (engine thread)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="jaxattn-engine", daemon=True)
        self._step_failed = False

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and not self._step_failed

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starts the thread, which delivers events on ``loop`` (the handlers')."""
        self._loop = loop
        self._update_gauges()
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Aborts the requests still in flight and ends the thread."""
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    def abort_all(self) -> None:
        """Ends every request in flight at the next step: each fails with 503 (shutting down)."""
        self._inbox.put(("abort_all", None))

    def submit(self, jobs: list[Job]) -> None:
        """Adds ``jobs``, the choices of one prompt (the same prompt, length and sampling:
        ``Engine.add_choices``, which computes the prompt once); one job is a plain request."""
        self._inbox.put(("add", jobs))

    def abort(self, job: Job) -> None:
        """Ends ``job``'s request at the next step (its pages freed); no more events come for it."""
        self._inbox.put(("abort", job))

    def _run(self) -> None:
        while True:
            commands = [self._inbox.get()] if not self.engine.has_work else []
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for command, job in commands:
                if command in ("stop", "abort_all"):
                    self._abort_all(Failed(503, "the server is shutting down"))
                if command == "stop":
                    self._flush()
                    return
                if command == "add":
                    self._add(job)
                elif command == "abort":
                    self._abort(job)
            if self.engine.has_work:
                self._step()
            self._flush()
            self._update_gauges()
            if self._step_failed and self.engine.has_work:
                time.sleep(FAILED_STEP_PAUSE_S)

    def _flush(self) -> None:
        """Delivers the iteration's events in one callback (dropped once the event loop closed)."""
        if self._outbox:
            outbox, self._outbox = self._outbox, []
            try:
                self._loop.call_soon_threadsafe(_dispatch, outbox)
            except RuntimeError:
                pass

    def _deliver(self, job: Job, event: Event) -> None:
        self._outbox.append((job, event))

    def _add(self, jobs: list[Job]) -> None:
        first = jobs[0]
        try:
            requests = self.engine.add_choices(first.prompt, first.max_tokens, len(jobs), sampling=first.sampling)
        except ValueError as err:
            failure = Failed(400, str(err))
        except Exception as err:  # this request fails alone
            log.exception("adding a request failed")
            failure = Failed(500, f"the engine failed to add the request: {type(err).__name__}: {err}")
        else:
            failure = None
        for i, job in enumerate(jobs):
            if failure is not None:
                self._deliver(job, failure)
                continue
            job.request = requests[i]
            self._live[job.request] = job
            self.metrics.prompt_tokens.inc(len(job.prompt))
            self._deliver(job, Admitted())

    def _abort(self, job: Job) -> None:
        if job.request is not None and self._live.pop(job.request, None) is not None:
            self._abort_request(job.request)

    def _abort_all(self, failure: Failed) -> None:
        for request, job in list(self._live.items()):
            self._abort_request(request)
            self._deliver(job, failure)
        self._live.clear()

    def _abort_request(self, request: Request) -> None:
        try:
            self.engine.abort(request)
        except Exception:  # the thread goes on serving the others
            log.exception("aborting a request failed")

    def _step(self) -> None:
        try:
            events = self.engine.step_events()
        except Exception as err:  # fail the step's requests, serve the next
            log.exception("an engine step failed")
            self._step_failed = True
            self._abort_all(Failed(500, f"the engine step failed: {type(err).__name__}: {err}"))
            return
        self._step_failed = False
        generated = 0
        for request, ids in events:
            job = self._live.get(request)
            if job is None:                          # aborted meanwhile
                continue
            job.generated += len(ids)
            generated += len(ids)
            logprobs = request.logprobs[len(request.logprobs) - len(ids):] if request.sampling.logprobs is not None \
                else None
            self._deliver(job, Tokens(list(ids), request.finish_reason, logprobs))
            if request.done:
                del self._live[request]
        self.metrics.generation_tokens.inc(generated)

    def _update_gauges(self) -> None:
        waiting = sum(job.generated == 0 for job in self._live.values())
        self.metrics.requests_waiting.set(waiting)
        self.metrics.requests_running.set(len(self._live) - waiting)
        usage = self.engine.page_usage
        self.metrics.kv_pages_in_use.set(usage.in_use)
        self.metrics.kv_pages_free.set(usage.free)
        self.metrics.kv_pages_cached.set(usage.cached)
        self.metrics.observe_engine(self.engine.stats)
