"""The incremental detokenizer equals a full decode at every step, and stops never leak."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from molora_runtime.engine.outputs.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! ünïcödé 日本語 🙂🙂 tabs\tand\nnewlines  double  spaces",
    "def f(x):\n    return x**2  # 😀",
    " leading space, emoji sequences 👩‍👩‍👧 and accents é",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


def settled(text: str) -> str:
    return text.rstrip("\ufffd")


def check_prefixes(tokenizer, ids: list[int]) -> None:
    detok = IncrementalDetokenizer(tokenizer, [])
    for i in range(1, len(ids) + 1):
        text, hit = detok.update(ids[:i])
        full = tokenizer.decode(ids[:i], skip_special_tokens=True)
        assert not hit
        assert settled(text) == settled(full)[: len(settled(text))]
    assert settled(text) == settled(tokenizer.decode(ids, skip_special_tokens=True))


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode_on_text(tokenizer, text: str) -> None:
    check_prefixes(tokenizer, tokenizer.encode(text, add_special_tokens=False))


@settings(max_examples=25, deadline=None)
@given(seed_ids=st.lists(st.integers(0, 49151), min_size=1, max_size=80))
def test_incremental_equals_full_decode_on_random_ids(tokenizer, seed_ids: list[int]) -> None:
    check_prefixes(tokenizer, seed_ids)


def test_stop_string_across_tokens_is_cut(tokenizer) -> None:
    ids = tokenizer.encode("The answer is 42. END of story", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, ["END"])
    for i in range(1, len(ids) + 1):
        text, hit = detok.update(ids[:i])
        assert "END" not in text
        if hit:
            assert text == "The answer is 42. "
            break
    else:
        pytest.fail("the stop string was never found")
