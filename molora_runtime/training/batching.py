"""Tokenising examples into padded training batches with the loss only on answer tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from molora_runtime.training.data import Example

IGNORE = -100


def render_prompt(tokenizer, example: Example) -> str:
    """The chat-templated prompt text, ending where the assistant's answer starts."""
    return tokenizer.apply_chat_template(
        example.messages(), tokenize=False, add_generation_prompt=True
    )


def end_of_turn(tokenizer) -> str:
    return tokenizer.eos_token or "<|im_end|>"


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T], IGNORE outside the answer; already shifted (label of t is t+1)


def _tokenize(tokenizer, example: Example, offsets: bool = False) -> tuple[str, dict, dict]:
    """The rendered prompt text and the encodings of prompt and answer (with char offsets)."""
    prompt_text = render_prompt(tokenizer, example)
    answer_text = example.target() + end_of_turn(tokenizer)
    kw = {"add_special_tokens": False, "return_offsets_mapping": offsets}
    return prompt_text, tokenizer(prompt_text, **kw), tokenizer(answer_text, **kw)


def _ids_and_labels(prompt: dict, answer: dict) -> tuple[list[int], list[int]]:
    ids = prompt["input_ids"] + answer["input_ids"]
    # position t predicts ids[t+1]; only answer tokens are targets.
    labels = [IGNORE] * len(ids)
    for t in range(len(prompt["input_ids"]) - 1, len(ids) - 1):
        labels[t] = ids[t + 1]
    return ids, labels


def encode_example(tokenizer, example: Example) -> tuple[list[int], list[int]]:
    """Token ids of prompt+answer and per-token labels (next token where it is answer)."""
    _, prompt, answer = _tokenize(tokenizer, example)
    return _ids_and_labels(prompt, answer)


def encode_routed(
    tokenizer, example: Example, domains: list[str]
) -> tuple[list[int], list[int], list[int]]:
    """`encode_example`'s ids and labels plus `route_labels`, from one tokenization."""
    tokenized = _tokenize(tokenizer, example, offsets=True)
    ids, labels = _ids_and_labels(*tokenized[1:])
    return ids, labels, route_labels(tokenizer, example, domains, tokenized)


def route_labels(
    tokenizer,
    example: Example,
    domains: list[str],
    tokenized: tuple[str, dict, dict] | None = None,
) -> list[int]:
    """Per position of `encode_example`'s ids, the index in `domains` of the adapter it wants.

    The label of a position is the domain whose text it serves: in the prompt, the question line
    it belongs to; in the answer, the line of the token it predicts (so the gate that produces a
    line's tokens is told that line's domain). System and template tokens come before any
    question, so no gate can know their domain: they stay unlabelled (IGNORE).
    """
    index = [domains.index(t.domain) for t in example.tasks]
    prompt_text, prompt, answer = tokenized or _tokenize(tokenizer, example, offsets=True)
    n_answer = len(answer["input_ids"])
    lines = [f"{i}. {t.question}" for i, t in enumerate(example.tasks, 1)]
    spans, cursor = [], 0
    for line in lines:  # question lines, in order, inside the rendered prompt
        start = prompt_text.index(line, cursor)
        spans.append((start, start + len(line)))
        cursor = start + len(line)
    line_of = [_span_index(spans, start) for start, _ in prompt["offset_mapping"]]
    labels = [IGNORE if i == IGNORE else index[i] for i in line_of]
    ends, cursor = [], 0
    for line in example.answer_lines():  # each answer line owns itself and its trailing newline
        cursor += len(line) + 1
        ends.append(cursor)
    answer_line = [
        next((i for i, end in enumerate(ends) if start < end), len(ends) - 1)
        for start, _ in answer["offset_mapping"]
    ]
    # position t predicts token t+1: the last prompt position serves the first answer token.
    labels[-1] = index[answer_line[0]]
    labels += [index[answer_line[j + 1]] for j in range(n_answer - 1)]
    labels.append(index[answer_line[-1]])
    return labels


def _span_index(spans: list[tuple[int, int]], pos: int) -> int:
    return next((i for i, (a, b) in enumerate(spans) if a <= pos < b), IGNORE)


def collate(encoded: list[tuple[list[int], list[int]]], pad_id: int) -> Batch:
    """Right-pad a list of (ids, labels) into tensors."""
    width = max(len(ids) for ids, _ in encoded)
    ids_t = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    labels = torch.full((len(encoded), width), IGNORE, dtype=torch.long)
    for row, (ids, lab) in enumerate(encoded):
        ids_t[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
        labels[row, : len(lab)] = torch.tensor(lab)
    return Batch(input_ids=ids_t, attention_mask=mask, labels=labels)


def answer_loss(
    hidden: torch.Tensor, lm_head: torch.nn.Module, labels: torch.Tensor, per_example: bool = False
):
    """Cross-entropy over answer positions only; projecting just those saves most lm_head work.

    `per_example`: mean over each row's supervised tokens, then over rows, so a 2-token answer
    (a digit and end of turn) weighs as much as a 17-token one; the default is the mean over all
    supervised tokens of the batch, where long answers dominate.
    """
    keep = labels != IGNORE
    logits = lm_head(hidden[keep])
    if not per_example:
        return torch.nn.functional.cross_entropy(logits.float(), labels[keep])
    token_loss = torch.nn.functional.cross_entropy(logits.float(), labels[keep], reduction="none")
    rows = keep.nonzero()[:, 0]
    counts = keep.sum(dim=1)
    per_row = torch.zeros(labels.shape[0], device=token_loss.device).index_add(0, rows, token_loss)
    has = counts > 0
    return (per_row[has] / counts[has]).mean()
