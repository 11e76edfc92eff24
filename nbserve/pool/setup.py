"""Where a Pool's replicas live and how big their KV caches are.

`resolve_devices` turns "auto" / a count / a list into device strings; `load_replicas` loads a
source once per distinct device (in parallel threads) or copies a loaded model there;
`plan_kv_caches` sizes each replica's cache: a paged cache gets a share of its device's free
memory (of the RAM available, on CPU) as its block budget, split between the replicas on one
device; a one-row-per-sequence cache gets `max_batch` rows, sized from the GPU's memory on CUDA.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from ..execution.weights import WeightFormats
from ..loading import LoadedModel, load
from ..models.adapters.step_model import served
from ..models.base import PagedModel

AUTO_CONTEXT_CAP = 8192  # longest automatic max_context (pass max_context= for more)
MIN_AUTO_BATCH = 8  # automatic sizing shortens the context before going below this many slots
MAX_AUTO_BATCH = 256  # automatic sizing never makes more slots than this
CPU_DEFAULT_CONTEXT = 4096  # the Engine's own default
M = TypeVar("M", bound=torch.nn.Module)


# ----------------------------------------------------------------------------- devices


def resolve_devices(devices: Any = "auto", device: str | None = None) -> list[str]:
    """Device strings, one per replica: "auto" (every CUDA device, else one CPU replica), a
    count, a list such as ["cuda:0", "cuda:1"] or ["cpu", "cpu"], or "cuda:0,cuda:1"."""
    if device is not None:
        if devices not in (None, "auto"):
            raise ValueError(f"got devices={devices!r} and device={device!r}: pass one of them "
                             "(devices=[...] for several replicas)")
        devices = [device]
    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices is None or devices == "auto":
        return [f"cuda:{i}" for i in range(n_cuda)] or ["cpu"]
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise ValueError(f"devices must be at least 1, got {devices}")
        if n_cuda == 0:
            return ["cpu"] * devices
        if devices > n_cuda:
            raise ValueError(
                f"devices={devices} but only {n_cuda} CUDA device(s) are visible: pass "
                f"devices={n_cuda} or fewer, or a list such as ['cuda:0', 'cuda:0'] to put "
                "several replicas on one GPU")
        return [f"cuda:{i}" for i in range(devices)]
    if isinstance(devices, (str, torch.device)):
        items: list[Any] = [d.strip() for d in str(devices).split(",") if d.strip()]
    elif isinstance(devices, Sequence):
        items = list(devices)
    else:
        raise TypeError(f"devices must be 'auto', a count or a list of devices, "
                        f"got {type(devices).__name__}")
    if not items:
        raise ValueError("devices is empty: pass 'auto', a count, or e.g. ['cuda:0', 'cuda:1']")
    return [_normalize(d, n_cuda) for d in items]


def _normalize(d: Any, n_cuda: int) -> str:
    try:
        dev = torch.device(d)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {d!r}: use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type == "cuda":
        if n_cuda == 0:
            raise ValueError(f"device {d!r} needs CUDA, which torch {torch.__version__} does not "
                             "see here: use devices='auto' or ['cpu', ...]")
        index = dev.index or 0
        if index >= n_cuda:
            raise ValueError(f"device {d!r} does not exist: {n_cuda} CUDA device(s) are "
                             f"visible (cuda:0 to cuda:{n_cuda - 1})")
        return f"cuda:{index}"
    return str(dev)


def same_device(a: Any, b: Any) -> bool:
    da, db = torch.device(a), torch.device(b)
    return da.type == db.type and (da.index or 0) == (db.index or 0)


# ----------------------------------------------------------------------------- loading


def load_replicas(model: Any, devices: list[str], *, dtype: Any = None,
                  **load_options: Any) -> dict[str, LoadedModel]:
    """One LoadedModel per distinct device, built in parallel threads.

    A source (path, "smollm2", hub id) is loaded on each device (a name that may download is
    loaded on the first device before the others). Anything else goes through `load()` once and
    is copied to the other devices. Replicas on the same device share one
    LoadedModel, so one copy of the weights: safe, since each Engine owns its KV cache.
    """
    distinct = list(dict.fromkeys(devices))
    out: dict[str, LoadedModel] = {}
    if isinstance(model, (str, os.PathLike)):
        def job(d: str) -> LoadedModel:
            return load(model, device=d, dtype=dtype, **load_options)

        if not os.path.exists(model):  # "smollm2" or a hub id: the first load fills the cache
            out[distinct[0]] = _checked(model, distinct[0], job)
    else:
        # a LoadedModel or a model object is adopted where it is, then copied where needed
        first = _checked(model, distinct[0],
                         lambda d: load(model, dtype=dtype, **load_options))

        def job(d: str) -> LoadedModel:
            return replicate(first, d)
    todo = [d for d in distinct if d not in out]
    with ThreadPoolExecutor(max_workers=max(len(todo), 1),
                            thread_name_prefix="nbserve-load") as ex:
        futures = {d: ex.submit(_checked, model, d, job) for d in todo}
    out.update((d, fut.result()) for d, fut in futures.items())
    return out


def _checked(model: Any, device: str, job: Any) -> LoadedModel:
    try:
        return job(device)
    except Exception as exc:
        raise RuntimeError(f"could not prepare a replica of {_describe(model)} on {device}: "
                           f"{exc}") from exc


def replicate(loaded: LoadedModel, device: str) -> LoadedModel:
    """`loaded` itself when it is on `device`; else a copy of its weights there (tokenizer and
    template shared)."""
    model = loaded.model
    if same_device(model.device, device):
        return loaded
    if isinstance(model, torch.nn.Module):
        formats = model if isinstance(model, WeightFormats) else None
        released = formats is not None and formats.dense_released
        if formats is not None and released:  # a quantized CPU model keeps no float32 matmul
            formats.restore_dense_weights()  # weights: rebuild them for the copy
        try:
            return dataclasses.replace(loaded, model=_copy_module(model, device))
        finally:
            if formats is not None and released:
                formats.release_dense_weights()
    if loaded.source:
        return load(loaded.source, device=device, dtype=model.dtype, verbose=False)
    raise TypeError(f"cannot copy a {type(model).__name__} to {device}: pass the model's source "
                    "(a path or hub id) to Pool so that each device loads its own copy")


def _copy_module(model: M, device: str) -> M:
    """deepcopy with every parameter and buffer pre-mapped to its copy on `device`, so the
    source tensors are never duplicated on their own device and tied weights stay tied."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in memo:
            moved = t.detach().to(device)
            memo[id(t)] = torch.nn.Parameter(moved, requires_grad=False) \
                if isinstance(t, torch.nn.Parameter) else moved
    copied = copy.deepcopy(model, memo)
    if isinstance(copied, WeightFormats):  # nbserve's model: fused views, CPU-only extras
        copied.refresh_derived()
    return copied


def _describe(model: Any) -> str:
    return repr(str(model)) if isinstance(model, (str, os.PathLike)) else \
        getattr(model, "name", type(model).__name__)


# ----------------------------------------------------------------------------- KV sizing


@dataclasses.dataclass(slots=True)
class KVPlan:
    """Cache size of one replica, and the memory it was sized from (CUDA only).
    `kv_memory`: the block budget in bytes of a paged cache (None for a row cache)."""

    max_batch: int | None
    max_context: int
    nbytes: int
    free_bytes: int | None = None
    fraction: float | None = None
    kv_memory: int | None = None

    def engine_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"max_batch": self.max_batch, "max_context": self.max_context}
        if self.kv_memory is not None:
            opts["kv_memory"] = self.kv_memory
        return opts

    def describe(self, index: int, device: str) -> str:
        if self.kv_memory is not None:
            return (f"nbserve: replica {index} on {device}: paged KV cache, "
                    f"{self.kv_memory / 2**20:.0f} MiB budget ({self.fraction:g} of "
                    f"{(self.free_bytes or 0) / 2**30:.1f} GiB free, shared by the replicas "
                    f"there), {self.max_context} tokens per request at most")
        size = f"{self.nbytes / 2**30:.2f} GiB" if self.nbytes >= 2**30 else \
            f"{self.nbytes / 2**20:.1f} MiB"
        line = (f"nbserve: replica {index} on {device}: KV cache {self.max_batch} slots x "
                f"{self.max_context} tokens ({size}")
        if self.free_bytes is not None:
            line += f"; {self.fraction:g} of {self.free_bytes / 2**30:.1f} GiB free"
        return line + ")"


def plan_paged(loaded: dict[str, LoadedModel], devices: list[str], fraction: float | None,
               max_batch: int | None, max_context: int | None,
               kv_memory: int | float | None) -> list[KVPlan]:
    """Block budgets in bytes: `kv_memory` bytes each, or a fraction of each device's free
    memory split between its replicas (a default budget capped as the Engine's is)."""
    from ..engine.config import PAGED_MAX_BATCH
    from ..engine.kv_budget import CPU_FRACTION, CUDA_FRACTION, available_bytes

    budgets: list[tuple[int, int | None, float | None]] = []
    per_device: dict[str, int] = {}
    for d in devices:
        model = served(loaded[d].model)
        assert isinstance(model, PagedModel)  # plan_kv_caches: only paged models get here
        per_token = per_device[d] = int(model.kv_bytes_per_token())
        ctx = min(int(model.max_context), max_context or int(model.max_context))
        if isinstance(kv_memory, int):
            budgets.append((kv_memory, None, None))
            continue
        dev = torch.device(d)
        share = kv_memory if kv_memory is not None else fraction if fraction is not None \
            else CUDA_FRACTION if dev.type == "cuda" else CPU_FRACTION
        free, _ = available_bytes(dev)
        budget = int(free * share) // devices.count(d)
        if kv_memory is None:
            budget = min(budget, (max_batch or PAGED_MAX_BATCH) * ctx * per_token)
        budgets.append((budget, free, share))
    tokens = min(b // per_device[d] for (b, _, _), d in zip(budgets, devices))
    ctx = min(min(int(loaded[d].model.max_context) for d in devices), max_context or tokens,
              tokens)
    return [KVPlan(max_batch, ctx, b, free, share, kv_memory=b) for b, free, share in budgets]


@runtime_checkable
class SizesKV(Protocol):
    """A model that says how many bytes a cached token takes (`PagedModel`, a user's
    `PagedStepModel`)."""

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int: ...


def kv_bytes_per_token(model: Any) -> int:
    """Bytes one cached token takes in one slot (all layers, keys and values)."""
    if isinstance(model, SizesKV):
        return int(model.kv_bytes_per_token())
    probe = model.make_cache(1, 2)
    try:
        return max(int(probe.nbytes) // 2, 1)
    finally:
        del probe


def choose_kv_size(per_token: int, budget: int, model_context: int, max_batch: int | None,
                   max_context: int | None) -> tuple[int, int]:
    """(max_batch, max_context) whose cache fits in `budget` bytes; what is given is kept."""
    def fit(ctx: int) -> int:
        return budget // (per_token * ctx)

    if max_batch is not None and max_context is not None:
        need = max_batch * max_context * per_token
        if need > budget:
            raise ValueError(
                f"max_batch={max_batch} x max_context={max_context} needs "
                f"{need / 2**30:.2f} GiB of KV cache but only {budget / 2**30:.2f} GiB is "
                "budgeted: lower max_batch or max_context, raise kv_memory_fraction, or free "
                "GPU memory")
        return max_batch, max_context
    if max_context is not None:
        batch = min(fit(max_context), MAX_AUTO_BATCH)
    elif max_batch is not None:
        max_context = min(model_context, AUTO_CONTEXT_CAP, fit(1) // max_batch)
        batch = max_batch
    else:
        max_context = min(model_context, AUTO_CONTEXT_CAP, fit(1) // MIN_AUTO_BATCH)
        max_context = max(max_context, min(model_context, 256))
        batch = min(fit(max_context), MAX_AUTO_BATCH)
    if batch < 1 or max_context < 2:
        raise ValueError(
            f"not enough free GPU memory for a KV cache: {budget / 2**20:.0f} MiB budgeted, "
            f"{per_token * (max_context or 2) / 2**20:.1f} MiB needed per slot. Lower "
            "max_context, raise kv_memory_fraction, or use a smaller model or dtype")
    return batch, max_context


def plan_kv_caches(loaded: dict[str, LoadedModel], devices: list[str], fraction: float | None,
                   max_batch: int | None, max_context: int | None,
                   default_batch: int = 16, kv_memory: int | float | None = None) -> list[KVPlan]:
    """One plan per replica; all get the same max_context. See the module docstring."""
    if all(isinstance(served(loaded[d].model), PagedModel) for d in devices):
        return plan_paged(loaded, devices, fraction, max_batch, max_context, kv_memory)
    fraction = 0.9 if fraction is None else fraction
    budgets: dict[str, tuple[int, int]] = {}  # device -> (free bytes, budget per replica)
    for d in dict.fromkeys(devices):
        if torch.device(d).type == "cuda":
            torch.cuda.empty_cache()  # loading leaves freed blocks in torch's allocator
            free, _ = torch.cuda.mem_get_info(torch.device(d))
            budgets[d] = (free, int(free * fraction) // devices.count(d))
    contexts = []
    for d in devices:
        m = loaded[d].model
        ctx_limit = int(m.max_context)
        if d in budgets:
            contexts.append(choose_kv_size(kv_bytes_per_token(m), budgets[d][1], ctx_limit,
                                           max_batch, max_context)[1])
        else:
            contexts.append(max_context or min(ctx_limit, CPU_DEFAULT_CONTEXT))
    ctx = min(contexts)
    plans = []
    for d in devices:
        m = loaded[d].model
        if d in budgets:
            free, budget = budgets[d]
            per_token = kv_bytes_per_token(m)
            batch, _ = choose_kv_size(per_token, budget, int(m.max_context), max_batch, ctx)
            plans.append(KVPlan(batch, ctx, batch * ctx * per_token, free, fraction))
        else:
            batch = max_batch or default_batch
            try:
                nbytes = batch * ctx * kv_bytes_per_token(m)
            except Exception:  # noqa: BLE001 - the size is only printed
                nbytes = 0
            plans.append(KVPlan(batch, ctx, nbytes))
    return plans
