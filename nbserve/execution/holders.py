"""The holders of a model's matmul weights and the one dispatch every layer calls.

A holder is a `Linear` (nn.Linear with a declared slot for its serving form) or a
`FusedProjection` (layers that read the same input, run as one matmul). `linear`,
`normed_linear` and `gated_linear` multiply through the holder's form (formats.py) where it
has one, else through its plain weight; the form decides which path serves how many rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .formats import PartsForm, WeightForm
from .linear import split_linear
from .lora import LoraSlot


class Linear(nn.Linear):
    """nn.Linear with its serving form (`form`, None: its weight as it is), the one slot
    `WeightFormats` sets; the same parameters and state dict as nn.Linear."""

    form: WeightForm | None
    lora: LoraSlot | None  # the adapters that update this matmul (execution/lora.py)

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.form = None
        self.lora = None


class KernelNorm(nn.Module):
    """A norm that a form's kernel may run inside its matmul call (`normed_linear`) where
    `kernel_fusable` says so: x / rms(x) * weight, with `weight` (K,) and `eps`."""

    weight: nn.Parameter
    eps: float

    @property
    def kernel_fusable(self) -> bool:
        return False


def linear(x: torch.Tensor, layer: Linear | FusedProjection) -> torch.Tensor:
    """`layer(x)`: through its form (formats.py) where it has one, else with the output rows
    split across threads where that is faster (`split_linear`); plus each row's LoRA update
    where the step has adapter rows (execution/lora.py)."""
    form = layer.form
    y = form.matmul(x) if form is not None else split_linear(x, layer.weight, layer.bias)
    lora = layer.lora
    return y if lora is None or not lora.live else lora.add(x, y)


def _lora_live(layer: Linear | FusedProjection) -> bool:
    """Whether this step adds a LoRA update to `layer` (then its input must be formed in torch:
    the kernels' fused norm and gating would hide it)."""
    return layer.lora is not None and layer.lora.live


def normed_linear(x: torch.Tensor, norm: nn.Module, layer: Linear | FusedProjection
                  ) -> torch.Tensor:
    """`linear(norm(x), layer)`; where `norm` is a plain RMSNorm (`KernelNorm.kernel_fusable`)
    its form may run the normalisation inside its kernel call (one op instead of about
    eight)."""
    form = layer.form
    if form is not None and isinstance(norm, KernelNorm) and norm.kernel_fusable \
            and norm.weight.dtype == torch.float32 and not _lora_live(layer):
        return form.matmul(x, norm=norm)
    return linear(norm(x), layer)


def gated_linear(gate_up: torch.Tensor, layer: Linear | FusedProjection) -> torch.Tensor:
    """`linear(silu(gate) * up, layer)` for gate_up (..., 2I) = [gate | up] (a SwiGLU MLP's
    down projection); inside the form's kernel call where it serves."""
    form = layer.form
    if form is not None and not _lora_live(layer):
        return form.matmul(gate_up, gated=True)
    half = gate_up.shape[-1] // 2
    return linear(F.silu(gate_up[..., :half]) * gate_up[..., half:], layer)


def runs_on_kernel(layer: Linear | FusedProjection) -> bool:
    """Whether the layer's few-row steps run on nbserve's C kernels (the paged attention and
    the decode stack go with it): its form's kernel, or the kernels of its parts."""
    form = layer.form
    return form is not None and (form.kernel is not None or isinstance(form, PartsForm))


class FusedProjection:
    """Linear layers that read the same input (q/k/v, gate/up), run as one matmul over their
    concatenated weights: fewer, larger matmuls (per-op overhead adds up over 30 layers).

    The fused weight is registered on `owner` as a non-persistent buffer (it follows `.to()`,
    stays out of the state dict), and each layer's weight becomes a view into it, so the
    model keeps its Hugging Face parameter names and uses no extra memory.
    """

    def __init__(self, owner: nn.Module, name: str, layers: Sequence[nn.Linear]):
        if len({layer.bias is None for layer in layers}) != 1:
            raise ValueError("fused layers must all have a bias or none")
        parts = [layer.weight.detach() for layer in layers]
        if all(w.device.type == "meta" for w in parts):  # weights served from blocks (no
            # values to join; torch.cat on meta would import torch's compiler stack)
            weight = torch.empty(sum(w.shape[0] for w in parts), parts[0].shape[1],
                                 dtype=parts[0].dtype, device="meta")
        else:
            weight = torch.cat(parts).contiguous()
        bias = None if layers[0].bias is None else \
            torch.cat([layer.bias.detach() for layer in layers]).contiguous()
        self._install(owner, name, layers, weight, bias)

    @classmethod
    def over(cls, owner: nn.Module, name: str, layers: Sequence[nn.Linear], weight: torch.Tensor,
             bias: torch.Tensor | None = None, source: str | None = None) -> FusedProjection:
        """A fused projection over a weight that comes fused (Phi-3's qkv_proj, GPT-2's
        c_attn): the layers' weights become views of it; nothing is copied. `source`: the
        checkpoint's name of that weight (its quantized blocks are found under it)."""
        self = cls.__new__(cls)
        self._install(owner, name, layers, weight.detach(),
                      None if bias is None else bias.detach())
        self.source = source
        return self

    def _install(self, owner: nn.Module, name: str, layers: Sequence[nn.Linear],
                 weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.owner, self.name = owner, name
        self.sizes = [layer.out_features for layer in layers]
        owner.register_buffer(f"{name}_weight", weight, persistent=False)
        owner.register_buffer(f"{name}_bias", bias, persistent=False)
        start = 0
        for layer, size in zip(layers, self.sizes):
            layer.weight = nn.Parameter(weight[start:start + size], requires_grad=False)
            if bias is not None:
                layer.bias = nn.Parameter(bias[start:start + size], requires_grad=False)
            start += size
        self.source: str | None = None  # see `over`
        self.form: WeightForm | None = None  # chosen by WeightFormats (weights.py)
        self.lora: LoraSlot | None = None  # see Linear.lora

    @property
    def weight(self) -> torch.Tensor:
        weight = self.owner._buffers[f"{self.name}_weight"]  # registered in `_install`
        assert weight is not None
        return weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.owner._buffers[f"{self.name}_bias"]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return linear(x, self).split(self.sizes, dim=-1)
