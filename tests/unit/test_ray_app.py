"""kvfence on Ray Serve without a cluster: the Serve config and the KubeRay RayService carry one serve
config, `kvfence.ray:app` builds an Application from it, and every option Ray cannot honour (or a key from
the environment) is refused in one line before Ray starts. The cluster: tests/integration/test_ray_serve.py.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from kvfence.cli import main
from kvfence.cli_checks import StartupError
from kvfence.ray.local import WORKER_NICENESS, ray_token, replica_argv
from kvfence.ray.replica import REPLICA_HEADER, ReplicaHeader, parse_replica_args

serve = pytest.importorskip("ray.serve")

DEPLOY = Path(__file__).parents[2] / "deploy"


def serve_config() -> dict:
    return yaml.safe_load((DEPLOY / "ray" / "serve.yaml").read_text())


def test_the_rayservice_carries_serve_yaml() -> None:
    service = yaml.safe_load((DEPLOY / "kuberay" / "rayservice.yaml").read_text())
    assert service["kind"] == "RayService"
    assert yaml.safe_load(service["spec"]["serveConfigV2"]) == serve_config()
    cluster = service["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:  # token auth in every Ray container, the token by path only
        for container in pod["spec"]["containers"]:
            env = {e["name"]: e["value"] for e in container["env"]}
            assert env["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN" not in env
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert Path(env["RAY_AUTH_TOKEN_PATH"]).parent.as_posix() in mounts
    args = serve_config()["applications"][0]["args"]["serve_args"]
    key_files = [args[args.index(flag) + 1] for flag in ("--api-keys", "--admin-key-file")]
    assert all(Path(path).parent.as_posix() in mounts for path in key_files)  # from the mounted Secret


def test_serve_yaml_builds_an_application() -> None:
    """The config's args through the builder Serve calls, no cluster: 2 replicas, the words as given."""
    from kvfence.ray import app

    (application,) = serve_config()["applications"]
    assert application["import_path"] == "kvfence.ray:app"
    built = app(application["args"])
    assert isinstance(built, serve.Application)
    front, deployment = _deployments(built)
    assert front.num_replicas == 1 and front.ray_actor_options == {"num_cpus": 0}
    assert front.max_ongoing_requests == 2 * deployment.max_ongoing_requests  # the servers' slots
    assert deployment.num_replicas == 2 and deployment.ray_actor_options == {"num_cpus": 1}
    assert deployment.init_args == (application["args"]["serve_args"],)
    assert front.init_args[1] == application["args"]["serve_args"]
    assert not any("SECRET" in str(word).upper() for word in deployment.init_args[0])  # paths, not keys
    router = deployment._deployment_config.request_router_config
    assert router.request_router_class == "kvfence.ray.router:TenantPrefixRouter"  # the default


def _deployments(built: serve.Application) -> tuple[serve.Deployment, serve.Deployment]:
    """The front and the servers (Ray's Application exposes its deployment only so)."""
    front = built._bound_deployment
    return front, front.init_args[0]._bound_deployment


def test_power_of_two_is_rays_own_router() -> None:
    from ray.serve._private.constants import DEFAULT_REQUEST_ROUTER_PATH

    from kvfence.ray import app

    _, deployment = _deployments(app({"serve_args": [], "router": "power-of-two"}))
    router = deployment._deployment_config.request_router_config
    assert router.request_router_class == DEFAULT_REQUEST_ROUTER_PATH


def test_the_builder_takes_serve_run_strings() -> None:
    """`serve run kvfence.ray:app serve_args="..." num_replicas=2`: strings, split and converted."""
    from kvfence.ray import app

    built = app({"serve_args": "--model smollm2 --num-threads 1", "num_replicas": "2", "num_cpus": "0.5"})
    _, deployment = _deployments(built)
    assert deployment.init_args == (["--model", "smollm2", "--num-threads", "1"],)
    assert (deployment.num_replicas, deployment.ray_actor_options) == (2, {"num_cpus": 0.5})


def test_the_builder_hands_serve_its_autoscaling_config() -> None:
    from kvfence.ray import app

    scaling = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1}
    front, deployment = _deployments(app({"serve_args": [], "autoscaling_config": scaling}))
    config = deployment._deployment_config.autoscaling_config  # Ray's Deployment exposes it only so
    assert (config.min_replicas, config.max_replicas, config.target_ongoing_requests) == (1, 2, 1)
    assert front._deployment_config.autoscaling_config is None and front.num_replicas == 1  # servers scale
    assert front.max_ongoing_requests == 2 * deployment.max_ongoing_requests  # slots for the most servers
    router = deployment._deployment_config.request_router_config  # scaling keeps the tenant router
    assert router.request_router_class == "kvfence.ray.router:TenantPrefixRouter"


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ({"serve_args": ["--port", "9000"]}, "--port: not for a Ray Serve replica"),
        ({"serve_args": ["--host=0.0.0.0"]}, "--host: not for a Ray Serve replica"),
        ({"serve_args": ["--disaggregated"]}, "--disaggregated: not for a Ray Serve replica"),
        ({"serve_args": ["--ray-replicas", "2"]}, "--ray-replicas: not for a Ray Serve replica"),
        ({"serve_args": ["--num-pages", "zero"]}, "--num-pages: must be a positive integer"),
        ({"serve_args": ["--admin-key", "sk-x"]}, "--admin-key is refused"),
        ({"serve_args": [], "replicas": 2}, "unknown argument 'replicas'"),
        ({"serve_args": [], "num_replicas": 0}, "num_replicas must be a whole number from 1 to 64"),
        ({"serve_args": [], "num_replicas": 1.5}, "num_replicas must be a whole number"),
        ({"serve_args": [], "num_cpus": "-1"}, "num_cpus must be a number above 0"),
        ({"serve_args": [], "router": "prefix"}, "router must be one of kvfence, power-of-two"),
        ({"serve_args": [], "autoscaling_config": 2}, "autoscaling_config must be a mapping"),
        ({"serve_args": [], "num_replicas": 2, "autoscaling_config": {}}, "not both"),
        (
            {"serve_args": [], "autoscaling_config": {"min_replicas": 3, "max_replicas": 2}},
            "autoscaling_config:",
        ),
    ],
)
def test_the_builder_refuses_in_one_line(args: dict, error: str) -> None:
    from kvfence.ray import app

    with pytest.raises(ValueError, match=r"^kvfence\.ray:app: ") as refused:
        app(args)
    assert error in str(refused.value) and "\n" not in str(refused.value)


def test_a_replica_parse_error_raises_not_exits() -> None:
    """In a replica an argparse exit would end Ray's worker process with a bare status."""
    with pytest.raises(StartupError, match="unrecognized arguments: --no-such-flag"):
        parse_replica_args(["--no-such-flag"])


def test_the_command_hands_replicas_its_arguments_less_its_own() -> None:
    argv = ["serve", "--ray-replicas", "2", "--port=9000", "--host", "0.0.0.0", "--num-pages", "64"]
    argv += ["--ray-address", "10.0.0.1:6379", "--insecure-ray", "--ray-replica-cpus", "0.5", "--model", "m"]
    argv += ["--ray-router", "power-of-two"]
    assert replica_argv(argv) == ["--num-pages", "64", "--model", "m"]


@pytest.mark.parametrize(
    ("address", "preset", "expected"), [(None, None, "0"), (None, "5", "5"), ("h:1", None, None)]
)
def test_a_cluster_started_here_runs_its_workers_at_normal_priority(
    monkeypatch: pytest.MonkeyPatch, address: str | None, preset: str | None, expected: str | None
) -> None:
    """Ray's default niceness (15) starves the replicas beside other work: 0 for a cluster kvfence starts,
    unless the operator set it; a cluster joined is started by someone else, its raylet already set."""
    environ = {k: v for k, v in os.environ.items() if k != WORKER_NICENESS}
    monkeypatch.setattr(os, "environ", environ | ({WORKER_NICENESS: preset} if preset else {}))
    args = argparse.Namespace(ray_address=address, insecure_ray=False)
    with ray_token(args) as token_path:
        assert os.environ.get(WORKER_NICENESS) == expected
        assert (token_path is None) == (address is not None)
        assert token_path is None or token_path.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--ray-replicas", "2", "--disaggregated"], "error: --disaggregated: not for a Ray Serve replica"),
        (
            ["--ray-replicas", "2", "--audit-log", "a.jsonl"],
            "error: --audit-log: not for a Ray Serve replica",
        ),
        (["--ray-address", "10.0.0.1:6379"], "error: --ray-address: only with --ray-replicas N"),
        (["--ray-router", "power-of-two"], "error: --ray-router: only with --ray-replicas N"),
        (["--ray-replicas", "2", "--insecure-ray"], "error: --insecure-ray: a cluster kvfence starts always"),
        (
            ["--ray-replicas", "2", "--ray-address", "h:1", "--ray-temp-dir", "/tmp/r"],
            "error: --ray-temp-dir",
        ),
    ],
)
def test_serve_on_ray_refuses_before_ray_starts(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *argv]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(error), lines


def test_keys_from_the_environment_are_refused_on_ray(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key in the environment would reach the replicas only through Ray's: refused, naming the file."""
    monkeypatch.setenv("KVFENCE_API_KEYS", "sk-env tenant-a")
    assert main(["serve", "--ray-replicas", "2"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "$KVFENCE_API_KEYS is set" in line and "--api-keys FILE" in line and "sk-env" not in line


def test_a_readable_key_file_is_refused_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command runs `kvfence serve`'s own checks on its replicas' options before any Ray process."""
    keys = tmp_path / "keys"
    keys.write_text("sk-a tenant-a\n")
    os.chmod(keys, 0o644)
    assert main(["serve", "--ray-replicas", "2", "--api-keys", str(keys)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert (
        line
        == f"error: --api-keys {keys}: its mode 0644 gives other users access to the key; chmod 600 {keys}"
    )


def test_the_replica_header_is_on_every_response_streams_included() -> None:
    async def stream(_: object) -> StreamingResponse:
        async def pieces() -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(pieces(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/s", stream)])
    app.add_middleware(ReplicaHeader, replica="r-1")
    with TestClient(app) as client:
        response = client.get("/s")
        missing = client.get("/nowhere")
    assert response.headers[REPLICA_HEADER] == "r-1" and response.text == "data: 1\n\ndata: [DONE]\n\n"
    assert missing.status_code == 404 and missing.headers[REPLICA_HEADER] == "r-1"
