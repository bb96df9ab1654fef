"""The HTTP option group of every command that serves the OpenAI API (`kvfence serve`, `kvfence router`, a
Ray replica through the serve parser): bind address and port, the key files, logs, CORS, the chat
template, the front door's limits and the sampling defaults.

Contracts: as cli_options.py's, every option whose value defaults to something states that default in its
help, from the constant the option uses; no secret is an option's value (`--api-key KEY` and `--admin-key
KEY` are refused, naming the file or environment variable to use); `--chat-template FILE` is read and
parsed as jinja while the options are parsed, so a bad file is one line before the model loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvfence.api.reasoning import PARSERS
from kvfence.api.slow_clients import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT_S
from kvfence.cli_checks import origin, port_number, positive_float, positive_int, temperature, top_p
from kvfence.startup import ApiKeyOnCommandLine, SecretOnCommandLine


def add_http_options(parser: argparse.ArgumentParser) -> None:
    """The flags of every command that serves the OpenAI API."""
    g = parser.add_argument_group("http")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    g.add_argument("--port", type=port_number, default=8000, help="HTTP port (default: %(default)s)")
    g.add_argument(
        "--api-keys",
        type=Path,
        metavar="FILE",
        help="'KEY TENANT' per line (# comments), a file only its owner may access (chmod 600) (default: "
        "$KVFENCE_API_KEYS, '; '-separated, or vLLM's $VLLM_API_KEY, one key of tenant 'default'; none: "
        "auth off)",
    )
    g.add_argument(  # vLLM's `--api-key KEY`: refused, naming --api-keys FILE and $VLLM_API_KEY
        "--api-key",
        nargs="?",
        action=ApiKeyOnCommandLine,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
    g.add_argument(
        "--admin-key-file",
        type=Path,
        metavar="FILE",
        help="a file holding the key for the audit endpoints and /metrics, on one line, that only its owner "
        "may access (chmod 600) (default: $KVFENCE_ADMIN_KEY)",
    )
    g.add_argument(
        "--admin-key",
        nargs="?",
        action=SecretOnCommandLine,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
    g.add_argument("--audit-log", type=Path, metavar="FILE", help="append audit events here as JSONL")
    g.add_argument(
        "--metrics-compat",
        choices=["vllm"],
        help="also expose vLLM's series under vLLM's names (vllm:...) on /metrics, for its dashboards "
        "(default: kvfence's names only)",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=PARSERS,
        help="split a chat answer's <think>...</think> off into reasoning_content, as vLLM's parser of that "
        "name (default: none, the answer as written)",
    )
    g.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no stats line every 10 s (vLLM's: prompt and generation throughput, requests running and "
        "waiting, KV cache usage, prefix cache hit rate; logged only while tokens move) (default: logged)",
    )
    g.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request's id, tenant, prompt length and sampling parameters when it arrives, and how "
        "it ended (finish reason, tokens); never its API key, its text only with --log-request-prompts",
    )
    g.add_argument(
        "--log-request-prompts",
        action="store_true",
        help="with --enable-log-requests, each prompt's text too: prompts are tenants' data, so only where "
        "whoever reads the log may read them (default: off)",
    )
    g.add_argument(
        "--allowed-origins",
        type=origin,
        nargs="+",
        metavar="ORIGIN",
        help="browser origins allowed to call the API by CORS, e.g. https://app.example.com, or * (default: "
        "none, no CORS headers)",
    )
    g.add_argument("--served-model-name", help="model id in the API (default: the GGUF file stem)")
    g.add_argument(
        "--chat-template",
        type=chat_template_file,
        metavar="FILE",
        help="jinja chat template for /v1/chat/completions, in place of the model file's (default: the "
        "file's tokenizer.chat_template; without one, chat requests get 400)",
    )
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
    g.add_argument(
        "--default-temperature",
        type=temperature,
        metavar="T",
        help="temperature of a request that sets none (default: the model's general.sampling.temp, "
        "else 0: greedy)",
    )
    g.add_argument(
        "--default-top-p",
        type=top_p,
        metavar="P",
        help="top_p of a request that sets none (default: the model's general.sampling.top_p, else 1)",
    )


def chat_template_file(text: str) -> str:
    """`--chat-template FILE`: the template's source, read and parsed at start-up so that a missing file or
    a jinja syntax error is one line before the model loads, not a failure on the first chat request."""
    import jinja2  # only when the option is given: --help stays light

    try:
        source = Path(text).read_text(encoding="utf-8")
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {exc}") from None
    except jinja2.TemplateSyntaxError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} line {exc.lineno}: not a jinja template: {exc}") from None
    return source
