"""What a Ray cluster a `kvfence serve` started holds, as its tests read it: Ray's state API through a
fresh client interpreter (JSON back, nothing unpickled), where each of a set of secrets is found (that
state, the live actors' environments, the session's files), and the processes a session directory left.

Contracts: the client is given the cluster's token by its file's path only; `secrets_found` names every
place a secret was found ([] when none) and reads every regular file under the session directory; a probe
that fails raises with its stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLIENT_TIMEOUT_S = 90.0
LOG_SUFFIXES = (".log", ".err", ".out")

# Run by a fresh interpreter with the token in its environment: Ray's state API (actors, tasks, jobs,
# placement groups) and the GCS's placement group table as JSON on the last line of stdout.
STATE_PROBE = """
import json, sys, ray
from ray.util.state import list_actors, list_jobs, list_placement_groups, list_tasks
ray.init(address=sys.argv[1], log_to_driver=False)
where = {"address": "http://" + sys.argv[2], "detail": True}  # this cluster's dashboard: others may run
def rows(listed):
    return [json.loads(json.dumps(getattr(row, "__dict__", row), default=str)) for row in listed]
listed = {"actors": list_actors, "tasks": list_tasks, "jobs": list_jobs,
          "placement_groups": list_placement_groups}
state = {what: rows(lister(**where)) for what, lister in listed.items()}
state["placement_group_table"] = ray.util.placement_group_table()  # the GCS's own: strategies, nodes
print(json.dumps(state, default=str))
"""


@dataclass(frozen=True)
class RayCluster:
    """A cluster as a client reaches it: its GCS and dashboard (HOST:PORT), its token's file, a directory
    for the client's HOME."""

    gcs: str
    dashboard: str
    token_path: Path
    home: Path

    def python(self, code: str, *args: str) -> subprocess.CompletedProcess[str]:
        """`python -c CODE GCS ARGS` as a Ray client holding this cluster's token (by its file's path)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        env |= {"HOME": str(self.home), "RAY_USAGE_STATS_ENABLED": "0"}
        env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}
        command = [sys.executable, "-c", code, self.gcs, *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)

    def state(self) -> dict[str, Any]:
        """Ray's state API (actors, tasks, jobs, placement groups) and placement group table, as JSON."""
        probe = self.python(STATE_PROBE, self.dashboard)
        if probe.returncode != 0:
            raise RuntimeError(f"the state probe failed:\n{probe.stderr[-3000:]}")
        return json.loads(probe.stdout.strip().splitlines()[-1])


def session_files(session: Path) -> list[Path]:
    return [p for p in session.rglob("*") if p.is_file() and not p.is_symlink()]


def secrets_found(
    state: dict[str, Any], pids: list[int], session: Path, secrets: dict[str, str]
) -> list[str]:
    """'WHAT in WHERE' for each secret (by what it is) found in Ray's `state`, the environment of any of
    `pids` or a file under `session`."""
    found, dump = [], json.dumps(state)
    places: list[tuple[str, bytes]] = [("Ray's state", dump.encode())]
    for pid in pids:
        with contextlib.suppress(OSError):  # gone since the state was read
            places.append((f"the environment of pid {pid}", Path(f"/proc/{pid}/environ").read_bytes()))
    for path in session_files(session):
        with contextlib.suppress(OSError):
            places.append((str(path), path.read_bytes()))
    for what, secret in secrets.items():
        found += [f"{what} in {where}" for where, data in places if secret.encode() in data]
    return found


def processes_under(directory: Path) -> list[int]:
    """Live processes whose command line names `directory` (a Ray session's raylet, GCS, workers...)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                if str(directory).encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    pids.append(int(entry))
    return pids
