"""nanochat's conversation format for serving: its special tokens, its `render_conversation`
(nanochat/tokenizer.py at commit 92d63d4e8bb4) as a Jinja chat template, and its tokenizer as
an nbserve Tokenizer.

A conversation renders as `<|bos|>`, then `<|user_start|>text<|user_end|>` and
`<|assistant_start|>text<|assistant_end|>` turns, alternating from the user; a leading system
message is merged into the first user message (its text, a blank line, the user's), as
nanochat merges it; the generation prompt is `<|assistant_start|>` (`render_for_completion`).
A reply ends at `<|assistant_end|>` (or `<|bos|>`, where nanochat's engine also stops).

nanochat's tokenizer is a tiktoken Encoding (inside its RustBPETokenizer), saved as a pickle:
nbserve takes the live object (`nanochat_tokenizer`) but never unpickles the file.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

from .chat_template import ChatTemplate
from .tokenizer import Tokenizer, _DuckBackend

SPECIAL_TOKENS = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>",
                  "<|assistant_end|>", "<|python_start|>", "<|python_end|>",
                  "<|output_start|>", "<|output_end|>")
BOS, ASSISTANT_END = "<|bos|>", "<|assistant_end|>"
REQUIRED = SPECIAL_TOKENS[:5]  # what the template and the stop rule use

NANOCHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set turns = messages[1:] -%}"
    "{%- if not turns -%}{{- raise_exception('a nanochat system message must be followed by "
    "a user message') -}}{%- endif -%}"
    "{%- else -%}{%- set system = none -%}{%- set turns = messages -%}{%- endif -%}"
    "{{- bos_token -}}"
    "{%- for message in turns -%}"
    "{%- if message['role'] != ('user' if loop.index0 % 2 == 0 else 'assistant') -%}"
    "{{- raise_exception('nanochat conversations alternate user and assistant messages, "
    "starting with the user (a system message may come first: it joins the first user "
    "message)') -}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '<|user_start|>' -}}"
    "{%- if loop.first and system is not none -%}{{- system ~ '\\n\\n' -}}{%- endif -%}"
    "{{- message['content'] ~ '<|user_end|>' -}}"
    "{%- else -%}"
    "{{- '<|assistant_start|>' ~ message['content'] ~ '<|assistant_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant_start|>' -}}{%- endif -%}"
)


def nanochat_chat_template() -> ChatTemplate:
    """nanochat's conversation format (see the module docstring)."""
    return ChatTemplate(NANOCHAT_TEMPLATE, bos_token=BOS, eos_token=ASSISTANT_END)


class _TiktokenBackend(_DuckBackend):
    """A tiktoken Encoding as the tokenizer backend: special-token text in a rendered prompt
    becomes its id (nanochat's own `encode` would spell it out as ordinary text)."""

    def __init__(self, enc: Any):
        super().__init__(enc)
        self.specials = {name: int(enc.encode_single_token(name))
                         for name in enc.special_tokens_set}
        self.special_ids = set(self.specials.values())

    def encode(self, text: str, add_special_tokens: bool = False) -> SimpleNamespace:
        return SimpleNamespace(ids=[int(i) for i in self.obj.encode(text,
                                                                    allowed_special="all")])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return str(self.obj.decode(ids))

    def id_to_token(self, i: int) -> str | None:
        try:
            return bytes(self.obj.decode_single_token_bytes(i)).decode("utf-8", "replace")
        except KeyError:
            return None

    def token_to_id(self, token: str) -> int | None:
        try:
            return int(self.obj.encode_single_token(token))
        except KeyError:
            return None

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return int(self.obj.n_vocab)

    def get_added_tokens_decoder(self) -> dict[int, Any]:
        return {i: SimpleNamespace(content=name, special=True)
                for name, i in self.specials.items()}


def _tiktoken_of(obj: Any) -> Any:
    """The tiktoken Encoding of nanochat's RustBPETokenizer (`.enc`) or the Encoding itself;
    None for other tokenizers."""
    enc = getattr(obj, "enc", obj)
    needed = ("encode_single_token", "decode_single_token_bytes", "special_tokens_set",
              "encode", "decode", "n_vocab")
    return enc if all(hasattr(enc, a) for a in needed) else None


def nanochat_tokenizer(obj: Any) -> Tokenizer:
    """An nbserve Tokenizer for a nanochat model: nanochat's own tokenizer (a RustBPETokenizer
    or its tiktoken Encoding), or anything `Tokenizer.from_any` takes (a tokenizers.Tokenizer,
    a tokenizer.json path, a transformers tokenizer) that has nanochat's special tokens. BOS
    is `<|bos|>` (prepended to completions, as nanochat begins every document), replies end at
    `<|assistant_end|>` or `<|bos|>`. Raises ValueError when the special tokens are missing
    or not read as single tokens."""
    enc = _tiktoken_of(obj)
    if enc is not None:
        tok = Tokenizer(_TiktokenBackend(enc))
    else:
        tok = copy.copy(Tokenizer.from_any(obj))  # the caller's object stays as it was
    ids = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
    missing = [name for name in REQUIRED if ids[name] is None]
    if missing:
        raise ValueError(f"this tokenizer lacks nanochat's special tokens {', '.join(missing)}: "
                         "pass the tokenizer the model was trained with")
    split = [name for name in REQUIRED if tok.encode(name) != [ids[name]]]
    if split:
        raise ValueError(f"this tokenizer does not read {', '.join(split)} as one token each "
                         "(they must be special tokens of the tokenizer, as nanochat's are)")
    found = {int(i) for i in ids.values() if i is not None}
    tok.bos_token_id = ids[BOS]
    tok.eos_token_ids = [int(ids[ASSISTANT_END] or 0), int(ids[BOS] or 0)]
    tok.add_bos_token = True
    tok.special_ids = set(tok.special_ids) | found
    return tok
