"""Key material (kvfence.disagg.keys): whoever can change the key directory or its `peers` file decides
who may talk, so `load` refuses either when group or others can write it, and key files another user owns;
`kvfence keys generate` refuses to overwrite keys without --force, and with it replaces them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfence.cli import main
from kvfence.disagg.keys import PEERS_FILE, KeyConfigError, generate, load

ADDRESSES = {
    "router": "tcp://127.0.0.1:5610",
    "prefill": "tcp://127.0.0.1:5600",
    "decode": "tcp://127.0.0.1:5601",
}
SPECS = [(role, role, address) for role, address in ADDRESSES.items()]
OTHER_UID = 4242  # a user that is neither this process's nor root
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")


@pytest.fixture
def key_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "keys"
    generate(directory, SPECS)
    return directory


def generate_command(directory: Path, *extra: str) -> int:
    flags = [word for role, address in ADDRESSES.items() for word in (f"--{role}", address)]
    return main(["keys", "generate", str(directory), *flags, *extra])


def refusal(directory: Path) -> str:
    with pytest.raises(KeyConfigError) as caught:
        load(directory, "decode")
    message = str(caught.value)
    assert "\n" not in message  # the CLI prints it as one line
    return message


@pytest.mark.parametrize("mode", [0o666, 0o664, 0o646], ids=oct)
def test_a_peers_file_group_or_others_can_write_is_refused(key_dir: Path, mode: int) -> None:
    peers = key_dir / PEERS_FILE
    peers.chmod(mode)
    message = refusal(key_dir)
    assert str(peers) in message and f"{mode:04o}" in message and f"chmod go-w {peers}" in message


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777], ids=oct)
def test_a_key_directory_group_or_others_can_write_is_refused(key_dir: Path, mode: int) -> None:
    key_dir.chmod(mode)
    message = refusal(key_dir)
    assert str(key_dir) in message and f"{mode:04o}" in message and f"chmod go-w {key_dir}" in message


def test_a_0755_directory_and_a_0644_peers_file_are_accepted(key_dir: Path) -> None:
    key_dir.chmod(0o755)
    (key_dir / PEERS_FILE).chmod(0o644)
    assert load(key_dir, "decode").identity.name == "decode"


@AS_ROOT
@pytest.mark.parametrize("owned", [PEERS_FILE, "", "decode.secret"])
def test_key_files_another_user_owns_are_refused(key_dir: Path, owned: str) -> None:
    path = key_dir / owned if owned else key_dir
    os.chown(path, OTHER_UID, -1)
    message = refusal(key_dir)
    assert f"{path} is owned by uid {OTHER_UID}" in message and "chown" in message


@AS_ROOT
def test_root_owned_keys_are_accepted_by_another_user(key_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Root can replace kvfence itself: keys it provisions for a service user are no weaker for it."""
    monkeypatch.setattr(os, "geteuid", lambda: OTHER_UID)
    assert load(key_dir, "decode").identity.name == "decode"


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    previous = os.umask(0o002)  # a shared-group default: new files group-writable
    yield
    os.umask(previous)


@pytest.mark.usefixtures("permissive_umask")
def test_generated_keys_pass_load_whatever_the_umask(tmp_path: Path) -> None:
    generate(tmp_path / "keys", SPECS)
    assert load(tmp_path / "keys", "router").identity.name == "router"


def test_generate_twice_is_refused_without_force(key_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = {p.name: p.read_text() for p in key_dir.iterdir()}
    assert generate_command(key_dir) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "already exists" in lines[0] and "--force" in lines[0], lines
    assert {p.name: p.read_text() for p in key_dir.iterdir()} == before  # nothing was overwritten


def test_generate_with_force_replaces_the_keys(key_dir: Path) -> None:
    old = load(key_dir, "decode").identity
    (key_dir / PEERS_FILE).chmod(0o666)  # --force also rewrites the modes of the files it replaces
    assert generate_command(key_dir, "--force") == 0
    new = load(key_dir, "decode").identity
    assert new.public_key != old.public_key and new.secret_key != old.secret_key
    assert old.public_key not in (key_dir / PEERS_FILE).read_text()
