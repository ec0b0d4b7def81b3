"""The FastAPI application: OpenAI-compatible completions and chat completions (plain or streamed
as server-sent events), the model list, health and Prometheus metrics, over an engine handle
(``EngineLoop``: a thread of this process; ``EngineProcess``: a process of its own).

Every request is checked before it reaches the engine; what a client can get wrong is a 4xx with
an OpenAI-style error body naming the field (``param``): a body over ``max_request_bytes`` is a
413 before it is read, the rest is ``protocol.parse_body``'s. Tokenizing and the chat template run
in a worker thread, so that a long prompt delays no other request. A client that disconnects has
its request aborted at the next engine step (its pages freed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxattn.serve.engine import Engine
from jaxattn.serve.http.logprobs import chat_logprobs, completion_logprobs, token_id_text
from jaxattn.serve.http.engine_process import EngineProcess
from jaxattn.serve.http.loop import Admitted, EngineLoop, Event, Failed, Job, hand_over_gil
from jaxattn.serve.http.metrics import CONTENT_TYPE_LATEST
from jaxattn.serve.http.protocol import APIError, Body, ChatRequest, CompletionRequest, error_body, parse_body
from jaxattn.serve.http.text import TextStream, TextTokenizer
from jaxattn.serve.http.tools import ToolPlan, plan_tools
from jaxattn.serve.sampling import SamplingParams
from jaxattn.serve.scheduler import TokenLogprobs
from jaxattn.serve.structured_output import StructuredOutputs

__all__ = ["MAX_REQUEST_BYTES", "build_app"]

# What a client disconnecting before its answer gets (nginx's "client closed request"; never sent).
CLIENT_CLOSED = 499
# The default bound on a request body (413 above it): a prompt of 128k tokens as JSON token ids or
# as text escaped to \uXXXX is well under it.
MAX_REQUEST_BYTES = 8 * 2**20
# Seconds the app's end waits for the engine to finish its step and abort what is left.
ENGINE_STOP_S = 60.0


class Chunk(NamedTuple):
    """What a take of a generation's events brings: the new text, token ids, the finish reason
    (None until the last), and the ids' ``TokenLogprobs`` when the request asked for them."""

    text: str
    ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None


class Generation:
    """One job's output as it comes: a ``Chunk`` per take of the job's events (the tokens of every
    engine step since the last take: one step's while the event loop keeps up, several once it
    falls behind), ``stop`` strings applied (the request is aborted at the first). ``close``
    aborts the request if it has not finished, and counts it in the metrics."""

    def __init__(self, engine_loop: EngineLoop | EngineProcess, job: Job, tokenizer: TextTokenizer | None, stop: tuple[str, ...]):
        self.engine_loop, self.job = engine_loop, job
        self.text = None if tokenizer is None else TextStream(tokenizer, job.prompt, stop, job.sampling.min_tokens)
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._pending: list[Event] = []             # events that came with Admitted
        self._arrival = time.perf_counter()
        self._first = self._last = 0.0
        self._closed = False

    async def start(self) -> None:
        """Waits for the engine to take the request; APIError when it refuses it."""
        event, *self._pending = await self.job.take()
        if isinstance(event, Failed):
            self.finish_reason = "error"
            raise _engine_error(event)
        assert isinstance(event, Admitted), event

    async def chunks(self) -> AsyncIterator[Chunk]:
        while self.finish_reason is None:
            events, self._pending = self._pending or await self.job.take(), []
            hand_over_gil()
            ids: list[int] = []
            logprobs: list[TokenLogprobs] | None = [] if self.job.sampling.logprobs is not None else None
            finish = failed = None
            for event in events:
                if isinstance(event, Failed):
                    failed = event
                    break
                ids += event.ids
                if logprobs is not None:
                    logprobs += event.logprobs
                finish = event.finish_reason
                if self.text is not None:
                    shown = event.ids
                    if finish == "stop" and shown and shown[-1] in self.job.sampling.stop_token_ids:
                        shown = shown[:-1]             # the stop token is not text
                    self.text.add(shown)
                    if self.text.stopped:              # a stop string: the request ends here
                        if finish is None:
                            self.engine_loop.abort(self.job)
                        finish = "stop"
                if finish is not None:
                    break
            if ids:
                self._last = time.perf_counter()
                self._first = self._first or self._last
                self.token_ids += ids
                delta = self.text.take(final=finish is not None) if self.text is not None else ""
                self.finish_reason = finish
                yield Chunk(delta, ids, finish, logprobs)
            if failed is not None:
                self.finish_reason = "error"
                raise _engine_error(failed)

    def close(self) -> None:
        """Aborts the request unless it finished; records its metrics (once)."""
        if self._closed:
            return
        self._closed = True
        if self.finish_reason is None:
            self.engine_loop.abort(self.job)
            self.finish_reason = "abort"
        metrics = self.engine_loop.metrics
        metrics.requests_finished.labels(self.finish_reason).inc()
        if self._first:
            metrics.ttft.observe(self._first - self._arrival)
            if len(self.token_ids) > 1:
                metrics.tpot.observe((self._last - self._first) / (len(self.token_ids) - 1))

def _usage(generations: list[Generation]) -> dict:
    """The usage of one prompt's choices: the prompt counted once, every choice's tokens."""
    prompt = len(generations[0].job.prompt)
    completion = sum(len(generation.token_ids) for generation in generations)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _merged(generations: list[Generation]) -> AsyncIterator[tuple[int, Chunk]]:
    """``(choice index, chunk)`` of every generation as they come; the first APIError raised."""
    if len(generations) == 1:                        # no tasks for the common case
        async for chunk in generations[0].chunks():
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, generation: Generation) -> None:
        try:
            async for chunk in generation.chunks():
                await queue.put((i, chunk))
        except APIError as err:
            await queue.put((i, err))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def _engine_error(event: Failed) -> APIError:
    return APIError(event.status, event.message, kind="invalid_request_error" if event.status < 500 else "server_error")


class _EventStream(StreamingResponse):
    """Server-sent events of a prompt's generations, closed however the response ends (a client
    gone before the first event never starts the events' generator, so its ``finally`` would not
    run)."""

    def __init__(self, events: AsyncIterator[str], generations: list[Generation]):
        super().__init__(events, media_type="text/event-stream")
        self.generations = generations

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for generation in self.generations:
                generation.close()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: only that message is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def build_app(engine: Engine | EngineLoop | EngineProcess, *, model_name: str, tokenizer: TextTokenizer | None = None,
              max_request_bytes: int = MAX_REQUEST_BYTES) -> FastAPI:
    """The server's app over ``engine`` (an Engine is run in a thread of this process: an
    ``EngineLoop``; the handle's thread or process starts and stops with the app's lifespan),
    serving it as ``model_name``; without ``tokenizer``, prompts are token ids only; bodies over
    ``max_request_bytes`` get a 413."""
    engine_loop = engine if isinstance(engine, (EngineLoop, EngineProcess)) else EngineLoop(engine)
    metrics = engine_loop.metrics
    created = int(time.time())
    vocab_size, max_seq_len = engine_loop.vocab_size, engine_loop.max_seq_len

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine_loop.start(asyncio.get_running_loop())
        yield
        engine_loop.stop(ENGINE_STOP_S)

    app = FastAPI(title="jaxattn", lifespan=lifespan)
    app.state.engine_loop = engine_loop

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        code = "model_not_found" if err.status == 404 else None
        return JSONResponse(error_body(err.message, kind=err.kind, param=err.param, code=code), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(err.detail)), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, err: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(err).__name__}: {err}", kind="server_error"),
                            status_code=500)

    async def read(request: Request, request_type: type[Body]) -> Body:
        """The request's body, read up to ``max_request_bytes`` (413 beyond), parsed."""
        too_large = APIError(413, f"the request body is over this server's limit of {max_request_bytes} bytes "
                             "(--max-request-bytes)")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_request_bytes:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_request_bytes:
                raise too_large
            chunks.append(chunk)
        return parse_body(b"".join(chunks), request_type)

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"model: the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", kind="not_found_error")

    def need_tokenizer(param: str, needs: str) -> TextTokenizer:
        if tokenizer is None:
            raise APIError(400, f"{param}: {needs} a tokenizer, and this server has none (a model without one): "
                           "send prompts as token ids to /v1/completions", param=param)
        return tokenizer

    async def compiled(found: tuple[StructuredOutputs, str] | None) -> StructuredOutputs | None:
        """The grammar of ``found`` (what the output must match, the field that asks: the body's
        ``response_format``, ``structured_outputs`` or ``tools``), compiled once off the event
        loop (the engine's copy is then a cached one); 400 when it does not compile or the server
        has no grammar compiler."""
        if found is None:
            return None
        spec, param = found
        if engine_loop.grammar_compiler is None:
            raise APIError(400, f"{param}: structured output needs the model's tokenizer and llguidance, and this "
                           "server has no grammar compiler", param=param)
        try:
            await asyncio.to_thread(engine_loop.grammar_compiler.grammar, spec)
        except ValueError as err:
            raise APIError(400, f"{param}: does not compile: {err}", param=param) from None
        return spec

    def make_jobs(body: CompletionRequest | ChatRequest, prompt: list[int], prompt_param: str, max_tokens: int | None,
                  max_tokens_param: str, constraint: StructuredOutputs | None) -> list[Job]:
        """The checked jobs of the ``n`` choices: prompt ids in the vocabulary, the length in
        max_seq_len, the sampling (``constraint``: the output's grammar)."""
        if not prompt:
            raise APIError(400, f"{prompt_param}: the prompt encodes to no tokens", param=prompt_param)
        if max(prompt) >= vocab_size:
            raise APIError(400, f"{prompt_param}: token ids must be in [0, {vocab_size}) (the model's vocab_size), "
                           f"got {max(prompt)}", param=prompt_param)
        if len(prompt) >= max_seq_len:
            raise APIError(400, f"{prompt_param}: the prompt has {len(prompt)} tokens; this server's max_seq_len "
                           f"(prompt + generated tokens) is {max_seq_len}", param=prompt_param)
        if max_tokens is None:
            max_tokens = max_seq_len - len(prompt)
        elif len(prompt) + max_tokens > max_seq_len:
            raise APIError(400, f"{max_tokens_param}: the prompt's {len(prompt)} tokens + {max_tokens_param}="
                           f"{max_tokens} exceed this server's max_seq_len {max_seq_len}", param=max_tokens_param)
        if body.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens: {body.min_tokens} is more than the {max_tokens} tokens the request may "
                           "generate", param="min_tokens")
        if body.stop_strings:
            need_tokenizer("stop", "stop strings need")
        eos_ids = tokenizer.stop_token_ids if tokenizer is not None and not body.ignore_eos else ()
        stop_ids = tuple(sorted(set(eos_ids) | set(body.stop_token_ids or ())))
        try:
            sampling = SamplingParams(temperature=float(1.0 if body.temperature is None else body.temperature),
                                      top_k=-1 if body.top_k is None else body.top_k,
                                      top_p=float(1.0 if body.top_p is None else body.top_p), seed=body.seed,
                                      stop_token_ids=stop_ids, min_tokens=body.min_tokens, logprobs=body.num_logprobs,
                                      structured_outputs=constraint)
        except ValueError as err:     # e.g. a temperature of 1e39 or a top_p of 1e-46: inf or 0 in float32
            message = str(err).removeprefix("SamplingParams: ")
            raise APIError(400, message, param=message.split(" ", 1)[0]) from None
        return [Job(prompt, max_tokens, sampling) for _ in range(body.n)]

    async def respond(request: Request, body: CompletionRequest | ChatRequest, jobs: list[Job], chat: bool,
                      tools: ToolPlan | None = None, echo: str = "") -> Response:
        """The answer of ``jobs`` (the ``n`` choices of one prompt), streamed or whole (``tools``:
        a chat's outputs are tool calls; ``echo``: a completion's text starts with it)."""
        generations = [Generation(engine_loop, job, tokenizer, body.stop_strings) for job in jobs]
        engine_loop.submit(jobs)
        try:
            for generation in generations:
                await generation.start()
        except BaseException:
            for generation in generations:
                generation.close()
            raise
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model_name}
        if body.stream:
            return _EventStream(stream(generations, body, head, chat, tools, echo), generations)
        collect = asyncio.ensure_future(complete(generations, body, head, chat, tools, echo))
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not collect.done():
                collect.cancel()
            for generation in generations:
                generation.close()
        if not collect.done() or collect.cancelled():
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(collect.result())

    token_text = tokenizer.token_text if tokenizer is not None else token_id_text

    def choice(chat: bool, index: int, chunk: Chunk, body, *, delta: bool, text_offset: int = 0,
               calls: list[dict] | None = None) -> dict:
        """Choice ``index`` of ``chunk`` (the whole answer unless ``delta``); ``text_offset``:
        where the chunk's tokens start in the completion's text (completions' logprobs);
        ``calls``: a chat's tool calls (its content then null)."""
        if not chat:
            out = {"index": index, "text": chunk.text}
        elif delta:
            out = {"index": index, "delta": {"content": chunk.text} if chunk.text else {}}
            if calls:
                out["delta"] = {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
        else:
            out = {"index": index, "message": {"role": "assistant", "content": chunk.text}}
            if calls:
                out["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
        out["logprobs"] = None
        if chunk.logprobs is not None:
            out["logprobs"] = chat_logprobs(chunk.ids, chunk.logprobs, token_text) if chat else \
                completion_logprobs(chunk.ids, chunk.logprobs, token_text, text_offset)
        out["finish_reason"] = chunk.finish_reason
        if body.return_token_ids:
            out["token_ids"] = chunk.ids
        return out

    async def whole(generation: Generation, body) -> Chunk:
        """A generation's chunks as one."""
        chunks = [chunk async for chunk in generation.chunks()]
        logprobs = None if body.num_logprobs is None else [e for chunk in chunks for e in chunk.logprobs]
        return Chunk("".join(chunk.text for chunk in chunks), generation.token_ids, generation.finish_reason,
                     logprobs)

    def tool_calls(tools: ToolPlan | None, chunk: Chunk, text: str) -> tuple[Chunk, list[dict] | None]:
        """The last chunk of a generation whose whole output is ``text``, and its tool calls (None:
        no tools, or an output cut before its calls were complete, then sent as text)."""
        if tools is None or chunk.finish_reason is None:
            return chunk, None
        calls = tools.calls(text) if chunk.finish_reason == "stop" else None
        if calls is None:
            return chunk._replace(text=text), None
        return chunk._replace(finish_reason=tools.finish_reason), calls

    async def complete(generations: list[Generation], body, head: dict, chat: bool, tools: ToolPlan | None,
                       echo: str) -> dict:
        answers = await asyncio.gather(*(whole(generation, body) for generation in generations))
        choices = []
        for i, answer in enumerate(answers):
            answer, calls = tool_calls(tools, answer._replace(text=echo + answer.text), answer.text)
            choices.append(choice(chat, i, answer, body, delta=False, calls=calls))
        result = {**head, "choices": choices, "usage": _usage(generations)}
        if body.return_token_ids:
            result["prompt_token_ids"] = generations[0].job.prompt
        return result

    async def stream(generations: list[Generation], body, head: dict, chat: bool,
                     tools: ToolPlan | None, echo: str) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        # A chunk is the head's JSON, serialized once, and its choice's: `prefix + choice + "]}\n\n"`.
        prefix = f"data: {json.dumps(head, ensure_ascii=False)[:-1]}, \"choices\": ["
        try:
            if chat:
                for i in range(len(generations)):
                    yield _sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                      "finish_reason": None}]})
            for i in range(len(generations) if echo else 0):
                yield _sse({**head, "choices": [{"index": i, "text": echo, "logprobs": None, "finish_reason": None}]})
            text_offsets = [0] * len(generations)
            async for i, chunk in _merged(generations):
                calls = None
                if tools is not None:                # tool calls come whole, in the last chunk
                    chunk, calls = tool_calls(tools, chunk._replace(text=""), generations[i].text.text)
                if chunk.text or chunk.finish_reason or body.return_token_ids or chunk.logprobs:
                    out = choice(chat, i, chunk, body, delta=True, text_offset=text_offsets[i], calls=calls)
                    yield f"{prefix}{json.dumps(out, ensure_ascii=False)}]}}\n\n"
                    if out["logprobs"] is not None and not chat:      # the next chunk's tokens start after these
                        text_offsets[i] += sum(map(len, out["logprobs"]["tokens"]))
            if include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(generations)})
            yield _sse("[DONE]")
        except APIError as err:                      # after the headers: the error as the last event,
            yield _sse(error_body(err.message, kind=err.kind, code=err.status))   # its status as the code

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read(request, CompletionRequest)
        check_model(body.model)
        if isinstance(body.prompt, list):
            prompt = body.prompt
        else:
            text_tokenizer = need_tokenizer("prompt", "a text prompt needs")
            prompt = await asyncio.to_thread(text_tokenizer.encode, body.prompt)
        echo = ""
        if body.echo:
            if body.logprobs is not None:
                raise APIError(400, "echo: with logprobs it needs the prompt's logprobs, which this server does not "
                               "compute", param="echo")
            echo = body.prompt if isinstance(body.prompt, str) else \
                need_tokenizer("echo", "echoing token ids needs").decode(prompt)
        constraint = await compiled(body.output_constraint())
        return await respond(request, body, make_jobs(body, prompt, "prompt", body.max_tokens, "max_tokens",
                                                      constraint), False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read(request, ChatRequest)
        check_model(body.model)
        chat_tokenizer = need_tokenizer("messages", "chat needs")
        tools = plan_tools(body, chat_tokenizer.chat_template)
        try:
            messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
            prompt = await asyncio.to_thread(chat_tokenizer.encode_chat, messages, tools and tools.tools)
        except ValueError as err:                    # ChatTemplateError too
            raise APIError(400, f"messages: {err}", param="messages") from err
        limit_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        constraint = await compiled((tools.constraint, "tools") if tools else body.output_constraint())
        return await respond(request, body, make_jobs(body, prompt, "messages", body.token_limit, limit_param,
                                                      constraint), True, tools)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "jaxattn", "max_model_len": max_seq_len}]}

    @app.get("/health")
    async def health() -> Response:
        if engine_loop.healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy: the engine stopped or its last step failed"},
                            status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app

