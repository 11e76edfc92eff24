"""Structured outputs and enforced tool calls with the real default model (SmolLM2-135M), over
a real server and the official `openai` SDK: `chat.completions.parse` with pydantic models of
increasing shape, `tool_choice` required / named / `parallel_tool_calls=False` at temperature 1,
streamed tool-call deltas against the non-streamed call, `/v1/completions`' structured_outputs
extension, and a property test over generated JSON schemas."""

from __future__ import annotations

import contextlib
import enum
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field
from server_util import app_running

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_engine(default_loaded: Any) -> Iterator[Any]:
    from nbserve.engine import Engine

    with Engine(default_loaded, max_batch=32, quiet=True) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(default_engine: Any) -> Iterator[openai.OpenAI]:
    with app_running(default_engine) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


# ----------------------------------------------------------------------------- parse()


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)


class Person(BaseModel):  # flat
    name: str = Field(max_length=30)
    age: int


class Trip(BaseModel):  # nested
    traveller: Person
    destination: City


class Item(BaseModel):
    name: str = Field(max_length=20)
    quantity: int


class ShoppingList(BaseModel):  # a list of objects
    items: list[Item] = Field(max_length=5)


class Mood(str, enum.Enum):
    happy = "happy"
    sad = "sad"
    calm = "calm"


class Diary(BaseModel):  # enums
    mood: Mood
    weather: Literal["sunny", "rainy", "cloudy"]


class Contact(BaseModel):  # optional fields
    name: str = Field(max_length=30)
    email: str | None = Field(max_length=40)
    phone: str | None = Field(max_length=20)


PARSE_CASES: list[tuple[type[BaseModel], str]] = [
    (Person, "Invent a person: a name and an age."),
    (Trip, "Invent a trip: who travels (name, age) and to which city and country."),
    (ShoppingList, "Write a short shopping list with quantities."),
    (Diary, "How was your day? Give your mood and the weather."),
    (Contact, "Invent a contact card; leave out what you do not know."),
]


@pytest.mark.parametrize("model,ask", PARSE_CASES, ids=[m.__name__ for m, _ in PARSE_CASES])
def test_parse_returns_objects_of_each_pydantic_model(client: openai.OpenAI,
                                                      model: type[BaseModel], ask: str) -> None:
    r = client.chat.completions.parse(model="", messages=[{"role": "user", "content": ask}],
                                      response_format=model, temperature=0.7, seed=1,
                                      max_tokens=200, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, model), choice.message
        assert model.model_validate_json(choice.message.content) == choice.message.parsed


def test_a_cut_json_answer_makes_parse_raise_its_length_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model="", messages=[{"role": "user", "content": "Hi"}],
                                      response_format=Trip, temperature=0, max_tokens=6)


def test_json_object_answers_are_json_objects(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        response_format={"type": "json_object"}, temperature=1.0, seed=3, n=4, max_tokens=120)
    done = [c for c in r.choices if c.finish_reason == "stop"]
    assert done  # free keys and strings may run to max_tokens (the engine tests check each token)
    for c in r.choices:
        assert c.message.content.startswith("{") and c.finish_reason in ("stop", "length")
    for c in done:
        assert isinstance(json.loads(c.message.content), dict)


# ----------------------------------------------------------------------------- loops


class Town(BaseModel):
    name: str
    country: str
    population: int


class Resident(BaseModel):  # a town nested
    name: str
    age: int
    town: Town


class Color(BaseModel):
    name: str
    hex: str


class Palette(BaseModel):
    title: str
    colors: list[Color]


@pytest.mark.parametrize("model,ask", [(Town, "Tell me about Paris."),
                                       (Resident, "Invent a person who lives in a city.")],
                         ids=["flat", "nested"])
def test_parse_gets_a_greedy_answer_whose_integer_would_run_on(client: openai.OpenAI,
                                                               model: type[BaseModel],
                                                               ask: str) -> None:
    """Greedy, the default model writes `"population": 1111…` until max_tokens; the grammar
    bounds an integer the schema leaves unbounded to |x| <= 2**53 - 1."""
    r = client.chat.completions.parse(model="", messages=[{"role": "user", "content": ask}],
                                      response_format=model, temperature=0, max_tokens=200)
    parsed = r.choices[0].message.parsed
    assert r.choices[0].finish_reason == "stop" and isinstance(parsed, model)
    town = parsed if isinstance(parsed, Town) else parsed.town
    assert abs(town.population) <= 2**53 - 1


PALETTE_ASK = [{"role": "user", "content": "Make a color palette for a beach house."}]


def test_greedy_the_default_model_repeats_a_list_item_until_max_tokens(
        client: openai.OpenAI) -> None:
    """The loop that the penalties below break (an unbounded list: no grammar ends it)."""
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model="", messages=PALETTE_ASK, response_format=Palette,
                                      temperature=0, max_tokens=200)


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 1.0}, {"presence_penalty": 1.0},
                                     {"extra_body": {"repetition_penalty": 1.1}}],
                         ids=["frequency", "presence", "repetition"])
def test_a_sampling_penalty_breaks_a_loop_under_a_constraint(client: openai.OpenAI,
                                                             penalty: dict[str, Any]) -> None:
    r = client.chat.completions.parse(model="", messages=PALETTE_ASK, response_format=Palette,
                                      temperature=0, max_tokens=200, **penalty)
    parsed = r.choices[0].message.parsed
    assert r.choices[0].finish_reason == "stop" and isinstance(parsed, Palette)
    assert 1 <= len(parsed.colors) <= 8


def test_the_readme_structured_output_example_prints_what_it_says(
        client: openai.OpenAI) -> None:
    """README.md's `parse` example, run as written against a real server of the default
    model: it prints the line its last comment shows."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S)
                 if "chat.completions.parse(" in b)
    *_, expected = block.rstrip().splitlines()
    assert expected.startswith("# ")
    code = block.replace("http://127.0.0.1:8000/v1", str(client.base_url).rstrip("/"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    assert out.getvalue().strip() == expected[2:]


# ----------------------------------------------------------------------------- tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False},
    "strict": True}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone.",
    "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "description": "An IANA zone, e.g. Europe/Paris",
                 "maxLength": 24}},
        "required": ["zone"], "additionalProperties": False},
    "strict": True}}
ASK = [{"role": "user", "content": "What's the weather like in Paris right now?"}]


def _many(client: openai.OpenAI, total: int, max_tokens: int = 160, **kw: Any) -> list[Any]:
    """`total` sampled choices: concurrent requests of n=5 (the server's limit is 8), each with
    its own seed, so that the batch holds them all at once."""
    from concurrent.futures import ThreadPoolExecutor

    def one(seed: int) -> list[Any]:
        r = client.chat.completions.create(model="", messages=ASK, tools=[WEATHER, TIME],
                                           temperature=1.0, seed=seed, n=5,
                                           max_tokens=max_tokens, **kw)
        return list(r.choices)

    with ThreadPoolExecutor(total // 5) as pool:
        return [c for cs in pool.map(one, range(total // 5)) for c in cs]


def _valid(call: Any) -> str:
    """The call's function name, after checking its arguments against its schema."""
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"
    return call.function.name


def test_tool_choice_required_always_calls_a_tool(client: openai.OpenAI) -> None:
    """50 sampled answers at temperature 1: each holds at least one valid call (a small model
    may go on calling until max_tokens cuts the last call: the ones before it are whole)."""
    choices = _many(client, 50, max_tokens=64, tool_choice="required")
    assert len(choices) == 50
    for choice in choices:
        assert choice.finish_reason in ("tool_calls", "length"), choice
        calls = choice.message.tool_calls or []
        complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
        assert complete, choice
        for call in complete:
            _valid(call)


def test_a_named_function_is_the_one_call(client: openai.OpenAI) -> None:
    choices = _many(client, 50, max_tokens=64, tool_choice={"type": "function",
                                                            "function": {"name": "get_time"}})
    for choice in choices:
        assert choice.finish_reason == "tool_calls", choice
        assert [_valid(c) for c in choice.message.tool_calls] == ["get_time"]
        assert choice.message.content is None


def test_a_tool_call_whose_integer_would_run_on_ends(client: openai.OpenAI) -> None:
    """Greedy, the default model writes `"population": 1111…` into the call's arguments until
    max_tokens (as instructor's tool mode asks); the arguments' integers are bounded too."""
    city = {"type": "function", "function": {
        "name": "City", "description": "Record a city.", "parameters": {
            "type": "object", "properties": {"name": {"type": "string"},
                                             "country": {"type": "string"},
                                             "population": {"type": "integer"}},
            "required": ["name", "country", "population"]}}}
    r = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Tell me about Paris."}], tools=[city],
        tool_choice={"type": "function", "function": {"name": "City"}}, temperature=0,
        max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    args = Town.model_validate_json(choice.message.tool_calls[0].function.arguments)
    assert abs(args.population) <= 2**53 - 1


def test_parallel_tool_calls_false_never_yields_two(client: openai.OpenAI) -> None:
    for choice in _many(client, 20, tool_choice="required", parallel_tool_calls=False):
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        _valid(choice.message.tool_calls[0])


def test_auto_lets_the_model_answer_in_text_or_call_a_tool(client: openai.OpenAI) -> None:
    for choice in _many(client, 5, max_tokens=64):
        if choice.message.tool_calls:
            assert choice.finish_reason in ("tool_calls", "length")
            if choice.finish_reason == "tool_calls":
                assert all(_valid(c) for c in choice.message.tool_calls)
        else:
            assert choice.message.content and "<tool_call>" not in choice.message.content


def test_streamed_tool_call_deltas_reassemble_into_the_non_streamed_call(
        client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="", messages=ASK, tools=[WEATHER, TIME],
                              tool_choice="required", parallel_tool_calls=False, temperature=0,
                              max_tokens=160)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    calls: dict[int, dict[str, str]] = {}
    fragments = 0
    finish = None
    for c in chunks:
        for ch in c.choices:
            finish = ch.finish_reason or finish
            for tc in ch.delta.tool_calls or []:
                if tc.id:  # the first delta of a call: its id and name
                    assert tc.index not in calls and tc.function.name
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
                fragments += bool(tc.function.arguments)
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert fragments > len(calls)  # the arguments came in pieces, as they were written


# ----------------------------------------------------------------------------- completions


def test_completions_take_the_structured_outputs_extension(client: openai.OpenAI) -> None:
    def one(so: dict[str, Any], prompt: str = "The capital of France is") -> str:
        r = client.completions.create(model="", prompt=prompt, max_tokens=40, temperature=0,
                                      extra_body={"structured_outputs": so})
        assert r.choices[0].finish_reason == "stop", r
        return r.choices[0].text

    assert one({"choice": ["Paris", "London", "Rome"]}) in ("Paris", "London", "Rome")
    year = one({"regex": r" (1[0-9]{3}|20[0-9]{2})"}, "The Eiffel Tower was built in")
    assert 1000 <= int(year) <= 2099
    obj = json.loads(one({"json": {"type": "object", "properties": {"city": {
        "type": "string", "maxLength": 20}}, "required": ["city"]}}))
    assert set(obj) == {"city"}
    assert one({"grammar": 'start: " " ("yes" | "no")'}, "Is Paris in France? Answer:") in \
        (" yes", " no")


# ----------------------------------------------------------------------------- properties


def _schemas() -> st.SearchStrategy[dict[str, Any]]:
    """JSON schemas in the subset nbserve enforces, with bounded strings so that an answer
    always has an end."""
    leaf = st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 12)),
        st.builds(lambda a, b: {"type": "integer", "minimum": min(a, b), "maximum": max(a, b)},
                  st.integers(-50, 50), st.integers(-50, 50)),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.lists(st.text("abcdefgh", min_size=1, max_size=5), min_size=1, max_size=4,
                 unique=True).map(lambda xs: {"enum": xs}),
    )

    def extend(inner: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
        return st.one_of(
            st.builds(lambda s, n: {"type": "array", "items": s, "maxItems": n}, inner,
                      st.integers(0, 3)),
            st.builds(lambda s: {"anyOf": [s, {"type": "null"}]}, inner),
            st.dictionaries(st.sampled_from(["a", "b", "c", "name", "kind"]), inner,
                            min_size=1, max_size=3).flatmap(
                lambda props: st.sets(st.sampled_from(sorted(props))).map(
                    lambda req: {"type": "object", "properties": props,
                                 "required": sorted(req), "additionalProperties": False})),
        )

    return st.recursive(leaf, extend, max_leaves=6).filter(lambda s: s.get("type") ==
                                                           "object")


def _check_answers(backend: Any, schema: dict[str, Any], n: int, seed: int) -> None:
    from nbserve.types import Constraint, Delta, Finished, Request, SamplingParams

    req = Request(messages=[{"role": "user", "content": "Fill in this form as JSON."}],
                  params=SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=160,
                                        constraint=Constraint("json_schema", schema)))
    texts, reasons = [""] * n, [""] * n
    for ev in backend.stream(req):
        if isinstance(ev, Delta):
            texts[ev.index] += ev.text
        elif isinstance(ev, Finished):
            reasons[ev.index] = ev.reason
    for text, reason in zip(texts, reasons):
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=_schemas(), seed=st.integers(0, 1000))
def test_every_answer_of_the_default_model_validates_against_a_generated_schema(
        default_engine: Any, schema: dict[str, Any], seed: int) -> None:
    _check_answers(default_engine, schema, n=4, seed=seed)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Any) -> Iterator[Any]:
    from server_util import engine_running

    with engine_running(tiny_llama_dir, max_batch=16, max_context=512) as engine:
        yield engine


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=_schemas(), seed=st.integers(0, 1000))
def test_every_answer_of_the_tiny_model_validates_against_a_generated_schema(
        tiny: Any, schema: dict[str, Any], seed: int) -> None:
    _check_answers(tiny, schema, n=4, seed=seed)
