"""Sampling results -> tokens, incremental text, stops, attribution, finish.

Stop strings are held back (at most the longest stop string minus one character) so they never
leak into the stream; the detokenizer decodes only a short window per token (prefix/read
offsets). A sequence's failure ends that sequence alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from molora_runtime.engine.detokenizer import IncrementalDetokenizer
from molora_runtime.engine.gate_summary import GateSummaries
from molora_runtime.engine.isolation import culprit_error, sample_isolated
from molora_runtime.engine.logits_processing import (
    RowInput,
    sample_rows,
    take_rows,
    token_logprob,
    verify_row,
)
from molora_runtime.engine.route_stats import GateStats, attribution, attributions, slot_names
from molora_runtime.engine.scheduler import Scheduler
from molora_runtime.engine.sequence import SeqStatus, Sequence
from molora_runtime.engine.speculation import Drafter
from molora_runtime.engine.step_batch import StepBatch
from molora_runtime.engine.types import FinishReason, GateSummary, GenerationOutput, TokenLogprob
from molora_runtime.lora.hotset import HotSet
from molora_runtime.model.lora_context import LoRAContext
from molora_runtime.multimodal.prompt import HIDDEN_IDS

log = logging.getLogger(__name__)

Outputs = list[GenerationOutput]


class OutputProcessor:
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
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_len = max_len
        self.scheduler = scheduler
        self.hot_set = hot_set
        self.wipe = wipe
        self.drafter = drafter
        self.gate_stats = GateStats(hot_set)
        self.summaries = GateSummaries(hot_set, max_num_seqs)
        self._detok: dict[str, IncrementalDetokenizer] = {}

    # ----- after a forward ------------------------------------------------------------------
    def process(
        self, batch: StepBatch, logits: torch.Tensor, ctx: LoRAContext | None, outputs: Outputs
    ) -> None:
        verified = {id(seq) for seq, _, _ in batch.verify}
        for seq, _, n in batch.segments:
            if id(seq) not in verified:  # a verification commits what it accepts
                self.scheduler.commit(seq, n)
        sampled_rows = len(batch.logits_index)
        verify_end = sampled_rows + len(batch.verify_index)
        if batch.prompt_logits_index:
            self._record_prompt_logprobs(batch, logits[verify_end:])
        verify_logits = logits[sampled_rows:verify_end]
        logits = logits[:sampled_rows]
        if ctx is not None and ctx.has_learned and ctx.layer_tables:
            try:
                self.gate_stats.record(ctx)
            except Exception:  # observability only; never fails the step
                log.debug("gate stats failed", exc_info=True)
        offset = 0
        for seq, start, n in batch.verify:
            self._verify(seq, start, verify_logits[offset : offset + n], ctx, outputs)
            offset += n
        seqs, src = self.scheduler.fork_prefills(batch.logits_seqs)
        if not seqs:
            return
        if len(src) != len(batch.logits_seqs):
            logits = logits[torch.tensor(src, dtype=torch.long, device=logits.device)]
        self.summaries.record(ctx, seqs, [batch.logits_index[i] for i in src])
        logprobs: dict[int, Any] = {}

        def sample(lg: torch.Tensor, rows: list[int], greedy: list[int]) -> list[int]:
            inputs = [self._row_input(seqs[r]) for r in rows]
            tokens, lps = sample_rows(take_rows(lg, rows), inputs, greedy)
            logprobs.update(zip(rows, lps, strict=True))
            return tokens

        picks = sample_isolated(logits, seqs, sample, lambda s, e: self.fail(s, e, outputs))
        now = time.monotonic()
        names = slot_names(self.hot_set) if any(s.request.return_attribution for s in seqs) else {}
        wanted = [(i, token) for i, token in picks if seqs[i].request.return_attribution]
        rows = [batch.logits_index[src[i]] for i, _ in wanted]
        try:  # one read-back for the whole batch
            found = attributions(ctx, rows, [t for _, t in wanted], names)
            attrs = dict(zip([i for i, _ in wanted], found, strict=True))
        except Exception:  # then row by row below, failing only the sequences it fails for
            attrs = {}
        for i, token in picks:
            seq = seqs[i]
            try:
                self._take(seq, token, logprobs.get(i), now)
                if seq.request.return_attribution:
                    found_i = attrs.get(i)
                    if found_i is None:
                        found_i = attribution(ctx, batch.logits_index[src[i]], token, names)
                    seq.attribution.append(found_i)
                self._finish_or_stream(seq, self._check_stop(seq, token), outputs)
            except Exception as exc:
                self.fail(seq, exc, outputs)

    def _finish_or_stream(
        self, seq: Sequence, reason: FinishReason | None, outputs: Outputs
    ) -> None:
        """End `seq` for `reason`, or hand the client what it has not seen yet."""
        if reason is not None:
            self.finish(seq, reason, outputs)
        else:
            out = self._increment(seq, finished=False)
            if out is not None:
                outputs.append(out)

    def _take(self, seq: Sequence, token: int, logprob: TokenLogprob | None, now: float) -> None:
        """`token` is `seq`'s next output: its grammar advances, its logprob is kept."""
        seq.output_ids.append(token)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        if seq.first_token_at is None:
            seq.first_token_at = now

    def _verify(
        self,
        seq: Sequence,
        start: int,
        rows: torch.Tensor,
        ctx: LoRAContext | None,
        outputs: Outputs,
    ) -> None:
        """Keep the longest prefix of `seq`'s draft the target agrees with, plus the target's
        own next token. Row j holds the logits after the last token and j draft tokens; each
        row is sampled (or, with temperature, accepted by the rejection rule) with the history
        as it stands after the rows before it, so masks, penalties, stops and logprobs see
        exactly what they see without speculation."""
        draft = seq.draft
        try:
            now = time.monotonic()
            names = slot_names(self.hot_set) if seq.request.return_attribution else {}
            accepted, emitted, reason = 0, 0, None
            for j in range(len(draft) + 1):
                proposal = draft[j] if j < len(draft) else None
                token, logprob = verify_row(rows[j], self._row_input(seq), proposal)
                self._take(seq, token, logprob, now)
                if seq.request.return_attribution:
                    seq.attribution.append(attribution(ctx, start + j, token, names))
                emitted += 1
                accepted += token == proposal
                reason = self._check_stop(seq, token)
                if reason is not None or token != proposal:
                    break
            self.scheduler.commit(seq, emitted)  # the last token and the accepted draft
            self.scheduler.release_draft(seq)
            assert self.drafter is not None and seq.spec is not None
            self.drafter.accepted(seq.spec, seq.route, len(draft), accepted)
            self.summaries.record(ctx, [seq] * emitted, list(range(start, start + emitted)))
            self._finish_or_stream(seq, reason, outputs)
        except Exception as exc:
            self.fail(seq, exc, outputs)

    def _record_prompt_logprobs(self, batch: StepBatch, logits: torch.Tensor) -> None:
        """Logprob of each prompt token given the ones before it (raw logits, k top ones)."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        for row, (seq, pos) in enumerate(batch.prompt_logits_owner):
            k = seq.request.sampling.prompt_logprobs or 0
            seq.prompt_logprobs.append(token_logprob(lp[row], seq.prompt_ids[pos + 1], k))

    def _row_input(self, seq: Sequence) -> RowInput:
        """The sampler's view of one sequence: its params, seed stream, history and masks."""
        p = seq.request.sampling
        banned: list[int] = []
        if len(seq.output_ids) < p.min_tokens:
            banned = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids))
        return RowInput(
            params=p,
            generator=seq.generator,
            prompt_ids=seq.prompt_ids,
            output_ids=seq.output_ids,
            banned=banned,
            allowed=seq.grammar.allowed() if seq.grammar is not None else None,
        )

    # ----- text and stops -------------------------------------------------------------------
    def _check_stop(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.request.sampling
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            if token in p.stop_token_ids:
                seq.stop_reason = token
                if p.include_stop_str_in_output:
                    seq.text, _ = self._detokenizer(seq).update(seq.output_ids, 1 << 62)
            return "stop"
        detok = self._detokenizer(seq)
        if seq.grammar is not None and seq.grammar.terminated:
            seq.text, _ = detok.update(seq.output_ids, search_from=1 << 62)
            return "stop"
        if len(seq.output_ids) <= p.min_tokens:  # stop strings only count after min_tokens
            seq.text, _ = detok.update(seq.output_ids, search_from=1 << 62)
            seq.stop_search_from = len(seq.text)
        else:
            seq.text, hit = detok.update(seq.output_ids, search_from=seq.stop_search_from)
            if hit is not None:
                seq.stop_reason = hit
                return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.total_len >= self.max_len:
            return "length"
        return None

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        detok = self._detok.get(seq.request_id)
        if detok is None:
            # image codes come back as images, not as text
            hidden = HIDDEN_IDS if seq.request.image_output else frozenset()
            p = seq.request.sampling
            detok = IncrementalDetokenizer(
                self.tokenizer, p.stop, hidden, p.include_stop_str_in_output
            )
            self._detok[seq.request_id] = detok
        return detok

    def _increment(
        self, seq: Sequence, finished: bool, summary: GateSummary | None = None
    ) -> GenerationOutput | None:
        detok = self._detokenizer(seq)
        safe = detok.safe_length(seq.text, finished)
        delta = seq.text[seq.emitted_chars : safe] if safe > seq.emitted_chars else ""
        new_ids = seq.output_ids[seq.emitted_tokens :]
        if not delta and not new_ids and not finished:
            return None
        end = len(seq.output_ids)
        attrs = (
            seq.attribution[seq.emitted_tokens : end] if seq.request.return_attribution else None
        )
        lps = (
            seq.logprobs[seq.emitted_tokens : end]
            if seq.request.sampling.logprobs is not None
            else None
        )
        prompt_logprobs = None
        if seq.request.sampling.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            prompt_logprobs = seq.prompt_logprobs
            seq.prompt_logprobs_sent = True
        seq.emitted_chars = max(seq.emitted_chars, safe)
        seq.emitted_tokens = end
        return GenerationOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            text_delta=delta,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            stop_reason=seq.stop_reason if finished else None,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=end,
            attribution=attrs,
            logprobs=lps,
            prompt_logprobs=prompt_logprobs,
            prompt_token_ids=list(seq.prompt_ids) if prompt_logprobs is not None else None,
            gate_summary=summary,
            error=seq.error,
            exception=seq.exception,
        )

    # ----- endings --------------------------------------------------------------------------
    def final(self, seq: Sequence, reason: FinishReason) -> GenerationOutput:
        """The closing output of a request that ends without new text (abort, error)."""
        seq.finish_reason = reason
        seq.status = SeqStatus.FINISHED
        self._detok.pop(seq.request_id, None)
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
        seq.finish_reason = reason
        seq.status = SeqStatus.FINISHED
        if reason not in ("abort", "error"):
            out = self._increment(seq, finished=True, summary=self.summaries.take(seq))
            if out is not None:
                outputs.append(out)
        else:
            outputs.append(self.final(seq, reason))
        self._detok.pop(seq.request_id, None)
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
