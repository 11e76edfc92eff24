"""Tiny random Qwen3 checkpoints as embedding models and rerankers ship them, for the loader
and /v1/rerank tests: the tiny tokenizer with "yes", "no", "<think>" and "</think>" added as
single tokens (as Qwen's vocabulary has them), Qwen3's own chat template, and the
sentence-transformers files written by hand (modules.json, 1_Pooling/config.json).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from family_models import _COMMON
from family_templates import QWEN3_TEMPLATE
from tiny_models import IM_END_ID, make_tiny_tokenizer
from tokenizers import Tokenizer

ADDED = ["yes", "no", "<think>", "</think>"]
ST_POOLING = "sentence_transformers.models.Pooling"


def reranker_tokenizer() -> Tokenizer:
    """The tiny byte-level BPE with Qwen's single "yes"/"no" and think tokens added."""
    tok = make_tiny_tokenizer()
    tok.add_tokens(ADDED)
    return tok


def save_qwen3(path: Path, *, bare: bool = False, tie: bool = False, seed: int = 0,
               **config: Any) -> Path:
    """A random tiny Qwen3 saved by transformers into `path`: `bare` saves the backbone alone
    (`Qwen3Model`: names without `model.`, no lm_head), as Qwen3-Embedding ships."""
    tok = reranker_tokenizer()
    cfg = transformers.Qwen3Config(**(_COMMON | {"tie_word_embeddings": tie} | config),
                                   vocab_size=tok.get_vocab_size())
    cfg._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (transformers.Qwen3Model if bare else transformers.Qwen3ForCausalLM)(cfg).eval()
        with torch.no_grad():  # non-trivial norm weights
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>", "add_bos_token": False,
        "chat_template": QWEN3_TEMPLATE}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END_ID]}))
    return path


def write_st_config(path: Path, modes: dict[str, bool] | None = None, normalize: bool = True,
                    extra_modules: list[dict[str, Any]] | None = None,
                    **pooling: Any) -> None:
    """sentence-transformers' files for `path`: a Transformer, a Pooling module with `modes`
    (pooling_mode_* keys: True) and `pooling` keys, a Normalize module if `normalize`, then
    `extra_modules`."""
    modules: list[dict[str, Any]] = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST_POOLING}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    for extra in extra_modules or []:
        modules.append({"idx": len(modules), "name": str(len(modules)), **extra})
    (path / "modules.json").write_text(json.dumps(modules))
    keys = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
            "weightedmean_tokens", "lasttoken")
    cfg: dict[str, Any] = {"word_embedding_dimension": _COMMON["hidden_size"]}
    cfg.update({f"pooling_mode_{k}": False for k in keys})
    cfg.update({f"pooling_mode_{k}": v for k, v in
                (modes if modes is not None else {"lasttoken": True}).items()})
    cfg.update(pooling)
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
