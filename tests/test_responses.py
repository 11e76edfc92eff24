"""The Responses API with the real clients against a real server: the `openai` SDK's
`responses.create` (plain, streamed, with a function tool and a second call carrying
`function_call_output` by `previous_response_id` or in full, `text.format` through `parse`),
the stored responses' GET and DELETE, refusals naming their field, a thinking model's
reasoning item, and an `openai-agents` Agent with one function tool run by `Runner.run`
(tracing off), all with the default model (the thinker is scripted)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field
from server_util import app_running

pytestmark = pytest.mark.slow

ASK = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 24}}, "required": ["city"],
               "additionalProperties": False}, "strict": True}
EVENT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta"]


@pytest.fixture(scope="module")
def served(default_loaded: Any) -> Iterator[tuple[str, Any]]:
    from nbserve.engine import Engine

    with Engine(default_loaded, max_batch=8, quiet=True) as engine, \
            app_running(engine) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(served: tuple[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def test_a_plain_response_and_its_stream(client: openai.OpenAI) -> None:
    r = client.responses.create(model="", input=ASK, temperature=0, max_output_tokens=40)
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert "Paris" in r.output_text
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events = list(client.responses.create(model="", input=ASK, temperature=0,
                                          max_output_tokens=40, stream=True))
    names = [e.type for e in events]
    assert names[:5] == EVENT_ORDER and names[-4:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text


def test_a_cut_answer_is_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(model="", input=ASK, temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(model="", input=ASK, temperature=0,
                                          max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"


def test_a_function_call_then_its_output_by_previous_response_id(client: openai.OpenAI
                                                                 ) -> None:
    first = client.responses.create(model="", input="What's the weather in Paris?",
                                    tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, temperature=0)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_")
    output = {"type": "function_call_output", "call_id": call.call_id,
              "output": json.dumps({"temperature_c": 18})}
    second = client.responses.create(model="", previous_response_id=first.id, input=[output],
                                     tools=[WEATHER], temperature=0, max_output_tokens=40)
    assert second.status == "completed" and "18" in second.output_text
    # the same conversation sent in full, nothing stored
    again = client.responses.create(
        model="", input=[{"role": "user", "content": "What's the weather in Paris?"},
                         {"type": "function_call", "call_id": call.call_id,
                          "name": "get_weather", "arguments": call.arguments}, output],
        tools=[WEATHER], temperature=0, max_output_tokens=40, store=False)
    assert again.output_text == second.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(again.id)


def test_streamed_function_call_arguments(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="", input="Weather in Rome?", tools=[WEATHER],
                                          tool_choice="required", parallel_tool_calls=False,
                                          temperature=0, stream=True))
    names = [e.type for e in events]
    assert "response.function_call_arguments.delta" in names
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    assert deltas == done.arguments and json.loads(done.arguments)["city"]
    assert names[-1] == "response.completed"


class Capital(BaseModel):
    country: str = Field(max_length=30)
    capital: str = Field(max_length=30)


def test_text_format_is_enforced_through_parse(client: openai.OpenAI) -> None:
    r = client.responses.parse(model="", input="Give the capital of France.",
                               text_format=Capital, temperature=0, max_output_tokens=80)
    assert isinstance(r.output_parsed, Capital) and r.status == "completed"


def test_stored_responses_are_retrieved_and_deleted(client: openai.OpenAI) -> None:
    r = client.responses.create(model="", input=ASK, temperature=0, max_output_tokens=8)
    assert client.responses.retrieve(r.id).output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model="", input="Hi", previous_response_id=r.id)
    assert exc.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"tools": [{**WEATHER, "description": 5}]}, "tools[0].description"),
    ({"tools": [{**WEATHER, "parameters": "city"}]}, "tools[0].parameters"),
    ({"tools": [{**WEATHER, "strict": "yes"}]}, "tools[0].strict"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"text": {"format": {"type": "json_schema", "name": "x",
                          "schema": {"type": "object", "not": {}}}}}, "text.format.schema"),
])
def test_what_cannot_be_served_is_a_400_naming_it(client: openai.OpenAI, fields: dict[str, Any],
                                                   param: str) -> None:
    body = {"model": "", "input": "Hi", "max_output_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(**body)
    assert exc.value.body["param"] == param, exc.value.body
    assert client.responses.create(model="", input="Hi", max_output_tokens=2).status


def test_an_agents_sdk_agent_runs_a_tool_against_nbserve(served: tuple[str, Any]) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is 18 degrees and sunny in {city}."

    url, engine = served
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    agent = Agent(name="weather", instructions="Answer questions about the weather.",
                  tools=[get_weather],
                  model=OpenAIResponsesModel(model=engine.model_name, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=80))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert calls and calls[0] == "Paris"
    assert isinstance(result.final_output, str) and result.final_output


def test_a_thinking_models_thought_is_a_reasoning_item() -> None:
    """A scripted thinker (see test_reasoning.py): the thought streams as reasoning_text."""
    from test_reasoning import QWEN3_LIKE, scripted_server

    with scripted_server(QWEN3_LIKE, "<think>\nSix sevens.\n</think>\n\nIt is 42.") as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        r = sdk.responses.create(model="", input="6 x 7?", max_output_tokens=60)
        assert [o.type for o in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == "Six sevens." and r.output_text == "It is 42."
        assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
        events = list(sdk.responses.create(model="", input="6 x 7?", max_output_tokens=60,
                                           stream=True))
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert thought == "Six sevens."
        assert "response.reasoning_text.done" in [e.type for e in events]
