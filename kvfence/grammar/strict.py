"""JSON schemas tightened before they are compiled: closed (no keys beyond an object's properties) and, for
OpenAI's `strict: true`, with every property required.

Contracts:
- `closed` gives each object schema that does not set `additionalProperties` (or `patternProperties`)
  `additionalProperties: false`, at every depth the schema nests schemas (properties, items, anyOf, $defs,
  ...), except under `allOf`, whose branches closed one by one would leave nothing to match.
- `strict_schema` is OpenAI's strict mode: `closed`, and every object's properties all in `required`
  (OpenAI asks for both; an optional field is written as a union with null). An answer under it has
  exactly the keys the schema lists, so a client's parse (`client.chat.completions.parse`) never meets a
  missing or extra key. What a schema says itself is kept: it is only ever narrowed, never widened.
- Neither changes the schema it is given: both return a new one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas (visited recursively).
_SCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_SCHEMA_LIST = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any) -> Any:
    """`schema` with each object schema that does not say otherwise closed to keys beyond its properties."""
    return _each_object(schema, _close)


def strict_schema(schema: Any) -> Any:
    """`schema` under OpenAI's strict mode: closed, and every property required."""
    return _each_object(schema, lambda out: _require_all(_close(out)))


def _close(out: dict[str, Any]) -> dict[str, Any]:
    if "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _require_all(out: dict[str, Any]) -> dict[str, Any]:
    properties = out.get("properties")
    if isinstance(properties, dict):
        required = [name for name in out.get("required", []) if isinstance(name, str)]
        out["required"] = required + [name for name in properties if name not in required]
    return out


def _each_object(schema: Any, change: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """A copy of `schema` with `change` applied to every object schema in it (bottom up)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA:
        if key in out:
            out[key] = _each_object(out[key], change)
    for key in _SCHEMA_LIST:
        if isinstance(out.get(key), list):
            out[key] = [_each_object(item, change) for item in out[key]]
    for key in _SCHEMA_MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: _each_object(item, change) for name, item in out[key].items()}
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in out
    return change(out) if is_object else out
