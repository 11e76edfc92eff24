"""nanochat's GPT on the engine (models/nanochat.py): a GPT module (tests/nanochat_model.py,
nanochat's gpt.py at 92d63d4e8bb4 written out) is adopted on its own tensors and computes
what its forward computes, at prefill (in chunks) and at 16 cached decode steps, past its
sliding windows, with the smear, value embeddings, lambdas, backout, soft-cap and padded
vocabulary; greedy answers through the Engine equal its naive generate loop, batched or
alone; its checkpoint directory loads (weights_only) with the same results; other versions'
parameters are refused by name; the chat template renders as render_conversation."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from nanochat_model import GPT, save_checkpoint, tiny_gpt
from tiny_models import make_tiny_tokenizer
from tokenizers import AddedToken, Tokenizer
from torch import nn

from nbserve.cpu.threads import torch_threads
from nbserve.engine import Engine
from nbserve.loading import load
from nbserve.models import registry
from nbserve.models.adapters import RecomputeAdapter, SlowPathWarning
from nbserve.models.families.nanochat import adopt_nanochat
from nbserve.models.nanochat import NanochatModel
from nbserve.text.nanochat_chat import SPECIAL_TOKENS, nanochat_chat_template, nanochat_tokenizer
from nbserve.types import Delta, ErrorEvent, InvalidRequestError, Request, SamplingParams, Started

SHORT = 5  # the S layers of the adopted module see 6 keys: a 40-token prompt passes them
PROMPT, DECODE = 40, 16


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """The tests' own forwards (tiny matmuls) in one thread: on a busy machine an OpenMP
    pool of two waits on each other far longer than the work takes."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """The tiny byte-level BPE with nanochat's special tokens after its vocabulary (as
    nanochat's tokenizer puts them): 649 tokens, which nanochat pads to 704 rows."""
    t = make_tiny_tokenizer()
    t.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    assert t.get_vocab_size() == 649
    return t


@pytest.fixture(scope="module")
def gpt(tok: Tokenizer) -> GPT:
    return tiny_gpt(tok.get_vocab_size(), seed=0, short_left=SHORT)


def _ids(name: str, tok: Tokenizer) -> int:
    i = tok.token_to_id(name)
    assert i is not None
    return i


def _reference_logits(module: GPT, seq: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return module(seq)[0]


def check_prefill_and_decode(step: Any, module: GPT, prompt: int, chunk: int,
                             seed: int) -> None:
    """Prefill `prompt` tokens in chunks of `chunk`, then 16 decode steps: every logit row
    equals the module's forward over the sequence so far (1e-4)."""
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, step.vocab_size, (1, prompt + DECODE), generator=gen)
    blocks = -(-(prompt + DECODE) // 8)
    cache, table = step.make_paged_cache(blocks, 8), torch.arange(blocks)[None]
    ref = _reference_logits(module, seq[:, :prompt])
    for start in range(0, prompt, chunk):
        end = min(start + chunk, prompt)
        out = step.forward(seq[:, start:end], torch.arange(start, end)[None], table, cache)
        assert out.shape == (1, end - start, step.vocab_size)
        torch.testing.assert_close(out[0], ref[start:end], atol=1e-4, rtol=0)
    for pos in range(prompt, prompt + DECODE):
        out = step.forward(seq[:, pos:pos + 1], torch.tensor([[pos]]), table, cache,
                           max_pos=pos)
        want = _reference_logits(module, seq[:, :pos + 1])[-1]
        torch.testing.assert_close(out[0, 0], want, atol=1e-4, rtol=0,
                                   msg=lambda m, pos=pos: f"decode at {pos}: {m}")


def naive(module: GPT, ids: list[int], n: int) -> list[int]:
    return list(module.generate(ids, n, temperature=0.0))


def greedy(engine: Engine, ids: list[int], n: int, choices: int = 1) -> list[int]:
    """Greedy tokens of choice 0 (each choice's, one after the other, with `choices`)."""
    return _collect(engine.stream(Request(prompt_ids=ids, params=SamplingParams(
        temperature=0.0, max_tokens=n, ignore_eos=True, n=choices))))


def _collect(events: Any) -> list[int]:
    out: dict[int, list[int]] = {}
    for ev in events:
        assert not isinstance(ev, ErrorEvent), ev
        if isinstance(ev, Delta):
            out.setdefault(ev.index, []).extend(ev.token_ids)
    return [t for i in sorted(out) for t in out[i]]


def check_engine(loaded: Any, module: GPT, lengths: list[int], new: int, seed: int) -> None:
    """Through the Engine with prefill chunks of 8 (chunked prefill crosses the smear and the
    windows), blocks of 4: each prompt alone, then all 8 at once, equals the module's naive
    greedy loop."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, loaded.model.vocab_size, (n,), generator=gen).tolist()
               for n in lengths]
    expected = [naive(module, p, new) for p in prompts]
    with Engine(loaded, max_batch=8, prefill_chunk=8, kv_block_size=4, quiet=True) as engine:
        alone = [greedy(engine, p, new) for p in prompts]
        between = engine.stats()["steps"]
        streams = [engine.stream(Request(prompt_ids=p, params=SamplingParams(
            temperature=0.0, max_tokens=new, ignore_eos=True))) for p in prompts]
        together = [_collect(s) for s in streams]
        after = engine.stats()["steps"]
        forked = greedy(engine, prompts[2], new, choices=2)  # n=2: the last block is copied
    assert forked == expected[2] * 2
    assert alone == expected
    assert together == expected
    assert after - between < between  # fewer steps: the rows ran in the same steps


# ----------------------------------------------------------------------------- the module


def test_a_nanochat_module_is_served_on_the_engine_on_its_own_tensors(gpt, tok) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)  # no adapter
        loaded = load(gpt, tokenizer=tok, verbose=False)
    step = loaded.model
    assert isinstance(step, NanochatModel) and not isinstance(step, RecomputeAdapter)
    assert (step.vocab_size, step.max_context) == (649, 128)
    assert step.transformer["wte"].weight.shape[0] == 704  # the padded rows stay unserved
    assert step.config.windows == (SHORT + 1,) * 3 + (129,)
    theirs = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
    assert {p.untyped_storage().data_ptr() for p in step.parameters()} <= theirs
    assert all(p.requires_grad for p in gpt.parameters())  # the module is left as it was


def test_logits_equal_its_forward_at_chunked_prefill_and_16_decode_steps(gpt) -> None:
    step = adopt_nanochat(gpt)
    for chunk, seed in ((PROMPT, 1), (7, 2), (1, 3)):  # whole, chunks of 7, token by token
        check_prefill_and_decode(step, gpt, PROMPT, chunk, seed)


def test_the_comparison_sees_windows_smear_and_backout(gpt) -> None:
    """The module's features change its logits past the first positions: a forward that
    ignored them would fail the comparisons above."""
    seq = torch.randint(0, 649, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    ref = _reference_logits(gpt, seq)
    variants = []
    for change in ("windows", "smear", "backout", "x0"):
        other = copy.deepcopy(gpt)
        with torch.no_grad():
            if change == "windows":
                other.window_sizes = [(128, 0)] * 4
            elif change == "smear":
                other.smear_lambda.zero_()
            elif change == "backout":
                other.backout_lambda.zero_()
            else:
                other.x0_lambdas.zero_()
        variants.append(_reference_logits(other, seq))
    for change, out in zip(("windows", "smear", "backout", "x0"), variants):
        assert (out[SHORT + 1:] - ref[SHORT + 1:]).abs().max() > 1e-2, change


def test_engine_greedy_equals_its_naive_generate_batched_and_alone(gpt, tok) -> None:
    loaded = load(gpt, tokenizer=tok, verbose=False)
    check_engine(loaded, gpt, [2, 40, 9, 17, 3, 26, 12, 33], new=12, seed=5)


def test_bfloat16_embeddings_beside_float32_weights_as_nanochat_trains(tok, monkeypatch) -> None:
    """nanochat on a GPU: COMPUTE_DTYPE bfloat16, the embeddings cast to it, the matmul
    weights float32 (cast at use). Adopted as it is: activations in bfloat16, no copies."""
    import nanochat_model

    monkeypatch.setattr(nanochat_model, "COMPUTE_DTYPE", torch.bfloat16)
    module = tiny_gpt(tok.get_vocab_size(), seed=11, short_left=SHORT)
    module.transformer.wte.to(torch.bfloat16)
    for ve in module.value_embeds.values():
        ve.to(torch.bfloat16)
    step = adopt_nanochat(module)
    assert step.dtype == torch.bfloat16
    assert step.transformer["h"][0].attn.c_q.weight.dtype == torch.float32
    theirs = {p.untyped_storage().data_ptr() for p in module.parameters()}
    assert {p.untyped_storage().data_ptr() for p in step.parameters()} <= theirs
    seq = torch.randint(0, 649, (1, PROMPT + 4), generator=torch.Generator().manual_seed(12))
    cache, table = step.make_paged_cache(8, 8), torch.arange(8)[None]
    out = step.forward(seq[:, :PROMPT], torch.arange(PROMPT)[None], table, cache)[0]
    torch.testing.assert_close(out, _reference_logits(module, seq[:, :PROMPT]), atol=1e-2,
                               rtol=0)  # the same ops in bfloat16
    for pos in range(PROMPT, PROMPT + 4):  # decode attention sums in another order: an ulp
        out = step.forward(seq[:, pos:pos + 1], torch.tensor([[pos]]), table, cache)[0, 0]
        want = _reference_logits(module, seq[:, :pos + 1])[-1]
        torch.testing.assert_close(out, want, atol=0.25, rtol=0)


def test_a_module_of_another_version_is_refused_by_name(gpt, tok, capsys) -> None:
    newer = copy.deepcopy(gpt)
    newer.register_parameter("smear_bias", nn.Parameter(torch.zeros(1)))
    with pytest.raises(ValueError, match=r"unexpected smear_bias"):
        adopt_nanochat(newer)
    older = copy.deepcopy(gpt)
    del older.backout_lambda
    with pytest.raises(ValueError, match=r"missing backout_lambda"):
        registry.for_module(older)
    with pytest.warns(SlowPathWarning):  # still served, by recompute, and told why
        loaded = load(newer, tokenizer=tok, verbose=False)
    assert isinstance(loaded.model, RecomputeAdapter)
    assert "smear_bias" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tok) -> tuple[Path, GPT]:
    """A nanochat-style checkpoint directory of a model whose windows come from nanochat's
    formula (sequence_len 512: S layers see 129 keys, so 150-token prompts pass them)."""
    module = tiny_gpt(tok.get_vocab_size(), seed=6, sequence_len=512)
    assert module.window_sizes == [(128, 0)] * 3 + [(512, 0)]
    root = save_checkpoint(tmp_path_factory.mktemp("nanochat") / "d4", 1200, module)
    tok.save(str(root / "tokenizer.json"))
    return root, module


def test_a_checkpoint_directory_loads_with_the_same_results(checkpoint, tok) -> None:
    root, module = checkpoint
    loaded = load(str(root), verbose=False)  # the tokenizer.json found in the directory
    step = loaded.model
    assert isinstance(step, NanochatModel) and step.max_context == 512
    assert loaded.name == "d4" and loaded.source.endswith("model_001200.pt")
    assert loaded.stop_token_ids == [_ids("<|assistant_end|>", tok), _ids("<|bos|>", tok)]
    check_prefill_and_decode(step, module, 150, 64, seed=7)
    check_engine(loaded, module, [150, 3, 70, 131, 9, 40, 2, 100], new=8, seed=8)
    adopted = adopt_nanochat(module)  # the same model in memory gives the same logits
    seq = torch.randint(0, 649, (1, 140), generator=torch.Generator().manual_seed(9))
    args = (seq, torch.arange(140)[None], torch.arange(18)[None])
    torch.testing.assert_close(step.forward(*args, step.make_paged_cache(18, 8)),
                               adopted.forward(*args, adopted.make_paged_cache(18, 8)),
                               atol=1e-4, rtol=0)


def test_a_named_step_and_a_given_tokenizer(checkpoint, tok, tmp_path) -> None:
    root, module = checkpoint
    only = tmp_path / "d4"
    only.mkdir()
    for name in ("model_001200.pt", "meta_001200.json"):
        (only / name).write_bytes((root / name).read_bytes())
    with pytest.raises(FileNotFoundError, match="tokenizer="):
        load(str(only), verbose=False)
    loaded = load(str(only / "model_001200.pt"), tokenizer=tok, max_context=200,
                  verbose=False)
    assert loaded.model.max_context == 200
    ids = tok.encode("Hello, world!").ids
    with Engine(loaded, max_batch=2, quiet=True) as engine:
        assert greedy(engine, ids, 6) == naive(module, ids, 6)


def _broken_copy(root: Path, dest: Path, edit: Any) -> Path:
    dest.mkdir()
    state = torch.load(root / "model_001200.pt", weights_only=True)
    edit(state)
    torch.save(state, dest / "model_001200.pt")
    (dest / "meta_001200.json").write_bytes((root / "meta_001200.json").read_bytes())
    return dest


def test_a_checkpoint_of_another_shape_is_refused_naming_the_parameters(checkpoint, tok,
                                                                        tmp_path) -> None:
    root, _ = checkpoint
    missing = _broken_copy(root, tmp_path / "missing", lambda s: s.pop("smear_gate.weight"))
    with pytest.raises(ValueError, match=r"missing smear_gate\.weight"):
        load(str(missing), tokenizer=tok, verbose=False)
    no_ve = _broken_copy(root, tmp_path / "no-ve", lambda s: s.pop("value_embeds.3.weight"))
    with pytest.raises(ValueError, match=r"missing value_embeds\.3\.weight"):
        load(str(no_ve), tokenizer=tok, verbose=False)

    def older_gate(state: dict) -> None:  # a ve_gate over 32 channels, as older nanochat had
        state["transformer.h.1.attn.ve_gate.weight"] = torch.zeros(2, 32)
        state["transformer.h.0.attn.ve_gate.weight"] = torch.zeros(2, 32)

    older = _broken_copy(root, tmp_path / "older", older_gate)
    with pytest.raises(ValueError, match=r"unexpected transformer\.h\.0\.attn\.ve_gate\.weight"
                                         r".*mis-shaped transformer\.h\.1\.attn\.ve_gate"):
        load(str(older), tokenizer=tok, verbose=False)


def test_weights_are_read_without_unpickling_code(checkpoint, tok, tmp_path) -> None:
    root, _ = checkpoint
    bad = tmp_path / "bad"
    bad.mkdir()
    torch.save({"transformer.wte.weight": torch.zeros(1), "payload": Path("x")},
               bad / "model_000001.pt")  # an object, not a tensor: weights_only refuses it
    (bad / "meta_000001.json").write_bytes((root / "meta_001200.json").read_bytes())
    with pytest.raises(ValueError, match=r"weights_only"):
        load(str(bad), tokenizer=tok, verbose=False)


def test_only_a_tokenizer_pickle_is_refused_saying_why(checkpoint, tmp_path) -> None:
    root, _ = checkpoint
    base = tmp_path / "base"
    ckpt = base / "chatsft_checkpoints" / "d4"  # nanochat's layout: <base>/tokenizer/
    ckpt.mkdir(parents=True)
    for name in ("model_001200.pt", "meta_001200.json"):
        (ckpt / name).write_bytes((root / name).read_bytes())
    (base / "tokenizer").mkdir()
    (base / "tokenizer" / "tokenizer.pkl").write_bytes(b"never unpickled")
    with pytest.raises(ValueError, match=r"pickle.*tokenizer=tok"):
        load(str(ckpt), verbose=False)


# ----------------------------------------------------------------------------- the chat format


def render_conversation(messages: list[dict[str, str]], encode: Any, special: Any,
                        for_completion: bool) -> list[int]:
    """nanochat's render_conversation (tokenizer.py), string contents; with `for_completion`
    its render_for_completion (the last assistant message dropped, <|assistant_start|> added)."""
    if for_completion:
        messages = messages[:-1]
    if messages[0]["role"] == "system":
        messages = [dict(messages[1], content=messages[0]["content"] + "\n\n"
                         + messages[1]["content"])] + messages[2:]
    ids = [special("<|bos|>")]
    for i, m in enumerate(messages):
        assert m["role"] == ("user" if i % 2 == 0 else "assistant")
        if m["role"] == "user":
            ids += [special("<|user_start|>"), *encode(m["content"]), special("<|user_end|>")]
        else:
            ids += [special("<|assistant_start|>"), *encode(m["content"]),
                    special("<|assistant_end|>")]
    return ids + ([special("<|assistant_start|>")] if for_completion else [])


CONVERSATION = [
    {"role": "system", "content": "You are a helpful AI assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of the lazy dog? 42 ✓"},
    {"role": "assistant", "content": "Once upon a time."},
]


@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:]], ids=["system", "plain"])
def test_the_chat_template_renders_as_render_conversation(messages, tok) -> None:
    ntok = nanochat_tokenizer(tok)
    template = nanochat_chat_template()

    def special(name: str) -> int:
        return _ids(name, tok)

    def encode(text: str) -> list[int]:
        return tok.encode(text).ids

    full = ntok.encode(template.render(messages, add_generation_prompt=False))
    assert full == render_conversation(messages, encode, special, for_completion=False)
    prompt = ntok.encode(template.render(messages[:-1], add_generation_prompt=True))
    assert prompt == render_conversation(messages, encode, special, for_completion=True)
    with pytest.raises(InvalidRequestError, match="alternate"):
        template.render([messages[-2], messages[-1], messages[-1]])


def test_a_chat_on_the_loaded_checkpoint_prompts_as_nanochat(checkpoint, tok) -> None:
    root, module = checkpoint
    loaded = load(str(root), verbose=False)
    messages = CONVERSATION[:4]
    want_prompt = render_conversation(CONVERSATION, lambda t: tok.encode(t).ids,
                                      lambda n: _ids(n, tok), for_completion=True)
    with Engine(loaded, max_batch=2, quiet=True) as engine:
        events = list(engine.stream(Request(messages=messages, params=SamplingParams(
            temperature=0.0, max_tokens=8))))
    started = next(e for e in events if isinstance(e, Started))
    assert started.prompt_ids == want_prompt
    reply = naive(module, want_prompt, 8)
    stops = loaded.stop_token_ids
    cut = next((i for i, t in enumerate(reply) if t in stops), len(reply))
    assert _collect(events) == reply[:cut]


def test_an_adopted_module_chats_in_nanochats_format_when_told(gpt, tok) -> None:
    loaded = load(gpt, tokenizer=nanochat_tokenizer(tok), chat_template=nanochat_chat_template(),
                  verbose=False)
    assert loaded.stop_token_ids == [_ids("<|assistant_end|>", tok), _ids("<|bos|>", tok)]
    want = render_conversation(CONVERSATION, lambda t: tok.encode(t).ids,
                               lambda n: _ids(n, tok), for_completion=True)
    with Engine(loaded, max_batch=2, quiet=True) as engine:
        events = list(engine.stream(Request(messages=CONVERSATION[:4], params=SamplingParams(
            temperature=0.0, max_tokens=4))))
    assert next(e for e in events if isinstance(e, Started)).prompt_ids == want


def test_an_adopted_module_chats_in_nanochats_format_by_default(gpt, tok) -> None:
    loaded = load(gpt, tokenizer=tok, verbose=False)
    assert loaded.template.source == nanochat_chat_template().source
    assert loaded.stop_token_ids == [_ids("<|assistant_end|>", tok), _ids("<|bos|>", tok)]


def test_nanochats_own_tiktoken_tokenizer_is_taken_live(tmp_path) -> None:
    """nanochat's RustBPETokenizer holds a tiktoken Encoding (`.enc`) with its split pattern
    and the special tokens after the merges: passed as tokenizer=, special-token text in the
    rendered prompt reads as the special ids, and completions start with <|bos|>."""
    tiktoken = pytest.importorskip("tiktoken")
    split = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++"""
             r"""[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")
    ranks = {bytes([b]): b for b in range(256)}
    for word in (b"th", b"he", b"the", b" the", b"in", b"er", b"an", b"at"):
        ranks[word] = len(ranks)
    enc = tiktoken.Encoding(name="rustbpe", pat_str=split, mergeable_ranks=ranks,
                            special_tokens={s: len(ranks) + i
                                            for i, s in enumerate(SPECIAL_TOKENS)})

    class RustBPETokenizer:  # nanochat's wrapper: the Encoding as `.enc`
        def __init__(self, enc: Any):
            self.enc = enc

    module = tiny_gpt(enc.n_vocab, seed=10)  # nanochat's windows: what the meta JSON gives
    root = save_checkpoint(tmp_path / "d4", 7, module)
    loaded = load(str(root), tokenizer=RustBPETokenizer(enc), verbose=False)
    messages = CONVERSATION[:4]
    rendered = loaded.template.render(messages)
    want = render_conversation(CONVERSATION, enc.encode_ordinary, enc.encode_single_token,
                               for_completion=True)
    assert loaded.tokenizer.encode(rendered) == want
    text = "the other thing"
    assert loaded.tokenizer.encode(text, add_special_tokens=True) == \
        [enc.encode_single_token("<|bos|>"), *enc.encode_ordinary(text)]
    assert loaded.tokenizer.decode(want, skip_special_tokens=True) == \
        "".join(m["content"] + ("\n\n" if m["role"] == "system" else "") for m in messages)
    with Engine(loaded, max_batch=2, quiet=True) as engine:
        ids = enc.encode_ordinary("the cat")
        assert greedy(engine, ids, 6) == naive(module, ids, 6)
