"""SwappableBackend: a Backend that forwards to a current backend which can be replaced live,
and `build_backend`, which turns what `launch` is given into a backend.

The server and the UI hold a SwappableBackend; `swap(new)` sends new requests to `new` at once
while requests already running finish on the old backend, closed when its last one ends.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, TypeGuard

from ..types import (
    AdapterHost,
    Backend,
    BackendDefaults,
    EngineStoppedError,
    Event,
    JSONObject,
    Request,
    TokenCodec,
)


def free_memory() -> None:
    """Collect a closed backend (an engine sits in reference cycles), give the freed heap back
    to the system (glibc keeps freed pages in its arenas until trimmed: a GGUF model's blocks
    are many heap allocations), and return cached CUDA blocks."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is None:
        return  # nothing was ever loaded
    from ..cpu.memory import return_freed_memory

    return_freed_memory()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class AbsentBackend(BackendDefaults):
    """Stands in where no model is served under a name (stopped, not loaded), so that nothing
    keeps a closed backend's weights alive: every request fails with `message()`, and `/stats`
    and `/health` say `status`."""

    status = "absent"

    def __init__(self, model_name: str):
        self.model_name = model_name

    def message(self) -> str:
        return f"the model {self.model_name!r} is not served here"

    async def generate(self, request: Request) -> AsyncIterator[Event]:
        raise EngineStoppedError(self.message())
        yield  # an async generator, like an Engine's

    def stats(self) -> JSONObject:
        return {"running": 0, "waiting": 0}

    def health(self) -> JSONObject:
        return {"ready": False, "status": self.status, "model": self.model_name}

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_name!r})"


class StoppedBackend(AbsentBackend):
    """Stands in for a closed backend once its server is stopped."""

    status = "stopped"

    def message(self) -> str:
        return "this server is stopped: launch it again to serve requests"

    def stats(self) -> JSONObject:
        return {**super().stats(), "stopped": True}


class SwappableBackend:
    """Satisfies the `Backend` protocol; `swap()` replaces the backend without a restart."""

    def __init__(self, backend: Backend):
        self._current = backend
        self._lock = threading.Lock()
        self._active: dict[int, int] = {}  # id(backend) -> requests in flight on it
        self._retiring: dict[int, Backend] = {}  # swapped out, closed when idle
        self._closers: list[threading.Thread] = []
        self._closed = False

    @property
    def current(self) -> Backend:
        """The backend new requests go to."""
        return self._current

    @property
    def model_name(self) -> str:
        return self._current.model_name

    # What the current backend knows of its model and prompts (`Backend`): read per call, so a
    # swap is seen at once.

    @property
    def tokenizer(self) -> TokenCodec | None:
        return self._current.tokenizer

    @property
    def max_context(self) -> int | None:
        return self._current.max_context

    @property
    def vocab_size(self) -> int | None:
        return self._current.vocab_size

    def adapter_names(self) -> list[str]:
        current = self._current
        return current.adapter_names() if isinstance(current, AdapterHost) else []

    def add_adapter(self, name: str, path: str) -> None:
        current = self._current
        if not isinstance(current, AdapterHost):
            raise ValueError(f"{current.model_name} takes no LoRA adapters (an Engine over one "
                             "of nbserve's native families does)")
        current.add_adapter(name, path)

    def prompt_token_ids(self, request: Request) -> list[int] | None:
        return self._current.prompt_token_ids(request)

    def count_prompt_tokens(self, request: Request) -> int | None:
        return self._current.count_prompt_tokens(request)

    # ------------------------------------------------------------------ serving

    def generate(self, request: Request) -> AsyncIterator[Event]:
        """Stream `request` from the current backend; it stays there until it ends."""
        return self._generate(request)

    async def _generate(self, request: Request) -> AsyncIterator[Event]:
        backend = self._acquire()
        stream = None
        try:
            stream = backend.generate(request)
            async for ev in stream:
                yield ev
        finally:
            try:
                if isinstance(stream, AsyncGenerator):
                    await stream.aclose()  # closing the backend's iterator aborts the request
            finally:
                self._release(backend)

    def _acquire(self) -> Backend:
        with self._lock:
            backend = self._current
            self._active[id(backend)] = self._active.get(id(backend), 0) + 1
            return backend

    def _release(self, backend: Backend) -> None:
        key = id(backend)
        with self._lock:
            left = self._active.get(key, 1) - 1
            if left:
                self._active[key] = left
                return
            self._active.pop(key, None)
            retired = self._retiring.pop(key, None)
        if retired is not None:
            self._close_later(retired)

    def in_flight(self, backend: Backend | None = None) -> int:
        """Requests running on `backend` (default: all backends)."""
        with self._lock:
            if backend is None:
                return sum(self._active.values())
            return self._active.get(id(backend), 0)

    # ------------------------------------------------------------------ swapping

    def swap(self, new: Backend, *, close_old: bool = True) -> Backend:
        """Send new requests to `new`; close the old backend once its requests end. Returns it."""
        if self._closed:
            raise RuntimeError("this server is stopped: launch a new one instead of updating it")
        with self._lock:
            old, self._current = self._current, new
            self._retiring.pop(id(new), None)  # current again: it must not close when idle
            if old is new or not close_old:
                return old
            if self._active.get(id(old)):
                self._retiring[id(old)] = old
                return old
        old.close()
        return old

    def _close_later(self, backend: Backend) -> None:
        # Called from the serving loop: close (which joins the engine thread) off that loop.
        t = threading.Thread(target=backend.close, name="nbserve-retire", daemon=True)
        with self._lock:
            self._closers = [c for c in self._closers if c.is_alive()] + [t]
        t.start()

    def cancel_all(self) -> int:
        """Cancel the requests on every backend (current and retiring; see
        `Backend.cancel_all`). Returns how many were cancelled."""
        with self._lock:
            backends = [self._current, *self._retiring.values()]
        return sum(b.cancel_all() for b in backends)

    # ------------------------------------------------------------------ Backend protocol

    def stats(self) -> JSONObject:
        stats = dict(self._current.stats())
        if self._retiring:
            stats["retiring_backends"] = len(self._retiring)
        return stats

    def health(self) -> JSONObject:
        return self._current.health()

    def close(self, *, close_current: bool = True) -> None:
        """Close every old backend still draining and (unless told not to) the current one,
        then let go of them all (their memory is freed). Idempotent."""
        with self._lock:
            self._closed = True
            backends = [*self._retiring.values()] + ([self._current] if close_current else [])
            self._retiring.clear()
            closers, self._closers = self._closers, []
            self._current = StoppedBackend(self._current.model_name)
        for backend in backends:
            backend.close()
        for t in closers:
            t.join(timeout=30)

    def __repr__(self) -> str:
        return f"SwappableBackend({self._current!r})"


# ----------------------------------------------------------------------------- building


def is_backend(obj: object) -> TypeGuard[Backend]:
    """Whether `obj` already serves requests: an Engine, a Pool, or another `Backend` (an
    object with every member the protocol declares)."""
    return isinstance(obj, Backend)


# build_backend gives these to the loader
LOAD_OPTIONS = ("device", "dtype", "weights", "exact", "chat_template")


def _builds_pool(devices: object) -> bool:
    return devices is not None and not (isinstance(devices, str) and devices != "auto")


def backend_option_names(devices: object = None) -> set[str]:
    """The keywords `build_backend(model, devices=devices, ...)` accepts: the loader's and the
    Engine's (`EngineConfig`), and the Pool's when `devices` makes a Pool."""
    import inspect

    from ..engine.config import EngineConfig

    names = {"devices", "tokenizer", *LOAD_OPTIONS, *EngineConfig.options()}
    if _builds_pool(devices):
        from ..pool.pool import Pool

        names |= {name for name, p in inspect.signature(Pool.__init__).parameters.items()
                  if p.kind is p.KEYWORD_ONLY}
    return names


def build_backend(model: object, *, devices: object = None, tokenizer: object = None,
                  **engine_options: Any) -> tuple[Backend, bool]:
    """(backend, owned): an existing backend as is (not owned), else a new Engine, or a Pool
    when `devices` names several ("auto", a count, a list). `device`, `dtype`, `weights`,
    `exact` and `chat_template` go to the loader, the other options to each Engine."""
    if is_backend(model):
        if devices is not None or tokenizer is not None or engine_options:
            raise ValueError("launch() got an existing engine/backend together with devices, "
                             "tokenizer or engine options: those only apply when nbserve "
                             "builds the engine; pass the model or its source instead")
        return model, False
    import os

    from ..loading import LoadedModel, load

    load_opts = {k: engine_options.pop(k) for k in LOAD_OPTIONS if k in engine_options}
    if tokenizer is not None:
        load_opts["tokenizer"] = tokenizer
    if _builds_pool(devices):
        from ..pool.pool import Pool

        return Pool(model, devices=devices, **load_opts, **engine_options), True
    if isinstance(devices, str):
        load_opts["device"] = devices
    from ..engine.engine import Engine

    if isinstance(model, LoadedModel):
        return Engine(model, **engine_options), True
    if not isinstance(model, (str, os.PathLike)) and "max_context" in engine_options:
        load_opts["max_context"] = engine_options["max_context"]  # a module's own context
    return Engine(load(model, **load_opts), **engine_options), True
