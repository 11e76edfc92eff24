"""Tools: the parser (the tiny random model never emits calls, so it is tested directly), the
fallback that lists tools in the system prompt when the chat template ignores them (the tiny
model's SmolLM2-style template does), and a real call by the default model over the SDK."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from server_util import app_running, engine_running
from tiny_models import QWEN25_TEMPLATE

from nbserve.text import ChatTemplate
from nbserve.text.tool_calls import HERMES
from nbserve.types import Request


def parse_tool_calls(text: str, names: set[str] | None = None) -> tuple[str | None, list]:
    return HERMES.parse(text, names)


WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_hermes_block_becomes_a_tool_call() -> None:
    content, calls = parse_tool_calls(WEATHER)
    assert content is None
    assert len(calls) == 1
    call = calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert isinstance(call["function"]["arguments"], str)
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_several_blocks_text_around_and_unique_ids() -> None:
    text = "Let me check.\n" + WEATHER + "\n" + WEATHER.replace("Paris", "Oslo")
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Oslo"]
    assert calls[0]["id"] != calls[1]["id"]


def test_list_inside_one_block_and_string_arguments() -> None:
    text = ('<tool_call>[{"name": "a", "arguments": {"x": 1}}, '
            '{"name": "b", "arguments": "{\\"y\\": 2}"}]</tool_call>')
    _, calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"y": 2}


@pytest.mark.parametrize("text", [
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "argu',  # cut inside the call's header
    "plain answer with no call",
])
def test_unparseable_output_is_kept_as_content(text: str) -> None:
    content, calls = parse_tool_calls(text, {"f"})
    assert calls == [] and content == text


def test_bad_block_stays_next_to_a_good_one() -> None:
    bad = "<tool_call>oops</tool_call>"
    content, calls = parse_tool_calls(bad + WEATHER)
    assert len(calls) == 1 and content == bad


def test_a_call_cut_after_its_arguments_is_still_a_call() -> None:
    """The arguments streamed whole before max_tokens cut the block: the call stands (its
    deltas were already sent), and the answer's finish_reason says "length"."""
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}', {"f"})
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1', {"f"})
    assert calls[0]["function"]["arguments"] == '{"x": 1'  # as OpenAI streams a cut call


def test_llama_json_form_needs_a_known_tool_name() -> None:
    from nbserve.text.tool_calls import LLAMA3_JSON
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    content, calls = LLAMA3_JSON.parse(text, {"get_weather"})
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    content, calls = LLAMA3_JSON.parse(text, {"other_tool"})
    assert calls == [] and content == text
    assert LLAMA3_JSON.parse(text, None) == (text, [])


def _stream(parts: list[str], names: set[str] | None = None, parallel: bool = True, fmt=HERMES):
    p = fmt.parser(names or {"get_weather"}, parallel)
    pieces = [x for part in parts for x in p.feed(part)]
    shown = "".join(x.text for x in pieces if x.kind == "content")
    tail = "".join(x.text for x in p.finish() if x.kind == "content")
    return shown, tail, p.calls


def test_stream_passes_text_and_holds_the_call() -> None:
    text = "Sure. " + WEATHER
    parts = [text[i:i + 3] for i in range(0, len(text), 3)]  # marker split across pieces
    shown, tail, calls = _stream(parts)
    assert shown == "Sure. "
    assert tail == "" and len(calls) == 1


def test_stream_without_calls_shows_everything() -> None:
    text = "No tools needed: a < b and <tool is not a tag."
    shown, tail, calls = _stream([text[i:i + 2] for i in range(0, len(text), 2)])
    assert shown + tail == text and calls == []


def test_stream_bad_call_comes_back_as_content() -> None:
    text = "<tool_call>{broken</tool_call> done"
    shown, tail, calls = _stream([text[:5], text[5:]])
    assert calls == [] and shown + tail == text


def test_stream_parallel_false_keeps_the_first_call() -> None:
    _, _, calls = _stream([WEATHER + WEATHER.replace("Paris", "Rome")], parallel=False)
    assert len(calls) == 1 and "Paris" in calls[0]["function"]["arguments"]


def test_stream_llama_form() -> None:
    from nbserve.text.tool_calls import LLAMA3_JSON
    shown, tail, calls = _stream(['  {"name": "get_weather", ', '"parameters": {"city": "X"}}'],
                                 fmt=LLAMA3_JSON)
    assert shown == "" and tail == "" and calls[0]["function"]["name"] == "get_weather"


# ----------------------------------------------------------------------------- tools fallback

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ROUND_TRIP = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
    {"role": "assistant", "content": "It is 18 degrees in Paris."},
    {"role": "user", "content": "And in Rome?"}]


def prompt_of(engine: Any, messages: list[dict[str, Any]], tools: Any = None) -> str:
    """The prompt the engine builds, as text."""
    return engine.tokenizer.decode(engine.prepare_prompt(Request(messages=messages, tools=tools)))


@pytest.fixture(scope="module")
def long_engine(tiny_llama_dir: Path) -> Any:
    """The tiny model (SmolLM2-style template, which ignores tools) with room for a tool list."""
    with engine_running(tiny_llama_dir, max_context=512) as engine:
        yield engine


def test_a_template_that_ignores_tools_gets_them_in_the_system_prompt(long_engine: Any) -> None:
    plain = prompt_of(long_engine, ASK)
    text = prompt_of(long_engine, ASK, [TOOL])
    assert text != plain
    assert "# Tools" in text and "<tools>\n" + json.dumps(TOOL) + "\n</tools>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n' \
        "</tool_call>" in text
    assert text.count("<|im_start|>system") == 1  # the tools replace the default system prompt
    assert text.endswith("<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
                         "<|im_start|>assistant\n")


def test_the_fallback_keeps_the_system_message_and_writes_the_calls_of_the_history(
        long_engine: Any) -> None:
    system = [{"role": "system", "content": "You are terse."}]
    text = prompt_of(long_engine, system + ROUND_TRIP, [TOOL])
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' \
        '{"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert '<|im_start|>tool\n<tool_response>\n{"temperature": 18}\n</tool_response>' \
        "<|im_end|>" in text


def test_the_fallback_reaches_the_prompt_over_http(client: openai.OpenAI) -> None:
    def prompt_tokens(**kw: Any) -> int:
        r = client.chat.completions.create(model="", messages=ASK, max_tokens=1, **kw)
        return r.usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(tools=[TOOL]) > plain + 40
    assert prompt_tokens(tools=[TOOL], tool_choice="none") == plain


def test_a_template_that_renders_tools_is_left_alone() -> None:
    text = ChatTemplate(QWEN25_TEMPLATE).render(ROUND_TRIP, tools=[TOOL])
    assert text.count("# Tools") == 1 and text.count(json.dumps(TOOL)) == 1
    assert text.startswith("<|im_start|>system\nYou are Qwen")  # its own system prompt
    # its own way of writing the history: the tool result as a user turn
    assert "<|im_start|>user\n<tool_response>\n" in text and "<|im_start|>tool" not in text


@pytest.fixture(scope="module")
def client(long_engine: Any) -> Any:
    with app_running(long_engine) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
def test_the_default_model_calls_a_tool_through_the_fallback(default_loaded: Any) -> None:
    """SmolLM2-135M-Instruct's template ignores tools: the fallback lists them, and with two
    earlier calls in the conversation the model writes a third, which comes back as
    `tool_calls` over the official SDK."""
    from nbserve.engine import Engine

    def turn(city: str, degrees: int) -> list[dict[str, Any]]:
        call_id = f"call_{city.lower()}"
        return [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": call_id,
             "content": json.dumps({"temperature": degrees})},
            {"role": "assistant", "content": f"It is {degrees} degrees in {city}."}]

    messages = turn("Paris", 18) + turn("Rome", 25) + [
        {"role": "user", "content": "What is the weather in Tokyo?"}]
    with Engine(default_loaded, max_batch=2, quiet=True) as engine:
        assert "<tools>\n" + json.dumps(TOOL) + "\n</tools>" in prompt_of(engine, messages,
                                                                          [TOOL])
        with app_running(engine) as url:
            sdk = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            r = sdk.chat.completions.create(model="", messages=messages, tools=[TOOL],
                                            temperature=0, max_tokens=60)
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_weather"
            assert json.loads(call.function.arguments) == {"city": "Tokyo"}
            chunks = list(sdk.chat.completions.create(model="", messages=messages,
                                                      tools=[TOOL], temperature=0,
                                                      max_tokens=60, stream=True))
            streamed = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls
                        or []]
            assert [tc.function.name for tc in streamed if tc.id] == ["get_weather"]
            assert "".join(tc.function.arguments or "" for tc in streamed) == \
                call.function.arguments
