"""LoRA adapters per request (issue 44, item 3): PEFT adapters on a tiny random Llama, served
per row. nbserve's greedy tokens and logits with an adapter equal transformers + PEFT's on the
same weights; a batch mixing adapters (and none) gives each row what it gets alone; adapters
that do not fit are refused with the mismatch named; the prefix cache is never shared across
adapters; and over HTTP `model="base:adapter"` routes through the OpenAI SDK."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import make_tiny_hf_dir

from nbserve.engine import Engine
from nbserve.loading.hf_dir import load_hf_dir
from nbserve.loading.lora_files import read_adapter
from nbserve.types import (
    Delta,
    ErrorEvent,
    Finished,
    ModelNotFoundError,
    Request,
    SamplingParams,
    Usage,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LOGIT_TOL = 1e-4  # float32 on both sides; summation orders differ (fused/packed matmuls)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13, 14, 15, 16, 300, 301, 302], [400, 8]]
TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def make_adapter(base: Path, out: Path, seed: int, targets: set[str], rank: int = 4,
                 alpha: float = 8.0, rslora: bool = False, **overrides: Any) -> Path:
    """A PEFT LoRA adapter on the model in `base`, with random A and B (B is zero at PEFT's
    init, which would make the adapter a no-op), saved with save_pretrained."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=sorted(targets),
                             lora_dropout=0.0, use_rslora=rslora, task_type="CAUSAL_LM")
    wrapped = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    wrapped.save_pretrained(out)
    if overrides:  # edit the saved config (refusal tests)
        cfg_file = out / "adapter_config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg.update(overrides)
        cfg_file.write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_hf_dir(root / "base", tie=False)
    other = make_tiny_hf_dir(root / "wide", tie=False, hidden_size=96, intermediate_size=160,
                             num_attention_heads=4, num_key_value_heads=2)
    return {
        "base": base,
        "a": make_adapter(base, root / "a", 1, TARGETS),
        "b": make_adapter(base, root / "b", 2, {"q_proj", "v_proj"}, rank=8, alpha=4.0,
                          rslora=True),
        "wide": make_adapter(other, root / "wide_adapter", 3, {"q_proj", "v_proj"}),
    }


def peft_reference(dirs: dict[str, Path], adapter: str | None, prompt: list[int], steps: int
                   ) -> tuple[list[int], torch.Tensor]:
    """transformers (+ PEFT) greedy tokens for `prompt` and the logits of every step."""
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        dirs["base"], torch_dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, dirs[adapter])
    model.eval()
    ids, rows = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            rows.append(logits)
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], torch.stack(rows)


def run(engine: Engine, prompt: list[int], adapter: str | None, steps: int,
        usage: list[Usage] | None = None) -> list[int]:
    """The greedy tokens of `prompt` (the request's usage appended to `usage`)."""
    out: list[int] = []
    for ev in engine.stream(Request(prompt_ids=prompt, adapter=adapter, params=SamplingParams(
            temperature=0, max_tokens=steps, ignore_eos=True))):
        assert not isinstance(ev, ErrorEvent), ev.message
        if isinstance(ev, Delta):
            out += ev.token_ids
        if isinstance(ev, Finished) and usage is not None:
            usage.append(ev.usage)
    return out


@pytest.fixture(scope="module")
def engine(dirs: dict[str, Path]) -> Any:
    eng = Engine(load_hf_dir(dirs["base"]), quiet=True, max_batch=8, max_context=128)
    eng.add_adapter("a", str(dirs["a"]))
    eng.add_adapter("b", str(dirs["b"]))
    yield eng
    eng.close()


def test_logits_equal_peft(dirs: dict[str, Path]) -> None:
    """The model's logits over a prompt, with each adapter, equal PEFT's to LOGIT_TOL (and
    differ from the base's: the adapter does something)."""
    loaded = load_hf_dir(dirs["base"])
    model: Any = loaded.model
    model.add_lora(0, read_adapter(dirs["a"]))
    model.add_lora(1, read_adapter(dirs["b"]))
    prompt = PROMPTS[0]
    for index, name in ((0, "a"), (1, "b"), (-1, None)):
        cache = model.make_cache(1, 64)
        ids = torch.tensor([prompt])
        positions = torch.arange(len(prompt))[None]
        with model.lora_rows([index]):
            ours = model.forward(ids, positions, torch.tensor([0]), cache)[0, -1]
        _, ref = peft_reference(dirs, name, prompt, 1)
        assert torch.allclose(ours, ref[0], atol=LOGIT_TOL, rtol=0), \
            (name, (ours - ref[0]).abs().max())
    _, base_ref = peft_reference(dirs, None, prompt, 1)
    _, a_ref = peft_reference(dirs, "a", prompt, 1)
    assert (base_ref - a_ref).abs().max() > 0.1


def forward_rows(model: Any, prompts: list[list[int]], adapters: list[int]) -> torch.Tensor:
    """The last prompt position's logits and the next (decode) step's, of `prompts` (one
    length) in one batch whose row b applies adapter adapters[b]: (B, 2, V)."""
    b, t = len(prompts), len(prompts[0])
    cache = model.make_paged_cache(4 * b, 32)
    tables = torch.arange(b)[:, None]
    with model.lora_rows(adapters):
        first = model.forward(torch.tensor(prompts), torch.arange(t).repeat(b, 1), tables,
                              cache, max_pos=t - 1)[:, -1]
        second = model.forward(first.argmax(-1)[:, None], torch.full((b, 1), t), tables,
                               cache, max_pos=t)[:, -1]
    return torch.stack([first, second], dim=1)


def test_one_batch_of_mixed_rows_equals_each_row_alone(dirs: dict[str, Path]) -> None:
    """A prefill and a decode step of rows with adapter a, adapter b and none, in one forward
    each: every row's logits equal that row's alone (and the adapters change them)."""
    model: Any = load_hf_dir(dirs["base"]).model
    model.add_lora(0, read_adapter(dirs["a"]))
    model.add_lora(1, read_adapter(dirs["b"]))
    prompt = PROMPTS[0]
    rows = [0, 1, -1, 0]
    together = forward_rows(model, [prompt, prompt, prompt, prompt[::-1]], rows)
    for i, index in enumerate(rows):
        alone = forward_rows(model, [prompt if i < 3 else prompt[::-1]], [index])[0]
        assert torch.allclose(together[i], alone, atol=1e-5, rtol=0), i
    assert (together[0] - together[2]).abs().max() > 0.1
    assert (together[1] - together[2]).abs().max() > 0.1


QUANT_TOL = 0.2  # Q8_0 blocks against float weights: the base alone is off by about 0.07


def test_quantized_base_keeps_its_blocks_and_applies_the_adapter(dirs: dict[str, Path],
                                                                  tmp_path: Path) -> None:
    """The base as a Q8_0 GGUF, served from its blocks: logits with an adapter stay within
    quantization error of PEFT's on the float weights (the adapter moves them much more),
    and a decode batch mixing adapters gives each row what it gets alone."""
    from gguf_util import hf_dir_to_gguf

    from nbserve import load

    gguf_file = str(hf_dir_to_gguf(dirs["base"], tmp_path / "base.gguf", "Q8_0"))
    model: Any = load(gguf_file).model
    assert model.weight_format == "quantized"
    model.add_lora(0, read_adapter(dirs["a"]))
    prompt = PROMPTS[0]
    (_, ref_a), (_, ref_base) = (peft_reference(dirs, n, prompt, 1) for n in ("a", None))
    for index, ref in ((0, ref_a), (-1, ref_base)):
        cache = model.make_paged_cache(8, 32)
        with model.lora_rows([index]):
            ours = model.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None],
                                 torch.tensor([[0]]), cache)[0, -1]
        assert (ours - ref[0]).abs().max() < QUANT_TOL, index
    assert (ref_a - ref_base).abs().max() > 10 * QUANT_TOL
    engine = Engine(load(gguf_file), quiet=True, max_batch=8, max_context=128)
    try:
        engine.add_adapter("a", str(dirs["a"]))
        engine.add_adapter("b", str(dirs["b"]))
        cases = [(p, name) for p in PROMPTS for name in ("a", "b", None)]
        alone = [run(engine, p, name, 8) for p, name in cases]
        results: list[list[int] | None] = [None] * len(cases)
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, run(engine, *cases[i], 8))) for i in range(len(cases))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == alone
    finally:
        engine.close()


def test_greedy_tokens_equal_peft(dirs: dict[str, Path], engine: Engine) -> None:
    for name in ("a", "b", None):
        want, _ = peft_reference(dirs, name, PROMPTS[1], 10)
        assert run(engine, PROMPTS[1], name, 10) == want, name


def test_mixed_batch_equals_each_alone(engine: Engine) -> None:
    """Rows with adapter a, adapter b and none decode in the same steps; each row's tokens
    equal what the request gets alone."""
    cases = [(p, name) for p in PROMPTS for name in ("a", "b", None)]
    alone = [run(engine, p, name, 12) for p, name in cases]
    results: list[list[int] | None] = [None] * len(cases)

    def one(i: int) -> None:
        results[i] = run(engine, cases[i][0], cases[i][1], 12)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == alone
    assert len({tuple(r) for r in alone}) > len(PROMPTS)  # the adapters change the answers


def test_prefix_cache_is_never_shared_across_adapters(dirs: dict[str, Path],
                                                      engine: Engine) -> None:
    """A long prompt served first without an adapter: the same prompt with adapter a takes
    nothing from the cache (the base's keys and values are not a's) and still answers as PEFT
    does; a second time with a, it takes a's own cached blocks."""
    prompt = [(7 * i + 3) % 500 + 10 for i in range(80)]  # over two 32-token blocks
    usage: list[Usage] = []
    run(engine, prompt, None, 2, usage)
    want, _ = peft_reference(dirs, "a", prompt, 6)
    assert run(engine, prompt, "a", 6, usage) == want
    assert usage[-1].cached_tokens == 0
    assert run(engine, prompt, "a", 6, usage) == want
    assert usage[-1].cached_tokens >= 64
    assert run(engine, prompt, "b", 2, usage) and usage[-1].cached_tokens == 0


def test_an_unknown_adapter_is_a_404_naming_those_there_are(engine: Engine) -> None:
    with pytest.raises(ModelNotFoundError, match="base:nope.*'base:a', 'base:b'"):
        run(engine, PROMPTS[0], "nope", 2)


def rename_module(adapter: Path, out: Path, old: str, new: str) -> Path:
    """A copy of `adapter` whose tensors of module `old` are named `new`."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    save_file({k.replace(old, new): v for k, v in tensors.items()},
              str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    return out


def test_adapters_that_do_not_fit_are_refused_naming_the_mismatch(
        dirs: dict[str, Path], engine: Engine, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"q_proj has lora_A \(4, 96\).*maps 64 to 64 features"):
        engine.add_adapter("wide", str(dirs["wide"]))
    odd = rename_module(dirs["a"], tmp_path / "odd", "self_attn.q_proj", "self_attn.c_attn")
    with pytest.raises(ValueError, match=r"targets 'model.layers.0.self_attn.c_attn', which "
                       r"this LlamaForCausalLM model has not \(its LoRA targets are down_proj,"):
        engine.add_adapter("odd", str(odd))
    for field, value, why in (("fan_in_fan_out", True, "fan_in_fan_out is true"),
                              ("bias", "all", "bias is 'all'"),
                              ("modules_to_save", ["lm_head"], "modules_to_save"),
                              ("use_dora", True, "DoRA")):
        bad = make_adapter(dirs["base"], tmp_path / field, 5, {"q_proj"}, **{field: value})
        with pytest.raises(ValueError, match=why):
            engine.add_adapter(field, str(bad))
    with pytest.raises(ValueError, match="not a PEFT adapter directory"):
        engine.add_adapter("empty", str(tmp_path))
    assert engine.adapter_names() == ["a", "b"]  # nothing of the refused ones stayed


@pytest.mark.usefixtures("no_server_left")
def test_served_by_name_through_the_openai_sdk(dirs: dict[str, Path]) -> None:
    """launch(adapters=...) and srv.add_adapter: /v1/models lists base:a and base:b; each
    answers (greedy, through the OpenAI SDK) as transformers + PEFT; an unknown adapter is a
    404 naming the models there are; an adapter that does not fit is refused at add."""
    import openai

    from nbserve import launch

    srv = launch({"base": str(dirs["base"]), "two": str(dirs["base"])}, ui=False, wait=True,
                 adapters={"a": str(dirs["a"]), "two:a": str(dirs["a"]),
                           "two:wide": str(dirs["wide"])},  # two loads on its first request
                 max_batch=4, max_context=128)
    try:
        srv.add_adapter(None, "b", str(dirs["b"]))
        with pytest.raises(ValueError, match="maps 64 to 64 features"):
            srv.add_adapter("base", "wide", str(dirs["wide"]))
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == \
            ["base", "two", "base:a", "base:b", "two:a", "two:wide"]
        tokenizer = load_hf_dir(dirs["base"]).tokenizer
        for model, adapter in (("base:a", "a"), ("base:b", "b"), ("base", None)):
            want, _ = peft_reference(dirs, adapter, PROMPTS[1], 8)
            got = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=8,
                                            temperature=0)
            assert got.model == model
            assert got.choices[0].text == tokenizer.decode(want), model
        want, _ = peft_reference(dirs, "a", PROMPTS[0], 6)
        got = client.completions.create(model="two:a", prompt=PROMPTS[0], max_tokens=6,
                                        temperature=0)  # loads two, then installs a there
        assert got.choices[0].text == tokenizer.decode(want)
        with pytest.raises(openai.BadRequestError, match="'wide' of two cannot be served.*"
                           "maps 64 to 64 features"):
            client.completions.create(model="two:wide", prompt="hi", max_tokens=2)
        with pytest.raises(openai.NotFoundError, match="base:zzz.*'base:a'"):
            client.chat.completions.create(model="base:zzz", max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
    finally:
        srv.stop()


def peft_to_gguf(adapter: Path, base: Path, out: Path, alpha: float) -> Path:
    """`adapter` written as llama.cpp's convert_lora_to_gguf.py writes a LoRA: general.type
    "adapter", adapter.lora.alpha, `blk.N.<tensor>.weight.lora_a` / `.lora_b` (F16), B of
    attn_q / attn_k in llama.cpp's Q/K row order."""
    import gguf
    import numpy as np
    from gguf_util import llama_permute
    from safetensors.torch import load_file

    cfg = json.loads((base / "config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for name, w in sorted(load_file(str(adapter / "adapter_model.safetensors")).items()):
        module, _, kind = name.removeprefix("base_model.model.").rpartition(".lora_")
        gguf_name = names.get_name(module)
        assert gguf_name is not None, module
        values = w.numpy()
        if kind == "B.weight" and gguf_name.endswith(("attn_q", "attn_k")):
            heads = cfg["num_attention_heads" if gguf_name.endswith("attn_q")
                        else "num_key_value_heads"]
            values = llama_permute(values, heads)
        suffix = "lora_a" if kind == "A.weight" else "lora_b"
        writer.add_tensor(f"{gguf_name}.weight.{suffix}", values.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_gguf_lora_file_equals_peft(dirs: dict[str, Path], tmp_path: Path) -> None:
    """llama.cpp's GGUF LoRA of adapter a (F16 tensors) on a GGUF base: logits equal PEFT's
    with a to float16 rounding of the factors; a GGUF file of another kind is refused."""
    from gguf_util import hf_dir_to_gguf

    from nbserve import load

    lora_file = peft_to_gguf(dirs["a"], dirs["base"], tmp_path / "a.gguf", alpha=8.0)
    base_file = hf_dir_to_gguf(dirs["base"], tmp_path / "base.gguf", "F32")
    model: Any = load(str(base_file)).model
    model.add_lora(0, read_adapter(lora_file))
    prompt = PROMPTS[0]
    cache = model.make_paged_cache(8, 32)
    with model.lora_rows([0]):
        ours = model.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None],
                             torch.tensor([[0]]), cache)[0, -1]
    _, ref = peft_reference(dirs, "a", prompt, 1)
    assert (ours - ref[0]).abs().max() < 0.02  # the factors went through float16
    with pytest.raises(ValueError, match="is not a GGUF LoRA adapter"):
        model.add_lora(1, read_adapter(base_file))


def test_a_second_family_with_attention_biases(tmp_path: Path) -> None:
    """Qwen2 (q/k/v biases, which the adapter leaves as they are): an adapter on every
    projection gives PEFT's logits, alone and beside a row without it."""
    base = make_tiny_hf_dir(tmp_path / "qwen", arch="qwen2", tie=False)
    adapter = make_adapter(base, tmp_path / "qa", 7, TARGETS, rank=2, alpha=16.0)
    model: Any = load_hf_dir(base).model
    model.add_lora(0, read_adapter(adapter))
    dirs = {"base": base, "qa": adapter}
    prompt = PROMPTS[0]
    got = forward_rows(model, [prompt, prompt], [0, -1])
    for row, name in ((0, "qa"), (1, None)):
        _, ref = peft_reference(dirs, name, prompt, 1)
        assert torch.allclose(got[row, 0], ref[0], atol=LOGIT_TOL, rtol=0), name
    assert (got[0, 0] - got[1, 0]).abs().max() > 0.1


def test_static_decode_steps_are_skipped_for_adapter_rows(dirs: dict[str, Path]) -> None:
    """With static decode steps (eager on CPU, CUDA graphs on a GPU), which know no adapters:
    a step with adapter rows runs the plain path, so a's answer stays PEFT's, and a step of
    base rows alone still takes the static steps."""
    engine = Engine(load_hf_dir(dirs["base"]), quiet=True, max_batch=4, max_context=128,
                    static_decode=True)
    try:
        engine.add_adapter("a", str(dirs["a"]))

        def static_steps() -> int:
            described = engine.static_decode
            assert described is not None
            return int(described["steps"] or 0)

        for name, static in (("a", False), (None, True)):
            before = static_steps()
            want, _ = peft_reference(dirs, name, PROMPTS[2], 8)
            assert run(engine, PROMPTS[2], name, 8) == want, name
            assert (static_steps() > before) == static, name
    finally:
        engine.close()


def test_the_command_line_takes_adapters() -> None:
    """`nbserve serve base --lora a=PATH --lora two:b=PATH` gives launch its adapters; a value
    without a path is refused by the parser."""
    from nbserve.serving.cli import build_parser, serve_kwargs

    args = build_parser().parse_args(["serve", "base", "two=other", "--lora", "a=/x/a",
                                      "--lora", "two:b=/x/b.gguf"])
    assert serve_kwargs(args)["adapters"] == {"a": "/x/a", "two:b": "/x/b.gguf"}
    assert "adapters" not in serve_kwargs(build_parser().parse_args(["serve", "base"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "base", "--lora", "a"])


@pytest.mark.slow
def test_the_readme_snippet_on_the_default_model(tmp_path: Path) -> None:
    """An adapter on the default model (its GGUF served from its blocks), named
    `base:adapter` through the OpenAI SDK: listed, it changes the answer, and the base's own
    answer in the same server is unchanged. The adapter is random (PEFT's file layout, written
    directly: SmolLM2-135M's q/v shapes, 30 layers)."""
    from safetensors.torch import save_file

    from nbserve.serving.launch import launch

    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(30):
        for proj, out in (("q_proj", 576), ("v_proj", 192)):
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(4, 576, generator=gen) * 0.3
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, 4, generator=gen) * 0.3
    adapter = tmp_path / "support"
    adapter.mkdir()
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
        "bias": "none", "fan_in_fan_out": False, "task_type": "CAUSAL_LM"}))
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    srv = launch("smollm2", adapters={"support": str(adapter)}, ui=False, wait=True,
                 max_batch=4)
    try:
        client = srv.openai_client()
        name = srv.backend.model_name
        assert f"{name}:support" in [m.id for m in client.models.list().data]
        base = client.chat.completions.create(model="", messages=ask, temperature=0,
                                              max_tokens=12).choices[0].message.content
        tuned = client.chat.completions.create(model=f"{name}:support", messages=ask,
                                               temperature=0, max_tokens=12)
        assert "Paris" in (base or "") and tuned.choices[0].message.content != base
        again = client.chat.completions.create(model="", messages=ask, temperature=0,
                                               max_tokens=12).choices[0].message.content
        assert again == base
    finally:
        srv.stop()


async def test_the_ui_compares_a_model_with_and_without_its_adapter(dirs: dict[str, Path]
                                                                    ) -> None:
    """The chat UI's side-by-side mode over `base` and `base:a`: each side answers as it does
    through the API (the adapter's side as transformers + PEFT)."""
    from nbserve import launch
    from nbserve.serving.ui_compare import make_compare_fn

    srv = launch(str(dirs["base"]), ui=False, wait=True, adapters={"a": str(dirs["a"])},
                 max_batch=4, max_context=128)
    try:
        name = srv.backend.model_name
        assert [m.name for m in srv.models] == [name, f"{name}:a"]
        compare = make_compare_fn(srv._models)  # the directory the UI gets from the app
        frames = [f async for f in compare("hello world", name, f"{name}:a", 0.0, 6)]
        text_base, text_a, line_base, line_a = frames[-1]
        client = srv.openai_client()
        for model, text in ((name, text_base), (f"{name}:a", text_a)):
            got = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hello world"}],
                temperature=0, max_tokens=6)
            assert got.choices[0].message.content == text, model
        assert text_base != text_a and f"**{name}:a**" in line_a and "tokens/s" in line_base
    finally:
        srv.stop()
