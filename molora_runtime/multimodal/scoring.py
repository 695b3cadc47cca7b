"""Scoring generated digits: images by the judge classifier, text by exact match."""

from __future__ import annotations

from dataclasses import dataclass

from molora_runtime.multimodal.digits import DigitTask
from molora_runtime.multimodal.tokens import split_images


@dataclass
class Parsed:
    """A completion split into its text and its first image (None when it drew none)."""

    text: str
    image: list[int] | None


def parse_completion(tokenizer, token_ids: list[int]) -> Parsed:
    eos = {tokenizer.convert_tokens_to_ids(tokenizer.eos_token or "<|im_end|>")}
    text_ids, images = split_images([t for t in token_ids if t not in eos])
    return Parsed(text=tokenizer.decode(text_ids).strip(), image=images[0] if images else None)


def normalize(text: str) -> str:
    return " ".join(text.strip().split())


def score_tasks(judge, tasks: list[DigitTask], parsed: list[Parsed]) -> list[dict[str, float]]:
    """Per task: `image` (the judge reads the asked digit), `text` (exact match), `both`."""
    drawn = [p.image for p in parsed if p.image is not None]
    verdicts = iter(judge.predict(drawn))
    out = []
    for task, p in zip(tasks, parsed, strict=True):
        row: dict[str, float] = {}
        if task.kind in ("draw", "mixed"):
            row["image"] = float(p.image is not None and next(verdicts) == task.digit)
        elif p.image is not None:
            next(verdicts)
        if task.kind in ("read", "mixed"):
            row["text"] = float(normalize(p.text) == normalize(task.answer_text()))
        row["both"] = float(all(row.values()))
        out.append(row)
    return out
