"""Prefill and decode on two "hosts": each worker in its own network namespace, joined by a Linux bridge.

    root namespace   bridge kvfbr<pid> 10.231.0.254/24   router's ZeroMQ socket (HTTP stays on 127.0.0.1)
      ├─ veth ── namespace kvf-p-<pid>  10.231.0.1   kvfence serve --role prefill --listen tcp://10.231.0.1:5601
      └─ veth ── namespace kvf-d-<pid>  10.231.0.2   kvfence serve --role decode  --listen tcp://10.231.0.2:5602

KV pages cross the bridge from one namespace to the other: with NIXL installed as one-sided WRITEs (UCX held
to TCP on the namespace's veth, as between two hosts), else as zmq frames; control messages go between the
router and each worker. Needs root and iproute2 (skipped otherwise). The fixture's teardown kills the workers
and deletes the namespaces, the veths and the bridge, whatever happened.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest
from conftest import real_engine
from test_disagg_e2e import KEYS, MODEL, chat_ids

from kvfence.disagg.nixl_transport import nixl_available
from kvfence.harness.cluster import Cluster, cluster
from kvfence.harness.workers import Command
from kvfence.model.gguf import GGUFModel
from kvfence.sampling import SamplingParams
from kvfence.units import cdiv

pytestmark = pytest.mark.real_model

PID = os.getpid()
SUBNET = "10.231.0"
BRIDGE = f"kvfbr{PID}"
ROOT_IP = f"{SUBNET}.254"
START_TIMEOUT_S = 180.0
WORKER_OPTIONS = ("--num-pages", "32", "--max-model-len", "512", "--num-threads", "1", "--device", "cpu")
TRANSPORT = "nixl" if nixl_available() else "zmq"


@dataclass(frozen=True)
class Host:
    role: str
    namespace: str
    ip: str
    port: int

    @property
    def veth(self) -> str:
        """The root end of the host's veth pair (a bridge port); interface names stay under 16 bytes."""
        return f"kvf{self.role[0]}{PID}"

    @property
    def peer(self) -> str:
        return f"kvf{self.role[0]}n{PID}"

    @property
    def address(self) -> str:
        return f"tcp://{self.ip}:{self.port}"

    @property
    def exec_prefix(self) -> tuple[str, ...]:
        """Run inside the namespace; UCX may use only TCP on its veth: on one machine it would otherwise
        write through cross-memory attach, which no two hosts have."""
        ucx = ("UCX_TLS=tcp", f"UCX_NET_DEVICES={self.peer}")
        return ("ip", "netns", "exec", self.namespace, "env", *ucx)


HOSTS = (
    Host("prefill", f"kvf-p-{PID}", f"{SUBNET}.1", 5601),
    Host("decode", f"kvf-d-{PID}", f"{SUBNET}.2", 5602),
)


class NetworkUnavailable(RuntimeError):
    """This machine cannot create the namespaces, veths or bridge: the test is skipped."""


def ip(*args: str, namespace: str | None = None) -> subprocess.CompletedProcess[str]:
    command = ["ip", "-n", namespace, *args] if namespace else ["ip", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)


def ip_step(*args: str, namespace: str | None = None, capability: bool = False) -> None:
    """Run one setup command. A failing `capability` step (creating a namespace or a link) means the
    machine cannot do this test; any other failure is a real error."""
    result = ip(*args, namespace=namespace)
    if result.returncode != 0:
        where = f" (in {namespace})" if namespace else ""
        message = f"`ip {' '.join(args)}`{where} failed: {result.stderr.strip()}"
        raise NetworkUnavailable(message) if capability else RuntimeError(message)


def build_network() -> None:
    ip_step("link", "add", BRIDGE, "type", "bridge", capability=True)
    ip_step("addr", "add", f"{ROOT_IP}/24", "dev", BRIDGE)
    ip_step("link", "set", BRIDGE, "up")
    for host in HOSTS:
        ip_step("netns", "add", host.namespace, capability=True)
        ip_step("link", "add", host.veth, "type", "veth", "peer", "name", host.peer, capability=True)
        ip_step("link", "set", host.veth, "master", BRIDGE)
        ip_step("link", "set", host.veth, "up")
        ip_step("link", "set", host.peer, "netns", host.namespace)
        ip_step("link", "set", "lo", "up", namespace=host.namespace)
        ip_step("addr", "add", f"{host.ip}/24", "dev", host.peer, namespace=host.namespace)
        ip_step("link", "set", host.peer, "up", namespace=host.namespace)


def tear_down_network() -> None:
    """Delete everything build_network may have created (missing pieces are fine)."""
    for host in HOSTS:
        ip("netns", "delete", host.namespace)  # takes the namespace end, and with it the pair, along
        ip("link", "delete", host.veth)
    ip("link", "delete", BRIDGE)


def network_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if SUBNET + "." in ip("-4", "-o", "addr", "show").stdout:
        return (
            f"{SUBNET}.0/24 is already in use on this machine: another run of this test, or the leftovers "
            "of a killed one (`ip netns list`, `ip link show type bridge`: kvf-*, kvfbr*)"
        )
    return None


@pytest.fixture(scope="module", name="cluster")
def namespaced_cluster() -> Iterator[Cluster]:
    """Each worker a `kvfence serve --role ...` process inside its namespace; the router and its HTTP server
    here, its ZeroMQ socket on the bridge."""
    reason = network_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    try:
        try:
            build_network()
        except NetworkUnavailable as exc:
            pytest.skip(f"cannot build the namespaced network: {exc}")
        prefill, decode = (
            Command(
                (*WORKER_OPTIONS, "--kv-transport", TRANSPORT), listen=host.address, prefix=host.exec_prefix
            )
            for host in HOSTS
        )
        with cluster(
            prefill=prefill,
            decode=decode,
            api_keys=KEYS,
            model_name=MODEL,
            router_listen=f"tcp://{ROOT_IP}:0",
            start_timeout_s=START_TIMEOUT_S,
        ) as running:
            yield running
    finally:
        tear_down_network()


def test_answer_across_namespaces_equals_single_node(cluster: Cluster, smollm2: GGUFModel) -> None:
    for worker in cluster.workers.values():  # each worker really runs on another network stack than this one
        assert os.readlink(f"/proc/{worker.pid}/ns/net") != os.readlink("/proc/self/ns/net")
    question = "What is the capital of France? Answer in one sentence."
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="key-a", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0
    )
    engine = real_engine(smollm2)
    assert engine.tokenizer is not None
    expected = engine.generate([chat_ids(engine.tokenizer, question)], SamplingParams(max_tokens=24))[0]
    assert reply.choices[0].message.content == expected.output_text

    events = cluster.router.audit_events(reply.id)
    where = {(e["where"], e["kind"]) for e in events}
    assert {("router", "admitted"), ("prefill", "transfer_complete"), ("decode", "finished")} <= where
    started = [e for e in events if (e["where"], e["kind"]) == ("prefill", "transfer_started")]
    assert [e["transport"] for e in started] == [TRANSPORT]
    received = [e for e in events if (e["where"], e["kind"]) == ("decode", "page_received")]
    assert reply.usage is not None
    page_size = cluster.router.workers["decode"].page_size
    # KV of every prompt token but the last, which decode computes itself before sampling.
    assert len(received) == cdiv(reply.usage.prompt_tokens - 1, page_size)
