"""The Ray Serve application builder: `app(args)` for `serve run kvfence.ray:app serve_args="..."` and for a
Serve config's `import_path: kvfence.ray:app` with `args` (deploy/ray/serve.yaml).

Contracts: `args` takes `serve_args` (the `kvfence serve` arguments of every replica: a list of words, or
one string split as a shell splits it), `num_replicas` (a whole number from 1 to 64, default 1),
`num_cpus` (Ray CPUs a replica reserves, above 0, default 1), `autoscaling_config` (Ray Serve's, a
mapping Serve checks; instead of `num_replicas`; it scales the servers) and `router` (`kvfence`, the
default: kvfence's tenant-scoped prefix router, kvfence.ray.router; or `power-of-two`, Ray's default
router), nothing else: an unknown or bad key is one line (ValueError). The arguments are parsed and refused
where Ray cannot honour an option before anything is deployed (kvfence.ray.replica.parse_replica_args); no
key file is read here, where the builder runs: each replica reads its own. The Application carries those
words only. The application is kvfence's front (kvfence.ray.front, the ingress: one replica, no CPU
reserved, it only reads bodies and forwards; as many requests at once as the servers together take, at
their most replicas) over the `num_replicas` servers (or as many as the autoscaling config sets), whose
handle routes with the router chosen.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvfence.cli_checks import DEFAULT_RAY_REPLICA_CPUS, DEFAULT_RAY_ROUTER, StartupError
from kvfence.cli_options import MAX_WORKERS_PER_ROLE
from kvfence.startup import reason

if TYPE_CHECKING:
    from ray.serve import Application

APP_KEYS = ("serve_args", "num_replicas", "num_cpus", "autoscaling_config", "router")
# --ray-router / `router`: the servers' request router (a Serve import path; None: Ray's default)
ROUTERS = {"kvfence": "kvfence.ray.router:TenantPrefixRouter", "power-of-two": None}


@dataclass(frozen=True)
class AppOptions:
    """The application's settings, checked."""

    serve_args: tuple[str, ...]
    num_replicas: int = 1
    num_cpus: float = DEFAULT_RAY_REPLICA_CPUS
    autoscaling: tuple[tuple[str, Any], ...] | None = None  # Serve's autoscaling_config, as given
    router: str = DEFAULT_RAY_ROUTER

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> AppOptions:
        unknown = sorted(set(args) - set(APP_KEYS))
        if unknown:
            raise ValueError(
                f"kvfence.ray:app: unknown argument {unknown[0]!r}; it takes {', '.join(APP_KEYS)}"
            )
        words = args.get("serve_args", [])
        if isinstance(words, str):
            words = shlex.split(words)
        if not isinstance(words, list | tuple) or not all(isinstance(w, str | int | float) for w in words):
            raise ValueError(
                "kvfence.ray:app: serve_args must be a list of kvfence serve arguments or a string"
            )
        replicas = _number(args.get("num_replicas", 1), int, "num_replicas", "a whole number from 1 to 64")
        if not 1 <= replicas <= MAX_WORKERS_PER_ROLE:
            raise ValueError(
                f"kvfence.ray:app: num_replicas must be a whole number from 1 to 64, got {replicas}"
            )
        cpus = _number(args.get("num_cpus", DEFAULT_RAY_REPLICA_CPUS), float, "num_cpus", "a number above 0")
        if not cpus > 0:
            raise ValueError(f"kvfence.ray:app: num_cpus must be a number above 0, got {cpus}")
        autoscaling = args.get("autoscaling_config")
        if autoscaling is not None and not isinstance(autoscaling, dict):
            raise ValueError("kvfence.ray:app: autoscaling_config must be a mapping (Ray Serve's)")
        if autoscaling is not None and "num_replicas" in args:
            raise ValueError("kvfence.ray:app: give num_replicas or autoscaling_config, not both")
        scaling = tuple(sorted(autoscaling.items())) if autoscaling is not None else None
        router = args.get("router", DEFAULT_RAY_ROUTER)
        if router not in ROUTERS:
            raise ValueError(f"kvfence.ray:app: router must be one of {', '.join(ROUTERS)}, got {router!r}")
        return cls(tuple(str(w) for w in words), replicas, cpus, scaling, router)


def _number(value: Any, kind: type[int] | type[float], key: str, what: str) -> Any:
    """A config value (a YAML number or a `serve run key=value` string) as `kind`, or one line naming it."""
    if isinstance(value, bool):
        raise ValueError(f"kvfence.ray:app: {key} must be {what}, got {value!r}")
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"kvfence.ray:app: {key} must be {what}, got {value!r}") from None
    if kind is int and number != float(value):
        raise ValueError(f"kvfence.ray:app: {key} must be {what}, got {value!r}")
    return number


def app(args: dict[str, Any]) -> Application:
    """The kvfence application: the front over `num_replicas` kvfence servers, each reserving `num_cpus`."""
    from kvfence.ray.replica import parse_replica_args

    options = AppOptions.from_dict(args)
    try:
        parse_replica_args(options.serve_args)
    except StartupError as exc:
        raise ValueError(f"kvfence.ray:app: serve_args: {exc}") from None
    return fronted(options, ROUTERS[options.router])


def fronted(
    options: AppOptions, router_class: str | None, router_kwargs: dict[str, Any] | None = None
) -> Application:
    """The front over the servers, their handle routing with `router_class` (a Serve import path; None:
    Ray's default) given `router_kwargs` (the benchmark compares routers through this); the servers scale
    by `options.autoscaling` where it is given."""
    from ray.serve.config import RequestRouterConfig  # Ray: only once the options are good

    from kvfence.ray.deployment import KvfenceServer
    from kvfence.ray.front import KvfenceFront

    routing = {} if router_class is None else {"request_router_class": router_class}
    scale: dict[str, Any] = {"num_replicas": options.num_replicas}
    if options.autoscaling is not None:
        scale = {"autoscaling_config": dict(options.autoscaling)}
    try:
        servers = KvfenceServer.options(
            **scale,
            ray_actor_options={"num_cpus": options.num_cpus},
            request_router_config=RequestRouterConfig(**routing, request_router_kwargs=router_kwargs or {}),
        )
    except (TypeError, ValueError) as exc:  # Serve's check of autoscaling_config (pydantic's is a ValueError)
        raise ValueError(f"kvfence.ray:app: autoscaling_config: {reason(exc)}") from None
    # the front holds each request while a server answers it: as many at once as the servers take, at most
    most = options.num_replicas if options.autoscaling is None else _most_replicas(options.autoscaling)
    front = KvfenceFront.options(
        num_replicas=1,
        max_ongoing_requests=servers.max_ongoing_requests * most,
        ray_actor_options={"num_cpus": 0},
    )
    return front.bind(servers.bind(list(options.serve_args)), list(options.serve_args))


def _most_replicas(autoscaling: tuple[tuple[str, Any], ...]) -> int:
    """The servers' most replicas under their autoscaling config, Serve-checked (Serve's default: 1)."""
    return int(dict(autoscaling).get("max_replicas", 1))
