"""Records shared by the engine, the server and the UI: no torch, no HTTP.

A caller builds a `Request` (chat messages, raw text or token ids, plus `SamplingParams`),
hands it to a `Backend`, and reads an ordered stream of events back.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias, TypedDict, final, runtime_checkable

# ----------------------------------------------------------------------------- JSON and chat shapes

# Any JSON value: what a JSON schema, a template variable or a parsed tool argument can be.
JSONValue: TypeAlias = (str | int | float | bool | None | list["JSONValue"]
                        | dict[str, "JSONValue"])
JSONObject: TypeAlias = dict[str, JSONValue]


class TextPart(TypedDict):
    """One part of a list-valued message content (only text parts are served)."""

    type: Literal["text"]
    text: str


class FunctionCall(TypedDict):
    """The function a tool call names; `arguments` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str


class ToolCall(TypedDict):
    """One call of an assistant message's `tool_calls`."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class _Role(TypedDict):
    role: str


class ChatMessage(_Role, total=False):
    """An OpenAI-style chat message as the chat template is given it: a role ("system",
    "user", "assistant", "tool"), its content (text or text parts), and the optional fields
    a template may render."""

    content: str | list[TextPart] | None
    name: str
    tool_calls: list[ToolCall]
    tool_call_id: str
    reasoning_content: str  # an earlier answer's thought (vLLM's name)
    reasoning: str  # the same (OpenRouter's name)


class _FunctionName(TypedDict):
    name: str


@final  # no other keys: `"function" in tool` tells a tool from a bare function
class FunctionSpec(_FunctionName, total=False):
    """A tool's function: its name, what it does, and the JSON schema of its arguments."""

    description: str
    parameters: JSONObject
    strict: bool


@final
class ToolSpec(TypedDict):
    """One entry of a request's `tools` (OpenAI's shape)."""

    type: Literal["function"]
    function: FunctionSpec


# ----------------------------------------------------------------------------- errors


class NbserveError(Exception):
    """Base class of every error nbserve raises on purpose."""

    kind = "server_error"


class InvalidRequestError(NbserveError, ValueError):
    """The request cannot be served as asked; `param` names the offending field."""

    kind = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class ContextLengthError(InvalidRequestError):
    """The prompt (plus the tokens asked for) does not fit in the context."""

    def __init__(self, prompt_tokens: int, max_context: int, param: str | None = "messages",
                 kv_tokens: int | None = None):
        why = "" if kv_tokens is None else (
            f" (the KV cache's budget holds {kv_tokens} tokens in all, less than the model's "
            "own context: serve it with a larger kv_memory for longer requests)")
        super().__init__(
            f"This model's maximum context length is {max_context} tokens{why}, but the prompt "
            f"has {prompt_tokens} tokens. Shorten the prompt or start a new conversation.",
            param=param,
            code="context_length_exceeded",
        )
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context


class ModelNotFoundError(InvalidRequestError):
    """A request named a model this server does not have (HTTP 404 `model_not_found`)."""

    def __init__(self, name: str, served: Sequence[str]):
        listed = ", ".join(repr(n) for n in served)
        super().__init__(f"The model {name!r} does not exist here; this server serves "
                         f"{listed} (see GET /v1/models).", param="model",
                         code="model_not_found")
        self.name = name


class BusyError(NbserveError):
    """The waiting queue is full; the caller should retry later."""

    kind = "rate_limit_error"

    def __init__(self, message: str = "The server is busy: the request queue is full. Retry soon.",
                 retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class EngineStoppedError(NbserveError):
    """The engine is shutting down or not running; new requests are refused."""

    kind = "service_unavailable"


class EngineError(NbserveError):
    """The model failed while computing this request."""

    kind = "server_error"


# ----------------------------------------------------------------------------- sampling

MAX_TOP_LOGPROBS = 20

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
CONSTRAINT_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a choice's output must match, enforced token by token (engine/constraints.py).

    `kind` and `value`: "json_schema" and a JSON schema (a dict); "json_object" (any JSON object,
    no value); "regex" and a pattern; "grammar" and a context-free grammar in Lark syntax (as
    llguidance reads it); "choice" and a list of strings, one of which is the whole answer.
    `strict`: False lets a JSON schema's keywords that cannot be enforced be ignored (a tool's
    non-strict parameters), True refuses them. `param` names the request field it came from,
    for the errors that point at it.
    """

    kind: ConstraintKind
    value: JSONValue = None
    strict: bool = True
    param: str = "response_format"

    def check(self) -> None:
        """Raise `InvalidRequestError` when the value does not fit the kind."""
        ok = {"json_schema": isinstance(self.value, dict), "json_object": self.value is None,
              "regex": isinstance(self.value, str) and bool(self.value),
              "grammar": isinstance(self.value, str) and bool(self.value.strip()),
              "choice": isinstance(self.value, list) and bool(self.value)
              and all(isinstance(c, str) and c for c in self.value)}
        if self.kind not in ok:
            raise InvalidRequestError(f"{self.param}: unknown constraint kind {self.kind!r}; "
                                      f"use one of {', '.join(CONSTRAINT_KINDS)}", self.param)
        if not ok[self.kind]:
            want = {"json_schema": "a JSON schema object", "json_object": "no value",
                    "regex": "a non-empty pattern", "grammar": "a non-empty Lark grammar",
                    "choice": "a non-empty list of non-empty strings"}[self.kind]
            raise InvalidRequestError(f"{self.param}: a {self.kind} constraint takes {want}, "
                                      f"got {self.value!r}", self.param)


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop, per request.

    temperature 0 means greedy. `top_k=0`, `top_p=1`, `min_p=0` switch those filters off.
    `max_tokens=None` generates until a stop condition or the end of the context.
    `stop_token_ids` end a choice like the model's own end-of-turn tokens, which `ignore_eos`
    switches off. Until a choice has `min_tokens` tokens, none of those stop tokens can be
    sampled (stop strings still apply), as in vLLM. Under a `constraint` a stop string or stop
    token ends the answer only where the grammar accepts the text before it, and min_tokens and
    ignore_eos hold the end back only while the grammar lets the answer go on.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    constraint: Constraint | None = None
    prompt_logprobs: int | None = None  # the prompt's log-probabilities, with this many top

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `InvalidRequestError` naming the first bad parameter."""

        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {msg}", param=param)

        def finite(name: str, value: float) -> None:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or \
                    not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")

        for name, value in (("temperature", self.temperature), ("top_p", self.top_p),
                            ("min_p", self.min_p), ("presence_penalty", self.presence_penalty),
                            ("frequency_penalty", self.frequency_penalty),
                            ("repetition_penalty", self.repetition_penalty)):
            finite(name, value)
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be between -2 and 2, got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty",
                      f"must be between -2 and 2, got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or
                not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise bad("prompt_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}, got "
                      f"{self.prompt_logprobs!r}")
        least = 0 if self.prompt_logprobs is not None else 1  # 0: score the prompt only
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or
                                            self.max_tokens < least):
            raise bad("max_tokens", f"must be an integer >= {least}, got {self.max_tokens!r}"
                      + (" (0 only to score a prompt: with echo and logprobs)" if least else ""))
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or \
                self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens "
                      f"({self.max_tokens})")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad("top_logprobs",
                      f"must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", f"entries must be non-empty strings, got {s!r}")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if not isinstance(tok, int) or \
                        (vocab_size is not None and not 0 <= tok < vocab_size):
                    raise bad("logit_bias",
                              f"keys must be token ids in [0, {vocab_size}), got {tok!r}")
                finite("logit_bias", bias)
                if not -100 <= bias <= 100:
                    raise bad("logit_bias", f"values must be between -100 and 100, got {bias}")
        if self.constraint is not None:
            self.constraint.check()
        if vocab_size is not None:
            for tok in self.stop_token_ids:
                if not 0 <= tok < vocab_size:
                    raise bad("stop_token_ids",
                              f"must be token ids in [0, {vocab_size}), got {tok}")


# ----------------------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class EmbedSpec:
    """Asks for the prompt's representation instead of an answer: a prefill-only request.

    By default, the prompt's hidden states after the final norm, pooled as the model declares
    (`nbserve.models.pooling.Pooling`: last token, mean or first; L2-normalised or not), in one
    `Embedded` event. `dimensions` keeps the first N values (a Matryoshka model's truncation;
    normalised again after the cut when the model normalises). `score_token_ids` asks instead
    for the logits of those tokens at the prompt's last position (a yes/no reranker)."""

    dimensions: int | None = None
    score_token_ids: tuple[int, ...] | None = None


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class Request:
    """One generation request. Exactly one of `messages`, `prompt`, `prompt_ids` is set.

    `messages` are OpenAI-style dicts (role, content, optional tool_calls / tool_call_id / name)
    rendered through the model's chat template; `prompt` is raw text encoded as it is.
    With `tools`, the answer is text or calls written in the model's own tool-call format, and
    the engine enforces them with a grammar: `tool_choice` "auto" (text, calls, or text then
    calls) or "required" (one call or more), `tool_name` (exactly one call of that function),
    `parallel_tool_calls` False (one call at most). A `params.constraint` then applies to the
    text answer. A thinking model's thought comes first, free up to its `</think>`.
    """

    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "required"] = "auto"
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    template_kwargs: JSONObject = field(default_factory=dict)  # e.g. enable_thinking
    add_generation_prompt: bool = True
    embed: EmbedSpec | None = None  # a prefill-only request: Started, Embedded, Finished
    adapter: str | None = None  # the LoRA adapter its rows apply (added to the engine by name)
    request_id: str = field(default_factory=new_request_id)
    # Set by whoever routes the request (pool affinity, logging); the engine ignores it.
    metadata: dict[str, Any] = field(default_factory=dict)

    def check_input(self) -> None:
        given = [x is not None for x in (self.messages, self.prompt, self.prompt_ids)]
        if sum(given) != 1:
            raise InvalidRequestError(
                "a request needs exactly one of messages, prompt or prompt_ids", param="messages")


# ----------------------------------------------------------------------------- events


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    bytes: list[int] | None = None
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (id, text, logprob)


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class Started:
    """First event: the prompt was accepted and is being prefilled."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    prompt_ids: list[int] = field(default_factory=list)
    tool_format: str | None = None  # how this model writes tool calls (text/tool_calls.py)
    reasoning: bool = False  # the answer may open with a thought (text/reasoning.py)
    thought_open: bool = False  # the prompt opened the thought: the answer starts inside it
    type: Literal["started"] = "started"


@dataclass(slots=True)
class PromptLogprobs:
    """The prompt's log-probabilities (a request with `prompt_logprobs`), before its first
    Delta: one entry per prompt token, None for the first (nothing predicts it)."""

    logprobs: list[TokenLogprob | None]
    type: Literal["prompt_logprobs"] = "prompt_logprobs"


@dataclass(slots=True)
class Delta:
    """New text for choice `index` (may be empty while a stop string or UTF-8 char is pending)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    type: Literal["delta"] = "delta"


FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(slots=True)
class Finished:
    """Choice `index` is done. `usage` counts the whole request so far (all choices);
    `ttft_s` (submission to this choice's first token) and `itl_s` (its mean inter-token
    latency) are None when the choice produced no token (or only one, for `itl_s`)."""

    index: int
    reason: FinishReason
    usage: Usage
    stop_matched: str | int | None = None
    ttft_s: float | None = None
    itl_s: float | None = None
    type: Literal["finished"] = "finished"


@dataclass(slots=True)
class ErrorEvent:
    """The request failed; no further events follow."""

    message: str
    kind: str = "server_error"
    request_id: str = ""
    type: Literal["error"] = "error"


@dataclass(slots=True)
class Embedded:
    """The answer of an `EmbedSpec` request (between its Started and its Finished): the pooled
    vector, or the requested tokens' logits in `score_token_ids`' order."""

    index: int
    values: list[float]
    type: Literal["embedded"] = "embedded"


Event = Started | PromptLogprobs | Delta | Embedded | Finished | ErrorEvent


# ----------------------------------------------------------------------------- backend seam


@runtime_checkable
class TokenCodec(Protocol):
    """What the server and the UI read of a backend's tokenizer (`nbserve.text.Tokenizer`
    satisfies it; this module imports no layer, so the view is declared here)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def id_to_token(self, i: int) -> str: ...

    def token_bytes(self, i: int) -> bytes: ...


@runtime_checkable
class Backend(Protocol):
    """What the server, the UI and launch use of a backend: an Engine, a Pool of them, or
    `serving/backend_ref.py`'s SwappableBackend forwarding to one.

    The first five members every backend has. The others say what a backend knows of its
    model and prompts; one that cannot tell answers None (0 for `cancel_all`), as
    `BackendDefaults` does for the classes that take it as a base (stand-ins, test doubles)."""

    @property
    def model_name(self) -> str: ...  # read only: launch's SwappableBackend forwards it

    def generate(self, request: Request) -> AsyncIterator[Event]:
        """Validate (raising `InvalidRequestError`, `ContextLengthError`, `BusyError`,
        `EngineStoppedError` before the first event) and stream the events of `request`.
        Closing the iterator cancels the request."""
        ...

    def stats(self) -> JSONObject: ...

    def health(self) -> JSONObject: ...

    def close(self) -> None: ...

    @property
    def tokenizer(self) -> TokenCodec | None:
        """The model's tokenizer (for /tokenize, /detokenize, logprob bytes, echo)."""
        ...

    @property
    def max_context(self) -> int | None:
        """The most tokens one request may hold (prompt and answer)."""
        ...

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (token ids are below it)."""
        ...

    def prompt_token_ids(self, request: Request) -> list[int] | None:
        """The request's prompt as it would be served (chat template applied, encoded), even
        past max_context: what /tokenize answers for messages."""
        ...

    def count_prompt_tokens(self, request: Request) -> int | None:
        """How many tokens the request's prompt takes, even past max_context: the UI fits a
        long chat into the context with it."""
        ...

    def cancel_all(self) -> int:
        """Cancel every request (a shutdown): running ones finish with reason "cancelled",
        waiting ones end with a "service_unavailable" error. Returns how many."""
        ...


@runtime_checkable
class AdapterHost(Protocol):
    """A backend that serves LoRA adapters by name (an Engine over a native decoder): a request
    names one in `Request.adapter`; over HTTP, `model` is "base:adapter"."""

    def adapter_names(self) -> list[str]:
        """The adapters served, in the order they were added."""
        ...

    def add_adapter(self, name: str, path: str) -> None:
        """Serve the adapter at `path` as `name`; ValueError naming what does not fit."""
        ...


class BackendDefaults:
    """`Backend`'s answers for a backend that knows no tokenizer, context or prompt (one that
    stands in while a model loads or after it stopped, a test double): a base class that
    leaves model_name, generate, stats, health and close to the subclass."""

    tokenizer: TokenCodec | None = None
    max_context: int | None = None
    vocab_size: int | None = None

    def prompt_token_ids(self, request: Request) -> list[int] | None:
        return None

    def count_prompt_tokens(self, request: Request) -> int | None:
        return None

    def cancel_all(self) -> int:
        return 0


ModelState = Literal["loaded", "loading", "unloaded", "failed"]


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One model of a server, as `/v1/models` lists it."""

    name: str
    state: ModelState
    source: str = ""
    max_context: int | None = None
    default: bool = False
    error: str | None = None  # why its last load failed


@runtime_checkable
class ModelDirectory(Protocol):
    """The models one server serves, by name (`serving/model_set.py`): the routes resolve each
    request's `model` here; a model named for the first time is loaded then."""

    @property
    def default(self) -> Backend:
        """The model that an empty name means, and the chat UI opens with."""
        ...

    async def backend(self, name: str | None, keep_alive: float | None = None) -> Backend:
        """The backend serving `name` ("" or None: the default), loaded first if it is not;
        `ModelNotFoundError` for a name the server does not have, `EngineStoppedError` when its
        load fails. `keep_alive`: from now on, unload it after that many seconds idle (a
        request's own keep-alive, as Ollama takes it)."""
        ...

    def entries(self) -> list[ModelEntry]:
        """Every model with its state, the default first."""
        ...

    def loaded(self, name: str) -> Backend | None:
        """The backend of `name` if it is loaded now (nothing is loaded, nothing counts as
        used: for listings), else None."""
        ...

    def unload(self, name: str) -> bool:
        """Unload `name` (its running requests finish first); whether it was loaded.
        `ValueError` for the default model, which stays loaded."""
        ...
