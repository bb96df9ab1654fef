"""`kvfence serve --disaggregated --ray`: the prefill and decode workers as Ray actors, the router (kvfence's
front door) on the command's own process, the sealed handoff between them unchanged.

Each worker is one actor running `disagg.launch.run_worker` (the one-machine launcher's worker main, same
arguments) on a thread of its own; the actor exits when that thread ends, however it ends. Ray restarts a
dead actor (`max_restarts`, the launcher's RESTART_LIMIT) on its bundle with the same arguments, so it binds
the same address with the same keys and the router re-learns it as it re-learns a restarted process.

Placement: one placement group, one bundle per worker (its CPUs), strategy SPREAD (Ray's best effort across
nodes; it still places every bundle on one node when that is all there is, where STRICT_SPREAD would
never be ready). Each bundle also holds a sliver of its host's `node:IP` resource, so a worker runs on the
host its address names in `peers`: a loopback address is the command's own node.

Keys: the workers' CURVE keys are files. Without --keys, this run's keys are written to a new directory
(0700, NAME.secret 0600, removed on exit) on the command's host, every address loopback, so every worker
runs on that node. With --keys DIR (`kvfence keys generate`), DIR/peers names each worker's address and
the operator has copied NAME.secret and peers to DIR on that host. An actor is given the directory's path
and its name, never a key: each reads its own secret there (`keys.load`: owner-only or refused), so no
secret is in Ray's actor arguments, runtime_env or GCS. The engine config names the tier key's file too.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfence.cli_checks import DEFAULT_RAY_ROUTER, StartupError, check_ray_environment
from kvfence.config import EngineConfig
from kvfence.disagg.keys import (
    PEERS_FILE,
    KeyConfigError,
    PeerBook,
    TransportKeys,
    generate,
    is_loopback,
    load,
    role_of,
)
from kvfence.disagg.launch import MAX_ADDRESS_BYTES, RESTART_LIMIT, START_TIMEOUT_S, free_ports, run_worker
from kvfence.disagg.plane import KvPlane

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup

PLACEMENT_STRATEGY = "SPREAD"
PLACEMENT_TIMEOUT_S = 120.0  # a hang guard: a bundle no node can hold is never ready
NODE_SHARE = 0.001  # of a node's `node:IP` resource (1.0): pins a bundle to that host, takes nothing
ACTOR_EXIT_CODE = 1
# The router: the command itself (its front door and the handoff's control plane), given the worker
# addresses by role, its listen address and its keys.
RouterMain = Callable[[list[str], list[str], str, TransportKeys], int]


class WorkerActor:
    """One prefill or decode worker in a Ray actor: `run_worker` on a thread, the actor's process ended
    (so Ray restarts it) when the worker stops, whether it raised or not."""

    def __init__(self, name: str, config: EngineConfig, bind: str, key_dir: str, plane: KvPlane) -> None:
        self.name = name
        keys = load(Path(key_dir), name)  # this actor's secret, read here: never an argument
        self._announced, ready = mp.Pipe(duplex=False)
        self._thread = threading.Thread(
            target=self._serve, args=(config, bind, ready, keys, plane), name=f"kvfence-{name}", daemon=True
        )
        self._thread.start()

    def _serve(
        self, config: EngineConfig, bind: str, ready: Any, keys: TransportKeys, plane: KvPlane
    ) -> None:
        try:
            run_worker(self.name, config, bind, ready, keys, plane)
        finally:
            os._exit(ACTOR_EXIT_CODE)  # a worker never returns: the actor dies with it, and Ray restarts it

    def address(self) -> str:
        """The worker's bound address, once its engine is loaded and it listens (RuntimeError otherwise)."""
        if not self._announced.poll(START_TIMEOUT_S):
            raise RuntimeError(f"the {self.name} worker did not start within {START_TIMEOUT_S:.0f}s")
        return self._announced.recv_bytes(MAX_ADDRESS_BYTES).decode()

    def __repr__(self) -> str:  # Ray's state API shows it (repr_name): which worker an actor is
        return f"WorkerActor({self.name})"


@contextlib.contextmanager
def key_directory(given: Path | None, names: list[str]) -> Iterator[Path]:
    """The key directory: --keys DIR, checked to name every worker and the router; or this run's keys
    (loopback addresses on free ports) in a new owner-only directory, removed when the block ends."""
    if given is not None:
        book = _peers(given)
        missing = [name for name in [*names, "router"] if name not in book.by_name]
        wrong = [n for n in names if n in book.by_name and book.by_name[n].role != role_of(n)]
        if missing or wrong or book.by_name["router"].address is None:
            problem = (
                f"no {missing[0]}" if missing else (f"{wrong[0]}'s role" if wrong else "no router address")
            )
            raise StartupError(f"--keys {given}: {problem} in {given / PEERS_FILE} (kvfence keys generate)")
        yield given
        return
    directory = Path(tempfile.mkdtemp(prefix="kvfence-pd-keys-"))  # mode 0700
    try:
        ports = free_ports(len(names) + 1)
        specs = [
            (n, role_of(n), f"tcp://127.0.0.1:{p}") for n, p in zip([*names, "router"], ports, strict=True)
        ]
        generate(directory, specs)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _peers(directory: Path) -> PeerBook:
    try:
        return PeerBook.parse((directory / PEERS_FILE).read_text())
    except (OSError, KeyConfigError) as exc:
        raise StartupError(f"--keys {directory}: {exc}") from None


class RayWorkers:
    """The workers `names` as actors in one placement group (module docstring), each reading its keys
    from `key_dir`; `addresses` by name once every one listens; actors and group removed when the block
    ends, however it ends."""

    def __init__(
        self, names: list[str], config: EngineConfig, key_dir: Path, plane: KvPlane, cpus: float
    ) -> None:
        self.names, self.config, self.key_dir, self.plane, self.cpus = names, config, key_dir, plane, cpus
        self.book = _peers(key_dir)
        self.actors: dict[str, ActorHandle] = {}
        self.group: PlacementGroup | None = None

    def __enter__(self) -> RayWorkers:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        here = ray.util.get_node_ip_address()
        hosts = {name: worker_host(self.book.by_name[name].address or "", here) for name in self.names}
        bundles = [{"CPU": self.cpus, f"node:{hosts[name]}": NODE_SHARE} for name in self.names]
        self.group = placement_group(bundles, strategy=PLACEMENT_STRATEGY)
        if not self.group.wait(PLACEMENT_TIMEOUT_S):
            wanted = ", ".join(f"{name} on {hosts[name]}" for name in self.names)
            raise StartupError(
                f"--ray: the cluster cannot place the workers ({wanted}, {self.cpus} CPU each)"
            )
        actor = ray.remote(WorkerActor)
        for index, name in enumerate(self.names):
            placed = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)
            self.actors[name] = actor.options(
                num_cpus=self.cpus, max_restarts=RESTART_LIMIT, max_task_retries=0, scheduling_strategy=placed
            ).remote(name, self.config, self.book.by_name[name].address, str(self.key_dir), self.plane)
        try:
            ray.get([handle.address.remote() for handle in self.actors.values()])
        except ray.exceptions.RayError as exc:
            raise StartupError(f"--ray: a worker did not start ({str(exc).splitlines()[-1]})") from None

    def addresses(self, role: str) -> list[str]:
        return [self.book.by_name[name].address or "" for name in self.names if role_of(name) == role]

    def __exit__(self, *exc: object) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for handle in self.actors.values():
            with contextlib.suppress(Exception):  # already gone: nothing to stop
                ray.kill(handle, no_restart=True)
        if self.group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.group)


def worker_host(address: str, here: str) -> str:
    """The node a worker's address puts it on: this node for a loopback address, else the address's host."""
    return here if is_loopback(address) else address.removeprefix("tcp://").rpartition(":")[0].strip("[]")


def check_options(args: Any) -> None:
    """What `serve --disaggregated --ray` refuses before anything starts (StartupError, one line)."""
    for option, given, why in (
        ("--ray-replicas", args.ray_replicas is not None, "the workers are Ray actors, not Serve replicas"),
        (
            "--ray-router",
            args.ray_router != DEFAULT_RAY_ROUTER,
            "the router is kvfence's own, on this process",
        ),
        ("--insecure-transport", args.insecure_transport, "each worker reads its CURVE keys from a file"),
    ):
        if given:
            raise StartupError(f"{option}: not with --disaggregated --ray: {why}")


def serve_workers(
    args: Any, config: EngineConfig, names: list[str], plane: KvPlane, router: RouterMain
) -> int:
    """Start or join Ray (its token authentication as `--ray-replicas` has it), place the workers, run the
    router here until it stops; then remove the actors and, on a cluster started here, stop Ray."""
    from kvfence.ray.local import ray_cluster, ray_token  # Ray's session: only for a server on Ray

    check_ray_environment()
    with key_directory(args.keys, names) as key_dir, ray_token(args) as token_path:
        keys = _router_keys(key_dir)
        with (
            ray_cluster(args, token_path, "--ray"),
            RayWorkers(names, config, key_dir, plane, args.ray_replica_cpus) as workers,
        ):
            placed = f"{len(names)} workers placed ({PLACEMENT_STRATEGY}), keys read from {key_dir}"
            print(f"ray: {placed}", file=sys.stderr, flush=True)
            listen = workers.book.by_name["router"].address or ""
            return router(workers.addresses("prefill"), workers.addresses("decode"), listen, keys)


def _router_keys(key_dir: Path) -> TransportKeys:
    try:
        return load(key_dir, "router")
    except KeyConfigError as exc:
        raise StartupError(f"--keys: {exc}") from None
