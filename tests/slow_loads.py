"""Models whose load waits for the test: a load that is slow on purpose, without timing.

`gated(model_dir, gate)` is the tiny model of `model_dir` whose engine cannot be built until
`gate` is set: the StepModel's first attribute read (the engine reads its layout as it builds)
waits on the event, as a slow download or weight read would.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

from nbserve.models.base import LoadedModel


class GatedModel:
    """Wraps a StepModel: every attribute read waits until `gate` is set, then forwards."""

    def __init__(self, inner: Any, gate: threading.Event):
        self._inner, self._gate = inner, gate

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        self._gate.wait()
        return getattr(self._inner, name)


def gated(model_dir: Path, gate: threading.Event, name: str | None = None) -> LoadedModel:
    """A LoadedModel of `model_dir` whose engine's build waits for `gate`."""
    from nbserve.loading.hf_dir import load_hf_dir

    loaded = load_hf_dir(model_dir)
    return dataclasses.replace(loaded, model=GatedModel(loaded.model, gate),
                               name=name or loaded.name)
