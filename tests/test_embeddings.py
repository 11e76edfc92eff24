"""Embeddings (issue 43): prefill-only requests through the engine and POST /v1/embeddings.

A tiny random Qwen3 saved as a Hugging Face folder (the family Qwen3-Embedding is) serves
embeddings through the real OpenAI SDK on a real port; each vector equals transformers'
`AutoModel` (the backbone: hidden states after the final norm) pooled the same way and
L2-normalised, within TOL (float32 on both sides). Mean and first-token pooling are checked at
the engine level over a prompt longer than one prefill chunk; a chat answer and embeddings
computed in the same steps are both right; bad requests are 400s in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tokenizers
import tokenizers.processors
import torch
import torch.nn.functional as F
import transformers
from family_models import save_family_dir
from gguf_util import hf_dir_to_gguf
from server_util import app_running, wait_until
from tiny_models import ENDOFTEXT_ID, make_tiny_tokenizer

from nbserve.api.embeddings import embed_texts
from nbserve.api.limits import Limits
from nbserve.engine import Engine
from nbserve.loading import load
from nbserve.loading.hf_dir import load_hf_dir
from nbserve.models.adopt import adopt
from nbserve.models.pooling import Pooling
from nbserve.pool import Pool
from nbserve.types import (
    Delta,
    Embedded,
    EmbedSpec,
    Finished,
    InvalidRequestError,
    Request,
    SamplingParams,
    Started,
)

TOL = 1e-4  # absolute, per value, float32 against float32
CHUNK = 16  # prefill chunk: LONG spans several
LONG = "the quick brown fox jumps over the lazy dog and runs far away " * 4
TEXTS = ["Hello, world!", "def add(a, b):\n    return a + b", LONG]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 whose config declares Matryoshka training (`dimensions` cuts)."""
    root = save_family_dir("qwen3", tmp_path_factory.mktemp("qwen3-embed"))
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return root


@pytest.fixture(scope="module")
def backbone(qwen3_dir: Path) -> Any:
    """transformers' own Qwen3Model (no LM head) of the same folder, float32."""
    return transformers.AutoModel.from_pretrained(qwen3_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(qwen3_dir: Path) -> Iterator[Engine]:
    with Engine(load_hf_dir(qwen3_dir), max_batch=8, max_context=256, prefill_chunk=CHUNK,
                quiet=True) as eng:
        yield eng


@pytest.fixture(scope="module")
def url(engine: Engine) -> Iterator[str]:
    with app_running(engine) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


def reference(backbone: Any, ids: list[int], kind: str = "last", dims: int | None = None
              ) -> np.ndarray:
    """transformers' final-norm hidden states of `ids`, pooled, cut and normalised."""
    with torch.no_grad():
        h = backbone(torch.tensor([ids])).last_hidden_state[0].float()
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[kind]
    if dims is not None:
        v = v[:dims]
    return F.normalize(v, dim=0).numpy()


def ids_of(engine: Engine, text: str) -> list[int]:
    return engine.prompt_token_ids(Request(prompt=text))


def close(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


# ----------------------------------------------------------------------------- over HTTP


def test_float_embeddings_equal_transformers(client: openai.OpenAI, engine: Engine,
                                             backbone: Any) -> None:
    out = client.embeddings.create(model=engine.model_name, input=TEXTS,
                                   encoding_format="float")
    assert [d.index for d in out.data] == [0, 1, 2] and out.object == "list"
    assert out.model == engine.model_name
    lengths = [len(ids_of(engine, t)) for t in TEXTS]
    assert lengths[2] > 2 * CHUNK  # the long text is prefilled in several chunks
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(lengths)
    for d, text in zip(out.data, TEXTS):
        close(d.embedding, reference(backbone, ids_of(engine, text)))
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-5


def test_metrics_count_the_route(client: openai.OpenAI, url: str) -> None:
    def served() -> float:
        text = httpx.get(url + "/metrics").text
        found = re.search(r'nbserve_requests_total\{route="/v1/embeddings",status="200"\} '
                          r"(\S+)", text)
        return float(found.group(1)) if found else 0.0

    before = served()
    client.embeddings.create(model="", input="count me", encoding_format="float")
    assert served() == before + 1


def test_base64_embeddings(client: openai.OpenAI, url: str, engine: Engine,
                           backbone: Any) -> None:
    # the SDK asks for base64 by itself when no format is given, and decodes it
    out = client.embeddings.create(model="", input=TEXTS[0])
    close(out.data[0].embedding, reference(backbone, ids_of(engine, TEXTS[0])))
    # asked for explicitly, the SDK hands over the string: little-endian float32s
    raw = client.embeddings.create(model="", input=TEXTS[:2], encoding_format="base64")
    for d, text in zip(raw.data, TEXTS[:2]):
        assert isinstance(d.embedding, str)
        vec = np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
        close(vec, reference(backbone, ids_of(engine, text)))


def test_token_id_inputs(client: openai.OpenAI, engine: Engine, backbone: Any) -> None:
    ids = [ids_of(engine, t) for t in TEXTS[:2]]
    many = client.embeddings.create(model="", input=ids, encoding_format="float")
    one = client.embeddings.create(model="", input=ids[1], encoding_format="float")
    for d, row in zip(many.data, ids):
        close(d.embedding, reference(backbone, row))
    close(one.data[0].embedding, reference(backbone, ids[1]))
    assert one.usage.prompt_tokens == len(ids[1])


def test_dimensions_cut_and_renormalise(client: openai.OpenAI, engine: Engine,
                                        backbone: Any) -> None:
    out = client.embeddings.create(model="", input=TEXTS[:2], dimensions=16,
                                   encoding_format="float")
    for d, text in zip(out.data, TEXTS[:2]):
        assert len(d.embedding) == 16
        close(d.embedding, reference(backbone, ids_of(engine, text), dims=16))


def test_embeddings_and_chat_in_the_same_steps(url: str, engine: Engine,
                                               backbone: Any) -> None:
    chat = [{"role": "user", "content": "Tell me about the fox."}]

    async def answer(c: openai.AsyncOpenAI) -> str:
        r = await c.chat.completions.create(model="", messages=chat,  # type: ignore[arg-type]
                                            max_tokens=24, temperature=0)
        return r.choices[0].message.content or ""

    async def both() -> tuple[str, Any, str]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused",
                                      max_retries=0, timeout=60) as c:
            alone = await answer(c)
            mixed, emb = await asyncio.gather(answer(c), c.embeddings.create(
                model="", input=[LONG, TEXTS[0], LONG[:40]], encoding_format="float"))
            return alone, emb, mixed

    alone, emb, mixed = asyncio.run(both())
    assert mixed == alone and alone
    for d, text in zip(emb.data, [LONG, TEXTS[0], LONG[:40]]):
        close(d.embedding, reference(backbone, ids_of(engine, text)))


def test_a_client_that_leaves_cancels_its_inputs(url: str, engine: Engine) -> None:
    """200 prompts of ~230 tokens take the engine seconds (16 tokens a step); the client
    leaves after 0.3 s: the inputs in the engine are cancelled, the rest never start."""
    before = engine.stats()["requests_finished"]
    body = {"input": [f"{i} " + LONG * 2 for i in range(200)], "encoding_format": "float"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/embeddings", json=body, timeout=httpx.Timeout(10, read=0.3))
    assert wait_until(lambda: engine.stats()["running"] == engine.stats()["waiting"] == 0, 10)
    after = engine.stats()["requests_finished"]
    cancelled = after.get("cancelled", 0) - before.get("cancelled", 0)
    stopped = after.get("stop", 0) - before.get("stop", 0)
    assert cancelled >= 1 and cancelled + stopped < 200


def _bad(client: openai.OpenAI, **kw: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(**{"model": "", "encoding_format": "float", **kw})
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict) and body["message"]
    return body


def test_bad_requests_are_400s(client: openai.OpenAI, url: str) -> None:
    assert _bad(client, input=[])["param"] == "input"
    assert "empty" in _bad(client, input="")["message"]
    assert _bad(client, input=["fine", ""])["message"].startswith("input[1] is empty")
    assert _bad(client, input="x", dimensions=0)["param"] == "dimensions"
    body = _bad(client, input="x", dimensions=65)
    assert body["param"] == "dimensions" and "64" in body["message"]
    assert _bad(client, input="x", encoding_format="xml")["param"] == "encoding_format"
    body = _bad(client, input="x", extra_body={"pooling": "mean"})
    assert body["code"] == "unknown_parameter" and body["param"] == "pooling"
    assert "token ids must be integers" in _bad(client, input=[[10**6]])["message"]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="another-model", input="x")


def test_input_count_limit(engine: Engine) -> None:
    with app_running(engine, limits=Limits(max_embedding_inputs=2)) as base, \
            openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) as c:
        assert len(c.embeddings.create(model="", input=["a", "b"],
                                       encoding_format="float").data) == 2
        body = _bad(c, input=["a", "b", "c"])
        assert "limit is 2" in body["message"]


# ----------------------------------------------------------------------------- the engine


def _embed(engine: Engine, spec: EmbedSpec | None = None, **req: Any
           ) -> tuple[Started, list[float], Finished]:
    events = list(engine.stream(Request(embed=spec or EmbedSpec(), **req)))
    assert [type(e) for e in events] == [Started, Embedded, Finished]
    started, embedded, finished = events
    assert isinstance(started, Started) and isinstance(embedded, Embedded) and \
        isinstance(finished, Finished)
    assert finished.reason == "stop" and finished.usage.completion_tokens == 0
    return started, embedded.values, finished


@pytest.mark.parametrize("kind", ["mean", "cls"])
def test_whole_prompt_pooling_over_chunks(qwen3_dir: Path, backbone: Any, kind: str) -> None:
    loaded = dataclasses.replace(load_hf_dir(qwen3_dir), pooling=Pooling(kind, True))
    with Engine(loaded, max_batch=4, max_context=256, prefill_chunk=CHUNK,
                quiet=True) as eng:
        ids = ids_of(eng, LONG)
        assert len(ids) > 2 * CHUNK
        want = reference(backbone, ids, kind)
        first = _embed(eng, prompt=LONG)
        again = _embed(eng, prompt=LONG)  # its prefix is cached now: not taken (every state)
        assert first[0].cached_tokens == again[0].cached_tokens == 0
        close(first[1], want)
        close(again[1], want)
        close(eng.embed([LONG])[0], want)  # the notebook helper


def test_embeddings_beside_static_decode_steps(qwen3_dir: Path, engine: Engine,
                                               backbone: Any) -> None:
    """An engine that decodes at fixed shapes (`static_decode`, eager on CPU): a greedy answer
    decoding while embeddings prefill is the one the module's engine gives alone."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def answer(eng: Engine) -> list[int]:
        events = eng.stream(Request(prompt="Once upon a time", params=params))
        return [t for ev in events if isinstance(ev, Delta) for t in ev.token_ids]

    alone = answer(engine)
    with Engine(load_hf_dir(qwen3_dir), max_batch=8, max_context=256, prefill_chunk=CHUNK,
                static_decode=True, quiet=True) as eng:
        assert eng._step.static is not None
        chat = eng.stream(Request(prompt="Once upon a time", params=params))
        first = next(chat)  # admitted: it decodes while the embeddings prefill
        embeds = [eng.stream(Request(prompt=t, embed=EmbedSpec())) for t in TEXTS]
        tokens = [t for ev in [first, *chat] if isinstance(ev, Delta) for t in ev.token_ids]
        assert tokens == alone
        for events, text in zip(embeds, TEXTS):
            values = [ev.values for ev in events if isinstance(ev, Embedded)]
            close(values[0], reference(backbone, ids_of(eng, text)))


def test_a_text_ends_as_the_tokenizer_closes_it(qwen3_dir: Path, backbone: Any,
                                                tmp_path: Path) -> None:
    """A tokenizer.json whose post-processor appends <|endoftext|> (Qwen3-Embedding's): an
    embedded text ends with it (the model reads it as the sequence's summary); token ids are
    embedded as given, and a completion's prompt does not get it."""
    closed = tmp_path / "closed"
    shutil.copytree(qwen3_dir, closed)
    tok = tokenizers.Tokenizer.from_file(str(closed / "tokenizer.json"))
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", ENDOFTEXT_ID)])
    tok.save(str(closed / "tokenizer.json"))
    with Engine(load_hf_dir(closed), max_batch=2, max_context=256, quiet=True) as eng:
        assert eng.tokenizer.closing_ids == (ENDOFTEXT_ID,)
        ids = ids_of(eng, TEXTS[0])
        assert ids[-1] != ENDOFTEXT_ID  # raw prompts are encoded as before
        started, values, finished = _embed(eng, prompt=TEXTS[0])
        assert started.prompt_ids == ids + [ENDOFTEXT_ID]
        assert finished.usage.prompt_tokens == len(ids) + 1
        close(values, reference(backbone, ids + [ENDOFTEXT_ID]))
        _, as_given, _ = _embed(eng, prompt_ids=ids)
        close(as_given, reference(backbone, ids))


def test_last_token_pooling_reuses_a_cached_prefix(engine: Engine, backbone: Any) -> None:
    head = ids_of(engine, LONG)
    longer = head + ids_of(engine, "and comes back")
    _embed(engine, prompt_ids=head)
    started, values, _ = _embed(engine, prompt_ids=longer)
    assert started.cached_tokens >= CHUNK  # whole blocks of `head` served from the cache
    close(values, reference(backbone, longer))


def test_token_scores_equal_the_lm_heads_logits(engine: Engine, qwen3_dir: Path) -> None:
    lm = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir,
                                                           dtype=torch.float32).eval()
    ids = ids_of(engine, LONG)
    with torch.no_grad():
        want = lm(torch.tensor([ids])).logits[0, -1, [7, 3, 11]].numpy()
    _, values, _ = _embed(engine, EmbedSpec(score_token_ids=(7, 3, 11)), prompt_ids=ids)
    np.testing.assert_allclose(values, want, rtol=0, atol=TOL)


def test_refusals_at_submit(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="n must be 1"):
        engine.stream(Request(prompt="x", embed=EmbedSpec(), params=SamplingParams(n=2)))
    with pytest.raises(InvalidRequestError, match="log-probabilities"):
        engine.stream(Request(prompt="x", embed=EmbedSpec(),
                              params=SamplingParams(prompt_logprobs=1)))
    with pytest.raises(InvalidRequestError, match="score_token_ids"):
        engine.stream(Request(prompt="x", embed=EmbedSpec(score_token_ids=())))
    sys.path.insert(0, str(ROOT / "examples"))
    from custom_step_model import TinyGPT  # a user's StepModel: no hidden states

    loaded = adopt(TinyGPT(), make_tiny_tokenizer(), name="tiny-gpt", verbose=False)
    with Engine(loaded, max_batch=2, quiet=True) as own:
        with pytest.raises(InvalidRequestError, match="gives no hidden states"):
            own.stream(Request(prompt="x", embed=EmbedSpec()))
        _embed(own, EmbedSpec(score_token_ids=(1, 2)), prompt="x")  # its logits: served


def test_a_quantized_gguf_on_the_c_kernels(qwen3_dir: Path, backbone: Any,
                                          tmp_path: Path) -> None:
    """The same model as a Q8_0 GGUF, served from its blocks by the C kernels (8-bit
    activations, as llama.cpp): each vector within a cosine of 0.999 of the float one
    (measured: 0.9997 and above), for a one-token prompt, a short one, and one of several
    chunks."""
    loaded = load(str(hf_dir_to_gguf(qwen3_dir, tmp_path / "m.gguf", "Q8_0")), verbose=False)
    assert loaded.model.weight_format == "quantized"
    with Engine(loaded, max_batch=4, max_context=256, prefill_chunk=CHUNK, quiet=True) as eng:
        prompts = [[5], ids_of(eng, TEXTS[0]), ids_of(eng, LONG)]
        for row in prompts:
            _, values, _ = _embed(eng, prompt_ids=row)
            assert float(np.dot(values, reference(backbone, row))) > 0.999


def test_a_pool_forwards_embeddings(qwen3_dir: Path, backbone: Any) -> None:
    with Pool(load_hf_dir(qwen3_dir), devices=["cpu", "cpu"], max_batch=4, max_context=256,
              prefill_chunk=CHUNK, quiet=True) as pool:
        vectors, tokens = asyncio.run(embed_texts(pool, TEXTS * 2, request_id="pool"))
        ids = [ids_of_pool(pool, t) for t in TEXTS * 2]
        assert tokens == sum(len(i) for i in ids)
        for v, row in zip(vectors, ids):
            close(v, reference(backbone, row))
        close(pool.embed(TEXTS[1], dimensions=8)[0], reference(backbone, ids[1], dims=8))
        st = pool.stats()
        assert [r["in_flight"] for r in st["replicas"]] == [0, 0]
        assert st["requests_finished"].get("stop") == len(ids) + 1


def ids_of_pool(pool: Pool, text: str) -> list[int]:
    ids = pool.prompt_token_ids(Request(prompt=text))
    assert ids is not None
    return ids


# ----------------------------------------------------------------------------- the default model


@pytest.mark.slow
def test_default_model_readme_snippet(default_loaded: Any) -> None:
    with Engine(default_loaded, max_batch=4, max_context=512, quiet=True) as eng, \
            app_running(eng) as base, \
            openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                          timeout=120) as client:
        texts = ["The cat sat on the mat.", "A cat was sitting on the mat.",
                 "Quarterly revenue rose by four percent."]
        out = client.embeddings.create(model=eng.model_name, input=texts)
        vecs = np.array([d.embedding for d in out.data])
        assert vecs.shape == (3, 576)  # SmolLM2-135M's hidden size
        np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)
        similar, unrelated = vecs[0] @ vecs[1], vecs[0] @ vecs[2]
        assert similar > unrelated


def test_dimensions_need_a_model_trained_for_them(qwen3_dir: Path, tmp_path: Path) -> None:
    """Without is_matryoshka / matryoshka_dimensions in config.json, a shorter vector is a 400
    that says why; the full width is still accepted."""
    plain = tmp_path / "plain"
    shutil.copytree(qwen3_dir, plain)
    config = json.loads((plain / "config.json").read_text())
    del config["is_matryoshka"]
    (plain / "config.json").write_text(json.dumps(config))
    loaded = load_hf_dir(plain)
    assert not loaded.pooling.truncatable and load_hf_dir(qwen3_dir).pooling.truncatable
    with Engine(loaded, max_batch=2, max_context=256, quiet=True) as eng, \
            app_running(eng) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        body = _bad(client, input="x", dimensions=16)
        assert body["param"] == "dimensions" and "Matryoshka" in body["message"]
        full = client.embeddings.create(model="", input="x", dimensions=64)
        assert len(full.data[0].embedding) == 64
