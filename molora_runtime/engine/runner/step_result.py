"""What one forward hands the output processor: its logits, split by the rows' purpose, the
LoRA context the layers recorded into (and, for a learned draft, the same rows' hidden states),
or the error the batch's lone sequence raised."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from molora_runtime.engine.runner.step_batch import StepBatch
from molora_runtime.model.lora_context import LoRAContext


@dataclass(frozen=True)
class StepResult:
    """One (sub-)batch's outcome; `logits` rows follow `StepBatch.logit_rows`, so the slices
    below are how the runner laid them out."""

    batch: StepBatch
    logits: torch.Tensor | None = None
    ctx: LoRAContext | None = None
    error: BaseException | None = None  # set only for a batch of one sequence
    hidden: torch.Tensor | None = None  # the logit rows' final-norm hidden states (eagle only)

    @property
    def _sampled_end(self) -> int:
        return len(self.batch.logits_index)

    @property
    def _verify_end(self) -> int:
        return self._sampled_end + len(self.batch.verify_index)

    @property
    def sampled_logits(self) -> torch.Tensor:
        """One row per sequence that samples its next token (a decode or a prefill's last)."""
        assert self.logits is not None
        return self.logits[: self._sampled_end]

    @property
    def verify_logits(self) -> torch.Tensor:
        """Every row of every verified draft (the last token and each draft token)."""
        assert self.logits is not None
        return self.logits[self._sampled_end : self._verify_end]

    @property
    def sampled_hidden(self) -> torch.Tensor | None:
        """The sampled rows' hidden states, when the forward kept them."""
        return None if self.hidden is None else self.hidden[: self._sampled_end]

    @property
    def verify_hidden(self) -> torch.Tensor | None:
        """The verified rows' hidden states, when the forward kept them."""
        return None if self.hidden is None else self.hidden[self._sampled_end : self._verify_end]

    @property
    def prompt_logits(self) -> torch.Tensor:
        """The prompt positions whose logprobs were asked for."""
        assert self.logits is not None
        return self.logits[self._verify_end :]
