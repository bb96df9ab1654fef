"""Where NIXL may carry KV pages: only where every condition of its separation holds. `--kv-transport
nixl` is refused elsewhere, saying which condition fails; `auto` takes ZeroMQ and says why."""

from __future__ import annotations

import pytest
from conftest import make_engine

from kvfence.cli import build_parser
from kvfence.cli_options import kv_plane
from kvfence.disagg import landing_identity
from kvfence.disagg.handoff import HandoffEngine
from kvfence.disagg.launch import kv_agent, nixl_refusal
from kvfence.disagg.nixl_transport import nixl_available
from kvfence.disagg.plane import KvPlane
from kvfence.model.transformer import Transformer
from kvfence.startup import StartupError

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed: always ZeroMQ")


@pytest.fixture
def engine(tiny: Transformer) -> HandoffEngine:
    return make_engine(tiny, HandoffEngine, num_pages=16, max_model_len=32)  # type: ignore[return-value]


@pytest.mark.parametrize("bind", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://no-such-host.invalid:5555"])
def test_a_wildcard_or_unresolvable_bind_needs_a_named_interface(
    engine: HandoffEngine, bind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    refusal, interface = nixl_refusal(engine, KvPlane("nixl"), bind)
    assert interface is None and refusal is not None and "--kv-interface" in refusal
    with pytest.raises(RuntimeError, match="--kv-interface"):
        kv_agent("decode", engine, KvPlane("nixl"), bind)
    assert kv_agent("decode", engine, KvPlane("auto"), bind) is None
    assert "ZeroMQ frames, not NIXL" in capsys.readouterr().out


def test_a_named_interface_is_used_and_must_exist(engine: HandoffEngine) -> None:
    assert nixl_refusal(engine, KvPlane("nixl", interface="lo"), "tcp://0.0.0.0:5555")[1] == "lo"
    refusal, _ = nixl_refusal(engine, KvPlane("nixl", interface="nosuch0"), "tcp://127.0.0.1:5555")
    assert refusal is not None and "no such interface" in refusal


def test_a_server_that_is_not_root_gets_no_landing_process(
    engine: HandoffEngine, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No other uid to give it: nixl refused, naming the way out; auto takes ZeroMQ."""
    monkeypatch.setattr(landing_identity.os, "geteuid", lambda: 1000)
    with pytest.raises(RuntimeError, match=r"not root.*--kv-transport zmq"):
        kv_agent("decode", engine, KvPlane("nixl"), "tcp://127.0.0.1:5555")
    assert kv_agent("decode", engine, KvPlane("auto"), "tcp://127.0.0.1:5555") is None
    assert "not root" in capsys.readouterr().out


def test_zmq_asks_for_nothing(engine: HandoffEngine) -> None:
    assert kv_agent("decode", engine, KvPlane("zmq"), "tcp://0.0.0.0:5555") is None


def test_cross_memory_attach_needs_the_landing_processes_one_uid_named() -> None:
    """--landing-cma shares a uid among landing processes: which one is the operator's to say, never a
    default (a default would be some worker's own)."""
    parser = build_parser()
    with pytest.raises(StartupError, match="--landing-uid"):
        kv_plane(parser.parse_args(["serve", "--landing-cma"]))
    plane = kv_plane(parser.parse_args(["serve", "--landing-cma", "--landing-uid", "1263861761"]))
    assert (plane.landing_uid, plane.landing_cma) == (1263861761, True)
    assert kv_plane(parser.parse_args(["serve"])).landing_cma is False
