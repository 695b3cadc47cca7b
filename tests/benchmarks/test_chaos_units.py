"""The chaos benchmark's judging, on hand-made streams and changes (no server): the pinned model
string of each route kind, the token check, and the staleness verdict."""

from __future__ import annotations

from benchmarks.chaos_churn import Change, judge
from benchmarks.chaos_streams import Reference, StreamResult, check, pinned_model


def test_pinned_model_names_exactly_the_reported_versions() -> None:
    assert pinned_model("a", ["a@v3"]) == "a@v3"
    assert pinned_model("a:0.7+b:0.3", ["a@v1", "b@v4"]) == "a@v1:0.7+b@v4:0.3"
    assert pinned_model("comp0", ["composition:comp0@v2"]) == "comp0@v2"
    assert pinned_model("a", None) is None


def _stream(
    model: str,
    versions: list[str] | None,
    tokens: list[str],
    lps: list[float],
    t: float = 0.0,
    status: int = 200,
) -> StreamResult:
    r = StreamResult("acme", model, 0, len(tokens), t, status=status, versions=versions)
    r.tokens, r.logprobs = tokens, lps
    return r


def test_check_counts_a_wrong_token_and_a_moved_logprob() -> None:
    refs = {("a@v1", 0): Reference(["x", "y", "z"], [-1.0, -2.0, -3.0])}
    right = _stream("a", ["a@v1"], ["x", "y", "z"], [-1.0, -2.0, -3.0])
    wrong_text = _stream("a", ["a@v1"], ["x", "q", "z"], [-1.0, -2.0, -3.0])
    wrong_lp = _stream("a", ["a@v1"], ["x", "y", "z"], [-1.0, -2.5, -3.0])
    unknown = _stream("a", ["a@v9"], ["x"], [-1.0])
    got = check([right, wrong_text, wrong_lp, unknown], refs)
    assert got["tokens_checked"] == 9 and got["tokens_wrong"] == 2
    assert got["tokens_unchecked"] == 1


def test_judge_flags_a_stream_sent_after_a_change_that_got_the_old_version() -> None:
    push = Change(
        "push", "n0", t_call=10.0, t_return=11.0, status=200, latest="v2", store_read=True
    )
    streams = [
        _stream("n0", ["n0@v1"], ["x"], [-1.0], t=10.5),  # sent before the return: either
        _stream("n0", ["n0@v2"], ["x"], [-1.0], t=11.2),
        _stream("n0", ["n0@v1"], ["x"], [-1.0], t=11.5),  # stale
        _stream("n0@v1", ["n0@v1"], ["x"], [-1.0], t=11.6),  # pinned: not judged
    ]
    got = judge([push], streams, duration_s=10.0, t0=0.0)
    assert got["stale_after_return"] == 1 and got["stale_after_confirmed_return"] == 1
    assert got["first_served_measured"] == 1


def test_judge_counts_a_failed_call_that_changed_the_store_by_the_store() -> None:
    # a call that answered 500 but made v2: the store's truth decides, no stale verdict
    push = Change(
        "push", "n0", t_call=10.0, t_return=11.0, status=500, latest="v2", store_read=True
    )
    streams = [_stream("n0", ["n0@v2"], ["x"], [-1.0], t=12.0)]
    got = judge([push], streams, duration_s=10.0, t0=0.0)
    assert got["stale_after_return"] == 0 and got["change_5xx"] == 1


def test_judge_expects_404_after_an_unload() -> None:
    unload = Change(
        "unload",
        "n0",
        t_call=10.0,
        t_return=11.0,
        status=200,
        latest=None,
        store_read=True,
        unconfirmed="1",
    )
    streams = [
        _stream("n0", ["n0@v1"], ["x"], [-1.0], t=12.0),
        _stream("n0", None, [], [], t=12.5, status=404),
    ]
    got = judge([unload], streams, duration_s=10.0, t0=0.0)
    assert got["stale_after_return"] == 1 and got["stale_after_confirmed_return"] == 0


def test_table_and_goals_read_every_section() -> None:
    from benchmarks.chaos import goals, table
    from benchmarks.chaos_churn import judge as judge_

    streams = [_stream("a", ["a@v1"], ["x"], [-1.0])]
    report = {
        "mode": "quick",
        "wall_s": 1.0,
        "wrong_weight": {
            **check(streams, {("a@v1", 0): Reference(["x"], [-1.0])}),
            "references": 1,
            "reference_failures": [],
            "distinguishable": 1.0,
        },
        "streams": {"streams": 1, "ends": {"complete": 1}, "lost_without_status": 0, "http_5xx": 0},
        "catalog": judge_([], streams, 1.0, 0.0),
        "faults": [
            {"fault": "SIGKILL Router", "recovery_s": 1.0},
            {
                "fault": "SIGKILL SeaweedFS",
                "recovery_s": 2.0,
                "resident_completed_during_outage": 1,
                "resident_requests_during_outage": 1,
                "cold_adapter": {"status": 503, "retry_after": "1", "seconds": 0.1},
            },
        ],
        "flood": {
            "victim_ttft_p99_solo_ms": 1,
            "victim_ttft_p99_flooded_ms": 2,
            "victim_ttft_p99_ratio": 2.0,
            "health_max_ms": 3,
            "health_p99_ms": 3,
            "health_errors": 0,
            "flood_5xx": 0,
        },
        "fuzz": {"cases": 1, "5xx": 0, "cross_tenant_names": 0, "existence_oracles": 0},
    }
    assert "tokens checked" in table(report)
    assert goals(report)["wrong_tokens_zero"] and goals(report)["existence_oracles_zero"]


def test_a_failed_call_that_landed_late_is_stale_but_no_broken_promise() -> None:
    push = Change(
        "push", "n0", t_call=10.0, t_return=11.0, status=500, latest="v2", store_read=True
    )
    streams = [_stream("n0", ["n0@v1"], ["x"], [-1.0], t=11.2)]
    got = judge([push], streams, duration_s=10.0, t0=0.0)
    assert got["stale_after_return"] == 1 and got["stale_after_confirmed_return"] == 0


def test_a_stream_admitted_after_the_next_change_began_may_get_its_version() -> None:
    unload = Change(
        "unload", "n0", t_call=10.0, t_return=11.0, status=200, latest=None, store_read=True
    )
    republish = Change(
        "republish", "n0", t_call=20.0, t_return=25.0, status=200, latest="v2", store_read=True
    )
    late = _stream("n0", ["n0@v2"], ["x"], [-1.0], t=15.0)  # sent in the unload's window,
    late.ttft = 8.0  # first token at 23 s: admitted after the republish began
    early = _stream("n0", ["n0@v2"], ["x"], [-1.0], t=12.0)
    early.ttft = 1.0  # admitted by 13 s, before the republish began: v2 did not exist
    got = judge([unload, republish], [late, early], duration_s=20.0, t0=0.0)
    assert got["stale_after_return"] == 1
