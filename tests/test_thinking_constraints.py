"""Thinking models under constraints and tools: the thought is free text up to `</think>`, and
`response_format`, `tool_choice` ("required", a named function, "auto") apply after it. Over a
real server and the official openai SDK, streamed and not, a scripted model (its greedy answer
is the test's text, when the grammar allows it) under an R1-style template (the prompt opens
the thought) and Qwen3's own template (the model opens it) answers JSON in `content` and calls
in `tool_calls`, its thought in `reasoning_content`; the Responses API gives a reasoning item,
then the function call. A random-weight tiny model, made to close its thought by a
`logit_bias`, answers JSON after it. The grammars are checked token by token too."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from family_templates import FAMILIES, QWEN3_TEMPLATE, family_tokenizer, make_family_model_dir
from pydantic import BaseModel
from server_util import app_running, engine_running
from tiny_models import IM_END_ID, IM_START_ID
from torch import nn

from nbserve.engine import Engine
from nbserve.engine.constraints import grammar_text, grammars_for
from nbserve.engine.thoughts import after_thought
from nbserve.models.adapters import RecomputeAdapter
from nbserve.models.adopt import adopt
from nbserve.text import Tokenizer
from nbserve.text.reasoning import thought_rule
from nbserve.text.tool_calls import FORMATS
from nbserve.types import Constraint

# R1-style (the DeepSeek-R1 distills, QwQ): the generation prompt opens the thought
R1_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
               "<|im_end|>\n{% endfor %}<|im_start|>assistant\n{{ '<think>\\n' }}")
USER = [{"role": "user", "content": "Weather in Paris, as JSON?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
JSON_ANSWER = '{"city": "Paris", "sunny": true}'
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}


class Weather(BaseModel):
    city: str
    sunny: bool


class Scripted(nn.Module):
    """forward(idx) -> logits whose argmax, after the last <|im_start|> of a row, spells
    `script`, then <|im_end|> forever."""

    def __init__(self, script: list[int], vocab: int):
        super().__init__()
        self.script, self.vocab = script, vocab
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the adapter a device and dtype

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*idx.shape, self.vocab)
        for r, row in enumerate(idx.tolist()):
            after = None  # tokens since the marker
            for p, tok in enumerate(row):
                after = 0 if tok == IM_START_ID else None if after is None else after + 1
                k = -1 if after is None else after
                ok = 0 <= k < len(self.script)
                logits[r, p, self.script[k] if ok else IM_END_ID] = 100.0
        return logits


def qwen_tokenizer() -> Tokenizer:
    """The tiny tokenizer with Qwen's added tokens (<think>, </think>, <tool_call> ... plain)."""
    return Tokenizer(family_tokenizer(FAMILIES["qwen3"]), eos_token_ids=[IM_END_ID])


@contextlib.contextmanager
def thinker(template: str, answer: str, after_marker: str) -> Iterator[openai.OpenAI]:
    """An openai client of a server whose model writes `answer` after the generation prompt's
    `<|im_start|>` and `after_marker` (what the prompt writes after it)."""
    tokenizer = qwen_tokenizer()
    script = tokenizer.encode(after_marker) + tokenizer.encode(answer)
    vocab = tokenizer.vocab_size
    step = RecomputeAdapter(Scripted(script, vocab), max_context=512, vocab_size=vocab,
                            warn=False)
    with Engine(adopt(step, tokenizer, chat_template=template, name="thinker", verbose=False),
                max_batch=2, quiet=True) as engine, app_running(engine) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


def r1(answer: str) -> Any:
    return thinker(R1_TEMPLATE, answer, "assistant\n<think>\n")


def qwen3(answer: str) -> Any:
    return thinker(QWEN3_TEMPLATE, answer, "assistant\n")


def chat_both(client: openai.OpenAI, **kw: Any) -> list[dict[str, Any]]:
    """[the answer, the same reassembled from its stream] as {reasoning, content, calls,
    finish}: calls as (name, arguments) pairs."""
    kw = {"model": "", "messages": USER, "max_tokens": 120, **kw}
    msg = (r := client.chat.completions.create(**kw)).choices[0].message
    whole = {"reasoning": getattr(msg, "reasoning_content", None) or "",
             "content": msg.content, "finish": r.choices[0].finish_reason,
             "calls": [(c.function.name, json.loads(c.function.arguments))
                       for c in msg.tool_calls or ()]}
    thought, text, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            thought += getattr(ch.delta, "reasoning_content", None) or ""
            text += ch.delta.content or ""
            for c in ch.delta.tool_calls or ():
                name, args = calls.get(c.index, ("", ""))
                calls[c.index] = (name + (c.function.name or ""),
                                  args + (c.function.arguments or ""))
            finish = ch.finish_reason or finish
    streamed = {"reasoning": thought, "content": text or None, "finish": finish,
                "calls": [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))]}
    return [whole, streamed]


PARIS = [("get_weather", {"city": "Paris"})]


# ----------------------------------------------------------------------------- R1 style


def test_a_json_answer_comes_after_a_thought_the_prompt_opened() -> None:
    with r1("The user wants JSON.\n</think>\n\n" + JSON_ANSWER) as client:
        for got in chat_both(client, response_format=FORMAT):
            assert got == {"reasoning": "The user wants JSON.", "content": JSON_ANSWER,
                           "finish": "stop", "calls": []}
        parsed = client.chat.completions.parse(model="", messages=USER, max_tokens=120,
                                               response_format=Weather)
        assert parsed.choices[0].message.parsed == Weather(city="Paris", sunny=True)


@pytest.mark.parametrize("choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_call_comes_after_a_thought_the_prompt_opened(choice: Any) -> None:
    with r1("I should look it up.\n</think>\n\n" + CALL) as client:
        for got in chat_both(client, tools=[WEATHER], tool_choice=choice):
            assert got == {"reasoning": "I should look it up.", "content": None,
                           "finish": "tool_calls", "calls": PARIS}


def test_auto_lets_a_sentence_and_a_call_follow_a_thought_the_prompt_opened() -> None:
    with r1("I should look it up.\n</think>\n\nLet me check.\n" + CALL) as client:
        for got in chat_both(client, tools=[WEATHER]):
            assert got == {"reasoning": "I should look it up.", "content": "Let me check.\n",
                           "finish": "tool_calls", "calls": PARIS}


def test_a_thought_the_prompt_opened_must_close_before_a_json_answer() -> None:
    """The model never closes its thought: max_tokens cuts it, and no JSON is claimed."""
    with r1("hmm " * 60) as client:
        for got in chat_both(client, response_format=FORMAT, max_tokens=20):
            assert got["finish"] == "length" and not got["content"] and got["reasoning"]


# ----------------------------------------------------------------------------- Qwen3


def test_qwen3_calls_a_tool_after_it_thinks() -> None:
    with qwen3("<think>\nThe user asks for the weather.\n</think>\n\n" + CALL) as client:
        for got in chat_both(client, tools=[WEATHER]):
            assert got == {"reasoning": "The user asks for the weather.", "content": None,
                           "finish": "tool_calls", "calls": PARIS}


def test_qwen3_calls_a_tool_after_a_sentence() -> None:
    with qwen3("Let me check.\n" + CALL) as client:
        for got in chat_both(client, tools=[WEATHER]):
            assert got == {"reasoning": "", "content": "Let me check.\n",
                           "finish": "tool_calls", "calls": PARIS}


def test_qwen3_thinks_then_writes_a_sentence_then_calls_a_tool() -> None:
    with qwen3("<think>\nWeather.\n</think>\n\nLet me check.\n" + CALL) as client:
        for got in chat_both(client, tools=[WEATHER]):
            assert got == {"reasoning": "Weather.", "content": "Let me check.\n",
                           "finish": "tool_calls", "calls": PARIS}


@pytest.mark.parametrize("choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_qwen3_thinks_then_makes_the_call_required(choice: Any) -> None:
    with qwen3("<think>\nWeather.\n</think>\n\n" + CALL) as client:
        for got in chat_both(client, tools=[WEATHER], tool_choice=choice):
            assert got == {"reasoning": "Weather.", "content": None, "finish": "tool_calls",
                           "calls": PARIS}


def test_qwen3_answers_json_after_it_thinks() -> None:
    with qwen3("<think>\nJSON it is.\n</think>\n\n" + JSON_ANSWER) as client:
        for got in chat_both(client, response_format=FORMAT):
            assert got == {"reasoning": "JSON it is.", "content": JSON_ANSWER,
                           "finish": "stop", "calls": []}
        for got in chat_both(client, tools=[WEATHER], response_format=FORMAT):
            assert got["content"] == JSON_ANSWER and got["reasoning"] == "JSON it is."


def test_with_thinking_off_no_thought_comes_before_the_json() -> None:
    """reasoning_effort "none" turns Qwen3's thinking off: a thought is not allowed, the
    answer is JSON from its first token."""
    with qwen3("<think>\nI want to think.\n</think>\n\n" + JSON_ANSWER) as client:
        for got in chat_both(client, response_format=FORMAT, reasoning_effort="none",
                             temperature=0):
            assert got["reasoning"] == "" and got["finish"] == "stop"
            assert set(json.loads(got["content"])) == {"city", "sunny"}


# ----------------------------------------------------------------------------- Responses


@pytest.mark.parametrize("template", ["r1", "qwen3"])
def test_the_responses_api_gives_the_reasoning_item_then_the_function_call(template: str
                                                                          ) -> None:
    thought = "I should look it up.\n</think>\n\n"
    server = r1(thought + CALL) if template == "r1" else qwen3("<think>\n" + thought + CALL)
    tool = {"type": "function", **WEATHER["function"]}
    with server as client:
        for choice in ("auto", "required"):
            r = client.responses.create(model="", input=USER[0]["content"], tools=[tool],
                                        tool_choice=choice, max_output_tokens=120)
            assert [o.type for o in r.output] == ["reasoning", "function_call"]
            assert r.output[0].content[0].text == "I should look it up."
            assert r.output[1].name == "get_weather"
            assert json.loads(r.output[1].arguments) == {"city": "Paris"}
            events = list(client.responses.create(
                model="", input=USER[0]["content"], tools=[tool], tool_choice=choice,
                max_output_tokens=120, stream=True))
            done = events[-1].response
            assert [o.type for o in done.output] == ["reasoning", "function_call"]
            args = "".join(e.delta for e in events
                           if e.type == "response.function_call_arguments.delta")
            assert json.loads(args) == {"city": "Paris"}


# ----------------------------------------------------------------------------- random model


@pytest.fixture(scope="module")
def r1_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = dataclasses.replace(FAMILIES["qwen3"], template=R1_TEMPLATE)
    return make_family_model_dir(tmp_path_factory.mktemp("r1_tiny"), family)


@pytest.mark.slow
def test_a_random_model_that_closes_its_thought_answers_json(r1_tiny_dir: Path) -> None:
    """A random-weight model whose `</think>` a logit_bias makes likely: whatever it writes,
    the JSON is the content and the thought holds none of it."""
    close = qwen_tokenizer().encode("</think>")
    assert len(close) == 1
    with engine_running(r1_tiny_dir) as engine, app_running(engine) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        for got in chat_both(client, response_format=FORMAT, logit_bias={str(close[0]): 100},
                             seed=3, max_tokens=60):
            assert got["finish"] == "stop" and got["reasoning"] == ""
            assert set(json.loads(got["content"])) == {"city", "sunny"}


# ----------------------------------------------------------------------------- grammars


def _accepts(grammars: Any, grammar: str, text: str) -> bool:
    m = grammars.matcher(grammar, "x")
    ids = grammars.tokenizer.tokenize_str(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


@pytest.fixture(scope="module")
def grammars() -> Any:
    tok = qwen_tokenizer()
    return grammars_for(tok, tok.vocab_size, [IM_END_ID])


def test_the_rule_is_read_off_the_prompt_and_the_switch() -> None:
    assert thought_rule("<|im_start|>assistant\n<think>\n") == "open"
    assert thought_rule("<|im_start|>assistant\n<think>\n", thinking=False) == "open"
    assert thought_rule("<|im_start|>assistant\n") == "optional"
    assert thought_rule("<|im_start|>assistant\n", thinking=False) == "none"
    assert thought_rule("<|im_start|>assistant\n<think>\n\n</think>\n\n") == "none"


@pytest.mark.parametrize("kind,value,answer", [
    ("json_schema", SCHEMA, JSON_ANSWER), ("json_object", None, '{"a": 1}'),
    ("regex", "[0-9]{3}", "123"), ("choice", ["yes", "no"], "no"),
    ("grammar", 'start: "A" NUM\nNUM: /[0-9]+/', "A12")])
def test_every_constraint_applies_after_the_thought(grammars: Any, kind: str, value: Any,
                                                    answer: str) -> None:
    g = grammar_text(Constraint(kind, value, param="response_format"))
    opened = after_thought(g, "open", grammars.special_id)
    assert _accepts(grammars, opened, "a { not JSON </thin\n</think>\n\n" + answer)
    assert not _accepts(grammars, opened, answer)  # the prompt's thought must close
    assert not _accepts(grammars, opened, "x</think>\n" + answer + "</think>")
    optional = after_thought(g, "optional", grammars.special_id)
    assert _accepts(grammars, optional, "<think>\nhm\n</think>\n\n" + answer)
    assert _accepts(grammars, optional, answer)
    assert not _accepts(grammars, optional, "Sure! " + answer)
    assert after_thought(g, "none", grammars.special_id) == g


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_auto_tool_grammars_allow_text_then_calls(grammars: Any, fmt_name: str) -> None:
    fmt = FORMATS[fmt_name]
    tools = [WEATHER]
    obj = json.dumps({"name": "get_weather", fmt.args_key: {"city": "Paris"}})
    call = {"hermes": f"<tool_call>\n{obj}\n</tool_call>", "llama3_json": "<|python_tag|>" + obj,
            "mistral": f"[TOOL_CALLS][{obj}]", "phi4_mini": f"functools[{obj}]"}[fmt_name]
    auto = fmt.grammar(tools, special=grammars.special_id)
    assert _accepts(grammars, auto, "Let me check.\n" + call)
    assert _accepts(grammars, auto, call) and _accepts(grammars, auto, "Sunny.")
    assert not _accepts(grammars, auto, "Let me check.\n" + call + " Done.")
    wrapped = after_thought(auto, "optional", grammars.special_id)
    assert _accepts(grammars, wrapped, "<think>\nA call.\n</think>\n\n" + call)
    assert _accepts(grammars, wrapped, "<think>\nA call.\n</think>\n\nLet me check.\n" + call)
    required = after_thought(fmt.grammar(tools, required=True, special=grammars.special_id),
                             "open", grammars.special_id)
    assert _accepts(grammars, required, "A call.\n</think>\n\n" + call)
    assert not _accepts(grammars, required, "A call.\n</think>\n\nLet me check.\n" + call)


def test_markers_that_are_special_tokens_are_named_as_tokens() -> None:
    """A tokenizer whose <think> and </think> are special tokens: the grammar names them."""
    from tokenizers import AddedToken

    raw = family_tokenizer(FAMILIES["qwen3"])
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<think>", "</think>")])
    tok = Tokenizer(raw, eos_token_ids=[IM_END_ID])
    g = grammars_for(tok, tok.vocab_size, [IM_END_ID])
    assert g.special_id("</think>") is not None
    inner = grammar_text(Constraint("choice", ["yes", "no"], param="response_format"))
    opened = after_thought(inner, "open", g.special_id)
    assert f"<[{g.special_id('</think>')}]>" in opened
    assert _accepts(g, opened, "hm </thin\n</think>\n\nyes")
    optional = after_thought(inner, "optional", g.special_id)
    assert _accepts(g, optional, "<think>hm</think>\nno") and _accepts(g, optional, "no")
