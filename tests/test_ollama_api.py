"""Ollama's API (/api/*) through the real `ollama` Python client against a real server on a
real port: chat and generate (plain, streaming, raw, options, format, tools, context), the
model routes, errors in Ollama's shape; the tiny random model for most, and one slow test of
a real answer from the default model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import openai
import pytest
from server_util import app_running, engine_running, wait_until

GREEDY = {"temperature": 0, "num_predict": 8}
ASK = [{"role": "user", "content": "Say something about the sea."}]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[Any]:
    with engine_running(tiny_llama_dir, max_context=512) as eng:
        yield eng


@pytest.fixture(scope="module")
def url(engine: Any) -> Iterator[str]:
    with app_running(engine) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> ollama.Client:
    return ollama.Client(host=url)


@pytest.fixture(scope="module")
def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def name(engine: Any) -> str:
    return f"{engine.model_name}:latest"


def _check_final(rec: Any) -> None:
    """A final record: done, its durations measured (positive, and within the total)."""
    assert rec.done is True and rec.done_reason in ("stop", "length")
    durations = (rec.load_duration, rec.prompt_eval_duration, rec.eval_duration)
    assert all(isinstance(d, int) and d >= 0 for d in durations), rec
    assert rec.total_duration > 0 and rec.prompt_eval_duration > 0 and rec.eval_duration > 0
    assert rec.eval_duration <= rec.total_duration
    assert sum(durations) <= rec.total_duration


# ----------------------------------------------------------------------------- /api/chat


def test_chat_answers_as_the_openai_route_with_the_same_counts(client: ollama.Client,
                                                               oai: openai.OpenAI,
                                                               name: str) -> None:
    r = client.chat(model=name, messages=ASK, options=GREEDY)
    ref = oai.chat.completions.create(model="", messages=ASK, temperature=0,  # type: ignore
                                      max_tokens=8)
    assert r.model == name and r.message.role == "assistant"
    assert r.message.content == ref.choices[0].message.content
    assert r.prompt_eval_count == ref.usage.prompt_tokens
    assert r.eval_count == ref.usage.completion_tokens
    assert r.done_reason == ("length" if ref.choices[0].finish_reason == "length" else "stop")
    _check_final(r)


def test_chat_streams_records_that_add_up_to_the_answer(client: ollama.Client,
                                                        name: str) -> None:
    parts = list(client.chat(model=name, messages=ASK, options=GREEDY, stream=True))
    whole = client.chat(model=name, messages=ASK, options=GREEDY)
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert len(parts) > 2  # the text came in pieces
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count
    _check_final(parts[-1])


def test_the_stream_is_ndjson_and_streams_by_default(url: str, name: str) -> None:
    with httpx.stream("POST", url + "/api/chat", json={"model": name, "messages": ASK,
                                                       "options": GREEDY}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and len(lines) > 2
    assert all(set(rec["message"]) >= {"role", "content"} for rec in lines)


def test_a_stream_dropped_midway_cancels_its_request(url: str, name: str,
                                                    engine: Any) -> None:
    cancelled = lambda: engine.stats()["requests_finished"].get("cancelled", 0)  # noqa: E731
    before = cancelled()
    long = {"model": name, "messages": ASK, "options": {"num_predict": 400},
            "format": {"type": "string", "minLength": 3000}}  # no early end
    with httpx.stream("POST", url + "/api/chat", json=long, timeout=30) as r:
        lines = (line for line in r.iter_lines() if line)
        assert [json.loads(next(lines))["done"] for _ in range(3)] == [False] * 3
    assert wait_until(lambda: cancelled() > before, timeout=2.0)
    assert wait_until(lambda: engine.stats()["running"] == 0, timeout=2.0)


def test_tools_reach_the_template_and_a_tool_round_trip_is_accepted(
        client: ollama.Client, name: str) -> None:
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
          city: The city's name
        """
        return "sunny"

    plain = client.chat(model=name, messages=ASK, options={"num_predict": 1})
    with_tools = client.chat(model=name, messages=ASK, tools=[get_weather],
                             options={"num_predict": 1})
    assert with_tools.prompt_eval_count > plain.prompt_eval_count + 40
    history = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]
    r = client.chat(model=name, messages=history, tools=[get_weather],
                    options={"num_predict": 1})
    assert r.prompt_eval_count > with_tools.prompt_eval_count + 10


def test_format_as_a_schema_answers_valid_json(client: ollama.Client, name: str) -> None:
    schema = {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"], "additionalProperties": False}
    for seed in (1, 2):
        r = client.chat(model=name, messages=ASK, format=schema,
                        options={"temperature": 1.0, "seed": seed, "num_predict": 100})
        assert r.done_reason == "stop", r.message.content
        jsonschema.validate(json.loads(r.message.content or ""), schema)
    r = client.chat(model=name, messages=ASK, format="json",
                    options={"seed": 3, "num_predict": 100})
    if r.done_reason == "stop":  # free keys and strings may run to num_predict
        assert isinstance(json.loads(r.message.content or ""), dict)
    else:
        assert (r.message.content or "").startswith("{")


def test_the_thought_comes_back_as_thinking_and_think_reaches_the_template() -> None:
    """A scripted model with Qwen3-like thinking tags: the thought is `thinking` (chat's
    message, generate's record), streamed and not; think=false renders the template's
    switch (its NOTHINK marker: a longer prompt)."""
    from test_reasoning import QWEN3_LIKE, USER, scripted_server

    with scripted_server(QWEN3_LIKE, "<think>\nSix sevens: 42.\n</think>\n\nIt is 42.") as base:
        client = ollama.Client(host=base)
        r = client.chat(model="thinker", messages=USER, think=True)
        assert (r.message.thinking, r.message.content) == ("Six sevens: 42.", "It is 42.")
        parts = list(client.chat(model="thinker", messages=USER, think=True, stream=True))
        assert "".join(p.message.thinking or "" for p in parts) == "Six sevens: 42."
        assert "".join(p.message.content or "" for p in parts) == "It is 42."
        off = client.chat(model="thinker", messages=USER, think=False,
                          options={"num_predict": 1})
        assert off.prompt_eval_count > r.prompt_eval_count
        g = client.generate(model="thinker", prompt=USER[0]["content"], think=True)
        assert (g.thinking, g.response) == ("Six sevens: 42.", "It is 42.")


def test_no_messages_is_a_load_request(client: ollama.Client, name: str) -> None:
    r = client.chat(model=name, messages=[])
    assert r.done is True and r.done_reason == "load"


# ----------------------------------------------------------------------------- /api/generate


def test_generate_templates_the_prompt_as_a_user_turn(client: ollama.Client,
                                                      oai: openai.OpenAI, name: str) -> None:
    r = client.generate(model=name, prompt=ASK[0]["content"], options=GREEDY)
    ref = oai.chat.completions.create(model="", messages=ASK, temperature=0,  # type: ignore
                                      max_tokens=8)
    assert r.response == ref.choices[0].message.content
    assert r.prompt_eval_count == ref.usage.prompt_tokens
    _check_final(r)
    assert len(r.context) == r.prompt_eval_count + r.eval_count
    system = client.generate(model=name, prompt=ASK[0]["content"], system="Be brief.",
                             options=GREEDY)
    ref = oai.chat.completions.create(model="", temperature=0, max_tokens=8, messages=[
        {"role": "system", "content": "Be brief."}, *ASK])  # type: ignore[list-item]
    assert system.response == ref.choices[0].message.content
    assert system.prompt_eval_count == ref.usage.prompt_tokens != r.prompt_eval_count


def test_raw_generate_is_the_completion_of_the_text(client: ollama.Client,
                                                    oai: openai.OpenAI, name: str) -> None:
    prompt = "Once upon a time"
    r = client.generate(model=name, prompt=prompt, raw=True, options=GREEDY)
    ref = oai.completions.create(model="", prompt=prompt, temperature=0, max_tokens=8)
    assert r.response == ref.choices[0].text
    assert (r.prompt_eval_count, r.eval_count) == (ref.usage.prompt_tokens,
                                                   ref.usage.completion_tokens)
    bare = client.generate(model=name, prompt=prompt, template="{{ .Prompt }}",
                           options=GREEDY)  # a template of the prompt alone: raw
    assert bare.response == r.response
    parts = list(client.generate(model=name, prompt=prompt, raw=True, options=GREEDY,
                                 stream=True))
    assert "".join(p.response for p in parts) == r.response
    assert parts[-1].context == r.context


def test_num_predict_and_stop(client: ollama.Client, name: str) -> None:
    prompt = "Once upon a time"
    long = client.generate(model=name, prompt=prompt, raw=True,
                           options={"temperature": 0, "num_predict": 12})
    assert long.eval_count <= 12
    three = client.generate(model=name, prompt=prompt, raw=True,
                            options={"temperature": 0, "num_predict": 3})
    assert three.eval_count == 3 and three.done_reason == "length"
    text = long.response
    cut = next((i for i in range(3, len(text)) if not text[i].isspace()), None)
    assert cut is not None, text
    stopped = client.generate(model=name, prompt=prompt, raw=True,
                              options={"temperature": 0, "num_predict": 12,
                                       "stop": [text[cut:cut + 2]]})
    assert stopped.done_reason == "stop" and stopped.response == text[:cut]


def test_context_continues_an_earlier_answer(client: ollama.Client, name: str) -> None:
    first = client.generate(model=name, prompt="Once upon a time", raw=True, options=GREEDY)
    second = client.generate(model=name, prompt=" and then", raw=True, context=first.context,
                             options=GREEDY)
    alone = client.generate(model=name, prompt=" and then", raw=True, options=GREEDY)
    assert second.prompt_eval_count == len(first.context) + alone.prompt_eval_count
    assert second.context[:len(first.context)] == first.context


def test_empty_prompt_is_a_load_request(client: ollama.Client, name: str) -> None:
    r = client.generate(model=name)
    assert r.done is True and r.done_reason == "load" and r.response == ""


FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


@pytest.fixture(scope="module")
def fim_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The tiny model with Qwen's infill tokens added to its tokenizer (ids below the
    model's vocabulary, made wider for them)."""
    from tiny_models import make_tiny_hf_dir
    from tokenizers import Tokenizer

    path = make_tiny_hf_dir(tmp_path_factory.mktemp("models") / "tiny-fim", vocab_size=704)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens(list(FIM))
    tok.save(str(path / "tokenizer.json"))
    with engine_running(path, max_context=256) as eng:
        yield eng


def test_suffix_is_infill_in_the_models_own_tokens(fim_engine: Any) -> None:
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))"
    with app_running(fim_engine) as base:
        client = ollama.Client(host=base)
        assert "insert" in client.show(fim_engine.model_name).capabilities
        r = client.generate(model=fim_engine.model_name, prompt=prefix, suffix=suffix,
                            options=GREEDY)
        fim_prompt = f"{FIM[0]}{prefix}{FIM[1]}{suffix}{FIM[2]}"
        ref = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0).completions.create(
            model="", prompt=fim_prompt, temperature=0, max_tokens=8)
    assert r.response == ref.choices[0].text
    assert r.prompt_eval_count == ref.usage.prompt_tokens
    assert r.prompt_eval_count == len(fim_engine.tokenizer.encode(fim_prompt, True))


# ----------------------------------------------------------------------------- models


def test_list_show_ps_version_pull(client: ollama.Client, url: str, name: str,
                                   engine: Any) -> None:
    (listed,) = client.list().models
    assert listed.model == name and listed.size > 0 and len(listed.digest or "") == 64
    assert listed.details.quantization_level
    shown = client.show(name)
    assert "completion" in shown.capabilities and "tools" in shown.capabilities
    assert "insert" not in shown.capabilities  # the tiny tokenizer has no infill tokens
    assert shown.modelinfo["nbserve.context_length"] == 512
    (running,) = client.ps().models
    assert running.model == name and running.context_length == 512
    assert httpx.get(url + "/api/version").json()["version"]
    assert client.pull(engine.model_name).status == "success"
    assert [p.status for p in client.pull(name, stream=True)] == ["success"]


# ----------------------------------------------------------------------------- errors


def _error(call: Any) -> ollama.ResponseError:
    with pytest.raises(ollama.ResponseError) as info:
        call()
    return info.value


def test_errors_come_in_ollamas_shape(client: ollama.Client, url: str, name: str) -> None:
    err = _error(lambda: client.chat(model="llama3:8b", messages=ASK))
    assert err.status_code == 404
    assert err.error.startswith('model "llama3:8b" not found, try pulling it first')
    err = _error(lambda: client.generate(model=name, prompt="hi", images=[b"\x89PNG"]))
    assert err.status_code == 400 and "images" in err.error
    err = _error(lambda: client.chat(model=name, messages=ASK, options={"mirostat": 2}))
    assert err.status_code == 400 and "options.mirostat" in err.error
    err = _error(lambda: client.chat(model=name, messages=ASK, options={"num_ctx": 100_000}))
    assert err.status_code == 400 and "num_ctx" in err.error
    err = _error(lambda: client.generate(model=name, prompt="def f(", suffix="return 1"))
    assert err.status_code == 400 and "infill" in err.error
    err = _error(lambda: client.generate(model=name, prompt="hi",
                                         template="<|user|>{{ .Prompt }}<|assistant|>"))
    assert err.status_code == 400 and "template" in err.error
    err = _error(lambda: client.pull("llama3"))
    assert err.status_code == 400 and "fetches nothing" in err.error
    r = httpx.post(url + "/api/chat", json={"model": name, "messages": ASK,
                                            "options": {"temprature": 0.5}})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    assert "options.temprature" in r.json()["error"] and "temperature" in r.json()["error"]
    r = httpx.get(url + "/api/nothing-here")
    assert r.status_code == 404 and set(r.json()) == {"error"}
    assert httpx.get(url + "/v1/nothing-here").json()["error"]["code"] == "unknown_url"


def test_keys_and_the_body_limit_answer_in_ollamas_shape(engine: Any, name: str) -> None:
    with app_running(engine, api_keys="sesame", limits={"max_body_bytes": 2000}) as base:
        err = _error(lambda: ollama.Client(host=base).list())
        assert err.status_code == 401 and isinstance(err.error, str)
        keyed = ollama.Client(host=base, headers={"Authorization": "Bearer sesame"})
        assert keyed.list().models[0].model == name
        err = _error(lambda: keyed.chat(model=name, messages=[
            {"role": "user", "content": "x" * 5000}]))
        assert err.status_code == 413 and "limit" in err.error


def test_embed_answers_one_unit_vector_per_input(client: ollama.Client, name: str) -> None:
    """/api/embed: one vector per input, of the model's width, normalised (as Ollama's), in
    the order given, each the same as the input embedded alone; measured counts."""
    r = client.embed(model=name, input=["a cat", "a dog"])
    assert len(r.embeddings) == 2 and all(len(v) == 64 for v in r.embeddings)
    for v in r.embeddings:
        assert abs(sum(x * x for x in v) - 1.0) < 1e-4
    assert r.embeddings[0] != r.embeddings[1]
    alone = client.embed(model=name, input="a dog")
    assert max(abs(a - b) for a, b in zip(alone.embeddings[0], r.embeddings[1])) < 1e-5
    assert (r.prompt_eval_count or 0) > 0 and 0 < (r.total_duration or 0)
    assert (r.load_duration or 0) <= (r.total_duration or 0)
    assert client.embed(model=name, input=[]).embeddings == []  # a load request


# ----------------------------------------------------------------------------- the default model


@pytest.mark.slow
def test_the_default_model_answers_through_the_ollama_client(default_loaded: Any) -> None:
    """The README snippet: a real answer; then a tool call after two earlier ones, with its
    arguments as an object."""
    from nbserve.engine import Engine

    with Engine(default_loaded, max_batch=2, quiet=True) as eng, app_running(eng) as base:
        client = ollama.Client(host=base)
        r = client.chat(model=eng.model_name, options={"temperature": 0},
                        messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in (r.message.content or "")
        _check_final(r)

        def turn(city: str, degrees: int) -> list[dict[str, Any]]:
            return [{"role": "user", "content": f"What is the weather in {city}?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"function": {"name": "get_weather", "arguments": {"city": city}}}]},
                    {"role": "tool", "tool_name": "get_weather",
                     "content": json.dumps({"temperature": degrees})},
                    {"role": "assistant", "content": f"It is {degrees} degrees in {city}."}]

        tool = {"type": "function", "function": {
            "name": "get_weather", "description": "Get the current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}
        messages = turn("Paris", 18) + turn("Rome", 25) + [
            {"role": "user", "content": "What is the weather in Tokyo?"}]
        r = client.chat(model=eng.model_name, messages=messages, tools=[tool],
                        options={"temperature": 0, "num_predict": 60})
        (call,) = r.message.tool_calls or []
        assert call.function.name == "get_weather"
        assert call.function.arguments == {"city": "Tokyo"}
