"""Choosing each matmul weight's serving form (formats.py) for every architecture: float32 with
the C kernel for a few rows and oneDNN-packed copies, float16 copies, quantized blocks; and a
transposed LM head.

A model file holds its architecture only; its model class derives from `WeightFormats` and
says which matmuls it has (`_named_holders`), so every family gets the same fast paths, kept
(or dropped) the same way when the weights move (`.to()`, a deep copy).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .formats import BlockForm, Float16Form, Float32Form, PartsForm, WeightForm
from .holders import FusedProjection, Linear
from .linear import HalfCopy, PackedCopy, packing_affordable, packing_available
from .quant import KernelLinear, QuantBlocks, float_kernel_serves

Holder = Linear | FusedProjection


class BlockExperts(Protocol):
    """A mixture's experts served from a checkpoint's blocks (`models.moe.Experts`): its
    float32 parameters on meta while released, read back out of the blocks for `.to()`,
    `state_dict()`... as the released weights of the matmul holders are."""

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks they are served from."""
        ...

    @property
    def released(self) -> bool:
        """Whether the parameters are on meta (the blocks serve)."""
        ...

    def release(self) -> int:
        """Put the parameters on meta where the blocks give them back bit for bit; the bytes
        freed."""
        ...

    def restore(self) -> None:
        """Make the parameters the blocks' values again (float32) while released."""
        ...


class WeightFormats(nn.Module):
    """The weight copies of a StepModel built from `nn.Linear`s (and fused projections).

    A subclass calls `_init_weight_formats()` in its `__init__`, has an `lm_head` (`Linear`)
    and implements `_named_holders()`, `embedding_weight()` and, if it fuses projections,
    `refresh_fused()`. What was asked for is remembered across `.to()`; each holder's form is
    in its one slot (`Linear.form`, `FusedProjection.form`; see `holders.linear`).
    """

    lm_head: Linear

    def _init_weight_formats(self) -> None:
        self._head_t: torch.Tensor | None = None  # (H, V) copy of the LM head
        self._wants = {"transposed_head": False, "16bit": False, "packed": False,
                       "quantized": False, "float_kernel": False, "release_dense": False}
        # per holder, kept across .to()
        self._quant_copies: list[BlockForm | PartsForm | None] = []
        self._released: list[Holder] = []  # holders whose float32 weight lives in copies only
        self._embedding_source: QuantBlocks | None = None  # a checkpoint's own embedding blocks
        self._embedding_blocks: QuantBlocks | None = None  # set while the embedding is released

    # ------------------------------------------------------------------ what a model provides

    def _named_holders(self) -> list[tuple[Holder, list[str]]]:
        """Every matmul (fused projections where there are), then the LM head, each with the
        HF names of the parameters it multiplies by."""
        raise NotImplementedError

    def embedding_weight(self) -> torch.Tensor:
        """The token embedding (a tied LM head shares it)."""
        raise NotImplementedError

    def refresh_fused(self) -> None:
        """Make fused projections views of their parameters again after the weights moved."""

    def serve_expert_blocks(self, blocks: dict[str, QuantBlocks], round16: bool = True) -> None:
        """Hook for a model with a mixture of experts: take the blocks of its experts'
        matrices out of `blocks` (named per expert, as a GGUF's stacked experts split:
        `loading.gguf.GGUFTensors.serve_blocks`) and serve the experts from them, their
        parameters left on meta (then listed by `block_experts`). `serve_file_blocks` calls it
        before it refuses blocks that serve nothing. `round16`: see `use_quantized_weights`.
        The default takes none (a model without experts)."""

    def block_experts(self) -> list[BlockExperts]:
        """Hook: the model's experts served from blocks (`serve_expert_blocks`), which the
        weight accounting, `release_dense_weights` and `restore_dense_weights` take along.
        The default: none."""
        return []

    @property
    def device(self) -> torch.device:
        return self._resident_parameter().device

    @property
    def dtype(self) -> torch.dtype:
        return self._resident_parameter().dtype

    def _resident_parameter(self) -> torch.Tensor:
        """The embedding, or while it is released (its values in blocks, the parameter on
        meta) the first parameter that is not: what the model's device and dtype are."""
        weight = self.embedding_weight()
        if weight.device.type != "meta":
            return weight
        found = self.__dict__.get("_resident")  # a walk over the parameters is slow, and
        if found is None or found.device.type == "meta":  # this is asked several times a step
            found = next((p for p in self.parameters() if p.device.type != "meta"), weight)
            self.__dict__["_resident"] = found
        return found

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embedding of `ids` (any shape), (*ids.shape, H): a lookup in the weight,
        or in its quantized blocks while it is released (`release_dense_weights`): the same
        values."""
        if self._embedding_blocks is not None:
            return self._embedding_blocks.dequantize_rows(ids)
        return F.embedding(ids, self.embedding_weight())

    # ------------------------------------------------------------------ the copies

    def use_transposed_head(self, enable: bool = True) -> None:
        """Keep a (hidden, vocab) copy of the LM head for `x @ W_t`.

        On CPU in float32, `F.linear` reads the large (vocab, hidden) head at a fraction of the
        memory bandwidth that a matmul against a pre-transposed copy reaches for a single row;
        with several rows neither wins consistently, so only single-row steps use it. Costs one more
        copy of the head. Loaders use it where `pack_weights` is not available; adopted models
        keep sharing their tensors.
        """
        self._head_t = self.lm_head.weight.t().contiguous() if enable else None
        self._wants["transposed_head"] = enable

    def packing_pays(self) -> bool:
        """Whether `pack_weights` is available here and its copies fit the RAM share loaders
        allow (`packing_affordable`): what loaders decide a CPU float32 model's copies by."""
        return packing_available(self.lm_head.weight) and packing_affordable(
            sum(h.weight.numel() * h.weight.element_size() for h in self._weight_holders()))

    def pack_weights(self) -> None:
        """Add a oneDNN-packed copy of every matmul weight and of the LM head (`PackedCopy`):
        on CPU, batched decode steps run their matmuls faster and one-row steps no slower.
        Outputs differ from plain float32 in the last bits. +100% weight memory.
        Loaders do it for CPU float32 (and mixed16, for the steps the float16 copies leave)."""
        if not packing_available(self.lm_head.weight):
            raise ValueError("packed weights need a CPU float32 model and torch built with "
                             "oneDNN (torch.backends.mkldnn.is_available())")
        self.restore_dense_weights()
        for holder in self._weight_holders():
            form = holder.form
            if form is None:
                holder.form = Float32Form(holder.weight, holder.bias, self._packed(holder))
            elif isinstance(form, (Float32Form, Float16Form)) and form.packed is None:
                holder.form = form.with_packed(self._packed(holder))
        self._head_t = None
        self._wants.update({"packed": True, "transposed_head": False})

    @staticmethod
    def _packed(holder: Holder) -> PackedCopy:
        return PackedCopy(holder.weight, holder.bias)

    def use_16bit_weights(self) -> None:
        """Add a float16 copy of every matmul weight (`HalfCopy`) for steps of one or two rows:
        a lone stream decodes faster; batches and prefills keep float32. Greedy
        output can differ from float32 where two tokens are nearly tied. +50% weight memory.
        """
        if self.dtype != torch.float32 or self.device.type != "cpu":
            raise ValueError("16-bit weights are a CPU float32 option: load the model with "
                             "dtype='float32' on cpu (on a GPU use dtype='bfloat16')")
        self.restore_dense_weights()
        for holder in self._weight_holders():  # the float16 copies serve few rows instead of
            form = holder.form  # the float32 kernel; blocks serve every step: left as they are
            if form is None or isinstance(form, Float32Form):
                packed = None if form is None else form.packed
                holder.form = Float16Form(holder.weight, holder.bias,
                                          HalfCopy(holder.weight, holder.bias), packed)
        self._head_t = None
        self._wants.update({"16bit": True, "transposed_head": False, "float_kernel": False})

    def use_float_kernel(self) -> None:
        """Multiply steps of up to FLOAT_MAX_ROWS rows with nbserve's C kernel over the float32
        weights as they are (no copy): faster than oneDNN for a few rows, with the norms and
        the SwiGLU gate inside the kernel calls (benchmarks/README.md). Outputs differ from plain
        float32 in summation order only; a row's result does not depend on the other rows of
        the step. Builds the kernel at first use
        (needs a C compiler); loaders turn it on for CPU float32 where it builds. It takes the
        few rows that float16 copies (`use_16bit_weights`) would: they go."""
        if self.dtype != torch.float32 or self.device.type != "cpu":
            raise ValueError("the float32 kernel is a CPU float32 option")
        self.restore_dense_weights()  # the float32 kernel reads them
        for holder in self._weight_holders():
            form = holder.form
            if (form is None or form.kernel is None) and float_kernel_serves(holder.weight):
                packed = form.packed if isinstance(form, (Float32Form, Float16Form)) else None
                holder.form = Float32Form(holder.weight, holder.bias, packed,
                                          KernelLinear(holder.weight, holder.bias))
        self._wants.update({"float_kernel": True, "16bit": False})

    def use_quantized_weights(self, blocks: Mapping[str, QuantBlocks] | None = None,
                              only_lossless: bool = False, round16: bool = True) -> bool:
        """Add a quantized copy of every matmul weight and of the LM head (`KernelLinear`),
        which then serves steps of every size (its packed copy, if any, goes): a step reads a
        fraction of float32's bytes, and batches are multiplied by panels of dequantized
        rows (benchmarks/README.md).
        `blocks`: a checkpoint's own blocks by parameter name (a GGUF's Q4_0/Q4_1/Q8_0
        tensors, see `loading.gguf`): the same values as the float32 weights dequantized from
        them, so nothing is lost; other weights are quantized to Q8_0 here, and greedy output
        can then differ from float32 where the quantization moves a near-tie. Builds the C
        kernel at first use (needs a C compiler). `only_lossless`: change nothing (and return
        False) unless every weight has its checkpoint's own blocks. `round16` (the default):
        steps of a few rows multiply the inputs rounded to 16 bits per block of 32 where the
        kernel build has integer row kernels for that and they are the faster path (AVX2;
        AVX-512 where measured so, see `KernelLinear`); False (weights="blocks", exact=True) keeps
        float32 arithmetic on every path."""
        if self.dtype != torch.float32 or self.device.type != "cpu":
            raise ValueError("quantized weights are a CPU float32 option: load the model with "
                             "dtype='float32' on cpu (on a GPU use dtype='bfloat16')")
        self.restore_dense_weights()  # Q8_0 blocks are made from them
        by_name: dict[str, QuantBlocks | None] = dict(blocks or {})
        self._embedding_source = by_name.get("model.embed_tokens.weight")
        if "lm_head.weight" not in by_name and \
                self.lm_head.weight is self.embedding_weight():  # tied head
            by_name["lm_head.weight"] = self._embedding_source
        found: list[QuantBlocks | None] = []
        for holder, names in self._named_holders():
            parts = [by_name.get(name) for name in names]
            present = [p for p in parts if p is not None]
            own = QuantBlocks.cat(present) if len(present) == len(parts) else None
            found.append(own if own is not None and own.shape == tuple(holder.weight.shape)
                         else None)
        if only_lossless and any(b is None for b in found):
            return False
        copies: list[BlockForm | PartsForm | None] = []
        for holder, own in zip(self._weight_holders(), found):
            made = own if own is not None else QuantBlocks.from_float(holder.weight)
            copies.append(None if made is None else BlockForm(made, holder.bias, round16))
        self._quant_copies = copies
        self._wants["quantized"] = True
        self._attach_quant_copies()
        return True

    def serve_file_blocks(self, blocks: dict[str, QuantBlocks], round16: bool = True) -> None:
        """Serve a model built with some weights on the meta device from a checkpoint's own
        blocks of them (a quantized GGUF: `loading.gguf.GGUFTensors.serve_blocks`), by
        parameter name: each matmul whose weights are all blocks takes them as its form
        (fused parts stacked where they are of one type, else a `PartsForm`), the token
        embedding is looked up from its blocks (a tied LM head multiplies the same blocks),
        and those weights stay on meta as `release_dense_weights` leaves them (read back out
        of the blocks for `.to()`, `state_dict()`...): no float32 copy of them is ever made.
        Takes `blocks` over: each part is dropped from it once stacked, so the weights are
        never held twice. A matmul stored as floats (or fused with one) gets Q8_0 blocks made
        of its float32 weight, which stays, as `use_quantized_weights` does. The blocks of a
        mixture's experts go to `serve_expert_blocks`. `round16`: see there."""
        if not blocks:
            return
        embedding = self.embedding_weight()
        names = [n for n, p in self.named_parameters(remove_duplicate=False) if p is embedding]
        source = next((blocks[n] for n in names if n in blocks), None)
        if embedding.device.type == "meta":
            if source is None:
                raise RuntimeError(f"the token embedding of {type(self).__name__} was left to "
                                   "blocks the checkpoint does not have")
            self._embedding_source = self._embedding_blocks = source
        tied = self.lm_head.weight is embedding
        copies: list[BlockForm | PartsForm | None] = []
        for holder, parts_names in self._named_holders():
            if holder.weight.device.type != "meta":  # stored as floats: Q8_0 made of them,
                made = QuantBlocks.from_float(holder.weight)  # as use_quantized_weights does
                copies.append(None if made is None else BlockForm(made, holder.bias, round16))
                if made is not None:
                    holder.form = copies[-1]
                continue
            parts = [source if tied and name == "lm_head.weight" else blocks.pop(name, None)
                     for name in parts_names]
            present = [p for p in parts if p is not None]
            if len(present) != len(parts):
                raise RuntimeError(f"{parts_names} of {type(self).__name__} were left to "
                                   "blocks the checkpoint does not have")
            own = QuantBlocks.cat(present)
            form: BlockForm | PartsForm = BlockForm(own, holder.bias, round16) \
                if own is not None else \
                PartsForm([BlockForm(p, None, round16) for p in present], holder.bias)
            holder.form = form
            copies.append(form)
            if holder.weight is not embedding:  # a tied head comes back with the embedding
                self._released.append(holder)
        self.serve_expert_blocks(blocks, round16)
        unserved = sorted(set(blocks) - set(names))
        if unserved:
            raise RuntimeError(f"blocks of {unserved[:3]} serve no matmul of "
                               f"{type(self).__name__}")
        blocks.clear()
        self._quant_copies = copies
        self._wants.update({"quantized": True, "release_dense": True})

    def _attach_quant_copies(self) -> None:
        """Make the blocks the form of their holders (a float form, its packed copy with it,
        would never be read again); a weight without blocks keeps its form."""
        for holder, form in zip(self._weight_holders(), self._quant_copies):
            if form is not None:
                holder.form = form

    # ------------------------------------------------------------------ released float32 weights

    def release_dense_weights(self) -> int:
        """Drop the float32 weight of every matmul that no step reads any more, and return the
        bytes freed: quantized blocks (`use_quantized_weights`) serve steps of every size, so
        the plain weight is only what they were made from. A weight is dropped only where it
        can come back bit for bit: from a form whose dense view (`WeightForm.dense`: blocks
        dequantized) is exactly its values (a GGUF's own blocks; not Q8_0 made at load from
        float weights).
        Its parameters stay, with their names and shapes, on the meta device, and come back by
        themselves (`restore_dense_weights`) for `.to()`, `state_dict()`, `load_state_dict()`
        and the methods that add copies. The token embedding (a tied LM head's weight too) goes
        the same way where the checkpoint's own blocks of it dequantize to exactly its values:
        lookups then read those blocks (`embed`). Outputs do not change: every step runs on the
        same copies as before. Loaders call it for weights="blocks"; remembered across
        `.to()`."""
        self._wants["release_dense"] = True
        embedding = self.embedding_weight()
        freed = 0
        for holder, names in self._named_holders():
            weight, form = holder.weight, holder.form
            if (any(h is holder for h in self._released) or form is None
                    or not form.serves_every_step or weight is embedding
                    or weight.device.type != "cpu" or not self._owns(holder, names)
                    or not torch.equal(form.dense(), weight)):
                continue
            freed += weight.numel() * weight.element_size()
            self._set_dense(holder, names, torch.empty(weight.shape, dtype=weight.dtype,
                                                       device="meta"))
            self._released.append(holder)
        freed += sum(experts.release() for experts in self.block_experts())
        return freed + self._release_embedding()

    def _release_embedding(self) -> int:
        """Put the token embedding (and a head tied to it) on meta where the checkpoint's own
        blocks of it give its values back bit for bit; return the bytes freed."""
        weight, blocks = self.embedding_weight(), self._embedding_source
        head = self.lm_head.form
        tied = self.lm_head.weight is weight
        if (self._embedding_blocks is not None or blocks is None or weight.device.type != "cpu"
                or blocks.shape != tuple(weight.shape)
                or (tied and (head is None or not head.serves_every_step))
                or not torch.equal(blocks.dequantize(), weight)):
            return 0
        self._set_embedding(torch.empty(weight.shape, dtype=weight.dtype, device="meta"))
        self._embedding_blocks = blocks
        return weight.numel() * weight.element_size()

    def _set_embedding(self, weight: torch.Tensor) -> None:
        """Make `weight` the value of every parameter that is the token embedding (a tied
        head's too, so they stay one parameter)."""
        old = self.embedding_weight()
        names = [name for name, p in self.named_parameters(remove_duplicate=False) if p is old]
        param = nn.Parameter(weight, requires_grad=False)
        for name in names:
            owner_name, _, attr = name.rpartition(".")
            setattr(self.get_submodule(owner_name), attr, param)

    @staticmethod
    def _dense_copy(holder: Holder) -> torch.Tensor:
        """A released weight's values, out of its form (its blocks)."""
        form = holder.form
        assert form is not None  # a weight is released only where its form serves every step
        return form.dense()

    def restore_dense_weights(self) -> None:
        """Bring back the float32 weights `release_dense_weights` dropped, read out of their
        forms (the same values bit for bit); they stay until released
        again."""
        if self._embedding_blocks is not None:
            self._set_embedding(self._embedding_blocks.dequantize())
            self._embedding_blocks = None
        for experts in self.block_experts():
            experts.restore()
        if not self._released:
            return
        named = {id(holder): names for holder, names in self._named_holders()}
        for holder in self._released:
            self._set_dense(holder, named[id(holder)], self._dense_copy(holder))
        self._released = []

    @property
    def dense_released(self) -> bool:
        """Whether some float32 weights (matmuls, the embedding) live in their copies only (on
        meta)."""
        return bool(self._released) or self._embedding_blocks is not None or any(
            experts.released for experts in self.block_experts())

    def _owns(self, holder: Holder, names: list[str]) -> bool:
        """Whether `names` are the parameters `holder` multiplies by (so they can be swapped)."""
        try:
            params = [self.get_parameter(name) for name in names]
        except AttributeError:
            return False
        if isinstance(holder, FusedProjection):
            return len(params) == len(holder.sizes) and all(
                p.shape[0] == size for p, size in zip(params, holder.sizes))
        return len(params) == 1 and params[0] is holder.weight

    def _set_dense(self, holder: Holder, names: list[str], weight: torch.Tensor) -> None:
        """Make `weight` (real or meta) the weight of `holder` and of its named parameters."""
        if isinstance(holder, FusedProjection):
            setattr(holder.owner, f"{holder.name}_weight", weight)
            start = 0
            for name, size in zip(names, holder.sizes):
                owner_name, _, attr = name.rpartition(".")
                setattr(self.get_submodule(owner_name), attr,
                        nn.Parameter(weight[start:start + size], requires_grad=False))
                start += size
        else:
            holder.weight = nn.Parameter(weight, requires_grad=False)

    def state_dict(self, *args, **kwargs):  # noqa: ANN002, ANN003 -- nn.Module's signature
        """nn.Module's, with released float32 weights read back from their forms (the
        model keeps them released; the returned tensors are the caller's)."""
        released = self.dense_released
        self.restore_dense_weights()
        try:
            return super().state_dict(*args, **kwargs)
        finally:
            if released:
                self.release_dense_weights()

    def load_state_dict(self, *args, **kwargs):  # noqa: ANN002, ANN003
        """nn.Module's, into real float32 weights: released ones come back first, and stay
        (the copies are not rebuilt from new values here, as before)."""
        self.restore_dense_weights()
        self._wants["release_dense"] = False
        return super().load_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse=True):  # noqa: ANN001 -- nn.Module's hook for .to(), .half()...
        self.restore_dense_weights()  # the move needs values, not meta tensors
        result = super()._apply(fn, recurse)
        self.refresh_derived()
        return result

    def refresh_derived(self) -> None:
        """Rebuild what is derived from the weights after they moved (`.to()`, a deep copy):
        the fused projections become views again, the CPU-float32-only extras (transposed
        head, float16 and packed copies) follow or are dropped, so no stale tensor on the old
        device or dtype is ever used. Released float32 weights come back first, and are
        released again once the copies that stand in for them are rebuilt."""
        self.restore_dense_weights()
        self.refresh_fused()
        self.__dict__.pop("_resident", None)
        cpu32 = self.device.type == "cpu" and self.dtype == torch.float32
        if self._wants["transposed_head"]:
            self._head_t = self.lm_head.weight.t().contiguous() if cpu32 else None
        for holder in self._weight_holders():
            holder.form = None
        if cpu32 and self._wants["quantized"]:
            self._attach_quant_copies()
        elif cpu32 and self._wants["float_kernel"]:
            self.use_float_kernel()
        if cpu32 and self._wants["16bit"]:
            self.use_16bit_weights()
        if cpu32 and self._wants["packed"] and packing_available(self.lm_head.weight):
            self.pack_weights()
        if cpu32 and self._wants["release_dense"]:
            self.release_dense_weights()

    def _weight_holders(self) -> list[Holder]:
        """The layer matmuls and the LM head: what carries float16, packed, quantized copies."""
        return [holder for holder, _ in self._named_holders()]

    def derived_bytes(self) -> int:
        """Bytes of the weight copies kept for speed (float16, packed, quantized, transposed
        head) and of the blocks experts are served from (`block_experts`); the float32 kernel
        shares the weights and adds none."""
        total = 0 if self._head_t is None else self._head_t.numel() * self._head_t.element_size()
        forms = [holder.form for holder in self._weight_holders()]
        total += sum(form.nbytes for form in forms if form is not None)
        head = self.lm_head.form
        if self._embedding_blocks is not None and not (
                isinstance(head, BlockForm) and head.blocks is self._embedding_blocks):
            total += self._embedding_blocks.nbytes  # an untied embedding's own blocks
        return total + sum(experts.nbytes for experts in self.block_experts())

    @property
    def weight_format(self) -> str:
        """"mixed16" after `use_16bit_weights`, "quantized" after `use_quantized_weights`
        ("quantized-exact" with round16=False): the LM head's form's name; else the dtype's."""
        head: WeightForm | None = self.lm_head.form
        if head is not None and head.weight_format is not None:
            return head.weight_format
        if self._wants["quantized"]:  # a head the file stores as floats: the layers' blocks
            named = (h.form.weight_format for h in self._weight_holders() if h.form is not None)
            found = next((name for name in named if name is not None), None)
            if found is not None:
                return found
        return str(self.dtype).replace("torch.", "")


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(parameters, bytes), counting tied tensors once, and the copies kept for speed; a
    released weight (on meta: its values live in its blocks or packed copy, counted there)
    counts as parameters, not bytes."""
    seen: dict[object, torch.Tensor] = {}
    for p in model.parameters():
        seen.setdefault(id(p) if p.device.type == "meta" else p.data_ptr(), p)
    extra = model.derived_bytes() if isinstance(model, WeightFormats) else 0
    return (sum(p.numel() for p in seen.values()),
            sum(p.numel() * p.element_size() for p in seen.values() if p.device.type != "meta")
            + extra)


def weight_summary(model: object) -> tuple[int, str]:
    """(bytes, format) of a model's weights as served: `count_parameters`' bytes (blocks
    counted as stored, released float32 weights not at all) and its `weight_format` (a torch
    module's dtype otherwise); (0, "unknown") for a model that is not a torch module."""
    if not isinstance(model, nn.Module):
        return 0, "unknown"
    if isinstance(model, WeightFormats):
        return count_parameters(model)[1], model.weight_format
    dtype = next((p.dtype for p in model.parameters()), None)
    return count_parameters(model)[1], str(dtype).replace("torch.", "")
