"""The Engine in a process of its own (as vLLM's EngineCore), so that the server's event loop and
the engine's host work share no GIL: ``EngineProcess`` is the server's handle on it, with
``loop.EngineLoop``'s interface.

The child process (``spawn``: the parent may have started threads) builds the engine with the
``build`` it is given (loading and compiling: the parent waits), then runs an ``EngineRunner``
whose commands come over a pipe (a thread reads them, compiling a new request's grammar on the
way) and whose events, keyed by ints, go back over it with the engine's state, one message per
iteration. A thread of the parent hands each message's events to their jobs on the event loop.
The child ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group, systemd signals
every process of the service: the parent shuts down gracefully and then stops it) and stops when
the pipe closes (the parent died).
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from jaxattn.serve.engine import Engine
from jaxattn.serve.http.loop import Admitted, EngineRunner, EngineState, Event, Failed, Job, Tokens, dispatch, is_last
from jaxattn.serve.http.metrics import Metrics
from jaxattn.serve.scheduler import PageUsage, TokenLogprobs
from jaxattn.serve.structured_output import GrammarCompiler

__all__ = ["EngineFacts", "EngineProcess"]

log = logging.getLogger("jaxattn.serve")


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What the child says of its engine once it is ready: what the handlers check requests against."""

    max_seq_len: int
    vocab_size: int


# An iteration's events and state cross the pipe as plain tuples: pickled in about 1/7 of the time
# the dataclasses take (128 events, a quarter with 5 logprobs: 70 against 480 us on a CPU), on the
# engine's thread between its steps.
_ADMITTED, _TOKENS, _FAILED = range(3)


def _pack(outbox: list[tuple[int, Event]], state: EngineState) -> tuple[list[tuple], tuple]:
    events = []
    for key, event in outbox:
        if isinstance(event, Tokens):
            logprobs = None if event.logprobs is None else [(e.logprob, e.top) for e in event.logprobs]
            events.append((key, _TOKENS, event.ids, event.finish_reason, logprobs))
        elif isinstance(event, Failed):
            events.append((key, _FAILED, event.status, event.message))
        else:
            events.append((key, _ADMITTED))
    pages = state.pages
    return events, (state.waiting, state.running, pages.in_use, pages.free, pages.cached, state.stats,
                    state.step_failed)


def _unpack(events: list[tuple], state: tuple) -> tuple[list[tuple[int, Event]], EngineState]:
    outbox = []
    for key, kind, *fields in events:
        if kind == _TOKENS:
            ids, finish_reason, logprobs = fields
            if logprobs is not None:
                logprobs = [TokenLogprobs(logprob, top) for logprob, top in logprobs]
            outbox.append((key, Tokens(ids, finish_reason, logprobs)))
        else:
            outbox.append((key, Failed(*fields) if kind == _FAILED else Admitted()))
    waiting, running, in_use, free, cached, stats, step_failed = state
    return outbox, EngineState(waiting, running, PageUsage(in_use, free, cached), stats, step_failed)


def _serve(conn: Connection, build: Callable[[], Engine]) -> None:
    """(The child's main.) Builds the engine, says ``("ready", EngineFacts)`` (or ``("failed",
    message)`` for a ``ValueError``: the parent's usage error), runs it until ``("stop",)``."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        engine = build()
    except ValueError as err:
        conn.send(("failed", str(err)))
        return
    conn.send(("ready", EngineFacts(engine.max_seq_len, engine.model.cfg.vocab_size)))

    def send(message: tuple) -> None:
        try:
            conn.send(message)
        except OSError:                              # the parent is gone: the reader stops the loop
            pass

    runner = EngineRunner(engine, lambda outbox, state: send(("events", *_pack(outbox, state))))

    def read() -> None:
        while True:
            try:
                command = conn.recv()
            except (EOFError, OSError):              # the parent is gone
                command = ("stop",)
            if command[0] == "add":
                _compile_grammar(engine, command[4])
            runner.commands.put(command)
            if command[0] == "stop":
                return

    threading.Thread(target=read, name="jaxattn-engine-commands", daemon=True).start()
    runner.run()
    send(("stopped",))


def _compile_grammar(engine: Engine, sampling) -> None:
    """Compiles the request's grammar here, so that adding it on the engine's thread finds it in the
    compiler's cache (the server compiled it too, to check it, in its own process)."""
    spec = sampling.structured_outputs
    if spec is not None and engine.grammar_compiler is not None:
        try:
            engine.grammar_compiler.grammar(spec)
        except ValueError:                           # the engine's add says so
            pass


class EngineProcess:
    """The server's handle on an Engine that ``build`` (picklable, no arguments) makes in a child
    process; returns once the engine is built and compiled. ``ValueError`` with the child's
    message when ``build`` raised one, ``RuntimeError`` when the child exited before it was ready.
    ``start``, ``stop``, ``submit``, ``abort``, ``abort_all``, ``healthy``, ``metrics``,
    ``max_seq_len``, ``vocab_size`` and ``grammar_compiler`` (the parent's own, for the handlers'
    checks: the child's engine has its own) as ``EngineLoop``'s."""

    def __init__(self, build: Callable[[], Engine], grammar_compiler: GrammarCompiler | None = None,
                 metrics: Metrics | None = None):
        self.metrics = metrics or Metrics()
        self.grammar_compiler = grammar_compiler
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, build), name="jaxattn-engine", daemon=True)
        self._process.start()
        child.close()
        # Before multiprocessing's own exit handler (atexit runs the last registered first), which
        # would SIGTERM the child (ignored) and wait for it forever.
        atexit.register(self._end)
        try:
            kind, detail = self._conn.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(f"the engine process exited with status {self._process.exitcode} before it was "
                               "ready") from None
        if kind == "failed":
            self._process.join()
            raise ValueError(detail)
        self.max_seq_len, self.vocab_size = detail.max_seq_len, detail.vocab_size
        self._send_lock = threading.Lock()
        self._keys = itertools.count()
        self._jobs: dict[int, Job] = {}              # jobs in flight by key (event loop)
        self._job_keys: dict[Job, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader = threading.Thread(target=self._read, name="jaxattn-engine-events", daemon=True)
        self._running = True
        self._stopping = False
        self._step_failed = False

    @property
    def healthy(self) -> bool:
        return self._running and not self._step_failed and self._process.is_alive()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starts the thread that delivers the engine's events on ``loop`` (the handlers')."""
        self._loop = loop
        self._reader.start()

    def stop(self, timeout: float | None = None) -> None:
        """Aborts the requests still in flight and ends the child process."""
        self._stopping = True
        self._send(("stop",))
        if self._reader.is_alive():
            self._reader.join(timeout)
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("the engine process did not stop within %s s: killing it", timeout)
            self._process.kill()
            self._process.join()
        self._conn.close()
        atexit.unregister(self._end)

    def _end(self, timeout: float = 5.0) -> None:
        """(At exit, however the server's process ends.) Closes the pipe, so the child stops at its
        next command read, and kills it if it has not exited within ``timeout`` seconds (it may be
        compiling)."""
        self._conn.close()
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def abort_all(self) -> None:
        """Ends every request in flight at the next step: each fails with 503 (shutting down)."""
        self._send(("abort_all",))

    def submit(self, jobs: list[Job]) -> None:
        """(On the event loop.) Adds ``jobs``, the choices of one prompt."""
        keys = [next(self._keys) for _ in jobs]
        for key, job in zip(keys, jobs):
            self._jobs[key], self._job_keys[job] = job, key
        first = jobs[0]
        self._send(("add", keys, first.prompt, first.max_tokens, first.sampling))

    def abort(self, job: Job) -> None:
        """(On the event loop.) Ends ``job``'s request at the next step; no more events come for it."""
        key = self._job_keys.pop(job, None)
        if key is not None:
            del self._jobs[key]
            self._send(("abort", key))

    def _send(self, command: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(command)
            except OSError:                          # the child is gone: _read fails the jobs
                pass

    def _read(self) -> None:
        """(The reader thread.) The child's messages until it stops or dies."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                message = ("stopped",)
            if message[0] != "events":
                break
            outbox, state = _unpack(*message[1:])
            self._observe(state)
            if outbox:
                self._call_soon(self._deliver, outbox)
        self._running = False
        if not self._stopping:
            log.error("the engine process exited (status %s)", self._process.exitcode)
            self._call_soon(self._fail_all, Failed(500, "the engine process exited"))

    def _observe(self, state: EngineState) -> None:
        self.metrics.observe_state(state)
        self._step_failed = state.step_failed

    def _call_soon(self, callback: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:                         # the event loop closed
            pass

    def _deliver(self, outbox: list[tuple[int, Event]]) -> None:
        """(On the event loop.) The events of the jobs still in flight to them."""
        delivered = []
        for key, event in outbox:
            job = self._jobs.get(key)
            if job is None:                          # aborted meanwhile
                continue
            if is_last(event):
                del self._jobs[key], self._job_keys[job]
            delivered.append((job, event))
        dispatch(delivered, self.metrics)

    def _fail_all(self, failure: Failed) -> None:
        jobs, self._jobs, self._job_keys = list(self._jobs.values()), {}, {}
        dispatch([(job, failure) for job in jobs], self.metrics)
