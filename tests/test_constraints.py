"""Grammar-constrained decoding in the engine, with the tiny random model (whose free answers
are noise, so every well-formed answer here is the grammar's doing): the masks equal
llguidance's own verdicts, every constrained answer matches its constraint together with the
other sampling options, n > 1, streaming, the Pool and shared prefixes; the tool-call formats'
grammars allow exactly what tool_choice allows."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from server_util import engine_running

from nbserve.engine.constraints import Grammars, apply_masks_, compute_masks, grammar_text
from nbserve.text.tool_calls import FORMATS, HERMES
from nbserve.types import (
    Constraint,
    Delta,
    Finished,
    InvalidRequestError,
    Request,
    SamplingParams,
    Started,
)

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    "boss": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/ref"}]}},
    "required": ["name", "age", "role", "tags", "boss"], "additionalProperties": False,
    "$defs": {"ref": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                                 "maximum": 999}},
                      "required": ["id"], "additionalProperties": False}}}

CONSTRAINTS: list[tuple[Constraint, Any]] = [
    (Constraint("json_schema", PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON)),
    (Constraint("json_object"), lambda t: isinstance(json.loads(t), dict) or 1 / 0),
    (Constraint("regex", r"[A-Z][a-z]{2,5}-\d{3}"),
     lambda t: re.fullmatch(r"[A-Z][a-z]{2,5}-\d{3}", t) or 1 / 0),
    (Constraint("choice", ["red", "green", "blue"]), lambda t: t in ("red", "green", "blue") or
     1 / 0),
    (Constraint("grammar", 'start: "(" num (" + " num)* ")"\nnum: /[1-9][0-9]?/'),
     lambda t: re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", t) or 1 / 0),
]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Any:
    with engine_running(tiny_llama_dir, max_batch=16, max_context=512) as e:
        yield e


@pytest.fixture(scope="module")
def grammars(engine: Any) -> Grammars:
    return engine.grammars()


TOKENS: dict[int, list[list[int]]] = {}  # id(request) -> generated ids per choice


async def answers(backend: Any, req: Request) -> tuple[list[str], list[str], Started]:
    """(text per choice, finish reason per choice, the Started event); the token ids go to
    TOKENS."""
    n = req.params.n
    texts, reasons = [""] * n, [""] * n
    ids: list[list[int]] = [[] for _ in range(n)]
    started = None
    async for ev in backend.generate(req):
        if isinstance(ev, Started):
            started = ev
        elif isinstance(ev, Delta):
            texts[ev.index] += ev.text
            ids[ev.index] += ev.token_ids
        elif isinstance(ev, Finished):
            reasons[ev.index] = ev.reason
    assert started is not None
    TOKENS[id(req)] = ids
    return texts, reasons, started


def run_all(backend: Any, reqs: list[Request]) -> list[tuple[list[str], list[str], Started]]:
    async def go() -> list[Any]:
        return await asyncio.gather(*(answers(backend, r) for r in reqs))
    return asyncio.run(go())


def chat(text: str = "Tell me about a person.", **params: Any) -> Request:
    return Request(messages=[{"role": "user", "content": text}],
                   params=SamplingParams(**{"max_tokens": 96, **params}))


# ----------------------------------------------------------------------------- masks


def test_the_mask_allows_only_tokens_the_matcher_accepts(grammars: Grammars) -> None:
    """llguidance's mask can be stricter than what its matcher would accept (where a grammar
    forces bytes it allows their longest tokens only), never looser."""
    m = grammars.matcher(grammar_text(Constraint("json_schema", PERSON)), "x")
    for prefix in ("", '{"name": "A', '{"name": "Al", "age": 3'):
        probe = m.deep_copy()
        assert probe.consume_tokens(grammars.tokenizer.tokenize_str(prefix)) or not prefix
        logits = torch.zeros(3, grammars.vocab_size)
        apply_masks_(logits, [1], compute_masks(grammars, [probe]))
        allowed = set((logits[1] == 0).nonzero().flatten().tolist())
        assert (logits[1][logits[1] != 0] <= -3e38).all()  # the rest: no probability at all
        accepted = {t for t in range(grammars.vocab_size)
                    if probe.deep_copy().try_consume_tokens([t]) == 1}
        assert allowed and allowed <= accepted, prefix
        assert len(allowed) < (grammars.vocab_size if prefix else 4)
        assert (logits[[0, 2]] == 0).all()  # the other rows are untouched


# ----------------------------------------------------------------------------- answers


@pytest.mark.parametrize("constraint,check", CONSTRAINTS,
                         ids=[c.kind for c, _ in CONSTRAINTS])
def test_every_answer_matches_its_constraint_beside_every_sampling_option(
        engine: Any, constraint: Constraint, check: Any) -> None:
    """One batch: constrained requests with sampling, penalties, bias, seeds, logprobs, n > 1
    and stop strings, next to unconstrained ones that must stay free."""
    options: list[dict[str, Any]] = [
        dict(temperature=0),
        dict(temperature=1.0, seed=1, n=3),
        dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=2),
        dict(temperature=1.2, presence_penalty=1.0, frequency_penalty=0.5,
             repetition_penalty=1.3, seed=3),
        dict(temperature=1.0, logit_bias={5: 50.0, 7: -100.0}, seed=4, logprobs=True,
             top_logprobs=3),
        dict(temperature=1.0, seed=5, stop=["\n\n"], min_tokens=2),
    ]
    reqs = [chat(**o, constraint=constraint) for o in options]
    reqs += [chat(temperature=1.0, seed=9), chat(temperature=0)]  # free, in the same batch
    results = run_all(engine, reqs)
    grammar = grammar_text(constraint)
    stopped = 0
    for req, (texts, reasons, _), opts in zip(reqs, results, options):
        for text, reason, ids in zip(texts, reasons, TOKENS[id(req)]):
            m = engine.grammars().matcher(grammar, "x")
            assert m.try_consume_tokens(ids) == len(ids), (opts, text)  # every token allowed
            assert reason in ("stop", "length"), (opts, text, reason)
            if reason == "stop":  # a noise model may ramble inside an unbounded string
                stopped += 1
                check(text)
    assert stopped >= len(options)  # of 8 choices
    free = [t for texts, _, _ in results[len(options):] for t in texts]
    assert any(not _matches(constraint, check, t) for t in free)  # noise, as before


def _matches(constraint: Constraint, check: Any, text: str) -> bool:
    try:
        check(text)
        return True
    except Exception:  # noqa: BLE001 - any failure means no match
        return False


def test_seeded_constrained_answers_repeat_whatever_else_is_in_the_batch(engine: Any) -> None:
    c = Constraint("json_schema", PERSON)
    alone = run_all(engine, [chat(temperature=1.0, seed=42, constraint=c)])[0][0]
    crowd = run_all(engine, [chat(temperature=1.0, seed=7), chat(temperature=0.5, seed=42,
                                                                 constraint=c),
                             chat(temperature=1.0, seed=42, constraint=c)])[2][0]
    assert alone == crowd


def test_a_length_cut_says_length_and_a_stream_holds_the_same_text(engine: Any) -> None:
    c = Constraint("json_schema", PERSON)
    (texts, reasons, _), = run_all(engine, [chat(temperature=0, max_tokens=5, constraint=c)])
    assert reasons == ["length"] and texts[0].startswith("{")
    streamed = "".join(ev.text for ev in engine.stream(chat(temperature=0, max_tokens=5,
                                                            constraint=c))
                       if isinstance(ev, Delta))
    assert streamed == texts[0]


def test_a_shared_prompt_prefix_is_reused_under_a_constraint(engine: Any) -> None:
    c = Constraint("regex", r"[a-z]{2,6}( [a-z]{2,6}){0,3}\.")
    long = "Describe a person for the staff directory. " * 6
    first = run_all(engine, [chat(long, temperature=0, constraint=c)])[0]
    second = run_all(engine, [chat(long, temperature=0, constraint=c)])[0]
    assert second[2].cached_tokens > 0
    assert second[0] == first[0] and second[1] == ["stop"]
    assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){0,3}\.", second[0][0])


def test_the_pool_serves_constrained_requests_on_every_replica(tiny_llama_dir: Path) -> None:
    from nbserve.pool import Pool

    c = Constraint("choice", ["alpha", "beta"])
    with Pool(str(tiny_llama_dir), devices=["cpu", "cpu"], quiet=True, max_context=256) as pool:
        results = run_all(pool, [chat(temperature=1.0, seed=i, constraint=c, n=2)
                                 for i in range(6)])
        assert {t for texts, _, _ in results for t in texts} <= {"alpha", "beta"}
        assert all(r["requests_served"] > 0 for r in pool.stats()["replicas"])


def test_a_schema_keyword_that_cannot_be_enforced_is_a_clear_error(engine: Any) -> None:
    bad = Constraint("json_schema", {"type": "object", "not": {"required": ["a"]}},
                     param="response_format.json_schema.schema")
    with pytest.raises(InvalidRequestError) as exc:
        run_all(engine, [chat(constraint=bad)])
    assert exc.value.param == "response_format.json_schema.schema"
    assert '"not"' in str(exc.value)
    assert engine.chat("hi", max_tokens=2)  # still serving


def test_numbers_a_schema_leaves_unbounded_get_a_bounded_length(grammars: Grammars) -> None:
    """|x| <= 2**53 - 1 and at most 10 decimals, so that a model cannot write digits forever;
    a schema's own bounds decide instead, looser or tighter."""
    def ok(schema: dict[str, Any], text: str) -> bool:
        return _accepts(grammars, grammar_text(Constraint("json_schema", schema)), text)

    city = {"type": "object", "properties": {"population": {"type": "integer"}},
            "required": ["population"]}
    assert ok(city, '{"population": 9007199254740991}')
    assert ok(city, '{"population": -9007199254740991}')
    assert not ok(city, '{"population": 9007199254740992}')
    assert not ok(city, '{"population": 11111111111111111}')
    number = {"type": ["number", "null"]}
    assert ok(number, "3.1415926535") and ok(number, "null") and ok(number, "-2")
    assert not ok(number, "3.14159265358") and not ok(number, "1e5")
    own = {"type": "integer", "minimum": 0, "maximum": 10**18}
    assert ok(own, "1" * 18) and not ok(own, "-1")
    assert ok({"type": "number", "multipleOf": 0.5}, "2.5")
    assert not ok({"type": "number", "multipleOf": 0.5}, "2.25")
    nested = {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "string"}],
              "$defs": {"n": {"type": "integer"}}}
    assert ok(nested, "12") and ok(nested, '"12"') and not ok(nested, "1" * 17)
    assert not ok({"type": "integer", "exclusiveMaximum": 5}, "5")
    assert ok({"type": "integer", "exclusiveMaximum": 5}, "-9007199254740991")


def test_ignore_eos_under_a_grammar_still_ends_with_the_grammar(engine: Any) -> None:
    (texts, reasons, _), = run_all(engine, [chat(temperature=1.0, seed=3, ignore_eos=True,
                                                 constraint=Constraint("choice", ["yes", "no"]))])
    assert texts[0] in ("yes", "no") and reasons == ["stop"]


# ----------------------------------------------------------------------------- tool grammars

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
             "required": ["zone"]}}}]
W = {"name": "get_weather", "{args}": {"city": "Oslo", "unit": "c"}}
T = {"name": "get_time", "{args}": {"zone": "UTC"}}


def _call_text(fmt_name: str, calls: list[dict[str, Any]]) -> str:
    fmt = FORMATS[fmt_name]
    objs = [json.dumps({"name": c["name"], fmt.args_key: c["{args}"]}) for c in calls]
    if fmt_name == "hermes":
        return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs)
    if fmt_name in ("mistral", "phi4_mini"):
        return fmt.open + "[" + ", ".join(objs) + "]"
    return "; ".join(objs)


def _accepts(grammars: Grammars, grammar: str, text: str) -> bool:
    m = grammars.matcher(grammar, "tools")
    ids = grammars.tokenizer.tokenize_str(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_tool_grammars_allow_what_tool_choice_allows(grammars: Grammars, fmt_name: str) -> None:
    fmt = FORMATS[fmt_name]
    one, two = _call_text(fmt_name, [W]), _call_text(fmt_name, [W, T])
    bad_args = one.replace('"unit": "c"', '"unit": "k"')
    unknown = one.replace("get_weather", "get_wether")
    auto = fmt.grammar(TOOLS, special=grammars.special_id)
    assert _accepts(grammars, auto, "It is sunny.")
    assert _accepts(grammars, auto, one) and _accepts(grammars, auto, two)
    assert not _accepts(grammars, auto, bad_args) and not _accepts(grammars, auto, unknown)
    required = fmt.grammar(TOOLS, required=True, special=grammars.special_id)
    assert not _accepts(grammars, required, "It is sunny.") and _accepts(grammars, required, two)
    single = fmt.grammar(TOOLS, required=True, parallel=False, special=grammars.special_id)
    assert _accepts(grammars, single, one) and not _accepts(grammars, single, two)
    named = fmt.grammar(TOOLS, name="get_time", special=grammars.special_id)
    assert _accepts(grammars, named, _call_text(fmt_name, [T]))
    assert not _accepts(grammars, named, one) and not _accepts(grammars, named, "Hi")
    # a text answer under a schema: JSON of that schema, or calls
    answer = fmt.grammar(TOOLS, answer='%json {"type": "object", "properties": {"ok": '
                         '{"type": "boolean"}}, "required": ["ok"]}', special=grammars.special_id)
    assert _accepts(grammars, answer, '{"ok": true}') and _accepts(grammars, answer, one)
    assert not _accepts(grammars, answer, "It is sunny.")


@pytest.mark.parametrize("source,name", [
    ("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}", "hermes"),
    ("{%- if tools %}<tool_call>{{ tools | tojson }}</tool_call>{% endif %}", "hermes"),
    ("{{ '<|python_tag|>' }}{% for m in messages %}{{ m.content }}<|eot_id|>{% endfor %}",
     "llama3_json"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}{% endif %}[TOOL_CALLS]", "mistral"),
    ("{% if m.tools %}<|tool|>{{ m.tools }}<|/tool|>{% endif %}", "phi4_mini"),
])
def test_the_tool_format_is_read_off_the_template(source: str, name: str) -> None:
    from nbserve.text.tool_calls import detect_tool_format

    assert detect_tool_format(source).name == name


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_each_format_streams_what_it_parses(fmt_name: str) -> None:
    """Character by character, the pieces give the same content and calls as a whole parse;
    arguments arrive in fragments that concatenate to the whole call's."""
    fmt = FORMATS[fmt_name]
    text = _call_text(fmt_name, [W, T])
    _, whole = fmt.parse(text, {"get_weather", "get_time"})
    p = fmt.parser({"get_weather", "get_time"})
    pieces = [x for ch in text for x in p.feed(ch)] + p.finish()
    starts = [(x.index, x.name) for x in pieces if x.kind == "start"]
    args: dict[int, str] = {}
    for x in pieces:
        if x.kind == "args":
            args[x.index] = args.get(x.index, "") + x.text
    assert starts == [(0, "get_weather"), (1, "get_time")]
    assert [args[0], args[1]] == [c["function"]["arguments"] for c in whole]
    assert json.loads(args[0]) == W["{args}"] and json.loads(args[1]) == T["{args}"]
    assert sum(x.kind == "args" for x in pieces) > 4  # streamed, not in one piece
    assert not [x for x in pieces if x.kind == "content"]


def test_the_tiny_model_is_made_to_call_the_named_tool(engine: Any) -> None:
    req = chat("Time in Oslo?", temperature=1.0, seed=11, n=4, max_tokens=64)
    req.tools, req.tool_name = TOOLS[1:], "get_time"  # a short tool list: a small context
    (texts, reasons, started), = run_all(engine, [req])
    assert started.tool_format == "hermes"  # the tiny template ignores tools: nbserve's prompt
    assert reasons == ["stop"] * 4, texts
    for text in texts:
        content, calls = HERMES.parse(text, {"get_time"})
        assert content is None and [c["function"]["name"] for c in calls] == ["get_time"]
        args = json.loads(calls[0]["function"]["arguments"])
        jsonschema.validate(args, TOOLS[1]["function"]["parameters"])
        assert set(args) == {"zone"}  # no invented properties


def test_a_tokenizer_without_a_tokenizer_json_gets_grammar_data_from_its_token_bytes() -> None:
    """A duck-typed tokenizer (encode/decode only, as a custom model may bring): llguidance
    gets each token's bytes instead of a tokenizer.json."""
    from tiny_models import make_tiny_tokenizer

    from nbserve.text.tokenizer import Tokenizer, _DuckBackend

    raw = make_tiny_tokenizer()

    class Duck:
        vocab_size = raw.get_vocab_size()

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return raw.encode(text, add_special_tokens=add_special_tokens).ids

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return raw.decode(ids, skip_special_tokens=skip_special_tokens)

        def convert_ids_to_tokens(self, i: int) -> str | None:
            return raw.id_to_token(i)

    tok = Tokenizer(_DuckBackend(Duck()), eos_token_ids=[2])
    g = Grammars(tok, tok.vocab_size, [2])
    m = g.matcher(grammar_text(Constraint("json_schema", PERSON)), "x")
    ids = tok.encode('{"name": "Al", "age": 3, "role": "user", "tags": [], "boss": null}')
    assert m.try_consume_tokens(ids) == len(ids) and m.is_accepting()
    assert not g.matcher(grammar_text(Constraint("json_schema", PERSON)), "x") \
        .try_consume_tokens(tok.encode('{"nom"')) == len(tok.encode('{"nom"'))
