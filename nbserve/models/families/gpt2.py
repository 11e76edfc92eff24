"""GPT-2 (GPT2LMHeadModel) and nanoGPT: learned positions, LayerNorm, GELU, biases, no RoPE.

Hugging Face's GPT-2 keeps its matmul weights as Conv1D, (in, out): they are taken transposed
(a view when adopting a live model, a contiguous copy when loading a file, which the C kernels
want). A nanoGPT module (Karpathy's model.py: `transformer.wte/wpe/h/ln_f`, `lm_head`, nn.Linear
weights, exact GELU, `config.bias`) has the same shape and is adopted with its own tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..config import DecoderConfig
from ..decoder import DecoderBuildOptions, DecoderModel, build_decoder
from ..family import Family, GGUFKeys, GGUFLayout

if TYPE_CHECKING:
    from typing_extensions import Unpack

_LAYER = re.compile(r"^transformer\.h\.(\d+)\.(.+)$")
_LAYER_NAMES = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm",
                "attn.c_attn": "self_attn.qkv_proj", "attn.c_proj": "self_attn.o_proj",
                "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
_GLOBAL_NAMES = {"transformer.wte.weight": "model.embed_tokens.weight",
                 "transformer.wpe.weight": "model.embed_positions.weight",
                 "transformer.ln_f.weight": "model.norm.weight",
                 "transformer.ln_f.bias": "model.norm.bias", "lm_head.weight": "lm_head.weight"}
_SKIPPED = (".attn.bias", ".attn.masked_bias")  # old checkpoints' causal-mask buffers


def read_config(cfg: dict[str, Any], name: str) -> DecoderConfig:
    """A GPT2LMHeadModel config.json (n_embd, n_layer, ...)."""
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if cfg.get(flag):
            raise ValueError(f"{name}: GPT-2 option {flag}=True is not implemented by nbserve")
    if cfg.get("scale_attn_weights") is False:
        raise ValueError(f"{name}: GPT-2 without scaled attention is not implemented by nbserve")
    act = cfg.get("activation_function", "gelu_new")
    acts = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
            "relu": "relu2"}
    if act not in acts or act == "relu":
        raise ValueError(f"{name}: unsupported GPT-2 activation {act!r}")
    hidden, heads = cfg["n_embd"], cfg["n_head"]
    return _config(name, cfg["vocab_size"], hidden, cfg.get("n_inner") or 4 * hidden,
                   cfg["n_layer"], heads, cfg.get("n_positions", 1024),
                   cfg.get("layer_norm_epsilon", 1e-5), acts[act], bias=True,
                   arch="GPT2LMHeadModel", bos=cfg.get("bos_token_id"),
                   eos=cfg.get("eos_token_id"))


def _config(name: str, vocab: int, hidden: int, inner: int, layers: int, heads: int,
            positions: int, eps: float, act: str, *, bias: bool, arch: str,
            bos: int | None = None, eos: Any = None) -> DecoderConfig:
    return DecoderConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inner, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
        max_position_embeddings=positions, rms_norm_eps=eps, tie_word_embeddings=True,
        attention_bias=bias, o_bias=bias, mlp_bias=bias, norm="layer", norm_bias=bias,
        architecture=arch, bos_token_id=bos,
        eos_token_id=[eos] if isinstance(eos, int) else list(eos or []), name=name,
        layer_rope=[None] * layers, hidden_act=act, gated_mlp=False, learned_positions=True)


def decoder_tensors(tensors: Iterable[tuple[str, torch.Tensor]], conv1d: bool,
                    contiguous: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """GPT-2 / nanoGPT names -> the decoder's; Conv1D weights (in, out) transposed (a view,
    or with `contiguous` a copy)."""
    for name, tensor in tensors:
        if name.endswith(_SKIPPED):
            continue
        if name in _GLOBAL_NAMES:
            yield _GLOBAL_NAMES[name], tensor
            continue
        m = _LAYER.match(name)
        module, _, kind = (m.group(2).rpartition(".") if m else ("", "", ""))
        if m is None or module not in _LAYER_NAMES:
            raise ValueError(f"unexpected tensor {name!r} for a GPT-2 model")
        if conv1d and kind == "weight" and module.startswith(("attn", "mlp")):
            tensor = tensor.t().contiguous() if contiguous else tensor.t()
        yield f"model.layers.{m.group(1)}.{_LAYER_NAMES[module]}.{kind}", tensor


def build(cfg: DecoderConfig, tensors: Iterable[tuple[str, torch.Tensor]],
          **options: Unpack[DecoderBuildOptions]) -> DecoderModel:
    """`build_decoder` over GPT-2-named tensors (Conv1D layout)."""
    contiguous = options.get("fuse", True)  # a loader's own copy: make it kernel-ready
    return build_decoder(cfg, decoder_tensors(tensors, conv1d=True, contiguous=contiguous),
                         **options)


def adopt_nanogpt(module: nn.Module) -> DecoderModel | None:
    """The decoder over a nanoGPT `GPT` module's own tensors (no copy), or None when `module`
    does not have nanoGPT's parameter names and config."""
    c = getattr(module, "config", None)
    names = {n for n, _ in module.named_parameters()}
    needed = {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
              "transformer.h.0.attn.c_attn.weight"}
    if c is None or not needed <= names or not all(
            hasattr(c, a) for a in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")):
        return None
    fc = module.get_submodule("transformer.h.0.mlp.c_fc")
    if not isinstance(fc, nn.Linear):
        return None
    act = _nanogpt_activation(module)
    bias = bool(getattr(c, "bias", True))
    cfg = _config(type(module).__name__, c.vocab_size, c.n_embd, fc.out_features, c.n_layer,
                  c.n_head, c.block_size, 1e-5, act, bias=bias, arch="nanoGPT")
    params = list(module.named_parameters())
    placements = {(p.device, p.dtype) for _, p in params}
    if len(placements) != 1:
        raise ValueError(f"its parameters are spread over {len(placements)} device/dtype pairs; "
                         "nbserve needs one")
    device, dtype = placements.pop()
    return build_decoder(cfg, decoder_tensors(params, conv1d=False, contiguous=False),
                         device=device, dtype=dtype, transposed_head=False, fuse=False,
                         pack=False)


def _nanogpt_activation(module: nn.Module) -> str:
    gelu = getattr(module.get_submodule("transformer.h.0.mlp"), "gelu", None)
    if isinstance(gelu, nn.GELU):
        return "gelu_tanh" if gelu.approximate == "tanh" else "gelu"
    raise ValueError("this nanoGPT-shaped module's MLP has no nn.GELU `gelu`; nbserve "
                     "implements nanoGPT's MLP (c_fc, GELU, c_proj)")


def read_gguf_keys(keys: GGUFKeys, cfg: dict[str, Any]) -> None:
    """GPT-2's own config.json names (n_embd, n_head, ...)."""
    hidden = int(keys.need("embedding_length"))
    heads = int(keys.need("attention.head_count"))
    if (keys.get_int("attention.head_count_kv") or heads) != heads:
        keys.refuse("attention.head_count_kv", "GPT-2 has as many K/V heads as query heads")
    ff = int(keys.need("feed_forward_length"))
    embd = keys.tensor_shape("token_embd.weight")
    positions = keys.tensor_shape("position_embd.weight")
    assert embd is not None  # the loader refuses a file without token_embd.weight
    layers = int(keys.need("block_count"))
    keys.need("attention.layer_norm_epsilon")  # refused when absent
    cfg.update({
        "vocab_size": embd[1],
        "n_embd": hidden, "n_layer": layers, "n_head": heads,
        "n_positions": positions[1] if positions is not None
        else keys.get_int("context_length", 1024),
        "n_inner": None if ff == 4 * hidden else ff,
        "layer_norm_epsilon": keys.get_float("attention.layer_norm_epsilon"),
        "activation_function": "gelu_new",
        "tie_word_embeddings": keys.tensor_shape("output.weight") is None,
    })


_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")

FAMILY = Family(
    name="gpt2",
    hf_architectures=("GPT2LMHeadModel",),
    model_types=("gpt2",),
    gguf=(GGUFLayout("gpt2", "gpt2", "GPT2LMHeadModel", ("ln_1", "attn.c_attn", "attn.c_proj",
                                                         "ln_2", "mlp.c_fc", "mlp.c_proj"),
                     top=("transformer.wte", "transformer.wpe", "transformer.ln_f", "lm_head"),
                     block_prefix="transformer.h.{bid}.", conv1d=_CONV1D, decoder_keys=False,
                     read_keys=read_gguf_keys),),
    read_config=read_config,
    build=build,
    description="GPT-2, nanoGPT",
    adopt_module=adopt_nanogpt,
)
