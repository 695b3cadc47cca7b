"""The workload both sides of the serving benchmark run: adapters, prompts, routes and cells."""

from __future__ import annotations

ADAPTERS = ["a", "b", "c", "d"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEW_TOKENS = 64
PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain photosynthesis in one sentence.",
    "Write a haiku about the sea.",
    "How do I boil an egg?",
    "What is 17 times 23?",
    "Name two benefits of regular exercise.",
    "Translate 'good morning' into Spanish.",
]
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 32


def modes(vocab_split: int) -> dict[str, list[tuple[str, dict | None]]]:
    """Each mode's (model name, explicit route) pairs; `vocab_split` bounds the vocab ranges."""
    vocab = {
        "kind": "vocab",
        "ranges": [
            {"start": 0, "end": vocab_split, "adapter": "a"},
            {"start": vocab_split, "end": 2 * vocab_split, "adapter": "b"},
        ],
        "default": "c",
    }
    return {
        "base": [("base", None)],
        "single": [("a", None)],
        "mixed": [(n, None) for n in ADAPTERS],
        "learned_top2": [("mix4", None)],
        "vocab": [("base", vocab)],
    }


CELLS = {"full": [(1, 4), (8, 32), (32, 64)], "quick": [(8, 16), (32, 64)]}
