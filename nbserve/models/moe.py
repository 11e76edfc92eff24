"""Mixture-of-experts MLPs for the decoder (Qwen3-MoE, Mixtral): a router picks the top-k
experts of each token, and each expert runs once over the tokens routed to it.

Routing is transformers': a softmax over the router logits in float32, the top k, renormalised
where the config says (`norm_topk_prob`; Mixtral always), then the weights cast back to the
model's dtype before they scale the experts' outputs (Qwen3-MoE) or kept in float32 until the
product is cast (Mixtral). The experts are computed grouped by expert: the (token, choice)
pairs are sorted by expert and each expert's rows go through one matmul against its slice of
the 3-D weights (`torch.nn.functional.grouped_mm` where torch has it: one call for all experts,
no host sync, so CUDA graphs can capture it; else one `F.linear` per expert that has tokens).
Expert weights are never gathered per token (that would copy top-k weight matrices per token)
and no expert runs on tokens not routed to it.

Parameters carry transformers 5's names, so its state dicts and models load as they are:
`mlp.gate.weight` (E, H) the router, `mlp.experts.gate_up_proj` (E, 2I, H) gate rows then up
rows, `mlp.experts.down_proj` (E, H, I). Checkpoints on the hub (and GGUF files, which the
GGUF reader splits per expert) name each expert's matrices; `stack_experts` stacks them at load.

A quantized GGUF's experts are served from the file's blocks (`Experts.serve_blocks`): each
expert's gate|up and down are a `BlockForm` multiplied by the C kernels over the rows routed
to it, and the 3-D parameters stay on the meta device (read back out of the blocks for
`.to()`, `state_dict()`: `restore`), as the other weights of such a model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..execution.formats import BlockForm, PartsForm
from ..execution.holders import FusedProjection, Linear, linear
from ..execution.quant import QuantBlocks
from .layers import ACTIVATION, MLP, DecoderMLP

if TYPE_CHECKING:
    from .config import DecoderConfig

ROUTINGS = ("qwen3_moe", "mixtral")

# torch >= 2.10 has F.grouped_mm, 2.8/2.9 torch._grouped_mm; older torch runs the per-expert loop
_GROUPED_MM: Callable[..., torch.Tensor] | None = getattr(F, "grouped_mm", None) or \
    getattr(torch, "_grouped_mm", None)
_GROUPED_FAILED: set[tuple[str, torch.dtype]] = set()  # (device type, dtype) it refused


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """The experts of a model. sparse_layers: the layers whose MLP is a mixture (the others
    keep the dense MLP of `intermediate_size`). routing: "qwen3_moe" (top-k weights cast to the
    model's dtype before they scale the outputs) or "mixtral" (kept in float32 until then)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: frozenset[int]
    routing: str = "qwen3_moe"

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown routing {self.routing!r}; nbserve routes as "
                             f"{', '.join(ROUTINGS)}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"{self.top_k} experts per token out of {self.num_experts}")

    def make_mlp(self, cfg: DecoderConfig, layer: int) -> DecoderMLP:
        """What the decoder calls for each layer (`layers.make_mlp`): `make_moe_mlp`."""
        return make_moe_mlp(cfg, layer, self)


def sparse_layers(n_layers: int, num_experts: int, decoder_sparse_step: int = 1,
                  mlp_only_layers: Iterable[int] = ()) -> frozenset[int]:
    """Qwen3-MoE's rule: layer i routes to experts iff it is not in `mlp_only_layers` and
    (i + 1) is a multiple of `decoder_sparse_step` (and the model has experts)."""
    dense = set(mlp_only_layers)
    step = max(int(decoder_sparse_step), 1)
    return frozenset(i for i in range(n_layers)
                     if num_experts > 0 and i not in dense and (i + 1) % step == 0)


def make_moe_mlp(cfg: DecoderConfig, layer: int, moe: MoEConfig) -> DecoderMLP:
    """Layer `layer`'s MLP: a `SparseMoE` where `moe` makes it sparse, else the dense MLP."""
    if layer in moe.sparse_layers:
        return SparseMoE(cfg, moe)
    return MLP(cfg)


class Experts(nn.Module):
    """The experts' weights as two 3-D parameters (transformers 5's layout) and their
    grouped computation."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = ACTIVATION[act]
        self.grouped = True  # False: one F.linear per expert with tokens, as without grouped_mm
        # served from blocks (`serve_blocks`): each expert's gate|up form and its down form
        self.forms: tuple[list[BlockForm | PartsForm], list[BlockForm]] | None = None
        self._released = False  # the parameters on meta, the forms serving (`released`)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                prompt: bool = False) -> torch.Tensor:
        """x (N, H), experts and weights (N, k) -> sum over k of weight * expert(x), (N, H).
        `prompt`: the rows are a prompt chunk's positions, which the kernels of experts served
        from blocks multiply without 8-bit inputs (`execution.quant.KernelLinear.flags`)."""
        n, k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, choice) pairs, expert by expert
        rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))  # (N*k, H)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        ends = counts.cumsum(0).to(torch.int32)  # grouped_mm's offsets: each group's end row
        forms = self.forms if self.released else None
        gate_up = (self._matmul(rows, self.gate_up_proj, counts, ends) if forms is None
                   else served_linear(rows, forms[0], counts, prompt))  # (N*k, 2I)
        i = self.intermediate
        hidden = self.act(gate_up[:, :i]) * gate_up[:, i:]
        out = (self._matmul(hidden, self.down_proj, counts, ends) if forms is None
               else served_linear(hidden, forms[1], counts, prompt))  # (N*k, H)
        out = (out * weights.reshape(-1)[order, None]).to(x.dtype)
        unsorted = torch.empty_like(out).index_copy_(0, order, out)
        return unsorted.view(n, k, -1).sum(dim=1)

    # ------------------------------------------------------------ served from blocks

    def serve_blocks(self, gate: list[QuantBlocks], up: list[QuantBlocks],
                     down: list[QuantBlocks], round16: bool = True) -> None:
        """Serve the experts from a checkpoint's blocks of each one's gate, up and down
        matrices (a GGUF's: `loading.gguf.GGUFTensors.serve_blocks`), their parameters left on
        the meta device: expert e's gate|up is `QuantBlocks.cat` of its gate and up blocks (no
        copy where the reader laid them out so; a `PartsForm` where their types differ), its
        down its down blocks, each multiplied by the C kernels (`round16`: see
        `KernelLinear`). Raises ValueError for a count or shape that is not this layer's."""
        n, i = self.num_experts, self.intermediate
        h = self.down_proj.shape[1]
        if not len(gate) == len(up) == len(down) == n:
            raise ValueError(f"blocks of {len(gate)}, {len(up)}, {len(down)} experts' gate, up, "
                             f"down for a layer of {n} experts")
        gate_up: list[BlockForm | PartsForm] = []
        for e, (g, u, d) in enumerate(zip(gate, up, down)):
            if g.shape != (i, h) or u.shape != (i, h) or d.shape != (h, i):
                raise ValueError(f"expert {e}'s blocks have shapes {g.shape}, {u.shape}, "
                                 f"{d.shape}; the layer's are {(i, h)}, {(i, h)}, {(h, i)}")
            own = QuantBlocks.cat([g, u])
            gate_up.append(BlockForm(own, None, round16) if own is not None else
                           PartsForm([BlockForm(g, None, round16), BlockForm(u, None, round16)]))
        self.forms = (gate_up, [BlockForm(d, None, round16) for d in down])
        self._released = True

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks the experts are served from (0 when they are not)."""
        return 0 if self.forms is None else sum(f.nbytes for f in (*self.forms[0],
                                                                   *self.forms[1]))

    @property
    def released(self) -> bool:
        """Whether the experts are served from their blocks, the parameters on meta."""
        return self._released

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_proj, down_proj) as float32, read out of the blocks (`serve_blocks`)."""
        assert self.forms is not None
        return (torch.stack([f.dense() for f in self.forms[0]]),
                torch.stack([f.dense() for f in self.forms[1]]))

    def restore(self) -> None:
        """Make the parameters the blocks' values again (float32, on CPU) while released."""
        if self.released:
            gate_up, down = self.dense()
            self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
            self.down_proj = nn.Parameter(down, requires_grad=False)
            self._released = False

    def release(self) -> int:
        """Put the parameters back on meta, the experts served from their blocks, where those
        give them back bit for bit (CPU float32, unchanged since `restore`); the bytes freed."""
        params = (self.gate_up_proj, self.down_proj)
        if self.forms is None or self.released or any(
                p.device.type != "cpu" or p.dtype != torch.float32 for p in params):
            return 0
        gate_up, down = self.dense()
        if not (torch.equal(gate_up, params[0]) and torch.equal(down, params[1])):
            return 0
        self.gate_up_proj, self.down_proj = (
            nn.Parameter(torch.empty(p.shape, device="meta"), requires_grad=False)
            for p in params)
        self._released = True
        return sum(p.numel() * p.element_size() for p in params)

    def _matmul(self, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
                ends: torch.Tensor) -> torch.Tensor:
        """Row group e of x (sorted by expert) times weight[e] transposed, for every e."""
        key = (x.device.type, x.dtype)
        if self.grouped and _GROUPED_MM is not None and key not in _GROUPED_FAILED:
            capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
            try:
                return grouped_linear(x, weight, ends)
            except (RuntimeError, NotImplementedError):
                if capturing:  # a failed capture falls back as a whole; eager steps retry
                    raise
                _GROUPED_FAILED.add(key)
        return per_expert_linear(x, weight, counts)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x (R, in) in expert order, weight (E, out, in), ends (E,) int32 -> (R, out): one
    grouped matmul over the weight as it is (a transposed view, no copy)."""
    assert _GROUPED_MM is not None
    return _GROUPED_MM(x, weight.transpose(1, 2), offs=ends)


def per_expert_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor
                      ) -> torch.Tensor:
    """`grouped_linear` as one `expert_linear` per expert with rows (reads the counts on the
    host: a device sync on CUDA)."""
    return by_expert(x, counts, lambda e, rows: expert_linear(rows, weight[e]))


def served_linear(x: torch.Tensor, forms: list[BlockForm] | list[BlockForm | PartsForm],
                  counts: torch.Tensor, prompt: bool = False) -> torch.Tensor:
    """`per_expert_linear` over experts served from blocks: each expert's rows through its
    form (`BlockForm.matmul`, the C kernels); a prompt's rows as one sequence's positions
    (1, rows, H), as the kernels tell a prompt chunk from decode rows (one position each)."""
    if prompt:
        return by_expert(x, counts, lambda e, rows: forms[e].matmul(rows[None])[0])
    return by_expert(x, counts, lambda e, rows: forms[e].matmul(rows))


def by_expert(x: torch.Tensor, counts: torch.Tensor,
              multiply: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x's rows in expert order (`counts` rows each), each expert's through `multiply(e,
    rows)`, the results in the same order."""
    outs, start = [], 0
    for e, count in enumerate(counts.tolist()):
        if count:
            outs.append(multiply(e, x[start:start + count]))
            start += count
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def expert_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One expert's matmul over its rows."""
    return F.linear(x, weight)


class SparseMoE(DecoderMLP):
    """A sparse MLP: the router (`gate`, an nn.Linear over float weights) and the experts.
    Offers the dense MLP's interface (forward(x, norm), fuse, holders)."""

    def __init__(self, cfg: DecoderConfig, moe: MoEConfig):
        super().__init__()
        h = cfg.hidden_size
        self.gate = Linear(h, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, h, moe.intermediate_size, cfg.hidden_act)
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.float32_weights = moe.routing == "mixtral"

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) (N, k) of x (N, H): softmax in float32, top-k, renormalised
        where the config says, the weights cast back to x's dtype (not for Mixtral)."""
        logits = linear(x, self.gate)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_weights else weights.to(logits.dtype)), experts

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """The mixture's output for norm(x) (x without a norm), x (..., H)."""
        h = x if norm is None else norm(x)
        flat = h.reshape(-1, h.shape[-1])
        weights, experts = self.route(flat)
        prompt = x.dim() >= 3 and x.shape[-2] > 1  # several positions a sequence
        return self.experts(flat, experts, weights, prompt).view(x.shape)

    def fuse(self, rebuild: bool = False) -> None:
        """Nothing to fuse: each expert's gate and up are one tensor already."""

    def holders(self, prefix: str) -> list[tuple[Linear | FusedProjection, list[str]]]:
        """None: the experts are 3-D tensors, not matmul holders, and the router stays plain
        float: it is a small matmul, routing on exact logits keeps the experts transformers
        picks, and GGUF files keep routers in F32, so a holder without the file's own blocks
        would keep the rest of the model off its lossless quantized blocks."""
        return []


# ------------------------------------------------------------------ per-expert checkpoints

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.weight$")
# what each family names an expert's matrices (their `PROJECTIONS`): gate, up or down
EXPERT_ROLES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",  # Qwen3-MoE
                "w1": "gate", "w3": "up", "w2": "down"}  # Mixtral


ExpertBlocks = tuple[list[QuantBlocks], list[QuantBlocks], list[QuantBlocks]]  # gate, up, down


def take_expert_blocks(blocks: dict[str, QuantBlocks], layers: Iterable[int]
                       ) -> dict[int, ExpertBlocks]:
    """The blocks of layers `layers`' experts, taken out of `blocks` (named per expert,
    `model.layers.L.{block}.experts.E.{proj}.weight`, proj one of `EXPERT_ROLES`): by layer,
    (gate, up, down) blocks in expert order. Raises ValueError for a layer that lacks some."""
    wanted = set(layers)
    found: dict[int, dict[tuple[str, int], QuantBlocks]] = {}
    for name in list(blocks):
        m = _EXPERT.match(name)
        if m is not None and int(m.group(1)) in wanted and m.group(4) in EXPERT_ROLES:
            found.setdefault(int(m.group(1)), {})[(EXPERT_ROLES[m.group(4)], int(m.group(3)))] \
                = blocks.pop(name)
    out: dict[int, ExpertBlocks] = {}
    for layer, parts in found.items():
        n = 1 + max(e for _, e in parts)
        lacking = [f"{role} of expert {e}" for e in range(n) for role in ("gate", "up", "down")
                   if (role, e) not in parts]
        if lacking:
            raise ValueError(f"layer {layer} has blocks of some experts' matrices but not of "
                             f"{', '.join(lacking[:3])}")
        gate, up, down = ([parts[(role, e)] for e in range(n)] for role in ("gate", "up", "down"))
        out[layer] = (gate, up, down)
    return out


class _LayerStack:
    """One layer's stacked expert tensors, filled as the per-expert matrices arrive (so a
    layer is held once, not per expert and then stacked)."""

    def __init__(self, layer: int, num_experts: int):
        self.layer, self.n = layer, num_experts
        self.gate_up: torch.Tensor | None = None
        self.down: torch.Tensor | None = None
        self.seen: set[tuple[str, int]] = set()

    def add(self, role: str, expert: int, t: torch.Tensor, name: str) -> None:
        if role == "down":
            if self.down is None:
                self.down = t.new_empty((self.n, *t.shape))
            dest = self.down[expert]
        else:
            if self.gate_up is None:
                self.gate_up = t.new_empty((self.n, 2 * t.shape[0], *t.shape[1:]))
            half = self.gate_up.shape[1] // 2
            dest = self.gate_up[expert, :half] if role == "gate" else self.gate_up[expert, half:]
        if dest.shape != t.shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, the other experts' "
                             f"{role} matrices {tuple(dest.shape)}")
        dest.copy_(t)
        self.seen.add((role, expert))

    @property
    def complete(self) -> bool:
        return len(self.seen) == 3 * self.n

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        prefix = f"model.layers.{self.layer}.mlp.experts"
        assert self.gate_up is not None and self.down is not None
        yield f"{prefix}.gate_up_proj", self.gate_up
        yield f"{prefix}.down_proj", self.down

    def lacking(self) -> list[str]:
        return [f"{role} of expert {e}" for e in range(self.n) for role in ("gate", "up", "down")
                if (role, e) not in self.seen]


def stack_experts(tensors: Iterable[tuple[str, torch.Tensor]], num_experts: int,
                  projections: dict[str, str], block: str = "mlp"
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors with per-expert names (`model.layers.L.{block}.experts.E.{proj}.weight`, proj a
    key of `projections`, which says whether it is the "gate", "up" or "down" matrix) as
    transformers 5's stacked `mlp.experts.gate_up_proj` (E, 2I, H: gate rows, then up rows) and
    `mlp.experts.down_proj` (E, H, I), each layer's as soon as all its experts have come;
    `{block}.` becomes `mlp.` in the other names of a layer (Mixtral's block_sparse_moe).
    Other tensors pass as they are. Raises ValueError for an expert out of range, a shape
    that differs from the other experts', or a missing expert."""
    pending: dict[int, _LayerStack] = {}
    rename = f".{block}." if block != "mlp" else None
    for name, tensor in tensors:
        m = _EXPERT.match(name)
        if m is None or m.group(2) != block or m.group(4) not in projections:
            if rename is not None and name.startswith("model.layers.") and rename in name:
                name = name.replace(rename, ".mlp.", 1)
            yield name, tensor
            continue
        layer, expert = int(m.group(1)), int(m.group(3))
        if expert >= num_experts:
            raise ValueError(f"tensor {name!r}: expert {expert} of a model with {num_experts}")
        stack = pending.setdefault(layer, _LayerStack(layer, num_experts))
        stack.add(projections[m.group(4)], expert, tensor, name)
        if stack.complete:
            yield from pending.pop(layer).tensors()
    for layer, stack in pending.items():
        lacking = stack.lacking()
        raise ValueError(f"layer {layer} lacks {len(lacking)} expert tensors, e.g. "
                         f"{', '.join(lacking[:3])}")


def moe_tensors(tensors: Iterable[tuple[str, torch.Tensor]], cfg: DecoderConfig,
                projections: dict[str, str], block: str = "mlp"
                ) -> Iterable[tuple[str, torch.Tensor]]:
    """`tensors` with per-expert ones stacked (`stack_experts`) for a model with experts."""
    moe = cfg.moe
    if moe is None:
        return tensors
    return stack_experts(tensors, moe.num_experts, projections, block)
