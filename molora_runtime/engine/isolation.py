"""Per-sequence failure domain of a step: one sequence's data must never fail its batch-mates.

Two defences, both cheap when nothing is wrong:
- `run_isolated`: when the batched forward raises, the batch is bisected and re-run until the
  culprit runs alone; only it fails, the others finish the step as if nothing happened (a re-run
  rewrites the same KV positions, and nothing else advances before `after` runs);
- `sample_isolated`: rows whose logits have no finite maximum (a NaN or +Inf) fail before
  sampling, and a row whose
  sampling raises fails alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from molora_runtime.engine.sampler import scan_rows
from molora_runtime.errors import MoLoRAError, NonFiniteLogitsError, SequenceStepError

log = logging.getLogger(__name__)

B = TypeVar("B")
S = TypeVar("S")


def culprit_error(exc: BaseException) -> MoLoRAError:
    """The error a sequence that broke a step is failed with (its own error, named)."""
    if isinstance(exc, MoLoRAError):
        return exc
    return SequenceStepError(
        f"the request failed inside the model step: {type(exc).__name__}: {exc}"
    )


def run_isolated(
    batch: B,
    size: Callable[[B], int],
    forward: Callable[[B], Any],
    after: Callable[[B, Any], None],
    fail: Callable[[B, BaseException], None],
    split: Callable[[B], list[B]],
) -> None:
    """`after(batch, forward(batch))`; on an exception, bisect until the culprit is alone.

    `fail` is only ever called for a batch of one sequence. Sub-batches that run cleanly are
    committed by `after` as they finish, so k culprits cost O(k log n) extra forwards.
    """
    try:
        result = forward(batch)
    except Exception as exc:
        if size(batch) <= 1:
            log.warning("a sequence failed its step alone: %r", exc)
            fail(batch, exc)
            return
        log.warning("batched step failed (%r); re-running in halves to isolate it", exc)
        for part in split(batch):
            run_isolated(part, size, forward, after, fail, split)
        return
    after(batch, result)


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
