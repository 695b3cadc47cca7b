"""The step's postprocess: one forward's result -> committed KV, recorded statistics, verified
drafts, sampled tokens, text, stops and outputs.

`process` runs named steps in a fixed order, each owning one job: commit what the forward
cached, record prompt logprobs and gate statistics, verify drafts (`VerifyStep`), sample the
next tokens (`SampleStep`); both end or stream each sequence through `Endings`, and its text and
stops through `TextStream`. A sequence's failure ends that sequence alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from molora_runtime.engine.outputs.endings import Endings, Outputs
from molora_runtime.engine.outputs.sample_step import SampleStep
from molora_runtime.engine.outputs.text_stream import TextStream
from molora_runtime.engine.outputs.verify_step import VerifyStep
from molora_runtime.engine.route_stats.gate_stats import GateStats
from molora_runtime.engine.route_stats.gate_summary import GateSummaries
from molora_runtime.engine.runner.step_batch import StepBatch
from molora_runtime.engine.runner.step_result import StepResult
from molora_runtime.engine.sampling.logits_processing import token_logprob
from molora_runtime.engine.scheduling.scheduler import Scheduler
from molora_runtime.engine.sequence import SeqStatus
from molora_runtime.engine.speculation.drafter import Drafter
from molora_runtime.lora.hotset import HotSet
from molora_runtime.model.lora_context import LoRAContext

log = logging.getLogger(__name__)


class OutputProcessor:
    """Postprocesses every forward; its `endings` also end aborted and queued requests."""

    def __init__(
        self,
        tokenizer: Any,
        eos_ids: set[int],
        max_len: int,
        scheduler: Scheduler,
        hot_set: HotSet,
        wipe: Callable[[list[int]], None],
        max_num_seqs: int = 1,
        drafter: Drafter | None = None,
    ) -> None:
        """`max_len`: tokens a sequence may reach (context limit and KV budget); `wipe` zeroes
        KV blocks of a failed sequence; `max_num_seqs` sizes the gate summaries' rows."""
        self.scheduler = scheduler
        self.gate_stats = GateStats(hot_set)
        self.summaries = GateSummaries(hot_set, max_num_seqs)
        self.text = TextStream(tokenizer, eos_ids, max_len)
        self.drafter = drafter
        self.endings = Endings(self.text, self.summaries, scheduler, wipe, drafter)
        self.verify = VerifyStep(
            eos_ids, hot_set, scheduler, drafter, self.summaries, self.text, self.endings
        )
        self.sample = SampleStep(
            eos_ids, hot_set, scheduler, self.summaries, self.text, self.endings
        )

    def process(self, result: StepResult, outputs: Outputs) -> None:
        """Postprocess one (sub-)batch's forward, appending each request's output."""
        if result.error is not None:  # the forward failed with this sequence alone in it
            self.endings.fail(result.batch.segments[0][0], result.error, outputs)
            return
        batch, ctx = result.batch, result.ctx
        self._commit(batch)
        self._record_prompt_logprobs(batch, result.prompt_logits)
        self._record_gate_stats(ctx)
        self.verify.run(batch.verify, result.verify_logits, ctx, outputs)
        self.sample.run(batch, result.sampled_logits, ctx, outputs)
        if result.hidden is not None:
            self._hand_features(result)

    def _hand_features(self, result: StepResult) -> None:
        """A learned draft starts from the hidden state of the row that sampled each sequence's
        newest token: a sampled row's own, a verification's last emitted row's."""
        drafter, batch = self.drafter, result.batch
        sampled, verified = result.sampled_hidden, result.verify_hidden
        if drafter is None or sampled is None or verified is None:
            return
        rows = zip(batch.logits_seqs, batch.logits_index, strict=True)
        picks = [(seq, batch.positions[row], sampled[i]) for i, (seq, row) in enumerate(rows)]
        offset = 0
        for seq, start, n in batch.verify:
            j = seq.num_computed - 1 - batch.positions[start]  # rows before it were committed
            if 0 <= j < n:
                picks.append((seq, seq.num_computed - 1, verified[offset + j]))
            offset += n
        for seq, pos, feature in picks:
            if seq.status is SeqStatus.FINISHED:
                continue
            if seq.spec is None:
                seq.spec = drafter.new_state(seq.request.tenant, seq.route)
            drafter.observe(seq.spec, pos, feature)

    def _commit(self, batch: StepBatch) -> None:
        """The tokens the forward cached are computed; full blocks join the prefix cache."""
        for seq, n in batch.computed():
            self.scheduler.commit(seq, n)

    @staticmethod
    def _record_prompt_logprobs(batch: StepBatch, logits: torch.Tensor) -> None:
        """Logprob of each prompt token given the ones before it (raw logits, k top ones)."""
        if not batch.prompt_logits_owner:
            return
        lp = torch.log_softmax(logits.float(), dim=-1)
        for row, (seq, pos) in enumerate(batch.prompt_logits_owner):
            k = seq.request.sampling.prompt_logprobs or 0
            seq.prompt_logprobs.append(token_logprob(lp[row], seq.prompt_ids[pos + 1], k))

    def _record_gate_stats(self, ctx: LoRAContext | None) -> None:
        """Queue the step's learned-gate routing for the metrics (never fails the step)."""
        if ctx is None or not ctx.has_learned or not ctx.layer_tables:
            return
        try:
            self.gate_stats.record(ctx)
        except Exception:  # observability only
            log.debug("gate stats failed", exc_info=True)
