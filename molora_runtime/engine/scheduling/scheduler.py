"""Admission, the step's token budget, and preemption; knows sequences and blocks, not tensors.

A waiting request starts when a sequence slot is free, its adapters are resident (the hot-set's
background loads never stall the batch) and the block manager has blocks for its whole prefill
(cached prefix blocks count as there). Requests whose adapters are resident fill the batch past
those still waiting for a slot or a load, until the oldest of those has waited `adapter_wait_s`:
then admission goes in order and slots drain for it, so no adapter starves. A running decode
that needs a block when none is free preempts the most recently started sequence: its blocks are
freed and it waits at the head of the queue to prefill its prompt and outputs again (recompute),
so no running request is ever failed for lack of KV. Between tenants, admission follows `FairShare`: weighted order, and a tenant under
its share of slots or blocks takes them back from one over its share.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from molora_runtime.config import EngineConfig
from molora_runtime.engine.runner.step_batch import StepBatch
from molora_runtime.engine.scheduling.adapter_binding import AdapterBinder
from molora_runtime.engine.scheduling.block_manager import BlockManager
from molora_runtime.engine.scheduling.fair_share import FairShare
from molora_runtime.engine.sequence import SeqStatus, Sequence
from molora_runtime.engine.speculation.drafter import Drafter

Failed = list[tuple[Sequence, BaseException]]  # requests that could not start, and why
LOADS_PER_PASS = 8  # held requests whose adapters start loading in one admission pass
SCAN_PER_PASS = 64  # waiting requests one admission pass looks at


class Scheduler:
    """Owns the waiting queue and the running list; forms each step's `StepBatch`."""

    def __init__(
        self,
        config: EngineConfig,
        blocks: BlockManager,
        binder: AdapterBinder,
        identify: Callable[[Sequence], bytes],
        copy_blocks: Callable[[list[int], list[int]], None],
        drafter: Drafter | None = None,
        max_len: int | None = None,
    ) -> None:
        """`drafter`: proposes drafts to verify (speculative decoding; None: off); `max_len`:
        the positions a sequence may reach (drafts stop short of it)."""
        self.max_num_seqs = config.max_num_seqs
        self.drafter = drafter
        self.max_len = max_len if max_len is not None else config.max_model_len
        self.adapter_wait_s = config.adapter_wait_s
        self.token_budget = config.max_num_batched_tokens
        self.blocks = blocks
        self.binder = binder
        self.identify = identify
        self.copy_blocks = copy_blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserve = max(1, blocks.num_blocks // 100)  # admission watermark (vLLM's 1%)
        self.fair = FairShare(config.tenant_weights, config.max_num_seqs, blocks.num_blocks)
        self.fair_preemptions = 0  # sequences preempted to give a tenant its share
        self.preemptions = 0
        self.forked_prefills = 0  # sibling choices (n > 1) that reused a prefill
        self.queue_times: deque[float] = deque(maxlen=4096)  # arrival -> first start, seconds

    # ----- admission ------------------------------------------------------------------------
    def admit(self) -> Failed:
        """Move waiting requests to running while sequence slots, blocks and hot-set slots
        allow (FIFO; a request whose adapters cannot all be resident now waits, later ones may
        pass it; one that does not fit in the free blocks stops admission). Returns the
        requests that failed to start (their adapters, store or route), each on its own."""
        held: list[Sequence] = []
        failed: Failed = []
        self._leaders_first()
        if self.waiting:
            self.waiting = self.fair.order(self.waiting, self.running)
        # With nothing decoding, loading an adapter inside the step stalls no one: load it now.
        idle = not self.running
        while self.waiting:
            seq = self.waiting[0]
            if len(self.running) >= self.max_num_seqs and not self._take_back(seq, 0):
                break
            try:
                if len(held) >= LOADS_PER_PASS and not self.binder.resident(seq):
                    self.waiting.popleft()  # past this pass's loads: only resident ones start
                    if self._hold(held, seq):
                        break
                    continue
                if not seq.identity:
                    # The identity hashes the adapters' files: only once the background
                    # workers have them local, so a store download never runs in the step.
                    if not idle and not self.binder.files_ready(seq):
                        self.waiting.popleft()
                        if self._hold(held, seq):
                            break
                        continue
                    seq.identity = self.identify(seq)
                lookup = self._lookup_tokens(seq)
                # Keep a few blocks for running decodes to grow into (fewer preemptions); with
                # nothing running, any request that fits the budget must be able to start.
                reserve = self.reserve if self.running else 0
                if not self._fits(seq, lookup, reserve):
                    break
                self.waiting.popleft()
                if not self.binder.bind(seq, wait_for_loads=not idle):
                    if self._hold(held, seq):
                        break
                    continue
            except Exception as exc:  # this request's adapters, store or route: it alone fails
                if self.waiting and self.waiting[0] is seq:
                    self.waiting.popleft()
                seq.status = SeqStatus.FINISHED
                failed.append((seq, exc))
                continue
            seq.block_table, seq.num_computed = self.blocks.allocate(
                seq.identity, lookup, seq.prefill_len
            )
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if seq.started_at is None:
                seq.started_at = time.monotonic()
                self.queue_times.append(seq.started_at - seq.arrival)
        for seq in reversed(held):
            self.waiting.appendleft(seq)
        return failed

    def _fits(self, seq: Sequence, lookup: list[int], reserve: int) -> bool:
        """Whether `seq`'s prefill fits in the free blocks, after taking back blocks from
        tenants over their share if `seq`'s tenant is under its own."""
        need = self.blocks.blocks_for(seq.prefill_len)
        while not self.blocks.can_allocate(seq.identity, lookup, seq.prefill_len, reserve):
            if not self._take_back(seq, need):
                return False
        return True

    def _take_back(self, seq: Sequence, need_blocks: int) -> bool:
        """Preempt one sequence of a tenant over its share so `seq` (under its own) can start;
        the victim waits right behind `seq`. False when fairness gives `seq` nothing."""
        victim = self.fair.victim(seq, need_blocks, self.waiting, self.running)
        if victim is None:
            return False
        self.preempt(victim)
        self.waiting.popleft()  # `preempt` queued the victim first: it goes behind `seq`
        self.waiting.insert(1 if self.waiting and self.waiting[0] is seq else 0, victim)
        self.fair_preemptions += 1
        return True

    def _hold(self, held: list[Sequence], seq: Sequence) -> bool:
        """Set `seq` aside this step (its adapters are loading or their slots are taken);
        True when admission should stop looking further: enough were looked at, or one set
        aside has waited `adapter_wait_s` and the slots must drain for it."""
        held.append(seq)
        if len(held) >= SCAN_PER_PASS:
            return True
        return time.monotonic() - min(s.arrival for s in held) > self.adapter_wait_s

    def _lookup_tokens(self, seq: Sequence) -> list[int]:
        """Tokens the prefix cache may serve: none for prompt logprobs (each position must be
        computed) or for n > 1 siblings (they copy their leader's prefill)."""
        if seq.wants_prompt_logprobs or seq.request.prefill_from is not None:
            return []
        return seq.tokens(0, seq.prefill_len)

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

    # ----- the step's batch -----------------------------------------------------------------
    def schedule(self) -> StepBatch:
        """Every running decode (one token each, growing its block table, preempting when the
        pool is dry; with a draft, its last token and the draft), then prefill chunks within
        the token budget."""
        batch = StepBatch(self.blocks.block_size)
        decoding = [s for s in self.running if not s.in_prefill]
        drafter = self.drafter
        speculate = drafter is not None and drafter.active(len(decoding))
        verifying: list[Sequence] = []
        for seq in decoding:
            # (an earlier decode's block may have preempted it: then it is waiting again)
            if seq.status is SeqStatus.RUNNING and self._reserve_decode(seq):
                if speculate and self._draft(seq):
                    verifying.append(seq)
                else:
                    batch.add(seq, seq.num_computed, 1, produces_logits=True)
        for seq in verifying:
            if seq.status is SeqStatus.RUNNING:
                batch.add(seq, seq.num_computed, 1 + len(seq.draft), produces_logits=True)
        budget = self.token_budget - len(batch.token_ids)
        for seq in self.running:
            if budget <= 0:
                break
            if not seq.in_prefill or self._fork_leader(seq) is not None:
                continue
            remaining = seq.prefill_len - seq.num_computed
            n = min(remaining, budget)
            batch.add(seq, seq.num_computed, n, produces_logits=(n == remaining))
            budget -= n
        return batch

    def _reserve_decode(self, seq: Sequence) -> bool:
        """Room in `seq`'s block table for its next token; False if `seq` itself was preempted."""
        if seq.num_computed < len(seq.block_table) * self.blocks.block_size:
            return True
        while self.blocks.num_free == 0:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.blocks.append_block(seq.block_table)
        return True

    def _draft(self, seq: Sequence) -> bool:
        """Propose `seq`'s draft, cut to its remaining `max_tokens`, the positions it may reach
        and the blocks free now (a draft never preempts anyone); True if one is left."""
        assert self.drafter is not None
        if seq.spec is None:
            seq.spec = self.drafter.new_state(seq.request.tenant, seq.route)
        room = min(
            seq.request.sampling.max_tokens - len(seq.output_ids) - 1,
            self.max_len - 1 - seq.num_computed,
        )
        if room <= 0:
            return False
        draft = self.drafter.propose(seq.spec, seq.tokens(0, seq.total_len))[:room]
        bs = self.blocks.block_size
        while draft and seq.num_computed + len(draft) >= len(seq.block_table) * bs:
            if self.blocks.num_free <= self.reserve:
                draft = draft[: len(seq.block_table) * bs - 1 - seq.num_computed]
                break
            self.blocks.append_block(seq.block_table)
        seq.draft = draft
        return bool(draft)

    def release_draft(self, seq: Sequence) -> None:
        """After verification: blocks past the next token's position (held only for rejected
        draft tokens, never indexed) go back to the pool."""
        seq.draft = []
        keep = self.blocks.blocks_for(seq.num_computed + 1)
        if len(seq.block_table) > keep:
            tail = seq.block_table[keep:]
            del seq.block_table[keep:]
            self.blocks.free(tail)

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s KV and queue it first to recompute prompt + outputs."""
        seq.draft = []
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        self.binder.release(seq)
        seq.block_hashes = []
        seq.num_computed = 0
        seq.recompute_len = seq.total_len
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    # ----- after the forward ----------------------------------------------------------------
    def commit(self, seq: Sequence, n: int) -> None:
        """`n` more tokens of `seq` are in the cache: index its newly full blocks."""
        seq.num_computed += n
        full = seq.num_computed // self.blocks.block_size
        if self.blocks.prefix_caching and full > len(seq.block_hashes):
            self.blocks.register(
                seq.block_table, seq.identity, seq.tokens(0, seq.num_computed), seq.block_hashes
            )

    def finish(self, seq: Sequence) -> None:
        """`seq` is done: out of the running list, its blocks and adapters released."""
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.free(seq.block_table)
        self.binder.release(seq)

    def discard(self, seq: Sequence) -> list[int]:
        """Unindex the blocks only `seq` holds (its K/V may be bad); returns them to be wiped."""
        return self.blocks.forget(seq.block_table)

    # ----- n > 1: one prefill, copied into the siblings' blocks -------------------------------
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
                and lead.identity == seq.identity
            ):
                return lead
        return None

    def fork_prefills(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """`seqs` plus the siblings of any that just finished its prefill (their blocks get a
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
                    and sib.prompt_ids == lead.prompt_ids
                    and sib.route == lead.route
                    and sib.identity == lead.identity
                ):
                    nb = self.blocks.blocks_for(lead.num_computed)
                    self.copy_blocks(lead.block_table[:nb], sib.block_table[:nb])
                    self.commit(sib, lead.num_computed)
                    sib.prompt_logprobs = list(lead.prompt_logprobs)
                    self.forked_prefills += 1
                    out.append(sib)
                    src.append(i)
        return out, src
