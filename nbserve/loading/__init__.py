"""Turn a source (HF directory, .gguf file, "smollm2", hub id) into a LoadedModel."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from .bundle import LoadedModel

DEFAULT_NAMES = {"smollm2", "default", "smollm2-135m-instruct"}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: Any, device: str | torch.device) -> torch.dtype:
    """float32 on CPU and bfloat16 on CUDA unless asked otherwise ("float16", torch.bfloat16...)."""
    if dtype is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16}
    if str(dtype).replace("torch.", "") not in names:
        raise ValueError(f"unsupported dtype {dtype!r}: use one of {', '.join(sorted(names))}")
    return names[str(dtype).replace("torch.", "")]


def load(source: Any, *, device: str | None = None, dtype: Any = None,
         verbose: bool = True, tokenizer: Any = None, chat_template: Any = None,
         max_context: int | None = None) -> LoadedModel:
    """Load a model to serve from `source` and print one summary line.

    `source`: "smollm2" (the default model), a HF checkpoint directory, a .gguf file, a
    Hugging Face hub id (needs `huggingface_hub`), or a LoadedModel (returned as is). A model
    object (transformers model, StepModel, torch module) goes to `nbserve.models.adopt.adopt`
    with `tokenizer`, `chat_template` and `max_context`; it is served where it is, not copied.
    """
    if isinstance(source, LoadedModel):
        return source
    if not isinstance(source, (str, os.PathLike)):
        from ..models.adopt import adopt, check_placement

        loaded = adopt(source, tokenizer, chat_template=chat_template, max_context=max_context,
                       verbose=verbose)
        check_placement(loaded.model, device, None if dtype is None else resolve_dtype(dtype, "cpu"))
        return loaded
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    t0 = time.perf_counter()
    loaded = _load_path(str(source), device, torch_dtype)
    if verbose:
        print(summary_line(loaded, time.perf_counter() - t0), flush=True)
    return loaded


def _load_path(src: str, device: str, dtype: torch.dtype) -> LoadedModel:
    path = Path(src).expanduser()
    if src.lower() in DEFAULT_NAMES and not path.exists():
        from .default import load_default

        return load_default(device=device, dtype=dtype)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{src}: expected a .gguf file or a HF checkpoint directory "
                             f"(config.json + model.safetensors), got a {path.suffix or 'plain'} file")
        from .gguf import load_gguf

        return load_gguf(path, device=device, dtype=dtype)
    if path.is_dir():
        from .hf_dir import load_hf_dir

        return load_hf_dir(path, device=device, dtype=dtype)
    if _looks_like_hub_id(src):
        return _load_from_hub(src, device, dtype)
    raise FileNotFoundError(
        f"model source {src!r} not found: expected 'smollm2', a HF checkpoint directory, "
        "a .gguf file, or a hub id like 'HuggingFaceTB/SmolLM2-135M-Instruct'")


def _looks_like_hub_id(src: str) -> bool:
    parts = src.split("/")
    return len(parts) == 2 and all(parts) and not src.startswith((".", "/", "~"))


def _load_from_hub(repo_id: str, device: str, dtype: torch.dtype) -> LoadedModel:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ImportError(
            f"loading {repo_id!r} from the Hugging Face hub needs huggingface_hub: "
            "pip install 'nbserve[hub]', or download the checkpoint and pass its local "
            "directory") from None
    from .hf_dir import load_hf_dir

    try:
        local = snapshot_download(repo_id, allow_patterns=[
            "*.json", "*.safetensors", "*.jinja", "tokenizer*"])
    except Exception as exc:  # offline, unknown repo, auth...
        raise RuntimeError(f"could not fetch {repo_id!r} from the hub ({exc}); pass a local "
                           "checkpoint directory or .gguf file instead") from exc
    return load_hf_dir(Path(local), device=device, dtype=dtype)


def summary_line(loaded: LoadedModel, seconds: float) -> str:
    """One line: model, parameters, dtype, device, weight memory, load time."""
    from ..models.llama import count_parameters

    n, nbytes = count_parameters(loaded.model)
    dtype = str(getattr(loaded.model, "dtype", "?")).replace("torch.", "")
    return (f"nbserve: loaded {loaded.name} ({n / 1e6:.1f}M parameters, {dtype}, "
            f"{getattr(loaded.model, 'device', '?')}, {nbytes / 2**20:.0f} MiB of weights) "
            f"in {seconds:.1f} s")


__all__ = ["LoadedModel", "load", "resolve_dtype", "default_device", "summary_line"]
