"""One HTTP endpoint as the front declares it: its path, methods, handler and the model its JSON body must
be. The route table (routes.py) builds them and the OpenAPI document (openapi.py) describes them; a module
of its own so that neither imports the other for it.

Contract: an `Endpoint` is frozen; `body` None means the endpoint reads no body.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Endpoint:
    """One path: its methods, its handler and the model its JSON body must be (None: no body)."""

    path: str
    methods: tuple[str, ...]
    handler: Handler
    body: type[BaseModel] | None = None
