"""`model="base:adapter"`: the base model's backend with one of its LoRA adapters applied to
every request (the engine applies it per row: requests of other adapters, and of none, decode
in the same batches). The server routes such a name here; it knows adapters only by name."""

from __future__ import annotations

from collections.abc import AsyncIterator

from ..types import AdapterHost, Backend, Event, JSONObject, ModelNotFoundError, Request, TokenCodec

SEPARATOR = ":"


def split_adapter(name: str) -> tuple[str, str] | None:
    """("base", "adapter") of "base:adapter", else None."""
    base, sep, adapter = name.rpartition(SEPARATOR)
    return (base, adapter) if sep and base and adapter else None


def adapter_names(backend: Backend) -> list[str]:
    """The adapters `backend` serves ([] for one that serves none)."""
    return backend.adapter_names() if isinstance(backend, AdapterHost) else []


def add_adapter(backend: Backend, name: str, path: str) -> None:
    """Serve the adapter at `path` as `name` on `backend`; ValueError where it cannot."""
    if not isinstance(backend, AdapterHost):
        raise ValueError(f"{backend.model_name} is served by a backend that takes no LoRA "
                         "adapters (an Engine over one of nbserve's native families does)")
    backend.add_adapter(name, path)


def with_adapter(backend: Backend, adapter: str, served: list[str]) -> AdapterBackend:
    """`backend` with `adapter` applied; a 404 naming `served` where it has no such adapter."""
    if adapter not in adapter_names(backend):
        raise ModelNotFoundError(f"{backend.model_name}{SEPARATOR}{adapter}", served)
    return AdapterBackend(backend, adapter)


class AdapterBackend:
    """A `Backend` whose requests apply `adapter` on `base`; everything else is the base's
    (closing it closes nothing: the base is served on its own too)."""

    def __init__(self, base: Backend, adapter: str):
        self.base, self.adapter = base, adapter

    @property
    def model_name(self) -> str:
        return f"{self.base.model_name}{SEPARATOR}{self.adapter}"

    def generate(self, request: Request) -> AsyncIterator[Event]:
        request.adapter = self.adapter
        return self.base.generate(request)

    def stats(self) -> JSONObject:
        return self.base.stats()

    def health(self) -> JSONObject:
        return self.base.health()

    def close(self) -> None:
        pass

    @property
    def tokenizer(self) -> TokenCodec | None:
        return self.base.tokenizer

    @property
    def max_context(self) -> int | None:
        return self.base.max_context

    @property
    def vocab_size(self) -> int | None:
        return self.base.vocab_size

    def prompt_token_ids(self, request: Request) -> list[int] | None:
        return self.base.prompt_token_ids(request)

    def count_prompt_tokens(self, request: Request) -> int | None:
        return self.base.count_prompt_tokens(request)

    def cancel_all(self) -> int:
        return 0  # the base's own cancel_all cancels every request, these too
