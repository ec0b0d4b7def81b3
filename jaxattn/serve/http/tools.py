"""Tool calling for chats: ``tools`` with ``tool_choice`` ``"required"`` or a named function,
through structured output (as vLLM does without a tool-call parser).

The tools go to the chat template (as transformers' ``apply_chat_template(tools=...)``; a
template that never mentions ``tools`` is refused). The output is constrained to JSON: for a
named function, its arguments (the function's ``parameters`` schema); for ``"required"``, a
non-empty array of ``{"name": ..., "parameters": {...}}`` calls of the given functions (one
call when ``parallel_tool_calls`` is false). The JSON becomes the answer's ``tool_calls``
(``content`` null). ``"auto"`` (OpenAI's default when tools are given) needs a parser of the
model's own tool-call format, which the server does not have: refused, as vLLM refuses it
without ``--tool-call-parser``. ``"none"``: the tools are left out and the answer is text.
"""

from __future__ import annotations

import dataclasses
import json
import uuid

from jaxattn.serve.http.protocol import APIError, ChatRequest
from jaxattn.serve.structured_output import StructuredOutputs

__all__ = ["ToolPlan", "plan_tools"]


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How a chat calls its tools: ``named`` (the function tool_choice names; None: any of them,
    "required"), the tools as the chat template takes them, and whether several calls may come."""

    named: str | None
    tools: list[dict]
    parallel: bool = True

    @property
    def constraint(self) -> StructuredOutputs:
        """What the output must match."""
        functions = {tool["function"]["name"]: tool["function"] for tool in self.tools}
        if self.named is not None:
            return StructuredOutputs(json=_parameters(functions[self.named]))
        call = {"anyOf": [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": _parameters(f)},
                           "required": ["name", "parameters"], "additionalProperties": False}
                          for name, f in functions.items()]}
        schema = {"type": "array", "items": call, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputs(json=schema)

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish reason of an answer that calls the tools: "stop" when the request named
        the function, else "tool_calls"."""
        return "stop" if self.named is not None else "tool_calls"

    def calls(self, text: str) -> list[dict] | None:
        """The answer's ``tool_calls`` from its complete output ``text``; None when ``text`` is no
        complete call (cut by max_tokens or a stop string)."""
        try:
            value = json.loads(text)
            pairs = [(self.named, value)] if self.named is not None else [(c["name"], c["parameters"]) for c in value]
        except (json.JSONDecodeError, TypeError, KeyError):
            return None
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
                for name, arguments in pairs]


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def plan_tools(body: ChatRequest, chat_template: str | None) -> ToolPlan | None:
    """The ``ToolPlan`` of ``body``'s ``tools`` and ``tool_choice`` (None: the answer is text, the
    template gets no tools). APIError (400) for "auto", a tool_choice without tools or naming
    none of them, tools beside ``response_format`` or ``structured_outputs``, or a chat template
    that takes no tools."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice: there are no tools to choose from", param="tool_choice")
        return None
    if choice == "none":
        return None
    if choice in (None, "auto"):
        raise APIError(400, 'tool_choice: "auto" (the default when tools are given) needs a parser of the model\'s '
                       'tool-call format, which this server does not have: use "required" or name a function '
                       '({"type": "function", "function": {"name": ...}})', param="tool_choice")
    names = [tool.function.name for tool in body.tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: two tools have the same name", param="tools")
    named = None if choice == "required" else choice.function.name
    if named is not None and named not in names:
        raise APIError(400, f"tool_choice: names the function {named!r}, which is not among the tools",
                       param="tool_choice")
    if body.output_constraint() is not None:
        raise APIError(400, "tools: a tool call's output is JSON of its own: not with response_format or "
                       "structured_outputs", param="tools")
    if chat_template is None or "tools" not in chat_template:
        raise APIError(400, "tools: this model's chat template takes no tools", param="tools")
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    return ToolPlan(named, tools, parallel=body.parallel_tool_calls is not False)
