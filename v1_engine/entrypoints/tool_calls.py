"""Tool calls on /v1/chat/completions: what a request's `tools` / `tool_choice` ask of the output,
and the calls read back from the text.

A forced call is enforced by structured outputs: a named function's output is its arguments
object (JSON valid under the function's `parameters`), and "required" is a JSON array of
`{"name", "parameters"}` objects, one of the tools each (at least one; exactly one with
`parallel_tool_calls: false`). "auto" leaves the output free and reads the calls back with the
server's tool-call parser (tool_parsers.py); without one it is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from v1_engine.structured_output import StructuredOutputsParams

if TYPE_CHECKING:
    from v1_engine.entrypoints.protocol_openai import ChatCompletionRequest

ANY_OBJECT: dict[str, Any] = {"type": "object"}
"""The arguments of a function without `parameters`."""


@dataclass(frozen=True)
class ToolPlan:
    mode: str
    """"text" (no tool call), "named", "required" or "auto"."""
    name: str | None = None
    """The named function."""
    parser: str | None = None
    """"auto": the tool-call parser reading the calls."""
    structured: StructuredOutputsParams | None = None
    """The constraint that forces the call(s)."""
    reasoning: str | None = None
    """The reasoning parser splitting the output before the plan reads it (None: no split)."""
    constrained: bool = False
    """Whether structured outputs constrain the output from its first token."""
    include_reasoning: bool = True
    """Whether the reasoning split off is sent (`reasoning_content`)."""
    reasoning_end_ids: tuple[int, ...] = ()
    """The reasoning's end tag as token ids (where its token count stops)."""


def plan_tools(body: ChatCompletionRequest, parser: str | None = None) -> ToolPlan:
    """The request's tool plan under the server's tool-call `parser`; a ValueError naming the
    field for a choice that cannot hold."""
    tools = body.tools or []
    choice = body.tool_choice
    if choice is not None and not tools:
        raise ValueError("tool_choice requires tools: no tool was given")
    if not tools:
        return ToolPlan("text")
    names = [tool.function.name for tool in tools]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"tools must name each function once, got {repeated} repeated")
    for i, tool in enumerate(tools):
        _check_schema(tool.function.parameters or ANY_OBJECT, f"tools.{i}.function.parameters")
    if choice is None or choice == "auto":
        if parser is None:
            raise ValueError(
                'tool_choice "auto" (the default when tools are given) needs a tool-call parser '
                "for the model: start the server with --tool-call-parser, or set tool_choice to "
                '"required", "none" or {"type": "function", "function": {"name": ...}}'
            )
        return ToolPlan("auto", parser=parser)
    if choice == "none":
        return ToolPlan("text")
    if choice == "required":
        item_schemas = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool.function.name},
                    "parameters": tool.function.parameters or ANY_OBJECT,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
        items = item_schemas[0] if len(item_schemas) == 1 else {"anyOf": item_schemas}
        schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", structured=StructuredOutputsParams(json=schema))
    name = choice.function.name  # type: ignore[union-attr]
    if name not in names:
        raise ValueError(f"tool_choice.function.name must be one of {names}, got {name!r}")
    parameters = tools[names.index(name)].function.parameters or ANY_OBJECT
    return ToolPlan("named", name=name, structured=StructuredOutputsParams(json=parameters))


def _check_schema(schema: dict[str, Any], field: str) -> None:
    try:
        StructuredOutputsParams(json=schema).verify()
    except ValueError as e:
        message = str(e).removeprefix("structured_outputs.json ")
        raise ValueError(f"{field} {message}") from None


def parse_required_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call in a "required" output, or None when the text is
    not a complete array of calls (the output was cut by max_tokens or a stop string)."""
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list):
        return None
    parsed = []
    for call in calls:
        if not isinstance(call, dict) or "name" not in call or "parameters" not in call:
            return None
        parsed.append((call["name"], json.dumps(call["parameters"], ensure_ascii=False)))
    return parsed


def is_complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
