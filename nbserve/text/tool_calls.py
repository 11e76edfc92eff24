"""Tool calls in a model's own format: the grammar that makes a model write them, and the
parser that reads them back as OpenAI `tool_calls`, streamed as they are written.

A `ToolFormat` says how a family writes a call: Hermes/Qwen/SmolLM `<tool_call>{json}
</tool_call>` blocks, Llama 3.x bare `{"name", "parameters"}` JSON (after `<|python_tag|>` or
alone), Mistral `[TOOL_CALLS][{...}, ...]`. `tool_grammar` writes the Lark grammar (llguidance's
dialect, with inline `%json` schemas) that allows exactly what the request's `tool_choice`
allows; `ToolCallParser` turns the text back into content and calls. No llguidance here: the
grammar is text, compiled by `engine/constraints.py`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..types import FunctionSpec, JSONObject, JSONValue, ToolCall, ToolSpec
from .json_bounds import bounded_numbers

# how grammars make models write JSON (no runaway spaces)
JSON_STYLE: JSONObject = {"whitespace_flexible": False, "item_separator": ", ",
                          "key_separator": ": ", "coerce_one_of": True}


def closed_schema(schema: JSONValue) -> JSONValue:
    """`schema` with `additionalProperties: false` on every object schema that lists its
    properties and says nothing of others: a grammar then writes the properties a schema names,
    not ones a small model invents (JSON Schema would allow them; a function would not take
    them). Schemas that allow more (additionalProperties, patternProperties) stay as they are."""
    if isinstance(schema, list):
        return [closed_schema(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (closed_schema(v) if k not in ("const", "enum", "default", "examples") else v)
           for k, v in schema.items()}
    properties = schema.get("properties")
    if "properties" in out and isinstance(properties, dict):
        out["properties"] = {k: closed_schema(v) for k, v in properties.items()}
        if "additionalProperties" not in out and "patternProperties" not in out:
            out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class ToolFormat:
    """How one family writes tool calls.

    `open`/`close`: the markers around a call region (`close` None: the region runs to the end
    of the answer); `args_key`: "arguments" or "parameters"; `listed`: the region holds a JSON
    list of calls; `separator`: between calls when not listed; `bare`: an answer that starts
    with `{` is a call region too (Llama 3's JSON calls, which the model may write without
    `<|python_tag|>`).
    """

    name: str
    open: str
    close: str | None
    args_key: str = "arguments"
    listed: bool = False
    separator: str = "\n"
    bare: bool = False

    def grammar(self, tools: Sequence[ToolSpec | FunctionSpec], *, required: bool = False,
                name: str | None = None, parallel: bool = True, answer: str | None = None,
                special: Callable[[str], int | None] = lambda s: None) -> str:
        """A Lark grammar: the text answer (`answer`, a Lark expression; free text when None,
        which calls may then follow: `Let me check.` and a call) or calls (`required` or
        `name`: calls only; `name`: one call of that function; `parallel` False: one call at
        most). `special(marker)` gives the token id of a marker that is one special token of
        the tokenizer (the grammar then names that token)."""
        chosen = [t for t in tools if function_of(t)["name"] == name] if name else tools
        schemas = [self._call_schema(t) for t in chosen]
        body = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        one = "%json " + json.dumps({**body, "x-guidance": {**JSON_STYLE, "lenient": True}},
                                    ensure_ascii=False)
        many = parallel and name is None
        closer = _marker(self.close, special) if self.close else ""
        if self.listed:
            inner = f'"[" call_obj ("{", "}" call_obj)* "]"' if many else '"[" call_obj "]"'
            rest = f"{inner} {closer}".strip()  # a region after its opener
            calls = f"calls: {_marker(self.open, special)} rest"
            more = ""
        else:
            opener = _marker(self.open, special) if self.open else ""
            if opener and self.bare:
                opener += "?"
            pad = _lark_str("\n") if self.close else ""  # <tool_call>\n{...}\n</tool_call>
            rest = " ".join(x for x in (pad, "call_obj", pad, closer) if x)  # a call's
            sep = _lark_str(self.separator)
            more = f" ({sep} call)*" if many else ""
            calls = f"calls: call{more}\ncall: " + " ".join(x for x in (opener, "rest") if x)
        text = answer if answer is not None else "TEXT"
        start = "start: calls" if required or name else f"start: {text} | calls"
        lines = [start, calls, f"rest: {rest}", f"call_obj: {one}"]
        if answer is None and not (required or name):
            lead = self._lead(special)
            if lead:
                lines[0] += f" | lead rest{more}"
                lines.append(lead)
            lines.append(self._free_text())
        return "\n".join(lines) + "\n"

    def _lead(self, special: Callable[[str], int | None]) -> str | None:
        """lead: text that ends with the first call's opener (`Let me check.\n<tool_call>`),
        lazy so that it ends at the first opener; None for a format without an opener."""
        if not self.open:
            return None
        bare = " & ~/[ \\t\\n]*\\{(.|\\n)*/" if self.bare else ""  # not a bare call's start
        tid = special(self.open)
        if tid is not None:  # a special token: no text can hold it
            return f"lead: LEAD_TEXT <[{tid}]>\nLEAD_TEXT: /(.|\\n)*/{bare}"
        return f"lead[lazy]: LEAD\nLEAD: /(.|\\n)*{_regex_escape(re.escape(self.open))}/{bare}"

    def _call_schema(self, tool: ToolSpec | FunctionSpec) -> JSONObject:
        fn = function_of(tool)
        params = bounded_numbers(closed_schema(fn.get("parameters") or {"type": "object"}))
        return {"type": "object", "additionalProperties": False,
                "properties": {"name": {"const": fn["name"]}, self.args_key: params},
                "required": ["name", self.args_key]}

    def _free_text(self) -> str:
        """TEXT: any answer that does not start a call region."""
        start = "(.|\\n)*" + re.escape(self.open) if self.open else None
        banned = [f"~/{_regex_escape(start)}(.|\\n)*/"] if start else []
        if self.bare:
            banned.append("~/[ \\t\\n]*\\{(.|\\n)*/")
        return "TEXT: /(.|\\n)+/" + "".join(f" & {b}" for b in banned)

    def parser(self, tool_names: set[str] | None = None, parallel: bool = True
               ) -> ToolCallParser:
        return ToolCallParser(self, tool_names or set(), parallel)

    def parse(self, text: str, tool_names: set[str] | None = None, parallel: bool = True
              ) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer; content None when the answer is only calls."""
        p = self.parser(tool_names, parallel)
        pieces = p.feed(text) + p.finish()
        content = "".join(x.text for x in pieces if x.kind == "content")
        if p.calls:
            return content.strip() or None, p.calls
        return content, p.calls


def function_of(tool: ToolSpec | FunctionSpec) -> FunctionSpec:
    """The function of an OpenAI tool (or the tool itself when it is a bare function)."""
    if "function" in tool:
        return tool["function"]
    return tool


def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _regex_escape(pattern: str) -> str:
    return pattern.replace("/", "\\/")


def _marker(marker: str, special: Callable[[str], int | None]) -> str:
    tid = special(marker)
    return f"<[{tid}]>" if tid is not None else _lark_str(marker)


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
LLAMA3_JSON = ToolFormat("llama3_json", "<|python_tag|>", None, args_key="parameters",
                         separator="; ", bare=True)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", None, listed=True)
PHI4_MINI = ToolFormat("phi4_mini", "functools", None, listed=True)
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, PHI4_MINI)}


def detect_tool_format(template_source: str | None) -> ToolFormat:
    """The format a chat template teaches its model: from the markers it writes. Templates
    that write none (or ignore tools: nbserve then prompts in the Hermes format) get Hermes."""
    src = template_source or ""
    if "[TOOL_CALLS]" in src:
        return MISTRAL
    if "functools" in src or "<|tool|>" in src:
        return PHI4_MINI
    if "<|python_tag|>" in src or ("<|eot_id|>" in src and "parameters" in src
                                   and "<tool_call>" not in src):
        return LLAMA3_JSON
    return HERMES


# ----------------------------------------------------------------------------- parsing


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class Piece:
    """One thing the parser found: `content` text, the `start` of call `index` (with its id
    and name), or an `args` fragment of call `index`."""

    kind: str
    text: str = ""
    index: int = 0
    call_id: str = ""
    name: str = ""


_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:\s*')
_PARTIAL_HEAD_MAX = 4096  # a call whose header is not seen in this many characters is read whole


@dataclass(slots=True)
class _Scan:
    """Where a JSON value ends, fed one character at a time."""

    depth: int = 0
    in_str: bool = False
    esc: bool = False
    started: bool = False
    scalar: bool = False

    def feed(self, ch: str) -> bool:
        """Add `ch` (part of the value); True when the value is complete with it. A scalar
        (number, true, null) is complete at the character after it, which the caller
        re-reads: `ends_before(ch)` tells."""
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                return self.depth == 0
            return False
        if ch == '"':
            self.in_str, self.started = True, True
        elif ch in "{[":
            self.depth += 1
            self.started = True
        elif ch in "}]":
            self.depth -= 1
            return self.depth <= 0
        elif not ch.isspace():
            self.started = True
            self.scalar = self.depth == 0
        return False

    def ends_before(self, ch: str) -> bool:
        return self.scalar and self.depth == 0 and not self.in_str and (ch in ",}]" or
                                                                        ch.isspace())


@dataclass
class ToolCallParser:
    """Streaming: `feed` model text, get `Piece`s back as soon as they are certain (a partial
    marker is held back; a call's id and name as soon as its header is written, then its
    arguments fragment by fragment); `finish` at the end of the answer. `calls` holds the
    calls found, OpenAI-shaped, arguments as the model wrote them (JSON text). A call region
    that turns out not to hold calls goes back to the content, unless part of it was streamed.
    """

    fmt: ToolFormat
    tool_names: set[str]
    parallel: bool = True
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _state: str = "text"  # text | region | head | args | tail
    _seen_text: bool = False  # non-space content sent
    _held_space: str = ""
    _obj: str = ""  # the current call object's text (for whole reads)
    _scan: _Scan = field(default_factory=_Scan)
    _streamed: bool = False
    _region: str = ""

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        while self._step(out, final=True):
            pass
        if self._state != "text" and not self._streamed:  # an unfinished region: content
            self._content(out, self._region + self._obj + self._buf)
        elif self._state == "text" and self._buf:
            self._content(out, self._buf)
        self._buf = ""
        if self._held_space and self._seen_text:
            out.append(Piece("content", self._held_space))
        self._held_space = ""
        return out

    # -- one transition; False when more text is needed

    def _step(self, out: list[Piece], final: bool) -> bool:
        if self._state == "text":
            return self._in_text(out, final)
        if self._state == "region":
            return self._in_region(out, final)
        if self._state == "head":
            return self._in_head(out, final)
        if self._state == "args":
            return self._in_args(out)
        return self._in_tail(out, final)

    def _content(self, out: list[Piece], text: str) -> None:
        if not text:
            return
        if not self._seen_text and not text.strip():
            self._held_space += text
            return
        if not self._seen_text:
            text, self._held_space = self._held_space + text, ""
            if not self.calls:  # leading space before any call or text is not content
                text = text.lstrip() if not text.strip() else text
        self._seen_text = True
        out.append(Piece("content", text))

    def _can_call(self) -> bool:
        return self.parallel or not self.calls

    def _in_text(self, out: list[Piece], final: bool) -> bool:
        fmt = self.fmt
        if fmt.bare and not self._seen_text and not self.calls:
            head = self._buf.lstrip()
            if not head:
                return False
            if head.startswith("{") and self.tool_names:
                self._held_space = ""
                self._buf, self._region, self._state = head, "", "region"
                return True
        i = self._buf.find(fmt.open) if fmt.open else -1
        if i >= 0:
            self._content(out, self._buf[:i])
            self._region = fmt.open
            self._buf, self._state = self._buf[i + len(fmt.open):], "region"
            return True
        keep = 0 if final or i >= 0 else _partial_suffix(self._buf, fmt.open)
        cut = len(self._buf) - keep
        self._content(out, self._buf[:cut])
        self._buf = self._buf[cut:]
        return False

    def _in_region(self, out: list[Piece], final: bool) -> bool:
        """Between calls of a region: separators, list brackets, the close marker."""
        b = self._buf
        j = 0
        while j < len(b) and (b[j].isspace() or b[j] in ",;[]"):
            j += 1
        self._region += b[:j]
        self._buf = b = b[j:]
        if not b:
            if final:
                self._state = "text"
            return False
        close = self.fmt.close
        if close and b.startswith(close):
            self._buf, self._state, self._region = b[len(close):], "text", ""
            return True
        if close and close.startswith(b) and not final:
            return False
        if b[0] == "{":
            self._state, self._obj = "head", ""
            return True
        # not a call: the rest of the region is content
        self._state = "text"
        if not self._streamed:
            self._content(out, self._region)
        self._region = ""
        return True

    def _in_head(self, out: list[Piece], final: bool) -> bool:
        m = _HEAD.match(self._buf)
        if m and m.end() == len(self._buf) and not final:
            return False  # the arguments' first character decides: wait for it
        if m and m.group(1) and self._buf[m.end():m.end() + 1] == "{" and \
                self._can_call() and \
                (not self.tool_names or _unescape(m.group(1)) in self.tool_names):
            name = _unescape(m.group(1))
            call: ToolCall = {"id": new_call_id(), "type": "function",
                              "function": {"name": name, "arguments": ""}}
            self.calls.append(call)
            self._streamed = True
            out.append(Piece("start", index=len(self.calls) - 1, call_id=call["id"], name=name))
            self._buf = self._buf[m.end():]
            self._scan, self._state = _Scan(), "args"
            return True
        # no header (yet): read the whole object once it is complete
        scan = _Scan()
        for k, ch in enumerate(self._buf):
            if scan.feed(ch):
                obj, self._buf = self._buf[:k + 1], self._buf[k + 1:]
                whole = _as_call(obj, self.tool_names)
                if whole is None:
                    self._state = "text"
                    if not self._streamed:
                        self._content(out, self._region + obj)
                    self._region = ""
                    return True
                if not self._can_call():  # parallel_tool_calls=False: only the first counts
                    self._state = "region"
                    return True
                self.calls.append(whole)
                i = len(self.calls) - 1
                out.append(Piece("start", index=i, call_id=whole["id"],
                                 name=whole["function"]["name"]))
                out.append(Piece("args", whole["function"]["arguments"], index=i))
                self._streamed = True
                self._state = "region"
                return True
        if final or len(self._buf) > _PARTIAL_HEAD_MAX:
            self._state = "text"
            if not self._streamed:
                self._content(out, self._region + self._buf)
            self._buf = self._region = ""
            return False
        return False

    def _in_args(self, out: list[Piece]) -> bool:
        i = len(self.calls) - 1
        done = len(self._buf)
        complete = False
        for k, ch in enumerate(self._buf):
            if self._scan.started and self._scan.ends_before(ch):
                done, complete = k, True
                break
            if self._scan.feed(ch):
                done, complete = k + 1, True
                break
        frag = self._buf[:done]
        if not self._scan.started:  # only space before the value so far: not arguments
            frag_out = frag.lstrip()
        else:
            frag_out = frag if self.calls[i]["function"]["arguments"] else frag.lstrip()
        if frag_out:
            self.calls[i]["function"]["arguments"] += frag_out
            out.append(Piece("args", frag_out, index=i))
        self._buf = self._buf[done:]
        if complete:
            self.calls[i]["function"]["arguments"] = \
                self.calls[i]["function"]["arguments"].rstrip()
            self._state, self._scan = "tail", _Scan()
            return True
        return False

    def _in_tail(self, out: list[Piece], final: bool) -> bool:
        """After the arguments: up to the call object's closing brace."""
        for k, ch in enumerate(self._buf):
            if ch == "}":
                self._buf, self._state = self._buf[k + 1:], "region"
                return True
            if not ch.isspace() and ch != ",":
                # more keys after the arguments: skip them up to the object's end
                scan = _Scan(depth=1, started=True)
                for j in range(k, len(self._buf)):
                    if scan.feed(self._buf[j]):
                        self._buf, self._state = self._buf[j + 1:], "region"
                        return True
                return False
        return False


def _unescape(s: str) -> str:
    try:
        return str(json.loads(f'"{s}"'))
    except ValueError:
        return s


def _as_call(obj_text: str, tool_names: set[str]) -> ToolCall | None:
    """A whole call object -> an OpenAI tool call, or None when it is not one."""
    try:
        obj = json.loads(obj_text)
    except ValueError:
        return None
    name = obj.get("name") if isinstance(obj, dict) else None
    if not isinstance(obj, dict) or not isinstance(name, str) or not name:
        return None
    if tool_names and name not in tool_names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        arguments = args
    elif isinstance(args, dict):
        arguments = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
