"""How a request leaves the step: streamed on, finished (stop, length, abort), or failed alone
(error); each ending frees what the request held, and a failure ends that request only."""

from __future__ import annotations

from collections.abc import Callable

from molora_runtime.engine.outputs.text_stream import TextStream
from molora_runtime.engine.route_stats.gate_summary import GateSummaries
from molora_runtime.engine.sampling.isolation import culprit_error
from molora_runtime.engine.scheduling.scheduler import Scheduler
from molora_runtime.engine.sequence import SeqStatus, Sequence
from molora_runtime.engine.speculation.drafter import Drafter
from molora_runtime.engine.types import FinishReason, GenerationOutput

Outputs = list[GenerationOutput]  # one step's outputs, appended to by every step below


class Endings:
    """Streams, finishes and fails sequences; the engine ends aborted and queued ones here too."""

    def __init__(
        self,
        text: TextStream,
        summaries: GateSummaries,
        scheduler: Scheduler,
        wipe: Callable[[list[int]], None],
        drafter: Drafter | None,
    ) -> None:
        """`wipe` zeroes the KV blocks of a failed sequence."""
        self.text = text
        self.summaries = summaries
        self.scheduler = scheduler
        self.wipe = wipe
        self.drafter = drafter

    def finish_or_stream(
        self, seq: Sequence, reason: FinishReason | None, outputs: Outputs
    ) -> None:
        """End `seq` for `reason`, or hand the client what it has not seen yet."""
        if reason is not None:
            self.finish(seq, reason, outputs)
        else:
            out = self.text.increment(seq, finished=False)
            if out is not None:
                outputs.append(out)

    def final(self, seq: Sequence, reason: FinishReason) -> GenerationOutput:
        """The closing output of a request that ends without new text (abort, error)."""
        seq.finish_reason = reason
        seq.status = SeqStatus.FINISHED
        self.text.close(seq)
        self.summaries.drop(seq.request_id)
        return GenerationOutput(
            request_id=seq.request_id,
            new_token_ids=[],
            text_delta="",
            finished=True,
            finish_reason=reason,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            attribution=[] if seq.request.return_attribution else None,
            error=seq.error,
            exception=seq.exception,
        )

    def finish(self, seq: Sequence, reason: FinishReason, outputs: Outputs) -> None:
        """End a running `seq`: its last increment (with its gate summary) or its closing
        output, its answer kept for drafting, its blocks and adapters released."""
        seq.finish_reason = reason
        seq.status = SeqStatus.FINISHED
        if reason not in ("abort", "error"):
            out = self.text.increment(seq, finished=True, summary=self.summaries.take(seq))
            if out is not None:
                outputs.append(out)
        else:
            outputs.append(self.final(seq, reason))
        self.text.close(seq)
        if self.drafter is not None and seq.spec is not None and reason != "error":
            self.drafter.remember(seq.spec, seq.output_ids)
        self.scheduler.finish(seq)

    def fail(self, seq: Sequence, exc: BaseException, outputs: Outputs) -> None:
        """End one running sequence with its own error; the blocks only it holds are unindexed
        and wiped (NaN K/V would survive masking in the next owner's attention)."""
        if seq.status is SeqStatus.FINISHED or seq not in self.scheduler.running:
            return
        seq.exception = culprit_error(exc)
        seq.error = str(seq.exception)
        self.wipe(self.scheduler.discard(seq))
        self.finish(seq, "error", outputs)

    def fail_waiting(self, seq: Sequence, exc: BaseException, outputs: Outputs) -> None:
        """A queued request that cannot start (its adapters, store or route) ends alone."""
        seq.exception = exc
        seq.error = str(exc) or type(exc).__name__
        outputs.append(self.final(seq, "error"))
