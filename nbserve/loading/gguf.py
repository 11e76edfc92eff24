"""Read a llama.cpp GGUF file: a config.json-style dict, HF-named tensors and a rebuilt tokenizer.

Tensors are dequantized one at a time and what llama.cpp's converter did to them is undone (as
each family file declares it, applied in gguf_archs.py: Q/K row order, Gemma's +1 norms, GPT-2's
transposes, stacked experts split), so the result feeds the same builder as a Hugging Face folder.
"""

from __future__ import annotations

import functools
import gc
import io
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor, TokenType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre
from tqdm.auto import tqdm

from ..cpu.memory import return_freed_memory
from ..models import registry
from ..models.base import LoadedModel
from ..models.family import GGUFLayout
from ..models.pooling import DECODER_DEFAULT, Pooling
from ..models.rope import unpermute_qk
from .gguf_archs import CONFIG_ONLY, Meta, Rule, hf_config, tensor_rule
from .gguf_reader import BulkArrayReader
from .pooling_config import gguf_pooling

if TYPE_CHECKING:
    from ..execution.quant import QuantBlocks

FLOAT_TYPES = ("F32", "F16", "BF16")  # tensors read as floats; every other type is blocks


def served_types() -> tuple[str, ...]:
    """The tensor types a GGUF may hold: the float types and every type the kernels serve
    from its blocks (`execution.quant.BLOCK_TYPES`, the one list of them)."""
    from ..execution.quant import BLOCK_TYPES
    return (*FLOAT_TYPES, *BLOCK_TYPES)

# Pre-tokenizer split regexes, by `tokenizer.ggml.pre` (the same splits as the models'
# tokenizer.json).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# o200k (GPT-4o, Phi-4-mini): words split at case changes, contractions kept on the word.
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
                r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_PRE = {"gpt2", "gpt-2", "phi-2", "default", "mpt", "olmo", "jais"}
_DIGITS_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r"}  # single digits first
_LLAMA3_PRE = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen"}
_GPT4O_PRE = {"gpt-4o", "llama4"}


@dataclass(slots=True)
class GGUFCheckpoint:
    """Everything a GGUF holds, in Hugging Face terms. `tensors` streams (hf_name, tensor) pairs."""

    path: Path
    name: str
    hf_config: dict[str, Any]
    tensors: GGUFTensors
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: list[int]
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    add_eos_token: bool = False  # an embedding model's texts end with EOS (Tokenizer.closing_ids)
    pooling: Pooling | None = None  # declared by `<arch>.pooling_type` (pooling_config.py)
    headless: bool = False  # an embedding model without output.weight (loading/headless.py)


class GGUFTensors:
    """Re-iterable stream of (hf_name, tensor): each tensor is dequantized only when reached."""

    def __init__(self, path: Path, tensors: list[ReaderTensor], layout: GGUFLayout,
                 cfg: dict[str, Any], dtype: torch.dtype) -> None:
        self._path, self._dtype = path, dtype
        self._transposes = bool(layout.conv1d)  # names change on the way in: see serve_blocks
        self._plan: list[tuple[ReaderTensor, Rule]] = []
        for t in tensors:
            if t.name in CONFIG_ONLY:
                continue
            rule = tensor_rule(t, layout, cfg)
            if rule is None:
                raise ValueError(f"unexpected tensor {t.name!r} in {path} for architecture "
                                 f"{layout.architecture!r} (read as {cfg['architectures'][0]})")
            self._plan.append((t, rule))
        self._served: set[str] = set()  # HF names streamed as meta, their blocks read (below)
        self._groups: dict[str, tuple[str, ...]] = {}  # a served name: its fused group's names
        self._experts: set[str] = set()  # GGUF names of stacked experts read as blocks
        self._expert_pairs: dict[str, tuple[str, str]] = {}  # gate or up: (gate, up) GGUF names
        self._shapes = {rule.hf_names[0]: tuple(int(d) for d in reversed(t.shape.tolist()))
                        for t, rule in self._plan}  # HF names: torch-order shapes
        self._blocks: dict[str, QuantBlocks] = {}

    def __len__(self) -> int:
        return sum(len(rule.hf_names) for _, rule in self._plan)

    def serve_blocks(self) -> None:
        """Stream the tensors stored in a type of `execution.quant.BLOCK_TYPES` as blocks
        instead of float tensors: each such matmul weight (and the token embedding) is read
        from the file into its blocks once (`take_blocks`), never dequantized, and streams as
        a tensor on the meta device of its shape (the builder keeps it there; the model is
        then served from the blocks, `WeightFormats.serve_file_blocks`). Stacked experts
        (`blk.N.ffn_{gate,up,down}_exps`, 3-D) too, where all of a layer's are of such types:
        each expert's matrix streams as a meta tensor under its own name, its blocks a row
        range of its stack's (a layer's gate and up stacks read into one buffer, each expert's
        gate rows then up rows, so its fused gate|up is those blocks, not a copy), and the
        model serves its experts from them (`WeightFormats.serve_expert_blocks`). Left as
        floats: 1-D tensors (norms, biases), shifted tensors, every tensor of a layout that
        transposes some (GPT-2's Conv1D), a fused group (q/k/v, gate/up) whose members are
        not all of such types, and a layer's experts where one of its stacks is not."""
        from ..execution.quant import BLOCK_TYPES

        if self._transposes:  # GPT-2: its family renames the tensors, and the blocks of
            return  # its matmul weights run along the other axis: built as floats, as before
        served = {rule.hf_names[0]: t for t, rule in self._plan
                  if t.tensor_type.name in BLOCK_TYPES and len(t.shape) == 2
                  and len(rule.hf_names) == 1 and not (rule.transpose or rule.shift)}
        self._served = {name for name in served
                        if all(other in served for other in _fused_group(name))}
        for name in self._served:  # a group of one type and row length is read as one
            group = _fused_group(name)
            kinds = {(served[m].tensor_type, tuple(served[m].data.shape[1:])) for m in group}
            if len(group) > 1 and len(kinds) == 1:
                self._groups[name] = group
        self._serve_experts()

    def _serve_experts(self) -> None:
        """Pick the stacked experts read as blocks (`serve_blocks`): a layer's, where all its
        stacks are of a served type; its gate and up stacks paired where they are of one type
        and row length."""
        from ..execution.quant import BLOCK_TYPES

        layers: dict[str, list[tuple[ReaderTensor, Rule]]] = {}
        for t, rule in self._plan:
            if len(t.shape) == 3 and len(rule.hf_names) > 1:
                layers.setdefault(t.name.split(".")[1], []).append((t, rule))
        for planned in layers.values():
            if not all(t.tensor_type.name in BLOCK_TYPES
                       and not (rule.transpose or rule.shift or rule.heads)
                       for t, rule in planned):
                continue
            stacks = [t for t, _ in planned]
            self._experts |= {t.name for t in stacks}
            by_role = {t.name.split(".")[2]: t for t in stacks}
            gate, up = by_role.get("ffn_gate_exps"), by_role.get("ffn_up_exps")
            if gate is not None and up is not None and gate.tensor_type == up.tensor_type \
                    and tuple(gate.data.shape) == tuple(up.data.shape):
                self._expert_pairs[gate.name] = self._expert_pairs[up.name] = (gate.name, up.name)

    def take_blocks(self) -> dict[str, QuantBlocks]:
        """The blocks the last pass read (`serve_blocks`), by HF name; handed over once."""
        found, self._blocks = self._blocks, {}
        return found

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[tuple[str, ...], tuple[np.ndarray, set[str]]] = {}
        pairs: dict[tuple[str, str], tuple[np.ndarray, dict[str, tuple[str, ...]]]] = {}
        with open(self._path, "rb", buffering=0) as file:
            for t, rule in tqdm(self._plan, desc=f"Loading {self._path.name}", unit="tensor",
                                leave=False):
                name = rule.hf_names[0]
                if t.name in self._experts:
                    self._read_experts(file, t, rule, pairs)
                    for name in rule.hf_names:  # each expert's (rows, cols), as split floats
                        yield name, torch.empty(int(t.shape[1]), int(t.shape[0]), device="meta")
                    continue
                if name in self._served:
                    self._read_served(file, t, rule, pending)
                    yield name, torch.empty(int(t.shape[1]), int(t.shape[0]), device="meta")
                    continue
                arr = dequantize(t.data, t.tensor_type)  # numpy layout: (rows, cols) = (ne1, ne0)
                w = torch.from_numpy(np.require(arr, np.float32, ["C", "W"]))  # copies views
                for name, part in rule.apply(w):
                    yield name, part.to(self._dtype)

    def _read_served(self, file: io.FileIO, t: ReaderTensor, rule: Rule,
                     pending: dict[tuple[str, ...], tuple[np.ndarray, set[str]]]) -> None:
        """Read a served tensor's blocks (`serve_blocks`): alone, or into its rows of its
        fused group's one buffer, whose blocks each member gets a row range of once the
        group is complete (so the fused projection is those blocks, not a copy of them)."""
        from ..execution.quant import QuantBlocks

        name = rule.hf_names[0]
        group = self._groups.get(name)
        if group is None:
            self._blocks[name] = _read_single(file, t, rule)
            return
        rows = {m: int(self._shapes[m][0]) for m in group}
        if group not in pending:
            pending[group] = (np.empty((sum(rows.values()), t.data.shape[1]), np.uint8), set())
        raw, done = pending[group]
        start = sum(rows[m] for m in group[:group.index(name)])
        _read_rows(file, t, rule, raw[start:start + rows[name]])
        done.add(name)
        if len(done) == len(group):
            blocks = QuantBlocks.from_gguf(raw, t.tensor_type.name)
            assert blocks is not None
            start = 0
            for member in group:
                self._blocks[member] = blocks.row_range(start, start + rows[member])
                start += rows[member]
            del pending[group]

    def _read_experts(self, file: io.FileIO, t: ReaderTensor, rule: Rule,
                      pairs: dict[tuple[str, str], tuple[np.ndarray, dict[str, tuple[str, ...]]]]
                      ) -> None:
        """Read a stacked experts tensor's blocks (`serve_blocks`), each expert's a row range
        of them: alone, or a layer's gate and up stacks into one buffer, expert by expert
        its gate rows then its up rows, whose blocks each expert's gate and up get a row range
        of once both are read (so its gate|up is one range: `QuantBlocks.cat` joins them
        without a copy)."""
        from ..execution.quant import QuantBlocks

        experts, rows, row_bytes = (int(d) for d in t.data.shape)
        pair = self._expert_pairs.get(t.name)
        if pair is None:
            blocks = _read_single(file, t, rule)
            for e, name in enumerate(rule.hf_names):
                self._blocks[name] = blocks.row_range(e * rows, (e + 1) * rows)
            return
        if pair not in pairs:
            pairs[pair] = (np.empty((experts, 2 * rows, row_bytes), np.uint8), {})
        raw, done = pairs[pair]
        start = 0 if t.name == pair[0] else rows
        for e in range(experts):  # expert e's matrix lies at e * its bytes in the stack
            _read_at(file, t, int(t.data_offset) + e * rows * row_bytes,
                     raw[e, start:start + rows])
        done[t.name] = rule.hf_names
        if len(done) < 2:
            return
        del pairs[pair]
        both = QuantBlocks.from_gguf(raw.reshape(experts * 2 * rows, row_bytes),
                                     t.tensor_type.name)
        assert both is not None  # `serve_blocks` picked only types of BLOCK_TYPES
        for e in range(experts):
            for offset, names in ((0, done[pair[0]]), (rows, done[pair[1]])):
                first = e * 2 * rows + offset
                self._blocks[names[e]] = both.row_range(first, first + rows)

    def quant_blocks(self) -> dict[str, QuantBlocks]:
        """The tensors stored in a type of `execution.quant.BLOCK_TYPES` (Q4_0, Q4_1, Q8_0, the
        K-quants, Q5_0, Q5_1, IQ4_NL, IQ4_XS), as they are (not dequantized), by HF name, with
        llama.cpp's Q/K row order undone and stacked experts split (weights="blocks"
        multiplies them). GPT-2's Conv1D weights are left out: their blocks
        run along the other axis than the HF tensor's rows."""
        from ..execution.quant import QuantBlocks

        found: dict[str, QuantBlocks] = {}
        for t, rule in self._plan:
            if rule.transpose or rule.shift:
                continue
            raw = np.asarray(t.data)
            parts = [raw] if len(rule.hf_names) == 1 else list(raw)
            for name, part in zip(rule.hf_names, parts):
                blocks = QuantBlocks.from_gguf(part, t.tensor_type.name)
                if blocks is None:
                    continue
                if rule.heads:
                    order = unpermute_qk(torch.arange(blocks.shape[0])[:, None], rule.heads)[:, 0]
                    blocks = blocks.take_rows(order)
                found[name] = blocks
        return found


# the weights a decoder fuses into one matmul (models.decoder's fused projections)
_FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          ("mlp.gate_proj", "mlp.up_proj"))


def _fused_group(name: str) -> tuple[str, ...]:
    """The HF names of the weights fused with `name` (itself included), or just `name`."""
    for group in _FUSED:
        for member in group:
            suffix = f".{member}.weight"
            if name.endswith(suffix):
                base = name[:-len(suffix)]
                return tuple(f"{base}.{m}.weight" for m in group)
    return (name,)


CHUNK_BYTES = 32 * 2**20  # a large tensor is read and converted this much at a time


def _read_single(file: io.FileIO, t: ReaderTensor, rule: Rule) -> QuantBlocks:
    """The blocks of tensor `t` alone. A large one (a Q8_0 embedding) is read in chunks of
    rows, each converted into its rows of the blocks, so that the file's bytes and the
    blocks made of them (Q4_0/Q4_1/Q8_0 are rearranged) are never both held whole."""
    from ..execution.quant import QuantBlocks

    row_bytes = int(t.data.shape[-1])  # a stack of experts: its experts' rows one after
    rows = int(t.data.size) // row_bytes  # the other
    step = max(1, CHUNK_BYTES // row_bytes)
    if rule.heads or rows <= 2 * step:
        raw = np.empty((rows, row_bytes), dtype=np.uint8)
        _read_rows(file, t, rule, raw)
        blocks = QuantBlocks.from_gguf(raw, t.tensor_type.name)
        assert blocks is not None  # `serve_blocks` picked only types of BLOCK_TYPES
        return blocks
    whole: QuantBlocks | None = None
    for start in range(0, rows, step):
        raw = np.empty((min(step, rows - start), row_bytes), dtype=np.uint8)
        _read_at(file, t, int(t.data_offset) + start * row_bytes, raw)
        part = QuantBlocks.from_gguf(raw, t.tensor_type.name)
        assert part is not None
        whole = whole if whole is not None else part.empty_rows(rows)
        whole.put_rows(start, part)
    assert whole is not None
    return whole


def _read_at(file: io.FileIO, t: ReaderTensor, offset: int, out: np.ndarray) -> None:
    """Bytes of the file from `offset` into `out` (contiguous), with plain reads."""
    view, done = out.data.cast("B"), 0
    file.seek(offset)
    while done < len(view):
        got = file.readinto(view[done:])
        if not got:
            raise ValueError(f"{file.name}: tensor {t.name!r} ends past the end of the file; "
                             "the file is truncated: download it again")
        done += got


def _read_rows(file: io.FileIO, t: ReaderTensor, rule: Rule, out: np.ndarray) -> None:
    """Tensor `t`'s bytes into `out` (rows, bytes a row), with plain reads (through the page
    cache, not the reader's memory map, whose touched pages would count in the process's
    memory beside the blocks), llama.cpp's Q/K row order undone."""
    raw = np.empty(t.data.shape, dtype=np.uint8) if rule.heads else out
    _read_at(file, t, int(t.data_offset), raw)
    if rule.heads:
        order = unpermute_qk(torch.arange(raw.shape[0])[:, None], rule.heads)[:, 0]
        out[...] = raw[order.numpy()]


def read_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> GGUFCheckpoint:
    """Open a .gguf file and check it is one nbserve can serve; tensors stream lazily in `dtype`."""
    path = Path(path).expanduser()
    reader = _open(path)
    meta = Meta(reader)
    served = served_types()
    for t in reader.tensors:
        if t.tensor_type.name not in served:
            raise ValueError(
                f"tensor {t.name!r} in {path} has type {t.tensor_type.name}, which nbserve "
                f"does not serve; served types: {', '.join(served)}. "
                "Use a GGUF quantized with one of these (e.g. Q4_K_M, IQ4_XS, Q8_0 or F16).")
    layout, cfg = _checked_config(meta, reader, path)
    tensors = GGUFTensors(path, list(reader.tensors), layout, cfg, dtype)
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError(f"{path} carries no tokenizer (tokenizer.ggml.tokens is missing)")
    tokenizer, add_bos = _tokenizer(meta, tokens, path)
    bos_id = cfg["bos_token_id"]
    pooling_key = f"{layout.architecture}.pooling_type"
    pooling = gguf_pooling(meta.get(pooling_key), pooling_key, path)
    return GGUFCheckpoint(
        path=path, name=meta.get("general.name") or path.stem, hf_config=cfg,
        tensors=tensors, tokenizer=tokenizer,
        chat_template=meta.get("tokenizer.chat_template"), bos_token_id=bos_id,
        eos_token_ids=cfg["eos_token_id"], bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[cfg["eos_token_id"][0]] if cfg["eos_token_id"] else None,
        add_bos_token=add_bos, pooling=pooling,
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        headless=pooling is not None and all(t.name != "output.weight" for t in reader.tensors))


def _checked_config(meta: Meta, reader: GGUFReader, path: Path
                    ) -> tuple[GGUFLayout, dict[str, Any]]:
    """(layout, config dict) of a file whose architecture a registered family reads."""
    arch = meta.get("general.architecture")
    layout = registry.gguf_layout(arch, int(meta.get(f"{arch}.expert_count") or 0))
    if layout is None:
        known = registry.gguf_architectures()
        raise ValueError(f"{path} has architecture {arch!r}; nbserve reads GGUF architectures "
                         f"{', '.join(known)} ({'; '.join(registry.descriptions())}).")
    return layout, hf_config(meta, layout, {t.name: t for t in reader.tensors}, path)


def read_quant_blocks(path: str | Path) -> dict[str, QuantBlocks]:
    """The tensors of a .gguf file stored in a type served from its blocks, as blocks
    (`GGUFTensors.quant_blocks`), without building its tokenizer (which `read_gguf` does)."""
    path = Path(path).expanduser()
    reader = _open(path)
    layout, cfg = _checked_config(Meta(reader), reader, path)
    return GGUFTensors(path, list(reader.tensors), layout, cfg, torch.float32).quant_blocks()


def serves_blocks(path: str | Path) -> bool:
    """Whether a .gguf file holds weights in a type served from its blocks
    (`execution.quant.BLOCK_TYPES`): a quantized file, which `loading.load` serves from its
    blocks on CPU by default."""
    from ..execution.quant import BLOCK_TYPES

    return any(t.tensor_type.name in BLOCK_TYPES and len(t.shape) >= 2
               for t in _open(Path(path).expanduser()).tensors)


def load_gguf(path: str | Path, device: str | torch.device | None = None,
              dtype: str | torch.dtype | None = None, name: str | None = None,
              weight_format: str | None = None, **options: Any) -> LoadedModel:
    """Build a servable model from a .gguf file, weights dequantized to `dtype` (default float32
    on CPU, bfloat16 on CUDA). It is named after the file unless `name` is given; `options` go
    to its family's `build` (pack, transposed_head...).

    `weight_format` "quantized" or "quantized-exact" (CPU, float32): the weights stored in a
    type of `execution.quant.BLOCK_TYPES` are read as blocks and served from them
    (`GGUFTensors.serve_blocks`, `WeightFormats.serve_file_blocks`), never built in float32;
    the other tensors as above. A layout whose weights are transposed (GPT-2's Conv1D) is
    built in float32 and given its blocks afterwards (`loading.load` does that)."""
    from ..execution.weights import WeightFormats
    from ..models.dtypes import QUANTIZED, QUANTIZED_FORMATS, resolve_dtype
    from ..text import ChatTemplate, Tokenizer

    device = torch.device(device if device is not None else "cpu")
    dtype = resolve_dtype(dtype, device)
    ckpt = read_gguf(path, dtype=dtype)
    blocks = weight_format in QUANTIZED_FORMATS
    if blocks:  # nothing reads the parsed metadata again (a large vocabulary's is hundreds
        forget_readers()  # of MB): dropped before the weights are read
        return_freed_memory()
    name = name or ckpt.path.stem
    family, config = registry.read_config(ckpt.hf_config, name)
    if blocks:
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"weight_format={weight_format!r} serves blocks on CPU in float32, "
                             f"not on {device.type} in {dtype}")
        ckpt.tensors.serve_blocks()
    if ckpt.headless:  # no single-row decode steps read the head: no transposed copy of it
        options = {**options, "transposed_head": False}
    model = family.build(config, ckpt.tensors, device=device, dtype=dtype, **options)
    if blocks:
        if not isinstance(model, WeightFormats):
            raise ValueError(f"weight_format={weight_format!r} needs nbserve's own model "
                             f"implementation; {type(model).__name__} does not have it")
        model.serve_file_blocks(ckpt.tensors.take_blocks(), round16=weight_format == QUANTIZED)
    model.has_lm_head = not ckpt.headless  # the head slot holds the embedding
    tokenizer = Tokenizer(ckpt.tokenizer, bos_token_id=ckpt.bos_token_id,
                          eos_token_ids=ckpt.eos_token_ids, add_bos_token=ckpt.add_bos_token,
                          closing_ids=ckpt.eos_token_ids[:1] if ckpt.add_eos_token else ())
    template = (ChatTemplate(ckpt.chat_template, bos_token=ckpt.bos_token or "",
                             eos_token=ckpt.eos_token or "") if ckpt.chat_template else None)
    return LoadedModel(model=model, tokenizer=tokenizer, template=template, name=name,
                       stop_token_ids=list(ckpt.eos_token_ids), source=str(ckpt.path),
                       pooling=ckpt.pooling or DECODER_DEFAULT)


def _open(path: Path) -> GGUFReader:
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}: pass the path of an existing .gguf file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
                         "pass a .gguf file, or a Hugging Face model folder instead")
    stat = path.stat()
    try:
        return _reader(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    except Exception as exc:  # truncated or corrupt: gguf raises assorted errors
        raise ValueError(f"{path} looks like GGUF but cannot be read ({exc}); "
                         "the file may be truncated: download it again") from exc


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int, size: int) -> GGUFReader:
    """A parsed file, kept for the next open of the same unchanged file: weights="blocks"
    opens the file twice (floats, blocks).
    The reader holds a read-only memory map, not the tensors, but its parsed fields and the
    pages of the map it touched are resident: `load` forgets it when it is done
    (`forget_readers`). Metadata arrays are read in bulk (`BulkArrayReader`)."""
    return BulkArrayReader(path)


def forget_readers() -> None:
    """Drop the parsed files `_open` keeps (their fields and memory maps): what a load needs
    of a file is in its model by then. No model tensor points into a reader's map: every
    tensor and block is a copy (see `GGUFTensors`, `QuantBlocks.from_gguf`)."""
    _reader.cache_clear()


def _tokenizer(meta: Meta, tokens: list[str], path: Path) -> tuple[Tokenizer, bool]:
    """Rebuild a `tokenizers.Tokenizer` from `tokenizer.ggml.*`; returns it and add_bos."""
    kind = meta.get("tokenizer.ggml.model")
    types = list(meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens))
    if kind == "gpt2":
        tok = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [],
                              meta.get("tokenizer.ggml.pre") or "default", path)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        tok = _sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.scores"), types,
                                 meta.get("tokenizer.ggml.unknown_token_id"),
                                 bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise ValueError(f"{path} has a {kind!r} tokenizer; nbserve rebuilds 'gpt2' (byte-level "
                         "BPE) and 'llama' (sentencepiece) tokenizers from GGUF metadata")
    specials = {TokenType.CONTROL, TokenType.UNKNOWN}
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == TokenType.USER_DEFINED])
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = add_bos and bos_id is not None
    if add_bos:  # as in such models' tokenizer.json: encode(..., add_special_tokens=True) adds it
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)])
    return tok, add_bos


def _byte_level_bpe(tokens: list[str], merges: list[str], pre_name: str, path: Path) -> Tokenizer:
    """GPT-2 style BPE over bytes mapped to printable characters, split like the original."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    # each merge is "left right": a pair
    pairs = cast("list[tuple[str, str]]", [tuple(m.split(" ", 1)) for m in merges])
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre_name in _LLAMA3_PRE))
    if pre_name in _DIGITS_PRE:
        tok.pre_tokenizer = pre.Sequence([pre.Digits(individual_digits=True),
                                          pre.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre_name in _LLAMA3_PRE or pre_name in _QWEN2_PRE or pre_name in _GPT4O_PRE:
        split = (_LLAMA3_SPLIT if pre_name in _LLAMA3_PRE else
                 _QWEN2_SPLIT if pre_name in _QWEN2_PRE else _GPT4O_SPLIT)
        tok.pre_tokenizer = pre.Sequence([pre.Split(Regex(split), behavior="isolated"),
                                          pre.ByteLevel(add_prefix_space=False, use_regex=False)])
        if pre_name in _QWEN2_PRE:
            tok.normalizer = normalizers.NFC()
    else:
        if pre_name not in _GPT2_PRE:
            warnings.warn(f"{path.name}: unknown pre-tokenizer {pre_name!r}, splitting text like "
                          "GPT-2; token ids may differ from the original tokenizer", stacklevel=3)
        tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: list[float] | None, types: list[int],
                       unk_id: int | None, add_space_prefix: bool) -> Tokenizer:
    """Sentencepiece BPE (Llama 2, Mistral, Gemma): merges recovered from the piece scores."""
    vocab = dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))  # a piece's first id
    merges = _sentencepiece_merges(tokens, vocab, scores, types)
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                               byte_fallback=True))
    del merges
    scheme = "first" if add_space_prefix else "never"
    tok.pre_tokenizer = pre.Metaspace(replacement="\u2581", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _sentencepiece_merges(tokens: list[str], vocab: dict[str, int], scores: list[float] | None,
                          types: list[int]) -> list[tuple[str, str]]:
    """The merges of a sentencepiece vocabulary: a piece is made by merging any split of it
    whose halves are both pieces, ranked by the piece's score, then the halves' ids (the
    order is total: a piece is made of its halves). A large vocabulary has hundreds of
    thousands of them, found with numpy (`_split_ids`) rather than a Python loop per split."""
    n = len(tokens)
    ids = np.arange(n)
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=n)
    mergeable = np.isin(np.asarray(types), [TokenType.NORMAL, TokenType.USER_DEFINED])
    first = np.fromiter(map(vocab.__getitem__, tokens), dtype=np.int64, count=n) == ids
    candidates = ids[mergeable & first & (lengths > 1)]
    found = _split_ids(tokens, lengths, candidates)
    if found is None:
        found = _split_ids_by_lookup(tokens, vocab, lengths, candidates)
    if not found:
        return []
    pieces, lefts, rights = (np.concatenate(parts) for parts in zip(*found))
    ranks = -np.asarray(scores, np.float64) if scores is not None else ids.astype(np.float64)
    order = np.lexsort((rights, lefts, ranks[pieces]))
    names = np.array(tokens, dtype=object)
    gc_was = gc.isenabled()
    gc.disable()  # hundreds of thousands of tuples: no collection pass between them
    try:
        return list(zip(names[lefts[order]].tolist(), names[rights[order]].tolist()))
    finally:
        if gc_was:
            gc.enable()


_Splits = list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # (piece, left, right) ids per cut
_HASH_BASE = 0x100000001B3
_HASH_MIX = 0x9E3779B97F4A7C15
_BUCKET_BITS = 20


def _split_ids(tokens: list[str], lengths: np.ndarray, candidates: np.ndarray) -> _Splits | None:
    """For each cut k, the candidate pieces whose k first and other characters are both
    pieces, with those ids (the first id of a piece written twice): every prefix and suffix
    hashed at once (polynomial hashes over the characters' code points, modulo 2**64), looked
    up among the pieces' hashes, and every match checked character by character. None where
    it cannot be exact (two pieces with one hash; a piece that numpy's strings cannot hold):
    the caller then looks the splits up one by one."""
    n = len(tokens)
    text = np.array(tokens, dtype=str)
    width = text.dtype.itemsize // 4
    if n == 0 or width == 0 or not np.array_equal(np.char.str_len(text), lengths):
        return None  # (numpy drops a string's trailing NULs)
    chars = text.view(np.uint32).reshape(n, width)
    base, mix = np.uint64(_HASH_BASE), np.uint64(_HASH_MIX)
    powers = np.array([pow(_HASH_BASE, e, 1 << 64) for e in range(width + 1)], dtype=np.uint64)
    full = np.zeros(n, dtype=np.uint64)  # each piece's hash; (code point + 1): NUL counts
    for j in range(width):
        full = np.where(j < lengths, full * base + chars[:, j] + np.uint64(1), full)
    full *= np.uint64(_HASH_MIX)  # (a bijection) spreads short pieces over the top bits
    by_hash = np.lexsort((np.arange(n), full))  # a hash's first id first
    hashes = full[by_hash]
    same = hashes[1:] == hashes[:-1]
    if same.any():  # equal hashes must be equal pieces (a piece written twice)
        a, b = by_hash[:-1][same], by_hash[1:][same]
        if not (np.array_equal(lengths[a], lengths[b]) and np.array_equal(chars[a], chars[b])):
            return None
    keep = np.concatenate(([True], ~same))
    hashes, hash_ids = hashes[keep], by_hash[keep]

    # buckets by the hash's top bits, a few pieces each: a lookup reads a bucket's few
    # entries, not a binary search's many scattered ones
    shift = np.uint64(64 - _BUCKET_BITS)
    starts = np.searchsorted(hashes >> shift, np.arange((1 << _BUCKET_BITS) + 1, dtype=np.uint64))
    deepest = int(np.diff(starts).max())

    def lookup(query: np.ndarray) -> np.ndarray:
        bucket = (query >> shift).astype(np.int64)
        at, end = starts[bucket], starts[bucket + 1]
        ids = np.full(len(query), -1, dtype=np.int64)
        for _ in range(deepest):
            inside = at < end
            hit = inside & (hashes[np.minimum(at, len(hashes) - 1)] == query)
            ids[hit] = hash_ids[at[hit]]
            at = at + 1
        return ids

    found: _Splits = []
    prefix = np.zeros(len(candidates), dtype=np.uint64)
    cand_len, cand_full, cand_chars = lengths[candidates], full[candidates], chars[candidates]
    for k in range(1, int(cand_len.max(initial=1))):
        prefix = prefix * base + cand_chars[:, k - 1] + np.uint64(1)
        rows = np.flatnonzero(cand_len > k)
        mixed = prefix[rows] * mix
        left = lookup(mixed)
        right = lookup(cand_full[rows] - mixed * powers[cand_len[rows] - k])
        both = (left >= 0) & (right >= 0)
        rows, left, right = rows[both], left[both], right[both]
        exact = (np.array_equal(lengths[left], np.full(len(rows), k))
                 and np.array_equal(lengths[right], cand_len[rows] - k)
                 and np.array_equal(chars[left, :k], cand_chars[rows, :k])
                 and np.array_equal(chars[right, :width - k], cand_chars[rows, k:]))
        if not exact:
            return None
        found.append((candidates[rows], left, right))
    return found


def _split_ids_by_lookup(tokens: list[str], vocab: dict[str, int], lengths: np.ndarray,
                         candidates: np.ndarray) -> _Splits:
    """`_split_ids` by looking each prefix and suffix up in `vocab` (a loop in C, through
    `map`, but a string and a lookup per split)."""
    found: _Splits = []
    for k in range(1, int(lengths[candidates].max(initial=1))):
        at = candidates[lengths[candidates] > k]
        pieces = [tokens[i] for i in at.tolist()]
        left, right = (np.fromiter(map(vocab.get, halves, repeat(-1)), dtype=np.int64,
                                   count=len(pieces))
                       for halves in ([p[:k] for p in pieces], [p[k:] for p in pieces]))
        both = (left >= 0) & (right >= 0)
        found.append((at[both], left[both], right[both]))
    return found
