"""Serve a model that lives in the notebook: `adopt(model, tokenizer)` -> LoadedModel.

Which weights are shared and which are copied:
- `adopt_transformers` on a `transformers` model of a native family (`models.registry`:
  Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, Gemma 2/3, Phi-3/4, GPT-2, OLMo 2, SmolLM3),
  and `adopt` on a nanoGPT or nanochat module: nbserve's own decoder takes over the module's
  parameter tensors
  (same storage, same device, no copy).
- `TransformersAdapter` (other `transformers` causal LMs) and `RecomputeAdapter` (a plain
  module whose `forward(idx)` returns logits) call the live module.
- An object that implements `StepModel` is served as it is.
In all three cases training the module in later cells changes what is served. The KV cache of
the running engine still holds keys/values computed with the old weights (reused for repeated
prompt prefixes), so call `srv.update(model)` after training: it builds a new engine with an
empty cache. To freeze the served weights while training goes on, serve `snapshot(model)`.
Loading from a path (HF directory, .gguf) always copies: the file is read into new tensors.
"""

from __future__ import annotations

import copy
import inspect
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from ..execution.weights import count_parameters
from ..text import ChatTemplate, Tokenizer
from ..text.chat_template import load_chat_template
from ..text.tokenizer import load_tokenizer
from . import registry
from .adapters import RecomputeAdapter, TransformersAdapter
from .base import LoadedModel, PagedModel, SlotModel, StepModel
from .config import DecoderConfig
from .nanochat import NanochatModel

M = TypeVar("M")


@runtime_checkable
class CompiledModule(Protocol):
    """What `torch.compile` returns for a module: a wrapper whose `_orig_mod` is the module."""

    _orig_mod: nn.Module


@runtime_checkable
class MakesCache(Protocol):
    """A user's StepModel, known by its `make_cache` (`_checked_step_model` checks the rest)."""

    def make_cache(self, max_batch: int, max_context: int) -> object: ...


@runtime_checkable
class PeftModel(Protocol):
    """A PEFT model, whose adapters `merge_and_unload` folds into a plain model."""

    def merge_and_unload(self) -> nn.Module: ...

ACCEPTED = (
    "Accepted models: a source ('smollm2', a HF checkpoint directory, a .gguf file, a hub id), "
    "a nbserve LoadedModel, a transformers PreTrainedModel (e.g. from "
    "AutoModelForCausalLM.from_pretrained, LoRA merged or not), an object implementing "
    "nbserve.StepModel, or a torch.nn.Module whose forward(idx) returns logits "
    "(batch, time, vocab). Accepted tokenizers (tokenizer=...): a transformers tokenizer, a "
    "tokenizers.Tokenizer, a path to tokenizer.json, or an object with encode(text) -> "
    "list[int] and decode(ids) -> str."
)


def adopt(model: object, tokenizer: object = None, *,
          chat_template: str | ChatTemplate | None = None,
          max_context: int | None = None, name: str | None = None,
          stop_token_ids: Iterable[int] | None = None, verbose: bool = True) -> LoadedModel:
    """Make an in-memory model servable: a StepModel (as is), a `transformers` model
    (`adopt_transformers`), or a plain `nn.Module` (`RecomputeAdapter`).

    `tokenizer` is required (see `ACCEPTED`). The chat template is `chat_template` (a Jinja
    string or a ChatTemplate), else the tokenizer's, else a plain ChatML default (a note says so).
    """
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, CompiledModule):  # torch.compile's wrapper -> the module itself
        model = model._orig_mod
    if _is_transformers_model(model):
        return adopt_transformers(model, tokenizer, chat_template=chat_template,
                                  max_context=max_context, name=name,
                                  stop_token_ids=stop_token_ids, verbose=verbose)
    step: StepModel | SlotModel
    if isinstance(model, MakesCache):
        step, how = _checked_step_model(model), "your StepModel, as is"
        if max_context is not None and max_context > int(step.max_context):
            raise ValueError(f"max_context={max_context} is more than this StepModel's "
                             f"max_context ({step.max_context}); set its attribute to allow more")
    elif isinstance(model, nn.Module) and (native := _take_over_module(model)) is not None:
        _require_tokenizer(model, tokenizer)
        if isinstance(native, NanochatModel):  # its own tokenizer format, template and stops
            tokenizer, own_template, own_stops = native.serving_defaults(tokenizer)
            chat_template = chat_template or own_template
            stop_token_ids = own_stops if stop_token_ids is None else stop_token_ids
        if max_context is not None:
            native.max_context = min(int(max_context), native.max_context)
        step, how = native, "nbserve's decoder (weights shared, no copy)"
    elif isinstance(model, nn.Module):
        if isinstance(model, PeftModel) and verbose:
            print("nbserve: this is a PEFT model: serve model.merge_and_unload() instead to get "
                  "nbserve's full-speed path", flush=True)
        _require_tokenizer(model, tokenizer)
        step, how = RecomputeAdapter(model, max_context=max_context), "RecomputeAdapter (live)"
    else:
        raise TypeError(f"cannot serve a {type(model).__name__}. {ACCEPTED}")
    return _bundle(model, step, tokenizer, chat_template, name, stop_token_ids, how, verbose)


def adopt_transformers(model: Any, tokenizer: object, *,
                       chat_template: str | ChatTemplate | None = None,
                       max_context: int | None = None, name: str | None = None,
                       stop_token_ids: Iterable[int] | None = None,
                       verbose: bool = True) -> LoadedModel:
    """Serve a `transformers` causal LM. A native family's weights are taken over by
    nbserve's decoder without a copy (same tensors, device and dtype); any other model,
    or one those cannot represent, runs through `TransformersAdapter` (slower, warned)."""
    _require_tokenizer(model, tokenizer)
    can_generate = getattr(model, "can_generate", lambda: True)
    if getattr(model.config, "is_encoder_decoder", False) or not can_generate():
        raise TypeError(f"{type(model).__name__} is not a causal language model: nbserve serves "
                        "decoder-only models with a language-model head (e.g. "
                        "AutoModelForCausalLM.from_pretrained(...), not AutoModel)")
    step: SlotModel | None = take_over(model, max_context=max_context)
    family = registry.for_class_name(type(model).__name__)
    if step is not None and family is not None:
        how = f"nbserve's decoder ({family.name} family, weights shared, no copy)"
    else:
        step = TransformersAdapter(model, max_context=max_context)
        how = "TransformersAdapter (live)"
    return _bundle(model, step, tokenizer, chat_template, name, stop_token_ids, how, verbose)


def take_over(model: Any, max_context: int | None = None) -> PagedModel | None:
    """nbserve's own model (from the registry) over `model`'s own parameter tensors, or None
    (with the reason printed) when the architecture or its options are not ones nbserve
    implements."""
    arch = type(model).__name__
    family = registry.for_class_name(arch)
    if family is None:
        return None
    cfg_dict = model.config.to_dict()
    cfg_dict["architectures"] = [arch]
    params = list(model.named_parameters())
    try:
        placements = {(p.device, p.dtype) for _, p in params}
        if len(placements) != 1:
            raise ValueError(f"its parameters are spread over {len(placements)} "
                             "device/dtype pairs; nbserve needs one")
        cfg = family.config_of(cfg_dict, arch)
        if max_context is not None and isinstance(cfg, DecoderConfig):
            cfg.max_position_embeddings = int(max_context)
        device, dtype = placements.pop()
        step: PagedModel = family.build(cfg, params, device=device, dtype=dtype,
                                        transposed_head=False, fuse=False, pack=False)
    except ValueError as exc:
        print(f"nbserve: {arch} cannot use nbserve's own model ({exc}); serving it through "
              "TransformersAdapter", flush=True)
        return None
    if isinstance(step, nn.Module):
        _assert_shared(step, [p for _, p in params])
    return step


def _take_over_module(module: nn.Module) -> PagedModel | None:
    """nbserve's decoder over a plain module of a native family (nanoGPT, nanochat), or None;
    a module of such a family that cannot be taken over says why and goes to the adapter."""
    try:
        step: PagedModel | None = registry.for_module(module)
    except ValueError as exc:
        print(f"nbserve: {type(module).__name__} cannot use nbserve's own model ({exc}); "
              "serving it through RecomputeAdapter", flush=True)
        return None
    if isinstance(step, nn.Module):
        _assert_shared(step, list(module.parameters()))
    return step


def _assert_shared(step: nn.Module, theirs: list[torch.Tensor]) -> None:
    """Every parameter of `step` lives in the memory of one of `theirs` (views allowed)."""
    storages = {p.untyped_storage().data_ptr() for p in theirs}
    ours = {p.untyped_storage().data_ptr() for p in step.parameters()}
    assert ours <= storages, "adoption must not copy weights"


def snapshot(module: M) -> M:
    """A frozen copy of `module` to serve while training goes on: a deepcopy in eval mode
    with gradients off. `srv.update(snapshot(model))` serves the weights of this moment."""
    with torch.no_grad():
        frozen = copy.deepcopy(module)
    if isinstance(frozen, nn.Module):
        frozen.eval()
        frozen.requires_grad_(False)
    return frozen


def check_placement(step: StepModel | SlotModel, device: str | torch.device | None = None,
                    dtype: torch.dtype | None = None) -> None:
    """Raise when `device`/`dtype` were asked for but the in-memory model is elsewhere: it is
    served where it is, never moved or copied."""
    have = torch.device(step.device)
    want = torch.device(device) if device is not None else have
    same_device = want.type == have.type and (want.index or 0) == (have.index or 0)
    if not same_device or dtype not in (None, step.dtype):
        raise ValueError(
            f"the model is on {have} in {str(step.dtype).replace('torch.', '')}; a model in "
            "memory is served where it is (its weights are not copied). Move it first, e.g. "
            "model.to('cuda', torch.bfloat16), and leave device/dtype unset.")


# ----------------------------------------------------------------------------- helpers


def _is_transformers_model(obj: object) -> bool:
    tf = sys.modules.get("transformers")  # not imported -> it cannot be one
    return tf is not None and isinstance(obj, tf.PreTrainedModel)


def _checked_step_model(model: object) -> StepModel:
    """`model` if it has what the StepModel protocol asks for, else a TypeError saying what."""
    what = type(model).__name__
    missing = [a for a in ("max_context", "vocab_size", "device", "dtype")
               if getattr(model, a, None) is None]
    if missing:
        raise TypeError(f"{what} has make_cache() but lacks {', '.join(missing)}: a "
                        "nbserve.StepModel needs max_context, vocab_size, device and dtype "
                        "attributes (see docs/custom_model.md)")
    if not isinstance(model, StepModel):  # what is left of it: forward
        raise TypeError(f"{what} has make_cache() but no forward(ids, positions, slots, cache, "
                        "logit_index=None): see docs/custom_model.md")
    sig = inspect.signature(model.forward)
    try:
        sig.bind(0, 0, 0, 0, logit_index=None)
    except TypeError:
        raise TypeError(f"{what}.forward{sig} does not match the StepModel protocol: "
                        "forward(ids, positions, slots, cache, logit_index=None)") from None
    return model


def _bundle(model: object, step: StepModel | SlotModel, tokenizer: object,
            chat_template: str | ChatTemplate | None, name: str | None,
            stop_token_ids: Iterable[int] | None, how: str, verbose: bool) -> LoadedModel:
    """Tokenizer, template and stop ids around a StepModel, and a summary line."""
    _require_tokenizer(model, tokenizer)
    tok = Tokenizer.from_any(tokenizer)
    name = name or _default_name(model)
    template = _template(chat_template, tokenizer, name, verbose)
    stops = _stop_ids(stop_token_ids, tok, model, template, int(step.vocab_size))
    if verbose:
        n = count_parameters(step)[0] if isinstance(step, nn.Module) else 0
        size = f"{n / 1e6:.1f}M parameters, " if n else ""
        print(f"nbserve: serving {name} ({type(model).__name__}, {size}"
              f"{str(step.dtype).replace('torch.', '')}, {step.device}) through {how}",
              flush=True)
    return LoadedModel(model=step, tokenizer=tok, template=template, name=name,
                       stop_token_ids=stops, source=f"<{type(model).__name__} in memory>")


def _require_tokenizer(model: object, tokenizer: object) -> None:
    if tokenizer is None:
        raise TypeError(f"serving a {type(model).__name__} needs its tokenizer: pass "
                        "tokenizer=... (e.g. nbserve.launch(model, tokenizer=tok)). " + ACCEPTED)


def _default_name(model: object) -> str:
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return Path(str(path)).name or type(model).__name__


def _template(chat_template: str | os.PathLike[str] | ChatTemplate | None, tokenizer: object,
              name: str, verbose: bool) -> ChatTemplate:
    if isinstance(chat_template, ChatTemplate):
        return chat_template
    specials: dict[str, Any] = {
        k: v for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items()
        if isinstance(v, str)}
    if isinstance(chat_template, (str, os.PathLike)):
        source = str(chat_template)
        if "{" not in source and Path(source).is_file():  # a .jinja file
            source = Path(source).read_text()
        return ChatTemplate(source, **specials)
    if chat_template is not None:
        raise TypeError(f"chat_template must be a Jinja string, a .jinja path or a "
                        f"ChatTemplate, got {type(chat_template).__name__}")
    if isinstance(tokenizer, (str, os.PathLike)) and Path(tokenizer).is_dir():
        found = load_chat_template(Path(tokenizer), load_tokenizer(Path(tokenizer))[1])
    else:
        found = ChatTemplate.from_transformers(tokenizer)
    if found is not None:
        return found
    if verbose:
        print(f"nbserve: {name}: no chat template given and the tokenizer has none, so chat "
              "uses a plain ChatML default (<|im_start|>role ... <|im_end|>). Pass "
              "chat_template='...' (Jinja) to use your own.", flush=True)
    return ChatTemplate.default()


def _ids(value: object) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple, set)):
        return [v for v in value if isinstance(v, int)]
    return []


def _stop_ids(explicit: Iterable[int] | None, tok: Tokenizer, model: object,
              template: ChatTemplate, vocab_size: int) -> list[int]:
    """`explicit`, else the tokenizer's EOS ids, the model's own (StepModel `stop_token_ids`,
    generation/model config `eos_token_id`) and `<|im_end|>` under the default template."""
    if explicit is not None:
        ids = [int(i) for i in explicit]
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {bad[0]}")
        return ids
    ids = list(tok.eos_token_ids) + _ids(getattr(model, "stop_token_ids", None))
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        ids += _ids(getattr(cfg, "eos_token_id", None))
    if template.is_default:
        ids += _ids(tok.token_to_id("<|im_end|>"))
    return [i for i in dict.fromkeys(ids) if 0 <= i < vocab_size]
