"""Sampling parameters beyond temperature/top-k/top-p: penalties, logit_bias, min_tokens and
logprobs — the processing math directly, and through the engine on the tiny model."""

from __future__ import annotations

import pytest
import torch

from molora_runtime.engine.sampling.logits_processing import RowInput, process_row, sample_rows
from molora_runtime.engine.types import SamplingParams
from tests.molora_runtime.rt_util import (
    engine_prefill_logits,
    random_prompts,
    request,
    run_to_completion,
)


def test_penalty_math_matches_the_definitions() -> None:
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    p = SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=2.0,
        logit_bias={4: 10.0},
    )
    got = process_row(row, RowInput(p, None, prompt_ids=[0], output_ids=[1, 1, 3]))
    # bias first, then repetition over prompt+output (0, 1, 3), then freq/presence over output.
    want = torch.tensor([2.0 / 2, -1.0 * 2 - 2 * 0.25 - 0.5, 0.5, 3.0 / 2 - 0.25 - 0.5, 8.0])
    assert torch.allclose(got, want)
    assert torch.equal(row, torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0]))  # input untouched


def test_banned_and_grammar_masks_and_logprobs_of_processed_row() -> None:
    row = torch.tensor([5.0, 4.0, 1.0, 0.0])
    allowed = torch.tensor([True, True, True, False])
    p = SamplingParams(logprobs=2)
    tokens, lps = sample_rows(row[None], [RowInput(p, None, banned=[0], allowed=allowed)], [0])
    assert tokens == [1]  # 0 banned, greedy over the rest
    want = torch.log_softmax(torch.tensor([float("-inf"), 4.0, 1.0, float("-inf")]), -1)
    lp = lps[0]
    assert lp is not None and lp.token_id == 1
    assert lp.logprob == pytest.approx(float(want[1]))
    assert [t for t, _ in lp.top] == [1, 2]
    assert lp.top[1][1] == pytest.approx(float(want[2]))


def test_temperature_scales_reported_logprobs() -> None:
    row = torch.tensor([1.0, 2.0, 3.0])
    p = SamplingParams(temperature=0.5, seed=1, logprobs=0)
    gen = torch.Generator().manual_seed(1)
    tokens, lps = sample_rows(row[None], [RowInput(p, gen)], [2])
    want = torch.log_softmax(row / 0.5, -1)
    assert lps[0] is not None and lps[0].logprob == pytest.approx(float(want[tokens[0]]))
    assert lps[0].top == []


def test_logprobs_are_the_log_softmax_of_the_model_logits(tiny_engine_factory) -> None:
    prompt = random_prompts(1, 256, [7], seed=3)[0]
    engine = tiny_engine_factory()
    sampling = SamplingParams(max_tokens=4, logprobs=5)
    got = run_to_completion(engine, [request("x", prompt, "a", sampling=sampling)])["x"]
    lps = [lp for out in got["outputs"] for lp in out.logprobs or []]
    assert len(lps) == 4
    for t, lp in enumerate(lps):
        logits = engine_prefill_logits(engine, "a", prompt + got["tokens"][:t])[-1]
        ref = torch.log_softmax(logits.float(), -1)
        assert lp.token_id == got["tokens"][t] == int(ref.argmax())
        assert lp.logprob == pytest.approx(float(ref[lp.token_id]), abs=1e-4)
        values, ids = torch.topk(ref, 5)
        assert [i for i, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_penalties_and_bias_change_engine_outputs(tiny_engine_factory) -> None:
    prompt = random_prompts(1, 256, [6], seed=5)[0]

    def run(**kw) -> list[int]:
        sp = SamplingParams(max_tokens=12, **kw)
        return run_to_completion(tiny_engine_factory(), [request("x", prompt, sampling=sp)])["x"][
            "tokens"
        ]

    greedy = run()
    assert run(logit_bias={17: 100.0}) == [17] * 12  # a +100 bias dominates every step
    assert run(logit_bias={17: 5.0}) == [17] * 12
    # frequency: each use of 17 costs 2, so after 3 uses its +5 bias no longer wins.
    assert run(logit_bias={17: 5.0}, frequency_penalty=2.0).count(17) <= 3
    # presence: a one-off cost; past it, 17 wins again. Negative presence keeps it winning.
    assert run(logit_bias={17: 5.0}, presence_penalty=-2.0) == [17] * 12
    assert run(logit_bias={17: 1.0}) == [17] * 12
    assert run(logit_bias={17: 1.0}, presence_penalty=2.0).count(17) == 1
    # repetition: 1.0 is neutral; 10 divides the seen token's positive logit by 10.
    assert run(repetition_penalty=1.0) == greedy
    assert run(logit_bias={17: 1.0}, repetition_penalty=10.0).count(17) < 12


def test_min_tokens_masks_stop_ids(tiny_engine_factory) -> None:
    prompt = random_prompts(1, 256, [6], seed=6)[0]
    engine = tiny_engine_factory()
    first = run_to_completion(engine, [request("x", prompt, max_tokens=1)])["x"]["tokens"][0]
    sp = SamplingParams(max_tokens=6, stop_token_ids=[first])
    stopped = run_to_completion(tiny_engine_factory(), [request("x", prompt, sampling=sp)])["x"]
    assert stopped["tokens"] == [first] and stopped["finish_reason"] == "stop"
    sp = SamplingParams(max_tokens=6, stop_token_ids=[first], min_tokens=3)
    held = run_to_completion(tiny_engine_factory(), [request("x", prompt, sampling=sp)])["x"]
    assert first not in held["tokens"][:3] and len(held["tokens"]) >= 3


def test_logit_bias_outside_vocab_is_refused(tiny_engine_factory) -> None:
    from molora_runtime.errors import InvalidRequestError

    sp = SamplingParams(logit_bias={10_000: 1.0})
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        tiny_engine_factory().add_request(request("x", [1, 2], sampling=sp))


def test_n_choices_share_one_prefill_and_match_running_alone(tiny_engine_factory) -> None:
    prompt = random_prompts(1, 256, [9], seed=8)[0]
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=41)
    alone = {
        i: run_to_completion(
            tiny_engine_factory(),
            [request("x", prompt, "b", sampling=sp.model_copy(update={"seed": 41 + i}))],
        )["x"]["tokens"]
        for i in range(3)
    }
    engine = tiny_engine_factory()
    reqs = [
        request(
            f"r.{i}",
            prompt,
            "b",
            sampling=sp.model_copy(update={"seed": 41 + i}),
            prefill_from="r.0" if i else None,
        )
        for i in range(3)
    ]
    got = run_to_completion(engine, reqs[::-1])  # siblings queued first: the leader goes first
    assert engine.forked_prefills == 2
    for i in range(3):
        assert got[f"r.{i}"]["tokens"] == alone[i]
    assert len({tuple(t) for t in alone.values()}) > 1  # the seeds matter


def test_prompt_logprobs_over_chunked_prefill(tiny_engine_factory) -> None:
    prompt = random_prompts(1, 256, [40], seed=12)[0]
    engine = tiny_engine_factory(max_num_batched_tokens=16)  # the prompt spans three chunks
    sp = SamplingParams(max_tokens=2, prompt_logprobs=2)
    got = run_to_completion(engine, [request("p", prompt, "c", sampling=sp)])["p"]
    plps = next(o.prompt_logprobs for o in got["outputs"] if o.prompt_logprobs)
    assert len(plps) == len(prompt) and plps[0] is None
    ref = torch.log_softmax(engine_prefill_logits(engine, "c", prompt).float(), -1)
    for pos in range(1, len(prompt)):
        lp = plps[pos]
        assert lp is not None and lp.token_id == prompt[pos]
        assert lp.logprob == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4)
        assert [t for t, _ in lp.top] == torch.topk(ref[pos - 1], 2).indices.tolist()
    assert sum(1 for o in got["outputs"] if o.prompt_logprobs) == 1  # sent once
