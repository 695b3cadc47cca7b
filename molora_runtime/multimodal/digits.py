"""Digits data for the `draw` and `read` adapters, from scikit-learn's load_digits (no download).

1,797 8x8 images with 17 grey levels, split once by a seeded permutation into a train split
(adapters and the judging classifier) and a disjoint eval split (every score). Three tasks:
- draw: "Draw the digit 7." -> an image of a 7 (image tokens);
- read: "Which digit is this? <image>" -> "7";
- mixed: "Draw a 3, then say which digit you drew and what it plus 4 is." -> image, then
  "I drew a 3. 3 + 4 = 7." (image tokens then text: one sequence wanting both adapters).

Each adapter is trained apart, on its own modality's tokens only: a loss position belongs to the
adapter a vocab route gives the *input* token there (see `tokens`). `draw` learns the predictions
made at image positions (codes, EOI) and, so that it can draw on its own, the BOI that opens the
answer and the end of turn after a lone image; `read` learns every prediction made at a text
position (the BOI that starts an image, the text after one) and never predicts an image code.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from molora_runtime.multimodal.tokens import EOI, IMAGE_RANGE, image_to_ids

SYSTEM_PROMPT = "Answer briefly."
IMAGE_PLACEHOLDER = "<image>"
SPLIT_SEED = 0
EVAL_FRACTION = 0.2
IGNORE = -100
MULTIMODAL_DOMAINS = ("draw", "read")


@lru_cache(maxsize=1)
def _digits() -> tuple[list[list[int]], list[int]]:
    from sklearn.datasets import load_digits  # the optional `train` extra

    d = load_digits()
    return [[int(v) for v in row] for row in d.data], [int(t) for t in d.target]


def split(name: str) -> list[tuple[list[int], int]]:
    """(pixels, label) pairs of the `train` or `eval` split (disjoint, fixed by SPLIT_SEED)."""
    images, labels = _digits()
    order = list(range(len(images)))
    random.Random(SPLIT_SEED).shuffle(order)
    cut = int(len(order) * (1 - EVAL_FRACTION))
    chosen = order[:cut] if name == "train" else order[cut:] if name == "eval" else None
    if chosen is None:
        raise ValueError(f"split is 'train' or 'eval', got {name!r}")
    return [(images[i], labels[i]) for i in chosen]


@dataclass(frozen=True)
class DigitTask:
    """One example: its kind, the digit, the addend (mixed), and the image shown or targeted."""

    kind: str  # "draw", "read" or "mixed"
    digit: int
    pixels: list[int]
    addend: int = 0

    def user_text(self) -> str:
        if self.kind == "draw":
            return f"Draw the digit {self.digit}."
        if self.kind == "read":
            return f"Which digit is this? {IMAGE_PLACEHOLDER}"
        return (
            f"Draw a {self.digit}, then say which digit you drew and what it plus {self.addend} is."
        )

    def answer_text(self) -> str:
        """The text part of the gold answer ('' for draw)."""
        if self.kind == "read":
            return str(self.digit)
        if self.kind == "mixed":
            return (
                f"I drew a {self.digit}. {self.digit} + {self.addend} = {self.digit + self.addend}."
            )
        return ""

    def messages(self) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": self.user_text()},
        ]


def tasks(kind: str, count: int, split_name: str, seed: int) -> list[DigitTask]:
    """`count` tasks of `kind` over the split's images (cycled in a seeded order)."""
    pool = split(split_name)
    rng = random.Random(f"{kind}-{split_name}-{seed}")
    order = list(range(len(pool)))
    rng.shuffle(order)
    out = []
    for i in range(count):
        pixels, label = pool[order[i % len(order)]]
        addend = rng.randint(1, 5) if kind == "mixed" else 0
        out.append(DigitTask(kind=kind, digit=label, pixels=pixels, addend=addend))
    return out


def prompt_ids(tokenizer, task: DigitTask) -> list[int]:
    """Chat-templated prompt ids, the image's tokens spliced in at the placeholder."""
    text = tokenizer.apply_chat_template(
        task.messages(), tokenize=False, add_generation_prompt=True
    )
    head, sep, tail = text.partition(IMAGE_PLACEHOLDER)
    ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    if sep:
        ids += image_to_ids(task.pixels)
        ids += tokenizer(tail, add_special_tokens=False)["input_ids"]
    return ids


def answer_ids(tokenizer, task: DigitTask) -> list[int]:
    """Gold answer ids: the image (draw, mixed), the text (read, mixed), end of turn."""
    ids = image_to_ids(task.pixels) if task.kind in ("draw", "mixed") else []
    text = task.answer_text()
    if text:
        ids += tokenizer((" " if ids else "") + text, add_special_tokens=False)["input_ids"]
    return [*ids, tokenizer.convert_tokens_to_ids(tokenizer.eos_token or "<|im_end|>")]


def _mine(adapter: str, kind: str, token: int, is_prompt_end: bool) -> bool:
    """Does `adapter` learn the prediction made at a position holding `token`?"""
    image = IMAGE_RANGE[0] <= token < IMAGE_RANGE[1]
    if adapter == "read":
        return not image
    if image:
        return True
    # draw alone must open its image and close a lone one
    return is_prompt_end or (kind == "draw" and token == EOI)


def encode_task(tokenizer, task: DigitTask, adapter: str) -> tuple[list[int], list[int]]:
    """(ids, labels) for training `adapter`; labels[t] is ids[t+1] where the adapter learns it."""
    prompt = prompt_ids(tokenizer, task)
    ids = prompt + answer_ids(tokenizer, task)
    labels = [IGNORE] * len(ids)
    for t in range(len(prompt) - 1, len(ids) - 1):
        if _mine(adapter, task.kind, ids[t], t == len(prompt) - 1):
            labels[t] = ids[t + 1]
    return ids, labels


# Training mixture per adapter: kinds and their shares.
MIXTURE = {
    "draw": (("draw", 0.5), ("mixed", 0.5)),
    # reading is the hard part of `read` (the text after an image mostly copies the prompt).
    # The loss is a mean over supervised tokens, so the digit is ~1/11 of it here (a mixed
    # example supervises ~16 easy tokens, a read one 2); v2 collapsed to a constant digit.
    # 80/5/15 was tried for 60 steps and collapsed too (README); kept at v2's shares so
    # scripts/build_multimodal.sh still rebuilds the published adapters.
    "read": (("read", 0.6), ("draw", 0.1), ("mixed", 0.3)),
}


KINDS = ("draw", "read", "mixed")


def parse_mixture(text: str) -> dict[str, float]:
    """'read=0.85,mixed=0.15' -> {'read': 0.85, 'mixed': 0.15} (a CLI override of MIXTURE)."""
    out: dict[str, float] = {}
    for item in text.split(","):
        kind, sep, share = item.partition("=")
        if not sep or kind.strip() not in KINDS:
            raise ValueError(f"mixture item {item!r} must be KIND=SHARE, KIND in {KINDS}")
        out[kind.strip()] = float(share)
    if any(v < 0 for v in out.values()) or abs(sum(out.values()) - 1) > 1e-6:
        raise ValueError(f"mixture shares must be >= 0 and sum to 1, got {out}")
    return out


def drop_codes(
    ids: list[int], labels: list[int], rate: float, rng: random.Random
) -> tuple[list[int], list[int]]:
    """Word dropout on the answer's image codes: each *input* code becomes a random code with
    probability `rate`; the labels (the true next tokens) stay. Teacher-forced, a drawing's first
    codes already tell the digit, so only the first few predictions need the prompt and `draw`
    learns the image prior but not the digit (draw@v2: same loss with the wrong digit asked).
    Corrupting the prefix makes the prompt's digit pay at every code (Bowman et al. 2016)."""
    if rate <= 0:
        return ids, labels
    lo, hi = IMAGE_RANGE[0] + 1, IMAGE_RANGE[1]  # codes only; BOI stays
    first = next((t for t, label in enumerate(labels) if label != IGNORE), len(ids))
    out = list(ids)
    for t in range(first + 1, len(ids)):
        if lo <= ids[t] < hi and rng.random() < rate:
            out[t] = rng.randrange(lo, hi)
    return out, labels


def training_examples(
    tokenizer,
    adapter: str,
    count: int,
    seed: int,
    mixture: dict[str, float] | None = None,
    code_dropout: float = 0.0,
) -> list[tuple[list[int], list[int]]]:
    """`count` encoded train-split examples for `adapter`, interleaved in a seeded order.

    `mixture` (kind -> share) replaces the adapter's default MIXTURE; `code_dropout` corrupts
    that share of the answer's input image codes (`drop_codes`; labels untouched).
    """
    if adapter not in MIXTURE:
        raise ValueError(f"unknown multimodal adapter {adapter!r}; known: {sorted(MIXTURE)}")
    shares = tuple(mixture.items()) if mixture else MIXTURE[adapter]
    chosen: list[DigitTask] = []
    for kind, share in shares:
        chosen += tasks(kind, round(count * share), "train", seed)
    random.Random(f"mix-{adapter}-{seed}").shuffle(chosen)
    encoded = [encode_task(tokenizer, t, adapter) for t in chosen[:count]]
    drop = random.Random(f"code-dropout-{adapter}-{seed}")
    encoded = [drop_codes(ids, labels, code_dropout, drop) for ids, labels in encoded]
    return [e for e in encoded if any(label != IGNORE for label in e[1])]
