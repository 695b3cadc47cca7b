"""Task data for composable specialization: reasoning-gym domains and mixed prompts.

Every example, single-domain or mixed, uses one numbered-list format so the same adapters serve
both: the user lists tasks as `N. question`, the assistant answers `N. answer`, one per line.
A single-domain example is a list of 1-2 tasks of one domain; a mixed example lists two tasks of
different domains, so its answer lines want different adapters (per-token routing). Train and
eval draw from disjoint seed ranges of the procedural generators.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

SYSTEM_PROMPT = "Answer each task as 'N. answer', one per line."

# Seeds of the generators: training below EVAL_SEED_BASE, evaluation at or above it.
EVAL_SEED_BASE = 1_000_000


class DomainSpec(BaseModel):
    """A reasoning-gym generator with the config that keeps its tasks short."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="adapter/domain name")
    generator: str = Field(description="reasoning-gym dataset name")
    config: dict[str, Any] = Field(default_factory=dict)


DOMAINS: dict[str, DomainSpec] = {
    d.name: d
    for d in (
        DomainSpec(
            name="arithmetic",
            generator="basic_arithmetic",
            config={
                "min_terms": 2,
                "max_terms": 2,
                "min_digits": 1,
                "max_digits": 2,
                "operators": ("+", "-"),
                "allow_parentheses": False,
                "allow_negation": False,
            },
        ),
        DomainSpec(
            name="sorting",
            generator="number_sorting",
            config={
                "min_numbers": 3,
                "max_numbers": 3,
                "min_decimals": 0,
                "max_decimals": 0,
                "min_value": 0,
                "max_value": 99,
            },
        ),
        DomainSpec(
            name="counting",
            generator="letter_counting",
            config={"min_words": 2, "max_words": 3},
        ),
        DomainSpec(
            name="reversal",
            generator="word_sequence_reversal",
            config={"min_words": 3, "max_words": 4},
        ),
        # Not in the default composition: the expert `molora compose add` adds to it.
        DomainSpec(
            name="multiplication",
            generator="products",
            config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        ),
        # Also outside it: ordering words by their letters, a second candidate for `compose add`.
        DomainSpec(
            name="alphabetical",
            generator="word_sorting",
            config={
                "min_words": 3,
                "max_words": 3,
                "min_word_length": 3,
                "max_word_length": 6,
            },
        ),
    )
}


@dataclass(frozen=True)
class Task:
    """One sub-task: a compact question, its gold answer, and its domain."""

    domain: str
    question: str
    answer: str


@dataclass
class Example:
    """A numbered list of tasks: a prompt (chat messages) and the gold answer lines."""

    tasks: list[Task]
    kind: str = "single"  # "single" or "mixed"
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def domains(self) -> list[str]:
        return [t.domain for t in self.tasks]

    def messages(self) -> list[dict[str, str]]:
        body = "\n".join(f"{i}. {t.question}" for i, t in enumerate(self.tasks, 1))
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": body},
        ]

    def answer_lines(self) -> list[str]:
        return [f"{i}. {t.answer}" for i, t in enumerate(self.tasks, 1)]

    def target(self) -> str:
        """The assistant completion the adapters are trained to produce."""
        return "\n".join(self.answer_lines())


def _compact_question(domain: str, entry: dict[str, Any]) -> str:
    """Rewrite reasoning-gym's long instructions into one short line (cheap to train on)."""
    meta = entry["metadata"]
    if domain == "sorting":  # whole numbers, without the generator's list-of-strings format
        numbers = ", ".join(_whole(n) for n in meta["original_numbers"])
        return f"Sort these numbers in {meta['direction']} order: {numbers}"
    if domain == "reversal":  # instructions on the answer format, then the task on its last line
        return entry["question"].strip().splitlines()[-1].strip()
    if domain == "multiplication":  # the expression without the answer-format sentence
        return f"Multiply: {meta['expression']}"
    if domain == "alphabetical":  # lowercased words, without the ASCII-ordering instructions
        words = ", ".join(w.lower() for w in meta["original_words"])
        return f"Sort these words alphabetically, {meta['direction']}: {words}"
    return entry["question"].strip()


def generate_tasks(domain: str, count: int, seed: int) -> list[Task]:
    """`count` tasks of `domain` from its generator at `seed` (deterministic)."""
    import reasoning_gym  # the optional `train` extra

    spec = DOMAINS[domain]
    dataset = reasoning_gym.create_dataset(spec.generator, seed=seed, size=count, **spec.config)
    return [
        Task(
            domain=domain, question=_compact_question(domain, e), answer=_compact_answer(domain, e)
        )
        for e in dataset
    ]


def _compact_answer(domain: str, entry: dict[str, Any]) -> str:
    if domain == "sorting":
        return ", ".join(_whole(n) for n in entry["metadata"]["sorted_numbers"])
    if domain == "alphabetical":  # the lowercased words the question shows, in its order
        meta = entry["metadata"]
        words = sorted(w.lower() for w in meta["original_words"])
        return ", ".join(words[::-1] if meta["direction"] == "descending" else words)
    return str(entry["answer"]).strip()


def _whole(number: str) -> str:
    """'56.0' -> '56' (the sorting domain draws whole numbers)."""
    return str(int(float(number)))


def train_seed(domain_index: int, seed: int) -> int:
    return seed * 97 + domain_index


def eval_seed(domain_index: int, seed: int) -> int:
    return EVAL_SEED_BASE + seed * 97 + domain_index


def domain_examples(
    domain: str, count: int, seed: int, split: str = "train", max_tasks: int = 2
) -> list[Example]:
    """Single-domain examples: lists of 1..max_tasks tasks of `domain`."""
    index = list(DOMAINS).index(domain)
    base_seed = train_seed(index, seed) if split == "train" else eval_seed(index, seed)
    rng = random.Random(base_seed)
    sizes = [rng.randint(1, max_tasks) for _ in range(count)]
    tasks = iter(generate_tasks(domain, sum(sizes), base_seed))
    return [Example(tasks=[next(tasks) for _ in range(n)]) for n in sizes]


def mixed_examples(
    domains: list[str], count: int, seed: int, split: str = "train"
) -> list[Example]:
    """Two-task examples whose tasks come from two different domains (all ordered pairs)."""
    offset = 500 if split == "train" else EVAL_SEED_BASE + 500
    pools = {
        d: iter(
            generate_tasks(d, count, (offset + seed) * 101 + i + 1_000)
        )  # separate seeds from the single-domain data
        for i, d in enumerate(domains)
    }
    pairs = [(a, b) for a in domains for b in domains if a != b]
    out = []
    for i in range(count):
        a, b = pairs[i % len(pairs)]
        out.append(Example(tasks=[next(pools[a]), next(pools[b])], kind="mixed"))
    return out


def normalize(text: str) -> str:
    return " ".join(text.strip().split())


def parse_answer_lines(completion: str, num_tasks: int) -> list[str | None]:
    """Map `N. answer` lines of a completion to task numbers (missing ones are None)."""
    found: dict[int, str] = {}
    for line in completion.strip().splitlines():
        head, sep, rest = line.strip().partition(".")
        if sep and head.strip().isdigit():
            n = int(head)
            if 1 <= n <= num_tasks and n not in found:
                found[n] = rest
    return [found.get(i) for i in range(1, num_tasks + 1)]


def score_completion(example: Example, completion: str) -> list[float]:
    """Exact-match (after whitespace normalisation) of each sub-answer: 1.0 or 0.0 each."""
    got = parse_answer_lines(completion, len(example.tasks))
    return [
        float(g is not None and normalize(g) == normalize(t.answer))
        for g, t in zip(got, example.tasks, strict=True)
    ]
