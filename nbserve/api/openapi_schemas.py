"""The request bodies' schemas in the OpenAPI document: routes that parse their body themselves
(to refuse unknown fields by name) point at a schema here instead of declaring a body model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def body_ref(model: type[BaseModel]) -> dict[str, Any]:
    """openapi_extra for a route that parses its body itself (see `add_request_schemas`)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def add_request_schemas(openapi: dict[str, Any], models: Sequence[type[BaseModel]]) -> None:
    """Put the request models (and the models they use) into the document's components."""
    schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
