"""The near-tie oracle on scripted steps: where an answer departs, how sure the solo run was there, the
jitter of the tokens both agree on, the margin's bounds, and reading logprobs in both OpenAI shapes."""

from __future__ import annotations

import math

from kvfence.audit.neartie import CEILING, FLOOR, Margin, departure, jitter
from kvfence.audit.tokens import Step, read_steps


def steps(*tokens: tuple[str, float, dict[str, float]]) -> list[Step]:
    return [Step(token, logprob, top) for token, logprob, top in tokens]


SOLO = steps(
    ("The", -0.01, {"The": -0.01, "A": -4.7}),
    (" cat", -0.70, {" cat": -0.70, " dog": -0.705, " cow": -3.0}),
    (" sat", -0.05, {" sat": -0.05, " ran": -3.2}),
)


def test_a_departure_at_a_near_tie_has_the_solo_runs_small_gap() -> None:
    other = [SOLO[0], Step(" dog", -0.69)]
    found = departure(SOLO, other)
    assert found is not None and (found.step, found.solo_token, found.other_token) == (1, " cat", " dog")
    assert found.exact and math.isclose(found.gap, 0.005, abs_tol=1e-9)
    assert Margin.measured([1e-5]).judge(found) == "explained"  # 0.005 < the floor of 0.02


def test_a_departure_the_solo_run_was_sure_of_is_beyond_any_margin() -> None:
    other = steps(("The", -0.01, {}), (" cat", -0.7, {}), (" ran", -0.1, {}))
    found = departure(SOLO, other)
    assert found is not None and found.step == 2 and math.isclose(found.gap, 3.15)
    assert Margin.measured([0.5]).judge(found) == "beyond"  # even at the ceiling (1 nat)


def test_an_unlisted_token_gives_a_lower_bound_and_an_early_end_no_gap() -> None:
    unlisted = departure(SOLO, steps(("The", -0.01, {}), (" pig", -0.2, {})))
    assert unlisted is not None and not unlisted.exact
    assert math.isclose(unlisted.gap, -0.70 - (-3.0))  # no unlisted token beats the least listed one
    ended = departure(SOLO, SOLO[:2])
    assert ended is not None and ended.gap is None and ended.other_token is None
    assert Margin.measured([]).judge(ended) == "undecided"
    assert departure(SOLO, list(SOLO)) is None


def test_jitter_is_measured_only_where_the_answers_agree() -> None:
    batched = steps(
        ("The", -0.0101, {"The": -0.0101, "A": -4.6995}),
        (" dog", -0.69, {" dog": -0.69, " cat": -0.9}),  # departs: nothing from here on counts
        (" sat", -9.0, {}),
    )
    assert math.isclose(jitter(SOLO, batched), 5e-4, rel_tol=1e-6)


def test_the_margin_is_ten_times_the_jitter_within_its_floor_and_ceiling() -> None:
    assert Margin.measured([1e-6, 3e-6]).value == FLOOR
    assert math.isclose(Margin.measured([0.004, 0.01]).value, 0.1)
    assert Margin.measured([2.5]).value == CEILING  # a faulty server cannot calibrate its faults away
    assert Margin.measured([0.01]).samples == 1


def test_both_openai_shapes_are_read_and_malformed_values_refused() -> None:
    chat = {
        "logprobs": {
            "content": [{"token": "Hi", "logprob": -0.1, "top_logprobs": [{"token": "Yo", "logprob": -2.0}]}]
        }
    }
    legacy = {"logprobs": {"tokens": ["Hi"], "token_logprobs": [-0.1], "top_logprobs": [{"Yo": -2.0}]}}
    assert read_steps(chat) == read_steps(legacy) == [Step("Hi", -0.1, {"Yo": -2.0})]
    assert read_steps({"text": "Hi"}) is None  # no logprobs: the server ignored the field
    for bad in ("x", float("nan"), 5.0, None, True):
        assert read_steps({"logprobs": {"tokens": ["Hi"], "token_logprobs": [bad]}}) is None
