"""Per-sequence failure domain of sampling: one sequence's logits must never fail its batch-mates.

Rows whose logits have no finite maximum (a NaN or +Inf) fail before sampling, and a row whose
sampling raises fails alone; cheap when nothing is wrong. (The forward's own failure domain is
`ModelRunner.run_isolated`.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from molora_runtime.engine.sampling.sampler import scan_rows
from molora_runtime.errors import MoLoRAError, NonFiniteLogitsError, SequenceStepError

S = TypeVar("S")


def culprit_error(exc: BaseException) -> MoLoRAError:
    """The error a sequence that broke a step is failed with (its own error, named)."""
    if isinstance(exc, MoLoRAError):
        return exc
    return SequenceStepError(
        f"the request failed inside the model step: {type(exc).__name__}: {exc}"
    )


def sample_isolated(
    logits: torch.Tensor,
    seqs: Sequence[S],
    sample: Callable[[torch.Tensor, list[int], list[int]], list[int]],
    fail: Callable[[S, BaseException], None],
) -> list[tuple[int, int]]:
    """(row, token) for every row that samples cleanly; the other rows' sequences `fail`.

    One `scan_rows` read screens the rows and finds their greedy tokens;
    `sample(logits, rows, greedy)` samples the given rows at once (`greedy`: those rows'
    greedy tokens); if it raises, rows are sampled one by one so the row at fault fails alone.
    """
    scan = scan_rows(logits)
    for i, finite in enumerate(scan.finite):
        if not finite:
            fail(
                seqs[i], NonFiniteLogitsError("the model produced NaN/Inf logits for this request")
            )
    rows = [i for i, finite in enumerate(scan.finite) if finite]
    if not rows:
        return []
    try:
        return list(zip(rows, sample(logits, rows, [scan.greedy[i] for i in rows]), strict=True))
    except Exception:
        picks: list[tuple[int, int]] = []
        for i in rows:
            try:
                picks.append((i, sample(logits, [i], [scan.greedy[i]])[0]))
            except Exception as exc:
                fail(seqs[i], culprit_error(exc))
        return picks
