"""Transport keys: who may talk to whom in a disaggregated deployment, decided by configuration.

A deployment's key directory holds one `NAME.secret` per process (its CURVE keypair, mode 0600, copied
only to the host that runs NAME) and one `peers` file, the allow-list every process loads:

    # name     role     public key (Z85, 40 chars)                 address it listens on ("-": none)
    router     router   rq:rM>}U?@Lx3Mwx+...                        tcp://10.0.0.9:5610
    prefill-0  prefill  8gh0...                                     tcp://10.0.0.1:5600
    prefill-1  prefill  ...                                         tcp://10.0.0.4:5600
    decode     decode   ...                                         tcp://10.0.0.2:5600

Workers are named by role and position (`worker_names`): the role itself when it has one worker, else
`ROLE-0`, `ROLE-1`... Each has its own keypair, so every worker is authenticated as itself.

A message's sender is the peer whose public key completed the CURVE handshake (ZAP User-Id), never a
field, a routing identity or an address inside the message; a process dials only addresses listed here.

Whoever can change the directory or `peers` decides who may talk, so `load` refuses either when it is
writable by group or others, and every key file owned by a user other than this process's or root (root
is accepted: it could replace kvfence itself). `generate` refuses to overwrite keys unless forced: new
keys lock out every host that still holds the old ones.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import zmq

ROLES = ("router", "prefill", "decode")
PEERS_FILE = "peers"
SECRET_SUFFIX = ".secret"
Z85_KEY_CHARS = 40
ROOT_UID = 0
SECRET_MODE, PEERS_MODE, DIRECTORY_MODE = 0o600, 0o644, 0o755


class KeyConfigError(ValueError):
    """A key directory that cannot be used as it is (missing file, bad line, readable secret...)."""


@dataclass(frozen=True)
class Peer:
    name: str
    role: str
    public_key: str  # Z85
    address: str | None  # where it listens; None for a process nobody dials


@dataclass(frozen=True)
class Identity:
    """This process's own keypair (Z85 text, as zmq's curve options take it)."""

    name: str
    public_key: str
    secret_key: str


@dataclass(frozen=True)
class TransportKeys:
    """What a process needs to speak CURVE: its own keypair and the allow-list."""

    identity: Identity
    book: PeerBook


class PeerBook:
    """The allow-list: peers by name, by public key and by address. Immutable after loading."""

    def __init__(self, peers: list[Peer]) -> None:
        self.by_name = {p.name: p for p in peers}
        self.by_key = {p.public_key: p for p in peers}
        self.by_address = {p.address: p for p in peers if p.address}
        if len(self.by_name) != len(peers) or len(self.by_key) != len(peers):
            raise KeyConfigError("a name or a public key appears twice in the peers file")

    def __iter__(self) -> Iterator[Peer]:
        return iter(self.by_name.values())

    def render(self) -> str:
        lines = ["# name role public-key address  (kvfence transport allow-list)"]
        lines += [f"{p.name} {p.role} {p.public_key} {p.address or '-'}" for p in self]
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, text: str) -> PeerBook:
        peers = []
        for number, line in enumerate(text.splitlines(), 1):
            words = line.split()
            if not words or words[0].startswith("#"):  # a comment line ('#' is also a Z85 digit)
                continue
            if len(words) != 4 or words[1] not in ROLES or len(words[2]) != Z85_KEY_CHARS:
                raise KeyConfigError(f"peers line {number}: expected 'NAME ROLE PUBLIC_KEY ADDRESS|-'")
            name, role, key, address = words
            peers.append(Peer(name, role, key, None if address == "-" else address))
        return cls(peers)


def worker_names(role: str, count: int) -> list[str]:
    """The names of `count` workers of `role`: the role itself for one, else ROLE-0, ROLE-1..."""
    return [role] if count == 1 else [f"{role}-{i}" for i in range(count)]


def role_of(name: str) -> str:
    """The role of a name `worker_names` made (`decode-1` -> `decode`)."""
    return name.partition("-")[0]


def named(role: str, addresses: list[str]) -> list[tuple[str, str, str]]:
    """(name, role, address) for each worker of `role`, as `ephemeral` and `generate` take them."""
    return [(name, role, a) for name, a in zip(worker_names(role, len(addresses)), addresses, strict=True)]


def ephemeral(specs: list[tuple[str, str, str | None]]) -> dict[str, TransportKeys]:
    """Fresh keypairs for (name, role, address), in memory: each name's keys and the shared allow-list.
    What `serve --disaggregated` gives its own children; nothing is written anywhere."""
    identities, peers = {}, []
    for name, role, address in specs:
        if role not in ROLES:
            raise KeyConfigError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
        public, secret = (k.decode() for k in zmq.curve_keypair())
        identities[name] = Identity(name, public, secret)
        peers.append(Peer(name, role, public, address))
    book = PeerBook(peers)
    return {name: TransportKeys(identity, book) for name, identity in identities.items()}


def generate(directory: Path, specs: list[tuple[str, str, str | None]], force: bool = False) -> PeerBook:
    """New keypairs for (name, role, address) into `directory`: NAME.secret (0600) each, and `peers`
    (0644). Keys already there are replaced only when `force` says so (else KeyConfigError)."""
    directory.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
    _check_guarded(directory)
    targets = [directory / PEERS_FILE, *(directory / f"{name}{SECRET_SUFFIX}" for name, _, _ in specs)]
    existing = [path for path in targets if path.exists()]
    if existing and not force:
        raise KeyConfigError(
            f"{existing[0]} already exists: give --force to replace the keys in {directory} "
            "(then copy the new ones to every host)"
        )
    keys = ephemeral(specs)
    for name, own in keys.items():
        secret = f"{own.identity.public_key}\n{own.identity.secret_key}\n"
        _write(directory / f"{name}{SECRET_SUFFIX}", secret, SECRET_MODE)
    book = next(iter(keys.values())).book
    _write(directory / PEERS_FILE, book.render(), PEERS_MODE)
    return book


def _write(path: Path, text: str, mode: int) -> None:
    """`text` into `path` with exactly `mode`: os.open's mode is masked by the umask and ignored for a
    file that exists, which --force overwrites."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, mode)
        f.write(text)


def load(directory: Path, name: str) -> TransportKeys:
    """This process's identity NAME and the allow-list, both from `directory`; the identity must be in
    the allow-list (so every peer can recognise it), its secret readable by its owner only, and no other
    user able to change the directory, `peers` or the secret (see the module's docstring)."""
    peers_path, secret_path = directory / PEERS_FILE, directory / f"{name}{SECRET_SUFFIX}"
    for path in (peers_path, secret_path):
        if not path.is_file():
            raise KeyConfigError(f"{path} is missing (kvfence keys generate DIR writes it)")
    _check_guarded(directory)
    _check_guarded(peers_path)
    _check_owner(secret_path)
    if secret_path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyConfigError(f"{secret_path} is readable by others: chmod 600 it")
    lines = secret_path.read_text().split()
    if len(lines) != 2 or any(len(k) != Z85_KEY_CHARS for k in lines):
        raise KeyConfigError(f"{secret_path}: expected two Z85 keys (public, secret)")
    book = PeerBook.parse(peers_path.read_text())
    me = book.by_name.get(name)
    if me is None or me.public_key != lines[0]:
        raise KeyConfigError(f"{name} is not in {peers_path} with the public key of {secret_path}")
    return TransportKeys(Identity(name, lines[0], lines[1]), book)


def _check_guarded(path: Path) -> None:
    """Refuse the key directory or `peers` when another user could rewrite it, and so add a peer."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KeyConfigError(
            f"{path} is writable by group or others (mode {mode:04o}), who could add a peer: "
            f"chmod go-w {path}"
        )
    _check_owner(path)


def _check_owner(path: Path) -> None:
    """Refuse a key file owned by a user other than this process's or root: it could change the file."""
    owner, me = path.stat().st_uid, os.geteuid()
    if owner not in (me, ROOT_UID):
        raise KeyConfigError(
            f"{path} is owned by uid {owner}, neither this process's user (uid {me}) nor root, who could "
            f"change it: chown {me} {path}"
        )


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ tcp address stays on this host (127.0.0.0/8, ::1, localhost)."""
    host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def resolve(directory: Path | None, name: str, addresses: list[str], insecure: bool) -> TransportKeys | None:
    """The keys a process starts with: loaded from `directory`, or None for an insecure transport, which
    is refused (KeyConfigError) when any of `addresses` leaves this host, unless `insecure` says so."""
    if directory is not None:
        return load(directory, name)
    remote = [a for a in addresses if not is_loopback(a)]
    if remote and not insecure:
        raise KeyConfigError(
            f"{', '.join(remote)} is not a loopback address and no transport keys were given: anyone who can "
            "reach it could act as any tenant. Give --keys DIR (kvfence keys generate DIR ...), or "
            "--insecure-transport on a network you trust."
        )
    return None
