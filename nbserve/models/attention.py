"""The decoder's attention over the paged cache: q/k/v (fused where loaders fuse them), q/k
norms, RoPE, sliding windows, softcaps, grouped heads; decode steps in nbserve's paged C kernels
where the layer's options allow, else in torch; and the lone step of one sequence's one token."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..execution.holders import FusedProjection, Linear, linear, runs_on_kernel
from ..execution.kv_cache import PagedKVCache
from ..execution.paged_attention import (
    paged_attention_serves,
    paged_cache_serves,
    paged_decode_step,
    paged_lone_attention,
)
from ..execution.step_inputs import LoneInputs, Rope, StepInputs
from .config import DecoderConfig
from .layers import RMSNorm, project
from .rope import apply_rope


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.layer, self.hq, self.hkv, self.d = layer, hq, hkv, d
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, hq * d, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, hkv * d, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, hkv * d, bias=bias)
        self.o_proj = Linear(hq * d, cfg.hidden_size, bias=cfg.o_bias)
        self.qkv: FusedProjection | None = None  # see DecoderModel.fuse_projections
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            full = cfg.qk_norm == "full"
            self.q_norm = RMSNorm(hq * d if full else d, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(hkv * d if full else d, cfg.rms_norm_eps, cfg.norm_offset)
        self.window = cfg.layer_window[layer]
        self.rope_id = cfg.layer_rope[layer]
        rope = cfg.ropes[self.rope_id] if self.rope_id is not None else None
        self.partial_rope = rope is not None and rope.rotary_dim != d
        self.scale = cfg.scale
        self.softcap = cfg.attn_softcap
        # the kernels scale by d ** -0.5: q is pre-scaled by the rest; 1.0 where float32 cannot
        # tell it from 1 (128 ** -0.5 * 128 ** 0.5 is 1 + 2e-16, 96's 1 - 1e-16), so that the
        # default scale of every head size leaves q as it is (the decode stack needs 1.0)
        factor = self.scale * d ** 0.5
        self.q_factor = 1.0 if abs(factor - 1.0) < 2**-24 else factor

    def _split_heads(self, x: torch.Tensor, norm: nn.Module | None, lead: tuple[int, ...]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q, k, v) of norm(x) (..., heads, D), q/k-normed where the model has it, and the
        fused heads (..., hq + 2 hkv, D) as they came out of the matmul when nothing changed
        them (the kernels' input), else None. `lead`: the leading shape of the heads
        ((B, T), or () for a lone step's one token)."""
        hq, hkv, d = self.hq, self.hkv, self.d
        if self.qkv is not None:
            heads = project(x, norm, self.qkv).view(*lead, hq + 2 * hkv, d)
            q, k, v = heads[..., :hq, :], heads[..., hq:hq + hkv, :], heads[..., hq + hkv:, :]
        else:
            if norm is not None:
                x = norm(x)
            q = linear(x, self.q_proj).view(*lead, hq, d)
            k = linear(x, self.k_proj).view(*lead, hkv, d)
            v = linear(x, self.v_proj).view(*lead, hkv, d)
            heads = None
        if self.qk_norm == "head":
            q, k, heads = self.q_norm(q), self.k_norm(k), None
        elif self.qk_norm == "full":
            q = self.q_norm(q.reshape(*lead, hq * d)).view(*lead, hq, d)
            k = self.k_norm(k.reshape(*lead, hkv * d)).view(*lead, hkv, d)
            heads = None
        return q, k, v, heads

    def _kernel_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      heads: torch.Tensor | None) -> torch.Tensor:
        """The (..., hq + 2 hkv, D) input of the paged kernels, q pre-scaled for this layer."""
        if heads is not None and self.q_factor == 1.0:
            return heads
        if self.q_factor != 1.0:
            q = q * self.q_factor
        return torch.cat((q, k, v), dim=-2).contiguous()

    def kernel_serves(self, kv_len: int) -> bool:
        """Whether the paged C kernels compute this layer's decode attention for reads of
        `kv_len` positions: no softcap, full-width RoPE (or none), no window cut yet."""
        return self.softcap is None and not self.partial_rope and \
            (self.window is None or kv_len <= self.window)

    def forward(self, x: torch.Tensor, norm: nn.Module | None, ropes: Sequence[Rope],
                step: StepInputs, cache: PagedKVCache) -> torch.Tensor:
        """Attention over norm(x) (the norm runs inside the q/k/v matmul where it can)."""
        b, t, _ = x.shape
        rope = ropes[self.rope_id] if self.rope_id is not None else None
        hq, hkv = self.hq, self.hkv
        q, k, v, heads = self._split_heads(x, norm, (b, t))
        if t == 1 and step.kernel and self.qkv is not None and self.kernel_serves(step.kv_len):
            keys_all, values_all = cache.k[self.layer], cache.v[self.layer]
            rows = step.identity_rope if rope is None else \
                (rope[0].view(b, self.d), rope[1].view(b, self.d))
            kheads = self._kernel_heads(q, k, v, heads).view(b, hq + 2 * hkv, self.d)
            if rows is not None and paged_cache_serves(keys_all, values_all) and \
                    paged_attention_serves(kheads, *rows):
                out = paged_decode_step(kheads, hq, hkv, rows, keys_all, values_all,
                                        cache.block_size, step.tables_i32, step.positions_i32)
                return linear(out.view(b, 1, -1), self.o_proj)
        if rope is not None:
            if heads is not None and not self.partial_rope:  # q and k heads roped together
                qk = apply_rope(heads[:, :, :hq + hkv], *rope)
                q, k = qk[:, :, :hq], qk[:, :, hq:]
            else:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        cache.write(self.layer, step.blocks, step.offsets, k, v)
        keys, values = cache.gather(self.layer, step.tables, step.kv_len)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if t == 1:  # (B, 1, H*D) over gathered blocks
            bias = step.decode_bias(hkv, hq // hkv, q.dtype, self.window)
            out = self._decode_attention(q, keys, values, bias)
        else:  # (B, H, T, D) x (B, Hkv, L, D) -> (B, H, T, D)
            mask = step.mask_for(self.window)
            if self.softcap is None:
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), keys, values, attn_mask=mask, scale=self.scale,
                    enable_gqa=hq != hkv)
            else:
                out = self._capped_attention(q.transpose(1, 2), keys, values, mask)
            out = out.transpose(1, 2).reshape(b, t, hq * self.d)
        return linear(out, self.o_proj)

    def _softcapped(self, scores: torch.Tensor) -> torch.Tensor:
        assert self.softcap is not None
        return torch.tanh(scores / self.softcap) * self.softcap

    def _capped_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          mask: torch.Tensor | None) -> torch.Tensor:
        """Attention with Gemma 2's logit softcap (scores -> cap * tanh(scores / cap) before
        the mask), which SDPA has no option for. q (B, H, T, D), keys (B, Hkv, L, D)."""
        group = self.hq // self.hkv
        if group > 1:
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        scores = self._softcapped(q @ keys.transpose(-1, -2) * self.scale)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(values.dtype) @ values

    def _decode_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
        """One query per row as two batched matmuls over (row, kv head) pairs, the query heads
        of each kv head together: on CPU, SDPA's kernels cost milliseconds of setup per call
        for a single query. Scale and mask ride in the first matmul (`baddbmm` with an
        additive mask): the same values as a matmul, a multiply and a masked fill, in fewer
        ops (benchmarks/README.md has the figures)."""
        b, hkv, length, d = keys.shape
        g = self.hq // hkv
        qg = q.reshape(b * hkv, g, d)  # (B*Hkv, G, D): query heads grouped by kv head
        k_t = keys.reshape(b * hkv, length, d).transpose(1, 2)  # a view for contiguous slots
        if self.softcap is not None:
            scores = self._softcapped(torch.bmm(qg, k_t) * self.scale)
            scores = scores if bias is None else scores + bias
        elif bias is None:
            scores = torch.bmm(qg, k_t) * self.scale
        else:
            scores = torch.baddbmm(bias, qg, k_t, alpha=self.scale)  # (B*Hkv, G, L)
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = torch.bmm(probs, values.reshape(b * hkv, length, d))
        return out.view(b, 1, self.hq * d)  # (B, 1, H*D)

    def lone_step(self, x: torch.Tensor, norm: nn.Module | None, ropes: Sequence[Rope],
                  pos: int, seq: LoneInputs, cache: PagedKVCache) -> torch.Tensor:
        """`forward` for one sequence's one new token, x (1, H), with a fused q/k/v: the same
        ops on the same values (bit-for-bit equal output), minus the batch bookkeeping (index
        tensors, advanced indexing into the cache, masks), which is a tenth of a lone step.
        Where the model runs on nbserve's C kernels, the attention is one kernel call over
        the block table (the same values up to summation order; the cache gets the same k
        and v bit for bit)."""
        hq, hkv, d, qkv = self.hq, self.hkv, self.d, self.qkv
        assert qkv is not None  # lone steps run on fused q/k/v (DecoderModel._lone_ready)
        rope = ropes[self.rope_id] if self.rope_id is not None else None
        q, k, v, heads = self._split_heads(x, norm, ())
        keys, values = cache.k[self.layer], cache.v[self.layer]  # (blocks, Hkv, bs, D)
        if runs_on_kernel(qkv) and self.kernel_serves(pos + 1) and \
                paged_cache_serves(keys, values):
            rows = seq.identity_rope if rope is None else rope
            kheads = self._kernel_heads(q, k, v, heads)
            if rows is not None and paged_attention_serves(kheads, *rows):
                out = paged_lone_attention(kheads, hq, hkv, rows, keys, values,
                                           cache.block_size, seq.table_i32, pos, check=False)
                return linear(out, self.o_proj)
        if rope is not None:
            if heads is not None and not self.partial_rope:
                qk = apply_rope(heads[:hq + hkv], *rope)
                q, k = qk[:hq], qk[hq:]
            else:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        keys[seq.block, :, seq.offset] = k.to(keys.dtype)
        values[seq.block, :, seq.offset] = v.to(values.dtype)
        start = 0 if self.window is None else max(0, pos + 1 - self.window)
        k_all, v_all = cache.gather(self.layer, seq.table, pos + 1, start)  # the window's keys
        out = self._decode_attention(q[None], k_all.to(q.dtype), v_all.to(q.dtype),
                                     None)  # every key left is visible
        return linear(out.view(1, hq * d), self.o_proj)

    def holders(self, prefix: str) -> list[tuple[Linear | FusedProjection, list[str]]]:
        """The matmuls (fused where they are) with the names of their weights."""
        names = [f"{prefix}.{a}.weight" for a in ("q_proj", "k_proj", "v_proj")]
        qkv: list[tuple[Linear | FusedProjection, list[str]]] = \
            [(self.qkv, [self.qkv.source] if self.qkv.source else names)] \
            if self.qkv is not None else \
            [(self.q_proj, names[:1]), (self.k_proj, names[1:2]), (self.v_proj, names[2:])]
        return qkv + [(self.o_proj, [f"{prefix}.o_proj.weight"])]
