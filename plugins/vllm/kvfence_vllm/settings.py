"""The plugin's settings, read from the environment of each vLLM process, and the versions it supports.

`KVFENCE_FENCE=on|off` (default on): validate every step's block-table rows, or only tag and record.
`KVFENCE_INJECT_FAULT=NAME:P[,NAME:P]` (P in [0, 1], each fault at most once): before a model step that runs
two or more requests with KV, with probability P, the worker's bookkeeping goes wrong as the fence exists
to catch: `swap_block_tables` swaps two running requests' block-table rows; `inflate_computed` moves one
running request's num_computed_tokens a block ahead (its step attends over KV nobody wrote for it).
`KVFENCE_FAULT_SEED` (default 0): the faults' random draws (one generator each), so a run can be repeated.
Anything else in these variables is refused with one line naming the variable (`PluginRefused`).
`check_engine`: the engine configurations the fence's bookkeeping holds for, refused otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

SUPPORTED = "0.32."  # vLLM's v1 engine as of 0.32.x: the internals patched in patches.py
SWAP, INFLATE = "swap_block_tables", "inflate_computed"
FAULTS = (SWAP, INFLATE)


class PluginRefused(Exception):
    """A configuration the plugin will not run under; its message is one line."""


@dataclass(frozen=True)
class Settings:
    fence: bool = True
    swap_probability: float = 0.0  # 0: no fault injected
    fault_seed: int = 0
    inflate_probability: float = 0.0


def check_version(version: str) -> None:
    if not version.startswith(SUPPORTED):
        raise PluginRefused(f"kvfence-vllm supports vLLM {SUPPORTED}x only, not {version}: refusing to start")


def check_engine(groups: list[str], async_scheduling: bool, pipeline: bool, connector: bool) -> None:
    """One full-attention KV cache group (`groups`: the kinds of vLLM's KV cache specs), and one step at a
    time, every block's KV written by this engine's steps: a record's written length counts what the
    steps that ran wrote, so async scheduling and pipeline parallelism (a step scheduled before the last
    one's output is read) and a KV connector (tokens another engine computed) are refused."""
    if groups != ["FullAttentionSpec"]:
        raise PluginRefused(f"kvfence-vllm: one full-attention KV cache group is supported, not {groups}")
    refused = [
        name
        for name, on in (
            ("async scheduling", async_scheduling),
            ("pipeline parallelism", pipeline),
            ("a KV connector", connector),
        )
        if on
    ]
    if refused:
        raise PluginRefused(
            f"kvfence-vllm: {', '.join(refused)} not supported (a record's written length counts what this "
            "engine's steps wrote, one step at a time)"
        )


def from_environ(env: Mapping[str, str]) -> Settings:
    fence = env.get("KVFENCE_FENCE", "on")
    if fence not in ("on", "off"):
        raise PluginRefused(f"KVFENCE_FENCE must be 'on' or 'off', not {fence!r}")
    faults = _faults(env.get("KVFENCE_INJECT_FAULT", ""))
    return Settings(fence == "on", faults.get(SWAP, 0.0), _seed(env), faults.get(INFLATE, 0.0))


def _faults(spec: str) -> dict[str, float]:
    faults: dict[str, float] = {}
    for part in spec.split(",") if spec else ():
        name, _, value = part.partition(":")
        try:
            probability = float(value)
        except ValueError:
            probability = -1.0
        if name not in FAULTS or name in faults or not 0.0 <= probability <= 1.0:
            raise PluginRefused(
                f"KVFENCE_INJECT_FAULT must be 'NAME:P[,NAME:P]' with NAME one of {', '.join(FAULTS)} "
                f"(each once) and P in [0, 1], not {spec!r}"
            )
        faults[name] = probability
    return faults


def _seed(env: Mapping[str, str]) -> int:
    seed = env.get("KVFENCE_FAULT_SEED", "0")
    if not seed.isdigit():
        raise PluginRefused(f"KVFENCE_FAULT_SEED must be a non-negative integer, not {seed!r}")
    return int(seed)
