"""Read a llama.cpp GGUF file: a config.json-style dict, HF-named tensors and a rebuilt tokenizer.

Tensors are dequantized one at a time and, for the llama architecture, llama.cpp's interleaving of
the Q/K rows is undone, so the result feeds the same builder as a Hugging Face folder.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader, ReaderTensor, TokenType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre
from tqdm.auto import tqdm

from ..models import registry
from ..models.base import LoadedModel

if TYPE_CHECKING:
    from ..models.quant import QuantBlocks

SUPPORTED_TYPES = (QType.F32, QType.F16, QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1,
                   QType.Q5_0, QType.Q5_1, QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K,
                   QType.Q6_K)

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_CONFIG_ONLY = {"rope_freqs.weight"}  # Llama-3 RoPE scaling factors, folded into rope_scaling

# Pre-tokenizer split regexes, by `tokenizer.ggml.pre` (the same splits as the models'
# tokenizer.json).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_GPT2_PRE = {"gpt2", "default", "mpt", "olmo", "jais"}
_DIGITS_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r"}  # single digits first
_LLAMA3_PRE = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen"}
# Control tokens that end a turn although the file does not name them eos/eot (as llama.cpp does).
_END_OF_TURN_TEXTS = {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                      "<|endoftext|>", "<|end_of_text|>", "<EOT>"}


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


class GGUFTensors:
    """Re-iterable stream of (hf_name, tensor): each tensor is dequantized only when reached."""

    def __init__(self, path: Path, tensors: list[ReaderTensor], cfg: dict[str, Any],
                 dtype: torch.dtype) -> None:
        self._path, self._dtype = path, dtype
        self._tensors = [t for t in tensors if t.name not in _CONFIG_ONLY]
        # llama.cpp interleaves Q/K rows for its RoPE kernel on the llama arch only (not qwen2)
        permuted = cfg["model_type"] == "llama"
        self._heads = {"attn_q": cfg["num_attention_heads"] if permuted else 0,
                       "attn_k": cfg["num_key_value_heads"] if permuted else 0}

    def __len__(self) -> int:
        return len(self._tensors)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for t in tqdm(self._tensors, desc=f"Loading {self._path.name}", unit="tensor", leave=False):
            arr = dequantize(t.data, t.tensor_type)  # numpy layout: (rows, cols) = (ne1, ne0)
            w = torch.from_numpy(np.require(arr, np.float32, ["C", "W"]))  # copies memmap views
            heads = self._heads.get(t.name.split(".")[2], 0) if t.name.startswith("blk.") else 0
            if heads:
                w = unpermute_qk(w, heads)
            yield _known_name(t.name), w.to(self._dtype)


    def quant_blocks(self) -> dict[str, QuantBlocks]:
        """The tensors stored as Q4_0, Q4_1 or Q8_0, as they are (not dequantized), by HF
        name, with llama.cpp's Q/K row order undone (dtype="quantized" multiplies them)."""
        from ..models.quant import QuantBlocks

        found: dict[str, QuantBlocks] = {}
        for t in self._tensors:
            blocks = QuantBlocks.from_gguf(np.asarray(t.data), t.tensor_type.name)
            if blocks is None:
                continue
            heads = self._heads.get(t.name.split(".")[2], 0) if t.name.startswith("blk.") else 0
            if heads:
                order = unpermute_qk(torch.arange(blocks.shape[0])[:, None], heads)[:, 0]
                blocks = blocks.take_rows(order)
            found[_known_name(t.name)] = blocks
        return found


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head it stores rows (0, D/2, 1, D/2+1, ...)."""
    rows = w.shape[0]  # (H*D, ...) -> (H, D/2, 2, ...) -> (H, 2, D/2, ...)
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2)
            .reshape(w.shape))


def hf_tensor_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return None


def _known_name(gguf_name: str) -> str:
    """`hf_tensor_name` of a tensor `read_gguf` has checked (every one it keeps has a name)."""
    name = hf_tensor_name(gguf_name)
    assert name is not None, gguf_name
    return name


def read_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> GGUFCheckpoint:
    """Open a .gguf file and check it is one nbserve can serve; tensors stream lazily in `dtype`."""
    path = Path(path).expanduser()
    reader = _open(path)
    meta = _Meta(reader)
    arch = meta.get("general.architecture")
    known = registry.gguf_architectures()
    if arch not in known:
        raise ValueError(f"{path} has architecture {arch!r}; nbserve reads GGUF architectures "
                         f"{', '.join(known)} ({'; '.join(registry.descriptions())}).")
    if meta.get(f"{arch}.expert_count"):
        raise ValueError(f"{path} is a mixture-of-experts model ({arch} with "
                         f"{meta.get(f'{arch}.expert_count')} experts); "
                         "nbserve serves dense models")
    by_name = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ValueError(
                f"tensor {t.name!r} in {path} has type {t.tensor_type.name}, "
                "which nbserve does not "
                f"dequantize; supported: {', '.join(q.name for q in SUPPORTED_TYPES)}. "
                "Use a GGUF quantized with one of these (e.g. Q4_K_M, Q8_0 or F16).")
        if t.name not in _CONFIG_ONLY and hf_tensor_name(t.name) is None:
            raise ValueError(f"unexpected tensor {t.name!r} in {path} for architecture {arch!r}")
    if "token_embd.weight" not in by_name:
        raise ValueError(f"{path} has no token_embd.weight tensor; is it a complete model file?")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError(f"{path} carries no tokenizer (tokenizer.ggml.tokens is missing)")
    cfg = _hf_config(meta, arch, by_name, path)
    tokenizer, add_bos = _tokenizer(meta, tokens, path)
    bos_id = cfg["bos_token_id"]
    return GGUFCheckpoint(
        path=path, name=meta.get("general.name") or path.stem, hf_config=cfg,
        tensors=GGUFTensors(path, list(reader.tensors), cfg, dtype), tokenizer=tokenizer,
        chat_template=meta.get("tokenizer.chat_template"), bos_token_id=bos_id,
        eos_token_ids=cfg["eos_token_id"], bos_token=tokens[bos_id] if bos_id is not None else None,
        eos_token=tokens[cfg["eos_token_id"][0]] if cfg["eos_token_id"] else None,
        add_bos_token=add_bos)


def read_quant_blocks(path: str | Path) -> dict[str, QuantBlocks]:
    """The Q4_0/Q4_1/Q8_0 tensors of a .gguf file as blocks (`GGUFTensors.quant_blocks`),
    without building its tokenizer (which `read_gguf` does, and which takes seconds)."""
    path = Path(path).expanduser()
    reader = _open(path)
    meta = _Meta(reader)
    by_name = {t.name: t for t in reader.tensors}
    cfg = _hf_config(meta, meta.get("general.architecture"), by_name, path)
    return GGUFTensors(path, list(reader.tensors), cfg, torch.float32).quant_blocks()


def load_gguf(path: str | Path, device: str | torch.device | None = None,
              dtype: str | torch.dtype | None = None, name: str | None = None,
              **options: Any) -> LoadedModel:
    """Build a servable model from a .gguf file, weights dequantized to `dtype` (default float32
    on CPU, bfloat16 on CUDA). It is named after the file unless `name` is given; `options` go
    to its family's `build` (pack, transposed_head...)."""
    from ..models.dtypes import resolve_dtype
    from ..text import ChatTemplate, Tokenizer

    device = torch.device(device if device is not None else "cpu")
    dtype = resolve_dtype(dtype, device)
    ckpt = read_gguf(path, dtype=dtype)
    name = name or ckpt.path.stem
    family, config = registry.read_config(ckpt.hf_config, name)
    model = family.build(config, ckpt.tensors, device=device, dtype=dtype, **options)
    tokenizer = Tokenizer(ckpt.tokenizer, bos_token_id=ckpt.bos_token_id,
                          eos_token_ids=ckpt.eos_token_ids, add_bos_token=ckpt.add_bos_token)
    template = (ChatTemplate(ckpt.chat_template, bos_token=ckpt.bos_token or "",
                             eos_token=ckpt.eos_token or "") if ckpt.chat_template else None)
    return LoadedModel(model=model, tokenizer=tokenizer, template=template, name=name,
                       stop_token_ids=list(ckpt.eos_token_ids), source=str(ckpt.path))


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
    """A parsed file, kept for the next open of the same unchanged file: parsing a vocabulary
    of 49k tokens takes 2-4 s, and dtype="quantized" opens the file twice (floats, blocks).
    The reader holds a read-only memory map, not the tensors, but its parsed fields and the
    pages of the map it touched are resident (about 220 MB for SmolLM2's 93 MB file):
    `load` forgets it when it is done (`forget_readers`)."""
    return GGUFReader(path)


def forget_readers() -> None:
    """Drop the parsed files `_open` keeps (their fields and memory maps): what a load needs
    of a file is in its model by then. No model tensor points into a reader's map: every
    tensor and block is a copy (see `GGUFTensors`, `QuantBlocks.from_gguf`)."""
    _reader.cache_clear()


class _Meta:
    """Metadata values by key, decoded on first use (token lists are large)."""

    def __init__(self, reader: GGUFReader) -> None:
        self._fields = reader.fields
        self._cache: dict[str, Any] = {}

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self._fields:
            return default
        if key not in self._cache:
            self._cache[key] = self._fields[key].contents()
        return self._cache[key]


def _hf_config(meta: _Meta, arch: str, by_name: dict[str, ReaderTensor], path: Path) -> dict:
    """config.json-style dict from `{arch}.*` keys, tensor shapes and special-token ids."""
    def need(key: str) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path} lacks the metadata key {arch}.{key}; is it a complete file?")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_dim = meta.get(f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(f"{path} rotates {rope_dim} of {head_dim} head dimensions; nbserve "
                         "implements full-head RoPE only")
    theta = _f32(meta.get(f"{arch}.rope.freq_base", 10000.0))
    tokens = meta.get("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or []
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos += [i for i, (tok, ty) in enumerate(zip(tokens, types))
            if ty == TokenType.CONTROL and tok in _END_OF_TURN_TEXTS]
    return {
        "architectures": [registry.gguf_architectures()[arch]],
        "model_type": arch,
        "vocab_size": int(by_name["token_embd.weight"].shape[1]),  # GGUF shapes are (ne0, ne1)
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(meta, arch, by_name.get("rope_freqs.weight"), theta,
                                      head_dim, path),
        "tie_word_embeddings": "output.weight" not in by_name,
        "attention_bias": "blk.0.attn_q.bias" in by_name,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(i) for i in eos if i is not None)),
    }


def _rope_scaling(meta: _Meta, arch: str, freqs: ReaderTensor | None, theta: float,
                  head_dim: int, path: Path) -> dict[str, Any] | None:
    """HF rope_scaling from `rope.scaling.*` keys or, for Llama 3, the `rope_freqs` factors."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind and kind != "none":  # linear / yarn: passed on; the model config decides support
        out: dict[str, Any] = {"rope_type": kind,
                               "factor": _f32(meta.get(f"{arch}.rope.scaling.factor", 1.0))}
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        if orig:
            out["original_max_position_embeddings"] = int(orig)
        return out
    if freqs is None:
        return None
    # llama.cpp stores Llama-3 scaling as one factor per frequency: 1 (kept), `factor` (slowed)
    # and a blend between. Recover (factor, low/high_freq_factor) with the original context set
    # to 8192: only the ratios matter, and 8192 is what every Llama 3.x uses.
    factors = dequantize(freqs.data, freqs.tensor_type).astype(np.float64).reshape(-1)
    if np.allclose(factors, 1.0):
        return None
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, orig, low, high = _f32(factors.max()), 8192, 1.0, 4.0  # Llama 3.x defaults
    mid = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    if mid.sum() >= 2:  # blend = a*x + b with x = orig / wavelen: solve for the two factors
        smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(orig * inv[mid] / (2 * math.pi), smooth, 1)
        low, high = _f32(-b / a), _f32((1 - b) / a)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": orig}
    if len(factors) == len(inv) and np.allclose(_llama3_factors(inv, scaling), factors,
                                                rtol=1e-4, atol=1e-5):
        return scaling
    raise ValueError(f"{path} has a rope_freqs tensor that is not Llama-3 RoPE scaling; "
                     "nbserve cannot serve this model's positional encoding")


def _f32(value: float) -> float:
    """A float32 from the file as the short decimal it was written from (1e-06, not 9.99e-07)."""
    return float(str(np.float32(value)))


def _llama3_factors(inv: np.ndarray, sc: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors of Llama-3 scaling (llama.cpp's rope_freqs) for checking a fit."""
    wavelen = 2 * math.pi / inv
    orig, low, high = sc["original_max_position_embeddings"], sc["low_freq_factor"], \
        sc["high_freq_factor"]
    smooth = (orig / wavelen - low) / (high - low)
    blend = 1 / ((1 - smooth) / sc["factor"] + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, sc["factor"], blend))


def _tokenizer(meta: _Meta, tokens: list[str], path: Path) -> tuple[Tokenizer, bool]:
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
    elif pre_name in _LLAMA3_PRE or pre_name in _QWEN2_PRE:
        split = _LLAMA3_SPLIT if pre_name in _LLAMA3_PRE else _QWEN2_SPLIT
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
    """Sentencepiece BPE (Llama 2, Mistral): merges recovered from the piece scores."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    scores = list(scores) if scores is not None else [-float(i) for i in range(len(tokens))]
    mergeable = {TokenType.NORMAL, TokenType.USER_DEFINED}
    ranked = []  # a piece is made by merging any split of it whose halves are both pieces
    for i, (piece, ty) in enumerate(zip(tokens, types)):
        if ty not in mergeable or vocab[piece] != i:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    ranked.sort()
    unk = tokens[unk_id] if unk_id is not None else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(r[3], r[4]) for r in ranked], unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    scheme = "first" if add_space_prefix else "never"
    tok.pre_tokenizer = pre.Metaspace(replacement="\u2581", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok
