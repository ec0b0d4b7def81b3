"""The OpenAI-compatible request bodies (pydantic), how a body is read, and the error bodies of
the HTTP server.

Fields follow OpenAI's completions and chat completions APIs; ``top_k``, ``ignore_eos``,
``stop_token_ids``, ``min_tokens``, ``return_token_ids``, ``structured_outputs`` and ``guided_*``
are vLLM's extensions (``response_format``, ``structured_outputs``: ``jaxattn.serve.structured_output``). The
policy for fields the server does not implement: those of OpenAI's API or vLLM's that change
what is returned (``best_of``, a chat's ``echo``, ``functions``, penalties, ...:
``UNIMPLEMENTED``) are accepted only absent, null or at their default, and refused otherwise
(400 naming the field), never ignored; any other unknown field (``user``, ``metadata``,
``store``, ...: nothing that changes the answer) is accepted and ignored, and logged once per
name (the first 256 names).

``parse_body`` reads a body before pydantic does: strict UTF-8, JSON without ``NaN`` or
``Infinity`` (or numbers too large for a float), no lone UTF-16 surrogates (``"\\ud800"`` is valid
JSON but no text), a JSON object; each a 400 naming the field.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from jaxattn.serve.sampling import MAX_LOGPROBS
from jaxattn.serve.structured_output import StructuredOutputs

__all__ = ["APIError", "Body", "ChatMessage", "ChatRequest", "CompletionRequest", "error_body", "parse_body"]

log = logging.getLogger("jaxattn.serve")

PositiveInt = Annotated[StrictInt, Field(ge=1)]
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
Number = StrictInt | StrictFloat
TokenId = Annotated[StrictInt, Field(ge=0, lt=2**31)]
NumLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]
MAX_CHOICES = 128                       # OpenAI's bound on n


class APIError(Exception):
    """An error answered with an OpenAI-style body: ``status`` and the ``param`` (field) at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


# Fields that change what is returned and that the server does not implement (OpenAI's, vLLM's),
# with the values it accepts (their defaults; null is accepted for every one).
_UNIMPLEMENTED_SAMPLING: dict[str, tuple] = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "min_p": (0,),
    "logit_bias": ({},), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "allowed_token_ids": (), "bad_words": ([],),
    "prompt_logprobs": (), "truncate_prompt_tokens": (), "use_beam_search": (False,), "length_penalty": (1,),
    "logits_processors": (),
}


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: the schema (``name``, ``description`` and
    ``strict`` are accepted; the schema is always enforced)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: StrictStr | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("json_schema", "json_schema is given with type \"json_schema\", and only then")
        return self


class StructuredOutputsBody(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema), ``json_object``,
    ``regex``, ``choice`` or ``grammar`` (Lark, llguidance's syntax)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    json_object: StrictBool | None = None
    regex: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    grammar: StrictStr | None = None


class _Sampling(BaseModel):
    """What both endpoints share: the model, sampling, stop conditions, streaming."""

    model_config = ConfigDict(extra="ignore")
    UNIMPLEMENTED: ClassVar[dict[str, tuple]] = _UNIMPLEMENTED_SAMPLING

    model: StrictStr
    # None (JSON null) is the default: temperature 1 (OpenAI's), top_p 1, top_k -1 (all tokens)
    temperature: Annotated[Number, Field(ge=0)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, lt=2**31)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, lt=2**32)] | None = None
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    # vLLM's older spelling of structured_outputs' json, regex, choice and grammar
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    guided_grammar: StrictStr | None = None

    def output_constraint(self) -> tuple[StructuredOutputs, str] | None:
        """(what the output must match, the field that asks) from ``response_format``,
        ``structured_outputs`` or a ``guided_*`` field; None: free text. APIError (400) when
        more than one asks, or when ``structured_outputs`` does not set exactly one constraint."""
        response_format = None if self.response_format is None or self.response_format.type == "text" else \
            self.response_format
        guided = {name: getattr(self, f"guided_{name}") for name in ("json", "regex", "choice", "grammar")}
        asking = ["response_format"] * (response_format is not None) + \
            ["structured_outputs"] * (self.structured_outputs is not None) + \
            [f"guided_{name}" for name, value in guided.items() if value is not None]
        if len(asking) > 1:
            raise APIError(400, f"{asking[-1]}: give one of {', '.join(asking)}, not several", param=asking[-1])
        if not asking:
            return None
        if response_format is not None:
            if response_format.type == "json_object":
                return StructuredOutputs(json_object=True), "response_format"
            return StructuredOutputs(json=response_format.json_schema.json_schema), "response_format"
        if self.structured_outputs is None:
            return StructuredOutputs(**{name: value for name, value in guided.items() if value is not None}), asking[0]
        given = self.structured_outputs
        try:
            spec = StructuredOutputs(json=given.json_schema, json_object=bool(given.json_object), regex=given.regex,
                                     choice=given.choice, grammar=given.grammar)
        except ValueError as err:
            raise APIError(400, f"structured_outputs: {str(err).removeprefix('StructuredOutputs: ')}",
                           param="structured_outputs") from None
        return spec, "structured_outputs"

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a text or a list of token ids (one prompt)."""

    UNIMPLEMENTED: ClassVar[dict[str, tuple]] = {**_UNIMPLEMENTED_SAMPLING, "best_of": (1,), "suffix": ()}

    prompt: StrictStr | Annotated[list[TokenId], Field(min_length=1)]
    max_tokens: PositiveInt | None = 16
    logprobs: NumLogprobs | None = None
    echo: StrictBool = False

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token of the logprobs asked for (None: no logprobs)."""
        return self.logprobs


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


class FunctionSpec(BaseModel):
    """A tool's function: its name and the JSON schema of its arguments."""

    model_config = ConfigDict(extra="ignore")

    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    """OpenAI's ``tools[i]``: ``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StrictStr


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call that function."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: the messages go through the checkpoint's chat template."""

    UNIMPLEMENTED: ClassVar[dict[str, tuple]] = {
        **_UNIMPLEMENTED_SAMPLING, "functions": ([],), "function_call": ("none",), "audio": (),
        "modalities": (["text"],), "echo": (False,), "add_generation_prompt": (True,),
        "continue_final_message": (False,), "chat_template": (), "chat_template_kwargs": (),
        "documents": (),
    }

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: NumLogprobs | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("needs_logprobs", "needs \"logprobs\": true")
        return value

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token of the logprobs asked for (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Body = TypeVar("Body", CompletionRequest, ChatRequest)
_ignored_fields: set[str] = set()       # unknown fields already logged
_MAX_LOGGED_FIELDS = 256                # then no more: clients choose the names
_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def parse_body(raw: bytes, request_type: type[Body]) -> Body:
    """The ``request_type`` of a request body ``raw``; APIError (400, naming the field where there is one)
    when the body is not UTF-8 JSON, holds a lone surrogate or a non-finite number, is not an
    object, sets an unimplemented field (``UNIMPLEMENTED``) off its default, or fails the model."""
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise APIError(400, f"the body is not UTF-8: byte {err.start} ({raw[err.start:err.start + 1]!r}) "
                       "starts no character") from None
    except json.JSONDecodeError as err:
        raise APIError(400, f"the body is not valid JSON: {err}") from None
    except ValueError:                            # Python's bound on int digits
        raise APIError(400, "the body holds an integer of over 4300 digits") from None
    except RecursionError:
        raise APIError(400, "the body nests arrays or objects too deeply") from None
    if not isinstance(value, dict):
        raise APIError(400, f"the body must be a JSON object, got {_JSON_TYPES[type(value)]}")
    _check_values(value)
    for name, accepted in request_type.UNIMPLEMENTED.items():
        given = value.get(name)
        if given is not None and not any(_same(given, a) for a in accepted):
            only = f"only {' or '.join(json.dumps(a) for a in accepted)} or null" if accepted else "only null"
            raise APIError(400, f"{name}: this server does not implement it ({only} accepted), got "
                           f"{_shorten(json.dumps(given))}", param=name)
    for name in value.keys() - request_type.model_fields.keys() - request_type.UNIMPLEMENTED.keys():
        if name not in _ignored_fields and len(_ignored_fields) < _MAX_LOGGED_FIELDS:
            _ignored_fields.add(name)
            log.warning("the request field %r is not one this server knows: ignored (logged once)", _shorten(name))
    try:
        return request_type.model_validate(value)
    except ValidationError as err:
        message, param = _validation_error(err)
        raise APIError(400, message, param=param) from None


# Values that hold no text and no float (a list of only these needs no walk).
_PLAIN_TYPES = {int, bool}


def _check_values(body: dict) -> None:
    """APIError naming the field of the first lone surrogate (in a string or a key) or non-finite
    number in ``body`` (``json.loads`` takes ``NaN``, ``Infinity`` and ``1e999`` as floats). Keys
    are checked before they are part of a path (an error message is text)."""
    for key in body:
        _check_text("a field name", key)
    pending: list[tuple[str, Any]] = list(body.items())
    while pending:
        path, value = pending.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise APIError(400, f"{_shorten(path)}: {value} is not a finite number (JSON has no NaN or Infinity)",
                           param=_field(path))
        if isinstance(value, str):
            _check_text(path, value)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(f"{path} (a key)", key)
                pending.append((f"{path}.{key}", item))
        elif isinstance(value, list) and not set(map(type, value)) <= _PLAIN_TYPES:   # token ids: nothing to check
            pending += [(f"{path}[{i}]", item) for i, item in enumerate(value)]


def _check_text(path: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(400, f"{_shorten(path)}: a lone UTF-16 surrogate ({text[err.start]!r} at character "
                       f"{err.start}) is not text", param=_field(path)) from None


def _field(path: str) -> str | None:
    """The top-level field of a path like ``messages[0].content``."""
    return None if path == "a field name" else path.split(".", 1)[0].split("[", 1)[0].split(" ", 1)[0]


def _same(given: Any, accepted: Any) -> bool:
    """``given == accepted``, but a bool is no number (``false == 0`` in Python)."""
    return given == accepted and isinstance(given, bool) == isinstance(accepted, bool)


def _shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _validation_error(err: ValidationError) -> tuple[str, str | None]:
    """(message, param) of a body pydantic refused: the first field at fault."""
    errors = err.errors()
    first = errors[0]
    param = str(first["loc"][0])
    same = [e for e in errors if [str(p) for p in e["loc"]][:1] == [param]]
    missing = [e for e in same if e["type"] == "missing"]
    if missing:
        inside = ".".join(str(p) for p in missing[0]["loc"][1:])
        return f"{param}: {inside + ': ' if inside else ''}a required field is missing", param
    hint = " (one prompt per request: a text or a list of token ids)" if param == "prompt" else ""
    # the path inside the field, for a nested one (response_format.type: ...)
    messages = (".".join(str(p) for p in e["loc"][1:] if not isinstance(p, int) or len(e["loc"]) > 2) + ": " * (
        len(e["loc"]) > 1) + e["msg"] for e in same)
    return _shorten(f"{param}: " + "; ".join(dict.fromkeys(messages)), 400) + hint, param
