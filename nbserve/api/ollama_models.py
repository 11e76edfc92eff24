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

from ..types import Backend, ModelNotFoundError
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


def untagged(name: str) -> str:
    """A model name as the server serves it: Ollama's default tag `:latest` dropped."""
    return name.removesuffix(":latest")


def not_found(name: str, why: object = "") -> APIError:
    """Ollama's 404 for a model the server does not have (nothing is pulled at run time)."""
    return APIError(404, f"model \"{name}\" not found, try pulling it first ({why})",
                    param="model", code="model_not_found")


def unloaded_entry(name: str) -> JSONBody:
    """/api/tags' entry of a model that has not loaded yet: its name (nothing else is known
    before its file is read)."""
    tag = tag_name(name)
    return {"name": tag, "model": tag, "modified_at": None, "size": 0,
            "digest": hashlib.sha256(tag.encode()).hexdigest(),
            "details": {"parent_model": ""}}


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

    def cards() -> tuple[list[ModelCard], list[str]]:
        """(the loaded models' cards, the names of the others), the default first."""
        if ctx.models is None:
            return [card()], []
        loaded, others = [], []
        for entry in ctx.models.entries():
            backend = ctx.models.loaded(entry.name)
            if backend is None:
                others.append(entry.name)
            else:
                loaded.append(ModelCard(backend, loaded_at))
        return loaded, others

    @r.get("/version")
    async def version() -> JSONBody:
        return {"version": metadata.version("nbserve")}  # nbserve's own, installed

    @r.get("/tags")
    async def tags() -> JSONBody:
        """Every model; one not loaded yet is listed with what its name tells (its size is
        known once it has loaded)."""
        loaded, others = cards()
        return {"models": [c.listed() for c in loaded] + [unloaded_entry(n) for n in others]}

    @r.get("/ps")
    async def ps() -> JSONBody:
        return {"models": [c.running() for c in cards()[0]]}

    @r.post("/show", openapi_extra=body_ref(ShowRequest))
    async def show(request: HTTPRequest) -> JSONBody:
        body = parse_body(ShowRequest, await request.body(), ctx.fields)
        name = body.model or body.name
        try:
            served = await ctx.for_model(untagged(name) if name else name)
        except ModelNotFoundError as exc:
            raise not_found(exc.name, exc) from None
        return ModelCard(served.backend, loaded_at).shown()

    @r.post("/pull", openapi_extra=body_ref(PullRequest))
    async def pull(request: HTTPRequest) -> Response:
        """The served model is there already: success. Any other is an error: nothing is
        fetched at run time."""
        body = parse_body(PullRequest, await request.body(), ctx.fields)
        name = body.model or body.name
        names = [e.name for e in ctx.models.entries()] if ctx.models is not None else \
            [ctx.backend.model_name]
        if name and untagged(name) not in names:
            raise APIError(400, f"nbserve fetches nothing at run time: it serves "
                           f"{', '.join(repr(tag_name(n)) for n in names)}. Start nbserve "
                           f"with {name!r} (or add it: srv.add(name, source)) to serve that "
                           "model.", param="model")
        rid = str(request.scope.get("state", {}).get("request_id", ""))
        return one_record({"status": "success"}, body.stream, rid)

    return r
