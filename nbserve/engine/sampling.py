"""Batched sampling on a step's logits (B, V), each row by its own SamplingParams and generator.

Per row: logit_bias, repetition, presence/frequency, the stop tokens held back until min_tokens,
the grammar's token mask (constraints.py) for a constrained row; then argmax, or temperature,
top-k, top-p, min-p and one draw. Logprobs: log_softmax of the raw logits (vLLM/OpenAI), not
of the masked ones. Inputs stay unmodified.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import torch

from nbserve.types import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from llguidance import LLMatcher

_MIN_TEMPERATURE = 1e-5  # below this a row is sampled greedily (dividing by it would overflow)
_CANDIDATE_TOP_K = 1024  # rows with 0 < top_k <= this sample among their top-k values only
SORT_TOP_P_ON_CPU = False  # True: CPU uses the sorted top-p mask too (slow at V ~ 50k; tests)


@dataclass(slots=True)
class SeqSampler:
    """Per-sequence sampling state: params, its own torch.Generator when seeded, token counts."""

    params: SamplingParams
    generator: torch.Generator | None = None
    prompt_ids: list[int] = field(default_factory=list)  # repetition penalty: prompt + output
    output_counts: dict[int, int] = field(default_factory=dict)  # presence/frequency: output only
    stop_ids: tuple[int, ...] = ()  # masked while fewer than params.min_tokens were generated
    eos_ids: tuple[int, ...] = ()  # a constrained row with ignore_eos: the model's end tokens
    generated: int = 0  # tokens observed
    seen_ids: set[int] = field(init=False, repr=False)  # prompt ∪ output ids, kept by observe()
    matcher: LLMatcher | None = None  # when the output is constrained (constraints.py)
    _bias: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.seen_ids = set(self.prompt_ids) | set(self.output_counts)

    def bias_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """params.logit_bias as (ids (N,), values (N,)) on `device`, made once per sequence
        (a lone row's bias is then one op a step)."""
        if self._bias is None or self._bias[0].device != device:
            bias = self.params.logit_bias or {}
            self._bias = (_tensor(list(bias), torch.long, device),
                          _tensor(list(bias.values()), torch.float32, device))
        return self._bias

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_ids: list[int],
        device: torch.device | str = "cpu",
        seed_offset: int = 0,
        stop_ids: Iterable[int] = (),
    ) -> SeqSampler:
        """Choice i of an n > 1 request passes seed_offset=i: streams differ but are reproducible.
        `stop_ids`: the tokens that would end the choice, which cannot be sampled before
        `params.min_tokens` tokens."""
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed((params.seed + seed_offset) % (1 << 64))
        held = tuple(sorted(stop_ids)) if params.min_tokens > 0 else ()
        return cls(params, gen, list(prompt_ids), {}, held)

    def observe(self, token_id: int) -> None:
        """Record a generated token; the engine calls this once per token that `sample` returned."""
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1
        self.seen_ids.add(token_id)
        self.generated += 1
        if self.matcher is not None:
            self.matcher.consume_token(token_id)

    @property
    def held_ids(self) -> tuple[int, ...]:
        """The end tokens masked at this step: the stop tokens until min_tokens, and for a
        constrained row with ignore_eos the model's end tokens. A constrained row's are
        masked only where its grammar allows another token (process_logits): where the grammar
        is complete and allows nothing more, the answer ends."""
        held = self.stop_ids if self.generated < self.params.min_tokens else ()
        return held + self.eos_ids if self.eos_ids else held

    @property
    def holds_stops(self) -> bool:
        """Whether some end tokens are masked at this step (`held_ids`)."""
        return bool(self.eos_ids) or (bool(self.stop_ids) and
                                      self.generated < self.params.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.params.temperature < _MIN_TEMPERATURE

    @property
    def needs_processing(self) -> bool:
        """Whether bias or penalties change this row's logits at this step."""
        p = self.params
        return bool(
            p.logit_bias
            or (p.repetition_penalty != 1.0 and self.seen_ids)
            or ((p.presence_penalty or p.frequency_penalty) and self.output_counts)
            or self.holds_stops
            or self.matcher is not None
        )


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]  # (B,) sampled ids
    logprobs: list[TokenLogprob | None]  # rows with params.logprobs; token strings left ""


def _tensor(values: list | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without waiting for queued GPU work."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def _flat(per_row: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row collections of token ids -> (rows (N,), ids (N,)) on device."""
    rows = list(chain.from_iterable([i] * len(ids) for i, ids in enumerate(per_row)))
    ids = list(chain.from_iterable(per_row))
    return _tensor(rows, torch.long, device), _tensor(ids, torch.long, device)


def greedy_ids(x: torch.Tensor) -> list[int]:
    """Each row's argmax of x (B, V), the first index on ties (a NaN counts as the largest),
    as torch's argmax. On CPU float32 it is numpy's, whose vectorised loop runs several times
    faster than torch's at a vocabulary's width (benchmarks/README.md)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad:
        return x.numpy().argmax(-1).tolist()
    return x.argmax(-1).tolist()


Masks = tuple[list[int], torch.Tensor]  # (constrained rows, their bitmasks (R, ceil(V / 32)))


def process_logits(logits: torch.Tensor, samplers: list[SeqSampler],
                   masks: Masks | None = None) -> torch.Tensor:
    """A float32 copy of `logits` (B, V) with, per row: logit_bias (added), repetition penalty
    (HF: positive / p, negative * p over prompt+output ids), then presence/frequency penalties
    (OpenAI: -= presence * (count > 0) + frequency * count over output ids), -inf on the
    end tokens a row holds back (`SeqSampler.held_ids`: min_tokens, as vLLM, and ignore_eos
    under a grammar; after the bias, which cannot undo it; a constrained row's only where its
    mask allows another token), and -inf on what a constrained row's grammar forbids
    (`masks`; last, so nothing undoes it)."""
    x = logits.to(torch.float32, copy=True)  # (B, V); the caller's tensor is never modified
    dev = x.device
    ps = [s.params for s in samplers]
    biased = [i for i, p in enumerate(ps) if p.logit_bias]
    if len(biased) == 1:
        ids, values = samplers[biased[0]].bias_tensors(dev)
        x[biased[0]].index_add_(0, ids, values)
    elif biased:
        biases = [p.logit_bias or {} for p in ps]
        r, c = _flat([b.keys() for b in biases], dev)  # (N,) each
        v = _tensor(list(chain.from_iterable(b.values() for b in biases)), torch.float32, dev)
        x.index_put_((r, c), v, accumulate=True)
    if any(p.repetition_penalty != 1.0 for p in ps):
        r, c = _flat(
            [s.seen_ids if s.params.repetition_penalty != 1.0 else () for s in samplers], dev
        )  # (N,) each; (row, id) pairs are unique
        pen = _tensor([p.repetition_penalty for p in ps], torch.float32, dev)[r]  # (N,)
        old = x[r, c]  # (N,)
        x[r, c] = torch.where(old > 0, old / pen, old * pen)
    if any(p.presence_penalty or p.frequency_penalty for p in ps):
        on = [bool(p.presence_penalty or p.frequency_penalty) for p in ps]
        r, c = _flat([s.output_counts.keys() if o else () for s, o in zip(samplers, on)], dev)
        n = _tensor(
            list(chain.from_iterable(s.output_counts.values() for s, o in zip(samplers, on) if o)),
            torch.float32,
            dev,
        )  # (N,) counts
        pres = _tensor([p.presence_penalty for p in ps], torch.float32, dev)[r]  # (N,)
        freq = _tensor([p.frequency_penalty for p in ps], torch.float32, dev)[r]  # (N,)
        x.index_put_((r, c), -(pres + freq * n), accumulate=True)
    if any(s.holds_stops for s in samplers):
        held = [s.held_ids if s.holds_stops else () for s in samplers]
        if masks is not None and masks[0]:
            from .constraints import allows_besides
            for j, i in enumerate(masks[0]):
                if held[i] and not allows_besides(masks[1][j], held[i]):
                    held[i] = ()  # the grammar allows only the end: it ends
        r, c = _flat(held, dev)  # (N,) each
        x[r, c] = -math.inf
    if masks is not None and masks[0]:
        from .constraints import apply_masks_
        apply_masks_(x, masks[0], masks[1])
    return x


def _top_k_(x: torch.Tensor, ks: list[int]) -> None:
    """Mask (-inf, in place) all but the k largest logits of each row of x (R, V); k=0 is off.
    Ties with the k-th value are kept."""
    ks = [min(k, x.shape[-1]) for k in ks]
    vals = x.topk(max(ks), dim=-1).values  # (R, kmax), descending
    kth = _tensor([max(k, 1) - 1 for k in ks], torch.long, x.device)[:, None]  # (R, 1)
    thr = vals.gather(1, kth)  # (R, 1)
    on = _tensor([k > 0 for k in ks], torch.bool, x.device)[:, None]  # (R, 1)
    x.masked_fill_(on & (x < thr), -math.inf)


def _top_p_sorted_(x: torch.Tensor, p: torch.Tensor) -> None:
    """Mask (-inf, in place) what top-p drops from x (R, V), p (R, 1); by a full sort (no sync).

    Keeps the smallest most-probable set whose mass reaches p, at least one token; ties at the
    cut stay. Rows with p = 1 keep everything.
    """
    xs = x.sort(-1, descending=True).values  # (R, V)
    w = (xs - xs[:, :1]).exp_()  # (R, V) unnormalised probabilities, descending
    cum = w.cumsum_(-1)  # (R, V), in place: w is no longer needed apart from its differences
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], -1)  # (R, V) exclusive cumsum
    n = (before < p * cum[:, -1:]).sum(-1, keepdim=True).clamp(min=1)  # (R, 1) tokens kept
    x.masked_fill_((p < 1.0) & (x < xs.gather(1, n - 1)), -math.inf)


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One U[0, 1) draw per row -> (R, 1): from the row's generator, else the global RNG."""
    u = torch.rand(len(generators), 1, device=device)  # (R, 1)
    for j, g in enumerate(generators):
        if g is not None:
            u[j] = torch.rand((), generator=g, device=g.device)
    return u


def _invert(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF lookup: cdf (..., V) unnormalised, u (..., 1) -> (..., 1) ids with weight > 0."""
    total = cdf[..., -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # < total
    ids = torch.searchsorted(cdf, target, right=True)  # first cdf > target: its weight is > 0
    return ids.clamp_(max=cdf.shape[-1] - 1)  # only NaN logits could reach past the end


def _mass_above(w: torch.Tensor, w_tok: torch.Tensor) -> torch.Tensor:
    """Sum of the weights w (..., C) greater than w_tok (..., 1) -> (..., 1).

    Arithmetic only: comparisons that build bool tensors are several times slower on CPU.
    """
    d = (w - w_tok).relu_()  # (..., C)
    over = d.sum(-1, keepdim=True)
    return over + w_tok * d.sign_().sum(-1, keepdim=True)  # count exact below 2**24 tokens


def _sample_rows(
    x: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    candidates: bool,
) -> torch.Tensor:
    """Draw one token per row of logits x (R, V) (read only) -> (R,) ids.

    Temperature, then top-k, top-p (over the top-k distribution), min-p, then one inverse-CDF draw
    with a uniform from the row's own generator (global RNG when None): a seeded row's stream
    depends on nothing else in the batch. `candidates` (every row has a small top_k): work on the
    top-k values only, not the whole vocabulary. On CUDA top-p is a sorted mask; on CPU, where
    sorting V ~ 50k is slow, it is exact rejection: a draw j is kept when the mass of the tokens
    more probable than j is < p (j is in the nucleus); else every token no more probable than j is
    dropped (none is in the nucleus) and the row draws again.
    """
    dev = x.device
    ids = None
    if candidates:
        x, ids = x.topk(max(p.top_k for p in params), dim=-1)  # (R, K) each, descending
    temps = _tensor([p.temperature for p in params], torch.float32, dev)[:, None]  # (R, 1)
    x = x / temps  # (R, C) a new tensor, C = V or K
    if any(p.top_k > 0 for p in params):
        _top_k_(x, [p.top_k for p in params])
    p_t = _tensor([p.top_p for p in params], torch.float32, dev)[:, None]  # (R, 1)
    reject = any(p.top_p < 1.0 for p in params) and dev.type == "cpu" and not SORT_TOP_P_ON_CPU
    if any(p.top_p < 1.0 for p in params) and not reject:
        _top_p_sorted_(x, p_t)
    w = x.sub_(x.amax(-1, keepdim=True)).exp_()  # (R, C) unnormalised probabilities, max 1
    cdf = w.cumsum(-1)  # (R, C); masked tokens add exactly 0
    need = torch.where(p_t < 1.0, p_t * cdf[:, -1:], math.inf)  # (R, 1) nucleus mass (rejection)
    if any(p.min_p > 0 for p in params):  # p_i < min_p * p_max  <=>  w_i < min_p
        w.masked_fill_(w < _tensor([p.min_p for p in params], torch.float32, dev)[:, None], 0.0)
        cdf = w.cumsum(-1)
    tok = _invert(cdf, _uniforms(generators, dev))  # (R, 1)
    if reject:
        bad = _mass_above(w, w.gather(1, tok)) >= need  # (R, 1): drawn outside the nucleus
        rows = bad.flatten().nonzero().flatten()  # (P,)
        while rows.numel():  # drop every token no more probable than the rejected one, redraw
            wp, need_p = w[rows], need[rows]  # (P, C), (P, 1)
            wp.masked_fill_(wp <= wp.gather(1, tok[rows]), 0.0)
            w[rows] = wp
            t = _invert(wp.cumsum(-1), _uniforms([generators[j] for j in rows.tolist()], dev))
            tok[rows] = t  # (P, 1)
            rows = rows[(_mass_above(wp, wp.gather(1, t)) >= need_p).flatten()]
    return tok.squeeze(1) if ids is None else ids.gather(1, tok).squeeze(1)


def _logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    token_ids: list[int],
    rows: list[int],
    params: list[SamplingParams],
) -> list[TokenLogprob]:
    """TokenLogprob of the sampled token and its top alternatives, from raw logits (B, V)."""
    dev = logits.device
    idx = _tensor(rows, torch.long, dev)
    raw, tok = (logits, tokens) if len(rows) == len(tokens) else (logits[idx], tokens[idx])
    lp = torch.log_softmax(raw.float(), dim=-1)  # (L, V)
    chosen = lp.gather(1, tok[:, None]).squeeze(1).tolist()  # (L,)
    k_max = max(params[i].top_logprobs for i in rows)
    top_v, top_i = lp.topk(k_max, dim=-1) if k_max else (lp[:, :0], lp[:, :0].long())  # (L, k)
    top_vals, top_ids = top_v.tolist(), top_i.tolist()
    out = []
    for j, i in enumerate(rows):
        k = params[i].top_logprobs
        top = [(t, "", v) for t, v in zip(top_ids[j][:k], top_vals[j][:k])]
        out.append(TokenLogprob(token_id=token_ids[i], token="", logprob=chosen[j], top=top))
    return out


def sample(logits: torch.Tensor, samplers: list[SeqSampler], masks: Masks | None = None
           ) -> SampleOutput:
    """Pick one token per row of logits (B, V). Does not modify `logits`; advances the
    generators of seeded sampled rows; does not call `observe` (the engine does). `masks`: the
    grammar masks of the rows whose sampler has a matcher (all of them)."""
    B = logits.shape[0]
    if len(samplers) != B:
        raise ValueError(f"sample() got {B} rows of logits but {len(samplers)} samplers")
    constrained = [i for i, s in enumerate(samplers) if s.matcher is not None]
    if constrained and (masks is None or masks[0] != constrained):
        raise ValueError("sample() needs the grammar masks of every constrained row")
    params = [s.params for s in samplers]
    lp_rows = [i for i, p in enumerate(params) if p.logprobs]
    greedy = [s.greedy for s in samplers]
    process = any(s.needs_processing for s in samplers)
    x = process_logits(logits, samplers, masks) if process else logits  # (B, V), read only below
    if all(greedy) and not lp_rows:  # fast path: one argmax, one transfer
        return SampleOutput(greedy_ids(x), [None] * B)
    dev = x.device
    # Each row's path depends on its own params only, so seeded streams ignore the batch.
    kinds = [
        "greedy" if greedy[i] else "top_k" if 0 < p.top_k <= _CANDIDATE_TOP_K else "vocab"
        for i, p in enumerate(params)
    ]
    tokens = torch.empty(B, dtype=torch.long, device=dev)  # (B,)
    for kind in ("greedy", "top_k", "vocab"):
        rows = [i for i in range(B) if kinds[i] == kind]
        if not rows:
            continue
        idx = _tensor(rows, torch.long, dev)
        sub = x if len(rows) == B else x[idx]  # (R, V)
        if kind == "greedy":
            t = sub.argmax(-1)
        else:
            gens = [samplers[i].generator for i in rows]
            t = _sample_rows(sub.float(), [params[i] for i in rows], gens, kind == "top_k")
        tokens = t if len(rows) == B else tokens.index_copy_(0, idx, t)
    token_ids = tokens.tolist()
    logprobs: list[TokenLogprob | None] = [None] * B
    if lp_rows:
        for i, lp in zip(lp_rows, _logprobs(logits, tokens, token_ids, lp_rows, params)):
            logprobs[i] = lp
    return SampleOutput(token_ids, logprobs)
