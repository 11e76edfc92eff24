"""Ollama's model routes: /api/tags, /api/show, /api/ps, /api/version and /api/pull, for the
one model this server serves; its name as Ollama writes names (`<name>:latest`); and the
family's error shape (`{"error": message}`), which every /api path answers in.

What nbserve knows of its model is what the Backend tells: its name, context, vocabulary and
tokenizer, and its `stats()` (the weights' bytes, format and dtype, the device). What Ollama
reads from a GGUF's header (family, parameter count, file format, the template) the Backend
does not expose: those fields are left out, never guessed."""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from importlib import metadata

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from ..types import Backend
from .errors import APIError
from .handler import RouteContext
from .ollama_schemas import FIM_TOKENS, _is_special
from .ollama_stream import one_record
from .openapi_schemas import body_ref
from .protocol import _Body, parse_body
from .streams import JSONBody

PREFIX = "/api/"
ROUTES = ("The Ollama routes are /api/chat, /api/generate, /api/embed, /api/tags, /api/show, "
          "/api/ps, /api/version and /api/pull.")


def tag_name(served: str) -> str:
    """The served model's name as Ollama lists it: with a tag (`:latest` unless it has one)."""
    return served if ":" in served else f"{served}:latest"


def check_model(backend: Backend, name: str | None) -> None:
    """Ollama's 404 unless `name` is the served model (with or without `:latest`); an empty
    or missing name means the served model, as on the OpenAI routes."""
    served = backend.model_name
    if name and name not in (served, tag_name(served)):
        raise APIError(404, f"model \"{name}\" not found, try pulling it first (this server "
                       f"serves {tag_name(served)!r} only)", param="model",
                       code="model_not_found")


class ShowRequest(_Body):
    """POST /api/show (`name` is its older spelling)."""

    name: str | None = None
    verbose: bool | None = None  # no-op: there are no tensors to list


class PullRequest(_Body):
    """POST /api/pull (`name` is its older spelling)."""

    name: str | None = None
    insecure: bool | None = None  # no-op: nothing is fetched
    stream: bool = True


def _int_stat(stats: JSONBody, key: str) -> int | None:
    value = stats.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str_stat(stats: JSONBody, key: str) -> str | None:
    value = stats.get(key)
    return value if isinstance(value, str) and value else None


class ModelCard:
    """The served model as Ollama's listings describe it, from what the Backend tells."""

    def __init__(self, backend: Backend, loaded_at: datetime):
        self.backend, self.loaded_at = backend, loaded_at
        self.stats: JSONBody = dict(backend.stats())
        self.name = tag_name(backend.model_name)

    @property
    def size(self) -> int:
        return _int_stat(self.stats, "weight_bytes") or 0

    @property
    def digest(self) -> str:
        """An identifier of what is served (name, weights' format and size): not a file's
        hash, which the Backend does not know; it changes when another model is served."""
        key = f"{self.backend.model_name}|{_str_stat(self.stats, 'weight_format')}|{self.size}"
        return hashlib.sha256(key.encode()).hexdigest()

    def details(self) -> JSONBody:
        """Ollama's `details`, with only what is known: the weights' format as the
        quantization level ("quantized", "mixed16", or a dtype such as "bfloat16")."""
        out: JSONBody = {"parent_model": ""}
        level = _str_stat(self.stats, "weight_format")
        if level:
            out["quantization_level"] = level
        return out

    def infill(self) -> bool:
        tokenizer = self.backend.tokenizer
        return tokenizer is not None and any(
            all(_is_special(tokenizer, t) for t in tokens) for tokens in FIM_TOKENS)

    def listed(self) -> JSONBody:
        """The model's entry in /api/tags."""
        return {"name": self.name, "model": self.name,
                "modified_at": self.loaded_at.isoformat(), "size": self.size,
                "digest": self.digest, "details": self.details()}

    def running(self) -> JSONBody:
        """The model's entry in /api/ps: loaded until the server stops (no expiry)."""
        on_gpu = (_str_stat(self.stats, "device") or "cpu").startswith("cuda")
        entry = {**self.listed(), "size_vram": self.size if on_gpu else 0, "expires_at": None}
        del entry["modified_at"]
        if self.backend.max_context:
            entry["context_length"] = self.backend.max_context
        return entry

    def shown(self) -> JSONBody:
        """/api/show's answer: details, what is known of the model, and its capabilities
        (completion and tools always: a template that ignores tools gets them listed in the
        system prompt; insert where the tokenizer has infill tokens)."""
        info: JSONBody = {"general.name": self.backend.model_name}
        if self.backend.max_context:
            info["nbserve.context_length"] = self.backend.max_context
        if self.backend.vocab_size:
            info["nbserve.vocab_size"] = self.backend.vocab_size
        caps = ["completion", "tools"] + (["insert"] if self.infill() else [])
        return {"modelfile": "", "parameters": "", "template": "", "details": self.details(),
                "model_info": info, "capabilities": caps,
                "modified_at": self.loaded_at.isoformat()}


def router(ctx: RouteContext) -> APIRouter:
    """The model routes of Ollama's API."""
    r = APIRouter(prefix=PREFIX.rstrip("/"))
    loaded_at = datetime.now(timezone.utc)

    def card() -> ModelCard:
        return ModelCard(ctx.backend, loaded_at)  # per call: the backend may be swapped

    @r.get("/version")
    async def version() -> JSONBody:
        return {"version": metadata.version("nbserve")}  # nbserve's own, installed

    @r.get("/tags")
    async def tags() -> JSONBody:
        return {"models": [card().listed()]}

    @r.get("/ps")
    async def ps() -> JSONBody:
        return {"models": [card().running()]}

    @r.post("/show", openapi_extra=body_ref(ShowRequest))
    async def show(request: HTTPRequest) -> JSONBody:
        body = parse_body(ShowRequest, await request.body(), ctx.fields)
        check_model(ctx.backend, body.model or body.name)
        return card().shown()

    @r.post("/pull", openapi_extra=body_ref(PullRequest))
    async def pull(request: HTTPRequest) -> Response:
        """The served model is there already: success. Any other is an error: nothing is
        fetched at run time."""
        body = parse_body(PullRequest, await request.body(), ctx.fields)
        name = body.model or body.name
        served = ctx.backend.model_name
        if name and name not in (served, tag_name(served)):
            raise APIError(400, f"nbserve fetches nothing at run time: it serves "
                           f"{tag_name(served)!r} only, which it loaded when it started. "
                           f"Start nbserve with {name!r} to serve that model.", param="model")
        rid = str(request.scope.get("state", {}).get("request_id", ""))
        return one_record({"status": "success"}, body.stream, rid)

    return r
