"""What the chat UI's settings become: a turn's sampling parameters (checked against the
same `Limits` as /v1), the "JSON answer" box's constraint and the "Tools" box's function
tools, each with an error that names the box."""

from __future__ import annotations

import json
import math

from ..api.limits import Limits
from ..types import (
    Constraint,
    FunctionSpec,
    InvalidRequestError,
    JSONValue,
    SamplingParams,
    ToolSpec,
)

JSON_BOX = "JSON answer"  # the settings' labels, which errors about them name
TOOLS_BOX = "Tools"


def _number(name: str, value: object) -> float:
    try:
        number = float(value) if isinstance(value, (int, float, str)) else math.nan
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", param=name)
    return number


def chat_params(limits: Limits, temperature: object, top_p: object, max_tokens: object,
                constraint: Constraint | None = None) -> SamplingParams:
    """The sampling settings of one chat turn, checked against the same `limits` as /v1."""
    params = SamplingParams(temperature=_number("temperature", temperature),
                            top_p=_number("top_p", top_p),
                            max_tokens=int(_number("max_tokens", max_tokens)),
                            constraint=constraint)
    limits.check_sampling(temperature=params.temperature, top_k=None, n=None,
                          max_tokens=params.max_tokens)
    params.validate()
    return params


# ----------------------------------------------------------------------------- structured answers


def _box_json(box: str, text: str, limits: Limits, want: str) -> JSONValue:
    """The JSON value a settings box holds; a readable error naming the box when it is none."""
    limits.check_text(box, len(text), limits.max_conversation_chars, f"The {box} box")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{box}: not valid JSON ({exc.msg} at line {exc.lineno}, "
                                  f"column {exc.colno}); {want}", param=box) from None


def _json_type(value: object) -> str:
    """The JSON name of a value's type, for errors."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def answer_constraint(text: object, limits: Limits | None = None) -> Constraint | None:
    """What the "JSON answer" box asks for: empty, free text (None); `json` or `{}`, any JSON
    object; otherwise the JSON schema it holds, which the answer must match."""
    raw = text.strip() if isinstance(text, str) else ""
    if not raw:
        return None
    if raw.lower() == "json":
        return Constraint("json_object", param=JSON_BOX)
    want = "leave it empty for free text, write json for any JSON object, or give a JSON schema"
    schema = _box_json(JSON_BOX, raw, limits or Limits(), want)
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{JSON_BOX}: a JSON schema is a JSON object ({{...}}), got "
                                  f"{_json_type(schema)}; {want}", param=JSON_BOX)
    if not schema:
        return Constraint("json_object", param=JSON_BOX)
    return Constraint("json_schema", schema, param=JSON_BOX)


_TOOL_KEYS = ("name", "description", "parameters", "strict")


def _tool(i: int, item: JSONValue, names: set[str]) -> ToolSpec:
    """Tool `i` of the "Tools" box as an OpenAI function tool (a bare function is wrapped)."""
    where = f"{TOOLS_BOX}: tool {i + 1}"
    if not isinstance(item, dict):
        raise InvalidRequestError(f"{where} is {_json_type(item)}, not an object", TOOLS_BOX)
    fn = item
    if "type" in item or "function" in item:
        if item.get("type") != "function" or not isinstance(item.get("function"), dict):
            raise InvalidRequestError(f'{where} must be {{"type": "function", "function": '
                                      '{...}} or a bare function {"name", "description", '
                                      '"parameters"}', TOOLS_BOX)
        inner = item["function"]
        fn = inner if isinstance(inner, dict) else {}  # (checked just above)
    unknown = sorted(set(fn) - set(_TOOL_KEYS))
    if unknown:
        raise InvalidRequestError(f"{where} has unknown keys ({', '.join(unknown)}); a function "
                                  f"has {', '.join(_TOOL_KEYS)}", TOOLS_BOX)
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise InvalidRequestError(f'{where} needs a "name" (a non-empty string)', TOOLS_BOX)
    if name in names:
        raise InvalidRequestError(f"{where}: another tool is named {name!r} too", TOOLS_BOX)
    names.add(name)
    function: FunctionSpec = {"name": name}
    for key, kind, what in (("description", str, "a string"), ("parameters", dict,
                                                                "a JSON schema object"),
                            ("strict", bool, "true or false")):
        value = fn.get(key)
        if value is not None and not isinstance(value, kind):
            raise InvalidRequestError(f"{where} ({name}): {key} must be {what}, got "
                                      f"{_json_type(value)}", TOOLS_BOX)
    description, parameters, strict = fn.get("description"), fn.get("parameters"), fn.get(
        "strict")
    if isinstance(description, str):
        function["description"] = description
    if isinstance(parameters, dict):
        function["parameters"] = parameters
    if isinstance(strict, bool):
        function["strict"] = strict
    return {"type": "function", "function": function}


def chat_tools(text: object, limits: Limits | None = None) -> list[ToolSpec] | None:
    """The tools of the "Tools" box, as OpenAI function tools: None when empty; else a JSON
    list of tools (or one tool), each `{"type": "function", "function": {...}}` or the bare
    function `{"name", "description", "parameters"}`."""
    raw = text.strip() if isinstance(text, str) else ""
    if not raw:
        return None
    want = ('give a list of functions such as [{"name": "get_weather", "description": "...", '
            '"parameters": {"type": "object", "properties": {...}}}], or leave it empty')
    value = _box_json(TOOLS_BOX, raw, limits or Limits(), want)
    items = [value] if isinstance(value, dict) else value
    if not isinstance(items, list) or not items:
        raise InvalidRequestError(f"{TOOLS_BOX}: got {_json_type(value)}"
                                  f"{' with no tools' if value == [] else ''}; {want}",
                                  param=TOOLS_BOX)
    names: set[str] = set()
    return [_tool(i, item, names) for i, item in enumerate(items)]

