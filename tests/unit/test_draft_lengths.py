"""The adaptive draft length (engine/draft_lengths.py), fed acceptance sequences: it grows on full accepts up
to the limit, cuts to the kept run + 1 on a partial one, halves on none, and at 0 pauses for doubling spans
of tokens between one-draft probes, until a probe is kept."""

from __future__ import annotations

import itertools

from kvfence.engine.draft_lengths import MAX_PAUSE, DraftLengths


def test_a_new_request_starts_at_the_limit_and_full_accepts_keep_it_there() -> None:
    lengths = DraftLengths(5)
    assert lengths.length("a", 0) == 5
    lengths.record("a", 0, drafted=5, accepted=5)
    assert lengths.length("a", 6) == 5


def test_a_partial_accept_cuts_to_the_kept_run_and_full_accepts_grow_it_back() -> None:
    lengths = DraftLengths(5)
    lengths.record("a", 0, drafted=5, accepted=2)
    assert lengths.length("a", 3) == 3
    seen = []
    for position in range(4, 8):
        k = lengths.length("a", position)
        lengths.record("a", position, drafted=k, accepted=k)
        seen.append(lengths.length("a", position + k + 1))
    assert seen == [4, 5, 5, 5]


def test_a_full_accept_cut_short_by_the_step_still_grows_the_length() -> None:
    """Fewer drafts than the length (the step's rows ran out, or the drafter had fewer), all kept: the length
    was not what failed, so it grows as after any full accept."""
    lengths = DraftLengths(5)
    lengths.record("a", 0, drafted=4, accepted=3)
    lengths.record("a", 4, drafted=1, accepted=1)
    assert lengths.length("a", 6) == 5


def test_rejections_halve_to_zero_then_probes_back_off_until_one_is_kept() -> None:
    lengths = DraftLengths(4)
    lengths.record("a", 0, drafted=4, accepted=0)
    assert lengths.length("a", 1) == 2
    lengths.record("a", 1, drafted=2, accepted=0)
    assert lengths.length("a", 2) == 1
    lengths.record("a", 2, drafted=1, accepted=0)  # 0: one token alone, then a probe
    assert [lengths.length("a", p) for p in (3, 4)] == [0, 1]
    lengths.record("a", 4, drafted=1, accepted=0)  # failed probe: two tokens alone
    assert [lengths.length("a", p) for p in (5, 6, 7)] == [0, 0, 1]
    lengths.record("a", 7, drafted=1, accepted=1)  # kept: drafting resumes, the pause starts over
    assert lengths.length("a", 9) == 2
    lengths.record("a", 9, drafted=2, accepted=0)
    lengths.record("a", 10, drafted=1, accepted=0)
    assert [lengths.length("a", p) for p in (11, 12)] == [0, 1]


def test_a_request_that_never_keeps_a_draft_spends_at_most_one_row_in_max_pause_plus_one() -> None:
    lengths = DraftLengths(3)
    drafted_at = []
    for position in range(2000):
        k = lengths.length("a", position)
        if k:
            drafted_at.append(position)
            lengths.record("a", position, drafted=k, accepted=0)
    gaps = [b - a for a, b in itertools.pairwise(drafted_at)]
    assert gaps[:7] == [1, 2, 3, 5, 9, 17, 33]  # halving 3 -> 1 -> 0, then pauses of 1, 2, 4, ... tokens
    assert set(gaps[7:]) == {MAX_PAUSE + 1}


def test_requests_are_apart_and_forget_drops_one() -> None:
    lengths = DraftLengths(4)
    lengths.record("a", 0, drafted=4, accepted=0)
    lengths.record("b", 0, drafted=4, accepted=1)
    assert (lengths.length("a", 1), lengths.length("b", 1)) == (2, 2)
    lengths.record("b", 1, drafted=2, accepted=2)
    assert (lengths.length("a", 4), lengths.length("b", 4)) == (2, 3)
    lengths.forget("a")
    assert lengths.length("a", 4) == 4
