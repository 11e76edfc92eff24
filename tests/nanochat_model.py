"""nanochat's GPT written out for the tests: the architecture of karpathy/nanochat's
nanochat/gpt.py at commit 92d63d4e8bb4 (2026-07-03), with its parameter names, its init and its
forward without a KV cache (attention by SDPA with the sliding-window mask of nanochat's SDPA
fallback), its naive `generate` loop, and its checkpoint layout (model_<step>.pt +
meta_<step>.json, as nanochat's checkpoint manager saves them). Training, FA3, the optimizer
and nanochat's own KV-cache engine are left out: the tests compare nbserve against this
forward.

`tiny_gpt` builds one at tiny sizes with every learned part switched on (nanochat's init
zeros the output projections and the smear, which would hide them), and optionally short
windows of a few tokens (nanochat's formula never goes below 128; its forward reads
`window_sizes`, which is what is overridden).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

COMPUTE_DTYPE = torch.float32  # nanochat's choice on CPU


@dataclass
class GPTConfig:
    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    window_pattern: str = "SSSL"


def norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),))


class Linear(nn.Linear):
    """nn.Linear that casts its weight to the input's dtype (nanochat's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(dtype=x.dtype))


def has_ve(layer_idx: int, n_layer: int) -> bool:
    return layer_idx % 2 == (n_layer - 1) % 2


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    y1 = x1 * cos + x2 * sin
    y2 = x1 * (-sin) + x2 * cos
    return torch.cat([y1, y2], 3)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   window_size: tuple[int, int], enable_gqa: bool) -> torch.Tensor:
    """nanochat's SDPA fallback for Tq == Tk: causal, keys at most `window` back."""
    t = q.size(2)
    window = window_size[0]
    if window < 0 or window >= t:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    row = torch.arange(t).unsqueeze(1)
    col = torch.arange(t).unsqueeze(0)
    mask = (col <= row) & ((row - col) <= window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.n_embd = config.n_head, config.n_kv_head, config.n_embd
        self.head_dim = self.n_embd // self.n_head
        self.c_q = Linear(self.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = Linear(self.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = Linear(self.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = Linear(self.n_embd, self.n_embd, bias=False)
        self.ve_gate_channels = 12
        self.ve_gate = Linear(self.ve_gate_channels, self.n_kv_head, bias=False) \
            if has_ve(layer_idx, config.n_layer) else None

    def forward(self, x: torch.Tensor, ve: torch.Tensor | None, cos_sin: Any,
                window_size: tuple[int, int]) -> torch.Tensor:
        b, t, _ = x.size()
        q = self.c_q(x).view(b, t, self.n_head, self.head_dim)
        k = self.c_k(x).view(b, t, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(b, t, self.n_kv_head, self.head_dim)
        if ve is not None:
            ve = ve.view(b, t, self.n_kv_head, self.head_dim)
            gate = 3 * torch.sigmoid(self.ve_gate(x[..., :self.ve_gate_channels]))
            v = v + gate.unsqueeze(-1) * ve
        cos, sin = cos_sin
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        q, k = norm(q), norm(k)
        q = q * 1.2
        k = k * 1.2
        y = sdpa_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           window_size, self.n_head != self.n_kv_head).transpose(1, 2)
        return self.c_proj(y.contiguous().view(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, ve: torch.Tensor | None, cos_sin: Any,
                window_size: tuple[int, int]) -> torch.Tensor:
        x = x + self.attn(norm(x), ve, cos_sin, window_size)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, pad_vocab_size_to: int = 64):
        super().__init__()
        self.config = config
        self.window_sizes = self._compute_window_sizes(config)
        padded = -(-config.vocab_size // pad_vocab_size_to) * pad_vocab_size_to
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(padded, config.n_embd),
            "h": nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
        })
        self.lm_head = Linear(config.n_embd, padded, bias=False)
        self.resid_lambdas = nn.Parameter(torch.ones(config.n_layer))
        self.x0_lambdas = nn.Parameter(torch.zeros(config.n_layer))
        self.smear_gate = Linear(24, 1, bias=False)
        self.smear_lambda = nn.Parameter(torch.zeros(1))
        self.backout_lambda = nn.Parameter(0.2 * torch.ones(1))
        head_dim = config.n_embd // config.n_head
        kv_dim = config.n_kv_head * head_dim
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(padded, kv_dim)
                                           for i in range(config.n_layer)
                                           if has_ve(i, config.n_layer)})
        self.rotary_seq_len = config.sequence_len * 10
        cos, sin = self._precompute_rotary_embeddings(self.rotary_seq_len, head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        torch.nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=0.8)
        torch.nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        n_embd = self.config.n_embd
        s = 3 ** 0.5 * n_embd ** -0.5
        for block in self.transformer.h:
            torch.nn.init.uniform_(block.attn.c_q.weight, -s, s)
            torch.nn.init.uniform_(block.attn.c_k.weight, -s, s)
            torch.nn.init.uniform_(block.attn.c_v.weight, -s, s)
            torch.nn.init.zeros_(block.attn.c_proj.weight)
            torch.nn.init.uniform_(block.mlp.c_fc.weight, -s * 0.4, s * 0.4)
            torch.nn.init.zeros_(block.mlp.c_proj.weight)
        n_layer = self.config.n_layer
        for i in range(n_layer):
            self.resid_lambdas.data[i] = 1.15 - (0.10 * i / max(n_layer - 1, 1))
            self.x0_lambdas.data[i] = 0.20 - (0.15 * i / max(n_layer - 1, 1))
        torch.nn.init.zeros_(self.smear_lambda)
        torch.nn.init.constant_(self.backout_lambda, 0.2)
        torch.nn.init.uniform_(self.smear_gate.weight, 0.0, 0.02)
        for ve in self.value_embeds.values():
            torch.nn.init.uniform_(ve.weight, -s, s)
        for block in self.transformer.h:
            if block.attn.ve_gate is not None:
                torch.nn.init.uniform_(block.attn.ve_gate.weight, 0.0, 0.02)

    def _precompute_rotary_embeddings(self, seq_len: int, head_dim: int,
                                      base: int = 100000) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.transformer.wte.weight.device
        channel_range = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
        inv_freq = 1.0 / (base ** (channel_range / head_dim))
        t = torch.arange(seq_len, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos().to(COMPUTE_DTYPE), freqs.sin().to(COMPUTE_DTYPE)
        return cos[None, :, None, :], sin[None, :, None, :]

    def _compute_window_sizes(self, config: GPTConfig) -> list[tuple[int, int]]:
        pattern = config.window_pattern.upper()
        long_window = config.sequence_len
        short_window = -(-long_window // 4 // 128) * 128
        char_to_window = {"L": (long_window, 0), "S": (short_window, 0)}
        sizes = [char_to_window[pattern[i % len(pattern)]] for i in range(config.n_layer)]
        sizes[-1] = (long_window, 0)
        return sizes

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.size()
        assert t <= self.cos.size(1)
        cos_sin = self.cos[:, :t], self.sin[:, :t]
        x = self.transformer.wte(idx).to(COMPUTE_DTYPE)
        x = norm(x)
        assert t > 1, "Training forward pass should have T > 1"
        gate = self.smear_lambda.to(x.dtype) * torch.sigmoid(self.smear_gate(x[:, 1:, :24]))
        x = torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)
        x0 = x
        backout_layer = self.config.n_layer // 2
        x_backout = None
        for i, block in enumerate(self.transformer.h):
            x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](idx).to(x.dtype) if str(i) in self.value_embeds \
                else None
            x = block(x, ve, cos_sin, self.window_sizes[i])
            if i == backout_layer:
                x_backout = x
        if x_backout is not None:
            x = x - self.backout_lambda.to(x.dtype) * x_backout
        x = norm(x)
        softcap = 15
        logits = self.lm_head(x)
        logits = logits[..., :self.config.vocab_size].float()
        return softcap * torch.tanh(logits / softcap)

    @torch.inference_mode()
    def generate(self, tokens: list[int], max_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, seed: int = 42) -> Any:
        """nanochat's naive loop: the whole sequence through forward for every token."""
        device = self.transformer.wte.weight.device
        rng = None
        if temperature > 0:
            rng = torch.Generator(device=device)
            rng.manual_seed(seed)
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        for _ in range(max_tokens):
            logits = self.forward(ids)[:, -1, :]
            if top_k is not None and top_k > 0:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("Inf")
            if temperature > 0:
                probs = F.softmax(logits / temperature, dim=-1)
                next_ids = torch.multinomial(probs, num_samples=1, generator=rng)
            else:
                next_ids = torch.argmax(logits, dim=-1, keepdim=True)
            ids = torch.cat((ids, next_ids), dim=1)
            yield next_ids.item()


# ----------------------------------------------------------------------------- for the tests


@torch.no_grad()
def scramble(model: GPT, seed: int) -> GPT:
    """Every learned part on, at sizes that matter: output projections, smear, backout,
    lambdas and gates away from their neutral init, logits spread over the softcap."""
    gen = torch.Generator().manual_seed(seed)
    model.init_weights()

    def rand(p: torch.Tensor, scale: float, shift: float = 0.0) -> None:
        p.copy_(torch.randn(p.shape, generator=gen) * scale + shift)

    n = model.config.n_embd
    for block in model.transformer.h:
        rand(block.attn.c_proj.weight, n ** -0.5)
        rand(block.mlp.c_proj.weight, (4 * n) ** -0.5)
        if block.attn.ve_gate is not None:
            rand(block.attn.ve_gate.weight, 0.5)
    rand(model.lm_head.weight, 0.5)
    rand(model.smear_gate.weight, 0.5)
    model.smear_lambda.fill_(0.8)
    model.backout_lambda.fill_(0.3)
    rand(model.resid_lambdas, 0.1, 1.0)
    rand(model.x0_lambdas, 0.1, 0.2)
    return model


def tiny_gpt(vocab_size: int, seed: int = 0, short_left: int | None = None,
             **config: Any) -> GPT:
    """A scrambled tiny GPT: 4 layers "SSSL", 4 heads of 16, 2 kv heads, 128 positions;
    `short_left`: the S layers' window (nanochat's `(left, 0)`), else nanochat's formula."""
    cfg = GPTConfig(**{**dict(sequence_len=128, vocab_size=vocab_size, n_layer=4, n_head=4,
                              n_kv_head=2, n_embd=64, window_pattern="SSSL"), **config})
    model = scramble(GPT(cfg), seed)
    if short_left is not None:
        pattern = cfg.window_pattern.upper()
        model.window_sizes = [
            (short_left, 0) if pattern[i % len(pattern)] == "S" and i < cfg.n_layer - 1
            else (cfg.sequence_len, 0) for i in range(cfg.n_layer)]
    return model.eval()


def save_checkpoint(checkpoint_dir: str | os.PathLike, step: int, model: GPT,
                    **meta: Any) -> Path:
    """As nanochat's checkpoint_manager.save_checkpoint: model_<step:06d>.pt (torch.save of
    the state dict) and meta_<step:06d>.json (the model config and training metadata)."""
    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), root / f"model_{step:06d}.pt")
    data = {"step": step, "val_bpb": 1.5, "model_config": asdict(model.config),
            "user_config": {}, "device_batch_size": 32,
            "max_seq_len": model.config.sequence_len, **meta}
    with open(root / f"meta_{step:06d}.json", "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    return root
