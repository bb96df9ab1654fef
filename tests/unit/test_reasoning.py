"""vLLM's `--reasoning-parser` (api/reasoning.py): a think block split off into `reasoning_content`, whole
and streamed, from a scripted answer decoded token by token by the engine's own incremental decoder; a
prompt that closed the block (Qwen 3's enable_thinking false) gives content only; no parser, no change.
Usage's reasoning_tokens counts the block's tokens (token ids, not characters), in every body and stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient
from test_grammar import CHATML, tiny_metadata

from kvfence.api.reasoning import PARSERS, Reasoning, ReasoningCounter, ReasoningSplitter, check_parser
from kvfence.api.server import build_app
from kvfence.engine.output import RequestOutput
from kvfence.model.tokenizer import IncrementalDecoder, Tokenizer
from kvfence.request import Status
from kvfence.sampling import SamplingParams

# Qwen 3's template, as far as thinking goes: with enable_thinking false it writes the closed block.
THINKING = CHATML.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}",
)
ANSWER = "<think>\nParis is in France.</think>\n\nParis."


@pytest.mark.parametrize(
    ("parser", "prompt_tail", "text", "expected"),
    [
        ("qwen3", "", ANSWER, ("\nParis is in France.", "\n\nParis.")),
        ("qwen3", "", "\n<think>a</think>b", ("a", "b")),
        ("qwen3", "", "no block <think>a</think>", ("", "no block <think>a</think>")),
        ("qwen3", "", "<think>cut by max_tokens </thi", ("cut by max_tokens </thi", "")),
        ("qwen3", "", "  <thi", ("", "  <thi")),
        ("qwen3", "<think>\n", "thought</think>answer", ("thought", "answer")),
        ("qwen3", "<think>\n\n</think>\n\n", "<think>a</think>b", ("", "<think>a</think>b")),
        ("deepseek_r1", "", "thought</think>answer", ("thought", "answer")),
        ("deepseek_r1", "", "<think>thought</think>answer</think>", ("thought", "answer</think>")),
        ("deepseek_r1", "", "unfinished", ("unfinished", "")),
        ("deepseek_r1", "<think>\n\n</think>\n\n", "answer", ("", "answer")),
    ],
)
def test_a_split_is_the_same_whole_or_streamed_anywhere(
    parser: str, prompt_tail: str, text: str, expected: tuple[str, str]
) -> None:
    reasoning = Reasoning(parser, prompt_tail)
    assert reasoning.split(text) == expected
    for size in (1, 2, 3, 5):
        splitter, parts = reasoning.splitter(), []
        pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
        for i, piece in enumerate(pieces):
            parts.append(splitter.feed(piece, final=i == len(pieces) - 1))
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == expected


def test_an_unknown_parser_is_refused_naming_the_choices() -> None:
    assert PARSERS == ("qwen3", "deepseek_r1") and check_parser(None) is None
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        check_parser("qwen")


class ScriptedEngine:
    """An engine client that answers every request with `script`'s tokens, detokenized one at a time by
    the engine's incremental decoder (the path every answer's text takes), then finishes with "stop"."""

    max_model_len = 512
    supports_parallel_sampling = True

    def __init__(self, tokenizer: Tokenizer, script: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.script = tokenizer, tokenizer.vocab_size, script
        self.prompts: list[list[int]] = []

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    alive = True

    async def generate(
        self, prompt: list[int], params: SamplingParams, tenant: str, request_id: str, n: int = 1
    ) -> AsyncIterator[RequestOutput]:
        self.prompts.append(prompt)
        for index in range(n):
            decoder = IncrementalDecoder(self.tokenizer)
            for count, token in enumerate(self.script, 1):
                last = count == len(self.script)
                status = Status.FINISHED if last else Status.RUNNING
                text = decoder.step(token, final=last)
                reason = "stop" if last else None
                yield RequestOutput(
                    request_id, [token], text, last, status, reason, len(prompt), count, index=index
                )


def tokenizer(atomic_tags: bool) -> Tokenizer:
    """The tiny byte-level vocab, with Qwen 3's think tags as tokens of their own or spelled out byte by
    byte (a tag spanning seven tokens)."""
    metadata = tiny_metadata() | {"tokenizer.chat_template": THINKING}
    if atomic_tags:
        metadata["tokenizer.ggml.tokens"] = [*metadata["tokenizer.ggml.tokens"], "<think>", "</think>"]
        metadata["tokenizer.ggml.token_type"] = [*metadata["tokenizer.ggml.token_type"], 4, 4]
    return Tokenizer(metadata)


@pytest.fixture(params=[True, False], ids=["atomic-tags", "byte-tags"])
def atomic(request: pytest.FixtureRequest) -> bool:
    return request.param


def serve(atomic: bool, answer: str, parser: str | None) -> tuple[TestClient, ScriptedEngine]:
    tok = tokenizer(atomic)
    assert len(tok.encode("<think></think>")) == (2 if atomic else 15)
    engine = ScriptedEngine(tok, tok.encode(answer))
    return TestClient(build_app(engine, "tiny", None, None, reasoning_parser=parser)), engine  # type: ignore[arg-type]


@pytest.fixture
def qwen3(atomic: bool) -> Iterator[TestClient]:
    client, _ = serve(atomic, ANSWER, "qwen3")
    with client:
        yield client


def chat(client: TestClient, **fields: Any) -> Any:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Capital of France?"}]} | fields
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply


def deltas(reply: Any) -> list[dict[str, Any]]:
    lines = [line.removeprefix("data: ") for line in reply.text.splitlines() if line.startswith("data: {")]
    return [json.loads(line)["choices"][0]["delta"] for line in lines if json.loads(line)["choices"]]


def test_the_message_has_reasoning_and_content_apart(qwen3: TestClient) -> None:
    message = chat(qwen3).json()["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == "\nParis is in France."
    assert message["content"] == "\n\nParis."


def test_the_stream_sends_reasoning_deltas_then_content(qwen3: TestClient) -> None:
    got = deltas(chat(qwen3, stream=True))
    reasoning = [d.get("reasoning_content") for d in got]
    content = [d.get("content") for d in got]
    assert "".join(r for r in reasoning if r) == "\nParis is in France."
    assert "".join(c for c in content if c) == "\n\nParis."
    last_reasoning = max(i for i, r in enumerate(reasoning) if r)
    assert all(not c for c in content[: last_reasoning + 1])  # no content before reasoning ends
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in got)
    assert sum(1 for r in reasoning if r) > 1  # streamed as it comes, not held to the end


@pytest.mark.parametrize("parser", PARSERS)
def test_thinking_off_in_the_template_gives_content_only(atomic: bool, parser: str) -> None:
    client, engine = serve(atomic, "Paris.", parser)
    with client:
        kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
        message = chat(client, **kwargs).json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "Paris.", "tool_calls": None}
        assert engine.tokenizer.decode(engine.prompts[-1], False).endswith("<think>\n\n</think>\n\n")
        streamed = deltas(chat(client, stream=True, **kwargs))
        assert "".join(d.get("content") or "" for d in streamed) == "Paris."
        assert not any("reasoning_content" in d for d in streamed)


def test_deepseek_r1_takes_text_before_the_end_tag_as_reasoning(atomic: bool) -> None:
    client, _ = serve(atomic, "The prompt opened it.</think>Paris.", "deepseek_r1")
    with client:
        message = chat(client).json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("The prompt opened it.", "Paris.")


def test_without_a_parser_the_answer_is_as_written(atomic: bool) -> None:
    client, _ = serve(atomic, ANSWER, None)
    with client:
        message = chat(client).json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": ANSWER, "tool_calls": None}
        streamed = deltas(chat(client, stream=True))
        assert "".join(d.get("content") or "" for d in streamed) == ANSWER
        assert not any("reasoning_content" in d for d in streamed)


def test_every_choice_is_split(qwen3: TestClient) -> None:
    choices = chat(qwen3, n=2).json()["choices"]
    assert [(c["message"]["reasoning_content"], c["message"]["content"]) for c in choices] == [
        ("\nParis is in France.", "\n\nParis.")
    ] * 2


def test_a_response_has_a_reasoning_item_before_its_message(qwen3: TestClient) -> None:
    reply = qwen3.post("/v1/responses", json={"model": "tiny", "input": "Capital of France?"})
    assert reply.status_code == 200, reply.text
    reasoning, message = reply.json()["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "\nParis is in France."}]
    assert message["content"][0]["text"] == "\n\nParis."
    stream = qwen3.post("/v1/responses", json={"model": "tiny", "input": "Capital?", "stream": True})
    events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: ")]
    kinds = [event["type"] for event in events]
    text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert text == "\nParis is in France."
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["reasoning", "message"]
    assert final[1]["content"][0]["text"] == "\n\nParis."


@pytest.mark.parametrize(
    ("parser", "prompt_tail", "pieces", "expected"),
    [
        ("qwen3", "", ["<think>", "a", "b", "</think>", "c", "d"], 4),
        ("qwen3", "", ["<think>", "a", "</", "thi", "nk>", "x"], 5),  # the tag over three tokens
        ("qwen3", "", ["<think>", "a", "</think>\n\nP", "aris"], 3),  # the tag and content in one token
        ("qwen3", "", ["\n", "<th", "ink>", "a", "</think>", "b"], 5),
        ("qwen3", "", ["<think>", "", "é", "</think>", "x"], 4),  # "": a character still incomplete
        ("qwen3", "", ["<think>", "cut", " by", " max_tokens", " </thi"], 5),  # never closed: all of them
        ("qwen3", "", ["Par", "is", " <think>", "a", "</think>"], 0),  # no block: content only
        ("qwen3", "", [" ", " <thi"], 0),
        ("qwen3", "<think>\n", ["thought", "</think>", "answer"], 2),
        ("qwen3", "<think>\n\n</think>\n\n", ["<think>", "a", "</think>", "b"], 0),  # the prompt closed it
        ("deepseek_r1", "", ["thought", "</think>", "answer", "</think>"], 2),
        ("deepseek_r1", "", ["<think>", "thought", "</think>", "answer"], 3),
        ("deepseek_r1", "", ["un", "finished"], 2),
        ("deepseek_r1", "", [" "], 1),
        ("deepseek_r1", "<think>\n\n</think>\n\n", ["answer", "</think>"], 0),
    ],
)
def test_reasoning_tokens_are_those_up_to_the_closing_tag(
    parser: str, prompt_tail: str, pieces: list[str], expected: int
) -> None:
    """Token i's text is pieces[i]; fed as the engine hands them out, one token an output or several (a
    verified draft), the count is the same, and no token after the block closed is decoded."""
    ids = list(range(len(pieces)))
    for size in (1, 2, 3, len(pieces)):
        decoded: list[int] = []
        counter = ReasoningCounter(ReasoningSplitter(parser, prompt_tail), Pieces(pieces, decoded).step)
        for start in range(0, len(ids), size):
            counter.feed(ids[start : start + size])
        assert counter.tokens == expected, (size, decoded)
        if expected:
            assert decoded == ids[:expected]  # nothing decoded after the closing token


class Pieces:
    """A decoder's step for a scripted answer: token i's text is pieces[i]; each id decoded is noted."""

    def __init__(self, pieces: list[str], decoded: list[int]) -> None:
        self.pieces, self.decoded = pieces, decoded

    def step(self, token: int) -> str:
        self.decoded.append(token)
        return self.pieces[token]


def test_a_counter_needs_the_tokenizer() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        Reasoning("qwen3", "").counter()


# ANSWER's think block, "<think>\nParis is in France.</think>": 22 tokens with atomic tags, 35 spelled out.
BLOCK_TOKENS = {True: 22, False: 35}


def closing_token(tok: Tokenizer, token_ids: list[int]) -> int:
    """How many of `token_ids` it takes for their text to hold </think>: the count, found another way."""
    return next(k for k in range(1, len(token_ids) + 1) if "</think>" in tok.decode(token_ids[:k], False))


def reasoning_tokens(usage: dict[str, Any]) -> int:
    return usage["completion_tokens_details"]["reasoning_tokens"]


def last_usage(reply: Any) -> dict[str, Any]:
    lines = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    assert lines[-1]["choices"] == [] and lines[-1]["usage"] is not None
    return lines[-1]["usage"]


def test_usage_counts_the_think_blocks_tokens(atomic: bool) -> None:
    client, engine = serve(atomic, ANSWER, "qwen3")
    with client:
        whole = chat(client, return_token_ids=True).json()
        ids = whole["choices"][0]["token_ids"]
        assert closing_token(engine.tokenizer, ids) == BLOCK_TOKENS[atomic]
        assert reasoning_tokens(whole["usage"]) == BLOCK_TOKENS[atomic]
        assert whole["usage"]["completion_tokens"] == len(ids) > BLOCK_TOKENS[atomic]
        streamed = chat(client, stream=True, stream_options={"include_usage": True})
        assert reasoning_tokens(last_usage(streamed)) == BLOCK_TOKENS[atomic]


def test_usage_sums_the_reasoning_tokens_of_every_choice(qwen3: TestClient, atomic: bool) -> None:
    whole = chat(qwen3, n=3).json()["usage"]
    assert reasoning_tokens(whole) == 3 * BLOCK_TOKENS[atomic]
    streamed = chat(qwen3, n=3, stream=True, stream_options={"include_usage": True})
    assert reasoning_tokens(last_usage(streamed)) == 3 * BLOCK_TOKENS[atomic]


def test_a_block_that_never_closes_is_all_reasoning(atomic: bool) -> None:
    client, _ = serve(atomic, "<think>cut short", "qwen3")
    with client:
        usage = chat(client).json()["usage"]
        assert reasoning_tokens(usage) == usage["completion_tokens"] == (10 if atomic else 16)


@pytest.mark.parametrize("parser", [*PARSERS, None])
def test_no_reasoning_tokens_without_a_block(atomic: bool, parser: str | None) -> None:
    """A prompt that closed the block, or no parser: chat's usage says 0; completions' has no details."""
    client, _ = serve(atomic, "<think>a</think>Paris." if parser is None else "Paris.", parser)
    with client:
        kwargs = {"chat_template_kwargs": {"enable_thinking": False}} if parser else {}
        assert reasoning_tokens(chat(client, **kwargs).json()["usage"]) == 0
        streamed = chat(client, stream=True, stream_options={"include_usage": True}, **kwargs)
        assert reasoning_tokens(last_usage(streamed)) == 0
        body = {"model": "tiny", "prompt": "x"}
        completion = client.post("/v1/completions", json=body).json()
        assert completion["usage"]["completion_tokens"] > 0
        assert "completion_tokens_details" not in completion["usage"]


def test_a_responses_usage_counts_reasoning_tokens(qwen3: TestClient, atomic: bool) -> None:
    reply = qwen3.post("/v1/responses", json={"model": "tiny", "input": "Capital of France?"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["output_tokens_details"] == {"reasoning_tokens": BLOCK_TOKENS[atomic]}
    stream = qwen3.post("/v1/responses", json={"model": "tiny", "input": "Capital?", "stream": True})
    events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.completed"
    details = events[-1]["response"]["usage"]["output_tokens_details"]
    assert details == {"reasoning_tokens": BLOCK_TOKENS[atomic]}
