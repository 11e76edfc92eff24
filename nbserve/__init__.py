"""nbserve: serve a language model from a Jupyter cell or a script.

    srv = nbserve.launch("smollm2")   # chat UI at srv.url, OpenAI API at srv.api_base

Attributes are imported lazily so that `import nbserve` stays fast (gradio alone takes seconds).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Imported eagerly: a lazy import of the submodule nbserve.launch would replace the function
# `nbserve.launch` with the module on first use (launch.py imports no heavy dependency at the top).
from .serving.launch import Server, launch, serve  # noqa: E402

_EXPORTS = {
    "load": "nbserve.loading",
    "LoadedModel": "nbserve.models.base",
    "Engine": "nbserve.engine.engine",
    "Pool": "nbserve.pool.pool",
    "create_app": "nbserve.serving.app",
    "StepModel": "nbserve.models.base",
    "adopt": "nbserve.models.adopt",
    "snapshot": "nbserve.models.adopt",
    "Limits": "nbserve.api.limits",
    "ServerOptions": "nbserve.serving.options",
    "Request": "nbserve.types",
    "SamplingParams": "nbserve.types",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nbserve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = ["launch", "serve", "Server", *_EXPORTS]
