"""Tool-call parsing (the tiny random model never emits calls, so the parser is tested directly)."""

from __future__ import annotations

import json

import pytest

from nbserve.api.tools import ToolCallStream, parse_tool_calls

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
    '<tool_call>{"name": "f", "arguments": {"x": 1}}',  # never closed (cut by max_tokens)
    "plain answer with no call",
])
def test_unparseable_output_is_kept_as_content(text: str) -> None:
    content, calls = parse_tool_calls(text, {"f"})
    assert calls == [] and content == text


def test_bad_block_stays_next_to_a_good_one() -> None:
    bad = "<tool_call>oops</tool_call>"
    content, calls = parse_tool_calls(bad + WEATHER)
    assert len(calls) == 1 and content == bad


def test_llama_json_form_needs_a_known_tool_name() -> None:
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    content, calls = parse_tool_calls(text, {"get_weather"})
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    content, calls = parse_tool_calls(text, {"other_tool"})
    assert calls == [] and content == text
    assert parse_tool_calls(text, None) == (text, [])


def _stream(parts: list[str], names: set[str] | None = None, parallel: bool = True):
    s = ToolCallStream(names or {"get_weather"}, parallel)
    shown = "".join(s.feed(p) for p in parts)
    tail, calls = s.finish()
    return shown, tail, calls


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
    shown, tail, calls = _stream(['  {"name": "get_weather", ', '"parameters": {"city": "X"}}'])
    assert shown == "" and tail == "" and calls[0]["function"]["name"] == "get_weather"
