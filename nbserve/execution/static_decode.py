"""Decode steps at fixed shapes, so that CUDA graphs can capture them.

A CUDA decode step of a small batch is mostly kernel launches: dozens per layer, each a few
microseconds of CPU time, while the GPU waits. A CUDA graph records the step's kernels once
and replays them with one launch, but only for fixed shapes and fixed buffers. So decode steps
here run at bucketed shapes: the batch rounded up to a power of two (padded rows read and
write only the cache's pad block, which no real row reads), the attention length rounded up to
a power-of-two number of blocks (the keys past a row's position are masked by position on the
device, as in any decode step), the token ids, positions and block tables copied into static
buffers per batch bucket. On CUDA every (batch, length) bucket up to CAPTURE_MAX_TOKENS is
captured when the engine starts and replayed per step; larger steps, and every step after a
capture that failed (logged once), take the model's dynamic path, unpadded. On CPU the same
bucketed steps run eagerly: the tests compare them with the dynamic path there, and the
device check compares captured and eager.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from .kv_cache import PagedKVCache


class BatchedStepModel(Protocol):
    """What the static steps need of a model (`LlamaModel` has it)."""

    @property
    def device(self) -> torch.device: ...

    def batched_step(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                     cache: PagedKVCache, kv_len: int, logit_index: torch.Tensor | None = None,
                     kernel: bool = False, padded: bool = False) -> torch.Tensor: ...

log = logging.getLogger("nbserve.static_decode")

MIN_LENGTH_BLOCKS = 8  # the shortest attention length bucket, in blocks
CAPTURE_MAX_TOKENS = 1 << 16  # rows x attention length of the largest bucket captured: past
# it a step's gathered keys and values (and its graph's memory) are large and its launches a
# small share of its time, so it runs dynamically, unpadded

_WARMUP_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # see warmup_stream


def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream every engine on `device` warms its kernels up on. One for the process,
    not one an engine: the CUDA libraries keep a workspace for each stream they ever ran on
    (cuBLAS: tens of MiB) for the life of the process, so a stream an engine would have grown
    the memory that launch/stop cycles in a notebook never get back."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    stream = _WARMUP_STREAMS.get(device)
    if stream is None:
        stream = _WARMUP_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def powers_of_two_up_to(limit: int, start: int = 1) -> list[int]:
    """start, 2 start, 4 start, ... and `limit` itself last (the largest bucket)."""
    out, n = [], start
    while n < limit:
        out.append(n)
        n *= 2
    return out + [limit]


def bucket(value: int, buckets: list[int]) -> int:
    """The smallest bucket that holds `value`."""
    for b in buckets:
        if value <= b:
            return b
    raise ValueError(f"{value} is past the largest bucket {buckets[-1]}")


class _Buffers:
    """The static inputs of one batch bucket (and the outputs of its captured graphs)."""

    def __init__(self, rows: int, max_blocks: int, pad_block: int, device: torch.device):
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.tables = torch.full((rows, max_blocks), pad_block, dtype=torch.long, device=device)
        self.logit_index = torch.zeros(rows, dtype=torch.long, device=device)


class StaticDecode:
    """Decode steps of `model` over `cache` at bucketed shapes, replayed from CUDA graphs where
    `capture` and the model is on CUDA, else run eagerly (`__call__`)."""

    def __init__(self, model: BatchedStepModel, cache: PagedKVCache, max_batch: int,
                 max_context: int, capture: bool):
        self.model, self.cache = model, cache
        bs = cache.block_size
        max_blocks = -(-max_context // bs)
        self.batch_buckets = powers_of_two_up_to(max_batch)
        self.block_buckets = powers_of_two_up_to(max_blocks, min(MIN_LENGTH_BLOCKS, max_blocks))
        device = torch.device(model.device)
        self.buffers = {rows: _Buffers(rows, max_blocks, cache.pad_block, device)
                        for rows in self.batch_buckets}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_error: str | None = None
        self.capturing = capture and device.type == "cuda"  # else every bucket runs eagerly
        self.steps = self.replays = 0
        if self.capturing:
            self._capture_all()

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def describe(self) -> dict[str, int | str | list[int] | None]:
        """For /stats and the benchmarks: buckets, graphs captured, steps run and replayed."""
        return {"batch_buckets": self.batch_buckets,
                "length_buckets": [b * self.cache.block_size for b in self.block_buckets],
                "graphs": len(self.graphs), "capture_error": self.capture_error,
                "steps": self.steps, "replays": self.replays}

    def serves(self, rows: int, max_pos: int, width: int) -> bool:
        """Whether a decode step of `rows` rows up to position `max_pos` over tables `width`
        blocks wide runs here: its bucket exists and, where graphs are captured, has one (a
        failed capture leaves none: every step then takes the model's dynamic path)."""
        key = self._key(rows, max_pos, width)
        return key is not None and (not self.capturing or key in self.graphs)

    def _key(self, rows: int, max_pos: int, width: int) -> tuple[int, int] | None:
        """The (batch, blocks) bucket of a step, None past the largest ones."""
        blocks = max(-(-(max_pos + 1) // self.cache.block_size), width)
        if rows > self.batch_buckets[-1] or blocks > self.block_buckets[-1]:
            return None
        return bucket(rows, self.batch_buckets), bucket(blocks, self.block_buckets)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor,
                 tables: torch.Tensor, max_pos: int) -> torch.Tensor:
        """Logits (B, V) of one decode step: ids, positions (B, 1), block tables (B, S)."""
        rows = ids.shape[0]
        key = self._key(rows, max_pos, tables.shape[1])
        if key is None:
            raise ValueError(f"a decode step of {rows} rows up to position {max_pos} is past "
                             "the largest buckets (see `serves`)")
        buf = self.buffers[key[0]]
        pad = self.cache.pad_block
        buf.ids[:rows].copy_(ids)
        buf.ids[rows:].zero_()
        buf.positions[:rows].copy_(positions)
        buf.positions[rows:].zero_()  # padded rows: position 0 of the pad block
        buf.tables[:rows, :tables.shape[1]].copy_(tables)
        buf.tables[:rows, tables.shape[1]:].fill_(pad)
        buf.tables[rows:].fill_(pad)
        graph = self.graphs.get(key)
        self.steps += 1
        if graph is not None:
            self.replays += 1
            graph[0].replay()
            return graph[1][:rows]
        return self._run(*key)[:rows]

    def _run(self, rows: int, blocks: int) -> torch.Tensor:
        """The model's batched step over the buffers of bucket (rows, blocks)."""
        buf = self.buffers[rows]
        with torch.inference_mode():
            return self.model.batched_step(buf.ids, buf.positions, buf.tables[:, :blocks],
                                           self.cache, blocks * self.cache.block_size,
                                           buf.logit_index[:rows], padded=True)

    def _capture_all(self) -> None:
        """Capture every bucket of at most CAPTURE_MAX_TOKENS, the largest first (they share
        one memory pool); on any error, none is kept and the steps run eagerly."""
        pool = torch.cuda.graph_pool_handle()
        try:
            stream = warmup_stream(torch.device(self.model.device))
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                for rows in self.batch_buckets:  # warm-up: kernels chosen, workspaces made
                    self._run(rows, self.block_buckets[0])
            torch.cuda.current_stream().wait_stream(stream)
            bs = self.cache.block_size
            for rows in reversed(self.batch_buckets):
                for blocks in reversed(self.block_buckets):
                    if rows * blocks * bs > CAPTURE_MAX_TOKENS:
                        continue  # served dynamically (`serves`)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
                        out = self._run(rows, blocks)
                    self.graphs[rows, blocks] = (graph, out)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 -- any capture failure: run eagerly instead
            self.graphs.clear()
            self.capture_error = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed, decode steps run eagerly: %s",
                        self.capture_error)
