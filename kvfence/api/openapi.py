"""The OpenAPI document of the HTTP front (`GET /openapi.json`, as vLLM serves one): every endpoint and
method, each path parameter, and the JSON schema of each request body, from the same pydantic models that
validate it (so a client generator or a fuzzer reads exactly what the server accepts).

Contract: `openapi_document(title, version, endpoints)` is an OpenAPI 3.1 document; a body's schema is a
`$ref` into `components.schemas`, built in pydantic's validation mode; responses are described by status
only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic.json_schema import models_json_schema

from kvfence.api.endpoint import Endpoint

_PATH_PARAMETER = re.compile(r"{(\w+)}")
_REF = "#/components/schemas/{model}"


def openapi_document(title: str, version: str, endpoints: Sequence[Endpoint]) -> dict[str, Any]:
    bodies = sorted({e.body for e in endpoints if e.body is not None}, key=lambda model: model.__name__)
    refs, schemas = models_json_schema([(model, "validation") for model in bodies], ref_template=_REF)
    paths: dict[str, dict[str, Any]] = {}
    for endpoint in endpoints:
        for method in endpoint.methods:
            operation: dict[str, Any] = {
                "operationId": re.sub(r"\W+", "_", f"{method.lower()} {endpoint.path}").strip("_"),
                "responses": {"200": {"description": "OK"}},
            }
            if names := _PATH_PARAMETER.findall(endpoint.path):
                operation["parameters"] = [
                    {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                    for name in names
                ]
            if endpoint.body is not None:
                schema = refs[(endpoint.body, "validation")]
                operation["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": schema}},
                }
            paths.setdefault(endpoint.path, {})[method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": schemas.get("$defs", {})},
    }
