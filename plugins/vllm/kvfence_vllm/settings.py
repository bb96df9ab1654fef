"""The plugin's settings, read from the environment of each vLLM process, and the versions it supports.

`KVFENCE_FENCE=on|off` (default on): validate every step's block-table rows, or only tag and record.
`KVFENCE_INJECT_FAULT=swap_block_tables:P` (P in [0, 1]): before a model step, with probability P, swap
two running requests' block-table rows in the worker (the bookkeeping bug the fence exists for).
`KVFENCE_FAULT_SEED` (default 0): the fault's random draws, so a run can be repeated.
Anything else in these variables is refused with one line naming the variable (`PluginRefused`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

SUPPORTED = "0.32."  # vLLM's v1 engine as of 0.32.x: the internals patched in patches.py
FAULT = "swap_block_tables"


class PluginRefused(Exception):
    """A configuration the plugin will not run under; its message is one line."""


@dataclass(frozen=True)
class Settings:
    fence: bool = True
    swap_probability: float = 0.0  # 0: no fault injected
    fault_seed: int = 0


def check_version(version: str) -> None:
    if not version.startswith(SUPPORTED):
        raise PluginRefused(f"kvfence-vllm supports vLLM {SUPPORTED}x only, not {version}: refusing to start")


def from_environ(env: Mapping[str, str]) -> Settings:
    fence = env.get("KVFENCE_FENCE", "on")
    if fence not in ("on", "off"):
        raise PluginRefused(f"KVFENCE_FENCE must be 'on' or 'off', not {fence!r}")
    return Settings(fence == "on", _swap_probability(env.get("KVFENCE_INJECT_FAULT", "")), _seed(env))


def _swap_probability(spec: str) -> float:
    if not spec:
        return 0.0
    name, _, value = spec.partition(":")
    try:
        probability = float(value)
    except ValueError:
        probability = -1.0
    if name != FAULT or not 0.0 <= probability <= 1.0:
        raise PluginRefused(f"KVFENCE_INJECT_FAULT must be '{FAULT}:P' with P in [0, 1], not {spec!r}")
    return probability


def _seed(env: Mapping[str, str]) -> int:
    seed = env.get("KVFENCE_FAULT_SEED", "0")
    if not seed.isdigit():
        raise PluginRefused(f"KVFENCE_FAULT_SEED must be a non-negative integer, not {seed!r}")
    return int(seed)
