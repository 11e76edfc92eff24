"""What happens to each request field, over a real server with the tiny model: every field the
openai SDK can send is served, a documented no-op or refused with a 400 naming it; an unknown
field (a typo) is a 400 with a suggestion unless the app accepts unknown fields (then it is
logged once); vLLM-style extensions (min_tokens, ignore_eos, stop_token_ids) work."""

from __future__ import annotations

import json
import logging
import re
import typing
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_util import app_running, engine_running, wait_until

ROOT = Path(__file__).resolve().parents[1]
HI = [{"role": "user", "content": "Tell me a story."}]
EOS = 2  # <|im_end|> of the tiny tokenizer, a stop token of the tiny model
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir: Path) -> Any:
    """The tiny model with room for a tool list in the prompt (its template ignores tools, so
    nbserve writes them into the system prompt)."""
    with engine_running(tiny_llama_dir, max_context=512) as engine:
        yield engine


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)


def post(url: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def error_of(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# ----------------------------------------------------------------------------- unknown fields


@pytest.mark.parametrize("path,body,param,suggestion", [
    ("/v1/chat/completions", {"messages": HI, "max_token": 5}, "max_token", "max_tokens"),
    ("/v1/completions", {"prompt": "Once", "max_token": 5}, "max_token", "max_tokens"),
    ("/v1/chat/completions", {"messages": HI, "temprature": 0.5}, "temprature", "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "nmae": "bob"}]},
     "messages[0].nmae", "name"),
    ("/v1/chat/completions", {"messages": HI, "stream": True,
                              "stream_options": {"include_usgae": True}},
     "stream_options.include_usgae", "include_usage"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {
        "name": "f", "paramters": {}}}]}, "tools[0].function.paramters", "parameters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "txt": "hi"}]}]}, "messages[0].content[0].txt", "text"),
])
def test_an_unknown_field_is_a_400_naming_it_with_a_suggestion(
        server_url: str, path: str, body: dict[str, Any], param: str, suggestion: str) -> None:
    err = error_of(post(server_url, body, path))
    assert err["param"] == param and err["code"] == "unknown_parameter", err
    assert param in err["message"] and f"did you mean {suggestion!r}" in err["message"], err


def test_an_unknown_field_without_a_near_miss_is_named_without_a_suggestion(
        server_url: str) -> None:
    err = error_of(post(server_url, {"messages": HI, "frobnicate": 1}))
    assert err["param"] == "frobnicate" and "did you mean" not in err["message"]


def test_the_sdk_extra_body_typo_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="", messages=HI, max_tokens=2,
                                       extra_body={"max_token": 5})
    assert exc.value.param == "max_token" and exc.value.code == "unknown_parameter"


@pytest.mark.parametrize("field,value", [
    ("guided_json", {"type": "object"}), ("guided_regex", "[a-z]+"),
    ("guided_choice", ["yes", "no"]), ("guided_grammar", "root ::= 'a'"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_older_constrained_decoding_fields_are_refused_even_when_unknown_fields_are_accepted(
        tiny_engine: Any, field: str, value: Any, path: str) -> None:
    base = {"messages": HI} if "chat" in path else {"prompt": "Once"}
    with app_running(tiny_engine, accept_unknown_fields=True) as url:
        err = error_of(post(url, {**base, "max_tokens": 2, field: value}, path))
    assert err["param"] == field and err["code"] == "unsupported_parameter", err
    assert "structured_outputs" in err["message"]


@pytest.mark.parametrize("response_format,check", [
    ({"type": "json_object"}, lambda v: isinstance(v, dict)),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}},
     lambda v: isinstance(v, dict) and isinstance(v["n"], int) and set(v) == {"n"}),
])
def test_response_format_json_is_served_and_the_answer_parses(
        server_url: str, response_format: dict[str, Any], check: Any) -> None:
    """The tiny random model writes whatever its weights say; the grammar makes it JSON."""
    r = post(server_url, {"messages": HI, "max_tokens": 64, "temperature": 0,
                          "response_format": response_format})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice  # greedy: the same answer every run
    assert check(json.loads(choice["message"]["content"])), choice


def test_accepting_unknown_fields_logs_each_name_once(tiny_engine: Any,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with app_running(tiny_engine, accept_unknown_fields=True) as url, \
            caplog.at_level(logging.WARNING, logger="nbserve.server"):
        for _ in range(3):
            r = post(url, {"messages": [{"role": "user", "content": "hi", "mood": "happy"}],
                           "max_tokens": 2, "frobnicate": 1, "skip_special_tokens": False})
            assert r.status_code == 200, r.text
        r = post(url, {"prompt": "Once", "max_tokens": 2, "frobnicate": 1}, "/v1/completions")
        assert r.status_code == 200, r.text
        assert wait_until(lambda: len(caplog.records) >= 3, 2)
    logged = [rec.getMessage() for rec in caplog.records if "unknown" in rec.getMessage()]
    for name in ("frobnicate", "skip_special_tokens", "messages[].mood"):
        assert sum(repr(name) in line for line in logged) == 1, (name, logged)
    assert len(logged) == 3, logged


def test_an_accepted_unknown_field_does_not_reach_the_template(
        tiny_engine: Any) -> None:
    """A tool with an unknown key, accepted and dropped: the prompt is the same as without it."""
    def prompt_tokens(url: str, tool: dict[str, Any]) -> int:
        r = post(url, {"messages": HI, "max_tokens": 1, "tools": [tool]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    with app_running(tiny_engine, accept_unknown_fields=True) as url:
        noisy = {**WEATHER, "function": {**WEATHER["function"], "x_notes": "n" * 200}}
        assert prompt_tokens(url, noisy) == prompt_tokens(url, WEATHER)


# ----------------------------------------------------------------------------- the SDK's fields

CHAT_BASE: dict[str, Any] = {"model": "", "messages": HI, "max_tokens": 2}
# field -> (fate, value sent, companions it needs)
CHAT_FIELDS: dict[str, tuple[str, Any, dict[str, Any]]] = {
    "messages": ("served", HI, {}),
    "model": ("served", "", {}),
    "frequency_penalty": ("served", 0.5, {}),
    "logit_bias": ("served", {"5": 1}, {}),
    "logprobs": ("served", True, {}),
    "max_completion_tokens": ("served", 2, {}),
    "max_tokens": ("served", 2, {}),
    "n": ("served", 2, {}),
    "parallel_tool_calls": ("served", False, {"tools": [WEATHER]}),
    "presence_penalty": ("served", 0.5, {}),
    "response_format": ("served", {"type": "text"}, {}),
    "seed": ("served", 7, {}),
    "stop": ("served", ["zzz"], {}),
    "stream": ("served", True, {}),
    "stream_options": ("served", {"include_usage": True}, {"stream": True}),
    "temperature": ("served", 0.5, {}),
    "tool_choice": ("served", "auto", {"tools": [WEATHER]}),
    "tools": ("served", [WEATHER], {}),
    "top_logprobs": ("served", 2, {"logprobs": True}),
    "top_p": ("served", 0.9, {}),
    "metadata": ("no-op", {"team": "a"}, {}),
    "prompt_cache_key": ("no-op", "k1", {}),
    "prompt_cache_options": ("no-op", {"mode": "implicit"}, {}),
    "prompt_cache_retention": ("no-op", "24h", {}),
    "safety_identifier": ("no-op", "hash-1", {}),
    "service_tier": ("no-op", "auto", {}),
    "store": ("no-op", False, {}),
    "user": ("no-op", "user-1", {}),
    "audio": ("refused", {"voice": "alloy", "format": "wav"}, {}),
    "function_call": ("refused", "auto", {}),
    "functions": ("refused", [WEATHER["function"]], {}),
    "modalities": ("refused", ["text", "audio"], {}),
    "moderation": ("refused", {"model": "omni-moderation-latest"}, {}),
    "prediction": ("refused", {"type": "content", "content": "x"}, {}),
    "reasoning_effort": ("served", "low", {}),
    "verbosity": ("refused", "low", {}),
    "web_search_options": ("refused", {}, {}),
}
COMPLETION_BASE: dict[str, Any] = {"model": "", "prompt": "Once upon", "max_tokens": 2}
COMPLETION_FIELDS: dict[str, tuple[str, Any, dict[str, Any]]] = {
    "prompt": ("served", "Once upon", {}),
    "model": ("served", "", {}),
    "best_of": ("served", 1, {}),
    "echo": ("served", True, {}),
    "frequency_penalty": ("served", 0.5, {}),
    "logit_bias": ("served", {"5": 1}, {}),
    "logprobs": ("served", 2, {}),
    "max_tokens": ("served", 2, {}),
    "n": ("served", 2, {}),
    "presence_penalty": ("served", 0.5, {}),
    "seed": ("served", 7, {}),
    "stop": ("served", ["zzz"], {}),
    "stream": ("served", True, {}),
    "stream_options": ("served", {"include_usage": True}, {"stream": True}),
    "temperature": ("served", 0.5, {}),
    "top_p": ("served", 0.9, {}),
    "user": ("no-op", "user-1", {}),
    "suffix": ("refused", " the end.", {}),
}


def sdk_fields(params_module: Any) -> set[str]:
    """Every top-level field of the SDK's create() params (streaming and not)."""
    names: set[str] = set()
    for cls in ("CompletionCreateParamsStreaming", "CompletionCreateParamsNonStreaming"):
        names |= set(typing.get_type_hints(getattr(params_module, cls)))
    return names


def test_every_field_the_sdk_defines_has_a_fate() -> None:
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    assert sdk_fields(chat_create_params) == set(CHAT_FIELDS)
    assert sdk_fields(completion_create_params) == set(COMPLETION_FIELDS)


def _check_fate(create: Any, base: dict[str, Any], field: str, fate: str, value: Any,
                extra: dict[str, Any]) -> None:
    kwargs = {**base, **extra, field: value}
    if fate == "refused":
        with pytest.raises(openai.BadRequestError) as exc:
            create(**kwargs)
        assert exc.value.param is not None and exc.value.param.split(".")[0] == field, \
            exc.value.body
        assert field in exc.value.message
    else:
        out = create(**kwargs)
        if kwargs.get("stream"):
            assert list(out), field
        else:
            assert out.choices, field


@pytest.mark.parametrize("field", sorted(CHAT_FIELDS))
def test_each_chat_field_is_served_or_a_no_op_or_refused_by_name(client: openai.OpenAI,
                                                                 field: str) -> None:
    fate, value, extra = CHAT_FIELDS[field]
    _check_fate(client.chat.completions.create, CHAT_BASE, field, fate, value, extra)


@pytest.mark.parametrize("field", sorted(COMPLETION_FIELDS))
def test_each_completion_field_is_served_or_a_no_op_or_refused_by_name(client: openai.OpenAI,
                                                                       field: str) -> None:
    fate, value, extra = COMPLETION_FIELDS[field]
    _check_fate(client.completions.create, COMPLETION_BASE, field, fate, value, extra)


def test_nested_sdk_fields_are_known_to_the_schema() -> None:
    """Each key of the SDK's message, content-part, tool and stream-option types is a field of
    nbserve's schema for it (so none is ever refused as unknown)."""
    import openai.types.chat as t
    from openai.types.shared_params import FunctionDefinition

    from nbserve.api import protocol as p

    pairs = [
        (t.ChatCompletionSystemMessageParam, p.SystemMessage),
        (t.ChatCompletionDeveloperMessageParam, p.DeveloperMessage),
        (t.ChatCompletionUserMessageParam, p.UserMessage),
        (t.ChatCompletionAssistantMessageParam, p.AssistantMessage),
        (t.ChatCompletionToolMessageParam, p.ToolMessage),
        (t.ChatCompletionFunctionMessageParam, p.FunctionMessage),
        (t.ChatCompletionContentPartTextParam, p.ContentPart),
        (t.ChatCompletionContentPartImageParam, p.ContentPart),
        (t.ChatCompletionContentPartInputAudioParam, p.ContentPart),
        (t.ChatCompletionContentPartRefusalParam, p.ContentPart),
        (t.ChatCompletionMessageToolCallParam, p.ToolCall),
        (t.ChatCompletionFunctionToolParam, p.Tool),
        (t.ChatCompletionNamedToolChoiceParam, p.NamedToolChoice),
        (t.ChatCompletionStreamOptionsParam, p.StreamOptions),
        (FunctionDefinition, p.FunctionDefinition),
    ]
    for sdk, ours in pairs:
        missing = set(typing.get_type_hints(sdk)) - set(ours.model_fields)
        assert not missing, (sdk.__name__, missing)


@pytest.mark.parametrize("message,param", [
    ({"role": "assistant", "content": "x", "audio": {"id": "audio_1"}}, "messages[1].audio"),
    ({"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}},
     "messages[1].function_call"),
])
def test_nested_fields_that_cannot_be_served_are_refused(server_url: str,
                                                         message: dict[str, Any],
                                                         param: str) -> None:
    err = error_of(post(server_url, {"messages": [*HI, message, *HI], "max_tokens": 2}))
    assert err["param"] == param, err


def test_a_strict_tool_with_a_keyword_that_cannot_be_enforced_is_refused_and_no_op_stream_options_are_accepted(  # noqa: E501
        server_url: str) -> None:
    params = {**WEATHER["function"]["parameters"], "not": {"required": ["city"]}}
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True,
                                      "parameters": params}}
    err = error_of(post(server_url, {"messages": HI, "tools": [strict]}))
    assert err["param"] == "tools[0].function.parameters" and '"not"' in err["message"], err
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "prompt_cache_breakpoint": {"type": "ephemeral"}}]}],
        "max_tokens": 2, "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False}}
    assert post(server_url, body).status_code == 200


# ----------------------------------------------------------------------------- the docs

def _docs_table() -> dict[str, tuple[str, str]]:
    """docs/api.md's field table (its first section: the other APIs' sections have tables of
    their own): `field` -> (fate on chat, fate on completions)."""
    rows: dict[str, tuple[str, str]] = {}
    first_section = (ROOT / "docs" / "api.md").read_text().split("\n## ", 1)[0]
    for line in first_section.splitlines():
        m = re.match(r"\|\s*`([^`]+)`\s*\|\s*([^|]*?)\s*\|\s*([^|]*?)\s*\|", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def test_the_docs_table_gives_each_sdk_field_its_fate() -> None:
    rows = _docs_table()
    for fields, col in ((CHAT_FIELDS, 0), (COMPLETION_FIELDS, 1)):
        for name, (fate, _, _) in fields.items():
            assert name in rows, f"docs/api.md has no row for `{name}`"
            assert rows[name][col] == fate, (name, rows[name])
    for name in ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                 "stop_token_ids", "structured_outputs"):
        assert rows[name] == ("served", "served"), name
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        assert rows[name] == ("refused", "refused"), name
    assert "docs/api.md" in (ROOT / "README.md").read_text()


# ----------------------------------------------------------------------------- extensions


def test_min_tokens_keeps_the_model_from_stopping_early(client: openai.OpenAI) -> None:
    eager = {"logit_bias": {str(EOS): 100}}  # the model wants to stop at once
    early = client.chat.completions.create(model="", messages=HI, max_tokens=20,
                                           temperature=0, **eager)
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    for stream in (False, True):
        kw = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        r = client.chat.completions.create(model="", messages=HI, max_tokens=20, temperature=0,
                                           extra_body={"min_tokens": 6}, **eager, **kw)
        if stream:
            chunks = list(r)
            usage, finish = chunks[-1].usage, [c.choices[0].finish_reason for c in chunks
                                                if c.choices][-1]
        else:
            usage, finish = r.usage, r.choices[0].finish_reason
        assert usage.completion_tokens == 7 and finish == "stop"  # 6 tokens, then the stop
    c = client.completions.create(model="", prompt="Once", max_tokens=20, temperature=0,
                                  extra_body={"min_tokens": 4}, **eager)
    assert c.usage.completion_tokens == 5 and c.choices[0].finish_reason == "stop"


def test_min_tokens_is_validated(server_url: str) -> None:
    err = error_of(post(server_url, {"messages": HI, "max_tokens": 4, "min_tokens": 5}))
    assert err["param"] == "min_tokens" and "max_tokens" in err["message"]
    err = error_of(post(server_url, {"messages": HI, "min_tokens": -1}))
    assert err["param"] == "min_tokens"


def test_ignore_eos_runs_to_max_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="", messages=HI, max_tokens=6, temperature=0,
                                       logit_bias={str(EOS): 100},
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"


def test_stop_token_ids_end_the_answer_at_that_token(client: openai.OpenAI, tiny_engine: Any,
                                                     server_url: str) -> None:
    from nbserve.types import Request, SamplingParams

    no_eos = {str(EOS): -100, "0": -100}
    greedy = SamplingParams(temperature=0, max_tokens=8, logit_bias={EOS: -100, 0: -100})
    ids = [t for ev in tiny_engine.stream(Request(prompt="Once", params=greedy))
           for t in getattr(ev, "token_ids", [])]
    assert len(ids) == 8
    stop_at = ids[2]
    r = client.completions.create(model="", prompt="Once", max_tokens=8, temperature=0,
                                  logit_bias=no_eos, extra_body={"stop_token_ids": [stop_at]})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == ids.index(stop_at) + 1
    held = client.completions.create(model="", prompt="Once", max_tokens=8, temperature=0,
                                     logit_bias=no_eos,
                                     extra_body={"stop_token_ids": [stop_at], "min_tokens": 8})
    assert held.usage.completion_tokens == 8 and held.choices[0].finish_reason == "length"
    err = error_of(post(server_url, {"prompt": "Once", "stop_token_ids": [10**9]},
                        "/v1/completions"))
    assert err["param"] == "stop_token_ids"
