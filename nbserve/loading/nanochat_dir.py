"""Load a nanochat checkpoint directory, as nanochat's checkpoint manager writes it:
`model_<step>.pt` (the GPT's state dict) and `meta_<step>.json` (its `model_config`, the
GPTConfig fields), the last step unless a `model_<step>.pt` file is named.

The weights are read with `torch.load(weights_only=True)`: tensors only, never code from the
file. nanochat keeps its tokenizer as `tokenizer.pkl` (a pickled tiktoken Encoding), which
nbserve does not unpickle either: pass the tokenizer (`tokenizer=`: nanochat's own tokenizer
object, a tokenizers.Tokenizer, a tokenizer.json path, a transformers tokenizer), or put a
tokenizer.json with nanochat's special tokens in the directory (or in nanochat's
`<base>/tokenizer/`). The chat template is nanochat's conversation format
(text/nanochat_chat.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from ..models.base import LoadedModel
from ..models.dtypes import resolve_dtype
from ..models.nanochat import NanochatConfig, build_nanochat
from ..text import ChatTemplate
from ..text.files import MissingFileError, read_json
from ..text.nanochat_chat import ASSISTANT_END, BOS
from .hf_dir import model_name

_MODEL_FILE = re.compile(r"^model_(\d+)\.pt$")


def is_nanochat_dir(path: Path) -> bool:
    """A directory with a model_<step>.pt and no config.json (a HF folder has one)."""
    return path.is_dir() and not (path / "config.json").exists() and \
        any(_MODEL_FILE.match(p.name) for p in path.iterdir())


def is_nanochat_file(path: Path) -> bool:
    """A model_<step>.pt with its meta_<step>.json beside it."""
    m = _MODEL_FILE.match(path.name)
    return path.is_file() and m is not None and (path.parent / f"meta_{m.group(1)}.json").is_file()


def checkpoint_files(path: Path) -> tuple[Path, Path]:
    """(model_<step>.pt, meta_<step>.json): of the named file, or of the directory's last
    step that has both."""
    if path.is_file():
        m = _MODEL_FILE.match(path.name)
        meta = path.parent / f"meta_{m.group(1)}.json" if m else None
        if meta is None or not meta.is_file():
            raise MissingFileError(f"{path} has no meta_<step>.json beside it (nanochat's "
                                   "checkpoint manager writes both)")
        return path, meta
    steps = {}
    for p in path.iterdir():
        m = _MODEL_FILE.match(p.name)
        if m:
            steps[int(m.group(1))] = (p, path / f"meta_{m.group(1)}.json")
    complete = {s: files for s, files in steps.items() if files[1].is_file()}
    if not complete:
        raise MissingFileError(f"{path} has {', '.join(sorted(p.name for p, _ in steps.values()))}"
                               " but no meta_<step>.json for them: the config lives there")
    return complete[max(complete)]


def find_tokenizer(root: Path) -> Path:
    """A tokenizer.json in the checkpoint directory or in nanochat's `<base>/tokenizer/`
    (checkpoints live in `<base>/<kind>_checkpoints/<tag>/`). Raises when there is only
    nanochat's tokenizer.pkl, or nothing."""
    places = [root, root.parent.parent / "tokenizer", root.parent / "tokenizer"]
    for place in places:
        if (place / "tokenizer.json").is_file():
            return place / "tokenizer.json"
    pickles = [place / "tokenizer.pkl" for place in places if (place / "tokenizer.pkl").is_file()]
    if pickles:
        raise ValueError(
            f"the tokenizer of {root.name} is {pickles[0]}, a pickle (nanochat saves its tiktoken "
            "Encoding with pickle.dump); nbserve does not unpickle files, because unpickling "
            "can run arbitrary code. Pass the tokenizer instead: nbserve.load(dir, "
            "tokenizer=tok) with nanochat's own tokenizer object (e.g. "
            "nanochat.tokenizer.get_tokenizer(), where you trust the file), a "
            "tokenizers.Tokenizer, or the path of a tokenizer.json with nanochat's special "
            "tokens.")
    raise MissingFileError(f"{root} has no tokenizer: pass tokenizer=... (nanochat's tokenizer "
                           "object, a tokenizers.Tokenizer or a tokenizer.json path)")


def read_state_dict(model_file: Path) -> dict[str, torch.Tensor]:
    """The tensors of model_<step>.pt (`torch.load(weights_only=True)`, memory-mapped), with
    torch.compile's `_orig_mod.` prefix dropped."""
    try:
        state = torch.load(model_file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # an unpickling refusal, a corrupt or old-format file
        raise ValueError(f"{model_file} could not be read as tensors only "
                         f"(torch.load(weights_only=True)): {exc}") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise ValueError(f"{model_file} is not a state dict of tensors")
    return {str(k).removeprefix("_orig_mod."): v for k, v in state.items()}


def load_nanochat_dir(path: str | os.PathLike, device: str | torch.device | None = None,
                      dtype: str | torch.dtype | None = None, *, tokenizer: Any = None,
                      chat_template: str | ChatTemplate | None = None,
                      max_context: int | None = None, **options: Any) -> LoadedModel:
    """The nanochat checkpoint at `path` (a directory, or one model_<step>.pt) on `device`
    (default cpu) in `dtype` (default float32 on CPU, bfloat16 on CUDA); `options` go to
    `build_nanochat` (pack, transposed_head, float_kernel). Refuses a checkpoint of another
    nanochat version, naming the parameters that differ."""
    target = Path(path).expanduser().resolve()
    model_file, meta_file = checkpoint_files(target)
    root = model_file.parent
    name = model_name(root)
    meta = read_json(meta_file)
    model_config = meta.get("model_config") if isinstance(meta, dict) else None
    if not isinstance(model_config, dict):
        raise ValueError(f"{meta_file} has no 'model_config' (nanochat's GPTConfig fields)")
    cfg = NanochatConfig.from_model_config(model_config, name)
    tok_source = tokenizer if tokenizer is not None else find_tokenizer(root)
    state = read_state_dict(model_file)
    for key, value in (("resid_lambdas", 1.0), ("x0_lambdas", 0.0)):
        if key not in state:  # as nanochat's checkpoint manager patches older checkpoints
            state[key] = torch.full((cfg.n_layer,), value)
    dev = torch.device(device if device is not None else "cpu")
    try:
        model = build_nanochat(cfg, state.items(), device=dev, dtype=resolve_dtype(dtype, dev),
                               **options)
    except ValueError as exc:
        raise ValueError(f"{model_file}: {exc}") from None
    del state
    if max_context is not None:
        model.max_context = min(int(max_context), model.max_context)
    tok, template, stops = model.serving_defaults(tok_source)
    if isinstance(chat_template, ChatTemplate):
        template = chat_template
    elif chat_template is not None:
        source = str(chat_template)
        if "{" not in source and Path(source).is_file():
            source = Path(source).read_text(encoding="utf-8")
        template = ChatTemplate(source, bos_token=BOS, eos_token=ASSISTANT_END)
    return LoadedModel(model=model, tokenizer=tok, template=template,
                       name=name, stop_token_ids=stops,
                       source=str(model_file))
