"""The engine's state for one request while it is queued or running, and the two things done to
it every step: the sampler's view of it (`sampling_input`) and taking its next token."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from molora_runtime.engine.sampling.logits_processing import RowInput
from molora_runtime.engine.speculation.drafter import SpecState
from molora_runtime.engine.structured.grammar_state import GrammarState
from molora_runtime.engine.types import (
    FinishReason,
    GenerationRequest,
    TokenAttribution,
    TokenLogprob,
)
from molora_runtime.routes import RouteSpec


class SeqStatus(Enum):
    """Where a sequence is: queued (or preempted), in the running batch, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a sequence is itself: lists of them compare by identity
class Sequence:
    """One request's tokens, KV blocks, text, stops, logprobs and attribution so far."""

    request: GenerationRequest
    prompt_ids: list[int]
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)  # KV blocks while running
    num_computed: int = 0  # tokens whose K/V are in the cache
    identity: bytes = b""  # route identity (prefix-cache key), set at admission
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of full blocks
    recompute_len: int = 0  # after a preemption: tokens to prefill again (prompt + outputs)
    preemptions: int = 0
    adapters: list[str] = field(default_factory=list)  # hot-set adapters held while running
    text: str = ""  # detokenized output so far (stop strings already cut)
    emitted_chars: int = 0
    grammar: GrammarState | None = None  # response_format's matcher
    stop_search_from: int = 0  # stop strings count from this character on (min_tokens)
    emitted_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None
    exception: BaseException | None = None  # what ended it, for the serving layer's status
    attribution: list[TokenAttribution] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, if asked
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])
    prompt_logprobs_sent: bool = False
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    started_at: float | None = None  # first admission to running (queue time ends)
    spec: SpecState | None = None  # speculative decoding: this sequence's drafter state
    draft: list[int] = field(default_factory=list)  # tokens this step verifies after the last

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def route(self) -> RouteSpec:
        return self.request.route

    @property
    def composition(self) -> str | None:
        """The composition whose gate routes this sequence; None for a static route."""
        return self.route.gate_composition

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_len(self) -> int:
        """Tokens to prefill before decoding: the prompt, or all tokens after a preemption."""
        return max(len(self.prompt_ids), self.recompute_len)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_len

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and not all recorded yet (never twice on a recompute)."""
        asked = self.request.sampling.prompt_logprobs is not None
        return asked and len(self.prompt_logprobs) < len(self.prompt_ids)

    def token_at(self, index: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[index] if index < n else self.output_ids[index - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs, without copying the whole history."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def sampling_input(self, eos_ids: set[int]) -> RowInput:
        """The sampler's view of this sequence: its params, seed stream, history and masks
        (EOS and stop ids banned until `min_tokens`, the grammar's allowed tokens)."""
        p = self.request.sampling
        banned: list[int] = []
        if len(self.output_ids) < p.min_tokens:
            banned = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids))
        return RowInput(
            params=p,
            generator=self.generator,
            prompt_ids=self.prompt_ids,
            output_ids=self.output_ids,
            banned=banned,
            allowed=self.grammar.allowed() if self.grammar is not None else None,
        )

    def append_token(self, token: int, logprob: TokenLogprob | None, now: float) -> None:
        """`token` is this sequence's next output: its grammar advances, its logprob is kept."""
        self.output_ids.append(token)
        if self.grammar is not None:
            self.grammar.accept(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.first_token_at is None:
            self.first_token_at = now
