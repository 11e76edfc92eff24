"""The decoder's building blocks besides attention: activations, norms, the dense MLP, and the
projection of a normed input (the norm inside the matmul where the weight's form can)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..execution.holders import (
    FusedProjection,
    KernelNorm,
    Linear,
    gated_linear,
    linear,
    normed_linear,
)
from .config import DecoderConfig

ACTIVATION = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu2": lambda x: F.relu(x).square(),
}


class RMSNorm(KernelNorm):
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


def project(x: torch.Tensor, norm: nn.Module | None, layer: Linear | FusedProjection
             ) -> torch.Tensor:
    """`layer(norm(x))`, the norm inside the matmul where it can; `layer(x)` without a norm."""
    return linear(x, layer) if norm is None else normed_linear(x, norm, layer)


class DecoderMLP(nn.Module):
    """What a decoder layer's MLP offers (the dense `MLP`, a mixture of experts in
    models/moe.py): forward(x, norm) (of norm(x), the norm inside the matmul where it can),
    `fuse` and `holders`."""

    def fuse(self, rebuild: bool = False) -> None:
        """Fuse the projections that read the same input (again with `rebuild`)."""

    def holders(self, prefix: str) -> list[tuple[Linear | FusedProjection, list[str]]]:
        """The matmul holders with the names of the parameters each multiplies by."""
        raise NotImplementedError


class MLP(DecoderMLP):
    """A gated MLP (SwiGLU, Gemma's GeGLU: down(act(gate(x)) * up(x))) or a plain one
    (GPT-2, nanochat: down(act(up(x))))."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gated = cfg.gated_mlp
        if self.gated:
            self.gate_proj = Linear(h, i, bias=bias)
        self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)
        self.act_name = cfg.hidden_act
        self.act = ACTIVATION[cfg.hidden_act]
        self.gate_up: FusedProjection | None = None  # see DecoderModel.fuse_projections

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """The MLP of norm(x) (of x without a norm). With fused gate/up, the norm and the
        silu(gate) * up run inside the matmuls where the C kernel serves them."""
        if not self.gated:
            return linear(self.act(project(x, norm, self.up_proj)), self.down_proj)
        if self.gate_up is not None:
            gate_up = project(x, norm, self.gate_up)
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

    def holders(self, prefix: str) -> list[tuple[Linear | FusedProjection, list[str]]]:
        down = (self.down_proj, [f"{prefix}.down_proj.weight"])
        if not self.gated:
            return [(self.up_proj, [f"{prefix}.up_proj.weight"]), down]
        names = [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"]
        if self.gate_up is not None:
            return [(self.gate_up, [self.gate_up.source] if self.gate_up.source else names),
                    down]
        return [(self.gate_proj, names[:1]), (self.up_proj, names[1:]), down]


def make_mlp(cfg: DecoderConfig, layer: int) -> DecoderMLP:
    """Layer `layer`'s MLP: a mixture of experts where `cfg.moe` puts one (models/moe.py),
    else the dense MLP."""
    if cfg.moe is not None:  # the experts' config makes them (the decoder imports no moe)
        mlp = cfg.moe.make_mlp(cfg, layer)
        if not isinstance(mlp, DecoderMLP):
            raise TypeError(f"{type(cfg.moe).__name__}.make_mlp must return a DecoderMLP")
        return mlp
    return MLP(cfg)
