"""Each request's text while it runs: what its tokens decode to, whether a token ends it, and the
increment the client has not seen yet.

Stop strings are held back (at most the longest stop string minus one character) so they never
leak into the stream; the detokenizer decodes only a short window per token (prefix/read
offsets).
"""

from __future__ import annotations

from typing import Any

from molora_runtime.engine.outputs.detokenizer import IncrementalDetokenizer
from molora_runtime.engine.sequence import Sequence
from molora_runtime.engine.types import FinishReason, GateSummary, GenerationOutput
from molora_runtime.multimodal.prompt import HIDDEN_IDS

SEARCH_NOTHING = 1 << 62  # a stop-string search start past any text: decode only


class TextStream:
    """One incremental detokenizer per running request, and the stop rules over its text."""

    def __init__(self, tokenizer: Any, eos_ids: set[int], max_len: int) -> None:
        """`max_len`: tokens a sequence may reach (context limit and KV budget)."""
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_len = max_len
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """Why `seq` ends after taking `token` (a stop id, EOS, its grammar's end, a stop
        string, a length limit), with its text brought up to date; None if it goes on."""
        p = seq.request.sampling
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            if token in p.stop_token_ids:
                seq.stop_reason = token
                if p.include_stop_str_in_output:
                    seq.text, _ = self._detokenizer(seq).update(seq.output_ids, SEARCH_NOTHING)
            return "stop"
        detok = self._detokenizer(seq)
        if seq.grammar is not None and seq.grammar.terminated:
            seq.text, _ = detok.update(seq.output_ids, search_from=SEARCH_NOTHING)
            return "stop"
        if len(seq.output_ids) <= p.min_tokens:  # stop strings only count after min_tokens
            seq.text, _ = detok.update(seq.output_ids, search_from=SEARCH_NOTHING)
            seq.stop_search_from = len(seq.text)
        else:
            seq.text, hit = detok.update(seq.output_ids, search_from=seq.stop_search_from)
            if hit is not None:
                seq.stop_reason = hit
                return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.total_len >= self.max_len:
            return "length"
        return None

    def increment(
        self, seq: Sequence, finished: bool, summary: GateSummary | None = None
    ) -> GenerationOutput | None:
        """What `seq`'s client has not seen yet (text safe to emit, new ids, their logprobs and
        attribution, prompt logprobs once); None when there is nothing and it is not done."""
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

    def close(self, seq: Sequence) -> None:
        """Drop `seq`'s detokenizer (it ended)."""
        self._detok.pop(seq.request_id, None)

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
