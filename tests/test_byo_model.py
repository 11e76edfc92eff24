"""Bring your own model: transformers Llama and GPT-2 models and nanoGPT's GPT (weights taken
over by nbserve's decoder, no copy), a transformers GPT-NeoX (TransformersAdapter), a module of
another shape (RecomputeAdapter) and the custom StepModel of
docs/custom_model.md, each equal to its own reference greedy decoding through the Engine (one
request at a time, and many at once) and over HTTP with the OpenAI SDK."""

from __future__ import annotations

import math
import re
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import torch.nn.functional as F
import transformers
from server_util import running_server
from tiny_models import make_tiny_tokenizer
from torch import nn

from nbserve.engine import Engine
from nbserve.loading import LoadedModel, load
from nbserve.models.adapters import RecomputeAdapter, SlowPathWarning, TransformersAdapter
from nbserve.models.adopt import adopt, snapshot
from nbserve.models.decoder import DecoderModel, LlamaModel
from nbserve.server import create_app
from nbserve.types import Delta, ErrorEvent, Request, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from custom_step_model import TinyGPT  # noqa: E402 (examples/ is on sys.path only now)

# Different lengths (so sequences join and leave the batch at different steps), and one that
# extends another (so a freed cache slot is reused for its prefix and rolled back).
PROMPTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog.",
           "def add(a, b):", "Hello, world! What is the capital of France?", "x"]
MAX_NEW = [12, 7, 16, 9, 5]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

Reference = Callable[[list[int], int], list[int]]


# ----------------------------------------------------------------------------- the checks


def greedy_ids(engine: Engine, ids: list[int], n: int, choices: int = 1) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, n=choices)
    return _collect(engine.stream(Request(prompt_ids=ids, params=params)), choices)


def _collect(events: Any, choices: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(choices)]
    for ev in events:
        assert not isinstance(ev, ErrorEvent), ev
        if isinstance(ev, Delta):
            out[ev.index] += ev.token_ids
    return out


def check_engine(loaded: LoadedModel, reference: Reference, **engine_options: Any) -> Engine:
    """Engine == reference, one request at a time, then all at once (twice: the second round
    reuses cached prefixes), then with n=2 choices. Returns the engine (caller closes it)."""
    # blocks of 4 tokens: these short prompts fill whole blocks (only full ones are shared)
    engine = Engine(loaded, max_batch=4, quiet=True, **{"kv_block_size": 4, **engine_options})
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    expected = [reference(ids, n) for ids, n in zip(prompts, MAX_NEW)]
    assert all(len(e) == n for e, n in zip(expected, MAX_NEW))
    alone = [greedy_ids(engine, ids, n)[0] for ids, n in zip(prompts, MAX_NEW)]
    assert alone == expected
    before = engine.stats()
    for _ in range(2):  # 5 requests on 4 slots: one waits, then takes a freed slot
        streams = [engine.stream(Request(prompt_ids=ids, params=SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True))) for ids, n in zip(prompts, MAX_NEW)]
        assert [_collect(s, 1)[0] for s in streams] == expected
    after = engine.stats()
    assert after["tokens_reused"] > 0  # cached prefixes were reused (and cut back)
    # several sequences decoded in one step: fewer steps than decoded tokens
    assert after["steps"] - before["steps"] < after["tokens_decoded"] - before["tokens_decoded"]
    assert greedy_ids(engine, prompts[1], MAX_NEW[1], choices=2) == [expected[1]] * 2
    return engine


def check_http(engine: Engine) -> None:
    """The OpenAI SDK over a real server gives what the engine gives, alone or concurrently."""
    chat: dict[str, Any] = {"messages": CHAT, "temperature": 0, "max_tokens": 8}
    want_chat = engine.chat(CHAT, temperature=0, max_tokens=8)
    want = [engine.complete(p, temperature=0, max_tokens=n) for p, n in zip(PROMPTS, MAX_NEW)]
    with running_server(create_app(engine, ui=False)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.chat.completions.create(model=engine.model_name, **chat)
        assert r.choices[0].message.content == want_chat
        streamed = client.chat.completions.create(model=engine.model_name, stream=True, **chat)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            want_chat

        def complete(i: int) -> str:
            return client.completions.create(model=engine.model_name, prompt=PROMPTS[i],
                                             temperature=0, max_tokens=MAX_NEW[i]).choices[0].text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(complete, range(len(PROMPTS)))) == want


# ----------------------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def hf_llama(tiny_llama_dir: Path) -> tuple[Any, Any]:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.generation_config.eos_token_id = None  # the reference runs to max_new_tokens
    return model, transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)


def hf_generate(model: Any) -> Reference:
    def reference(ids: list[int], n: int) -> list[int]:
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
        return out[0, len(ids):].tolist()
    return reference


def test_llama_weights_are_taken_over_without_copy(hf_llama: tuple[Any, Any]) -> None:
    model, tok = hf_llama
    loaded = adopt(model, tok)
    assert isinstance(loaded.model, LlamaModel)
    ours = dict(loaded.model.named_parameters())
    for name, p in model.named_parameters():
        assert ours[name].data_ptr() == p.data_ptr(), name
        assert (ours[name].device, ours[name].dtype) == (p.device, p.dtype)
    assert loaded.template is not None and not loaded.template.is_default  # the tokenizer's
    assert loaded.stop_token_ids == [2] and loaded.name == "tiny-llama"
    from_dir = adopt(model, str(model.config._name_or_path), verbose=False)  # a directory
    assert from_dir.template.source == loaded.template.source and from_dir.stop_token_ids == [2]
    with pytest.raises(TypeError, match="not a causal language model"):
        adopt(model.model, tok)  # the backbone without its LM head
    half = transformers.AutoModelForCausalLM.from_pretrained(model.config._name_or_path,
                                                             dtype=torch.bfloat16)
    shared = adopt(half, tok, verbose=False).model
    assert shared.dtype == torch.bfloat16
    assert shared.lm_head.weight.data_ptr() == half.model.embed_tokens.weight.data_ptr()


def test_llama_adopted_equals_generate(hf_llama: tuple[Any, Any]) -> None:
    model, tok = hf_llama
    engine = check_engine(load(model, tokenizer=tok, verbose=False), hf_generate(model))
    try:
        check_http(engine)
    finally:
        engine.close()


def test_training_the_adopted_model_changes_what_is_served(tiny_llama_dir: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tok.encode("Hello, world!")
    with Engine(adopt(model, tok, verbose=False), max_batch=2, quiet=True) as engine:
        before = greedy_ids(engine, ids, 8)[0]
        with torch.no_grad():  # one "training step": an in-place update, like an optimizer's
            model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
        model.generation_config.eos_token_id = None
        assert greedy_ids(engine, [*ids, 5], 8)[0] == hf_generate(model)([*ids, 5], 8)
    assert hf_generate(model)(ids, 8) != before


@pytest.fixture(scope="module")
def gpt2() -> Any:
    config = transformers.GPT2Config(vocab_size=640, n_positions=128, n_embd=64, n_layer=2,
                                     n_head=4, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)  # in training mode: dropout 0.1 is on


def test_gpt2_runs_natively_on_its_own_tensors_and_equals_generate(gpt2: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)  # the full-speed path: no warning
        loaded = adopt(gpt2, make_tiny_tokenizer(), verbose=False)
    assert isinstance(loaded.model, DecoderModel)
    theirs = {p.untyped_storage().data_ptr() for p in gpt2.parameters()}
    assert {p.untyped_storage().data_ptr() for p in loaded.model.parameters()} <= theirs
    frozen = snapshot(gpt2)  # eval mode: the reference runs without dropout
    engine = check_engine(loaded, hf_generate(frozen))
    engine.close()
    assert gpt2.training  # the user's module is untouched


@pytest.fixture(scope="module")
def neox() -> Any:
    config = transformers.GPTNeoXConfig(vocab_size=640, max_position_embeddings=128,
                                        hidden_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=128,
                                        bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    return transformers.GPTNeoXForCausalLM(config).train()  # dropout settings on


def test_a_non_native_architecture_goes_through_the_adapter(neox: Any) -> None:
    with pytest.warns(SlowPathWarning, match="natively: Llama.*Qwen3.*Gemma.*StepModel"):
        loaded = adopt(neox, make_tiny_tokenizer(), verbose=False)
    assert isinstance(loaded.model, TransformersAdapter)
    assert loaded.template.is_default and loaded.stop_token_ids == [2]  # <|im_end|>
    assert loaded.model.max_context == 128 and loaded.model.vocab_size == 640
    frozen = snapshot(neox)  # eval mode: the reference runs without dropout
    assert not frozen.training and neox.training
    engine = check_engine(loaded, hf_generate(frozen))
    try:
        check_http(engine)
        assert engine.stats()["kv_cache_bytes"] > 0
    finally:
        engine.close()
    assert neox.training  # serving used an eval-mode view; the user's module is untouched


# ----------------------------------------------------------------------------- nanoGPT-style


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 640
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 48
    dropout: float = 0.2


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = c.n_head, c.dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.c_attn, self.c_proj = nn.Linear(c.n_embd, 3 * c.n_embd), nn.Linear(c.n_embd, c.n_embd)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(),
                                 nn.Linear(4 * c.n_embd, c.n_embd), nn.Dropout(c.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.c_attn(self.ln_1(x)).view(b, t, 3, self.n_head, c // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's shape: forward(idx, targets=None) -> (logits, loss), with the logits of the
    last position only when there are no targets; dropout on while training."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.3)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        assert t <= self.config.block_size, "sequence longer than block_size"
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def naive_greedy(model: nn.Module, block_size: int) -> Reference:
    """nanoGPT's generate loop with temperature 0: crop to block_size, argmax, append."""
    @torch.no_grad()
    def reference(ids: list[int], n: int) -> list[int]:
        idx = torch.tensor([ids])
        for _ in range(n):
            logits, _ = model(idx[:, -block_size:])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return idx[0, len(ids):].tolist()
    return reference


def test_nanogpt_recompute_equals_naive_loop() -> None:
    torch.manual_seed(0)
    model = NanoGPT(GPTConfig())
    tok = make_tiny_tokenizer()
    with pytest.warns(SlowPathWarning, match="nbserve.StepModel"):
        loaded = load(model, tokenizer=tok, max_context=48, verbose=False)
    step = loaded.model
    assert isinstance(step, RecomputeAdapter)
    assert (step.max_context, step.window, step.vocab_size) == (48, 16, 640)
    # answers run past block_size (16): the adapter crops the window like nanoGPT's generate
    engine = check_engine(loaded, naive_greedy(snapshot(model), 16))
    try:
        check_http(engine)
    finally:
        engine.close()
    assert model.training


@dataclass
class NanoGPTConfig:  # nanoGPT's GPTConfig fields
    block_size: int = 64
    vocab_size: int = 640
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 48
    dropout: float = 0.1
    bias: bool = True


class NanoLayerNorm(nn.Module):  # nanoGPT's LayerNorm: an optional bias
    def __init__(self, n: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoAttention(nn.Module):
    def __init__(self, c: NanoGPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd, bias=c.bias)
        self.attn_dropout, self.resid_dropout = nn.Dropout(c.dropout), nn.Dropout(c.dropout)
        self.n_head, self.n_embd, self.dropout = c.n_head, c.n_embd, c.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class NanoMLP(nn.Module):
    def __init__(self, c: NanoGPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd, bias=c.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd, bias=c.bias)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class NanoBlock(nn.Module):
    def __init__(self, c: NanoGPTConfig):
        super().__init__()
        self.ln_1, self.attn = NanoLayerNorm(c.n_embd, c.bias), NanoAttention(c)
        self.ln_2, self.mlp = NanoLayerNorm(c.n_embd, c.bias), NanoMLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NamedNanoGPT(nn.Module):
    """nanoGPT's GPT module layout (model.py): `transformer` = wte, wpe, drop, h, ln_f; a tied
    `lm_head`; forward(idx, targets=None) -> (logits of the last position, None)."""

    def __init__(self, config: NanoGPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(NanoBlock(config) for _ in range(config.n_layer)),
            ln_f=NanoLayerNorm(config.n_embd, config.bias)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does
        for name, p in self.named_parameters():
            nn.init.normal_(p, std=0.3 if p.dim() > 1 else 0.1)
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight"):
                p.data += 1

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        x = self.transformer.drop(self.transformer.wte(idx) +
                                  self.transformer.wpe(torch.arange(t, device=idx.device)))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x)[:, [-1], :]), None


@pytest.mark.parametrize("bias", [True, False])
def test_a_nanogpt_module_runs_on_the_engine_not_by_recompute(bias: bool) -> None:
    torch.manual_seed(0)
    model = NamedNanoGPT(NanoGPTConfig(bias=bias))  # left in training mode
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)  # no adapter, no warning
        loaded = load(model, tokenizer=make_tiny_tokenizer(), verbose=False)
    step = loaded.model
    assert isinstance(step, DecoderModel) and not isinstance(step, RecomputeAdapter)
    assert step.max_context == 64
    theirs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert {p.untyped_storage().data_ptr() for p in step.parameters()} <= theirs
    engine = check_engine(loaded, naive_greedy(snapshot(model), 64))
    try:
        check_http(engine)
    finally:
        engine.close()
    assert model.training


def test_recompute_reads_context_and_vocab_from_the_module() -> None:
    class Bare(nn.Module):  # no config at all: vocab from a probe forward, context from argument
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 8)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.emb(idx) @ self.emb.weight.T  # (B, T, 50)

    for unset in (None, 0):  # 0 means "not given", as for TransformersAdapter
        with pytest.raises(ValueError, match="max_context"):
            RecomputeAdapter(Bare(), max_context=unset, warn=False)
    step = RecomputeAdapter(Bare(), max_context=16, warn=False)
    assert (step.max_context, step.vocab_size) == (16, 50)
    model = Bare()
    model.sequence_len = 32  # nanochat's name
    assert RecomputeAdapter(model, warn=False).max_context == 32


# ----------------------------------------------------------------------------- custom StepModel


def naive_step_model(model: TinyGPT) -> Reference:
    """Greedy decoding that recomputes everything with a fresh cache at every step."""
    def reference(ids: list[int], n: int) -> list[int]:
        out = list(ids)
        for _ in range(n):
            cache = model.make_cache(1, len(out))
            logits = model.forward(torch.tensor([out]), torch.arange(len(out))[None],
                                   torch.tensor([0]), cache)
            out.append(int(logits[0, -1].argmax()))
        return out[len(ids):]
    return reference


def test_custom_step_model_example_is_served() -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)  # the full-speed path: no warning
        loaded = adopt(model, make_tiny_tokenizer(), name="tiny-gpt", verbose=False)
    assert loaded.model.max_context == 256 and loaded.stop_token_ids == [2]
    engine = check_engine(loaded, naive_step_model(model), prefill_chunk=8)  # chunked prefill
    try:
        check_http(engine)
    finally:
        engine.close()


def test_doc_embeds_the_example_file() -> None:
    doc = (ROOT / "docs" / "custom_model.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.DOTALL)
    code = (ROOT / "examples" / "custom_step_model.py").read_text()
    assert code in blocks, "docs/custom_model.md must embed examples/custom_step_model.py as is"


# ----------------------------------------------------------------------------- errors


def test_errors_say_what_to_pass() -> None:
    with pytest.raises(TypeError, match="tokenizer=") as err:
        load(object())
    assert "transformers PreTrainedModel" in str(err.value) and "tokenizers.Tokenizer" in \
        str(err.value) and "StepModel" in str(err.value)
    with pytest.raises(TypeError, match="pass tokenizer="):
        load(NanoGPT(GPTConfig()))
    with pytest.raises(TypeError, match="encode"):
        load(NanoGPT(GPTConfig()), tokenizer=42)

    class HalfStep:
        max_context, vocab_size = 8, 8

        def make_cache(self, max_batch: int, max_context: int) -> None: ...
        def forward(self, ids: torch.Tensor) -> torch.Tensor: ...

    with pytest.raises(TypeError, match="device, dtype"):
        adopt(HalfStep(), make_tiny_tokenizer())
    HalfStep.device, HalfStep.dtype = torch.device("cpu"), torch.float32
    with pytest.raises(TypeError, match="forward"):
        adopt(HalfStep(), make_tiny_tokenizer())
    with pytest.raises(ValueError, match="served where it is"):
        load(TinyGPT(), tokenizer=make_tiny_tokenizer(), device="cuda", verbose=False)


def test_chat_template_argument_and_default_note(capsys: pytest.CaptureFixture[str]) -> None:
    tok = make_tiny_tokenizer()
    loaded = adopt(TinyGPT(), tok, chat_template="{% for m in messages %}{{ m.content }}\n"
                   "{% endfor %}", stop_token_ids=[0], verbose=False)
    assert loaded.template.render(CHAT) == CHAT[0]["content"] + "\n"
    assert loaded.stop_token_ids == [0]
    adopt(TinyGPT(), tok)
    assert "plain ChatML default" in capsys.readouterr().out
    with pytest.raises(ValueError, match="stop_token_ids"):
        adopt(TinyGPT(), tok, stop_token_ids=[10**6], verbose=False)


def test_snapshot_is_frozen() -> None:
    model = NanoGPT(GPTConfig())
    frozen = snapshot(model)
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    with torch.no_grad():
        model.lm_head.weight.zero_()
    assert not math.isclose(float(frozen.lm_head.weight.abs().sum()), 0.0)
