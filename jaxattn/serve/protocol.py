"""The OpenAI-compatible request bodies (pydantic) and error bodies of the HTTP server.

Fields follow OpenAI's completions and chat completions APIs; ``top_k`` and ``return_token_ids``
are vLLM's extensions. Fields OpenAI has that the engine does not implement are accepted only at
their default values, and refused (400 naming the field) otherwise, rather than ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)

__all__ = ["APIError", "ChatMessage", "ChatRequest", "CompletionRequest", "error_body"]

PositiveInt = Annotated[StrictInt, Field(ge=1)]
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
Number = StrictInt | StrictFloat


class APIError(Exception):
    """An error answered with an OpenAI-style body: ``status`` and the ``param`` (field) at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    """What both endpoints share: the model, sampling, stop conditions, streaming."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    # None (JSON null) is the default: temperature 1 (OpenAI's), top_p 1, top_k -1 (all tokens)
    temperature: Annotated[Number, Field(ge=0)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, lt=2**32)] | None = None
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=16)] | None = None
    n: Literal[1] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False
    # OpenAI's, not implemented: only their defaults
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0
    logit_bias: None = None
    logprobs: Literal[False] | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a text or a list of token ids (one prompt)."""

    prompt: StrictStr | Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
    max_tokens: PositiveInt | None = 16
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as text: a string, or the concatenated text of ``{"type": "text"}`` parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in self.content):
            raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
        return "".join(part["text"] for part in self.content)


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: the messages go through the checkpoint's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    tools: None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
