"""Ollama's request bodies (/api/chat, /api/generate, /api/embed) and their conversion to the
same `Request`, sampling and limits as the OpenAI routes: messages become the OpenAI message
models (`protocol.template_messages` applies the limits), `options` become `_Sampling`'s
fields, `format` the constraint `response_format` would be, `think` the template's switch.

Every field has a fate (docs/api.md, "Ollama's API", has the list): served; accepted as a no-op
(`keep_alive`, and the load-time options that mean nothing to a server that already holds its
model: `num_thread`, `num_gpu`, ...); or refused with a 400 naming it (images, custom
templates, sampling nbserve does not implement). A field no schema defines is a 400 too.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from ..text.chat_template import plain_json
from ..types import (
    ChatMessage,
    Constraint,
    EmbedSpec,
    InvalidRequestError,
    JSONObject,
    Request,
    SamplingParams,
    TokenCodec,
)
from .fields import unsupported as _refuse
from .limits import Limits
from .protocol import (
    AssistantMessage,
    FunctionCall,
    Message,
    SystemMessage,
    Tool,
    ToolCall,
    ToolMessage,
    UserMessage,
    _Body,
    _Sampling,
    _Schema,
    template_messages,
    thinking_switch,
)

# Ollama's defaults where a request sets no option (its documented ones; a Modelfile's own
# parameters do not exist here). Repetition is not penalised by default (Ollama's 1.1 over the
# last 64 tokens has no equal: nbserve's penalty reads the whole context).
DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P = 0.8, 40, 0.9
# Infill (fill-in-the-middle) tokens, as (prefix, suffix, middle), in the order they are tried.
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
              ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))


class Options(_Schema):
    """`options`: Ollama's runtime options, mapped to sampling; its load-time options as
    no-ops (the model is loaded once, as the server was started)."""

    # served
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_last_n: int | None = None  # -1 (the whole context, as nbserve counts) or 0 (off)
    num_ctx: int | None = None  # accepted up to the served context, which it does not change
    # no-ops: how the model is loaded and run, fixed when the server started
    numa: bool | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: int | None = None
    num_keep: int | None = None  # nbserve never shifts the context: nothing to keep
    penalize_newline: bool | None = None  # Ollama ignores it too
    # refused unless off: sampling nbserve does not implement
    tfs_z: float | None = None
    typical_p: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None

    def _refuse_unsupported(self) -> None:
        if self.tfs_z not in (None, 1.0):
            raise _refuse("options.tfs_z", "tail-free sampling is not implemented (1.0: off)")
        if self.typical_p not in (None, 1.0):
            raise _refuse("options.typical_p", "typical sampling is not implemented (1.0: off)")
        if self.mirostat not in (None, 0):
            raise _refuse("options.mirostat", "Mirostat sampling is not implemented (0: off)")
        if self.repeat_last_n not in (None, -1, 0):
            raise _refuse("options.repeat_last_n", "the repetition penalty reads the whole "
                          "context: send -1 (or 0 for no penalty)")

    def sampling(self, limits: Limits, max_context: int | None,
                 constraint: Constraint | None) -> SamplingParams:
        """The SamplingParams these options ask for (Ollama's defaults where unset), through
        the same checks as the OpenAI routes'."""
        self._refuse_unsupported()
        if self.num_ctx is not None and (self.num_ctx < 1 or (
                max_context is not None and self.num_ctx > max_context)):
            raise InvalidRequestError(
                f"options.num_ctx must be between 1 and the served context ({max_context} "
                f"tokens), got {self.num_ctx}: the context is set when the server starts",
                param="options.num_ctx")
        predict = self.num_predict
        if predict is not None and (predict < -2 or predict == 0):
            raise InvalidRequestError(f"options.num_predict must be >= 1, or -1 (until the "
                                      f"answer ends), got {predict}",
                                      param="options.num_predict")
        penalty = self.repeat_penalty
        if self.repeat_last_n == 0:
            penalty = None
        sampling = _Sampling(
            temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=DEFAULT_TOP_P if self.top_p is None else self.top_p,
            top_k=min(DEFAULT_TOP_K, limits.max_top_k) if self.top_k is None else self.top_k,
            min_p=self.min_p, seed=self.seed, stop=self.stop,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=penalty)
        max_tokens = limits.max_tokens if predict is None or predict < 0 else predict
        params = sampling._params(limits, max_tokens, "options.num_predict", False, 0)
        params.constraint = constraint
        params.validate()
        return params


def format_constraint(fmt: str | dict[str, object] | None) -> Constraint | None:
    """`format`: "json" (any JSON object) or a JSON schema, as `response_format` would be."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return Constraint("json_object", param="format")
    if isinstance(fmt, dict):
        return Constraint("json_schema", plain_json(fmt), strict=True, param="format")
    raise InvalidRequestError(f"format must be \"json\" or a JSON schema object, got {fmt!r}",
                              param="format")


def think_switch(think: bool | str | None) -> JSONObject:
    """`think` (true/false, or "low"/"medium"/"high") as the template's thinking switch."""
    if think is None:
        return {}
    if isinstance(think, str) and think not in ("low", "medium", "high"):
        raise InvalidRequestError(f"think must be true, false, \"low\", \"medium\" or "
                                  f"\"high\", got {think!r}", param="think")
    effort = think if isinstance(think, str) else "medium" if think else "none"
    return thinking_switch(effort, None)


class _Generating(_Body):
    """What /api/chat and /api/generate share."""

    stream: bool = True  # Ollama streams unless told not to
    format: str | dict[str, object] | None = None
    options: Options | None = None
    think: bool | str | None = None
    keep_alive: str | int | float | None = None  # no-op: the model stays loaded
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def _refuse_common(self) -> None:
        if self.logprobs or self.top_logprobs:
            raise _refuse("logprobs", "Ollama's logprobs are not served; use "
                          "/v1/chat/completions with logprobs")

    def sampling(self, limits: Limits, max_context: int | None) -> SamplingParams:
        return (self.options or Options()).sampling(limits, max_context,
                                                    format_constraint(self.format))


# ----------------------------------------------------------------------------- /api/chat


class OllamaFunction(_Schema):
    name: str
    arguments: dict[str, object]
    index: int | None = None  # Ollama numbers the calls of a message


class OllamaToolCall(_Schema):
    function: OllamaFunction
    id: str | None = None
    type: Literal["function"] | None = None


class OllamaMessage(_Schema):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    thinking: str | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None


def openai_messages(messages: list[OllamaMessage]) -> list[Message]:
    """Ollama's messages as the OpenAI message models the template layer takes: a call's
    arguments object becomes JSON text with an id, and a tool result answers the latest call
    of its `tool_name` (the latest call if it names none)."""
    out: list[Message] = []
    calls: list[tuple[str, str]] = []  # (id, name) of the calls so far
    for i, m in enumerate(messages):
        if m.images:
            raise _refuse(f"messages[{i}].images", "it serves text-only models")
        if m.role == "assistant":
            tool_calls = []
            for j, c in enumerate(m.tool_calls or ()):
                call_id = c.id or f"call_{i}_{j}"
                calls.append((call_id, c.function.name))
                tool_calls.append(ToolCall(id=call_id, function=FunctionCall(
                    name=c.function.name, arguments=json.dumps(c.function.arguments))))
            out.append(AssistantMessage(role="assistant", content=m.content,
                                        tool_calls=tool_calls or None,
                                        reasoning_content=m.thinking or None))
        elif m.role == "tool":
            named = [cid for cid, name in calls if name == m.tool_name] if m.tool_name else []
            answered = named[-1] if named else calls[-1][0] if calls else f"call_{i}"
            out.append(ToolMessage(role="tool", content=m.content, tool_call_id=answered))
        elif m.role == "system":
            out.append(SystemMessage(role="system", content=m.content))
        else:
            out.append(UserMessage(role="user", content=m.content))
    return out


class OllamaChatRequest(_Generating):
    """POST /api/chat."""

    messages: list[OllamaMessage] | None = None
    tools: list[Tool] | None = None

    @property
    def tool_names(self) -> set[str] | None:
        return {t.function.name for t in self.tools} if self.tools else None

    def to_request(self, limits: Limits, max_context: int | None, request_id: str) -> Request:
        """The nbserve Request for this body; InvalidRequestError (400) naming what is wrong."""
        self._refuse_common()
        messages: list[ChatMessage] = template_messages(openai_messages(self.messages or []),
                                                        limits)
        return Request(messages=messages, params=self.sampling(limits, max_context),
                       tools=[t.spec() for t in self.tools] if self.tools else None,
                       template_kwargs=think_switch(self.think), request_id=request_id)


# ----------------------------------------------------------------------------- /api/generate


def infill_prompt(tokenizer: TokenCodec | None, prompt: str, suffix: str) -> str:
    """The fill-in-the-middle prompt (prefix, suffix, then the middle to write) in the
    model's own infill tokens; a 400 when its tokenizer has none."""
    for tokens in FIM_TOKENS:
        if tokenizer is not None and all(_is_special(tokenizer, t) for t in tokens):
            pre, suf, mid = tokens
            return f"{pre}{prompt}{suf}{suffix}{mid}"
    raise InvalidRequestError("suffix needs a model with an infill format (fill-in-the-middle "
                              "tokens such as <|fim_prefix|> in its tokenizer); this model has "
                              "none. Send the prompt without a suffix.", param="suffix")


def _is_special(tokenizer: TokenCodec, token: str) -> bool:
    ids = tokenizer.encode(token)
    return len(ids) == 1 and tokenizer.id_to_token(ids[0]) == token


class OllamaGenerateRequest(_Generating):
    """POST /api/generate."""

    prompt: str = ""
    suffix: str = ""
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None
    width: int | None = None
    height: int | None = None
    steps: int | None = None

    def _refuse_unsupported(self) -> None:
        self._refuse_common()
        if self.images:
            raise _refuse("images", "it serves text-only models")
        for name, value in (("width", self.width), ("height", self.height),
                            ("steps", self.steps)):
            if value is not None:
                raise _refuse(name, "it generates text, not images")
        if self.template and not self.bare_template:
            raise _refuse("template", "custom prompt templates are not applied; the model's "
                          "own chat template is, or none with raw=true (send the prompt "
                          "already formatted)")
        if (self.raw or self.bare_template) and self.system:
            raise InvalidRequestError("system has no place in a raw prompt (no template is "
                                      "applied): write it into the prompt", param="system")

    @property
    def bare_template(self) -> bool:
        """A template that is the prompt alone (`{{ .Prompt }}`): the same as raw."""
        return re.sub(r"\s", "", self.template or "") == "{{.Prompt}}"

    def to_request(self, limits: Limits, max_context: int | None, request_id: str,
                   tokenizer: TokenCodec | None) -> Request:
        """The nbserve Request for this body. A raw prompt (or an infill one) is encoded as
        it is; otherwise the model's template renders it as a user turn after `system`.
        (`context` is the route's: it needs the prompt's token ids, see `after_context`.)"""
        self._refuse_unsupported()
        limits.check_text("prompt", len(self.prompt) + len(self.suffix),
                          limits.max_conversation_chars, "The prompt")
        params = self.sampling(limits, max_context)
        kwargs = think_switch(self.think)
        if self.suffix or self.raw or self.bare_template:
            text = infill_prompt(tokenizer, self.prompt, self.suffix) if self.suffix \
                else self.prompt
            req = Request(prompt=text, params=params, template_kwargs=kwargs,
                          request_id=request_id)
        else:
            turns: list[Message] = [UserMessage(role="user", content=self.prompt)]
            if self.system:
                turns.insert(0, SystemMessage(role="system", content=self.system))
            req = Request(messages=template_messages(turns, limits), params=params,
                          template_kwargs=kwargs, request_id=request_id)
        return req

    def after_context(self, req: Request, prompt_ids: list[int] | None) -> Request:
        """`req` continuing `context` (an earlier answer's token ids, as /api/generate returned
        them): its own prompt's token ids (`prompt_ids`, None without a tokenizer) after them."""
        if not self.context:
            return req
        if prompt_ids is None:
            raise InvalidRequestError("context needs a model with a tokenizer", param="context")
        req.prompt_ids = list(self.context) + prompt_ids
        req.messages = req.prompt = None
        return req


# ----------------------------------------------------------------------------- /api/embed


class OllamaEmbedRequest(_Body):
    """POST /api/embed."""

    input: str | list[str] = ""
    truncate: bool | None = None  # true by default: an input longer than the context is cut
    dimensions: int | None = None
    options: Options | None = None  # accepted; sampling means nothing to an embedding
    keep_alive: str | int | float | None = None  # no-op

    def inputs(self, limits: Limits) -> list[str]:
        """The inputs as a list, within the limits (none for "" or []: a load request)."""
        items = ([self.input] if self.input else []) if isinstance(self.input, str) \
            else list(self.input)
        if len(items) > limits.max_prompts:
            raise InvalidRequestError(f"input holds {len(items)} texts; the limit is "
                                      f"{limits.max_prompts}", param="input")
        for i, text in enumerate(items):
            limits.check_text(f"input[{i}]", len(text), limits.max_conversation_chars,
                              f"input[{i}]")
            if not text:
                raise InvalidRequestError(f"input[{i}] is empty", param=f"input[{i}]")
        return items

    def to_requests(self, limits: Limits, request_id: str, tokenizer: TokenCodec | None,
                    max_context: int | None) -> list[Request]:
        """One prefill-only Request per input; one longer than the context is cut to it
        unless `truncate` is false (then the engine refuses it)."""
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(f"dimensions must be >= 1, got {self.dimensions}",
                                      param="dimensions")
        spec = EmbedSpec(dimensions=self.dimensions)
        out = []
        for i, text in enumerate(self.inputs(limits)):
            rid = f"{request_id}-{i}"
            ids = tokenizer.encode(text, add_special_tokens=True) if tokenizer else None
            if self.truncate is not False and ids is not None and max_context and \
                    len(ids) > max_context:
                out.append(Request(prompt_ids=ids[:max_context], embed=spec, request_id=rid))
            else:
                out.append(Request(prompt=text, embed=spec, request_id=rid))
        return out
