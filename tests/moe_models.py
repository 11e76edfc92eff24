"""Tiny random-weight mixture-of-experts `transformers` models (Qwen3-MoE, Mixtral), for the
equivalence tests of tests/test_moe.py, saved as Hugging Face folders in either tensor layout.

The cases: Qwen3-MoE with 8 experts, top-2, a dense middle layer (`mlp_only_layers`) and raw
top-k weights; Qwen3-MoE renormalising them, with every other layer sparse
(`decoder_sparse_step`) and a sliding window; Mixtral with 8 experts, top-2 and a sliding
window. The routers' weights are scaled up so that routing is decisive (two experts nearly
tied would make the comparison flaky at float32 rounding, not wrong).

`save_moe_dir` writes the weights in the layout asked for: "legacy" (one matrix per expert,
the names of hub checkpoints: Qwen3-MoE `mlp.experts.E.gate_proj`, Mixtral
`block_sparse_moe.experts.E.w1`), written here from the model's tensors, or "fused"
(transformers 5's own `mlp.experts.gate_up_proj` (E, 2I, H) and `mlp.experts.down_proj`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from family_models import MAX_POS, WINDOW, tiny_family_model
from safetensors.torch import save_file
from tiny_models import IM_END_ID, IM_START_ID, SMOLLM2_TEMPLATE, make_tiny_tokenizer

NUM_EXPERTS, TOP_K = 8, 2
ROUTER_SCALE = 4.0

_COMMON: dict[str, Any] = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=MAX_POS, rms_norm_eps=1e-6, bos_token_id=IM_START_ID,
    eos_token_id=IM_END_ID, pad_token_id=None, initializer_range=0.1,
    tie_word_embeddings=False, num_experts_per_tok=TOP_K)

# case -> (config class, model class, config kwargs)
CASES: dict[str, tuple[Callable[..., Any], Callable[..., Any], dict[str, Any]]] = {
    "qwen3-moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, _COMMON | dict(
        num_hidden_layers=3, num_experts=NUM_EXPERTS, moe_intermediate_size=32,
        intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3-moe-norm-window": (
        transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, _COMMON | dict(
            num_hidden_layers=4, num_experts=NUM_EXPERTS, moe_intermediate_size=32,
            intermediate_size=96, decoder_sparse_step=2, norm_topk_prob=True,
            use_sliding_window=True, sliding_window=WINDOW)),
    "mixtral-window": (transformers.MixtralConfig, transformers.MixtralForCausalLM, _COMMON | dict(
        num_hidden_layers=2, num_local_experts=NUM_EXPERTS, intermediate_size=32,
        sliding_window=WINDOW)),
}

# per case: the legacy name of a sparse block, and of each expert's (gate, up, down) matrices
LEGACY = {"qwen3-moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
          "qwen3-moe-norm-window": ("mlp", ("gate_proj", "up_proj", "down_proj")),
          "mixtral-window": ("block_sparse_moe", ("w1", "w3", "w2"))}


def tiny_moe_model(case: str, vocab_size: int, seed: int = 0) -> transformers.PreTrainedModel:
    """A random tiny model of `case` (tests/family_models.py's builder), routers scaled up."""
    model = tiny_family_model(case, vocab_size, seed, cases=CASES)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_SCALE)
    return model


def legacy_tensors(case: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (transformers 5 names) with every stacked expert tensor split per expert under
    the hub checkpoints' names."""
    block, (gate, up, down) = LEGACY[case]
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        prefix, _, last = name.rpartition(".mlp.")
        if last == "experts.gate_up_proj":
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{block}.experts.{e}.{gate}.weight"] = t[e, :half].clone()
                out[f"{prefix}.{block}.experts.{e}.{up}.weight"] = t[e, half:].clone()
        elif last == "experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}.{block}.experts.{e}.{down}.weight"] = t[e].clone()
        elif last == "gate.weight":
            out[f"{prefix}.{block}.gate.weight"] = t.clone()
        else:
            out[name] = t.clone()
    return out


def save_moe_dir(case: str, path: Path, layout: str = "legacy", seed: int = 0) -> Path:
    """`tiny_moe_model(case)` as a HF folder (config, tiny tokenizer, template), its weights in
    `layout`: "legacy" (per-expert names) or "fused" (transformers 5's stacked tensors)."""
    tok = make_tiny_tokenizer()
    model = tiny_moe_model(case, tok.get_vocab_size(), seed)
    model.generation_config.eos_token_id = [IM_END_ID]
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    tensors = legacy_tensors(case, state) if layout == "legacy" else state
    for old in path.glob("model*.safetensors*"):
        old.unlink()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>", "add_bos_token": False,
        "chat_template": SMOLLM2_TEMPLATE}))
    return path
