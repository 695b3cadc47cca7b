"""Speculative decoding's verification: of each drafted sequence, keep the longest draft prefix the
target model agrees with, plus the target's own next token, so drafts change how many steps an
answer takes and never the answer."""

from __future__ import annotations

import time

import torch

from molora_runtime.engine.outputs.endings import Endings, Outputs
from molora_runtime.engine.outputs.text_stream import TextStream
from molora_runtime.engine.outputs.token_step import TokenStep
from molora_runtime.engine.route_stats.attribution import attribution, slot_names
from molora_runtime.engine.route_stats.gate_summary import GateSummaries
from molora_runtime.engine.sampling.logits_processing import verify_row
from molora_runtime.engine.scheduling.scheduler import Scheduler
from molora_runtime.engine.sequence import Sequence
from molora_runtime.engine.speculation.drafter import Drafter
from molora_runtime.lora.hotset import HotSet
from molora_runtime.model.lora_context import LoRAContext


class VerifyStep(TokenStep):
    """Verifies every draft of one forward, each sequence failing alone."""

    def __init__(
        self,
        eos_ids: set[int],
        hot_set: HotSet,
        scheduler: Scheduler,
        drafter: Drafter | None,
        summaries: GateSummaries,
        text: TextStream,
        endings: Endings,
    ) -> None:
        super().__init__(eos_ids, hot_set, scheduler, summaries, text, endings)
        self.drafter = drafter

    def run(
        self,
        verify: list[tuple[Sequence, int, int]],
        logits: torch.Tensor,
        ctx: LoRAContext | None,
        outputs: Outputs,
    ) -> None:
        """`verify`: (seq, first batch row, rows) per drafted sequence, in `logits` order."""
        offset = 0
        for seq, start, n in verify:
            self._verify(seq, start, logits[offset : offset + n], ctx, outputs)
            offset += n

    def _verify(
        self,
        seq: Sequence,
        start: int,
        rows: torch.Tensor,
        ctx: LoRAContext | None,
        outputs: Outputs,
    ) -> None:
        """Row j holds the logits after the last token and j draft tokens; each row is sampled
        (or, with temperature, accepted by the rejection rule) with the history as it stands
        after the rows before it, so masks, penalties, stops and logprobs see exactly what they
        see without speculation."""
        draft = seq.draft
        try:
            now = time.monotonic()
            names = slot_names(self.hot_set) if seq.request.return_attribution else {}
            accepted, emitted, reason = 0, 0, None
            for j in range(len(draft) + 1):
                proposal = draft[j] if j < len(draft) else None
                token, logprob = verify_row(rows[j], seq.sampling_input(self.eos_ids), proposal)
                seq.append_token(token, logprob, now)
                if seq.request.return_attribution:
                    seq.attribution.append(attribution(ctx, start + j, token, names))
                emitted += 1
                accepted += token == proposal
                reason = self.text.stop_reason(seq, token)
                if reason is not None or token != proposal:
                    break
            self.scheduler.commit(seq, emitted)  # the last token and the accepted draft
            self.scheduler.release_draft(seq)
            assert self.drafter is not None and seq.spec is not None
            self.drafter.accepted(seq.spec, seq.route, len(draft), accepted)
            self.summaries.record(ctx, [seq] * emitted, list(range(start, start + emitted)))
            self.endings.finish_or_stream(seq, reason, outputs)
        except Exception as exc:
            self.endings.fail(seq, exc, outputs)
