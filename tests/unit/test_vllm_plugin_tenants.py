"""The vLLM plugin's tenants (plugins/vllm/kvfence_vllm/tenants.py, issue 62): the cache_salt a request runs
under is its authenticated tenant's, whatever the client sends, and an unknown key never reaches vLLM."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from kvfence.harness.key_files import write_key_file
from kvfence_vllm.settings import PluginRefused
from kvfence_vllm.tenants import TenantSalt, tenant_keys

KEYS = {"sk-alice": "alice", "sk-bob": "bob"}


def client(seen: list[Any]) -> TestClient:
    """vLLM's place: an app that records the JSON body each request reaches it with."""

    async def echo(request: Request) -> JSONResponse:
        seen.append(json.loads(await request.body()))
        return JSONResponse({"ok": True})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({})

    app = Starlette(routes=[Route("/v1/completions", echo, methods=["POST"]), Route("/health", health)])
    return TestClient(TenantSalt(app, KEYS))


def post(test: TestClient, key: str | None, body: dict[str, Any]) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return test.post("/v1/completions", json=body, headers=headers)


def test_the_salt_is_the_tenants_and_a_client_salt_only_partitions_inside_it() -> None:
    seen: list[Any] = []
    test = client(seen)
    assert post(test, "sk-alice", {"prompt": "hi"}).status_code == 200
    assert post(test, "sk-bob", {"prompt": "hi", "cache_salt": "kvfence:alice"}).status_code == 200
    assert [s["cache_salt"] for s in seen] == ["kvfence:alice", "kvfence:bob:kvfence:alice"]
    assert all(s["prompt"] == "hi" for s in seen)


@pytest.mark.parametrize("key", [None, "sk-mallory", ""])
def test_a_request_without_a_known_key_is_a_401_that_never_reaches_vllm(key: str | None) -> None:
    seen: list[Any] = []
    reply = post(client(seen), key, {"prompt": "hi", "cache_salt": "kvfence:alice"})
    assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
    assert seen == []


def test_requests_outside_the_api_pass_untouched() -> None:
    assert client([]).get("/health").status_code == 200


def test_keys_come_from_the_file_then_vllms_keys_then_vllm_api_key(tmp_path: Path) -> None:
    path = write_key_file(tmp_path / "keys", ["sk-a alice", "sk-b bob"])
    assert tenant_keys(["k1"], {"KVFENCE_TENANT_KEYS": str(path)}) == {"sk-a": "alice", "sk-b": "bob"}
    assert tenant_keys(["k1", "k2"], {"VLLM_API_KEY": "k0"}) == {"k1": "api-key-1", "k2": "api-key-2"}
    assert tenant_keys(None, {"VLLM_API_KEY": "k0"}) == {"k0": "default"}
    assert tenant_keys(None, {}) == {}


def test_a_keys_file_others_can_read_is_refused_in_one_line_without_its_keys(tmp_path: Path) -> None:
    path = write_key_file(tmp_path / "keys", ["sk-secret alice"])
    os.chmod(path, 0o644)
    with pytest.raises(PluginRefused) as refused:
        tenant_keys(None, {"KVFENCE_TENANT_KEYS": str(path)})
    message = str(refused.value)
    assert "KVFENCE_TENANT_KEYS" in message and "chmod 600" in message and "\n" not in message
    assert "sk-secret" not in message
