"""ModelSet: several named models behind one server (`ModelDirectory`).

The default model is the server's own (loaded at launch, never unloaded by the set: the chat UI
opens with it). Every other model is loaded on the first request that names it (that request
waits; the load runs on a thread, with its progress in the log) and unloaded again when it has
been idle longer than its keep-alive, or when the set holds more models than `max_loaded` or
more bytes than `max_memory` (the least recently used first, never one with requests running).
Each name keeps one `SwappableBackend` for its whole life, so a request that started on a model
finishes on it even if the model is unloaded meanwhile; its memory is given back once the last
such request ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..api.adapter_backend import adapter_names, split_adapter, with_adapter
from ..types import (
    AdapterHost,
    Backend,
    EngineStoppedError,
    InvalidRequestError,
    JSONObject,
    ModelEntry,
    ModelNotFoundError,
    ModelState,
)
from .backend_ref import AbsentBackend, SwappableBackend, free_memory

log = logging.getLogger("nbserve.models")
BuildBackend = Callable[[str, object], tuple[Backend, bool]]  # (name, source) -> backend, owned
SWEEP_S = 1.0  # how often idle models are looked for


class UnloadedBackend(AbsentBackend):
    """Stands in for a model of the set while it is not loaded."""

    status = "unloaded"

    def __init__(self, name: str, why: str = "is not loaded"):
        super().__init__(name)
        self.why = why

    def message(self) -> str:
        return f"the model {self.model_name!r} {self.why}; retry to load it"

    def stats(self) -> JSONObject:
        return {**super().stats(), "loaded": False}


@dataclass(slots=True)
class _Model:
    """One named model of the set: its source, its reference, and where its load stands."""

    name: str
    source: object
    ref: SwappableBackend
    state: ModelState = "unloaded"
    owned: bool = True
    keep_alive: float | None = None  # seconds idle before unloading; None: the set's
    last_used: float = field(default_factory=time.monotonic)
    error: str | None = None
    loading: concurrent.futures.Future[Backend] | None = None
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters: name -> path


def model_names(models: Mapping[str, object] | list[object] | tuple[object, ...]
                ) -> dict[str, object]:
    """Named sources from what `launch` takes for several models: a dict (its keys), a list
    (each named after its file or folder, or `name=source`), or a folder of models (each GGUF
    file and each checkpoint folder in it). Raises ValueError for a repeated or empty name."""
    named: dict[str, object] = {}
    items = list(models.items()) if isinstance(models, Mapping) else \
        [_split_named(m) for m in models]
    for name, source in items:
        if not name:
            raise ValueError(f"a model needs a name: got {source!r}; write name=source")
        if name in named:
            raise ValueError(f"two models are named {name!r}: name one of them (name=source)")
        named[name] = source
    if not named:
        raise ValueError("no models given")
    return named


def several_models(model: object) -> dict[str, object] | None:
    """The named sources when `launch` is given several models (a dict, a list or tuple, a
    folder of models), else None (one model)."""
    if isinstance(model, Mapping) or isinstance(model, (list, tuple)):
        return model_names(model)
    if isinstance(model, (str, os.PathLike)):
        return folder_of_models(model)
    return None


def _split_named(item: object) -> tuple[str, object]:
    if isinstance(item, str) and "=" in item and not os.path.exists(item):
        name, _, source = item.partition("=")
        return name.strip(), source.strip()
    if isinstance(item, (str, os.PathLike)):
        return Path(item).stem if str(item).endswith(".gguf") else Path(item).name, item
    name = type(item).__name__
    return name, item


def folder_of_models(path: str | os.PathLike[str]) -> dict[str, object] | None:
    """The models of a folder that is not itself a checkpoint (no config.json): its GGUF files
    and its checkpoint folders, by name (sorted); None when `path` is no such folder."""
    p = Path(path)
    if not p.is_dir() or (p / "config.json").exists():
        return None
    found: dict[str, object] = {}
    for child in sorted(p.iterdir()):
        if child.suffix == ".gguf" and child.is_file():
            found[child.stem] = str(child)
        elif child.is_dir() and (child / "config.json").exists():
            found[child.name] = str(child)
    return found or None


class ModelSet:
    """The models of one server, by name; satisfies `ModelDirectory` (see the module doc).

    `default_name`: the name given to the default model, if any (it also answers to its own,
    and to `default_aliases`: the source it was launched with, "smollm2");
    `default`: the server's own reference (loaded by the server); `build`: makes a backend of
    a named source (with the server's load and engine options); `others`: the other models by name.
    `max_loaded` counts the default too; `max_memory` is in bytes (weights and KV cache as the
    backends' stats give them); `keep_alive` in seconds (None: kept until evicted)."""

    def __init__(self, default_name: str | None, default: SwappableBackend, build: BuildBackend,
                 others: Mapping[str, object] | None = None, *, max_loaded: int | None = None,
                 max_memory: int | None = None, keep_alive: float | None = None,
                 default_aliases: Iterable[str] = ()):
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be at least 1, got {max_loaded}")
        if keep_alive is not None and keep_alive < 0:
            raise ValueError(f"keep_alive must be seconds >= 0, got {keep_alive}")
        self._build = build
        self.max_loaded, self.max_memory, self.keep_alive = max_loaded, max_memory, keep_alive
        self._lock = threading.Lock()
        self._default = _Model(default_name or "", None, default, state="loaded", owned=False)
        self._aliases = frozenset(a for a in default_aliases if a)
        self._models: dict[str, _Model] = {}
        self._closed = False
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        for name, source in (others or {}).items():
            self.add(name, source)

    # ------------------------------------------------------------------ ModelDirectory

    @property
    def default(self) -> Backend:
        return self._default.ref

    @property
    def default_name(self) -> str:
        """The default model's name (the served model's own name once it has loaded)."""
        return self._default.ref.model_name

    def _find(self, name: str | None) -> _Model:
        if not name or name in (self.default_name, self._default.name):
            return self._default
        with self._lock:
            model = self._models.get(name)
        if model is None and name in self._aliases:  # a model of that name comes first
            return self._default
        if model is None:
            raise ModelNotFoundError(name, [e.name for e in self.entries()])
        return model

    async def backend(self, name: str | None, keep_alive: float | None = None) -> Backend:
        """The backend of `name`; "base:adapter" names base's backend with that LoRA adapter
        (installed in base's engine on its first request after each load)."""
        try:
            model = self._find(name)
        except ModelNotFoundError as missing:
            parts = split_adapter(name or "")
            if parts is None:
                raise
            try:
                model = self._find(parts[0])
            except ModelNotFoundError:
                raise missing from None
            if parts[1] not in model.adapters:
                raise
            base = await self._backend_of(model, keep_alive)
            await asyncio.to_thread(self._install, model, parts[1])
            return with_adapter(base, parts[1], [e.name for e in self.entries()])
        return await self._backend_of(model, keep_alive)

    async def _backend_of(self, model: _Model, keep_alive: float | None) -> Backend:
        model.last_used = time.monotonic()
        if keep_alive is not None:
            model.keep_alive = keep_alive
        if model is self._default:
            return model.ref
        future = self._start_load(model)
        if future is not None:
            try:
                await asyncio.wrap_future(future)
            except Exception as exc:  # noqa: BLE001 -- the load's own error, for the client
                raise EngineStoppedError(f"the model {model.name!r} failed to load "
                                         f"({type(exc).__name__}: {exc})") from exc
        model.last_used = time.monotonic()
        return model.ref

    def loaded(self, name: str) -> Backend | None:
        try:
            model = self._find(name)
        except ModelNotFoundError:
            return None
        return model.ref if model is self._default or model.state == "loaded" else None

    def entries(self) -> list[ModelEntry]:
        default = self._default.ref
        status = str(default.health().get("status", ""))
        state: ModelState = "loaded" if status in ("ready", "restarting", "stalled") else \
            "failed" if status == "error" else "loading"
        out = [ModelEntry(self.default_name, state, _source_text(self._default.source),
                          default.max_context, default=True)]
        with self._lock:
            models = list(self._models.values())
        out += [ModelEntry(m.name, m.state, _source_text(m.source),
                           m.ref.max_context if m.state == "loaded" else None, error=m.error)
                for m in models]
        return out + [ModelEntry(f"{e.name}:{a}", e.state, path, e.max_context)
                      for e, m in zip(out, [self._default, *models])
                      for a, path in list(m.adapters.items())]

    # ------------------------------------------------------------------ LoRA adapters

    def add_adapter(self, base: str | None, name: str, path: str) -> None:
        """Serve the LoRA adapter at `path` on model `base` (None: the default) as
        "base:name". Installed now where `base` is loaded (ValueError naming what does not
        fit), else on the first request that names it."""
        model = self._find(base)
        if not name or ":" in name:
            raise ValueError(f"an adapter needs a name without ':', got {name!r}")
        with self._lock:
            if name in model.adapters:
                raise ValueError(f"{self._name_of(model)} already has an adapter named {name!r}")
            model.adapters[name] = str(path)
        if isinstance(model.ref.current, AdapterHost):  # loaded: refuse a misfit now
            try:
                self._install(model, name)
            except BaseException:
                with self._lock:
                    model.adapters.pop(name, None)
                raise
        log.info("LoRA adapter %r added to %r (%s)", name, self._name_of(model), path)

    def _install(self, model: _Model, name: str) -> None:
        """Install adapter `name` in the model's current backend unless it has it."""
        with self._lock:
            path = model.adapters[name]
            if name in adapter_names(model.ref):
                return
            try:
                model.ref.add_adapter(name, path)
            except ValueError as exc:
                raise InvalidRequestError(f"the LoRA adapter {name!r} of "
                                          f"{self._name_of(model)} cannot be served: {exc}",
                                          param="model") from exc

    def _name_of(self, model: _Model) -> str:
        return self.default_name if model is self._default else model.name

    # ------------------------------------------------------------------ adding and removing

    def add(self, name: str, source: object, *, load: bool = False) -> None:
        """Add a model named `name` (loaded on its first request, or now with `load`)."""
        if not name or name in (self.default_name, self._default.name):
            raise ValueError(f"a model named {name!r} is already served")
        with self._lock:
            if self._closed:
                raise RuntimeError("this server is stopped")
            if name in self._models:
                raise ValueError(f"a model named {name!r} is already served")
            self._models[name] = _Model(name, source, SwappableBackend(UnloadedBackend(name)))
        log.info("model %r added (%s); it loads on its first request", name,
                 _source_text(source))
        self._ensure_sweeper()
        if load:
            self.load(name)

    def load(self, name: str, timeout: float | None = None) -> Backend:
        """Load `name` now (from any thread but the server's loop); returns its backend."""
        model = self._find(name)
        future = self._start_load(model)
        if future is not None:
            future.result(timeout)
        return model.ref

    def update(self, name: str, source: object = None) -> Backend:
        """Serve `source` (default: the model's own source again, re-read) as `name` from now
        on: requests already running finish on the old weights, which are then freed. The
        default model is the server's to update (`Server.update`)."""
        model = self._find(name)
        if model is self._default:
            raise ValueError(f"{self.default_name!r} is the default model: update it with "
                             "srv.update(model), without a name")
        if model.loading is not None:
            with contextlib.suppress(Exception):  # (a failed load is replaced here)
                model.loading.result()
        src = model.source if source is None else source
        backend, owned = self._build(model.name, src)
        with self._lock:
            old_owned = model.owned
            model.source, model.owned, model.error = src, owned, None
            model.state, model.last_used = "loaded", time.monotonic()
        model.ref.swap(backend, close_old=old_owned)
        log.info("model %r now serves %s", model.name, _source_text(src))
        self._evict(keep=model)
        return model.ref

    def unload(self, name: str) -> bool:
        """Unload `name` (its running requests finish first, then its memory is given back).
        Returns whether it was loaded. The default model is not unloaded."""
        model = self._find(name)
        if model is self._default:
            raise ValueError(f"{self.default_name!r} is the default model: it stays loaded "
                             "(remove the others, or stop the server)")
        return self._unload(model, "was unloaded")

    def remove(self, name: str) -> None:
        """Unload `name` and forget it."""
        self.unload(name)
        with self._lock:
            self._models.pop(name, None)
        log.info("model %r removed", name)

    def close(self) -> None:
        """Unload every model but the default (which its server closes); stop the sweeper."""
        self._stop.set()
        with self._lock:
            self._closed = True
            models = list(self._models.values())
        for model in models:
            self._unload(model, "was unloaded: the server stopped")
            model.ref.close()

    # ------------------------------------------------------------------ loading

    def _start_load(self, model: _Model) -> concurrent.futures.Future[Backend] | None:
        """The load of `model` in progress (started now if it is not loaded); None if loaded."""
        with self._lock:
            if model.state == "loaded":
                return None
            if model.loading is None:
                model.state, model.error = "loading", None
                model.loading = concurrent.futures.Future()
                threading.Thread(target=self._load, args=(model, model.loading),
                                 name=f"nbserve-load-{model.name}", daemon=True).start()
            return model.loading

    def _load(self, model: _Model, future: concurrent.futures.Future[Backend]) -> None:
        log.info("loading model %r (%s) for its first request", model.name,
                 _source_text(model.source))
        started = time.perf_counter()
        try:
            backend, owned = self._build(model.name, model.source)
        except BaseException as exc:  # noqa: BLE001 -- the waiting requests get it
            log.warning("model %r failed to load: %s: %s", model.name, type(exc).__name__, exc)
            with self._lock:
                model.state, model.error, model.loading = "failed", f"{type(exc).__name__}: " \
                    f"{exc}", None
            future.set_exception(exc)
            return
        with self._lock:
            closed = self._closed
            if not closed:
                model.ref.swap(backend, close_old=True)
                model.state, model.owned, model.loading = "loaded", owned, None
                model.last_used = time.monotonic()
        if closed:
            if owned:
                backend.close()
            future.set_exception(EngineStoppedError("the server stopped"))
            return
        log.info("model %r loaded in %.1f s", model.name, time.perf_counter() - started)
        future.set_result(model.ref)
        self._evict(keep=model)

    # ------------------------------------------------------------------ unloading

    def _unload(self, model: _Model, why: str) -> bool:
        with self._lock:
            if model.state != "loaded":
                return False
            model.state = "unloaded"
        old = model.ref.swap(UnloadedBackend(model.name, why), close_old=model.owned)
        del old
        if not model.ref.in_flight():
            free_memory()  # (otherwise: once its last request ends, as SwappableBackend does)
        log.info("model %r unloaded (%s)", model.name, why)
        return True

    def _evict(self, keep: _Model | None = None) -> None:
        """Unload the least recently used idle models while the set is over its count or its
        memory; a model with requests running is never unloaded."""
        while True:
            with self._lock:
                loaded = [m for m in self._models.values() if m.state == "loaded"]
            over_count = self.max_loaded is not None and len(loaded) + 1 > self.max_loaded
            over_memory = self.max_memory is not None and self._bytes(loaded) > self.max_memory
            if not (over_count or over_memory):
                return
            idle = sorted((m for m in loaded if m is not keep and not m.ref.in_flight()),
                          key=lambda m: m.last_used)
            if not idle:
                log.warning("%d models are loaded, over the set's limit, and every one is busy",
                            len(loaded) + 1)
                return
            self._unload(idle[0], "was unloaded: least recently used past the "
                         + ("max_loaded" if over_count else "max_memory") + " limit")

    def _bytes(self, loaded: list[_Model]) -> int:
        total = 0
        for backend in [self._default.ref, *(m.ref for m in loaded)]:
            stats = backend.stats()
            for key in ("weight_bytes", "kv_cache_bytes"):
                value = stats.get(key)
                total += value if isinstance(value, int) else 0
        return total

    def sweep(self, now: float | None = None) -> list[str]:
        """Unload the models idle past their keep-alive; returns their names."""
        now = time.monotonic() if now is None else now
        with self._lock:
            models = [m for m in self._models.values() if m.state == "loaded"]
        gone = []
        for m in models:
            keep = m.keep_alive if m.keep_alive is not None else self.keep_alive
            if keep is not None and not m.ref.in_flight() and now - m.last_used >= keep:
                if self._unload(m, f"was unloaded: idle for {keep:g} s"):
                    gone.append(m.name)
        return gone

    def _ensure_sweeper(self) -> None:
        with self._lock:
            if self._sweeper is not None:
                return
            self._sweeper = threading.Thread(target=self._sweep_loop, name="nbserve-models",
                                             daemon=True)
        self._sweeper.start()

    def _sweep_loop(self) -> None:
        while not self._stop.wait(SWEEP_S):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 -- a failing backend must not stop the sweeper
                log.exception("the idle-model sweep failed")


def _source_text(source: object) -> str:
    if source is None or isinstance(source, (str, os.PathLike)):
        return str(source or "")
    return type(source).__name__

