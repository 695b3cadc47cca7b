"""Task data: deterministic, disjoint train/eval, mixed prompts span two domains, strict scoring."""

from __future__ import annotations

from molora_runtime.training.data import (
    DOMAINS,
    Example,
    Task,
    domain_examples,
    mixed_examples,
    score_completion,
)


def test_examples_are_deterministic_and_splits_disjoint() -> None:
    for domain in DOMAINS:
        a = domain_examples(domain, 20, seed=0, split="train")
        b = domain_examples(domain, 20, seed=0, split="train")
        assert [e.target() for e in a] == [e.target() for e in b]
        train_q = {t.question for e in domain_examples(domain, 60, 0, "train") for t in e.tasks}
        eval_q = {t.question for e in domain_examples(domain, 30, 0, "eval") for t in e.tasks}
        # procedural generators can repeat tiny tasks by chance, but not wholesale
        assert len(train_q & eval_q) <= len(eval_q) // 4


def test_mixed_examples_pair_two_domains() -> None:
    examples = mixed_examples(list(DOMAINS), 24, seed=0, split="eval")
    assert all(len(e.tasks) == 2 and e.domains[0] != e.domains[1] for e in examples)
    assert {tuple(e.domains) for e in examples} == {
        (a, b) for a in DOMAINS for b in DOMAINS if a != b
    }


def test_scoring_is_exact_match_per_sub_answer() -> None:
    ex = Example(
        tasks=[Task("arithmetic", "Calculate 2 + 3.", "5"), Task("reversal", "Spell: cat", "tac")],
        kind="mixed",
    )
    assert ex.target() == "1. 5\n2. tac"
    assert score_completion(ex, "1. 5\n2. tac") == [1.0, 1.0]
    assert score_completion(ex, "1. 5\n2. tca") == [1.0, 0.0]
    assert score_completion(ex, "The answer is 5") == [0.0, 0.0]
    assert score_completion(ex, "2. tac") == [0.0, 1.0]
