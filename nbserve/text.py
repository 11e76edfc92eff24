"""The text layer: tokenizer wrapper, sandboxed chat templates, streaming detokenizer, stop strings.

Server and UI both go messages -> `ChatTemplate.render` -> `Tokenizer.encode`, and token ids ->
`IncrementalDetokenizer` -> `StopStringMatcher` -> text deltas.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import jinja2
import tokenizers
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nbserve.types import InvalidRequestError

# ----------------------------------------------------------------------------- tokenizer

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _gpt2_byte_decoder() -> dict[str, int]:
    """Invert GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class _DuckBackend:
    """Gives an object with `encode`/`decode` (a slow transformers tokenizer, tiktoken, a test
    double) the few `tokenizers.Tokenizer` methods `Tokenizer` calls."""

    def __init__(self, obj: Any):
        self.obj = obj

    def encode(self, text: str, add_special_tokens: bool = False) -> SimpleNamespace:
        try:
            ids = self.obj.encode(text, add_special_tokens=add_special_tokens)
        except TypeError:
            ids = self.obj.encode(text)
        ids = getattr(ids, "ids", ids)
        return SimpleNamespace(ids=[int(i) for i in ids])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        try:
            return self.obj.decode(ids, skip_special_tokens=skip_special_tokens)
        except TypeError:
            return self.obj.decode(ids)

    def id_to_token(self, i: int) -> str | None:
        convert = getattr(self.obj, "convert_ids_to_tokens", None)
        return convert(i) if convert else self.decode([i])

    def token_to_id(self, token: str) -> int | None:
        convert = getattr(self.obj, "convert_tokens_to_ids", None)
        return convert(token) if convert else None

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        for attr in ("n_vocab", "vocab_size"):
            if isinstance(getattr(self.obj, attr, None), int):
                size = getattr(self.obj, attr)
                break
        else:
            size = 0
        try:
            size = max(size, len(self.obj))
        except TypeError:
            pass
        return size

    def get_added_tokens_decoder(self) -> dict[int, Any]:
        ids = getattr(self.obj, "all_special_ids", None) or []
        return {i: SimpleNamespace(content=self.id_to_token(i), special=True) for i in ids}


class Tokenizer:
    """Text <-> token ids for one model, over a `tokenizers.Tokenizer`.

    `encode` maps special-token text (e.g. `<|im_start|>` in a rendered chat template) to its id.
    `eos_token_ids` are the ids that end generation; `special_ids` are skipped by
    `decode(skip_special_tokens=True)`.
    """

    def __init__(self, tok: tokenizers.Tokenizer, bos_token_id: int | None = None,
                 eos_token_ids: int | Iterable[int] = (), add_bos_token: bool = False):
        self._tok = tok
        self.bos_token_id = bos_token_id
        eos = [eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids
        self.eos_token_ids: list[int] = list(dict.fromkeys(int(i) for i in eos))
        self.add_bos_token = bool(add_bos_token and bos_token_id is not None)
        added = tok.get_added_tokens_decoder()
        self._added: dict[int, str] = {i: t.content for i, t in added.items()}
        self.special_ids: set[int] = {i for i, t in added.items() if t.special}
        self.special_ids |= set(self.eos_token_ids) | ({bos_token_id} - {None})
        self.vocab_size: int = max([tok.get_vocab_size(with_added_tokens=True),
                                    *(i + 1 for i in self._added)])
        self._bytes: dict[int, bytes] = {}
        self._byte_mode: str | None = None

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_ids={self.eos_token_ids})")

    # -- construction

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, bos_token: str | None = None,
                  eos_token: str | Sequence[str] | None = None,
                  add_bos_token: bool | None = None) -> Tokenizer:
        """Load a `tokenizer.json`. Special tokens are given as strings (as in tokenizer_config);
        `add_bos_token=None` means: add BOS when the file's post-processor does."""
        tok = tokenizers.Tokenizer.from_file(str(path))
        bos_id = tok.token_to_id(bos_token) if bos_token else None
        eos_tokens = [eos_token] if isinstance(eos_token, str) else list(eos_token or [])
        eos_ids = [i for i in (tok.token_to_id(t) for t in eos_tokens) if i is not None]
        post_bos = _post_processor_bos(tok)
        if bos_id is None and bos_token is None:
            bos_id = post_bos
        if add_bos_token is None:
            add_bos_token = post_bos is not None and post_bos == bos_id
        return cls(tok, bos_id, eos_ids, add_bos_token)

    @classmethod
    def from_any(cls, obj: Any) -> Tokenizer:
        """Adopt a `Tokenizer`, a `tokenizers.Tokenizer`, a transformers tokenizer, a path to
        tokenizer.json or to a model directory, or any object with `encode` and `decode`."""
        if isinstance(obj, Tokenizer):
            return obj
        if isinstance(obj, tokenizers.Tokenizer):
            bos = _post_processor_bos(obj)
            return cls(obj, bos, (), add_bos_token=bos is not None)
        if isinstance(obj, (str, os.PathLike)):
            path = Path(obj)
            if path.is_dir():
                from nbserve.loading.hf_dir import load_tokenizer

                return load_tokenizer(path)[0]
            if path.is_file():
                return cls.from_file(path)
            raise ValueError(f"no tokenizer file or model directory at {path}")
        encode, decode = getattr(obj, "encode", None), getattr(obj, "decode", None)
        if callable(encode) and callable(decode):
            bos = getattr(obj, "bos_token_id", None)
            eos = getattr(obj, "eos_token_id", None)
            eos = [] if eos is None else eos
            try:  # transformers tokenizers know whether they add BOS; ask them directly.
                probe = list(obj.encode("a", add_special_tokens=True))
                add_bos = bos is not None and bool(probe) and probe[0] == bos
            except Exception:  # noqa: BLE001 - any object may be passed; probing is best-effort
                add_bos = False
            backend = getattr(obj, "backend_tokenizer", None)
            if not isinstance(backend, tokenizers.Tokenizer):
                backend = _DuckBackend(obj)
            return cls(backend, bos, eos, add_bos)
        raise TypeError(
            f"cannot use a {type(obj).__name__} as a tokenizer. Pass one of: "
            "nbserve.text.Tokenizer, tokenizers.Tokenizer, a transformers tokenizer, a path to "
            "tokenizer.json or to a model directory, or an object with encode(text) -> list[int] "
            "and decode(ids) -> str.")

    # -- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids. With
        `add_special_tokens`, BOS is prepended if the model wants it and it is not there yet."""
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        """The vocabulary piece of id `i` (e.g. `Ġhello`); "" for ids the tokenizer lacks."""
        return self._tok.id_to_token(int(i)) or ""

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, i: int) -> bytes:
        """The raw bytes token `i` stands for; may be part of a UTF-8 character (byte-level BPE
        pieces, `<0xE4>` byte-fallback pieces). Used for logprobs `bytes`."""
        i = int(i)
        cached = self._bytes.get(i)
        if cached is None:
            cached = self._bytes[i] = self._compute_token_bytes(i)
        return cached

    def _compute_token_bytes(self, i: int) -> bytes:
        if i in self._added:
            return self._added[i].encode()
        if self._byte_mode is None:
            self._byte_mode = _byte_mode(self._tok)
        if isinstance(self._tok, _DuckBackend):
            single = getattr(self._tok.obj, "decode_single_token_bytes", None)  # tiktoken
            if callable(single):
                return bytes(single(i))
        piece = self._tok.id_to_token(i)
        if piece is None:
            return b""
        if self._byte_mode == "byte_level":
            table = _BYTE_DECODER
            return b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)
        if self._byte_mode == "sentencepiece":
            m = _BYTE_PIECE.match(piece)
            return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()
        return self.decode([i]).encode()


_BYTE_DECODER = _gpt2_byte_decoder()


def _byte_mode(tok: Any) -> str:
    """How vocabulary pieces spell bytes: "byte_level" (GPT-2), "sentencepiece" (▁ and <0xAB>),
    or "text" (ask the decoder)."""
    decoder = getattr(tok, "decoder", None)
    try:
        spec = json.dumps(json.loads(decoder.__getstate__())) if decoder is not None else ""
    except Exception:  # noqa: BLE001 - decoders without a JSON state are "text"
        spec = ""
    if '"ByteLevel"' in spec:
        return "byte_level"
    if '"ByteFallback"' in spec or '"Metaspace"' in spec or "\\u2581" in spec:
        return "sentencepiece"
    return "text"


def _post_processor_bos(tok: tokenizers.Tokenizer) -> int | None:
    """The id a tokenizer.json post-processor puts first (Llama-3's <|begin_of_text|>), if any."""
    try:
        plain = tok.encode("a", add_special_tokens=False).ids
        full = tok.encode("a", add_special_tokens=True).ids
    except Exception:  # noqa: BLE001 - a post-processor that cannot run adds nothing
        return None
    if len(full) > len(plain) and full[1:1 + len(plain)] == plain:
        return full[0]
    return None


# ----------------------------------------------------------------------------- chat template

_MAX_REPEAT = 10_000_000  # characters/items a template may build with `*`


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; when serving it simply renders its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The jinja2 sandbox, stricter: touching an unsafe attribute raises (jinja2 would render
    ""), and `'x' * n` / `a ** b` are capped so one expression cannot exhaust memory or CPU."""

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # jinja2 returns an Undefined that prints as "" here; fail loudly instead.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} "
                            "is not allowed")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
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

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates may not set the attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Like transformers: no HTML escaping (unlike jinja's own filter), non-ASCII kept as is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_env() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True,
                   extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       namespace=_Namespace, dict=lambda *a, **k: dict(*a, **k))
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


def _plain(value: Any) -> Any:
    """Rebuild `value` from plain JSON types, so a template only ever sees str/int/dict/list."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    for base in (bool, int, float, str):
        if isinstance(value, base):  # enums, numpy scalars, str subclasses
            return base(value)
    if callable(getattr(value, "model_dump", None)):  # pydantic (e.g. OpenAI SDK messages)
        return _plain(value.model_dump(exclude_none=True))
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


class ChatTemplate:
    """A Hugging Face chat template compiled once in a sandbox; renders like transformers'
    `apply_chat_template(..., tokenize=False)`.

    `extra` are variables every render sees (e.g. `unk_token`, or `enable_thinking=False`).
    `tool_source` is an optional second template used when tools are given (the "tool_use"
    template some models ship).
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", *,
                 tool_source: str | None = None, is_default: bool = False, **extra: Any):
        self.source = source
        self.tool_source = tool_source
        self.is_default = is_default
        self.variables: dict[str, Any] = {"bos_token": bos_token, "eos_token": eos_token, **extra}
        env = _make_env()
        self._template, self._lists = self._compile(env, source)
        self._tool_template, self._tool_lists = (self._compile(env, tool_source) if tool_source
                                                 else (self._template, self._lists))

    @staticmethod
    def _compile(env: _Sandbox, source: str) -> tuple[jinja2.Template, bool]:
        try:
            return env.from_string(source), _iterates_content(env.parse(source))
        except TemplateError as e:
            line = getattr(e, "lineno", None)
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
    def from_transformers(cls, tokenizer: Any) -> ChatTemplate | None:
        """The chat template of a transformers tokenizer (None if it has none), with the special
        tokens transformers would pass to it."""
        source = getattr(tokenizer, "chat_template", None)
        tool_source = None
        if isinstance(source, dict):  # {"default": ..., "tool_use": ...}
            source, tool_source = source.get("default"), source.get("tool_use")
        if not source:
            return None
        tokens = {k: v for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items()
                  if isinstance(v, str)}
        return cls(source, tool_source=tool_source, **tokens)

    def render(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for `messages` (OpenAI-style dicts). Raises `InvalidRequestError` when
        the template rejects the messages or attempts something the sandbox forbids."""
        template, lists = (self._tool_template, self._tool_lists) if tools else (
            self._template, self._lists)
        if not messages:
            raise InvalidRequestError("messages must contain at least one message",
                                      param="messages")
        prepared = [_prepare_message(m, i, keep_lists=lists) for i, m in enumerate(messages)]
        context = {**self.variables, **_plain(kwargs)}
        context.setdefault("documents", None)
        try:
            return template.render(messages=prepared, tools=_plain(tools),
                                   add_generation_prompt=add_generation_prompt, **context)
        except SecurityError as e:
            raise InvalidRequestError(
                f"the chat template tried an operation the sandbox forbids ({e}); it was stopped "
                "and nothing ran. Use a trusted chat template.", param="messages") from e
        except TemplateError as e:
            raise InvalidRequestError(f"the chat template rejected these messages: {e}",
                                      param="messages") from e
        except Exception as e:  # a template is code; its bugs are reported, not crashed on
            raise InvalidRequestError(f"the chat template failed on these messages "
                                      f"({type(e).__name__}: {e})", param="messages") from e


def _prepare_message(message: Any, index: int, keep_lists: bool) -> dict[str, Any]:
    """Normalize one message the way servers expect: drop None values, alias reasoning fields,
    flatten text-part lists (unless the template loops over them), parse JSON tool arguments."""
    message = _plain(message)
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidRequestError(f"messages[{index}] must be an object with a string 'role'",
                                  param="messages")
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning")
                      if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequestError(
                    f"messages[{index}].content has a part of type {kind!r}; this model takes "
                    "text only: use {'type': 'text', 'text': ...} parts or a string.",
                    param="messages")
            texts.append(part["text"])
        if not keep_lists:
            message["content"] = "\n".join(texts)
    for call in message.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:  # OpenAI sends arguments as a JSON string; HF templates expect a dict
                parsed = json.loads(fn["arguments"])
            except ValueError:
                continue
            if isinstance(parsed, dict):
                fn["arguments"] = parsed
    return message


# ----------------------------------------------------------------------------- streaming text


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas without splitting UTF-8 characters.

    Each step decodes only a small window: the tokens of the previous delta (context for
    tokenizers whose decoding depends on the neighbour, e.g. sentencepiece's leading space)
    plus the tokens not emitted yet. Text ending in U+FFFD (an incomplete character) is held
    back until a later token completes it or `finish()` flushes it. The concatenation of all
    deltas equals `tokenizer.decode(all_ids)`; the one exception is an invalid byte run under
    a byte-fallback decoder, where the full decode replaces the whole run, even its valid head.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._window: list[int] = []  # previous delta's tokens, then pending ones
        self._read = 0  # window[:_read] were already emitted
        self.num_tokens = 0

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed new token ids; return the text they complete (may be "")."""
        new = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        self._window.extend(new)
        self.num_tokens += len(new)
        return self._advance(final=False)

    def finish(self) -> str:
        """Return whatever is still held back (e.g. a trailing incomplete character as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._window):
            return ""
        decode = self._tokenizer.decode
        before = decode(self._window[:self._read], skip_special_tokens=self.skip_special_tokens)
        text = decode(self._window, skip_special_tokens=self.skip_special_tokens)
        if len(text) <= len(before) or (not final and text.endswith("\ufffd")):
            return ""
        self._window = self._window[self._read:]
        self._read = len(self._window)
        return text[len(before):]


class StopStringMatcher:
    """Finds stop strings in streamed text, even when they span deltas.

    `feed` returns the text that is safe to show and the stop string once one is complete. It
    holds back the longest tail that could still begin a stop string and never returns the stop
    string or anything after it. When two stops complete, the one that ends first wins, so the
    result does not depend on how the text was chunked.
    """

    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add a text delta; return `(text to emit, matched stop or None)`."""
        if self.matched is not None:
            return "", self.matched
        buf = self._held + text
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            at = buf.find(stop)
            if at >= 0 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        if best is not None:
            self._held, self.matched = "", best[2]
            return buf[:best[1]], best[2]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        """End of stream: return the held-back tail (it never completed a stop)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _partial_tail(self, buf: str) -> int:
        longest = max((len(s) for s in self.stops), default=1) - 1
        for k in range(min(len(buf), longest), 0, -1):
            tail = buf[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self.stops):
                return k
        return 0
