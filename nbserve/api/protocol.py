"""The OpenAI request schemas' shared parts, ordered like the API reference: messages, tools,
formats, the sampling fields chat and completions share, and the template's messages. Each
route family's own body lives with its route (`chat.py`, `completions.py`, `responses.py`,
`tokenize.py`).

Every field has a fate (docs/api.md has the table): served; accepted as a no-op because it
changes nothing on a local server (`metadata`, `store`, `user`, ...); or refused with a 400
naming it because it would change the output and nbserve does not implement it. vLLM-style
extensions that nbserve implements (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids) are served. A field no schema defines is a 400 too (see `fields.py`).
Numbers and booleans are strict: `"n": true` or `"temperature": "hot"` is a 400, not a guess.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..text.chat_template import plain_json
from ..types import (
    ChatMessage,
    Constraint,
    FunctionSpec,
    InvalidRequestError,
    JSONObject,
    SamplingParams,
    TextPart,
    ToolSpec,
)
from .errors import validation_error
from .fields import UnknownFields
from .fields import unsupported as _refuse
from .limits import Limits

_SEED_MAX = 2**63 - 1


class _Schema(BaseModel):
    # Undefined fields are kept for `UnknownFields` to find (and refuse, or drop); the OpenAPI
    # document says what is served by default: no additional properties.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False,
                              json_schema_extra={"additionalProperties": False})


class _Body(_Schema):
    """A request body: its first field names the model (checked by every route's prologue)."""

    model: str | None = None


B = TypeVar("B", bound=_Schema)
T = TypeVar("T")


def parse_body(model: type[B], body: bytes, unknown: UnknownFields | None = None) -> B:
    """Validate a JSON body into `model`; a 400-style InvalidRequestError naming the field.
    Undefined fields are refused by name unless `unknown` accepts them (then dropped)."""
    try:
        parsed = model.model_validate_json(body or b"")
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    (unknown or UnknownFields()).check(parsed)
    return parsed


# ----------------------------------------------------------------------------- messages


class ContentPart(_Schema):
    """One part of a list-valued `content`; only text (and refusal) parts are served. The other
    OpenAI part fields are known so that such a part is refused for its type, not its keys."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: object = None
    input_audio: object = None
    file: object = None
    prompt_cache_breakpoint: object = None  # no-op: the prefix cache needs no hints


Content = str | list[ContentPart]


class FunctionCall(_Schema):
    name: str
    arguments: str


class ToolCall(_Schema):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeveloperMessage(_Schema):
    role: Literal["developer"]
    content: Content
    name: str | None = None


class SystemMessage(_Schema):
    role: Literal["system"]
    content: Content
    name: str | None = None


class UserMessage(_Schema):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Schema):
    role: Literal["assistant"]
    audio: dict[str, object] | None = None
    content: Content | None = None
    function_call: FunctionCall | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    # an earlier answer's thought, sent back for templates that render it (Qwen3 keeps the
    # thought of the turns after the last user message); vLLM's and OpenRouter's names
    reasoning_content: str | None = None
    reasoning: str | None = None


class ToolMessage(_Schema):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


class FunctionMessage(_Schema):
    role: Literal["function"]
    content: str | None = None
    name: str


Message = Annotated[
    DeveloperMessage | SystemMessage | UserMessage | AssistantMessage | ToolMessage
    | FunctionMessage,
    Field(discriminator="role"),
]


# ----------------------------------------------------------------------------- tools & options


class FunctionDefinition(_Schema):
    name: str
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class Tool(_Schema):
    type: Literal["function"]
    function: FunctionDefinition

    def spec(self) -> ToolSpec:
        """The tool as the engine takes it (the fields given, none of the unset ones)."""
        f = self.function
        fn: FunctionSpec = {"name": f.name}
        if f.description is not None:
            fn["description"] = f.description
        if f.parameters is not None:
            fn["parameters"] = {k: plain_json(v) for k, v in f.parameters.items()}
        if f.strict is not None:
            fn["strict"] = f.strict
        return {"type": self.type, "function": fn}


def typed(value: object, kind: type[T], param: str, what: str) -> T:
    """`value` if it is a `kind`; else a 400 saying `param` must be `what`."""
    if not isinstance(value, kind):
        raise InvalidRequestError(f"{param} must be {what}, got {value!r}", param=param)
    return value


def function_tool(tool: Mapping[str, object], where: str, parameters: str = "parameters",
                  fields: Sequence[str] = ("description", "strict")) -> ToolSpec:
    """A function tool from a tool object given as loose JSON (the Responses API's flat tools,
    Anthropic's): its `name`, its JSON schema under `parameters` (the key its API uses), and
    those of `fields` that are given; a 400 naming a field of the wrong type, or a key it does
    not know."""
    extra = set(tool) - {"type", "name", parameters, *fields}
    if extra:
        raise InvalidRequestError(f"{where} has unknown fields: {', '.join(sorted(extra))}",
                                  param=where)
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{where}.name must be a non-empty string",
                                  param=f"{where}.name")
    fn: FunctionSpec = {"name": name}
    description, schema, strict = (tool.get(k) for k in ("description", parameters, "strict"))
    if description is not None:
        fn["description"] = typed(description, str, f"{where}.description", "a string")
    if schema is not None:
        schema = typed(schema, dict, f"{where}.{parameters}", "a JSON schema object")
        fn["parameters"] = {str(k): plain_json(v) for k, v in schema.items()}
    if strict is not None:
        fn["strict"] = typed(strict, bool, f"{where}.strict", "true or false")
    return {"type": "function", "function": fn}


def unique_names(tools: Sequence[ToolSpec]) -> None:
    """A 400 naming the first tool whose name another tool has."""
    names = [t["function"]["name"] for t in tools]
    for i, name in enumerate(names):
        if names.index(name) != i:
            raise InvalidRequestError(f"tools[{i}] is named {name!r}, as another tool is; tool "
                                      "names must be unique", param=f"tools[{i}].name")


class NamedToolChoiceFunction(_Schema):
    name: str


class NamedToolChoice(_Schema):
    type: Literal["function"]
    function: NamedToolChoiceFunction


class JSONSchemaFormat(_Schema):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, object] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Schema):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def constraint(self) -> Constraint | None:
        """The Constraint this format asks for (None for text)."""
        if self.type == "json_object":
            return Constraint("json_object", param="response_format")
        if self.type == "json_schema":
            if self.json_schema is None:
                raise InvalidRequestError("response_format of type json_schema needs a "
                                          "json_schema object with the schema",
                                          param="response_format.json_schema")
            schema = self.json_schema.schema_
            return Constraint("json_schema", {} if schema is None else plain_json(schema),
                              strict=True, param="response_format.json_schema.schema")
        return None


class StructuredOutputs(_Schema):
    """nbserve's (and vLLM's) extension: exactly one of these constrains the answer."""

    json_: dict[str, object] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def constraint(self) -> Constraint:
        given = {k: v for k, v in (("json", self.json_), ("regex", self.regex),
                                   ("choice", self.choice), ("grammar", self.grammar),
                                   ("json_object", self.json_object or None)) if v is not None}
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, "
                f"json_object; got {', '.join(given) or 'none'}", param="structured_outputs")
        (key, value), = given.items()
        param = f"structured_outputs.{key}"
        if key == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise InvalidRequestError(f"{param} is not valid JSON: {exc}",
                                              param=param) from None
            if not isinstance(value, dict):
                raise InvalidRequestError(f"{param} must be a JSON schema object", param=param)
            return Constraint("json_schema", plain_json(value), param=param)
        kind = {"json_object": "json_object", "regex": "regex", "choice": "choice",
                "grammar": "grammar"}[key]
        c = Constraint(kind, None if kind == "json_object" else value,  # type: ignore[arg-type]
                       param=param)
        c.check()
        return c


class StreamOptions(_Schema):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # no-op: chunks are never padded


# ----------------------------------------------------------------------------- helpers


def _content(content: Content | None, param: str) -> tuple[str | list[TextPart], int]:
    """(content for the template, its length in characters). Lists stay lists of text parts
    (the template layer joins them, or loops over them if the template wants parts)."""
    if content is None:
        return "", 0
    if isinstance(content, str):
        return content, len(content)
    parts: list[TextPart] = []
    for j, part in enumerate(content):
        text = part.text if part.type == "text" else part.refusal if part.type == "refusal" \
            else None
        if text is None:
            raise InvalidRequestError(
                f"{param}[{j}].type {part.type!r} is not supported: nbserve serves text-only "
                "models; send content as a string or as parts of type 'text'.",
                param=f"{param}[{j}].type")
        parts.append({"type": "text", "text": text})
    return parts, sum(len(p["text"]) for p in parts)


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids written as strings (e.g. \"42\"), got {key!r}",
                param="logit_bias") from None
    return out


def _check_seed(seed: int | None) -> None:
    if seed is not None and not -_SEED_MAX - 1 <= seed <= _SEED_MAX:
        raise InvalidRequestError(f"seed must fit in 64 bits, got {seed}", param="seed")


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


PromptInput = str | list[str] | list[int] | list[list[int]]  # OpenAI's prompt/input shapes


def prompt_list(given: PromptInput, param: str, most: int, limits: Limits
                ) -> list[str | list[int]]:
    """A prompt field in any of OpenAI's four shapes (`prompt` of /v1/completions, `input` of
    /v1/embeddings) as a list: one string or token-id list per item. A 400 naming `param`
    for an empty list, more than `most` items, or an item past the prompt limit."""
    items: list[str | list[int]]
    if isinstance(given, str):
        items = [given]
    elif given and all(isinstance(x, int) for x in given):
        items = [[x for x in given if isinstance(x, int)]]
    else:
        items = [x for x in given if not isinstance(x, int)]
    if not items:
        raise InvalidRequestError(f"{param} must not be an empty list", param=param)
    if len(items) > most:
        raise InvalidRequestError(f"{param} holds {len(items)} items; the limit is {most}: "
                                  "send them in several requests", param=param)
    for i, item in enumerate(items):
        where = f"{param}[{i}]" if len(items) > 1 else f"The {param}"
        limits.check_text(param, len(item), limits.max_conversation_chars, where)
    return items


def thinking_switch(effort: str | None, kwargs: Mapping[str, object] | None) -> JSONObject:
    """The chat-template variables of a request: its `chat_template_kwargs`, and for a
    `reasoning_effort` the switch thinking models' templates read (Qwen3's and SmolLM3's
    `enable_thinking`): off for "none" and "minimal", on otherwise. A template that does not
    read it is not changed by it. An explicit `enable_thinking` in the kwargs wins."""
    out = {k: plain_json(v) for k, v in (kwargs or {}).items()}
    if effort is not None:
        out.setdefault("enable_thinking", effort not in ("none", "minimal"))
    return out


class _Sampling(_Body):
    """Fields chat and completions share, plus nbserve's extensions."""

    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None  # no-op (kept in the request's metadata)
    # extensions (vLLM / llama.cpp style)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _params(self, limits: Limits, max_tokens: int | None, max_tokens_param: str,
                logprobs: bool, top_logprobs: int) -> SamplingParams:
        stop = _stop_list(self.stop)
        limits.check_sampling(temperature=self.temperature, top_k=self.top_k, n=self.n,
                              max_tokens=max_tokens, max_tokens_param=max_tokens_param, stop=stop)
        _check_seed(self.seed)
        if self.min_tokens is not None:
            limits.check_range("min_tokens", self.min_tokens, 0, limits.max_tokens)
        params = SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=_logit_bias(self.logit_bias),
            max_tokens=max_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            min_tokens=self.min_tokens or 0,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            n=self.n or 1,
            constraint=self._constraint(),
        )
        params.validate()
        return params

    def _format(self) -> ResponseFormat | None:
        """The body's response_format (chat has one)."""
        return None

    def _constraint(self) -> Constraint | None:
        fmt = self._format()
        c = fmt.constraint() if fmt is not None else None
        if self.structured_outputs is not None:
            if c is not None:
                raise InvalidRequestError("send response_format or structured_outputs, not "
                                          "both", param="structured_outputs")
            c = self.structured_outputs.constraint()
        return c


# ----------------------------------------------------------------------------- template messages


def template_messages(messages: Sequence[Message], limits: Limits) -> list[ChatMessage]:
    """Messages as plain dicts for the chat template, after the size limits."""
    if not messages:
        raise InvalidRequestError("messages must hold at least one message",
                                  param="messages")
    if len(messages) > limits.max_messages:
        raise InvalidRequestError(
            f"messages holds {len(messages)} messages; the limit is "
            f"{limits.max_messages}. Drop or summarize older turns.", param="messages")
    out: list[ChatMessage] = []
    total = 0
    for i, m in enumerate(messages):
        if m.role == "function":
            raise _refuse(f"messages[{i}].role", "role 'function' is deprecated; use 'tool'")
        if isinstance(m, AssistantMessage):
            if m.audio is not None:
                raise _refuse(f"messages[{i}].audio", "it serves text-only models")
            if m.function_call is not None:
                raise _refuse(f"messages[{i}].function_call", "the deprecated functions "
                              "API is not served; use tool_calls")
        param = f"messages[{i}].content"
        text = m.content
        if isinstance(m, AssistantMessage) and not m.content and m.refusal:
            text = m.refusal  # an earlier refusal is what the assistant said
        content, chars = _content(text, param)
        limits.check_text(param, chars, limits.max_message_chars, f"messages[{i}]")
        total += chars
        d: ChatMessage = {"role": "system" if m.role == "developer" else m.role,
                          "content": content}
        name = None if isinstance(m, ToolMessage) else m.name  # a tool message has none
        if name:
            d["name"] = name
        if isinstance(m, AssistantMessage) and m.tool_calls:
            # arguments stay JSON strings; the template layer parses them for templates
            d["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": c.function.arguments}}
                for c in m.tool_calls]
        thought = m.reasoning_content or m.reasoning if isinstance(m, AssistantMessage) else None
        if thought:
            param = f"messages[{i}].reasoning_content"
            limits.check_text(param, len(thought), limits.max_message_chars, f"messages[{i}]")
            total += len(thought)
            d["reasoning_content"] = d["reasoning"] = thought
        if isinstance(m, ToolMessage):
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    limits.check_text("messages", total, limits.max_conversation_chars, "The conversation")
    return out
