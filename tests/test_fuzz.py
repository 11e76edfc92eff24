"""Hostile and random input: schemathesis against the app's own OpenAPI schema over loopback,
and hypothesis properties of the detokenizer, stop strings and sampling-parameter validation.

Every case is bounded: the engine's context is 128 tokens, so no generated request runs long.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_util import app_running, engine_running, wait_until
from tiny_models import utf8_cut

from nbserve.text import IncrementalDetokenizer, StopStringMatcher
from nbserve.types import Delta, Finished, InvalidRequestError, Request, SamplingParams

FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
PROPS = settings(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow])


@pytest.fixture(scope="module")
def fuzz_engine(tiny_llama_dir: Any) -> Iterator[Any]:
    with engine_running(tiny_llama_dir, max_context=128) as engine:
        yield engine


@pytest.fixture(scope="module")
def fuzz_url(fuzz_engine: Any) -> Iterator[str]:
    with app_running(fuzz_engine) as url:
        yield url


OPERATIONS = [("GET", "/health"), ("GET", "/stats"), ("GET", "/metrics"), ("GET", "/v1/models"),
              ("GET", "/v1/models/{model_id}"), ("POST", "/v1/chat/completions"),
              ("POST", "/v1/completions"), ("POST", "/v1/responses"), ("POST", "/v1/embeddings"),
              ("POST", "/v1/rerank"),
              ("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/messages"),
              ("POST", "/v1/messages/count_tokens"),
              ("POST", "/api/chat"), ("POST", "/api/generate"), ("POST", "/api/embed"),
              ("GET", "/api/tags"), ("GET", "/api/ps"), ("GET", "/api/version"),
              ("POST", "/api/show"), ("POST", "/api/pull"),
              ("POST", "/models/load"), ("POST", "/models/unload")]
POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
# Fields the schema allows but nbserve refuses with a 400 (deprecated or not served); the
# "repaired" cases drop them and use a valid prompt, so that the other random fields reach
# the engine instead of stopping at the first refusal.
UNSERVED = ("functions", "function_call", "audio", "modalities", "prediction",
            "response_format", "suffix", "web_search_options", "best_of", "moderation",
            "reasoning_effort", "verbosity",  # random values of these are refused
            "thinking", "output_config", "container", "context_management", "mcp_servers",
            "system")  # (Anthropic's: a random system holds non-text blocks)
# The same for Ollama's bodies (random formats and contexts are mostly refused too), and its
# options that random values get refused for (sampling nbserve does not implement).
OLLAMA_UNSERVED = ("images", "template", "logprobs", "top_logprobs", "context", "width",
                   "height", "steps", "format", "think")
UNSERVED_OPTIONS = ("tfs_z", "typical_p", "mirostat", "repeat_last_n", "num_ctx")
FUZZ_CASES = [(m, p, "positive") for m, p in OPERATIONS] + [
    (m, p, mode) for m, p in OPERATIONS if m == "POST" for mode in ("negative", "repaired")]


@pytest.fixture(scope="module")
def api_schema(fuzz_url: str) -> Any:
    return schemathesis.openapi.from_url(fuzz_url + "/openapi.json")


def assert_openai_error(resp: Any, path: str = "/v1") -> None:
    """An error answer is JSON of exactly the OpenAI shape (Ollama's under /api/)."""
    body = resp.json()
    assert set(body) == {"error"}, body
    if path.startswith("/api/"):
        assert isinstance(body["error"], str) and body["error"], body
        return
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str), err


def assert_anthropic_error(resp: Any, path: str = "/v1/messages") -> None:
    """An error answer of the Messages API's paths is JSON of exactly Anthropic's shape."""
    body = resp.json()
    assert set(body) <= {"type", "error", "request_id"} and body["type"] == "error", body
    err = body["error"]
    assert set(err) == {"type", "message"}, err
    assert isinstance(err["message"], str) and err["message"], err


def test_the_fuzz_covers_every_operation_of_the_schema(api_schema: Any) -> None:
    ops = {(r.ok().method.upper(), r.ok().path) for r in api_schema.get_all_operations()}
    assert ops == set(OPERATIONS)


def _repair(case: Any) -> None:
    """Give a generated body a valid prompt and drop the fields nbserve refuses."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key in (*UNSERVED, "model"):
        body.pop(key, None)
    if case.operation.path.endswith("/embeddings"):
        body["input"] = "Once upon a time"
        return
    if case.operation.path.endswith("/rerank"):
        body.update(query="Once upon a time", documents=["a small dragon", "a quote"])
        return
    if body.get("tool_choice") not in (None, "none", "auto", {"type": "auto"}):
        body.pop("tool_choice")
    for tool in body.get("tools") or []:
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            tool["function"].pop("strict", None)  # random strict schemas are mostly refused
    path = case.operation.path
    if path.startswith("/api/"):  # Ollama's: the length is an option
        for key in OLLAMA_UNSERVED:
            body.pop(key, None)
        options = body["options"] = body.get("options") if isinstance(body.get("options"),
                                                                      dict) else {}
        for key in UNSERVED_OPTIONS:
            options.pop(key, None)
        if not isinstance(options.get("num_predict"), int) or options["num_predict"] < 1:
            options["num_predict"] = 8
        if path == "/api/embed":
            body["input"] = "Once upon a time"
            return
    elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 8  # the default (up to the context) is in the positive cases
    if case.operation.path.startswith("/v1/messages"):
        body.pop("tools", None)  # random tools are mostly server tools, refused
        body["messages"] = [{"role": "user", "content": "Tell me a story."}]
        if case.operation.path.endswith("/count_tokens"):
            body.pop("max_tokens")  # not a field of its body
    elif path.endswith("/chat/completions") or path == "/api/chat":
        body["messages"] = [{"role": "user", "content": "Tell me a story."}]
    else:
        body["prompt"] = "Once upon a time"


# schemathesis' own pytest integration (from_fixture) does not run under pytest 9, so each
# operation's strategy is drawn from directly: ~230 cases in all (operations without
# parameters have few distinct cases; negative cases need a body to break).
@pytest.mark.parametrize("method,path,mode", FUZZ_CASES,
                         ids=[f"{m} {p} {mode}" for m, p, mode in FUZZ_CASES])
def test_api_fuzz_no_5xx_and_openai_errors(api_schema: Any, fuzz_url: str, method: str,
                                           path: str, mode: str) -> None:
    strategy = api_schema[path][method].as_strategy(
        generation_mode=NEGATIVE if mode == "negative" else POSITIVE)

    @settings(FUZZ, max_examples=35 if method == "POST" else 10)
    @given(case=strategy)
    def check(case: Any) -> None:
        if mode == "repaired":
            _repair(case)
        resp = case.call(base_url=fuzz_url, timeout=60)
        assert resp.status_code < 500, (case.as_curl_command(), resp.text[:500])
        anthropic = path.startswith("/v1/messages")
        if resp.status_code >= 400:
            (assert_anthropic_error if anthropic else assert_openai_error)(resp, path)
        elif "text/event-stream" in resp.headers.get("content-type", ""):
            end = "data: {\"type\":\"message_stop\"}" if anthropic else "data: [DONE]"
            assert resp.text.rstrip().endswith(end), resp.text[-300:]
        elif "application/x-ndjson" in resp.headers.get("content-type", ""):
            last = json.loads(resp.text.splitlines()[-1])
            assert last.get("done") is True or set(last) in ({"error"}, {"status"}), \
                resp.text[-300:]

    check()


def test_server_is_idle_after_the_fuzz(fuzz_url: str, fuzz_engine: Any) -> None:
    assert wait_until(lambda: fuzz_engine.stats()["running"] == 0, 5)
    st_ = fuzz_engine.stats()
    assert st_["waiting"] == 0 and st_["slots_used"] == 0
    assert httpx.get(fuzz_url + "/health").json()["ready"] is True


# ----------------------------------------------------------------------------- detokenizer


@PROPS
@given(data=st.data())
def test_detokenizer_deltas_concatenate_to_the_full_decode(tiny_tokenizer: Any,
                                                           data: st.DataObject) -> None:
    """Any token sequence, fed in any chunking: the deltas add up to decode(all ids), less a
    character the last tokens leave incomplete (the tiny byte-level BPE decodes the tokens'
    bytes as Python's "replace" does)."""
    vocab = tiny_tokenizer.vocab_size
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=40), label="ids")
    cuts = data.draw(st.lists(st.integers(1, 4), max_size=40), label="chunk sizes")
    detok = IncrementalDetokenizer(tiny_tokenizer)
    out, i = [], 0
    for size in cuts + [len(ids)]:
        if i >= len(ids):
            break
        out.append(detok.add(ids[i:i + size]))
        i += size
    out.append(detok.finish())
    raw = b"".join(tiny_tokenizer.token_bytes(i) for i in ids)
    assert "".join(out) == raw[:len(raw) - utf8_cut(raw)].decode("utf-8", "replace")
    if not utf8_cut(raw):
        assert "".join(out) == tiny_tokenizer.decode(ids)


@PROPS
@given(data=st.data())
def test_detokenizer_never_emits_half_a_character(tiny_tokenizer: Any,
                                                  data: st.DataObject) -> None:
    """Encoded text (emoji, CJK, accents) streamed token by token: no delta ends in U+FFFD."""
    text = data.draw(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)),
                             max_size=30))
    ids = tiny_tokenizer.encode(text)
    detok = IncrementalDetokenizer(tiny_tokenizer)
    deltas = [detok.add(t) for t in ids]
    assert not any(d.endswith("\ufffd") for d in deltas) or "\ufffd" in text
    assert "".join(deltas) + detok.finish() == tiny_tokenizer.decode(ids)


# ----------------------------------------------------------------------------- stop strings

ALPHABET = st.sampled_from("ab c\n😀é")


def _run_matcher(stops: list[str], chunks: list[str]) -> tuple[str, str | None]:
    m = StopStringMatcher(stops)
    out = []
    for c in chunks:
        text, matched = m.feed(c)
        out.append(text)
        if matched is not None:
            return "".join(out), matched
    return "".join(out) + m.flush(), None


@PROPS
@given(data=st.data())
def test_stop_strings_cut_the_text_before_the_first_stop(data: st.DataObject) -> None:
    text = data.draw(st.text(ALPHABET, max_size=40), label="text")
    stops = data.draw(st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3),
                      label="stops")
    if text and data.draw(st.booleans(), label="stop taken from the text"):
        a = data.draw(st.integers(0, len(text) - 1))
        stops.append(text[a:a + data.draw(st.integers(1, 4))])
    sizes = data.draw(st.lists(st.integers(0, 5), max_size=40), label="chunk sizes")
    chunks, i = [], 0
    for size in sizes:
        chunks.append(text[i:i + size])
        i += size
    chunks.append(text[i:])

    out, matched = _run_matcher(stops, chunks)
    assert text.startswith(out)  # a prefix of the unstopped text
    assert not any(s in out for s in stops), (out, stops)  # never shows a stop string
    if matched is None:
        assert out == text and not any(s in text for s in stops)
    else:
        assert text.startswith(out + matched)  # cut exactly where the stop begins
        ends = [text.find(s) + len(s) for s in stops if s in text]
        assert len(out) + len(matched) == min(ends)  # the stop that ends first wins
    assert _run_matcher(stops, [text]) == (out, matched)  # chunking does not matter


@settings(PROPS, max_examples=15)
@given(start=st.integers(0, 30), length=st.integers(1, 6))
def test_engine_output_never_contains_the_stop_string(fuzz_engine: Any, start: int,
                                                      length: int) -> None:
    def text_of(stop: list[str]) -> tuple[str, str]:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop)
        out, reason = "", ""
        for ev in fuzz_engine.stream(Request(prompt="Once upon a time", params=params)):
            if isinstance(ev, Delta):
                out += ev.text
            elif isinstance(ev, Finished):
                reason = ev.reason
        return out, reason

    full, _ = text_of([])
    stop = full[start:start + length]
    if not stop:
        return
    out, reason = text_of([stop])
    assert stop not in out and full.startswith(out)
    assert out == full[:full.find(stop)] and reason == "stop"


# ----------------------------------------------------------------------------- sampling params

PARAM_VALUES: dict[str, Any] = {
    "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), st.just(float("nan")),
                             st.just(float("inf")), st.integers(-2, 3)),
    "top_p": st.one_of(st.floats(-0.5, 1.5, allow_nan=False), st.just(0)),
    "top_k": st.one_of(st.integers(-3, 300), st.just(2.5)),
    "min_p": st.floats(-0.5, 1.5, allow_nan=False),
    "presence_penalty": st.floats(-3, 3, allow_nan=False),
    "frequency_penalty": st.floats(-3, 3, allow_nan=False),
    "repetition_penalty": st.floats(-1, 3, allow_nan=False),
    "max_tokens": st.one_of(st.integers(-2, 8), st.none(), st.just("4")),
    "n": st.integers(-1, 10),
    "top_logprobs": st.integers(-2, 25),
    "logprobs": st.booleans(),
    "seed": st.one_of(st.none(), st.integers(-2**63, 2**63 - 1), st.just(1.5)),
    "logit_bias": st.dictionaries(st.integers(-5, 700), st.floats(-150, 150, allow_nan=False),
                                  max_size=3),
    "stop": st.lists(st.text(max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(-3, 700), max_size=2),
}


@settings(PROPS, max_examples=150)
@given(params=st.fixed_dictionaries({}, optional=PARAM_VALUES))
def test_sampling_params_are_refused_by_name_or_served(fuzz_engine: Any,
                                                       params: dict[str, Any]) -> None:
    """Random values: either an InvalidRequestError naming one of the parameters given, or a
    request that completes."""
    params.setdefault("max_tokens", 4)
    try:
        sp = SamplingParams(**params)
        events = list(fuzz_engine.stream(Request(prompt="hi", params=sp)))
    except InvalidRequestError as exc:
        assert exc.param in params, (exc.param, params)
        assert exc.param in str(exc)
        return
    assert sum(isinstance(e, Finished) for e in events) == sp.n, events[-1]


HTTP_VALUES = {k: v for k, v in PARAM_VALUES.items() if k not in ("stop_token_ids",)}


@settings(PROPS, max_examples=60)
@given(params=st.fixed_dictionaries({}, optional=HTTP_VALUES))
def test_http_sampling_params_are_a_named_400_or_a_200(fuzz_url: str,
                                                       params: dict[str, Any]) -> None:
    params.setdefault("max_tokens", 4)
    body = {"messages": [{"role": "user", "content": "hi"}], **params}
    if "logit_bias" in body:
        body["logit_bias"] = {str(k): v for k, v in body["logit_bias"].items()}
    content = json.dumps(body, allow_nan=True)  # NaN/Infinity as a sloppy client would send
    resp = httpx.post(fuzz_url + "/v1/chat/completions", content=content, timeout=60,
                      headers={"content-type": "application/json"})
    assert resp.status_code in (200, 400), resp.text
    if resp.status_code == 400:
        assert_openai_error(resp)
        err = resp.json()["error"]
        named = err["param"] or ""
        assert named.split(".")[0].split("[")[0] in params or named == "", (err, params)
        if named:
            assert named in err["message"] or named.split(".")[0] in err["message"], err
    else:
        assert len(resp.json()["choices"]) == params.get("n", 1)

