"""Rotary position embeddings: the frequencies of every RoPE variant the families use, and the
cos/sin tables a model looks positions up in.

A `RopeSpec` is one layer kind's RoPE (a model may have two: Gemma 3's local and global layers);
`read_rope` builds it from a config.json dict, old style (`rope_theta`, `rope_scaling`) or
transformers >= 5 (`rope_parameters`, per layer type where a model has several).
Variants: default, linear, dynamic (NTK), llama3, yarn, longrope, each as transformers defines
it; partial rotary (`partial_rotary_factor`) rotates the first dims of each head only.
Where the frequencies depend on the sequence's length (dynamic, longrope), `regime(length)`
names the table a row uses: each row is roped by its own length, so a request batched with
others gets what it gets alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


RopeRegime = str | int | None  # longrope's "long"/"short", dynamic NTK's length, or None


@dataclass(frozen=True)
class RopeSpec:
    """theta, the variant (`kind`, one of KINDS) and its parameters, the rotated dims per head,
    and the model's max_position_embeddings (which dynamic and longrope read)."""

    theta: float
    rotary_dim: int
    kind: str = "default"
    params: tuple[tuple[str, Any], ...] = field(default_factory=tuple)
    max_positions: int = 2048

    def param(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    @property
    def original(self) -> int:
        """The pretraining context the scaling is relative to."""
        return int(self.param("original_max_position_embeddings") or self.max_positions)

    def regime(self, length: int) -> RopeRegime:
        """Which table a row whose positions reach `length` - 1 uses (None: the one table)."""
        if self.kind == "longrope":
            return "long" if length > self.original else "short"
        if self.kind == "dynamic" and length > self.max_positions:
            return length
        return None

    def inv_freq(self, regime: RopeRegime = None) -> tuple[torch.Tensor, float]:
        """(inverse frequencies (rotary_dim / 2,) float64, the factor cos/sin are scaled by)."""
        d = self.rotary_dim
        exponents = torch.arange(0, d, 2, dtype=torch.float64) / d
        base = self.theta
        if self.kind == "dynamic" and isinstance(regime, int):
            factor = float(self.param("factor"))
            base = base * ((factor * regime / self.max_positions) - (factor - 1)) ** (d / (d - 2))
        inv = 1.0 / base ** exponents
        if self.kind == "linear":
            return inv / float(self.param("factor")), 1.0
        if self.kind == "llama3":
            return _llama3(inv, dict(self.params)), 1.0
        if self.kind == "yarn":
            return self._yarn(inv)
        if self.kind == "longrope":
            return self._longrope(regime == "long")
        return inv, 1.0

    def _yarn(self, inv: torch.Tensor) -> tuple[torch.Tensor, float]:
        d, base = self.rotary_dim, self.theta
        factor = self.param("factor") or self.max_positions / self.original
        mscale, mscale_all = self.param("mscale"), self.param("mscale_all_dim")
        attention = self.param("attention_factor")
        if attention is None:
            attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                         if mscale and mscale_all else _yarn_mscale(factor))
        fast, slow = self.param("beta_fast") or 32, self.param("beta_slow") or 1

        def dim_of(rotations: float) -> float:
            return d * math.log(self.original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = dim_of(fast), dim_of(slow)
        if self.param("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (high frequencies kept), 0: interpolate
        return inv / factor * (1 - keep) + inv * keep, float(attention)

    def _longrope(self, long: bool) -> tuple[torch.Tensor, float]:
        d = self.rotary_dim
        factors = torch.tensor(self.param("long_factor" if long else "short_factor"),
                               dtype=torch.float64)
        if factors.numel() != d // 2:
            raise ValueError(f"longrope factors: {factors.numel()} given, {d // 2} needed")
        factor = self.param("factor") or self.max_positions / self.original
        attention = self.param("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else \
                math.sqrt(1 + math.log(factor) / math.log(self.original))
        exponents = torch.arange(0, d, 2, dtype=torch.float64) / d
        return 1.0 / (factors * self.theta ** exponents), float(attention)

    def table(self, length: int, regime: RopeRegime, device: torch.device, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed), each (length, rotary_dim): see `apply_rope` for the signs."""
        inv, scale = self.inv_freq(regime)
        pos = torch.arange(length, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, inv.float().to(device))
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        return (torch.cat((cos, cos), dim=-1).to(dtype),
                torch.cat((-sin, sin), dim=-1).to(dtype))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _llama3(inv: torch.Tensor, sc: dict[str, Any]) -> torch.Tensor:
    """Llama-3 scaling: slow down low frequencies, keep high ones, blend in between."""
    factor = sc["factor"]
    low, high = sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old_ctx = sc.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (..., D): x * cos + rotate_half(x) * sin, where rotate_half(x) =
    [-x2, x1]. Written as x * cos + [x2, x1] * [-sin, sin] (`sin_signed`, one roll): the
    same values bit for bit (only signs move), in 4 ops instead of 6. Where the tables are
    narrower than x (partial rotary), only the first dims rotate."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + x.roll(r // 2, dims=-1) * sin_signed
    head = x[..., :r]
    return torch.cat((head * cos + head.roll(r // 2, dims=-1) * sin_signed, x[..., r:]), dim=-1)


def read_rope(cfg: dict[str, Any], head_dim: int, name: str,
              layer_type: str | None = None, default_theta: float = 10000.0) -> RopeSpec:
    """The RoPE of config.json `cfg` (of its layers of `layer_type`, where the model keeps one
    per type); ValueError naming a variant nbserve does not implement."""
    params: dict[str, Any] = {}
    theta = cfg.get("rope_theta")
    rope_params = cfg.get("rope_parameters")
    if isinstance(rope_params, dict):
        if layer_type is not None and isinstance(rope_params.get(layer_type), dict):
            rope_params = rope_params[layer_type]
        if not any(isinstance(v, dict) for v in rope_params.values()):
            params.update(rope_params)
            theta = params.pop("rope_theta", None) or theta
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict) and not params.get("rope_type"):
        params.update(scaling)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if kind not in KINDS:
        raise ValueError(f"unsupported rope_scaling type {kind!r} in {name}: nbserve implements "
                         f"{', '.join(KINDS)}")
    partial = params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0
    if "original_max_position_embeddings" not in params and \
            cfg.get("original_max_position_embeddings"):
        params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    rotary = int(head_dim * float(partial))
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise ValueError(f"{name}: partial_rotary_factor {partial} gives {rotary} rotary dims "
                         f"of {head_dim}; an even number in 2..{head_dim} is needed")
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                          for k, v in params.items()))
    return RopeSpec(theta=float(theta or default_theta), rotary_dim=rotary, kind=kind,
                    params=frozen, max_positions=int(cfg.get("max_position_embeddings", 2048)))


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (its RoPE pairs rows differently): per head it stores
    rows (0, D/2, 1, D/2+1, ...)."""
    rows = w.shape[0]  # (H*D, ...) -> (H, D/2, 2, ...) -> (H, 2, D/2, ...)
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2)
            .reshape(w.shape))
