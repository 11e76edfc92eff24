"""nbserve's decoder-only transformer, written for serving; every native family runs on it.

It implements the StepModel protocol: token ids at explicit positions in, logits out, keys and
values kept in the blocks of a PagedKVCache, addressed by block tables. The architecture's
options come from a `DecoderConfig` (models/config.py), which each family file in
models/families/ fills in from its config.json; the defaults are Llama's. Parameter names are
Llama's Hugging Face names (`model.layers.3.self_attn.q_proj.weight`), so a Llama-family state
dict loads as it is, a family whose names differ renames them on the way in, and a
`transformers` model's tensors are adopted without a copy.

Fast paths (fused q/k/v and gate/up, the C kernels' matmuls and paged decode attention, the
lone-stream step) serve every layer whose options they implement; a layer with what they lack
(a sliding window past its width, a logit softcap, partial rotary) takes the torch path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu.kernels.build import kernels_available
from ..execution.decode_stack import DecodeStack
from ..execution.kv_cache import PagedKVCache
from ..execution.linear import (
    FusedProjection,
    gated_linear,
    linear,
    normed_linear,
)
from ..execution.paged_attention import (
    CACHE_DTYPES,
    paged_attention_serves,
    paged_cache_serves,
    paged_decode_step,
    paged_lone_attention,
)
from ..execution.static_decode import StaticDecode
from ..execution.weights import WeightFormats
from .base import PagedModel
from .config import DecoderConfig
from .dtypes import QUANTIZED_FORMATS
from .rope import RopeSpec, apply_rope

PAGED_BLOCK_SIZE = 32  # positions per block of a cache made by make_cache (the row convention)
ROPE_TABLE_MIN = 4096  # RoPE tables grow in powers of two from here, up to max_context

Rope = tuple[torch.Tensor, torch.Tensor] | None  # (cos, sin_signed) of a layer; None: no RoPE


def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    """Inverse frequencies of the model's first RoPE (float32), scaling applied."""
    return cfg.ropes[0].inv_freq()[0].float()


ACTIVATION = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu2": lambda x: F.relu(x).square(),
}


class RMSNorm(nn.Module):
    """RMSNorm; `offset` 1 for Gemma's, which scales by (1 + weight)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    @property
    def kernel_fusable(self) -> bool:
        """Whether the C kernel can run this norm inside a matmul (plain weight scaling)."""
        return not self.offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            w = self.weight if not self.offset else self.weight + self.offset
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        # 16-bit: normalise in float32 like the reference implementations, then scale
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma scales in float32, then rounds
            return (xf * (self.weight.float() + self.offset)).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def make_norm(cfg: DecoderConfig, dim: int) -> nn.Module:
    if cfg.norm == "layer":
        return nn.LayerNorm(dim, eps=cfg.rms_norm_eps, bias=cfg.norm_bias)
    return RMSNorm(dim, cfg.rms_norm_eps, cfg.norm_offset)


def _project(x: torch.Tensor, norm: nn.Module | None, layer: nn.Linear | FusedProjection
             ) -> torch.Tensor:
    """`layer(norm(x))`, the norm inside the matmul where it can; `layer(x)` without a norm."""
    return linear(x, layer) if norm is None else normed_linear(x, norm, layer)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.layer, self.hq, self.hkv, self.d = layer, hq, hkv, d
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, hq * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=bias)
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=cfg.o_bias)
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
        self.q_factor = self.scale * d ** 0.5  # the kernels scale by d ** -0.5: q is pre-scaled

    def _split_heads(self, x: torch.Tensor, norm: nn.Module | None, lead: tuple[int, ...]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q, k, v) of norm(x) (..., heads, D), q/k-normed where the model has it, and the
        fused heads (..., hq + 2 hkv, D) as they came out of the matmul when nothing changed
        them (the kernels' input), else None. `lead`: the leading shape of the heads
        ((B, T), or () for a lone step's one token)."""
        hq, hkv, d = self.hq, self.hkv, self.d
        if self.qkv is not None:
            heads = _project(x, norm, self.qkv).view(*lead, hq + 2 * hkv, d)
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
        if qkv.kernel is not None and self.kernel_serves(pos + 1) and \
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

    def holders(self, prefix: str) -> list[tuple[nn.Linear | FusedProjection, list[str]]]:
        """The matmuls (fused where they are) with the names of their weights."""
        names = [f"{prefix}.{a}.weight" for a in ("q_proj", "k_proj", "v_proj")]
        qkv: list[tuple[nn.Linear | FusedProjection, list[str]]] = \
            [(self.qkv, [self.qkv.source] if self.qkv.source else names)] \
            if self.qkv is not None else \
            [(self.q_proj, names[:1]), (self.k_proj, names[1:2]), (self.v_proj, names[2:])]
        return qkv + [(self.o_proj, [f"{prefix}.o_proj.weight"])]


class MLP(nn.Module):
    """A gated MLP (SwiGLU, Gemma's GeGLU: down(act(gate(x)) * up(x))) or a plain one
    (GPT-2, nanochat: down(act(up(x))))."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gated = cfg.gated_mlp
        if self.gated:
            self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.act_name = cfg.hidden_act
        self.act = ACTIVATION[cfg.hidden_act]
        self.gate_up: FusedProjection | None = None  # see DecoderModel.fuse_projections

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """The MLP of norm(x) (of x without a norm). With fused gate/up, the norm and the
        silu(gate) * up run inside the matmuls where the C kernel serves them."""
        if not self.gated:
            return linear(self.act(_project(x, norm, self.up_proj)), self.down_proj)
        if self.gate_up is not None:
            gate_up = _project(x, norm, self.gate_up)
            if self.act_name == "silu":
                return gated_linear(gate_up, self.down_proj)
            half = gate_up.shape[-1] // 2
            return linear(self.act(gate_up[..., :half]) * gate_up[..., half:], self.down_proj)
        x = x if norm is None else norm(x)
        return linear(self.act(linear(x, self.gate_proj)) * linear(x, self.up_proj),
                      self.down_proj)

    def fuse(self, rebuild: bool = False) -> None:
        if self.gated and (rebuild or self.gate_up is None):
            self.gate_up = FusedProjection(self, "gate_up", [self.gate_proj, self.up_proj])

    def holders(self, prefix: str) -> list[tuple[nn.Linear | FusedProjection, list[str]]]:
        down = (self.down_proj, [f"{prefix}.down_proj.weight"])
        if not self.gated:
            return [(self.up_proj, [f"{prefix}.up_proj.weight"]), down]
        names = [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"]
        if self.gate_up is not None:
            return [(self.gate_up, [self.gate_up.source] if self.gate_up.source else names),
                    down]
        return [(self.gate_proj, names[:1]), (self.up_proj, names[1:]), down]


def make_mlp(cfg: DecoderConfig, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: a mixture of experts where `cfg.moe` puts one (models/moe.py),
    else the dense MLP. Either offers forward(x, norm), fuse(rebuild), holders(prefix)."""
    if cfg.moe is not None:  # the experts' config makes them (the decoder imports no moe)
        return cfg.moe.make_mlp(cfg, layer)
    return MLP(cfg)


class DecoderLayer(nn.Module):
    """Attention and MLP with their norms where `cfg.norm_layout` puts them: "pre" (Llama:
    input_layernorm before attention, post_attention_layernorm before the MLP), "sandwich"
    (Gemma: input_layernorm / post_attention_layernorm around attention,
    pre_feedforward_layernorm / post_feedforward_layernorm around the MLP), "post" (OLMo 2:
    post_attention_layernorm and post_feedforward_layernorm after each)."""

    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = make_mlp(cfg, layer)
        h = cfg.hidden_size
        self.layout = cfg.norm_layout
        if self.layout in ("pre", "sandwich"):
            self.input_layernorm = make_norm(cfg, h)
        self.post_attention_layernorm = make_norm(cfg, h)
        if self.layout == "sandwich":
            self.pre_feedforward_layernorm = make_norm(cfg, h)
        if self.layout in ("sandwich", "post"):
            self.post_feedforward_layernorm = make_norm(cfg, h)

    def _norms(self) -> tuple[Any, Any, Any, Any]:
        """(before attention, after it, before the MLP, after it); None where there is none."""
        if self.layout == "pre":
            return self.input_layernorm, None, self.post_attention_layernorm, None
        if self.layout == "sandwich":
            return (self.input_layernorm, self.post_attention_layernorm,
                    self.pre_feedforward_layernorm, self.post_feedforward_layernorm)
        return None, self.post_attention_layernorm, None, self.post_feedforward_layernorm

    def forward(self, x, ropes, step, cache):
        attn_in, attn_out, mlp_in, mlp_out = self._norms()
        h = self.self_attn(x, attn_in, ropes, step, cache)
        x = x + (h if attn_out is None else attn_out(h))
        h = self.mlp(x, mlp_in)
        return x + (h if mlp_out is None else mlp_out(h))

    def lone_step(self, x, ropes, pos: int, seq, cache):  # see Attention.lone_step
        attn_in, attn_out, mlp_in, mlp_out = self._norms()
        h = self.self_attn.lone_step(x, attn_in, ropes, pos, seq, cache)
        x = x + (h if attn_out is None else attn_out(h))
        h = self.mlp(x, mlp_in)
        return x + (h if mlp_out is None else mlp_out(h))


class Backbone(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        # built on meta and filled from a checkpoint: `_weight` skips the random init, whose
        # meta version imports torch._dynamo (seconds, and tens of MB for the process's life)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        if cfg.learned_positions:
            n = cfg.max_position_embeddings
            self.embed_positions = nn.Embedding(n, cfg.hidden_size,
                                                _weight=torch.empty(n, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = make_norm(cfg, cfg.hidden_size)

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """`layers` as the type checker should see it (a ModuleList holds plain Modules)."""
        return cast("Sequence[DecoderLayer]", self.layers)


def padded_tables(tables: torch.Tensor, kv_len: int, cache: PagedKVCache) -> torch.Tensor:
    """Block tables (B, S) wide enough for reads of `kv_len` positions: positions past every
    row's blocks read the pad block."""
    width = -(-kv_len // cache.block_size)
    if tables.shape[1] >= width:
        return tables
    pad = tables.new_full((tables.shape[0], width - tables.shape[1]), cache.pad_block)
    return torch.cat((tables, pad), dim=1)


class StepInputs:
    """Per-forward values shared by every layer: where each token's keys and values go
    (block, offset), the block tables, the masks (causal, and per sliding window), the cache
    read length."""

    __slots__ = ("tables", "positions", "kv_len", "mask", "blocks", "offsets", "kernel",
                 "tables_i32", "positions_i32", "identity_rope", "_bias", "_windowed")

    def __init__(self, positions: torch.Tensor, tables: torch.Tensor, max_pos: int,
                 cache: PagedKVCache, kernel: bool, padded: bool = False,
                 identity_rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        """`padded`: the read length `max_pos` + 1 may pass every row's position (a length
        rounded up), so even a lone row needs its mask. `identity_rope`: rope rows (B, D)
        that leave heads as they are, for the kernels at layers without RoPE."""
        self.positions = positions
        self.kv_len = max_pos + 1
        bs = cache.block_size
        tables = padded_tables(tables, self.kv_len, cache)
        self.tables = tables
        self.blocks = tables.gather(1, torch.div(positions, bs, rounding_mode="floor"))
        self.offsets = positions % bs
        b, t = positions.shape
        self.kernel = kernel and t == 1
        if self.kernel:
            self.tables_i32 = tables.to(torch.int32).contiguous()
            self.positions_i32 = positions[:, 0].to(torch.int32).contiguous()
        self.identity_rope = identity_rope
        if b == 1 and t == 1 and not padded:
            self.mask = None  # one query at the last position: every cached key is visible
        else:  # key j is visible to the query at position p iff j <= p
            keys = torch.arange(self.kv_len, device=positions.device)
            self.mask = (keys[None, None, None, :] <= positions[:, None, :, None])  # (B,1,T,L)
        self._bias: dict[int | None, torch.Tensor | None] = {}
        self._windowed: dict[int, torch.Tensor] = {}

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The mask of a layer with this sliding window (None: global), (B, 1, T, L); None
        when every key is visible. Before the window's width is reached it is the causal one."""
        if window is None or self.kv_len <= window:
            return self.mask
        if window not in self._windowed:
            keys = torch.arange(self.kv_len, device=self.positions.device)
            pos = self.positions[:, None, :, None]
            self._windowed[window] = (keys[None, None, None, :] <= pos) & \
                (keys[None, None, None, :] > pos - window)
        return self._windowed[window]

    def decode_bias(self, kv_heads: int, group: int, dtype: torch.dtype,
                    window: int | None = None) -> torch.Tensor | None:
        """The mask of a decode step (T = 1) as 0 / -inf, (B * kv_heads, group, L), for
        `baddbmm`; made once per step and window, shared by the layers. None when all keys
        are visible."""
        if window is not None and self.kv_len <= window:
            window = None
        if window not in self._bias:
            mask = self.mask_for(window)
            if mask is None:
                self._bias[window] = None
            else:
                b, _, _, length = mask.shape
                bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
                bias.masked_fill_(~mask, float("-inf"))
                self._bias[window] = bias.expand(b, kv_heads, group, length).reshape(
                    b * kv_heads, group, length)
        return self._bias[window]


class LoneInputs:
    """Where a lone decode step's token goes: its block table (as an index and as the C
    kernel's int32 array), the block and offset of its position."""

    __slots__ = ("table", "table_i32", "block", "offset", "identity_rope")

    def __init__(self, table: torch.Tensor, pos: int, block_size: int,
                 identity_rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.table = table[None, :]  # (1, blocks)
        self.table_i32 = table.to(torch.int32).contiguous()
        self.block = int(table[pos // block_size])
        self.offset = pos % block_size
        self.identity_rope = identity_rope


class DecoderModel(WeightFormats, PagedModel):
    """The StepModel of every native family. Build it with `build_decoder`."""

    accepts_padded_rows = True  # causal masking by position: pads past a row's end are inert

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.vocab_size = cfg.vocab_size
        self.max_context = cfg.max_position_embeddings
        self._rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._init_weight_formats()

    def fuse_projections(self, rebuild: bool = False) -> None:
        """Run q/k/v and gate/up as one matmul each (`FusedProjection`): same parameters (as
        views), same results, fewer ops per token. Loaders do it; adopted models, whose tensors
        must stay the caller's, do not (unless they come fused: then it is free).
        `rebuild`: fuse again layers already fused, e.g. after `.to()` or a deep copy moved
        the views and the fused tensor apart (two copies)."""
        for layer in self.model.decoder_layers:
            att = layer.self_attn
            if rebuild or att.qkv is None:
                att.qkv = FusedProjection(att, "qkv", [att.q_proj, att.k_proj, att.v_proj])
            fuse: Any = getattr(layer.mlp, "fuse", None)
            if fuse is not None:
                fuse(rebuild)

    def refresh_fused(self) -> None:
        if any(layer.self_attn.qkv is not None for layer in self.model.decoder_layers):
            self.fuse_projections(rebuild=True)

    def embedding_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    def _named_holders(self) -> list[tuple[nn.Linear | FusedProjection, list[str]]]:
        """What runs each layer matmul (fused projections where there are, else the Linears),
        then the LM head, each with the names of the parameters it multiplies by."""
        out: list[tuple[nn.Linear | FusedProjection, list[str]]] = []
        for i, layer in enumerate(self.model.decoder_layers):
            out += layer.self_attn.holders(f"model.layers.{i}.self_attn")
            mlp: Any = layer.mlp  # an MLP, or a mixture of experts with the same interface
            out += mlp.holders(f"model.layers.{i}.mlp")
        return out + [(self.lm_head, ["lm_head.weight"])]

    def make_paged_cache(self, n_blocks: int, block_size: int,
                         dtype: torch.dtype | None = None) -> PagedKVCache:
        """A paged cache of `n_blocks` blocks (`execution.kv_cache`), in `dtype` (default:
        `default_kv_dtype`); forward then takes block tables (B, blocks) where slots were."""
        c = self.config
        return PagedKVCache(c.num_hidden_layers, n_blocks, block_size, c.num_key_value_heads,
                            c.head_dim, self.device, dtype or self.default_kv_dtype)

    @property
    def default_kv_dtype(self) -> torch.dtype:
        """The paged cache's dtype when the engine is not told one (`kv_dtype=None`):
        float16 for a quantized CPU model (dtype="quantized", a GGUF's default), whose
        attention runs in the C kernels, as fast over float16 as over float32, and which kept
        every reference answer of the default model (benchmarks/README.md); half the memory
        per token, as llama.cpp's default. Else the model's dtype, so float32 stays exact.
        `kv_dtype="float32"` keeps a quantized model's cache in float32."""
        if self.weight_format in QUANTIZED_FORMATS and self._paged_kernel:
            return torch.float16
        return self.dtype

    def make_cache(self, max_batch: int, max_context: int) -> PagedKVCache:
        """A paged cache laid out as `max_batch` rows of `max_context` positions, for callers
        that address sequences by row ("slot"): forward then also takes slots (B,)."""
        bs = PAGED_BLOCK_SIZE
        per_row = -(-max_context // bs)
        c = self.config
        return PagedKVCache(c.num_hidden_layers, max_batch * per_row, bs,
                            c.num_key_value_heads, c.head_dim, self.device, self.dtype,
                            rows=max_batch)

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes one cached token takes (keys and values of every layer), in `dtype`
        (default: `default_kv_dtype`)."""
        c = self.config
        item = torch.empty((), dtype=dtype or self.default_kv_dtype).element_size()
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * item

    # ------------------------------------------------------------------ RoPE tables

    def _rope_table(self, index: int, regime: Any, length: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) of RoPE `index` in `regime`, at least `length` positions: grown in
        powers of two (a 128k-context model's full tables would be hundreds of MB)."""
        key = (index, regime, self.device, self.dtype)
        have = self._rope_cache.get(key)
        if have is None or have[0].shape[0] < length:
            size = max(ROPE_TABLE_MIN, 1 << max(length - 1, 1).bit_length())
            size = max(length, min(size, self.max_context))
            if len(self._rope_cache) > 16:  # dynamic NTK makes one per length: keep a few
                self._rope_cache = {k: v for k, v in self._rope_cache.items() if k[1] is None}
            spec: RopeSpec = self.config.ropes[index]
            have = spec.table(size, regime, self.device, self.dtype)
            self._rope_cache[key] = have
        return have

    def _batch_ropes(self, positions: torch.Tensor, kv_len: int) -> list[Rope]:
        """Each RoPE's (cos, sin_signed) rows (B, T, 1, rotary) for `positions` (B, T); a RoPE
        whose frequencies depend on the length (longrope, dynamic) takes each row's own."""
        out: list[Rope] = []
        for i, spec in enumerate(self.config.ropes):
            if spec.regime(kv_len) is None and spec.regime(1) is None:
                cos, sin = self._rope_table(i, None, kv_len)
                out.append((cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)))
                continue
            lengths = (positions.max(dim=1).values + 1).tolist()
            rows = []
            for b, n in enumerate(lengths):
                cos, sin = self._rope_table(i, spec.regime(int(n)), int(n))
                rows.append((cos[positions[b]], sin[positions[b]]))
            out.append((torch.stack([r[0] for r in rows]).unsqueeze(2),
                        torch.stack([r[1] for r in rows]).unsqueeze(2)))
        return out

    def _lone_ropes(self, pos: int) -> list[Rope]:
        out: list[Rope] = []
        for i, spec in enumerate(self.config.ropes):
            cos, sin = self._rope_table(i, spec.regime(pos + 1), pos + 1)
            out.append((cos[pos], sin[pos]))
        return out

    def _identity_rope(self, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rope rows that change nothing (cos 1, sin 0), for the kernels at layers without
        RoPE; None when every layer has one."""
        if all(r is not None for r in self.config.layer_rope):
            return None
        d = self.config.head_dim
        return (torch.ones(rows, d, dtype=self.dtype, device=self.device),
                torch.zeros(rows, d, dtype=self.dtype, device=self.device))

    # ------------------------------------------------------------------ forward

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                cache: PagedKVCache, logit_index: torch.Tensor | None = None,
                max_pos: int | None = None, contiguous_from: int | None = None) -> torch.Tensor:
        """ids, positions (B, T), block tables (B, blocks) -> logits (B, T, V), or (B, V)
        with logit_index. Rows of a cache made by `make_cache` may be given as slots (B,).

        `max_pos` (the largest position, if the caller knows it: the engine does) saves a
        device sync, and lets a lone decode step (B = T = 1) take `_lone_step`.
        `contiguous_from` is accepted for callers of the row convention and not needed.
        """
        if tables.dim() == 1:
            tables = cache.row_tables(tables)
        lone = max_pos is not None
        if max_pos is None:
            max_pos = int(positions.max())
        if ids.shape == (1, 1) and lone and self._lone_ready:
            return self._lone_step(ids, max_pos, tables[0], cache, logit_index is None)
        kernel = self._paged_kernel and cache.dtype in CACHE_DTYPES
        return self.batched_step(ids, positions, tables, cache, max_pos + 1, logit_index, kernel)

    def batched_step(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                     cache: PagedKVCache, kv_len: int, logit_index: torch.Tensor | None = None,
                     kernel: bool = False, padded: bool = False) -> torch.Tensor:
        """`forward` for a batch (never the lone-step shortcut), attention reading the first
        `kv_len` positions of every table row: the largest position + 1, or with `padded`
        more, masked by position (`StaticDecode` rounds it up, to run at fixed shapes).
        `kernel`: decode attention in the C kernels (CPU)."""
        identity = self._identity_rope(ids.shape[0]) if kernel and ids.shape[1] == 1 else None
        ropes = self._batch_ropes(positions, kv_len)
        x = self._embed(ids, positions)  # (B, T, H)
        stacked = self._stacked_batch_step(x, positions, tables, cache, kv_len, ropes,
                                           identity) if kernel and ids.shape[1] == 1 else None
        if stacked is not None:
            x = stacked
        else:
            step = StepInputs(positions, tables, kv_len - 1, cache, kernel, padded, identity)
            for layer in self.model.decoder_layers:
                x = layer(x, ropes, step, cache)
        if logit_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logit_index]  # (B, H)
        return self._logits(x)

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Token embeddings, scaled (Gemma) and with learned positions added (GPT-2)."""
        x = self.embed(ids)
        scale = self.config.embed_scale
        if scale is not None:  # in the model's dtype, as the reference rounds it
            x = x * torch.tensor(scale, dtype=x.dtype)
        if self.config.learned_positions:
            assert positions is not None
            x = x + F.embedding(positions, self.model.embed_positions.weight)
        return x

    def make_static_decode(self, cache: PagedKVCache, max_batch: int, max_context: int,
                           capture: bool) -> StaticDecode | None:
        """Decode steps at bucketed shapes over `cache` (`execution.static_decode`), captured as
        CUDA graphs where `capture` (on a CUDA model), else run eagerly. None for a model whose
        RoPE depends on the length (its tables are chosen per step)."""
        if any(s.regime(1) is not None or s.regime(max_context) is not None
               for s in self.config.ropes):
            return None
        for i in range(len(self.config.ropes)):  # full tables: a captured graph keeps them
            self._rope_table(i, None, max_context)
        return StaticDecode(self, cache, max_batch, max_context, capture)

    @property
    def _paged_kernel(self) -> bool:
        """Whether decode attention runs in nbserve's C kernel: where the matmuls do."""
        qkv = self.model.decoder_layers[0].self_attn.qkv
        return qkv is not None and qkv.kernel is not None

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head over the final norm of the hidden states, as float32 (softcapped where
        the model caps its logits)."""
        if self._head_t is not None and x.numel() == x.shape[-1]:  # one row: see above
            logits = (self.model.norm(x) @ self._head_t).float()
        else:
            logits = normed_linear(x, self.model.norm, self.lm_head).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @property
    def _lone_ready(self) -> bool:
        """Whether `_lone_step` can serve: it is written for fused q/k/v (what loaders make)."""
        return self.model.decoder_layers[0].self_attn.qkv is not None

    def _lone_step(self, ids: torch.Tensor, pos: int, table: torch.Tensor,
                   cache: PagedKVCache, keep_time_dim: bool) -> torch.Tensor:
        """`forward` for a lone decode step (B = T = 1, the single-stream case): the same
        values, through `DecoderLayer.lone_step`, without the batch bookkeeping that costs a
        noticeable share of a one-token step (benchmarks/README.md)."""
        ropes = self._lone_ropes(pos)
        learned = self.config.learned_positions  # a position tensor only where it is read
        x = self._embed(ids.view(1), ids.new_full((1,), pos) if learned else None)  # (1, H)
        identity = self._identity_rope(1)
        seq = LoneInputs(table, pos, cache.block_size,
                         None if identity is None else (identity[0][0], identity[1][0]))
        stacked = self._stacked_lone_step(x, ropes, pos, seq, cache)
        if stacked is not None:
            x = stacked
        else:
            for layer in self.model.decoder_layers:
                x = layer.lone_step(x, ropes, pos, seq, cache)
        logits = self._logits(x)
        return logits.view(1, 1, -1) if keep_time_dim else logits

    def _stack_of_layers(self) -> DecodeStack | None:
        """The model's layers as one C call (models/decode_stack.py), or None where they do
        not fit it; decided once per model (its shape does not change), its pointers checked
        at every step."""
        stack = self.__dict__.get("_decode_stack", False)
        if stack is False:
            stack = DecodeStack.for_model(self)
            self.__dict__["_decode_stack"] = stack
        return stack

    def _stacked_lone_step(self, x: torch.Tensor, ropes: Sequence[Rope], pos: int,
                           seq: LoneInputs, cache: PagedKVCache) -> torch.Tensor | None:
        """Every layer's lone step in one C call where the model's layers and this step
        allow it (the same values); None: run them one by one."""
        stack = self._stack_of_layers()
        if stack is None or not stack.serves(pos, cache):
            return None
        rope = seq.identity_rope if stack.rope_id is None else ropes[stack.rope_id]
        if rope is None:
            return None
        rows = (rope[0].view(1, -1), rope[1].view(1, -1))
        return stack(x, ctypes.c_int32(pos), seq.table_i32, cache, rows)

    def _stacked_batch_step(self, x: torch.Tensor, positions: torch.Tensor,
                            tables: torch.Tensor, cache: PagedKVCache, kv_len: int,
                            ropes: Sequence[Rope],
                            identity: tuple[torch.Tensor, torch.Tensor] | None
                            ) -> torch.Tensor | None:
        """A decode batch's layers (x (B, 1, H), one token a row) in one C call, or None."""
        stack = self._stack_of_layers()
        if stack is None or not stack.serves(kv_len - 1, cache):
            return None
        b, d = x.shape[0], self.config.head_dim
        rope = identity if stack.rope_id is None else \
            (ropes[stack.rope_id][0].reshape(b, d), ropes[stack.rope_id][1].reshape(b, d))
        if rope is None:
            return None
        tables = padded_tables(tables, kv_len, cache)
        out = stack(x, positions[:, 0].to(torch.int32).contiguous(),
                    tables.to(torch.int32).contiguous(), cache,
                    (rope[0].contiguous(), rope[1].contiguous()))
        return None if out is None else out.view(b, 1, -1)


LlamaModel = DecoderModel  # the Llama family is the decoder with its defaults


PREFUSED = {"self_attn.qkv_proj": ("self_attn", "qkv", ("q_proj", "k_proj", "v_proj")),
            "mlp.gate_up_proj": ("mlp", "gate_up", ("gate_proj", "up_proj"))}


def build_decoder(cfg: DecoderConfig, tensors: Iterable[tuple[str, torch.Tensor]],
                  device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  transposed_head: bool | None = None, fuse: bool = True,
                  pack: bool | None = None, float_kernel: bool | None = None) -> DecoderModel:
    """Create a DecoderModel from Llama-named tensors, moving each to (device, dtype) as it
    arrives. Tensors fused already (`self_attn.qkv_proj`, `mlp.gate_up_proj`: q|k|v and
    gate|up rows, as Phi-3 keeps them) become the fused projection, the layers' weights
    views of it, whatever `fuse` says: no copy.

    `fuse` concatenates q/k/v and gate/up (`DecoderModel.fuse_projections`); `pack` (default: on
    for CPU float32 where torch has oneDNN and the copies take at most a quarter of the RAM,
    `packing_affordable`) adds the faster packed copies of
    `DecoderModel.pack_weights`; `transposed_head` (default: on for CPU float32 when not packed)
    keeps the LM-head copy of `DecoderModel.use_transposed_head`. Pass False to all three to
    share every tensor with the caller. `float_kernel` (default: on for CPU float32 where the C
    kernel builds, see `kernels_available`) is `DecoderModel.use_float_kernel`; it copies nothing.

    Raises ValueError naming unknown or missing tensors.
    """
    with torch.device("meta"):
        model = DecoderModel(cfg)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    fused: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        prefused = _prefused_key(name)
        if prefused is not None:
            fused.setdefault(prefused[0], {})[prefused[1]] = tensor.to(device=device,
                                                                       dtype=dtype)
            continue
        if name not in params:
            raise ValueError(f"unexpected tensor {name!r} for {cfg.architecture} ({cfg.name})")
        want = params[name].shape
        if tuple(tensor.shape) != tuple(want):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(want)} from the config of {cfg.name}")
        _set_param(model, name, tensor.to(device=device, dtype=dtype))
        seen.add(name)
    for (layer, what), parts in fused.items():
        seen |= _set_prefused(model, cfg, layer, what, parts)
    if "lm_head.weight" not in seen:
        model.lm_head.weight = model.model.embed_tokens.weight
        seen.add("lm_head.weight")
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"checkpoint {cfg.name} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.eval()
    model.requires_grad_(False)
    if fuse:
        model.fuse_projections()
    if pack is None:
        pack = model.packing_pays()
    if pack:
        model.pack_weights()
    if transposed_head is None:
        transposed_head = not pack and model.device.type == "cpu" and dtype == torch.float32
    if transposed_head:
        model.use_transposed_head()
    if float_kernel is None:
        float_kernel = model.device.type == "cpu" and dtype == torch.float32 and kernels_available()
    if float_kernel:
        model.use_float_kernel()
    return model


build_llama = build_decoder


def _prefused_key(name: str) -> tuple[tuple[int, str], str] | None:
    """((layer, 'self_attn.qkv_proj' | 'mlp.gate_up_proj'), 'weight' | 'bias') for a fused
    tensor's name, else None."""
    parts = name.split(".")
    if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        key = f"{parts[3]}.{parts[4]}"
        if key in PREFUSED and parts[5] in ("weight", "bias"):
            return (int(parts[2]), key), parts[5]
    return None


def _set_prefused(model: DecoderModel, cfg: DecoderConfig, layer: int, what: str,
                  parts: dict[str, torch.Tensor]) -> set[str]:
    """Install a fused weight (and bias) as the fused projection of `layer`; the names of the
    parameters it provides."""
    owner_name, attr, names = PREFUSED[what]
    owner = getattr(model.model.decoder_layers[layer], owner_name)
    layers = [getattr(owner, n) for n in names]
    prefix = f"model.layers.{layer}.{owner_name}"
    rows = sum(lin.out_features for lin in layers)
    weight = parts.get("weight")
    if weight is None or tuple(weight.shape) != (rows, layers[0].in_features):
        raise ValueError(f"tensor {prefix}.{what.split('.')[1]}.weight of {cfg.name} has shape "
                         f"{None if weight is None else tuple(weight.shape)}, expected "
                         f"{(rows, layers[0].in_features)}")
    bias = parts.get("bias")
    if (bias is None) != (layers[0].bias is None):
        raise ValueError(f"{prefix}.{what.split('.')[1]}: the config and the checkpoint "
                         "disagree on whether it has a bias")
    projection = FusedProjection.over(owner, attr, layers, weight, bias,
                                      source=f"{prefix}.{what.split('.')[1]}.weight")
    if owner_name == "self_attn":
        owner.qkv = projection
    else:
        owner.gate_up = projection
    provided = {f"{prefix}.{n}.weight" for n in names}
    return provided | ({f"{prefix}.{n}.bias" for n in names} if bias is not None else set())


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    setattr(owner, attr, nn.Parameter(value, requires_grad=False))
