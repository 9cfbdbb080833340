"""A request's constraint on decoding: OpenAI's ``response_format``, vLLM's
``structured_outputs``, or ``tools`` with ``tool_choice`` "required" or a named function, as one
``StructuredOutputsParams`` for the engine, validated here: an invalid schema, regex or grammar,
or a tool_choice that does not fit the tools, is a 400 naming the field before anything reaches
the engine (validating a schema takes ~0.2 ms, so it runs inline)."""

from __future__ import annotations

from ..engine.params import StructuredOutputsParams
from ..engine.structured import grammar_error
from .protocol import APIError, NamedToolChoice

# What a function with no parameters takes.
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def constraint(req, tool_choice=None) -> StructuredOutputsParams | None:
    """The request's constraint, or None. ``tool_choice``: the chat request's resolved choice
    (see ``resolve_tool_choice``)."""
    spec = _from_response_format(req.response_format) if req.response_format is not None else None
    if req.structured_outputs is not None:
        if spec is not None:
            raise APIError(400, "structured_outputs: give either response_format or structured_outputs, not both",
                           "structured_outputs")
        spec = StructuredOutputsParams(**req.structured_outputs.fields())
        if len(spec.kinds) != 1:
            raise APIError(400, "structured_outputs: give exactly one of json, regex, choice, grammar or "
                                f"json_object, got {spec.kinds or 'none'}", "structured_outputs")
        _check(spec, f"structured_outputs.{spec.kinds[0]}")
    if tool_choice == "required" or isinstance(tool_choice, NamedToolChoice):
        if spec is not None:
            raise APIError(400, "tool_choice: \"required\" or a named function cannot be combined with "
                                "response_format or structured_outputs", "tool_choice")
        spec = _from_tools(req, tool_choice)
    return spec


def resolve_tool_choice(req, auto_tool_choice: bool) -> str | NamedToolChoice:
    """The chat request's tool_choice, checked against its tools (vLLM's rules: with tools and
    no tool_choice it is "auto", which needs --enable-auto-tool-choice and --tool-call-parser)."""
    tools, choice = req.tools, req.tool_choice
    if tools is not None and not tools:
        raise APIError(400, "tools: must not be an empty array; omit it instead", "tools")
    for i, tool in enumerate(tools or []):
        params = tool.function.parameters
        if params is not None:
            _check(StructuredOutputsParams(json=params), f"tools.{i}.function.parameters")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return choice
    if not tools:
        raise APIError(400, "tool_choice: when tool_choice is given, tools must be set", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t.function.name for t in tools}:
            raise APIError(400, f"tool_choice.function.name: the tool {choice.function.name!r} is not among tools",
                           "tool_choice.function.name")
    elif choice == "auto" and not auto_tool_choice:
        raise APIError(400, 'tool_choice: "auto" tool choice requires --enable-auto-tool-choice and '
                            "--tool-call-parser to be set", "tool_choice")
    return choice


def _from_response_format(fmt) -> StructuredOutputsParams | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None:
        raise APIError(400, "response_format.json_schema: required when type is json_schema",
                       "response_format.json_schema")
    if fmt.json_schema.schema_ is None:
        return StructuredOutputsParams(json_object=True)
    spec = StructuredOutputsParams(json=fmt.json_schema.schema_)
    _check(spec, "response_format.json_schema.schema")
    return spec


def _from_tools(req, tool_choice) -> StructuredOutputsParams:
    """A named function: its parameters' schema. "required": a JSON array of
    ``{"name", "parameters"}``, one item per call (one at most with parallel_tool_calls false);
    ``$defs`` of the tools' schemas move to the top, where their ``$ref``s point."""
    by_name = {t.function.name: t.function.parameters or EMPTY_PARAMETERS for t in req.tools}
    if isinstance(tool_choice, NamedToolChoice):
        return StructuredOutputsParams(json=by_name[tool_choice.function.name])
    defs, items = {}, []
    for name, params in by_name.items():
        params = dict(params)
        for key, value in (params.pop("$defs", None) or {}).items():
            if defs.setdefault(key, value) != value:
                raise APIError(400, f"tools: the definition {key!r} differs between tools", "tools")
        # No other keys: an open object let a random model write one long key until max_tokens.
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                       "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return StructuredOutputsParams(json=schema)


def _check(spec: StructuredOutputsParams, param: str) -> None:
    error = grammar_error(spec)
    if error:
        raise APIError(400, f"{param}: {error}", param)
