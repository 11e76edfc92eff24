"""The native families, one file each: how a family's config.json (and its tensor names) map
onto nbserve's decoder (models/decoder.py), and its registry entry. Importing this package
registers them all (`models.registry` does it on first use)."""

from . import gemma, gpt2, llama, mixtral, nanochat, olmo2, phi3, qwen3, qwen3_moe, smollm3

__all__ = ["gemma", "gpt2", "llama", "mixtral", "nanochat", "olmo2", "phi3", "qwen3", "qwen3_moe",
           "smollm3"]
