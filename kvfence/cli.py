"""The `kvfence` command, one entry point: `serve` (the OpenAI-compatible server, single node, one
prefill/decode worker, `--disaggregated` locally or with `--ray` its workers as Ray actors
(kvfence.ray.workers), or `--ray-replicas N` on Ray Serve: kvfence.ray.local),
`router` (the front of remote workers), `audit` (acceptance checks against a running server), `lab` (the
isolation lab) and `generate` (one prompt, offline).

Engine options are defined once (`add_engine_options`, in kvfence.cli_options with the other shared option
groups, each default stated in its help) and turned into an EngineConfig once (`engine_config`), so every
subcommand that runs the engine takes the same flags with the same meaning.
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

from kvfence.cli_checks import (
    Front,
    OneLineParser,
    StartupError,
    check_engine,
    check_http,
    check_ray_options,
    fault_spec,
    model_file,
    protection_lines,
)
from kvfence.cli_http import add_http_options
from kvfence.cli_model import check_model
from kvfence.cli_options import (
    DEFAULT_LISTEN,
    add_engine_options,
    add_serve_options,
    add_transport_options,
    address_list,
    engine_config,
    http_app,
    kv_plane,
    resolve_model_arg,
    served_model,
)
from kvfence.config import CapacityError, EngineConfig
from kvfence.lifetime import exit_with_named_parent
from kvfence.trail.events import EventLog
from kvfence.trail.faults import FaultInjector

if TYPE_CHECKING:
    from kvfence.disagg.keys import TransportKeys
    from kvfence.engine.async_engine import EngineClient
    from kvfence.engine.engine import LLMEngine
    from kvfence.request import Request

ROLES = ("prefill", "decode", "router")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _load_engine(
    config: EngineConfig, events: EventLog | None = None, chat_template: str | None = None
) -> LLMEngine | None:
    """The engine, or None after printing why it refused to start (the window does not fit the pool)."""
    from kvfence.engine.engine import load_engine  # torch: only once a model is to be loaded

    try:
        return load_engine(config, events, log=_log, chat_template=chat_template)
    except CapacityError as exc:
        _log(f"error: {exc}")
        return None


def _report(args: argparse.Namespace, front: Front | None) -> None:
    """What protects the server, before the model loads (the pool and window follow from the engine)."""
    for line in protection_lines(args.isolation == "on", args.inject_fault, front):
        _log(line)


def _serve(args: argparse.Namespace) -> int:
    resolve_model_arg(args)
    check_ray_options(args)
    if args.ray:
        from kvfence.ray.workers import check_options  # no Ray yet: only its refusals

        check_options(args)
    if args.ray_replicas is not None:
        from kvfence.ray.local import run  # Ray: only for a server on Ray

        return run(args, args.argv)
    config = engine_config(args)
    if args.role != "single":
        keys = _transport_keys(args, args.role, [args.listen] if args.listen else [])
        check_engine(config)
        _report(args, None)
        listen = args.listen or _own_address(keys) or DEFAULT_LISTEN
        from kvfence.disagg.launch import run_worker  # the worker's engine: torch, after every check

        run_worker(args.role, config, listen, keys=keys, plane=kv_plane(args))
        return 0
    check_engine(config)
    front = check_http(args)
    _report(args, front)
    if args.disaggregated:
        return _serve_disaggregated(args, config, front)
    events = EventLog(path=args.audit_log) if args.audit_log else None
    engine = _load_engine(config, events, args.chat_template)
    if engine is None:
        return 2
    from kvfence.engine.async_engine import AsyncEngine

    return _run_http(args, AsyncEngine(engine), front)


def _serve_disaggregated(args: argparse.Namespace, config: EngineConfig, front: Front) -> int:
    """--prefill-workers prefill and --decode-workers decode worker processes plus the router, all on this
    host, speaking CURVE with keys made for this run only, one per process (unless --insecure-transport);
    with --ray the workers are Ray actors instead. A worker that dies is restarted; SIGTERM and SIGINT stop
    every child."""
    from kvfence.disagg.keys import ephemeral, worker_names
    from kvfence.disagg.launch import LocalWorkers, free_ports

    names = worker_names("prefill", args.prefill_workers) + worker_names("decode", args.decode_workers)
    if args.ray:  # the workers as Ray actors, this process the router (kvfence.ray.workers)
        from kvfence.ray.workers import serve_workers

        def router(prefill: list[str], decode: list[str], listen: str, keys: TransportKeys) -> int:
            with _terminate_on_sigterm():  # again: ray.init installed a handler of its own (sys.exit(15))
                return _run_router(args, prefill, decode, listen, keys, front)

        with _terminate_on_sigterm():
            return serve_workers(args, config, names, kv_plane(args), router)
    ports = free_ports(len(names) + 1)
    addresses = {
        name: f"tcp://127.0.0.1:{port}" for name, port in zip([*names, "router"], ports, strict=True)
    }
    specs = [(name, name.partition("-")[0], address) for name, address in addresses.items()]
    keys = None if args.insecure_transport else ephemeral(specs)
    _log(f"transport: {'INSECURE (--insecure-transport)' if keys is None else 'CURVE with ephemeral keys'}")
    workers = [(name, config) for name in names]
    with _terminate_on_sigterm(), LocalWorkers(workers, addresses, keys, plane=kv_plane(args)):
        router_keys = keys["router"] if keys else None
        prefill = [addresses[n] for n in names if n.startswith("prefill")]
        decode = [addresses[n] for n in names if n.startswith("decode")]
        return _run_router(args, prefill, decode, addresses["router"], router_keys, front)


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
        args, "router", [*args.prefill, *args.decode, *([args.listen] if args.listen else [])]
    )
    if keys is not None:
        for role in ("prefill", "decode"):
            for address in getattr(args, role):
                peer = keys.book.by_address.get(address)
                if peer is None or peer.role != role:
                    _log(f"error: --{role} {address} is not a {role} worker in {args.keys}/peers")
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
    prefill: list[str],
    decode: list[str],
    listen: str,
    keys: TransportKeys | None,
    front: Front,
) -> int:
    from kvfence.disagg.router import Router
    from kvfence.model.gguf import read_header
    from kvfence.model.hf_dir import read_dir
    from kvfence.model.tokenizer import Tokenizer
    from kvfence.pins import default_model_path

    path = args.model or default_model_path()
    if path.is_dir():
        config, tokenizer = read_dir(path).config, Tokenizer.from_hf_dir(path, args.chat_template)
    else:
        config, metadata = read_header(path)
        tokenizer = Tokenizer(metadata, args.chat_template)
    router = Router(
        prefill,
        decode,
        tokenizer,  # the router renders chat prompts, not the workers
        config.vocab_size,
        isolation=args.isolation == "on",
        listen=listen,
        events=EventLog(path=args.audit_log) if args.audit_log else None,
        faults=_faults(args.inject_fault),
        keys=keys,
    )
    return _run_http(args, router, front)


def _keys_generate(args: argparse.Namespace) -> int:
    from kvfence.disagg.keys import KeyConfigError, generate, named

    specs = [spec for role in ROLES for spec in named(role, getattr(args, role))]
    try:
        book = generate(args.directory, specs, force=args.force)
    except KeyConfigError as exc:  # keys already there, or a directory others could write: one line
        _log(f"error: {exc}")
        return 2
    _log(f"wrote {args.directory}/peers and one .secret per process (mode 0600):")
    for peer in book:
        _log(f"  {peer.name:9} {peer.address}: copy {peer.name}.secret and peers to that host only")
    return 0


def _audit(args: argparse.Namespace) -> int:
    from kvfence.audit import cli as audit_cli  # its HTTP client loads here, not in every command

    return audit_cli.run(args)


def _lab(args: argparse.Namespace) -> int:
    from kvfence.audit import lab  # the lab runs engines: torch

    return lab.run(args)


def _faults(specs: list[tuple[str, float]]) -> FaultInjector:
    faults = FaultInjector()
    for name, rate in specs:
        faults.arm(name, rate)
    return faults


def _run_http(args: argparse.Namespace, client: EngineClient, front: Front) -> int:
    """Serve `client` (engine thread or router) over HTTP on the socket bound at start, behind the front
    door (kvfence.api.slow_clients), until interrupted."""
    import uvicorn

    from kvfence.api.slow_clients import uvicorn_config
    from kvfence.api.stats_log import log_to_stderr

    app = http_app(args, client, front.api_keys, front.admin_key, front.sampling)
    log_to_stderr()
    _log(f"serving '{served_model(args)}' on http://{args.host}:{args.port}/v1")
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
    elif not tokenizer.has_chat_template:
        _log("error: this model file has no chat template: pass --raw to send the text as it is")
        return 2
    else:
        messages = [{"role": "user", "content": args.text}]
        prompt = tokenizer.encode(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False
        )
    from kvfence.engine.engine import AdmissionError
    from kvfence.sampling import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        request = engine.add_request(prompt, params)
    except (AdmissionError, ValueError) as exc:
        _log(f"error: {exc}")
        return 1
    return _stream(engine, request)


def _stream(engine: LLMEngine, request: Request) -> int:
    """Step the engine and print the request's text as each step gives it (flushed, so a pipe sees every
    piece as it comes), then a newline. Exit code 1 when the request did not finish normally: the fence
    aborted it, and stderr says why."""
    while not request.is_finished:
        for output in engine.step():
            if output.request_id == request.request_id and output.new_text:
                sys.stdout.write(output.new_text)
                sys.stdout.flush()
    from kvfence.request import Status

    print(flush=True)
    if request.status is not Status.FINISHED:
        _log(f"error: request {request.status.value}: {request.finish_reason}")
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kvfence", description="A paged-KV LLM server with fenced KV.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the OpenAI-compatible server (or one PD worker)")
    add_serve_options(serve)
    serve.set_defaults(run=_serve)

    router = commands.add_parser("router", help="the OpenAI front of prefill and decode workers")
    add_http_options(router)
    router.add_argument(
        "--prefill",
        type=address_list,
        required=True,
        help="prefill worker addresses, comma-separated, e.g. tcp://10.0.0.1:5600,tcp://10.0.0.4:5600",
    )
    router.add_argument(
        "--decode", type=address_list, required=True, help="decode worker addresses, likewise"
    )
    router.add_argument(
        "--listen",
        help="the router's own ZeroMQ address; workers reply to it, so it must be reachable "
        "from them (default: its address in --keys, else a free loopback port)",
    )
    add_transport_options(router)
    router.add_argument(
        "--model", type=model_file, help="GGUF file for the tokenizer (default: packaged SmolLM2)"
    )
    router.add_argument(
        "--isolation",
        choices=["on", "off"],
        default="on",
        help="fail-closed admission against both pools ('off': window only, as in the incident) "
        "(default: %(default)s)",
    )
    router.add_argument(
        "--inject-fault",
        type=fault_spec,
        action="append",
        default=[],
        metavar="NAME[:RATE]",
        help="arm a named fault (repeatable; default: none)",
    )
    router.set_defaults(run=_router)

    keys = commands.add_parser("keys", help="transport keys for a disaggregated deployment")
    keys_commands = keys.add_subparsers(dest="keys_command", required=True)
    generate_keys = keys_commands.add_parser(
        "generate", help="a CURVE keypair per process and the allow-list (DIR/peers) naming them"
    )
    generate_keys.add_argument("directory", type=Path)
    for role in ROLES:
        generate_keys.add_argument(
            f"--{role}",
            type=address_list if role != "router" else lambda a: [a],
            required=True,
            metavar="ADDRESS" if role == "router" else "ADDRESS[,ADDRESS...]",
            help=f"where the {role} listens"
            + ("" if role == "router" else f" (several: named {role}-0, {role}-1... by position)"),
        )
    generate_keys.add_argument(
        "--force",
        action="store_true",
        help="replace keys already in DIR (every host must then get its new ones)",
    )
    generate_keys.set_defaults(run=_keys_generate)

    from kvfence.audit.options import add_arguments as add_audit_arguments

    audit_parser = commands.add_parser("audit", help="the five acceptance checks against a running server")
    add_audit_arguments(audit_parser)
    audit_parser.set_defaults(run=_audit)

    lab_parser = commands.add_parser("lab", help="the four-request isolation lab on the real model")
    lab_parser.add_argument("--model", type=model_file, help="GGUF file (default: the packaged SmolLM2)")
    lab_parser.add_argument(
        "--mode",
        choices=["single", "disaggregated", "both"],
        default="both",
        help="which deployment runs the four requests (default: %(default)s)",
    )
    lab_parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    lab_parser.set_defaults(run=_lab)

    generate = commands.add_parser("generate", help="generate one answer offline and print it")
    add_engine_options(generate)
    generate.add_argument("text")
    generate.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    generate.add_argument("--max-tokens", type=int, default=64, help="tokens at most (default: %(default)s)")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    generate.add_argument("--seed", type=int)
    generate.set_defaults(run=_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    exit_with_named_parent()  # started by a harness or supervisor that names itself: never outlive it
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # `serve --ray-replicas` hands its replicas the same arguments, less its own
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except StartupError as exc:
        _log(f"error: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
