"""POST /v1/rerank over a real server on a real port with httpx (issue 43, point 4): a tiny
random Qwen3 with single "yes"/"no" tokens and Qwen3's own template. The prompt each document
becomes is Qwen3-Reranker's, rendered by the template (checked against transformers'
`apply_chat_template` and the model card's format); the scores equal the yes/no probability
transformers computes on the same prompt; order, top_n, return_documents, the aliases; bad
input is a 400 naming the field.

The scoring tests need the engine to serve `EmbedSpec(score_token_ids=...)` requests (the
`embed` branch of issue 43); until it does, they skip, saying so.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import transformers
from embed_models import save_qwen3
from server_util import app_running, engine_running

from nbserve.api.limits import Limits
from nbserve.api.rerank import judge_messages, judge_request, relevance, yes_no_ids
from nbserve.types import EmbedSpec, InvalidRequestError

QUERY = "What is the capital of China?"
DOCS = ["The capital of China is Beijing.",
        "Gravity is a force that attracts two bodies towards each other.",
        "def add(a, b):\n    return a + b",
        "Once upon a time, in a land far away, there lived a small dragon."]
TOLERANCE = 1e-4  # on a probability: float32 logits agree to ~1e-5 on this model
# Qwen3-Reranker's prompt as its model card builds it by hand (the reference the template must
# reproduce): prefix + "<Instruct>: ...\n<Query>: ...\n<Document>: ..." + suffix
CARD_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on "
               "the Query and the Instruct provided. Note that the answer can only be \"yes\" "
               "or \"no\".<|im_end|>\n<|im_start|>user\n")
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CARD_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_qwen3(tmp_path_factory.mktemp("qwen3-reranker"), seed=3,
                      max_position_embeddings=1024)


@pytest.fixture(scope="module")
def engine(reranker_dir: Path) -> Iterator[Any]:
    with engine_running(reranker_dir, max_context=1024) as eng:
        yield eng


@pytest.fixture(scope="module")
def url(engine: Any) -> Iterator[str]:
    with app_running(engine) as base:
        yield base


@pytest.fixture(scope="module")
def scores_served(engine: Any) -> None:
    """Skip unless the engine answers score_token_ids requests (the embed branch's work)."""
    probe = judge_request(QUERY, DOCS[0], None)
    probe.embed = EmbedSpec(score_token_ids=(1, 2))
    try:
        engine.submit(probe, lambda ev: None)
    except InvalidRequestError as exc:
        if "not served by this engine yet" in str(exc):
            pytest.skip("waits for the engine side of issue 43 (prefill-only requests)")
        raise  # served: the probe runs to its end, its events dropped


def post(url: str, body: dict[str, Any], path: str = "/v1/rerank") -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


# ----------------------------------------------------------------------------- the prompt


def test_each_document_is_qwen3_rerankers_prompt_from_the_template(
        engine: Any, reranker_dir: Path) -> None:
    hf_tok = transformers.AutoTokenizer.from_pretrained(reranker_dir)
    for instruction in (None, "Find the code that adds numbers"):
        req = judge_request(QUERY, DOCS[2], instruction)
        ids = engine.prompt_token_ids(req)
        want = hf_tok.apply_chat_template(judge_messages(QUERY, DOCS[2], instruction),
                                          add_generation_prompt=True, enable_thinking=False,
                                          tokenize=True, return_dict=False)
        assert ids == list(want)
        card = (CARD_PREFIX + f"<Instruct>: {instruction or CARD_INSTRUCTION}\n"
                f"<Query>: {QUERY}\n<Document>: {DOCS[2]}" + CARD_SUFFIX)
        assert engine.tokenizer.decode(ids) == card


def test_yes_and_no_are_the_tokenizers_single_tokens(engine: Any) -> None:
    no, yes = yes_no_ids(engine.tokenizer)
    assert engine.tokenizer.id_to_token(yes) == "yes" and engine.tokenizer.id_to_token(no) == "no"


def test_relevance_is_the_yes_part_of_a_softmax_over_no_and_yes() -> None:
    for no, yes in [(0.0, 0.0), (1.5, -2.0), (-3.0, 4.25), (800.0, -800.0), (-800.0, 800.0)]:
        want = torch.softmax(torch.tensor([no, yes], dtype=torch.float64), 0)[1].item()
        assert relevance(no, yes) == pytest.approx(want, abs=1e-12)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("body", "param"), [
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
    ({"query": QUERY, "documents": ["d"] * (Limits().max_prompts + 1)}, "documents"),
    ({"query": QUERY, "documents": DOCS, "top_k": 2}, "top_k"),
    ({"query": QUERY, "documents": [{"txt": "a"}]}, "documents"),
    ({"query": QUERY, "documents": "one document"}, "documents"),
    ({"documents": DOCS}, "query"),
    ({"query": QUERY, "documents": ["x" * (Limits().max_conversation_chars + 1)]},
     "documents[0]"),
])
def test_bad_input_is_a_400_naming_the_field(url: str, body: dict[str, Any], param: str) -> None:
    r = post(url, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(param), err


def test_another_model_name_is_a_404(url: str) -> None:
    r = post(url, {"model": "someone-else", "query": QUERY, "documents": DOCS})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_model_without_single_yes_no_tokens_is_refused(tiny_engine: Any) -> None:
    """The tiny Llama's tokenizer spells "yes" with two tokens: not a yes/no reranker."""
    with app_running(tiny_engine) as base:
        r = post(base, {"query": QUERY, "documents": DOCS})
    assert r.status_code == 400, r.text
    assert "not a yes/no reranker" in r.json()["error"]["message"]


# ----------------------------------------------------------------------------- scores


def reference_scores(model_dir: Path, query: str, docs: list[str],
                     instruction: str | None = None) -> list[float]:
    """transformers' yes/no probability at the last position of each judge prompt."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.float32).eval()
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    out = []
    for doc in docs:
        ids = tok.apply_chat_template(judge_messages(query, doc, instruction),
                                      add_generation_prompt=True, enable_thinking=False,
                                      tokenize=True, return_dict=False)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        out.append(torch.softmax(logits[[no, yes]].double(), 0)[1].item())
    return out


@pytest.mark.usefixtures("scores_served")
def test_scores_equal_transformers_yes_no_probability(url: str, reranker_dir: Path) -> None:
    want = reference_scores(reranker_dir, QUERY, DOCS)
    r = post(url, {"model": "", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    results = body["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
    for x in results:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=TOLERANCE)
        assert x["document"] == {"text": DOCS[x["index"]]}  # returned by default
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    assert body["id"].startswith("rerank-") and body["model"]


@pytest.mark.usefixtures("scores_served")
def test_an_instruction_changes_the_prompt_and_the_scores(url: str, reranker_dir: Path) -> None:
    instruction = "Find the code that adds numbers"
    want = reference_scores(reranker_dir, QUERY, DOCS, instruction)
    results = post(url, {"query": QUERY, "documents": DOCS,
                         "instruction": instruction}).json()["results"]
    for x in results:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=TOLERANCE)


@pytest.mark.usefixtures("scores_served")
def test_top_n_return_documents_objects_and_aliases(url: str) -> None:
    full = post(url, {"query": QUERY, "documents": DOCS}).json()
    top = post(url, {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
                     "return_documents": False}).json()
    assert [x["index"] for x in top["results"]] == [x["index"] for x in full["results"][:2]]
    assert all("document" not in x for x in top["results"])
    many = post(url, {"query": QUERY, "documents": DOCS, "top_n": 99}).json()
    assert len(many["results"]) == len(DOCS)
    for path in ("/rerank", "/v2/rerank"):
        alias = post(url, {"query": QUERY, "documents": DOCS}, path)
        assert alias.status_code == 200, alias.text
        assert [x["index"] for x in alias.json()["results"]] == \
            [x["index"] for x in full["results"]]


@pytest.mark.usefixtures("scores_served")
def test_a_headless_embedding_model_cannot_rerank(tmp_path: Path) -> None:
    bare = save_qwen3(tmp_path / "qwen3-embedding", bare=True)
    with engine_running(bare) as eng, app_running(eng) as base:
        r = post(base, {"query": QUERY, "documents": DOCS[:2]})
    assert r.status_code == 400, r.text
    assert "LM head" in r.json()["error"]["message"]


@pytest.mark.slow
def test_the_readme_snippet_on_the_default_model(default_loaded: Any) -> None:
    """The README's rerank snippet against the default chat model: it answers in the shape
    the snippet prints (scores are P(yes), between 0 and 1; the model is no reranker, so
    their order is not checked)."""
    from nbserve.engine import Engine

    with Engine(default_loaded, max_batch=2, quiet=True) as engine, app_running(engine) as url:
        r = httpx.post(url + "/v1/rerank", timeout=120, json={
            "query": "capital of China?", "top_n": 1,
            "documents": ["Beijing is the capital of China.", "Gravity attracts bodies."]})
    assert r.status_code == 200, r.text
    (best,) = r.json()["results"]
    assert best["index"] in (0, 1) and 0.0 < best["relevance_score"] < 1.0
    assert best["document"]["text"] in ("Beijing is the capital of China.",
                                        "Gravity attracts bodies.")
