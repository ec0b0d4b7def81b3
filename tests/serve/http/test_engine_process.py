"""``EngineProcess``: the engine in a process of its own (the server's default). In a fresh
process, as the server's would be: the handle touches no device (no JAX backend is initialized in
it); a request's greedy tokens equal the dense model's; an aborted request gets no more events and
its pages are freed; SIGTERM to the engine process is ignored (the server stops it); when it dies,
the requests in flight fail with a 500 and the handle is unhealthy. A ``ValueError`` of the
engine's build is the handle's, with its message; events and state cross the pipe unchanged; a
server's process that exits without stopping its engine process ends it (and does not hang)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("fastapi", reason="needs the [serve] extra (pip install -e \".[test]\")")

from tests.serve.helpers import REPO

ARGS = ["--preset", "tiny", "--layers", "1", "--dtype", "float32", "--backend", "xla", "--max-seqs", "2",
        "--max-seq-len", "64", "--page-size", "8", "--max-step-tokens", "8", "--compilation-cache-dir", ""]

SCRIPT = r"""
import asyncio, functools, json, os, signal, sys
from jax._src import xla_bridge
from jaxattn.serve import cli
from jaxattn.serve.http.engine_process import EngineProcess
from jaxattn.serve.http.loop import Failed, Job, Tokens, is_last
from jaxattn.serve.sampling import SamplingParams

args = cli.build_parser().parse_args(json.loads(sys.argv[1]))
handle = EngineProcess(functools.partial(cli.build_engine, args))
out = {"max_seq_len": handle.max_seq_len}


async def events_of(job):
    events = []
    while not events or not is_last(events[-1]):
        events += await job.take()
    return events


async def main():
    handle.start(asyncio.get_running_loop())
    kept, left = Job([1, 2, 3], 6, SamplingParams()), Job([4, 5, 6], 40, SamplingParams())
    handle.submit([kept])
    handle.submit([left])
    await left.take()                          # admitted
    handle.abort(left)
    events = await events_of(kept)
    out["kept"] = [i for e in events if isinstance(e, Tokens) for i in e.ids]
    out["finish"] = events[-1].finish_reason
    os.kill(handle._process.pid, signal.SIGTERM)     # ignored
    await asyncio.sleep(0.5)
    again = Job([1, 2, 3], 6, SamplingParams())
    handle.submit([again])
    out["again"] = [i for e in await events_of(again) if isinstance(e, Tokens) for i in e.ids]
    for _ in range(50):                        # the iteration after the last step publishes the pages
        if handle.metrics.kv_pages_in_use._value.get() == 0:
            break
        await asyncio.sleep(0.1)
    out["pages_in_use"] = handle.metrics.kv_pages_in_use._value.get()
    out["left_events"] = len(left._events)
    out["healthy"] = handle.healthy
    doomed = Job([7, 8, 9], 60, SamplingParams())
    handle.submit([doomed])
    await doomed.take()
    handle._process.kill()
    failure = (await events_of(doomed))[-1]
    out["after_kill"] = [failure.status, failure.message] if isinstance(failure, Failed) else repr(failure)
    out["healthy_after_kill"] = handle.healthy

asyncio.run(main())
out["parent_backends"] = xla_bridge.backends_are_initialized()
handle.stop(10)
model = cli.load_model(args, None)
from tests.serve.models.test_llama import dense_greedy
import numpy as np
out["dense"] = dense_greedy(model, np.array([1, 2, 3], np.int32), 6)
print(json.dumps(out))
"""


def test_engine_process_serves_aborts_and_fails_alone():
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(ARGS)], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["parent_backends"] is False
    assert out["max_seq_len"] == 64
    assert out["kept"] == out["again"] == out["dense"] and out["finish"] == "length"
    assert out["left_events"] == 0 and out["pages_in_use"] == 0 and out["healthy"]
    assert out["after_kill"] == [500, "the engine process exited"] and not out["healthy_after_kill"]


def test_a_build_error_is_the_handles_value_error():
    from jaxattn.serve import cli
    from jaxattn.serve.http.engine_process import EngineProcess

    args = cli.build_parser().parse_args([*ARGS, "--tp", "64"])
    with pytest.raises(ValueError, match="--tp 64: there are only"):
        EngineProcess(functools.partial(cli.build_engine, args))


def test_events_cross_the_pipe_unchanged():
    """What the engine process packs for the pipe unpacks to the same events and state."""
    from jaxattn.serve.http.engine_process import _pack, _unpack
    from jaxattn.serve.http.loop import Admitted, EngineState, Failed, Tokens
    from jaxattn.serve.scheduler import PageUsage, TokenLogprobs

    outbox = [(0, Admitted()), (1, Tokens([5, 6], None)), (2, Tokens([7], "stop", [TokenLogprobs(-0.5, ((7, -0.5),))])),
              (3, Failed(503, "the server is shutting down"))]
    state = EngineState(1, 2, PageUsage(3, 4, 5), {"preemptions": 1}, True)
    assert _unpack(*_pack(outbox, state)) == (outbox, state)


def test_a_server_process_that_exits_without_stopping_ends_its_engine_process():
    """However the server's process ends (here: it exits with its engine process running, never
    stopped), its exit does not hang on the child (which ignores SIGTERM), and the child is gone."""
    import time

    script = ("import functools, json, sys\n"
              "from jaxattn.serve import cli\n"
              "from jaxattn.serve.http.engine_process import EngineProcess\n"
              "handle = EngineProcess(functools.partial(cli.build_engine, cli.build_parser().parse_args("
              "json.loads(sys.argv[1]))))\n"
              "print(handle._process.pid, flush=True)\n"
              "sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(ARGS)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 3, proc.stderr[-3000:]
    child = int(proc.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the engine process {child} outlived the server's")
