"""OpenAI request schemas, ordered like the API reference, and their conversion to `Request`s.

Every field has a fate (docs/api.md has the table): served; accepted as a no-op because it
changes nothing on a local server (`metadata`, `store`, `user`, ...); or refused with a 400
naming it because it would change the output and nbserve does not implement it. vLLM-style
extensions that nbserve implements (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids) are served. A field no schema defines is a 400 too (see `fields.py`).
Numbers and booleans are strict: `"n": true` or `"temperature": "hot"` is a 400, not a guess.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..types import MAX_TOP_LOGPROBS, Constraint, InvalidRequestError, Request, SamplingParams
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


def parse_body(model: type[_Schema], body: bytes, unknown: UnknownFields | None = None) -> Any:
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
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    prompt_cache_breakpoint: Any = None  # no-op: the prefix cache needs no hints


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
    audio: dict[str, Any] | None = None
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
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Schema):
    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoiceFunction(_Schema):
    name: str


class NamedToolChoice(_Schema):
    type: Literal["function"]
    function: NamedToolChoiceFunction


class JSONSchemaFormat(_Schema):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
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
            return Constraint("json_schema", {} if schema is None else schema,
                              strict=True, param="response_format.json_schema.schema")
        return None


class StructuredOutputs(_Schema):
    """nbserve's (and vLLM's) extension: exactly one of these constrains the answer."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
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
            return Constraint("json_schema", value, param=param)
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


def _content(content: Content | None, param: str) -> tuple[str | list[dict[str, str]], int]:
    """(content for the template, its length in characters). Lists stay lists of text parts
    (the template layer joins them, or loops over them if the template wants parts)."""
    if content is None:
        return "", 0
    if isinstance(content, str):
        return content, len(content)
    parts = []
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


def thinking_switch(effort: str | None, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The chat-template variables of a request: its `chat_template_kwargs`, and for a
    `reasoning_effort` the switch thinking models' templates read (Qwen3's and SmolLM3's
    `enable_thinking`): off for "none" and "minimal", on otherwise. A template that does not
    read it is not changed by it. An explicit `enable_thinking` in the kwargs wins."""
    out = dict(kwargs or {})
    if effort is not None:
        out.setdefault("enable_thinking", effort not in ("none", "minimal"))
    return out


class _Sampling(_Schema):
    """Fields chat and completions share, plus nbserve's extensions."""

    model: str | None = None
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

    def _constraint(self) -> Constraint | None:
        fmt = getattr(self, "response_format", None)
        c = fmt.constraint() if fmt is not None else None
        if self.structured_outputs is not None:
            if c is not None:
                raise InvalidRequestError("send response_format or structured_outputs, not "
                                          "both", param="structured_outputs")
            c = self.structured_outputs.constraint()
        return c


# ----------------------------------------------------------------------------- chat


def template_messages(messages: list[Any], limits: Limits) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template, after the size limits."""
    if not messages:
        raise InvalidRequestError("messages must hold at least one message",
                                  param="messages")
    if len(messages) > limits.max_messages:
        raise InvalidRequestError(
            f"messages holds {len(messages)} messages; the limit is "
            f"{limits.max_messages}. Drop or summarize older turns.", param="messages")
    out: list[dict[str, Any]] = []
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
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                             "content": content}
        name = getattr(m, "name", None)  # a tool message has none
        if name:
            d["name"] = name
        if isinstance(m, AssistantMessage) and m.tool_calls:
            # arguments stay JSON strings; the template layer parses them for templates
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
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




class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[Message]
    audio: dict[str, Any] | None = None
    function_call: Any = None
    functions: list[Any] | None = None
    logprobs: bool | None = None
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    metadata: dict[str, Any] | None = None  # no-op
    modalities: list[str] | None = None
    moderation: Any = None
    parallel_tool_calls: bool | None = None
    prediction: Any = None
    prompt_cache_key: str | None = None  # no-op: prefixes are reused without a key
    prompt_cache_options: dict[str, Any] | None = None  # no-op
    prompt_cache_retention: str | None = None  # no-op
    reasoning_effort: str | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM): template variables
    safety_identifier: str | None = None  # no-op
    service_tier: str | None = None  # no-op
    store: bool | None = None  # no-op: nothing is stored
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    tools: list[Tool] | None = None
    top_logprobs: int | None = None
    verbosity: str | None = None
    web_search_options: Any = None

    @property
    def use_tools(self) -> bool:
        """Tools go to the template (and output is parsed for calls) unless tool_choice is none."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def tool_names(self) -> set[str]:
        return {t.function.name for t in self.tools or []}

    def _refuse_unsupported(self) -> None:
        if self.audio is not None:
            raise _refuse("audio", "it serves text-only models")
        if self.modalities and any(m != "text" for m in self.modalities):
            raise _refuse("modalities", "only [\"text\"] is served")
        if self.prediction is not None:
            raise _refuse("prediction", "predicted outputs are not implemented")
        if self.moderation is not None:
            raise _refuse("moderation", "it has no moderation model")
        if self.reasoning_effort not in (None, *REASONING_EFFORTS):
            raise InvalidRequestError(f"reasoning_effort must be one of "
                                      f"{', '.join(REASONING_EFFORTS)}, got "
                                      f"{self.reasoning_effort!r}", param="reasoning_effort")
        if self.verbosity not in (None, "medium"):
            raise _refuse("verbosity", "only \"medium\" (the model as it is) is served; ask "
                          "for a shorter or longer answer in the prompt")
        if self.web_search_options is not None:
            raise _refuse("web_search_options", "it has no web access")
        if self.functions is not None or self.function_call is not None:
            param = "functions" if self.functions is not None else "function_call"
            raise _refuse(param, "the deprecated functions API is not served; use tools and "
                          "tool_choice")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise InvalidRequestError(f"tool_choice {self._choice_name()} needs tools",
                                      param="tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
        names = [t.function.name for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice) and \
                self.tool_choice.function.name not in names:
            raise InvalidRequestError(
                f"tool_choice names the function {self.tool_choice.function.name!r}, which is "
                f"not in tools ({', '.join(names)})", param="tool_choice")
        for i, name in enumerate(names):
            if not name or names.index(name) != i:
                raise InvalidRequestError(f"tools[{i}].function.name must be a non-empty name "
                                          "that no other tool has", param=f"tools[{i}].function"
                                          ".name")

    def _choice_name(self) -> str:
        c = self.tool_choice
        return repr(c) if isinstance(c, str) else f"naming {c.function.name!r}" if c else "none"

    def template_messages(self, limits: Limits) -> list[dict[str, Any]]:
        """Messages as plain dicts for the chat template, after the size limits."""
        return template_messages(self.messages, limits)

    def to_request(self, limits: Limits | None = None, request_id: str | None = None) -> Request:
        """The nbserve Request for this body; InvalidRequestError (400) naming what is wrong."""
        limits = limits or Limits()
        self._refuse_unsupported()
        messages = self.template_messages(limits)
        max_tokens: int | None
        if self.max_completion_tokens is not None:
            max_tokens, param = self.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = self.max_tokens, "max_tokens"
        if self.top_logprobs is not None:
            limits.check_range("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        params = self._params(limits, limits.max_tokens if max_tokens is None else max_tokens,
                              param, bool(self.logprobs), self.top_logprobs or 0)
        tools = [t.model_dump(exclude_none=True) for t in self.tools or []] if self.use_tools \
            else None
        req = Request(messages=messages, params=params, tools=tools,
                      parallel_tool_calls=self.parallel_tool_calls is not False,
                      template_kwargs=thinking_switch(self.reasoning_effort,
                                                      self.chat_template_kwargs))
        if isinstance(self.tool_choice, NamedToolChoice):
            req.tool_name = self.tool_choice.function.name
        elif self.tool_choice == "required":
            req.tool_choice = "required"
        if request_id:
            req.request_id = request_id
        if self.user:
            req.metadata["user"] = self.user
        return req


# ----------------------------------------------------------------------------- completions


class CompletionRequest(_Sampling):
    """POST /v1/completions (the legacy text API)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None

    def prompts(self, limits: Limits) -> list[str | list[int]]:
        """The prompt as a list: one string or token-id list per prompt."""
        p = self.prompt
        if isinstance(p, str):
            items: list[Any] = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [list(p)]
        else:
            items = list(p)
        if not items:
            raise InvalidRequestError("prompt must not be an empty list", param="prompt")
        if len(items) > limits.max_prompts:
            raise InvalidRequestError(f"prompt holds {len(items)} prompts; the limit is "
                                      f"{limits.max_prompts}", param="prompt")
        for i, item in enumerate(items):
            size = len(item)
            limits.check_text("prompt", size, limits.max_conversation_chars,
                              f"prompt[{i}]" if len(items) > 1 else "The prompt")
        return items

    def to_requests(self, limits: Limits | None = None, request_id: str = "cmpl"
                    ) -> list[Request]:
        """One Request per prompt, ids `{request_id}-{i}` when there are several."""
        limits = limits or Limits()
        if self.suffix:
            raise _refuse("suffix", "insertion (fill-in-the-middle) is not implemented")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise _refuse("best_of", "ranking several samples is not implemented; use n")
        if self.logprobs is not None:
            limits.check_range("logprobs", self.logprobs, 0, 5)
        scored = bool(self.echo) and self.logprobs is not None  # the prompt's logprobs too
        if self.max_tokens == 0 and not scored:
            raise InvalidRequestError("max_tokens 0 only scores a prompt: send it with echo "
                                      "and logprobs", param="max_tokens")
        items = self.prompts(limits)
        max_tokens = self.max_tokens if self.max_tokens is not None else 16
        params = self._params(limits, max_tokens or None, "max_tokens",
                              self.logprobs is not None, self.logprobs or 0)
        if scored:
            params.prompt_logprobs = self.logprobs
            params.max_tokens = max_tokens
            params.validate()
        out = []
        for i, item in enumerate(items):
            rid = request_id if len(items) == 1 else f"{request_id}-{i}"
            p = replace(params, stop=list(params.stop))
            if isinstance(item, str):
                r = Request(prompt=item, params=p, request_id=rid)
            else:
                r = Request(prompt_ids=list(item), params=p, request_id=rid)
            if self.user:
                r.metadata["user"] = self.user
            out.append(r)
        return out

    def to_request(self, limits: Limits | None = None, request_id: str = "cmpl") -> Request:
        """The Request for a single prompt (see `to_requests` for lists)."""
        reqs = self.to_requests(limits, request_id)
        if len(reqs) != 1:
            raise InvalidRequestError("to_request() needs a single prompt; use to_requests()",
                                      param="prompt")
        return reqs[0]
