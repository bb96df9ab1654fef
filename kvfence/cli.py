"""The `kvfence` command, one entry point: `serve` (the OpenAI-compatible server, single node, one
prefill/decode worker, or `--disaggregated` locally), `router` (the front of remote workers), `audit`
(acceptance checks against a running server), `lab` (the isolation lab) and `generate` (one prompt,
offline).

Engine options are defined once (`add_engine_options`) and turned into an EngineConfig once
(`engine_config`), so every subcommand that runs the engine takes the same flags with the same meaning.
Progress and the capacity line go to stderr, so `generate` prints only the answer on stdout.

Start-up options are checked before any model loads (kvfence.cli_checks): a bad one is one line on stderr
naming the option and the fix, exit code 2. Then the console says what protects the server.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvfence.api.slow_clients import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT_S
from kvfence.cli_checks import (
    Front,
    OneLineParser,
    StartupError,
    check_engine,
    check_http,
    check_model,
    fault_spec,
    port_number,
    positive_float,
    positive_int,
    protection_lines,
    size_bytes,
)
from kvfence.config import CapacityError, EngineConfig
from kvfence.engine.async_engine import EngineClient
from kvfence.engine.engine import AdmissionError, LLMEngine, load_engine
from kvfence.model.llama import DECODE_ATTENTION, DECODE_MATMUL
from kvfence.sampling import SamplingParams
from kvfence.trail.events import EventLog
from kvfence.trail.faults import FAULTS, FaultInjector

if TYPE_CHECKING:
    from kvfence.disagg.keys import TransportKeys

ROLES = ("prefill", "decode", "router")
DEFAULT_LISTEN = "tcp://127.0.0.1:5600"  # a worker's address when neither --listen nor its key names one


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The flags every engine-running subcommand shares."""
    g = parser.add_argument_group("engine")
    defaults = EngineConfig()  # one source of truth for default values
    g.add_argument("--model", type=Path, help="GGUF file (default: the packaged SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    g.add_argument("--device", default=default_device(), help="torch device (default: %(default)s)")
    g.add_argument("--page-size", type=positive_int, default=defaults.page_size, help="tokens per KV page")
    g.add_argument(
        "--num-pages", type=positive_int, help="KV pool size in pages (wins over --kv-cache-memory)"
    )
    g.add_argument(
        "--kv-cache-memory",
        type=size_bytes,
        default=defaults.kv_cache_memory,
        help="KV pool size, e.g. 512MiB, 1GiB (default: %(default)s bytes)",
    )
    g.add_argument("--max-model-len", type=positive_int, help="context window (default: the model's)")
    g.add_argument(
        "--max-num-seqs", type=positive_int, default=defaults.max_num_seqs, help="requests per batch"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=defaults.max_num_batched_tokens,
        help="tokens per step",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument(
        "--isolation",
        choices=["on", "off"],
        default="on",
        help="the KV fence; 'off' only for the lab and benchmarks, never to serve tenants",
    )
    g.add_argument(
        "--inject-fault",
        type=fault_spec,
        action="append",
        default=[],
        metavar="NAME[:RATE]",
        help="arm a named fault (repeatable): " + ", ".join(sorted(FAULTS)),
    )
    g.add_argument("--num-threads", type=positive_int, help="torch CPU threads")
    g.add_argument(
        "--decode-attention",
        choices=DECODE_ATTENTION,
        default=defaults.decode_attention,
        help="kernel: the C paged-attention kernel (float32 on CPU); sdpa: gather pages + torch SDPA; "
        "auto: the kernel where it can run (default: %(default)s)",
    )
    g.add_argument(
        "--decode-matmul",
        choices=DECODE_MATMUL,
        default=defaults.decode_matmul,
        help="kernel: decode rows multiply by the GGUF's quantized weights (Q4_0/Q4_1/Q8_0) in a C kernel "
        "(float32 on CPU); dense: BLAS over the dequantized weights; auto: the kernel where it can run "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--trace-pages",
        action="store_true",
        help="audit which pages each request reads and whose data they hold (lab, audits)",
    )
    t = parser.add_argument_group("tenants")
    t.add_argument(
        "--max-waiting-per-tenant",
        type=positive_int,
        default=1024,
        help="a tenant's waiting requests beyond this get 429 (default: %(default)s)",
    )
    for flag, what in (("running", "running requests"), ("pages", "KV pages")):
        t.add_argument(
            f"--max-{flag}-per-tenant",
            type=positive_int,
            help=f"{what} a tenant may hold at once; at the limit its requests wait (default: no limit)",
        )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig named by the options `add_engine_options` defined."""
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        page_size=args.page_size,
        num_pages=args.num_pages,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        isolation=args.isolation == "on",
        faults=dict(args.inject_fault),
        num_threads=args.num_threads,
        decode_attention=args.decode_attention,
        decode_matmul=args.decode_matmul,
        trace_pages=args.trace_pages,
        max_waiting_per_tenant=args.max_waiting_per_tenant,
        max_running_per_tenant=args.max_running_per_tenant,
        max_pages_per_tenant=args.max_pages_per_tenant,
    )


def add_http_options(parser: argparse.ArgumentParser) -> None:
    """The flags of every command that serves the OpenAI API."""
    g = parser.add_argument_group("http")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    g.add_argument("--port", type=port_number, default=8000, help="HTTP port (default: %(default)s)")
    g.add_argument(
        "--api-keys",
        type=Path,
        metavar="FILE",
        help="'KEY TENANT' per line (# comments); else $KVFENCE_API_KEYS ('; '-separated)",
    )
    g.add_argument("--admin-key", help="key for the audit endpoint (else $KVFENCE_ADMIN_KEY)")
    g.add_argument("--audit-log", type=Path, metavar="FILE", help="append audit events here as JSONL")
    g.add_argument("--served-model-name", help="model id in the API (default: the GGUF file stem)")
    g.add_argument(
        "--http-read-timeout",
        type=positive_float,
        default=DEFAULT_READ_TIMEOUT_S,
        metavar="SECONDS",
        help="a connection must send its whole request head within this, and a body that sends nothing for "
        "this long is cut (default: %(default)ss)",
    )
    g.add_argument(
        "--max-connections",
        type=positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help="connections served at once; a request beyond them gets 503 (default: %(default)s)",
    )


def _load_engine(config: EngineConfig, events: EventLog | None = None) -> LLMEngine | None:
    """The engine, or None after printing why it refused to start (the window does not fit the pool)."""
    try:
        return load_engine(config, events, log=_log)
    except CapacityError as exc:
        _log(f"error: {exc}")
        return None


def _report(args: argparse.Namespace, front: Front | None) -> None:
    """What protects the server, before the model loads (the pool and window follow from the engine)."""
    for line in protection_lines(args.isolation == "on", args.inject_fault, front):
        _log(line)


def _serve(args: argparse.Namespace) -> int:
    config = engine_config(args)
    if args.role != "single":
        from kvfence.disagg.launch import run_worker

        keys = _transport_keys(args, args.role, [args.listen] if args.listen else [])
        check_engine(config)
        _report(args, None)
        run_worker(args.role, config, args.listen or _own_address(keys) or DEFAULT_LISTEN, keys=keys)
        return 0
    check_engine(config)
    front = check_http(args)
    _report(args, front)
    if args.disaggregated:
        return _serve_disaggregated(args, config, front)
    events = EventLog(path=args.audit_log) if args.audit_log else None
    engine = _load_engine(config, events)
    if engine is None:
        return 2
    from kvfence.engine.async_engine import AsyncEngine

    return _run_http(args, AsyncEngine(engine), front)


def _serve_disaggregated(args: argparse.Namespace, config: EngineConfig, front: Front) -> int:
    """One prefill and one decode worker process plus the router, all on this host, speaking CURVE with
    keys made for this run only (unless --insecure-transport). A worker that dies is restarted; SIGTERM and
    SIGINT stop every child."""
    from kvfence.disagg.keys import ephemeral
    from kvfence.disagg.launch import LocalWorkers, free_ports

    addresses = {role: f"tcp://127.0.0.1:{port}" for role, port in zip(ROLES, free_ports(3), strict=True)}
    keys = None if args.insecure_transport else ephemeral([(r, r, a) for r, a in addresses.items()])
    _log(f"transport: {'INSECURE (--insecure-transport)' if keys is None else 'CURVE with ephemeral keys'}")
    with _terminate_on_sigterm(), LocalWorkers([("prefill", config), ("decode", config)], addresses, keys):
        router_keys = keys["router"] if keys else None
        return _run_router(
            args, addresses["prefill"], addresses["decode"], addresses["router"], router_keys, front
        )


@contextlib.contextmanager
def _terminate_on_sigterm() -> Iterator[None]:
    """SIGTERM (kill, systemd, docker stop) ends the server like Ctrl-C, so that `finally` blocks run and
    no child outlives it: uvicorn drains and re-raises the signal it caught, and this handler turns that
    into SystemExit instead of the default immediate death."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _router(args: argparse.Namespace) -> int:
    keys = _transport_keys(
        args, "router", [args.prefill, args.decode, *([args.listen] if args.listen else [])]
    )
    if keys is not None:
        for role in ("prefill", "decode"):
            peer = keys.book.by_address.get(getattr(args, role))
            if peer is None or peer.role != role:
                _log(f"error: --{role} {getattr(args, role)} is not a {role} worker in {args.keys}/peers")
                return 2
    check_model(args.model)
    front = check_http(args)
    _report(args, front)
    listen = args.listen or _own_address(keys) or "tcp://127.0.0.1:0"
    return _run_router(args, args.prefill, args.decode, listen, keys, front)


def _own_address(keys: TransportKeys | None) -> str | None:
    """Where this process listens according to the allow-list (None without keys)."""
    return keys.book.by_name[keys.identity.name].address if keys else None


def _transport_keys(args: argparse.Namespace, role: str, addresses: list[str]) -> TransportKeys | None:
    """The process's transport keys from --keys, or None (insecure) where that is allowed; a bad key
    directory or a non-loopback address without keys ends the command with a clear message (exit 2)."""
    from kvfence.disagg.keys import KeyConfigError, resolve

    try:
        keys = resolve(args.keys, args.key_name or role, addresses, args.insecure_transport)
    except KeyConfigError as exc:
        _log(f"error: {exc}")
        sys.exit(2)
    if keys is None:
        _log("WARNING: the transport is INSECURE: no keys, any process that reaches this port may send to it")
    return keys


def _run_router(
    args: argparse.Namespace,
    prefill: str,
    decode: str,
    listen: str,
    keys: TransportKeys | None,
    front: Front,
) -> int:
    from kvfence.disagg.router import Router
    from kvfence.model.gguf import read_header
    from kvfence.model.tokenizer import Tokenizer
    from kvfence.pins import default_model_path

    config, metadata = read_header(args.model or default_model_path())
    router = Router(
        prefill,
        decode,
        Tokenizer(metadata),
        config.vocab_size,
        isolation=args.isolation == "on",
        listen=listen,
        events=EventLog(path=args.audit_log) if args.audit_log else None,
        faults=_faults(args.inject_fault),
        keys=keys,
    )
    return _run_http(args, router, front)


def _keys_generate(args: argparse.Namespace) -> int:
    from kvfence.disagg.keys import generate

    book = generate(args.directory, [(role, role, getattr(args, role)) for role in ROLES])
    _log(f"wrote {args.directory}/peers and one .secret per process (mode 0600):")
    for peer in book:
        _log(f"  {peer.name:8} {peer.address}: copy {peer.name}.secret and peers to that host only")
    return 0


def _faults(specs: list[tuple[str, float]]) -> FaultInjector:
    faults = FaultInjector()
    for name, rate in specs:
        faults.arm(name, rate)
    return faults


def _run_http(args: argparse.Namespace, client: EngineClient, front: Front) -> int:
    """Serve `client` (engine thread or router) over HTTP on the socket bound at start, behind the front
    door (kvfence.api.slow_clients), until interrupted."""
    import uvicorn

    from kvfence.api.server import build_app
    from kvfence.api.slow_clients import uvicorn_config
    from kvfence.pins import default_model_path

    name = args.served_model_name or (args.model or default_model_path()).stem
    app = build_app(client, name, front.api_keys, front.admin_key)
    _log(f"serving '{name}' on http://{args.host}:{args.port}/v1")
    config = uvicorn_config(app, front.read_timeout_s, front.max_connections, log_level="info")
    uvicorn.Server(config).run(sockets=[front.sock])
    return 0


def _generate(args: argparse.Namespace) -> int:
    config = engine_config(args)
    check_engine(config)
    engine = _load_engine(config)
    if engine is None:
        return 2
    tokenizer = engine.tokenizer
    assert tokenizer is not None, "load_engine always loads the tokenizer"
    if args.raw:
        prompt = tokenizer.encode(args.text, add_special_tokens=True)
    else:
        messages = [{"role": "user", "content": args.text}]
        prompt = tokenizer.encode(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False
        )
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        (request,) = engine.generate([prompt], params)
    except (AdmissionError, ValueError) as exc:
        _log(f"error: {exc}")
        return 1
    print(request.output_text)
    return 0


def add_transport_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--keys",
        type=Path,
        help="transport key directory (kvfence keys generate): CURVE on every socket, peers from its "
        "allow-list",
    )
    parser.add_argument("--key-name", help="this process's name in --keys (default: its role)")
    parser.add_argument(
        "--insecure-transport",
        action="store_true",
        help="allow a non-loopback address without keys (any process that reaches it may send: trusted "
        "networks only; shown in /v1/audit/info and failed by kvfence audit)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kvfence", description="A paged-KV LLM server with fenced KV.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the OpenAI-compatible server (or one PD worker)")
    add_engine_options(serve)
    add_http_options(serve)
    serve.add_argument(
        "--role",
        choices=["single", "prefill", "decode"],
        default="single",
        help="single-node server, or one prefill/decode worker (no HTTP) for a router",
    )
    serve.add_argument(
        "--listen",
        help=f"a worker's ZeroMQ address (default: its address in --keys, else {DEFAULT_LISTEN})",
    )
    add_transport_options(serve)
    serve.add_argument(
        "--disaggregated",
        action="store_true",
        help="start a prefill worker, a decode worker and the router on this host",
    )
    serve.set_defaults(run=_serve)

    router = commands.add_parser("router", help="the OpenAI front of a prefill and a decode worker")
    add_http_options(router)
    router.add_argument("--prefill", required=True, help="prefill worker address, e.g. tcp://10.0.0.1:5600")
    router.add_argument("--decode", required=True, help="decode worker address")
    router.add_argument(
        "--listen",
        help="the router's own ZeroMQ address; workers reply to it, so it must be reachable "
        "from them (default: its address in --keys, else a free loopback port)",
    )
    add_transport_options(router)
    router.add_argument("--model", type=Path, help="GGUF file for the tokenizer (default: packaged SmolLM2)")
    router.add_argument(
        "--isolation",
        choices=["on", "off"],
        default="on",
        help="fail-closed admission against both pools ('off': window only, as in the incident)",
    )
    router.add_argument("--inject-fault", type=fault_spec, action="append", default=[], metavar="NAME[:RATE]")
    router.set_defaults(run=_router)

    keys = commands.add_parser("keys", help="transport keys for a disaggregated deployment")
    keys_commands = keys.add_subparsers(dest="keys_command", required=True)
    generate_keys = keys_commands.add_parser(
        "generate", help="a CURVE keypair per process and the allow-list (DIR/peers) naming them"
    )
    generate_keys.add_argument("directory", type=Path)
    for role in ROLES:
        generate_keys.add_argument(
            f"--{role}", required=True, metavar="ADDRESS", help=f"where the {role} listens"
        )
    generate_keys.set_defaults(run=_keys_generate)

    from kvfence.audit import cli as audit_cli
    from kvfence.audit import lab

    audit_parser = commands.add_parser("audit", help="the five acceptance checks against a running server")
    audit_cli.add_arguments(audit_parser)
    audit_parser.set_defaults(run=audit_cli.run)

    lab_parser = commands.add_parser("lab", help="the four-request isolation lab on the real model")
    lab.add_arguments(lab_parser)
    lab_parser.set_defaults(run=lab.run)

    generate = commands.add_parser("generate", help="generate one answer offline and print it")
    add_engine_options(generate)
    generate.add_argument("text")
    generate.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    generate.add_argument("--seed", type=int)
    generate.set_defaults(run=_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except StartupError as exc:
        _log(f"error: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
