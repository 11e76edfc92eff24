"""Helpers shared by the adapters: an eval-mode view of a live module, config look-ups,
and the warning category for slower serving paths."""

from __future__ import annotations

import copy
import sys
import warnings
import weakref
from pathlib import Path
from types import FrameType

import torch
from torch import nn

from ..base import SlotModel

CONTEXT_KEYS = ("block_size", "sequence_len", "max_position_embeddings", "n_positions",
                "max_seq_len", "context_length", "n_ctx")


class SlowPathWarning(UserWarning):
    """Raised (as a warning) when a model is served through a correct but slower adapter."""


_PACKAGE = str(Path(__file__).resolve().parents[2])  # .../nbserve
_WARNED: weakref.WeakSet[object] = weakref.WeakSet()


def native_list() -> str:
    """The families nbserve's engine runs natively, for the slow paths' warnings."""
    from .. import registry
    return "; ".join(registry.descriptions())


def warn_slow(module: object, message: str) -> None:
    """Warn with `SlowPathWarning` once per module (not again at each `srv.update(model)`),
    attributed to the first caller outside nbserve: the user's cell or script."""
    try:
        if module in _WARNED:
            return
        _WARNED.add(module)
    except TypeError:  # not weak-referenceable: warn every time
        pass
    level = 1
    frame: FrameType | None = sys._getframe(0)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, SlowPathWarning, stacklevel=level)


def eval_view(module: nn.Module) -> nn.Module:
    """A shallow clone of `module` in eval mode that shares its parameters and buffers.

    Each clone shares the original's `_parameters` and `_buffers` dicts, so optimizer steps,
    `load_state_dict` and reassigned parameters show through; only the `training` flags
    differ. Serving never changes the user's module (its train/eval mode stays as it was).
    """

    def clone(m: nn.Module) -> nn.Module:
        c = copy.copy(m)  # new __dict__, same _parameters/_buffers dict objects
        c.__dict__["_modules"] = {k: (clone(v) if v is not None else None)
                                  for k, v in m._modules.items()}
        return c

    view = clone(module)
    view.train(False)
    return view


def module_device_dtype(module: object) -> tuple[torch.device, torch.dtype]:
    """Device and dtype of the first floating-point parameter (cpu/float32 when none)."""
    params = module.parameters() if isinstance(module, nn.Module) else ()
    for p in params:
        if p.is_floating_point():
            return p.device, p.dtype
    return torch.device("cpu"), torch.float32


def config_value(obj: object, keys: tuple[str, ...]) -> int | None:
    """The first positive int under `keys` in `obj.config` (an object or a dict), then `obj`."""
    return first_int(keys, getattr(obj, "config", None), obj)


def first_int(keys: tuple[str, ...], *sources: object) -> int | None:
    """The first positive int found under `keys` in `sources` (objects or dicts), in order."""
    for source in sources:
        if source is None:
            continue
        for key in keys:
            value = source.get(key) if isinstance(source, dict) else getattr(source, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def logits_of(output: object, what: str) -> torch.Tensor:
    """The logits in a module's output: a tensor, a tuple/list (first item), or `.logits`."""
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    elif not isinstance(output, torch.Tensor):
        logits = getattr(output, "logits", None)  # a transformers ModelOutput's
        if isinstance(logits, torch.Tensor):
            output = logits
    if not isinstance(output, torch.Tensor) or output.dim() != 3:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise TypeError(f"{what} must return logits of shape (batch, time, vocab) (or a tuple "
                        f"whose first item is), got {shape}")
    return output


class ModuleAdapter(nn.Module, SlotModel):
    """Base of the adapters (a `SlotModel`: one cache row per sequence, no padded rows, the
    hints ignored): device and dtype follow the wrapped `self.module`, and `train()` is a
    no-op (serving runs an eval-mode view; the user's module keeps its own mode)."""

    module: nn.Module

    @property
    def device(self) -> torch.device:
        return module_device_dtype(self.module)[0]

    @property
    def dtype(self) -> torch.dtype:
        return module_device_dtype(self.module)[1]

    def train(self, mode: bool = True) -> ModuleAdapter:
        return self
