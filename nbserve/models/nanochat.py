"""nanochat's GPT as a StepModel over a paged KV cache.

Follows karpathy/nanochat, nanochat/gpt.py at commit 92d63d4e8bb4 ("clean up fragile code",
2026-07-03); `NANOCHAT_COMMIT` names it. Its forward, as implemented here:

- token embedding (padded vocabulary), then an RMSNorm without weight (eps: the dtype's);
- the "smear": each position adds `smear_lambda * sigmoid(smear_gate(x[:24]))` times the
  normed embedding of the previous token (position 0 has none). A decode step has only its own
  token, so the cache keeps the token id of every position (`NanochatCache.ids`) and the
  previous one is looked up there: chunked prefill and decode read the same value;
- per layer: `x = resid_lambdas[i] * x + x0_lambdas[i] * x0` (x0: the smeared embedding), then
  attention over norm(x) and a ReLU² MLP over norm(x), each added to x;
- attention: q, k, v projections (GQA), on alternating layers (the last always) a value
  embedding added to v, gated per kv head by `3 * sigmoid(ve_gate(x[:12]))`; RoPE (base
  100000, rotating by -theta), then an RMSNorm of q and k, each scaled by 1.2; causal, with
  the layer's window: nanochat's (left, 0) sees `left + 1` keys, the window pattern ("SSSL")
  gives short layers ceil(sequence_len / 4 / 128) * 128 and the rest sequence_len;
- "backout": the residual after layer n_layer // 2 is subtracted, times `backout_lambda`,
  before the final norm; the untied head's logits are cut to the real vocabulary (the padded
  rows are never served) and soft-capped at 15 (`15 * tanh(logits / 15)`).

The longest sequence served (`max_context`) is the trained `sequence_len`, which the long
layers' window (sequence_len + 1 keys) never cuts. Activations run in the embedding's dtype
(nanochat's COMPUTE_DTYPE); a weight of another dtype (nanochat keeps fp32 master weights
beside bf16 embeddings on a GPU) is cast at use, as nanochat's own `Linear` does.
Parameters keep nanochat's names, so its state dict loads as it is and an in-memory GPT is
adopted without a copy (`build_nanochat(..., share=True)`). A module or checkpoint of another
shape (an older or newer gpt.py) is refused with a ValueError naming the missing, unexpected
and mis-shaped parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..cpu.kernels.build import kernels_available
from ..execution.holders import Linear, linear
from ..execution.kv_cache import PagedKVCache
from ..execution.step_inputs import StepInputs
from ..execution.weights import Holder, WeightFormats
from ..text import ChatTemplate, Tokenizer
from ..text.nanochat_chat import nanochat_chat_template, nanochat_tokenizer
from .base import PagedModel
from .decoder import PAGED_BLOCK_SIZE
from .rope import apply_rope

NANOCHAT_COMMIT = "92d63d4e8bb4df75c3b71618f31ddde2378b2bcd"
NANOCHAT_VERSION = f"nanochat/gpt.py at {NANOCHAT_COMMIT[:12]} (2026-07-03)"
SMEAR_CHANNELS = 24  # smear_gate reads the first 24 channels of the normed embedding
VE_GATE_CHANNELS = 12  # ve_gate reads the first 12 channels of the attention input
QK_SCALE = 1.2  # q and k are each scaled after their norm ("sharper attention")
LOGIT_SOFTCAP = 15.0
ROPE_BASE = 100000.0


def window_sizes(sequence_len: int, window_pattern: str, n_layer: int) -> list[tuple[int, int]]:
    """nanochat's per-layer (left, right) windows: the pattern tiled over the layers, the last
    layer always long; L = sequence_len, S = a quarter of it rounded up to 128."""
    pattern = window_pattern.upper()
    if not pattern or any(c not in "SL" for c in pattern):
        raise ValueError(f"invalid nanochat window_pattern {window_pattern!r}: use S and L")
    short = -(-sequence_len // 4 // 128) * 128
    sizes = [(sequence_len if pattern[i % len(pattern)] == "L" else short, 0)
             for i in range(n_layer)]
    sizes[-1] = (sequence_len, 0)
    return sizes


@dataclass(frozen=True, slots=True)
class NanochatConfig:
    """A nanochat GPTConfig plus what its GPT derives: the padded vocabulary and the windows.

    windows: per layer, how many keys a query sees, itself included (None: all); nanochat's
    (left, 0) is left + 1, and left < 0 is all.
    """

    vocab_size: int
    padded_vocab_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    sequence_len: int
    windows: tuple[int | None, ...]
    name: str = "nanochat"

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def has_ve(self, layer: int) -> bool:
        """nanochat's `has_ve`: value embeddings on alternating layers, the last included."""
        return layer % 2 == (self.n_layer - 1) % 2

    @classmethod
    def from_model_config(cls, cfg: dict[str, Any], name: str = "nanochat",
                          pad_vocab_size_to: int = 64) -> NanochatConfig:
        """From a checkpoint's meta JSON `model_config` (nanochat's GPTConfig fields); a
        missing window_pattern is "L", as nanochat's checkpoint manager patches it."""
        try:
            vocab, n_layer = int(cfg["vocab_size"]), int(cfg["n_layer"])
            seq = int(cfg["sequence_len"])
            sizes = window_sizes(seq, str(cfg.get("window_pattern", "L")), n_layer)
            return cls.of(vocab, -(-vocab // pad_vocab_size_to) * pad_vocab_size_to, n_layer,
                          int(cfg["n_head"]), int(cfg["n_kv_head"]), int(cfg["n_embd"]), seq,
                          sizes, name)
        except KeyError as exc:
            raise ValueError(f"{name}: the model_config lacks {exc.args[0]!r}, which "
                             f"{NANOCHAT_VERSION} needs") from None

    @classmethod
    def of(cls, vocab: int, padded: int, n_layer: int, n_head: int, n_kv_head: int,
           n_embd: int, sequence_len: int, sizes: Sequence[tuple[int, int]],
           name: str = "nanochat") -> NanochatConfig:
        """Checked sizes, with nanochat's (left, right) windows."""
        if n_embd % n_head or n_head % n_kv_head or len(sizes) != n_layer:
            raise ValueError(f"{name}: inconsistent nanochat sizes (n_embd {n_embd}, n_head "
                             f"{n_head}, n_kv_head {n_kv_head}, {len(sizes)} windows for "
                             f"{n_layer} layers)")
        windows: list[int | None] = []
        for left, right in sizes:
            if right != 0:
                raise ValueError(f"{name}: window {(left, right)} is not causal")
            windows.append(None if left < 0 else int(left) + 1)
        if padded < vocab:
            raise ValueError(f"{name}: the embedding has {padded} rows for {vocab} tokens")
        return cls(vocab, padded, n_layer, n_head, n_kv_head, n_embd, sequence_len,
                   tuple(windows), name)


def _norm(x: torch.Tensor) -> torch.Tensor:
    """nanochat's `norm`: RMSNorm over the last dim, no weight, torch's default eps."""
    return F.rms_norm(x, (x.shape[-1],))


def _mm(x: torch.Tensor, layer: Linear) -> torch.Tensor:
    """`layer(x)` without bias: the fast helpers where the weight has x's dtype, else the
    weight cast to it (nanochat's `Linear`)."""
    if layer.weight.dtype == x.dtype:
        return linear(x, layer)
    return F.linear(x, layer.weight.to(x.dtype))


class NanochatCache(PagedKVCache):
    """The paged K/V blocks plus the token id at every position (`ids`, (blocks + 1, block
    size)), which the smear of the next position reads."""

    def __init__(self, n_layers: int, n_blocks: int, block_size: int, n_kv_heads: int,
                 head_dim: int, device: torch.device | str, dtype: torch.dtype,
                 rows: int | None = None):
        super().__init__(n_layers, n_blocks, block_size, n_kv_heads, head_dim, device, dtype,
                         rows=rows)
        self.ids = torch.zeros(n_blocks + 1, block_size, dtype=torch.long, device=self.device)

    @property
    def nbytes(self) -> int:
        ids = self.ids[:self.n_blocks]
        return super().nbytes + ids.numel() * ids.element_size()

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        super().copy_prefix(src, dst, length)
        self.ids[dst, :length] = self.ids[src, :length]

    def write_ids(self, step: StepInputs, ids: torch.Tensor) -> None:
        self.ids[step.blocks, step.offsets] = ids

    def previous_ids(self, step: StepInputs) -> torch.Tensor:
        """The token id one position before each of `step.positions` (B, T); position 0
        reads its own (its smear is switched off)."""
        prev = (step.positions - 1).clamp(min=0)
        blocks = step.tables.gather(1, torch.div(prev, self.block_size, rounding_mode="floor"))
        return self.ids[blocks, prev % self.block_size]


class NanochatAttention(nn.Module):
    """c_q, c_k, c_v, c_proj and, on value-embedding layers, ve_gate (nanochat's names)."""

    def __init__(self, cfg: NanochatConfig, layer: int):
        super().__init__()
        d, hq, hkv = cfg.head_dim, cfg.n_head, cfg.n_kv_head
        self.layer, self.hq, self.hkv, self.d = layer, hq, hkv, d
        self.window = cfg.windows[layer]
        self.c_q = Linear(cfg.n_embd, hq * d, bias=False)
        self.c_k = Linear(cfg.n_embd, hkv * d, bias=False)
        self.c_v = Linear(cfg.n_embd, hkv * d, bias=False)
        self.c_proj = Linear(hq * d, cfg.n_embd, bias=False)
        self.ve_gate = Linear(VE_GATE_CHANNELS, hkv, bias=False) if cfg.has_ve(layer) \
            else None

    def forward(self, x: torch.Tensor, ve: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor], step: StepInputs,
                cache: NanochatCache) -> torch.Tensor:
        """Attention of x (B, T, C), already normed, over the cached keys and its own."""
        b, t, _ = x.shape
        hq, hkv, d = self.hq, self.hkv, self.d
        q = _mm(x, self.c_q).view(b, t, hq, d)
        k = _mm(x, self.c_k).view(b, t, hkv, d)
        v = _mm(x, self.c_v).view(b, t, hkv, d)
        if ve is not None and self.ve_gate is not None:  # value residual, gated per kv head
            gate = 3 * torch.sigmoid(_mm(x[..., :VE_GATE_CHANNELS], self.ve_gate))
            v = v + gate.unsqueeze(-1) * ve.view(b, t, hkv, d)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k = _norm(q) * QK_SCALE, _norm(k) * QK_SCALE
        cache.write(self.layer, step.blocks, step.offsets, k, v)
        keys, values = cache.gather(self.layer, step.tables, step.kv_len)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if t == 1:
            bias = step.decode_bias(hkv, hq // hkv, q.dtype, self.window)
            out = _one_query(q, keys, values, bias)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=step.mask_for(self.window),
                enable_gqa=hq != hkv).transpose(1, 2).reshape(b, t, hq * d)
        return _mm(out, self.c_proj)


def _one_query(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """Decode attention, q (B, 1, H, D) over keys/values (B, Hkv, L, D), as two batched
    matmuls over (row, kv head) pairs (the decoder's way: SDPA's per-call setup dominates a
    single query on CPU). `bias`: the additive mask (B * Hkv, H / Hkv, L), or None."""
    b, hkv, length, d = keys.shape
    hq = q.shape[2]
    qg = q.reshape(b * hkv, hq // hkv, d)
    k_t = keys.reshape(b * hkv, length, d).transpose(1, 2)
    scale = d ** -0.5
    scores = torch.bmm(qg, k_t) * scale if bias is None else \
        torch.baddbmm(bias, qg, k_t, alpha=scale)
    probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
    return torch.bmm(probs, values.reshape(b * hkv, length, d)).view(b, 1, hq * d)


class NanochatMLP(nn.Module):
    def __init__(self, cfg: NanochatConfig):
        super().__init__()
        self.c_fc = Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.c_proj = Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _mm(F.relu(_mm(x, self.c_fc)).square(), self.c_proj)


class NanochatBlock(nn.Module):
    def __init__(self, cfg: NanochatConfig, layer: int):
        super().__init__()
        self.attn = NanochatAttention(cfg, layer)
        self.mlp = NanochatMLP(cfg)

    def forward(self, x: torch.Tensor, ve: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor], step: StepInputs,
                cache: NanochatCache) -> torch.Tensor:
        x = x + self.attn(_norm(x), ve, rope, step, cache)
        return x + self.mlp(_norm(x))


class NanochatModel(WeightFormats, PagedModel):
    """The StepModel of nanochat's GPT (see the module docstring). Build it with
    `build_nanochat`; its parameters are named as in nanochat's state dict."""

    accepts_padded_rows = True  # masks by position; pads past a row's end are never read

    def __init__(self, cfg: NanochatConfig):
        super().__init__()
        self.config = cfg
        p, c, kv = cfg.padded_vocab_size, cfg.n_embd, cfg.n_kv_head * cfg.head_dim
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(p, c, _weight=torch.empty(p, c)),
            "h": nn.ModuleList(NanochatBlock(cfg, i) for i in range(cfg.n_layer)),
        })
        self.lm_head = Linear(c, p, bias=False)
        self.resid_lambdas = nn.Parameter(torch.empty(cfg.n_layer))
        self.x0_lambdas = nn.Parameter(torch.empty(cfg.n_layer))
        self.smear_gate = Linear(SMEAR_CHANNELS, 1, bias=False)
        self.smear_lambda = nn.Parameter(torch.empty(1))
        self.backout_lambda = nn.Parameter(torch.empty(1))
        self.value_embeds = nn.ModuleDict({
            str(i): nn.Embedding(p, kv, _weight=torch.empty(p, kv))
            for i in range(cfg.n_layer) if cfg.has_ve(i)})
        self.vocab_size = cfg.vocab_size
        self.max_context = cfg.sequence_len
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._init_weight_formats()

    # ------------------------------------------------------------------ what WeightFormats needs

    @property
    def blocks(self) -> Sequence[NanochatBlock]:
        return cast("Sequence[NanochatBlock]", self.transformer["h"])

    def embedding_weight(self) -> torch.Tensor:
        return cast(nn.Embedding, self.transformer["wte"]).weight

    def _named_holders(self) -> list[tuple[Holder, list[str]]]:
        out: list[tuple[Holder, list[str]]] = []
        for i, block in enumerate(self.blocks):
            attn, mlp = block.attn, block.mlp
            named: list[tuple[Holder, str]] = [
                (attn.c_q, "attn.c_q"), (attn.c_k, "attn.c_k"), (attn.c_v, "attn.c_v"),
                (attn.c_proj, "attn.c_proj"), (mlp.c_fc, "mlp.c_fc"), (mlp.c_proj, "mlp.c_proj")]
            out += [(layer, [f"transformer.h.{i}.{name}.weight"]) for layer, name in named]
        return out + [(self.lm_head, ["lm_head.weight"])]

    def serving_defaults(self, tokenizer: object) -> tuple[Tokenizer, ChatTemplate, list[int]]:
        """What the model is served with when the caller names nothing else: `tokenizer` read
        as nanochat's (`nanochat_tokenizer`), nanochat's conversation format as the chat
        template, and its stop ids (`<|assistant_end|>`, `<|bos|>`)."""
        tok = nanochat_tokenizer(tokenizer)
        if tok.vocab_size > self.vocab_size:
            raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but {self.config.name} "
                             f"was trained on {self.vocab_size}: pass its own tokenizer")
        return tok, nanochat_chat_template(), list(tok.eos_token_ids)

    # ------------------------------------------------------------------ the cache

    def make_paged_cache(self, n_blocks: int, block_size: int,
                         dtype: torch.dtype | None = None) -> NanochatCache:
        c = self.config
        return NanochatCache(c.n_layer, n_blocks, block_size, c.n_kv_head, c.head_dim,
                             self.device, dtype or self.default_kv_dtype)

    def make_cache(self, max_batch: int, max_context: int) -> NanochatCache:
        """A paged cache laid out as `max_batch` rows (forward then also takes slots (B,))."""
        per_row = -(-max_context // PAGED_BLOCK_SIZE)
        c = self.config
        return NanochatCache(c.n_layer, max_batch * per_row, PAGED_BLOCK_SIZE, c.n_kv_head,
                             c.head_dim, self.device, self.dtype, rows=max_batch)

    @property
    def default_kv_dtype(self) -> torch.dtype:
        return self.dtype

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Keys and values of every layer, plus the token id the smear reads."""
        c = self.config
        item = torch.empty((), dtype=dtype or self.default_kv_dtype).element_size()
        return 2 * c.n_layer * c.n_kv_head * c.head_dim * item + 8

    # ------------------------------------------------------------------ forward

    def _rope(self, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) rows (B, T, 1, D) for `apply_rope`, computed as nanochat computes
        its tables (float32, then the compute dtype); sin_signed = [sin, -sin] rotates by
        -theta, as nanochat's `apply_rotary_emb` does."""
        have = self._rope_table
        if have is None or have[0].shape[0] < length or have[0].device != self.device or \
                have[0].dtype != self.dtype:
            size = max(length, self.max_context)
            d = self.config.head_dim
            channels = torch.arange(0, d, 2, dtype=torch.float32, device=self.device)
            inv_freq = 1.0 / (ROPE_BASE ** (channels / d))
            t = torch.arange(size, dtype=torch.float32, device=self.device)
            freqs = torch.outer(t, inv_freq)
            cos, sin = freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)
            have = (torch.cat((cos, cos), dim=-1), torch.cat((sin, -sin), dim=-1))
            self._rope_table = have
        return have[0][positions].unsqueeze(2), have[1][positions].unsqueeze(2)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                cache: NanochatCache, logit_index: torch.Tensor | None = None,
                max_pos: int | None = None, contiguous_from: int | None = None) -> torch.Tensor:
        """ids, positions (B, T), block tables (B, blocks) (or slots (B,) of `make_cache`)
        -> logits (B, T, vocab_size) as float32, or (B, vocab_size) with logit_index."""
        if tables.dim() == 1:
            tables = cache.row_tables(tables)
        if max_pos is None:
            max_pos = int(positions.max())
        step = StepInputs(positions, tables, max_pos, cache, kernel=False)
        cache.write_ids(step, ids)
        x = self._smeared(ids, cache.previous_ids(step), positions)
        rope = self._rope(positions, max_pos + 1)
        x0, backout_at, x_backout = x, self.config.n_layer // 2, x
        for i, block in enumerate(self.blocks):
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = None
            if str(i) in self.value_embeds:
                table = cast(nn.Embedding, self.value_embeds[str(i)]).weight
                ve = F.embedding(ids, table).to(x.dtype)
            x = block(x, ve, rope, step, cache)
            if i == backout_at:
                x_backout = x
        x = x - self.backout_lambda.to(x.dtype) * x_backout
        if logit_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logit_index]
        return self._logits(_norm(x))

    def _embedded(self, ids: torch.Tensor) -> torch.Tensor:
        return _norm(self.embed(ids).to(self.dtype))

    def _smeared(self, ids: torch.Tensor, prev_ids: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """The normed embedding plus the gated normed embedding of the previous token."""
        x = self._embedded(ids)
        gate = self.smear_lambda.to(x.dtype) * torch.sigmoid(
            _mm(x[..., :SMEAR_CHANNELS], self.smear_gate))
        smeared = x + gate * self._embedded(prev_ids)
        return torch.where((positions > 0).unsqueeze(-1), smeared, x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self._head_t is not None and x.numel() == x.shape[-1]:  # one row, CPU float32
            logits = x @ self._head_t
        else:
            logits = _mm(x, self.lm_head)
        logits = logits[..., :self.vocab_size].float()
        return LOGIT_SOFTCAP * torch.tanh(logits / LOGIT_SOFTCAP)


# ----------------------------------------------------------------------------- building


def expected_shapes(cfg: NanochatConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of this version's GPT, by its nanochat name, with its shape."""
    with torch.device("meta"):
        model = NanochatModel(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_tensors(cfg: NanochatConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """ValueError naming what differs between `shapes` (name -> shape) and this version."""
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(shapes))
    unexpected = sorted(set(shapes) - set(want))
    wrong = sorted(f"{n} {shapes[n]} (expected {want[n]})" for n in set(want) & set(shapes)
                   if tuple(shapes[n]) != want[n])
    if not (missing or unexpected or wrong):
        return
    parts = [f"missing {', '.join(missing)}" if missing else "",
             f"unexpected {', '.join(unexpected)}" if unexpected else "",
             f"mis-shaped {', '.join(wrong)}" if wrong else ""]
    raise ValueError(f"{cfg.name} is not the nanochat GPT nbserve implements "
                     f"({NANOCHAT_VERSION}): {'; '.join(p for p in parts if p)}")


def build_nanochat(cfg: NanochatConfig, tensors: Iterable[tuple[str, torch.Tensor]],
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *,
                   share: bool = False, pack: bool | None = None,
                   transposed_head: bool | None = None,
                   float_kernel: bool | None = None, **unused: object) -> NanochatModel:
    """A NanochatModel from nanochat-named tensors (a state dict's items).

    `share`: take the tensors as they are (adoption: same storage, device and dtypes, no
    copies for speed); else each is moved to (device, dtype) and, on CPU float32, the loaders'
    copies are added as for the decoder (`pack`, `transposed_head`, `float_kernel`; None: the
    same defaults as `build_decoder`; the decoder builders' `fuse` has nothing to fuse here
    and is ignored with any other option). Raises ValueError naming missing, unexpected or
    mis-shaped parameters (a checkpoint of another nanochat version)."""
    items = [(name.removeprefix("_orig_mod."), t) for name, t in tensors]
    check_tensors(cfg, {name: tuple(t.shape) for name, t in items})
    if share:
        devices = {t.device for _, t in items}
        if len(devices) != 1:
            raise ValueError(f"{cfg.name}: its parameters are on {len(devices)} devices; "
                             "nbserve needs one")
    with torch.device("meta"):
        model = NanochatModel(cfg)
    for name, tensor in items:
        value = tensor.detach() if share else tensor.detach().to(device=device, dtype=dtype)
        owner_name, attr = name.rpartition(".")[::2]
        owner = model.get_submodule(owner_name) if owner_name else model
        setattr(owner, attr, nn.Parameter(value, requires_grad=False))
    model.eval()
    if share:
        return model
    if pack is None:
        pack = model.packing_pays()
    if pack:
        model.pack_weights()
    cpu32 = model.device.type == "cpu" and model.dtype == torch.float32
    if transposed_head is None:
        transposed_head = not pack and cpu32
    if transposed_head:
        model.use_transposed_head()
    if float_kernel is None:
        float_kernel = cpu32 and kernels_available()
    if float_kernel:
        model.use_float_kernel()
    return model
