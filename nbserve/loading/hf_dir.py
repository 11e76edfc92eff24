"""Load a Hugging Face model directory: config.json, safetensors weights, tokenizer and template.

Weights stream tensor by tensor from safetensors into the family's builder (models/registry.py),
so peak host memory stays at about one tensor. Pickle checkpoints (`pytorch_model.bin`) are
refused: unpickling can run code.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..models import registry
from ..models.base import LoadedModel
from ..models.dtypes import resolve_dtype
from ..models.pooling import DECODER_DEFAULT
from ..text.chat_template import load_chat_template
from ..text.files import MissingFileError, read_json
from ..text.tokenizer import load_tokenizer
from .headless import causal_config, is_bare, is_headless, prefixed, tensor_names
from .pooling_config import read_hf_pooling

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_PICKLE_GLOBS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed by the model; old checkpoints ship it


def load_hf_dir(path: str | os.PathLike, device: str | torch.device | None = None,
                dtype: str | torch.dtype | None = None, **options: Any) -> LoadedModel:
    """Load the model directory at `path` on `device` (default cpu) in `dtype` (default float32
    on CPU, bfloat16 on CUDA). The model is named after the directory; `options` go to its
    family's `build` (pack, transposed_head...)."""
    root = _model_dir(path)
    name = model_name(path)
    hf_config, bare_arch = causal_config(read_json(root / "config.json"))
    family, config = registry.read_config(hf_config, name)
    weight_files = find_weight_files(root)  # fail on missing weights before the slow parts
    pooling = read_hf_pooling(root, hf_config)  # refused before the slow parts too
    names = tensor_names(weight_files)
    headless = is_headless(names, bool(hf_config.get("tie_word_embeddings")),
                           bare_arch or pooling is not None)
    tokenizer, tokenizer_config = load_tokenizer(root)
    template = load_chat_template(root, tokenizer_config)
    if tokenizer.vocab_size > config.vocab_size:
        warnings.warn(f"{name}: the tokenizer has {tokenizer.vocab_size} tokens but the model "
                      f"embeds only {config.vocab_size}; higher ids cannot be used", stacklevel=2)
    dev = torch.device(device if device is not None else "cpu")
    if headless:  # no single-row decode steps read the head: no transposed copy of it
        options = {**options, "transposed_head": False}
    tensors = iter_safetensors(weight_files, desc=f"Loading {name}")
    model = family.build(config, prefixed(tensors) if is_bare(names) else tensors,
                         device=dev, dtype=resolve_dtype(dtype, dev), **options)
    model.has_lm_head = not headless  # the head slot holds the embedding: no logits to serve
    return LoadedModel(model=model, tokenizer=tokenizer, template=template, name=name,
                       stop_token_ids=list(tokenizer.eos_token_ids), source=str(root),
                       pooling=pooling or DECODER_DEFAULT)


# ----------------------------------------------------------------------------- pieces


def find_weight_files(root: Path) -> list[Path]:
    """The safetensors files to load: `model.safetensors`, or the shards its index lists."""
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map'; re-download the checkpoint")
        shards = list(dict.fromkeys(str(s) for s in weight_map.values()))
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
