"""litellm against kvfence as it talks to vLLM: the `hosted_vllm/` provider (and `openai/`), one scenario a
line, PASS or FAIL.

    .venv/bin/pip install litellm          # heavy (boto3, aiohttp, ...): not in the test requirements
    .venv/bin/python bench/litellm_check.py [--url URL --api-key KEY --model NAME]

Without `--url`, starts `kvfence serve` on the packaged SmolLM2 with one API key (kvfence.harness.cluster)
and stops it after. Scenarios, each through `litellm.completion` / `text_completion` / `embedding` with
`hosted_vllm/<model>` and `api_base` = the server's /v1: chat; streamed chat with usage, whose text is the
unstreamed greedy text; a completion; a forced tool call (tool_choice required) whose arguments parse;
`response_format` json_schema whose answer parses and has the required key; vLLM's `guided_choice`
through `extra_body`; an embedding of the model's hidden size; an unknown field refused as a 400
(litellm's BadRequestError); and chat through `openai/`. Exit status 1 when any fails; writes
bench/results/litellm_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from typing import Any

from common import exit_status, verdict, write_json

from kvfence.harness.cluster import cluster

KEY = "sk-litellm-check"
MODEL = "smollm2"
HIDDEN = 576  # SmolLM2-135M's hidden size: an embedding's length
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CITY = {
    "type": "json_schema",
    "json_schema": {
        "name": "city",
        "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    },
}
ASK = [{"role": "user", "content": "Name a large city in France."}]


@contextmanager
def server(args: argparse.Namespace) -> Iterator[tuple[str, str, str]]:
    """(base URL, API key, model name): the given server, or one started here."""
    if args.url:
        yield args.url, args.api_key, args.model
        return
    serve = ["--max-model-len", "2048", "--num-threads", "2"]
    with cluster(serve_args=serve, api_keys={KEY: "litellm"}, model_name=MODEL) as running:
        yield running.url, KEY, MODEL


def scenarios(litellm: Any, base: str, key: str, model: str) -> dict[str, Callable[[], str | None]]:
    """Name -> a check returning None (pass) or what went wrong."""
    vllm = {"model": f"hosted_vllm/{model}", "api_base": f"{base}/v1", "api_key": key}
    greedy = {**vllm, "messages": ASK, "temperature": 0, "max_tokens": 24}

    def chat() -> str | None:
        answer = litellm.completion(**greedy)
        return None if answer.choices[0].message.content else f"no content: {answer}"

    def streamed() -> str | None:
        whole = litellm.completion(**greedy).choices[0].message.content
        chunks = list(litellm.completion(**greedy, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = [c.usage for c in chunks if getattr(c, "usage", None)]
        if text != whole:
            return f"streamed {text!r} != {whole!r}"
        return None if usage and usage[-1].completion_tokens else "no usage in the stream"

    def completion() -> str | None:
        answer = litellm.text_completion(**vllm, prompt="The capital of France is", max_tokens=8)
        return None if answer.choices[0].text else f"no text: {answer}"

    def tool_call() -> str | None:
        answer = litellm.completion(**greedy | {"max_tokens": 64}, tools=[WEATHER], tool_choice="required")
        calls = answer.choices[0].message.tool_calls or []
        if not calls or calls[0].function.name != "get_weather":
            return f"no get_weather call: {answer.choices[0].message}"
        return None if "city" in json.loads(calls[0].function.arguments) else "no city argument"

    def json_schema() -> str | None:
        answer = litellm.completion(**greedy | {"max_tokens": 64}, response_format=CITY)
        content = answer.choices[0].message.content
        return None if "name" in json.loads(content) else f"no name key: {content!r}"

    def guided_choice() -> str | None:
        answer = litellm.completion(**greedy, extra_body={"guided_choice": ["Paris", "Lyon"]})
        content = answer.choices[0].message.content
        return None if content in ("Paris", "Lyon") else f"{content!r} is not a choice"

    def embedding() -> str | None:
        answer = litellm.embedding(**vllm, input=["Paris", "Lyon"])
        sizes = [len(item["embedding"]) for item in answer.data]
        return None if sizes == [HIDDEN, HIDDEN] else f"embedding sizes {sizes}"

    def unknown_field() -> str | None:
        try:
            litellm.completion(**greedy, extra_body={"best_of_everything": 3})
        except litellm.BadRequestError as exc:
            return None if "best_of_everything" in str(exc) else f"400 without the field's name: {exc}"
        return "an unknown field was accepted"

    def openai_prefix() -> str | None:
        answer = litellm.completion(**greedy | {"model": f"openai/{model}"})
        return None if answer.choices[0].message.content else f"no content: {answer}"

    return {
        "chat": chat,
        "streamed chat with usage": streamed,
        "completion": completion,
        "forced tool call": tool_call,
        "json_schema": json_schema,
        "guided_choice (extra_body)": guided_choice,
        "embedding": embedding,
        "unknown field is a 400": unknown_field,
        "openai/ prefix": openai_prefix,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="a running kvfence (default: start one here)")
    parser.add_argument("--api-key", default=KEY)
    parser.add_argument("--model", default=MODEL)
    args = parser.parse_args()
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled map: no fetch from GitHub
    import litellm  # imported here: without it, --help still works and says how to install it

    found = {}
    with server(args) as (base, key, model):
        for name, check in scenarios(litellm, base, key, model).items():
            try:
                problem = check()
            except Exception as exc:  # any failure of the client is this scenario's FAIL
                problem = f"{type(exc).__name__}: {exc}"
            found[name] = verdict(f"litellm {name}", problem is None, problem or "ok")
    write_json("litellm_check", {"litellm": version("litellm"), "verdicts": list(found.values())})
    return exit_status()


if __name__ == "__main__":
    sys.exit(main())
