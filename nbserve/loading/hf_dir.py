"""Load a Hugging Face model directory: config.json, safetensors weights, tokenizer and template.

Weights stream tensor by tensor from safetensors into `build_llama`, so peak host memory stays at
about one tensor. Pickle checkpoints (`pytorch_model.bin`) are refused: unpickling can run code.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from nbserve.models.base import LoadedModel
from nbserve.models.config import LlamaConfig
from nbserve.text import ChatTemplate, Tokenizer

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_PICKLE_GLOBS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed by the model; old checkpoints ship it


class MissingFileError(FileNotFoundError, ValueError):
    """A file the loader needs is not in the model directory (catchable as either base)."""


def load_hf_dir(path: str | os.PathLike, device: str | torch.device | None = None,
                dtype: str | torch.dtype | None = None) -> LoadedModel:
    """Load the model directory at `path` on `device` (default cpu) in `dtype` (default float32
    on CPU, bfloat16 on CUDA). The model is named after the directory."""
    root = _model_dir(path)
    name = model_name(path)
    config = LlamaConfig.from_hf(read_json(root / "config.json"), name=name)
    weight_files = find_weight_files(root)  # fail on missing weights before the slow parts
    tokenizer, tokenizer_config = load_tokenizer(root)
    template = load_chat_template(root, tokenizer_config)
    if tokenizer.vocab_size > config.vocab_size:
        warnings.warn(f"{name}: the tokenizer has {tokenizer.vocab_size} tokens but the model "
                      f"embeds only {config.vocab_size}; higher ids cannot be used", stacklevel=2)
    dev = torch.device(device if device is not None else "cpu")
    from nbserve.models.llama import build_llama

    model = build_llama(config, iter_safetensors(weight_files, desc=f"Loading {name}"),
                        device=dev, dtype=resolve_dtype(dtype, dev))
    return LoadedModel(model=model, tokenizer=tokenizer, template=template, name=name,
                       stop_token_ids=list(tokenizer.eos_token_ids), source=str(root))


# ----------------------------------------------------------------------------- pieces


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON file, naming the directory and file when it is missing or broken."""
    if not path.is_file():
        raise MissingFileError(f"{path.parent} has no {path.name}: expected a Hugging Face model "
                               "directory (config.json, model.safetensors, tokenizer.json, ...)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-download or fix the file") from e
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ValueError(f"{path} should hold a JSON object, got {kind}")  # noqa: TRY004
    return data


def find_weight_files(root: Path) -> list[Path]:
    """The safetensors files to load: `model.safetensors`, or the shards its index lists."""
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map'; re-download the checkpoint")
        shards = list(dict.fromkeys(weight_map.values()))
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise MissingFileError(f"{root} is missing {len(missing)} of {len(shards)} weight "
                                   f"shards listed in {SAFETENSORS_INDEX}: {', '.join(missing)}. "
                                   "Finish the download.")
        return [root / s for s in shards]
    single = root / SAFETENSORS_SINGLE
    if single.is_file():
        return [single]
    pickles = sorted({p.name for pattern in _PICKLE_GLOBS for p in root.glob(pattern)})
    if pickles:
        raise ValueError(
            f"{root} has only pickle weights ({', '.join(pickles)}). nbserve loads safetensors "
            "only, because unpickling can run arbitrary code. Convert once where you trust the "
            "file, e.g. "
            "transformers.AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir), "
            "which writes model.safetensors.")
    others = sorted(p.name for p in root.glob("*.safetensors"))
    found = f" (found {', '.join(others)}, which is not the Hugging Face layout)" if others else ""
    raise MissingFileError(f"{root} has no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}{found}; "
                           "download the model's weights into it.")


def iter_safetensors(files: list[Path], desc: str = "Loading weights"
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face tensor name, CPU tensor) one at a time, with a progress bar."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    total = 0
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            total += len(sf.keys())
    with tqdm(total=total, desc=desc, unit="tensor", leave=False) as bar:
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open is not iterable
                    bar.update(1)
                    if not name.endswith(_SKIPPED_SUFFIXES):
                        yield name, sf.get_tensor(name)


def load_tokenizer(root: Path) -> tuple[Tokenizer, dict[str, Any]]:
    """The directory's `Tokenizer` and its tokenizer_config.json (empty if absent).

    End-of-sequence ids are the union of generation_config.json, config.json and the tokenizer's
    eos_token, in that order: any of them ends a reply.
    """
    root = Path(root)
    tok_file = root / "tokenizer.json"
    if not tok_file.is_file():
        hint = (" It has tokenizer.model (sentencepiece): convert it once with transformers, "
                "AutoTokenizer.from_pretrained(dir).save_pretrained(dir), which writes "
                "tokenizer.json." if (root / "tokenizer.model").is_file() else "")
        raise MissingFileError(f"{root} has no tokenizer.json (the fast tokenizer file).{hint}")
    cfg = _optional_json(root / "tokenizer_config.json")
    specials = {**_optional_json(root / "special_tokens_map.json"), **cfg}
    tokenizer = Tokenizer.from_file(tok_file, bos_token=_token_str(specials.get("bos_token")),
                                    eos_token=_token_str(specials.get("eos_token")),
                                    add_bos_token=cfg.get("add_bos_token"))
    stop = [*_ids(_optional_json(root / "generation_config.json").get("eos_token_id")),
            *_ids(_optional_json(root / "config.json").get("eos_token_id")),
            *tokenizer.eos_token_ids]
    tokenizer.eos_token_ids = list(dict.fromkeys(stop))
    tokenizer.special_ids.update(tokenizer.eos_token_ids)
    return tokenizer, {**specials, **cfg}


def load_chat_template(root: Path, tokenizer_config: dict[str, Any]) -> ChatTemplate | None:
    """The model's chat template (chat_template.jinja wins over tokenizer_config.json), with its
    special-token strings; None when the model ships none."""
    root = Path(root)
    source = tool_source = None
    raw = tokenizer_config.get("chat_template")
    if isinstance(raw, str):
        source = raw
    elif isinstance(raw, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
        tool_source = named.get("tool_use")
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    tool_file = root / "additional_chat_templates" / "tool_use.jinja"
    if tool_file.is_file():
        tool_source = tool_file.read_text(encoding="utf-8")
    if not source:
        return None
    tokens = {k: _token_str(tokenizer_config.get(k)) for k in
              ("bos_token", "eos_token", "unk_token", "pad_token")}
    extra = {k: v for k, v in tokens.items()
             if v is not None and k not in ("bos_token", "eos_token")}
    try:
        return ChatTemplate(source, tokens["bos_token"] or "", tokens["eos_token"] or "",
                            tool_source=tool_source, **extra)
    except ValueError as e:
        raise ValueError(f"{root.name}: {e}") from e


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None/"auto" -> bfloat16 on CUDA (float16 where bf16 is unsupported), float32 elsewhere."""
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
               "float": "float32"}
    if isinstance(dtype, str):
        dtype = getattr(torch, aliases.get(dtype, dtype), None)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16 (or 'auto'), got {dtype!r}")
    return dtype


# ----------------------------------------------------------------------------- helpers


def model_name(path: str | os.PathLike) -> str:
    """The directory's name, or org/name for a hub cache snapshot
    (models--org--name/snapshots/<sha>)."""
    p = Path(path).expanduser().absolute()
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name[len("models--"):].replace("--", "/")
    return p.name


def _model_dir(path: str | os.PathLike) -> Path:
    root = Path(path).expanduser().resolve()
    if not root.exists():
        raise MissingFileError(f"no model directory at {root}")
    if not root.is_dir():
        raise ValueError(f"{root} is a file; load_hf_dir wants a Hugging Face model directory "
                         "(config.json, model.safetensors, tokenizer.json, ...)")
    return root


def _optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def _token_str(value: Any) -> str | None:
    """Special tokens appear as "<s>" or as {"content": "<s>", ...} in tokenizer configs."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []
