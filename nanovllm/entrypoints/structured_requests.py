"""A request's constraint on its output, as SamplingParams.structured_outputs: from OpenAI's
response_format, vLLM's structured_outputs (or its older guided_* fields), or a chat request's tool_choice
("required" or a named function: JSON schemas built from the tools' parameters, vLLM's shapes). At most one
source a request; anything malformed is a 400 naming the field, before anything runs (a schema, regex or
grammar that does not compile is the engine's ValueError when the request is checked, also a 400)."""
import copy
import json
from dataclasses import dataclass

from nanovllm.entrypoints.errors import APIError
from nanovllm.sampling_params import StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
NO_ARGUMENTS = {"type": "object", "properties": {}}


def _params(fields: dict, param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams.from_dict(fields)
    except (ValueError, TypeError) as error:
        raise APIError(f"{param}: {error}", param=param) from None


def from_response_format(response_format: dict) -> StructuredOutputsParams | None:
    """OpenAI's response_format: {"type": "text"} (no constraint), {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}; also vLLM's
    {"type": "structural_tag", ...} (passed on whole as xgrammar's structural tag)."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _params({"json_object": True}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise APIError('response_format: type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}',
                           param="response_format.json_schema")
        if not isinstance(spec["schema"], dict):
            raise APIError("response_format.json_schema.schema must be a JSON schema object",
                           param="response_format.json_schema.schema")
        return _params({"json": spec["schema"]}, "response_format.json_schema")
    if kind == "structural_tag":
        return _params({"structural_tag": json.dumps(response_format)}, "response_format")
    raise APIError(f"response_format.type must be one of text, json_object, json_schema, structural_tag; "
                   f"got {kind!r}", param="response_format.type")


def requested_structured_outputs(body) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint a request (completions or chat) asks for, and the field it came from."""
    sources = []
    if body.response_format is not None:
        found = from_response_format(body.response_format)
        if found is not None:
            sources.append(("response_format", found))
    if body.structured_outputs is not None:
        sources.append(("structured_outputs", _params(body.structured_outputs, "structured_outputs")))
    guided = {field: getattr(body, field) for field in GUIDED_FIELDS if getattr(body, field) is not None}
    if guided:
        if len(guided) > 1:
            raise APIError(f"give at most one of {', '.join(guided)}", param=next(iter(guided)))
        [(field, value)] = guided.items()
        sources.append((field, _params({GUIDED_FIELDS[field]: value}, field)))
    if len(sources) > 1:
        names = " and ".join(name for name, _ in sources)
        raise APIError(f"a request takes one constraint on its output; got {names}", param=sources[1][0])
    return (sources[0][1], sources[0][0]) if sources else (None, None)


def _arguments_schema(function) -> dict:
    return function.parameters if function.parameters is not None else NO_ARGUMENTS


def required_tools_schema(tools: list, parallel: bool = True) -> dict:
    """tool_choice "required": a JSON array of one or more {"name": <a tool's name>, "parameters": <its
    arguments>} (exactly one without `parallel`). Each tool's $defs move to the top, where their
    "#/$defs/..." references point."""
    defs, variants = {}, []
    for tool in tools:
        parameters = copy.deepcopy(_arguments_schema(tool.function))
        for name, definition in parameters.pop("$defs", {}).items():
            if name in defs and defs[name] != definition:
                raise APIError(f"tools define $defs {name!r} twice, differently", param="tools")
            defs[name] = definition
        variants.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": parameters},
                         "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass
class ToolPlan:
    """How a chat request's output becomes tool calls: mode "none" (not at all), "auto" (parsed from what
    the model writes), "required" or "named" (forced by a JSON schema); `function`: the named one."""
    mode: str = "none"
    function: str | None = None
    structured_outputs: StructuredOutputsParams | None = None


def tool_plan(body, enable_auto_tool_choice: bool, tool_call_parser: str | None) -> ToolPlan:
    """A chat request's tool_choice checked against its tools and the server's options (vLLM's rules:
    "auto", the default with tools, needs the server started with --enable-auto-tool-choice and
    --tool-call-parser)."""
    choice, tools = body.tool_choice, body.tools or []
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan()
    if not tools:
        raise APIError("when using `tool_choice`, `tools` must be set", param="tool_choice")
    if choice == "auto":
        if not (enable_auto_tool_choice and tool_call_parser):
            raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                           param="tool_choice")
        return ToolPlan("auto")
    # compact JSON (", " and ": " between items, no other whitespace): a weak model at a high temperature
    # would otherwise spend its tokens on newlines between a call's items
    if choice == "required":
        schema = required_tools_schema(tools, parallel=body.parallel_tool_calls is not False)
        return ToolPlan("required", structured_outputs=_params({"json": schema, "disable_any_whitespace": True},
                                                               "tools"))
    name = choice.function.name
    chosen = next((tool for tool in tools if tool.function.name == name), None)
    if chosen is None:
        raise APIError(f"tool_choice names the function {name!r}, which is not in `tools`",
                       param="tool_choice.function.name")
    schema = _arguments_schema(chosen.function)
    return ToolPlan("named", name, _params({"json": schema, "disable_any_whitespace": True}, "tools"))


def chat_structured_outputs(body, plan: ToolPlan) -> StructuredOutputsParams | None:
    """A chat request's one constraint: its own, or its tool_choice's."""
    requested, source = requested_structured_outputs(body)
    if requested is not None and plan.structured_outputs is not None:
        raise APIError(f'a request takes one constraint on its output; got {source} and tool_choice '
                       f'"{plan.mode}" (which constrains the output to tool calls)', param=source)
    return requested if requested is not None else plan.structured_outputs
