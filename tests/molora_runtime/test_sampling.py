"""Sampling: seeds, top_k=1, stop strings (never leaked into streamed deltas), stop_token_ids,
max_tokens, and chat messages through the template."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from molora_runtime.engine.sampling.sampler import scan_rows
from molora_runtime.engine.types import SamplingParams
from tests.molora_runtime.rt_util import build_engine, random_prompts, request, run_to_completion


def _sampled(seed: int | None, max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.3, top_p=0.95, seed=seed, **kw)


def test_same_seed_same_tokens_regardless_of_company(tiny_engine_factory) -> None:
    prompt = random_prompts(1, 256, [9], seed=1)[0]
    alone = run_to_completion(
        tiny_engine_factory(), [request("s", prompt, "a", sampling=_sampled(1234))]
    )["s"]["tokens"]
    others = [
        request(f"o{i}", p, r, sampling=_sampled(None if i % 2 else i))
        for i, (p, r) in enumerate(
            zip(random_prompts(5, 256, [4, 13, 7], seed=2), ["b", None, "c", "a", "b"], strict=True)
        )
    ]
    crowd = tiny_engine_factory()
    got = run_to_completion(
        crowd, [*others[:2], request("s", prompt, "a", sampling=_sampled(1234)), *others[2:]]
    )
    assert got["s"]["tokens"] == alone
    different = run_to_completion(
        tiny_engine_factory(), [request("s", prompt, "a", sampling=_sampled(99))]
    )["s"]["tokens"]
    assert different != alone  # the seed matters (12 tokens at temperature 1.3)


def test_top_k_one_equals_greedy(tiny_engine_factory) -> None:
    prompts = random_prompts(3, 256, [5, 12], seed=4)
    greedy = run_to_completion(
        tiny_engine_factory(), [request(f"g{i}", p, "b", 10) for i, p in enumerate(prompts)]
    )
    topk = run_to_completion(
        tiny_engine_factory(),
        [
            request(
                f"g{i}", p, "b", sampling=SamplingParams(max_tokens=10, temperature=2.0, top_k=1)
            )
            for i, p in enumerate(prompts)
        ],
    )
    for i in range(3):
        assert topk[f"g{i}"]["tokens"] == greedy[f"g{i}"]["tokens"]


def test_max_tokens_finishes_with_length(tiny_engine_factory) -> None:
    got = run_to_completion(tiny_engine_factory(), [request("x", [1, 2, 3], "c", 5)])
    assert len(got["x"]["tokens"]) == 5 and got["x"]["finish_reason"] == "length"
    assert got["x"]["outputs"][-1].completion_tokens == 5


def test_stop_token_ids(tiny_engine_factory) -> None:
    full = run_to_completion(tiny_engine_factory(), [request("x", [7, 8, 9], "a", 16)])["x"]
    tokens = full["tokens"]
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    sp = SamplingParams(max_tokens=16, stop_token_ids=[stop_id])
    got = run_to_completion(tiny_engine_factory(), [request("x", [7, 8, 9], "a", sampling=sp)])["x"]
    assert got["tokens"] == tokens[: first + 1]
    assert got["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def chat_engine_factory(tiny_chat_model: Path):
    def factory(**kw):
        return build_engine(tiny_chat_model, {}, {}, **kw)

    return factory


def test_stop_strings_cut_text_and_never_leak(chat_engine_factory) -> None:
    engine = chat_engine_factory()
    prompt = "The quick brown fox"
    full = run_to_completion(engine, [request("x", None, None, 24, prompt=prompt)])["x"]
    text = full["text"]
    assert len(text) > 12, text
    checked = 0
    for start, length in [(6, 3), (len(text) // 2, 4), (len(text) - 5, 2)]:
        stop = text[start : start + length]
        if not stop.strip():
            continue
        cut = text.find(stop)
        sp = SamplingParams(max_tokens=24, stop=[stop, "\x00never"])
        got = run_to_completion(engine, [request("y", None, None, sampling=sp, prompt=prompt)])["y"]
        assert got["finish_reason"] == "stop"
        assert got["text"] == text[:cut]
        deltas = [o.text_delta for o in got["outputs"]]
        assert "".join(deltas) == text[:cut]
        assert all(stop not in d for d in deltas)
        assert got["tokens"] == full["tokens"][: len(got["tokens"])]
        checked += 1
    assert checked >= 2


def test_streamed_text_equals_full_decode(chat_engine_factory) -> None:
    engine = chat_engine_factory()
    got = run_to_completion(engine, [request("x", None, None, 20, prompt="Hello there")])["x"]
    assert got["text"] == engine.tokenizer.decode(got["tokens"], skip_special_tokens=True)
    assert len(got["outputs"]) > 2  # it really streamed


def test_chat_messages_through_the_template(chat_engine_factory) -> None:
    engine = chat_engine_factory()
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    rendered = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert "Name a colour." in rendered and rendered.rstrip().endswith("assistant")
    ids = engine.tokenizer.encode(rendered, add_special_tokens=False)
    via_messages = run_to_completion(engine, [request("m", None, None, 6, messages=messages)])["m"]
    via_ids = run_to_completion(engine, [request("i", ids, None, 6)])["i"]
    assert via_messages["outputs"][-1].prompt_tokens == len(ids)
    assert via_messages["tokens"] == via_ids["tokens"]


@pytest.mark.parametrize("vocab", [512, 49152, 100])
def test_row_scan_matches_argmax_and_the_finite_screen(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=gen)
    logits[1, 3] = logits[1, vocab - 1] = 50.0  # a tie: the first index wins, as argmax
    logits[2, 0] = float("nan")
    logits[3, vocab // 2] = float("inf")
    logits[4] = float("-inf")
    logits[5, 7] = float("-inf")  # a masked token alone leaves the row samplable
    logits[6] = 0.0  # all equal: token 0
    scan = scan_rows(logits)
    assert scan.finite == [True, True, False, False, False, True, True, True, True]
    ok = [i for i, f in enumerate(scan.finite) if f]
    assert [scan.greedy[i] for i in ok] == logits[ok].argmax(-1).tolist()
    assert scan.greedy[1] == 3 and scan.greedy[6] == 0
    assert scan_rows(logits[:0]) == ([], [])
    assert scan_rows(logits[:, : vocab - 1]).greedy[0] == int(logits[0, : vocab - 1].argmax())
