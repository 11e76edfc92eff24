"""A lone decode step through every layer in one C call (models/decode_stack.py): bit for bit the
per-layer path's logits, on every kernel path (AVX-512 where the CPU has it, AVX2, plain C),
for quantized blocks and float32 weights, float32 and float16 caches; the per-layer path
wherever the stack cannot serve (a window passed, unfit layers, kernels gone); and weights
replaced between steps are seen."""

from __future__ import annotations

import copy

import pytest
import torch
from family_models import WINDOW, save_family_dir
from gguf_util import hf_dir_to_gguf
from kernel_paths import NEEDS_COMPILER, PATHS
from tiny_models import make_tiny_hf_dir

import nbserve
from nbserve.cpu.kernels import build
from nbserve.cpu.kernels.abi import BlockType, KernelFlag, Weight, WeightKind
from nbserve.cpu.kernels.blocks import blocks_rounded8
from nbserve.execution.decode_stack import DecodeStack, unfit_reason
from nbserve.execution.formats import PartsForm
from nbserve.execution.quant import FLOAT_MAX_ROWS
from nbserve.models.dtypes import load_kwargs

pytestmark = NEEDS_COMPILER
IDS = [3, 17, 5, 9, 11, 2, 40, 7]


@pytest.fixture(scope="module")
def q4_gguf(tiny_llama_dir, tmp_path_factory):
    """The tiny llama as Q4_1 blocks, a Q4_0 down projection and a Q8_0 tied head."""
    types = {"token_embd.weight": "Q8_0", "blk.0.ffn_down.weight": "Q4_0"}
    return hf_dir_to_gguf(tiny_llama_dir, tmp_path_factory.mktemp("q4") / "m.gguf", "Q4_1",
                          tensor_types=types)


def _count_served(monkeypatch) -> list[int]:
    """A one-item list counting the calls of the stack that answered a hidden state (the
    steps it served), from now on."""
    served = [0]
    original = DecodeStack.__call__

    def counting(stack, *args, **kwargs):
        out = original(stack, *args, **kwargs)
        served[0] += out is not None
        return out
    monkeypatch.setattr(DecodeStack, "__call__", counting)
    return served


def _decode(model, steps: int, stacked: bool, kv_dtype=None, block_size: int = 4,
            *, monkeypatch, keep: bool = False) -> tuple[list[torch.Tensor], int]:
    """Logits of `steps` lone greedy decode steps from position 0 (crossing cache blocks), with
    the stack on or off (`keep`: the model's stack as it is); and how many steps it served."""
    cache = model.make_paged_cache(32, block_size, kv_dtype)
    table = torch.arange(32)
    if not stacked:
        model.__dict__["_decode_stack"] = None  # None: the layers one by one
    elif not keep:
        model.__dict__.pop("_decode_stack", None)  # decided again at the first step
    served = _count_served(monkeypatch)
    logits, token = [], torch.tensor([IDS[0]])
    for pos in range(steps):
        out = model._lone_step(token, pos, table, cache, False)
        logits.append(out.clone())
        token = torch.tensor([IDS[pos + 1]]) if pos + 1 < len(IDS) else out.argmax(-1).view(1)
    return logits, served[0]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("arch", PATHS)
@pytest.mark.parametrize("dtype", ["quantized", "float32"])
@pytest.mark.parametrize("kv", [torch.float32, torch.float16], ids=["kv32", "kv16"])
def test_the_stack_gives_the_per_layer_logits_bit_for_bit(arch, dtype, kv, q4_gguf,
                                                          tiny_llama_dir, monkeypatch):
    if arch is not None:  # every kernel of the step (matmuls, attention, the stack) this build
        monkeypatch.setattr(build, "_loaded", build.quant_kernels(arch))
    source = q4_gguf if dtype == "quantized" else tiny_llama_dir
    model = nbserve.load(str(source), verbose=False, **load_kwargs(dtype)).model
    assert unfit_reason(model) is None
    want, none = _decode(model, 12, stacked=False, kv_dtype=kv, monkeypatch=monkeypatch)
    got, served = _decode(model, 12, stacked=True, kv_dtype=kv, monkeypatch=monkeypatch)
    assert none == 0 and served == 12
    assert _equal(got, want)


def test_the_per_layer_path_serves_past_a_window(tmp_path, monkeypatch):
    model = nbserve.load(str(save_family_dir("mistral-window", tmp_path / "m")),
                         verbose=False).model
    steps = WINDOW + 4
    want, _ = _decode(model, steps, stacked=False, monkeypatch=monkeypatch)
    got, served = _decode(model, steps, stacked=True, monkeypatch=monkeypatch)
    assert served == WINDOW  # positions 0..WINDOW-1 read no more than the window
    assert _equal(got, want)


@pytest.mark.parametrize("case, why", [("qwen3", "q/k norms"), ("olmo2", "norm layout"),
                                       ("gemma3", "norm"), ("gpt2", "norm")])
def test_layers_the_stack_cannot_run_say_why(case, why, tmp_path):
    model = nbserve.load(str(save_family_dir(case, tmp_path / case)), verbose=False).model
    reason = unfit_reason(model)
    assert reason is not None and why in reason
    assert DecodeStack.for_model(model) is None


def test_without_kernels_the_layers_run_one_by_one(q4_gguf, monkeypatch):
    monkeypatch.setenv("NBSERVE_KERNELS", "0")
    model = nbserve.load(str(q4_gguf), verbose=False).model  # float32, torch only
    assert model.weight_format == "float32"
    _, served = _decode(model, 3, stacked=True, monkeypatch=monkeypatch)
    assert served == 0


def test_replaced_weights_are_read_after_the_change(tiny_llama_dir, monkeypatch):
    model = nbserve.load(str(tiny_llama_dir), dtype="float32", verbose=False).model
    before, served = _decode(model, 4, stacked=True, monkeypatch=monkeypatch)
    assert served == 4
    layer = model.model.decoder_layers[0]
    with torch.no_grad():  # a new tensor (a new pointer) for a norm and a matmul weight
        layer.input_layernorm.weight.data = layer.input_layernorm.weight.data * 1.5
        layer.mlp.down_proj.weight.data = layer.mlp.down_proj.weight.data.clone() * 0.5
    model.refresh_derived()
    want, _ = _decode(model, 4, stacked=False, monkeypatch=monkeypatch)
    got, served = _decode(model, 4, stacked=True, monkeypatch=monkeypatch)
    assert served == 4 and _equal(got, want) and not _equal(got, before)
    stack = model.__dict__["_decode_stack"]  # built: it must see the next changes itself
    changes = [lambda: layer.post_attention_layernorm.weight.mul_(0.25),  # same pointer
               lambda: setattr(layer.post_attention_layernorm, "weight",  # a new parameter
                               torch.nn.Parameter(layer.post_attention_layernorm.weight * 2))]
    for change in changes:  # no refresh: the kernels read these weights at every call
        with torch.no_grad():
            change()
        want, _ = _decode(model, 4, stacked=False, monkeypatch=monkeypatch)
        model.__dict__["_decode_stack"] = stack
        got, served = _decode(model, 4, stacked=True, monkeypatch=monkeypatch, keep=True)
        assert served == 4 and _equal(got, want)


def test_a_copy_of_a_stacked_model_serves(q4_gguf, monkeypatch):
    model = nbserve.load(str(q4_gguf), verbose=False).model
    want, _ = _decode(model, 4, stacked=True, monkeypatch=monkeypatch)
    model._lone_step(torch.tensor([3]), 0, torch.arange(32),
                     model.make_paged_cache(32, 4, None), False)  # a built stack in the model
    assert isinstance(model.__dict__["_decode_stack"], DecodeStack)
    twin = copy.deepcopy(model)  # a Pool's replica: its own weights, its own stack
    assert twin.__dict__["_decode_stack"] is not model.__dict__["_decode_stack"]
    got, served = _decode(twin, 4, stacked=True, monkeypatch=monkeypatch, keep=True)
    assert served == 4 and _equal(got, want)


def _batch_decode(model, rows: int, stacked: bool, monkeypatch) -> tuple[list, int]:
    """Logits of 6 greedy decode steps of `rows` sequences of different prompt lengths (each
    prefilled alone), batched; and how many steps the stack served."""
    model.__dict__.pop("_decode_stack", None)
    if not stacked:
        model.__dict__["_decode_stack"] = None
    served = _count_served(monkeypatch)
    cache = model.make_paged_cache(rows * 8, 4, None)
    tables = torch.arange(rows * 8).view(rows, 8)
    lengths = [3 + (r * 5) % 11 for r in range(rows)]
    for r, n in enumerate(lengths):  # prefills: the per-layer path
        ids = torch.tensor([[(7 * r + 3 * j) % 200 + 1 for j in range(n)]])
        model.forward(ids, torch.arange(n)[None], tables[r:r + 1], cache)
    positions = torch.tensor(lengths)[:, None]
    token = torch.tensor([[5 + r] for r in range(rows)])
    logits = []
    for _ in range(6):
        out = model.forward(token, positions, tables, cache, max_pos=int(positions.max()),
                            logit_index=torch.zeros(rows, dtype=torch.long))
        logits.append(out.clone())
        token, positions = out.argmax(-1, keepdim=True), positions + 1
    return logits, served[0]


@pytest.mark.parametrize("rows", [3, 12], ids=["row-kernels", "panels"])
@pytest.mark.parametrize("dtype", ["quantized", "float32"])
def test_a_decode_batch_in_one_call_gives_the_per_layer_logits(rows, dtype, q4_gguf,
                                                               tiny_llama_dir, monkeypatch):
    source = q4_gguf if dtype == "quantized" else tiny_llama_dir
    model = nbserve.load(str(source), verbose=False, **load_kwargs(dtype)).model
    want, none = _batch_decode(model, rows, False, monkeypatch)
    got, served = _batch_decode(model, rows, True, monkeypatch)
    # the float32 kernel takes up to FLOAT_MAX_ROWS rows; more go to oneDNN, layer by layer
    stacked = dtype == "quantized" or rows <= FLOAT_MAX_ROWS
    assert none == 0 and served == (6 if stacked else 0) and _equal(got, want)


def test_two_caches_over_one_model_keep_their_own_descriptions(q4_gguf, monkeypatch):
    """A Pool's CPU replicas may share one model, each engine stepping over its own cache:
    steps alternating between two caches give what each gives alone."""
    model = nbserve.load(str(q4_gguf), verbose=False).model
    alone, _ = _decode(model, 6, stacked=True, monkeypatch=monkeypatch)
    model.__dict__.pop("_decode_stack", None)
    caches = [model.make_paged_cache(32, 4, None) for _ in range(2)]
    tokens = [torch.tensor([IDS[0]])] * 2
    got: list[list[torch.Tensor]] = [[], []]
    for pos in range(6):
        for i, cache in enumerate(caches):
            out = model._lone_step(tokens[i], pos, torch.arange(32), cache, False)
            got[i].append(out.clone())
            tokens[i] = torch.tensor([IDS[pos + 1]])
    assert len(model.__dict__["_decode_stack"]._built) == 2
    assert _equal(got[0], alone) and _equal(got[1], alone)


@pytest.fixture(scope="module")
def q4_k_m_parts_gguf(tmp_path_factory):
    """A tiny Llama as llama.cpp's Q4_K_M lays many layers out: q and k Q4_K beside a Q6_K v
    (one fused q/k/v of two types: a PartsForm), layer 1's up Q6_K beside its Q4_K gate (a
    gate/up of two types too); rows of whole K-quant blocks (256 weights); heads of 128, as
    most models have (128 ** -0.5 * 128 ** 0.5 is not 1.0 in float64)."""
    folder = tmp_path_factory.mktemp("parts")
    hf = make_tiny_hf_dir(folder / "hf", "llama", hidden_size=256, intermediate_size=512,
                          num_attention_heads=2, num_key_value_heads=1)
    types = {f"blk.{i}.attn_v.weight": "Q6_K" for i in range(2)}
    types["blk.1.ffn_up.weight"] = "Q6_K"
    return hf_dir_to_gguf(hf, folder / "m.gguf", "Q4_K", tensor_types=types)


PARTS_ROUNDING = {"exact": {}, "round16": {"NBSERVE_ROUND16": "1", "NBSERVE_ROUND8": "0"},
                  "round8": {"NBSERVE_ROUND16": "1", "NBSERVE_ROUND8": "1"}}


@pytest.mark.parametrize("rounding", sorted(PARTS_ROUNDING))
@pytest.mark.parametrize("rows", [1, 3, 12], ids=["lone", "row-kernels", "panels"])
def test_fused_parts_of_different_types_run_in_the_stack(rows, rounding, q4_k_m_parts_gguf,
                                                         monkeypatch):
    """A fused projection whose parts differ in block type (a Q4_K_M file's Q4_K q/k and Q6_K
    v) is one NBQ_PARTS weight of the stack, each part with its own type and flags: the stack
    serves every step, bit for bit the per-layer path's logits, a lone step or a batch, with
    the inputs exact or rounded to 16 or 8 bits (where the build has those kernels)."""
    for name, value in PARTS_ROUNDING[rounding].items():
        monkeypatch.setenv(name, value)
    model = nbserve.load(str(q4_k_m_parts_gguf), weights="blocks", exact=rounding == "exact",
                         verbose=False).model
    layers = model.model.layers
    assert layers[0].self_attn.d == 128
    assert all(isinstance(layer.self_attn.qkv.form, PartsForm) for layer in layers)
    assert isinstance(layers[1].mlp.gate_up.form, PartsForm)
    assert unfit_reason(model) is None and DecodeStack.for_model(model) is not None
    if rows == 1:
        want, none = _decode(model, 8, stacked=False, monkeypatch=monkeypatch)
        got, served = _decode(model, 8, stacked=True, monkeypatch=monkeypatch)
        steps = 8
    else:
        want, none = _batch_decode(model, rows, False, monkeypatch)
        got, served = _batch_decode(model, rows, True, monkeypatch)
        steps = 6
    assert none == 0 and served == steps and _equal(got, want)
    (built,) = model.__dict__["_decode_stack"]._built.values()  # the description it ran
    for entry, layer in zip(built.array, layers, strict=True):
        qkv, forms = entry.qkv, layer.self_attn.qkv.form.parts
        assert qkv.kind == WeightKind.PARTS and qkv.parts == 3
        parts = (Weight * 3).from_address(qkv.part)
        assert [p.block_type for p in parts] == [BlockType.Q4_K, BlockType.Q4_K,
                                                 BlockType.Q6_K]
        assert [p.flags for p in parts] == [form.kernel.flags for form in forms]
        assert [p.n for p in parts] == [form.shape[0] for form in forms]
    assert built.array[0].gate_up.kind == WeightKind.BLOCKS
    assert built.array[1].gate_up.kind == WeightKind.PARTS
    flags = {p.kernel.flags for layer in layers for p in layer.self_attn.qkv.form.parts}
    lib = build.quant_kernels()
    if rounding == "exact":
        assert flags == {0}
    elif rounding == "round16" and lib.nbq_round16_max_rows():
        assert flags == {KernelFlag.ROUND16}
    elif rounding == "round8" and blocks_rounded8(BlockType.Q4_K, lib):
        assert flags == {KernelFlag.ROUND16 | KernelFlag.ROUND8}  # both reach each part
