"""Bounds on the numbers of a JSON schema that a grammar enforces, so that a model cannot write
digits forever (`"population": 1111111111…` until `max_tokens`), as llama.cpp's JSON grammar
caps an integer's digits.

An integer or number that the schema leaves unbounded gets |x| <= 2**53 - 1, the largest
integer that a JSON number (an IEEE double, RFC 7493's I-JSON) holds exactly; a number also
gets at most `DECIMALS` digits after the point (a `multipleOf`, which writes it without an
exponent). Each bound applies only where the schema says nothing of that side: its own
`minimum`/`exclusiveMinimum`, `maximum`/`exclusiveMaximum` and `multipleOf` decide instead,
tighter or looser. Every answer under the bounded schema validates against the original one.
"""

from __future__ import annotations

from ..types import JSONObject, JSONValue

SAFE_INTEGER = 2**53 - 1  # 9007199254740991
DECIMALS = 10  # the most that llguidance's multipleOf takes (1e-11 has too many digits)
_STEP = float(f"1e-{DECIMALS}")
_NOT_SCHEMAS = ("const", "enum", "default", "examples")  # values, not subschemas


def bounded_numbers(schema: JSONValue) -> JSONValue:
    """`schema` with the bounds above on every integer and number subschema (a copy; `schema`
    is not modified)."""
    if isinstance(schema, list):
        return [bounded_numbers(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _NOT_SCHEMAS or k.startswith("x-") else bounded_numbers(v)
           for k, v in schema.items()}
    kind = schema.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    if not kinds & {"integer", "number"} or "enum" in schema or "const" in schema:
        return out
    low = _bound(schema, "minimum", "exclusiveMinimum")
    high = _bound(schema, "maximum", "exclusiveMaximum")
    if low is None and (high is None or high >= -SAFE_INTEGER):
        out["minimum"] = -SAFE_INTEGER
    if high is None and (low is None or low <= SAFE_INTEGER):
        out["maximum"] = SAFE_INTEGER
    if "number" in kinds and "multipleOf" not in schema:
        out["multipleOf"] = _STEP
    return out


def _bound(schema: JSONObject, *keys: str) -> float | None:
    """The schema's own bound on one side (None: it sets none). A draft-4 boolean
    `exclusiveMinimum: true` goes with its `minimum`."""
    for key in keys:
        value = schema.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    return None
