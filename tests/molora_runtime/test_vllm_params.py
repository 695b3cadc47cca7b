"""vLLM's request parameters in the engine: min_p (batched filter and its twin),
include_stop_str_in_output, stop_reason, chat_template_kwargs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from molora_runtime.engine.sampling.sampler import min_p_filter, min_p_filter_reference
from molora_runtime.engine.types import GenerationRequest, SamplingParams
from tests.molora_runtime.rt_util import build_engine, random_prompts, request, run_to_completion


def test_min_p_filter_matches_its_reference_twin() -> None:
    gen = torch.Generator().manual_seed(3)
    scaled = torch.randn(6, 512, generator=gen) * 3
    min_p = [0.0, 0.01, 0.1, 0.5, 0.9, 1.0]
    got = min_p_filter(scaled, torch.tensor(min_p))
    want = min_p_filter_reference(scaled, min_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[0], scaled[0])  # min_p 0 keeps every token
    assert int(torch.isfinite(got[5]).sum()) == 1  # min_p 1 keeps only the top token
    kept = torch.isfinite(got).sum(dim=-1).tolist()
    assert kept == sorted(kept, reverse=True)  # a higher min_p never keeps more


def test_min_p_one_is_greedy_and_batched_rows_match_alone(tiny_engine_factory) -> None:
    prompts = random_prompts(3, 256, [6, 11], seed=5)
    greedy = run_to_completion(
        tiny_engine_factory(), [request(f"r{i}", p, "a", 10) for i, p in enumerate(prompts)]
    )
    hot = SamplingParams(max_tokens=10, temperature=1.5, min_p=1.0, seed=1)
    top = run_to_completion(
        tiny_engine_factory(),
        [request(f"r{i}", p, "a", sampling=hot) for i, p in enumerate(prompts)],
    )
    for i in range(3):
        assert top[f"r{i}"]["tokens"] == greedy[f"r{i}"]["tokens"]
    # a seeded min_p row gives the same tokens alone and beside other sampled rows
    mid = SamplingParams(max_tokens=10, temperature=1.5, min_p=0.05, seed=9)
    alone = run_to_completion(tiny_engine_factory(), [request("s", prompts[0], "a", sampling=mid)])
    crowd = run_to_completion(
        tiny_engine_factory(),
        [
            request("o", prompts[1], "b", sampling=SamplingParams(max_tokens=10, temperature=1.0)),
            request("s", prompts[0], "a", sampling=mid),
        ],
    )
    assert crowd["s"]["tokens"] == alone["s"]["tokens"]


def test_stop_token_reason_and_its_text(tiny_engine_factory) -> None:
    full = run_to_completion(tiny_engine_factory(), [request("x", [7, 8, 9], "a", 16)])["x"]
    assert full["finish_reason"] == "length" and full["outputs"][-1].stop_reason is None
    stop_id = full["tokens"][4]
    sp = SamplingParams(max_tokens=16, stop_token_ids=[stop_id])
    got = run_to_completion(tiny_engine_factory(), [request("x", [7, 8, 9], "a", sampling=sp)])
    assert got["x"]["finish_reason"] == "stop"
    assert got["x"]["outputs"][-1].stop_reason == stop_id


@pytest.fixture(scope="module")
def chat_engine(tiny_chat_model: Path):
    return build_engine(tiny_chat_model, {}, {})


def test_stop_string_reason_and_include_stop_str_in_output(chat_engine) -> None:
    prompt = "The quick brown fox"
    text = run_to_completion(chat_engine, [request("x", None, None, 24, prompt=prompt)])["x"][
        "text"
    ]
    stop = text[8:11]
    assert stop.strip(), text
    cut = text.find(stop)
    for include, want in ((False, text[:cut]), (True, text[: cut + len(stop)])):
        sp = SamplingParams(
            max_tokens=24, stop=["\x00never", stop], include_stop_str_in_output=include
        )
        got = run_to_completion(chat_engine, [request("y", None, None, sampling=sp, prompt=prompt)])
        y = got["y"]
        assert y["finish_reason"] == "stop" and y["outputs"][-1].stop_reason == stop
        assert y["text"] == want
        assert "".join(o.text_delta for o in y["outputs"]) == want


def test_chat_template_kwargs_reach_the_template(chat_engine) -> None:
    tok = chat_engine.tokenizer
    saved = tok.chat_template
    tok.chat_template = (
        "{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    )
    try:
        messages = [{"role": "user", "content": "hello"}]
        plain = chat_engine.checker.encode_prompt(
            GenerationRequest(request_id="a", messages=messages)
        )
        loud = chat_engine.checker.encode_prompt(
            GenerationRequest(
                request_id="b", messages=messages, chat_template_kwargs={"shout": True}
            )
        )
        assert loud == tok.encode("LOUD hello\n", add_special_tokens=False)
        assert plain == tok.encode("hello\n", add_special_tokens=False)
    finally:
        tok.chat_template = saved


@pytest.mark.parametrize(
    "kwargs", [{"add_generation_prompt": False}, {"messages": "x"}, {"__init__": 1}, {"a": [1]}]
)
def test_chat_template_kwargs_are_bounded(kwargs) -> None:
    with pytest.raises(ValueError):
        GenerationRequest(request_id="a", messages=[], chat_template_kwargs=kwargs)
