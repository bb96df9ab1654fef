"""Start-up checks and the start-up report of the `kvfence` commands that serve.

Every bad start-up option ends the command with one line on stderr, naming the option and the fix, exit
code 2, no traceback, and before any model is loaded: option values that cannot be right (argparse types
and a parser whose errors are one line), the model file (its GGUF header only: cli_model.py), the device,
the pool against the window (from the header: the same report and check the engine runs after loading),
the API key file and the admin key file (each refused unless it is a regular file no other user may read or
change), the audit log, the open-file limit and the HTTP port (bound here, then served). No secret is ever
an option's value: a command line is readable by every local user (/proc/PID/cmdline).
A check that fails raises `StartupError`; `kvfence.cli.main` prints it. On Ray Serve (kvfence/ray/) a
replica's options are refused where Ray cannot honour them (`check_replica_args`: Ray's proxy holds the
port, a replica is a whole server), and no key may come from the environment (`check_ray_environment`): each
replica reads its key files itself.

Once the checks pass, `protection_lines` says what protects the server: isolation, auth, who may read the
metrics, the front door's limits, and every armed fault.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import resource
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from kvfence.cli_model import check_bf16_rows, check_model
from kvfence.config import (
    DTYPE_BYTES,
    CapacityError,
    EngineConfig,
    SpeculativeConfig,
    capacity_report,
    check_window,
)
from kvfence.sampling import SamplingDefaults
from kvfence.startup import StartupError, one_key, read_secret_file, reason
from kvfence.trail.faults import FAULTS, parse_fault_spec
from kvfence.units import parse_size

DEFAULT_RAY_ROUTER = "kvfence"  # --ray-router: kvfence's tenant-scoped prefix router (kvfence.ray.router)
DEFAULT_RAY_REPLICA_CPUS = 1.0  # --ray-replica-cpus: Ray's own default for an actor that runs tasks
SPARE_FILES = 64  # file descriptors beyond the connection cap: the model, logs, ZeroMQ sockets
T = TypeVar("T")


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2), like every other start-up error; `--help` is unchanged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No prefixes: vLLM's `--api-key sk-x` must not become `--api-keys` (a file that is not there).
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _number(text: str, convert: Callable[[str], T], ok: Callable[[T], bool], what: str) -> T:
    """An argparse type: `text` converted, or one clear error naming what was expected."""
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def positive_float(text: str) -> float:
    return _number(text, float, lambda v: 0 < v < math.inf, "a positive number")


def port_number(text: str) -> int:
    return _number(text, int, lambda v: 1 <= v <= 65535, "a port number from 1 to 65535")


def origin(text: str) -> str:
    """A CORS origin: `*`, or scheme://host[:port] with nothing after it (a browser sends no path)."""
    scheme, sep, rest = text.partition("://")
    if text == "*" or (sep and scheme in ("http", "https") and rest and not set("/?#@") & set(rest)):
        return text
    raise argparse.ArgumentTypeError(f"must be * or an origin such as https://app.example.com, got {text!r}")


def temperature(text: str) -> float:
    return _number(text, float, lambda v: 0 <= v <= 2, "a number from 0 to 2")


def top_p(text: str) -> float:
    return _number(text, float, lambda v: 0 < v <= 1, "a number above 0 and at most 1")


def size_bytes(text: str) -> int:
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be a positive size, got {text!r}")
    return size


def model_file(text: str) -> Path:
    """`--model`: a path (a GGUF file or a Hugging Face directory), the name of a packaged model
    (`pins.PACKAGED_MODELS`) that is not a file here, or a hub id already in the local HF cache."""
    from kvfence.model.hf_dir import model_path
    from kvfence.pins import PACKAGED_MODELS, packaged_model

    if text not in PACKAGED_MODELS or Path(text).exists():
        try:
            return model_path(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    try:
        return packaged_model(text)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def speculative_config(text: str) -> SpeculativeConfig:
    """--speculative-config: vLLM's JSON object (argparse's error names what is wrong, never ignores it)."""
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({reason(exc)})") from exc
    if not isinstance(values, dict):
        raise argparse.ArgumentTypeError('a JSON object, e.g. {"method": "ngram", ...}')
    return speculative_from_dict(values)


def speculative_from_dict(values: dict[str, Any]) -> SpeculativeConfig:
    """vLLM's speculative config as a dict (the CLI's JSON, the offline LLM's `speculative_config`), its
    draft model named as --model is (ArgumentTypeError naming what is wrong)."""
    try:
        config = SpeculativeConfig.from_dict(values)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if config.model is None:
        return config
    return replace(config, model=str(model_file(config.model)))


def kv_tier(spec: str) -> str:
    """--kv-tier: a spec cache/tier_stores.py reads (the store is opened when the engine starts)."""
    from kvfence.cache.tier_stores import parse_spec

    try:
        parse_spec(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return spec


def fault_spec(spec: str) -> tuple[str, float]:
    try:
        name, rate = parse_fault_spec(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad fault rate in {spec!r}") from exc
    if name not in FAULTS:
        raise argparse.ArgumentTypeError(f"unknown fault {name!r}; known: {', '.join(sorted(FAULTS))}")
    if not 0 < rate <= 1:
        raise argparse.ArgumentTypeError(f"fault rate must be in (0, 1], got {rate}")
    return name, rate


# ---- the engine ------------------------------------------------------------------------------------------


def check_device(device: str) -> None:
    """`auto` and `cpu` need no look: only a named accelerator makes this load torch to find it."""
    if device in ("auto", "cpu"):
        return
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise StartupError(f"--device {device}: not a torch device ({reason(exc)}); use cpu or cuda") from exc
    if parsed.type == "cuda" and (parsed.index or 0) >= (
        torch.cuda.device_count() if torch.cuda.is_available() else 0
    ):
        raise StartupError(f"--device {device}: no such CUDA device on this machine; use --device cpu")


def check_engine(config: EngineConfig) -> None:
    """The device, the model file (bfloat16 rows where asked), and the pool against the window, before any
    weight is loaded: the same capacity report and window check the engine runs once it has loaded."""
    check_device(config.device)
    shape = check_model(config.model)
    check_bf16_rows(config, shape)
    try:
        kv_bytes = DTYPE_BYTES[config.expected_kv_dtype(shape.block_quantized)]
        check_window(capacity_report(config, shape, kv_bytes), shape.context_length)
    except CapacityError as exc:
        raise StartupError(str(exc)) from exc


# ---- the HTTP front --------------------------------------------------------------------------------------


def parse_api_keys(text: str) -> dict[str, str]:
    """`KEY TENANT` entries, one per line or `;`-separated; `#` starts a comment. ValueError if malformed;
    the message names the entry by number, never by its key."""
    keys: dict[str, str] = {}
    for number, entry in enumerate(text.replace(";", "\n").splitlines(), 1):
        fields = entry.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2:
            raise ValueError(f"entry {number} is not 'KEY TENANT' (it has {len(fields)} fields)")
        key, tenant = fields
        if key in keys:
            raise ValueError(f"entry {number} lists a key a second time")
        keys[key] = tenant
    if not keys:
        raise ValueError("it lists no 'KEY TENANT' entry")
    return keys


def load_api_keys(path: Path | None) -> dict[str, str] | None:
    """From --api-keys FILE (`read_secret_file`), else from $KVFENCE_API_KEYS, else vLLM's $VLLM_API_KEY
    (`vllm_api_key`), else None (auth off)."""
    vllm_key = vllm_api_key()
    if vllm_key is not None:
        if path is not None or os.environ.get("KVFENCE_API_KEYS"):
            message = "$VLLM_API_KEY is set beside --api-keys or $KVFENCE_API_KEYS: keep one of them"
            raise StartupError(message)
        return {vllm_key: "default"}
    if path is not None:
        source = f"--api-keys {path}"
        text = read_secret_file(path, "--api-keys")
    else:
        source, text = "$KVFENCE_API_KEYS", os.environ.get("KVFENCE_API_KEYS", "")
        if not text:
            return None
    try:
        return parse_api_keys(text)
    except ValueError as exc:
        raise StartupError(
            f"{source}: {exc}; write one 'KEY TENANT' per line ('#' starts a comment)"
        ) from exc


def vllm_api_key() -> str | None:
    """vLLM's $VLLM_API_KEY, one key (whitespace refused, as a key file's), taken out of the environment
    once read so that no child process inherits it; None when unset or empty."""
    key = os.environ.pop("VLLM_API_KEY", "")
    return one_key(key, "$VLLM_API_KEY") if key else None


def load_admin_key(path: Path | None) -> tuple[str | None, str]:
    """The admin key and where it came from: --admin-key-file FILE (`read_secret_file`; one trailing
    newline dropped), else $KVFENCE_ADMIN_KEY, else None. A file's key with whitespace left in it is
    refused: a bearer token has none (RFC 6750), so it is a mistake (a second line, a stray CR)."""
    if path is None:
        return os.environ.get("KVFENCE_ADMIN_KEY") or None, "$KVFENCE_ADMIN_KEY"
    source = f"--admin-key-file {path}"
    return one_key(read_secret_file(path, "--admin-key-file"), source), source


def bind_http(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound now (not listening yet), so that a port in use fails before the model loads
    and nothing can take the port while it does."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise StartupError(
            f"--host {host}: cannot resolve it ({reason(exc)}); give an address, e.g. 127.0.0.1"
        ) from exc
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            fix = f"{host}:{port} is already in use; stop what listens there or choose another --port"
            raise StartupError(f"--port {port}: {fix}") from exc
        if exc.errno == errno.EACCES:
            fix = "permission denied (a port below 1024 needs privileges); choose another --port"
            raise StartupError(f"--port {port}: {fix}") from exc
        raise StartupError(
            f"--host {host}: cannot bind port {port} there ({reason(exc)}); give an address of this machine"
        ) from exc
    return sock


def check_open_files(max_connections: int) -> None:
    """Every connection holds a file descriptor: raise the soft open-file limit to fit the cap, or refuse
    the cap."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + SPARE_FILES
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise StartupError(
            f"--max-connections {max_connections}: the open-file limit is {hard} (ulimit -Hn); choose "
            f"--max-connections {max(1, hard - SPARE_FILES)} or less, or raise the limit"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


@dataclass
class Front:
    """The HTTP front as checked at start: the keys, the bound socket and the front door's limits."""

    api_keys: dict[str, str] | None
    admin_key: str | None
    sock: socket.socket
    read_timeout_s: float
    max_connections: int
    sampling: SamplingDefaults  # what a request that leaves a value out gets
    allowed_origins: tuple[str, ...] = ()  # CORS: the browser origins that may call the API (none: no CORS)
    metrics_compat: str | None = None  # "vllm": /metrics repeats vLLM's series under vLLM's names

    def describe(self) -> list[str]:
        if self.api_keys:
            tenants = len(set(self.api_keys.values()))
            auth = f"auth: on ({tenants} tenant{'' if tenants == 1 else 's'})"
        else:
            auth = "WARNING: auth: off (no --api-keys / $KVFENCE_API_KEYS): every request is tenant 'default'"
        if self.api_keys and self.admin_key:
            metrics = "metrics: admin key required"
        elif self.api_keys:
            metrics = (
                "metrics: admin key required, and none is set (--admin-key-file, $KVFENCE_ADMIN_KEY): "
                "/metrics refuses everyone"
            )
        else:
            metrics = "metrics: open (no API keys)"
        door = (
            f"front door: a request head within {self.read_timeout_s:g}s, a body stalled for "
            f"{self.read_timeout_s:g}s is cut, at most {self.max_connections} connections"
        )
        cors = f"CORS: {', '.join(self.allowed_origins)}" if self.allowed_origins else "CORS: off"
        return [auth, metrics, door, cors]


def check_http(args: argparse.Namespace) -> Front:
    """The options of the HTTP front (`add_http_options`), checked, and its socket bound."""
    api_keys, admin_key, sampling = check_http_options(args)
    check_open_files(args.max_connections)
    sock = bind_http(args.host, args.port)
    origins = tuple(args.allowed_origins or ())
    return Front(
        api_keys,
        admin_key,
        sock,
        args.http_read_timeout,
        args.max_connections,
        sampling,
        origins,
        args.metrics_compat,
    )


def check_http_options(
    args: argparse.Namespace,
) -> tuple[dict[str, str] | None, str | None, SamplingDefaults]:
    """The HTTP options that need no socket: the API keys, the admin key, the request log's flags, the
    audit log and the sampling defaults (what a Ray replica checks: Ray's proxy holds the port)."""
    api_keys = load_api_keys(args.api_keys)
    admin_key, admin_source = load_admin_key(args.admin_key_file)
    if admin_key and api_keys and admin_key in api_keys:
        raise StartupError(
            f"{admin_source}: it is also a tenant key in the API key list; give the admin its own key"
        )
    if args.log_request_prompts and not args.enable_log_requests:
        message = "--log-request-prompts: it adds prompts to --enable-log-requests' lines; give both"
        raise StartupError(message)
    if args.audit_log is not None:
        try:
            args.audit_log.open("a", encoding="utf-8").close()
        except OSError as exc:
            raise StartupError(f"--audit-log {args.audit_log}: cannot append to it ({reason(exc)})") from exc
    return api_keys, admin_key, check_sampling(args)


def check_sampling(args: argparse.Namespace) -> SamplingDefaults:
    """The sampling defaults of requests: --default-temperature / --default-top-p where given, else the
    model's general.sampling.* settings, else greedy (kvfence.sampling.SamplingDefaults)."""
    from kvfence.model.hf_dir import model_metadata
    from kvfence.pins import default_model_path

    path = args.model or default_model_path()
    overrides = {"temperature": args.default_temperature, "top_p": args.default_top_p}
    try:
        return SamplingDefaults.resolve(model_metadata(path), overrides)
    except (OSError, ValueError, struct.error) as exc:
        raise StartupError(
            f"--model {path}: its general.sampling.* settings are unusable ({reason(exc)}); "
            "give --default-temperature and --default-top-p"
        ) from exc


def protection_lines(isolation: bool, faults: Sequence[tuple[str, float]], front: Front | None) -> list[str]:
    """What protects the server, one line each: isolation, the HTTP front (if any), every armed fault."""
    lines = ["isolation: ON" if isolation else "WARNING: isolation: OFF (for the lab and benchmarks only)"]
    if front is not None:
        lines += front.describe()
    lines += [f"WARNING: fault armed: {name} at rate {rate}" for name, rate in faults]
    return lines


# ---- Ray Serve (kvfence/ray/) ----------------------------------------------------------------------------

# What a replica's options may not hold, and why: Ray's proxy is the HTTP front, Ray places the replicas,
# and a replica is a whole server (the workers as Ray actors: kvfence serve --disaggregated --ray).
RAY_REFUSED = {
    "--host": "Ray Serve's proxy binds the address (http_options.host, or kvfence serve --host)",
    "--port": "Ray Serve's proxy binds the port (http_options.port, or kvfence serve --port)",
    "--http-read-timeout": "Ray Serve's proxy is the front door, not kvfence's",
    "--max-connections": "Ray Serve's proxy is the front door, not kvfence's",
    "--audit-log": "the replicas would append to one file at once",
    "--role": "a replica is a whole server (workers on Ray: kvfence serve --disaggregated --ray)",
    "--listen": "a replica is a whole server (workers on Ray: kvfence serve --disaggregated --ray)",
    "--disaggregated": "its workers run on Ray with kvfence serve --disaggregated --ray",
    "--prefill-workers": "its workers run on Ray with kvfence serve --disaggregated --ray",
    "--decode-workers": "its workers run on Ray with kvfence serve --disaggregated --ray",
    "--keys": "it is the prefill/decode transport's (kvfence serve --disaggregated --ray)",
    "--key-name": "it is the prefill/decode transport's (kvfence serve --disaggregated --ray)",
    "--insecure-transport": "it is the prefill/decode transport's (kvfence serve --disaggregated --ray)",
    "--kv-transport": "it is the prefill/decode transport's (kvfence serve --disaggregated --ray)",
    "--kv-interface": "it is the prefill/decode transport's (kvfence serve --disaggregated --ray)",
    "--landing-uid": "it is the prefill/decode transport's (kvfence serve --disaggregated --ray)",
    "--landing-cma": "it is the prefill/decode transport's (kvfence serve --disaggregated --ray)",
    "--ray-replicas": "it is kvfence serve's, not a replica's: the replica count is the application's",
    "--ray": "it is kvfence serve --disaggregated's, not a replica's",
    "--ray-address": "it is kvfence serve's, not a replica's",
    "--insecure-ray": "it is kvfence serve's, not a replica's",
    "--ray-replica-cpus": "it is kvfence serve's, not a replica's: ray_actor_options are the application's",
    "--ray-temp-dir": "it is kvfence serve's, not a replica's",
    "--ray-router": "it is kvfence serve's, not a replica's: the router is the application's",
}
# Secrets that would reach a replica only through the environment Ray gives it: a key file each replica
# reads itself is the one way in (no secret in Ray's runtime_env, actor arguments or GCS).
RAY_SECRET_VARIABLES = {
    "KVFENCE_API_KEYS": "--api-keys FILE",
    "VLLM_API_KEY": "--api-keys FILE",
    "KVFENCE_ADMIN_KEY": "--admin-key-file FILE",
}


def check_ray_options(args: argparse.Namespace) -> None:
    """`serve`'s Ray options go together: each needs --ray-replicas or --disaggregated --ray (whose own
    refusals are kvfence.ray.workers'), --insecure-ray needs --ray-address and --ray-temp-dir a cluster
    kvfence starts."""
    if args.ray and not args.disaggregated:
        raise StartupError("--ray: only with --disaggregated (--ray-replicas N serves whole servers on Ray)")
    ray = args.ray_replicas is not None or args.ray
    for option, given in (
        ("--ray-address", args.ray_address is not None),
        ("--insecure-ray", args.insecure_ray),
        ("--ray-temp-dir", args.ray_temp_dir is not None),
        ("--ray-replica-cpus", args.ray_replica_cpus != DEFAULT_RAY_REPLICA_CPUS),
        ("--ray-router", args.ray_router != DEFAULT_RAY_ROUTER),
    ):
        if given and not ray:
            raise StartupError(f"{option}: only with --ray-replicas N (a server on Ray Serve) or --ray")
    if args.insecure_ray and args.ray_address is None:
        raise StartupError(
            "--insecure-ray: a cluster kvfence starts always has token auth; it is only for "
            "joining one with --ray-address"
        )
    if args.ray_temp_dir is not None and args.ray_address is not None:
        raise StartupError("--ray-temp-dir: only for a cluster kvfence starts, not one --ray-address joins")


def check_replica_args(argv: Sequence[str]) -> None:
    """A Ray replica's `kvfence serve` arguments hold no option Ray cannot honour (one line naming it and
    why). Exact names: the parser takes no abbreviation, so `--port=1` and `--port 1` are all it can be."""
    for word in argv:
        option = word.split("=", 1)[0]
        if option in ("-h", "--help"):
            raise StartupError(f"{option}: not for a Ray Serve replica: run kvfence serve --help")
        if option in RAY_REFUSED:
            raise StartupError(f"{option}: not for a Ray Serve replica: {RAY_REFUSED[option]}")


def check_ray_environment() -> None:
    """No key comes from the environment under Ray: each replica reads its key files itself."""
    for variable, instead in RAY_SECRET_VARIABLES.items():
        if os.environ.get(variable):
            raise StartupError(
                f"${variable} is set: under Ray every replica reads its keys from a file only its owner may "
                f"read; pass {instead} and unset ${variable}"
            )
