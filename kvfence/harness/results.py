"""A benchmark's results as JSON, with what was measured where: the kvfence version and commit, torch's
threads, the machine, its CPUs and its load.

Contract: `write_results(directory, name, payload)` writes `directory/name.json` (the directory made if
need be) as {"meta": ..., **payload}, dataclasses written as their fields; anything else not JSON raises.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from kvfence.pins import code_info


def write_results(directory: Path, name: str, payload: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    meta = {
        "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **code_info(),  # the kvfence version and commit measured (git_dirty: uncommitted changes)
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1_5_15m": os.getloadavg(),
    }
    path.write_text(json.dumps({"meta": meta, **payload}, indent=2, default=_jsonable))
    print(f"wrote {path}")
    return path


def _jsonable(value: object) -> object:
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)  # type: ignore[call-overload]
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
