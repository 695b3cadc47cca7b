"""The synchronous engine core: admission, batch formation, one forward per step, sampling.

Continuous batching: requests join and leave between steps. A step packs every running decode
(one token each) first, then prefill chunks, into one flat token batch; every projection and every
routed-LoRA delta runs once over all of them, whatever each token's route.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from molora_runtime.config import EngineConfig
from molora_runtime.engine.detokenizer import IncrementalDetokenizer
from molora_runtime.engine.isolation import culprit_error, run_isolated, sample_isolated
from molora_runtime.engine.logits_processing import RowInput, sample_rows, token_logprob
from molora_runtime.engine.sequence import SeqStatus, Sequence
from molora_runtime.engine.structured import GrammarCompiler
from molora_runtime.engine.types import (
    EngineStats,
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    TokenAttribution,
)
from molora_runtime.errors import (
    AdapterLoadError,
    EngineOverloadedError,
    InvalidRequestError,
    SequenceStepError,
)
from molora_runtime.lora.composition import CompositionError, read_composition_config
from molora_runtime.lora.context import LoRAContext
from molora_runtime.lora.hotset import HotSet
from molora_runtime.lora.routing import RouteSegment, build_lora_context, check_route_width
from molora_runtime.lora.source import AdapterSource
from molora_runtime.model.attention_meta import KVCache, PrefillSegment, step_attention
from molora_runtime.model.loader import load_model
from molora_runtime.model.registry import resolve_model_path
from molora_runtime.routes import LearnedRoute, check_route_limits

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(config: EngineConfig) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), where bf16 GEMMs run
    about 3x faster than fp32 ones; elsewhere bf16 is emulated and slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def pick_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on CUDA and on CPUs with native bf16 math, else fp32."""
    if config.dtype == "auto":
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    return _DTYPES[config.dtype]


def load_tokenizer(folder: Path) -> Any | None:
    if (
        not (folder / "tokenizer.json").is_file()
        and not (folder / "tokenizer_config.json").is_file()
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


class LLMEngine:
    """One model, one hot-set, one KV cache; driven by `step()` (not thread-safe except
    `add_request`/`abort`, which only enqueue)."""

    def __init__(self, config: EngineConfig, source: AdapterSource) -> None:
        self.config = config
        self.device = pick_device(config)
        self.dtype = pick_dtype(config, self.device)
        self.model_path = resolve_model_path(config.model)
        self.model = load_model(
            self.model_path, self.dtype, self.device, max_positions=config.max_model_len
        )
        self.arch = self.model.arch
        self.model_id = config.model
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_ids = set(self.arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(int(self.tokenizer.eos_token_id))
        self.max_model_len = min(config.max_model_len, self.arch.max_position_embeddings)
        rows = config.max_num_seqs + 1  # the extra row absorbs padded graph replays
        self.kv = KVCache(
            self.arch.num_layers,
            rows,
            self.max_model_len,
            self.arch.num_kv_heads,
            self.arch.head_dim,
            self.dtype,
            self.device,
        )
        self.scratch_row = rows - 1
        served = [config.model, str(self.model_path), self.arch.name_or_path]
        self.hot_set = HotSet(
            self.model, config.hot_set, source, self.device, self.dtype, served_names=served
        )
        self.width = config.hot_set.max_adapters_per_token
        self._free_rows = list(range(config.max_num_seqs))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._incoming: deque[Sequence] = deque()
        self._aborts: deque[str] = deque()
        self._lock = threading.Lock()
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._gate_stats: dict[str, torch.Tensor] = {}
        self._seed_gen = torch.Generator().manual_seed(config.seed)
        self.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size, sorted(self.eos_ids))
        self.forked_prefills = 0  # sibling choices (n > 1) that reused a prefill
        self.graph_runner = None
        if config.enable_cuda_graph and self.device.type == "cuda":
            from molora_runtime.engine.cuda_graph import CudaGraphRunner

            self.graph_runner = CudaGraphRunner(self)
            self.graph_runner.capture_all()

    # ----- requests -------------------------------------------------------------------------
    def encode_prompt(self, req: GenerationRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
            bad = [t for t in ids if not 0 <= t < self.arch.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.arch.vocab_size})"
                )
            return ids
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send prompt_token_ids")
        if req.messages is not None:
            try:
                text = self.tokenizer.apply_chat_template(
                    req.messages, add_generation_prompt=True, tokenize=False
                )
            except Exception as exc:  # template errors are the caller's messages' fault
                raise InvalidRequestError(f"cannot apply the chat template: {exc}") from exc
        else:
            assert req.prompt is not None
            text = req.prompt
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except Exception as exc:  # e.g. a lone surrogate: the text is not valid Unicode
            raise InvalidRequestError(f"cannot tokenize the prompt: {type(exc).__name__}") from exc

    def validate_request(self, req: GenerationRequest) -> list[int]:
        """Cheap checks before queueing; returns the prompt ids."""
        ids = self.encode_prompt(req)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; this model's limit is {self.max_model_len} "
                "tokens for prompt and completion together"
            )
        p = req.sampling
        if not p.clamp_to_context and len(ids) + p.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{len(ids) + p.max_tokens} were requested ({len(ids)} in the prompt, "
                f"{p.max_tokens} in max_tokens)"
            )
        vocab = self.arch.vocab_size
        bad = [t for t in p.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
        bad = [t for t in p.logit_bias if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
        if req.response_format is not None:
            self.grammars.compile(req.response_format)  # an invalid schema fails here: a 400
        route = req.route
        try:
            check_route_limits(route, self.config.routes, vocab)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        for name in route.adapters():
            self.hot_set.check_adapter(name)  # raises AdapterNotFoundError; no download
        comp_top_k = None
        needed = list(route.adapters())
        if isinstance(route, LearnedRoute):
            folder = self.hot_set.source.composition_path(route.composition)
            try:
                comp_config = read_composition_config(route.composition, folder)
            except CompositionError as exc:
                raise AdapterLoadError(str(exc)) from exc
            comp_top_k = comp_config.top_k
            if route.top_k is not None and route.top_k > len(comp_config.adapters):
                raise InvalidRequestError(
                    f"top_k={route.top_k} exceeds the {len(comp_config.adapters)} experts of "
                    f"composition {route.composition!r}"
                )
            needed = list(dict.fromkeys(needed + comp_config.adapters))
        check_route_width(route, self.width, comp_top_k)
        if len(needed) > self.hot_set.num_slots:
            raise InvalidRequestError(
                f"the route needs {len(needed)} adapters at once but the hot-set has "
                f"{self.hot_set.num_slots} slots"
            )
        return ids

    def add_request(self, req: GenerationRequest, prompt_ids: list[int] | None = None) -> None:
        """Validate and enqueue; raises InvalidRequestError / AdapterNotFoundError /
        EngineOverloadedError without touching anything else."""
        if prompt_ids is None:
            prompt_ids = self.validate_request(req)
        with self._lock:
            if not self._has_room():
                raise EngineOverloadedError(
                    f"{self.config.max_queue_len} requests are already waiting; retry later"
                )
            seed = req.sampling.seed
            gen = None
            if req.sampling.temperature > 0:
                if seed is None:
                    seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))
                gen = torch.Generator().manual_seed(seed)
            seq = Sequence(request=req, prompt_ids=prompt_ids, generator=gen)
            if req.response_format is not None:
                seq.grammar = self.grammars.new_state(req.response_format)
            self._incoming.append(seq)

    def has_room(self) -> bool:
        """Whether `add_request` would accept one more request now (not overloaded)."""
        with self._lock:
            return self._has_room()

    def _has_room(self) -> bool:
        # Requests that will start at the next step (free KV rows) do not count as queued.
        capacity = self.config.max_queue_len + len(self._free_rows)
        return len(self.waiting) + len(self._incoming) < capacity

    def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._incoming or self._aborts)

    def stats(self) -> EngineStats:
        c = self.hot_set.counters
        host = self.hot_set.host
        return EngineStats(
            running=len(self.running),
            waiting=len(self.waiting) + len(self._incoming),
            hot_set=self.hot_set.loaded(),
            pinned=self.hot_set.pinned(),
            free_slots=self.hot_set.free_slots(),
            num_slots=self.hot_set.num_slots,
            hot_set_hits=c.hits,
            hot_set_misses=c.misses,
            hot_set_evictions=c.evictions,
            hot_set_loads=c.loads,
            compositions=self.hot_set.compositions(),
            host_resident=sorted(host.resident()),
            host_loading=host.loading(),
            host_bytes=host.nbytes,
            host_fetches=host.counters.fetches,
            host_fetch_failures=host.counters.failures,
        )

    def pop_load_latencies(self) -> list[float]:
        """Adapter load times (seconds) recorded since the last call (for the metrics exporter).

        Slicing then deleting the prefix keeps appends that land meanwhile from the step thread.
        """
        pending = self.hot_set.counters.load_seconds
        n = len(pending)
        taken = pending[:n]
        del pending[:n]
        return taken

    def pop_gate_stats(self) -> dict[str, list[list[int]]]:
        """Per composition, [layer][expert] token counts since the last call."""
        out = {k: v.long().tolist() for k, v in self._gate_stats.items()}
        self._gate_stats.clear()
        return out

    # ----- the step -------------------------------------------------------------------------
    def step(self) -> list[GenerationOutput]:
        outputs: list[GenerationOutput] = []
        self._drain_incoming(outputs)
        self._admit(outputs)
        if not self.running:
            if self.waiting:  # their adapters are loading in the background: sleep, not spin
                self.hot_set.host.wait(0.05)
            return outputs
        batch = self._form_batch()
        run_isolated(
            batch,
            size=lambda b: len(b.segments),
            forward=self._forward,
            after=lambda b, res: self._after_forward(b, res[0], res[1], outputs),
            fail=lambda b, exc: self._fail(b.segments[0][0], exc, outputs),
            split=_Batch.halves,
        )
        try:
            self._prefetch()
        except Exception:  # prefetch is an optimisation: a store hiccup must not fail the step
            log.debug("prefetch failed", exc_info=True)
        return outputs

    def _drain_incoming(self, outputs: list[GenerationOutput]) -> None:
        with self._lock:
            while self._incoming:
                self.waiting.append(self._incoming.popleft())
        aborted = set()
        while self._aborts:
            aborted.add(self._aborts.popleft())
        if not aborted:
            return
        for seq in [s for s in self.waiting if s.request_id in aborted]:
            self.waiting.remove(seq)
            seq.status = SeqStatus.FINISHED
            outputs.append(self._final(seq, "abort"))
        for seq in [s for s in self.running if s.request_id in aborted]:
            self._finish(seq, "abort", outputs)

    # ----- n > 1: one prefill, forked into the siblings' KV rows ------------------------------
    def _fork_leader(self, seq: Sequence) -> Sequence | None:
        """The running sibling whose prefill `seq` waits for (same prompt and route), if any."""
        lead_id = seq.request.prefill_from
        if lead_id is None or seq.num_computed or seq.output_ids:
            return None
        for lead in self.running:
            if (
                lead.request_id == lead_id
                and lead.in_prefill
                and lead.prompt_ids == seq.prompt_ids
                and lead.route == seq.route
            ):
                return lead
        return None

    def _fork_prefills(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """`seqs` plus the siblings of any that just finished its prefill (their KV rows get a
        copy of its cache), and for each, the logits row it samples from."""
        src = list(range(len(seqs)))
        out = list(seqs)
        waiting = [s for s in self.running if s.request.prefill_from and s.num_computed == 0]
        if not waiting:
            return out, src
        for i, lead in enumerate(seqs):
            if lead.output_ids or lead.num_computed != len(lead.prompt_ids):
                continue
            for sib in waiting:
                if (
                    sib.request.prefill_from == lead.request_id
                    and sib.row is not None
                    and lead.row is not None
                    and sib.prompt_ids == lead.prompt_ids
                    and sib.route == lead.route
                ):
                    self.kv.move_row(lead.row, sib.row, lead.num_computed)
                    sib.num_computed = lead.num_computed
                    sib.prompt_logprobs = list(lead.prompt_logprobs)
                    self.forked_prefills += 1
                    out.append(sib)
                    src.append(i)
        return out, src

    def _leaders_first(self) -> None:
        """Queue a sibling group's leader ahead of its siblings, so they start together."""
        if not any(s.request.prefill_from for s in self.waiting):
            return
        by_id = {s.request_id: s for s in self.waiting}
        order: list[Sequence] = []
        placed: set[str] = set()
        for seq in self.waiting:
            lead = by_id.get(seq.request.prefill_from or "")
            for s in (lead, seq):
                if s is not None and s.request_id not in placed:
                    order.append(s)
                    placed.add(s.request_id)
        self.waiting = deque(order)

    def _needs(self, seq: Sequence) -> list[str]:
        return seq.route.adapters()

    def _admit(self, outputs: list[GenerationOutput]) -> None:
        """Move waiting requests to running while KV rows and hot-set slots allow (FIFO; a
        request whose adapters cannot all be resident now waits, later ones may pass it)."""
        held: list[Sequence] = []
        self._leaders_first()
        # With nothing decoding, loading an adapter inside the step stalls no one: load it
        # now. Otherwise a cold adapter loads in the background while the batch goes on.
        idle = not self.running
        while self.waiting and self._free_rows:
            seq = self.waiting.popleft()
            try:
                if not self._bind_adapters(seq, wait_for_loads=not idle):
                    held.append(seq)
                    if len(held) >= 8:
                        break
                    continue
            except Exception as exc:  # this request's adapters, store or route: it alone fails
                seq.status = SeqStatus.FINISHED
                seq.exception = exc
                seq.error = str(exc) or type(exc).__name__
                outputs.append(self._final(seq, "error"))
                continue
            seq.row = self._free_rows.pop(0)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        for seq in reversed(held):
            self.waiting.appendleft(seq)

    def _bind_adapters(self, seq: Sequence, wait_for_loads: bool = True) -> bool:
        comp = seq.composition
        needs = self._needs(seq)
        if comp is not None and not self.hot_set.can_hold_composition(comp):
            return False  # every gate slot is held by running requests: wait, do not fail
        if comp is not None:
            cslot, experts = self.hot_set.ensure_composition(comp)
            needs = list(dict.fromkeys(needs + experts))
        if not self.hot_set.can_hold(needs):
            return False
        if wait_for_loads and not self.hot_set.ready(needs):
            return False  # parsing in the background: wait without holding back the batch
        self.hot_set.ensure(needs)
        self.hot_set.acquire(needs)
        seq.adapters = needs
        if comp is not None:
            self.hot_set.acquire_composition(comp)
            self.hot_set.bind_experts(cslot)
        return True

    def _form_batch(self) -> _Batch:
        budget = self.config.max_num_batched_tokens
        # Decodes in KV-row order: rows are kept compact, so they form one span (a view).
        decodes = sorted((s for s in self.running if not s.in_prefill), key=lambda s: s.row)
        prefills = [s for s in self.running if s.in_prefill and self._fork_leader(s) is None]
        batch = _Batch()
        for seq in decodes:
            batch.add(seq, seq.num_computed, 1, produces_logits=True)
        budget -= len(decodes)
        for seq in prefills:
            if budget <= 0:
                break
            remaining = len(seq.prompt_ids) - seq.num_computed
            n = min(remaining, budget)
            batch.add(seq, seq.num_computed, n, produces_logits=(n == remaining))
            budget -= n
        batch.num_decode = len(decodes)
        return batch

    def _forward(self, batch: _Batch) -> tuple[torch.Tensor, LoRAContext | None]:
        dev = self.device
        ids = torch.tensor(batch.token_ids, dtype=torch.long, device=dev)
        segments = [
            RouteSegment(seq.route, ids[start : start + n]) for seq, start, n in batch.segments
        ]
        record = any(
            seq.request.return_attribution or isinstance(seq.route, LearnedRoute)
            for seq, _, _ in batch.segments
        )
        ctx = build_lora_context(segments, self.hot_set, self.width, dev, record_layers=record)
        if (
            self.graph_runner is not None
            and batch.num_decode == len(batch.segments)
            and self.graph_runner.can_run(batch.num_decode, ctx)
        ):
            logits = self.graph_runner.run(batch, ids, ctx)
            return logits, ctx
        meta = step_attention(
            batch.rows, batch.positions, batch.num_decode, batch.prefill_segments, dev
        )
        # Prompt positions of requests asking for prompt logprobs ride after the sampled rows.
        logits_index = torch.tensor(
            batch.logits_index + batch.prompt_logits_index, dtype=torch.long, device=dev
        )
        with torch.inference_mode():
            logits = self.model(ids, meta, self.kv, ctx, logits_index)
        return logits, ctx

    def _after_forward(
        self,
        batch: _Batch,
        logits: torch.Tensor,
        ctx: LoRAContext | None,
        outputs: list[GenerationOutput],
    ) -> None:
        for seq, _, n in batch.segments:
            seq.num_computed += n
        if batch.prompt_logits_index:
            sampled_rows = len(batch.logits_index)
            self._record_prompt_logprobs(batch, logits[sampled_rows:])
            logits = logits[:sampled_rows]
        if ctx is not None and ctx.has_learned and ctx.layer_tables:
            try:
                self._record_gate_stats(ctx)
            except Exception:  # observability only; never fails the step
                log.debug("gate stats failed", exc_info=True)
        sampled_seqs, src = self._fork_prefills(batch.logits_seqs)
        if not sampled_seqs:
            return
        if len(src) != len(batch.logits_seqs):
            logits = logits[torch.tensor(src, dtype=torch.long, device=logits.device)]
        logprobs: dict[int, Any] = {}

        def sample(lg: torch.Tensor, rows: list[int]) -> list[int]:
            tokens, lps = sample_rows(lg[rows], [self._row_input(sampled_seqs[r]) for r in rows])
            logprobs.update(zip(rows, lps, strict=True))
            return tokens

        picks = sample_isolated(
            logits, sampled_seqs, sample, lambda seq, exc: self._fail(seq, exc, outputs)
        )
        now = time.monotonic()
        slot_names = (
            self._slot_names() if any(s.request.return_attribution for s in sampled_seqs) else {}
        )
        for i, token in picks:
            seq = sampled_seqs[i]
            try:
                seq.output_ids.append(token)
                if seq.grammar is not None:
                    seq.grammar.accept(token)
                if logprobs.get(i) is not None:
                    seq.logprobs.append(logprobs[i])
                if seq.first_token_at is None:
                    seq.first_token_at = now
                if seq.request.return_attribution:
                    seq.attribution.append(
                        self._attribution(ctx, batch.logits_index[src[i]], token, slot_names)
                    )
                reason = self._check_stop(seq, token)
                if reason is not None:
                    self._finish(seq, reason, outputs)
                else:
                    out = self._increment(seq, finished=False)
                    if out is not None:
                        outputs.append(out)
            except Exception as exc:
                self._fail(seq, exc, outputs)

    def _record_prompt_logprobs(self, batch: _Batch, logits: torch.Tensor) -> None:
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

    def _check_stop(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.request.sampling
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            return "stop"
        if seq.grammar is not None and seq.grammar.terminated:
            seq.text, _ = self._detokenizer(seq).update(seq.output_ids, search_from=1 << 62)
            return "stop"
        detok = self._detokenizer(seq)
        if len(seq.output_ids) <= p.min_tokens:  # stop strings only count after min_tokens
            seq.text, _ = detok.update(seq.output_ids, search_from=1 << 62)
            seq.stop_search_from = len(seq.text)
        else:
            seq.text, hit = detok.update(seq.output_ids, search_from=seq.stop_search_from)
            if hit:
                return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.total_len >= self.max_model_len:
            return "length"
        return None

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        detok = self._detok.get(seq.request_id)
        if detok is None:
            detok = IncrementalDetokenizer(self.tokenizer, seq.request.sampling.stop)
            self._detok[seq.request_id] = detok
        return detok

    def _increment(self, seq: Sequence, finished: bool) -> GenerationOutput | None:
        detok = self._detokenizer(seq)
        safe = detok.safe_length(seq.text, finished)
        delta = seq.text[seq.emitted_chars : safe] if safe > seq.emitted_chars else ""
        new_ids = seq.output_ids[seq.emitted_tokens :]
        if not delta and not new_ids and not finished:
            return None
        attribution = None
        if seq.request.return_attribution:
            attribution = seq.attribution[seq.emitted_tokens : len(seq.output_ids)]
        logprobs = None
        if seq.request.sampling.logprobs is not None:
            logprobs = seq.logprobs[seq.emitted_tokens : len(seq.output_ids)]
        prompt_logprobs = None
        if seq.request.sampling.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            prompt_logprobs = seq.prompt_logprobs
            seq.prompt_logprobs_sent = True
        seq.emitted_chars = max(seq.emitted_chars, safe)
        seq.emitted_tokens = len(seq.output_ids)
        return GenerationOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            text_delta=delta,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            attribution=attribution,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            prompt_token_ids=list(seq.prompt_ids) if prompt_logprobs is not None else None,
            error=seq.error,
            exception=seq.exception,
        )

    def _final(self, seq: Sequence, reason: FinishReason) -> GenerationOutput:
        seq.finish_reason = reason
        self._detok.pop(seq.request_id, None)
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

    def _finish(self, seq: Sequence, reason: FinishReason, outputs: list[GenerationOutput]) -> None:
        seq.finish_reason = reason
        seq.status = SeqStatus.FINISHED
        if reason not in ("abort", "error"):
            out = self._increment(seq, finished=True)
            if out is not None:
                outputs.append(out)
        else:
            outputs.append(self._final(seq, reason))
        self._detok.pop(seq.request_id, None)
        self.running.remove(seq)
        self.hot_set.release(seq.adapters)
        if seq.composition is not None:
            self.hot_set.release_composition(seq.composition)
        seq.adapters = []
        if seq.row is not None:
            self._free_rows.append(seq.row)
            seq.row = None
            self._compact_rows()
        self._free_rows.sort()

    def _compact_rows(self) -> None:
        """Keep running sequences in the lowest KV rows: move the top one into the lowest hole.

        Decode attention then reads one contiguous span of rows instead of gathering them
        every layer of every step; the move copies one sequence's cached KV once.
        """
        if not self._free_rows or not self.running:
            return
        hole = min(self._free_rows)
        top = max(self.running, key=lambda s: s.row if s.row is not None else -1)
        if top.row is None or top.row < hole:
            return
        self.kv.move_row(top.row, hole, top.num_computed)
        self._free_rows.remove(hole)
        self._free_rows.append(top.row)
        top.row = hole

    def _fail(self, seq: Sequence, exc: BaseException, outputs: list[GenerationOutput]) -> None:
        """End one running sequence with its own error; its KV row is wiped (NaN K/V would
        survive masking in the next owner's attention) and its slot references released."""
        if seq.status is SeqStatus.FINISHED or seq not in self.running:
            return
        seq.exception = culprit_error(exc)
        seq.error = str(seq.exception)
        if seq.row is not None:
            self.kv.k[:, seq.row].zero_()
            self.kv.v[:, seq.row].zero_()
        self._finish(seq, "error", outputs)

    def fail_running(self, message: str) -> list[GenerationOutput]:
        """Last resort after a step failed outside any one sequence: end every running and
        waiting request with `message` (never another request's error text)."""
        outputs: list[GenerationOutput] = []
        for seq in list(self.running):
            self._fail(seq, SequenceStepError(message), outputs)
        with self._lock:
            while self._incoming:
                self.waiting.append(self._incoming.popleft())
        while self.waiting:
            seq = self.waiting.popleft()
            seq.status = SeqStatus.FINISHED
            seq.exception = SequenceStepError(message)
            seq.error = message
            outputs.append(self._final(seq, "error"))
        return outputs

    def _prefetch(self) -> None:
        """Warm empty slots with adapters of queued requests (never evicts)."""
        for seq in list(self.waiting)[:4]:
            self.hot_set.prefetch(self._needs(seq))

    # ----- routing observability --------------------------------------------------------------
    def _slot_names(self) -> dict[int, str]:
        return {self.hot_set.slot_of(n): n for n in self.hot_set.loaded()}

    def _attribution(
        self, ctx: LoRAContext | None, index: int, token: int, names: dict[int, str]
    ) -> TokenAttribution:
        if ctx is None or not ctx.layer_tables:
            return TokenAttribution(token_id=token, adapters={})
        slots = torch.stack([t[0][index] for t in ctx.layer_tables]).cpu()
        weights = torch.stack([t[1][index] for t in ctx.layer_tables]).float().cpu()
        totals: dict[str, float] = {}
        for s, w in zip(slots.flatten().tolist(), weights.flatten().tolist(), strict=True):
            if s > 0 and w != 0.0:
                name = names.get(s, f"slot{s}")
                totals[name] = totals.get(name, 0.0) + w
        n_layers = len(ctx.layer_tables)
        return TokenAttribution(
            token_id=token, adapters={k: round(v / n_layers, 4) for k, v in totals.items()}
        )

    def _record_gate_stats(self, ctx: LoRAContext) -> None:
        assert ctx.comp_idx is not None and ctx.gates is not None
        slots = torch.stack([t[0] for t in ctx.layer_tables])  # [L, T, W]
        weights = torch.stack([t[1] for t in ctx.layer_tables])
        for comp in self.hot_set.compositions():
            c = self.hot_set.comp_slot_of(comp)
            mask = ctx.comp_idx == c
            if not bool(mask.any()):
                continue
            k = int(ctx.gates.num_experts[c])
            experts = ctx.gates.expert_slots[c, :k]
            hit = (slots[:, mask, :, None] == experts) & (weights[:, mask, :, None] > 0)
            counts = hit.sum(dim=(1, 2)).cpu()  # [L, K]
            prev = self._gate_stats.get(comp)
            self._gate_stats[comp] = (
                counts if prev is None or prev.shape != counts.shape else prev + counts
            )


class _Batch:
    """Host-side description of one step's flat token batch."""

    @staticmethod
    def halves(batch: _Batch) -> list[_Batch]:
        """The batch's sequences in two sub-batches (decodes first in each, as `_form_batch`),
        rebuilt from the sequences' unchanged state: nothing advances until `_after_forward`."""
        segs = batch.segments
        mid = len(segs) // 2
        makes_logits = {id(s) for s in batch.logits_seqs}
        parts = []
        for group in (segs[:mid], segs[mid:]):
            part = _Batch()
            for seq, _, n in group:
                part.add(seq, seq.num_computed, n, produces_logits=id(seq) in makes_logits)
            part.num_decode = sum(1 for seq, _, _ in group if not seq.in_prefill)
            parts.append(part)
        return parts

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.positions: list[int] = []
        self.rows: list[int] = []
        self.segments: list[tuple[Sequence, int, int]] = []  # (seq, start index in batch, n)
        self.prefill_segments: list[PrefillSegment] = []
        self.logits_index: list[int] = []
        self.logits_seqs: list[Sequence] = []
        self.prompt_logits_index: list[int] = []  # prompt_logprobs: batch index of position p
        self.prompt_logits_owner: list[tuple[Sequence, int]] = []  # (seq, p)
        self.num_decode = 0

    def add(self, seq: Sequence, pos: int, n: int, produces_logits: bool) -> None:
        start = len(self.token_ids)
        assert seq.row is not None
        self.token_ids.extend(seq.tokens(pos, pos + n))
        self.positions.extend(range(pos, pos + n))
        self.rows.extend([seq.row] * n)
        self.segments.append((seq, start, n))
        if seq.in_prefill:
            self.prefill_segments.append(PrefillSegment(start, n, seq.row, pos))
            if seq.request.sampling.prompt_logprobs is not None:
                last = len(seq.prompt_ids) - 1  # its logits sample the first output token
                for i in range(n):
                    if pos + i < last:
                        self.prompt_logits_index.append(start + i)
                        self.prompt_logits_owner.append((seq, pos + i))
        if produces_logits:
            self.logits_index.append(start + n - 1)
            self.logits_seqs.append(seq)
