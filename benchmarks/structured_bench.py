"""Grammar-constrained decoding on the default model, beside unconstrained decoding, in one run.

Prints: the CPU's model and SIMD flags; the time to build the tokenizer's grammar data (a fresh
`Grammars`, median of 3), to turn a typical pydantic-made JSON schema into a grammar, and to
compile it the first time and again (cached); aggregate decode tokens/s (completion tokens over
the wall time) at 1 and 16 concurrent streams, unconstrained and constrained by a JSON schema,
on the same engine, prompts, seeds and max_tokens, each with the mean completion tokens per
request, the median inter-token latency (prefill does not touch it: constrained answers end
sooner, so prefill weighs more in their tokens/s) and the engine's step time split (model,
sampling, where the grammar masks are waited for and applied, and the rest; ms per step); the
ratios constrained / unconstrained and the goal (>= 0.9x at 16 streams). In the speed runs
every request decodes max_tokens tokens: the constrained ones write a JSON list too long to end
sooner, the unconstrained ones ignore the end of turn. Then one batch of answers constrained by
a short schema: how many parse as JSON and validate, and how many ended for length. Each level runs
REPEATS times, the two modes alternating, after a warm-up of each; figures are the medians.

    python benchmarks/structured_bench.py               # full run (a few minutes on 2 cores)
    python benchmarks/structured_bench.py --quick       # streams 1,4, 48 tokens: a smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Literal

import jsonschema
import pydantic

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from machine import cpu_line  # noqa: E402  (the same CPU line as the serving benchmark)

from nbserve.engine import Engine  # noqa: E402
from nbserve.engine.constraints import Grammars, grammar_text  # noqa: E402
from nbserve.types import (  # noqa: E402
    Constraint,
    Delta,
    ErrorEvent,
    Finished,
    Request,
    SamplingParams,
)

NAMES = ["Ada", "Bruno", "Chiara", "Dmitri", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas",
         "Kemi", "Luca", "Mei", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq",
         "Uma", "Viktor", "Wanda", "Xavier", "Yara", "Zoltan", "Amara", "Boris", "Chen", "Dara",
         "Emil", "Farah"]
JOBS = ["a baker", "a pilot", "a chess player", "a gardener", "a violinist", "a nurse",
        "a sailor", "a librarian", "a beekeeper", "a geologist", "a potter", "a mail carrier",
        "an astronomer", "a carpenter", "a cartographer", "a clockmaker"]

# The schema of the answers that are checked (valid JSON, against the schema).
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


# The schema the speed runs are constrained by: a list of people longer than max_tokens, so that
# both modes decode exactly max_tokens tokens a request (the unconstrained runs ignore the end
# of turn) and tokens/s compares like with like.
LONG_SCHEMA = {"type": "array", "items": PERSON_SCHEMA, "minItems": 64}


# A typical application schema, as pydantic writes it ($defs and $ref, titles, an enum, an
# optional field as anyOf-null, bounds): the one whose compile time is reported.
class Address(pydantic.BaseModel):
    street: str = pydantic.Field(max_length=80)
    city: str = pydantic.Field(max_length=40)
    postcode: str = pydantic.Field(pattern=r"^[0-9]{5}$")
    country: Literal["DE", "FR", "IT", "ES", "NL"]


class LineItem(pydantic.BaseModel):
    sku: str = pydantic.Field(pattern=r"^[A-Z]{3}-[0-9]{4}$")
    quantity: int = pydantic.Field(ge=1, le=99)
    unit_price: float = pydantic.Field(ge=0)


class Order(pydantic.BaseModel):
    order_id: int
    customer: str = pydantic.Field(min_length=1, max_length=60)
    email: str | None = None
    shipping: Address
    items: list[LineItem] = pydantic.Field(min_length=1, max_length=10)
    gift: bool = False
    note: str | None = pydantic.Field(default=None, max_length=200)


REPEATS = 3  # runs per level and mode, the two modes alternating; figures are their medians
GOAL = 0.9  # constrained aggregate tokens/s at least this fraction of unconstrained, 16 streams


def chat_prompts(n: int) -> list[list[dict[str, str]]]:
    """n different chats asking for a person described as JSON."""
    return [[{"role": "user", "content": f"Describe a person named {NAMES[i % len(NAMES)]}, "
                                         f"{JOBS[i % len(JOBS)]}, as JSON with name, age and "
                                         f"tags."}]
            for i in range(n)]


def median(values: list[float]) -> float:
    return statistics.median(values)


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def grammar_figures(engine: Engine, runs: int) -> list[tuple[str, float]]:
    """(name, seconds): build the tokenizer's grammar data fresh (median of `runs`), turn the
    pydantic schema into a grammar, compile it the first time, and again (cached)."""
    builds = []
    grammars = None
    for _ in range(runs):
        dt, grammars = timed(lambda: Grammars(engine.tokenizer, engine.vocab_size,
                                              engine.stop_token_ids))
        builds.append(dt)
    assert isinstance(grammars, Grammars)
    schema = Order.model_json_schema()
    to_text, text = timed(lambda: grammar_text(Constraint("json_schema", schema)))
    first, _ = timed(lambda: grammars.matcher(text, "response_format"))
    cached = median([timed(lambda: grammars.matcher(text, "response_format"))[0]
                     for _ in range(runs)])
    return [(f"build tokenizer grammar data (Grammars, {engine.vocab_size} tokens; median of "
             f"{runs})", median(builds)),
            (f"schema -> grammar text (pydantic Order schema, {len(json.dumps(schema))} chars "
             "of JSON)", to_text),
            ("compile grammar, first time", first),
            ("compile grammar, cached (a copy of the compiled matcher)", cached)]


async def run_level(engine: Engine, chats: list, max_tokens: int, constrained: bool,
                    seed0: int, schema: dict | None = None) -> dict:
    """All chats at once; aggregate completion tokens/s over the wall time, and each answer.
    Speed runs (no `schema`): constrained by LONG_SCHEMA, or free with the end of turn ignored,
    so that every request decodes max_tokens tokens either way."""
    constraint = Constraint("json_schema", schema or LONG_SCHEMA) if constrained else None

    async def one(i: int, messages: list) -> dict:
        params = SamplingParams(temperature=0.7, max_tokens=max_tokens, seed=seed0 + i,
                                constraint=constraint, ignore_eos=schema is None)
        text, tokens, reason, itl, error = [], 0, None, None, None
        try:
            async for ev in engine.generate(Request(messages=messages, params=params)):
                if isinstance(ev, Delta):
                    text.append(ev.text)
                elif isinstance(ev, Finished):
                    tokens, reason, itl = ev.usage.completion_tokens, ev.reason, ev.itl_s
                elif isinstance(ev, ErrorEvent):
                    error = f"{ev.kind}: {ev.message}"
        except Exception as exc:  # refused before the first event
            error = f"{type(exc).__name__}: {exc}"
        return {"text": "".join(text), "tokens": tokens, "reason": reason, "itl": itl,
                "error": error}

    before = engine.stats()
    t0 = time.perf_counter()
    answers = await asyncio.gather(*[one(i, m) for i, m in enumerate(chats)])
    wall = time.perf_counter() - t0
    after = engine.stats()
    tokens = sum(a["tokens"] for a in answers)
    split = {k: v - before["step_time_s"][k] for k, v in after["step_time_s"].items()}
    return {"tok_s": tokens / wall, "mean_tokens": tokens / len(answers), "answers": answers,
            "split": split, "steps": after["steps"] - before["steps"]}


def check_answers(answers: list[dict]) -> tuple[int, int, int, list[str]]:
    """(valid, for length, errors, the first few failures) of constrained answers."""
    valid = length = errors = 0
    bad: list[str] = []
    for a in answers:
        length += a["reason"] == "length"
        if a["error"]:
            errors += 1
            bad.append(a["error"])
            continue
        try:
            jsonschema.validate(json.loads(a["text"]), PERSON_SCHEMA)
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError) as exc:
            bad.append(f"{a['reason']}: {type(exc).__name__}: {a['text'][:80]!r}")
    return valid, length, errors, bad[:3]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--streams", default="1,16", help="concurrent streams (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 96 (48 with --quick)")
    ap.add_argument("--repeats", type=int, default=None,
                    help=f"runs per level and mode (default {REPEATS}, 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="streams 1,4, 48 tokens, one repeat")
    args = ap.parse_args()
    streams = [1, 4] if args.quick else [int(x) for x in args.streams.split(",")]
    max_tokens = args.max_tokens or (48 if args.quick else 96)
    repeats = args.repeats or (1 if args.quick else REPEATS)

    print(cpu_line())
    print(f"{time.strftime('%Y-%m-%d %H:%M')}")
    load_s, engine = timed(lambda: Engine(args.model, quiet=True, max_batch=max(streams),
                                          max_context=512))
    assert isinstance(engine, Engine)
    print(f"engine: {engine.model_name}, loaded in {load_s:.1f} s, threads "
          f"{engine.threads or 'tuned per forward size'}, "
          f"max_batch {engine.max_batch}")

    compile_rows = grammar_figures(engine, 3)
    print(f"\n{'grammar':<72} {'ms':>9}")
    for name, seconds in compile_rows:
        print(f"{name:<72} {seconds * 1e3:>9.2f}")

    chats = chat_prompts(max(streams))
    print(f"\nprompts: {len(chats)} chats (\"{chats[0][0]['content']}\" ...), temperature 0.7, "
          f"seeded, max_tokens {max_tokens} decoded by every request; constrained: a list of "
          f"64 or more of {json.dumps(PERSON_SCHEMA)}")
    for constrained in (False, True):  # warm-up: thread tuner, the grammar's compile
        asyncio.run(run_level(engine, chats[:max(streams)], max_tokens, constrained, 10_000))

    results: dict[tuple[int, bool], list[dict]] = {}
    for n in streams:
        for rep in range(repeats):
            order = (False, True) if rep % 2 == 0 else (True, False)
            for constrained in order:
                r = asyncio.run(run_level(engine, chats[:n], max_tokens, constrained,
                                          100 * rep))
                results.setdefault((n, constrained), []).append(r)
                print(f"  {n:>2} streams, {'constrained  ' if constrained else 'unconstrained'}"
                      f" run {rep + 1}: {r['tok_s']:7.1f} tokens/s, {r['mean_tokens']:5.1f} "
                      f"tokens/request", flush=True)
    checked = asyncio.run(run_level(engine, chats, 2 * max_tokens, True, 7, PERSON_SCHEMA))
    engine.close()

    print(f"\n{'decode (medians; ms per engine step)':<38} {'tokens/s':>9} {'tokens/req':>11} "
          f"{'ITL ms':>7} {'model':>6} {'sampling':>8} {'other':>6}")
    agg: dict[tuple[int, bool], float] = {}
    for n in streams:
        for constrained in (False, True):
            runs = results[(n, constrained)]
            agg[(n, constrained)] = median([r["tok_s"] for r in runs])
            mean_tokens = median([r["mean_tokens"] for r in runs])
            steps = max(sum(r["steps"] for r in runs), 1)
            split = " ".join(f"{sum(r['split'][k] for r in runs) / steps * 1e3:>{w}.1f}"
                             for k, w in (("model", 6), ("sampling", 8), ("bookkeeping", 6)))
            itls = [a["itl"] for r in runs for a in r["answers"] if a["itl"] is not None]
            itl = f"{median(itls) * 1e3:7.1f}" if itls else f"{'-':>7}"
            label = f"{n} streams, " + ("constrained (JSON schema)" if constrained
                                        else "unconstrained")
            print(f"{label:<38} {agg[(n, constrained)]:>9.1f} {mean_tokens:>11.1f} {itl} "
                  f"{split}")
    print()
    for n in streams:
        print(f"ratio constrained / unconstrained at {n} streams: "
              f"{agg[(n, True)] / agg[(n, False)]:.2f}x")
    goal_at = 16 if 16 in streams else max(streams)
    ratio = agg[(goal_at, True)] / agg[(goal_at, False)]
    print(f"goal: constrained >= {GOAL}x unconstrained at 16 streams: "
          f"{'met' if ratio >= GOAL else 'NOT met'}"
          + ("" if goal_at == 16 else f" (measured at {goal_at} streams, not 16)"))

    answers = checked["answers"]
    valid, length, errors, bad = check_answers(answers)
    print(f"\nanswers constrained by the person schema ({len(answers)} at once, max_tokens "
          f"{2 * max_tokens}): {valid} parse as JSON and validate "
          f"({valid / len(answers) * 100:.0f}%); {length} ended for length; {errors} errors; "
          f"{checked['mean_tokens']:.1f} tokens a request")
    for line in bad:
        print(f"  failed: {line}")
    errors_speed = [a["error"] for r in results.values() for x in r for a in x["answers"]
                    if a["error"]]
    print(f"speed runs: {len(errors_speed)} errors"
          + (f" (first: {errors_speed[0]})" if errors_speed else ""))


if __name__ == "__main__":
    main()
