"""API-key auth: which tenant a request belongs to, and who may read the audit trail.

Contracts:
- The tenant comes from the API key only (invariant 7): `Authorization: Bearer KEY` looked up in the key
  map; a missing or unknown key is 401. With no key map, auth is off and every request is tenant
  "default".
- The admin-only endpoints open to the admin key alone (compared in constant time): a tenant's key gets
  403, anything else 401, and with no admin key configured they refuse everyone with a 403 saying so.
- Each endpoint (routes.py) calls its check on the app's one `Auth` before it reads the body.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from starlette.requests import Request

from kvfence.api.errors import APIError


@dataclass(frozen=True)
class Auth:
    api_keys: dict[str, str] | None
    admin_key: str | None

    def tenant(self, request: Request) -> str:
        """The tenant of the request's API key; 401 when the key is missing or unknown (auth on)."""
        if self.api_keys is None:
            return "default"
        key = _bearer_key(request)
        tenant = self.api_keys.get(key) if key else None
        if tenant is None:
            raise APIError(
                401, "Invalid or missing API key (send 'Authorization: Bearer KEY').", code="invalid_api_key"
            )
        return tenant

    def admin(self, request: Request) -> None:
        """Admin only: 401 without a known key, 403 for a tenant's key (and for everyone when the server
        has no admin key: the audit trail names tenants and pages, so it is never open by default)."""
        key = _bearer_key(request)
        if key and self.admin_key and hmac.compare_digest(key.encode(), self.admin_key.encode()):
            return
        if key and self.api_keys and key in self.api_keys:
            raise APIError(403, "This endpoint needs the admin key.", code="admin_only")
        if self.admin_key is None:  # say so: no key could open it, and a caller would retry forever
            message = (
                "No admin key is configured on this server: start it with --admin-key-file FILE (or "
                "$KVFENCE_ADMIN_KEY) to open this."
            )
            raise APIError(403, message, code="admin_key_not_configured")
        raise APIError(401, "Invalid or missing admin key.", code="invalid_api_key")

    def metrics(self, request: Request) -> None:
        """/metrics: open when auth is off (one tenant, nothing to hide from it); with API keys the admin
        key only, since token counts and prefix hits would tell one tenant about another's traffic."""
        if self.api_keys is not None:
            self.admin(request)


def _bearer_key(request: Request) -> str | None:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None
