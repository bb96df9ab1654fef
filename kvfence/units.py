"""Units the whole house counts in: pages from tokens (`cdiv`), byte sizes from text (`parse_size`) and back
to text for people (`format_size`: what `--help` and the logs show)."""

from __future__ import annotations

import re

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'1GiB' -> 1073741824; plain integers are bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 1GiB or a byte count)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def format_size(num_bytes: int) -> str:
    """536870912 -> '512 MiB', 1610612736 -> '1.5 GiB': the largest binary unit it reaches, to 0.1."""
    for unit in ("GiB", "MiB", "KiB"):
        scale = _SIZE_UNITS[unit.upper()]
        if num_bytes >= scale:
            return f"{round(num_bytes / scale, 1):g} {unit}"
    return f"{num_bytes} bytes"


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the pages of `b` tokens that hold `a` tokens (numpy arrays work too)."""
    return -(-a // b)
