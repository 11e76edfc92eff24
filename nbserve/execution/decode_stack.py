"""A decode step (a lone one, or a batch's) through all of a decoder's layers in one C call
(`nbq_decode_stack`, cpu/kernels/decode_stack.c), for the models whose layers are
Llama-shaped and run on nbserve's C kernels: the same kernels on the same values as the
per-layer path (`DecoderLayer.lone_step`, `DecoderLayer.forward`: bit-for-bit the same hidden
states), without the Python and op dispatch between them.

`DecodeStack.for_model` says once per model whether its layers qualify (and why not, for
tests); the per-step call checks what can change between steps (the position against the
layers' windows, the cache, the weights' pointers) and answers None where the step must take
the per-layer path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter, is_, itemgetter
from typing import Protocol

import torch

from ..cpu.kernels.abi import Layer, Weight, WeightKind  # nbserve_kernels.h's structs
from ..cpu.kernels.build import quant_kernels
from .formats import PartsForm, WeightForm
from .holders import FusedProjection, KernelNorm, Linear
from .kv_cache import PagedKVCache
from .paged_attention import paged_cache_serves
from .quant import KernelLinear


class StackConfig(Protocol):
    """The architecture's options the stack checks (models.config.DecoderConfig has them)."""

    @property
    def norm(self) -> str: ...
    @property
    def norm_offset(self) -> float: ...
    @property
    def norm_layout(self) -> str: ...
    @property
    def qk_norm(self) -> str: ...
    @property
    def gated_mlp(self) -> bool: ...
    @property
    def hidden_act(self) -> str: ...
    @property
    def attention_bias(self) -> bool: ...
    @property
    def o_bias(self) -> bool: ...
    @property
    def mlp_bias(self) -> bool: ...
    @property
    def moe(self) -> object: ...
    @property
    def attn_softcap(self) -> float | None: ...
    @property
    def layer_rope(self) -> Sequence[int | None]: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...


class StackAttention(Protocol):
    """A layer's attention as the stack reads it."""

    @property
    def layer(self) -> int: ...  # its index in the cache
    @property
    def hq(self) -> int: ...
    @property
    def hkv(self) -> int: ...
    @property
    def d(self) -> int: ...
    @property
    def rope_id(self) -> int | None: ...
    @property
    def window(self) -> int | None: ...
    @property
    def partial_rope(self) -> bool: ...
    @property
    def q_factor(self) -> float: ...
    @property
    def qkv(self) -> FusedProjection | None: ...
    @property
    def o_proj(self) -> Linear: ...


class StackMLP(Protocol):
    """A layer's dense MLP as the stack reads it."""

    @property
    def gate_up(self) -> FusedProjection | None: ...
    @property
    def down_proj(self) -> Linear: ...


class StackLayer(Protocol):
    """A decoder layer as the stack reads it."""

    @property
    def self_attn(self) -> StackAttention: ...

    def dense_mlp(self) -> StackMLP | None:
        """Its dense MLP; None for experts."""
        ...

    def stack_norms(self) -> tuple[KernelNorm, KernelNorm] | None:
        """Its RMSNorms before attention and before the MLP (a "pre" layout); else None."""
        ...


class StackModel(Protocol):
    """A model as the stack reads it (models.decoder.DecoderModel)."""

    @property
    def config(self) -> StackConfig: ...

    def stack_layers(self) -> Sequence[StackLayer]:
        """Its decoder layers, in order."""
        ...


def unfit_reason(model: StackModel) -> str | None:
    """Why `model`'s layers cannot run as one C call (None: they can, weights permitting)."""
    cfg = model.config
    checks = [
        (cfg.norm == "rms" and not cfg.norm_offset, "a norm other than plain RMSNorm"),
        (cfg.norm_layout == "pre", f"the {cfg.norm_layout!r} norm layout"),
        (not cfg.qk_norm, "q/k norms"),
        (cfg.gated_mlp and cfg.hidden_act == "silu", "an MLP other than SwiGLU"),
        (not (cfg.attention_bias or cfg.o_bias or cfg.mlp_bias), "biases"),
        (cfg.moe is None, "experts"),
        (cfg.attn_softcap is None, "an attention softcap"),
        (len(set(cfg.layer_rope)) == 1, "layers with different RoPEs"),
    ]
    for ok, what in checks:
        if not ok:
            return what
    for layer in model.stack_layers():
        attn, mlp, norms = layer.self_attn, layer.dense_mlp(), layer.stack_norms()
        if attn.partial_rope or attn.q_factor != 1.0:
            return "a partial RoPE or a query scale other than 1/sqrt(head_dim)"
        if attn.qkv is None or mlp is None or mlp.gate_up is None:
            return "unfused q/k/v or gate/up projections"
        if norms is None:
            return "a norm other than plain RMSNorm"
        for norm in norms:
            if norm.weight.dtype != torch.float32 or not norm.weight.is_contiguous():
                return "norm weights that are not contiguous float32"
    return None


_FORM = attrgetter("form")
_PARAMETERS = attrgetter("_parameters")
_WEIGHT = itemgetter("weight")
_POINTER = torch.Tensor.data_ptr


@dataclass
class _Built:
    """The ctypes description of the layers over one cache, and what it was built from."""

    array: ctypes.Array[ctypes.Structure]  # of Layer (nbq_layer)
    layers: tuple[StackLayer, ...]
    cache: tuple[int, int]  # (id, first key pointer)
    holders: tuple[Linear | FusedProjection, ...]  # the holders whose form's kernel each is
    forms: tuple[object, ...]  # their forms
    weights: tuple[torch.Tensor, ...]  # float32 kernels' weights
    weight_pointers: list[int]  # and their pointers
    norms: tuple[KernelNorm, ...]  # the RMSNorm modules
    norm_weights: tuple[torch.Tensor, ...]  # their parameters
    norm_pointers: list[int]  # and their pointers
    max_rows: int | None  # the most rows every kernel takes (None: any)
    parts: tuple[ctypes.Array[ctypes.Structure], ...] = ()  # the parts' Weight arrays, kept

    def current(self, model: StackModel, cache: PagedKVCache) -> bool:
        """Whether every object and pointer it was built from is still in place: a layer, a
        kernel, a norm given a new parameter, a weight or norm given new storage (`.data =`).
        Once a step, so the loops run in C (map), not in Python."""
        return (self.cache == (id(cache), cache.k[0].data_ptr())
                and all(map(is_, model.stack_layers(), self.layers))
                and all(map(is_, map(_FORM, self.holders), self.forms))
                and list(map(_POINTER, self.weights)) == self.weight_pointers
                and all(map(is_, map(_WEIGHT, map(_PARAMETERS, self.norms)),
                            self.norm_weights))
                and list(map(_POINTER, self.norm_weights)) == self.norm_pointers)


class DecodeStack:
    """A model's layers as one C call. The description is built per cache (engines that share
    a model, as a Pool's CPU replicas may, each step over their own cache, concurrently) and
    rebuilt when anything it points at changes (weights replaced, `.to()`, a new cache).

    `spent`: when set (a ctypes array of two doubles), each call adds the seconds of its
    matmuls and of its attention calls to it (benchmarks/step_split.py sets it)."""

    spent: ctypes.Array[ctypes.c_double] | None = None
    KEEP = 8  # descriptions kept (one per cache in use)

    def __init__(self, model: StackModel):
        self.model = model
        cfg = model.config
        layers = list(model.stack_layers())
        self.hidden, self.eps = cfg.hidden_size, float(cfg.rms_norm_eps)
        attn = layers[0].self_attn
        self.hq, self.hkv, self.d = attn.hq, attn.hkv, attn.d
        self.rope_id = attn.rope_id
        self.min_window = min((layer.self_attn.window for layer in layers
                               if layer.self_attn.window is not None), default=None)
        self._built: dict[int, _Built] = {}  # by id(cache)

    def __getstate__(self) -> dict[str, object]:  # copies and pickles rebuild the descriptions
        return {**self.__dict__, "_built": {}}

    @classmethod
    def for_model(cls, model: StackModel) -> DecodeStack | None:
        """A stack for `model`, or None where its layers must run one by one. Whether its
        matmuls run on the C kernels is checked at each step (they can come and go)."""
        if unfit_reason(model) is not None:
            return None
        return cls(model)

    @staticmethod
    def _holders(layer: StackLayer) -> tuple[Linear | FusedProjection, ...]:
        """qkv, o, gate_up, down (`unfit_reason` has checked that they exist)."""
        attn, mlp = layer.self_attn, layer.dense_mlp()
        assert attn.qkv is not None and mlp is not None and mlp.gate_up is not None
        return attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj

    def _described(self, cache: PagedKVCache) -> _Built | None:
        """The current description over `cache` (built now if it is missing or stale); None
        where a matmul has no bias-free kernel, so that the per-layer path serves."""
        built = self._built.get(id(cache))
        if built is not None and built.current(self.model, cache):
            return built
        built = self._build(cache)
        if built is not None:
            if len(self._built) >= self.KEEP:
                self._built = {}
            self._built[id(cache)] = built  # one assignment: a concurrent step sees old or new
        return built

    @staticmethod
    def _kernels(form: WeightForm | None) -> list[KernelLinear] | None:
        """The bias-free kernels that give a form's outputs in order: its one kernel, or each
        part's of a `PartsForm` (an NBQ_PARTS weight); None where it has none."""
        if isinstance(form, PartsForm):
            if form.bias is not None:
                return None
            kernels = [part.kernel for part in form.parts]
        else:
            kernel = None if form is None else form.kernel
            kernels = [] if kernel is None else [kernel]
        if not kernels or any(k.bias is not None for k in kernels):
            return None
        return kernels

    def _build(self, cache: PagedKVCache) -> _Built | None:
        layers = list(self.model.stack_layers())
        array = (Layer * len(layers))()
        forms: list[tuple[Linear | FusedProjection, object]] = []
        weights: list[tuple[torch.Tensor, int]] = []
        norms: list[tuple[KernelNorm, torch.Tensor, int]] = []
        parts: list[ctypes.Array[ctypes.Structure]] = []
        max_rows: int | None = None
        for i, layer in enumerate(layers):
            entry = array[i]
            for w, holder in zip((entry.qkv, entry.o, entry.gate_up, entry.down),
                                 self._holders(layer)):
                form = holder.form
                kernels = self._kernels(form)
                if kernels is None:
                    return None
                forms.append((holder, form))
                if len(kernels) > 1:  # each part its own weight, its outputs the next columns
                    described = (Weight * len(kernels))()
                    parts.append(described)
                    w.kind, w.parts, w.part = WeightKind.PARTS, len(kernels), \
                        ctypes.addressof(described)
                    w.n = sum(kernel.out_features for kernel in kernels)
                    w.k = kernels[0].in_features
                    slots = list(described)
                else:
                    slots = [w]
                for slot, kernel in zip(slots, kernels, strict=True):
                    slot.kind = kernel.weight_kind
                    slot.n, slot.k = kernel.out_features, kernel.in_features
                    slot.flags = kernel.flags
                    slot.block_type = kernel.block_type
                    slot.codes, slot.d, slot.m = kernel.pointers
                    if isinstance(kernel.weight, torch.Tensor):  # the model's own float32 rows:
                        weights.append((kernel.weight, slot.codes))  # watched for a new pointer
                    if kernel.max_rows is not None:
                        max_rows = min(kernel.max_rows, max_rows or kernel.max_rows)
            layer_norms = layer.stack_norms()
            assert layer_norms is not None  # `unfit_reason` has checked it
            entry.attn_norm = layer_norms[0].weight.data_ptr()
            entry.mlp_norm = layer_norms[1].weight.data_ptr()
            for norm in layer_norms:
                norms.append((norm, norm.weight, norm.weight.data_ptr()))
            keys, values = cache.k[layer.self_attn.layer], cache.v[layer.self_attn.layer]
            entry.keys, entry.values = keys.data_ptr(), values.data_ptr()
        return _Built(array, tuple(layers), (id(cache), cache.k[0].data_ptr()),
                      tuple(h for h, _ in forms), tuple(f for _, f in forms),
                      tuple(w for w, _ in weights), [p for _, p in weights],
                      tuple(n for n, _, _ in norms), tuple(w for _, w, _ in norms),
                      [p for _, _, p in norms], max_rows, tuple(parts))

    def serves(self, max_pos: int, cache: PagedKVCache) -> bool:
        """Whether a step whose rows reach `max_pos` can run as one call on `cache`."""
        if self.min_window is not None and max_pos + 1 > self.min_window:
            return False  # past a window the layers attend from its start: the torch path
        return paged_cache_serves(cache.k[0], cache.v[0]) and \
            cache.head_dim == self.d and cache.n_kv_heads == self.hkv

    def __call__(self, x: torch.Tensor, positions: torch.Tensor | ctypes.c_int32,
                 tables_i32: torch.Tensor, cache: PagedKVCache,
                 rope: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The hidden states (rows, H) after every layer for x (rows, H), or None where this
        step cannot run here (the caller then runs the layers one by one). `positions`: an
        int32 tensor (rows,), or a ctypes int32 for a lone step; `tables_i32` (rows, S) int32,
        contiguous (a lone step's 1-D table is one row); rope: cos and sin_signed (rows, D)."""
        built = self._described(cache)
        if built is None:
            return None
        rows = x.numel() // self.hidden
        if built.max_rows is not None and rows > built.max_rows:
            return None  # a float32 kernel takes a few rows; more take the model's other paths
        cos, sin_signed = rope
        if not all(t.dtype == torch.float32 and t.is_contiguous() for t in (cos, sin_signed)):
            return None
        out = x.reshape(rows, self.hidden).to(torch.float32, copy=True).contiguous()
        where = ctypes.byref(positions) if isinstance(positions, ctypes.c_int32) \
            else positions.data_ptr()
        failed = quant_kernels().nbq_decode_stack(
            built.array, len(built.layers), rows, self.hidden, self.hq, self.hkv, self.d,
            self.eps, int(cache.k[0].dtype == torch.float16), cache.block_size,
            tables_i32.data_ptr(), tables_i32.shape[-1], where, cos.data_ptr(),
            sin_signed.data_ptr(), out.data_ptr(), torch.get_num_threads(), DecodeStack.spent)
        if failed == -1:
            raise MemoryError("decode stack: out of memory for its scratch buffers")
        if failed:
            raise ValueError("decode stack: invalid arguments (a negative block table entry, "
                             "a position past its table row, or shapes that do not fit)")
        return out
