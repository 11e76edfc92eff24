"""The native families, one file each: how a family's config.json (and its tensor names) map
onto nbserve's decoder (models/decoder.py), and its `Family` entry. `BUILTIN` lists them in
the order the registry tries them (`models.registry` registers them on first use)."""

from . import gemma, gpt2, llama, mixtral, nanochat, olmo2, phi3, qwen3, qwen3_moe, smollm3

BUILTIN = [module.FAMILY for module in (llama, qwen3, qwen3_moe, mixtral, gemma, phi3, gpt2,
                                        olmo2, smollm3, nanochat)]

__all__ = ["BUILTIN"]
