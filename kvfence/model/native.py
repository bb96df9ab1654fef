"""Build and load the C kernels under csrc/: compiled on first use with the system C compiler, loaded
with ctypes.

Each library is built into a per-user cache, keyed by its source and the flags (the instruction sets are named
explicitly, from what this CPU reports: never `-march=native`), and written under a temporary name then
renamed, so concurrent processes never load a half-written library. No torch headers are involved: a build
takes well under a second. The libraries link libgomp, which resolves to the OpenMP runtime torch has already
loaded, so the kernels share torch's thread pool instead of competing with a second one.

`load_library()` returns None with the reason when a kernel cannot be used (no compiler, a build error):
the model then takes its torch path, which computes the same thing. `load_extension()` builds a source
that is a Python extension module instead (the fence's check: called once a step, where a ctypes call's
own cost would be most of it), None likewise when it cannot be built.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

CSRC = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
# Instruction sets named explicitly, chosen at run time from what this CPU reports, never -march=native:
# a library built on one machine (a cache on a shared home) then runs on any CPU that has the same sets.
# F16C is named beside AVX-512 too: -mavx512f does not imply it, and a build that turns AVX-512 off
# (-mno-avx512f: the AVX2 path an AVX2-only machine runs) needs it for that path.
_AVX512 = ({"avx512f", "avx512bw", "fma", "f16c"}, ("-mavx512f", "-mavx512bw", "-mfma", "-mf16c"))
_VNNI = (_AVX512[0] | {"avx512_vnni"}, (*_AVX512[1], "-mavx512vnni"))
# AVX512-BF16 (vdpbf16ps: two bf16 products a lane, f32 accumulation) is what paged_prefill.c's bf16
# attention and half_matmul.c's pairs run on; the other kernels do not use it.
BF16_FLAG = "-mavx512bf16"
_ISA = (
    (_VNNI[0] | {"avx512_bf16"}, (*_VNNI[1], BF16_FLAG)),
    _VNNI,
    _AVX512,
    ({"avx2", "fma", "f16c"}, ("-mavx2", "-mfma", "-mf16c")),
)


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty elsewhere, which builds the portable code."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return set(next(line for line in lines if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set()


def isa_flags() -> tuple[str, ...]:
    """The widest instruction-set flags this CPU runs (x86-64 only; other machines get none)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ()
    flags = cpu_flags()
    return next((isa for needed, isa in _ISA if needed <= flags), ())


def has_bf16_dot() -> bool:
    """Whether the kernels build with AVX512-BF16 here (`isa_flags` names it)."""
    return BF16_FLAG in isa_flags()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvfence" / "kernels"


def _build(compiler: str, sources: tuple[Path, ...], flags: tuple[str, ...]) -> Path:
    """One shared library from `sources` (the first names it), cached under a key of every source's text,
    every header beside them (what they may include) and the flags."""
    headers = sorted({header for source in sources for header in source.parent.glob("*.h")})
    texts = [path.read_bytes() for path in (*sources, *headers)]
    key = hashlib.sha256(b"\0".join([*texts, " ".join(flags).encode()]))
    target = _cache_dir() / f"{sources[0].stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, *map(str, sources), "-o", str(built), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(built, target)  # atomic: a concurrent build of the same key writes the same bytes
    return target


@functools.cache
def load_library(
    name: str, extra_flags: tuple[str, ...] = (), with_sources: tuple[str, ...] = (), csrc: Path = CSRC
) -> tuple[ctypes.CDLL | None, str]:
    """(`csrc`/`name`.c, linked with `csrc`/`with_sources`.c, built and loaded, "") or (None, why not).
    Built once per process and per machine; `extra_flags` (e.g. a -D switch) give a separately cached
    build. `csrc`: another package's C sources (the fence's, cache/csrc)."""
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler (cc) on PATH"
    try:
        sources = tuple(csrc / f"{source}.c" for source in (name, *with_sources))
        return ctypes.CDLL(str(_build(compiler, sources, FLAGS + isa_flags() + extra_flags))), ""
    except subprocess.CalledProcessError as exc:
        return None, f"kernel build failed: {exc.stderr.strip()[-500:]}"
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"kernel unavailable: {exc}"


@functools.cache
def load_extension(name: str, csrc: Path) -> ModuleType | None:
    """`csrc`/`name`.c built as the extension module `kvfence_<name>` and imported, or None where it cannot
    be (no compiler, no Python headers, a build error)."""
    compiler = _compiler()
    include = Path(sysconfig.get_paths()["include"])
    if compiler is None or not (include / "Python.h").exists():
        return None
    try:
        built = _build(compiler, (csrc / f"{name}.c",), ("-O2", "-shared", "-fPIC", f"-I{include}"))
    except (OSError, subprocess.SubprocessError):
        return None
    loader = importlib.machinery.ExtensionFileLoader(f"kvfence_{name}", str(built))
    spec = importlib.util.spec_from_file_location(loader.name, str(built), loader=loader)
    assert spec is not None
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError:  # built against other headers than this interpreter's, say
        return None
    return module
