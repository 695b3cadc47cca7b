"""The synchronous engine core, in nano-vllm's shape: schedule -> run -> postprocess, once a step.

Continuous batching over a paged KV cache: requests join and leave between steps. A step packs
every running decode (one token each, or its last token and a draft to verify) first, then
prefill chunks, into one flat token batch; every projection and every routed-LoRA delta runs
once over all of them, whatever each token's route. The rooms: `Scheduler` (admission, budgets,
preemption) over a `BlockManager` (blocks and the prefix cache) forms the `StepBatch`;
`ModelRunner` (KV cache, hot-set, CUDA graphs, step inputs) runs it; `OutputProcessor` (commit,
verification, sampling, text, stops, attribution, endings) postprocesses it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

import torch

from molora_runtime.config import EngineConfig
from molora_runtime.engine.device import load_tokenizer, pick_device, pick_dtype
from molora_runtime.engine.outputs.endings import Endings, Outputs
from molora_runtime.engine.outputs.output_processor import OutputProcessor
from molora_runtime.engine.request_check import RequestChecker
from molora_runtime.engine.route_stats.gate_telemetry import LayerTelemetry
from molora_runtime.engine.runner.cuda_graph import CudaGraphRunner
from molora_runtime.engine.runner.model_runner import ModelRunner
from molora_runtime.engine.runner.step_batch import StepBatch
from molora_runtime.engine.scheduling.adapter_binding import AdapterBinder
from molora_runtime.engine.scheduling.block_manager import BlockManager
from molora_runtime.engine.scheduling.route_key import (
    RouteIdentities,
    cache_identity,
    chain_block_hash,
)
from molora_runtime.engine.scheduling.scheduler import Scheduler
from molora_runtime.engine.sequence import Sequence
from molora_runtime.engine.speculation.drafter import Drafter
from molora_runtime.engine.structured.grammar_compiler import GrammarCompiler
from molora_runtime.engine.types import (
    BlockStats,
    EngineStats,
    GenerationRequest,
    RequestAdapters,
    StepOutputs,
)
from molora_runtime.errors import EngineOverloadedError, SequenceStepError
from molora_runtime.lora.hotset import HotSet
from molora_runtime.lora.source import AdapterSource
from molora_runtime.model.attention_meta import KVCache
from molora_runtime.model.chat_templates import use_chat_template
from molora_runtime.model.loader import load_model
from molora_runtime.model.model_paths import resolve_model_path

log = logging.getLogger(__name__)


class LLMEngine:
    """One model, one hot-set, one paged KV cache; driven by `step()` (not thread-safe except
    `add_request`/`abort`, which only enqueue)."""

    def __init__(self, config: EngineConfig, source: AdapterSource) -> None:
        self.config = config
        self.device = pick_device(config)
        self.dtype = pick_dtype(config, self.device)
        self.model_path = resolve_model_path(config.model)
        self.model = load_model(
            self.model_path, self.dtype, self.device, max_positions=config.max_model_len
        )
        if self.device.type == "cpu":
            # Verifying a draft must give each row the bits a plain decode gives it.
            invariant = config.speculative is not None and config.speculative.exact
            log.info("CPU base GEMMs run on %s", self.model.pack_cpu_weights(invariant))
        self.arch = arch = self.model.arch
        self.model_id = config.model
        self.tokenizer = load_tokenizer(self.model_path)
        use_chat_template(self.tokenizer, config.chat_template, config.model)
        self.eos_ids = set(arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(int(self.tokenizer.eos_token_id))
        self.max_model_len = min(config.max_model_len, arch.max_position_embeddings)
        served = [config.model, str(self.model_path), arch.name_or_path]
        self.runner = ModelRunner(
            config, self.model, source, served, self.max_model_len, self.dtype, self.device
        )
        self.block_manager = BlockManager(
            self.kv.num_blocks,
            self.kv.block_size,
            chain_block_hash,
            prefix_caching=config.enable_prefix_caching,
        )
        self.identities = RouteIdentities(str(self.model_path), source)
        spec = config.speculative
        self.drafter = Drafter(spec, self.model) if spec is not None else None
        self.scheduler = Scheduler(
            config,
            self.block_manager,
            AdapterBinder(self.hot_set),
            identify=self._cache_identity,
            copy_blocks=self.kv.copy_blocks,
            drafter=self.drafter,
            max_len=self.max_seq_len,
        )
        self.grammars = GrammarCompiler(
            self.tokenizer, arch.vocab_size, sorted(self.eos_ids), config.grammar
        )
        self.checker = RequestChecker(
            self.tokenizer,
            arch.vocab_size,
            self.max_model_len,
            self.max_seq_len,
            config.routes,
            self.hot_set,
            self.width,
            self.grammars,
        )
        self.outputs = OutputProcessor(
            self.tokenizer,
            self.eos_ids,
            self.max_seq_len,
            self.scheduler,
            self.hot_set,
            self.kv.zero_blocks,
            config.max_num_seqs,
            self.drafter,
        )
        self._incoming: deque[Sequence] = deque()
        self._aborts: deque[str] = deque()
        self._lock = threading.Lock()
        self._seed_gen = torch.Generator().manual_seed(config.seed)

    @property
    def waiting(self) -> deque[Sequence]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def forked_prefills(self) -> int:
        return self.scheduler.forked_prefills

    @property
    def kv(self) -> KVCache:
        return self.runner.kv

    @property
    def hot_set(self) -> HotSet:
        return self.runner.hot_set

    @property
    def width(self) -> int:
        """Adapters per token."""
        return self.runner.width

    @property
    def max_seq_len(self) -> int:
        """One sequence's reach (the KV budget)."""
        return self.runner.max_seq_len

    @property
    def graph_runner(self) -> CudaGraphRunner | None:
        """The runner's CUDA graphs; tests and benchmarks swap in their own (or none)."""
        return self.runner.graph_runner

    @graph_runner.setter
    def graph_runner(self, value: CudaGraphRunner | None) -> None:
        self.runner.graph_runner = value

    @property
    def endings(self) -> Endings:
        return self.outputs.endings

    def _cache_identity(self, seq: Sequence) -> bytes:
        """The prefix-cache key of `seq`: route identity salted with tenant and cache_salt."""
        req = seq.request
        return cache_identity(self.identities.identity(seq.route), req.tenant, req.cache_salt)

    # ----- requests -------------------------------------------------------------------------
    def encode_prompt(self, req: GenerationRequest) -> list[int]:
        """The request's prompt ids (chat template, images), without the other checks."""
        return self.checker.encode_prompt(req)

    def validate_request(self, req: GenerationRequest) -> list[int]:
        """Cheap checks before queueing; returns the prompt ids."""
        return self.checker.check(req)

    def add_request(
        self, req: GenerationRequest, prompt_ids: list[int] | None = None, grammar: Any = None
    ) -> None:
        """Validate and enqueue; raises InvalidRequestError / AdapterNotFoundError /
        EngineOverloadedError without touching anything else. `grammar`: the compiled
        response_format (compiled here, blocking, when not given)."""
        if prompt_ids is None:
            prompt_ids = self.validate_request(req)
        if req.response_format is not None and grammar is None:
            grammar = self.grammars.compile(req.response_format, req.tenant)
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
                seq.grammar = self.grammars.new_state(grammar)
            self._incoming.append(seq)

    def has_room(self) -> bool:
        """Whether `add_request` would accept one more request now (not overloaded)."""
        with self._lock:
            return self._has_room()

    def _has_room(self) -> bool:
        # Requests that can start at the next step (free sequence slots) do not count as queued.
        free = max(0, self.config.max_num_seqs - len(self.running))
        capacity = self.config.max_queue_len + free
        return len(self.waiting) + len(self._incoming) < capacity

    def abort(self, request_id: str) -> None:
        """End `request_id` at the next step (any thread)."""
        self._aborts.append(request_id)

    def has_work(self) -> bool:
        """Whether a step has anything to do: requests queued, running, or to abort."""
        return bool(self.waiting or self.running or self._incoming or self._aborts)

    def stats(self) -> EngineStats:
        """A snapshot of the queues, hot-set, host tier, KV blocks and speculation."""
        c = self.hot_set.counters
        host = self.hot_set.host
        bm = self.block_manager
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
            host_fetches=host.counters.loads,
            host_fetch_failures=host.counters.failures,
            kv=BlockStats(
                block_size=bm.block_size,
                blocks_total=bm.num_blocks,
                blocks_used=bm.num_used,
                blocks_free=bm.num_free,
                blocks_cached=bm.num_cached,
                prefix_hit_tokens=bm.counters.prefix_hit_tokens,
                prefix_queried_tokens=bm.counters.prefix_queried_tokens,
                preemptions=self.scheduler.preemptions,
            ),
            rank_pools=self.hot_set.pool_report(),
            adapter_ranks=self.hot_set.known_ranks(self.hot_set.loaded() + host.resident()),
            speculation=self.drafter.counters.snapshot() if self.drafter is not None else None,
        )

    def request_adapters(self) -> RequestAdapters:
        """Adapters and compositions named by the running and the waiting requests (queued ones
        not yet drained included), with request counts.

        Called from the event loop while the step thread runs: the lists are copied first
        (`list()` of a list or deque runs in C, so no step mutation interleaves), then counted
        off the step's path; `_incoming` is copied under the lock its writers hold.
        """
        running = list(self.running)
        waiting = list(self.waiting)
        with self._lock:
            waiting += self._incoming
        return RequestAdapters(running=route_names(running), waiting=route_names(waiting))

    def pop_load_latencies(self) -> list[float]:
        """Adapter load times (seconds) recorded since the last call (for the metrics exporter).

        Slicing then deleting the prefix keeps appends that land meanwhile from the step thread.
        """
        pending = self.hot_set.counters.load_seconds
        n = len(pending)
        taken = pending[:n]
        del pending[:n]
        return taken

    def pop_queue_times(self) -> list[float]:
        """Seconds each request admitted since the last call waited before it first ran."""
        times = self.scheduler.queue_times
        return [times.popleft() for _ in range(len(times))]

    def pop_gate_stats(self) -> dict[str, list[list[int]]]:
        """Per composition, [layer][expert] token counts since the last call."""
        return self.outputs.gate_stats.pop()

    def pop_gate_telemetry(self) -> dict[str, list[LayerTelemetry]]:
        """Per composition and layer, gate entropy / top-1 weight / top-1 expert since the last
        call (one device read-back per composition)."""
        return self.outputs.gate_stats.telemetry.pop()

    # ----- the step -------------------------------------------------------------------------
    def step(self) -> StepOutputs:
        """One schedule -> run -> postprocess round; every request's increments in one batch."""
        outputs: Outputs = []
        self._take_in(outputs)
        if not self.running:
            return self._idle(outputs)
        for result in self.runner.run_isolated(self._form_batch()):
            self.outputs.process(result, outputs)
        self._prefetch()
        return StepOutputs(outputs)

    def _take_in(self, outputs: Outputs) -> None:
        """Queue new requests, end aborted ones, and admit what fits; a request that cannot
        start ends alone."""
        self._drain_incoming(outputs)
        for seq, exc in self.scheduler.admit():
            self.endings.fail_waiting(seq, exc, outputs)

    def _idle(self, outputs: Outputs) -> StepOutputs:
        """A step with nothing to run: waiting requests' adapters are loading in the
        background, so sleep on their loads rather than spin."""
        if self.waiting:
            self.hot_set.host.wait(0.05)
        return StepOutputs(outputs)

    def _form_batch(self) -> StepBatch:
        """The step's batch: every running decode (and draft), then prefill chunks."""
        return self.scheduler.schedule()

    def _prefetch(self) -> None:
        """Start loading the adapters of requests still waiting (an optimisation: a store
        hiccup must not fail the step)."""
        try:
            self.scheduler.binder.prefetch(self.waiting)
        except Exception:
            log.debug("prefetch failed", exc_info=True)

    def _drain_incoming(self, outputs: Outputs) -> None:
        """Move requests queued since the last step to the waiting queue; end the aborted."""
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
            outputs.append(self.endings.final(seq, "abort"))
        for seq in [s for s in self.running if s.request_id in aborted]:
            self.endings.finish(seq, "abort", outputs)

    def fail_running(self, message: str) -> StepOutputs:
        """Last resort after a step failed outside any one sequence: end every running and
        waiting request with `message` (never another request's error text)."""
        outputs: Outputs = []
        for seq in list(self.running):
            self.endings.fail(seq, SequenceStepError(message), outputs)
        with self._lock:
            while self._incoming:
                self.waiting.append(self._incoming.popleft())
        while self.waiting:
            seq = self.waiting.popleft()
            self.scheduler.binder.release(seq)
            seq.exception = SequenceStepError(message)
            seq.error = message
            outputs.append(self.endings.final(seq, "error"))
        return StepOutputs(outputs)


def route_names(seqs: list[Sequence]) -> dict[str, int]:
    """How many of `seqs` name each adapter or composition ref (`RouteSpec.refs`: a learned
    route names its composition, not the experts its gate picks)."""
    counts: dict[str, int] = {}
    for seq in seqs:
        for name in dict.fromkeys(seq.route.refs()):
            counts[name] = counts.get(name, 0) + 1
    return counts
