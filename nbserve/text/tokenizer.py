"""Tokenizer: one wrapper over `tokenizers`, transformers or duck-typed tokenizers, with the
raw bytes of each token (for logprobs and byte-level streaming)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol, runtime_checkable

import tokenizers

from ..types import JSONObject
from .files import MissingFileError, ids, optional_json, token_str

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


@runtime_checkable
class TokenizerProtocol(Protocol):
    """What the engine, the grammar layer and the streaming text code read of a tokenizer.

    `Tokenizer` is the one implementation; code that only reads a tokenizer types its argument
    with this protocol so the interface it relies on is written down in one place.
    """

    bos_token_id: int | None
    eos_token_ids: list[int]
    special_ids: set[int]
    vocab_size: int
    add_bos_token: bool

    @property
    def added_tokens(self) -> dict[int, str]:
        """Added (special) tokens: id -> their text, e.g. 2 -> "<|im_end|>"."""
        ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def id_to_token(self, i: int) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def token_bytes(self, i: int) -> bytes: ...


@runtime_checkable
class _EncodesText(Protocol):
    """Any tokenizer object `Tokenizer.from_any` adopts: text -> ids -> text."""

    def encode(self, text: str, **kwargs: Any) -> Any: ...

    def decode(self, ids: list[int], **kwargs: Any) -> str: ...


@runtime_checkable
class _IdsToTokens(Protocol):  # transformers tokenizers
    def convert_ids_to_tokens(self, i: int) -> str | None: ...


@runtime_checkable
class _TokensToIds(Protocol):  # transformers tokenizers
    def convert_tokens_to_ids(self, token: str) -> int | None: ...


@runtime_checkable
class _SingleTokenBytes(Protocol):  # tiktoken
    def decode_single_token_bytes(self, i: int) -> bytes: ...


class _DuckBackend:
    """Gives an object with `encode`/`decode` (a slow transformers tokenizer, tiktoken, a test
    double) the few `tokenizers.Tokenizer` methods `Tokenizer` calls."""

    def __init__(self, obj: _EncodesText):
        self.obj: Any = obj  # its other members (tiktoken's, transformers') vary

    def encode(self, text: str, add_special_tokens: bool = False) -> SimpleNamespace:
        try:
            ids = self.obj.encode(text, add_special_tokens=add_special_tokens)
        except TypeError:
            ids = self.obj.encode(text)
        ids = ids.ids if isinstance(ids, tokenizers.Encoding) else ids
        return SimpleNamespace(ids=[int(i) for i in ids])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        try:
            return self.obj.decode(ids, skip_special_tokens=skip_special_tokens)
        except TypeError:
            return self.obj.decode(ids)

    def id_to_token(self, i: int) -> str | None:
        if isinstance(self.obj, _IdsToTokens):
            return self.obj.convert_ids_to_tokens(i)
        return self.decode([i])

    def token_to_id(self, token: str) -> int | None:
        if isinstance(self.obj, _TokensToIds):
            return self.obj.convert_tokens_to_ids(token)
        return None

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

    def __init__(self, tok: tokenizers.Tokenizer | _DuckBackend, bos_token_id: int | None = None,
                 eos_token_ids: int | Iterable[int] = (), add_bos_token: bool = False,
                 closing_ids: Iterable[int] = ()):
        self._tok = tok
        self.bos_token_id = bos_token_id
        # What the tokenizer puts after a text of its own (Qwen3-Embedding's <|endoftext|>,
        # from its post-processor; `add_eos_token` in tokenizer_config or a GGUF): an embedded
        # text ends with it, as the model was trained to read it. Generation never adds it.
        self.closing_ids: tuple[int, ...] = tuple(int(i) for i in closing_ids)
        eos = [eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids
        self.eos_token_ids: list[int] = list(dict.fromkeys(int(i) for i in eos))
        self.add_bos_token = bool(add_bos_token and bos_token_id is not None)
        added = tok.get_added_tokens_decoder()
        self._added: dict[int, str] = {i: t.content for i, t in added.items()}
        self.special_ids: set[int] = {i for i, t in added.items() if t.special}
        self.special_ids |= set(self.eos_token_ids) | (set() if bos_token_id is None
                                                       else {bos_token_id})
        self.vocab_size: int = max([tok.get_vocab_size(with_added_tokens=True),
                                    *(i + 1 for i in self._added)])
        self._bytes: dict[int, bytes] = {}
        self._byte_mode: str | None = None

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_ids={self.eos_token_ids})")

    @property
    def added_tokens(self) -> dict[int, str]:
        """Added (special) tokens: id -> their text, e.g. 2 -> "<|im_end|>"."""
        return self._added

    # -- construction

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, bos_token: str | None = None,
                  eos_token: str | Sequence[str] | None = None,
                  add_bos_token: bool | None = None,
                  add_eos_token: bool | None = None) -> Tokenizer:
        """Load a `tokenizer.json`. Special tokens are given as strings (as in tokenizer_config);
        `add_bos_token=None` means: add BOS when the file's post-processor does. The closing
        ids (`closing_ids`) are those the post-processor appends, else the EOS where
        `add_eos_token` says so."""
        tok = tokenizers.Tokenizer.from_file(str(path))
        bos_id = tok.token_to_id(bos_token) if bos_token else None
        eos_tokens = [eos_token] if isinstance(eos_token, str) else list(eos_token or [])
        eos_ids = [i for i in (tok.token_to_id(t) for t in eos_tokens) if i is not None]
        post_bos = _post_processor_bos(tok)
        if bos_id is None and bos_token is None:
            bos_id = post_bos
        if add_bos_token is None:
            add_bos_token = post_bos is not None and post_bos == bos_id
        closing = _post_processor_tail(tok) or (tuple(eos_ids[:1]) if add_eos_token else ())
        return cls(tok, bos_id, eos_ids, add_bos_token, closing)

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
                return load_tokenizer(path)[0]
            if path.is_file():
                return cls.from_file(path)
            raise ValueError(f"no tokenizer file or model directory at {path}")
        if isinstance(obj, _EncodesText):
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
        bos = self.bos_token_id  # add_bos_token implies a BOS id
        if add_special_tokens and self.add_bos_token and bos is not None and \
                (not ids or ids[0] != bos):
            ids.insert(0, bos)
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
            if isinstance(self._tok.obj, _SingleTokenBytes):
                return bytes(self._tok.obj.decode_single_token_bytes(i))
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


def _byte_mode(tok: tokenizers.Tokenizer | _DuckBackend) -> str:
    """How vocabulary pieces spell bytes: "byte_level" (GPT-2), "sentencepiece" (▁ and <0xAB>),
    or "text" (ask the decoder)."""
    decoder = tok.decoder if isinstance(tok, tokenizers.Tokenizer) else None
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


def _post_processor_tail(tok: tokenizers.Tokenizer) -> tuple[int, ...]:
    """The ids a tokenizer.json post-processor puts after a text (Qwen3-Embedding's
    <|endoftext|>), if any."""
    try:
        plain = tok.encode("a", add_special_tokens=False).ids
        full = tok.encode("a", add_special_tokens=True).ids
    except Exception:  # noqa: BLE001 - a post-processor that cannot run adds nothing
        return ()
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return tuple(full[start + len(plain):])
    return ()


def load_tokenizer(root: Path) -> tuple[Tokenizer, JSONObject]:
    """The directory's `Tokenizer` and its tokenizer_config.json (empty if absent).

    End-of-sequence ids are the union of generation_config.json, config.json and the tokenizer's
    eos_token, in that order: any of them ends a reply.
    """
    root = Path(root)
    tok_file = root / "tokenizer.json"
    if not tok_file.is_file():
        hint = (" It has tokenizer.model (sentencepiece): convert it once with transformers, "
                "AutoTokenizer.from_pretrained(dir).save_pretrained(dir), which writes "
                "tokenizer.json." if (root / "tokenizer.model").is_file() else "")
        raise MissingFileError(f"{root} has no tokenizer.json (the fast tokenizer file).{hint}")
    cfg = optional_json(root / "tokenizer_config.json")
    specials = {**optional_json(root / "special_tokens_map.json"), **cfg}
    add_bos = cfg.get("add_bos_token")
    tokenizer = Tokenizer.from_file(tok_file, bos_token=token_str(specials.get("bos_token")),
                                    eos_token=token_str(specials.get("eos_token")),
                                    add_bos_token=None if add_bos is None else bool(add_bos),
                                    add_eos_token=bool(cfg.get("add_eos_token")))
    stop = [*ids(optional_json(root / "generation_config.json").get("eos_token_id")),
            *ids(optional_json(root / "config.json").get("eos_token_id")),
            *tokenizer.eos_token_ids]
    tokenizer.eos_token_ids = list(dict.fromkeys(stop))
    tokenizer.special_ids.update(tokenizer.eos_token_ids)
    return tokenizer, {**specials, **cfg}
