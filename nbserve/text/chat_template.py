"""ChatTemplate: a model's Jinja chat template rendered in a sandbox, byte-identical to
transformers' `apply_chat_template` output."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..types import FunctionSpec, InvalidRequestError, JSONObject, JSONValue, ToolSpec
from .files import token_str
from .tool_calls import HERMES, ToolFormat, detect_tool_format
from .tool_prompt import tools_in_prompt

log = logging.getLogger("nbserve.text")

# ----------------------------------------------------------------------------- chat template

_MAX_REPEAT = 10_000_000  # characters/items a template may build with `*`


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; when serving it simply renders its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The jinja2 sandbox, stricter: touching an unsafe attribute raises (jinja2 would render
    ""), and `'x' * n` / `a ** b` are capped so one expression cannot exhaust memory or CPU."""

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: object, attribute: str) -> NoReturn:
        # jinja2 returns an Undefined that prints as "" here; fail loudly instead.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} "
                            "is not allowed")

    def call_binop(self, context: Context, operator: str, left: object, right: object
                   ) -> object:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and \
                        len(seq) * n > _MAX_REPEAT:
                    raise SecurityError("the chat template tried to build a huge sequence")
        if operator == "**" and isinstance(right, int) and right > 1000:
            raise SecurityError("the chat template tried to compute a huge power")
        return super().call_binop(context, operator, left, right)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so templates cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: object) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates may not set the attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Like transformers: no HTML escaping (unlike jinja's own filter), non-ASCII kept as is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _TemplateDict:
    """`dict` for templates, as transformers gives it: `dict(...)` and `dict.fromkeys(...)`,
    without the type itself (its attributes would reach Python internals)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_env() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       namespace=_Namespace, dict=_TemplateDict())
    return env


def _is_content(node: nodes.Node) -> bool:
    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    return (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const)
            and node.arg.value == "content")


def _iterates_content(ast: nodes.Template) -> bool:
    """Does the template loop over `message.content` (so it understands content-part lists)?"""
    aliases = {a.target.name for a in ast.find_all(nodes.Assign)
               if isinstance(a.target, nodes.Name) and _is_content(a.node)}
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter) and it.node is not None:
            it = it.node
        if _is_content(it) or (isinstance(it, nodes.Name) and it.name in aliases):
            return True
    return False


def plain_json(value: object) -> JSONValue:
    """Rebuild `value` from plain JSON types, so a template only ever sees str/int/dict/list."""
    if value is None or isinstance(value, (str, int, float, bool)) and \
            type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
    for base in (bool, int, float, str):
        if isinstance(value, base):  # enums, numpy scalars, str subclasses
            return base(value)
    pydantic = sys.modules.get("pydantic")  # a pydantic model means pydantic is imported
    if pydantic is not None and isinstance(value, pydantic.BaseModel):  # OpenAI SDK messages
        return plain_json(value.model_dump(exclude_none=True))
    raise InvalidRequestError(f"chat messages must be JSON data, got a {type(value).__name__}",
                              param="messages")


_DEFAULT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}"
    "You can call these functions. To call one, reply with "
    "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] if message['content'] is defined }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "<tool_call>{{ (call['function'] if call['function'] is defined else call) | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


_PROBE_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


class ChatTemplate:
    """A Hugging Face chat template compiled once in a sandbox; renders like transformers'
    `apply_chat_template(..., tokenize=False)`.

    `variables` and `extra` are variables every render sees (e.g. `unk_token`, or
    `enable_thinking=False`).
    `tool_source` is an optional second template used when tools are given (the "tool_use"
    template some models ship). A template that ignores `tools` (a probe conversation renders
    the same with and without a tool) gets them in the system prompt instead, in the
    Hermes/Qwen format (`tool_prompt.py`).
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", *,
                 tool_source: str | None = None, is_default: bool = False,
                 variables: Mapping[str, JSONValue] | None = None, **extra: JSONValue):
        self.source = source
        self.tool_source = tool_source
        self.is_default = is_default
        self.variables: JSONObject = {"bos_token": bos_token, "eos_token": eos_token,
                                      **(variables or {}), **extra}
        env = _make_env()
        self._template, self._lists = self._compile(env, source)
        self._tool_template, self._tool_lists = (self._compile(env, tool_source) if tool_source
                                                 else (self._template, self._lists))
        self._ignores_tools: bool | None = None  # probed at the first request with tools
        self._renders: dict[str, bool] = {}  # role -> does the template show its text

    @staticmethod
    def _compile(env: _Sandbox, source: str) -> tuple[jinja2.Template, bool]:
        try:
            return env.from_string(source), _iterates_content(env.parse(source))
        except TemplateError as e:
            line = e.lineno if isinstance(e, TemplateSyntaxError) else None
            where = f" at line {line}" if line else ""
            raise ValueError(f"the chat template has a syntax error{where}: {e}. "
                             "Fix the template (tokenizer_config.json or chat_template.jinja) or "
                             "pass another one.") from e

    @classmethod
    def default(cls, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """Plain ChatML for models that ship no template:
        `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, tools (if any) listed as JSON
        in a system block, tool calls as `<tool_call>{json}</tool_call>`, and
        `<|im_start|>assistant\\n` as the generation prompt."""
        return cls(_DEFAULT_TEMPLATE, bos_token, eos_token, is_default=True)

    @classmethod
    def from_transformers(cls, tokenizer: object) -> ChatTemplate | None:
        """The chat template of a transformers tokenizer (None if it has none), with the special
        tokens transformers would pass to it."""
        # transformers' tokenizers have both attributes (None when unset); other objects none
        found = getattr(tokenizer, "chat_template", None)
        named = found if isinstance(found, dict) else {"default": found}  # and "tool_use"
        source, tool_source = named.get("default"), named.get("tool_use")
        if not source or not isinstance(source, str):
            return None
        specials = getattr(tokenizer, "special_tokens_map", None)
        tokens: dict[str, JSONValue] = {
            k: v for k, v in (specials if isinstance(specials, dict) else {}).items()
            if isinstance(v, str)}
        return cls(source, tool_source=tool_source if isinstance(tool_source, str) else None,
                   variables=tokens)

    def render(self, messages: Sequence[Mapping[str, object]],
               tools: Sequence[ToolSpec | FunctionSpec] | None = None,
               add_generation_prompt: bool = True, **kwargs: object) -> str:
        """The prompt text for `messages` (OpenAI-style dicts, `nbserve.types.ChatMessage`;
        checked here, as any JSON data). Raises `InvalidRequestError` when the template rejects
        the messages or attempts something the sandbox forbids."""
        if not messages:
            raise InvalidRequestError("messages must contain at least one message",
                                      param="messages")
        context = {**self.variables, **{k: plain_json(v) for k, v in kwargs.items()}}
        context.setdefault("documents", None)
        plain_tools = None if tools is None else [plain_json(t) for t in tools]
        if plain_tools and self.ignores_tools:
            plain = [_prepare_message(m, i, keep_lists=self._lists)
                     for i, m in enumerate(messages)]
            prompted = self._fit_roles(tools_in_prompt(plain, plain_tools),
                                       own_system=plain[0].get("role") == "system")
            return self._render(self._template, prompted, None, add_generation_prompt, context)
        template, lists = (self._tool_template, self._tool_lists) if tools else (
            self._template, self._lists)
        prepared = [_prepare_message(m, i, keep_lists=lists) for i, m in enumerate(messages)]
        return self._render(template, prepared, plain_tools, add_generation_prompt, context)

    @property
    def ignores_tools(self) -> bool:
        """Whether the template renders a probe conversation the same with and without a tool
        (then `render` puts the tools in the system prompt itself). Probed once."""
        if self._ignores_tools is None:
            probe = [{"role": "user", "content": "What is the weather in Paris?"}]
            context = {"documents": None, **self.variables, "messages": probe,
                       "add_generation_prompt": True}
            try:
                with_tool = self._tool_template.render(tools=[_PROBE_TOOL], **context)
                without = self._template.render(tools=None, **context)
            except Exception as e:  # noqa: BLE001 - a template that fails here is not probed
                log.debug("tool probe of the chat template failed: %s", e)
                self._ignores_tools = False
            else:
                self._ignores_tools = with_tool == without
                if self._ignores_tools:
                    log.info("the chat template ignores tools: nbserve lists them in the system "
                             "prompt in the Hermes/Qwen format instead (docs/api.md)")
        return self._ignores_tools

    def renders_role(self, role: str) -> bool:
        """Whether the template shows the text of a `role` message ("system" first, "tool"
        after an answer) rather than refusing it (Gemma, Mixtral) or dropping it (Phi-3's and
        OLMo 2's templates drop tool results). Probed once per role."""
        if role not in self._renders:
            marker = "nbserve role probe 7d1e"
            probe: list[JSONObject] = (
                [{"role": "system", "content": marker}, {"role": "user", "content": "Hi"}]
                if role == "system" else
                [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                 {"role": role, "content": marker}])
            try:
                text = self._template.render(messages=probe, tools=None, documents=None,
                                             add_generation_prompt=True, **self.variables)
            except Exception as e:  # noqa: BLE001 - a template that fails here refuses it
                log.debug("the chat template refuses a %s message: %s", role, e)
                self._renders[role] = False
            else:
                self._renders[role] = marker in text
        return self._renders[role]

    def _fit_roles(self, messages: list[JSONObject], own_system: bool
                   ) -> list[JSONObject]:
        """nbserve's tool prompt (`tools_in_prompt`) moved to turns the template takes: its
        tool list to the start of the first user turn when the template takes no system
        message and the request sent none, and the tool results into user turns when the
        template refuses or drops tool messages. The request's own messages keep their roles
        (a system message the template refuses is still refused, as in transformers)."""
        if not own_system and not self.renders_role("system"):
            messages = _system_into_first_user(messages)
        if any(m.get("role") == "tool" for m in messages) and not self.renders_role("tool"):
            messages = _tool_results_as_user(messages)
        return messages

    @property
    def tool_format(self) -> ToolFormat:
        """How the model writes tool calls: the format its template teaches, or Hermes when
        the template ignores tools (nbserve's own tool prompt teaches that one)."""
        if self.ignores_tools:
            return HERMES
        return detect_tool_format(self.tool_source or self.source)

    def _render(self, template: jinja2.Template, messages: list[JSONObject],
                tools: list[JSONValue] | None, add_generation_prompt: bool,
                context: JSONObject) -> str:
        try:
            return template.render(messages=messages, tools=tools,
                                   add_generation_prompt=add_generation_prompt, **context)
        except SecurityError as e:
            raise InvalidRequestError(
                f"the chat template tried an operation the sandbox forbids ({e}); it was stopped "
                "and nothing ran. Use a trusted chat template.", param="messages") from e
        except TemplateError as e:
            raise InvalidRequestError(f"the chat template rejected these messages: {e}"
                                      f"{self._hint(messages)}", param="messages") from e
        except Exception as e:  # a template is code; its bugs are reported, not crashed on
            raise InvalidRequestError(f"the chat template failed on these messages "
                                      f"({type(e).__name__}: {e})", param="messages") from e

    def _hint(self, messages: list[JSONObject]) -> str:
        """What to do when the template refuses a system or tool message it was given."""
        for role in ("system", "tool"):
            if any(m.get("role") == role for m in messages) and not self.renders_role(role):
                where = ("at the start of the first user message" if role == "system" else
                         "in a user message")
                return (f" (this model's chat template takes no {role} message; put its text "
                        f"{where} instead)")
        return ""


def _joined(first: JSONValue, second: JSONValue, sep: str) -> JSONValue:
    """Two message contents (strings or text-part lists) as one, `sep` between them."""
    if isinstance(first, list) or isinstance(second, list):
        a = first if isinstance(first, list) else [{"type": "text", "text": first or ""}]
        b = second if isinstance(second, list) else [{"type": "text", "text": second or ""}]
        last, head = (a[-1], b[0]) if a and b else (None, None)
        if isinstance(last, dict) and isinstance(head, dict) and last.get("type") == "text" \
                and head.get("type") == "text":
            text = last["text"]
            more = head["text"]
            if isinstance(text, str) and isinstance(more, str):  # text parts hold strings
                return [*a[:-1], {"type": "text", "text": text + sep + more}, *b[1:]]
        return [*a, *b]
    return f"{first or ''}{sep}{second or ''}"


def _system_into_first_user(messages: list[JSONObject]) -> list[JSONObject]:
    """The leading system message folded into the first user message (as Gemma 3's own
    template folds one): its text, a blank line, then the user's."""
    if not messages or messages[0].get("role") != "system":
        return messages
    system, rest = messages[0], list(messages[1:])
    for i, m in enumerate(rest):
        if m.get("role") == "user":
            rest[i] = {**m, "content": _joined(system.get("content"), m.get("content"), "\n\n")}
            return rest
    return messages


def _tool_results_as_user(messages: list[JSONObject]) -> list[JSONObject]:
    """Tool messages as user messages, each run of them joined with the user message next to
    it, so user and assistant turns still alternate."""
    out: list[JSONObject] = []
    holds_result = False  # whether out[-1] holds a tool result
    for m in messages:
        is_tool = m.get("role") == "tool"
        if is_tool:
            m = {"role": "user", "content": m.get("content")}
        if out and m.get("role") == "user" and out[-1].get("role") == "user" and \
                (is_tool or holds_result):
            out[-1] = {**out[-1], "content": _joined(out[-1].get("content"), m["content"], "\n")}
            holds_result = True
        else:
            out.append(m)
            holds_result = is_tool
    return out


def _prepare_message(given: object, index: int, keep_lists: bool) -> JSONObject:
    """Normalize one message the way servers expect: drop None values, alias reasoning fields,
    flatten text-part lists (unless the template loops over them), parse JSON tool arguments."""
    plain = plain_json(given)
    if not isinstance(plain, dict) or not isinstance(plain.get("role"), str):
        raise InvalidRequestError(f"messages[{index}] must be an object with a string 'role'",
                                  param="messages")
    message: JSONObject = {k: v for k, v in plain.items() if v is not None}
    reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning")
                      if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            text = part.get("text") if isinstance(part, dict) else None
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(text, str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequestError(
                    f"messages[{index}].content has a part of type {kind!r}; this model takes "
                    "text only: use {'type': 'text', 'text': ...} parts or a string.",
                    param="messages")
            texts.append(text)
        if not keep_lists:
            message["content"] = "\n".join(texts)
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        fn = call.get("function") if isinstance(call, dict) else None
        arguments = fn.get("arguments") if isinstance(fn, dict) else None
        if isinstance(fn, dict) and isinstance(arguments, str):
            try:  # OpenAI sends arguments as a JSON string; HF templates expect a dict
                parsed = json.loads(arguments)
            except ValueError:
                continue
            if isinstance(parsed, dict):
                fn["arguments"] = parsed
    return message


def token_variables(tokenizer_config: Mapping[str, object]) -> dict[str, str]:
    """The special-token strings transformers hands a chat template: every `*_token` entry of
    tokenizer_config.json (bos, eos, unk, sep, pad, cls, mask and model-specific names such as
    Gemma 3's boi_token), and the named `extra_special_tokens` / `model_specific_special_tokens`.
    Unset (null) tokens are left out."""
    out: dict[str, str] = {}
    for key, value in tokenizer_config.items():
        text = token_str(value)
        if isinstance(key, str) and key.endswith("_token") and text is not None:
            out[key] = text
    for group in ("extra_special_tokens", "model_specific_special_tokens"):
        named = tokenizer_config.get(group)
        if isinstance(named, dict):
            out.update({k: t for k, v in named.items()
                        if isinstance(k, str) and (t := token_str(v)) is not None})
    return out


def load_chat_template(root: Path, tokenizer_config: Mapping[str, object]
                       ) -> ChatTemplate | None:
    """The model's chat template (chat_template.jinja wins over tokenizer_config.json), with its
    special-token strings; None when the model ships none."""
    root = Path(root)
    source = tool_source = None
    raw = tokenizer_config.get("chat_template")
    if isinstance(raw, str):
        source = raw
    elif isinstance(raw, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
        tool_source = named.get("tool_use")
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    tool_file = root / "additional_chat_templates" / "tool_use.jinja"
    if tool_file.is_file():
        tool_source = tool_file.read_text(encoding="utf-8")
    if not source:
        return None
    tokens = dict(token_variables(tokenizer_config))
    bos, eos = tokens.pop("bos_token", ""), tokens.pop("eos_token", "")
    try:
        return ChatTemplate(source, bos, eos, tool_source=tool_source, variables=tokens)
    except ValueError as e:
        raise ValueError(f"{root.name}: {e}") from e
