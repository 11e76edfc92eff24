"""Fields a request body holds that its schema does not define: refused by name, or accepted
and logged once.

The schemas keep what they do not define (`extra="allow"`) so that this module can find it
after validation, wherever it sits (`messages[0].nmae`, `stream_options.include_usgae`).
A vendor extension that would change the output and that nbserve does not read (vLLM's
older guided_* fields) is refused even when unknown fields are accepted. See docs/api.md for
the fate of every field.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Iterator

from pydantic import BaseModel

from ..types import InvalidRequestError

log = logging.getLogger("nbserve.server")

_GUIDED = ("vLLM's older guided_* fields are not read; send structured_outputs with one of json, "
           "regex, choice, grammar or json_object (docs/api.md)")
# Top-level vendor extensions that nbserve knows of and does not read: field -> why.
UNSERVED_EXTENSIONS: dict[str, str] = {
    name: _GUIDED for name in (
        "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "guided_decoding_backend", "guided_whitespace_pattern")}


def unsupported(param: str, why: str) -> InvalidRequestError:
    """The 400 for a field nbserve knows and cannot serve."""
    return InvalidRequestError(f"{param} is not supported by nbserve: {why}", param=param,
                               code="unsupported_parameter")


def _extras(model: BaseModel, path: str) -> Iterator[tuple[str, BaseModel, str]]:
    """(path of the field, the model holding it, its name) for every undefined field, depth
    first in field order."""
    for name in model.__pydantic_extra__ or {}:
        yield f"{path}.{name}" if path else name, model, name
    for name in type(model).model_fields:
        yield from _walk(getattr(model, name), f"{path}.{name}" if path else name)


def _walk(value: object, path: str) -> Iterator[tuple[str, BaseModel, str]]:
    if isinstance(value, BaseModel):
        yield from _extras(value, path)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _walk(item, f"{path}[{i}]")


def _suggestion(name: str, model: BaseModel) -> str:
    known = list(type(model).model_fields)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""


class UnknownFields:
    """What one app does with undefined fields: refuse them (a 400 naming the first, with the
    closest known name), or, with `accept=True`, drop them and log each name once."""

    def __init__(self, accept: bool = False):
        self.accept = accept
        self._logged: set[str] = set()

    def check(self, body: BaseModel) -> None:
        """Raise for a refused field; otherwise drop every undefined field from `body`."""
        found = list(_extras(body, ""))
        for _path, model, name in found:
            if model is body and name in UNSERVED_EXTENSIONS:
                raise unsupported(name, UNSERVED_EXTENSIONS[name])
        for path, model, name in found:
            if not self.accept:
                raise InvalidRequestError(
                    f"Unrecognized request argument supplied: {path}{_suggestion(name, model)}. "
                    "nbserve refuses fields it does not know rather than ignore them; "
                    "docs/api.md lists the fields it serves (or start the server with "
                    "accept_unknown_fields=True to drop unknown ones).",
                    param=path, code="unknown_parameter")
            key = re.sub(r"\[\d+\]", "[]", path)
            if key not in self._logged:
                self._logged.add(key)
                log.warning("ignoring the unknown request field %r (accept_unknown_fields=True; "
                            "each name is logged once)", key)
            model.__pydantic_extra__.pop(name, None)  # type: ignore[union-attr]
