"""Who a landing process runs as, what it inherits, and what its worker observes of it from outside.

The landing process is reachable through UCX, so it is treated as hostile from its first frame. Contract:
- It runs under a uid of its own: never root, never its worker's uid, never the shared `nobody`. By
  default `LANDING_UID_BASE + the worker's pid` (unique among the workers alive on the host, so no two
  landing processes share one: one taken over through UCX cannot reach another); `--landing-uid` picks
  one per deployment. Its gid is the same number and it has no supplementary groups.
- It is not dumpable: no process but root may ptrace it, take its file descriptors (`pidfd_getfd`) or
  read its memory or environment (`/proc/PID/mem`, `/proc/PID/environ`).
- It inherits an allow-listed environment (`landing_env`): locale, paths and UCX/NIXL tuning, no
  `KVFENCE_*` variable and nothing else a worker holds (API keys, the admin key). UCX's cross-memory
  attach is off unless `UCX_TLS` says otherwise (it needs a dumpable peer); its TCP segments and socket
  buffers are larger than UCX's own unless the environment names them (`UCX_TCP`).
- Only root can start one: a worker that is not root has no other uid to give it, so `--kv-transport
  nixl` is refused there (`separation_refusal`) and `auto` takes the sealed ZeroMQ transport.
- Opt-in cross-memory attach (`cma`, `--landing-cma`, which needs `--landing-uid`): the landing processes
  of a deployment share that one uid (never a worker's) and stay dumpable to it, so that UCX moves pages
  between two of them with one process_vm_writev instead of TCP (bench/kv_transport.py, two runs: a
  16-page WRITE 5.2-6.6 against 2.6-2.9 GB/s, a sealed request 2.02-2.29x CURVE ZeroMQ against
  1.57-1.64x). The cost: a process of that
  uid (a landing process taken over through UCX) may ptrace every other landing process and read its
  memory: sealed pages, no key and no plaintext, and it could already forge writes into them through
  UCX; no other uid gains anything. `not_dumpable` is then false, and the data plane is not reported
  sealed.
- `observe` reads each condition from /proc, never from what the landing process says.
"""

from __future__ import annotations

import ctypes
import os
import resource

NOBODY = 65534
LANDING_UID_BASE = 0x4B560000  # "KV": far above the uids of people and packages; + a pid (< 2^22)
_PR_SET_DUMPABLE, _PR_GET_DUMPABLE = 4, 3
ENV_NAMES = ("PATH", "LANG", "LC_ALL", "TZ", "TMPDIR", "LD_LIBRARY_PATH")
ENV_PREFIXES = ("UCX_", "NIXL_")
# Without cross-memory attach UCX moves pages over TCP: in larger segments and socket buffers than its own
# (8K / 64K), bench/kv_transport.py's WRITE of 16 pages ran 2.53-2.87 GB/s against 2.10-2.46 and a sealed
# request 1.26-1.40 against 1.21-1.31 (three A-B pairs, one machine). The operator's own UCX_* win.
UCX_TCP = {
    "UCX_TCP_TX_SEG_SIZE": "256k",
    "UCX_TCP_RX_SEG_SIZE": "1m",
    "UCX_TCP_SNDBUF": "4m",
    "UCX_TCP_RCVBUF": "4m",
}
# What one landing process may use of the host: no core files (they would hold its memory), a bounded log.
LIMITS = {resource.RLIMIT_CORE: 0, resource.RLIMIT_FSIZE: 64 << 20}


def separation_refusal() -> str | None:
    """Why a landing process cannot run under a uid of its own here, or None when it can."""
    if os.geteuid() != 0:
        return (
            f"this server runs as uid {os.geteuid()}, not root, so it cannot run its NIXL landing process "
            "under a uid of its own (UCX lets anyone who reaches it read and write that process; as this "
            "server's uid it could read the server's memory and key files). Start as root, or use "
            "--kv-transport zmq (pages sealed on the CURVE channel)"
        )
    return None


def landing_uid(requested: int | None, worker_pid: int) -> int:
    """The uid a worker's landing process runs under: `requested`, else one of its own for this worker."""
    uid = requested if requested is not None else LANDING_UID_BASE + worker_pid
    if uid in (0, NOBODY, os.geteuid()) or not 0 < uid < 2**31:
        raise ValueError(f"landing uid {uid}: must be a uid of its own (not root, nobody or the server's)")
    return uid


def landing_env(extra: dict[str, str], cma: bool = False) -> dict[str, str]:
    """The environment a landing process starts with: the allow-list above, then `extra`; with `cma`,
    UCX's own choice of transports (cross-memory attach among them)."""
    kept = {
        name: value
        for name, value in os.environ.items()
        if name in ENV_NAMES or name.startswith(ENV_PREFIXES)
    }
    # Cross-memory attach needs ptrace rights over the peer, which a process that is not dumpable grants
    # to nobody: UCX would pick it between two landing processes of one host and retry it forever.
    return {**({} if cma else {"UCX_TLS": "^cma"}), **UCX_TCP, **kept, **extra}


def drop_privileges(uid: int, dumpable: bool = False) -> None:
    """In the landing process, before its agent exists: limits, then the uid (every one of the four) and
    gid of its own, no groups, not dumpable (or, for cross-memory attach, dumpable to that uid alone: the
    kernel lets root and processes of the same uid ptrace it). Raises if any of it did not hold."""
    for limit, value in LIMITS.items():
        resource.setrlimit(limit, (value, value))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    libc = ctypes.CDLL(None, use_errno=True)
    # Changing uid already clears it (fs.suid_dumpable is 0 by default); say so whatever the sysctl.
    libc.prctl(_PR_SET_DUMPABLE, int(dumpable), 0, 0, 0)
    held = libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == int(dumpable)
    if os.getresuid() != (uid, uid, uid) or os.getgroups() or not held:
        raise RuntimeError("the landing process did not drop its privileges")


def observe(pid: int, uid: int) -> dict[str, bool]:
    """What holds of landing process `pid` as /proc shows it: every uid is `uid` and `uid` is its own
    (`separate_uid`); its /proc entries belong to root, which the kernel does for a process that is not
    dumpable (`not_dumpable`; the directory itself keeps the process's uid). A process that is gone
    holds nothing."""
    try:
        status = open(f"/proc/{pid}/status").read()  # noqa: SIM115
        owner = os.stat(f"/proc/{pid}/environ").st_uid
    except OSError:
        return {"separate_uid": False, "not_dumpable": False}
    uids = next((line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")), [])
    separate = uids == [str(uid)] * 4 and uid not in (0, NOBODY, os.geteuid())
    return {"separate_uid": separate, "not_dumpable": separate and owner == 0}
