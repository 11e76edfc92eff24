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

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import TypedDict, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu.kernels.build import kernels_available
from ..execution.decode_stack import DecodeStack
from ..execution.holders import FusedProjection, Linear, normed_linear, runs_on_kernel
from ..execution.kv_cache import PagedKVCache
from ..execution.lora import AdapterRows
from ..execution.quant import QuantBlocks
from ..execution.static_decode import StaticDecode
from ..execution.step_inputs import LoneInputs, Rope, StepInputs
from ..execution.steps import PagedSteps
from ..execution.weights import BlockExperts, WeightFormats
from .attention import Attention
from .base import PagedModel
from .config import DecoderConfig
from .dtypes import QUANTIZED_FORMATS
from .layers import MLP, KernelNorm, make_mlp, make_norm
from .lora import LoraAdapter, install_adapter, remove_adapter
from .moe import SparseMoE, take_expert_blocks
from .rope import RopeRegime, RopeSpec

PAGED_BLOCK_SIZE = 32  # positions per block of a cache made by make_cache (the row convention)
ROPE_TABLE_MIN = 4096  # RoPE tables grow in powers of two from here, up to max_context

def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    """Inverse frequencies of the model's first RoPE (float32), scaling applied."""
    return cfg.ropes[0].inv_freq()[0].float()


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

    def _norms(self) -> tuple[nn.Module | None, nn.Module | None, nn.Module | None,
                              nn.Module | None]:
        """(before attention, after it, before the MLP, after it); None where there is none."""
        if self.layout == "pre":
            return self.input_layernorm, None, self.post_attention_layernorm, None
        if self.layout == "sandwich":
            return (self.input_layernorm, self.post_attention_layernorm,
                    self.pre_feedforward_layernorm, self.post_feedforward_layernorm)
        return None, self.post_attention_layernorm, None, self.post_feedforward_layernorm

    def forward(self, x: torch.Tensor, ropes: Sequence[Rope], step: StepInputs,
                cache: PagedKVCache) -> torch.Tensor:
        attn_in, attn_out, mlp_in, mlp_out = self._norms()
        h = self.self_attn(x, attn_in, ropes, step, cache)
        x = x + (h if attn_out is None else attn_out(h))
        h = self.mlp(x, mlp_in)
        return x + (h if mlp_out is None else mlp_out(h))

    def lone_step(self, x: torch.Tensor, ropes: Sequence[Rope], pos: int, seq: LoneInputs,
                  cache: PagedKVCache) -> torch.Tensor:  # see Attention.lone_step
        attn_in, attn_out, mlp_in, mlp_out = self._norms()
        h = self.self_attn.lone_step(x, attn_in, ropes, pos, seq, cache)
        x = x + (h if attn_out is None else attn_out(h))
        h = self.mlp(x, mlp_in)
        return x + (h if mlp_out is None else mlp_out(h))

    def dense_mlp(self) -> MLP | None:
        """The dense MLP (None for experts): what the decode stack reads."""
        return self.mlp if isinstance(self.mlp, MLP) else None

    def stack_norms(self) -> tuple[KernelNorm, KernelNorm] | None:
        """A "pre" layer's RMSNorms before attention and before the MLP (the decode stack's);
        None for other layouts and norms."""
        if self.layout != "pre":
            return None
        before, after = self.input_layernorm, self.post_attention_layernorm
        if isinstance(before, KernelNorm) and isinstance(after, KernelNorm):
            return before, after
        return None


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


class DecoderModel(PagedSteps, WeightFormats, PagedModel):
    """The StepModel of every native family. Build it with `build_decoder`. Its step paths
    (`forward`) are execution's `PagedSteps`, over the hooks below."""

    accepts_padded_rows = True  # causal masking by position: pads past a row's end are inert

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.hidden_size
        self.max_context = cfg.max_position_embeddings
        self._rope_cache: dict[tuple[int, RopeRegime, torch.device, torch.dtype],
                              tuple[torch.Tensor, torch.Tensor]] = {}
        self._init_weight_formats()
        self.adapter_rows = AdapterRows()  # which LoRA each row of a step applies

    # ------------------------------------------------------------------ LoRA adapters

    def _lora_holders(self) -> list[tuple[Linear | FusedProjection, list[str]]]:
        return [(h, names) for h, names in self._named_holders() if h is not self.lm_head]

    def add_lora(self, index: int, adapter: LoraAdapter) -> None:
        """Install `adapter` (as read by loading/lora_files.py) as adapter `index`
        (models/lora.py): its low-rank
        factors sit beside the base weights, which stay as they are. Projections fused later
        (`fuse_projections(rebuild=True)`) drop the adapters: add them again."""
        self.remove_lora(index)  # (a new adapter at an index replaces the old one whole)
        c = self.config
        install_adapter(self._lora_holders(), self.adapter_rows, index, adapter, self.device,
                        self.dtype, c.architecture, (c.num_attention_heads,
                                                     c.num_key_value_heads))

    def remove_lora(self, index: int) -> None:
        remove_adapter(self._lora_holders(), index)

    def lora_rows(self, indices: list[int]) -> AbstractContextManager[None]:
        return self.adapter_rows.selected(indices, self.device)

    def _adapters_active(self) -> bool:
        return self.adapter_rows.active

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
            layer.mlp.fuse(rebuild)

    def refresh_fused(self) -> None:
        if any(layer.self_attn.qkv is not None for layer in self.model.decoder_layers):
            self.fuse_projections(rebuild=True)

    def embedding_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    def _sparse_mlps(self) -> dict[int, SparseMoE]:
        """The layers whose MLP is a mixture of experts, by index."""
        return {i: layer.mlp for i, layer in enumerate(self.model.decoder_layers)
                if isinstance(layer.mlp, SparseMoE)}

    def serve_expert_blocks(self, blocks: dict[str, QuantBlocks], round16: bool = True) -> None:
        """Each mixture's experts served from their blocks in `blocks` (`take_expert_blocks`,
        `Experts.serve_blocks`)."""
        sparse = self._sparse_mlps()
        if not sparse:
            return
        for i, (gate, up, down) in take_expert_blocks(blocks, sparse).items():
            sparse[i].experts.serve_blocks(gate, up, down, round16)

    def block_experts(self) -> list[BlockExperts]:
        return [mlp.experts for mlp in self._sparse_mlps().values()
                if mlp.experts.forms is not None]

    def _named_holders(self) -> list[tuple[Linear | FusedProjection, list[str]]]:
        """What runs each layer matmul (fused projections where there are, else the Linears),
        then the LM head, each with the names of the parameters it multiplies by."""
        out: list[tuple[Linear | FusedProjection, list[str]]] = []
        for i, layer in enumerate(self.model.decoder_layers):
            out += layer.self_attn.holders(f"model.layers.{i}.self_attn")
            out += layer.mlp.holders(f"model.layers.{i}.mlp")
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
        float16 for a quantized CPU model (weights="blocks", a GGUF's default), whose
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

    def _rope_table(self, index: int, regime: RopeRegime, length: int
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

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head over the final norm of the hidden states, as float32 (softcapped where
        the model caps its logits)."""
        if self._head_t is not None and x.numel() == x.shape[-1]:  # one row: see above
            logits = (self.model.norm(x) @ self._head_t).float()
        else:
            logits = normed_linear(x, self.model.norm, self.lm_head).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.model.norm(x))

    # ------------------------------------------------------------------ what the steps read

    def _step_layers(self) -> Sequence[DecoderLayer]:
        return self.model.decoder_layers

    def stack_layers(self) -> Sequence[DecoderLayer]:
        """The layers as the decode stack reads them (`DecodeStack`)."""
        return self.model.decoder_layers

    def _embed_lone(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        learned = self.config.learned_positions  # a position tensor only where it is read
        return self._embed(ids, ids.new_full((1,), pos) if learned else None)

    def _stack_of_layers(self) -> DecodeStack | None:
        """The model's layers as one C call (execution/decode_stack.py), or None where they do
        not fit it; decided once per model (its shape does not change), its pointers checked
        at every step."""
        stack = self.__dict__.get("_decode_stack", False)
        if stack is False:
            stack = DecodeStack.for_model(self)
            self.__dict__["_decode_stack"] = stack
        return stack

    @property
    def _paged_kernel(self) -> bool:
        """Whether decode attention runs in nbserve's C kernel: where the matmuls do."""
        qkv = self.model.decoder_layers[0].self_attn.qkv
        return qkv is not None and runs_on_kernel(qkv)

    @property
    def _lone_ready(self) -> bool:
        """Whether `_lone_step` can serve: it is written for fused q/k/v (what loaders make)."""
        return self.model.decoder_layers[0].self_attn.qkv is not None


LlamaModel = DecoderModel  # the Llama family is the decoder with its defaults


class DecoderBuildOptions(TypedDict, total=False):
    """What `build_decoder` takes besides the config and the tensors (a family's `build`
    passes it on as it is)."""

    device: torch.device | str
    dtype: torch.dtype
    transposed_head: bool | None
    fuse: bool
    pack: bool | None
    float_kernel: bool | None


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

    A tensor given on the meta device stays there (its loader serves it from blocks).
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
            fused.setdefault(prefused[0], {})[prefused[1]] = _placed(tensor, device, dtype)
            continue
        if name not in params:
            raise ValueError(f"unexpected tensor {name!r} for {cfg.architecture} ({cfg.name})")
        want = params[name].shape
        if tuple(tensor.shape) != tuple(want):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(want)} from the config of {cfg.name}")
        _set_param(model, name, _placed(tensor, device, dtype))
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
    decoder_layer = model.model.decoder_layers[layer]
    attn, mlp = decoder_layer.self_attn, decoder_layer.dense_mlp()
    owner: Attention | MLP
    if owner_name == "self_attn":
        owner, layers = attn, [attn.q_proj, attn.k_proj, attn.v_proj]
    elif mlp is not None and mlp.gated:
        owner, layers = mlp, [mlp.gate_proj, mlp.up_proj]
    else:
        raise ValueError(f"{what} of layer {layer} in {cfg.name}: the config has no gated MLP "
                         "there")
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
    if isinstance(owner, Attention):
        owner.qkv = projection
    else:
        owner.gate_up = projection
    provided = {f"{prefix}.{n}.weight" for n in names}
    return provided | ({f"{prefix}.{n}.bias" for n in names} if bias is not None else set())


def _placed(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype
            ) -> torch.Tensor:
    """`tensor` on (device, dtype); one on the meta device stays there: a loader that serves
    that weight from its blocks (a GGUF's, `WeightFormats.serve_file_blocks`) never builds it."""
    return tensor if tensor.device.type == "meta" else tensor.to(device=device, dtype=dtype)


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    setattr(owner, attr, nn.Parameter(value, requires_grad=False))
