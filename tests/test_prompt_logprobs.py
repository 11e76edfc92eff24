"""Prompt log-probabilities for evals (`/v1/completions` with `echo` and `logprobs`, also with
`max_tokens: 0`) over a real server and the openai SDK: equal to `log_softmax` of transformers'
logits for the same tokens (float32, tiny model), the first token's null, the same when the
prompt's blocks are cached from an earlier request, streamed and not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import transformers
from server_util import app_running, engine_running

PROMPTS = ["Once upon a time there was a small fox who", "The capital of France is Paris"]


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path) -> Any:
    with engine_running(tiny_llama_dir) as engine, app_running(engine) as url:
        yield engine, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir,
                                                              dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return logprobs


def test_echoed_prompt_logprobs_equal_transformers(served: Any, reference: Any) -> None:
    engine, client = served
    for _ in range(2):  # the second time the prompts' blocks are in the cache
        r = client.completions.create(model="", prompt=PROMPTS, echo=True, logprobs=3,
                                      max_tokens=0)
        for prompt, choice in zip(PROMPTS, r.choices):
            ids = engine.tokenizer.encode(prompt, add_special_tokens=True)
            ref = reference(ids)
            lp = choice.logprobs
            assert choice.text == prompt and choice.finish_reason == "length"
            assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
            assert lp.top_logprobs[0] is None
            want = [ref[j, ids[j + 1]].item() for j in range(len(ids) - 1)]
            assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
            for j in range(1, len(ids)):  # the 3 most likely alternatives at each position
                top = ref[j - 1].topk(3)
                texts = [engine.tokenizer.decode([t]) for t in top.indices.tolist()]
                for text, value in zip(texts, top.values.tolist()):
                    if texts.count(text) == 1:  # OpenAI's legacy shape keys them by text
                        assert lp.top_logprobs[j][text] == pytest.approx(value, abs=1e-4)
            assert "".join(lp.tokens) == prompt and lp.text_offset[0] == 0
        assert r.usage.completion_tokens == 0


def test_prompt_then_answer_streamed_and_not(served: Any, reference: Any) -> None:
    engine, client = served
    kw: dict[str, Any] = dict(model="", prompt=PROMPTS[0], echo=True, logprobs=1,
                              max_tokens=4, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    ids = engine.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
    assert whole.text.startswith(PROMPTS[0]) and len(whole.logprobs.tokens) == len(ids) + 4
    tokens, values = [], []
    for c in client.completions.create(**kw, stream=True):
        for ch in c.choices:
            if ch.logprobs:
                tokens += ch.logprobs.tokens
                values += ch.logprobs.token_logprobs
    assert tokens == whole.logprobs.tokens
    assert values[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)
    offsets = whole.logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[len(ids)] == len(PROMPTS[0])


def test_a_scored_prompt_answered_with_one_token_runs_each_chunk_once(served: Any) -> None:
    """lm-eval asks for max_tokens 1 with echo and logprobs: the scored chunk samples the
    answer's one token, and must not run again as an ordinary chunk (it did, failing)."""
    engine, client = served
    before = engine.stats()["model_errors"]
    r = client.completions.create(model="", prompt=PROMPTS, echo=True, logprobs=1, max_tokens=1)
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    assert engine.stats()["model_errors"] == before


def test_max_tokens_zero_without_echo_and_logprobs_is_a_400(served: Any) -> None:
    _, client = served
    for kw in ({}, {"echo": True}, {"logprobs": 2}):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model="", prompt="Hi", max_tokens=0, **kw)
        assert exc.value.param == "max_tokens"
    assert client.completions.create(model="", prompt="Hi", max_tokens=1).choices
