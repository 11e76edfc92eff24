"""A thinking model's thought before its constrained answer.

A thought is free text that ends at the model's end-of-thought marker; a request's grammar
(`response_format`, `structured_outputs`, tools) applies to what comes after it, as vLLM does
with its reasoning parsers. `after_thought` wraps a compiled-ready grammar (llguidance's Lark
text or its JSON form) so: the request's grammar becomes a subgrammar that follows the thought,
whitespace between the two allowed. How the thought may come is the request's `ThoughtRule`
(see `nbserve.text.reasoning.thought_rule`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from ..text.reasoning import CLOSE, OPEN, ThoughtRule
from ..types import JSONObject

_ANSWER = "nbserve_answer"  # the name of the request's own grammar inside the wrapper


def after_thought(grammar: str, rule: ThoughtRule,
                  special: Callable[[str], int | None] = lambda s: None) -> str:
    """`grammar` behind a thought: `open`, the answer starts inside a thought the prompt opened
    and must close it first; `optional`, the answer may start with a whole thought; `none`:
    `grammar` unchanged. `special(marker)` gives the token id of a marker that is one special
    token of the tokenizer (the grammar then names that token)."""
    if rule == "none":
        return grammar
    grammars = _as_grammars(grammar)
    ref = grammars[0].get("name") or _ANSWER
    grammars[0] = {**grammars[0], "name": ref}
    close = special(CLOSE)
    if close is not None:  # a special token ends the thought: no text can hold it
        rest = f"thought_rest: THOUGHT_TEXT <[{close}]>\nTHOUGHT_TEXT: /(.|\\n)*/"
    else:
        rest = f"thought_rest[lazy]: /(.|\\n)*{_regex(CLOSE)}/"
    if rule == "open":
        start = f"start: thought_rest gap? @{ref}"
    else:
        opener = special(OPEN)
        start = f"start: thought gap? @{ref} | @{ref}\nthought: " + \
            (f"<[{opener}]>" if opener is not None else json.dumps(OPEN)) + " thought_rest"
    lark = f"{start}\n{rest}\ngap: /[ \\t\\n]+/\n"
    return json.dumps({"grammars": [{"lark_grammar": lark}, *grammars]}, ensure_ascii=False)


def _as_grammars(grammar: str) -> list[JSONObject]:
    """The grammar list of `grammar`: its JSON form's, or one entry for Lark text."""
    if grammar.lstrip().startswith("{"):
        top = json.loads(grammar)
        return [dict(g) for g in top["grammars"]]
    return [{"lark_grammar": grammar}]


def _regex(text: str) -> str:
    return re.escape(text).replace("/", "\\/")
