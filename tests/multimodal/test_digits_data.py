"""Digits data: disjoint splits, the loss split between adapters by the input token's modality."""

from __future__ import annotations

from pathlib import Path

import pytest

from molora_runtime.multimodal import digits, tokens
from molora_runtime.multimodal.classifier import DigitJudge
from molora_runtime.multimodal.scoring import Parsed, score_tasks

MODEL = Path("~/.cache/molora/models/smollm2-135m-instruct").expanduser()


def test_splits_are_disjoint_and_cover_the_dataset() -> None:
    train, ev = digits.split("train"), digits.split("eval")
    assert len(train) + len(ev) == 1797
    as_key = {tuple(p) for p, _ in train}
    assert sum(tuple(p) in as_key for p, _ in ev) <= 2  # load_digits has a few exact duplicates
    assert {y for _, y in ev} == set(range(10))


def test_tasks_are_deterministic() -> None:
    a, b = digits.tasks("mixed", 30, "train", 0), digits.tasks("mixed", 30, "train", 0)
    assert a == b
    t = a[0]
    assert t.answer_text() == f"I drew a {t.digit}. {t.digit} + {t.addend} = {t.digit + t.addend}."


@pytest.fixture(scope="module")
def tokenizer():
    if not (MODEL / "tokenizer.json").exists():
        pytest.skip("SmolLM2 not prepared")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


def _split_labels(ids, labels):
    """Learned labels at image positions and at text positions."""
    image_ids = range(*tokens.IMAGE_RANGE)
    learned = [(t, y) for t, y in zip(ids, labels, strict=True) if y != -100]
    return [y for t, y in learned if t in image_ids], [y for t, y in learned if t not in image_ids]


def test_each_adapter_learns_only_its_modality(tokenizer) -> None:
    mixed = digits.tasks("mixed", 1, "train", 0)[0]
    ids, read_labels = digits.encode_task(tokenizer, mixed, "read")
    image, text = _split_labels(ids, read_labels)
    assert image == []  # read never predicts at an image position
    assert text[0] == tokens.BOI  # the text side opens the image
    assert tokenizer.decode(text[1:]).strip().startswith("I drew a")
    ids, draw_labels = digits.encode_task(tokenizer, mixed, "draw")
    image, text = _split_labels(ids, draw_labels)
    assert text == [tokens.BOI]  # draw opens its image (so it can draw alone), no text after
    assert image == tokens.image_to_ids(mixed.pixels)[1:]  # the 16 codes and EOI


def test_read_prompts_carry_the_image(tokenizer) -> None:
    task = digits.tasks("read", 1, "eval", 0)[0]
    ids = digits.prompt_ids(tokenizer, task)
    start = ids.index(tokens.BOI)
    image = ids[start : start + tokens.IMAGE_LEN]
    assert tokens.ids_to_image(image) == tokens.quantize(task.pixels)
    assert "<image>" not in tokenizer.decode(ids)


def test_judge_reads_real_eval_digits_and_scoring_is_strict() -> None:
    judge = DigitJudge()
    ev = digits.split("eval")
    assert judge.accuracy([p for p, _ in ev], [y for _, y in ev]) > 0.9
    # the ceiling of `draw`: the judge on eval digits as the codebook renders them
    assert judge.accuracy([tokens.quantize(p) for p, _ in ev], [y for _, y in ev]) > 0.85
    pixels, label = ev[0]
    task = digits.DigitTask(kind="mixed", digit=label, pixels=pixels, addend=2)
    good = Parsed(text=task.answer_text(), image=pixels)
    assert score_tasks(judge, [task], [good])[0] == {"image": 1.0, "text": 1.0, "both": 1.0}
    no_image = Parsed(text=task.answer_text(), image=None)
    assert score_tasks(judge, [task], [no_image])[0]["both"] == 0.0


def test_mixture_override_sets_the_task_shares(tokenizer) -> None:
    """`--mixture read=0.9,mixed=0.1`: 9 of 10 examples are pure reads (2 labels: digit, end)."""
    examples = digits.training_examples(tokenizer, "read", 20, 0, {"read": 0.9, "mixed": 0.1})
    short = [e for e in examples if sum(y != -100 for y in e[1]) == 2]
    assert len(examples) == 20 and len(short) == 18


def test_code_dropout_corrupts_input_codes_only(tokenizer) -> None:
    """`--code-dropout`: some input image codes become random codes; labels and BOI stay."""
    clean = digits.training_examples(tokenizer, "draw", 20, 0, {"draw": 0.5, "mixed": 0.5})
    noisy = digits.training_examples(tokenizer, "draw", 20, 0, {"draw": 0.5, "mixed": 0.5}, 0.5)
    codes = range(tokens.CODE0, tokens.EOI)
    changed = 0
    for (ids, labels), (nids, nlabels) in zip(clean, noisy, strict=True):
        assert nlabels == labels and len(nids) == len(ids)
        diff = [t for t, (a, b) in enumerate(zip(ids, nids, strict=True)) if a != b]
        assert all(ids[t] in codes and nids[t] in codes for t in diff)
        changed += len(diff)
        assert nids.count(tokens.BOI) == ids.count(tokens.BOI)
    total = sum(sum(t in codes for t in ids) for ids, _ in clean)
    assert 0.3 * total < changed < 0.6 * total  # ~half, minus random codes equal to the true one
    assert noisy == digits.training_examples(
        tokenizer, "draw", 20, 0, {"draw": 0.5, "mixed": 0.5}, 0.5
    )
