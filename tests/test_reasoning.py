"""Thoughts apart from the answer: a scripted model whose chat template uses thinking tags
writes `<think>...</think>` and an answer; over a real server and the openai SDK the thought
comes back in `reasoning_content` (and `reasoning`), not in `content`, streamed and not; a
template that opens the thought itself (the R1 distills) is read from inside it;
`reasoning_effort` reaches the template's `enable_thinking`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from server_util import app_running
from test_answer_endings import VOCAB, ScriptedModel
from tiny_models import IM_END_ID, make_tiny_tokenizer

from nbserve.engine import Engine
from nbserve.models.adapters import RecomputeAdapter
from nbserve.models.adopt import adopt
from nbserve.text import Tokenizer
from nbserve.text.reasoning import ReasoningSplitter

# Qwen3-like: the answer starts after <|im_start|>; "no thinking" writes an empty thought
QWEN3_LIKE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
              "{% if enable_thinking is defined and enable_thinking is false %}NOTHINK"
              "{% endif %}<|im_start|>{# <think> #}")
# R1-like: the prompt opens the thought (jinja drops a template's last newline)
R1_LIKE = "{% for m in messages %}{{ m['content'] }}{% endfor %}<|im_start|><think>"
USER = [{"role": "user", "content": "What is 6 times 7?"}]


@contextlib.contextmanager
def scripted_server(template: str, answer: str, after_marker: str = "") -> Iterator[str]:
    """The URL of a server whose scripted model writes `answer` after the template's last
    <|im_start|> (what the prompt itself writes after it, `after_marker`, comes first)."""
    tokenizer = Tokenizer(make_tiny_tokenizer(), eos_token_ids=[IM_END_ID])
    script = tokenizer.encode(after_marker) + tokenizer.encode(answer)
    step = RecomputeAdapter(ScriptedModel(script), max_context=256, vocab_size=VOCAB, warn=False)
    with Engine(adopt(step, tokenizer, chat_template=template, name="thinker", verbose=False),
                max_batch=2, quiet=True) as engine, app_running(engine) as url:
        yield url


@pytest.fixture
def serve() -> Iterator[Any]:
    """serve(template, answer) -> an openai client of a server whose model writes `answer`."""
    with contextlib.ExitStack() as stack:

        def start(template: str, answer: str, after_marker: str = "") -> openai.OpenAI:
            url = stack.enter_context(scripted_server(template, answer, after_marker))
            return stack.enter_context(openai.OpenAI(base_url=url + "/v1", api_key="unused",
                                                     max_retries=0))

        yield start


def both(client: openai.OpenAI, **kw: Any) -> tuple[tuple[str, str], tuple[str, str]]:
    """((reasoning, content) of the answer, the same reassembled from its stream)."""
    r = client.chat.completions.create(model="", messages=USER, max_tokens=60, **kw)
    msg = r.choices[0].message
    assert getattr(msg, "reasoning", None) == getattr(msg, "reasoning_content", None)
    whole = (getattr(msg, "reasoning_content", None) or "", msg.content or "")
    thought, text = "", ""
    for chunk in client.chat.completions.create(model="", messages=USER, max_tokens=60,
                                                stream=True, **kw):
        for ch in chunk.choices:
            thought += getattr(ch.delta, "reasoning_content", None) or ""
            text += ch.delta.content or ""
    return whole, (thought, text)


def test_the_thought_is_apart_from_the_answer(serve: Any) -> None:
    client = serve(QWEN3_LIKE, "<think>\nSix sevens: 42.\n</think>\n\nIt is 42.")
    whole, streamed = both(client)
    assert whole == streamed == ("Six sevens: 42.", "It is 42.")


def test_a_template_that_opens_the_thought_is_read_from_inside_it(serve: Any) -> None:
    client = serve(R1_LIKE, "\nSix sevens.\n</think>\n\nIt is 42.", after_marker="<think>")
    whole, streamed = both(client)
    assert whole == streamed == ("Six sevens.", "It is 42.")


def test_a_thought_cut_by_max_tokens_is_all_reasoning(serve: Any) -> None:
    client = serve(QWEN3_LIKE, "<think>\n" + "hmm " * 40 + "</think>\n\nIt is 42.")
    r = client.chat.completions.create(model="", messages=USER, max_tokens=16)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and not msg.content
    assert msg.reasoning_content.startswith("hmm h")


def test_an_answer_without_a_thought_is_all_content(serve: Any) -> None:
    client = serve(QWEN3_LIKE, "It is 42, <think> is a tag.")
    whole, streamed = both(client)
    assert whole == streamed == ("", "It is 42, <think> is a tag.")


def test_reasoning_effort_reaches_the_templates_switch(serve: Any) -> None:
    client = serve(QWEN3_LIKE, "<think>\nok\n</think>\n\nIt is 42.")

    def prompt_tokens(**kw: Any) -> int:
        return client.chat.completions.create(model="", messages=USER, max_tokens=1,
                                              **kw).usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(reasoning_effort="none") > plain  # NOTHINK rendered
    assert prompt_tokens(reasoning_effort="high") == plain
    assert prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}}) > plain
    with pytest.raises(openai.BadRequestError) as exc:
        prompt_tokens(reasoning_effort="extreme")
    assert exc.value.param == "reasoning_effort"


def test_a_model_without_thinking_tags_keeps_its_message_shape(serve: Any) -> None:
    client = serve("{% for m in messages %}{{ m['content'] }}{% endfor %}<|im_start|>",
                   "<think>not a thinker</think>")
    msg = client.chat.completions.create(model="", messages=USER, max_tokens=30).choices[0]
    assert msg.message.content == "<think>not a thinker</think>"
    assert getattr(msg.message, "reasoning_content", None) is None


@pytest.mark.parametrize("step", [1, 2, 5, 100])
def test_the_splitter_gives_the_same_split_whatever_the_pieces(step: int) -> None:
    text = "\n<think>\nfirst\n\nsecond\n</think>\n\nanswer </think> stays"
    s = ReasoningSplitter()
    parts = [s.feed(text[i:i + step]) for i in range(0, len(text), step)] + [s.finish()]
    assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == \
        ("first\n\nsecond", "answer </think> stays")


def test_an_earlier_thought_sent_back_reaches_the_template() -> None:
    """An assistant turn's `reasoning_content` (or `reasoning`) is accepted and rendered by a
    template that uses it (Qwen3's keeps the thoughts after the last user turn)."""
    import httpx

    template = ("{% for m in messages %}{% if m.reasoning_content %}[T:{{ m.reasoning_content }}]"
                "{% endif %}{{ m['content'] }}|{% endfor %}<|im_start|>")
    turns = [*USER, {"role": "assistant", "content": "42", "reasoning_content": "6*7"},
             {"role": "user", "content": "and 6 times 8?"}]
    with scripted_server(template, "48") as url:
        for key in ("reasoning_content", "reasoning"):
            sent = [dict(t) for t in turns]
            if key == "reasoning":
                sent[1]["reasoning"] = sent[1].pop("reasoning_content")
            ids = httpx.post(url + "/tokenize", json={"messages": sent}).json()["tokens"]
            text = httpx.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"]
            assert "[T:6*7]42|" in text, text
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="", messages=turns, max_tokens=8)  # type: ignore[arg-type]
        assert r.choices[0].message.content == "48"
