"""Read the pooling an embedding checkpoint declares (`models.pooling.Pooling`).

A Hugging Face directory declares it the sentence-transformers way: `modules.json` lists the
modules run after the transformer (a Pooling module, whose `config.json` sets one
`pooling_mode_*`; a Normalize module when the vectors are L2-normalised). A GGUF file declares
it in `<arch>.pooling_type` (llama.cpp's numbering), and llama.cpp normalises the vectors it
serves. What nbserve cannot pool the same way (max or weighted-mean pooling, several modes at
once, Dense layers after the pooling) is refused at load, naming the file, rather than served
as different vectors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..models.pooling import Pooling, PoolingKind
from ..text.files import read_json

MODULES_FILE = "modules.json"
_ST = "sentence_transformers.models."
# sentence-transformers' Pooling config: pooling_mode_<key> -> nbserve's kind (None: refused)
_ST_MODES: dict[str, PoolingKind | None] = {
    "lasttoken": "last", "mean_tokens": "mean", "cls_token": "cls", "max_tokens": None,
    "mean_sqrt_len_tokens": None, "weightedmean_tokens": None}
# the newer single `pooling_mode` string -> the same keys
_ST_MODE_NAMES = {"lasttoken": "lasttoken", "mean": "mean_tokens", "cls": "cls_token",
                  "max": "max_tokens", "mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                  "weightedmean": "weightedmean_tokens"}
# llama.cpp's enum llama_pooling_type: 0 none, 1 mean, 2 cls, 3 last, 4 rank
GGUF_POOLING: dict[int, PoolingKind] = {1: "mean", 2: "cls", 3: "last"}
GGUF_NONE, GGUF_RANK = 0, 4


def read_hf_pooling(root: Path, hf_config: dict[str, Any] | None = None) -> Pooling | None:
    """The pooling `root`'s sentence-transformers files declare, and whether its config.json
    (`hf_config`) declares Matryoshka training; None when it declares neither (then
    `models.pooling.DECODER_DEFAULT` applies). ValueError naming the file for what nbserve
    cannot pool."""
    config = hf_config or {}
    truncatable = bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions"))
    path = root / MODULES_FILE
    if not path.is_file():
        return Pooling(truncatable=True) if truncatable else None
    modules = _module_list(path)
    kind: PoolingKind | None = None
    normalize = False
    for module in modules:
        mtype = str(module.get("type", ""))
        short = mtype.removeprefix(_ST)
        if short == "Transformer":
            continue
        if short == "Pooling":
            kind = _st_pooling_kind(root / str(module.get("path", "")) / "config.json")
        elif short == "Normalize":
            normalize = True
        else:
            raise ValueError(
                f"{path} lists a {mtype!r} module; nbserve pools the transformer's hidden "
                "states and L2-normalises them, and runs no other module (a Dense projection "
                "after the pooling would change every vector). Serve the model with "
                "sentence-transformers, or drop the module if the model card says it is "
                "optional.")
    if kind is None:
        raise ValueError(f"{path} lists no sentence_transformers.models.Pooling module; "
                         "nbserve needs one to know how to pool (or delete modules.json to "
                         "pool at the last token, normalised)")
    return Pooling(kind=kind, normalize=normalize, truncatable=truncatable)


def _module_list(path: Path) -> list[dict[str, Any]]:
    try:
        modules = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); re-download or fix it") from exc
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{path} should be a list of modules (objects with 'type' and 'path'), "
                         "as sentence-transformers writes it")
    return sorted(modules, key=lambda m: int(m.get("idx", 0)))


def _st_pooling_kind(config_path: Path) -> PoolingKind:
    """The one mode a sentence-transformers Pooling config turns on, as nbserve's kind."""
    cfg = read_json(config_path)
    named = cfg.get("pooling_mode")
    if isinstance(named, str):
        if named not in _ST_MODE_NAMES:
            raise ValueError(f"{config_path}: unknown pooling_mode {named!r}")
        modes = [_ST_MODE_NAMES[named]]
    else:
        modes = [key for key in _ST_MODES if cfg.get(f"pooling_mode_{key}") is True]
    if len(modes) != 1:
        raise ValueError(
            f"{config_path} turns on {len(modes)} pooling modes ({', '.join(modes) or 'none'}); "
            "nbserve pools with exactly one of lasttoken, mean_tokens or cls_token")
    kind = _ST_MODES[modes[0]]
    if kind is None:
        raise ValueError(f"{config_path} asks for pooling_mode_{modes[0]}, which nbserve does "
                         "not compute; it pools with lasttoken, mean_tokens or cls_token")
    if cfg.get("include_prompt", True) is not True:
        raise ValueError(f"{config_path} sets include_prompt false (pool without the "
                         "instruction's tokens), which nbserve does not do: it pools the whole "
                         "input")
    return kind


def gguf_pooling(value: object, key: str, path: Path) -> Pooling | None:
    """The pooling a GGUF's `<arch>.pooling_type` (`value`, None when absent) declares; None
    for none (0) or absent (a generative model: the decoder default applies). Rank (4, a
    classifier head that llama.cpp's converter writes for rerankers) is refused."""
    if value is None or value == GGUF_NONE:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{path}: {key} should be an integer, got {value!r}")
    if value == GGUF_RANK:
        raise ValueError(f"{path}: {key} is 4 (rank: a classifier head over the last token, "
                         "cls.output), which nbserve does not serve; load the reranker's own "
                         "Hugging Face directory (or a GGUF of it with its LM head): /v1/rerank "
                         "scores with the yes/no logits of the LM head")
    kind = GGUF_POOLING.get(value)
    if kind is None:
        raise ValueError(f"{path}: unknown {key} {value} (llama.cpp's are 0 none, 1 mean, "
                         "2 cls, 3 last, 4 rank)")
    return Pooling(kind=kind, normalize=True)  # llama.cpp's servers normalise by default

