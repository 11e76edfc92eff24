"""A tiny GPT that implements nbserve.StepModel: its own KV cache, explicit positions."""
import torch
import torch.nn.functional as F
from torch import nn


class KVCache:
    """Keys and values of every layer: (layers, 2, slots, heads, max_context, head_dim)."""

    def __init__(self, layers, slots, heads, max_context, head_dim, device, dtype):
        shape = (layers, 2, slots, heads, max_context, head_dim)
        self.kv = torch.zeros(shape, device=device, dtype=dtype)
        self.nbytes = self.kv.numel() * self.kv.element_size()

    def copy_prefix(self, src, dst, length):  # n > 1 choices share one prompt prefill
        self.kv[:, :, dst, :, :length] = self.kv[:, :, src, :, :length]


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.ln1, self.ln2 = heads, nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, positions, slots, kv, mask):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).unbind(2)  # (B, T, H, D)
        kv[0][slots[:, None], :, positions] = k  # write this step's keys/values into the cache
        kv[1][slots[:, None], :, positions] = v
        length = mask.shape[-1]  # attend to cached positions 0..length-1, masked by position
        keys, values = kv[0][slots, :, :length], kv[1][slots, :, :length]  # (B, H, L, D)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab_size=640, dim=64, layers=2, heads=4, max_context=256):
        super().__init__()
        self.vocab_size, self.max_context, self.heads = vocab_size, max_context, heads
        self.tok, self.pos = nn.Embedding(vocab_size, dim), nn.Embedding(max_context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab_size, bias=False)
        self.stop_token_ids = [2]  # optional: ids that end a reply (here <|im_end|>)

    device = property(lambda self: self.head.weight.device)
    dtype = property(lambda self: self.head.weight.dtype)

    def make_cache(self, max_batch, max_context):
        head_dim = self.head.in_features // self.heads
        return KVCache(len(self.blocks), max_batch, self.heads, max_context, head_dim,
                       self.device, self.dtype)

    @torch.inference_mode()
    def forward(self, ids, positions, slots, cache, logit_index=None):
        x = self.tok(ids) + self.pos(positions)  # (B, T, C)
        keys = torch.arange(int(positions.max()) + 1, device=ids.device)
        mask = keys <= positions[:, None, :, None]  # (B, 1, T, L): key j visible from p if j <= p
        for layer, block in enumerate(self.blocks):
            x = block(x, positions, slots, cache.kv[layer], mask)
        if logit_index is not None:  # only the position the engine samples from: (B, C)
            x = x[torch.arange(x.shape[0], device=x.device), logit_index]
        return self.head(self.norm(x)).float()
