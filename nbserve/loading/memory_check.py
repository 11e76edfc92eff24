"""Refuse a model that cannot fit before anything is allocated.

The bytes a load's weights will hold are computed from the checkpoint's header alone (a GGUF's
tensor infos, safetensors' JSON headers: types and shapes, no tensor data read) and the form
the loader builds of each tensor (`WeightForm`), then compared with the memory a new
allocation can take (`cpu.memory.available_bytes`: RAM available, under a cgroup's limit, or a
GPU's free memory). A model that does not fit is refused with the GiB it needs, the GiB
available and what to do, instead of growing until the machine runs out.

`weight_bytes` is the one place that knows what the loader makes of a tensor: when the loader
changes (blocks served as the file stores them), it changes with it.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..cpu.memory import available_bytes
from ..execution.linear import packing_affordable, packing_available
from ..models.dtypes import MIXED16, QUANTIZED_FORMATS

GiB = 2**30
BLOCK = 32  # weights per Q4_0/Q4_1/Q8_0 block along a row
Q8_0_BYTES = 34  # one Q8_0 block: a float16 scale and 32 int8 codes
FILE_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # the types whose blocks the loader keeps as stored
# 2-D tensors that are looked up, not multiplied (no matmul copy is made of them, unless a
# tied LM head multiplies by the token embedding), and the LM head, by GGUF name and by the
# end of a Hugging Face name
TOKEN_EMBEDDINGS = ("token_embd.weight", "embed_tokens.weight", "wte.weight", "embed_in.weight")
POSITION_EMBEDDINGS = ("position_embd.weight", "wpe.weight", "embed_positions.weight")
HEADS = ("output.weight", "lm_head.weight", "embed_out.weight")


class ModelTooLargeError(RuntimeError):
    """The model's weights, as the loader would build them, need more memory than there is."""


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """One tensor as a checkpoint stores it: `shape` rows first (torch's order, the row
    length last), `stored` the file's type name ("Q4_K", "F16", "BF16"...), `nbytes` its
    bytes in the file."""

    name: str
    shape: tuple[int, ...]
    stored: str
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class WeightForm:
    """What a load builds of each tensor: dense weights in `dtype`, plus `copies` of the
    matmul weights: "none"; "file" (a GGUF's own Q4_0/Q4_1/Q8_0 blocks, the CPU default for
    a file whose matmul weights are all of those types); "blocks" (weights="blocks": those
    blocks, or Q8_0 made at load for the other weights); "served" (a quantized GGUF on CPU,
    by default: the file's blocks read as they are, those weights never dense); "float16"
    (weights="mixed16").
    `float_copies`: a CPU float32 model's copies for speed (oneDNN-packed weights where they
    fit a share of the RAM, else a transposed LM head), made unless blocks serve every step."""

    dtype: torch.dtype
    copies: str = "none"
    float_copies: bool = False

    def describe(self) -> str:
        dense = f"{str(self.dtype).replace('torch.', '')} weights"
        return {"none": dense, "file": f"{dense} plus the file's own 4/8-bit blocks",
                "blocks": f"{dense} plus 4/8-bit blocks (weights='blocks')",
                "served": "the file's own blocks (weights='blocks'), other tensors "
                          f"as {dense}",
                "float16": f"{dense} plus float16 copies (weights='mixed16')"}[self.copies] + \
            (" and copies for speed" if self.float_copies else "")


def load_form(dtype: torch.dtype, weight_format: str | None, file_blocks: bool,
              device: torch.device, served: bool = False) -> WeightForm:
    """The form `loading.load` builds: `dtype` the dense weights' dtype, `weight_format` a
    weight format asked for ("quantized", "mixed16"...), `file_blocks` whether a GGUF's own
    blocks are kept by default (where they serve every matmul), on `device`; `served`: a
    GGUF's blocks read and served as they are (`gguf.load_gguf`'s weight_format)."""
    if served:
        return WeightForm(dtype, "served")
    if weight_format in QUANTIZED_FORMATS:
        return WeightForm(dtype, "blocks")
    float_copies = device.type == "cpu" and dtype == torch.float32
    if weight_format == MIXED16:
        return WeightForm(dtype, "float16", float_copies)
    return WeightForm(dtype, "file" if file_blocks else "none", float_copies)


def weight_bytes(tensors: Iterable[StoredTensor], form: WeightForm) -> int:
    """The bytes the weights hold at the load's peak, at least: every tensor dense in
    `form.dtype` (a GGUF's blocks are dequantized at load), the copies `form` adds, and the
    largest tensor once more in float32 (the load's temporary: one tensor dequantized, then
    converted or fused). The dense weights a quantized model drops once its blocks serve
    every step are counted: they exist until the load ends."""
    tensors = list(tensors)
    size = torch.tensor([], dtype=form.dtype).element_size()
    if form.copies == "served":  # matmul weights (2-D) and stacked experts (3-D) of a served
        from ..execution.quant import BLOCK_TYPES  # type as stored, the rest dense; one
        # tensor (a layer's gate and up experts: one buffer) read and reordered at a time
        kept = [t.nbytes if t.stored in BLOCK_TYPES and len(t.shape) in (2, 3)
                else t.numel * size for t in tensors]
        return sum(kept) + 2 * max(kept, default=0)
    dense = sum(t.numel * size for t in tensors)
    largest = max((t.numel * 4 for t in tensors), default=0)
    tied = not any(_named(t, HEADS) for t in tensors)
    copies = matmul_bytes = head_bytes = 0
    lossless = True  # every matmul weight stored as blocks the loader keeps
    for t in tensors:
        if len(t.shape) < 2:
            continue
        matmul = not _named(t, POSITION_EMBEDDINGS) and (tied or not _named(t, TOKEN_EMBEDDINGS))
        if matmul:
            matmul_bytes += t.numel * size
            lossless = lossless and t.stored in FILE_BLOCK_TYPES
            if _named(t, HEADS) or tied and _named(t, TOKEN_EMBEDDINGS):
                head_bytes = t.numel * size
        if form.copies in ("file", "blocks") and t.stored in FILE_BLOCK_TYPES:
            copies += t.nbytes  # kept as stored, the embedding's too (lookups read them)
        elif form.copies == "blocks" and matmul and t.shape[-1] % BLOCK == 0:
            copies += t.numel // BLOCK * Q8_0_BYTES  # Q8_0 made from the dense weight
        elif form.copies == "float16" and matmul:
            copies += t.numel * 2
    if form.float_copies and not (form.copies == "file" and lossless):
        packs = packing_available(torch.empty(0, 0)) and packing_affordable(matmul_bytes)
        copies += matmul_bytes if packs else head_bytes
    return dense + copies + largest


def _named(tensor: StoredTensor, names: tuple[str, ...]) -> bool:
    """Whether `tensor` is one of `names` (a GGUF name, or the end of a dotted HF name)."""
    return any(tensor.name == n or tensor.name.endswith("." + n) for n in names)


def check_fits(tensors: list[StoredTensor], form: WeightForm, device: torch.device,
               what: str) -> None:
    """Raise `ModelTooLargeError` when `tensors` in `form` need more than `device` has
    available; the message names the GiB needed, the GiB available and what to do."""
    needed = weight_bytes(tensors, form)
    available, where = available_bytes(device)
    if needed <= available:
        return
    plain = weight_bytes(tensors, replace(form, copies="none"))
    described = form.describe() if plain < needed or form.copies == "served" else \
        replace(form, copies="none").describe()
    hints = ["a model with fewer parameters, or a smaller quantization" if
             form.copies == "served" else
             f"a model with fewer parameters (the weights are built in "
             f"{str(form.dtype).replace('torch.', '')} whatever the file's quantization)"]
    if plain < needed:
        hints.append(f"weights='dense' without the copies "
                     f"({plain / GiB:.1f} GiB)")
    if form.dtype == torch.float32 and form.copies != "served":
        half = weight_bytes(tensors, WeightForm(torch.bfloat16))
        hints.append(f"dtype='bfloat16' ({half / GiB:.1f} GiB; slower on most CPUs)")
    hints.append("a machine with more memory")
    raise ModelTooLargeError(
        f"{what} does not fit: its weights need about {needed / GiB:.1f} GiB as nbserve "
        f"loads them ({described}, on {device.type}), and {available / GiB:.1f} GiB is "
        f"available ({where}). Nothing was loaded. Try {', or '.join(hints)}.")


def gguf_tensors(path: Path) -> list[StoredTensor]:
    """The tensors of a .gguf file from its header (the data is mapped, never read)."""
    from .gguf import _open  # the parsed file is kept for the load that follows

    reader = _open(path)
    return [StoredTensor(t.name, tuple(int(d) for d in reversed(t.shape.tolist())),
                         t.tensor_type.name, int(t.n_bytes)) for t in reader.tensors]


def safetensors_tensors(files: Iterable[Path]) -> list[StoredTensor]:
    """The tensors of safetensors files from their JSON headers (no tensor data read)."""
    found: list[StoredTensor] = []
    for file in files:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            found.append(StoredTensor(name, tuple(info["shape"]), info["dtype"], end - start))
    return found


def check_source(source: str, device: torch.device, form: WeightForm) -> None:
    """Refuse `source` (a .gguf file or a Hugging Face checkpoint directory) before it loads
    when its weights in `form` cannot fit on `device`; other sources (the default model, a
    nanochat checkpoint, a hub id) and unreadable files pass, for the loader to handle."""
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        tensors = gguf_tensors(path)
    elif path.is_dir() and (path / "config.json").is_file():
        from .hf_dir import find_weight_files

        try:
            files = find_weight_files(path)
        except (OSError, ValueError):  # the loader says what is missing
            return
        tensors = safetensors_tensors(files)
    else:
        return
    check_fits(tensors, form, device, str(path))
