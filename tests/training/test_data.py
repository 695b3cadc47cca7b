"""Task data: deterministic, disjoint train/eval, mixed prompts span two domains, strict scoring."""

from __future__ import annotations

from molora_runtime.training.data import (
    DOMAINS,
    Example,
    Task,
    _compact_answer,
    _compact_question,
    domain_examples,
    mixed_examples,
    score_completion,
)

# 1-digit products: 100 questions in all, so train and eval draws cannot be disjoint.
SMALL_SPACE = {"multiplication"}


def test_examples_are_deterministic_and_splits_disjoint() -> None:
    for domain in DOMAINS:
        a = domain_examples(domain, 20, seed=0, split="train")
        b = domain_examples(domain, 20, seed=0, split="train")
        assert [e.target() for e in a] == [e.target() for e in b]
        train_q = {t.question for e in domain_examples(domain, 60, 0, "train") for t in e.tasks}
        eval_q = {t.question for e in domain_examples(domain, 30, 0, "eval") for t in e.tasks}
        if domain in SMALL_SPACE:  # every question is likely drawn in both splits
            assert len(eval_q) >= 20, "the eval split still varies its questions"
            continue
        # procedural generators can repeat tiny tasks by chance, but not wholesale
        assert len(train_q & eval_q) <= len(eval_q) // 4


def test_alphabetical_questions_are_compact_and_answers_sorted_lowercase() -> None:
    tasks = [t for e in domain_examples("alphabetical", 40, 0, "eval") for t in e.tasks]
    directions = set()
    for t in tasks:
        head, _, listed = t.question.partition(": ")
        prefix, _, direction = head.partition(", ")
        assert prefix == "Sort these words alphabetically"
        assert direction in {"ascending", "descending"}
        words = listed.split(", ")
        assert len(words) == 3 and all(w == w.lower() for w in words)
        answer = t.answer.split(", ")
        assert sorted(answer) == sorted(words), "the answer reorders the question's words"
        assert answer == sorted(words, reverse=direction == "descending")
        directions.add(direction)
    assert directions == {"ascending", "descending"}


def test_alphabetical_ignores_the_generators_ascii_order_of_capitals() -> None:
    # reasoning-gym sorts by ASCII ("Only" before "ambassador"); the question shows lowercase
    entry = {
        "question": "...",
        "answer": "Only, ambassador, federal",
        "metadata": {"original_words": ["federal", "Only", "ambassador"], "direction": "ascending"},
    }
    assert _compact_question("alphabetical", entry).endswith(": federal, only, ambassador")
    assert _compact_answer("alphabetical", entry) == "ambassador, federal, only"
    entry["metadata"]["direction"] = "descending"
    assert _compact_answer("alphabetical", entry) == "only, federal, ambassador"


def test_mixed_examples_pair_two_domains() -> None:
    pairs = len(DOMAINS) * (len(DOMAINS) - 1)
    examples = mixed_examples(list(DOMAINS), pairs, seed=0, split="eval")
    assert all(len(e.tasks) == 2 and e.domains[0] != e.domains[1] for e in examples)
    assert {tuple(e.domains) for e in examples} == {
        (a, b) for a in DOMAINS for b in DOMAINS if a != b
    }


def test_scoring_is_exact_match_per_sub_answer() -> None:
    ex = Example(
        tasks=[
            Task("arithmetic", "Calculate 2 + 3.", "5"),
            Task("reversal", "Reverse: a, b", "b, a"),
        ],
        kind="mixed",
    )
    assert ex.target() == "1. 5\n2. b, a"
    assert score_completion(ex, "1. 5\n2.  b,  a ") == [1.0, 1.0]
    assert score_completion(ex, "1. 5\n2. a, b") == [1.0, 0.0]
    assert score_completion(ex, "The answer is 5") == [0.0, 0.0]
    assert score_completion(ex, "2. b, a") == [0.0, 1.0]


def test_route_labels_follow_question_and_answer_lines() -> None:
    from transformers import AutoTokenizer

    from molora_runtime.model.model_paths import resolve_model_path
    from molora_runtime.training.batching import IGNORE, encode_example, route_labels

    tok = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    domains = list(DOMAINS)
    ex = Example(
        tasks=[
            Task("arithmetic", "Calculate 2 + 3.", "5"),
            Task("reversal", "Reverse this list of words: cat, dog", "dog, cat"),
        ],
        kind="mixed",
    )
    ids, labels = encode_example(tok, ex)
    routes = route_labels(tok, ex, domains)
    assert len(routes) == len(ids)
    ari, rev = domains.index("arithmetic"), domains.index("reversal")
    text = [tok.decode([i]) for i in ids]
    # question tokens carry their own line's domain; template tokens none
    assert routes[text.index(" Calculate")] == ari
    assert routes[text.index(" Reverse")] == rev
    assert routes[text.index("<|im_start|>")] == IGNORE
    # the position that predicts an answer token is labelled with that token's line
    predicted = {
        tok.decode([labels[t]]).strip(): routes[t] for t in range(len(ids)) if labels[t] >= 0
    }
    assert predicted["5"] == ari
    assert predicted["dog"] == rev
    single = Example(tasks=[Task("counting", "How many a in 'aa'?", "2")])
    assert set(route_labels(tok, single, domains)) == {domains.index("counting"), IGNORE}
