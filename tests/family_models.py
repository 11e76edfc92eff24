"""Tiny random-weight `transformers` models of every native family, for equivalence tests.

Each entry builds a config with the family's distinctive options switched on at tiny sizes
(hidden 64, 4 heads of 16, 2 kv heads): sliding windows of 8 positions so a 24-token prompt
already passes them, both layer kinds where a family interleaves them, RoPE scalings, softcaps,
partial rotary, layers without RoPE. `save_family_dir` writes one as a Hugging Face folder with
the tiny tokenizer of tiny_models.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from tiny_models import IM_END_ID, IM_START_ID, SMOLLM2_TEMPLATE, make_tiny_tokenizer

WINDOW = 8
MAX_POS = 256

_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=MAX_POS, rms_norm_eps=1e-6,
    bos_token_id=IM_START_ID, eos_token_id=IM_END_ID, pad_token_id=None,
    initializer_range=0.1, tie_word_embeddings=False)


def _with(**kw: Any) -> dict[str, Any]:
    return _COMMON | kw


def _longrope(n: int) -> dict[str, Any]:
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(n)],
            "long_factor": [1.5 + 0.2 * i for i in range(n)],
            "original_max_position_embeddings": 32}


# family case -> (config class, model class, config kwargs)
CASES: dict[str, tuple[Callable[..., Any], Callable[..., Any], dict[str, Any]]] = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, _with()),
    "qwen3-window": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                     _with(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                           max_window_layers=1)),
    "mistral-window": (transformers.MistralConfig, transformers.MistralForCausalLM,
                       _with(sliding_window=WINDOW)),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               _with(num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24,
                     attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                     hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               _with(num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                     rope_parameters={
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1000000.0}},
                     tie_word_embeddings=True)),
    "phi3-longrope": (transformers.Phi3Config, transformers.Phi3ForCausalLM,
                      _with(rope_scaling=_longrope(8), original_max_position_embeddings=32)),
    "phi4-mini": (transformers.Phi3Config, transformers.Phi3ForCausalLM,
                  _with(partial_rotary_factor=0.75, tie_word_embeddings=True)),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, _with()),
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM,
                _with(num_hidden_layers=4, no_rope_layer_interval=2)),
    "llama-yarn": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   _with(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                       "original_max_position_embeddings": 64})),
    "llama-linear": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                     _with(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
             dict(n_embd=64, n_layer=2, n_head=4, n_positions=MAX_POS, bos_token_id=IM_START_ID,
                  eos_token_id=IM_END_ID, initializer_range=0.1)),
}

WINDOWED = ("qwen3-window", "mistral-window", "gemma2", "gemma3")


def tiny_family_model(case: str, vocab_size: int, seed: int = 0,
                      cases: dict[str, Any] | None = None) -> transformers.PreTrainedModel:
    """A random tiny model of `case` (of `cases`, default CASES), float32, eval mode, eager
    attention."""
    config_cls, model_cls, kwargs = (CASES if cases is None else cases)[case]
    config = config_cls(vocab_size=vocab_size, **kwargs)
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).eval()
        with torch.no_grad():  # non-trivial norm weights (they start at 1, or 0 for Gemma)
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)
    return model


def save_family_dir(case: str, path: Path, seed: int = 0) -> Path:
    """`tiny_family_model(case)` saved as a HF folder with the tiny tokenizer and a template."""
    tok = make_tiny_tokenizer()
    model = tiny_family_model(case, tok.get_vocab_size(), seed)
    model.generation_config.eos_token_id = [IM_END_ID]
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>", "add_bos_token": False,
        "chat_template": SMOLLM2_TEMPLATE}))
    return path
