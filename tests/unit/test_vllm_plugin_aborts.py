"""The vLLM plugin's fence aborts as a client sees them (plugins/vllm/kvfence_vllm/aborts.py, issue 62): only
a condemned request's error output is marked, the API side files it under its external id, and the serving
finds it under the id it knows (a completion's per-prompt ids extend it), once."""

from __future__ import annotations

from dataclasses import dataclass

from kvfence_vllm.aborts import MARK, MAX_KEPT, FencedRequests, error_body, mark_outputs, message

ERROR, STOP = 3, 0  # vLLM's FinishReason.ERROR and STOP


@dataclass
class Output:  # the fields of vLLM's EngineCoreOutput that are read
    request_id: str
    finish_reason: int | None
    stop_reason: object = None


def test_only_the_condemned_requests_error_outputs_are_marked_with_their_reason() -> None:
    outputs = [Output("a", ERROR), Output("b", STOP), Output("c", ERROR), Output("a", None)]
    mark_outputs(outputs, {"a": "foreign_owner", "b": "stale_generation"}, ERROR)
    assert [o.stop_reason for o in outputs] == [MARK + "foreign_owner", None, None, None]


def test_a_marked_request_is_found_under_its_own_or_its_prompts_prefix_and_only_once() -> None:
    fenced = FencedRequests()
    fenced.note("chatcmpl-1", MARK + "foreign_owner")
    fenced.note("cmpl-2-0", MARK + "stale_generation")
    fenced.note("cmpl-3-0", 7)  # a stop token id: not the fence's
    fenced.note("cmpl-4-0", "kv:other")
    assert fenced.take("chatcmpl-1") == "foreign_owner" and fenced.take("chatcmpl-1") is None
    assert fenced.take("cmpl-2") == "stale_generation" and fenced.take("cmpl-2") is None
    assert fenced.take("cmpl-3") is None and fenced.take("cmpl-4") is None
    assert fenced.take("cmpl") is None  # "cmpl-2-0" is gone; no id is a prefix match of another's


def test_the_ids_kept_are_bounded_oldest_first() -> None:
    fenced = FencedRequests()
    for n in range(MAX_KEPT + 2):
        fenced.note(f"r{n}", MARK + "foreign_owner")
    assert len(fenced.reasons) == MAX_KEPT
    assert fenced.take("r0") is None and fenced.take(f"r{MAX_KEPT + 1}") == "foreign_owner"


def test_the_error_is_openais_shape_typed_kv_integrity_error_naming_the_reason() -> None:
    body = error_body(message("foreign_owner"), "kv_integrity_error", 500)
    assert body["error"]["type"] == "kv_integrity_error" and body["error"]["code"] == 500
    assert "(foreign_owner)" in body["error"]["message"] and set(body["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }
