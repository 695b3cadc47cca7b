"""The step's next tokens: one for every sequence the batch samples (each decode, each prefill that
just finished, and the n > 1 siblings forked from it), sampled with a bad row failing alone,
attributed to the adapters that served it, then streamed or finished."""

from __future__ import annotations

import time
from functools import partial

import torch

from molora_runtime.engine.outputs.endings import Outputs
from molora_runtime.engine.outputs.token_step import TokenStep
from molora_runtime.engine.route_stats.attribution import attribution, attributions, slot_names
from molora_runtime.engine.runner.step_batch import StepBatch
from molora_runtime.engine.sampling.isolation import sample_isolated
from molora_runtime.engine.sampling.logits_processing import sample_rows, take_rows
from molora_runtime.engine.sequence import Sequence
from molora_runtime.engine.types import TokenAttribution, TokenLogprob
from molora_runtime.model.lora_context import LoRAContext

Picks = list[tuple[int, int]]  # (index into the sampled sequences, its token)


class SampleStep(TokenStep):
    """Samples, attributes and emits the batch's sampled rows, each sequence failing alone."""

    def run(
        self, batch: StepBatch, logits: torch.Tensor, ctx: LoRAContext | None, outputs: Outputs
    ) -> None:
        """`logits`: one row per `batch.logits_seqs`, in that order."""
        seqs, src = self.scheduler.fork_prefills(batch.logits_seqs)
        if not seqs:
            return
        if len(src) != len(batch.logits_seqs):  # a forked sibling samples its leader's row
            logits = logits[torch.tensor(src, dtype=torch.long, device=logits.device)]
        rows = [batch.logits_index[i] for i in src]  # each sequence's batch row
        self.summaries.record(ctx, seqs, rows)
        picks, logprobs = self._sample(logits, seqs, outputs)
        now = time.monotonic()
        names = slot_names(self.hot_set) if any(s.request.return_attribution for s in seqs) else {}
        attrs = self._attributions(ctx, seqs, rows, picks, names)
        for i, token in picks:
            seq = seqs[i]
            try:
                seq.append_token(token, logprobs.get(i), now)
                if seq.request.return_attribution:
                    found = attrs.get(i)
                    if found is None:
                        found = attribution(ctx, rows[i], token, names)
                    seq.attribution.append(found)
                self.endings.finish_or_stream(seq, self.text.stop_reason(seq, token), outputs)
            except Exception as exc:
                self.endings.fail(seq, exc, outputs)

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], outputs: Outputs
    ) -> tuple[Picks, dict[int, TokenLogprob | None]]:
        """The token of every row that samples cleanly, and the logprobs of those that ask."""
        logprobs: dict[int, TokenLogprob | None] = {}

        def sample(lg: torch.Tensor, rows: list[int], greedy: list[int]) -> list[int]:
            inputs = [seqs[r].sampling_input(self.eos_ids) for r in rows]
            tokens, lps = sample_rows(take_rows(lg, rows), inputs, greedy)
            logprobs.update(zip(rows, lps, strict=True))
            return tokens

        fail = partial(self.endings.fail, outputs=outputs)
        return sample_isolated(logits, seqs, sample, fail), logprobs

    @staticmethod
    def _attributions(
        ctx: LoRAContext | None,
        seqs: list[Sequence],
        rows: list[int],
        picks: Picks,
        names: dict[int, str],
    ) -> dict[int, TokenAttribution]:
        """The attribution of every pick that asks, with one read-back for the whole batch;
        empty when that read fails (then each is read alone, failing only its own sequence)."""
        wanted = [(i, token) for i, token in picks if seqs[i].request.return_attribution]
        try:
            found = attributions(ctx, [rows[i] for i, _ in wanted], [t for _, t in wanted], names)
            return dict(zip([i for i, _ in wanted], found, strict=True))
        except Exception:
            return {}
