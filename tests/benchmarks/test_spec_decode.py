"""The speculative-decoding benchmark's pure parts: the prompt set, a cell's numbers, the
acceptance and speed-up arithmetic, the greedy-equality check and the table. No server starts."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.chat_stream import Sample
from benchmarks.spec_decode import (
    CONCURRENCY,
    NGRAM,
    ROUTES,
    acceptance,
    cell_prompts,
    cell_stats,
    first_difference,
    geomean,
    greedy_check,
    main,
    make_plan,
    parse_counters,
    pooled_acceptance,
    ratio,
    render_table,
    request_body,
    requests_for,
    summarize,
    variant_order,
    vllm_args,
)
from benchmarks.spec_prompts import CHAT, GROUNDED, GROUNDED_KINDS, WORKLOADS


def _words(text: str) -> int:
    return len(text.split())


# ---- the prompt set -------------------------------------------------------------------------


def test_grounded_prompts_are_eight_of_each_kind_interleaved() -> None:
    assert len(GROUNDED) == 32
    assert [p.kind for p in GROUNDED[:4]] == list(GROUNDED_KINDS)
    for kind in GROUNDED_KINDS:
        assert sum(p.kind == kind for p in GROUNDED) == 8
    # any first n prompts spread over the kinds: the quick run's 3 are 3 different kinds
    assert len({p.kind for p in GROUNDED[:3]}) == 3


def test_every_grounded_prompt_carries_a_passage_of_a_few_hundred_tokens() -> None:
    for p in GROUNDED:
        instruction, _, passage = p.text.partition("\n\n")
        assert instruction and passage, p.id
        # ~4 characters per token (SmolLM2's tokenizer gives these prompts 240-400 tokens)
        assert 700 <= len(passage) <= 2000, (p.id, len(passage))


def test_prompt_ids_are_unique_and_name_their_kind() -> None:
    every = [p for prompts in WORKLOADS.values() for p in prompts]
    assert len({p.id for p in every}) == len(every)
    assert all(p.id.startswith(p.kind + "-") for p in every)
    assert 3 <= len(CHAT) <= 10 and all(_words(p.text) < 30 for p in CHAT)


def test_extraction_prompts_ask_for_json_and_summaries_for_quotes() -> None:
    for p in GROUNDED:
        instruction = p.text.partition("\n\n")[0]
        if p.kind == "extract":
            assert "JSON" in instruction
        if p.kind == "summarize":
            assert "quotation" in instruction and '"' in p.text.partition("\n\n")[2]


# ---- the workload of a cell -----------------------------------------------------------------


def test_requests_per_cell() -> None:
    assert requests_for(1, 32) == 8  # c=1: a sample, every kind twice (interleaved)
    assert requests_for(4, 32) == 32  # every prompt at least once above c=1
    assert requests_for(32, 32) == 64  # two full batches' worth
    assert requests_for(4, 6) == 16
    assert requests_for(1, 3, quick=True) == 3


def test_cell_prompts_cycle_through_the_workload() -> None:
    picked = cell_prompts(CHAT[:2], 5)
    assert [p.id for p in picked] == ["chat-0", "chat-1", "chat-0", "chat-1", "chat-0"]


def test_request_body_is_a_greedy_streaming_chat() -> None:
    body = request_body("digits", "hi", None, 128, False)
    assert body["temperature"] == 0.0 and body["max_tokens"] == 128 and body["stream"]
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["model"] == "digits" and body["ignore_eos"] is False


def test_routes_name_what_the_embedded_store_serves() -> None:
    assert set(ROUTES) == {"base", "single", "mix", "vocab", "learned_top2"}
    assert ROUTES["vocab"] == "digits" and ROUTES["learned_top2"] == "molora"
    assert ":" in ROUTES["mix"] and "+" in ROUTES["mix"]


def test_vllm_gets_the_briefs_ngram_config_and_the_same_peft_folder() -> None:
    args = vllm_args(NGRAM, ["base", "single"])
    assert args[args.index("--speculative-config") + 1] == (
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}'
    )
    module = args[args.index("--lora-modules") + 1]
    assert module.startswith("arithmetic=") and module.endswith(tuple("0123456789abcdef"))
    assert vllm_args(None, ["base"]) == ()


def test_rounds_reverse_the_whole_variant_order() -> None:
    first = variant_order(0, ["vllm", "molora"])
    assert first == [("vllm", False), ("vllm", True), ("molora", False), ("molora", True)]
    assert variant_order(1, ["vllm", "molora"]) == first[::-1]
    assert variant_order(2, ["vllm", "molora"]) == first


def _args(**kw: object) -> argparse.Namespace:
    base = dict(workloads=None, routes=None, concurrency=None, max_tokens=None,
                ignore_eos=False, quick=False, method="ngram", k=4, max_batch=4)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_quick_plan_is_one_route_c1_three_prompts_short() -> None:
    plan = make_plan(_args(quick=True))
    assert plan["routes"] == ["base"] and plan["concurrency"] == [1]
    assert plan["prompts"] == 3 and plan["workloads"] == ["grounded"]
    assert plan["max_tokens"] < 128
    full = make_plan(_args())
    assert full["concurrency"] == list(CONCURRENCY) and full["max_tokens"] == 128
    assert full["vllm_routes"] == ["base", "single"]
    assert full["speculative_molora"] == {**NGRAM, "max_batch": 4}
    assert full["speculative_vllm"] == NGRAM  # vLLM has no max_batch


def test_cli_refuses_an_unknown_route() -> None:
    with pytest.raises(SystemExit):
        main(["--routes", "nonsense"])


# ---- a cell's numbers -----------------------------------------------------------------------


def test_cell_stats_decode_rate_excludes_the_first_token() -> None:
    # 9 tokens, first after 0.5 s, then 4 chunks 0.1 s apart carrying 8 tokens (2 per chunk)
    fast = Sample(ttft=0.5, itl=[0.1] * 4, tokens=9, text="x")
    slow = Sample(ttft=0.7, itl=[0.2] * 8, tokens=9, text="y")
    failed = Sample(error="500: boom")
    row = cell_stats([fast, slow, failed], seconds=2.0)
    assert row["requests"] == 3 and row["errors"] == ["500: boom"]
    assert row["completion_tokens"] == 18 and row["tok_per_s"] == 9.0
    assert row["decode_tok_per_s"] == pytest.approx(16 / 2.0, abs=0.1)  # tokens over time
    assert row["tokens_per_request"] == 9.0
    assert row["tpot_p50_ms"] == 200.0  # sorted [50 ms, 200 ms]: the upper median
    assert row["tokens_per_chunk"] == pytest.approx(18 / 14, abs=0.01)
    assert row["itl_p50_ms"] == 200.0 and row["ttft_p50_ms"] == 700.0


def test_chunks_that_arrive_together_do_not_make_an_absurd_decode_rate() -> None:
    # the router delivered a stream's last 7 tokens in one read: ~0 s of decode time
    together = Sample(ttft=0.2, itl=[1e-6], tokens=8, text="z")
    steady = Sample(ttft=0.2, itl=[0.05] * 7, tokens=8, text="w")
    row = cell_stats([together, steady], seconds=1.0)
    assert row["decode_tok_per_s"] == pytest.approx(14 / 0.35, abs=0.1)


def test_cell_stats_of_nothing_is_none_not_a_crash() -> None:
    row = cell_stats([Sample(error="x")], seconds=0.0)
    assert row["tok_per_s"] is None and row["decode_tok_per_s"] is None
    assert row["itl_p50_ms"] is None and row["tokens_per_chunk"] is None


# ---- counters, acceptance and speed-up ------------------------------------------------------

VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="base"} 6.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="base"} 1.7966076812244706e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="base"} 24.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="base"} 17.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="base",position="0"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="base",position="1"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",position="1"} 1.79e+09
vllm:generation_tokens_total{model_name="base"} 120.0
vllm:num_requests_running{model_name="base"} 0.0
"""


def test_parse_counters_reads_vllms_series_without_created_or_other_series() -> None:
    got = parse_counters(VLLM_METRICS)
    assert got == {
        "drafts": 6.0,
        "draft_tokens": 24.0,
        "accepted_tokens": 17.0,
        "generation_tokens": 120.0,
        "accepted_per_pos": {0: 6.0, 1: 5.0},
    }


def test_parse_counters_sums_replicas_and_takes_rays_underscore_form() -> None:
    text = (
        'vllm_spec_decode_num_drafts_total{replica="a"} 2\n'
        'vllm_spec_decode_num_drafts_total{replica="b"} 3\n'
        "vllm_spec_decode_num_draft_tokens 20\n"
        "vllm_spec_decode_num_accepted_tokens_total 9\n"
        "molora_tier_hits_total 4\n"
    )
    assert parse_counters(text) == {"drafts": 5.0, "draft_tokens": 20.0, "accepted_tokens": 9.0}


def test_no_counters_on_the_server_means_acceptance_null() -> None:
    assert parse_counters("molora_tier_hits_total 4\n") == {}
    for after in (None, {}, {"generation_tokens": 5.0}, {"drafts": 1.0}):
        acc = acceptance({}, after)
        assert acc == {"available": False, "acceptance_rate": None, "mean_accepted_length": None}


def test_acceptance_is_the_delta_around_the_cell() -> None:
    before = {"drafts": 6.0, "draft_tokens": 24.0, "accepted_tokens": 17.0,
              "accepted_per_pos": {0: 6.0, 1: 5.0}}  # fmt: skip
    after = {"drafts": 16.0, "draft_tokens": 64.0, "accepted_tokens": 47.0,
             "accepted_per_pos": {0: 16.0, 1: 12.0, 2: 9.0}}  # fmt: skip
    acc = acceptance(before, after)
    assert (acc["drafts"], acc["draft_tokens"], acc["accepted_tokens"]) == (10, 40, 30)
    assert acc["acceptance_rate"] == 0.75  # 30 / 40
    assert acc["mean_accepted_length"] == 4.0  # 1 + 30 / 10
    assert acc["accepted_per_pos"] == {0: 10, 1: 7, 2: 9}


def test_a_cell_without_drafts_has_no_rate() -> None:
    same = {"drafts": 3.0, "draft_tokens": 12.0, "accepted_tokens": 5.0}
    acc = acceptance(same, dict(same))
    assert acc["available"] and acc["drafts"] == 0
    assert acc["acceptance_rate"] is None and acc["mean_accepted_length"] is None


def test_pooled_acceptance_sums_counts_before_dividing() -> None:
    a = {"available": True, "drafts": 10, "draft_tokens": 40, "accepted_tokens": 40}
    b = {"available": True, "drafts": 30, "draft_tokens": 120, "accepted_tokens": 0}
    pooled = pooled_acceptance([a, b, {"available": False}])
    assert pooled["acceptance_rate"] == 0.25  # 40 / 160, not the mean of 1.0 and 0.0
    assert pooled["mean_accepted_length"] == 2.0  # 1 + 40 / 40
    assert pooled_acceptance([{"available": False}])["acceptance_rate"] is None


def test_speedup_is_a_ratio_and_rounds_combine_geometrically() -> None:
    assert ratio(30.0, 15.0) == 2.0
    assert ratio(None, 15.0) is None and ratio(3.0, 0.0) is None
    assert geomean([2.0, 0.5]) == 1.0  # drift for, then against: no speed-up
    assert geomean([None, 1.5]) == 1.5 and geomean([]) is None


def _row(spec: bool, rnd: int, tok: float, dec: float, acc: dict | None = None) -> dict:
    return {"dtype": "float32", "server": "molora", "workload": "grounded", "route": "base",
            "concurrency": 1, "spec": spec, "round": rnd, "tok_per_s": tok,
            "decode_tok_per_s": dec, "ttft_p50_ms": 100.0, "itl_p50_ms": 40.0,
            "itl_p99_ms": 90.0, "tpot_p50_ms": 30.0, "tokens_per_chunk": 1.0,
            "tokens_per_request": 100.0,
            "acceptance": acc or acceptance(None, None)}  # fmt: skip


def test_summary_pairs_rounds_and_pools_acceptance() -> None:
    acc0 = {"available": True, "drafts": 10, "draft_tokens": 40, "accepted_tokens": 20}
    acc1 = {"available": True, "drafts": 10, "draft_tokens": 40, "accepted_tokens": 20}
    rows = [
        _row(False, 0, 20.0, 25.0),
        _row(True, 0, 40.0, 50.0, acc0),  # round 0: 2.0x
        _row(True, 1, 36.0, 45.0, acc1),  # round 1 ran spec first, box slower: 1.8x
        _row(False, 1, 20.0, 25.0),
    ]
    (entry,) = summarize(rows)
    assert entry["speedup_tok_per_s"] == pytest.approx((2.0 * 1.8) ** 0.5, abs=1e-3)
    assert entry["speedup_decode_tok_per_s"] == pytest.approx((2.0 * 1.8) ** 0.5, abs=1e-3)
    assert entry["no_spec"]["tok_per_s"] == 20.0 and entry["spec"]["tok_per_s"] == 38.0
    assert entry["acceptance"]["acceptance_rate"] == 0.5
    assert entry["acceptance"]["mean_accepted_length"] == 3.0


def test_summary_of_a_side_that_never_started() -> None:
    (entry,) = summarize([_row(False, 0, 20.0, 25.0)])
    assert entry["spec"] is None and entry["speedup_tok_per_s"] is None
    assert entry["acceptance"]["acceptance_rate"] is None


# ---- greedy equality ------------------------------------------------------------------------


def test_first_difference() -> None:
    assert first_difference("abc", "abc") == -1
    assert first_difference("abcd", "abXd") == 2
    assert first_difference("abc", "abcdef") == 3  # one is a prefix of the other


def test_greedy_check_counts_mismatches_and_keeps_where_they_part() -> None:
    off1 = [("p0", "same text"), ("p1", "The answer is 42."), ("p2", None)]
    on1 = [("p0", "same text"), ("p1", "The answer is 43."), ("p2", "x")]
    off4 = [("p0", "same text"), ("p1", "The answer is 41.")]
    on4 = [("p0", "same text"), ("p1", "The answer is 41.")]
    texts = {
        ("molora", False, 0, "grounded", "base", 1): off1,
        ("molora", True, 0, "grounded", "base", 1): on1,
        ("molora", False, 0, "grounded", "base", 4): off4,
        ("molora", True, 0, "grounded", "base", 4): on4,
        ("vllm", False, 0, "grounded", "base", 1): off1[:2],  # its spec side never started
    }
    check = greedy_check(texts)
    mine = check["molora"]
    assert (mine["compared"], mine["identical"], mine["mismatches"]) == (4, 3, 1)
    assert mine["skipped_errors"] == 1
    (diff,) = mine["diffs"]
    assert diff["prompt"] == "p1" and diff["at_char"] == 15 and diff["concurrency"] == 1
    assert diff["no_spec"].endswith("42.") and diff["spec"].endswith("43.")
    # the noise floor: c=4 no-spec against c=1 no-spec, p1 differs (41 vs 42)
    assert mine["no_spec_across_c"] == {"compared": 2, "mismatches": 1}
    assert check["vllm"]["compared"] == 0


def test_greedy_check_keeps_only_the_first_few_diffs() -> None:
    off = [(f"p{i}", f"text {i}") for i in range(9)]
    on = [(f"p{i}", f"other {i}") for i in range(9)]
    texts = {("molora", False, 0, "chat", "mix", 1): off, ("molora", True, 0, "chat", "mix", 1): on}
    mine = greedy_check(texts)["molora"]
    assert mine["mismatches"] == 9 and len(mine["diffs"]) == 5


# ---- the table ------------------------------------------------------------------------------


def test_table_shows_both_sides_speedup_acceptance_and_equality() -> None:
    acc = {"available": True, "drafts": 10, "draft_tokens": 40, "accepted_tokens": 30}
    summary = summarize([_row(False, 0, 20.0, 25.0), _row(True, 0, 40.0, 55.0, acc)])
    equality = {"float32": greedy_check({
        ("molora", False, 0, "grounded", "base", 1): [("p0", "a")],
        ("molora", True, 0, "grounded", "base", 1): [("p0", "a")],
    })}  # fmt: skip
    lines = render_table(summary, equality)
    header, rule, row = lines[:3]
    assert header.count("|") == rule.count("|") == row.count("|")
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:5] == ["float32", "molora", "grounded", "base", "1"]
    assert cells[5] == "100.0"  # tokens per request
    assert cells[6] == "20.0 → 40.0" and cells[7] == "2.00"
    assert cells[8] == "25.0 → 55.0" and cells[9] == "2.20"
    assert cells[12:] == ["0.75", "4.00"]
    assert "identical with and without speculation: 1 of 1" in lines[-1]


def test_table_marks_missing_numbers_with_a_dash() -> None:
    lines = render_table(summarize([_row(False, 0, 20.0, 25.0)]), {})
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[6] == "20.0 → -" and cells[7] == "-" and cells[12:] == ["-", "-"]
