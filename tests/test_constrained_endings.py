"""How a constrained answer ends, over a real server with the official openai SDK and the tiny
random model (whose answers are the grammar's doing): a stop string or a stop token is matched
only where the text before it is a whole answer, so an answer that says "stop" always matches
its constraint; `min_tokens` and `ignore_eos` hold the end back while the grammar lets the
answer go on, and the grammar's own end wins where it allows nothing more."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from tiny_models import IM_END_ID

from nbserve.types import Constraint, Delta, Request, SamplingParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}},
          "required": ["a"], "additionalProperties": False}
JSON_ANSWER = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA,
                                                      "strict": True}}
ASK = [{"role": "user", "content": "Answer."}]
NO_END = {str(IM_END_ID): -100}  # the model would rather not end
WANTS_END = {str(IM_END_ID): 100}  # the model would end at the first chance


@pytest.fixture(scope="module")
def client(server_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def chat(client: openai.OpenAI, stream: bool, **kw: Any) -> tuple[str, str, int]:
    """(content, finish_reason, completion tokens) of one chat answer, streamed or not."""
    kw = {"model": "", "messages": ASK, "temperature": 0, "max_tokens": 60, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        assert r.usage is not None
        return r.choices[0].message.content or "", r.choices[0].finish_reason, \
            r.usage.completion_tokens
    text, reason, tokens = "", "", -1
    for chunk in client.chat.completions.create(stream=True,
                                                stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, reason, tokens


def so(**constraint: Any) -> dict[str, Any]:
    return {"structured_outputs": constraint}


# ----------------------------------------------------------------------------- stop


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_inside_a_json_answer_is_not_matched(client: openai.OpenAI,
                                                           stream: bool) -> None:
    text, reason, _ = chat(client, stream, response_format=JSON_ANSWER, stop=[":", '"'])
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_sampled_json_answers_that_stop_match_their_schema_despite_stop_strings(
        client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="", messages=ASK, response_format=JSON_ANSWER,
                                       stop=[":", "a", " "], temperature=1.0, seed=5, n=4,
                                       max_tokens=60)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content or ""), SCHEMA)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_inside_a_choice_is_not_matched(client: openai.OpenAI,
                                                      stream: bool) -> None:
    text, reason, _ = chat(client, stream, stop=["e"],
                           extra_body=so(choice=["yes", "yeah"]))
    assert (text, reason) in (("yes", "stop"), ("yeah", "stop"))
    r = client.completions.create(model="", prompt="Yes?", stop=["e"], temperature=0,
                                  max_tokens=20, extra_body=so(choice=["yes", "yeah"]))
    assert r.choices[0].text in ("yes", "yeah") and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_ends_a_constrained_answer_where_it_is_whole(client: openai.OpenAI,
                                                                   stream: bool) -> None:
    """The model may not end after "yes" (bias), so only the stop string ends it there."""
    text, reason, _ = chat(client, stream, stop=[" "], logit_bias=NO_END,
                           extra_body=so(choice=["yes", "yes indeed"]))
    assert (text, reason) == ("yes", "stop")


def test_a_stop_token_inside_a_constrained_answer_is_text(client: openai.OpenAI,
                                                          tiny_engine: Any) -> None:
    """stop_token_ids holds a token from the middle of the greedy answer: it stays text."""
    req = Request(messages=ASK, params=SamplingParams(
        temperature=0, max_tokens=60, constraint=Constraint("json_schema", SCHEMA)))
    ids = [t for ev in tiny_engine.stream(req) if isinstance(ev, Delta) for t in ev.token_ids]
    inside = ids[len(ids) // 2]
    text, reason, _ = chat(client, False, response_format=JSON_ANSWER,
                           extra_body={"stop_token_ids": [inside]})
    assert reason == "stop" and text == tiny_engine.tokenizer.decode(ids)
    jsonschema.validate(json.loads(text), SCHEMA)


# ------------------------------------------------------------------- min_tokens, ignore_eos


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_min_tokens_holds_the_end_while_the_grammar_goes_on(client: openai.OpenAI,
                                                            stream: bool) -> None:
    """"yes" is two tokens; with min_tokens 4 the answer must take the longer choice."""
    text, reason, tokens = chat(client, stream, logit_bias=WANTS_END, extra_body={
        "min_tokens": 4, **so(choice=["yes", "yes, absolutely not"])})
    assert (text, reason) == ("yes, absolutely not", "stop") and tokens >= 4


def test_min_tokens_end_where_the_grammar_allows_nothing_more(client: openai.OpenAI) -> None:
    text, reason, tokens = chat(client, False, extra_body={"min_tokens": 8,
                                                           **so(choice=["yes", "no"])})
    assert text in ("yes", "no") and reason == "stop" and tokens < 8


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_ignore_eos_holds_the_end_while_the_grammar_goes_on(client: openai.OpenAI,
                                                            stream: bool) -> None:
    text, reason, _ = chat(client, stream, logit_bias=WANTS_END, extra_body={
        "ignore_eos": True, **so(regex="[a-z]{1,12}")})
    assert re.fullmatch("[a-z]{12}", text) and reason == "stop", text
    text, reason, tokens = chat(client, stream, logit_bias=WANTS_END, max_tokens=10,
                                extra_body={"ignore_eos": True, **so(regex="[a-z]+")})
    assert re.fullmatch("[a-z]+", text) and (reason, tokens) == ("length", 10), text
