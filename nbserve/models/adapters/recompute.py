"""RecomputeAdapter: serve a plain module whose `forward(idx)` returns logits (B, T, V).

Such a module (nanoGPT, nanochat, a model written in the notebook) has no KV cache, so the
adapter keeps each slot's tokens and runs the whole sequence again at every step. Correct for
any causal LM, but each new token costs a full forward: implement `nbserve.StepModel` to speed
it up (see docs/custom_model.md).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from .common import (
    CONTEXT_KEYS,
    ModuleAdapter,
    config_value,
    eval_view,
    logits_of,
    native_list,
    warn_slow,
)


class TokenCache:
    """The adapter's "KV cache": the tokens of each slot (logits are recomputed from them)."""

    def __init__(self, max_batch: int):
        self.tokens: list[list[int]] = [[] for _ in range(max_batch)]

    @property
    def nbytes(self) -> int:
        return 8 * sum(len(t) for t in self.tokens)

    def write(self, slot: int, start: int, ids: list[int]) -> list[int]:
        """Put `ids` at positions start.. of `slot`, dropping anything after; return the row."""
        row = self.tokens[slot]
        if start > len(row):
            raise RuntimeError(f"slot {slot} holds {len(row)} tokens; cannot write at {start}")
        del row[start:]
        row.extend(ids)
        return row

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        self.tokens[dst] = self.tokens[src][:length]


class RecomputeAdapter(ModuleAdapter):
    """A StepModel over a module whose `forward(idx)` returns logits, recomputing every step.

    The module is used live (through an eval-mode view that shares its weights): training it
    further changes what is served. `max_context` comes from the argument or the module's
    config (`block_size`, `sequence_len`, `max_position_embeddings`, ...); when it exceeds the
    module's own window, the oldest tokens are cropped like nanoGPT's `generate` does.
    """

    def __init__(self, module: nn.Module, *, max_context: int | None = None,
                 vocab_size: int | None = None, warn: bool = True):
        if not isinstance(module, nn.Module):
            raise TypeError("RecomputeAdapter needs a torch.nn.Module, "
                            f"got {type(module).__name__}")
        super().__init__()
        self.module = module
        self._view = eval_view(module)
        self.name = type(module).__name__
        window = config_value(module, CONTEXT_KEYS)
        context = max_context or window
        if context is None:
            raise ValueError(
                f"cannot tell the context length of {self.name}: its config has none of "
                f"{', '.join(CONTEXT_KEYS[:3])}. Pass max_context=... (e.g. "
                "nbserve.launch(model, tokenizer=tok, max_context=256))")
        self.max_context = int(context)
        self.window = min(window or self.max_context, self.max_context)
        self.vocab_size = int(vocab_size or config_value(module, ("vocab_size",))
                              or self._probe_vocab())
        if warn:
            warn_slow(module, (
                f"nbserve: {self.name} is served by recomputing the whole sequence for every "
                "new token (it has no KV cache), so long answers get slow. nbserve's engine "
                f"runs these natively: {native_list()} (a nanoGPT or nanochat GPT module is "
                "recognised by its parameter names). Implement the nbserve.StepModel protocol "
                "(docs/custom_model.md) for full speed."))

    def __repr__(self) -> str:
        return f"RecomputeAdapter({self.name}, max_context={self.max_context})"

    def _probe_vocab(self) -> int:
        with torch.inference_mode():
            out = logits_of(self._view(torch.zeros(1, 1, dtype=torch.long, device=self.device)),
                            f"{self.name}.forward(idx)")
        return int(out.shape[-1])

    def make_cache(self, max_batch: int, max_context: int) -> TokenCache:
        return TokenCache(max_batch)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                cache: TokenCache, logit_index: torch.Tensor | None = None,
                max_pos: int | None = None, contiguous_from: int | None = None) -> torch.Tensor:
        """ids, positions (B, T), slots (B,) -> logits (B, T, V), or (B, V) with logit_index.

        Rows whose windows have the same length run as one batch; others run separately.
        """
        b = ids.shape[0]
        pos = positions.tolist()
        windows: list[list[int]] = []
        for row, (slot, row_ids) in enumerate(zip(slots.tolist(), ids.tolist())):
            seq = cache.write(slot, pos[row][0], row_ids)
            windows.append(seq[-self.window:])
        pick = logit_index.tolist() if logit_index is not None else None
        wanted = [[pos[r][pick[r]]] if pick is not None else pos[r] for r in range(b)]
        groups: dict[int, list[int]] = defaultdict(list)
        for row, w in enumerate(windows):
            groups[len(w)].append(row)
        out: list[torch.Tensor | None] = [None] * b
        for length, rows in groups.items():
            idx = torch.tensor([windows[r] for r in rows], device=self.device)
            logits = logits_of(self._view(idx), f"{self.name}.forward(idx)")  # (G, L', V)
            for g, r in enumerate(rows):
                end = pos[r][-1] + 1  # the row's length; logits[:, -1] is position end - 1
                at = [logits.shape[1] - (end - p) for p in wanted[r]]
                if min(at) < 0:
                    raise RuntimeError(
                        f"{self.name} returned logits for {logits.shape[1]} of {length} "
                        "positions; nbserve needs the last one at least")
                out[r] = logits[g, at]  # (T or 1, V)
        stacked = torch.stack(out)  # type: ignore[arg-type]  # (B, T, V) or (B, 1, V)
        return (stacked[:, 0] if logit_index is not None else stacked).float()
