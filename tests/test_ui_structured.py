"""The chat UI's structured answers: the "JSON answer" and "Tools" boxes, read and checked,
passed on to the engine, tool calls shown as such and sent back to the model as short notes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from server_util import engine_running
from test_ui import collect

from nbserve.serving.ui import FAILED_LINE, make_chat_fn
from nbserve.serving.ui_answer import (
    ERROR_PREFIX,
    THOUGHT_TITLE,
    TOOL_CALL_TITLE,
    to_messages,
    tool_call_message,
)
from nbserve.serving.ui_settings import JSON_BOX, TOOLS_BOX, answer_constraint, chat_tools
from nbserve.types import (
    BackendDefaults,
    Delta,
    Finished,
    InvalidRequestError,
    Request,
    Started,
    Usage,
)

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n' \
       '</tool_call>'


class Scripted(BackendDefaults):
    """A backend that writes the given chunks of text (in Hermes' tool-call format) and records
    the requests it was given."""

    model_name = "scripted"
    max_context = 4096

    def __init__(self, *chunks: str, reasoning: bool = False):
        self.chunks = chunks
        self.reasoning = reasoning
        self.requests: list[Request] = []

    async def generate(self, request: Request):
        self.requests.append(request)
        yield Started(request.request_id, 3, 0, tool_format="hermes", reasoning=self.reasoning)
        for i, chunk in enumerate(self.chunks):
            yield Delta(0, chunk, [i])
        yield Finished(0, "stop", Usage(3, len(self.chunks)))

    def stats(self) -> dict[str, Any]:
        return {"max_context": self.max_context}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Any) -> Iterator[Any]:
    with engine_running(tiny_llama_dir, max_batch=2, max_context=512) as e:
        yield e


# ----------------------------------------------------------------------------- the boxes


def test_the_json_answer_box_reads_free_text_any_object_or_a_schema():
    assert answer_constraint("") is None and answer_constraint("  \n") is None
    for text in ("json", " JSON ", "{}", "{ }"):
        c = answer_constraint(text)
        assert c is not None and (c.kind, c.value, c.param) == ("json_object", None, JSON_BOX)
    c = answer_constraint(json.dumps(PERSON))
    assert c is not None and (c.kind, c.value, c.param) == ("json_schema", PERSON, JSON_BOX)


@pytest.mark.parametrize("text, needle", [
    ('{"type": "object",', "not valid JSON"),
    ("[1, 2]", "a JSON schema is a JSON object"),
    ('"json"', "got a string"),
])
def test_a_bad_json_answer_box_is_an_error_naming_the_box(text: str, needle: str):
    with pytest.raises(InvalidRequestError) as exc:
        answer_constraint(text)
    assert str(exc.value).startswith(JSON_BOX + ": ") and needle in str(exc.value)
    assert exc.value.param == JSON_BOX


def test_the_tools_box_takes_openai_tools_or_bare_functions():
    assert chat_tools("") is None and chat_tools("   ") is None
    wrapped = {"type": "function", "function": WEATHER}
    assert chat_tools(json.dumps([WEATHER])) == [wrapped]
    assert chat_tools(json.dumps(wrapped)) == [wrapped]  # one tool, not in a list
    bare = chat_tools('[{"name": "now"}, {"type": "function", "function": {"name": "x", '
                      '"description": null}}]')
    assert bare == [{"type": "function", "function": {"name": "now"}},
                    {"type": "function", "function": {"name": "x"}}]


@pytest.mark.parametrize("text, needle", [
    ("[{name: 1}]", "not valid JSON"),
    ("[]", "with no tools"),
    ('"get_weather"', "got a string"),
    ('[{"description": "no name"}]', 'tool 1 needs a "name"'),
    ('[{"name": "a"}, {"name": "a"}]', "tool 2: another tool is named 'a'"),
    ('[{"type": "fn", "function": {"name": "a"}}]', 'must be {"type": "function"'),
    ('[{"name": "a", "parameter": {}}]', "unknown keys (parameter)"),
    ('[{"name": "a", "parameters": []}]', "parameters must be a JSON schema object"),
    ("[3]", "tool 1 is a number"),
])
def test_a_bad_tools_box_is_an_error_naming_the_box(text: str, needle: str):
    with pytest.raises(InvalidRequestError) as exc:
        chat_tools(text)
    assert str(exc.value).startswith(TOOLS_BOX + ": ") and needle in str(exc.value)


# ----------------------------------------------------------------------------- the chat function


@pytest.mark.parametrize("json_answer, tools", [("{oops", ""), ("", "[{}]")])
async def test_a_bad_box_is_shown_in_the_chat_and_nothing_is_generated(json_answer: str,
                                                                       tools: str):
    backend = Scripted("never")
    out = await collect(make_chat_fn(backend)("hi", [], "", 0.0, 1.0, 16, json_answer, tools))
    assert len(out) == 1 and out[0][1] == FAILED_LINE
    box = JSON_BOX if json_answer else TOOLS_BOX
    assert out[0][0].startswith(ERROR_PREFIX + box + ": ")
    assert backend.requests == []


async def test_the_boxes_go_on_the_request():
    backend = Scripted("ok")
    out = await collect(make_chat_fn(backend)("hi", [], "", 0.0, 1.0, 16, json.dumps(PERSON),
                                              json.dumps([WEATHER])))
    assert out[-1][0] == "ok"  # no calls: the answer is its text, as without tools
    req = backend.requests[0]
    assert req.params.constraint is not None and req.params.constraint.value == PERSON
    assert req.tools == [{"type": "function", "function": WEATHER}]
    assert req.tool_choice == "auto"
    await collect(make_chat_fn(backend, tool_choice="required")("hi", [], "", 0, 1, 16, "",
                                                                json.dumps([WEATHER])))
    assert backend.requests[1].tool_choice == "required"
    assert backend.requests[1].params.constraint is None


async def test_a_tool_call_is_shown_as_such_while_it_streams_and_at_the_end():
    chunks = ["Let me look. ", CALL[:30], CALL[30:60], CALL[60:]]
    chat = make_chat_fn(Scripted(*chunks))
    out = await collect(chat("Weather in Oslo?", [], "", 0.0, 1.0, 64, "", json.dumps([WEATHER])))
    assert out[0][0] == "Let me look. "
    streaming = [t for t, _ in out[:-1] if isinstance(t, list)]
    assert streaming[0][-1]["content"].startswith("```json\n{")  # shown while it streams
    final, speed = out[-1]
    assert "<tool_call>" not in json.dumps(final)
    assert final[0] == {"role": "assistant", "content": "Let me look."}
    call = final[1]
    assert call["metadata"] == {"title": TOOL_CALL_TITLE + "get_weather"}
    assert call["content"] == '```json\n{\n  "city": "Oslo",\n  "unit": "c"\n}\n```'
    assert "tokens/s" in speed and "1 tool call" in speed
    # the next turn: the model reads its call as a short note, after its text
    history = [{"role": "user", "content": "Weather in Oslo?"}, *final]
    assert to_messages("thanks", history) == [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant",
         "content": 'Let me look.\n\n(called get_weather with {"city": "Oslo", "unit": "c"})'},
        {"role": "user", "content": "thanks"},
    ]


async def test_a_thought_is_shown_collapsed_above_the_answer_and_not_sent_back():
    chunks = ["<thi", "nk>\nSix sev", "ens.\n</th", "ink>\n\nIt is ", "42."]
    chat = make_chat_fn(Scripted(*chunks, reasoning=True))
    out = await collect(chat("6 x 7?", [], "", 0.0, 1.0, 64, "", ""))
    final, _ = out[-1]
    assert final[0] == {"role": "assistant", "content": "Six sevens.",
                        "metadata": {"title": THOUGHT_TITLE, "status": "done"}}
    assert final[1] == {"role": "assistant", "content": "It is 42."}
    assert "<think>" not in json.dumps(final)
    history = [{"role": "user", "content": "6 x 7?"}, *final]
    assert to_messages("thanks", history)[1:] == [
        {"role": "assistant", "content": "It is 42."}, {"role": "user", "content": "thanks"}]


def test_tool_call_messages_from_the_browser_go_back_as_notes():
    """The chatbot's value as gradio hands it back: content as text parts, metadata with
    every key; an unfinished call keeps its arguments as written."""
    shown = tool_call_message("get_time", '{"zone": "UTC"}')
    cut = tool_call_message("get_time", '{"zone": "U')
    history = [{"role": "user", "content": [{"type": "text", "text": "time?"}]},
               {"role": "assistant", "content": [{"type": "text", "text": shown["content"]}],
                "metadata": {**shown["metadata"], "log": None, "status": None}},
               {"role": "assistant", "content": cut["content"], "metadata": cut["metadata"]},
               {"role": "assistant", "content": ERROR_PREFIX + "the engine was stopped"},
               {"role": "assistant", "content": "a thought", "metadata": {"title": "Thinking"}}]
    assert to_messages("again", history)[1:] == [
        {"role": "assistant", "content": '(called get_time with {"zone": "UTC"})\n\n'
                                         '(called get_time with {"zone": "U)\n\na thought'},
        {"role": "user", "content": "again"},
    ]


# ----------------------------------------------------------------------------- the tiny model


async def test_the_tiny_model_answers_in_the_schema_of_the_json_answer_box(engine: Any):
    """The random model writes noise: a valid answer is the grammar's doing."""
    out = await collect(make_chat_fn(engine)("Describe someone.", [], "", 0.0, 1.0, 96,
                                             json.dumps(PERSON)))
    text, speed = out[-1]
    jsonschema.validate(json.loads(text), PERSON)
    assert "tokens/s" in speed and "ended by" not in speed
    out = await collect(make_chat_fn(engine)("Anything.", [], "", 0.0, 1.0, 96, "json"))
    assert isinstance(json.loads(out[-1][0]), dict)


async def test_a_schema_the_engine_cannot_enforce_is_an_error_line_naming_the_box(engine: Any):
    schema = {"type": "object", "not": {"required": ["a"]}}
    out = await collect(make_chat_fn(engine)("hi", [], "", 0.0, 1.0, 16, json.dumps(schema)))
    assert out[-1][0].startswith(ERROR_PREFIX + JSON_BOX + ": ") and '"not"' in out[-1][0]
    assert out[-1][1] == FAILED_LINE


async def test_the_tiny_model_made_to_call_a_tool_shows_the_call(engine: Any):
    chat = make_chat_fn(engine, tool_choice="required")
    out = await collect(chat("Weather in Oslo?", [], "", 0.0, 1.0, 96, "", json.dumps([WEATHER])))
    final, speed = out[-1]
    assert isinstance(final, list) and "tool call" in speed, final
    calls = [m for m in final if m.get("metadata", {}).get("title", "").startswith(
        TOOL_CALL_TITLE)]
    assert calls and calls[0]["metadata"]["title"] == TOOL_CALL_TITLE + "get_weather"
    args = json.loads(calls[0]["content"].removeprefix("```json\n").removesuffix("\n```"))
    jsonschema.validate(args, WEATHER["parameters"])
