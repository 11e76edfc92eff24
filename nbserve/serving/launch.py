"""launch() and serve(): a `Server` (`server.py`) built from a model and options, announced.

The server answers at once and the model loads in the background. In a Jupyter kernel
launch() returns at once; elsewhere it returns once the model is ready. One server per port per
process: launching again on a port that one of ours holds stops that one first; launching the
same model again without a port (a notebook cell run twice) stops the server already serving it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from ..types import Backend
from .access import Access, decide_access
from .backend_ref import SwappableBackend, backend_option_names, build_backend, is_backend
from .model_set import ModelSet, several_models
from .options import ServerOptions, option_names, suggest
from .server import SERVERS, Server, bind
from .share import open_share_link
from .startup import LoadingBackend, LoadState

# ----------------------------------------------------------------------------- launch / serve


_LAUNCH_OWN = ("port", "host", "share", "devices", "tokenizer", "startup_timeout",
               "stop_timeout", "wait", "options", "max_loaded", "max_memory", "keep_alive")


def split_launch_options(kwargs: dict[str, Any], options: ServerOptions | None = None,
                         devices: object = None) -> tuple[ServerOptions, dict[str, Any]]:
    """(the server options, the engine/loader options) of launch's other keywords; a keyword
    that is neither is a TypeError naming it (with the closest accepted name)."""
    if options is not None and not isinstance(options, ServerOptions):
        raise TypeError(f"options must be a nbserve.ServerOptions, got {type(options).__name__}")
    server_names = option_names()
    server = {k: v for k, v in kwargs.items() if k in server_names}
    engine = {k: v for k, v in kwargs.items() if k not in server_names}
    # (only when there are some: the engine's names import torch, seconds in a fresh kernel)
    engine_names = sorted(backend_option_names(devices) - set(_LAUNCH_OWN)) if engine else []
    unknown = [k for k in engine if k not in engine_names]
    if unknown:
        accepted = [*_LAUNCH_OWN, *server_names, *engine_names]
        named = ", ".join(f"{k!r}{suggest(k, accepted)}" for k in unknown)
        raise TypeError(f"launch() got unknown keyword argument{'s' * (len(unknown) > 1)} "
                        f"{named}. Launch options: {', '.join(_LAUNCH_OWN)}. Server options: "
                        f"{', '.join(server_names)}. Engine options: {', '.join(engine_names)}.")
    base = options or ServerOptions()
    return (dataclasses.replace(base, **server) if server else base), engine


def _stop_earlier(port: int | None, model: object) -> None:
    """Stop our server on `port`; with no port, the one serving `model` (a cell run again)."""
    earlier = SERVERS.on_port(port) if port else SERVERS.serving(model)
    for server in earlier:
        if port:
            print(f"nbserve: stopping the previous server on port {port}", flush=True)
        else:
            print(f"nbserve: stopping the previous server of {server._ref.model_name} on port "
                  f"{server.port} (pass port= to keep both)", flush=True)
        server.stop()


def launch(model: object = "smollm2", *, port: int | None = None, host: str = "127.0.0.1",
           share: bool = False, devices: object = None, tokenizer: object = None,
           startup_timeout: float = 120.0, stop_timeout: float = 5.0, wait: bool | None = None,
           options: ServerOptions | None = None, max_loaded: int | None = None,
           max_memory: int | None = None, keep_alive: float | None = None,
           adapters: Mapping[str, str | os.PathLike[str]] | None = None,
           **kwargs: Any) -> Server:
    """Serve `model` (a source like "smollm2", a HF dir or .gguf; a LoadedModel; or an
    Engine/Pool, served as is) on http://host:port (https:// with a certificate): OpenAI API
    under /v1, chat UI at /.

    The server answers at once; the model loads on a background thread (until it is ready,
    /health and the API answer 503 "loading" and the UI shows a loading page; the API serves
    once the model is loaded, the chat UI once it is built after it). `wait`: return only once
    the model is ready and the chat UI built (raising the load's error if it fails); the
    default is
    False in a Jupyter kernel (the cell returns at once: `srv.ready`, `srv.wait()`; `srv.engine`
    and `srv.openai_client()` wait for the model) and True elsewhere (a script, `serve`).
    `startup_timeout` bounds the server's start, not the load. `port=None` picks a free port,
    and stops the server
    of ours already serving the same model (the same source or object: a cell run again); a
    port held by one of our servers is taken over (that server is stopped first).
    `stop_timeout`: seconds running requests get to finish when the server stops (stop() or
    SIGTERM under `serve`).
    Other keywords are server options (`ServerOptions`: api_keys, ui, cors_origins, limits,
    rate_limit_per_minute, log_messages, accept_unknown_fields, ui_password, ssl_certfile,
    ssl_keyfile; or `options=` a record) or
    go to `Engine` and the loader (e.g. max_batch, max_context, dtype, weights, exact,
    queue_timeout,
    max_backlog, restart_on_failure). An unknown keyword is a TypeError naming it.
    Several models: `model` a dict of name -> source, a list of sources (each named after its
    file or folder, or "name=source"), or a folder of GGUF files and checkpoint folders; the
    first is the default (loaded now, the chat UI's), the others load on the first request that
    names them (`srv.add(name, source)` adds one later, `srv.remove(name)` unloads and forgets
    it). `max_loaded` (models, the default included), `max_memory` (bytes of weights and KV
    cache) and `keep_alive` (seconds idle) unload the least recently used of the others.
    `adapters`: PEFT LoRA adapter directories by name ("name": the default model's,
    "base:name": model base's), served as "base:name" (`srv.add_adapter` adds one later).
    `api_keys` protect /v1 and the UI; `share=True` without them generates one (printed once).
    `ui_password`: the UI (and its gradio API) also accepts this password at its login.
    """
    if not isinstance(stop_timeout, (int, float)) or stop_timeout < 0:
        raise ValueError(f"stop_timeout must be a number of seconds >= 0, got {stop_timeout!r}")
    opts, engine_options = split_launch_options(kwargs, options, devices)
    if share and opts.tls:
        raise ValueError("share=True cannot be used with TLS (ssl_certfile): the share tunnel "
                         "speaks plain HTTP to the local port; its public link is HTTPS already")
    access = decide_access(share=share, api_keys=list(opts.api_keys),
                           ui_password=opts.ui_password, ui=opts.ui)
    opts = dataclasses.replace(opts, api_keys=tuple(access.api_keys))
    if wait is None:
        wait = not in_jupyter_kernel()
    named = several_models(model)
    default_name: str | None = None
    others: dict[str, object] = {}
    if named is not None:
        if "name" in engine_options:
            raise ValueError("name= names the one model served; with several, name each one "
                             "(a dict of name -> source, or \"name=source\")")
        default_name, model = next(iter(named.items()))
        others = dict(list(named.items())[1:])
    _stop_earlier(port, model)
    sock = bind(host, port)
    build = dict(devices=devices, tokenizer=tokenizer, **engine_options)

    def build_named(name: str, source: object) -> tuple[Backend, bool]:
        return build_backend(source, **({**build, "name": name} if not is_backend(source)
                                        else build))

    load = LoadState(default_name or _source_name(model))
    ref = SwappableBackend(LoadingBackend(load))
    # a request may name the model as it was launched ("smollm2"), not only as it is served
    aliases = (os.fspath(model),) if isinstance(model, (str, os.PathLike)) else ()
    models = ModelSet(default_name, ref, build_named, others, max_loaded=max_loaded,
                      max_memory=max_memory, keep_alive=keep_alive, default_aliases=aliases)
    if default_name is not None and not is_backend(model):
        build["name"] = default_name
    try:
        share_url = None
        if share:
            share_url, why = open_share_link(sock.getsockname()[1])
            if share_url is None:
                print(f"nbserve: WARNING: could not create a share link ({why}); the server is "
                      "only reachable locally", flush=True)
        from .app import create_app

        app = create_app(models, options=dataclasses.replace(opts, ui=False))  # the UI: later
        server = Server(app, ref, sock, host, owned=False, options=opts,
                        share_url=share_url, model=model,
                        build_options={k: v for k, v in build.items() if v is not None},
                        drain_s=float(stop_timeout), load=load, ui_password=access.ui_password,
                        models=models)
    except BaseException:
        models.close()
        sock.close()
        raise
    try:
        server._start(startup_timeout)
        server._load_in_background(model, build)
        if wait:
            server.wait()
        for key, path in (adapters or {}).items():  # checked now where the base is loaded
            base, _, name = key.rpartition(":")
            models.add_adapter(base or None, name, str(path))
        _announce(server, share_url, access)
    except BaseException:  # Ctrl-C while starting, loading or announcing, a failed start or
        server.stop()      # load: leave nothing running
        raise
    return server


def in_jupyter_kernel() -> bool:
    """Whether this code runs in a Jupyter kernel (a notebook, JupyterLab, Colab, VS Code)."""
    ipython, zmqshell = sys.modules.get("IPython"), sys.modules.get("ipykernel.zmqshell")
    if ipython is None or zmqshell is None:
        return False
    return isinstance(ipython.get_ipython(), zmqshell.ZMQInteractiveShell)


def _source_name(model: object) -> str:
    """What to call a model before it has loaded: its source as given, or its type."""
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    # not imported here (it imports torch: seconds in a fresh kernel); a LoadedModel exists
    # only once its module has been imported
    models = sys.modules.get("nbserve.models.base")
    if models is not None and isinstance(model, models.LoadedModel):
        return str(model.name)
    if is_backend(model):
        return str(model.model_name)
    return type(model).__name__


def _announce(server: Server, share_url: str | None, access: Access) -> None:
    """Register a started server and print where it is (and its key, once); while its model
    loads, say so (the load prints a line when it ends)."""
    others = SERVERS.add(server)
    with server._stop_lock:  # the load's own line comes after this one
        loading = not server._load.done
        server._announce_load = loading
        what = server._ref.model_name if server._load.ready else \
            f"loading {server._ref.model_name}"
        line = f"nbserve: {what} at {server.url} · OpenAI API base {server.api_base}"
        line += " (UI at /)" if server.ui else ""
        if loading:
            line += "; the API answers 503 until it is ready (srv.wait() waits for it)"
        print(line, flush=True)
        if server._load.done and not server._load.ready:
            print(server._load_line(), flush=True)
    if share_url:
        print(f"nbserve: public link {share_url}", flush=True)
    if access.generated_key:
        where = "/v1 and the chat UI (login: any user name, the key as password)" \
            if server.ui else "/v1"
        print(f"nbserve: the key for {where}, shown once: {access.generated_key}", flush=True)
    if others:
        print(f"nbserve: note: other servers of this process still run on port(s) "
              f"{', '.join(map(str, others))}; stop() them to free their memory, or pass "
              "port= to replace one", flush=True)


def running_servers() -> list[Server]:
    """The servers launched in this process that are still running."""
    return SERVERS.all()


def stop_all() -> None:
    """Stop every server launched in this process."""
    for server in running_servers():
        server.stop()


def serve(model: object = "smollm2", **kwargs: Any) -> None:
    """`launch(...)` and block until Ctrl-C (or SIGTERM), then stop cleanly: new requests get
    503, running ones get `stop_timeout` s to finish, the rest are cancelled."""
    earlier = {id(s) for s in running_servers()}
    restore = _take_stop_signals()
    try:
        server = launch(model, **{"wait": True, **kwargs})
        print("nbserve: press Ctrl-C to stop", flush=True)
        while server.running:
            # Not server._thread.join(0.5): a KeyboardInterrupt inside join() makes CPython
            # mark the thread as stopped while it still runs, so stop() would not drain it.
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nnbserve: stopping", flush=True)
    finally:
        # every server this call started, wherever a Ctrl-C landed (even between launch()
        # returning and the name being bound): one left running keeps the process alive
        for started in running_servers():
            if id(started) not in earlier:
                started.stop()
        restore()


def _take_stop_signals() -> Callable[[], None]:
    """Make SIGINT and SIGTERM raise KeyboardInterrupt in the main thread while serve() runs,
    and return what puts the earlier handlers back. SIGINT is taken only where Python would
    not raise on it: a background job of a script inherits it ignored, and `kill -INT` must
    still stop the server (as it stops uvicorn's and llama.cpp's); a handler someone
    installed (a notebook kernel's) is left alone. A second SIGTERM must not break the drain;
    a second Ctrl-C can."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # signals reach only the main thread; the caller handles them
    terminating = False

    def on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal terminating
        if not terminating:
            terminating = True
            raise KeyboardInterrupt

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, on_term)}
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    return restore
