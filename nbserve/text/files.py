"""The tokenizer and chat-template files of a Hugging Face model directory: tokenizer.json,
tokenizer_config.json, special_tokens_map.json, generation_config.json, chat_template.jinja.

The JSON reading and the special-token conventions shared by `Tokenizer.from_dir`
(tokenizer.py) and `load_chat_template` (chat_template.py); loaders and model adoption call
those, so that text/ depends on no loader.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..types import JSONObject


class MissingFileError(FileNotFoundError, ValueError):
    """A file the loader needs is not in the model directory (catchable as either base)."""


def read_json(path: Path) -> JSONObject:
    """Parse a JSON file, naming the directory and file when it is missing or broken."""
    if not path.is_file():
        raise MissingFileError(f"{path.parent} has no {path.name}: expected a Hugging Face model "
                               "directory (config.json, model.safetensors, tokenizer.json, ...)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-download or fix the file") from e
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ValueError(f"{path} should hold a JSON object, got {kind}")  # noqa: TRY004
    return data


def optional_json(path: Path) -> JSONObject:
    return read_json(path) if path.is_file() else {}


def token_str(value: object) -> str | None:
    """Special tokens appear as "<s>" or as {"content": "<s>", ...} in tokenizer configs."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def ids(value: object) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []
