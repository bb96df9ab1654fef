"""`serve --disaggregated --ray` without a cluster: its options refused in one line before Ray starts, the
key directory it makes (owner-only, every address loopback, removed after) or takes (--keys DIR, checked
to name every worker and the router), and where each worker's address puts its actor. The cluster:
tests/integration/test_ray_disagg.py.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kvfence.cli import main
from kvfence.cli_checks import StartupError
from kvfence.disagg.keys import PeerBook, generate, load
from kvfence.ray.workers import key_directory, worker_host

NAMES = ["prefill", "decode-0", "decode-1"]


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--ray"], "error: --ray: only with --disaggregated"),
        (["--disaggregated", "--ray", "--ray-replicas", "2"], "error: --ray-replicas: not with"),
        (["--disaggregated", "--ray", "--ray-router", "power-of-two"], "error: --ray-router: not with"),
        (["--disaggregated", "--ray", "--insecure-transport"], "error: --insecure-transport: not with"),
        (["--disaggregated", "--ray-temp-dir", "/tmp/r"], "error: --ray-temp-dir: only with --ray-replicas"),
        (["--ray-replicas", "2", "--ray"], "error: --ray: only with --disaggregated"),
    ],
)
def test_pd_on_ray_refuses_before_ray_starts(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *argv]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(error), lines


def test_keys_from_the_environment_are_refused_before_ray(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The router's key in its environment would be in every Ray process it starts: refused, by name."""
    monkeypatch.setenv("KVFENCE_API_KEYS", "sk-env tenant-a")
    assert main(["serve", "--disaggregated", "--ray"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert "$KVFENCE_API_KEYS is set" in last and "sk-env" not in last


def test_this_runs_keys_are_owner_only_files_on_loopback_removed_after() -> None:
    with key_directory(None, NAMES) as directory:
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        book = PeerBook.parse((directory / "peers").read_text())
        assert sorted(p.name for p in book) == sorted([*NAMES, "router"])
        assert all(p.address and p.address.startswith("tcp://127.0.0.1:") for p in book)
        assert len({p.address for p in book}) == len(NAMES) + 1
        for name in [*NAMES, "router"]:
            assert stat.S_IMODE((directory / f"{name}.secret").stat().st_mode) == 0o600
            assert load(directory, name).identity.name == name  # what each actor reads, as it reads it
    assert not directory.exists()


def test_a_given_key_directory_must_name_every_worker_and_the_router(tmp_path: Path) -> None:
    specs = [("prefill", "prefill", "tcp://10.0.0.1:5600"), ("decode-0", "decode", "tcp://10.0.0.2:5600")]
    generate(tmp_path / "keys", [*specs, ("router", "router", "tcp://10.0.0.9:5610")])
    with pytest.raises(StartupError, match="no decode-1 in"), key_directory(tmp_path / "keys", NAMES):
        pass
    with key_directory(tmp_path / "keys", NAMES[:2]) as directory:
        assert directory == tmp_path / "keys"  # the operator's: used where it is, never removed
    assert (tmp_path / "keys" / "prefill.secret").exists()
    swapped = tmp_path / "swapped"
    generate(swapped, [("prefill", "decode", "tcp://10.0.0.1:5600"), ("router", "router", None)])
    with pytest.raises(StartupError, match="prefill's role"), key_directory(swapped, ["prefill"]):
        pass


def test_a_worker_runs_on_the_host_its_address_names() -> None:
    assert worker_host("tcp://127.0.0.1:5600", "10.0.0.5") == "10.0.0.5"  # loopback: this node
    assert worker_host("tcp://10.0.0.2:5600", "10.0.0.5") == "10.0.0.2"
    assert worker_host("tcp://[fd00::2]:5600", "10.0.0.5") == "fd00::2"
