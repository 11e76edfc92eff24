"""The LoRA adapters an engine serves, by name: each is loaded into the model once (under an
index its rows are selected by, models/lora.py) with a prefix-cache root key of its own, so
that no cached block is ever shared between adapters, or with the base (engine/blocks.py)."""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass

from ..loading.lora_files import read_adapter
from ..models.base import SlotModel
from ..types import ModelNotFoundError
from .prefix_keys import ROOT_KEY


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    name: str
    path: str
    index: int
    root: bytes  # its sequences' prefix-key chains start here


class EngineAdapters:
    """Adapters by name; `add` loads one into `model` (ValueError where it does not fit)."""

    def __init__(self, model: SlotModel, base_name: str):
        self._model, self._base = model, base_name
        self._lock = threading.Lock()
        self._by_name: dict[str, ServedAdapter] = {}
        self._next = 0

    def add(self, name: str, path: str) -> ServedAdapter:
        if not name or ":" in name:
            raise ValueError(f"an adapter needs a name without ':', got {name!r}")
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"an adapter named {name!r} is already served")
            index, self._next = self._next, self._next + 1
        self._model.add_lora(index, read_adapter(path))
        adapter = ServedAdapter(name, str(path), index, secrets.token_bytes(16))
        with self._lock:
            self._by_name[name] = adapter
        return adapter

    def names(self) -> list[str]:
        with self._lock:
            return list(self._by_name)

    def find(self, name: str | None) -> tuple[int, bytes]:
        """(index, root key) of adapter `name` (None: the base alone: -1, ROOT_KEY);
        ModelNotFoundError naming base:adapter for each adapter there is."""
        if name is None:
            return -1, ROOT_KEY
        with self._lock:
            adapter = self._by_name.get(name)
            served = [self._base] + [f"{self._base}:{n}" for n in self._by_name]
        if adapter is None:
            raise ModelNotFoundError(f"{self._base}:{name}", served)
        return adapter.index, adapter.root
