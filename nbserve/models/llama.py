"""Llama-family transformer written for serving (Llama 2/3, Mistral, Qwen2, SmolLM).

It implements the StepModel protocol: token ids at explicit positions in, logits out, keys and
values kept in the blocks of a PagedKVCache, addressed by block tables. Parameter names mirror
Hugging Face's, so a HF state dict loads as it is and a `transformers` model's tensors can be
adopted without a copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu.kernels.build import kernels_available
from .config import LlamaConfig
from .kv_cache import PagedKVCache
from .linear import (
    FusedProjection,
    gated_linear,
    linear,
    normed_linear,
)
from .paged_attention import (
    CACHE_DTYPES,
    paged_attention_serves,
    paged_cache_serves,
    paged_decode_step,
    paged_lone_attention,
)
from .static_decode import StaticDecode
from .weights import WeightFormats

PAGED_BLOCK_SIZE = 32  # positions per block of a cache made by make_cache (the row convention)


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,), with Llama-3 scaling applied when the config asks for it."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = cfg.rope_scaling
    if sc:  # Llama-3: slow down low frequencies, keep high ones, blend in between
        factor = sc["factor"]
        low, high = sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old_ctx = sc.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv = torch.where(medium, blended, scaled)
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (..., D): x * cos + rotate_half(x) * sin, where rotate_half(x) =
    [-x2, x1]. Written as x * cos + [x2, x1] * [-sin, sin] (`sin_signed`, one roll): the
    same values bit for bit (only signs move), in 4 ops instead of 6."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.layer, self.hq, self.hkv, self.d = layer, hq, hkv, d
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, hq * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=bias)
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=False)
        self.qkv: FusedProjection | None = None  # see LlamaModel.fuse_projections

    def forward(self, x: torch.Tensor, norm: RMSNorm, rope: tuple[torch.Tensor, torch.Tensor],
                step: StepInputs, cache: PagedKVCache) -> torch.Tensor:
        """Attention over norm(x) (the norm runs inside the q/k/v matmul where it can)."""
        b, t, _ = x.shape
        cos, sin_signed = rope  # (B, T, 1, D)
        hq, hkv = self.hq, self.hkv
        if self.qkv is not None:  # one matmul; rope on q and k heads together
            heads = normed_linear(x, norm, self.qkv).view(b, t, hq + 2 * hkv, self.d)
            if t == 1 and step.kernel:  # rope, cache write and attention in one kernel call
                keys_all, values_all = cache.k[self.layer], cache.v[self.layer]
                rows = (cos.view(b, self.d), sin_signed.view(b, self.d))
                if paged_cache_serves(keys_all, values_all) and \
                        paged_attention_serves(heads, *rows):
                    out = paged_decode_step(heads.view(b, hq + 2 * hkv, self.d), hq, hkv, rows,
                                            keys_all, values_all, cache.block_size,
                                            step.tables_i32, step.positions_i32)
                    return linear(out.view(b, 1, -1), self.o_proj)
            qk = apply_rope(heads[:, :, :hq + hkv], cos, sin_signed)
            q, k, v = qk[:, :, :hq], qk[:, :, hq:], heads[:, :, hq + hkv:]
        else:
            x = norm(x)
            q = apply_rope(linear(x, self.q_proj).view(b, t, hq, self.d), cos, sin_signed)
            k = apply_rope(linear(x, self.k_proj).view(b, t, hkv, self.d), cos, sin_signed)
            v = linear(x, self.v_proj).view(b, t, hkv, self.d)
        cache.write(self.layer, step.blocks, step.offsets, k, v)
        if t == 1:  # (B, 1, H*D) over gathered blocks
            keys, values = cache.gather(self.layer, step.tables, step.kv_len)
            bias = step.decode_bias(hkv, hq // hkv, q.dtype)
            out = self._decode_attention(q, keys.to(q.dtype), values.to(q.dtype), bias)
        else:  # (B, H, T, D) x (B, Hkv, L, D) -> (B, H, T, D)
            keys, values = cache.gather(self.layer, step.tables, step.kv_len)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), attn_mask=step.mask,
                enable_gqa=self.hq != self.hkv).transpose(1, 2).reshape(b, t, self.hq * self.d)
        return linear(out, self.o_proj)

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
        if bias is None:
            scores = torch.bmm(qg, k_t) * (d ** -0.5)
        else:
            scores = torch.baddbmm(bias, qg, k_t, alpha=d ** -0.5)  # (B*Hkv, G, L)
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = torch.bmm(probs, values.reshape(b * hkv, length, d))
        return out.view(b, 1, self.hq * d)  # (B, 1, H*D)

    def lone_step(self, x: torch.Tensor, norm: RMSNorm, rope: tuple[torch.Tensor, torch.Tensor],
                  pos: int, seq: LoneInputs, cache: PagedKVCache) -> torch.Tensor:
        """`forward` for one sequence's one new token, x (1, H), with a fused q/k/v: the same
        ops on the same values (bit-for-bit equal output), minus the batch bookkeeping (index
        tensors, advanced indexing into the cache, masks), which is a tenth of a lone step.
        Where the model runs on nbserve's C kernels, the attention is one kernel call over
        the block table (the same values up to summation order; the cache gets the same k
        and v bit for bit)."""
        hq, hkv, d, qkv = self.hq, self.hkv, self.d, self.qkv
        assert qkv is not None  # lone steps run on fused q/k/v (LlamaModel._lone_ready)
        heads = normed_linear(x, norm, qkv).view(hq + 2 * hkv, d)
        keys, values = cache.k[self.layer], cache.v[self.layer]  # (blocks, Hkv, bs, D)
        if qkv.kernel is not None and paged_attention_serves(heads, *rope) and \
                paged_cache_serves(keys, values):
            out = paged_lone_attention(heads, hq, hkv, rope, keys, values, cache.block_size,
                                       seq.table_i32, pos, check=False)
            return linear(out, self.o_proj)
        qk = apply_rope(heads[:hq + hkv], *rope)
        keys[seq.block, :, seq.offset] = qk[hq:].to(keys.dtype)
        values[seq.block, :, seq.offset] = heads[hq + hkv:].to(values.dtype)
        k_all, v_all = cache.gather(self.layer, seq.table, pos + 1)
        out = self._decode_attention(qk[None, :hq], k_all.to(qk.dtype), v_all.to(qk.dtype),
                                     None)  # all keys visible
        return linear(out.view(1, hq * d), self.o_proj)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up: FusedProjection | None = None  # see LlamaModel.fuse_projections

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """The MLP of norm(x) (of x without a norm). With fused gate/up, the norm and the
        silu(gate) * up run inside the matmuls where the C kernel serves them."""
        if self.gate_up is not None:
            gate_up = linear(x, self.gate_up) if norm is None else normed_linear(x, norm,
                                                                                 self.gate_up)
            return gated_linear(gate_up, self.down_proj)
        x = x if norm is None else norm(x)
        return linear(F.silu(linear(x, self.gate_proj)) * linear(x, self.up_proj),
                      self.down_proj)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # 16-bit: normalise in float32 like the reference implementation, then scale
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, step, cache):
        x = x + self.self_attn(x, self.input_layernorm, rope, step, cache)
        return x + self.mlp(x, self.post_attention_layernorm)

    def lone_step(self, x, rope, pos: int, seq, cache):  # see Attention.lone_step
        x = x + self.self_attn.lone_step(x, self.input_layernorm, rope, pos, seq, cache)
        return x + self.mlp(x, self.post_attention_layernorm)


class Backbone(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        # built on meta and filled from a checkpoint: `_weight` skips the random init, whose
        # meta version imports torch._dynamo (seconds, and tens of MB for the process's life)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """`layers` as the type checker should see it (a ModuleList holds plain Modules)."""
        return cast("Sequence[DecoderLayer]", self.layers)


class StepInputs:
    """Per-forward values shared by every layer: where each token's keys and values go
    (block, offset), the block tables, the mask, the cache read length."""

    __slots__ = ("tables", "positions", "kv_len", "mask", "blocks", "offsets", "kernel",
                 "tables_i32", "positions_i32", "_bias")

    def __init__(self, positions: torch.Tensor, tables: torch.Tensor, max_pos: int,
                 cache: PagedKVCache, kernel: bool, padded: bool = False):
        """`padded`: the read length `max_pos` + 1 may pass every row's position (a length
        rounded up), so even a lone row needs its mask."""
        self.positions = positions
        self.kv_len = max_pos + 1
        bs = cache.block_size
        width = -(-self.kv_len // bs)
        if tables.shape[1] < width:  # pad positions past every row's blocks: the pad block
            pad = tables.new_full((tables.shape[0], width - tables.shape[1]), cache.pad_block)
            tables = torch.cat((tables, pad), dim=1)
        self.tables = tables
        self.blocks = tables.gather(1, torch.div(positions, bs, rounding_mode="floor"))
        self.offsets = positions % bs
        b, t = positions.shape
        self.kernel = kernel and t == 1
        if self.kernel:
            self.tables_i32 = tables.to(torch.int32).contiguous()
            self.positions_i32 = positions[:, 0].to(torch.int32).contiguous()
        if b == 1 and t == 1 and not padded:
            self.mask = None  # one query at the last position: every cached key is visible
        else:  # key j is visible to the query at position p iff j <= p
            keys = torch.arange(self.kv_len, device=positions.device)
            self.mask = (keys[None, None, None, :] <= positions[:, None, :, None])  # (B,1,T,L)
        self._bias: torch.Tensor | None = None

    def decode_bias(self, kv_heads: int, group: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask of a decode step (T = 1) as 0 / -inf, (B * kv_heads, group, L), for
        `baddbmm`; made once per step, shared by every layer. None when all keys are visible."""
        if self.mask is None:
            return None
        if self._bias is None:
            b, _, _, length = self.mask.shape
            bias = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            bias.masked_fill_(~self.mask, float("-inf"))
            self._bias = bias.expand(b, kv_heads, group, length).reshape(b * kv_heads, group,
                                                                         length)
        return self._bias


class LoneInputs:
    """Where a lone decode step's token goes: its block table (as an index and as the C
    kernel's int32 array), the block and offset of its position."""

    __slots__ = ("table", "table_i32", "block", "offset")

    def __init__(self, table: torch.Tensor, pos: int, block_size: int):
        self.table = table[None, :]  # (1, blocks)
        self.table_i32 = table.to(torch.int32).contiguous()
        self.block = int(table[pos // block_size])
        self.offset = pos % block_size


class LlamaModel(WeightFormats):
    """The StepModel for Llama-family checkpoints. Build it with `build_llama`."""

    accepts_padded_rows = True  # causal masking by position: pads past a row's end are inert

    def __init__(self, cfg: LlamaConfig):
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
        must stay the caller's, do not. `rebuild`: fuse again layers already fused, e.g. after
        `.to()` or a deep copy moved the views and the fused tensor apart (two copies)."""
        for layer in self.model.decoder_layers:
            att, mlp = layer.self_attn, layer.mlp
            if rebuild or att.qkv is None:
                att.qkv = FusedProjection(att, "qkv", [att.q_proj, att.k_proj, att.v_proj])
            if rebuild or mlp.gate_up is None:
                mlp.gate_up = FusedProjection(mlp, "gate_up", [mlp.gate_proj, mlp.up_proj])

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
            att, mlp = layer.self_attn, layer.mlp
            groups = ((att.qkv, att, "self_attn", ("q_proj", "k_proj", "v_proj")),
                      (None, att, "self_attn", ("o_proj",)),
                      (mlp.gate_up, mlp, "mlp", ("gate_proj", "up_proj")),
                      (None, mlp, "mlp", ("down_proj",)))
            for fused, owner, prefix, attrs in groups:
                names = [f"model.layers.{i}.{prefix}.{attr}.weight" for attr in attrs]
                if fused is not None:
                    out.append((fused, names))
                else:
                    out += [(getattr(owner, attr), [name]) for attr, name in zip(attrs, names)]
        return out + [(self.lm_head, ["lm_head.weight"])]

    def make_paged_cache(self, n_blocks: int, block_size: int,
                         dtype: torch.dtype | None = None) -> PagedKVCache:
        """A paged cache of `n_blocks` blocks (`models.kv_cache`), in `dtype` (default:
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
        if self.weight_format == "quantized" and self._paged_kernel:
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

    def _rope_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        key = (self.device, self.dtype)
        if key not in self._rope_cache:
            inv = rope_inv_freq(self.config).to(self.device)
            pos = torch.arange(self.max_context, device=self.device, dtype=torch.float32)
            freqs = torch.outer(pos, inv)
            cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)  # (max_context, D)
            sin_signed = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)  # see apply_rope
            self._rope_cache = {key: (cos.to(self.dtype), sin_signed.to(self.dtype))}
        return self._rope_cache[key]

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
        step = StepInputs(positions, tables, kv_len - 1, cache, kernel, padded)
        cos_t, sin_signed_t = self._rope_table()
        rope = (cos_t[positions].unsqueeze(2), sin_signed_t[positions].unsqueeze(2))  # (B,T,1,D)
        x = self.embed(ids)  # (B, T, H)
        for layer in self.model.decoder_layers:
            x = layer(x, rope, step, cache)
        if logit_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logit_index]  # (B, H)
        return self._logits(x)

    def make_static_decode(self, cache: PagedKVCache, max_batch: int, max_context: int,
                           capture: bool) -> StaticDecode:
        """Decode steps at bucketed shapes over `cache` (`models.static_decode`), captured as
        CUDA graphs where `capture` (on a CUDA model), else run eagerly."""
        return StaticDecode(self, cache, max_batch, max_context, capture)

    @property
    def _paged_kernel(self) -> bool:
        """Whether decode attention runs in nbserve's C kernel: where the matmuls do."""
        qkv = self.model.decoder_layers[0].self_attn.qkv
        return qkv is not None and qkv.kernel is not None

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head over the final norm of the hidden states, as float32."""
        if self._head_t is not None and x.numel() == x.shape[-1]:  # one row: see above
            return (self.model.norm(x) @ self._head_t).float()
        return normed_linear(x, self.model.norm, self.lm_head).float()

    @property
    def _lone_ready(self) -> bool:
        """Whether `_lone_step` can serve: it is written for fused q/k/v (what loaders make)."""
        return self.model.decoder_layers[0].self_attn.qkv is not None

    def _lone_step(self, ids: torch.Tensor, pos: int, table: torch.Tensor,
                   cache: PagedKVCache, keep_time_dim: bool) -> torch.Tensor:
        """`forward` for a lone decode step (B = T = 1, the single-stream case): the same
        values, through `DecoderLayer.lone_step`, without the batch bookkeeping that costs a
        noticeable share of a one-token step (benchmarks/README.md)."""
        cos_t, sin_signed_t = self._rope_table()
        rope = (cos_t[pos], sin_signed_t[pos])  # (D,)
        x = self.embed(ids.view(1))  # (1, H)
        seq = LoneInputs(table, pos, cache.block_size)
        for layer in self.model.decoder_layers:
            x = layer.lone_step(x, rope, pos, seq, cache)
        logits = self._logits(x)
        return logits.view(1, 1, -1) if keep_time_dim else logits


def build_llama(cfg: LlamaConfig, tensors: Iterable[tuple[str, torch.Tensor]],
                device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                transposed_head: bool | None = None, fuse: bool = True,
                pack: bool | None = None, float_kernel: bool | None = None) -> LlamaModel:
    """Create a LlamaModel from HF-named tensors, moving each to (device, dtype) as it arrives.

    `fuse` concatenates q/k/v and gate/up (`LlamaModel.fuse_projections`); `pack` (default: on
    for CPU float32 where torch has oneDNN and the copies take at most a quarter of the RAM,
    `packing_affordable`) adds the faster packed copies of
    `LlamaModel.pack_weights`; `transposed_head` (default: on for CPU float32 when not packed)
    keeps the LM-head copy of `LlamaModel.use_transposed_head`. Pass False to all three to
    share every tensor with the caller. `float_kernel` (default: on for CPU float32 where the C
    kernel builds, see `kernels_available`) is `LlamaModel.use_float_kernel`; it copies nothing.

    Raises ValueError naming unknown or missing tensors.
    """
    with torch.device("meta"):
        model = LlamaModel(cfg)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for name, tensor in tensors:
        if name not in params:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise ValueError(f"unexpected tensor {name!r} for {cfg.architecture} ({cfg.name})")
        want = params[name].shape
        if tuple(tensor.shape) != tuple(want):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(want)} from the config of {cfg.name}")
        _set_param(model, name, tensor.to(device=device, dtype=dtype))
        seen.add(name)
    if cfg.tie_word_embeddings or "lm_head.weight" not in seen:
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


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    setattr(owner, attr, nn.Parameter(value, requires_grad=False))
