"""Turn a source (HF directory, .gguf file, "smollm2", hub id) into a LoadedModel."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from ..cpu.memory import return_freed_memory
from ..cpu.threads import torch_threads
from ..models.base import LoadedModel
from ..models.dtypes import (
    MIXED16,
    QUANTIZED,
    QUANTIZED_EXACT,
    QUANTIZED_FORMATS,
    resolve_dtype,
    weight_choice,
    weights_of,
)
from .memory_check import check_source, load_form

if TYPE_CHECKING:
    from ..execution.weights import WeightFormats
    from ..text.chat_template import ChatTemplate

class _Serving(TypedDict):
    """What `load` passes on to a source that takes it (a nanochat checkpoint)."""

    tokenizer: object
    chat_template: str | ChatTemplate | None
    max_context: int | None


DEFAULT_NAMES = {"smollm2", "default", "smollm2-135m-instruct"}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _add_weight_copies(loaded: LoadedModel, weight_format: str) -> None:
    """mixed16: float16 copies; quantized(-exact): a GGUF's own quantized blocks (or Q8_0
    ones), with 16-bit-rounded inputs on the row kernels that have them, or without."""
    from ..execution.weights import WeightFormats

    model = loaded.model
    if not isinstance(model, WeightFormats):
        raise ValueError(f"dtype={weight_format!r} needs nbserve's own model implementation; "
                         f"{type(model).__name__} does not have it")
    if weight_format == MIXED16:
        model.use_16bit_weights()
    else:
        model.use_quantized_weights(_file_blocks(loaded), round16=weight_format == QUANTIZED)


def _use_lossless_blocks(loaded: LoadedModel) -> None:
    """CPU default for a GGUF that was not read as blocks (GPT-2's Conv1D layout) whose
    matmul weights are all Q4_0, Q4_1 or Q8_0 blocks: keep them (weights="blocks") when the
    C kernel is available. The blocks hold the float32
    weights' exact values, so nothing changes but the speed. The model was built without the
    float32 model's own copies (`_blocks_will_serve`); a file of other types gets them now."""
    from ..execution.weights import WeightFormats

    model = loaded.model
    if not isinstance(model, WeightFormats) or _gguf_file(str(loaded.source)) is None:
        return
    from ..cpu.kernels.build import kernels_available

    if not (kernels_available() and
            model.use_quantized_weights(_file_blocks(loaded), only_lossless=True)):
        _add_float_copies(model)


def _blocks_will_serve(source: object, copies: str | None, auto: bool, device: str) -> bool:
    """Whether quantized blocks will serve every matmul of this load (weights="blocks", or
    the CPU default for a .gguf, where the kernel builds): then the float32 model is built
    without packed copies or a transposed head, which would be dropped at once (for a large
    model they would double the memory the load needs on its way)."""
    cpu = torch.device(device).type == "cpu"
    if copies in QUANTIZED_FORMATS:
        return cpu
    if copies is not None or not auto or not cpu or _gguf_file(str(source)) is None:
        return False
    from ..cpu.kernels.build import kernels_available

    return kernels_available()


def _served_from_blocks(source: object, copies: str | None, auto: bool, device: str) -> bool:
    """Whether this load reads a GGUF's blocks and serves them, never building those weights
    in float32 (`gguf.load_gguf`'s weight_format): a .gguf file (the default model's too)
    holding quantized weights, on CPU, asked for as weights="blocks" or left to the loader
    (`auto`) where the C kernels build (dense weights only when asked)."""
    if torch.device(device).type != "cpu" or not (copies in QUANTIZED_FORMATS or (
            copies is None and auto)):
        return False
    path = _gguf_file(str(source))
    if path is None or not path.is_file():
        return False
    from ..cpu.kernels.build import kernels_available
    from .gguf import serves_blocks

    try:
        quantized = serves_blocks(path)
    except ValueError:  # not a readable GGUF: the loader says why
        return False
    return quantized and (copies is not None or kernels_available())


def _serves_blocks(loaded: LoadedModel) -> bool:
    """Whether the model serves from blocks already (`gguf.load_gguf` read them as such)."""
    from ..execution.weights import WeightFormats

    model = loaded.model
    return isinstance(model, WeightFormats) and model.weight_format in QUANTIZED_FORMATS


def _add_float_copies(model: WeightFormats) -> None:
    """What `build_llama` would have added to a CPU float32 model built without copies: the
    oneDNN-packed copies where they pay (`WeightFormats.packing_pays`), else a transposed head."""
    if model.dense_released:
        return
    if model.packing_pays():
        model.pack_weights()
    else:
        model.use_transposed_head()


def _file_blocks(loaded: LoadedModel) -> dict | None:
    """The Q4_0/Q4_1/Q8_0 blocks of the .gguf file a model was loaded from; None for others."""
    gguf_file = _gguf_file(str(loaded.source))
    if gguf_file is None:
        return None
    from .gguf import read_quant_blocks

    return read_quant_blocks(gguf_file)


def _gguf_file(source: str) -> Path | None:
    """The .gguf file a model was loaded from (the default model's included), if any."""
    if source.lower() in DEFAULT_NAMES and not Path(source).exists():
        from .default import default_model_path

        return default_model_path()
    return Path(source).expanduser() if source.lower().endswith(".gguf") else None


def load(source: object, *, device: str | None = None, dtype: str | torch.dtype | None = None,
         weights: str = "auto", exact: bool = False,
         verbose: bool = True, tokenizer: object = None,
         chat_template: str | ChatTemplate | None = None,
         max_context: int | None = None) -> LoadedModel:
    """Load a model to serve from `source` and print one summary line.

    `source`: "smollm2" (the default model), a HF checkpoint directory, a .gguf file, a
    Hugging Face hub id (needs `huggingface_hub`), or a LoadedModel (returned as is). A model
    object (transformers model, StepModel, torch module) goes to `nbserve.models.adopt.adopt`
    with `tokenizer`, `chat_template` and `max_context`; it is served where it is, not copied.

    `dtype`, the compute dtype: "auto" (None: float32 on CPU, bfloat16 on CUDA), "float32",
    "bfloat16" or "float16". `weights`, the weight format: "auto" (with no dtype given, a
    quantized GGUF on CPU is "blocks", its blocks read as they are and never built in
    float32, `gguf.load_gguf`; anything else "dense" in `dtype`); "blocks" (CPU, float32:
    every matmul, of any step size, over a GGUF's own blocks of any served type or Q8_0 made
    at load; compiles a small C kernel at first use; see
    `WeightFormats.use_quantized_weights`. A GGUF's own blocks are the float32 weights' exact
    values, so those are then dropped, see `WeightFormats.release_dense_weights`: the weights
    take about the file's size); "dense" (dequantized to `dtype`); or "mixed16" (CPU:
    float32 plus float16 copies of the matmul weights for one- and two-row steps: a faster
    lone stream, +50% weight memory, outputs can differ from float32 in rare near-ties, see
    `WeightFormats.use_16bit_weights`). `exact` (blocks): float32 arithmetic on every kernel
    path; False (default): on AVX2 CPUs (and AVX-512 ones where that measures faster,
    `cpu.kernels.tuning`) steps of one or two rows round their inputs to 16 bits per block
    of 32. The old dtype names "mixed16", "quantized" and "quantized-exact" still work for
    weights="mixed16", weights="blocks" and weights="blocks", exact=True, with a
    FutureWarning. Bad values: ValueError listing the valid ones. On CPU in
    float32 (and mixed16) the
    loaders also keep oneDNN-packed copies of the matmul weights, which make batched decoding
    faster (+100% weight memory; skipped when the copies would take over a quarter of the RAM;
    see `WeightFormats.pack_weights`). The load line shows the copies apart;
    benchmarks/README.md has the figures.
    """
    choice = weight_choice(dtype, weights, exact)  # the old dtype names warn here
    if isinstance(source, LoadedModel):
        return source
    copies, dtype = choice.format, choice.dtype
    if copies and dtype is not None and resolve_dtype(dtype, "cpu") != torch.float32:
        raise ValueError(f"weights={choice.weights!r} computes in float32; dtype must be "
                         f"'auto' or 'float32' with it, got {dtype!r}")
    if not isinstance(source, (str, os.PathLike)):
        from ..models.adopt import adopt, check_placement

        if choice.weights != "auto":
            raise ValueError(f"weights={choice.weights!r} applies to checkpoints nbserve loads "
                             "itself (a HF directory, a .gguf file, \"smollm2\"); a model "
                             "object is served in the dtype it has")
        loaded = adopt(source, tokenizer, chat_template=chat_template, max_context=max_context,
                       verbose=verbose)
        check_placement(loaded.model, device,
                        None if dtype is None else resolve_dtype(dtype, "cpu"))
        return loaded
    device = device or default_device()
    t0 = time.perf_counter()
    served = _served_from_blocks(source, copies, choice.auto, device)
    if served and copies is None:  # a quantized GGUF on CPU: its blocks by default
        copies = QUANTIZED_EXACT if choice.exact else QUANTIZED
    torch_dtype = resolve_dtype("float32" if copies else dtype, device)
    bare = served or _blocks_will_serve(source, copies, choice.auto, device)
    options: dict[str, object] = {"pack": False, "transposed_head": False} if bare else {}
    if served:
        options["weight_format"] = copies
    with torch_threads(1):  # loading is I/O-bound; no OpenMP pool in the caller's thread
        try:
            # refused before any tensor is read when the weights cannot fit
            check_source(str(source), torch.device(device),
                         load_form(torch_dtype, copies, bare, torch.device(device), served))
            loaded = _load_path(str(source), device, torch_dtype, options,
                                _Serving(tokenizer=tokenizer, chat_template=chat_template,
                                     max_context=max_context))
            if _serves_blocks(loaded):
                pass  # read as blocks (a quantized GGUF's layout that keeps its tensors)
            elif choice.auto and torch_dtype == torch.float32:
                _use_lossless_blocks(loaded)  # the default, as before (GPT-2's Conv1D)
            elif copies:
                _add_weight_copies(loaded, copies)
        finally:
            _forget_files()
        _release_unread_weights(loaded)
    return_freed_memory()  # loading's temporaries (about 100 MB after SmolLM2)
    if verbose:
        print(summary_line(loaded, time.perf_counter() - t0), flush=True)
    return loaded


def _forget_files() -> None:
    """Drop the parsed GGUF files kept for the opens of one load (`gguf.forget_readers`)."""
    gguf = sys.modules.get(f"{__name__}.gguf")
    if gguf is not None:
        gguf.forget_readers()


def _release_unread_weights(loaded: LoadedModel) -> None:
    """weights="blocks" (asked for, or a GGUF's lossless default): drop the float32 weights
    that its quantized and packed copies leave unread (`WeightFormats.release_dense_weights`;
    the outputs stay the same bit for bit)."""
    from ..execution.weights import WeightFormats

    model = loaded.model
    if isinstance(model, WeightFormats) and model.weight_format in QUANTIZED_FORMATS:
        model.release_dense_weights()


def _load_path(src: str, device: str, dtype: torch.dtype,
               options: dict[str, Any] | None = None,
               serving: _Serving | None = None) -> LoadedModel:
    """The model at `src`; `options`: for its family's `build` (pack, transposed_head...);
    `serving`: tokenizer, chat_template, max_context, for sources that take them (nanochat)."""
    options = options or {}
    path = Path(src).expanduser()
    from .nanochat_dir import is_nanochat_dir, is_nanochat_file, load_nanochat_dir

    if is_nanochat_dir(path) or is_nanochat_file(path):
        given = serving or _Serving(tokenizer=None, chat_template=None, max_context=None)
        return load_nanochat_dir(path, device=device, dtype=dtype, **given, **options)
    if src.lower() in DEFAULT_NAMES and not path.exists():
        from .default import load_default

        return load_default(device=device, dtype=dtype, **options)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{src}: expected a .gguf file, a HF checkpoint directory "
                             f"(config.json + model.safetensors) or a nanochat checkpoint, "
                             f"got a {path.suffix or 'plain'} file")
        from .gguf import load_gguf

        return load_gguf(path, device=device, dtype=dtype, **options)
    if path.is_dir():
        from .hf_dir import load_hf_dir

        return load_hf_dir(path, device=device, dtype=dtype, **options)
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
    # downloaded now: refused before its tensors are read when they cannot fit
    check_source(local, torch.device(device), load_form(dtype, None, False, torch.device(device)))
    return load_hf_dir(Path(local), device=device, dtype=dtype)


def summary_line(loaded: LoadedModel, seconds: float) -> str:
    """One line: model, parameters, dtype, device, weight memory, load time."""
    from torch import nn

    from ..execution.weights import WeightFormats, count_parameters

    model = loaded.model
    if not isinstance(model, nn.Module):
        raise TypeError(f"summary_line counts a torch module's parameters; {type(model).__name__}"
                        " is not one")
    n, nbytes = count_parameters(model)
    formats = model if isinstance(model, WeightFormats) else None
    copies = formats.derived_bytes() if formats is not None else 0
    kind, exact = weights_of(formats.weight_format) if formats is not None else ("dense", False)
    dtype = str(model.dtype).replace("torch.", "")
    form = f"{kind}{' exact' if exact else ''} weights, {dtype}"
    if formats is not None and formats.dense_released:  # the blocks stand for the weights
        weights = f"{nbytes / 2**20:.0f} MiB of weights, {copies / 2**20:.0f} MiB of them " \
            "quantized blocks"
    else:
        extra = f" + {copies / 2**20:.0f} MiB of copies for speed" if copies else ""
        weights = f"{(nbytes - copies) / 2**20:.0f} MiB of weights{extra}"
    return (f"nbserve: loaded {loaded.name} ({n / 1e6:.1f}M parameters, {form}, "
            f"{model.device}, {weights}) in {seconds:.1f} s")


__all__ = ["LoadedModel", "load", "resolve_dtype", "default_device", "summary_line"]
